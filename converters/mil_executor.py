"""A small, strict numpy interpreter for the MIL programs edgespec exports (a test oracle).

    ex = MILExecutor("drafter.mlpackage", fp16=True)
    state = ex.make_state()                       # {"key_cache": zeros, ...}
    out = ex.run("decode", {"input_ids": ids, "position": pos}, state)   # state updated in place

The program is read back from the saved package (coremltools' milproto loader,
weights from the package's weight file), so what is tested is the artifact
itself, not the builder's in-memory graph. Only the ops edgespec's export
emits are known; any other op is an error naming it, so a graph change can
never be silently skipped. Compressed weights are decoded here from the raw
constexpr inputs (never from coremltools' own value inference).

fp16=False computes everything in fp32 (fp16 tensors are widened): it checks
the graph's math. fp16=True rounds every fp16-typed result (and the states) to
fp16 after each op, emulating an fp16 device such as the Neural Engine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from edgespec.converters.mil_ops import OPS
from edgespec.converters.mil_values import MILExecutorError, _blocks, _slice  # noqa: F401  (re-exported)

from edgespec.drafters.coreml_runtime import logits_rows
from edgespec.errors import ModelLoadError


def load_program(path: str | Path):
    """-> (spec, MIL program) of a saved .mlpackage; clear ModelLoadError if it is damaged."""
    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    import coremltools as ct  # optional: coremltools
    from coremltools.converters.mil.frontend.milproto.load import load  # optional: coremltools

    path = Path(path)
    if not (path / "Manifest.json").is_file():
        raise ModelLoadError(f"{path}: not an .mlpackage (no Manifest.json)")
    try:
        model = ct.models.MLModel(str(path), skip_model_load=True)
        spec = model.get_spec()
        prog = load(spec, spec.specificationVersion, model.weights_dir)
    except Exception as e:  # protobuf / blob reader errors have no common base class
        raise ModelLoadError(
            f"{path}: cannot read the Core ML package ({type(e).__name__}: {e}); re-export it"
        ) from None
    return spec, prog


def _dtype_name(var) -> str:
    # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
    from coremltools.converters.mil.mil import types  # optional: coremltools

    t = var.dtype
    return types.builtin_to_string(t) if t is not None else "unknown"


class MILExecutor:
    def __init__(self, path: str | Path, fp16: bool = False):
        self.path = Path(path)
        self.fp16 = fp16
        self.spec, self.program = load_program(self.path)
        self.functions = dict(self.program.functions)

    # ---- tensors and dtypes -------------------------------------------------
    def _store(self, value, var):
        """Round/convert an op result to the declared dtype of `var`."""
        name = _dtype_name(var)
        if name == "string":  # op parameters such as cast's dtype
            return value
        value = np.asarray(value)
        if name == "fp16":
            return value.astype(np.float16 if self.fp16 else np.float32)
        if name == "fp32":
            return value.astype(np.float32)
        if name in (
            "int32",
            "int16",
            "int8",
            "uint8",
            "uint16",
            "int4",
            "uint4",
            "uint1",
            "uint2",
            "uint3",
            "uint6",
        ):
            return value.astype(np.int32)
        if name == "bool":
            return value.astype(bool)
        raise MILExecutorError(f"unsupported tensor dtype {name} for {var.name}")

    def state_specs(self, function: str = "decode") -> dict[str, tuple[tuple[int, ...], str]]:
        """state name -> (shape, dtype name) of a function's state inputs."""
        # coremltools is heavy and optional (the convert extra): imported only when a package is built or read
        from coremltools.converters.mil.mil import types  # optional: coremltools

        fn = self._function(function)
        return {
            name: (tuple(var.shape), _dtype_name(var))
            for name, var in fn.inputs.items()
            if types.is_state(var.sym_type)
        }

    def make_state(self, function: str = "decode") -> dict[str, np.ndarray]:
        dt = np.float16 if self.fp16 else np.float32
        return {
            name: np.zeros(shape, dt) for name, (shape, _) in self.state_specs(function).items()
        }

    def _function(self, name: str):
        if name not in self.functions:
            raise MILExecutorError(
                f"no function {name!r} in {self.path.name}; it has {', '.join(self.functions)}"
            )
        return self.functions[name]

    # ---- running ------------------------------------------------------------
    def run(
        self, function: str, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Execute `function`; `state` arrays are replaced by their updated values. Returns outputs by name."""
        fn = self._function(function)
        states = self.state_specs(function)
        env: dict[str, np.ndarray] = {}
        for name, var in fn.inputs.items():
            if name in states:
                continue
            if name not in inputs:
                raise MILExecutorError(f"function {function!r} needs input {name!r}")
            x = np.asarray(inputs[name])
            if tuple(x.shape) != tuple(var.shape):
                raise MILExecutorError(
                    f"input {name!r} must have shape {tuple(var.shape)}, got {x.shape}"
                )
            env[name] = self._store(x, var)
        for op in fn.operations:
            outs = self._eval(op, env, state)
            if len(outs) != len(op.outputs):
                raise MILExecutorError(
                    f"{op.op_type} {op.name}: produced {len(outs)} outputs, expected {len(op.outputs)}"
                )
            for var, val in zip(op.outputs, outs, strict=True):
                val = self._store(val, var)
                if var.shape is not None and all(isinstance(d, int) for d in var.shape):
                    if tuple(val.shape) != tuple(var.shape):
                        raise MILExecutorError(
                            f"{op.op_type} {op.name}: result shape {val.shape} != declared {tuple(var.shape)}"
                        )
                env[var.name] = val
        return {v.name: env[v.name] for v in fn.outputs}

    def _eval(self, op, env, state):
        impl = OPS.get(op.op_type)
        if impl is None:
            raise MILExecutorError(
                f"unsupported MIL op {op.op_type!r} (op {op.name}); the executor knows {', '.join(sorted(OPS))}"
            )

        def get(name, default=None):
            v = op.inputs.get(name)
            if v is None:
                return default
            if isinstance(v, (list, tuple)):
                return [self._value(x, env) for x in v]
            return self._value(v, env)

        return impl(op, get, state, self)

    def _value(self, var, env):
        if var.name in env:
            return env[var.name]
        if var.val is not None and var.op is not None and var.op.op_type == "const":
            return np.asarray(var.val)
        raise MILExecutorError(
            f"value of {var.name} is not available (op order or unsupported producer)"
        )


class ExecutorBackend:
    """CoreMLDrafter backend that runs the package with this executor (Linux tests)."""

    def __init__(self, executor: MILExecutor):
        self.executor = executor
        self.calls: list[tuple[str, int]] = []  # (function, position) log, for tests
        self.reset()

    def reset(self) -> None:
        self.state = self.executor.make_state()

    def call(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        """ids (1, T) int32 -> logits (T_out, V) float32."""
        self.calls.append((function, position))
        out = self.executor.run(
            function, {"input_ids": ids, "position": np.array([position], np.int32)}, self.state
        )
        return logits_rows(out["logits"])
