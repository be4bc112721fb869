"""Shared fixtures: tiny random models built in memory, and the real default model on demand."""

from __future__ import annotations

import os
import random
from pathlib import Path

import mlx.core as mx
import pytest
from edgespec.models.llama import Model, ModelArgs
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers import models as tk_models

from edgespec.engine import Engine
from edgespec.tokenizer import Tokenizer
from edgespec.weights.loader import LoadedModel

REPO = Path(__file__).resolve().parents[1]


def tiny_args(**overrides) -> ModelArgs:
    cfg = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    cfg.update(overrides)
    return ModelArgs.from_dict(cfg)


def make_tiny_model(seed: int = 0, scale: float = 1.0, **overrides) -> Model:
    """Random tiny Llama. `scale` multiplies the weights: larger = peakier distributions."""
    mx.random.seed(seed)
    model = Model(tiny_args(**overrides))
    if scale != 1.0:
        from mlx.utils import tree_map

        model.update(tree_map(lambda p: p * scale if p.ndim > 1 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def random_prompts(count: int, seed: int = 0, max_len: int = 25) -> list[list[int]]:
    """Mixed prompts of ids 1..63: random ones, and every third repeated three times (copy-heavy,
    for prompt lookup and the n-gram pool)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        p = [rng.randrange(1, 64) for _ in range(rng.randrange(1, max_len))]
        out.append(p * 3 if i % 3 == 0 else p)
    return out


def make_tiny_tokenizer(vocab_size: int = 64) -> Tokenizer:
    """Word-level tokenizer over single characters: ids 0..vocab_size-1, id 0 = EOS."""
    chars = [chr(c) for c in range(97, 97 + 26)] + [chr(c) for c in range(65, 65 + 26)] + list("0123456789 .")
    vocab = {"</s>": 0}
    for ch in chars:
        if len(vocab) >= vocab_size:
            break
        vocab[ch] = len(vocab)
    backend = HFTokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, {"eos_token": "</s>"})


# JSON's punctuation pairs as single tokens, as real BPE vocabularies have them: a token that
# ends one lexeme and starts the next (`{"`: the object, then a key) is where a grammar
# matcher's state is most delicate (issue 42: tests/test_grammar_forks.py).
JSON_PAIRS = ('{"', '["', '",', '":', '"]', '"}', '"],', '"]]', ': "', ', "', ': [', ': {', '[[', ']]', '},', '],')


def make_json_tokenizer() -> Tokenizer:
    """EOS, the 95 printable ASCII characters (ids 1-95, one a token) and JSON_PAIRS (ids 96-).
    It encodes text one character a token; the pairs are there to be drafted and masked."""
    vocab = {"</s>": 0}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    for pair in JSON_PAIRS:
        vocab[pair] = len(vocab)
    backend = HFTokenizer(tk_models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, {"eos_token": "</s>"})


def make_tiny_engine(seed: int = 0, **overrides) -> Engine:
    model = make_tiny_model(seed, **overrides)
    tok = make_tiny_tokenizer(model.args.vocab_size)
    return Engine(LoadedModel(model, tok, None))


@pytest.fixture
def tiny_model() -> Model:
    return make_tiny_model()


@pytest.fixture
def tiny_engine() -> Engine:
    return make_tiny_engine()


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF (downloaded once into the cache folder)."""
    from edgespec.weights.default_model import default_gguf_path

    return default_gguf_path(progress=False)


@pytest.fixture(scope="session")
def real_bundle() -> Path:
    """Dense bundle of the default model (converted once into the cache folder)."""
    from edgespec.converters.default_model import default_bundle_path

    return default_bundle_path(progress=False)


@pytest.fixture(scope="session")
def real_engine(real_bundle) -> Engine:
    import edgespec

    return edgespec.load(real_bundle, drafter="none", progress=False)


def pytest_configure(config):
    """The device the suite assumes: the CPU (a Mac's default is its GPU). Tests marked `metal`
    or `macos` run on the default device instead (`_device_of_mac_tests`)."""
    mx.set_default_device(mx.cpu)


@pytest.fixture(autouse=True)
def _device_of_mac_tests(request):
    if request.node.get_closest_marker("metal") is None and request.node.get_closest_marker("macos") is None:
        yield
        return
    mx.set_default_device(mx.gpu if mx.metal.is_available() else mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(mx.cpu)


@pytest.fixture
def cpu_device():
    """For a test that needs the CPU device whatever the suite's pin says (the int8 drafter's)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(before)


def pytest_collection_modifyitems(config, items):
    import sys

    for item in items:
        if "macos" in item.keywords and sys.platform != "darwin":
            item.add_marker(pytest.mark.skip(reason="needs macOS (Core ML runtime / Metal); this is " + sys.platform))
        if "metal" in item.keywords and not mx.metal.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a Metal GPU (mx.metal.is_available() is False)"))


os.environ.setdefault("EDGESPEC_HOME", str(REPO / ".cache" / "edgespec"))
# Learnt pass costs are not read from or written to the cache folder (edgespec.calibration): every
# test process starts from the same prior; tests/test_first_use.py turns it on in a temp home.
os.environ.setdefault("EDGESPEC_CALIBRATION", "off")
# The BLAS shim's kernel takes every few-row product, as built, instead of the row counts this
# host's timing gives it (edgespec.kernels.cpu_blas.apply_verdicts): every test process computes
# the same bits whatever the load; tests/test_cpu_blas_verdicts.py turns it on in a temp home.
os.environ.setdefault("EDGESPEC_KERNEL_CHECKS", "off")
# Every emitted token is checked against the verifier row that drew it (edgespec.logits.exactness).
os.environ.setdefault("EDGESPEC_CHECK_EXACT", "1")


def write_tiny_hf_folder(folder: Path, seed: int = 0, **overrides) -> Path:
    """A Hugging Face-style model folder (config.json, model.safetensors, tokenizer files)."""
    import json

    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(seed, **overrides)
    (folder / "config.json").write_text(json.dumps(model.args.to_dict()))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    make_tiny_tokenizer(model.args.vocab_size).save(folder)
    return folder


def write_tiny_bundle(folder: Path, seed: int = 0, **overrides) -> Path:
    """An edgespec bundle of a tiny random model (via the real converter)."""
    from edgespec.converters.convert import convert

    src = write_tiny_hf_folder(folder.parent / f".{folder.name}-hf", seed, **overrides)
    convert(src, folder, quantize="none", dtype="float32", progress=False)
    return folder


def pytest_sessionfinish(session, exitstatus):
    """Stop the pipelined drafter's worker thread while the interpreter is still whole."""
    from edgespec.modes.speculative import _Worker

    _Worker._shutdown()


class PacedClock:
    """Time that passes only while a paced model runs (`PacedModel`): what `auto` measures on it
    is the pacing alone, whatever else loads the host, so a paced test decides the same on any
    host and under any load."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class PacedModel:
    """A model whose every forward call takes `seconds`, whatever its width.

    Stands in for an accelerator where a verifier pass costs about the same for 1 or 32
    tokens and dwarfs the host's bookkeeping (a tiny model on a CPU is the opposite), so
    tests of cost-driven choices see the regime the choices are made for.

    clock: a PacedClock the call advances by `seconds` (deterministic: the decoder times by it,
    make_paced_engine); None sleeps `seconds` of wall time instead (tests of what the host's own
    timer makes of a slow pass).
    """

    def __init__(self, model, seconds: float = 0.005, clock: PacedClock | None = None):
        self._model = model
        self._seconds = seconds
        self._clock = clock

    def __call__(self, *args, **kwargs):
        if self._clock is not None:
            self._clock.t += self._seconds
        else:
            import time

            time.sleep(self._seconds)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def make_paced_engine(seed: int = 0, seconds: float = 0.005, **overrides) -> Engine:
    """A tiny engine on paced time: every verifier pass costs `seconds` of a PacedClock, host work
    and draft calls nothing, and `auto`'s timed policy reads that clock (Engine.policy), so its
    choices are the same on every host and under any load."""
    from edgespec.adaptive.policy import TimedPolicy

    model = make_tiny_model(seed, **overrides)
    clock = PacedClock()
    engine = Engine(LoadedModel(PacedModel(model, seconds, clock), make_tiny_tokenizer(model.args.vocab_size), None))
    engine.policy = TimedPolicy(clock=clock)
    return engine


def paced(engine: Engine, model, seconds: float):
    """`model` (a drafter's) paced on a paced engine's clock: its every call costs `seconds` there
    (a drafter measured as free keeps its prior price, unlike any real one)."""
    return PacedModel(model, seconds, engine.policy.clock)


def count_drafts(drafter, monkeypatch) -> list[int]:
    """The k of every draft call drafters of this one's class get from now on: counted on the
    class, since each request drafts with a fork of the engine's drafter
    (drafters.base.request_drafter)."""
    calls, draft = [], type(drafter).draft

    def counted(self, k, sampler, **ranking):
        calls.append(k)
        return draft(self, k, sampler, **ranking)

    monkeypatch.setattr(type(drafter), "draft", counted)
    if drafter.caps.trees:  # a drafter growing its own trees drafts them in auto and tree (depth counted)
        grow = type(drafter).draft_tree

        def counted_tree(self, depth, *a, **kw):
            calls.append(depth)
            return grow(self, depth, *a, **kw)

        monkeypatch.setattr(type(drafter), "draft_tree", counted_tree)
    return calls


def run_at_once(fn, n: int = 4) -> list:
    """fn(0..n-1) on n threads released together (a batch forms); their results in order."""
    import threading

    got: list = [None] * n
    start = threading.Barrier(n)

    def run(i):
        start.wait()
        got[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got
