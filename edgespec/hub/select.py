"""Which files of a hub repository edgespec needs: config, tokenizer, one weights format, the chosen
GGUF file, a shipped drafter; and, when none of it is there, what the repository holds instead."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from edgespec.errors import ModelLoadError

# Read by edgespec.tokenizer / edgespec.weights.formats.hf when present; small, so always taken.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "added_tokens.json", "vocab.json", "merges.txt",
)
# A drafter shipped inside the repository (edgespec bundles' drafter/, a Core ML drafter).
DRAFTER_DIRS = ("drafter/", "drafter.mlpackage/")
# Without a :QUANT tag, the first of these present is taken (as llama.cpp's -hf does, Q4_K_M first),
# else the first GGUF file by name.
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0", "Q4_0")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class NothingRunnableError(ModelLoadError):
    """The repository holds no weights edgespec can run."""


@dataclass
class Selection:
    """`kind`: bundle, safetensors or gguf; `files`: repository paths to fetch; `gguf`: the
    chosen GGUF file (kind gguf); `quants`: every quant tag the repository offers (kind gguf)."""

    kind: str
    files: list[str]
    gguf: str | None = None
    quants: list[str] = field(default_factory=list)

    def size(self, sizes: dict[str, int]) -> int:
        return sum(int(sizes.get(f) or 0) for f in self.files)


def quant_of(filename: str) -> str | None:
    """The quant tag in a GGUF file name (Model-Q4_K_M.gguf -> Q4_K_M), upper-cased."""
    stem = filename.rsplit("/", 1)[-1][: -len(".gguf")]
    m = re.search(r"(?:^|[-_.])((?:IQ|Q|TQ)\d[A-Z0-9_]*|F16|BF16|F32|FP16|FP32)$", stem, re.IGNORECASE)
    return m.group(1).upper() if m else None


def _stem(filename: str) -> str:
    return filename.rsplit("/", 1)[-1][: -len(".gguf")]


def _gguf_files(paths: list[str]) -> list[str]:
    return sorted(p for p in paths if p.lower().endswith(".gguf") and "mmproj" not in p.lower())


def select(paths: list[str], quant: str | None = None, repo: str = "the repository") -> Selection:
    """The files to fetch from a repository listing `paths` (relative paths).

    With `quant`, the GGUF file tagged so (case-insensitive); without, safetensors weights when
    there are any, else a GGUF file by DEFAULT_QUANTS. NothingRunnableError names what the
    repository holds when nothing in it runs here.
    """
    top = [p for p in paths if "/" not in p]
    side = [p for p in top if p in SIDE_FILES]
    drafter = [p for p in paths if p.startswith(DRAFTER_DIRS)]
    ggufs = _gguf_files(paths)
    if quant is None and "manifest.json" in top:  # an edgespec bundle published as it is
        return Selection("bundle", sorted(set(paths) - {".gitattributes", "README.md"}))
    if quant is None:
        weights = [p for p in top if p.endswith(".safetensors")]
        named = [p for p in weights if p.startswith("model")]
        weights = named or weights  # consolidated.safetensors next to model-*.safetensors is a copy
        if weights and "config.json" in top:
            index = [p for p in top if p.endswith(".safetensors.index.json")]
            return Selection("safetensors", sorted(set(side + weights + index + drafter)))
    if ggufs:
        tags = {g: quant_of(g) for g in ggufs}
        offered = sorted({t for t in tags.values() if t})
        if quant is not None:
            # a file's own name (its stem, or the whole name) picks it; else the quant tag
            chosen = [g for g in ggufs if quant.lower() in (_stem(g).lower(), g.rsplit("/", 1)[-1].lower())]
            chosen = chosen or [g for g in ggufs if tags[g] == quant.upper()]
            if not chosen:
                raise NothingRunnableError(
                    f"{repo} has no GGUF file tagged {quant}; it offers {', '.join(offered) or ', '.join(ggufs[:5])}"
                )
            tag = quant
        else:
            tag = next((q for q in DEFAULT_QUANTS if q in tags.values()), None)
            chosen = [g for g in ggufs if tags[g] == tag] if tag else ggufs[:1]
        if len(chosen) > 1:  # never the first by name without a word: the user picks
            shown = ", ".join(chosen[:6]) + (", ..." if len(chosen) > 6 else "")
            raise NothingRunnableError(f"{repo} has {len(chosen)} GGUF files tagged {tag.upper()}: {shown}; name one "
                                       f"by its file name: " + " or ".join(f"{repo}:{_stem(g)}" for g in chosen[:2]))
        pick = chosen[0]
        if _SPLIT.search(pick):
            raise NothingRunnableError(f"{repo}: {pick} is one part of a split GGUF; edgespec reads single-file GGUFs "
                                       "(join the parts with llama.cpp's gguf-split --merge, then pass the file)")
        return Selection("gguf", [pick], gguf=pick, quants=offered)
    if quant is not None:
        raise NothingRunnableError(f"{repo} holds no GGUF files, so :{quant} picks nothing; "
                                   f"use the name without :{quant}")
    raise NothingRunnableError(f"{repo} holds no model edgespec can run: {describe(paths)}; edgespec reads "
                               "safetensors with config.json, GGUF files and edgespec bundles")


def describe(paths: list[str]) -> str:
    """What a repository holds, in a few words (e.g. 'only ONNX (onnx/model.onnx)')."""
    kinds = {
        "ONNX": ["*.onnx", "*.onnx_data"], "PyTorch pickles": ["*.bin", "*.pt", "*.pth"],
        "TensorFlow": ["*.h5", "*.tflite"], "Core ML": ["*.mlmodel", "*.mlpackage/*"],
        "safetensors without config.json": ["*.safetensors"], "Flax": ["*.msgpack"],
    }
    found = []
    for label, pats in kinds.items():
        hits = [p for p in paths if any(fnmatch.fnmatch(p, pat) for pat in pats)]
        if hits:
            found.append(f"{label} ({', '.join(hits[:2])}{', ...' if len(hits) > 2 else ''})")
    if not found:
        shown = [p for p in paths if p not in (".gitattributes", "README.md")]
        return "no weights at all (" + (", ".join(shown[:4]) or "an empty repository") + ")"
    return ("only " if len(found) == 1 else "") + ", ".join(found)
