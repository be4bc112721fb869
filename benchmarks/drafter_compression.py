"""What compressing a reduced-vocabulary (distilled) drafter costs, with and without calibration.

    python benchmarks/drafter_compression.py [--drafter FOLDER] [--compress int8 int4 palette4]
        [--calibrate 0 200] [--heldout-data FOLDER] [--examples 24]

For each compression and calibration budget, the drafter's linear layers are
compressed exactly as `edgespec convert --drafter-compress C --drafter-calibrate N`
does (converters/coreml_calibrate.compress_model), decoded back to dense weights
(the function the Core ML package computes, up to fp16: tests/test_coreml_*.py
check that with the numpy MIL executor) and measured on the verifier's greedy
answers to the held-out prompts (never used for training or calibration):

- agree: greedy agreement with the uncompressed drafter over every position
  (prompt and answer), the issue's ">= 95% on real text" figure;
- accept: held-out greedy acceptance at K=4 against the verifier (what drafting
  speed depends on), next to the uncompressed drafter's.

--slice N measures the first N layers of the verifier instead (full vocabulary,
the real-model slice of tests/test_coreml_real.py) on the held-out prompts
themselves, agreement only.

The held-out answers are built once with the distillation data builder into
--heldout-data (resumable; about 10 minutes on 2 cores for the built-in set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="verifier bundle (default: the default model's bundle)"
    )
    p.add_argument(
        "--drafter", default=None, help="distilled drafter folder (default: the shipped one)"
    )
    p.add_argument("--compress", nargs="+", default=["int8", "int4", "palette4"], help="variants")
    p.add_argument(
        "--calibrate", nargs="+", type=int, default=[0, 200], help="calibration step budgets"
    )
    p.add_argument("--heldout-data", default=str(ROOT / ".cache" / "bench" / "heldout-answers"),
                   help="folder for the verifier's held-out answers (built on first use)")  # fmt: skip
    p.add_argument("--examples", type=int, default=24, help="held-out answers measured")
    p.add_argument("--max-new", type=int, default=128, help="answer length when building the data")
    p.add_argument("--slice", type=int, default=None, metavar="N",
                   help="measure the first N layers of the verifier instead (full vocabulary, as in "
                   "tests/test_coreml_real.py) on the held-out prompts themselves: agreement only")  # fmt: skip
    args = p.parse_args()

    import mlx.core as mx
    import numpy as np
    from edgespec.converters.coreml_calibrate import calibration_sequences, compress_model
    from edgespec.converters.coreml_compress import decode_packed
    from edgespec.converters.default_model import default_bundle_path
    from edgespec.converters.distill.data import build_dataset, load_dataset
    from edgespec.converters.distill.evaluate import acceptance_fast
    from edgespec.converters.distill.prompts import (
        BUILTIN_HELDOUT,
        builtin_path,
        encode_item,
        read_prompts,
    )
    from mlx.utils import tree_flatten

    from edgespec.drafters import DATA
    from edgespec.drafters.distilled import VocabMap
    from edgespec.progress import progress_bar
    from edgespec.weights.loader import load, load_model_folder

    bundle = args.model or default_bundle_path(progress=False)
    heldout = read_prompts(builtin_path(BUILTIN_HELDOUT))
    if args.slice:  # full vocabulary, no map: texts are the held-out prompts, no acceptance
        sys.path.insert(0, str(ROOT / "tests"))
        from test_coreml_real import truncated_real

        make, tokenizer = truncated_real(bundle, args.slice)
        vmap, examples, name = None, None, f"first {args.slice} layers of the verifier"
        texts = [encode_item(tokenizer, it, 128) for it in heldout]
    else:
        folder = Path(args.drafter) if args.drafter else DATA / "smollm2-135m-instruct"
        vmap, name = VocabMap.load(folder), folder.name
        verifier = load(bundle, verify_hashes=False)
        tokenizer = verifier.tokenizer
        data = Path(args.heldout_data)
        if not (data / "complete").exists():
            with progress_bar(total=len(heldout), desc="held-out answers", unit="prompt") as bar:
                build_dataset(verifier, heldout, data, max_new=args.max_new,
                              progress=lambda done, total: bar.update(done - bar.n))  # fmt: skip
        examples = load_dataset(data)[1][: args.examples]
        texts = [vmap.to_reduced[np.asarray(e.tokens)].tolist() for e in examples]

        def make():
            return load_model_folder(folder, dtype=mx.float32)

    calibration = calibration_sequences(tokenizer, vmap)

    def greedy(model) -> np.ndarray:
        # a reduced vocabulary's slot 0 ("other") never wins, as in the runtime
        first = 0 if vmap is None else 1
        return np.concatenate([np.array(model(mx.array([t]))[0, :, first:]).argmax(-1) for t in texts])

    def accept(model) -> str:
        return "-" if vmap is None else f"{acceptance_fast(model, vmap, examples)['all']['rate']:.3f}"

    ref = greedy(make())
    print(f"drafter {name}: {len(ref)} positions in {len(texts)} held-out "
          f"{'prompts' if vmap is None else 'answers'}; {len(calibration)} calibration answers")  # fmt: skip
    print(f"uncompressed: K=4 acceptance {accept(make())}")
    print("compress  calib_steps  agree   accept  held_back_kl(before->after)  seconds")
    for c in args.compress:
        for steps in args.calibrate:
            t = time.perf_counter()
            with progress_bar(
                total=steps, desc=f"{c} x {steps}", unit="step", enable=steps > 0
            ) as bar:
                packed, stats = compress_model(make(), c, calibration, steps,
                                               progress=lambda *_: bar.update(1))  # fmt: skip
            secs = time.perf_counter() - t
            model = make()
            dense = dict(tree_flatten(model.parameters()))
            model.load_weights(
                [(n, mx.array(decode_packed(packed[n])).astype(dense[n].dtype)) for n in packed],
                strict=False,
            )
            got = greedy(model)
            acc = accept(model)
            kl = (
                f"{stats['held_back_kl_before']:.4f} -> {stats['held_back_kl_after']:.4f}"
                if stats
                else "-"
            )
            print(
                f"{c:9s} {steps:11d}  {(got == ref).mean():.3f}  {acc:5s}   {kl:27s}  {secs:7.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
