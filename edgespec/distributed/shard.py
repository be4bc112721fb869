"""Which weights each rank holds, and loading only those from a bundle.

Pipeline: rank r holds the contiguous layers [start_r, stop_r); rank 0 also holds
everything outside the layers (embedding, final norm, output head), since tokens enter
and logits leave there. Boundaries balance bytes: rank 0's share of layers is smaller by
the size of the embedding and head.

Tensor: every rank holds every layer, split Megatron-style. q/k/v and gate/up keep
1/N of their output rows (whole heads, whole MLP columns); o_proj and down_proj keep
the matching 1/N of their input columns, so each rank's partial outputs add up
(all_sum) to the full one. The embedding and the output head are split by vocabulary
rows (padded to a multiple of N). Norms are replicated (a few KB).

Weights are read lazily (`mx.load` of a safetensors file maps nothing until an array is
evaluated) and each kept slice is copied out, so a rank never holds the full model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from edgespec.distributed.errors import DistributedError
from edgespec.models import model_from_config
from edgespec.models.experts import SwitchGLU
from edgespec.weights.bundle import is_bundle
from edgespec.weights.loader import apply_quantization

MODES = ("pipeline", "tensor")
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split
COL_SPLIT = ("o_proj", "down_proj")  # input columns split; outputs all_sum'ed
VOCAB_SPLIT = ("embed_tokens", "lm_head")


@dataclass
class Plan:
    mode: str
    rank: int
    size: int
    num_layers: int
    ranges: list[tuple[int, int]]  # pipeline: layer range per rank; tensor: all layers everywhere
    vocab_size: int = 0
    vocab_per_rank: int = 0  # tensor: padded rows per rank

    def owns(self, layer: int, rank: int | None = None) -> bool:
        a, b = self.ranges[self.rank if rank is None else rank]
        return a <= layer < b


def layer_prefixes(model: nn.Module) -> list[str]:
    """Parameter-name prefix of each entry of `model.layers` ("model.layers.3.")."""
    where = {id(m): path for path, m in model.named_modules()}
    out = []
    for i, layer in enumerate(model.layers):
        if id(layer) not in where:
            raise DistributedError(f"layer {i} of the model is not one of its modules")
        out.append(where[id(layer)] + ".")
    return out


def pipeline_ranges(layer_bytes: list[int], rest_bytes: int, size: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, rank 0 first, each rank's bytes near total/size.

    Rank 0 carries `rest_bytes` (embedding, head) on top of its layers; every other rank
    gets at least one layer.
    """
    n = len(layer_bytes)
    if n < size - 1 or n == 0:
        raise DistributedError(f"the model has {n} layers: too few to split over {size} ranks (pipeline)")
    total = rest_bytes + sum(layer_bytes)
    cuts = [0]
    acc = rest_bytes
    i = 0
    for r in range(1, size):
        target = total * r / size
        # advance while taking the next layer brings rank r-1 closer to its target,
        # leaving at least one layer for each rank after it
        while i < n - (size - r) and abs(acc + layer_bytes[i] - target) <= abs(acc - target):
            acc += layer_bytes[i]
            i += 1
        if r > 1 and i == cuts[-1]:  # ranks 1.. hold at least one layer
            acc += layer_bytes[i]
            i += 1
        cuts.append(i)
    cuts.append(n)
    return [(cuts[r], cuts[r + 1]) for r in range(size)]


def read_bundle_config(folder: Path) -> dict[str, Any]:
    folder = Path(folder).expanduser()
    if not is_bundle(folder):
        raise DistributedError(
            f"{folder}: a distributed verifier loads from an edgespec bundle (manifest.json); "
            "convert the checkpoint first with `edgespec convert`"
        )
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DistributedError(f"{folder}/config.json: {e}") from None


def _split(a: mx.array, axis: int, rank: int, size: int, pad_to: int | None = None) -> mx.array:
    """Rank's 1/size slice of `a` along `axis` (padded with zeros to `pad_to` first), copied out."""
    if pad_to is not None and a.shape[axis] < pad_to:
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad_to - a.shape[axis])
        a = mx.pad(a, widths)
    n = a.shape[axis]
    if n % size:
        raise DistributedError(f"cannot split a dimension of {n} over {size} ranks")
    step = n // size
    # a gather (take) writes a fresh buffer; a plain slice, even through mx.contiguous, can
    # stay a view that keeps the whole tensor alive
    return mx.take(a, mx.arange(rank * step, (rank + 1) * step), axis=axis)


def check_tensor_split(model: nn.Module) -> None:
    """Every projection inside the layers must be one the tensor split knows (fused ones are not)."""
    for path, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            name = path.rsplit(".", 1)[-1]
            if name not in ROW_SPLIT + COL_SPLIT + VOCAB_SPLIT:
                raise DistributedError(
                    f"tensor split does not know how to split {path} ({type(model).__name__}); "
                    "use --distributed-split pipeline"
                )


def tensor_config(config: dict[str, Any], size: int) -> dict[str, Any]:
    """The config of one tensor-parallel shard: 1/size of the heads, MLP width and vocabulary."""
    H = int(config["num_attention_heads"])
    Hk = int(config.get("num_key_value_heads") or H)
    F = int(config["intermediate_size"])
    E = int(config["hidden_size"])
    bad = [f"{name} ({v})" for name, v in (("num_attention_heads", H), ("num_key_value_heads", Hk),
                                           ("intermediate_size", F)) if v % size]
    if bad:
        raise DistributedError(
            f"tensor parallel over {size} ranks needs {', '.join(bad)} divisible by {size}; "
            "use --distributed-split pipeline"
        )
    V = int(config["vocab_size"])
    out = dict(config)
    out.update(
        num_attention_heads=H // size,
        num_key_value_heads=Hk // size,
        intermediate_size=F // size,
        head_dim=int(config.get("head_dim") or E // H),
        vocab_size=-(-V // size),
    )
    return out


def refuse_unsplittable(model: nn.Module, model_type: str | None, mode: str) -> None:
    """DistributedError naming the architecture and why, for models neither split can run."""
    if any(c.span_kind == "state" for c in model.make_cache()):
        # the mirrored caches forward K/V operations only; a recurrent state is not split or mirrored
        raise DistributedError(f"distributed verifiers run attention layers only; {model_type!r} has "
                               "recurrent (convolution / linear-attention) layers: run it on one machine")
    if not getattr(model, "layerwise", True):
        # Gemma 4: each layer reads per-layer inputs computed from the token ids at the model's
        # top, and its last num_kv_shared_layers read keys and values computed by earlier layers
        # in the same pass; both splits call the layers one by one with hidden states only.
        raise DistributedError(f"distributed verifiers call the layers one by one; {model_type!r} layers also read "
                               "the pass's per-layer inputs and earlier layers' shared keys and values, which "
                               "neither split forwards: run it on one machine")
    if mode == "tensor" and any(isinstance(m, SwitchGLU) for _, m in model.named_modules()):
        raise DistributedError(f"tensor split does not shard mixture-of-experts layers ({model_type!r}: experts "
                               "stacked per layer, a router per token); use --distributed-split pipeline")


def load_shard(folder: Path, mode: str, rank: int, size: int):
    """(local model, plan, full config) for this rank, holding only its weights."""
    if mode not in MODES:
        raise DistributedError(f"distributed split {mode!r}: use one of {', '.join(MODES)}")
    folder = Path(folder).expanduser()
    config = read_bundle_config(folder)
    try:
        weights = mx.load(str(folder / "model.safetensors"))  # lazy: nothing read yet
    except Exception as e:  # mlx raises RuntimeError/ValueError on bad files
        raise DistributedError(f"{folder}/model.safetensors: not readable ({e})") from None
    try:
        model = model_from_config(config)  # parameters stay lazy until loaded over
        refuse_unsplittable(model, config.get("model_type"), mode)
        local_config = tensor_config(config, size) if mode == "tensor" else config
        if mode == "tensor":
            model = model_from_config(local_config)
    except (TypeError, ValueError) as e:
        raise DistributedError(f"{folder}/config.json: {e}") from None
    apply_quantization(model, config.get("quantization"))
    prefixes = layer_prefixes(model)
    n = len(prefixes)
    if mode == "tensor":
        check_tensor_split(model)

    def layer_of(name: str) -> int | None:
        for i, p in enumerate(prefixes):
            if name.startswith(p):
                return i
        return None

    names = [k for k, _ in tree_flatten(model.parameters())]
    missing = [k for k in names if k not in weights]
    if missing:
        raise DistributedError(f"{folder}/model.safetensors lacks {len(missing)} weight(s), e.g. {missing[0]}")

    if mode == "pipeline":
        layer_bytes = [0] * n
        rest = 0
        for k in names:
            i = layer_of(k)
            if i is None:
                rest += weights[k].nbytes
            else:
                layer_bytes[i] += weights[k].nbytes
        plan = Plan(mode, rank, size, n, pipeline_ranges(layer_bytes, rest, size))
        a, b = plan.ranges[rank]
        keep = {}
        for k in names:
            i = layer_of(k)
            if (i is None and rank == 0) or (i is not None and a <= i < b):
                keep[k] = weights[k]
    else:
        V = int(config["vocab_size"])
        Vr = local_config["vocab_size"]
        plan = Plan(mode, rank, size, n, [(0, n)] * size, V, Vr)
        keep = {}
        for k in names:
            w = weights[k]
            parts = k.split(".")
            module, leaf = parts[-2], parts[-1]
            if module in VOCAB_SPLIT:
                keep[k] = _split(w, 0, rank, size, pad_to=Vr * size)
            elif module in ROW_SPLIT:
                keep[k] = _split(w, 0, rank, size)
            elif module in COL_SPLIT:
                if leaf == "bias":  # added once: rank 0 keeps it, the others add zeros
                    keep[k] = w if rank == 0 else mx.zeros_like(w)
                else:
                    keep[k] = _split(w, -1, rank, size)
            else:
                keep[k] = w
    del weights
    try:
        model.load_weights(list(keep.items()), strict=False)
    except ValueError as e:
        raise DistributedError(f"{folder}: weights do not fit this shard: {e}") from None
    model.eval()
    mx.eval(list(keep.values()))
    return model, plan, config


def shard_bytes(model: nn.Module, plan: Plan) -> int:
    """Bytes of the weights this rank holds (evaluated arrays only)."""
    prefixes = layer_prefixes(model)
    total = 0
    for k, v in tree_flatten(model.parameters()):
        i = next((j for j, p in enumerate(prefixes) if k.startswith(p)), None)
        if plan.mode == "tensor" or (i is None and plan.rank == 0) or (i is not None and plan.owns(i)):
            total += v.nbytes
    return total
