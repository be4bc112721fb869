"""Calibrated compression of the Core ML drafter's linear layers (quantization-aware tuning).

Plain compression (coreml_compress) rounds every weight to its nearest code on
its own, and a small drafter's top-1 choices are fragile: on the shipped
distilled drafter, over 3671 positions of the verifier's held-out answers, the
greedy token of the compressed model equals the uncompressed one's at int8 0.977,
int4 0.864, palette4 0.787 (each single 4-bit linear layer alone costs 3-10%).

Calibration tunes the compressed form against the uncompressed model's own
next-token distributions on calibration text:

- every compressed linear keeps a latent fp32 weight plus its compression
  parameters (palette: the per-row 16-entry table; int4: the per-block scale and
  offset; int8: the per-row scale);
- the forward pass uses the compressed weight, its codes recomputed from the
  latent weight at every step (nearest palette entry, or rounded affine code),
  with straight-through gradients to the latent weight and exact gradients to
  the tables and scales;
- the loss is KL(uncompressed || compressed) per position, Adam, a short run;
- if the held-back KL did not fall, the plain rounding is kept (int8 measured
  worse after tuning: its grid is finer than Adam's steps, 0.978 -> 0.965).

Only the compressed representation changes; embeddings, norms and the tied head
stay as they are. The calibration text is the verifier's greedy answers to the
built-in distillation prompts (the training split, so the held-out prompts stay
unseen), each after its prompt in the verifier's chat template and cut to its
last `seq_len` tokens (calibration_sequences). Every 8th sequence is held back to
report the KL before and after, and the greedy agreement (greedy_agreement).
Measured figures are in docs/coreml.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from edgespec.converters.coreml_compress import compress_linear, decode_packed
from edgespec.converters.dense import _dense_params
from edgespec.converters.distill.calibration_text import read_answers
from mlx.utils import tree_flatten

from edgespec.weights.loader import build_model

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HOLDOUT_EVERY = 8
# The bar for a compressed drafter: its greedy token equals the uncompressed one's on
# >= 95% of positions of real text. `edgespec convert` measures it and says when it is missed.
AGREEMENT_TARGET = 0.95


def split_calibration(seqs: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """-> (train, held back): every HOLDOUT_EVERY-th sequence of 2+ tokens is held back."""
    seqs = [s for s in seqs if len(s) >= 2]
    held = seqs[::HOLDOUT_EVERY]
    train = [s for i, s in enumerate(seqs) if i % HOLDOUT_EVERY] or held
    return train, held


def linear_weight_names(model) -> list[str]:
    """Names of the weights compression applies to: the decoder's linears and an untied head."""
    names = []
    for name, _ in tree_flatten(model.parameters()):
        parts = name.split(".")
        if parts[-1] == "weight" and (parts[-2] in LINEAR_NAMES or name == "lm_head.weight"):
            names.append(name)
    return names


def calibration_sequences(
    tokenizer, vocab_map=None, max_len: int = 96, rows: list[dict] | None = None
) -> list[list[int]]:
    """The built-in calibration text as the drafter's input ids.

    Each row of edgespec/data/calibration_answers.jsonl (the verifier's greedy answer to
    one built-in training prompt; converters/distill/calibration_text.py) becomes the
    prompt in the verifier's chat template followed by the answer, cut to its last
    `max_len` tokens: the answer, with as much of its prompt as fits. A drafter only
    drafts answers, so that is the text its compression is tuned and judged on.
    A reduced-vocabulary drafter gets its own ids (the "other" slot for tokens it lacks).
    rows: other {"prompt", "answer"} rows instead (e.g. read_answers of the held-out file).
    """
    seqs = []
    for row in read_answers() if rows is None else rows:
        ids = tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
        ids = np.asarray(ids + tokenizer.encode(row["answer"], add_special_tokens=False), np.int64)
        ids = ids[-max_len:]
        if vocab_map is not None:
            ids = vocab_map.to_reduced[ids]
        if len(ids) >= 2:
            seqs.append(ids.tolist())
    return seqs


def _nearest_code(w, table):
    """Index into each row's table (O, K) of the entry nearest to w (O, I), on mx arrays."""
    order = mx.argsort(table, axis=1)
    sorted_t = mx.take_along_axis(table, order, axis=1)
    mids = (sorted_t[:, 1:] + sorted_t[:, :-1]) / 2
    rank = (w[:, :, None] > mids[:, None, :]).sum(-1)  # position in the sorted table
    return mx.take_along_axis(order, rank, axis=1)


def _make_linear_class():
    class CompressedLinear(nn.Module):
        """A linear layer whose weight is the compressed form of a trainable latent weight."""

        def __init__(self, w: np.ndarray, packed: dict[str, np.ndarray], method: str, bias=None):
            super().__init__()
            self.method = method
            self.latent = mx.array(w.astype(np.float32))
            if bias is not None:
                self.bias = bias
            if method == "palette4":
                self.lut = mx.array(packed["lut"].reshape(w.shape[0], -1).astype(np.float32))
            else:
                self.scale = mx.array(packed["scale"][:, :, 0, 0].astype(np.float32))
                if "offset" in packed:
                    self.offset = mx.array(packed["offset"][:, :, 0, 0].astype(np.float32))
            self.freeze(keys=["bias"], strict=False)

        def codes(self):
            """Integer codes of the current latent weight (no gradient)."""
            w = mx.stop_gradient(self.latent)
            if self.method == "palette4":
                return _nearest_code(w, mx.stop_gradient(self.lut))
            z = self._affine(w, mx.stop_gradient(self.scale), self._offset(True))
            return mx.round(z)

        def _offset(self, frozen: bool):
            if "offset" not in self:
                return None
            return mx.stop_gradient(self.offset) if frozen else self.offset

        def _blocks(self, x):
            n_out, n_in = self.latent.shape
            nb = self.scale.shape[1]
            return x.reshape(n_out, nb, n_in // nb)

        def _affine(self, w, scale, offset):
            z = self._blocks(w) / scale[..., None]
            if offset is not None:  # int4: unsigned codes with an offset
                return mx.clip(z + offset[..., None], 0, 15)
            return mx.clip(z, -127, 127)  # int8: symmetric

        def weight(self):
            w = self.latent
            if self.method == "palette4":
                dense = mx.take_along_axis(self.lut, self.codes(), axis=1)
                return dense + (w - mx.stop_gradient(w))  # straight through to the latent weight
            z = self._affine(w, self.scale, self._offset(False))
            q = z + mx.stop_gradient(mx.round(z) - z)  # rounding, straight through
            off = self._offset(False)
            if off is not None:
                q = q - off[..., None]
            return (self.scale[..., None] * q).reshape(w.shape)

        def __call__(self, x):
            y = x @ self.weight().T
            return y + self.bias if "bias" in self else y

        def packed(self) -> dict[str, np.ndarray]:
            """The constexpr inputs (coreml_compress layout) of the tuned compressed weight."""
            codes = np.array(self.codes())
            if self.method == "palette4":
                lut = np.array(self.lut).astype(np.float16)
                return {"indices": codes.astype(np.uint8)[:, :, None, None],
                        "lut": lut[:, None, None, None, :, None]}  # fmt: skip
            shape = self.latent.shape
            out = {"scale": np.array(self.scale).astype(np.float16)[:, :, None, None]}
            if "offset" in self:
                out["offset"] = np.array(self.offset).astype(np.float16)[:, :, None, None]
                out["data"] = codes.reshape(shape).astype(np.uint8)[:, :, None, None]
            else:
                out["data"] = codes.reshape(shape).astype(np.int8)[:, :, None, None]
            return out

    return CompressedLinear


def _set_module(root, path: str, module) -> None:
    parts = path.split(".")
    parent = root
    for p in parts[:-1]:
        parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
    setattr(parent, parts[-1], module)


def compress_model(
    model,
    method: str,
    calibration: list[list[int]] | None = None,
    steps: int = 0,
    lr: float = 1e-4,
    batch_size: int = 8,
    seq_len: int = 96,
    seed: int = 0,
    progress=None,
) -> tuple[dict[str, dict[str, np.ndarray]], dict | None]:
    """Compress every linear weight of an edgespec Llama `model` (model-space names).

    -> (name -> constexpr inputs as in coreml_compress.compress_linear, stats).
    With `calibration` (input id sequences) and steps > 0 the compressed forms are
    tuned first (module docstring); stats then holds the steps, token counts and the
    held-back KL before and after, else it is None. progress(done, total, loss) is
    called after each step.
    """
    dense = _dense_params(model)
    names = linear_weight_names(model)
    packed = {n: compress_linear(dense[n], method) for n in names}
    if not calibration or steps <= 0:
        return packed, None
    train, held = split_calibration(calibration)
    if not held:
        raise ValueError("calibration needs at least one sequence of 2 or more tokens")
    tuning = Tuning(steps, lr, batch_size, seq_len, seed)
    return _tune(model, dense, packed, method, train, held, tuning, progress)


def greedy_agreement(
    model,
    packed: dict[str, dict[str, np.ndarray]],
    sequences: list[list[int]],
    seq_len: int = 96,
    first_slot: int = 0,
    batch_size: int = 8,
) -> dict:
    """How often the compressed model's greedy token equals the uncompressed `model`'s.

    packed: compress_model's output (model-space names). Every position of the first
    `seq_len` tokens of each sequence counts; logits before `first_slot` are ignored
    (1 for a reduced vocabulary, whose slot 0 "other" is never drafted).
    -> {"held_back_greedy": share, "positions": count, "target": AGREEMENT_TARGET}.
    """
    if not sequences:
        raise ValueError("greedy agreement needs at least one sequence")
    config = model.args.to_dict()
    dense = _dense_params(model)
    ref = build_model(config, {k: mx.array(v) for k, v in dense.items()}, mx.float32)
    weights = {**dense, **{n: decode_packed(p) for n, p in packed.items()}}
    comp = build_model(config, {k: mx.array(v) for k, v in weights.items()}, mx.float32)
    same = count = 0.0
    for i in range(0, len(sequences), batch_size):
        x, m = _batch(sequences[i : i + batch_size], seq_len)
        a = mx.argmax(ref(x)[..., first_slot:], axis=-1)
        b = mx.argmax(comp(x)[..., first_slot:], axis=-1)
        same += float(((a == b) * m).sum())
        count += float(m.sum())
    return {"held_back_greedy": round(same / count, 4), "positions": int(count),
            "target": AGREEMENT_TARGET}  # fmt: skip


def _batch(seqs: list[list[int]], seq_len: int):
    x = np.zeros((len(seqs), seq_len), np.int32)
    m = np.zeros((len(seqs), seq_len), np.float32)
    for j, s in enumerate(seqs):
        s = s[:seq_len]
        x[j, : len(s)] = s
        m[j, : len(s)] = 1
    return mx.array(x), mx.array(m)


@dataclass(frozen=True)
class Tuning:
    """The optimiser settings of one calibration run (compress_model's arguments)."""

    steps: int
    lr: float
    batch_size: int
    seq_len: int
    seed: int


def _tune(model, dense, packed, method, train, held, tuning: Tuning, progress):
    """Tune the compressed forms of `packed` (plain rounding of `dense`); -> (packed, stats)."""
    config = model.args.to_dict()
    teacher = build_model(config, {k: mx.array(v) for k, v in dense.items()}, mx.float32)
    student = build_model(config, {k: mx.array(v) for k, v in dense.items()}, mx.float32)
    teacher.freeze()
    student.freeze()
    CompressedLinear = _make_linear_class()
    names = list(packed)
    steps, lr, batch_size, seq_len = tuning.steps, tuning.lr, tuning.batch_size, tuning.seq_len
    modules = {}
    for n in names:
        path = n.rsplit(".", 1)[0]
        bias = dense.get(f"{path}.bias")
        layer = CompressedLinear(
            dense[n], packed[n], method, None if bias is None else mx.array(bias)
        )
        _set_module(student, path, layer)
        modules[n] = layer

    def kl(x, m, target_lp):
        lp = nn.log_softmax(student(x), axis=-1)
        per = (mx.exp(target_lp) * (target_lp - lp)).sum(-1)
        return (per * m).sum() / m.sum()

    def held_kl() -> float:
        total = count = 0.0
        for i in range(0, len(held), batch_size):
            x, m = _batch(held[i : i + batch_size], seq_len)
            total += float(kl(x, m, nn.log_softmax(teacher(x), axis=-1))) * float(m.sum())
            count += float(m.sum())
        return total / count

    before = held_kl()
    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, steps, lr * 0.1))
    step = nn.value_and_grad(student, lambda x, m, t: kl(x, m, t))
    rng = np.random.default_rng(tuning.seed)
    for s in range(steps):
        x, m = _batch([train[i] for i in rng.choice(len(train), batch_size)], seq_len)
        loss, grads = step(x, m, nn.log_softmax(teacher(x), axis=-1))
        opt.update(student, grads)
        mx.eval(student.parameters(), opt.state)
        if progress:
            progress(s + 1, steps, float(loss))
    after = held_kl()
    stats = {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "calibration_tokens": int(sum(min(len(s), seq_len) for s in train)),
        "held_back_tokens": int(sum(min(len(s), seq_len) for s in held)),
        "held_back_kl_before": round(before, 6),
        "held_back_kl_after": round(after, 6),
        "text": "built-in verifier answers to the distillation prompts (training split)",
        "kept": "tuned" if after < before else "plain",
    }
    if not after < before:  # never worse than plain rounding on text the tuning did not see (or NaN)
        return packed, stats
    return {n: modules[n].packed() for n in names}, stats
