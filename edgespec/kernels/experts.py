"""The mixture-of-experts MLP of a decoding step or a verify pass (few tokens) on Metal.

For N tokens, each routed to k of X experts (indices (N, k)), SwitchGLU computes per token
and chosen expert e: y = W_down[e] (act(W_gate[e] x) * W_up[e] x). MLX runs it as three
`gather_mm` (or `gather_qmm`) calls and an element-wise activation, so the gate and up
outputs each go to memory, are read back for the activation, whose result goes to memory
again. With few tokens every product is a matrix-vector product bound by reading the k
experts' weight rows; the two kernels here read each row once and keep the rest in
registers:

- EXPERT_GATE_UP, grid (F, k, N): one thread per (expert-width feature f, slot j, token n)
  reads row f of the gate and up weights of expert indices[n, j] against x[n], and writes
  act(gate) * up: h (N, k, F) float32 (gate and up never hit memory);
- EXPERT_DOWN, grid (E, k, N): one thread per (hidden feature, slot, token) reads row e of
  the down weights against h[n, j]: y (N, k, E).

Each has a quantized variant (`*_Q`) on MLX's affine quantization at 2, 4 or 8 bits (groups
of `group` inputs, w = scale * q + bias, 32 / bits values q per uint32, low bits first) that
dequantizes as it reads, using sum_i x_i (s q_i + b) = s (x . q) + b sum_i x_i per group.

Activations: 0 SiLU (g / (1 + e^-g)), 1 GELU's tanh approximation (gelu_pytorch_tanh).
A token's result depends on its own row only (no reduction across tokens or threads), so a
decoding step and a verify pass compute the same numbers for the same token: speculation
stays exact where both take the kernel (SwitchGLU takes it for up to MAX_TOKENS tokens).

The threads of one expert row read it serially; on a GPU, neighbouring threads read
neighbouring rows (cache lines shared over the loop, not coalesced per load). Its speed on
Apple GPUs is unmeasured (no Mac here): the tests check the numbers only.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edgespec.kernels.spec import KernelSpec, compare, dtype_name, metal, prologue, usable

MAX_TOKENS = 16  # SwitchGLU takes the kernels on Metal for up to this many tokens
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
QUANT_BITS = (2, 4, 8)  # affine widths whose values do not straddle uint32 words

_ACT = """
    float a;
    if (act == 0) {
        a = gsum / (1.0f + exp(-gsum));
    } else {
        float c = clamp(0.7978845608028654f * (gsum + 0.044715f * gsum * gsum * gsum), -20.0f, 20.0f);
        a = 0.5f * gsum * (1.0f + tanh(c));
    }
    h[((size_t(n) * size_t(K) + size_t(j)) * size_t(F)) + size_t(f)] = a * usum;
"""

_HEAD = """
    uint f = thread_position_in_grid.x;
    uint j = thread_position_in_grid.y;
    uint n = thread_position_in_grid.z;
    int N = dims[0];
    int K = dims[1];
    int E = dims[2];
    int F = dims[3];
    int act = dims[4];
    if (int(f) >= F || int(j) >= K || int(n) >= N) {
        return;
    }
    size_t e = size_t(indices[size_t(n) * size_t(K) + size_t(j)]);
    size_t xb = size_t(n) * size_t(E);  // token n's row of x
"""

# dims = [N, k, E, F, act]
EXPERT_GATE_UP = KernelSpec(
    name="edgespec_expert_gate_up",
    inputs=("x", "indices", "w_gate", "w_up", "dims"),
    outputs=("h",),
    source=_HEAD
    + """
    size_t row = (e * size_t(F) + size_t(f)) * size_t(E);
    float gsum = 0.0f;
    float usum = 0.0f;
    for (int i = 0; i < E; ++i) {
        float xi = float(x[xb + size_t(i)]);
        gsum += xi * float(w_gate[row + size_t(i)]);
        usum += xi * float(w_up[row + size_t(i)]);
    }
"""
    + _ACT,
)

# dims = [N, k, E, F]
EXPERT_DOWN = KernelSpec(
    name="edgespec_expert_down",
    inputs=("h", "indices", "w_down", "dims"),
    outputs=("y",),
    source=prologue("d j n", "N K E F") + """
    if (int(d) >= E || int(j) >= K || int(n) >= N) {
        return;
    }
    size_t nj = size_t(n) * size_t(K) + size_t(j);
    size_t row = (size_t(indices[nj]) * size_t(E) + size_t(d)) * size_t(F);
    size_t hb = nj * size_t(F);  // h's row of (token, slot)
    float acc = 0.0f;
    for (int i = 0; i < F; ++i) {
        acc += h[hb + size_t(i)] * float(w_down[row + size_t(i)]);
    }
    y[nj * size_t(E) + size_t(d)] = acc;
""",
)

# Affine 2-, 4- or 8-bit: a row of `cols` inputs is cols * bits / 32 uint32 words (PER = 32 / bits
# values each, low bits first) and cols / G scales and biases. Adds to `acc` the row's product
# with a vector, `vec` + "i]" its i-th entry.
def _quant_dot(acc: str, w: str, scales: str, biases: str, vec: str, cols: str, row: str) -> str:
    return f"""
    for (int grp = 0; grp < {cols} / G; ++grp) {{
        float s = float({scales}[{row} * size_t({cols} / G) + size_t(grp)]);
        float bias = float({biases}[{row} * size_t({cols} / G) + size_t(grp)]);
        float qdot = 0.0f;
        float total = 0.0f;
        for (int wd = 0; wd < G / PER; ++wd) {{
            int i0 = grp * G + wd * PER;
            uint word = {w}[{row} * size_t({cols} / PER) + size_t(i0 / PER)];
            for (int b = 0; b < PER; ++b) {{
                float xi = float({vec}size_t(i0 + b)]);
                qdot += xi * float((word >> (BITS * b)) & MASK);
                total += xi;
            }}
        }}
        {acc} += s * qdot + bias * total;
    }}
"""


# dims = [N, k, E, F, act, group, bits]
EXPERT_GATE_UP_Q = KernelSpec(
    name="edgespec_expert_gate_up_q",
    inputs=("x", "indices", "w_gate", "s_gate", "b_gate", "w_up", "s_up", "b_up", "dims"),
    outputs=("h",),
    source=_HEAD
    + """
    int G = dims[5];
    int BITS = dims[6];
    int PER = 32 / BITS;
    uint MASK = (1u << BITS) - 1u;
    size_t row = e * size_t(F) + size_t(f);
    float gsum = 0.0f;
    float usum = 0.0f;
"""
    + _quant_dot("gsum", "w_gate", "s_gate", "b_gate", "x[xb + ", "E", "row")
    + _quant_dot("usum", "w_up", "s_up", "b_up", "x[xb + ", "E", "row")
    + _ACT,
)

# dims = [N, k, E, F, group, bits]
EXPERT_DOWN_Q = KernelSpec(
    name="edgespec_expert_down_q",
    inputs=("h", "indices", "w_down", "s_down", "b_down", "dims"),
    outputs=("y",),
    source=prologue("d j n", "N K E F G BITS") + """
    int PER = 32 / BITS;
    uint MASK = (1u << BITS) - 1u;
    if (int(d) >= E || int(j) >= K || int(n) >= N) {
        return;
    }
    size_t nj = size_t(n) * size_t(K) + size_t(j);
    size_t row = size_t(indices[nj]) * size_t(E) + size_t(d);
    size_t hb = nj * size_t(F);  // h's row of (token, slot)
    float acc = 0.0f;
"""
    + _quant_dot("acc", "w_down", "s_down", "b_down", "h[hb + ", "F", "row")
    + """
    y[nj * size_t(E) + size_t(d)] = acc;
""",
)


def expert_glu_reference(x, indices, gate, up, down, activation: str) -> mx.array:
    """MLX's composition (SwitchGLU's unsorted path): x (N, E), indices (N, k), each projection
    a dict with `weight` (X, out, in) and, quantized, `scales`, `biases`, `group_size`, `bits`
    -> (N, k, E)."""
    xs = x[:, None, None, :]  # (N, 1, 1, E): one row shared by the k experts

    def proj(p, h):
        if "scales" in p:
            return mx.gather_qmm(h, p["weight"], p["scales"], p["biases"], rhs_indices=indices, transpose=True,
                                 group_size=p["group_size"], bits=p["bits"])
        return mx.gather_mm(h, p["weight"].swapaxes(-1, -2), rhs_indices=indices)

    act = {"silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx}[activation]
    return proj(down, act(proj(gate, xs)) * proj(up, xs))[:, :, 0]


def kernel_applies(indices, gate, up, down, activation: str) -> bool:
    """Whether the kernels compute this call (a few tokens; dense, or affine 2/4/8-bit weights alike)."""
    N = indices.size // indices.shape[-1] if indices.ndim else 0
    if activation not in ACTIVATIONS or not 0 < N <= MAX_TOKENS:
        return False
    quant = ["scales" in p for p in (gate, up, down)]
    if not any(quant):
        return True
    return all(quant) and all(p.get("bits") in QUANT_BITS and p.get("mode", "affine") == "affine"
                              and p.get("biases") is not None and p["group_size"] % (32 // p["bits"]) == 0
                              and p["bits"] == gate["bits"] and p["group_size"] == gate["group_size"]
                              for p in (gate, up, down))


def launch_args(x, indices, gate, up, down, activation: str):
    """Per kernel: (spec, inputs, grid, output shapes, output dtypes). The same inputs in the same
    order go to Metal and to the C++ emulation; arrays are whatever library `x` comes from."""
    lib = mx if isinstance(x, mx.array) else np
    N, K = indices.shape
    E, F = x.shape[-1], gate["weight"].shape[1]
    act = ACTIVATIONS[activation]
    idx = indices.astype(lib.int32)
    if "scales" in gate:
        G, bits = gate["group_size"], gate["bits"]
        up_args = [x, idx, *(p[n] for p in (gate, up) for n in ("weight", "scales", "biases"))]
        first = (EXPERT_GATE_UP_Q, up_args + [lib.array([N, K, E, F, act, G, bits], dtype=lib.int32)])
        second = (EXPERT_DOWN_Q, [idx, down["weight"], down["scales"], down["biases"],
                                  lib.array([N, K, E, F, G, bits], dtype=lib.int32)])
    else:
        first = (EXPERT_GATE_UP, [x, idx, gate["weight"], up["weight"], lib.array([N, K, E, F, act], dtype=lib.int32)])
        second = (EXPERT_DOWN, [idx, down["weight"], lib.array([N, K, E, F], dtype=lib.int32)])
    return [(*first, (F, K, N), (N, K, F)), (*second, (E, K, N), (N, K, E))]


def expert_glu_metal(x, indices, gate, up, down, activation: str) -> mx.array:
    """Both kernels on an Apple GPU (the call is one kernel_applies took). They are checked as a
    pair, under the first one's name, per (activation dtype, weight format); a pair that failed
    its self-check gives expert_glu_reference's results."""
    quant = "scales" in gate
    traits = (x.dtype, gate["weight"].dtype if not quant else gate["scales"].dtype,
              gate["group_size"] if quant else 0, gate["bits"] if quant else 0)
    fmt = f"q{traits[3]}/{traits[2]} " if quant else ""
    variant = f"{dtype_name(traits[0])} {fmt}{dtype_name(traits[1])}"
    if not usable(EXPERT_GATE_UP_Q if quant else EXPERT_GATE_UP, variant, _check, *traits):
        return expert_glu_reference(x, indices, gate, up, down, activation)
    return _expert_glu_kernels(x, indices, gate, up, down, activation)


def _check(x_dtype, w_dtype, group: int, bits: int) -> None:
    """The self-check: 3 tokens over 4 experts (2 each, one expert chosen twice), both
    activations, against MLX's composition in float32 (the kernels accumulate in float32)."""
    rng = np.random.default_rng(0)
    E = F = max(64, 2 * group)
    x = mx.array(rng.standard_normal((3, E)).astype(np.float32)).astype(x_dtype)
    indices = mx.array([[0, 3], [2, 2], [1, 0]], dtype=mx.uint32)

    def proj(rows, cols):
        w = mx.array(rng.standard_normal((4, rows, cols)).astype(np.float32) * np.float32(cols ** -0.5))
        if not bits:
            return {"weight": w.astype(w_dtype)}
        wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        return {"weight": wq, "scales": scales.astype(w_dtype), "biases": biases.astype(w_dtype),
                "group_size": group, "bits": bits}

    gate, up, down = proj(F, E), proj(F, E), proj(E, F)
    as32 = [{k: (v.astype(mx.float32) if k in ("scales", "biases") or (k == "weight" and not bits) else v)
             for k, v in p.items()} for p in (gate, up, down)]
    for activation in ACTIVATIONS:
        got = _expert_glu_kernels(x, indices, gate, up, down, activation)
        want = expert_glu_reference(x.astype(mx.float32), indices, *as32, activation)
        compare(f"experts ({activation})", got, want.astype(got.dtype), tol=1e-4 if got.dtype == mx.float32 else 2e-2)


def _expert_glu_kernels(x, indices, gate, up, down, activation: str) -> mx.array:
    (s1, in1, grid1, shape1), (s2, in2, grid2, shape2) = launch_args(x, indices, gate, up, down, activation)
    (h,) = metal(s1)(inputs=in1, grid=grid1, threadgroup=(min(grid1[0], 64), 1, 1), output_shapes=[shape1],
                     output_dtypes=[mx.float32])
    (y,) = metal(s2)(inputs=[h, *in2], grid=grid2, threadgroup=(min(grid2[0], 64), 1, 1), output_shapes=[shape2],
                     output_dtypes=[mx.float32])  # float32 out: the source needs no half/bfloat type names
    return y if x.dtype == mx.float32 else y.astype(x.dtype)
