"""Every CPU kernel runs only where it beats what it replaces on this host (edgespec.kernels.host):
the base-2 exponentials, the grouped attention path, numpy's prompt-chunk attention and activation,
each timed once per machine and kept as a verdict; a kernel that loses is not used, and the
output stays the model's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model, random_prompts

from edgespec.kernels import activation, attention, base2, host, verdicts

KERNELS = (base2.KERNEL, attention.GROUPED_KERNEL, attention.NUMPY_KERNEL, activation.KERNEL)


@pytest.fixture
def checks(tmp_path, monkeypatch):
    """Kernel checks on, a fresh verdict store, every path as built (restored afterwards), and
    `race` replaced by a scripted one: the kernels named in `losers` lose, the others win.
    -> (losers, timed): the set to fill, the (kernel, variant) pairs raced."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGESPEC_KERNEL_CHECKS", "on")
    monkeypatch.setattr(base2, "ENABLED", True)
    monkeypatch.setitem(attention.TAKES, "grouped", True)
    monkeypatch.setitem(attention.TAKES, "numpy", True)
    monkeypatch.setitem(activation.TAKES, "numpy", True)
    monkeypatch.setattr(host.cpu_blas, "apply_verdicts", lambda: 0)  # its own tests time it
    verdicts.forget()
    losers: set[str] = set()
    timed: list[tuple[str, str]] = []

    def race(kernel, variant, fast, replaced, reps=5, what=""):
        fast(), replaced()  # both paths run (a broken one would raise here)
        timed.append((kernel, variant))
        lost = kernel in losers
        return verdicts.Verdict(kernel, variant, "slower" if lost else "native", "scripted")

    monkeypatch.setattr(verdicts, "race", race)
    yield losers, timed
    verdicts.forget()


def test_each_kernel_is_timed_once_per_machine_and_used_where_it_wins(checks):
    losers, timed = checks
    got = host.settle()
    assert got["base2"] and got["attention"] == {"grouped": True, "numpy": True} and got["activation"]["numpy"]
    assert [k for k, _ in timed] == list(KERNELS)
    assert {(v.kernel, v.variant) for v in verdicts.all_verdicts()} == set(timed)
    assert dict(timed)[attention.NUMPY_KERNEL] == "against=grouped"  # compared with the path it replaces
    timed.clear()
    verdicts.forget()  # a new process on the same machine reads them back
    host.settle()
    assert timed == []


@pytest.mark.parametrize("lost", KERNELS)
def test_a_kernel_that_loses_is_not_used(checks, lost):
    losers, timed = checks
    losers.add(lost)
    host.settle()
    assert base2.ENABLED == (lost != base2.KERNEL)
    assert attention.TAKES["numpy"] == (lost != attention.NUMPY_KERNEL)
    assert activation.TAKES["numpy"] == (lost != activation.KERNEL)
    if lost == base2.KERNEL:
        # no base-2 forms: the grouped path (base 2) is not raced, numpy's races the fused kernel
        assert attention.GROUPED_KERNEL not in dict(timed)
        assert dict(timed)[attention.NUMPY_KERNEL] == "against=fused"
        assert dict(timed)[activation.KERNEL] == "against=mlx"
    else:
        assert attention.TAKES["grouped"] == (lost != attention.GROUPED_KERNEL)
    q = mx.random.normal((1, 9, 128, 64), key=mx.random.key(1))
    k, v = (mx.random.normal((1, 3, 256, 64), key=mx.random.key(i)) for i in (2, 3))
    assert attention.use_numpy_attention(q, k) == (lost != attention.NUMPY_KERNEL)
    gate = mx.zeros((128, 32))
    assert activation.use_numpy_activation("silu", gate) == (lost != activation.KERNEL)
    # whichever path runs, attention is attention
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    np.testing.assert_allclose(np.array(attention.attention(q, k, v, 0.125, "causal")), np.array(want),
                               rtol=1e-4, atol=1e-5)


def test_a_model_gives_its_logits_whichever_kernels_run(checks, tmp_path, monkeypatch):
    """A prompt chunk long enough for numpy's paths, then a decoding step: the logits with every
    kernel losing are those with every kernel winning, within float32 rounding."""
    losers, _ = checks
    model = make_tiny_model(0, scale=2.0)
    prompt = mx.array([(random_prompts(1, seed=5)[0] * 40)[:192]])
    calls = []
    for mod, name in ((attention, "numpy_attention"), (activation, "numpy_gated")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **kw: (calls.append(name), real(*a, **kw))[1])

    def run():
        cache = model.make_cache()
        chunk = model(prompt, cache)
        step = model(mx.array([[3]]), cache)
        return np.array(chunk[0, -1]), np.array(step[0, -1])

    host.settle()
    calls.clear()  # the races ran both paths
    fast = run()
    assert {"numpy_attention", "numpy_gated"} <= set(calls)  # the chunk took numpy's paths
    calls.clear()
    losers.update(KERNELS)  # another machine (home), where every kernel loses
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "other"))
    verdicts.forget()
    host.settle()
    assert not (base2.ENABLED or attention.TAKES["numpy"] or activation.TAKES["numpy"])
    calls.clear()
    slow = run()
    assert calls == []
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        assert int(np.argmax(a)) == int(np.argmax(b))


def test_off_by_setting_nothing_is_timed(checks, monkeypatch):
    losers, timed = checks
    monkeypatch.setenv("EDGESPEC_KERNEL_CHECKS", "off")
    losers.update(KERNELS)
    got = host.settle()
    assert timed == [] and got["base2"] and got["attention"]["numpy"] and got["activation"]["numpy"]
    assert not verdicts.path().exists()
