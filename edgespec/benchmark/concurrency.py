"""`edgespec bench --concurrency 1,2,4,8`: throughput and latency of concurrent requests.

For every concurrency level c and speculation policy, c clients (one thread each,
`Engine.stream`, so their requests join one batch) each send `per_client` requests
back to back, the next as soon as the last reply ends: the way concurrent streaming
clients load a server, so a reply that ends early makes room for the next one at
once. Policies:

    off     mode plain: no speculation
    on      mode auto with batch_aware=0: trees priced as if each request ran alone
    chosen  mode auto: the adaptive decoder prices trees against the whole batch

Per (c, policy): aggregate tokens/s (all tokens / wall time from the first request
to the last reply), mean per-request tokens/s, mean time to first token (from
submission), tokens per verifier pass (1.0 = no speculation), and greedy replies
that differ from the same request run alone with plain decoding ("wrong"; must be
0). Policies are interleaved round by round, their order turning each round, so a
machine whose speed drifts slows them alike: several short rounds (`--per-client 1
--repeats 4`) compare better than one long one. The
history source is off for the run: the same prompts come back round after round.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from edgespec.benchmark.plots import _pyplot
from edgespec.engine import make_options
from edgespec.generate import GenerationStats

POLICIES = {"off": ("plain", {}), "on": ("auto", {"batch_aware": False}), "chosen": ("auto", {})}


@dataclass
class Cell:
    concurrency: int
    policy: str
    tokens: int = 0
    wall_s: float = 0.0
    per_request_tps: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    passes: int = 0
    wrong: int = 0

    def row(self) -> dict:
        n = len(self.ttft_s) or 1
        return {
            "concurrency": self.concurrency, "policy": self.policy,
            "aggregate_tps": self.tokens / self.wall_s if self.wall_s else 0.0,
            "per_request_tps": sum(self.per_request_tps) / max(len(self.per_request_tps), 1),
            "ttft_s": sum(self.ttft_s) / n,
            "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0,
            "requests": len(self.ttft_s), "wrong": self.wrong,
        }


def _clients(engine, queues: list[list[list[int]]], mode: str, mode_options: dict, max_tokens: int):
    """One thread per client, each running its queue of prompts back to back.
    -> (per request: (client, index, tokens, ttft, stats, t0, t1)), wall seconds."""
    out: list = []
    lock = threading.Lock()
    gate = threading.Barrier(len(queues))

    def work(c):
        options = make_options(max_tokens=max_tokens, mode=mode, **mode_options)
        gate.wait()
        for j, ids in enumerate(queues[c]):
            stats = GenerationStats()
            t0 = time.perf_counter()
            first, toks = None, []
            for chunk in engine._stream(ids, options, engine.resolve_mode(options), None, stats):
                if first is None and chunk.tokens:
                    first = time.perf_counter() - t0
                toks.extend(chunk.tokens)
            t1 = time.perf_counter()
            with lock:
                out.append((c, j, toks, first if first is not None else t1 - t0, stats, t0, t1))

    threads = [threading.Thread(target=work, args=(c,)) for c in range(len(queues))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(o[6] for o in out) - min(o[5] for o in out)
    return out, wall


def run_concurrency(engine, prompts: list[list[int]], levels: list[int], max_tokens: int, rounds: int = 2,
                    policies=tuple(POLICIES), on_progress=None, per_client: int = 3) -> dict:
    """-> {"rows": [Cell.row()...], "settings": {...}} (see the module docstring)."""
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    if per_client < 1:
        raise ValueError(f"per_client must be >= 1, got {per_client}")
    saved_history, engine.history = engine.history, None
    batcher = engine.batcher
    saved_max = batcher.max_batch
    batcher.max_batch = max(levels)
    try:
        refs = {}
        for i, ids in enumerate(prompts):  # each request alone, plain decoding: the reference
            refs[i] = engine.generate(ids, max_tokens=max_tokens, mode="plain").tokens
        for p in policies:  # warm-up (calibration, first-use allocations)
            mode, mo = POLICIES[p]
            _clients(engine, [prompts[:1]], mode, mo, 8)
        cells = {(c, p): Cell(c, p) for c in levels for p in policies}
        for c in levels:
            for r in range(rounds):
                # client k's j-th request: prompts taken in turn, a different slice each round
                which = [[(r * c * per_client + k * per_client + j) % len(prompts) for j in range(per_client)]
                         for k in range(c)]
                # The order turns round by round: on a machine whose speed drifts, no policy
                # always runs first after a level change or right after the same neighbour.
                for p in policies[r % len(policies):] + policies[: r % len(policies)]:
                    mode, mo = POLICIES[p]
                    res, wall = _clients(engine, [[prompts[i] for i in w] for w in which], mode, mo, max_tokens)
                    cell = cells[(c, p)]
                    cell.wall_s += wall
                    for k, j, toks, ttft, stats, t0, t1 in res:
                        cell.tokens += len(toks)
                        cell.passes += max(stats.verifier_passes, 1)
                        cell.per_request_tps.append(len(toks) / max(t1 - t0, 1e-9))
                        cell.ttft_s.append(ttft)
                        cell.wrong += toks != refs[which[k][j]]
                    if on_progress:
                        on_progress(c, f"c={c} {p}")
    finally:
        engine.history = saved_history
        batcher.max_batch = saved_max
    rows = [cells[(c, p)].row() for c in levels for p in policies]
    guard = {str(n): v for n, v in batcher.guard.summary().items()}
    return {"rows": rows, "guard": guard,
            "settings": {"levels": levels, "policies": list(policies), "rounds": rounds, "per_client": per_client,
                         "max_tokens": max_tokens, "prompts": len(prompts)}}


def summarise(report: dict) -> dict:
    """Per level: speedup of each policy's aggregate over serial (plain, c=1), and how the
    controller's choice compares with the better of forced on / forced off."""
    rows = report["rows"]
    by = {(r["concurrency"], r["policy"]): r for r in rows}
    serial = by.get((1, "off"), {}).get("aggregate_tps") or None
    out = {}
    for c in report["settings"]["levels"]:
        d = {}
        for p in report["settings"]["policies"]:
            agg = by[(c, p)]["aggregate_tps"]
            d[f"{p}_vs_serial"] = agg / serial if serial else None
        if all((c, p) in by for p in ("on", "off", "chosen")):
            best = max(by[(c, "on")]["aggregate_tps"], by[(c, "off")]["aggregate_tps"])
            d["chosen_vs_best"] = by[(c, "chosen")]["aggregate_tps"] / best if best else None
        out[c] = d
    return out


def format_concurrency(report: dict) -> str:
    """Markdown table of the report."""
    summ = summarise(report)
    lines = ["| requests | policy | aggregate tok/s | x serial | per-request tok/s | TTFT ms | tokens/pass | wrong |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        x = summ[r["concurrency"]].get(f"{r['policy']}_vs_serial")
        lines.append(f"| {r['concurrency']} | {r['policy']} | {r['aggregate_tps']:.1f} | "
                     f"{'' if x is None else f'{x:.2f}x'} | {r['per_request_tps']:.1f} | {r['ttft_s'] * 1000:.0f} | "
                     f"{r['tokens_per_pass']:.2f} | {r['wrong']} |")
    chosen = [(c, d["chosen_vs_best"]) for c, d in summ.items() if d.get("chosen_vs_best") is not None]
    if chosen:
        lines.append("")
        lines.append("chosen / best of forced on and off: "
                     + ", ".join(f"{c} requests {v:.2f}x" for c, v in chosen))
    measured = [(n, g) for n, g in report.get("guard", {}).items() if g["spec_steps"] and g["plain_steps"]]
    if measured:
        lines.append("")
        lines.append("the batch's guard at the end (decoding steps of chosen, edgespec.batch.guard): "
                     + "; ".join(f"{n} rows: speculation {g['spec_tps']:.1f} tok/s over {g['spec_steps']} steps, "
                                 f"plain {g['plain_tps']:.1f} over {g['plain_steps']}, runs {g['best']}"
                                 for n, g in measured))
    return "\n".join(lines)


def plot_concurrency(report: dict, path) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    levels = report["settings"]["levels"]
    for p in report["settings"]["policies"]:
        rows = [r for r in report["rows"] if r["policy"] == p]
        a1.plot(levels, [r["aggregate_tps"] for r in rows], marker="o", label=p)
        a2.plot(levels, [r["ttft_s"] * 1000 for r in rows], marker="o", label=p)
    a1.set(xlabel="concurrent requests", ylabel="aggregate tokens/s", xticks=levels, title="throughput")
    a2.set(xlabel="concurrent requests", ylabel="time to first token (ms)", xticks=levels, title="latency")
    a1.legend(title="speculation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
