"""A verifier's weights in int8 and the native pass over them (cpu_q8.c), for drafting on the CPU.

A `Q8Model` holds a Llama-style model's products in int8 with one scale an output row
(`quantize_rows`: w ~ scale[o] * q[o, i], q in -127..127; the norms and the input embedding rows
stay float32), and `forward` runs new tokens through it, reading the keys and values of the
positions before them from the verifier's cache. edgespec.drafters.quantized builds one from a
verifier and drafts with it.

The library is built with the system's C compiler on first use into `$EDGESPEC_HOME/kernels/`
(edgespec.kernels.native: named by a hash of the source, flags and CPU, written atomically) and
checked against numpy (`reference_forward`) on a tiny random model before use; `library()` is
None where it cannot be built or fails the check (one warning).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.kernels import native

SOURCE = Path(__file__).with_name("cpu_q8.c")
# One pass at a time: the library's worker threads and activation buffer serve one caller.
_LOCK = threading.Lock()
P_N = 10  # pointers a layer (cpu_q8.c's P_ enum)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float -> (int8 (out, in), float32 scales (out,)): symmetric, one scale a row."""
    w = np.asarray(w, dtype=np.float32)
    top = np.abs(w).max(axis=1)
    scale = np.where(top > 0, top / 127.0, 1.0).astype(np.float32)
    q = np.rint(w / scale[:, None])
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8), scale


@dataclass
class Q8Layer:
    qkv: np.ndarray
    s_qkv: np.ndarray
    o: np.ndarray
    s_o: np.ndarray
    gu: np.ndarray
    s_gu: np.ndarray
    down: np.ndarray
    s_down: np.ndarray
    n1: np.ndarray
    n2: np.ndarray

    def arrays(self) -> tuple:
        return (self.qkv, self.s_qkv, self.o, self.s_o, self.gu, self.s_gu, self.down, self.s_down, self.n1, self.n2)


class Q8Model:
    """A Llama-style model's products in int8 (see the module notes): `layers` (one `Q8Layer`
    each: fused q|k|v, o, fused gate|up and down products with their row scales, and the two
    norms' weights), the output projection `head` (V, E) with its scales, the final norm's
    weight and the input embedding rows `embed` (V_in, E) float32. `dims`: hidden E, heads H,
    kv heads Hk, head size D, intermediate F; `rot` rotary dims, `traditional` RoPE layout."""

    def __init__(self, layers: list[Q8Layer], head: np.ndarray, s_head: np.ndarray, final_norm: np.ndarray,
                 embed: np.ndarray, *, dims: tuple[int, int, int, int, int], rot: int, traditional: bool,
                 eps: float, scale: float):
        self.E, self.H, self.Hk, self.D, self.F = (int(d) for d in dims)
        self.V, self.L = int(head.shape[0]), len(layers)
        self.rot, self.traditional, self.eps, self.scale = int(rot), bool(traditional), float(eps), float(scale)
        if self.H % self.Hk or self.rot % 2 or self.rot > self.D:
            raise ValueError(f"heads {self.H} / kv heads {self.Hk} / rotary dims {self.rot} of head size {self.D}")
        self.layers, self.head, self.s_head, self.final_norm = layers, head, s_head, final_norm
        self.embed = embed
        self.cfg = np.array([self.E, self.H, self.Hk, self.D, self.F, self.V, self.L, self.rot, int(self.traditional)],
                            np.int64)
        self.fcfg = np.array([self.eps, self.scale], np.float32)
        ptrs = [arr.ctypes.data for layer in layers for arr in layer.arrays()]
        self.ptrs = (ctypes.c_void_p * len(ptrs))(*ptrs)

    @property
    def nbytes(self) -> int:
        """Bytes of what it holds of its own: the int8 weights, scales and norms (the embedding
        rows are the model's when it holds them in float32)."""
        own = sum(arr.nbytes for layer in self.layers for arr in layer.arrays())
        return own + self.head.nbytes + self.s_head.nbytes + self.final_norm.nbytes

    def scratch(self, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of up to `positions` new positions a layer: (L, Hk, positions, D) each."""
        shape = (self.L, self.Hk, positions, self.D)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def forward(self, tokens: list[int], ctx: list[tuple[np.ndarray, np.ndarray]], n_ctx: int,
                scratch: tuple[np.ndarray, np.ndarray], n_scr: int, rope: tuple[np.ndarray, np.ndarray],
                out_rows: int = 1, lib=None) -> np.ndarray:
        """Logits (out_rows, V) of the last `out_rows` of `tokens`, fed at positions n_ctx + n_scr ..:
        ctx, per layer, the verifier cache's (keys, values), each (Hk, >= n_ctx, D) float32 with
        unit stride along D; scratch holds n_scr positions after them and takes the new ones.
        rope: cos and sin (T, rot/2) float32 of the new positions. lib: the library (default
        `library()`)."""
        lib = library() if lib is None else lib
        if lib is None:
            raise RuntimeError("the int8 drafting kernel is unavailable on this machine")
        T = len(tokens)
        sk, sv = scratch
        if n_scr + T > sk.shape[2]:
            raise ValueError(f"the scratch holds {sk.shape[2]} positions, {n_scr + T} asked")
        if len(ctx) != self.L:
            raise ValueError(f"{len(ctx)} caches for {self.L} layers")
        h = np.ascontiguousarray(self.embed[np.asarray(tokens, dtype=np.int64)], dtype=np.float32)
        cos, sin = (np.ascontiguousarray(r, dtype=np.float32) for r in rope)
        if cos.shape != (T, self.rot // 2) or sin.shape != cos.shape:
            raise ValueError(f"cos and sin must be ({T}, {self.rot // 2}), got {cos.shape} and {sin.shape}")
        kp = (ctypes.c_void_p * self.L)()
        vp = (ctypes.c_void_p * self.L)()
        hs = np.empty(self.L, np.int64)
        ps = np.empty(self.L, np.int64)
        for i, (k, v) in enumerate(ctx):
            if k.shape[-2] < n_ctx or k.strides != v.strides or k.strides[-1] != 4 or k.dtype != np.float32:
                raise ValueError("verifier keys and values must be float32 with unit stride along D")
            kp[i], vp[i] = k.ctypes.data, v.ctypes.data
            hs[i], ps[i] = k.strides[-3] // 4, k.strides[-2] // 4
        out = np.empty((min(out_rows, T), self.V), np.float32)
        with _LOCK:
            rc = lib.edgespec_q8_forward(self.cfg.ctypes.data, self.fcfg.ctypes.data, self.ptrs, self.head.ctypes.data,
                                         self.s_head.ctypes.data, self.final_norm.ctypes.data, h.ctypes.data, T, kp,
                                         vp, hs.ctypes.data, ps.ctypes.data, n_ctx, sk.ctypes.data, sv.ctypes.data,
                                         n_scr, sk.shape[2], cos.ctypes.data, sin.ctypes.data, out.ctypes.data,
                                         out.shape[0])
        if rc != 0:
            raise MemoryError("the int8 drafting kernel found no memory for its scratch")
        return out


def reference_forward(q: Q8Model, tokens: list[int], ctx, n_ctx: int, scratch, n_scr: int, rope) -> np.ndarray:
    """numpy's version of `Q8Model.forward` (float64 inside; out_rows = all), for checks and tests."""
    T, H, Hk, D = len(tokens), q.H, q.Hk, q.D
    G = H // Hk
    h = q.embed[np.asarray(tokens)].astype(np.float64)
    cos, sin = (np.asarray(r, dtype=np.float64) for r in rope)
    sk, sv = scratch

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + q.eps) * w

    def rotate(x):  # (..., T, D)
        out, r, half = x.copy(), q.rot, q.rot // 2
        if q.traditional:
            a, b = x[..., 0:r:2], x[..., 1:r:2]
            out[..., 0:r:2], out[..., 1:r:2] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = x[..., :half], x[..., half:r]
            out[..., :half], out[..., half:r] = a * cos - b * sin, a * sin + b * cos
        return out

    def mm(x, w, s):
        return (x @ w.astype(np.float64).T) * s

    for i, layer in enumerate(q.layers):
        x = norm(h, layer.n1)
        qkv = mm(x, layer.qkv, layer.s_qkv)
        qh = rotate(qkv[:, : H * D].reshape(T, H, D).transpose(1, 0, 2))
        kh = rotate(qkv[:, H * D : (H + Hk) * D].reshape(T, Hk, D).transpose(1, 0, 2))
        vh = qkv[:, (H + Hk) * D :].reshape(T, Hk, D).transpose(1, 0, 2)
        sk[i, :, n_scr : n_scr + T], sv[i, :, n_scr : n_scr + T] = kh, vh
        keys = np.concatenate([ctx[i][0][:, :n_ctx], sk[i, :, : n_scr + T]], axis=1).astype(np.float64)
        vals = np.concatenate([ctx[i][1][:, :n_ctx], sv[i, :, : n_scr + T]], axis=1).astype(np.float64)
        S = keys.shape[1]
        att = np.empty((T, H, D))
        for hh in range(H):
            s = qh[hh] @ keys[hh // G].T * q.scale  # (T, S)
            s = np.where(np.arange(S)[None] <= (S - T + np.arange(T))[:, None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, hh] = (p / p.sum(-1, keepdims=True)) @ vals[hh // G]
        h = h + mm(att.reshape(T, H * D), layer.o, layer.s_o)
        gu = mm(norm(h, layer.n2), layer.gu, layer.s_gu)
        g, u = gu[:, : q.F], gu[:, q.F :]
        h = h + mm(g / (1 + np.exp(-g)) * u, layer.down, layer.s_down)
    return mm(norm(h, q.final_norm), q.head, q.s_head)


def threads() -> int:
    """Threads a product uses: EDGESPEC_Q8_THREADS, else one a core (at most 8)."""
    env = os.environ.get("EDGESPEC_Q8_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return min(int(env), 8)
    return max(1, min(os.cpu_count() or 1, 8))


@functools.cache
def library():
    """The built and checked library (its `edgespec_q8_forward`), or None (one warning)."""
    try:
        return load_library()
    except (native.NativeBuildError, OSError, subprocess.SubprocessError, RuntimeError) as e:
        warnings.warn(f"edgespec: the int8 drafting kernel is unavailable ({e})", RuntimeWarning, stacklevel=2)
        return None


def load_library(defines: tuple[str, ...] = ()):
    """Build (once per source and flags), load and check the library; `defines`: extra -D flags
    (benchmarks: "-DEDGESPEC_Q8_FLOAT" keeps the float products where int16 ones would run)."""
    path = native.build(source=SOURCE, stem="libedgespec_q8", extra_flags=("-lm", "-pthread", *defines))
    lib = ctypes.CDLL(str(path))
    fwd = lib.edgespec_q8_forward
    fwd.restype = ctypes.c_int
    fwd.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64]
                    + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64])
    lib.edgespec_q8_threads.restype = ctypes.c_int
    lib.edgespec_q8_threads.argtypes = [ctypes.c_int]
    lib.edgespec_q8_threads(threads())
    _check(lib)
    return lib


def random_model(seed: int = 0, traditional: bool = False, rot: int | None = None) -> Q8Model:
    """A tiny random int8 model (E 48, 6 heads over 2 kv heads of 8, F 80, V 97, 2 layers), what
    the check and the tests run the kernel on."""
    rng = np.random.default_rng(seed)
    E, H, Hk, D, F, V = 48, 6, 2, 8, 80, 97

    def w(o, i):
        return quantize_rows(rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i))

    def norm():
        return (1 + 0.1 * rng.standard_normal(E)).astype(np.float32)

    layers = [Q8Layer(*w((H + 2 * Hk) * D, E), *w(E, H * D), *w(2 * F, E), *w(E, F), norm(), norm())
              for _ in range(2)]
    head, s_head = w(V, E)
    embed = rng.standard_normal((V, E)).astype(np.float32)
    return Q8Model(layers, head, s_head, norm(), embed, dims=(E, H, Hk, D, F), rot=D if rot is None else rot,
                   traditional=traditional, eps=1e-5, scale=D**-0.5)


def random_rope(start: int, n: int, rot: int, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, rot/2) of positions start.. for plain RoPE at `base` (checks and tests)."""
    inv = base ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    ang = np.arange(start, start + n, dtype=np.float64)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _check(lib) -> None:
    """The kernel against `reference_forward` on a tiny model: a context, a scratch, 3 new tokens."""
    rng = np.random.default_rng(0)
    q = random_model()
    n_ctx = 21
    ctx = [(rng.standard_normal((q.Hk, 32, q.D)).astype(np.float32)[:, :, :],
            rng.standard_normal((q.Hk, 32, q.D)).astype(np.float32)) for _ in range(q.L)]
    toks = [3, 50, 96]
    a, b = q.scratch(8), q.scratch(8)
    a[0][:, :, :2] = b[0][:, :, :2] = rng.standard_normal((q.L, q.Hk, 2, q.D))
    a[1][:, :, :2] = b[1][:, :, :2] = rng.standard_normal((q.L, q.Hk, 2, q.D))
    rope = random_rope(n_ctx + 2, len(toks), q.rot)
    got = q.forward(toks, ctx, n_ctx, a, 2, rope, 3, lib=lib)
    want = reference_forward(q, toks, ctx, n_ctx, b, 2, rope)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
    if not err < 1e-4:
        raise RuntimeError(f"the int8 kernel disagrees with numpy (relative error {err:.1e})")

