"""Benchmark decoding modes on a prompt set (the engine behind `edgespec bench`).

from edgespec.benchmark import load_prompts, parse_mode_specs, run_benchmark, build_report
specs = parse_mode_specs("plain,speculative,lookahead", available_modes())
run = run_benchmark(engine, load_prompts(), specs, max_tokens=64, repeats=2)
report = build_report(run)          # JSON-ready dict; see format.py / plots.py
"""

from edgespec.benchmark.prompts import BenchPrompt, load_prompts, parse_prompts, select_prompts
from edgespec.benchmark.report import build_report
from edgespec.benchmark.runner import BenchRun, run_benchmark
from edgespec.benchmark.specs import ModeSpec, parse_mode_specs

__all__ = [
    "BenchPrompt",
    "BenchRun",
    "ModeSpec",
    "build_report",
    "load_prompts",
    "parse_mode_specs",
    "parse_prompts",
    "run_benchmark",
    "select_prompts",
]
