"""Cost of one MTP draft step against one verifier step (Qwen3.5's multi-token-prediction head).

A random Qwen3.5 (Gated DeltaNet + gated attention, 3:1) built with transformers, with a
random MTP head (one full-attention layer, fc, norms) added as mtp.safetensors, loaded by
edgespec; measured side by side in one run, at a context of `--context` tokens:

1. verifier step: one decode pass of one token (all layers, logits), rolled back after;
2. MTP step: one head step of one token (fc, its attention layer over its own cache, norm,
   the shared lm_head's logits), rolled back after;
3. a whole draft of K tokens through the drafter (edgespec/drafters/mtp.py), per token,
   its catch-up entry included.

Acceptance of a random head is meaningless; the ratio says what a drafted token costs
relative to a verified one (the break-even acceptance for K drafts follows from it).

    python benchmarks/mtp.py [--hidden 512] [--layers 8] [--context 256] [--k 4]

Figures are indicative: this machine's CPUs are shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def build(folder: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    def config(n, kinds=None):
        return transformers.Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=n,
            layer_types=kinds, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
            head_dim=64, linear_num_key_heads=hidden // 128, linear_num_value_heads=hidden // 64,
            linear_key_head_dim=64, linear_value_head_dim=64, initializer_range=0.05)

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config(layers), dtype=torch.float32).save_pretrained(folder)
    layer = transformers.Qwen3_5TextModel(config(1, ["full_attention"]))
    mtp = {f"mtp.{k}": v.contiguous() for k, v in layer.state_dict().items() if k.startswith(("layers.", "norm."))}
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    mtp["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    mtp["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden)
    save_file(mtp, str(folder / "mtp.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_architectures import vocab_tokenizer

    vocab_tokenizer(vocab).save(folder)


def side_by_side(fns, reps: int) -> list[float]:
    """Fastest of `reps` runs of each, interleaved so load hits every one alike."""
    out = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            out[i] = min(out[i], time.perf_counter() - t0)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)

    import edgespec
    from edgespec.drafters.mtp import MTPDrafter
    from edgespec.logits.sampling import Sampler, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), a.hidden, a.layers, a.vocab)
        engine = edgespec.load(tmp, progress=False, history="off")
    model, drafter = engine.model, engine.drafter
    assert isinstance(drafter, MTPDrafter), "the checkpoint's MTP head was not loaded as the drafter"
    seq = [(7 * i + 3) % a.vocab for i in range(a.context + 1)]
    vcache = model.make_cache()
    mx.eval(model(mx.array([seq[:-1]]), vcache))  # the verifier holds positions 0..context-1
    drafter.bind_verifier_cache(vcache)
    drafter.begin(seq)
    sampler = Sampler(SamplingParams(temperature=0.0))
    drafter.draft(a.k, sampler)  # builds the head's cache over the context
    tok = mx.array([[seq[-1]]])

    def verifier_step():
        mx.eval(mx.argmax(model(tok, vcache)[0, -1]))
        for c in vcache:
            c.trim(1)

    head, hcache = model.mtp, drafter.head.cache
    g = mx.zeros((1, 1, a.hidden), dtype=model.model.embed_tokens.weight.dtype)

    def mtp_step():
        out = head(model.embed(tok), g, hcache)
        mx.eval(mx.argmax(model.project(out)[0, -1]))
        for c in hcache:
            c.trim(1)

    def draft_k():
        drafter.sync(seq)  # the same committed sequence: the last entry is re-fed, then k steps
        drafter.draft(a.k, sampler)

    v, m, d = side_by_side([verifier_step, mtp_step, draft_k], a.reps)
    print(f"random Qwen3.5: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, context {a.context}, "
          f"device {mx.default_device()}")
    print(f"verifier step (1 token):      {v * 1e3:7.2f} ms")
    print(f"MTP draft step (1 token):     {m * 1e3:7.2f} ms   = {m / v:.2f}x a verifier step")
    print(f"MTP draft of K={a.k}, per token: {d / a.k * 1e3:7.2f} ms   = {d / a.k / v:.2f}x a verifier step")


if __name__ == "__main__":
    main()
