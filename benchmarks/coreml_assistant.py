"""What crosses into Gemma 4's assistant package: key/value slots sent as deltas vs resending the context.

A tiny random Gemma 4 and an assistant taught to draft its greedy continuation (tests/
test_arch_moe_gemma4.py), converted with `convert --drafter`; speculative decoding with the
package run by the numpy MIL executor (greedy output checked equal to plain). Counted from
the backend's call log, side by side in one run: the key/value slots the `append_S` calls
write (the prompt's windows plus each round's delta, padding included), against resending
positions 0..p-1 once per round, and before every draft step.

    python benchmarks/coreml_assistant.py [--tokens 48] [--k 2 3 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    args = ap.parse_args()
    from edgespec.converters.convert import convert
    from edgespec.converters.coreml_assistant import AssistantExecutorBackend
    from edgespec.converters.mil_executor import MILExecutor
    from test_arch_moe_gemma4 import (
        SHORT,
        assistant_checkpoint,
        checkpoint,
        hf_greedy,
        teach_assistant,
    )

    import edgespec
    from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        verifier = checkpoint(tmp / "hf", "gemma4_text", seed=1)
        plain = hf_greedy(verifier, SHORT, args.tokens)
        teach_assistant(assistant_checkpoint(tmp / "a", seed=5, ordered=False), verifier,
                        SHORT[-1:] + plain).save_pretrained(tmp / "a")
        convert(tmp / "hf", tmp / "b", quantize="none", dtype="float32", progress=False, drafter=tmp / "a",
                drafter_options={"context_length": len(SHORT) + args.tokens + 8, "prefill_chunk": 16})
        engine = edgespec.load(tmp / "b", progress=False, history="off")
        info = json.loads((tmp / "b" / "manifest.json").read_text())["drafter"]["coreml"]
        backend = AssistantExecutorBackend(MILExecutor(tmp / "b" / "drafter.mlpackage"))
        engine.drafter = CoreMLAssistantDrafter(backend, info, engine.model, device="cpu")
        print(f"prompt {len(SHORT)} tokens, {args.tokens} generated")
        for k in args.k:
            backend.calls.clear()
            r = engine.generate(SHORT, max_tokens=args.tokens, mode="speculative", draft_tokens=k)
            assert r.tokens == plain, "speculative output differs from plain"
            sent = sum(int(f.split("_")[1]) for f, _ in backend.calls if f.startswith("append"))
            steps = [p for f, p in backend.calls if f == "draft"]
            rounds = sorted(set(steps))  # p grows every round
            print(f"k={k}: drafted {r.stats.drafted}, accepted {r.stats.accepted}; slots sent {sent}; "
                  f"resending per round {sum(rounds)} ({sum(rounds) / sent:.1f}x), "
                  f"per draft step {sum(steps)} ({sum(steps) / sent:.1f}x)")


if __name__ == "__main__":
    main()
