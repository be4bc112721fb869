"""First use of `auto` against plain decoding, in fresh processes, with a cold and a warm $EDGESPEC_HOME.

    python benchmarks/first_use.py [--model PATH] [--repeats 5] [--prompt "Say hi."] [--max-tokens 8]
        [--only generate|serve|steady]

What a new user meets first (issue #34), each run a new process:

- generate: `edgespec generate --prompt P --max-tokens N --stats json` as a subprocess;
  measured from the process start: the time to its first reply byte on stdout (import,
  model load, prefill, first token) and to its exit (wall), and the reply's tokens/s
  (its --stats). Modes auto and plain.
- serve: `edgespec serve --port PORT --mode auto|plain` started on a free port, /health
  polled until it answers, then the first streaming /v1/chat/completions request timed
  to its first content chunk (the server's time to first token), and the server stopped.

Both with two $EDGESPEC_HOME folders made for the run, holding the model files of the
source home (--home, default: $EDGESPEC_HOME or ~/.cache/edgespec) as links, so the
model is never fetched or copied again: *cold* has no calibration (its calibration
folder is removed before every auto run: the first process on this machine); *warm*
holds what earlier processes learnt (primed by --prime auto runs first, then kept as the
runs go). The runs are interleaved (every repeat runs every mode x home, in an order
that turns), so load spikes on shared cores hit all alike; reported: medians and the
auto / plain ratios of the medians (goal <= 1.1 for times, >= 1.0 for tokens/s).

And what learning instead of measuring costs once auto has run a while:

- steady (--only steady; in this process): three engines on one loaded model, side by
  side: plain; auto starting from the prior (no persisted file) and learning; auto whose
  whole curve is timed up front (`calibration.measure`, what every process did before).
  --steady-prompts prompts of benchmarks/prompts/mixed.jsonl's --steady-domains, each
  run on the three in turning order, --steady-tokens tokens, greedy; reported: tokens/s
  over all prompts against plain's, tokens per pass, and both curves at a few sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("plain", "auto")
HOMES = ("cold", "warm")


PRIME_TOKENS = 48  # the priming replies' length at least


def make_home(src: Path, root: Path, name: str) -> Path:
    """A home holding links to everything of `src` but its calibration and history."""
    home = root / name
    home.mkdir()
    for entry in src.iterdir():
        if entry.name not in ("calibration", "history"):
            (home / entry.name).symlink_to(entry.resolve())
    return home


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgespec.cli", *args]


def run_generate(home: Path, mode: str, args, max_tokens: int | None = None) -> dict:
    cmd = cli("generate", "--prompt", args.prompt, "--max-tokens", str(max_tokens or args.max_tokens), "--mode", mode,
              "--stats", "json", *(["--model", args.model] if args.model else []))
    env = {**os.environ, "EDGESPEC_HOME": str(home)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - t0
    out = first + proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"edgespec generate --mode {mode} failed ({code}):\n{err[-2000:]}")
    stats = next((json.loads(line) for line in reversed(err.splitlines()) if line.startswith("{")), {})
    return {"ttft": ttft, "wall": wall, "tok_s": float(stats.get("tokens_per_s") or 0.0),
            "text": out.decode(errors="replace").strip()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(home: Path, mode: str, args) -> dict:
    import httpx

    port = free_port()
    cmd = cli("serve", "--host", "127.0.0.1", "--port", str(port), "--mode", mode,
              *(["--model", args.model] if args.model else []))
    env = {**os.environ, "EDGESPEC_HOME": str(home)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"edgespec serve --mode {mode} exited ({proc.returncode})")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 600:
                raise SystemExit("the server did not answer /health within 10 minutes")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        body = {"model": "default", "stream": True, "max_tokens": args.max_tokens,
                "messages": [{"role": "user", "content": args.prompt}]}
        t1 = time.perf_counter()
        first, text = None, []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    piece = c.get("delta", {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter() - t1
                    text.append(piece)
        total = time.perf_counter() - t1
        return {"ttft": first if first is not None else total, "reply": total, "ready": ready,
                "text": "".join(text).strip()}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def calibration_files(home: Path) -> int:
    d = home / "calibration"
    return len(list(d.glob("*.json"))) if d.is_dir() else 0


def steady(args) -> int:
    os.environ["EDGESPEC_CALIBRATION"] = "off"  # the learning engine starts from the prior, writes nothing
    import edgespec
    import edgespec.calibration as cal
    from edgespec.drafters import attach_drafter
    from edgespec.engine import Engine
    from edgespec.progress import progress_bar

    loaded = edgespec.load(args.model, progress=False, history="off").loaded

    def engine():
        e = Engine(loaded, history="off")
        attach_drafter(e, None)
        return e

    engines = {"plain": engine(), "learnt": engine(), "measured": engine()}
    t0 = time.perf_counter()
    cal.measure(engines["measured"])
    print(f"timing the whole curve up front took {time.perf_counter() - t0:.1f} s")
    domains = args.steady_domains.split(",")
    path = Path(__file__).parent / "prompts" / "mixed.jsonl"
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["domain"] in domains]
    rows = rows[: args.steady_prompts]
    tot = {k: [0, 0.0, 0] for k in engines}  # tokens, decode seconds, verifier passes
    names = list(engines)
    with progress_bar(total=len(rows) * len(names), desc="steady state", unit="reply") as bar:
        for i, r in enumerate(rows):
            msgs = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
            outs = {}
            for name in names[i % 3:] + names[: i % 3]:
                res = engines[name].generate(messages=msgs, max_tokens=args.steady_tokens,
                                             mode="plain" if name == "plain" else "auto")
                outs[name] = res.tokens
                t = tot[name]
                t[0], t[1], t[2] = t[0] + len(res.tokens), t[1] + res.stats.decode_s, t[2] + res.stats.verifier_passes
                bar.update(1)
            if len({tuple(v) for v in outs.values()}) != 1:
                raise SystemExit(f"{r['id']}: auto's reply differs from plain's")
    plain = tot["plain"][0] / tot["plain"][1]
    print(f"\n{len(rows)} prompts ({args.steady_domains}), {args.steady_tokens} tokens, greedy; every reply identical")
    for k, (n, secs, passes) in tot.items():
        print(f"  {k:8} {n / secs:6.1f} tok/s = {n / secs / plain:.2f}x plain, {n / max(passes, 1):.2f} tokens/pass")
    learnt, measured = (cal.cost_store(engines[k]).costs for k in ("learnt", "measured"))
    print("  sizes the learning engine measured:", sorted(learnt.seen))
    for T in (1, 2, 4, 8, 16, 32):
        print(f"  T={T:2}: learnt {learnt.verify(T) * 1000:.0f} ms, timed up front (then learnt) "
              f"{measured.verify(T) * 1000:.0f} ms")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--model", default=None, help="bundle/GGUF (default: the default model)")
    ap.add_argument("--home", default=None, help="the home holding the model files (default: $EDGESPEC_HOME "
                    "or ~/.cache/edgespec), linked into the run's homes (its calibration and history are not)")
    ap.add_argument("--prompt", default="Say hi.")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="runs of every mode x home, interleaved")
    ap.add_argument("--prime", type=int, default=2, help="auto runs that fill the warm home's calibration first")
    ap.add_argument("--only", choices=["generate", "serve", "steady"], default=None,
                    help="one measurement (default: generate and serve)")
    ap.add_argument("--steady-domains", default="rag,code_edit,code", help="steady: mixed.jsonl domains")
    ap.add_argument("--steady-prompts", type=int, default=15, help="steady: prompts (in file order)")
    ap.add_argument("--steady-tokens", type=int, default=96, help="steady: max tokens per reply")
    ap.add_argument("--json", default=None, help="also write every sample to this file")
    args = ap.parse_args()
    if args.repeats < 1 or args.max_tokens < 1:
        raise SystemExit("--repeats and --max-tokens must be >= 1")

    if args.only == "steady":
        return steady(args)
    from edgespec.paths import home as edgespec_home
    from edgespec.progress import progress_bar

    src = Path(args.home).expanduser() if args.home else edgespec_home()
    if args.model is None:  # the default model: fetched into the source home once, before anything is timed
        env = {**os.environ, "EDGESPEC_HOME": str(src)}
        subprocess.run(cli("generate", "--prompt", "hi", "--max-tokens", "1", "--mode", "plain", "--stats", "none"),
                       env=env, check=True, stdout=subprocess.DEVNULL)
    kinds = [k for k in ("generate", "serve") if args.only in (None, k)]
    samples: dict = {k: {(m, h): [] for m in MODES for h in HOMES} for k in kinds}
    root = Path(tempfile.mkdtemp(prefix="edgespec-first-use-"))
    try:
        homes = {h: make_home(src, root, h) for h in HOMES}
        with progress_bar(total=args.prime, desc="priming the warm home", unit="run") as bar:
            for _ in range(args.prime):
                # Long enough to time a pass the curve keeps: a short reply may be all Jacobi-window
                # rounds, which teach the curve nothing (their extra tokens are the window's).
                run_generate(homes["warm"], "auto", args, max(args.max_tokens, PRIME_TOKENS))
                bar.update(1)
        if args.prime and not calibration_files(homes["warm"]):
            raise SystemExit("the priming runs wrote no calibration file (is EDGESPEC_CALIBRATION off?)")
        order = [(k, m, h) for k in kinds for h in HOMES for m in MODES]
        with progress_bar(total=args.repeats * len(order), desc="fresh processes", unit="run") as bar:
            for r in range(args.repeats):
                turn = r % len(order)
                for k, m, h in order[turn:] + order[:turn]:
                    if h == "cold":
                        shutil.rmtree(homes["cold"] / "calibration", ignore_errors=True)
                    res = (run_generate if k == "generate" else run_serve)(homes[h], m, args)
                    samples[k][(m, h)].append(res)
                    bar.update(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    print(f"\n{args.repeats} fresh processes per mode and home (medians), prompt {args.prompt!r}, "
          f"--max-tokens {args.max_tokens}")
    for k in kinds:
        fields = [("ttft", "first token", "s"), ("wall", "exit", "s"), ("tok_s", "reply tok/s", "")] \
            if k == "generate" else [("ttft", "first token", "s"), ("reply", "whole reply", "s"),
                                     ("ready", "start to /health", "s")]
        print(f"\n{k}:")
        for h in HOMES:
            parts = []
            for f, label, unit in fields:
                p = med(s[f] for s in samples[k][("plain", h)])
                a = med(s[f] for s in samples[k][("auto", h)])
                parts.append(f"{label} auto {a:.2f}{unit} / plain {p:.2f}{unit} = {a / p if p else float('nan'):.2f}x")
            print(f"  {h:4} home: " + "; ".join(parts))
        same = all(s["text"] == samples[k][("plain", "cold")][0]["text"] for v in samples[k].values() for s in v)
        print(f"  every reply identical: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {f"{m}/{h}": v for (m, h), v in d.items()}
                                               for k, d in samples.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
