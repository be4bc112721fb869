"""`edgespec bench`: measure every decoding mode's speed and acceptance on a prompt set."""

from __future__ import annotations

import json
import os
import shlex
import sys

from edgespec.apps.common import add_model_arguments

HELP = "measure speed, acceptance and memory of the decoding modes on a prompt set"
DESCRIPTION = (
    "Run each decoding mode over a prompt set (built-in: code, summarization, chat, translation; or "
    "your JSONL), interleaving modes per prompt, with warm-up and repeats. Reports tokens/s, speedup "
    "vs plain in the same run, acceptance, tokens per verifier pass, time split and peak memory per "
    "mode and domain, checks that every mode reproduces plain's greedy output (exit code 3 if not), "
    "recommends a mode, and writes report.json, report.md and PNG plots."
)
EXIT_MISMATCH = 3


def add_arguments(p) -> None:
    add_model_arguments(p)
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--prompts",
        default=None,
        help='JSONL prompt file, one {"prompt": str | "messages": [...], "domain": str, "max_tokens": int} '
        "per line; None = the built-in set",
    )
    g.add_argument(
        "--modes",
        default=None,
        help="comma-separated mode specs NAME or NAME:KEY=VALUE:..., e.g. "
        "'plain,speculative:draft_tokens=4,speculative:drafter=self,lookahead:window=5:ngram=3' "
        "(drafter=SPEC attaches that drafter for that spec only); None = every registered mode; plain is "
        "always added as the reference",
    )
    g.add_argument("--domains", default=None, help="comma-separated domains to keep; None = all")
    g.add_argument(
        "--per-domain",
        type=int,
        default=None,
        help="use at most this many prompts per domain; None = all",
    )
    g.add_argument(
        "--max-tokens", type=int, default=128, help="reply length for prompts that set none"
    )
    g.add_argument("--repeats", type=int, default=3, help="measured runs of every (prompt, mode)")
    g.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up rounds per mode")
    g.add_argument(
        "--temperature",
        "--temp",
        type=float,
        default=0.0,
        help="0 = greedy (enables the equality check); >0 samples",
    )
    g.add_argument("--seed", type=int, default=None, help="random seed when sampling")
    g.add_argument(
        "--raw", action="store_true", help="feed 'prompt' text as is, without the chat template"
    )
    g.add_argument(
        "--out", default="bench-out", help="folder for report.json, report.md and the PNG plots"
    )
    g.add_argument(
        "--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)"
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--concurrency", default=None,
        help="comma-separated numbers of concurrent requests, e.g. 1,2,4,8: measure batched serving instead "
        "of the modes (aggregate and per-request tokens/s, time to first token, speculation off / forced on / "
        "chosen per batch; --repeats rounds per level); writes concurrency.json, concurrency.md and a plot",
    )
    g.add_argument(
        "--profile", default=None,
        help="also run every generation on the simulated clock of an Apple-silicon cost profile, "
        "PROFILE[:FORMAT] (e.g. m4-pro, m1-max:f16; weights q4_0 unless FORMAT says otherwise): `auto` "
        "decides by that chip's prices and the report adds simulated tokens/s and speedup, the same on "
        "any host; 'list' lists the profiles with the source of every number; default "
        "$EDGESPEC_COST_PROFILE (docs/costs.md)",
    )
    g.add_argument(
        "--verifier-shape", default=None,
        help="with --profile: price the verifier's passes as this published model (llama3-8b, qwen3-0.6b, "
        "qwen3-1.7b, qwen3-4b, qwen3-8b, ...; tokens stay the loaded model's); default: the loaded model's shape",
    )
    g.add_argument(
        "--draft-device", default=None, choices=("gpu", "ane", "cpu"),
        help="with --profile: the unit every drafter runs on (default: a Core ML drafter on the Neural "
        "Engine, others on the GPU)",
    )
    g.add_argument(
        "--per-client", type=int, default=3,
        help="with --concurrency: requests each client sends back to back in a round (default 3)",
    )


def _csv(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def reproduce_command(args) -> str:
    """The command line that reruns this benchmark (defaults left out)."""
    parts = ["edgespec", "bench"]
    for flag, value, default in (
        ("--model", args.model, None),
        ("--drafter", args.drafter, None),
        ("--memory-budget", getattr(args, "memory_budget", None), None),
        ("--numerics", getattr(args, "numerics", None), None),
        ("--prompts", args.prompts, None),
        ("--modes", args.modes, None),
        ("--domains", args.domains, None),
        ("--per-domain", args.per_domain, None),
        ("--max-tokens", args.max_tokens, None),
        ("--repeats", args.repeats, None),
        ("--warmup", args.warmup, None),
        ("--temperature", args.temperature, 0.0),
        ("--seed", args.seed, None),
        ("--out", args.out, None),
        ("--concurrency", getattr(args, "concurrency", None), None),
        ("--profile", getattr(args, "profile", None), None),
        ("--verifier-shape", getattr(args, "verifier_shape", None), None),
        ("--draft-device", getattr(args, "draft_device", None), None),
        ("--per-client", getattr(args, "per_client", 3) if getattr(args, "concurrency", None) else None, 3),
    ):
        if value is not None and value != default:
            parts += [flag, str(value)]
    parts += [f for f, on in (("--raw", args.raw), ("--no-plots", args.no_plots)) if on]
    if getattr(args, "bitwise_verify", None) is not None:
        parts.append("--bitwise-verify" if args.bitwise_verify else "--no-bitwise-verify")
    cmd = shlex.join(parts)
    from edgespec.kernels import cpu_blas  # deferred: CLI start-up

    preload = os.environ.get("LD_PRELOAD", "")
    if cpu_blas.describe(preload):
        cmd = f"LD_PRELOAD={shlex.quote(preload)} {cmd}"
    return cmd


def machine_info() -> dict:
    import platform  # deferred: CLI start-up

    import mlx.core as mx  # deferred: CLI start-up

    info = {
        "platform": platform.platform(terse=True),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "mlx": getattr(mx, "__version__", "?"),
    }
    from edgespec.kernels import cpu_blas  # deferred: CLI start-up

    blas = cpu_blas.describe()
    if blas:
        info["blas"] = blas
    return info


def run(args) -> int:
    from edgespec.apps.common import load_engine  # deferred: CLI start-up

    from edgespec.benchmark import (  # deferred: CLI start-up
        build_report,
        load_prompts,
        parse_mode_specs,
        run_benchmark,
        select_prompts,
    )
    from edgespec.benchmark.format import (  # deferred: CLI start-up
        bugs,
        format_markdown,
        format_table,
        problems,
        summary_lines,
    )
    from edgespec.modes import available_modes  # deferred: CLI start-up
    from edgespec.progress import progress_bar  # deferred: CLI start-up

    # Validate everything cheap before loading the model.
    if _profile(args) == "list":
        from edgespec.costs.profiles import PROFILES, describe  # deferred: CLI start-up

        for p in PROFILES.values():
            print("\n".join(describe(p)))
        return 0
    if args.concurrency is not None:
        if args.per_client < 1:
            raise ValueError(f"--per-client takes a positive integer, got {args.per_client}")
        return run_concurrency_bench(args, _levels(args.concurrency))
    specs = parse_mode_specs(args.modes, available_modes())
    prompts = select_prompts(load_prompts(args.prompts), _csv(args.domains), args.per_domain)
    os.makedirs(args.out, exist_ok=True)
    engine = load_engine(args, progress=not args.quiet)

    registered = set(available_modes()) | {"auto"}
    n_modes = sum(s.mode in registered for s in specs)
    total = n_modes * (args.warmup + args.repeats * len(prompts))
    with progress_bar(total=total, desc="bench", unit="gen", enable=not args.quiet) as bar:

        def on_progress(n: int, desc: str) -> None:
            bar.set_description_str(desc[:40])
            bar.update(n)

        run_ = run_benchmark(
            engine,
            prompts,
            specs,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            warmup=args.warmup,
            temperature=args.temperature,
            seed=args.seed,
            chat=not args.raw,
            on_progress=on_progress,
            profile=args.profile,
            verifier_shape=args.verifier_shape,
            draft_device=args.draft_device,
        )
    path = getattr(engine.loaded, "path", None)
    meta = dict(
        command=reproduce_command(args),
        # As the user named it: a resolved default path would only describe this machine.
        model=args.model or (f"default ({os.path.basename(str(path))})" if path else "default"),
        model_name=((engine.loaded.manifest.get("source") or {}).get("hub")  # a hub name, not its snapshot's commit
                    or (os.path.basename(str(path)) if path else "model")),
        drafter=args.drafter,  # the --drafter spec (for the recommended command line)
        drafter_name=getattr(engine.drafter, "name", None),
        auto_drafter_name=getattr(engine.auto_drafter, "name", None),  # what mode auto drafts with
        machine=machine_info(),
    )
    report = build_report(run_, meta)
    plots = [] if args.no_plots else _write_plots(report, args.out)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(format_markdown(report, plots))

    print(format_table(report))
    print()
    for line in summary_lines(report):
        print(line)
    for line in problems(report):
        print(("!! " if line.startswith("BUG") else "note: ") + line, file=sys.stderr)
    print(f"wrote {args.out}/report.json, report.md" + "".join(f", {p}" for p in plots))
    if run_.settings.get("interrupted"):
        print(
            "!! interrupted: the report covers only the generations that finished", file=sys.stderr
        )
    if bugs(report):
        print(
            f"!! {len(bugs(report))} greedy output(s) differ from plain: a decoding bug "
            "(see the list above and report.json 'equality')",
            file=sys.stderr,
        )
        return EXIT_MISMATCH
    return 130 if run_.settings.get("interrupted") else 0


def _profile(args) -> str | None:
    """--profile (else $EDGESPEC_COST_PROFILE), checked: ValueError names the known profiles."""
    from edgespec.costs import clock  # deferred: CLI start-up
    from edgespec.costs.model import SHAPES  # deferred: CLI start-up

    spec = args.profile if args.profile is not None else clock.from_env()
    if spec is not None and spec.strip().lower() == "list":
        args.profile = "list"
        return "list"
    if spec is not None:
        clock.parse(spec)
    elif args.verifier_shape is not None or args.draft_device is not None:
        raise ValueError("--verifier-shape and --draft-device price a cost profile's passes: give --profile too")
    if args.verifier_shape is not None and args.verifier_shape not in SHAPES:
        raise ValueError(f"unknown --verifier-shape {args.verifier_shape!r}; known: {', '.join(SHAPES)}")
    args.profile = spec
    return spec


def _levels(text: str) -> list[int]:
    try:
        levels = [int(t) for t in _csv(text) or []]
    except ValueError:
        levels = []
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"--concurrency takes positive integers separated by commas (e.g. 1,2,4,8), got {text!r}")
    return sorted(set(levels))


def run_concurrency_bench(args, levels: list[int]) -> int:
    """`--concurrency`: see edgespec.benchmark.concurrency."""
    from edgespec.apps.common import load_engine  # deferred: CLI start-up

    from edgespec.benchmark import load_prompts, select_prompts  # deferred: CLI start-up
    from edgespec.benchmark.concurrency import (  # deferred: CLI start-up
        format_concurrency,
        plot_concurrency,
        run_concurrency,
        summarise,
    )
    from edgespec.benchmark.runner import encode  # deferred: CLI start-up

    prompts = select_prompts(load_prompts(args.prompts), _csv(args.domains), args.per_domain)
    os.makedirs(args.out, exist_ok=True)
    engine = load_engine(args, progress=not args.quiet)
    ids = [encode(engine, p, not args.raw) for p in prompts]

    def on_progress(c: int, desc: str) -> None:
        if not args.quiet:
            print(f"  {desc}", file=sys.stderr, flush=True)

    report = run_concurrency(engine, ids, levels, args.max_tokens, rounds=max(args.repeats, 1),
                             on_progress=on_progress, per_client=args.per_client)
    report["summary"] = summarise(report)
    report["command"] = reproduce_command(args)
    report["machine"] = machine_info()
    table = format_concurrency(report)
    plots = []
    if not args.no_plots:
        plot_concurrency(report, os.path.join(args.out, "concurrency.png"))
        plots.append(os.path.join(args.out, "concurrency.png"))
    with open(os.path.join(args.out, "concurrency.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "concurrency.md"), "w") as f:
        f.write(f"# Concurrent requests\n\n`{report['command']}`\n\n{table}\n")
        if plots:
            f.write("\n![throughput and latency](concurrency.png)\n")
    print(table)
    print(f"wrote {args.out}/concurrency.json, concurrency.md" + "".join(f", {p}" for p in plots))
    wrong = sum(r["wrong"] for r in report["rows"])
    if wrong:
        print(f"!! {wrong} greedy repl(ies) differ from the request run alone: a batching bug", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def _write_plots(report: dict, out: str) -> list[str]:
    from edgespec.benchmark.plots import write_plots  # deferred: CLI start-up

    return write_plots(report, out)


if __name__ == "__main__":  # pragma: no cover
    from edgespec.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
