"""The new hot spots on the CPU device, side by side in one run: the gated delta rule's recurrent
form and the MoE experts of a few tokens; plus the C++ emulation of their Metal kernels
(edgespec/kernels/delta.py, experts.py) checked against the MLX paths (correctness only: the
emulation runs GPU threads one after another, its speed means nothing).

    LD_PRELOAD=$(make -s preload) .venv/bin/python benchmarks/kernels_new.py [--reps 9] [--model]

1. Gated delta rule, one layer, B = 1, per pass of T positions (T = 1: a decoding step; 5:
   a verify pass of K = 4; 16, 32: long verify passes; chains, and a tree of three branches):
   - loop: edgespec.caches.recurrent.delta_recurrent, what the CPU runs (six MLX operations over
     the whole state per position);
   - compiled: the same step under mx.compile (MLX fuses the element-wise operations);
   - chunked: the chunked form (edgespec.caches.recurrent.delta_chunked) with one chunk of T: the
     composition prefill uses, matrix products instead of a loop (chains only; it rounds
     differently, so a decoding step and a verify pass would not agree bit for bit);
   - native: edgespec.kernels.cpu_delta (a C loop, two passes over each head's state per
     position, heads over the cores), which the CPU runs where recurrent.CPU_NATIVE is set.
   Two shapes: Qwen3.5's (16 key heads, 32 value heads, 128 x 128 states) and the small
   random model of benchmarks/recurrent.py (4 / 8 heads, 64 x 64).
2. With --model: plain decoding and speculative decoding (oracle drafts wrong half the time,
   K = 4) of benchmarks/recurrent.py's random hybrid Qwen3.5, recurrent.CPU_NATIVE off vs on,
   and plain decoding with MLX's loop behind the evaluation the native path forces per layer.
3. MoE experts (SwitchGLU, Qwen3-30B-A3B's shape / 4): gather_mm (what the CPU runs) vs the
   straightforward compositions of benchmarks/moe_gather.py (weights gathered per token; a
   loop over the chosen experts), N = 1, 4, 16 tokens; and where a sparse block's time goes
   (router, gate+up, activation, down, weighted sum), each part evaluated on its own.

Median ms of --reps calls (the first dropped), the kinds alternated call by call so a load
spike hits them alike. The machine is shared: read the ratios, not the absolute figures.
Figures measured here, and what they decided: docs/lookahead.md ("The gated delta rule and
the MoE experts").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def medians(kinds: dict, reps: int) -> dict[str, float]:
    times = {k: [] for k in kinds}
    for _ in range(reps + 1):
        for name, fn in kinds.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def delta_inputs(T, Hk, H, D, seed=0):
    r = np.random.default_rng(seed)
    q, k = (r.standard_normal((1, T, Hk, D)).astype(np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * D**0.5
    v = r.standard_normal((1, T, H, D)).astype(np.float32)
    g = -r.uniform(0.01, 1.0, (1, T, H)).astype(np.float32)
    beta = r.uniform(0.05, 1.0, (1, T, H)).astype(np.float32)
    S = (r.standard_normal((1, H, D, D)) * 0.1).astype(np.float32)
    return [mx.array(a) for a in (q, k, v, g, beta, S)]


def bench_delta(reps: int) -> None:
    from edgespec.caches.recurrent import delta_chunked, delta_recurrent, delta_step
    from edgespec.kernels import emulate
    from edgespec.kernels.cpu_delta import delta_rule_cpu
    from edgespec.kernels.delta import DELTA_RULE, emulator_inputs

    step = mx.compile(delta_step)

    def compiled(q, k, v, g, beta, S):
        outs = []
        for t in range(q.shape[1]):
            S = step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
            outs.append((q[:, t, :, None, :] @ S)[:, :, 0, :])
        return mx.stack(outs, axis=1), S

    emu = emulate.EmulatedKernel(DELTA_RULE, [np.float32] * 6 + [np.int32] * 3, [np.float32] * 3)
    print("1. gated delta rule, one layer, B=1: median ms per pass (ratio to the MLX loop); "
          "emu err: the Metal kernel's C++ emulation against the loop")
    print(f"{'shape':>22} {'T':>3} {'form':>5} {'loop':>8} {'compiled':>16} {'chunked':>16} {'native':>16} {'emu err':>8}")
    for Hk, H, D in ((16, 32, 128), (4, 8, 64)):
        for T in (1, 5, 16, 32):
            forms = [("chain", None)] + ([("tree", [-1] + [t - 1 if t % (T // 3) else 0 for t in range(1, T)])]
                                         if T >= 5 else [])
            for form, parents in forms:
                a = delta_inputs(T, Hk, H, D, seed=T)
                rep = [mx.repeat(x, H // Hk, axis=2) for x in a[:2]] + a[2:]
                mx.eval(a, rep)
                kinds = {"loop": lambda rep=rep, p=parents: delta_recurrent(*rep, parents=p),
                         "native": lambda a=a, p=parents: delta_rule_cpu(*a, parents=p)}
                if parents is None:
                    kinds["compiled"] = lambda rep=rep: compiled(*rep)
                    kinds["chunked"] = lambda rep=rep, T=T: delta_chunked(*rep, chunk=max(T, 2))
                want = kinds["loop"]()
                for name in kinds:
                    got = kinds[name]()
                    err = float(mx.abs(got[1] - want[1]).max())
                    assert err < 1e-4, f"{name} differs from the loop ({err:.1e})"
                ins, grid, shapes = emulator_inputs(*(np.array(x) for x in a), parents=parents)
                out, state, _ = emu(ins, grid, shapes, init=np.nan)
                emu_err = max(float(np.abs(out - np.array(want[0])).max()), float(np.abs(state - np.array(want[1])).max()))
                med = medians(kinds, reps)
                lo = med["loop"]

                def cell(name, lo=lo, med=med):
                    return f"{med[name]:7.2f} ({lo / med[name]:4.1f}x)" if name in med else f"{'-':>16}"

                print(f"{f'Hk{Hk} Hv{H} {D}x{D}':>22} {T:>3} {form:>5} {lo:>8.2f} {cell('compiled'):>16} "
                      f"{cell('chunked'):>16} {cell('native'):>16} {emu_err:>8.1e}")


def bench_model(reps: int) -> None:
    import random
    import tempfile

    import recurrent as rb

    import edgespec
    import edgespec.caches.recurrent as rec
    from edgespec.generate import GenerationStats, PlainMode
    from edgespec.logits.sampling import Sampler, SamplingParams
    from edgespec.modes.speculative import SpeculativeMode
    from edgespec.options import GenerateOptions

    folder = Path(tempfile.mkdtemp(prefix="edgespec-kernels-"))
    vocab, K, tokens = 2048, 4, 64
    rb.build(folder, 512, 8, vocab)
    model = edgespec.load(folder, drafter="none", progress=False, history="off").model
    rng = random.Random(1)
    prompt = [rng.randrange(1, vocab) for _ in range(200)]
    sampler = Sampler(SamplingParams(temperature=0.0))
    outputs = {}

    def plain(native: bool):
        def run():
            rec.CPU_NATIVE = native
            st = GenerationStats()
            t0 = time.perf_counter()
            steps = PlainMode(model).steps(prompt, sampler, st)
            out = [next(steps).id for _ in range(tokens)]
            steps.close()
            outputs[("plain", native)] = out
            return time.perf_counter() - t0 - st.prefill_s
        return run

    def spec(native: bool, truth, p_wrong):
        def run():
            rec.CPU_NATIVE = native
            mode = SpeculativeMode(model, rb.OracleDrafter(truth, vocab, p_wrong), GenerateOptions(draft_tokens=K))
            st = GenerationStats()
            t0 = time.perf_counter()
            steps = mode.steps(prompt, sampler, st)
            out = [next(steps).id for _ in range(tokens)]
            steps.close()
            outputs[("spec", native)] = out
            return time.perf_counter() - t0 - st.prefill_s
        return run

    lo, hi = 0.0, 1.0  # per-token survival q with (q + ... + q^K) / K = 1/2: half the drafts accepted
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**j for j in range(1, K + 1)) / K < 0.5 else (lo, q)
    p_wrong = 1 - q
    loop = rec.delta_recurrent

    def synced(*args, **kw):  # MLX's loop after the evaluation the native path forces
        mx.eval(args[:6])
        return loop(*args, **kw)

    def plain_synced():
        rec.delta_recurrent = synced
        try:
            return plain(False)()
        finally:
            rec.delta_recurrent = loop

    plain(False)()
    truth = prompt + outputs[("plain", False)]
    fns = [plain(False), plain(True), spec(False, truth, p_wrong), spec(True, truth, p_wrong), plain_synced]
    times = rb.side_by_side(fns, reps)
    rec.CPU_NATIVE = False
    same = all(outputs[(m, n)] == outputs[("plain", n)] for m in ("spec",) for n in (False, True))
    print(f"2. random hybrid Qwen3.5 (hidden 512, 8 layers, 6 Gated DeltaNet), {tokens} tokens, decode only, "
          f"best of {reps}: CPU_NATIVE off / on")
    print(f"   plain      : {tokens / times[0]:6.1f} / {tokens / times[1]:6.1f} tok/s = {times[0] / times[1]:.2f}x")
    print(f"   speculative: {tokens / times[2]:6.1f} / {tokens / times[3]:6.1f} tok/s = {times[2] / times[3]:.2f}x "
          f"(K={K}, drafts wrong with p={p_wrong:.2f}: about half accepted); speculative == plain in each: {same}")
    print(f"   plain, MLX's loop after a forced evaluation of its inputs (the native path's sync): "
          f"{tokens / times[4]:6.1f} tok/s = {times[0] / times[4]:.2f}x")


def bench_moe(reps: int) -> None:
    from edgespec.models.experts import SwitchGLU
    from moe_gather import loop_composition, take_composition, unsorted_gather

    import edgespec.kernels.experts as ke
    from edgespec.kernels import emulate

    E, F, X, K = 512, 192, 32, 8
    mx.random.seed(0)
    layer = SwitchGLU(E, F, X, "silu")
    mx.eval(layer.parameters())
    projs = [{"weight": np.array(p.weight)} for p in (layer.gate_proj, layer.up_proj, layer.down_proj)]
    print(f"3. MoE experts (hidden {E}, width {F}, {X} experts, {K} active): median ms (ratio to gather_mm); "
          "emu err: the Metal kernels' C++ emulation against gather_mm, relative")
    print(f"{'N':>4} {'gather_mm':>10} {'take':>16} {'loop':>16} {'emu err':>8}")
    compiled = {}
    for N in (1, 4, 16):
        x = mx.random.normal((N, E))
        idx_np = np.stack([np.random.default_rng(N + i).choice(X, K, replace=False) for i in range(N)]).astype(np.int32)
        idx = mx.array(idx_np)
        kinds = {"gather_mm": lambda x=x, idx=idx: unsorted_gather(layer, x, idx),
                 "take": lambda x=x, idx=idx: take_composition(layer, x, idx),
                 "loop": lambda x=x, idx_np=idx_np: loop_composition(layer, x, idx_np)}
        want = np.array(kinds["gather_mm"]())
        h = None
        for spec, ins, grid, shape in ke.launch_args(np.array(x), idx_np, *projs, "silu"):
            ins = ins if h is None else [h, *ins]
            key = spec.name
            if key not in compiled:
                compiled[key] = emulate.EmulatedKernel(spec, [a.dtype for a in ins], [np.float32])
            (h,) = compiled[key](ins, grid, [shape], init=np.nan)
        err = float(np.abs(h - want).max() / np.abs(want).max())
        med = medians(kinds, reps)
        g = med["gather_mm"]
        print(f"{N:>4} {g:>10.2f} {med['take']:>7.2f} ({med['take'] / g:4.1f}x) "
              f"{med['loop']:>7.2f} ({med['loop'] / g:4.1f}x) {err:>8.1e}")


def bench_moe_parts(reps: int) -> None:
    """Where a sparse MoE block's time goes for a few tokens (each part evaluated on its own)."""
    import mlx.nn as nn
    from edgespec.models.experts import SwitchGLU, top_k

    E, F, X, K = 512, 192, 32, 8
    mx.random.seed(1)
    layer = SwitchGLU(E, F, X, "silu")
    router = nn.Linear(E, X, bias=False)
    mx.eval(layer.parameters(), router.parameters())
    print("   the MoE block's parts, median ms: router (linear, softmax, top-k) | gate+up gather_mm | "
          "SiLU(gate)*up | down gather_mm | weighted sum")
    for N in (1, 4, 16):
        x = mx.random.normal((N, E))
        w, idx = top_k(mx.softmax(router(x), axis=-1), K)
        xs = x[:, None, None, :]
        g, u = layer.gate_proj(xs, idx), layer.up_proj(xs, idx)
        h = nn.silu(g) * u
        y = layer.down_proj(h, idx)[:, :, 0]
        mx.eval(w, idx, g, u, h, y)
        parts = {
            "router": lambda x=x: top_k(mx.softmax(router(x), axis=-1), K),
            "gate+up": lambda xs=xs, idx=idx: (layer.gate_proj(xs, idx), layer.up_proj(xs, idx)),
            "act": lambda g=g, u=u: nn.silu(g) * u,
            "down": lambda h=h, idx=idx: layer.down_proj(h, idx),
            "sum": lambda y=y, w=w: (y * w[..., None]).sum(axis=-2),
        }
        med = medians(parts, reps)
        total = sum(med.values())
        print(f"{N:>4} " + " | ".join(f"{k} {v:.3f} ({v / total:.0%})" for k, v in med.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--model", action="store_true", help="also decode with a random hybrid model (slower)")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    bench_delta(a.reps)
    if a.model:
        bench_model(max(3, a.reps // 3))
    bench_moe(a.reps)
    bench_moe_parts(a.reps)


if __name__ == "__main__":
    main()
