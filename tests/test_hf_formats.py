"""MLX-quantized Hugging Face folders (the mlx-community layout: config.json with "quantization",
packed weights with .scales/.biases) load directly and convert with their quantization kept."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import make_tiny_model, make_tiny_tokenizer
from mlx.utils import tree_flatten

from edgespec.weights.loader import load

IDS = mx.array([[1, 2, 3, 4, 9, 17]])


@pytest.fixture
def mlx_folder(tmp_path):
    model = make_tiny_model(0)
    nn.quantize(model, group_size=32, bits=4)
    cfg = {**model.args.to_dict(), "quantization": {"group_size": 32, "bits": 4}}
    cfg["quantization_config"] = cfg["quantization"]
    folder = tmp_path / "mlx-4bit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    make_tiny_tokenizer(64).save(folder)
    return folder, model(IDS)


def test_mlx_folder_loads_as_it_is(mlx_folder):
    folder, ref = mlx_folder
    loaded = load(folder)
    assert loaded.model.layers[0].self_attn.q_proj.bits == 4
    assert mx.array_equal(loaded.model(IDS), ref)


@pytest.mark.parametrize("quantize", ["none", "native"])
def test_mlx_folder_converts_keeping_its_quantization(mlx_folder, tmp_path, quantize):
    from edgespec.converters.convert import convert

    folder, ref = mlx_folder
    manifest = convert(folder, tmp_path / "out", quantize=quantize, dtype="float32", progress=False)
    assert manifest["source"]["format"] == "mlx"
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4}
    assert mx.array_equal(load(tmp_path / "out").model(IDS), ref)


def test_requantizing_an_mlx_folder_is_refused(mlx_folder, tmp_path):
    from edgespec.converters.convert import convert

    with pytest.raises(ValueError, match="already MLX-quantized \\(4-bit, groups of 32\\)"):
        convert(mlx_folder[0], tmp_path / "out", quantize="8", progress=False)
