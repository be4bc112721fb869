"""`edgespec distill` end to end on a tiny bundle: folder, card, resume rules, attach."""

from __future__ import annotations

import json

import pytest
from conftest import write_tiny_bundle

from edgespec.cli import main
from edgespec.drafters.distilled import DistilledDrafter


def _prompts(path, n, off=0):
    words = ["abc", "hello", "xyz", "data", "Mix", "top", "QRS", "lmno"]
    rows = [{"prompt": f"{words[(i + off) % 8]} {words[(i * 3 + off) % 8]}", "domain": ["code", "chat"][i % 2]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _extra(path):
    path.write_text("\n".join(json.dumps({"prompt": p, "domain": "code"}) for p in ("zz top", "QRS QRS QRS", "a b c d")))
    return path


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    bundle = write_tiny_bundle(root / "verifier", seed=2, scale=3.0)
    argv = ["distill", "--verifier", str(bundle), "--out", str(root / "drafter"),
            "--data", str(_prompts(root / "train.jsonl", 10)), "--heldout", str(_prompts(root / "held.jsonl", 4, 5)),
            "--layers", "1", "--vocab", "40", "--steps", "6", "--batch-size", "2", "--max-new", "8",
            "--gen-batch", "4", "--checkpoint-every", "2", "--quiet",
            "--samples", "2", "--add-data", str(_extra(root / "extra.jsonl"))]
    assert main(argv) == 0
    return root, bundle, argv


def test_folder_contents_and_card(distilled):
    root, _, _ = distilled
    out = root / "drafter"
    assert sorted(p.name for p in out.iterdir()) == [
        "MODEL_CARD.md", "config.json", "corpus.bin", "distill.json", "model.safetensors", "vocab_map.json"]
    card = (out / "MODEL_CARD.md").read_text()
    assert "| code |" in card and "| chat |" in card and "edgespec distill" in card
    info = json.loads((out / "distill.json").read_text())
    assert 0.0 <= info["acceptance"]["all"]["rate"] <= 1.0
    assert info["acceptance"]["all"]["drafted"] > 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 40
    # 10 prompts (8 distinct) answered twice (greedy + one sampled) plus 3 added prompts answered once
    assert (info["n_prompts"], info["n_sequences"], info["samples"]) == (11, 23, 2)
    assert "extra.jsonl" in info["prompts"] and "2 more time" not in card and "1 more time(s)" in card
    assert [p.name.startswith("data-extra-") for p in sorted((root / "drafter.work").iterdir())].count(True) == 1


def test_existing_out_and_work_need_flags(distilled, capsys):
    root, _, argv = distilled
    assert main(argv) == 1  # OUT exists
    assert "already exists" in capsys.readouterr().err
    argv2 = [a if a != str(root / "drafter") else str(root / "drafter2") for a in argv]
    argv2 += ["--work", str(root / "drafter.work")]
    assert main(argv2) == 1  # work folder exists without --resume
    assert "--resume" in capsys.readouterr().err
    assert main(argv2 + ["--resume", "--no-eval"]) == 0  # finished work: data reused, training done
    assert (root / "drafter2" / "model.safetensors").read_bytes() == (root / "drafter" / "model.safetensors").read_bytes()


def test_engine_attaches_distilled_folder(distilled):
    import edgespec

    root, bundle, _ = distilled
    engine = edgespec.load(bundle, drafter=str(root / "drafter"), progress=False)
    assert isinstance(engine.drafter, DistilledDrafter)
    plain = engine.generate("abc top", max_tokens=12, temperature=0, mode="plain")
    spec = engine.generate("abc top", max_tokens=12, temperature=0, mode="speculative")
    assert spec.tokens == plain.tokens
    # The folder's corpus (the verifier's answers to the distillation prompts) is found and drafts.
    table = engine.corpus_table
    assert table is not None and table.vocab_hash == engine.loaded.tokenizer.vocab_hash() and len(table) > 0
    auto = engine.generate("abc top", max_tokens=12, temperature=0, mode="adaptive", sources="corpus")
    assert auto.tokens == plain.tokens and table.lookups > 0
