"""--memory-budget: auto leaves the drafter out (weight-free sources only) when it would not fit."""

from __future__ import annotations

import argparse

import pytest
from conftest import make_tiny_engine, make_tiny_model

from edgespec.drafters.base import ModelDrafter
from edgespec.drafters.prompt_lookup import PromptLookupDrafter
from edgespec.engine import make_options
from edgespec.lookahead.memory import drafter_bytes, drafter_fits, kv_bytes, parse_size, tree_bytes


class FakeModelDrafter(ModelDrafter):
    name, device = "fake", "cpu"


def test_parse_size():
    assert parse_size("800M") == 800 * 2**20
    assert parse_size("1.5G") == int(1.5 * 2**30)
    assert parse_size("2gb") == 2 * 2**30
    assert parse_size("4096") == 4096
    assert parse_size(None) is None
    for bad in ("-1G", "lots", "0", "1.5X"):
        with pytest.raises(ValueError, match="memory budget"):
            parse_size(bad)


def test_engine_prefers_lookahead_when_drafter_does_not_fit():
    engine = make_tiny_engine(0)
    engine.drafter = FakeModelDrafter(make_tiny_model(1, num_hidden_layers=1))
    w, kv = drafter_bytes(engine.drafter, engine.model, engine.context_length)
    assert w == tree_bytes(engine.drafter.model) > 0 and kv == kv_bytes(
        engine.drafter.model.args, engine.context_length
    )
    need = tree_bytes(engine.model) + kv_bytes(engine.model.args, engine.context_length) + w + kv
    engine.memory_budget = need - 1
    assert not drafter_fits(engine, engine.memory_budget)
    # auto is the adaptive decoder either way; without room it leaves the drafter out.
    assert engine.resolve_mode(make_options()) == "adaptive"
    ref = engine.generate([1, 2, 3, 1, 2, 3], max_tokens=12, mode="plain").tokens
    r = engine.generate([1, 2, 3, 1, 2, 3], max_tokens=12)
    assert r.tokens == ref and any("does not fit the memory budget" in n for n in r.stats.notes)
    assert "drafter" not in r.stats.accepted_by_source
    engine.memory_budget = need
    r = engine.generate([1, 2, 3, 1, 2, 3], max_tokens=12)
    assert r.tokens == ref and not any("memory budget" in n for n in r.stats.notes)
    assert engine.resolve_mode(make_options(mode="plain")) == "plain"  # explicit modes are kept


def test_weight_free_drafter_always_fits():
    engine = make_tiny_engine(0)
    engine.drafter = PromptLookupDrafter()
    assert drafter_bytes(engine.drafter, engine.model, 4096) == (0, 0)
    assert drafter_fits(
        engine, tree_bytes(engine.model) + kv_bytes(engine.model.args, engine.context_length)
    )


def test_cli_option_sets_the_budget():
    from edgespec.apps.common import add_model_arguments

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    args = p.parse_args(["--memory-budget", "1G"])
    assert parse_size(args.memory_budget) == 2**30
    assert "--memory-budget" in p.format_help()
