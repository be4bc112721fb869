"""The MoE experts' product (models/experts.py) on MLX's gathered matmuls against straightforward
MLX compositions, side by side in one process, CPU device.

    LD_PRELOAD=$(make -s preload) .venv/bin/python benchmarks/moe_gather.py [--reps 7]

One sparse layer's experts (SwitchGLU: gate, up, down) of Qwen3-30B-A3B's shape by default
(hidden 2048, expert width 768, 128 experts, 8 active; --small for a quarter of each size),
for N = 1, 4, 16 and 128 tokens (a decoding step, verification rounds, a prompt chunk):
- gather_mm: `mx.gather_mm` over the tokens' k expert indices, unsorted (what edgespec runs for a decoding step);
- sorted: the same with the (token, expert) pairs sorted by expert first (`sorted_indices`; what
  edgespec runs from 64 pairs);
- take: the k experts' weights gathered per token (`w[idx]`, (N, k, out, in)) then a batched
  matmul, the obvious composition: it copies k weight matrices per token (skipped, nan, where
  those copies would pass 1 GB);
- loop: one matmul per expert that any token chose, over the rows that chose it (the
  reference implementation's loop), its outputs scattered back;
- 4-bit: the same layer quantized (groups of 64) as SwitchGLU runs it (`mx.gather_qmm`, sorted
  from 64 pairs), beside gather_mm.
Each kind's median ms a call, the kinds alternated rep by rep so a load spike hits them
alike; all kinds' outputs are checked against gather_mm's first. The machine is shared:
figures are indicative, ratios measured in one run are what to read.

Measured here (2 x86 cores shared with other work, --small --reps 9, ms; gather_mm / sorted /
take / loop / 4-bit): N=1: 3.23 / 3.44 / 3.56 / 6.70 / 4.47; N=4: 11.0 / 10.3 / 59.7 / 15.7 /
20.2; N=16: 39.4 / 29.6 / 237 / 316 / 59.0; N=128: 306 / 214 / 4571 / 1854 / 632. gather_mm
beats gathering the weights (1.1-15x) and the reference's loop (1.4-8x; one noisier 1-rep run
had the loop ahead at N=16 and 128); sorting by expert gained 25-30% from N=16 (and 7-20% in
a 5-rep run), nothing at N=1-4, so SwitchGLU sorts from 64 (token, expert) pairs
(models/experts.SORT_MIN). Indicative: the machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from edgespec.models.experts import SwitchGLU


def take_composition(layer: SwitchGLU, x: mx.array, idx: mx.array) -> mx.array:
    """(N, E), (N, k) -> (N, k, E): each token's k expert matrices gathered, then multiplied."""
    def proj(lin, h):  # h (N, k, in) -> (N, k, out)
        w = lin.weight[idx]  # (N, k, out, in)
        return (w @ h[..., None])[..., 0]

    h = mx.broadcast_to(x[:, None, :], (*idx.shape, x.shape[-1]))
    return proj(layer.down_proj, nn.silu(proj(layer.gate_proj, h)) * proj(layer.up_proj, h))


def unsorted_gather(layer: SwitchGLU, x: mx.array, idx: mx.array) -> mx.array:
    """gather_mm on the pairs as they come: (N, E), (N, k) -> (N, k, E)."""
    h = x[:, None, None, :]
    g, u = layer.gate_proj(h, idx), layer.up_proj(h, idx)
    return layer.down_proj(nn.silu(g) * u, idx)[:, :, 0]


def sorted_gather(layer: SwitchGLU, x: mx.array, idx: mx.array) -> mx.array:
    """gather_mm with the (token, expert) pairs sorted by expert (`sorted_indices=True`), unsorted after."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = mx.argsort(flat)
    rows = x[order // k][:, None, :]  # (N*k, 1, E)
    e = flat[order]

    def proj(lin, h):
        return mx.gather_mm(h, lin.weight.swapaxes(-1, -2), rhs_indices=e, sorted_indices=True)

    y = proj(layer.down_proj, nn.silu(proj(layer.gate_proj, rows)) * proj(layer.up_proj, rows))[:, 0]
    return y[mx.argsort(order)].reshape(N, k, -1)


def loop_composition(layer: SwitchGLU, x: mx.array, idx: np.ndarray) -> mx.array:
    """The reference's loop: per chosen expert, its rows through it; -> (N, k, E)."""
    N, k = idx.shape
    out = mx.zeros((N * k, x.shape[-1]), x.dtype)
    flat = idx.reshape(-1)
    for e in np.unique(flat):
        slots = np.nonzero(flat == e)[0]
        rows = x[mx.array(slots // k)]
        g = rows @ layer.gate_proj.weight[int(e)].T
        u = rows @ layer.up_proj.weight[int(e)].T
        out[mx.array(slots)] = (nn.silu(g) * u) @ layer.down_proj.weight[int(e)].T
    return out.reshape(N, k, -1)


def timed(fn, reps_out: list[float]) -> mx.array:
    t0 = time.perf_counter()
    y = fn()
    mx.eval(y)
    reps_out.append((time.perf_counter() - t0) * 1e3)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--small", action="store_true", help="a quarter of every size (a quick run)")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    E, F, X, K = (512, 192, 32, 8) if a.small else (2048, 768, 128, 8)
    mx.random.seed(0)
    layer = SwitchGLU(E, F, X, "silu")
    mx.eval(layer.parameters())
    q = SwitchGLU(E, F, X, "silu")
    q.update(layer.parameters())
    nn.quantize(q, group_size=64, bits=4)
    mx.eval(q.parameters())
    print(f"experts: hidden {E}, width {F}, {X} experts, {K} active; CPU; median ms of {a.reps} (first run dropped)")
    print(f"{'N':>5} {'gather_mm':>10} {'sorted':>10} {'take':>10} {'loop':>10} {'4-bit':>10}"
          "   sorted/gather take/gather loop/gather")
    for N in (1, 4, 16, 128):
        x = mx.random.normal((N, E))
        idx_np = np.stack([np.random.default_rng(N + i).choice(X, K, replace=False) for i in range(N)])
        idx = mx.array(idx_np.astype(np.int32))
        kinds = {
            "gather_mm": lambda x=x, idx=idx: unsorted_gather(layer, x, idx),
            "sorted": lambda x=x, idx=idx: sorted_gather(layer, x, idx),
            "take": lambda x=x, idx=idx: take_composition(layer, x, idx),
            "loop": lambda x=x, idx_np=idx_np: loop_composition(layer, x, idx_np),
            "4-bit": lambda x=x, idx=idx: q(x, idx),
        }
        if N * K * E * F * 4 > 1e9:  # the gathered weight copies alone would pass 1 GB
            kinds.pop("take")
        want = kinds["gather_mm"]()
        mx.eval(want)
        for name in [k for k in ("sorted", "take", "loop") if k in kinds]:
            got = kinds[name]()
            err = float(mx.abs(got - want).max() / mx.abs(want).max())
            assert err < 1e-4, f"{name} differs from gather_mm ({err:.1e})"
        times = {k: [] for k in kinds}
        for _ in range(a.reps + 1):
            for name, fn in kinds.items():
                timed(fn, times[name])
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        med.setdefault("take", float("nan"))
        g = med["gather_mm"]
        print(f"{N:>5} {g:>10.2f} {med['sorted']:>10.2f} {med['take']:>10.2f} {med['loop']:>10.2f} "
              f"{med['4-bit']:>10.2f}   {med['sorted'] / g:>12.2f}x {med['take'] / g:>10.2f}x {med['loop'] / g:>10.2f}x")


if __name__ == "__main__":
    main()
