"""Whether a drafter can draft for a verifier: the one vocabulary check every drafter kind runs at
load time and the converter runs at export time.

    check_compatible(drafter_vocab, verifier_vocab, drafter_hash, verifier_hash)   # sizes, hashes
    check_compatible(rows, verifier_vocab, drafter_tokenizer=t1, verifier_tokenizer=t2)  # id by id

A drafter proposes token ids the verifier scores, so both must mean the same token by the same
id. With both tokenizers at hand the check is id by id on the ids both define (a family's
models share one tokenizer but pad their embedding tables differently, so sizes may differ,
as long as the drafter's table covers every verifier token); without them the vocabulary
sizes must be equal and the tokenizer hashes too, when both sides recorded one.

A reduced-vocabulary drafter (distilled, feature, or its Core ML package) names the
verifier's vocabulary in its map (vocab_map.json: full size and tokenizer hash), checked the
same way (`check_map_vocabulary`); a package's map must also be the one it was exported with
(`package_vocab_map`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgespec.drafters.coreml_runtime import read_package_info
from edgespec.drafters.vocab_map import VOCAB_MAP, VocabMap, is_distilled_folder
from edgespec.errors import ModelLoadError, VocabularyMismatchError


def check_compatible(drafter_vocab: int, verifier_vocab: int, drafter_hash: str | None = None,
                     verifier_hash: str | None = None, *, what: str = "drafter",
                     drafter_tokenizer=None, verifier_tokenizer=None,
                     error: type[Exception] = VocabularyMismatchError, size_message: str | None = None) -> None:
    """Raise `error` (VocabularyMismatchError) unless the drafter can draft for the verifier.

    drafter_vocab / verifier_vocab: output sizes (the drafter's embedding rows when tokenizers
    are given); *_hash: tokenizer vocab hashes (checked when both are known); *_tokenizer: both
    given, the check is id by id. size_message: the message of a size mismatch where a drafter
    kind words it its own way (its callers' tests match it)."""
    if drafter_tokenizer is not None and verifier_tokenizer is not None:
        check_tokenizers(drafter_tokenizer, verifier_tokenizer, what)
        if drafter_vocab < verifier_tokenizer.vocab_size:
            raise error(
                f"the {what} has a vocabulary of {drafter_vocab} tokens, the verifier {verifier_tokenizer.vocab_size}: "
                "its embedding table must cover every verifier token; a drafter must use the verifier's tokenizer"
            )
        return
    if drafter_vocab != verifier_vocab:
        raise error(size_message or (
            f"the {what} has a vocabulary of {drafter_vocab} tokens, the verifier {verifier_vocab}: "
            "a drafter must use the verifier's tokenizer"
        ))
    if drafter_hash and verifier_hash and drafter_hash != verifier_hash:
        raise error(
            f"the {what}'s tokenizer (vocab hash {drafter_hash}) differs from the verifier's "
            f"({verifier_hash}): a drafter must use the verifier's tokenizer"
        )


def check_tokenizers(drafter_tok, verifier_tok, what: str = "drafter") -> None:
    """Token-by-token check on the ids both tokenizers define; the error names the first id whose
    strings differ (and both strings)."""
    d_vocab = drafter_tok._tok.get_vocab(with_added_tokens=True)
    v_vocab = verifier_tok._tok.get_vocab(with_added_tokens=True)
    d_by_id = {i: t for t, i in d_vocab.items()}
    v_by_id = {i: t for t, i in v_vocab.items()}
    shared = min(drafter_tok.vocab_size, verifier_tok.vocab_size)
    for i in range(shared):
        a, b = d_by_id.get(i), v_by_id.get(i)
        if a != b:
            raise VocabularyMismatchError(
                f"the {what}'s tokenizer differs from the verifier's at id {i}: {what} {a!r}, verifier {b!r} "
                f"(checked ids 0..{shared - 1}); a drafter must use the verifier's tokenizer"
            )


def map_hash(folder: Path) -> str | None:
    """The verifier tokenizer hash a drafter folder's vocab_map.json records (None if none)."""
    return json.loads((Path(folder) / VOCAB_MAP).read_text()).get("vocab_hash")


def check_map_vocabulary(folder: Path, vmap: VocabMap, verifier) -> None:
    """Refuse a drafter folder whose vocab map names another vocabulary than the verifier's
    (size, and tokenizer hash when both sides know theirs). verifier: Engine or LoadedModel."""
    loaded = getattr(verifier, "loaded", verifier)  # an Engine holds its LoadedModel
    d_hash = map_hash(folder)
    v_hash = (loaded.manifest or {}).get("vocab_hash")
    if v_hash is None and loaded.tokenizer is not None and d_hash:
        v_hash = loaded.tokenizer.vocab_hash()
    check_compatible(vmap.full_vocab_size, loaded.model.args.vocab_size, d_hash, v_hash)


def check_package_map(vmap: VocabMap, info: dict[str, Any], where) -> VocabMap:
    """The map a reduced-vocabulary Core ML package is given must be the one it was exported
    with (size, full vocabulary, digest in its info)."""
    rv = info.get("reduced_vocab") or {}
    if (
        vmap.size != int(rv.get("size", -1))
        or vmap.full_vocab_size != int(info["vocab_size"])
        or (rv.get("sha256") and vmap.digest() != rv["sha256"])
    ):
        raise ModelLoadError(
            f"{where}: the reduced-vocabulary map does not match the one the package was exported with; "
            "re-export the drafter"
        )
    return vmap


def package_vocab_map(path: Path, info: dict[str, Any]) -> VocabMap | None:
    """The VocabMap of a reduced-vocabulary package (None for a full-vocabulary one).

    Its ids come from the info itself (package metadata), else from the bundle's
    drafter/vocab_map.json beside the package, else from the package metadata;
    the recorded digest must match, so a swapped map is refused.
    """
    rv = info.get("reduced_vocab")
    if not rv:
        return None
    ids = rv.get("ids")
    if ids is not None:
        vmap = VocabMap(ids, int(info["vocab_size"]))
    elif is_distilled_folder(path.parent / "drafter"):
        vmap = VocabMap.load(path.parent / "drafter")
    else:
        ids = (read_package_info(path, prefer_manifest=False).get("reduced_vocab") or {}).get("ids")
        if not ids:
            raise ModelLoadError(f"{path}: a reduced-vocabulary package without its vocab map; re-export it")
        vmap = VocabMap(ids, int(info["vocab_size"]))
    return check_package_map(vmap, info, path)


def check_package_vocabulary(info: dict[str, Any], verifier) -> None:
    """A Core ML package's recorded vocabulary (size, tokenizer hash) against the verifier's.
    verifier: the Engine or LoadedModel (its tokenizer, when it has one, gives the hash)."""
    if not info:
        return  # no export info: refused by the package's loader
    tok = getattr(verifier, "tokenizer", None)  # a bare model drafted for in tests has none
    check_compatible(int(info["vocab_size"]), verifier.model.args.vocab_size, info.get("vocab_hash"),
                     tok.vocab_hash() if tok is not None else None, what="Core ML drafter")
