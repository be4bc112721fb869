"""One short generation per decoding mode with every Metal kernel emulated: the dispatchers are
told they run on an Apple GPU (edgespec.kernels.emulate.standing_in) and each kernel's exact
Metal source runs as C++, self-check included. Greedy output equals plain decoding's (computed
without emulation), and the kernels each mode relies on did run."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import make_tiny_engine, make_tiny_model

from edgespec.drafters.mlx_drafter import MLXDrafter
from edgespec.kernels import emulate, verdicts

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler to emulate Metal kernels")

PROMPT = [1, 5, 9, 5, 9, 5, 9, 3, 7, 1, 5, 9, 5, 9, 2]
N = 20


class Perturbed:
    """A drafter model: the verifier's logits with the top token pushed down at every third
    position, so drafts are accepted up to there and rejected mid-chain (and, in trees, a
    sibling other than the first is kept: the KV gather moves entries)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kw):
        out = self._model(inputs, cache, **kw)
        T = inputs.shape[1]
        end = max(c.offset for c in cache)
        bad = ((mx.arange(end - T, end) + 1) % 3 == 0)[None, :, None]
        return mx.where(bad & (out == out.max(axis=-1, keepdims=True)), out - 30.0, out)


@pytest.fixture(scope="module")
def engine():
    e = make_tiny_engine(0)
    e.drafter = MLXDrafter(Perturbed(make_tiny_model(0)))
    return e


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate(PROMPT, max_tokens=N, mode="plain").tokens


@pytest.fixture
def mac(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    verdicts.forget()
    with emulate.standing_in(tmp_path_factory.getbasetemp() / "emu_modes") as made:
        yield made
    verdicts.forget()


# mode -> kernels it must have run (beyond their self-checks)
MODES = {
    "plain": (),
    "speculative": (),
    "prompt_lookup": (),
    "lookahead": ("edgespec_tree_mask", "edgespec_tree_accept"),
    "tree": ("edgespec_tree_mask", "edgespec_tree_accept"),  # (the gather: the test below)
    "cascade": (),
    "auto": ("edgespec_tree_accept",),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_with_every_kernel_emulated_equals_plain(engine, plain, mac, mode):
    got = engine.generate(PROMPT, max_tokens=N, mode=mode)
    assert got.tokens == plain
    for name in MODES[mode]:
        assert name in mac and mac[name].calls > 1, f"{mode} did not run {name}"
    assert all(v.used for v in verdicts.all_verdicts())  # every kernel that ran passed its check


def test_half_model_tree_and_lookahead_equal_plain_and_commit_through_the_half_gather(mac):
    """A float16 model, as a Mac runs one: its KV caches are half. Tree and lookahead decoding
    with the kernels emulated equal plain; a tree step's commit of a half cache (commit_kv) goes
    through the half gather, bit for bit what KVCache.keep does."""
    from edgespec.caches.kv import KVCache
    from edgespec.kernels import commit_kv

    e = make_tiny_engine(0)
    d = make_tiny_model(0)
    for m in (e.model, d):
        m.set_dtype(mx.float16)
        mx.eval(m.parameters())
    e.drafter = MLXDrafter(Perturbed(d))
    prompt = [8, 32, 49, 29, 31, 42, 25, 51, 14]
    plain = e.generate(prompt, max_tokens=N, mode="plain").tokens
    for mode in ("tree", "lookahead"):
        assert e.generate(prompt, max_tokens=N, mode=mode).tokens == plain
    caches, want = [KVCache() for _ in range(2)], [KVCache() for _ in range(2)]
    k = (mx.arange(2 * 3 * 9 * 8).reshape(2, 3, 9, 8) * 0.37 - 50).astype(mx.float16)
    for c in caches + want:
        c.update_and_fetch(k, -k)
    commit_kv(caches, 2, [0, 3, 5, 6])  # a step at 2..8 whose kept path skips entries: they move
    for c in want:
        c.keep(2, [0, 3, 5, 6])
    for c, w in zip(caches, want, strict=True):
        assert c.offset == w.offset == 6
        for a, b in zip(c.state, w.state, strict=True):
            assert a.dtype == mx.float16 and mx.array_equal(a, b).item()
    gather = mac["edgespec_kv_gather"]
    assert gather.calls > 1 and {key[0][0] for key in gather.built} == {mx.float16}
    assert verdicts.get("edgespec_kv_gather", "float16").used
