"""The feature drafter at run time: drafts from the verifier's own hidden states.

Folder (written by `edgespec distill --kind feature`): config.json (the drafter's
decoder layers, Llama format), model.safetensors (fc, layers, norm),
vocab_map.json (the kept output ids, same format as the distilled drafter's; slot 0
unused) and drafter.json ({"format": "edgespec-feature-drafter"}). The token
embedding and the output head are the verifier's, taken at load time, so the
folder holds no copy of them.

State, with seq the committed sequence x_0..x_{n-1}: the verifier has produced a
feature f_j for every committed position but the last (`features_needed()` says
how many the speculative mode still owes; it hands them over with
`add_features`). Cache entry j is (x_{j+1}, f_j) and sits at RoPE position j.
Entries made from true features on the committed path are kept across rounds;
entries made during a draft from the drafter's own guesses are dropped at the
next draft, because the verifier's true features replace the guesses.

q is the softmax over the kept ids (the verifier's head rows), -inf elsewhere: it
gives no mass to tokens it cannot name, so rejection sampling stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgespec.drafters.base import AcceptsDrafts, Draft, DrafterCaps, common_prefix
from edgespec.drafters.compat import check_compatible, check_map_vocabulary
from edgespec.drafters.vocab_map import VOCAB_MAP, VocabMap
from edgespec.errors import ModelLoadError
from edgespec.models.feature_drafter import FeatureDraftModel
from edgespec.models.llama import ModelArgs
from edgespec.weights.formats.hf import read_safetensors
from edgespec.weights.numerics import emulate_half_products, runs_as_metal

DRAFTER_JSON = "drafter.json"
FORMAT = "edgespec-feature-drafter"


def is_feature_folder(path: str | Path) -> bool:
    p = Path(path) / DRAFTER_JSON
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def verifier_head_rows(verifier, ids: np.ndarray) -> mx.array:
    """(N, E) rows of the verifier's output projection for full ids `ids`."""
    w = verifier.model.embed_tokens.weight if verifier.args.tie_word_embeddings else verifier.lm_head.weight
    return w[mx.array(np.asarray(ids, np.int32))]


class FeatureDrafter(AcceptsDrafts):
    """Speculative drafter reading the verifier's features (mode 'speculative' only)."""

    name = "feature"
    # reads the verifier's features of the committed positions: mode 'speculative' only, unpipelined
    caps = DrafterCaps(reads="features", modes=frozenset({"speculative"}))

    def __init__(self, model, verifier, vocab_map: VocabMap, name: str = "feature"):
        check_compatible(vocab_map.full_vocab_size, verifier.args.vocab_size, error=ModelLoadError,
                         size_message=f"feature drafter was built for a vocabulary of {vocab_map.full_vocab_size} "
                                      f"tokens, the verifier has {verifier.args.vocab_size}")
        if model.args.hidden_size != verifier.args.hidden_size:
            raise ModelLoadError(
                f"feature drafter reads features of width {model.args.hidden_size}, "
                f"the verifier's are {verifier.args.hidden_size}: it was trained for another verifier"
            )
        self.model = model
        self.name = name
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.vocab_map = vocab_map
        self.vocab_size = vocab_map.full_vocab_size
        dtype = model.fc.weight.dtype
        self._embed = verifier.model.embed_tokens.weight  # (V, E), shared, never copied
        self._head = verifier_head_rows(verifier, vocab_map.ids[1:]).astype(dtype)  # (N-1, E)
        self._kept = mx.array(vocab_map.ids[1:].astype(np.int32))
        # Evaluate now: MLX streams are per thread, and the engine drafts on its own worker
        # thread, which cannot run a graph left pending on the constructing thread's stream.
        mx.eval(self._head, self._kept, model.parameters())
        self.cache = []
        self.seq: list[int] = []
        self.feats: list[mx.array] = []  # (m, E) blocks; together one row per seq position but the last
        self._n_feats = 0
        self.fed = 0  # cache entries built from true features on the committed path
        self._last_draft: list[int] = []

    # ------------------------------------------------------------- features in
    def features_needed(self) -> int:
        return len(self.seq) - 1 - self._n_feats

    def add_features(self, f: mx.array) -> None:
        """Verifier features (m, E) of the next m committed positions."""
        if f.ndim != 2 or f.shape[0] > self.features_needed():
            raise ValueError(f"got {f.shape[0] if f.ndim == 2 else f.shape} feature rows, "
                             f"{self.features_needed()} committed positions lack one")
        self.feats.append(f)
        self._n_feats += f.shape[0]

    def _feature_rows(self, start: int, stop: int) -> mx.array:
        """Rows start..stop-1; only the blocks that hold them are touched (a round needs the
        newest few, so a long context costs no copy of every feature per round)."""
        pieces, end = [], self._n_feats
        for block in reversed(self.feats):
            begin = end - block.shape[0]
            if begin < stop and end > start:
                pieces.append(block[max(start, begin) - begin : min(stop, end) - begin])
            if begin <= start:
                break
            end = begin
        pieces.reverse()
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)

    # ------------------------------------------------------------- protocol
    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.cache = self.model.make_cache()
        self.seq = list(prompt)
        self.feats, self._n_feats, self.fed = [], 0, 0
        self._last_draft = []

    def _logits(self, g: mx.array) -> mx.array:
        """(T, E) guesses -> (T, V) logits over the full vocabulary (-inf outside the kept ids)."""
        red = g @ self._head.T
        full = mx.full((g.shape[0], self.vocab_size), -mx.inf, dtype=red.dtype)
        full[:, self._kept] = red
        return full

    def _step(self, toks: mx.array, feats: mx.array) -> mx.array:
        emb = self._embed[toks].astype(self.model.fc.weight.dtype)
        return self.model(emb[None], feats[None], self.cache)[0]

    def draft(self, k: int, sampler) -> Draft:
        if k < 1:
            return Draft([], None)
        if self.features_needed():
            raise RuntimeError(f"feature drafter: {self.features_needed()} committed position(s) lack a verifier feature")
        n = len(self.seq)
        if n < 2:
            raise RuntimeError("feature drafter: needs at least one verifier feature (a prompt of 2+ tokens, or one step)")
        # Re-feed at least the last entry: its output is where the draft starts.
        self.fed = min(self.fed, n - 2)
        drop = self.cache[0].offset - self.fed if self.cache else 0
        if drop > 0:
            for c in self.cache:
                c.trim(drop)
        # Entries fed..n-2 from true features: (x_{j+1}, f_j).
        g = self._step(mx.array(self.seq[self.fed + 1 : n], dtype=mx.int32), self._feature_rows(self.fed, n - 1))
        self.fed = n - 1
        g = g[-1:]
        toks, rows = [], []
        for i in range(k):
            lp = sampler.logprobs(self._logits(g)[0])
            tok = sampler.sample(lp)
            toks.append(tok)
            rows.append(lp)
            if i + 1 < k:
                g = self._step(tok.reshape(1).astype(mx.int32), g)[-1:]
        return self._finish(toks, rows)

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence; features and entries off that path are dropped."""
        keep = common_prefix(self.seq, committed)
        self.seq = list(committed)
        self._last_draft = []
        # Feature j belongs to position j, whose content (x_0..x_j) must be unchanged.
        if self._n_feats > keep:
            self.feats = [self._feature_rows(0, keep)] if keep else []
            self._n_feats = keep
        # Entry j reads x_{j+1} and f_j: valid while j + 1 < keep.
        self.fed = min(self.fed, max(0, keep - 1))

    def close(self) -> None:
        self.cache = []
        self.feats = []

    # ------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path, verifier) -> FeatureDrafter:
        """From a feature drafter folder; `verifier` (Engine or LoadedModel) supplies embedding and head."""
        path = Path(path).expanduser()
        for name in ("config.json", "model.safetensors", VOCAB_MAP, DRAFTER_JSON):
            if not (path / name).is_file():
                raise ModelLoadError(f"{path}: a feature drafter folder needs {name}")
        try:
            vmap = VocabMap.load(path)
            args = ModelArgs.from_dict(json.loads((path / "config.json").read_text()))
        except (ValueError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: {e}") from None
        check_map_vocabulary(path, vmap, verifier)
        loaded = getattr(verifier, "loaded", verifier)
        model = FeatureDraftModel(args)
        weights = read_safetensors([path / "model.safetensors"])
        # fp16 on disk (size); the CPU computes fp16 several times slower than fp32.
        on_cpu = not runs_as_metal(verifier)  # the CPU device, in its own numerics
        dtype = mx.float32 if on_cpu else mx.float16
        try:
            model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
        except ValueError as e:
            raise ModelLoadError(f"{path}/model.safetensors does not fit config.json: {e}") from None
        mx.eval(model.parameters())
        if not on_cpu:  # as Metal computes float16, also on the CPU device (numerics="metal")
            emulate_half_products(model)
        return cls(model, loaded.model, vmap, name=f"feature:{path.name}")
