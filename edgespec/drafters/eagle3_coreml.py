"""An EAGLE-3 head drafting through its Core ML package (converters/eagle3_coreml.py) on the Neural Engine.

    bundle/drafter.mlpackage (kind "eagle3") + bundle/drafter/ (the head's folder)

`Eagle3PackageDrafter` is the MLX drafter (edgespec.drafters.eagle3.Eagle3Drafter) with its head
steps sent to the package: the same rounds, chains, ranks and d2t map, the verifier's recorded
aux-layer states and the tokens' embedding rows crossing as inputs. The package's state holds the
head's keys and values in a fixed buffer (`PackageHead`, a drafters.coreml_runtime.PackageCursor):
rolling back is lowering its offset. A chain is shortened to what the buffer holds (no draft at
all once the committed sequence fills it), never a wrong one.

The backend is the one Gemma 4's assistant package runs on (`call(function, inputs) -> outputs`,
one shared state made by `draft`): drafters.coreml_assistant.CoreMLAssistantBackend under Core ML
on a Mac, converters.coreml_assistant.AssistantExecutorBackend (the numpy MIL executor) in tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import CHAIN_MODES, Draft, DrafterCaps
from edgespec.drafters.coreml_runtime import PackageCursor, package_features, units_device
from edgespec.drafters.eagle3 import Eagle3Drafter, is_eagle3_folder, load_eagle3
from edgespec.errors import ModelLoadError

EAGLE3_PACKAGE = "eagle3"  # the package info's kind
FEED_SIZES = (1, 2, 4, 8)  # entries one feed_S call appends; a longer feed runs in pieces


class PackageHead(PackageCursor):
    """The head's package through a backend: `feed` appends entries at `offset`."""

    def __init__(self, backend, info: dict[str, Any]):
        super().__init__(backend, info)
        self.sizes = sorted(int(s) for s in info["feed_sizes"])

    def feed(self, emb: np.ndarray, states: np.ndarray, fused: bool) -> tuple[np.ndarray, np.ndarray]:
        """emb (T, E), states (T, n*Et) the verifier's aux rows or, fused, (1, E) the head's own
        -> (logits over the draft vocabulary (Vd,), the state the next step reads (E,)), float32."""
        T = len(emb)
        if self.offset + T > self.context:
            raise ValueError(f"{self.offset + T} entries exceed the EAGLE-3 package's context of {self.context}")
        i, out = 0, None
        while i < T:
            if fused:
                S, fn, key = 1, "draft", "hidden"
            else:
                S = max([s for s in self.sizes if s <= T - i], default=1)
                fn, key = f"feed_{S}", "features"
            out = self.backend.call(fn, {"embedding": package_features(emb[i : i + S]),
                                         key: package_features(states[i : i + S]),
                                         "position": np.array([self.offset], np.int32)})
            self.offset += S
            i += S
        return (np.asarray(out["logits"], np.float32).reshape(-1),
                np.asarray(out["hidden_out"], np.float32).reshape(-1))


class Eagle3PackageDrafter(Eagle3Drafter):
    """Eagle3Drafter whose head steps run in the package (see the module doc)."""

    # Chains only (speculative, auto; ranked): the package has no tree mask, so the MLX head's own
    # dynamic trees are not drafted through it.
    caps = DrafterCaps(reads="verifier_cache", forks=True, modes=CHAIN_MODES, ranks=True, runs_on="coreml")

    def __init__(self, model, verifier, head: PackageHead, name: str = "eagle3-coreml", embed=None,
                 device: str = "ane"):
        super().__init__(model, verifier, name=name, embed=embed)
        self.head = head
        self.device = device

    def fork(self) -> Eagle3PackageDrafter:
        twin = super().fork()
        twin.head = self.head.fork()
        return twin

    def begin(self, prompt: list[int]) -> None:
        super().begin(prompt)
        self.head.reset()

    def draft(self, k: int, sampler, *args, **kwargs) -> Draft:
        # entries held after a chain of k: the committed n - 1, then k - 1 drafted steps
        k = min(k, self.head.context + 2 - len(self.seq))
        if k < 1:
            return Draft([], None)
        return super().draft(k, sampler, *args, **kwargs)

    def _trim_to(self, n: int) -> None:
        self.head.trim_to(n)

    def feed(self, ids, states: mx.array, fused: bool) -> tuple[mx.array, mx.array]:
        ids = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
        emb = np.array(self.embed(ids.reshape(1, -1))[0].astype(mx.float32))
        rows = np.array(states.astype(mx.float32)).reshape(len(emb) if not fused else 1, -1)
        logits, g = self.head.feed(emb, rows, fused)
        dtype = self.model.fc.weight.dtype
        return mx.array(logits).astype(dtype), mx.array(g).astype(dtype).reshape(1, 1, -1)


def check_info(info: dict[str, Any], drafter: Eagle3Drafter, path: Path | str) -> None:
    """The package was exported from this head: refused by name otherwise."""
    a = drafter.args
    want = {"hidden_size": a.hidden_size, "draft_vocab_size": a.draft_vocab_size,
            "features": a.num_aux * a.target_hidden_size, "num_layers": a.num_hidden_layers}
    for key, value in want.items():
        if int(info.get(key, -1)) != value:
            raise ModelLoadError(f"{path}: the EAGLE-3 package's {key} is {info.get(key)}, the head in drafter/ "
                                 f"has {value}: re-export the bundle")


def from_package(path: Path, verifier, info: dict[str, Any], compute_units: str,
                 backend=None) -> Eagle3PackageDrafter:
    """A bundle's EAGLE-3 package (Core ML checked available by the caller, drafters.registry), with
    the head's folder beside it (drafter/: its config, weights and maps). backend: the runner of
    the package's functions (default: Core ML)."""
    path = Path(path)
    folder = path.parent / "drafter"
    if not is_eagle3_folder(folder):
        raise ModelLoadError(f"{path}: an EAGLE-3 package needs the bundle's drafter/ folder beside it")
    mlx_drafter = load_eagle3(folder, verifier)
    check_info(info, mlx_drafter, path)
    if backend is None:
        from edgespec.drafters.coreml_assistant import CoreMLAssistantBackend

        backend = CoreMLAssistantBackend(path, list(info["functions"]), compute_units)
    return Eagle3PackageDrafter(mlx_drafter.model, mlx_drafter.verifier, PackageHead(backend, info),
                                name=f"eagle3-coreml:{path.name}", embed=mlx_drafter.embed_table,
                                device=units_device(compute_units))
