"""Speculation on recurrent layers: what checkpointing costs, and whether it still pays.

Two ratios on a random hybrid Qwen3.5 (Gated DeltaNet + gated attention, 3:1) built with
transformers, measured side by side in one run:

1. Checkpointing overhead per verified token: a verify pass of K+1 positions followed by
   a rollback to a half-accepted draft (recomputing the recurrent state of the kept
   positions, edgespec.caches.recurrent), against the same pass with no rollback; and a tree pass
   (per-branch states) against a chain pass of the same size.
2. Speculative decoding with drafts rejected about half the time vs plain decoding: an
   oracle drafter that knows plain decoding's continuation and corrupts each proposal with
   the probability that makes the expected acceptance rate 50% for K drafts (drafting
   costs nothing: the ratio isolates the verifier's side, rollbacks included).

    python benchmarks/recurrent.py [--hidden 512] [--layers 8] [--tokens 96] [--k 4]

Figures are indicative: this machine's CPUs are shared.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from edgespec.drafters.base import DrafterCaps


def build(folder: Path, hidden: int, layers: int, vocab: int):
    import torch
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        linear_num_key_heads=hidden // 128, linear_num_value_heads=hidden // 64, linear_key_head_dim=64,
        linear_value_head_dim=64, initializer_range=0.05)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_architectures import vocab_tokenizer

    vocab_tokenizer(vocab).save(folder)


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def side_by_side(fns, reps: int) -> list[float]:
    """Fastest of `reps` runs of each, interleaved so load hits every one alike. A function
    returning a number reports its own time (a decode without its prompt's prefill)."""
    out = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            own = fn()
            dt = time.perf_counter() - t0
            out[i] = min(out[i], own if isinstance(own, float) else dt)
    return out


class OracleDrafter:
    """Proposes plain decoding's continuation, each token replaced by a wrong one with
    probability `p_wrong` (point-mass proposals; drafting costs nothing)."""

    name, device = "oracle", "none"
    caps = DrafterCaps(syncs=False, runs_on="host")  # accept() only
    model, expected_acceptance = None, 0.5

    def __init__(self, truth: list[int], vocab: int, p_wrong: float, seed: int = 0):
        self.truth, self.vocab_size, self.p = truth, vocab, p_wrong
        self.rng = random.Random(seed)

    def begin(self, prompt):
        self.seq, self._last = list(prompt), []

    def draft(self, k, sampler):
        from edgespec.drafters.base import Draft

        i = len(self.seq)
        out = []
        for j in range(k):
            t = self.truth[i + j] if i + j < len(self.truth) else 1
            out.append((t + 1) % self.vocab_size if self.rng.random() < self.p else t)
        self._last = out
        return Draft(out, None)

    def accept(self, n, nxt):
        self.seq += self._last[:n] + [int(nxt)]
        self._last = []

    def close(self):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--acceptance", type=float, default=0.5, help="target acceptance rate of the drafts")
    a = ap.parse_args()

    import edgespec
    from edgespec.generate import GenerationStats, PlainMode, prefill
    from edgespec.kernels import commit_kv, tree_mask
    from edgespec.logits.sampling import Sampler, SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    folder = Path(tempfile.mkdtemp(prefix="edgespec-recurrent-"))
    build(folder, a.hidden, a.layers, a.vocab)
    model = edgespec.load(folder, drafter="none", progress=False, history="off").model
    rng = random.Random(1)
    prompt = [rng.randrange(1, a.vocab) for _ in range(200)]
    K = a.k

    # ---- 1. checkpointing overhead per verified token
    cache = model.make_cache()
    prefill(model, cache, prompt)
    x = mx.array([prompt[: K + 1]])

    def verify(rollback: int):
        def run():
            out = model(x, cache)
            mx.eval(out)
            for c in cache:
                c.trim(rollback)
            mx.eval([arr for c in cache for arr in (c.arrays() if hasattr(c, "arrays") else [])])
            for c in cache:  # back to the prompt for the next repeat
                c.trim(K + 1 - rollback)
        return run

    half = (K + 1) // 2
    for _ in range(2):
        verify(K + 1)()
    # every position kept (nothing to recompute) vs `half` kept (recomputed from the checkpoint)
    t_free, t_half = side_by_side([verify(0), verify(K + 1 - half)], a.reps)
    T = 12
    parents = [-1] + [0, 1, 2, 3, 0, 5, 6, 0, 8, 9, 10]  # three branches of the root
    xt = mx.array([prompt[:T]])
    mask, pos = tree_mask(mx.array(parents, dtype=mx.int32), len(prompt))

    def chain_pass():
        mx.eval(model(xt, cache))
        for c in cache:
            c.trim(T)

    def tree_pass():
        mx.eval(model(xt, cache, mask=mask, positions=pos))
        commit_kv(cache, len(prompt), [0, 5, 6, 7])
        mx.eval([arr for c in cache for arr in (c.arrays() if hasattr(c, "arrays") else [])])
        for c in cache:
            c.trim(4)

    chain_pass(), tree_pass()
    t_chain, t_tree = side_by_side([chain_pass, tree_pass], a.reps)

    # ---- 2. speculative decoding, drafts rejected about half the time, vs plain
    sampler = Sampler(SamplingParams(temperature=0.0))

    def plain_tokens(st):
        steps = PlainMode(model).steps(prompt, sampler, st)
        out = [next(steps).id for _ in range(a.tokens)]
        steps.close()
        return out

    def plain_run():
        st = GenerationStats()
        t0 = time.perf_counter()
        plain_tokens(st)
        return time.perf_counter() - t0 - st.prefill_s  # decode only

    truth = prompt + plain_tokens(GenerationStats())
    stats = GenerationStats()

    def spec_run():
        mode = SpeculativeMode(model, OracleDrafter(truth, a.vocab, p_wrong), GenerateOptions(draft_tokens=K))
        st = GenerationStats()
        t0 = time.perf_counter()
        steps = mode.steps(prompt, sampler, st)
        out = [next(steps).id for _ in range(a.tokens)]
        steps.close()
        dt = time.perf_counter() - t0 - st.prefill_s
        stats.__dict__.update(st.__dict__)
        assert out == truth[len(prompt):], "speculative output differs from plain"
        return dt

    # per-token survival q with (q + q^2 + ... + q^K) / K = target acceptance
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**j for j in range(1, K + 1)) / K < a.acceptance else (lo, q)
    p_wrong = 1 - q
    t_plain, t_spec = side_by_side([plain_run, spec_run], 3)

    print(f"model: qwen3_5_text hidden {a.hidden}, {a.layers} layers (3 Gated DeltaNet : 1 attention), "
          f"vocab {a.vocab}; prompt {len(prompt)}; indicative figures (shared CPU)")
    print(f"verify pass of {K + 1}, all kept (no recompute)             : {t_free * 1e3:7.2f} ms")
    print(f"verify pass of {K + 1}, {K + 1 - half} rejected (state recomputed) : {t_half * 1e3:7.2f} ms  "
          f"ratio {t_half / t_free:.3f}, overhead {(t_half - t_free) / (K + 1) * 1e3:.3f} ms per verified token")
    print(f"tree pass of {T} nodes (per-branch states) vs chain pass : {t_tree * 1e3:7.2f} vs {t_chain * 1e3:7.2f} ms"
          f"  ratio {t_tree / t_chain:.3f}")
    print(f"speculative K={K}, each draft wrong with p={p_wrong:.2f}, acceptance {stats.acceptance_rate:.0%}, {a.tokens / stats.verifier_passes:.2f} tokens/pass: "
          f"{a.tokens / t_spec:.1f} tok/s vs plain {a.tokens / t_plain:.1f} tok/s = {t_plain / t_spec:.2f}x (decode, "
          "prefill excluded)")


if __name__ == "__main__":
    main()
