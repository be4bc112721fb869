"""Gemma 4's assistant as a Core ML drafter: the package `convert --drafter` exports from a
gemma4_assistant checkpoint (converters/coreml_assistant.py), run on the Neural Engine (macOS 15+).

    drafter = CoreMLDrafter.load("bundle/drafter.mlpackage", engine)   # dispatches here by the info's kind

It drafts exactly as the MLX AssistantDrafter (edgespec/drafters/assistant.py): at the fixed
position p of a round (the committed sequence is x_0..x_p, the verifier's cache holds 0..p-1)
each step reads the verifier's embedding of the input token and a hidden state (the
verifier's at p - 1 first, then the step's own guess), and cross-attends to the verifier's
store-layer keys and values of positions 0..p-1. Those live in the package's state; `fed`
counts the positions of the committed sequence already written there, and a round first
sends the verifier's keys and values of positions fed..p-1 only (`append_S`; a prompt in
chunks, a round the few positions it committed). Rolling back (sync to a sequence that
shares only a prefix) is lowering `fed`: the package masks every slot at or past p, and the
next writes overwrite them.

The Core ML runtime is reached through a backend (`call(function, inputs) -> outputs`,
`reset()`), so the same logic runs here against the numpy MIL executor
(converters/coreml_assistant.AssistantExecutorBackend) and on a Mac against Core ML.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import (
    CHAIN_MODES,
    AcceptsDrafts,
    Draft,
    DrafterCaps,
    common_prefix,
    fork_backend,
)
from edgespec.drafters.compat import check_compatible
from edgespec.drafters.coreml_runtime import CoreMLUnavailable, require_coreml, units_device
from edgespec.errors import ModelLoadError

KIND = "gemma4_assistant"
SHORT = {"sliding_attention": "sliding", "full_attention": "full"}


class CoreMLAssistantBackend:
    """The package's functions under Core ML, sharing one state (macOS 15+ only)."""

    def __init__(self, path: Path, functions: list[str], compute_units: str):
        try:
            # coremltools is optional (macOS, the convert extra): imported only where a package runs
            import coremltools as ct  # optional: coremltools
        except ImportError:
            raise CoreMLUnavailable("coremltools is not installed; the MLX assistant is used instead") from None
        cu = getattr(ct.ComputeUnit, compute_units)
        self.models = {f: ct.models.MLModel(str(path), compute_units=cu, function_name=f) for f in functions}
        self.reset()

    def reset(self) -> None:
        self.state = self.models["draft"].make_state()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {k: v.astype(np.float16) if v.dtype.kind == "f" else v.astype(np.int32) for k, v in inputs.items()}
        return self.models[function].predict(feed, state=self.state)


class CoreMLAssistantDrafter(AcceptsDrafts):
    """Drafter protocol (begin / draft / accept / sync / close) over an assistant package."""

    # drafts from the verifier's live cache: speculative and auto only, unpipelined
    caps = DrafterCaps(reads="verifier_cache", forks=True, runs_on="coreml", modes=CHAIN_MODES)

    def __init__(self, backend, info: dict[str, Any], verifier, device: str = "ane",
                 name: str = "coreml-gemma4-assistant"):
        """verifier: the Gemma 4 model (MLX) whose cache and embedding the drafts read."""
        args = verifier.args
        if info.get("kind") != KIND:
            raise ModelLoadError(f"not a gemma4_assistant package (kind {info.get('kind')!r})")
        if not hasattr(args, "store_layers"):
            raise ModelLoadError(f"a gemma4_assistant drafts for Gemma 4; the verifier is {args.model_type!r}")
        check_compatible(int(info["vocab_size"]), args.vocab_size, error=ModelLoadError,
                         size_message=f"the assistant package's vocabulary has {info['vocab_size']} tokens, "
                                      f"the verifier's {args.vocab_size}")
        if int(info["backbone_hidden_size"]) != args.hidden_size:
            raise ModelLoadError(f"the assistant package reads hidden states of width {info['backbone_hidden_size']}, "
                                 f"the verifier's are {args.hidden_size}")
        self.context = int(info["context_length"])
        store = args.store_layers()
        self.store = {}
        for kind in info["layer_types"]:
            j = store.get(kind)
            want = [args.layer_kv_heads[j], args.layer_head_dims[j], self.context] if j is not None else None
            if want is None or list(info["states"][f"{SHORT[kind]}_keys"]) != want:
                raise ModelLoadError(f"the assistant package's {kind} key buffer "
                                     f"{info['states'].get(SHORT[kind] + '_keys')} does not fit the verifier "
                                     f"({'no such layer' if want is None else want})")
            self.store[kind] = j
        self.appends = sorted(int(s) for s in info["append_tokens"])
        self.backend, self.verifier, self.device, self.name = backend, verifier, device, name
        self.vocab_size = args.vocab_size
        verifier.keep_hidden = True  # its caches made from now on record the hidden states read here
        self.cache = None
        self.seq: list[int] = []
        self.fed = 0  # positions 0..fed-1 of the committed sequence hold the verifier's keys/values
        self._last_draft: list[int] = []

    @classmethod
    def load(cls, path: str | Path, verifier, compute_units: str, info: dict[str, Any]) -> CoreMLAssistantDrafter:
        require_coreml()
        loaded = getattr(verifier, "loaded", verifier)
        backend = CoreMLAssistantBackend(Path(path), list(info["functions"]), compute_units)
        return cls(backend, info, loaded.model, units_device(compute_units), name=f"coreml-gemma4-assistant:{Path(path).name}")

    def fork(self) -> CoreMLAssistantDrafter:
        """For one request (see drafters.base.ModelDrafter.fork): the same package, a Core ML
        state, verifier cache binding and committed sequence of its own."""
        twin = copy.copy(self)
        twin.backend = fork_backend(self.backend)
        twin.cache, twin.seq, twin.fed, twin._last_draft = None, [], 0, []
        return twin

    # ------------------------------------------------------------- verifier state
    def bind_verifier_cache(self, cache) -> None:
        """The verifier cache of the generation this drafter now serves."""
        if cache is not self.cache:
            self.fed = 0  # another cache: nothing written so far is known to match it
        self.cache = cache

    def _send(self, p: int) -> None:
        """Write the verifier's keys and values of positions fed..p-1 into the package."""
        C = self.context
        while self.fed < p:
            n = p - self.fed
            S = next((s for s in self.appends if s >= n), self.appends[-1])
            start = min(self.fed, C - S)  # near the end: an earlier window, rewriting slots with what they hold
            end = min(start + S, p)
            inputs = {"position": np.array([start], np.int32)}
            for kind, j in self.store.items():
                keys, values = self.cache[j].state
                for name, x in (("keys", keys), ("values", values)):
                    rows = np.array(x[0, :, start:end, :].astype(mx.float32)).transpose(0, 2, 1)  # (Hk, D, end-start)
                    if end - start < S:  # slots past p: padding, masked until overwritten
                        rows = np.concatenate([rows, np.zeros((*rows.shape[:2], S - (end - start)), np.float32)], 2)
                    inputs[f"{SHORT[kind]}_{name}_new"] = rows
            self.backend.call(f"append_{S}", inputs)
            self.fed = end

    def _row(self, x: mx.array) -> np.ndarray:
        """(..., B) MLX row -> (1, B, 1, 1) float32 package input."""
        return np.array(x.astype(mx.float32)).reshape(1, -1, 1, 1)

    # ------------------------------------------------------------- protocol
    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.seq = list(prompt)
        self.fed = 0  # a new generation: its cache's keys and values are sent afresh
        self._last_draft = []

    def draft(self, k: int, sampler) -> Draft:
        p = len(self.seq) - 1
        cache = self.cache
        hidden = None
        if k >= 1 and cache is not None and 1 <= p <= self.context and cache[0].offset >= p \
                and cache[0].keeps_hidden:
            hidden = cache[0].hidden_at(p - 1)
        if hidden is None or any(cache[j].state is None for j in self.store.values()):
            self._last_draft = []
            return Draft([], None)
        self._send(p)
        hidden = self._row(hidden)
        pos = np.array([p], np.int32)
        tok, toks, rows = self.seq[-1], [], []
        for _ in range(k):
            emb = self._row(self.verifier.embed(mx.array([[tok]], dtype=mx.int32)))
            out = self.backend.call("draft", {"embedding": emb, "hidden": hidden, "position": pos})
            lp = sampler.logprobs(mx.array(np.asarray(out["logits"], np.float32).reshape(-1)))
            t = sampler.sample(lp)
            rows.append(lp)
            tok = int(t)
            toks.append(tok)
            hidden = np.asarray(out["next_hidden"], np.float32)
        q = mx.stack(rows)
        mx.eval(q)
        self._last_draft = toks
        return Draft(list(toks), q)

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; the key/value slots of positions whose
        prefix changed become stale (masked, then overwritten)."""
        self.fed = min(self.fed, common_prefix(self.seq, committed))
        self.seq = list(committed)
        self._last_draft = []

    def close(self) -> None:
        self.cache = None
