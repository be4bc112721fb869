"""A roofline cost model of a transformer on an Apple-silicon profile, and its calibration.

Priced (seconds), for a model `Shape` at a weight format (`FORMATS`: bits per weight):

- `verify(T, L)`: one verifier pass over T positions after L cached ones, on the GPU:
  max(weight bytes / bandwidth, 2 x weights x T / throughput) + dequantisation + attention +
  kernel launches, the attention (its own kernel) max(the KV cache at L / its bandwidth,
  T x its flops over L / throughput): the cache is read once for all T positions;
- `prefill(P, L0)`: the prompt's P positions in chunks of PREFILL_CHUNK, each a `verify`;
- `draft_step(shape, fmt, device, c)`: one drafted token (after c unseen ones fed first) on the GPU,
  the Neural Engine (a Core ML call, its fixed cost per call) or the CPU cores;
- `concurrent(gpu_s, other_s, other_bytes)`: a GPU pass and a drafter step on another unit at the
  same time, sharing the bandwidth.

Three efficiencies and one dequantisation cost (E_BW, E_FLOPS, E_KV, DEQUANT_OPS) are fitted once to
the published measurements in CALIBRATION (llama.cpp's llama-bench on Apple GPUs: tg = tokens/s
generating 512 or 4096 tokens from an empty context, pp = tokens/s over a 512-token prompt).
`calibration_table()` gives the model's prediction beside each published figure and the error;
tests/test_costs.py keeps every row within its bound, docs/costs.md shows the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgespec.costs.profiles import PROFILES, Profile

# bits per weight of each format (the block scales included): GGUF Q4_0 = 18 bytes / 32 weights,
# Q8_0 = 34 / 32, Q4_K_M about 4.9 (Llama 3 8B: 4.58 GiB for 8.03 B weights); MLX 4-bit
# with group size 64 and a float16 scale and bias: 4.5.
FORMATS = {"f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q4_k_m": 4.9, "q4_0": 4.5, "mlx4": 4.5, "int8": 8.5}
KV_BYTES = 2  # float16 KV caches (the Mac's)
KERNELS_PER_LAYER = 14  # guess: norm x2, q/k/v/o, rope x2, attention, add x2, gate/up, act, down
PREFILL_CHUNK = 512

# Fitted to CALIBRATION (see `fit`): the share of peak bandwidth and of peak throughput a pass
# reaches, and the GPU ops spent per quantized weight read (dequantisation: unpack, scale) that
# do not overlap the memory traffic.
E_BW = 0.82
E_FLOPS = 0.68
DEQUANT_OPS = 6.5
E_KV = 0.1  # the share of bandwidth the attention kernel reaches reading the KV cache at decode
E_ANE = 0.3  # guess: share of the Neural Engine's quoted TOPS a drafter's small matrices reach
E_CPU_FLOPS = 0.2e12  # guess: flop/s the CPU cores reach on few-row products (NEON / AMX)


@dataclass(frozen=True)
class Shape:
    """What prices a pass: a dense decoder's sizes."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False  # the output matrix is the embedding's (read once a pass either way)

    @property
    def weights(self) -> int:
        """Weights read by one pass: every layer's matrices and the output matrix (the embedding
        is looked up, a row a token, when untied)."""
        h, hd = self.hidden, self.head_dim
        attn = h * self.heads * hd * 2 + h * self.kv_heads * hd * 2
        mlp = 3 * h * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * h

    def kv_bytes(self, L: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * int(L) * KV_BYTES

    def attention_flops(self, L: int) -> float:
        """Per position, attending to L positions: q.k and p.v over every head."""
        return 4.0 * self.layers * self.heads * self.head_dim * L

    @classmethod
    def of(cls, model) -> Shape:
        """The shape of an MLX model (its `args`), for any model of edgespec.models."""
        a = getattr(model, "args", model)
        h = int(a.hidden_size)
        heads = int(a.num_attention_heads)
        hd = int(getattr(a, "head_dim", None) or h // heads)
        return cls(int(a.num_hidden_layers), h, int(a.intermediate_size), heads,
                   int(getattr(a, "num_key_value_heads", None) or heads), hd, int(a.vocab_size),
                   bool(getattr(a, "tie_word_embeddings", False)))


# Published shapes used by the calibration and by `edgespec bench --verifier-shape`.
SHAPES = {
    "llama2-7b": Shape(32, 4096, 11008, 32, 32, 128, 32000),
    "llama3-8b": Shape(32, 4096, 14336, 32, 8, 128, 128256),
    "qwen3-0.6b": Shape(28, 1024, 3072, 16, 8, 128, 151936, tied=True),
    "qwen3-1.7b": Shape(28, 2048, 6144, 16, 8, 128, 151936, tied=True),
    "qwen3-4b": Shape(36, 2560, 9728, 32, 8, 128, 151936, tied=True),
    "qwen3-8b": Shape(36, 4096, 12288, 32, 8, 128, 151936),
    "smollm2-135m": Shape(30, 576, 1536, 9, 3, 64, 49152, tied=True),
}


def _bits(fmt: str) -> float:
    try:
        return FORMATS[fmt.lower()]
    except KeyError:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}") from None


class RooflineCosts:
    """Seconds of the passes of one model at one weight format on one profile."""

    def __init__(self, profile: Profile | str, shape: Shape, fmt: str = "q4_0"):
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.shape, self.fmt = shape, fmt.lower()
        self.bits = _bits(fmt)

    # ------------------------------------------------------------------ the GPU
    def verify(self, T: int, L: int = 0) -> float:
        """One pass over T positions after L cached ones, on the GPU."""
        p, s = self.profile, self.shape
        T, L = max(int(T), 1), max(int(L), 0)
        w = s.weights
        mem = (w * self.bits / 8 + s.kv_bytes(T)) / (p.bandwidth_gbs * 1e9 * E_BW)
        comp = T * 2.0 * w / (p.gpu_tflops * 1e12 * E_FLOPS)
        deq = 0.0 if self.bits >= 16 else w * DEQUANT_OPS / (p.gpu_tflops * 1e12)
        # Attention is its own kernel after the products: the cache read once for all T queries.
        attn = max(s.kv_bytes(L) / (p.bandwidth_gbs * 1e9 * E_KV),
                   T * s.attention_flops(L + T / 2) / (p.gpu_tflops * 1e12 * E_FLOPS))
        return max(mem, comp) + deq + attn + s.layers * KERNELS_PER_LAYER * p.launch_us * 1e-6

    def prefill(self, P: int, L0: int = 0) -> float:
        """A prompt of P positions after L0 cached ones (chunks of PREFILL_CHUNK)."""
        out, done = 0.0, 0
        while done < P:
            n = min(PREFILL_CHUNK, P - done)
            out += self.verify(n, L0 + done)
            done += n
        return out

    # ------------------------------------------------------------------ a drafter
    def draft_step(self, shape: Shape, fmt: str = "q4_0", device: str = "gpu", unseen: int = 0,
                   L: int = 0) -> float:
        """One drafted token of a drafter of `shape` on `device` ("gpu", "ane", "cpu"), after
        feeding `unseen` committed tokens it had not seen (one pass over them)."""
        p = self.profile
        bits = _bits(fmt)
        if device == "gpu":
            d = RooflineCosts(p, shape, fmt)
            return d.verify(1 + unseen, L) if unseen else d.verify(1, L)
        T = 1 + max(int(unseen), 0)
        bytes_ = shape.weights * bits / 8 + shape.kv_bytes(L)
        flops = T * (2.0 * shape.weights + shape.attention_flops(L))
        if device == "ane":
            return max(bytes_ / (0.5 * p.bandwidth_gbs * 1e9 * E_BW), flops / (p.ane_tops * 1e12 * E_ANE)) \
                + p.ane_call_us * 1e-6
        if device == "cpu":
            return max(bytes_ / p.cpu_bw, flops / E_CPU_FLOPS)
        raise ValueError(f"unknown drafter device {device!r}: gpu, ane or cpu")

    def concurrent(self, gpu_s: float, other_s: float, other_bytes: float) -> float:
        """Seconds until both a GPU pass of `gpu_s` and another unit's work of `other_s` (reading
        `other_bytes`) are done, run at the same time: the other unit's bytes also take the shared
        bandwidth from the GPU's pass."""
        taken = other_bytes / (self.profile.bandwidth_gbs * 1e9 * E_BW)
        return max(gpu_s + taken, other_s)


# ---------------------------------------------------------------------------- calibration
SRC_XD = ("XiongjieDai/GPU-Benchmarks-on-LLM-Inference README, llama.cpp llama-bench "
          "(LLaMA 3: snapshot of May 2024; LLaMA 2: Dec 2023)")


@dataclass(frozen=True)
class Published:
    profile: str
    model: str  # a SHAPES key
    fmt: str
    test: str  # "tg512", "tg4096" or "pp512"
    tok_s: float
    note: str = ""
    bound: float = 0.30  # the largest relative error the test accepts for this row
    source: str = SRC_XD


CALIBRATION: tuple[Published, ...] = (
    Published("m1", "llama3-8b", "q4_k_m", "tg512", 10.20, "7-core GPU, 8 GB"),
    Published("m1", "llama3-8b", "q4_k_m", "pp512", 94.48, "7-core GPU, 8 GB"),
    Published("m1-max", "llama3-8b", "q4_k_m", "tg512", 35.73),
    Published("m1-max", "llama3-8b", "q4_k_m", "tg4096", 31.18),
    Published("m1-max", "llama3-8b", "q4_k_m", "pp512", 408.23),
    Published("m1-max", "llama3-8b", "f16", "tg512", 18.75),
    Published("m1-max", "llama3-8b", "f16", "tg4096", 16.33),
    Published("m1-max", "llama3-8b", "f16", "pp512", 517.34),
    Published("m2-ultra", "llama3-8b", "q4_k_m", "tg512", 78.81),
    Published("m2-ultra", "llama3-8b", "q4_k_m", "tg4096", 64.58),
    Published("m2-ultra", "llama3-8b", "q4_k_m", "pp512", 994.04),
    Published("m2-ultra", "llama3-8b", "f16", "tg512", 36.90),
    Published("m2-ultra", "llama3-8b", "f16", "tg4096", 33.67),
    Published("m2-ultra", "llama3-8b", "f16", "pp512", 1175.40),
    Published("m3-max", "llama3-8b", "q4_k_m", "tg512", 48.97),
    Published("m3-max", "llama3-8b", "q4_k_m", "tg4096", 44.21),
    Published("m3-max", "llama3-8b", "q4_k_m", "pp512", 693.32),
    Published("m3-max", "llama3-8b", "f16", "tg512", 22.04),
    Published("m3-max", "llama3-8b", "f16", "tg4096", 20.72),
    Published("m3-max", "llama3-8b", "f16", "pp512", 769.84),
    Published("m3", "llama2-7b", "q4_0", "tg128", 20.79, "10-core GPU, 16 GB; mean of 3 runs"),
    Published("m3", "llama2-7b", "q4_0", "pp512", 184.51, "10-core GPU, 16 GB; mean of 3 runs"),
    Published("m3-max", "llama2-7b", "q4_0", "tg128", 63.11, "mean of 3 runs"),
    Published("m3-max", "llama2-7b", "q4_0", "pp512", 740.97, "mean of 3 runs"),
    Published("m3-max", "llama2-7b", "f16", "tg128", 24.76, "mean of 3 runs"),
    Published("m3-max", "llama2-7b", "f16", "pp512", 761.40, "mean of 3 runs"),
)


def predict(row: Published) -> float:
    """The model's tokens/s for a published test: tgN = N tokens generated one pass each from an
    empty context (priced at the mean context N/2), ppN = one prompt of N positions."""
    m = RooflineCosts(row.profile, SHAPES[row.model], row.fmt)
    n = int(row.test[2:])
    if row.test.startswith("tg"):
        return 1.0 / m.verify(1, n // 2)
    return n / m.prefill(n)


def calibration_table() -> list[dict]:
    """Each published row with the model's prediction and the relative error."""
    out = []
    for r in CALIBRATION:
        pred = predict(r)
        out.append(dict(profile=r.profile, model=r.model, fmt=r.fmt, test=r.test, published=r.tok_s,
                        predicted=round(pred, 2), error=round(pred / r.tok_s - 1.0, 3), bound=r.bound,
                        note=r.note))
    return out


def fit() -> tuple[float, float, float, float]:
    """(E_BW, E_FLOPS, DEQUANT_OPS, E_KV) minimising the squared log error over CALIBRATION (a grid:
    how the constants above were found; kept so a new published row can refit them)."""
    global E_BW, E_FLOPS, DEQUANT_OPS, E_KV
    saved = E_BW, E_FLOPS, DEQUANT_OPS, E_KV
    best = (math.inf, saved)
    try:
        for e_bw in [x / 100 for x in range(60, 101, 2)]:
            for e_f in [x / 100 for x in range(50, 91, 2)]:
                for dq in [x / 2 for x in range(0, 30)]:
                    for e_kv in (0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4):
                        E_BW, E_FLOPS, DEQUANT_OPS, E_KV = e_bw, e_f, dq, e_kv
                        err = sum(math.log(predict(r) / r.tok_s) ** 2 for r in CALIBRATION)
                        if err < best[0]:
                            best = (err, (e_bw, e_f, dq, e_kv))
    finally:
        E_BW, E_FLOPS, DEQUANT_OPS, E_KV = saved
    return best[1]
