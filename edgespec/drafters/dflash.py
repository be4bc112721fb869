"""DFlash block drafters at run time: one drafter pass fills a block after the last committed token.

A DFlash folder is the published layout (config.json with `architectures: ["DFlashDraftModel"]` or
`["DFlash2DraftModel"]` and `block_size`, `target_layer_ids`, `mask_token_id`, at top level or
under `dflash_config`; *.safetensors with fc, hidden_norm, layers, norm and DFlash2's
candidate_selector). The math is models/dflash.py's (after the `dflash` package's reference,
dflash/model.py and dflash/model_mlx.py). `edgespec convert MODEL OUT --drafter DFLASH_FOLDER`
stores the folder as the bundle's drafter/, which loads the same way.

Verifier states. Attaching the drafter makes the verifier record, on every pass it already makes
with a cache (prefill, plain steps, verification), the outputs of the target layers concatenated,
(T, n*E) per pass, in the cache of its first attention layer (models.base.Model.record_hidden,
edgespec.caches.kv.HiddenKVCache): trimmed and kept with that cache, so with seq = x_0..x_{n-1} the
rows of positions 0..n-2 (the verifier's cache never holds the last committed token) are the
verifier's states on the committed path. No extra verifier pass. Qwen3.5's recurrent verifiers
record in their first full-attention layer, whose trims follow the state protocol like any other.

State. The drafter's own cache holds, per layer, the keys and values of the fused context
(hidden_norm(fc(features))) of positions 0..fed-1. A draft call feeds the rows fed..n-2 (the
verifier's new states), then one forward of the block [x_{n-1}, mask, ..., mask] (block_size
slots, RoPE positions n-1..n+block_size-2) gives block_size-1 proposals for x_n.. (the first k are
returned). The block's keys are never cached (the reference crops them after each block), so
`sync` only lowers `fed` to the common prefix with the new committed sequence (context entry j
depends on x_0..x_j only).

Acceptance rule. Proposals are drawn from q, the sampler-filtered softmax of the drafter's logits
(`Draft.logprobs`), and mode `speculative` verifies them by rejection sampling against the
verifier's p: accept x with probability min(1, p(x)/q(x)), else draw from norm(max(p - q, 0)).
That is exact for any q a proposal is drawn from given what precedes it; here slot i's q does not
depend on the drafts before it (the block is filled at once) except through DFlash2's selector,
whose q_i is the softmax over slot i's candidates rescored given the token picked at slot i-1, a
proposal distribution conditioned on the drafted prefix, which rejection sampling admits. Greedy
is the point-mass limit (q one-hot): accept while the proposal is the verifier's argmax. `auto`
asks for the greedy chain and accepts by match against the verifier's draw (draw, then match),
exact because each accepted token is the verifier's own draw.

Vocabulary. The block's embeddings and the output head are the verifier's (the drafter ships
neither), so the drafter must be for a verifier of the same hidden size and vocabulary size, and
every target layer must exist. The mask token is only ever an input: it needs a row of the
verifier's embedding table (mask_token_id < the verifier's vocab_size; published drafters use a
reserved or padding row past the tokenizer's tokens, which is fine) and is refused by name at load
otherwise. It may be proposed like any token; the verifier then rejects it unless it would emit
it itself.

Where it cannot run: tree and cascade (they verify branches; this drafter follows only the
committed path of the verifier's cache: `reads_verifier`, refused by name there), pipelined
drafting (off), a distributed verifier or an architecture whose pass does not record layers
(Gemma 4): refused at load by name.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import (
    CHAIN_MODES,
    AcceptsDrafts,
    Draft,
    DrafterCaps,
    common_prefix,
    read_folder_config,
)
from edgespec.drafters.compat import check_compatible
from edgespec.drafters.coreml_runtime import CoreMLBlockBackend, PackageCursor, package_features  # noqa: F401
from edgespec.errors import ModelLoadError
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.models.base import Model as BaseModel
from edgespec.models.dflash import KINDS, Model, ModelArgs
from edgespec.weights.formats.hf import read_safetensors
from edgespec.weights.numerics import emulate_half_products, runs_as_metal

CONFIG = "config.json"


def is_dflash_folder(path: str | Path) -> bool:
    """A published DFlash drafter folder (or a bundle's drafter/ holding one): the architecture
    names a DFlash draft model, or the config carries `dflash_config`."""
    cfg = read_folder_config(Path(path))
    if cfg is None:
        return False
    archs = cfg.get("architectures") or []
    return (isinstance(archs, list) and any(a in KINDS for a in archs)) or isinstance(cfg.get("dflash_config"), dict)


def load_dflash(path: str | Path, verifier, name: str | None = None) -> DFlashDrafter:
    """The drafter of a DFlash folder for `verifier` (an Engine, a LoadedModel or a model)."""
    path = Path(path).expanduser()
    cfg = read_folder_config(path)
    if cfg is None:
        raise ModelLoadError(f"{path}: a DFlash drafter folder needs a readable {CONFIG}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: a DFlash drafter folder needs its *.safetensors")
    try:
        args = ModelArgs.from_dict(cfg)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}/{CONFIG}: {e}") from None
    loaded = getattr(verifier, "loaded", verifier)
    model_v = getattr(loaded, "model", loaded)
    check_pairing(args, model_v, path)
    model = Model(args)
    weights = model.sanitize(read_safetensors(files))
    # fp32 on the CPU (it computes fp16 several times slower), the verifier's dtype elsewhere.
    on_cpu = not runs_as_metal(verifier)  # the CPU device, in its own numerics
    dtype = mx.float32 if on_cpu else model_v.model.norm.weight.dtype
    try:
        model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: the safetensors do not fit {CONFIG}: {e}") from None
    mx.eval(model.parameters())
    if not on_cpu:  # as Metal computes float16, also on the CPU device (numerics="metal")
        emulate_half_products(model)
    return DFlashDrafter(model, model_v, name=name or f"dflash:{path.name}")


def check_pairing(args, verifier, path: Path | str = "drafter") -> None:
    """Refuse, by name, a DFlash drafter that cannot draft for `verifier` (see the module notes)."""
    if not isinstance(verifier, BaseModel) or not verifier.records_layers:
        raise ModelLoadError(f"{path}: a DFlash drafter reads the verifier's target-layer states on its own passes; "
                             f"this verifier ({type(verifier).__name__}, {verifier.args.model_type}) does not record "
                             "them (a distributed verifier, or an architecture with its own pass such as Gemma 4)")
    check_args(args, verifier.args, path)


def check_args(args, va, path: Path | str = "drafter") -> None:
    """The vocabulary and shape checks of a DFlash drafter's config `args` against the verifier's
    ModelArgs `va` (at load and before `convert --drafter` stores it)."""
    if args.hidden_size != va.hidden_size:
        raise ModelLoadError(f"{path}: the DFlash drafter reads states of width {args.hidden_size}, the verifier's "
                             f"are {va.hidden_size}: it was trained for another verifier")
    check_compatible(args.vocab_size, va.vocab_size, error=ModelLoadError,
                     size_message=f"{path}: the DFlash drafter was built for a vocabulary of {args.vocab_size} "
                                  f"tokens, the verifier has {va.vocab_size}")
    bad = [i for i in args.target_layer_ids if i >= va.num_hidden_layers]
    if bad:
        raise ModelLoadError(f"{path}: target_layer_ids {bad} past the verifier's {va.num_hidden_layers} layers")
    if args.mask_token_id >= va.vocab_size:
        raise ModelLoadError(f"{path}: mask_token_id {args.mask_token_id} has no row in the verifier's embedding "
                             f"table ({va.vocab_size} rows); the block's mask slots are embedded with it")


DFLASH_PACKAGE = "dflash"  # the export info's kind of a DFlash drafter's Core ML package


class DFlashDrafter(AcceptsDrafts):
    """Drafter protocol (begin / draft / accept / sync / close / fork) over a DFlash block drafter."""

    # Drafts from the verifier's live cache (the recorded target-layer states): no pipelining,
    # not in tree/cascade; its states come through the cache, so speculative and auto both draft.
    caps = DrafterCaps(reads="verifier_cache", forks=True, modes=CHAIN_MODES)
    expected_acceptance = 0.6  # the controller's prior until acceptance is measured

    def __init__(self, model, verifier, name: str = "dflash"):
        """model: a models.dflash.Model; verifier: the engine's models.base.Model (paired: check_pairing)."""
        check_pairing(model.args, verifier)
        self.model, self.verifier, self.name = model, verifier, name
        self.args = model.args
        self.tap = verifier.record_hidden(self.args.target_layer_ids)
        self._recording = verifier.record_layers  # this drafter's recording (another's is another tuple)
        if self.tap is None:
            raise ModelLoadError(f"{name}: the verifier ({verifier.args.model_type}) has no attention layer "
                                 "whose cache can keep the DFlash drafter's states")
        self.width = len(self.args.target_layer_ids) * self.args.hidden_size
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.vocab_size = verifier.args.vocab_size
        self.vcache = None  # the verifier's cache of the generation this drafter serves
        self.owner = True  # the engine's drafter (not a request's fork): its close stops the recording
        self.cache: list = []
        self.package: PackageBlock | None = None  # the Core ML package in place of the MLX layers (from_package)
        self.seq: list[int] = []
        self.fed = 0  # context entries in self.cache (positions 0..fed-1, all on the committed path)
        self._last_draft: list[int] = []

    # ------------------------------------------------------------- verifier side
    def fork(self) -> DFlashDrafter:
        """For one request (see drafters.base.ModelDrafter.fork): the same weights, a state of its own."""
        twin = copy.copy(self)
        twin.vcache, twin.cache, twin.seq, twin.fed, twin._last_draft = None, [], [], 0, []
        twin.owner = False
        twin.package = self.package.fork() if self.package is not None else None
        return twin

    def bind_verifier_cache(self, cache) -> None:
        self.vcache = cache

    def _rows(self, start: int, stop: int) -> mx.array | None:
        """(1, stop - start, n*E) recorded target-layer states of positions start..stop-1, or None."""
        if self.vcache is None:
            return None
        store = self.vcache[self.tap]
        hidden = getattr(store, "hidden", None)  # a HiddenKVCache (or not: a quantized cache keeps none)
        if hidden is None or store.offset < stop or hidden.shape[1] < stop or hidden.shape[2] != self.width:
            return None
        return hidden[:, start:stop]

    def embed(self, ids: mx.array) -> mx.array:
        """(B, L) ids -> (B, L, E): the verifier's embedding rows times input_embedding_scale (the
        reference embeds with the raw table, dflash/model.py `_raw_input_embeddings`)."""
        h = self.verifier.model.embed_tokens(ids).astype(self.model.fc.weight.dtype)
        s = self.args.input_embedding_scale
        return h if s == 1.0 else h * s

    def logits(self, out: mx.array) -> mx.array:
        """Final-norm block states (..., E) -> the drafter's logits (..., V) through the verifier's head."""
        v = self.verifier
        w = v.model.embed_tokens if v.args.tie_word_embeddings else None
        raw = w.as_linear(out) if w is not None else v.lm_head(out)
        return self.model.scale_logits(raw)

    def block(self, last: int, features: mx.array | None) -> mx.array:
        """Feed `features` (1, S, n*E) as context after the cached entries, then fill the block after
        `last` -> final-norm states of slots 1.. (block_size - 1, E)."""
        ids = mx.array([[last] + [self.args.mask_token_id] * (self.args.block_size - 1)], dtype=mx.int32)
        return self.model(self.embed(ids), features, self.cache)[0, 1:]

    # ------------------------------------------------------------- protocol
    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.cache = self.model.make_cache()
        if self.package is not None:
            self.package.reset()
        self.seq = list(prompt)
        self.fed = 0
        self._last_draft = []

    def _trim_to(self, n: int) -> None:
        for c in self.cache:
            c.trim(c.offset - n)
        if self.package is not None:
            self.package.trim_to(n)
        self.fed = n

    def draft(self, k: int, sampler) -> Draft:
        n = len(self.seq)
        self._last_draft = []
        if k < 1 or n < 2 or not self.cache:
            return Draft([], None)
        # The package's functions take at least one row: re-feed the last one (rewritten in place).
        fed = min(self.fed, n - 1 if self.package is None else n - 2)
        rows = self._rows(fed, n - 1)
        if rows is None:  # no recorded states (a pass that kept none): no draft, never a wrong one
            return Draft([], None)
        if self.package is not None and n - 1 > self.package.context:
            return Draft([], None)  # past the package's context: no draft (plain steps go on)
        self._trim_to(fed)
        m = min(k, self.args.block_size - 1)
        if self.package is not None:
            logits, out = self.package.block(self.seq[-1], rows)
            logits, out = logits[:m], out[:m]
        else:
            out = self.block(self.seq[-1], rows)  # (block_size - 1, E)
            logits = self.logits(out[:m])  # (m, V)
        self.fed = n - 1
        if self.args.kind == "dflash2":
            return self._select(out[:m], logits, sampler)
        lp = sampler.logprobs(logits)  # (m, V) q of every slot at once
        toks = sampler.sample(lp)
        mx.eval(toks, lp)
        self._last_draft = [int(t) for t in toks.tolist()]
        return Draft(list(self._last_draft), lp)

    def _select(self, out: mx.array, logits: mx.array, sampler) -> Draft:
        """DFlash2: slot by slot, q over the slot's top candidates rescored by the token picked before."""
        sel = self.model.candidate_selector
        cand, unary = sel.candidates(logits)  # (m, K)
        proj = sel.hidden_projection(out)  # (m, R)
        prev = mx.array(self.seq[-1], dtype=mx.int32)
        toks, rows = [], []
        for i in range(out.shape[0]):
            s = sel.scores(proj[i], prev, cand[i], unary[i])
            full = mx.full((self.vocab_size,), -mx.inf, dtype=mx.float32)
            full[cand[i]] = s.astype(mx.float32)
            lp = sampler.logprobs(full)
            prev = sampler.sample(lp).astype(mx.int32)
            toks.append(prev)
            rows.append(lp)
        return self._finish(toks, rows)

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; context entries off that path are dropped."""
        keep = common_prefix(self.seq, committed)
        self.seq = list(committed)
        self._last_draft = []
        self.fed = min(self.fed, keep)  # entry j depends on x_0..x_j only

    def close(self) -> None:
        """Called when the engine's drafter is replaced (drafters.attach_drafter): the verifier's
        passes stop recording the target layers (a request's fork leaves them on)."""
        self.vcache = None
        self.cache = []
        if self.owner and self.verifier.record_layers is self._recording:
            self.verifier.stop_recording()


class PackageBlock(PackageCursor):
    """The drafter's layers as its Core ML package (converters/dflash_export.py), through a backend
    (`call(function, features (S, n*E), block ids (1, L), position) -> (logits (L-1, V), hidden (L-1, E))`):
    a fixed buffer of `context` slots where rolling back is lowering `offset`. New context rows go
    in pieces of the package's feed sizes; the block of the last piece is the one used."""

    def __init__(self, backend, info: dict):
        super().__init__(backend, info)
        self.sizes = sorted(int(s) for s in info["feed_sizes"])
        self.block_size, self.mask = int(info["block_size"]), int(info["mask_token_id"])

    def block(self, last: int, features: mx.array) -> tuple[mx.array, mx.array]:
        """features (1, S, n*E) new context rows (S >= 0) -> (logits (L-1, V), final-norm states (L-1, E))."""
        rows = np.array(features[0].astype(mx.float32))
        ids = np.array([[last] + [self.mask] * (self.block_size - 1)], np.int32)
        if self.offset + len(rows) > self.context:
            raise ValueError(f"{self.offset + len(rows)} context rows exceed the DFlash package's {self.context}")
        i, out = 0, None
        while i < len(rows):
            left = len(rows) - i
            S = max([s for s in self.sizes if s <= left], default=self.sizes[0])
            out = self.backend.call(f"feed_{S}", rows[i : i + S], ids, self.offset)
            self.offset += S
            i += S
        return mx.array(out[0]), mx.array(out[1])


def from_package(path: Path, verifier, info: dict, compute_units: str) -> DFlashDrafter:
    """A bundle's DFlash package (Core ML checked available by the caller, drafters.coreml), with
    the MLX folder beside it (drafter/: the config, DFlash2's selector, the fallback)."""
    folder = Path(path).parent / "drafter"
    if not is_dflash_folder(folder):
        raise ModelLoadError(f"{path}: a DFlash package needs the bundle's drafter/ folder beside it")
    d = load_dflash(folder, verifier, name=f"dflash-coreml:{Path(path).name}")
    d.package = PackageBlock(CoreMLBlockBackend(Path(path), list(info["functions"]), compute_units), info)
    d.device = "ane" if "NE" in compute_units or compute_units == "ALL" else "cpu"
    d.caps = replace(DFlashDrafter.caps, runs_on="coreml")
    return d


def reference_round(drafter: DFlashDrafter, features: np.ndarray, last: int) -> list[int]:
    """The greedy block a fresh drafter proposes after a context whose target-layer states are
    `features` (S, n*E) and whose last committed token is `last` (tests and benchmarks)."""
    drafter.cache = drafter.model.make_cache()
    drafter.fed = 0
    out = drafter.block(last, mx.array(features)[None])
    logits = drafter.logits(out)
    if drafter.args.kind == "dflash2":
        drafter.seq = [last]
        return drafter._select(out, logits, Sampler(SamplingParams(temperature=0.0))).tokens
    return [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
