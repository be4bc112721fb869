"""The CPU kernel choices of edgespec.kernels, each against the alternative, side by side in one process.

    LD_PRELOAD=$(make -s preload) \\
        .venv/bin/python benchmarks/cpu_kernels.py [--model BUNDLE] [--reps 3]

On the default model's bundle (or --model), CPU device:
- activation: a 512-token prefill with the MLP's act(gate) * up in numpy
  (edgespec.kernels.activation) vs in MLX, tokens/s, alternating rep by rep;
- linear: one decoding pass of B = 1, 4, 8 rows (caches at 150 positions) with the
  few-row product `(W @ x.T).T` (edgespec.kernels.linear) vs MLX's `x @ W.T`, and with
  every layer's product done by numpy's BLAS inside the pass, median ms;
- attention: the CPU long-prompt attention (edgespec.kernels.attention) of one layer's
  worth of SmolLM2-shaped heads over a whole 8,190-token prefill in 512-query chunks, ms:
  the fused native kernel (edgespec.kernels.native), BLAS products around the native
  softmax pass, and BLAS products around numpy's passes, in rotation;
- softmax: the softmax pass alone on one thread over a 384 x 8,190 score block, the
  native kernel vs numpy's max, subtract and exp, ns an element;
- batch shapes: a batched pass of B = 2, 4, 8 rows of one KV arena (contexts 100,
  137, ...) at T = 1..16 tokens each, median ms, beside what the batcher estimates for
  it from the measured (B, 1) pass scaled along the one-sequence cost curve (the
  adaptive decoder's calibration, edgespec.batch.cost.StepCost);
- arena rows: a decoding pass over 7 of an 8-row KV arena's rows, contiguous, with a
  gap (read as contiguous runs), and with a gap or reversed read by a gather (mx.take,
  what a pass did before it took its rows in arena order and copied runs), median ms;
- joint choice: one row's `edgespec.batch.cost.joint_sizes` among B = 2, 4, 8 adaptive
  rows (gain curves of 32 tokens), ms a call, with the step-cost memo cleared before
  every call (what every measured pass did before `MEMO_REFRESH`) and kept;
- weights: every 2-D weight of the model (538 MB for SmolLM2, more than the caches hold)
  times B = 1, 4, 8 rows, MLX's `x @ W.T` (its CPU BLAS: a general product, also for
  one row) vs numpy's `W @ x` (numpy's own OpenBLAS, a matrix-vector product for one
  row), median ms a sweep: what a decoding pass's weights cost apart from everything
  else in it, and what the MLX CPU path leaves on the table;
- prefill bound: the 8,190 / 512-token prefill rate ratio this machine allows, predicted
  from a 512-token prefill's rate plus one layer's attention over 8,190 tokens (times the
  layers) as it runs (the fused kernel), with BLAS products around numpy's softmax
  passes, with those passes' `exp` skipped, and with the two BLAS products alone.

- base2: MLX's CPU exp, sigmoid and tanh against power(2, x) and a product, ns an element;
  then verifier passes of T = 1, 2, 4, 8 tokens at 150 and 600 keys with the CPU's base-2
  exponentials (edgespec.kernels.base2) on and off in pairs (alternating order): median ms
  each way and the median of the paired differences.
- align: verifier passes of T = 1, 2, 4, 8 tokens at 150 keys with the CBLAS shim's copy of
  misaligned activation rows (cblas_skinny.h) on and off, measured as base2's.
- int8: the int8 drafter's steps with int16 activations (vpmaddwd on AVX2, vpdpwssd on AVX-512
  VNNI) against the float products, two builds of edgespec/kernels/cpu_q8.c alternating in one
  process: median ms a drafted token, and the drafted tokens that differ.

`--only NAME[,NAME]` runs some of them (activation, linear, attention, softmax, shapes,
arena, joint, weights, bound, base2, align, int8).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
import warnings

import mlx.core as mx
import numpy as np

import edgespec
import edgespec.kernels.activation as act
import edgespec.kernels.linear as lin
from edgespec.generate import prefill
from edgespec.kernels import cpu_blas, native
from edgespec.kernels.attention import numpy_attention


def _timed(fn) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t0


def activation(model, reps: int) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(model.args.vocab_size) for _ in range(512)]
    rates: dict[str, list[float]] = {"numpy": [], "mlx": []}
    saved = act.CPU_NUMPY_MIN_ROWS
    try:
        for _ in range(reps + 1):  # the first round warms both up
            for name, rows in (("numpy", saved), ("mlx", 1 << 62)):
                act.CPU_NUMPY_MIN_ROWS = rows
                rates[name].append(512 / _timed(lambda: prefill(model, model.make_cache(), ids)))
    finally:
        act.CPU_NUMPY_MIN_ROWS = saved
    print("activation, 512-token prefill tok/s: " + ", ".join(
        f"{k} {' / '.join(f'{r:.0f}' for r in v[1:])}" for k, v in rates.items()))


def _numpy_linear(self, x: mx.array) -> mx.array:
    """A Linear layer's product through numpy's BLAS inside an MLX pass: the layer's input is
    evaluated, multiplied by a numpy view of the weight, and handed back to MLX (the
    numpy decoding path the weights line suggests, tried in place)."""
    w = self.__dict__.get("_np_weight")
    if w is None:
        w = self.__dict__["_np_weight"] = np.asarray(self["weight"])
    rows = x.reshape(-1, x.shape[-1])
    mx.eval(rows)
    y = mx.array(np.asarray(rows) @ w.T).reshape(*x.shape[:-1], -1)
    return y + self["bias"] if "bias" in self else y


def linear(model, reps: int) -> None:
    rng = random.Random(1)
    saved, own_call, native = lin.CPU_SWAP_MAX_ROWS, lin.Linear.__call__, cpu_blas._TAKEN
    cpu_blas._TAKEN = 0  # the forms as named, whether or not the shim's kernel would take x @ W.T
    forms = (("(W@x.T).T", saved, own_call), ("x@W.T", 0, own_call), ("numpy W@x", saved, _numpy_linear))
    try:
        for B in (1, 4, 8):
            cache = model.make_cache()
            mx.eval(model(mx.array([[rng.randrange(1000) for _ in range(150)] for _ in range(B)]), cache))
            times: dict[str, list[float]] = {name: [] for name, _, _ in forms}
            for _ in range(5 * reps):
                for name, rows, call in forms:
                    lin.CPU_SWAP_MAX_ROWS, lin.Linear.__call__ = rows, call
                    x = mx.array([[rng.randrange(1000)] for _ in range(B)])
                    times[name].append(_timed(lambda x=x, cache=cache: model(x, cache, last_only=True)))
                    for c in cache:
                        c.trim(1)
                time.sleep(0.5)  # numpy's OpenBLAS threads spin for a while after its calls (see weights)
            print(f"linear, decoding pass of {B} rows, median ms: " + ", ".join(
                f"{k} {statistics.median(v) * 1000:.1f}" for k, v in times.items()))
    finally:
        lin.CPU_SWAP_MAX_ROWS, lin.Linear.__call__, cpu_blas._TAKEN = saved, own_call, native


def _attention_layer(reps: int, H: int = 9, Hk: int = 3, D: int = 64, S: int = 8190, chunk: int = 512) -> list[float]:
    """Seconds of numpy attention for one layer's worth of SmolLM2-shaped heads over a whole
    S-token prefill in `chunk`-query chunks, per rep."""
    rng = np.random.default_rng(0)
    Q = mx.array(rng.standard_normal((1, H, S, D)).astype(np.float32))
    K = mx.array(rng.standard_normal((1, Hk, S, D)).astype(np.float32))
    mx.eval(Q, K)
    totals = []
    for _ in range(reps):
        total = 0.0
        for s in range(0, S, chunk):
            e = min(S, s + chunk)
            q, k = Q[:, :, s:e], K[:, :, :e]
            mx.eval(q, k)
            total += _timed(lambda q=q, k=k: numpy_attention(q, k, k, D**-0.5))
        totals.append(total)
    return totals


@contextlib.contextmanager
def _native(on: bool, fused: bool = True):
    """Attention with the native kernels (on, where they build; the fused one where it
    applies and `fused`) or BLAS products around numpy's passes."""
    import edgespec.kernels.attention as attn_mod

    saved = native.ENABLED, attn_mod.FUSED
    native.ENABLED, attn_mod.FUSED = on, fused
    try:
        yield
    finally:
        native.ENABLED, attn_mod.FUSED = saved


def attention(reps: int, S: int = 8190, chunk: int = 512) -> None:
    variants = {"fused kernel": (True, True), "BLAS + native softmax pass": (True, False),
                "BLAS + numpy's passes": (False, False)}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            with _native(*variants[name]):
                runs[name] += _attention_layer(1, S=S, chunk=chunk)
    if native.kernels() is None:
        print("attention: the native kernels are unavailable here (see the warning): every row ran numpy's passes")
    print(f"attention, one layer over a {S}-token prefill in {chunk}-query chunks, ms: "
          + "; ".join(f"{name} " + " / ".join(f"{t * 1000:.0f}" for t in ts) for name, ts in runs.items()))


def softmax(reps: int, rows: int = 384, cols: int = 8190) -> None:
    fn = native.softmax_rows()
    if fn is None:
        print("softmax: the native kernel is unavailable here (see the warning)")
        return
    rng = np.random.default_rng(0)
    src = (rng.standard_normal((rows, cols)) * 4).astype(np.float32)
    work = np.empty_like(src)
    times: dict[str, list[float]] = {"native": [], "numpy": []}
    for _ in range(reps):
        for name in times:
            np.copyto(work, src)
            t0 = time.perf_counter()
            if name == "native":
                fn(work.ctypes.data, rows, cols, cols, -1, 1, None)
            else:
                top = work.max(axis=-1, keepdims=True)
                work -= top
                np.exp(work, out=work)
            times[name].append(time.perf_counter() - t0)
    print(f"softmax pass, {rows} x {cols} block, one thread, ns an element: "
          + ", ".join(f"{k} {statistics.median(v) / (rows * cols) * 1e9:.2f}" for k, v in times.items()))


def _products(reps: int, H: int = 9, Hk: int = 3, D: int = 64, S: int = 8190, chunk: int = 512) -> list[float]:
    """Seconds of the two matrix products alone of what `_attention_layer` times: the same
    score blocks (BLOCK_ROWS score rows, causal ends), on one thread per core with BLAS held
    to one thread, as numpy_attention runs them."""
    from edgespec.kernels.attention import BLOCK_ROWS, _blas_controller, _pool, _workers

    G = H // Hk
    qb = max(1, BLOCK_ROWS // G)
    rng = np.random.default_rng(0)
    qg = rng.standard_normal((Hk, S * G, D)).astype(np.float32)
    kn = rng.standard_normal((Hk, S, D)).astype(np.float32)
    vn = rng.standard_normal((Hk, S, D)).astype(np.float32)

    def block(job):
        h, t0, t1 = job
        (qg[h, t0 * G : t1 * G] @ kn[h, :t1].T) @ vn[h, :t1]

    jobs = [(h, t0, min(e, t0 + qb)) for s in range(0, S, chunk) for e in [min(S, s + chunk)]
            for h in range(Hk) for t0 in range(s, e, qb)]
    totals = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with _blas_controller().limit(limits=1, user_api="blas"):
            if _workers() == 1:
                for job in jobs:
                    block(job)
            else:
                list(_pool().map(block, jobs))
        totals.append(time.perf_counter() - t0)
    return totals


def prefill_bound(model, reps: int, S: int = 8190, short: int = 512) -> None:
    """How the S-token prefill rate can compare with the `short`-token rate on this machine.

    A long prompt's chunks cost what a short prompt's tokens cost apart from attention
    (weights, norms, the MLP: the short prompt's rate less its own attention) plus causal
    attention over the whole prefix. Timed: the short prompt's prefill rate, one layer of
    attention over the short prompt and over the S-token prefill (as `attention`: the
    fused kernel), the latter again with BLAS products around numpy's softmax passes,
    with those passes' `exp` skipped, and with the two BLAS products alone.
    Printed: the S / short rate ratio those predict with attention as it runs, with the
    BLAS path, without its exponentials, and with its products alone (nothing else of the
    softmax: the best the BLAS path allows here)."""
    import edgespec.kernels.attention as attn_mod

    a = model.args
    shape = dict(H=a.num_attention_heads, Hk=a.num_key_value_heads, D=a.head_dim, S=S)
    rng = random.Random(0)
    ids = [rng.randrange(a.vocab_size) for _ in range(short)]
    mx.eval(prefill(model, model.make_cache(), ids[:64]))  # warm-up
    rates = []
    for _ in range(reps):
        cache = model.make_cache()
        t0 = time.perf_counter()
        mx.eval(prefill(model, cache, ids))
        rates.append(short / (time.perf_counter() - t0))
    r_short = statistics.median(rates)

    class _NoExp:  # numpy, except that exp leaves its input as it is
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def exp(x, out=None):
            return x if out is None else out

    full = statistics.median(_attention_layer(reps, **shape))
    own = statistics.median(_attention_layer(reps, **{**shape, "S": short}))  # what the short prompt's rate holds
    with _native(False):
        passes = statistics.median(_attention_layer(reps, **shape))
    attn_mod.np = _NoExp()
    native.ENABLED, saved = False, native.ENABLED  # exp skipped: numpy's passes
    try:
        with warnings.catch_warnings():  # unexponentiated scores: the division meets inf and nan
            warnings.simplefilter("ignore", RuntimeWarning)
            no_exp = statistics.median(_attention_layer(reps, **shape))
    finally:
        attn_mod.np, native.ENABLED = np, saved
    products = statistics.median(_products(reps, **shape))
    layers = len(model.layers)
    # seconds of everything but attention: the short prompt's time per token, less its attention
    base = S / r_short - (S / short) * layers * own

    def ratio(per_layer: float) -> float:
        return (S / (base + layers * per_layer)) / r_short

    print(f"prefill bound, {short}-token prefill {r_short:.0f} tok/s; one layer's attention over {S} tokens "
          f"{full * 1000:.0f} ms (BLAS with numpy's softmax passes {passes * 1000:.0f}, those without exp "
          f"{no_exp * 1000:.0f}, products alone {products * 1000:.0f}; over the {short}-token prompt "
          f"{own * 1000:.0f}); {S} / {short} rate ratio predicted, {layers} layers: as it runs "
          f"{ratio(full):.2f}, BLAS with numpy's passes {ratio(passes):.2f}, their exp free {ratio(no_exp):.2f}, "
          f"products alone {ratio(products):.2f}")


def batch_shapes(engine, reps: int) -> None:
    from edgespec.batch.arena import KVArena, SlotCache
    from edgespec.batch.cost import PassCost
    from edgespec.batch.forward import Row, batched_forward
    from edgespec.modes.adaptive import adaptive_costs

    model = engine.model
    curve = adaptive_costs(engine, measure=True)  # timed now: the estimates below need a measured curve
    c = PassCost(curve.sizes, curve.verify_s)
    Ts = (1, 2, 3, 4, 6, 8, 12, 16)
    for B in (2, 4, 8):
        arena = KVArena()
        caches = []
        for i in range(B):
            row = arena.acquire()
            cache = [SlotCache(arena, j, row) for j in range(len(model.layers))]
            for sc in cache:
                sc.attach()
            mx.eval(model((mx.arange(1, 101 + 37 * i) % 1000)[None], cache))
            caches.append(cache)
        times: dict[int, list[float]] = {T: [] for T in Ts}
        for _ in range(1 + 5 * reps):
            for T in Ts:
                rows = [Row(mx.array([[5] * T]), cache) for cache in caches]
                times[T].append(_timed(lambda rows=rows: batched_forward(model, rows)))
                for cache in caches:
                    for sc in cache:
                        sc.trim(T)
        med = {T: statistics.median(v[1:]) for T, v in times.items()}
        print(f"batch shapes, {B} rows, T = {', '.join(map(str, Ts))}: measured ms "
              + " / ".join(f"{med[T] * 1000:.0f}" for T in Ts) + "; estimated "
              + " / ".join(f"{med[1] * c(B * T) / c(B) * 1000:.0f}" for T in Ts))


def arena_rows(engine, reps: int) -> None:
    from edgespec.batch.arena import KVArena, SlotCache
    from edgespec.batch.forward import Row, batched_forward

    model = engine.model
    arena = KVArena()
    caches = []
    for i in range(8):
        row = arena.acquire(8)
        cache = [SlotCache(arena, j, row) for j in range(len(model.layers))]
        for sc in cache:
            sc.attach()
        mx.eval(model((mx.arange(1, 91 + 7 * i) % 1000)[None], cache))
        caches.append(cache)
    real_read = KVArena.read_rows

    def gather_read(self, layer, rows, n):  # the read before runs and compaction: one gather
        idx = mx.array(rows, dtype=mx.int32)
        return (mx.take(self.keys[layer][:, :, :n, :], idx, axis=0),
                mx.take(self.values[layer][:, :, :n, :], idx, axis=0))

    cases = {"7 contiguous": (list(range(7)), real_read), "7 with a gap": ([0, 1, 2, 3, 4, 5, 7], real_read),
             "7 with a gap, gathered": ([0, 1, 2, 3, 4, 5, 7], gather_read),
             "7 reversed, gathered": ([6, 5, 4, 3, 2, 1, 0], gather_read)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for _ in range(1 + 4 * reps):
            for name, (rows, read) in cases.items():
                KVArena.read_rows = read
                calls = [Row(mx.array([[7]]), caches[r]) for r in rows]
                times[name].append(_timed(lambda calls=calls: batched_forward(model, calls)))
                for r in rows:
                    for sc in caches[r]:
                        sc.trim(1)
    finally:
        KVArena.read_rows = real_read
    print("arena rows, a decoding pass of 7 of 8 rows, median ms: "
          + "; ".join(f"{k} {statistics.median(v[1:]) * 1000:.0f}" for k, v in times.items()))


def joint_choice(reps: int) -> None:
    from edgespec.batch.cost import PassCost, Peer, StepCost, joint_sizes

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    step = StepCost(PassCost(sizes, [0.08 * (1 + n / 20) for n in sizes]))
    rng = np.random.default_rng(0)

    def curve():
        return 1.0 + np.cumsum(np.sort(rng.random(32))[::-1] * 0.6)

    for B in (2, 4, 8):
        peers = [Peer(1, curve(), i + 1) for i in range(B - 1)]
        out = []
        for clear in (True, False):
            calls = 100 * reps
            t0 = time.perf_counter()
            for _ in range(calls):
                if clear:
                    step._memo.clear()
                joint_sizes(curve(), peers, step, 0, 0.0)
            out.append((time.perf_counter() - t0) / calls * 1000)
        print(f"joint choice, {B} rows: {out[0]:.2f} ms a call with the memo cleared, {out[1]:.2f} kept")


def weights(model, reps: int) -> None:
    from mlx.utils import tree_flatten

    ws = [w for _, w in tree_flatten(model.parameters()) if w.ndim == 2]
    wn = [np.array(w) for w in ws]
    mb = sum(w.nbytes for w in ws) / 1e6
    for B in (1, 4, 8):
        xs = [mx.ones((B, w.shape[1])) for w in ws]
        xn = [np.ones(w.shape[1], np.float32) if B == 1 else np.ones((w.shape[1], B), np.float32) for w in wn]
        mx.eval(xs)
        times: dict[str, list[float]] = {"mlx x@W.T": [], "numpy W@x": []}
        for _ in range(reps):
            # In blocks, with a pause between libraries: an OpenBLAS's threads spin for a while
            # after a call, and the other library's product running meanwhile shares the cores
            # with them (alternated call by call, MLX's sweep took twice as long here).
            for _ in range(3):
                times["mlx x@W.T"].append(_timed(lambda xs=xs: [x @ w.T for x, w in zip(xs, ws, strict=True)]))
            time.sleep(0.5)
            for _ in range(3):
                t0 = time.perf_counter()
                for w, x in zip(wn, xn, strict=True):
                    w @ x
                times["numpy W@x"].append(time.perf_counter() - t0)
            time.sleep(0.5)
        print(f"weights, {mb:.0f} MB times {B} rows, median ms: " + ", ".join(
            f"{k} {statistics.median(v) * 1000:.1f}" for k, v in times.items()))


def _alternating_passes(engine, reps: int, what: str, switch, contexts=(150,), widths=(1, 2, 4, 8)) -> None:
    """Verifier passes of each width at each context with `switch(True)` and `switch(False)` in
    pairs, one right after the other, in alternating order (the machine's drift hits both
    alike): median ms each way, and the median of the paired differences; left switched on."""
    model = engine.model
    try:
        for S in contexts:
            ids = [1000 + (i * 7) % 5000 for i in range(S)]
            cache = engine.make_cache()
            mx.eval(model(mx.array(ids, dtype=mx.int32)[None], cache))
            times: dict[tuple, list[float]] = {}
            for rep in range(reps):
                for T in widths:
                    for i in range(3):
                        for on in ((True, False) if (rep + i) % 2 else (False, True)):
                            switch(on)
                            x = mx.array(ids[:T], dtype=mx.int32)[None]
                            times.setdefault((on, T), []).append(_timed(lambda x=x, cache=cache: model(x, cache)))
                            for c in cache:
                                c.trim(T)
            for on in (True, False):
                med = {T: statistics.median(times[(on, T)]) * 1000 for T in widths}
                print(f"pass at {S} keys, {what} {'on' if on else 'off'}, median ms: "
                      + ", ".join(f"T={T} {med[T]:.1f}" for T in widths)
                      + f"; T={widths[-1]} / T={widths[0]} {med[widths[-1]] / med[widths[0]]:.2f}")
            print(f"pass at {S} keys, {what} on minus off, paired median ms: " + ", ".join(
                f"T={T} {statistics.median(a - b for a, b in zip(times[(True, T)], times[(False, T)], strict=True)) * 1000:+.2f}"
                for T in widths))
    finally:
        switch(True)


def base2_passes(engine, reps: int) -> None:
    from edgespec.kernels import base2

    unary = {"exp": mx.exp, "sigmoid": mx.sigmoid, "tanh": mx.tanh, "power(2, x)": lambda x: mx.power(2.0, x),
             "product": lambda x: x * 1.5}
    x = mx.random.normal((1 << 18,)) * 3
    mx.eval(x)
    per = {name: statistics.median(_timed(lambda f=f: f(x)) for _ in range(5 * reps)) / x.size * 1e9
           for name, f in unary.items()}
    print("element-wise, ns an element: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
    _alternating_passes(engine, reps, "base 2", lambda on: setattr(base2, "ENABLED", on), contexts=(150, 600))


def aligned_rows(engine, reps: int) -> None:
    """The CBLAS shim's copy of misaligned activation rows (cblas_skinny.h) on and off."""
    import ctypes

    try:
        switch = ctypes.CDLL(None).edgespec_cblas_skinny_align
    except AttributeError:
        print("align: the CBLAS shim is not preloaded (LD_PRELOAD=$(make -s preload))")
        return
    _alternating_passes(engine, reps, "aligned rows", lambda on: switch(int(on)))


def int8_products(engine, reps: int, k: int = 4, prompt_len: int = 150) -> None:
    """The int8 drafter's steps with int16 activations (the library as built where the CPU has
    AVX2 or AVX-512 VNNI) against the float products it replaces (built with -DEDGESPEC_Q8_FLOAT),
    the two libraries in one process, alternating draft by draft: median ms a drafted token, and
    how many of the drafted tokens differ between the two (drafts only: the output is the
    verifier's either way)."""
    from edgespec.drafters.quantized import QuantizedDrafter
    from edgespec.kernels import q8
    from edgespec.logits.sampling import Sampler, SamplingParams

    libs = {"int16": q8.load_library(), "float": q8.load_library(("-DEDGESPEC_Q8_FLOAT",))}
    d = QuantizedDrafter.load(engine)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 20000) for _ in range(prompt_len)]
    cache = engine.model.make_cache()
    mx.eval(prefill(engine.model, cache, prompt))
    d.bind_verifier_cache(cache)
    sampler = Sampler(SamplingParams())
    times: dict = {name: [] for name in libs}
    drafts: dict = {name: [] for name in libs}
    original = q8.library
    try:
        for rep in range(max(reps, 1) * 8):
            order = list(libs) if rep % 2 == 0 else list(libs)[::-1]
            for name in order:
                q8.library = lambda lib=libs[name]: lib
                d.sync(prompt + [prompt[rep % prompt_len]])
                t0 = time.perf_counter()
                out = d.draft(k, sampler)
                times[name].append((time.perf_counter() - t0) / k)
                drafts[name].append(list(out.tokens))
    finally:
        q8.library = original
    differ = sum(a != b for x, y in zip(drafts["int16"], drafts["float"], strict=True) for a, b in zip(x, y, strict=False))
    total = sum(len(x) for x in drafts["int16"])
    med = {n: 1000 * statistics.median(t) for n, t in times.items()}
    print(f"int8 drafter, {k} tokens a draft after {prompt_len} cached positions, median ms a token: "
          f"int16 activations {med['int16']:.2f}, float products {med['float']:.2f} "
          f"(float / int16 {med['float'] / med['int16']:.2f}); drafted tokens that differ: {differ} of {total}")


SECTIONS = {"activation": lambda e, r: activation(e.model, r), "linear": lambda e, r: linear(e.model, r),
            "attention": lambda e, r: attention(r), "softmax": lambda e, r: softmax(r), "shapes": batch_shapes,
            "arena": arena_rows,
            "joint": lambda e, r: joint_choice(r), "weights": lambda e, r: weights(e.model, r),
            "bound": lambda e, r: prefill_bound(e.model, r), "base2": base2_passes,
            "align": aligned_rows, "int8": int8_products}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle folder (default: the default model's bundle)")
    ap.add_argument("--reps", type=int, default=3, help="measured rounds per comparison")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        ap.error(f"--only: unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    mx.set_default_device(mx.cpu)
    engine = edgespec.load(args.model, drafter="none", progress=False, history="off")
    for name in only:
        SECTIONS[name](engine, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
