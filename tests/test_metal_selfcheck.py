"""The Metal kernels' self-check at first use, on any machine: Metal is stood in for by the C++
emulation (edgespec.kernels.emulate.standing_in, which makes on_metal() true and routes every
kernel build to the emulator), and failures are injected into that stand-in: a kernel that does
not compile, a kernel that computes a wrong result. Each falls back to its reference ops with a
one-line warning, once; the verdict is kept for the machine; the run goes on and its output is
still exactly plain decoding's."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_engine

from edgespec.kernels import emulate, spec, verdicts
from edgespec.kernels.kv import kv_gather, kv_gather_reference
from edgespec.kernels.tree import tree_accept, tree_mask, tree_mask_reference
from edgespec.kernels.verdicts import Verdict

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler to emulate Metal kernels")


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("emu")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    verdicts.forget()
    yield tmp_path / "home"
    verdicts.forget()


class Broken:
    """A stand-in kernel that fails to compile (raises as MLX does when the Metal library does
    not build) or wraps a working one and spoils its first output."""

    def __init__(self, working=None, spoil=None):
        self.working, self.spoil, self.calls = working, spoil, 0

    def __call__(self, **kw):
        self.calls += 1
        if self.working is None:
            raise RuntimeError("[metal::Device] Unable to build metal library from source\n"
                               "program_source:12:5: error: use of undeclared identifier 'idx2'")
        outs = self.working(**kw)
        return [self.spoil(outs[0]), *outs[1:]]


def inject(name: str, broken: Broken):
    """Within standing_in: the kernel `name` is `broken` (its working stand-in handed to it)."""
    real = spec._backend

    def build(s):
        if s.name != name:
            return real(s)
        if broken.spoil is not None and broken.working is None:
            broken.working = real(s)
        return broken

    spec.set_backend(build)


def test_off_metal_nothing_is_checked_or_kept(home):
    assert not spec.on_metal()
    src = mx.arange(24, dtype=mx.float16).reshape(1, 1, 6, 4)
    np.testing.assert_array_equal(np.array(kv_gather(src, mx.array([4, 1]))), np.array(src[:, :, [4, 1]]))
    assert verdicts.all_verdicts() == []


def test_a_kernel_that_does_not_compile_falls_back_with_one_line_once(home, emu_dir):
    src = mx.array(np.random.default_rng(0).standard_normal((1, 2, 8, 16)).astype(np.float16))
    idx = mx.array([5, 2, 7], dtype=mx.int32)
    with emulate.standing_in(emu_dir) as made:
        broken = Broken()
        inject("edgespec_kv_gather", broken)
        with pytest.warns(RuntimeWarning) as caught:
            got = kv_gather(src, idx)
        msg = str(caught[0].message)
        assert len(caught) == 1 and "\n" not in msg
        assert "edgespec_kv_gather (float16)" in msg and "Unable to build metal library" in msg
        assert "reference ops run instead" in msg
        np.testing.assert_array_equal(np.array(got), np.array(kv_gather_reference(src, idx)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second use: no check, no warning
            np.testing.assert_array_equal(np.array(kv_gather(src, idx)), np.array(kv_gather_reference(src, idx)))
        assert broken.calls == 1  # the self-check's compile attempt only
        v = verdicts.get("edgespec_kv_gather", "float16")
        assert v.status == "fallback" and v.note.startswith("RuntimeError: [metal::Device] Unable to build")
        # the other kernels are unaffected
        p = mx.array([-1, 0, 0, 1], dtype=mx.int32)
        tree_mask(p, 3)
        assert made["edgespec_tree_mask"].calls >= 2 and verdicts.get("edgespec_tree_mask", "int32").used
        # another dtype of the same kernel is its own verdict (and here its own broken build)
        with pytest.warns(RuntimeWarning, match=r"edgespec_kv_gather \(float32\)"):
            kv_gather(src.astype(mx.float32), idx)


def test_a_wrong_result_falls_back_and_decoding_stays_exact(home, emu_dir):
    engine = make_tiny_engine(0)
    prompt = [1, 5, 9, 5, 9, 5, 9, 3, 7, 1, 5, 9]
    want = engine.generate(prompt, max_tokens=24, mode="plain").tokens
    with emulate.standing_in(emu_dir):
        broken = Broken(spoil=lambda mask: mx.ones_like(mask))  # every node sees every other: wrong
        inject("edgespec_tree_mask", broken)
        with pytest.warns(RuntimeWarning, match=r"edgespec_tree_mask \(int32\).*KernelMismatch") as caught:
            got = engine.generate(prompt, max_tokens=24, mode="lookahead").tokens
        assert len([w for w in caught if "edgespec_tree_mask" in str(w.message)]) == 1
        assert got == want
        assert broken.calls == 1  # checked once (it failed on its first tree), never used after
        assert verdicts.get("edgespec_tree_mask", "int32").status == "fallback"
        assert verdicts.get("edgespec_tree_accept", "int32").used  # lookahead's other kernel runs
        p = mx.array([-1, 0, 1], dtype=mx.int32)
        np.testing.assert_array_equal(np.array(tree_mask(p, 2)[0]), np.array(tree_mask_reference(p, 2)[0]))


def test_a_verdict_is_kept_for_the_machine_not_rechecked_each_process(home, emu_dir):
    with emulate.standing_in(emu_dir) as made:
        tokens, parents, pred = (mx.array(a, dtype=mx.int32) for a in ([0, 4, 2], [-1, 0, 1], [4, 2, 2]))
        assert tree_accept(tokens, parents, pred).tolist() == [2, 2, 2]
        first = made["edgespec_tree_accept"].calls  # the self-check's calls and this one
        assert first > 1
        spec.forget_checks()
        verdicts.forget()  # as a new process would
        assert tree_accept(tokens, parents, pred).tolist() == [2, 2, 2]
        assert made["edgespec_tree_accept"].calls == first + 1  # no second check
    saved = verdicts.path()
    assert saved.is_file() and "edgespec_tree_accept|int32" in saved.read_text()
    # a kept fallback is honoured: the kernel is never built, the note is shown once
    verdicts.put(Verdict("edgespec_kv_gather", "bfloat16", "fallback", "KernelMismatch: kv_gather: 3 of 9 differ"))
    verdicts.forget()
    with emulate.standing_in(emu_dir) as made:
        src = mx.arange(32, dtype=mx.bfloat16).reshape(1, 1, 8, 4)
        with pytest.warns(RuntimeWarning, match="KernelMismatch: kv_gather: 3 of 9 differ"):
            got = kv_gather(src, mx.array([6, 1], dtype=mx.int32))
        assert "edgespec_kv_gather" not in made
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(src[:, :, [6, 1]].astype(mx.float32)))
