"""Two checkouts of edgespec side by side: `auto`/plain and plain tokens/s, runs alternating.

    LD_PRELOAD=$(make -s preload) python benchmarks/side_by_side.py \
        --tree old=/path/to/old/checkout --tree new=. [--prompts FILE] [--rounds 3] [--per-domain 2] [--own-shim]

Each tree runs `edgespec bench --modes plain,auto` with its own virtual environment's `edgespec`
(TREE/.venv/bin/edgespec) and its own $EDGESPEC_HOME (under --work; the downloaded default
model is copied there, so each converts it with its own code). Rounds alternate the trees'
order (A B, B A, ...), so the machine's drift hits both alike. Prints, per tree, the mean over
rounds of auto's speedup per domain and overall, plain's tokens/s, and the ratio of the last
tree to the first; exit 3 if any run's greedy output differed from plain (the bench's own check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_bench(tree: Path, home: Path, args, out: Path) -> dict:
    env = dict(os.environ, EDGESPEC_HOME=str(home), PYTHONUNBUFFERED="1")
    if args.own_shim:  # the CBLAS shim this tree built (its few-row kernel is part of what is compared)
        env["LD_PRELOAD"] = str(tree / ".cache" / "lib" / "libedgespec_cblas.so")
    cmd = [str(tree / ".venv" / "bin" / "edgespec"), "bench", "--prompts", str(args.prompts),
           "--modes", "plain,auto", "--max-tokens", str(args.max_tokens), "--repeats", "1",
           "--per-domain", str(args.per_domain), "--out", str(out), "--no-plots", "--quiet"]
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if p.returncode not in (0, 3):
        sys.exit(f"{tree}: bench failed ({p.returncode}):\n{p.stderr[-2000:]}")
    rep = json.loads((out / "report.json").read_text())
    rep["_exit"] = p.returncode
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a checkout with its own .venv (give two or more)")
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts" / "mixed.jsonl",
                    help="prompt set (JSONL, as edgespec bench --prompts)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--per-domain", type=int, default=2, help="prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per reply")
    ap.add_argument("--own-shim", action="store_true",
                    help="run each tree with the CBLAS shim it built (TREE/.cache/lib/libedgespec_cblas.so, "
                         "`make openblas` there) instead of this process's LD_PRELOAD")
    ap.add_argument("--work", type=Path, default=None, help="folder for homes and reports (default: a temporary one)")
    ap.add_argument("--model-file", type=Path, default=None,
                    help="the default model's downloaded GGUF to seed each home with "
                         "(default: $EDGESPEC_HOME or ~/.cache/edgespec downloads/)")
    args = ap.parse_args(argv)
    trees = []
    for t in args.tree:
        name, _, path = t.partition("=")
        trees.append((name, Path(path).resolve()))
    if args.own_shim:
        missing = [str(p) for _, p in trees if not (p / ".cache" / "lib" / "libedgespec_cblas.so").is_file()]
        if missing:
            ap.error(f"--own-shim: no .cache/lib/libedgespec_cblas.so in {', '.join(missing)} (run `make openblas` there)")
    work = args.work or Path(tempfile.mkdtemp(prefix="edgespec-sbs-"))
    src = args.model_file
    if src is None:
        base = Path(os.environ.get("EDGESPEC_HOME") or Path.home() / ".cache" / "edgespec")
        found = sorted((base / "downloads").glob("*.gguf"))
        src = found[0] if found else None
    for name, _ in trees:
        d = work / name / "home" / "downloads"
        d.mkdir(parents=True, exist_ok=True)
        if src and not (d / src.name).exists():
            shutil.copy2(src, d / src.name)
    args.prompts = args.prompts.resolve()
    speed: dict[str, dict[str, list[float]]] = {n: {} for n, _ in trees}
    plain: dict[str, list[float]] = {n: [] for n, _ in trees}
    auto: dict[str, list[float]] = {n: [] for n, _ in trees}
    differs = 0
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name, tree in order:
            rep = run_bench(tree, work / name / "home", args, work / name / f"round{r}")
            differs += rep["_exit"] == 3
            res = rep["results"]
            for dom, m in res.get("auto", {}).items():
                if m.get("speedup"):
                    speed[name].setdefault(dom, []).append(m["speedup"])
            tps = next(iter(res.get("plain", {}).values()), {}).get("tokens_per_s")
            allp = res.get("plain", {}).get("all", {}).get("tokens_per_s") or tps
            plain[name].append(allp)
            auto[name].append(res.get("auto", {}).get("all", {}).get("tokens_per_s") or 0.0)
            print(f"round {r} {name}: auto/plain {speed[name].get('all', [None])[-1]}, plain {allp:.1f} tok/s",
                  flush=True)
    doms = sorted({d for s in speed.values() for d in s}, key=lambda d: (d != "all", d))
    print("\n| tree | plain tok/s | auto tok/s | " + " | ".join(doms) + " |")
    print("|---|---|---|" + "---|" * len(doms))
    for name, _ in trees:
        cells = [f"{statistics.mean(speed[name][d]):.2f}" if speed[name].get(d) else "-" for d in doms]
        print(f"| {name} | {statistics.mean(plain[name]):.1f} | {statistics.mean(auto[name]):.1f} | "
              + " | ".join(cells) + " |")
    (a, _), (b, _) = trees[0], trees[-1]
    if speed[a].get("all") and speed[b].get("all"):
        print(f"\n{b}/{a}: auto/plain ratio {statistics.mean(speed[b]['all']) / statistics.mean(speed[a]['all']):.3f}, "
              f"plain tok/s {statistics.mean(plain[b]) / statistics.mean(plain[a]):.3f}, "
              f"auto tok/s {statistics.mean(auto[b]) / statistics.mean(auto[a]):.3f}")
    print(f"reports under {work}; runs whose greedy output differed from plain: {differs}")
    return 3 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
