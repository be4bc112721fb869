"""PNG plots of a bench report (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

from edgespec.benchmark.report import ALL

SPEEDUP_PNG = "speedup.png"
ACCEPTANCE_PNG = "acceptance.png"


def _pyplot():
    try:
        import matplotlib  # optional: matplotlib
    except ImportError:
        raise ValueError(
            "plots need matplotlib: pip install 'edgespec[bench]' (or pass --no-plots)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    return plt


def plot_speedup(report: dict, path: Path) -> None:
    """Grouped bars: x = domain (plus 'all'), one bar per mode; error bars = min/max over repeats."""
    plt = _pyplot()
    groups = [*report["domains"], ALL]
    # The reference (plain) is the dashed line at 1.0, not a bar.
    ref = report["modes"][0]["label"]
    labels = [
        m["label"] for m in report["modes"] if m["label"] in report["results"] and m["label"] != ref
    ]
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(
        figsize=(max(6.0, 1.4 * len(groups) * max(1, len(labels)) ** 0.5 + 2), 4.2)
    )
    for j, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(groups):
            m = report["results"][label].get(g)
            if not m or m["speedup"] is None:
                continue
            xs.append(i + (j - (len(labels) - 1) / 2) * width)
            ys.append(m["speedup"])
            lo.append(
                m["speedup"] - (m["speedup_min"] if m["speedup_min"] is not None else m["speedup"])
            )
            hi.append(
                (m["speedup_max"] if m["speedup_max"] is not None else m["speedup"]) - m["speedup"]
            )
        status = report["status"][label]
        name = label if status == "ok" else f"{label} ({status})"
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name)
        for b, y, up in zip(bars, ys, hi, strict=False):
            ax.annotate(
                f"{y:.2f}",
                (b.get_x() + b.get_width() / 2, y + up),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
    if not labels:
        ax.text(
            0.5,
            0.5,
            "only the plain reference ran",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label=f"{ref} (reference)")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup vs plain (decode tokens/s)")
    ax.set_title(f"Speedup by domain and mode ({report['meta'].get('model_name', 'model')})")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(report: dict, path: Path) -> None:
    """Share of drafted tokens kept at each draft position, one line per drafting mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = 0
    for label, per in report["acceptance_by_position"].items():
        curve = [c for c in per.get(ALL) or [] if c["rate"] is not None]
        if not curve:
            continue
        ax.plot([c["position"] for c in curve], [c["rate"] for c in curve], marker="o", label=label)
        drawn += 1
    if not drawn:
        ax.text(
            0.5,
            0.5,
            "no mode drafted tokens in this run",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    else:
        ax.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator  # optional: matplotlib

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("accepted / drafted at this position")
    ax.set_title("Acceptance by draft position (all domains)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(report: dict, out: str | Path) -> list[str]:
    """Write both PNGs into `out`; returns their file names."""
    out = Path(out)
    plot_speedup(report, out / SPEEDUP_PNG)
    plot_acceptance(report, out / ACCEPTANCE_PNG)
    return [SPEEDUP_PNG, ACCEPTANCE_PNG]
