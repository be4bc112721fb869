"""The drafter's shape and its initialisation from the verifier's own weights.

Same width as the verifier (so its embedding rows, layers and final norm can be
copied as a head start), few layers, reduced vocabulary N. With hidden E = 576 and
2 layers from SmolLM2-135M a draft step costs ~2 layers + an N x E head, versus 30
layers + a 49152 x E head for the verifier.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from edgespec.models.llama import Model, ModelArgs
from mlx.utils import tree_map


def student_config(verifier_args: ModelArgs, layers: int, vocab_n: int, hidden: int | None = None) -> dict:
    """HF-style config.json dict for the drafter."""
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    v = verifier_args
    cfg = {k: val for k, val in v.to_dict().items()}
    cfg.update(num_hidden_layers=layers, vocab_size=int(vocab_n), tie_word_embeddings=True)
    if hidden is not None and hidden != v.hidden_size:
        if hidden % 64:
            raise ValueError(f"--hidden must be a multiple of 64 (head dim), got {hidden}")
        heads = hidden // 64
        kv = max(1, heads // max(1, v.num_attention_heads // v.num_key_value_heads))
        while heads % kv:
            kv -= 1
        cfg.update(hidden_size=hidden, intermediate_size=int(hidden * v.intermediate_size / v.hidden_size),
                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=64)
    cfg.pop("use_sliding_window", None)  # a Qwen verifier's; llama reads no such field
    cfg["model_type"] = "llama"
    return cfg


def init_student(config: dict, verifier: Model, vocab_ids: np.ndarray, init_layers: list[int] | None, seed: int = 0) -> Model:
    """Build the drafter; copy verifier weights where shapes allow.

    vocab_ids (N,) full id per reduced slot (slot 0 = -1 "other", embedded as the
    mean row). init_layers: verifier layer index for each drafter layer (same width
    only); None = the first n. Measured on SmolLM2-135M (2 layers, untrained, KL
    loss on verifier data): layers [0, 1] 17.9, [28, 29] 17.9, [0, 15] 21.2,
    [0, 29] 60.8: a late layer fed a shallow residual stream is far off.
    """
    mx.random.seed(seed)
    student = Model(ModelArgs.from_dict(config))
    v = verifier.args
    if config["hidden_size"] != v.hidden_size:
        mx.eval(student.parameters())
        return student  # different width: random init, nothing to copy
    n = config["num_hidden_layers"]
    if init_layers is None:
        init_layers = list(range(min(n, v.num_hidden_layers)))
    if len(init_layers) != n or not all(0 <= i < v.num_hidden_layers for i in init_layers):
        raise ValueError(f"--init-layers needs {n} verifier layer indices in 0..{v.num_hidden_layers - 1}")
    emb = verifier.model.embed_tokens.weight.astype(mx.float32)  # (V, E)
    if not v.tie_word_embeddings:
        emb = verifier.lm_head.weight.astype(mx.float32)  # output rows matter most for drafting
    rows = mx.array(vocab_ids[1:].astype(np.int32))
    new_emb = mx.concatenate([emb.mean(axis=0, keepdims=True), emb[rows]], axis=0)  # (N, E)
    student.model.embed_tokens.weight = new_emb
    for dst, src in zip(student.layers, init_layers, strict=True):
        dst.update(verifier.layers[src].parameters())
    student.model.norm.update(verifier.model.norm.parameters())
    # Own copies in float32 (the verifier may hold another dtype); training updates them.
    student.update(tree_map(lambda p: mx.array(p, dtype=mx.float32), student.parameters()))
    mx.eval(student.parameters())
    return student
