"""Export the first N layers of a real model to Core ML in every compression and report
package sizes and executor-vs-MLX differences (numpy MIL executor, fp32 and fp16 emulation).

    python benchmarks/coreml_drafter.py [--model BUNDLE] [--layers 2] [--context 96] [--tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="bundle/GGUF/HF folder (default: the default model's bundle)"
    )
    p.add_argument("--layers", type=int, default=2, help="how many leading layers form the drafter")
    p.add_argument("--context", type=int, default=96, help="Core ML KV buffer length")
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk")
    p.add_argument("--tokens", type=int, default=48, help="tokens of text to teacher-force")
    p.add_argument(
        "--compress", nargs="+", default=["none", "int8", "int4", "palette4"], help="variants"
    )
    args = p.parse_args()

    from coreml_support import executor_logits, fp16_weights, reference_logits, rel_err
    from edgespec.converters.coreml_export import export_drafter
    from edgespec.converters.default_model import default_bundle_path
    from edgespec.converters.mil_executor import MILExecutor
    from test_coreml_real import TEXT, truncated_real

    make, tok = truncated_real(args.model or default_bundle_path(progress=False), args.layers)
    tokens = tok.encode(TEXT, add_special_tokens=False)[: args.tokens]
    ref = reference_logits(make(), tokens)[args.chunk - 1 :]
    ref16 = reference_logits(fp16_weights(make()), tokens)[args.chunk - 1 :]
    print(
        f"{args.layers} layers, context {args.context}, {len(ref)} positions (prefill {args.chunk} + decode)"
    )
    print(
        "compress   size_MB  cpu_s  fp32_rel_err(vs fp16 weights)  fp16emu_rel_err  greedy_agree(fp16emu)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.compress:
            path = Path(tmp) / f"{c}.mlpackage"
            t = time.process_time()
            export_drafter(
                make(), path, context_length=args.context, prefill_chunk=args.chunk, compress=c
            )
            cpu = time.process_time() - t
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
            g32 = executor_logits(MILExecutor(path, fp16=False), tokens, args.chunk)
            g16 = executor_logits(MILExecutor(path, fp16=True), tokens, args.chunk)
            e32 = rel_err(g32, ref16) if c == "none" else float("nan")
            agree = float((g16.argmax(-1) == ref.argmax(-1)).mean())
            print(
                f"{c:9s} {size:8.1f} {cpu:6.1f} {e32:30.2e} {rel_err(g16, ref):16.2e} {agree:21.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
