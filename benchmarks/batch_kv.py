"""KV layout for batched decode steps, timed side by side on the default model.

    python benchmarks/batch_kv.py [--model PATH] [--reps 9]

One decode step of B rows (contexts 100, 137, 174, ... tokens) four ways:
arena (each row's caches a row of one KVArena, written by one scatter per layer:
what edgespec.batch does), gathered (per-sequence caches padded into
(B, Hk, S_max, D) per layer: what it did before, and still does for rows with
caches of their own), shared (one batched cache at a common offset: the bound for
per-row offsets) and separate (B single-row calls). Interleaved rep by rep;
medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

import edgespec
from edgespec.batch.arena import KVArena, SlotCache
from edgespec.batch.forward import Row, batched_forward


def filled(model, n: int, rows: int = 1):
    cache = model.make_cache()
    ids = mx.repeat((mx.arange(1, n + 1) % 1000)[None], rows, axis=0)
    mx.eval(model(ids, cache))
    return cache


def in_arena(model, arena: KVArena, n: int):
    row = arena.acquire()
    cache = [SlotCache(arena, i, row) for i in range(len(model.layers))]
    for c in cache:
        c.attach()
    ids = (mx.arange(1, n + 1) % 1000)[None]
    mx.eval(model(ids, cache))
    return cache


def rollback(caches) -> None:
    for layers in caches:
        for c in layers:
            c.trim(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    model = edgespec.load(args.model, progress=False, drafter="none").model
    for B in (1, 4, 8):
        lens = [100 + 37 * i for i in range(B)]
        caches = [filled(model, n) for n in lens]
        shared_cache = filled(model, max(lens), B)
        arena = KVArena()
        rows = [in_arena(model, arena, n) for n in lens]

        def arena_step(rows=rows):
            mx.eval(batched_forward(model, [Row(mx.array([[5]]), c) for c in rows]))
            rollback(rows)

        def gathered(caches=caches):
            mx.eval(batched_forward(model, [Row(mx.array([[5]]), c) for c in caches]))
            rollback(caches)

        def shared(cache=shared_cache, B=B):
            mx.eval(model(mx.full((B, 1), 5), cache))
            rollback([cache])

        def separate(caches=caches):
            for c in caches:
                mx.eval(model(mx.array([[5]]), c))
            rollback(caches)

        ways = {"arena": arena_step, "gathered": gathered, "shared": shared, "separate": separate}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for f in ways.values():
            f()  # warm-up
        for _ in range(args.reps):
            for k, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        a, g, s, sep = (statistics.median(times[k]) for k in ways)
        print(f"B={B}: arena {a * 1000:.1f} ms, gathered {g * 1000:.1f} ms, shared cache {s * 1000:.1f} ms, "
              f"{B} separate calls {sep * 1000:.1f} ms (gathered/arena {g / a:.2f}, arena/shared {a / s:.2f})")


if __name__ == "__main__":
    main()
