"""`edgespec convert`: a Hugging Face folder or GGUF file to an MLX bundle."""

from __future__ import annotations

import argparse
import sys

# Calibration steps for a 4-bit Core ML drafter (converters/coreml_calibrate.py). Measured on the
# shipped drafter (docs/coreml.md): 200 steps take ~6 min on 2 cores and raise greedy agreement
# palette4 0.79 -> 0.89, int4 0.86 -> 0.93; int8 (0.98) got worse, so it is not tuned by default.
CALIBRATE_STEPS = 200
CALIBRATED_BY_DEFAULT = ("int4", "palette4")

HELP = "convert a Hugging Face folder or GGUF file into an edgespec bundle"
DESCRIPTION = (
    "Convert SRC (a Hugging Face model folder or a GGUF file) into an edgespec bundle at OUT: "
    "manifest.json, MLX weights and tokenizer, written to a temp folder and renamed into place."
)


def add_arguments(p) -> None:
    p.add_argument(
        "src",
        help="Hugging Face model folder (config.json + *.safetensors), .gguf file, or a hub name "
        "ORG/NAME[@REVISION][:QUANT] (fetched once; its paired drafter, when in the cache, goes into the "
        "bundle unless --drafter is given); with --add-drafter: the existing bundle",
    )
    p.add_argument("out", nargs="?", default=None, help="output bundle folder (not with --add-drafter)")
    p.add_argument(
        "--add-drafter",
        default=None,
        metavar="DRAFTER_SRC",
        help="add a drafter to the existing bundle SRC (atomically; vocabulary checked; --force replaces "
        "a drafter it already has); takes the --drafter-* and --coreml options",
    )
    p.add_argument(
        "--quantize",
        choices=["none", "native", "4", "8"],
        default=None,
        help="weights: none = dense (an MLX-quantized folder keeps its quantization); native = keep a "
        "GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K blocks exactly and re-quantize Q2_K/Q3_K/Q6_K to "
        "2/3/6 bits (error reported); 4/8 = MLX affine quantization. Default: dense on the CPU "
        "(faster there), native/4 on Metal",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="dtype of dense weights (default: float32 on the CPU, float16 on Metal)",
    )
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="group size for --quantize 4/8")
    p.add_argument(
        "--drafter",
        default=None,
        metavar="DRAFTER_SRC",
        help="also bundle a drafter (HF folder, GGUF, bundle or MLX folder with the verifier's vocabulary, "
        "a DFlash block drafter's folder, or an EAGLE-3 head's folder in either published layout, "
        "docs/dflash.md, docs/eagle3.md): OUT/drafter/ in MLX and OUT/drafter.mlpackage for the Neural "
        "Engine; 'mtp': export the source's own MTP head (Qwen3.5 mtp.* weights) to OUT/drafter.mlpackage",
    )
    p.add_argument(
        "--drafter-compress",
        choices=["none", "int8", "int4", "palette4"],
        default="none",
        help="compress the Core ML drafter's linear layers: int8 per channel, int4 per block of 32, "
        "or a 4-bit k-means palette (none = fp16)",
    )
    p.add_argument(
        "--drafter-calibrate",
        type=int,
        default=None,
        metavar="STEPS",
        help="with --drafter-compress: tune the compressed weights for STEPS steps so the drafter's "
        "next-token distributions match the uncompressed ones on built-in answer text (quantization-aware; "
        "~6 min for 200 steps of a 2-layer drafter on 2 CPU cores; kept only if the KL on held-back "
        "answers falls); 0 = plain rounding. Either way convert reports how often the compressed "
        "drafter's greedy token is the uncompressed one's on held-back answers. "
        f"Default {CALIBRATE_STEPS} for int4 and palette4, 0 for int8",
    )
    p.add_argument(
        "--coreml",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="export the drafter to Core ML (drafter.mlpackage, macOS 15+); --no-coreml writes MLX only",
    )
    p.add_argument(
        "--drafter-context", type=int, default=1024, help="Core ML drafter KV buffer length in tokens"
    )
    p.add_argument(
        "--drafter-chunk", type=int, default=64, help="Core ML drafter prefill chunk in tokens"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing OUT, but only an edgespec bundle (or a drafter folder or Core ML package "
        "edgespec wrote) holding nothing else, or an empty folder; any other folder or file, the home "
        "folder, / and folders holding the working folder are refused, nothing deleted. "
        "With --add-drafter: replace the bundle's drafter",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from edgespec.converters.convert import add_drafter, convert  # deferred: CLI start-up

    drafter_options = {
        "coreml": args.coreml,
        "compress": args.drafter_compress,
        "calibrate": args.drafter_calibrate
        if args.drafter_calibrate is not None
        else (CALIBRATE_STEPS if args.drafter_compress in CALIBRATED_BY_DEFAULT else 0),
        "context_length": args.drafter_context,
        "prefill_chunk": args.drafter_chunk,
    }
    if args.add_drafter is not None:
        if args.out is not None or args.drafter is not None:
            raise ValueError("--add-drafter takes the bundle as its only folder "
                             "(edgespec convert BUNDLE --add-drafter DRAFTER_SRC): no OUT, no --drafter")
        manifest = add_drafter(args.src, args.add_drafter, force=args.force, progress=not args.quiet,
                               drafter_options=drafter_options)  # fmt: skip
        out = args.src
    else:
        if args.out is None:
            raise ValueError("OUT is required (edgespec convert SRC OUT, or SRC --add-drafter DRAFTER_SRC)")
        src, drafter = _named_source(args)
        manifest = convert(
            src,
            args.out,
            quantize=args.quantize,
            dtype=args.dtype,
            group_size=args.group_size,
            force=args.force,
            progress=not args.quiet,
            drafter=drafter,
            drafter_options=drafter_options,
        )
        out = args.out
    size = sum(f["size"] for f in manifest["files"].values())
    print(f"wrote {out} ({size / 1e6:.1f} MB, vocab {manifest['vocab_hash']})")
    for line in gguf_summary((manifest.get("source") or {}).get("gguf_types") or {}):
        print(line)
    q = manifest.get("quantization")
    if q:
        exact = [t for t, e in ((manifest.get("source") or {}).get("gguf_types") or {}).items()
                 if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")]
        hint = f"; --quantize native keeps {', '.join(sorted(exact))} exactly" if exact else ""
        print(f"  re-quantized to {q['bits']}-bit, groups of {q['group_size']}: relative error up to "
              f"{100 * q['max_rel_error']:.2f}%{hint}")
    coreml = (manifest.get("drafter") or {}).get("coreml")
    if (manifest.get("drafter") or {}).get("coreml_note"):
        print(f"  drafter: MLX only ({manifest['drafter']['coreml_note']})")
    if coreml:
        pkg = sum(f["size"] for n, f in manifest["files"].items() if n.startswith(coreml["package"] + "/"))
        print(f"  drafter: {coreml['package']} ({pkg / 1e6:.1f} MB, {coreml['compression']}, "
              f"context {coreml['context_length']}, functions {', '.join(coreml['functions'])})")
        agreement = coreml.get("agreement")
        if agreement:
            share, target = agreement["held_back_greedy"], agreement["target"]
            print(f"  drafter: {coreml['compression']} keeps the uncompressed drafter's greedy token on "
                  f"{share:.1%} of {agreement['positions']} positions of held-back answers")
            if share < target:
                finer = "none" if coreml["compression"] == "int8" else "int8, or none"
                print(f"  warning: that is below {target:.0%}: drafting may accept less; a finer "
                      f"--drafter-compress ({finer}) keeps more (docs/coreml.md)")
    return 0


def _named_source(args):
    """(SRC, --drafter) as local paths: hub names fetched once; a model named on the hub brings the
    drafter paired with it when that is in the cache and no --drafter was given."""
    from edgespec.apps.common import resolve_model_arg  # deferred: CLI start-up

    from edgespec.hub.names import as_hub_name  # deferred: CLI start-up

    src, drafter = args.src, resolve_model_arg(args.drafter, progress=not args.quiet)
    name = as_hub_name(src)
    if name is None:
        return src, drafter
    from edgespec.hub.fetch import resolve  # deferred: CLI start-up

    r = resolve(name, progress=not args.quiet, report=None if args.quiet else _say)
    for note in r.notes:
        _say(note)
    if drafter is None and r.drafter is not None:
        _say(f"storing the paired drafter {r.drafter.parent.parent.name.split('--', 1)[-1].replace('--', '/')} "
             "in the bundle")
        drafter = r.drafter
    return r.local.path, drafter


def _say(message: str) -> None:
    print(f"edgespec: {message}", file=sys.stderr, flush=True)


def gguf_summary(report: dict) -> list[str]:
    """One line per GGUF tensor type of the source: kept exact, re-quantized (with the measured
    relative error ||w' - w|| / ||w||, worst tensor) or read dense."""
    lines = []
    for name, e in sorted(report.items()):
        n = f"{e['tensors']} tensor{'s' if e['tensors'] != 1 else ''}"
        if e["how"] == "exact":
            lines.append(f"  {name}: {n} kept quantized, exact ({e['bits']}-bit, groups of {e['group_size']})")
        elif e["how"] == "requantized":
            lines.append(f"  {name}: {n} re-quantized to {e['bits']}-bit groups of {e['group_size']} "
                         f"(no exact MLX form; relative error up to {100 * e['max_rel_error']:.2f}%)")
        else:
            lines.append(f"  {name}: {n} read dense")
    return lines
