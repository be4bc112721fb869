"""Turn a BenchRun into numbers: per mode and domain metrics, acceptance curves, a recommendation.

Timing per (mode, prompt) is the median over repeats (robust to one noisy
run); a domain's tokens/s is total tokens / total decode time over its
prompts, so long replies weigh more, as they do in real traffic. Speedup is
mode tokens/s over plain tokens/s on the same prompts in the same run.
"""

from __future__ import annotations

import statistics
from collections import Counter

from edgespec.benchmark.runner import BenchRun, RunRecord

ALL = "all"
# A mode must beat plain by this much (and in every repeat) to be recommended:
# below it, run-to-run noise on a shared machine can flip the order.
MARGIN = 0.05


def _sum(records: list[RunRecord], key: str) -> float:
    return float(sum(r.stats.get(key) or 0 for r in records))


def _per_prompt_medians(records: list[RunRecord]) -> tuple[float, float, float]:
    """(tokens, decode seconds, wall seconds) summed over prompts of per-prompt medians."""
    by_prompt: dict[int, list[RunRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt_index, []).append(r)
    tok = dec = wall = 0.0
    for recs in by_prompt.values():
        tok += statistics.median(r.stats["generated_tokens"] for r in recs)
        dec += statistics.median(r.stats["decode_s"] for r in recs)
        wall += statistics.median(r.wall_s for r in recs)
    return tok, dec, wall


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def acceptance_curve(records: list[RunRecord]) -> list[dict]:
    """Per draft position i (1-based): drafted, accepted, rate = accepted/drafted, and the
    conditional rate accepted_i / accepted_{i-1} (P(accept i | accepted 1..i-1))."""
    drafted: list[int] = []
    accepted: list[int] = []
    for r in records:
        d, a = r.stats.get("drafted_by_position") or [], r.stats.get("accepted_by_position") or []
        for i in range(len(d)):
            if i >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d[i]
            accepted[i] += a[i] if i < len(a) else 0
    out = []
    for i, (d, a) in enumerate(zip(drafted, accepted, strict=False)):
        prev = drafted[0] if i == 0 else accepted[i - 1]
        out.append(
            dict(
                position=i + 1,
                drafted=d,
                accepted=a,
                rate=_rate(a, d),
                conditional_rate=_rate(a, prev),
            )
        )
    return out


def metrics(records: list[RunRecord], ref: list[RunRecord]) -> dict:
    """Metrics of one mode's records against the plain records of the same (prompt, repeat)s."""
    # Compare on the (prompt, repeat)s both have (they differ only after a mode failed
    # or the run was interrupted).
    keys = {(r.prompt_index, r.repeat) for r in records} & {(r.prompt_index, r.repeat) for r in ref}
    ref_all = ref
    ref = [r for r in ref if (r.prompt_index, r.repeat) in keys]
    if ref_all:
        records = [r for r in records if (r.prompt_index, r.repeat) in keys] or records
    tok, dec, wall = _per_prompt_medians(records)
    rtok, rdec, rwall = _per_prompt_medians(ref) if ref else (0.0, 0.0, 0.0)
    tps, e2e = _rate(tok, dec), _rate(tok, wall)
    ref_tps, ref_e2e = _rate(rtok, rdec), _rate(rtok, rwall)
    # Per-repeat speedups give the spread the median hides.
    per_repeat = []
    for rep in sorted({r.repeat for r in records}):
        a = [r for r in records if r.repeat == rep]
        b = [r for r in ref if r.repeat == rep]
        s_a = _rate(_sum(a, "generated_tokens"), _sum(a, "decode_s"))
        s_b = _rate(_sum(b, "generated_tokens"), _sum(b, "decode_s"))
        if s_a and s_b:
            per_repeat.append(s_a / s_b)
    n = len(records)
    decode_total = _sum(records, "decode_s")
    ks = Counter(r.stats.get("draft_tokens") for r in records if r.stats.get("draft_tokens"))
    notes = list(dict.fromkeys(note for r in records for note in r.stats.get("notes") or []))
    return dict(
        prompts=len({r.prompt_index for r in records}),
        runs=n,
        generated_tokens=tok,
        tokens_per_s=tps,
        e2e_tokens_per_s=e2e,
        speedup=tps / ref_tps if tps and ref_tps else None,
        speedup_min=min(per_repeat) if per_repeat else None,
        speedup_max=max(per_repeat) if per_repeat else None,
        e2e_speedup=e2e / ref_e2e if e2e and ref_e2e else None,
        acceptance_rate=_rate(_sum(records, "accepted"), _sum(records, "drafted")),
        tokens_per_pass=_rate(_sum(records, "generated_tokens"), _sum(records, "verifier_passes")),
        drafted=int(_sum(records, "drafted")),
        accepted=int(_sum(records, "accepted")),
        prefill_s=_sum(records, "prefill_s") / n,
        decode_s=decode_total / n,
        draft_s=_sum(records, "draft_s") / n,
        verify_s=_sum(records, "verify_s") / n,
        hidden_draft_s=_sum(records, "hidden_draft_s") / n,
        draft_fraction=_rate(_sum(records, "draft_s"), decode_total),
        verify_fraction=_rate(_sum(records, "verify_s"), decode_total),
        peak_memory_mb=max(r.stats.get("peak_memory_bytes") or 0 for r in records) / 2**20,
        draft_tokens=ks.most_common(1)[0][0] if ks else None,
        finish_reasons=dict(Counter(r.finish_reason for r in records)),
        notes=notes[:8],
        # What transfers to another machine: how many drafter calls each committed token cost,
        # and per source the tokens it got committed per verifier pass.
        draft_calls_per_token=_rate(sum(r.draft_calls for r in records), _sum(records, "generated_tokens")),
        source_tokens_per_pass=_by_source(records),
        **_simulated(records, ref),
    )


def _by_source(records: list[RunRecord]) -> dict[str, float]:
    passes = _sum(records, "verifier_passes")
    kept: Counter = Counter()
    for r in records:
        kept.update(r.stats.get("accepted_by_source") or {})
    return {k: v / passes for k, v in sorted(kept.items())} if passes else {}


def _simulated(records: list[RunRecord], ref: list[RunRecord]) -> dict:
    """Under a cost profile: tokens per simulated decode second (the prompt's passes left out,
    as decode_s leaves them out) and the speedup over plain's on the same generations."""
    def rate(recs):
        if not recs or any(r.sim is None for r in recs):
            return None
        dec = sum(r.sim["sim_s"] - r.sim["sim_prefill_s"] for r in recs)
        return _rate(_sum(recs, "generated_tokens"), dec)

    mine, plain = rate(records), rate(ref)
    if mine is None:
        return {}
    n = len(records)
    return dict(sim_tokens_per_s=mine, sim_speedup=mine / plain if plain else None,
                sim_prefill_s=sum(r.sim["sim_prefill_s"] for r in records) / n,
                sim_draft_s=sum(r.sim["sim_draft_s"] for r in records) / n)


def domains_of(run: BenchRun) -> list[str]:
    return list(dict.fromkeys(p.domain for p in run.prompts))


def recommend(report: dict, drafter: str | None = None) -> dict:
    """Pick the fastest mode that is correct and beats plain by MARGIN in every repeat. Under a
    cost profile (`--profile`), by the simulated speedup: what pays on the profile's machine (the
    simulated clock is deterministic, so one figure stands for every repeat)."""
    ref = report["modes"][0]["label"]
    results = report["results"]
    profile = (report.get("settings") or {}).get("profile")

    def speedup(m: dict) -> float | None:
        return m.get("sim_speedup") if profile else m["speedup"]

    def qualifies(label: str, dom: str) -> bool:
        m = results.get(label, {}).get(dom)
        spec = next(s for s in report["modes"] if s["label"] == label)
        if spec["mode"] == ref or not m or speedup(m) is None or report["status"][label] != "ok":
            return False
        lo = speedup(m) if profile or m["speedup_min"] is None else m["speedup_min"]
        return speedup(m) >= 1 + MARGIN and lo > 1.0

    def best(dom: str) -> tuple[str, float]:
        cands = [lab for lab in results if qualifies(lab, dom)]
        if not cands:
            return ref, 1.0
        lab = max(cands, key=lambda x: speedup(results[x][dom]))
        return lab, speedup(results[lab][dom])

    label, best_x = best(ALL)
    spec = next(m for m in report["modes"] if m["label"] == label)
    m = results.get(label, {}).get(ALL, {})
    cli = [f"--mode {spec['mode']}"]
    settings = dict(spec["settings"])
    if "draft_tokens" in settings:
        cli.append(f"--draft-tokens {settings.pop('draft_tokens')}")
    drafter = settings.pop("drafter", None) or drafter
    if spec["mode"] == "speculative" and drafter:
        cli.append(f"--drafter {drafter}")
    if label == ref:
        reason = (
            f"no mode beat plain by at least {MARGIN:.0%} in every repeat on this traffic and machine; "
            "plain decoding is the safe choice"
        ) if not profile else (
            f"no mode beat plain by at least {MARGIN:.0%} on this traffic on the simulated clock of {profile}; "
            "plain decoding is the safe choice")
    else:
        reason = (
            f"{label} was {best_x:.2f}x plain over all prompts"
            f"{f' on the simulated clock of {profile}' if profile else ''} (greedy output identical to plain)"
        )
        if m.get("draft_tokens") and spec["draft_tokens"] == "auto":
            if spec["mode"] in ("auto", "adaptive"):
                reason += f"; its verifier passes checked mostly {m['draft_tokens']} candidate tokens"
            else:
                reason += f"; the K controller settled mostly on K={m['draft_tokens']}"
    per_domain = {}
    for dom in report["domains"]:
        lab, sp = best(dom)
        per_domain[dom] = dict(label=lab, speedup=sp)
    return dict(
        label=label,
        mode=spec["mode"],
        settings=spec["settings"],
        observed_draft_tokens=m.get("draft_tokens"),
        speedup=best_x,
        reason=reason,
        cli=" ".join(
            cli
            + [
                f"--mode-option {k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in settings.items()
            ]
        ),
        per_domain=per_domain,
    )


def build_report(run: BenchRun, meta: dict | None = None) -> dict:
    """Everything the table, JSON and plots need, as plain JSON-ready data."""
    meta = dict(meta or {})
    ref = run.specs[0].label
    doms = domains_of(run)
    ref_recs = [r for r in run.records if r.label == ref]
    results, curves = {}, {}
    for spec in run.specs:
        recs = [r for r in run.records if r.label == spec.label]
        if not recs:
            continue
        results[spec.label] = {ALL: metrics(recs, ref_recs)}
        curves[spec.label] = {ALL: acceptance_curve(recs)}
        for dom in doms:
            sub = [r for r in recs if r.domain == dom]
            if sub:
                results[spec.label][dom] = metrics(sub, [r for r in ref_recs if r.domain == dom])
                curves[spec.label][dom] = acceptance_curve(sub)
    report = dict(
        meta=meta,
        settings=run.settings,
        domains=doms,
        prompts=[
            dict(id=p.id, domain=p.domain, preview=p.preview(), line=p.line) for p in run.prompts
        ],
        modes=[
            dict(
                label=s.label,
                mode=s.mode,
                draft_tokens=s.draft_tokens,
                drafter=s.drafter,
                options=s.options,
                settings=s.settings,
            )
            for s in run.specs
        ],
        status={s.label: run.status(s.label) for s in run.specs},
        unavailable=run.unavailable,
        errors=run.errors,
        equality=dict(run.equality, mismatches=[m.__dict__ for m in run.mismatches]),
        results=results,
        acceptance_by_position=curves,
        runs=[r.compact() for r in run.records],
    )
    report["recommendation"] = recommend(report, meta.get("drafter"))
    return report
