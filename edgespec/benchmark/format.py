"""Text renderings of a bench report: the terminal table and the Markdown report."""

from __future__ import annotations

from edgespec.benchmark.report import ALL

MAX_LISTED = 5  # mismatches listed per mode in text (report.json has all)
COLUMNS = (
    "mode",
    "domain",
    "tok/s",
    "speedup",
    "accept",
    "tok/pass",
    "calls/tok",
    "draft",
    "verify",
    "peak MB",
    "status",
)


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _speedup(m: dict) -> str:
    if m["speedup"] is None:
        return "-"
    s = f"{m['speedup']:.2f}x"
    lo, hi = m["speedup_min"], m["speedup_max"]
    if lo is not None and hi is not None and hi - lo >= 0.005:
        s += f" [{lo:.2f}-{hi:.2f}]"
    return s


SIM_COLUMNS = ("sim tok/s", "sim x")  # with a cost profile: simulated tokens/s and speedup


def columns(report: dict) -> tuple[str, ...]:
    """The table's columns: the simulated ones after tokens/s when the run had a cost profile."""
    if not (report.get("settings") or {}).get("profile"):
        return COLUMNS
    return COLUMNS[:4] + SIM_COLUMNS + COLUMNS[4:]


def table_rows(report: dict) -> list[tuple[str, ...]]:
    sim = columns(report) != COLUMNS
    rows = []
    for spec in report["modes"]:
        label = spec["label"]
        status = report["status"][label]
        per = report["results"].get(label)
        if not per:
            rows.append((label, ALL) + ("-",) * (len(columns(report)) - 3) + (status,))
            continue
        for dom in [ALL, *report["domains"]]:
            m = per.get(dom)
            if m is None:
                continue
            simulated = (_f(m.get("sim_tokens_per_s"), ".1f"), _f(m.get("sim_speedup"), ".2f") + "x") if sim else ()
            rows.append(
                (
                    label if dom == ALL else "",
                    dom,
                    _f(m["tokens_per_s"], ".1f"),
                    _speedup(m),
                    *simulated,
                    _f(m["acceptance_rate"], ".1%"),
                    _f(m["tokens_per_pass"], ".2f"),
                    _f(m.get("draft_calls_per_token"), ".2f"),
                    _f(m["draft_fraction"], ".0%"),
                    _f(m["verify_fraction"], ".0%"),
                    f"{m['peak_memory_mb']:.0f}",
                    status if dom == ALL else "",
                )
            )
    return rows


def format_table(report: dict) -> str:
    """Fixed-width table: one block per mode, its 'all' row first, then each domain."""
    cols = columns(report)
    rows = [cols, *table_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = []
    for n, r in enumerate(rows):
        if n > 0 and r[0]:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=False))
            )
        )
    return "\n".join(lines)


def problems(report: dict) -> list[str]:
    """Human-readable lines for unavailable modes, errors and (loudly) mismatches."""
    out = [f"mode {lab} unavailable: {why}" for lab, why in report["unavailable"].items()]
    out += [f"mode {lab} failed: {why}" for lab, why in report["errors"].items()]
    prompts = report["prompts"]
    shown: dict[tuple[str, str], int] = {}
    for m in report["equality"]["mismatches"]:
        kind = "near-tie" if m.get("near_tie") else "BUG"
        key = (kind, m["label"])
        shown[key] = shown.get(key, 0) + 1
        if shown[key] > MAX_LISTED:
            continue
        p = prompts[m["prompt_index"]]
        gap = "" if m.get("gap") is None else f", plain's log-prob gap {m['gap']:.2g}"
        out.append(
            f"{kind}: {m['label']} differs from plain on prompt {p['id']} (repeat {m['repeat']}) at token "
            f"{m['position']}: plain {m['expected']} vs {m['got']} (lengths {m['expected_len']}/{m['got_len']}{gap})"
        )
    for (kind, label), n in shown.items():
        if n > MAX_LISTED:
            out.append(f"{kind}: {label}: {n - MAX_LISTED} more mismatch(es) listed in report.json")
    return out


def bugs(report: dict) -> list[dict]:
    """The mismatches that are not near-ties (report["equality"]["mismatches"] entries)."""
    return [m for m in report["equality"]["mismatches"] if not m.get("near_tie")]


def summary_lines(report: dict) -> list[str]:
    rec = report["recommendation"]
    eq = report["equality"]
    lines = []
    if eq["checked"]:
        n_bad = len(bugs(report))
        n_tie = len(eq["mismatches"]) - n_bad
        verdict = "all identical" if not eq["mismatches"] else (
            (f"{n_bad} MISMATCH(ES) - a decoding bug" if n_bad else "no bug")
            + (f"; {n_tie} near-tie(s) (plain's two tokens within {eq.get('near_tie_logprob', 1e-3):g} in "
               "log-prob there: a pass over many positions rounds differently; --bitwise-verify removes "
               "them)" if n_tie else ""))
        lines.append(
            f"equality check vs plain: {eq['comparisons']} generations compared, {verdict}"
        )
    else:
        lines.append(f"equality check skipped: {eq['reason']}")
    lines.append(f"recommendation: {rec['cli']} ({rec['reason']})")
    doms = [f"{d}: {v['label']} {v['speedup']:.2f}x" for d, v in rec["per_domain"].items()]
    lines.append("best per domain: " + "; ".join(doms))
    return lines


def _md_accept(report: dict) -> list[str]:
    out = []
    for label, per in report["acceptance_by_position"].items():
        curve = per.get(ALL) or []
        if not curve:
            continue
        cells = " | ".join(f"{c['rate']:.0%}" if c["rate"] is not None else "-" for c in curve)
        out.append(f"| {label} | {cells} |")
    if not out:
        return []
    k = max(len(per.get(ALL) or []) for per in report["acceptance_by_position"].values())
    head = "| mode | " + " | ".join(f"pos {i}" for i in range(1, k + 1)) + " |"
    sep = "|---" * (k + 1) + "|"
    return [
        "",
        "Acceptance by draft position (share of drafts at that position kept):",
        "",
        head,
        sep,
        *out,
    ]


def format_markdown(report: dict, plots: list[str] | None = None) -> str:
    meta, st = report["meta"], report["settings"]
    rows = table_rows(report)
    md = ["# edgespec bench report", ""]
    if meta.get("command"):
        md += ["Reproduce with:", "", "```sh", meta["command"], "```", ""]
    md.append(
        f"Model: `{meta.get('model', '?')}`; drafter: `{meta.get('drafter_name') or 'none'}`"
        + (f" (auto: `{meta['auto_drafter_name']}`)" if meta.get("auto_drafter_name") else "") + "; "
        f"{len(report['prompts'])} prompts in {len(report['domains'])} domains; max_tokens {st['max_tokens']}, "
        f"{st['repeats']} repeat(s) after {st['warmup']} warm-up round(s); temperature {st['temperature']}."
    )
    if st.get("interrupted"):
        md.append("**Interrupted**: these numbers cover only the generations that finished.")
    if meta.get("machine"):
        md.append("Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()) + ".")
    cols = columns(report)
    md += ["", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    md += ["| " + " | ".join(c or " " for c in r) + " |" for r in rows]
    md += [
        "",
        "tok/s: generated tokens / decode seconds (prefill excluded), median per prompt over repeats. "
        "speedup: vs plain on the same prompts in this run, [min-max] over repeats. accept: drafted tokens kept. "
        "tok/pass: tokens per verifier pass. calls/tok: drafter calls per generated token. "
        "draft/verify: share of decode time spent drafting/verifying. peak MB: MLX peak memory.",
        "",
    ]
    if st.get("profile"):
        md += [f"sim tok/s, sim x: tokens/s and speedup over plain on the simulated clock of cost profile "
               f"`{st['profile']}`" + (f", the verifier priced as `{st['verifier_shape']}`" if st.get("verifier_shape")
                                       else "") + " (docs/costs.md): the same run gives the same figures "
               "on any host.", ""]
    md += ["- " + line for line in summary_lines(report)]
    probs = problems(report)
    if probs:
        md += ["", "Problems:", ""] + ["- " + p for p in probs]
    md += _md_accept(report)
    for p in plots or []:
        md += ["", f"![{p}]({p})"]
    return "\n".join(md) + "\n"
