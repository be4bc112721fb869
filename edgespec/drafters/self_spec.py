"""Self-speculation: draft with the verifier itself, skipping a searched set of layers.

Zero extra weights: the drafter runs `model(..., layer_ids=keep)` with its own KV
cache (entries only for the kept layers). Which layers to skip is chosen by
measured acceptance (as in Draft & Verify, Zhang et al. 2023, which searches the
skip set with Bayesian optimisation; here a greedy backward elimination):
starting from all layers, repeatedly drop the layer whose removal keeps the
highest greedy acceptance on calibration text, then pick the point on that path
with the best modelled speedup. Truncating to the first layers is far worse
(SmolLM2-135M: the first 4 or 8 of 30 layers accept < 2% of drafts).

Teacher-forced acceptance: on the verifier's own greedy continuations, the
fraction of positions where the drafter's argmax equals the verifier's token is
the per-token acceptance alpha of greedy speculative decoding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

import edgespec.sealed as sealed
from edgespec.controller import expected_tokens
from edgespec.drafters.base import ModelDrafter
from edgespec.errors import DrafterRequiredError
from edgespec.generate import prefill
from edgespec.paths import home
from edgespec.progress import progress_bar
from edgespec.weights.identity import identity_digest

# Written for the search (not the benchmark prompts): chat, code, summary, translation.
CALIBRATION_PROMPTS = [
    "What are three good habits for staying healthy?",
    "Write a Python function that returns the factorial of n.",
    "Summarize in two sentences: The city council voted to expand the bike lane network after a year of "
    "public consultation, citing safer streets and lower traffic.",
    "Translate to French: The weather is nice today and I want to go to the park.",
]


class SelfSpecDrafter(ModelDrafter):
    """Drafts with the verifier's own weights through the kept layers only."""

    def __init__(self, model, keep_layers: list[int], expected_acceptance: float | None = None):
        n = len(model.layers)
        if not keep_layers or any(not 0 <= i < n for i in keep_layers):
            raise ValueError(f"keep_layers must be a non-empty list of layer indices in 0..{n - 1}")
        super().__init__(model, layer_ids=sorted(keep_layers))
        self.name = f"self:{len(self.layer_ids)}/{n}"
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        if expected_acceptance is not None:
            self.expected_acceptance = expected_acceptance


# ---------------------------------------------------------------------- search
def calibration_sequences(model, tokenizer, prompts=None, new_tokens: int = 24) -> list[tuple[list[int], int]]:
    """(prompt + verifier greedy continuation, prompt length) for each calibration prompt."""
    out = []
    for text in prompts or CALIBRATION_PROMPTS:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if isinstance(text, str) else list(text)
        cache = model.make_cache()
        logits = prefill(model, cache, ids)
        seq = list(ids)
        for _ in range(new_tokens):
            t = int(mx.argmax(logits).item())
            seq.append(t)
            logits = model(mx.array([[t]], dtype=mx.int32), cache)[0, -1]
        out.append((seq, len(ids)))
    return out


def _match_rate(model, seqs, layer_ids, starts=None, vocab_subsets=None) -> float:
    """Greedy acceptance of `layer_ids` on teacher-forced calibration sequences.

    starts: optional per-sequence (position j in layer_ids, hidden before it) to resume from.
    vocab_subsets: optional per-sequence (P, S) token ids; the drafter's argmax is then
    taken among those S candidates only (a cheap proxy for the full (E, V) head).
    """
    hits = total = 0
    for s, (seq, plen) in enumerate(seqs):
        if starts is None:
            h = model.model.embed_tokens(mx.array(seq, dtype=mx.int32)[None])
            ids = layer_ids
        else:
            j, h = starts[s]
            ids = layer_ids[j:]
        for i in ids:
            h = model.layers[i](h, "causal", None, None)
        # Positions plen-1 .. end-2 predict the generated tokens seq[plen:].
        hp = h[:, plen - 1 : -1]
        target = mx.array(seq[plen:], dtype=mx.int32)
        if vocab_subsets is None:
            pred = mx.argmax(model.head(hp), axis=-1)[0]
        else:
            sub = vocab_subsets[s]  # (P, S)
            hn = model.model.norm(hp)[0]  # (P, E)
            w = _head_rows(model, sub)  # (P, S, E)
            scores = (w @ hn[:, :, None])[..., 0]  # (P, S)
            pred = mx.take_along_axis(sub, mx.argmax(scores, axis=-1)[:, None], axis=1)[:, 0]
        hits += int(mx.sum(pred == target).item())
        total += len(seq) - plen
    return hits / max(total, 1)


def _head_rows(model, ids: mx.array) -> mx.array:
    """Output-projection rows for token ids (..., S) -> (..., S, E) (tied or separate head;
    a quantized one's rows dequantized, as on a Mac's 4-bit default model)."""
    head = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    if "scales" in head:
        return mx.dequantize(head["weight"][ids], head["scales"][ids], head.get("biases")[ids],
                             group_size=head.group_size, bits=head.bits)
    return head.weight[ids]


def _verifier_top(model, seqs, n: int = 32) -> list[mx.array]:
    """Per sequence, the verifier's top-n token ids at each generated position (P, n)."""
    out = []
    for seq, plen in seqs:
        logits = model(mx.array(seq, dtype=mx.int32)[None])[0, plen - 1 : -1]
        top = mx.argpartition(-logits, n - 1, axis=-1)[:, :n]
        mx.eval(top)
        out.append(top)
    return out


def _hidden_prefixes(model, seqs, layer_ids) -> list[list[mx.array]]:
    """Per sequence, the hidden state before each position of layer_ids (len+1 states)."""
    out = []
    for seq, _ in seqs:
        h = model.model.embed_tokens(mx.array(seq, dtype=mx.int32)[None])
        states = [h]
        for i in layer_ids:
            h = model.layers[i](h, "causal", None, None)
            mx.eval(h)
            states.append(h)
        out.append(states)
    return out


def modelled_speedup(alpha: float, draft_cost: float, verify_growth: float = 0.05, kmax: int = 8) -> float:
    """Best speedup over K of (E[tokens]) / (t_v(K+1) + K t_d), in units of one plain step.

    draft_cost: drafter token cost / verifier token cost; t_v(K+1) ~ 1 + verify_growth*K
    (a fast BLAS makes extra positions nearly free).
    """
    return max(expected_tokens(alpha, k) / (1 + verify_growth * k + k * draft_cost) for k in range(1, kmax + 1))


def layer_cost_fractions(model) -> tuple[float, float]:
    """(one layer, embedding+head) shares of a one-token verifier pass, by multiply-adds."""
    a = model.args
    D = a.head_dim
    layer = a.hidden_size * D * (2 * a.num_attention_heads + 2 * a.num_key_value_heads) + 3 * a.hidden_size * a.intermediate_size
    head = a.hidden_size * a.vocab_size
    total = layer * a.num_hidden_layers + head
    return layer / total, head / total


def search_skip_layers(
    model,
    tokenizer=None,
    seqs=None,
    max_skip: int | None = None,
    prompts=None,
    candidates: int = 3,
    on_step=None,
) -> dict:
    """Greedy backward elimination of layers by measured acceptance.

    Phase 1 scores every layer by the acceptance left when it alone is skipped.
    Phase 2 removes layers one at a time: the `candidates` least important
    remaining layers (phase-1 order) are each tried in the current set and the
    one keeping the highest acceptance goes. Candidate scoring takes the
    drafter's argmax among the verifier's top-32 tokens (a cheap proxy); the
    chosen set's acceptance is then measured with the full head.
    on_step(dropped_layer, acceptance, modelled_speedup) follows each removal.
    Returns {"keep", "skip", "acceptance", "speedup_model", "path": [[layer, acceptance], ...]}.
    """
    n = len(model.layers)
    seqs = seqs or calibration_sequences(model, tokenizer, prompts)
    max_skip = max_skip if max_skip is not None else n // 2
    f_layer, f_head = layer_cost_fractions(model)
    subsets = _verifier_top(model, seqs, min(32, model.args.vocab_size))

    def score(keep, j, prefixes):
        cand = keep[:j] + keep[j + 1 :]
        # Layers before position j are unchanged: resume from the stored hidden state.
        return _match_rate(model, seqs, cand, [(j, prefixes[s][j]) for s in range(len(seqs))], subsets)

    keep = list(range(n))
    prefixes = _hidden_prefixes(model, seqs, keep)
    importance = {i: score(keep, i, prefixes) for i in range(n)}  # higher = less important
    path, best = [], None
    for _ in range(max_skip):
        prefixes = _hidden_prefixes(model, seqs, keep)
        pool = sorted(keep, key=lambda i: -importance[i])[:candidates]
        acc, drop = max((score(keep, keep.index(i), prefixes), i) for i in pool)
        keep = [i for i in keep if i != drop]
        speed = modelled_speedup(acc, f_layer * len(keep) + f_head)
        path.append([drop, round(acc, 4)])
        if on_step is not None:
            on_step(drop, acc, speed)
        if best is None or speed > best["speedup_model"]:
            best = {"keep": list(keep), "acceptance_proxy": acc, "speedup_model": speed}
    best["acceptance"] = _match_rate(model, seqs, best["keep"])
    best["speedup_model"] = modelled_speedup(best["acceptance"], f_layer * len(best["keep"]) + f_head)
    best["skip"] = [i for i in range(n) if i not in best["keep"]]
    best["path"] = path
    return best


# ---------------------------------------------------------------------- cache
def _cache_file(key: str) -> Path:
    return home() / "self_spec" / f"{key[:32]}.json"


def model_key(loaded) -> str | None:
    """What the skip set is cached by (edgespec.weights.identity): the weights' checksums a
    bundle's manifest records, else a GGUF's or a folder's sizes and times, with the shape;
    None for a model built in memory (searched each time)."""
    return identity_digest(loaded)


def skip_set_for(loaded, search: bool = True, progress: bool = True) -> dict | None:
    """The cached skip set of this model (by `model_key`), searching and caching it when missing.

    The search (about a minute for SmolLM2-135M on 2 CPU cores) shows a progress bar on
    stderr unless progress=False."""
    sha = model_key(loaded)
    n = len(loaded.model.layers)
    if sha:
        f = _cache_file(sha)
        if f.is_file() and not f.is_symlink():
            try:
                found = sealed.unseal(json.loads(f.read_text()))
            except (OSError, ValueError):
                found = None
            if found is not None and _valid_skip_set(found, n):
                return found
            # edited, damaged or another model's: searched again (and written over: it is ours)
    if not search:
        return None
    if not getattr(loaded.model, "layerwise", True):
        raise DrafterRequiredError(
            f"self-speculation searches which layers to skip by running them one by one, which "
            f"{loaded.model.args.model_type} cannot (its layers read per-layer inputs and shared keys the whole "
            "forward makes); name the layers instead (cascade's mid_layers option) or load a drafter")

    steps = len(loaded.model.layers) // 2  # search_skip_layers' default max_skip
    with progress_bar(total=steps, desc="choosing layers to skip (once per model)", unit="layer",
                      enable=progress) as bar:

        def on_step(dropped, acceptance, speedup):
            bar.update(1)
            bar.set_postfix_str(f"dropped {dropped}, acceptance {acceptance:.2f}, model {speedup:.2f}x")

        result = search_skip_layers(loaded.model, loaded.tokenizer, on_step=on_step)
    if sha:
        f = _cache_file(sha)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sealed.seal(result), indent=1))
        os.replace(tmp, f)
    return result


def _valid_skip_set(found: dict, n: int) -> bool:
    """A skip set read back names each of the model's n layers at most once, keeps at least one."""
    keep = found.get("keep")
    return (isinstance(keep, list) and 0 < len(keep) <= n and len(set(keep)) == len(keep)
            and all(type(i) is int and 0 <= i < n for i in keep))


def self_drafter(engine) -> SelfSpecDrafter:
    """Self-speculative drafter for the engine's model (skip set searched once, then cached)."""
    found = skip_set_for(engine.loaded)
    return SelfSpecDrafter(engine.model, found["keep"], expected_acceptance=found.get("acceptance"))
