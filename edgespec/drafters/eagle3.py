"""EAGLE-3 heads at run time: one head step per drafted token, from the verifier's own hidden states.

A head folder is either published layout (models/eagle3.py): the EAGLE authors' (config.json with
`draft_vocab_size`, weights `midlayer.*`, `d2t`, `t2d`) or the `speculators` one (config.json with
`speculators_model_type: "eagle3"`, `transformer_layer_config` and `speculators_config`), weights
in *.safetensors (or the authors' pytorch_model.bin, read without torch and without running its
pickle). `--drafter FOLDER` loads it; `edgespec convert MODEL OUT --drafter FOLDER` stores it as
the bundle's drafter/ (converters/eagle3_export.py), which loads the same way.

Verifier states. Attaching the head makes the verifier record, on every pass it already makes with
a cache (prefill, plain steps, verification), its hidden states at the head's aux layers (the
input of layer i, HF hidden_states[i], is the output of layer i - 1: the recording of
models.base.Model.record_hidden, the one DFlash drafters use), concatenated, in the cache of its
first attention layer. With seq = x_0..x_{n-1}, the rows of positions 0..n-2 are the verifier's
states on the committed path (its cache never holds the last committed token). No extra pass.

State. The head's own KV cache holds entry j = (x_{j+1}, fc(states of j)) at RoPE position j + 1,
for the `fed` entries built on the committed path. A draft call feeds entries fed..n-2 (at least
the last one, whose output is where the chain starts), samples x_n from the head's logits, then
feeds (x_n, the head's own output state) to draft x_{n+1}, and so on; the entries of drafted
steps are trimmed at the next call, where the verifier's true states replace them, so a partially
accepted chain rolls back exactly (entry j depends on x_0..x_{j+1} only: `sync` keeps j + 1 < the
common prefix).

Vocabulary. A head with a reduced draft vocabulary (draft_vocab_size < the verifier's) proposes
draft id d as the verifier's token d + d2t[d]; its q puts no mass on the other tokens (their
logits are -inf before the sampler's filters), which rejection sampling admits: every accepted
token is still drawn from the verifier's law. Greedy acceptance is by match. The embedding of a
drafted token is the folder's own table when it ships one (`embed_tokens.weight`), else the
verifier's.

Refused at load, by name: a head for another verifier (hidden size, aux layer ids past its layers
or the embedding layer 0, vocabulary size, a d2t map pointing past the vocabulary or twice at one
token, a t2d map that disagrees with d2t), malformed folders (config, weights that do not fit
it, no weights), a verifier whose passes do not record layers (distributed, Gemma 4). The
cascade refuses it (it follows only the committed path: `reads_verifier`); pipelined drafting
is off with it.

Dynamic trees (EAGLE-2, `draft_tree`, DrafterCaps.trees). From the same start as a chain, each
depth takes the `topk` most likely tokens (under the head's own softmax) below every node fed at
the depth before; a node's score is the product of the head's probabilities along its path; the
`width` best new nodes by score are fed next, all in one head call under a tree mask over the
head's cache (each node sees the committed entries and its own ancestors, at RoPE position
entry + 1 of its depth), each paired with its parent's output state as a chain step is; the
`keep` best nodes by score form the tree (closed under ancestors: a score never grows along a
path). The tree's entries sit past `fed` like a chain's guesses and are trimmed at the next call.
Mode `tree` verifies these trees (cascade still refuses the head).
"""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import (
    CHAIN_MODES,
    AcceptsDrafts,
    Draft,
    DrafterCaps,
    DraftTree,
    common_prefix,
    ranked_tokens,
    read_folder_config,
)
from edgespec.drafters.compat import check_compatible
from edgespec.errors import ModelLoadError
from edgespec.kernels import tree_mask
from edgespec.models.base import Model as BaseModel
from edgespec.models.eagle3 import Model, ModelArgs, default_layer_ids
from edgespec.weights.formats.hf import read_safetensors
from edgespec.weights.formats.torch_pickle import read_torch_checkpoint
from edgespec.weights.numerics import emulate_half_products, runs_as_metal

CONFIG = "config.json"


def is_eagle3_folder(path: str | Path) -> bool:
    """A published EAGLE-3 head folder: a speculators config of an eagle3 model, or the EAGLE
    authors' (architectures LlamaForCausalLMEagle3, or a draft_vocab_size)."""
    cfg = read_folder_config(Path(path))
    if cfg is None:
        return False
    if cfg.get("speculators_model_type") is not None:
        return cfg.get("speculators_model_type") == "eagle3"
    archs = cfg.get("architectures") or []
    return (isinstance(archs, list) and "LlamaForCausalLMEagle3" in archs) or "draft_vocab_size" in cfg


def load_eagle3(path: str | Path, verifier, name: str | None = None) -> Eagle3Drafter:
    """The drafter of an EAGLE-3 head folder for `verifier` (an Engine, a LoadedModel or a model)."""
    path = Path(path).expanduser()
    cfg = read_folder_config(path)
    if cfg is None:
        raise ModelLoadError(f"{path}: an EAGLE-3 head folder needs a readable {CONFIG}")
    try:
        args = ModelArgs.from_dict(cfg)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}/{CONFIG}: {e}") from None
    loaded = getattr(verifier, "loaded", verifier)
    model_v = getattr(loaded, "model", loaded)
    check_pairing(args, model_v, path)
    model = Model(args)
    raw = read_weights(path)
    t2d = raw.get("t2d")
    weights, embed = Model.sanitize(raw)
    on_cpu = not runs_as_metal(verifier)  # the CPU device, in its own numerics
    dtype = mx.float32 if on_cpu else model_v.model.norm.weight.dtype
    d2t = weights.pop("d2t", None)
    if args.uses_draft_vocab:
        if d2t is None:
            raise ModelLoadError(f"{path}: a head with draft_vocab_size {args.draft_vocab_size} < vocab_size "
                                 f"{args.vocab_size} needs its d2t map")
        weights["d2t"] = d2t.astype(mx.int32)
    try:
        model.load_weights([(k, v if k == "d2t" else v.astype(dtype)) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: the weights do not fit {CONFIG}: {e}") from None
    check_maps(model, t2d, path)
    if embed is not None:
        if tuple(embed.shape) != (args.vocab_size, args.hidden_size):
            raise ModelLoadError(f"{path}: embed_tokens.weight is {tuple(embed.shape)}, the head reads "
                                 f"({args.vocab_size}, {args.hidden_size})")
        embed = embed.astype(dtype)
    mx.eval(model.parameters())
    if not on_cpu:  # as Metal computes float16, also on the CPU device (numerics="metal")
        emulate_half_products(model)
    return Eagle3Drafter(model, model_v, name=name or f"eagle3:{path.name}", embed=embed)


def read_weights(path: Path) -> dict[str, mx.array]:
    """The folder's tensors: its *.safetensors, else its pytorch_model.bin (the authors' heads ship
    that; read without torch, see edgespec.weights.formats.torch_pickle)."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        return read_safetensors(files)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"{path}: an EAGLE-3 head folder needs its *.safetensors (or pytorch_model.bin)")
    out: dict[str, mx.array] = {}
    for f in bins:
        out.update(read_torch_checkpoint(f))
    return out


def check_maps(model: Model, t2d: mx.array | None, path: Path | str) -> None:
    """The draft-vocabulary maps point inside the verifier's vocabulary, one draft id per token,
    and t2d (when shipped) marks exactly the tokens d2t reaches."""
    args = model.args
    if not args.uses_draft_vocab:
        return
    tids = np.array(model.target_ids())
    V = args.vocab_size
    if tids.min() < 0 or tids.max() >= V:
        raise ModelLoadError(f"{path}: the d2t map sends draft ids to tokens outside the verifier's vocabulary "
                             f"(0..{V - 1}): it was built for another verifier")
    if len(np.unique(tids)) != len(tids):
        raise ModelLoadError(f"{path}: the d2t map sends two draft ids to one verifier token: a malformed map")
    if t2d is not None:
        mask = np.array(t2d).astype(bool).reshape(-1)
        want = np.zeros(V, bool)
        want[tids] = True
        if mask.shape != want.shape or not (mask == want).all():
            raise ModelLoadError(f"{path}: the t2d map ({mask.shape[0]} tokens, {int(mask.sum())} marked) does not "
                                 f"mark the {len(tids)} tokens d2t reaches in the verifier's {V}: the maps disagree")


def layer_ids(args, verifier_args) -> list[int]:
    """The head's aux layer ids (HF hidden_states indices) for this verifier."""
    return list(args.target_layer_ids) if args.target_layer_ids is not None else \
        default_layer_ids(verifier_args.num_hidden_layers)


def check_pairing(args, verifier, path: Path | str = "drafter") -> None:
    """Refuse, by name, an EAGLE-3 head that cannot draft for `verifier`."""
    if not isinstance(verifier, BaseModel) or not verifier.records_layers:
        raise ModelLoadError(f"{path}: an EAGLE-3 head reads the verifier's aux-layer states on its own passes; "
                             f"this verifier ({type(verifier).__name__}, {verifier.args.model_type}) does not record "
                             "them (a distributed verifier, or an architecture with its own pass such as Gemma 4)")
    check_args(args, verifier.args, path)


def check_args(args, va, path: Path | str = "drafter") -> None:
    """The shape and vocabulary checks of a head's config `args` against the verifier's ModelArgs `va`."""
    if args.target_hidden_size != va.hidden_size:
        raise ModelLoadError(f"{path}: the EAGLE-3 head reads verifier states of width {args.target_hidden_size}, "
                             f"the verifier's hidden size is {va.hidden_size}: it was trained for another verifier")
    if args.hidden_size != va.hidden_size:
        raise ModelLoadError(f"{path}: the EAGLE-3 head's hidden size is {args.hidden_size}, the verifier's "
                             f"{va.hidden_size}: it embeds with the verifier's table, so it must match")
    check_compatible(args.vocab_size, va.vocab_size, error=ModelLoadError,
                     size_message=f"{path}: the EAGLE-3 head was built for a vocabulary of {args.vocab_size} "
                                  f"tokens, the verifier has {va.vocab_size}")
    ids = layer_ids(args, va)
    L = va.num_hidden_layers
    bad = [i for i in ids if not 1 <= i <= L]
    if bad:
        raise ModelLoadError(f"{path}: eagle_aux_hidden_state_layer_ids {ids}: {bad} not among the verifier's layer "
                             f"outputs 1..{L} (it has {L} layers)")
    if len(ids) != args.num_aux:
        raise ModelLoadError(f"{path}: the head fuses {args.num_aux} layers, its layer ids name {len(ids)}")


class Eagle3Drafter(AcceptsDrafts):
    """Drafter protocol (begin / draft / accept / sync / close / fork) over an EAGLE-3 head."""

    # Drafts from the verifier's live cache (the recorded aux-layer states): no pipelining, not in
    # the cascade; its states come through the cache, so speculative, tree and auto all draft.
    # ranks: its own confidence in each drafted token and its runner-ups (Draft.ranked), so auto's
    # planner stops the chain where the head is unsure and branches on its next guesses
    # (`runner_ups`, `draft_floor`): EAGLE-2's dynamic drafting, priced like every source.
    # trees: its own dynamic trees (draft_tree), verified by mode `tree` and priced by `auto`.
    caps = DrafterCaps(reads="verifier_cache", forks=True, modes=CHAIN_MODES | {"tree"}, ranks=True, trees=True)
    expected_acceptance = 0.6  # the controller's prior until acceptance is measured

    def __init__(self, model: Model, verifier, name: str = "eagle3", embed: mx.array | None = None):
        """model: a models.eagle3.Model; verifier: the engine's models.base.Model (check_pairing);
        embed: the folder's own embedding table, or None for the verifier's."""
        check_pairing(model.args, verifier)
        self.model, self.verifier, self.name = model, verifier, name
        self.args = model.args
        self.layer_ids = layer_ids(self.args, verifier.args)
        # HF hidden_states[i] is the output of layer i - 1
        self.tap = verifier.record_hidden([i - 1 for i in self.layer_ids])
        self._recording = verifier.record_layers
        if self.tap is None:
            raise ModelLoadError(f"{name}: the verifier ({verifier.args.model_type}) has no attention layer "
                                 "whose cache can keep the EAGLE-3 head's states")
        self.width = len(self.layer_ids) * verifier.args.hidden_size
        self.embed_table = embed
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.vocab_size = verifier.args.vocab_size
        # verifier token -> column of [draft logits, -inf]: the head's logits over the verifier's vocabulary
        cols = np.full(self.vocab_size, self.args.draft_vocab_size, np.int32)
        cols[np.array(model.target_ids())] = np.arange(self.args.draft_vocab_size, dtype=np.int32)
        self._columns = mx.array(cols)
        self._targets = model.target_ids()
        self._targets_np = np.array(self._targets).astype(np.int64)
        self.vcache = None
        self.owner = True  # the engine's drafter (not a request's fork): its close stops the recording
        self.cache: list = []
        self.seq: list[int] = []
        self.fed = 0
        self._last_draft: list[int] = []

    # ------------------------------------------------------------- pieces
    def fork(self) -> Eagle3Drafter:
        """For one request: the same weights, a cache and committed sequence of its own."""
        twin = copy.copy(self)
        twin.vcache, twin.cache, twin.seq, twin.fed, twin._last_draft = None, [], [], 0, []
        twin.owner = False
        return twin

    def bind_verifier_cache(self, cache) -> None:
        self.vcache = cache

    def _rows(self, start: int, stop: int) -> mx.array | None:
        """(1, stop - start, n*E) recorded aux-layer states of positions start..stop-1, or None."""
        if self.vcache is None:
            return None
        store = self.vcache[self.tap]
        hidden = getattr(store, "hidden", None)
        if hidden is None or store.offset < stop or hidden.shape[1] < stop or hidden.shape[2] != self.width:
            return None
        return hidden[:, start:stop]

    def embed(self, ids: mx.array) -> mx.array:
        """(B, T) verifier token ids -> (B, T, E): the folder's table, else the verifier's raw rows."""
        table = self.embed_table
        h = table[ids] if table is not None else self.verifier.model.embed_tokens(ids)
        return h.astype(self.model.fc.weight.dtype)

    def full_logits(self, draft_logits: mx.array) -> mx.array:
        """(..., draft_vocab_size) -> (..., V) over the verifier's vocabulary (-inf off the draft vocabulary)."""
        if not self.args.uses_draft_vocab:
            return draft_logits
        pad = mx.full(draft_logits.shape[:-1] + (1,), -mx.inf, dtype=draft_logits.dtype)
        return mx.take(mx.concatenate([draft_logits, pad], axis=-1), self._columns, axis=-1)

    def feed(self, ids: list[int] | mx.array, states: mx.array, fused: bool) -> tuple[mx.array, mx.array]:
        """Entries (ids[i], states[:, i]) appended to the head's cache -> (logits over the draft
        vocabulary (draft_vocab_size,) after the last, the state the next step reads (1, 1, E)).
        fused=False: states are the verifier's aux rows (fc applied here); True: the head's own."""
        ids = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
        emb = self.embed(ids.reshape(1, -1))
        g = states.astype(emb.dtype) if fused else self.model.fuse(states.astype(emb.dtype))
        h = self.model(emb, g, self.cache)[:, -1:]
        return self.model.logits(h)[0, -1], self.model.feedback(h)

    def _rank(self, logits: mx.array, token: mx.array, n: int) -> tuple[mx.array, mx.array]:
        """The n most likely verifier tokens under the head's own softmax (over its draft
        vocabulary, where all its mass is), `token` first: (ids (n,), probs (n,))."""
        slot = mx.minimum(self._columns[token.astype(mx.int32)], self.args.draft_vocab_size - 1)
        ids, probs = ranked_tokens(logits, slot, n)
        return self._targets[ids], probs

    def _trim_to(self, n: int) -> None:
        for c in self.cache:
            c.trim(c.offset - n)

    # ------------------------------------------------------------- protocol
    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.cache = self.model.make_cache()
        self.seq = list(prompt)
        self.fed = 0
        self._last_draft = []

    def draft(self, k: int, sampler, ranks: int = 0, floor: float = 0.0) -> Draft:
        """k tokens continuing `seq` (q (k, V) filtered by the sampler's params). ranks > 0: also
        every drafted position's `ranks` most likely tokens and probabilities (Draft.ranked), and
        the chain stops, after one token, once the product of its tokens' probabilities < floor."""
        self._last_draft = []
        start = self._start() if k >= 1 else None
        if start is None:  # no recorded states (a pass that kept none): no draft, never a wrong one
            return Draft([], None)
        logits, g = start
        toks, lps, tops = [], [], []
        sure = 1.0
        for i in range(k):
            lp = sampler.logprobs(self.full_logits(logits))
            t = sampler.sample(lp)
            toks.append(t)
            lps.append(lp)
            if ranks:
                tops.append(self._rank(logits, t, ranks))
                if floor > 0.0:
                    mx.eval(tops[-1])
                    sure *= float(tops[-1][1][0].item())
                    if sure < floor:
                        break
            if i + 1 < k:
                logits, g = self.feed(t.reshape(1).astype(mx.int32), g, fused=True)
        d = self._finish(toks, lps)
        if ranks:
            ids, probs = mx.stack([x[0] for x in tops]), mx.stack([x[1] for x in tops])
            mx.eval(ids, probs)
            d.ranked = (np.array(ids).astype(np.int64), np.array(probs).astype(np.float64))
        return d

    def _start(self) -> tuple[mx.array, mx.array] | None:
        """Feed the committed entries the head lacks, (x_{j+1}, states of j) for j = fed..n-2 (at
        least the last one: a draft starts at its output) -> (its logits over the draft vocabulary
        (Dv,), its output state (1, 1, E)), or None (no recorded states: no draft)."""
        n = len(self.seq)
        if n < 2 or not self.cache:
            return None
        fed = min(self.fed, n - 2)
        rows = self._rows(fed, n - 1)
        if rows is None:
            return None
        self._trim_to(fed)  # drop the entries of the last call's guesses
        logits, g = self.feed(self.seq[fed + 1 : n], rows, fused=False)
        self.fed = n - 1
        return logits, g

    def _top(self, logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, Dv) head logits -> the k most likely verifier tokens of each row and their
        probabilities under the head's own softmax, best first: numpy (rows, k) each."""
        p = mx.softmax(logits.astype(mx.float32), axis=-1)
        k = min(k, p.shape[-1])
        idx = mx.argpartition(-p, k - 1, axis=-1)[:, :k]
        val = mx.take_along_axis(p, idx, axis=-1)
        mx.eval(idx, val)
        idx, val = np.array(idx), np.array(val).astype(np.float64)
        order = np.argsort(-val, axis=-1, kind="stable")
        idx, val = np.take_along_axis(idx, order, -1), np.take_along_axis(val, order, -1)
        return self._targets_np[idx], val

    def draft_tree(self, depth: int, width: int | None, topk, keep=None) -> DraftTree:
        """EAGLE-2's dynamic tree after `seq` (DrafterCaps.trees): `depth` levels; level d gives
        each node fed before it its topk (an int, or one per level) most likely children;
        `width` best new nodes by path score are fed for the next level (None: all of them);
        `keep` the number of nodes kept, best by score (an int, a function of the sorted scores
        returning one, or None: all). One head call per level."""
        self._last_draft = []
        tree = DraftTree([], [], [], [])
        start = self._start() if depth >= 1 else None
        if start is None:
            return tree
        logits, g0 = start[0].reshape(1, -1), start[1]
        n = len(self.seq)
        tok: list[int] = []
        par: list[int] = []
        prob: list[float] = []
        score: list[float] = []
        state = {-1: g0}  # node -> its output state (the next level's input), -1 the last committed
        fed_par = [-1]  # parents of the fed entries in feed order; 0 = the last committed entry (n - 2)
        feed_of = {-1: 0}
        frontier = [-1]
        tree.levels = 1
        for level in range(depth):
            k = topk[min(level, len(topk) - 1)] if isinstance(topk, (tuple, list)) else topk
            ids, ps = self._top(logits, max(1, int(k)))
            new = []
            for row, d in enumerate(frontier):
                base = 1.0 if d < 0 else score[d]
                for t, q in zip(ids[row].tolist(), ps[row].tolist(), strict=True):
                    if q <= 0.0:
                        continue
                    tok.append(int(t))
                    par.append(d)
                    prob.append(q)
                    score.append(base * q)
                    new.append(len(tok) - 1)
            if level + 1 == depth or not new:
                break
            if width is not None:
                new = sorted(new, key=lambda i: -score[i])[:width]
            for i in new:
                fed_par.append(feed_of[par[i]])
                feed_of[i] = len(fed_par) - 1
            mask, pos = tree_mask(mx.array(fed_par, dtype=mx.int32), n - 2)
            m = len(new)
            emb = self.embed(mx.array([tok[i] for i in new], dtype=mx.int32).reshape(1, -1))
            g = mx.concatenate([state[par[i]] for i in new], axis=1).astype(emb.dtype)
            h = self.model(emb, g, self.cache, mask[-m:], pos[-m:])
            logits = self.model.logits(h)[0]
            out = self.model.feedback(h)
            for j, i in enumerate(new):
                state[i] = out[:, j : j + 1]
            frontier = new
            tree.levels += 1
        depth_of = []
        for p in par:
            depth_of.append(1 if p < 0 else depth_of[p] + 1)
        best = sorted(range(len(tok)), key=lambda i: (-score[i], depth_of[i]))
        n_keep = len(best) if keep is None else keep([score[i] for i in best]) if callable(keep) else int(keep)
        new_of = {-1: -1}
        for i in sorted(best[: max(0, n_keep)]):  # draft order: parents first
            if par[i] not in new_of:
                continue  # its parent was not kept (never, scores fall along paths): drop it
            new_of[i] = len(tree.tokens)
            tree.tokens.append(tok[i])
            tree.parents.append(new_of[par[i]])
            tree.scores.append(score[i])
            tree.probs.append(prob[i])
        return tree

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; entries off that path are dropped."""
        keep = common_prefix(self.seq, committed)
        self.seq = list(committed)
        self._last_draft = []
        self.fed = min(self.fed, max(0, keep - 1))  # entry j reads x_0..x_{j+1}

    def close(self) -> None:
        """Called when the engine's drafter is replaced: the verifier's passes stop recording
        the aux layers (a request's fork leaves them on)."""
        self.vcache = None
        self.cache = []
        if self.owner and self.verifier.record_layers is self._recording:
            self.verifier.stop_recording()
