"""`edgespec doctor`: what this machine runs, and whether it works.

Device and versions; each kernel's verdict (a Metal kernel's self-check at first use on a Mac,
a CPU kernel's speed check, or, off Metal, that a Metal kernel is checked by the C++ emulator
in the test suite and its reference runs here); the drafter mode `auto` drafts with and why it
passed over each other one; Core ML's availability; a short plain-versus-auto probe on the
model; with --full, the Mac-only tests. --json prints all of it as one object for a bug report.
"""

from __future__ import annotations

import sys

HELP = "report the device, versions, kernel verdicts, auto's drafter and a short plain vs auto probe"
DESCRIPTION = (
    "Report what edgespec runs on this machine: device, MLX / coremltools / OS / Python versions, "
    "each kernel's verdict (native, fallback, slower, emulated, reference), the drafter mode auto "
    "drafts with and why every other one was passed over, Core ML's availability and compute units, "
    "and a short plain vs auto probe on the model (greedy, the same prompt). --full also runs the "
    "Mac-only tests (pytest -m 'macos or metal'), --json prints one object for a bug report."
)

PROBE_PROMPT = "Explain in a few sentences why the sky is blue, then list three everyday uses of prisms."  # a chat turn
PROBE_TOKENS = 64  # a reply's length in the probe (greedy): long enough for auto's drafts to pay


def add_arguments(p) -> None:
    from edgespec.apps.common import add_model_arguments  # deferred: CLI start-up

    add_model_arguments(p)
    p.add_argument("--probe-seconds", type=float, default=10.0, metavar="S",
                   help="time for the plain vs auto probe, split between the two (at least one reply each)")
    p.add_argument("--no-probe", action="store_true", help="skip the probe (the model is still loaded: "
                   "auto's drafter choice needs it)")
    p.add_argument("--full", action="store_true",
                   help="also run the Mac-only tests (pytest -m 'macos or metal'; needs a source checkout "
                   "with the test extra installed; skipped tests are reported as such off a Mac)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


# ---------------------------------------------------------------- the parts


def device_info() -> dict:
    import platform

    import mlx.core as mx

    from edgespec.kernels import verdicts
    from edgespec.kernels.spec import on_metal

    try:
        metal = bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 - builds without the metal module
        metal = False
    info = {"default": str(mx.default_device()), "metal_available": metal, "on_metal": on_metal(),
            "machine": platform.machine(), "system": platform.system(), "cpu": verdicts.scope()["cpu"] or None}
    if metal:
        try:
            d = mx.metal.device_info()
            info["gpu"] = str(d.get("device_name", "")) or None
            info["memory_bytes"] = int(d.get("memory_size", 0)) or None
        except Exception:  # noqa: BLE001 - older MLX: no device_info
            pass
    return info


def versions() -> dict:
    import importlib.metadata as md
    import platform

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    from edgespec.version import __version__

    mac = platform.mac_ver()[0]
    return {"edgespec": __version__, "python": platform.python_version(), "mlx": version("mlx"),
            "coremltools": version("coremltools"), "numpy": version("numpy"),
            "os": f"macOS {mac}" if mac else platform.platform()}


def kernel_verdicts() -> tuple[dict[str, str], dict[str, str]]:
    """(kernel -> verdict, kernel -> one-line note). A Metal kernel off Metal is "emulated"; on
    Metal, one entry per dtype it was checked at ("name/dtype"), or "unchecked" before its first
    use. Every other verdict kept for this machine (CPU kernels' speed checks) is listed as kept."""
    from edgespec.kernels import METAL_KERNELS, verdicts
    from edgespec.kernels.spec import on_metal

    kept = verdicts.all_verdicts()
    out, notes = {}, {}
    metal = on_metal()
    for name, (what, dtypes) in METAL_KERNELS.items():
        mine = [v for v in kept if v.kernel == name or (name.endswith("_") and v.kernel.startswith(name)
                                                           and v.kernel[len(name):].isdigit())]
        if not metal:
            out[name] = "emulated"
            notes[name] = (f"{what}; Metal only: checked by the C++ emulator in the test suite at "
                           f"{', '.join(dtypes)}; not run on this device (its reference or a CPU kernel runs)")
            continue
        if not mine:
            out[name] = "unchecked"
            notes[name] = f"{what}; self-checked at its first use on this Mac"
        for v in mine:
            key = f"{v.kernel}/{v.variant}" if v.variant else v.kernel
            out[key], notes[key] = v.status, f"{what}; {v.note}"
    for v in kept:
        if any(v.kernel == n or (n.endswith("_") and v.kernel.startswith(n)) for n in METAL_KERNELS):
            continue
        key = f"{v.kernel}/{v.variant}" if v.variant else v.kernel
        out[key], notes[key] = v.status, v.note
    return out, notes


def auto_drafter_info(engine, named: bool = False) -> dict:
    """auto's drafter for `engine` (registry.auto_drafter_choice) and the drafters loaded;
    `named`: a drafter was named at load (--drafter), which auto then drafts with."""
    from edgespec.drafters.registry import auto_drafter_choice

    chosen, passed = auto_drafter_choice(engine)
    attached = engine.drafter
    info = {"name": chosen, "passed_over": passed,
            "attached": type(attached).__name__ if attached is not None else None,
            "attached_device": attached.device if attached is not None else None,
            "loaded": type(engine.auto_drafter).__name__ if engine.auto_drafter is not None else None}
    if chosen is None:
        info["note"] = "auto drafts from weight-free sources only (context n-grams, history, the Jacobi window)"
    if named:
        info["note"] = "a drafter named at load: auto drafts with it"
    return info


def coreml_info(engine=None) -> dict:
    import importlib.util
    import platform

    from edgespec.drafters.coreml_runtime import COMPUTE_UNITS

    has_ct = importlib.util.find_spec("coremltools") is not None
    mac = platform.system() == "Darwin"
    info = {"coremltools_installed": has_ct, "can_run_packages": has_ct and mac,
            "compute_units_choices": list(COMPUTE_UNITS), "default_compute_units": COMPUTE_UNITS[0]}
    drafter = engine.drafter if engine is not None else None
    info["drafter_on_neural_engine"] = drafter is not None and drafter.device == "ane"
    if not mac:
        info["note"] = ("Core ML runs packages on macOS only; here a drafter package is checked by edgespec's "
                        "MIL executor in the tests and the MLX drafter stands in")
    elif not has_ct:
        info["note"] = "coremltools is not installed: Core ML drafters are replaced by their MLX twins"
    return info


def probe(engine, seconds: float) -> dict:
    """Greedy plain and auto replies to one prompt, each for about seconds / 2 (one reply at least,
    after a warm-up reply each): tokens per second, auto's speedup, tokens per verifier pass, and
    whether auto's first reply equals plain's token for token (it must)."""
    import time

    out: dict = {"seconds": seconds, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS}
    first: dict[str, list[int]] = {}
    messages = [{"role": "user", "content": PROBE_PROMPT}]
    for mode in ("plain", "auto"):
        r = engine.chat(messages, max_tokens=PROBE_TOKENS, mode=mode, temperature=0.0)  # warm-up
        first[mode] = r.tokens
        tokens = passes = replies = 0
        spent = 0.0
        while spent < seconds / 2 or replies == 0:  # (a reply may end at once: count replies, not tokens)
            t0 = time.perf_counter()
            r = engine.chat(messages, max_tokens=PROBE_TOKENS, mode=mode, temperature=0.0)
            spent += time.perf_counter() - t0
            tokens, passes, replies = tokens + len(r.tokens), passes + r.stats.verifier_passes, replies + 1
        out[mode] = {"replies": replies, "tokens": tokens, "seconds": round(spent, 3),
                     "tokens_per_s": round(tokens / spent, 2) if spent > 0 else None,
                     "tokens_per_pass": round(tokens / passes, 3) if passes else None}
    plain_rate, auto_rate = out["plain"]["tokens_per_s"], out["auto"]["tokens_per_s"]
    out["speedup"] = round(auto_rate / plain_rate, 3) if plain_rate and auto_rate else None
    out["same_output"] = first["auto"] == first["plain"]
    return out


def mac_tests() -> dict:
    """Run the Mac-only tests of a source checkout (pytest -m "macos or metal")."""
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tests = root / "tests"
    if not (tests / "conftest.py").is_file():
        return {"ran": False, "note": f"no test suite beside the package ({tests}): run from a source checkout"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "macos or metal", str(tests)]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    last = [ln for ln in r.stdout.strip().splitlines() if ln.strip()][-1:] or [r.stderr.strip()[-300:]]
    return {"ran": True, "command": shlex.join(["python", *cmd[1:]]), "exit_code": r.returncode, "summary": last[0]}


# ---------------------------------------------------------------- the report


def report(args) -> dict:
    from edgespec.apps.common import load_engine  # deferred: CLI start-up

    out: dict = {"device": device_info(), "versions": versions()}
    out["kernels"], out["kernel_notes"] = kernel_verdicts()
    engine = load_engine(args, progress=not args.json)
    out["model"] = {"path": str(engine.loaded.path) if engine.loaded.path is not None else None,
                    "numerics": str(getattr(engine.loaded, "numerics", "native"))}
    out["auto_drafter"] = auto_drafter_info(engine, named=args.drafter is not None)
    out["coreml"] = coreml_info(engine)
    out["probe"] = None if args.no_probe else probe(engine, args.probe_seconds)
    if not args.no_probe:
        out["kernels"], out["kernel_notes"] = kernel_verdicts()  # the probe's first uses checked some
    out["mac_tests"] = mac_tests() if args.full else None
    return out


def _print(r: dict) -> None:
    d, v = r["device"], r["versions"]
    print(f"device     {d['default']} ({d['system']} {d['machine']}{', ' + d['cpu'] if d.get('cpu') else ''}"
          f"{', Metal available' if d['metal_available'] else ', no Metal'}"
          f"{', GPU ' + d['gpu'] if d.get('gpu') else ''})")
    print("versions   " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in
                                   ("edgespec", "mlx", "coremltools", "numpy", "python")) + f"; {v['os']}")
    print(f"model      {r['model']['path']} (numerics: {r['model']['numerics']})")
    print("kernels")
    width = max(len(k) for k in r["kernels"]) if r["kernels"] else 0
    for k, status in r["kernels"].items():
        print(f"  {k.ljust(width)}  {status:<9}  {r['kernel_notes'].get(k, '')}")
    a = r["auto_drafter"]
    print(f"auto       drafts with: {a['name'] or 'no drafter (weight-free sources only)'}"
          + (f" ({a['note']})" if a.get("note") else ""))
    for name, why in a["passed_over"].items():
        print(f"  passed over {name}: {why}")
    c = r["coreml"]
    print(f"coreml     coremltools {'installed' if c['coremltools_installed'] else 'not installed'}, "
          f"{'can' if c['can_run_packages'] else 'cannot'} run packages here; compute units "
          f"{c['default_compute_units']} by default ({', '.join(c['compute_units_choices'])}); the drafter "
          f"{'runs' if c['drafter_on_neural_engine'] else 'does not run'} on the Neural Engine"
          + (f" ({c['note']})" if c.get("note") else ""))
    p = r["probe"]
    if p is None:
        print("probe      skipped (--no-probe)")
    else:
        print(f"probe      plain {p['plain']['tokens_per_s']} tok/s, auto {p['auto']['tokens_per_s']} tok/s "
              f"(x{p['speedup']}; {p['auto']['tokens_per_pass']} tokens a verifier pass); auto's output "
              + ("equals plain's" if p["same_output"] else "DIFFERS from plain's: please report this"))
    m = r["mac_tests"]
    if m is not None:
        print(f"mac tests  {m['summary'] if m['ran'] else m['note']}")


def run(args) -> int:
    import json
    import math

    if not (math.isfinite(args.probe_seconds) and args.probe_seconds > 0):
        raise ValueError(f"--probe-seconds must be a positive number of seconds, got {args.probe_seconds}")
    r = report(args)
    if args.json:
        print(json.dumps(r, indent=1, default=str))
    else:
        _print(r)
    failed = (r["probe"] is not None and not r["probe"]["same_output"]) or \
        (r["mac_tests"] is not None and r["mac_tests"].get("exit_code", 0) not in (0, 5))
    return 1 if failed else 0
