"""The drafter registry (edgespec.drafters.registry) and the abilities drafter classes declare
(DrafterCaps): each class's declaration matches the methods it has, and a folder goes to the
first kind in the table that detects it (a feature drafter's folder also holds a vocab map,
so the feature entry must come before the distilled one; any other folder is an MLX model)."""

from __future__ import annotations

import json

import pytest

from edgespec.drafters.assistant import AssistantDrafter
from edgespec.drafters.base import DrafterCaps
from edgespec.drafters.coreml import CoreMLDrafter
from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter
from edgespec.drafters.distilled import DistilledDrafter
from edgespec.drafters.feature import FeatureDrafter
from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.drafters.mtp import MTPDrafter
from edgespec.drafters.prompt_lookup import PromptLookupDrafter
from edgespec.drafters.registry import KINDS, SHORTCUTS, Candidate
from edgespec.drafters.self_spec import SelfSpecDrafter
from edgespec.tree.cascade import CascadeDrafter

CLASSES = [AssistantDrafter, CoreMLDrafter, CoreMLAssistantDrafter, DistilledDrafter, FeatureDrafter, MLXDrafter,
           MTPDrafter, PromptLookupDrafter, SelfSpecDrafter, CascadeDrafter]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_declared_abilities_match_the_methods(cls):
    caps = cls.caps
    assert isinstance(caps, DrafterCaps)
    assert callable(getattr(cls, "sync", None)) == caps.syncs
    assert callable(getattr(cls, "fork", None)) == caps.forks
    assert callable(getattr(cls, "bind_verifier_cache", None)) == caps.reads_verifier
    assert callable(getattr(cls, "add_features", None)) == caps.needs_features
    assert callable(getattr(cls, "_forward", None)) == caps.mlx_model
    assert callable(getattr(cls, "reuses_prefixes", None)) == caps.prefix_store
    # what it reads from the verifier limits where it drafts
    if caps.reads != "nothing":
        assert "tree" not in caps.modes and "cascade" not in caps.modes


def test_caps_refuse_an_unknown_source():
    with pytest.raises(ValueError, match="reads must be one of"):
        DrafterCaps(reads="logits")


def _kind(path) -> str:
    cand = Candidate(path, engine=None)
    return next(k.name for k in KINDS if k.detect(cand))


def test_a_folder_goes_to_the_first_kind_that_detects_it(tmp_path):
    vmap = {"format": "edgespec-reduced-vocab", "full_vocab_size": 8, "vocab_hash": None, "ids": [-1, 3]}
    feature, distilled, assistant, plain = (tmp_path / n for n in ("feature", "distilled", "assistant", "plain"))
    for folder in (feature, distilled, assistant, plain):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for folder in (feature, distilled):
        (folder / "vocab_map.json").write_text(json.dumps(vmap))
    (feature / "drafter.json").write_text(json.dumps({"format": "edgespec-feature-drafter"}))
    (assistant / "config.json").write_text(json.dumps({"model_type": "gemma4_assistant"}))
    assert [_kind(p) for p in (feature, distilled, assistant, plain)] == ["feature", "distilled", "gemma4-assistant",
                                                                           "mlx"]
    assert KINDS[-1].name == "mlx" and set(SHORTCUTS) == {"none", "self", "int8", "mtp", "prompt_lookup"}
