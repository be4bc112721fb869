"""Bad or unusual inputs to the Python API get a clear ValueError, never a raw exception from
deep inside (#34): message content that is not text, options given as a dict or together with
keywords, config metadata keys transformers writes, and --distributed on the default model."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_engine, write_tiny_hf_folder

from edgespec.engine import make_options


@pytest.fixture(scope="module")
def engine():
    return make_tiny_engine(seed=1)


@pytest.mark.parametrize("content, said", [
    (None, "content must be a string"),
    (5, "content must be a string"),
    ({"text": "hi"}, "content must be a string"),
    ([{"type": "image_url", "image_url": "x"}], "content parts must be"),
    (["hi"], "content parts must be"),
])
def test_message_content_that_is_not_text_is_a_clear_value_error(engine, content, said):
    with pytest.raises(ValueError, match=said) as e:
        engine.generate(messages=[{"role": "user", "content": content}], max_tokens=2)
    assert "message 0 (user)" in str(e.value)


@pytest.mark.parametrize("message, said", [
    ({"role": None, "content": "hi"}, "role must be a non-empty string"),
    ({"content": "hi"}, "needs 'role' and 'content'"),
    ("hi", "needs 'role' and 'content'"),
])
def test_malformed_messages_are_refused_by_position(engine, message, said):
    with pytest.raises(ValueError, match=said):
        engine.generate(messages=[{"role": "system", "content": "x"}, message], max_tokens=2)


def test_text_parts_are_joined_like_a_string(engine):
    parts = engine.generate(messages=[{"role": "user", "content": [{"type": "text", "text": "ab"},
                                                                   {"type": "text", "text": "c"}]}], max_tokens=6)
    plain = engine.generate(messages=[{"role": "user", "content": "abc"}], max_tokens=6)
    assert parts.tokens == plain.tokens and parts.prompt_tokens == plain.prompt_tokens


def test_options_as_a_dict_equal_the_same_keywords(engine):
    a = engine.generate("abc", options={"max_tokens": 3})
    b = engine.generate("abc", max_tokens=3)
    assert len(a.tokens) == 3 and a.tokens == b.tokens


def test_keywords_override_options_instead_of_being_dropped(engine):
    opts = make_options(max_tokens=9, temperature=0.0)
    out = engine.generate("abc", options=opts, max_tokens=3)
    assert len(out.tokens) == 3  # was 9: the keyword silently ignored
    out = engine.generate("abc", options={"max_tokens": 9}, max_tokens=4)
    assert len(out.tokens) == 4
    chunks = list(engine.stream("abc", options=opts, max_tokens=2))
    assert sum(len(c.tokens) for c in chunks) == 2
    # the options object given is not changed by the override
    assert opts.max_tokens == 9


@pytest.mark.parametrize("options, said", [
    (5, "options must be a GenerateOptions"),
    ("max_tokens=3", "options must be a GenerateOptions"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temprature": 0.5}, "temprature"),
])
def test_bad_options_are_value_errors(engine, options, said):
    with pytest.raises(ValueError, match=said):
        engine.generate("abc", options=options)


def test_config_metadata_keys_with_a_leading_underscore_are_accepted(tmp_path):
    """transformers writes `_name_or_path` and, for a model loaded from a GGUF and saved again,
    `_model_name_or_path`: metadata, not math."""
    from edgespec.weights.loader import load

    folder = write_tiny_hf_folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    meta = {"_model_name_or_path": "/x/model.gguf", "_name_or_path": "x", "_attn_implementation_autoset": True}
    (folder / "config.json").write_text(json.dumps({**config, **meta}))
    loaded = load(folder)
    assert loaded.model.args.vocab_size == config["vocab_size"]
    # a math field next to them is still refused by name
    (folder / "config.json").write_text(json.dumps({**config, **meta, "attention_multiplier": 0.5}))
    with pytest.raises(ValueError, match="attention_multiplier"):
        load(folder)


def test_distributed_without_model_runs_the_default_models_bundle(monkeypatch, tmp_path):
    """`--distributed` without --model: the launcher converts the default model once and names
    its bundle to every rank (it used to refuse: 'needs --model BUNDLE')."""
    import argparse

    import edgespec.distributed.launch as launch

    bundle = tmp_path / "models" / "default"
    seen = {}
    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.setattr(launch, "launch", lambda spec, argv: seen.setdefault("argv", argv) and 0)
    args = argparse.Namespace(model=None, distributed="local:2")
    code, engine = launch.join_or_launch(args, ["generate", "--prompt", "hi", "--distributed", "local:2"],
                                         default_bundle=lambda: bundle)
    assert (code, engine) == (0, None)
    assert seen["argv"][-2:] == ["--model", str(bundle)]

    # a rank started without --model and without the bundle says which path it looked for
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    args = argparse.Namespace(model=None, distributed="local:2", distributed_split="pipeline")
    with pytest.raises(launch.DistributedError, match="no bundle of the default model at"):
        launch.join_or_launch(args, [])
