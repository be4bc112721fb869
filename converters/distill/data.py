"""Distillation data: the verifier's own greedy continuations and its top-k log-probs.

For every prompt the verifier generates greedily (batched, left-padded) and at each
step records the k most likely next tokens with their log-probabilities (temperature
1, unfiltered): the drafter is later trained to match that distribution (KL), not
only the argmax. "text" items are scored teacher-forced in one pass instead.

`samples` > 1 answers every prompt again samples-1 times with tokens *sampled* at a
low temperature (default 0.7): mostly the verifier's argmax, with an occasional
other choice that opens a new branch, after which the text goes on in the
verifier's own greedy style. The targets stay the temperature-1 top-k at every
position. Measured reason: with one greedy answer per prompt the drafter memorised
its 12k targets (top-1 agreement 67% on training vs 30% held-out); near-greedy
branches multiply the data with text of the kind the drafter meets at draft time.
Each sampled shard has its own seed, so a resumed build yields the same data.

On disk (`DATA/`): meta.json (settings + verifier identity) and shard-NNNNN.npz
files, each written atomically; a rerun skips shards that exist, so an interrupted
build resumes where it stopped and yields the same data.

Example layout: tokens (L,) int32; targets start at `start`: row j of
topk_ids/topk_lp (L-start, k) is the verifier's distribution for tokens[start+j]
given tokens[:start+j] (row j's first id is the greedy token itself).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from edgespec.converters.distill.prompts import PromptItem, encode_item

FORMAT = "edgespec-distill-data"


@dataclass
class Example:
    tokens: np.ndarray  # (L,) int32
    start: int
    topk_ids: np.ndarray  # (L - start, k) int32
    topk_lp: np.ndarray  # (L - start, k) float16
    domain: str


def _topk(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits (..., V) -> (ids, log-probs), each (..., k), sorted by decreasing probability."""
    lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[..., :k]
    val = mx.take_along_axis(lp, idx, axis=-1)
    order = mx.argsort(-val, axis=-1)
    idx, val = mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(val, order, axis=-1)
    return np.array(idx, dtype=np.int32), np.array(val, dtype=np.float16)


def generate_batch(model, prompts: list[list[int]], max_new: int, k: int, eos_ids: set[int],
                   samples: int = 1, temperature: float = 0.7, seed: int = 0):
    """Continuations of B prompts in one batch: per prompt the greedy one, then samples-1
    sampled at `temperature`.

    Prompts are left-padded to the longest (P); a per-row boolean mask (B, 1, T, S)
    hides the padding. RoPE depends only on relative positions, so the shift left
    padding causes does not change any score. The prompts are prefilled once; their
    KV rows are then repeated `samples` times (prefill is the costly part here:
    ~200 tok/s against ~120 tok/s of batched decode on the 2-core CPU), row
    b * samples + s being prompt b's answer s. Returns per row (gen ids, topk ids, topk lp).
    """
    B, P = len(prompts), max(len(p) for p in prompts)
    S = P + max_new
    x = np.zeros((B, P), np.int32)
    valid = np.zeros((B, S), bool)  # which key positions hold real tokens
    for b, p in enumerate(prompts):
        x[b, P - len(p) :] = p
        valid[b, P - len(p) : P] = True
    # Pad query rows attend to themselves only, so no row is fully masked (0 * NaN).
    m = np.tril(np.ones((P, P), bool))[None] & valid[:, None, :P]
    m |= np.eye(P, dtype=bool)[None]
    cache = model.make_cache()
    logits = model(mx.array(x), cache=cache, mask=mx.array(m[:, None]))[:, -1]  # (B, V)
    if samples > 1:
        for c in cache:
            c.keys, c.values = mx.repeat(c.keys, samples, axis=0), mx.repeat(c.values, samples, axis=0)
        logits = mx.repeat(logits, samples, axis=0)
        valid = np.repeat(valid, samples, axis=0)
    R = B * samples
    sampled = (np.arange(R) % samples) > 0
    out = [([], [], []) for _ in range(R)]
    done = np.zeros(R, bool)
    key = mx.random.key(seed)
    for t in range(max_new):
        ids, lps = _topk(logits, k)  # (R, k)
        tok = ids[:, 0]
        if sampled.any():
            key, sub = mx.random.split(key)
            draw = np.array(mx.random.categorical(logits.astype(mx.float32) / temperature, key=sub), np.int32)
            tok = np.where(sampled, draw, tok).astype(np.int32)
        for r in np.nonzero(~done)[0]:
            out[r][0].append(int(tok[r]))
            out[r][1].append(ids[r])
            out[r][2].append(lps[r])
            if int(tok[r]) in eos_ids:
                done[r] = True
        if done.all() or t == max_new - 1:
            break
        valid[:, P + t] = True
        mask = mx.array(valid[:, None, None, : P + t + 1])  # (R, 1, 1, S)
        logits = model(mx.array(tok[:, None]), cache=cache, mask=mask)[:, -1]
    return [(g, np.stack(i), np.stack(lp)) for g, i, lp in out]


def score_text(model, tokens: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced top-k for tokens[1:] given their prefixes: (L-1, k) each."""
    logits = model(mx.array([tokens]))[0, :-1]
    return _topk(logits, k)


def items_hash(items: list[PromptItem]) -> str:
    blob = json.dumps([[i.text, i.domain, i.kind] for i in items]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _save_shard(path: Path, examples: list[Example]) -> None:
    lens = [len(e.tokens) for e in examples]
    tmp = path.with_name(path.name + ".part.npz")
    np.savez(
        tmp,
        tokens=np.concatenate([e.tokens for e in examples]).astype(np.int32),
        lens=np.array(lens, np.int32),
        starts=np.array([e.start for e in examples], np.int32),
        topk_ids=np.concatenate([e.topk_ids for e in examples]).astype(np.int32),
        topk_lp=np.concatenate([e.topk_lp for e in examples]).astype(np.float16),
        domains=np.array([e.domain for e in examples]),
    )
    os.replace(tmp, path)


def _load_shard(path: Path) -> list[Example]:
    z = np.load(path)
    out, t0, r0 = [], 0, 0
    for n, s, d in zip(z["lens"], z["starts"], z["domains"], strict=True):
        n, s = int(n), int(s)
        out.append(Example(z["tokens"][t0 : t0 + n], s, z["topk_ids"][r0 : r0 + n - s], z["topk_lp"][r0 : r0 + n - s], str(d)))
        t0, r0 = t0 + n, r0 + n - s
    return out


PLAN_VERSION = 2


def shard_plan(tok, items: list[PromptItem], batch_size: int, max_prompt: int) -> list[list[tuple[int, list[int]]]]:
    """Deterministic shards of (item index, prompt ids).

    Per domain, prompts sorted by length are cut into batches (rows of a batch finish
    at similar times and pad little); shards then take turns across domains, so
    every prefix of the plan covers all domains. Texts go last, scored in batches.
    """
    enc = [(i, encode_item(tok, it, max_prompt)) for i, it in enumerate(items)]
    per_domain: dict[str, list] = {}
    for e in enc:
        if items[e[0]].kind == "prompt":
            per_domain.setdefault(items[e[0]].domain, []).append(e)
    queues = []
    for dom in sorted(per_domain):
        rows = sorted(per_domain[dom], key=lambda e: (len(e[1]), e[0]))
        queues.append([rows[i : i + batch_size] for i in range(0, len(rows), batch_size)])
    plan = []
    for turn in range(max((len(q) for q in queues), default=0)):
        plan += [q[turn] for q in queues if turn < len(q)]
    txt = [e for e in enc if items[e[0]].kind == "text" and len(e[1]) > 1]
    plan += [txt[i : i + batch_size] for i in range(0, len(txt), batch_size)]
    return plan


def build_dataset(
    loaded,
    items: list[PromptItem],
    out: str | Path,
    max_new: int = 160,
    topk: int = 8,
    batch_size: int = 16,
    max_prompt: int = 384,
    progress: Callable[[int, int], None] | None = None,
    max_shards: int | None = None,
    samples: int = 1,
    sample_temperature: float = 0.7,
) -> Path:
    """Run the verifier over `items`, writing shards to `out` (resumes a partial build).

    `max_shards` keeps only the first shards of the plan (each prefix is balanced
    across domains, see shard_plan): a smaller data budget, still reproducible.
    `samples` answers per prompt: the greedy one, then samples-1 near-greedy ones
    (temperature `sample_temperature`); texts are scored once.
    `progress(done_items, total_items)` is called after every shard.
    """
    if topk < 1 or max_new < 1 or batch_size < 1 or samples < 1:
        raise ValueError("topk, max_new, batch_size and samples must be >= 1")
    if samples > 1 and not 0 < sample_temperature <= 2:
        raise ValueError(f"sample temperature must be in (0, 2], got {sample_temperature}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = loaded.tokenizer
    meta = {
        "format": FORMAT,
        "vocab_hash": tok.vocab_hash(),
        "vocab_size": int(loaded.model.args.vocab_size),
        "items_hash": items_hash(items),
        "max_new": max_new,
        "topk": topk,
        "batch_size": batch_size,
        "max_prompt": max_prompt,
        "plan": PLAN_VERSION,
    }
    if samples > 1:  # absent for one greedy answer, so older data folders stay valid
        meta.update(samples=samples, sample_temperature=sample_temperature)
    meta_path = out / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = sorted(k for k in meta if old.get(k) != meta[k])
            raise ValueError(f"{out} holds data built with other settings ({', '.join(diff)}); use another folder")
    else:
        meta_path.write_text(json.dumps(meta, indent=2))
    plan = shard_plan(tok, items, batch_size, max_prompt)
    if max_shards is not None:
        plan = plan[:max_shards]
    eos = set(tok.eos_token_ids)
    done = 0
    for n, group in enumerate(plan):
        path = out / f"shard-{n:05d}.npz"
        if not path.is_file():
            exs = []
            if items[group[0][0]].kind == "prompt":
                res = generate_batch(loaded.model, [ids for _, ids in group], max_new, topk, eos,
                                     samples=samples, temperature=sample_temperature, seed=n)
                rows = [(i, ids) for i, ids in group for _ in range(samples)]
                for (i, ids), (g, ti, tl) in zip(rows, res, strict=True):
                    exs.append(Example(np.array(ids + g, np.int32), len(ids), ti, tl, items[i].domain))
            else:
                for i, ids in group:
                    ti, tl = score_text(loaded.model, ids, topk)
                    exs.append(Example(np.array(ids, np.int32), 1, ti, tl, items[i].domain))
            _save_shard(path, exs)
        done += len(group)
        if progress:
            progress(done, sum(len(g) for g in plan))
    (out / "complete").write_text(str(len(plan)))
    return out


def load_dataset(folder: str | Path) -> tuple[dict, list[Example]]:
    """(meta, examples) of a finished build, in shard order."""
    folder = Path(folder)
    if not (folder / "meta.json").is_file() or not (folder / "complete").is_file():
        raise ValueError(f"{folder}: not a finished distillation data folder (run the data stage first)")
    meta = json.loads((folder / "meta.json").read_text())
    n = int((folder / "complete").read_text())
    examples: list[Example] = []
    for i in range(n):
        examples += _load_shard(folder / f"shard-{i:05d}.npz")
    return meta, examples
