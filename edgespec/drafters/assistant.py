"""Gemma 4's assistant as a drafter: drafts from the verifier's own keys, values and hidden state.

Folder: a Hugging Face `gemma4_assistant` checkpoint (config.json, *.safetensors), as Google
ships it beside Gemma 4, or the `drafter/` folder `edgespec convert --drafter` wrote from one.
It is found like any drafter: `edgespec.load(verifier, drafter=folder)`, or a `drafter/`
folder inside the verifier's bundle or Hugging Face folder (then `auto` and `speculative`
use it with no option).

State: with the committed sequence x_0..x_p, the verifier's cache holds positions 0..p-1
(every mode that drafts with it keeps that invariant: the last committed token is fed with
the next verification). A draft reads, from that cache, the keys and values of the
verifier's store layers and the final-norm hidden state at p - 1 (layer 0's cache records
it once an assistant is attached, models/gemma4.HiddenKVCache), so the assistant owns no
cache and has nothing to roll back: `sync` only replaces the committed sequence. The
speculative and adaptive (auto) modes hand it their verifier cache (`bind_verifier_cache`);
it drafts in those modes only (tree, cascade and pipelined drafting refuse it or fall back,
see `reads_verifier`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx

from edgespec.drafters.base import CHAIN_MODES, Draft, DrafterCaps, ReadsVerifierCache
from edgespec.drafters.compat import check_compatible
from edgespec.errors import ModelLoadError
from edgespec.models.gemma4_assistant import AssistantArgs, AssistantModel
from edgespec.weights.formats.hf import read_config, read_safetensors
from edgespec.weights.numerics import emulate_half_products, runs_as_metal

MODEL_TYPE = "gemma4_assistant"


def is_assistant_folder(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, json.JSONDecodeError):
        return False


def load_assistant_model(path: str | Path, dtype=None):
    """The assistant's MLX model from its folder (HF checkpoint or an edgespec drafter/ copy)."""
    path = Path(path).expanduser()
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    try:
        args = AssistantArgs.from_dict(config)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    model = AssistantModel(args)
    weights = model.sanitize(read_safetensors(files))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: weights do not match config.json: {e}") from None
    mx.eval(model.parameters())
    return model


def check_fit(assistant_args, verifier_args) -> dict[str, int]:
    """Refuse an assistant that cannot draft for this verifier, naming what differs; returns
    {layer type: the verifier's store layer of that type}."""
    if not hasattr(verifier_args, "store_layers"):
        raise ModelLoadError(f"a gemma4_assistant drafts for Gemma 4; the verifier is "
                             f"{getattr(verifier_args, 'model_type', '?')!r}")
    t = assistant_args.text
    check_compatible(assistant_args.vocab_size, verifier_args.vocab_size, error=ModelLoadError,
                     size_message=f"the assistant's vocabulary has {assistant_args.vocab_size} tokens, "
                                  f"the verifier's {verifier_args.vocab_size}")
    if assistant_args.backbone_hidden_size != verifier_args.hidden_size:
        raise ModelLoadError(f"the assistant was trained on a verifier of width (hidden size) "
                             f"{assistant_args.backbone_hidden_size}, this one is {verifier_args.hidden_size}")
    store = verifier_args.store_layers()
    for i, kind in enumerate(t.layer_types):
        j = store.get(kind)
        if j is None:
            raise ModelLoadError(f"assistant layer {i} reads {kind} keys; the verifier has no such layer")
        D, Hk = verifier_args.layer_head_dims[j], verifier_args.layer_kv_heads[j]
        if t.layer_head_dims[i] != D or t.num_attention_heads % Hk:
            raise ModelLoadError(f"assistant layer {i} ({kind}) does not fit the verifier's layer {j}: "
                                 f"head size {t.layer_head_dims[i]} vs {D}, "
                                 f"{t.num_attention_heads} query heads over {Hk} key/value heads")
    return {kind: store[kind] for kind in set(t.layer_types)}


class AssistantDrafter(ReadsVerifierCache):
    """Drafter protocol (begin / draft / accept / sync / close) over Gemma 4's assistant."""

    # drafts from the verifier's live cache: no pipelining, not in tree/cascade
    caps = DrafterCaps(reads="verifier_cache", forks=True, modes=CHAIN_MODES)

    def __init__(self, assistant, verifier, name: str = "gemma4-assistant"):
        store = check_fit(assistant.args, verifier.args)
        self.assistant, self.verifier, self.name = assistant, verifier, name
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.vocab_size = verifier.args.vocab_size
        self.store = store
        verifier.keep_hidden = True  # its caches made from now on record the hidden states read here
        self.cache = None
        self.seq: list[int] = []
        self._last_draft: list[int] = []

    def fork(self) -> AssistantDrafter:
        """This drafter for one request (see drafters.base.ModelDrafter.fork): the same
        weights, a verifier cache binding and committed sequence of its own, so requests
        drafting at once in a batch do not share them. It owns no cache: nothing to reuse
        (the verifier's cache it drafts from is restored by the prefix cache)."""
        twin = copy.copy(self)
        twin.cache, twin.seq, twin._last_draft = None, [], []
        return twin

    # ------------------------------------------------------------- verifier state
    def _inputs(self):
        """(keys/values per layer type, hidden at p - 1, p) from the verifier cache, or None."""
        p = len(self.seq) - 1
        cache = self.cache
        if cache is None or p < 1 or cache[0].offset < p or not cache[0].keeps_hidden:
            return None
        hidden = cache[0].hidden_at(p - 1)
        if hidden is None:
            return None
        kv = {}
        for kind, j in self.store.items():
            state = cache[j].state  # (keys, values) of the held positions (dequantized for a quantized cache)
            if state is None:
                return None
            kv[kind] = (state[0][..., :p, :], state[1][..., :p, :])
        return kv, hidden, p

    # ------------------------------------------------------------- protocol
    def draft(self, k: int, sampler) -> Draft:
        got = self._inputs() if k >= 1 else None
        if got is None:
            return self._no_draft()
        kv, hidden, p = got
        dtype = self.assistant.pre_projection.weight.dtype
        hidden = hidden.astype(dtype)
        tok = mx.array([[self.seq[-1]]], dtype=mx.int32)
        toks, rows = [], []
        for _ in range(k):
            x = mx.concatenate([self.verifier.embed(tok).astype(dtype), hidden], axis=-1)
            logits, hidden = self.assistant(x, kv, p)
            lp = sampler.logprobs(logits[0, -1])
            t = sampler.sample(lp)
            toks.append(t)
            rows.append(lp)
            tok = t.reshape(1, 1).astype(mx.int32)
        return self._finish(toks, rows)

    @classmethod
    def load(cls, path: str | Path, verifier) -> AssistantDrafter:
        """From a gemma4_assistant folder; `verifier` is the Engine (or LoadedModel) it drafts for."""
        loaded = getattr(verifier, "loaded", verifier)
        model = loaded.model
        on_cpu = not runs_as_metal(verifier)  # the CPU device, in its own numerics
        dtype = mx.float32 if on_cpu else mx.float16
        drafter_model = load_assistant_model(path, dtype)
        if not on_cpu:  # as Metal computes float16, also on the CPU device (numerics="metal")
            emulate_half_products(drafter_model)
        return cls(drafter_model, model, name=f"gemma4-assistant:{Path(path).name}")
