"""The gated delta rule's recurrent form (Gated DeltaNet decode and verify passes) on Metal.

Per position t, for each (batch b, value head h) with state S (Dk, Dv), float32:

    S <- exp(g_t) S;  delta = beta_t (v_t - k_t^T S);  S <- S + k_t delta^T;  out_t = q_t^T S

(edgespec.caches.recurrent.delta_step / delta_recurrent are the reference). Every column of S
evolves on its own (the update reads only that column), so the kernel runs one thread per
(Dv column, value head, batch) -- grid (Dv, Hv, B) -- holding its Dk-column in registers
across the pass: S is read once and written once per pass, whatever its length, and no
thread reads what another writes.

Tree passes (`parents`, each position starting from its parent's state): a node whose
parent is the previous position continues from the registers; a node whose parent is
earlier reloads that parent's column from `scratch`, where the kernel saved it, and a node
whose parent is -1 reloads the state before the pass. Only positions that are the parent of
some node other than the next one are saved (`tree_slots`), so `scratch` holds at most
T - 1 states ((B, Hv, slots, Dk, Dv) floats; nothing for a chain).

q and k may have fewer heads than v (Hk dividing Hv; value head h reads key head
h // (Hv / Hk), the grouping of Qwen3.5's `mx.repeat(..., Hv // Hk, axis=2)`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import mlx.core as mx
import numpy as np

from edgespec.kernels.delta_reference import delta_recurrent
from edgespec.kernels.spec import KernelSpec, compare, metal, prologue, usable

DK_MAX = 256  # the per-thread column lives in a private array of up to this many floats

# Grid (Dv, Hv, B). dims = [B, T, Hv, Hk, Dk, Dv, slots].
DELTA_RULE = KernelSpec(
    name="edgespec_gated_delta",
    inputs=("q", "k", "v", "g", "beta", "state_in", "parents", "slots", "dims"),
    outputs=("out", "state_out", "scratch"),
    header=f"#define EDGESPEC_DK_MAX {DK_MAX}\n",
    source=prologue("col h b", "B T H Hk Dk Dv nslots") + """
    if (int(col) >= Dv || int(h) >= H || int(b) >= B) {
        return;
    }
    uint hk = h / uint(H / Hk);
    size_t bh = size_t(b) * size_t(H) + size_t(h);
    size_t state_base = bh * size_t(Dk) * size_t(Dv) + size_t(col);
    thread float s[EDGESPEC_DK_MAX];
    for (int i = 0; i < Dk; ++i) {
        s[i] = state_in[state_base + size_t(i) * size_t(Dv)];
    }
    for (int t = 0; t < T; ++t) {
        int p = parents[t];
        if (p != t - 1) {
            if (p < 0) {
                for (int i = 0; i < Dk; ++i) {
                    s[i] = state_in[state_base + size_t(i) * size_t(Dv)];
                }
            } else {
                size_t from = (bh * size_t(nslots) + size_t(slots[p])) * size_t(Dk) * size_t(Dv) + size_t(col);
                for (int i = 0; i < Dk; ++i) {
                    s[i] = scratch[from + size_t(i) * size_t(Dv)];
                }
            }
        }
        size_t bth = (size_t(b) * size_t(T) + size_t(t)) * size_t(H) + size_t(h);
        size_t btk = ((size_t(b) * size_t(T) + size_t(t)) * size_t(Hk) + size_t(hk)) * size_t(Dk);
        float decay = exp(g[bth]);
        float mem = 0.0f;
        for (int i = 0; i < Dk; ++i) {
            s[i] = s[i] * decay;
            mem += k[btk + size_t(i)] * s[i];
        }
        float delta = (v[bth * size_t(Dv) + size_t(col)] - mem) * beta[bth];
        float o = 0.0f;
        for (int i = 0; i < Dk; ++i) {
            s[i] = s[i] + k[btk + size_t(i)] * delta;
            o += q[btk + size_t(i)] * s[i];
        }
        out[bth * size_t(Dv) + size_t(col)] = o;
        if (slots[t] >= 0) {
            size_t to = (bh * size_t(nslots) + size_t(slots[t])) * size_t(Dk) * size_t(Dv) + size_t(col);
            for (int i = 0; i < Dk; ++i) {
                scratch[to + size_t(i) * size_t(Dv)] = s[i];
            }
        }
    }
    for (int i = 0; i < Dk; ++i) {
        state_out[state_base + size_t(i) * size_t(Dv)] = s[i];
    }
""",
)


@functools.cache
def delta_spec(dk: int) -> KernelSpec:
    """DELTA_RULE with its private column sized for key heads of `dk` (rounded up to a multiple
    of 32): a 256-float array where 128 are used would spill registers for nothing. The source
    is the same string; only the header's size differs."""
    if not 0 < dk <= DK_MAX:
        raise ValueError(f"gated delta rule kernel: key head size {dk} is not in 1..{DK_MAX}")
    size = -(-dk // 32) * 32
    return replace(DELTA_RULE, name=f"{DELTA_RULE.name}_{size}", header=f"#define EDGESPEC_DK_MAX {size}\n")


def tree_slots(parents: list[int] | None, T: int) -> tuple[list[int], list[int], int]:
    """(parents as a list, each position's scratch slot or -1, the slot count) for a pass of T.

    A chain (None) needs no slot; in a tree, position t gets one only if some node other
    than t + 1 starts from it (the next position continues from the registers)."""
    if parents is None:
        return list(range(-1, T - 1)), [-1] * T, 0
    if len(parents) != T or any(not -1 <= p < t for t, p in enumerate(parents)):
        raise ValueError(f"gated delta rule: parents must list, for each of the {T} positions, an earlier "
                         f"position or -1; got {parents}")
    saved = sorted({p for t, p in enumerate(parents) if p >= 0 and p != t - 1})
    slot = {p: i for i, p in enumerate(saved)}
    return list(parents), [slot.get(t, -1) for t in range(T)], len(saved)


def delta_rule_metal(q, k, v, g, beta, S, parents: list[int] | None = None):
    """The kernel on an Apple GPU; arguments and results as edgespec.caches.recurrent.delta_rule.
    A kernel that failed its self-check (for this key head size) gives the reference's results."""
    spec = delta_spec(k.shape[3])
    if not usable(spec, "float32", _check, k.shape[3]):
        H, Hk = v.shape[2], k.shape[2]
        if Hk != H:
            q, k = mx.repeat(q, H // Hk, axis=2), mx.repeat(k, H // Hk, axis=2)
        f32 = [a.astype(mx.float32) for a in (q, k, v, g, beta, S)]
        return delta_recurrent(*f32, parents)
    return _delta_rule_kernel(q, k, v, g, beta, S, parents)


def _check(dk: int) -> None:
    """The self-check at key head size `dk`: a chain and a tree pass with grouped heads against
    the reference (within float32 rounding: the reference's products sum in another order)."""
    rng = np.random.default_rng(0)
    B, T, H, Hk, Dv = 1, 4, 2, 1, 8

    def arr(*shape, scale=1.0):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))

    q, k = arr(B, T, Hk, dk, scale=dk ** -0.5), arr(B, T, Hk, dk, scale=dk ** -0.5)
    v, S = arr(B, T, H, Dv), arr(B, H, dk, Dv, scale=0.1)
    g = mx.array(-rng.random((B, T, H)).astype(np.float32))
    beta = mx.array(rng.random((B, T, H)).astype(np.float32))
    qr, kr = mx.repeat(q, H // Hk, axis=2), mx.repeat(k, H // Hk, axis=2)
    for parents in (None, [-1, 0, 0, 2]):
        got, want = _delta_rule_kernel(q, k, v, g, beta, S, parents), delta_recurrent(qr, kr, v, g, beta, S, parents)
        compare("gated delta rule output", got[0], want[0], tol=1e-4)
        compare("gated delta rule state", got[1], want[1], tol=1e-4)


def _delta_rule_kernel(q, k, v, g, beta, S, parents: list[int] | None = None):
    B, T, H, Dv = v.shape
    Hk, Dk = k.shape[2], k.shape[3]
    par, slots, n = tree_slots(parents, T)
    dims = mx.array([B, T, H, Hk, Dk, Dv, n], dtype=mx.int32)
    f32 = [a.astype(mx.float32) for a in (q, k, v, g, beta, S)]
    out, state, _ = metal(delta_spec(Dk))(
        inputs=[*f32, mx.array(par, dtype=mx.int32), mx.array(slots, dtype=mx.int32), dims],
        grid=(Dv, H, B),
        threadgroup=(min(Dv, 64), 1, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dk, Dv), (B * H * n * Dk * Dv,) if n else (1,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return out, state


def emulator_inputs(q, k, v, g, beta, S, parents: list[int] | None = None):
    """(inputs, grid, output shapes) of one call of DELTA_RULE, as numpy arrays (the tests'
    driver for the C++ emulation; the same layout delta_rule_metal passes)."""
    B, T, H, Dv = v.shape
    Hk, Dk = k.shape[2], k.shape[3]
    par, slots, n = tree_slots(parents, T)
    arrs = [np.asarray(a, dtype=np.float32) for a in (q, k, v, g, beta, S)]
    ints = [np.array(par, np.int32), np.array(slots, np.int32), np.array([B, T, H, Hk, Dk, Dv, n], np.int32)]
    shapes = [(B, T, H, Dv), (B, H, Dk, Dv), (B * H * n * Dk * Dv,) if n else (1,)]
    return arrs + ints, (Dv, H, B), shapes
