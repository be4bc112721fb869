"""The BLAS shim's few-row kernel takes only the row counts where it beats OpenBLAS on this host:
timed once per machine (edgespec.kernels.cpu_blas.apply_verdicts), kept as verdicts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgespec.kernels import cpu_blas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_shim = pytest.mark.skipif(cpu_blas._mask_calls() is None,
                                reason="needs the CBLAS shim preloaded (LD_PRELOAD=$(make -s preload))")

_CHILD = r"""
import json, sys
import mlx.core as mx
from edgespec.kernels import cpu_blas, verdicts
timed = []
real = cpu_blas._time_class
def fake(rows, set_mask, reps=cpu_blas.CHECK_REPS):
    timed.append(rows)
    # the kernel wins up to 3 rows, loses above (as on a host without AVX-512)
    return (1.0, 2.0) if rows <= 3 else (2.0, 1.0)
cpu_blas._time_class = fake if sys.argv[1] == "fake" else real
mask = cpu_blas.apply_verdicts()
x = mx.random.normal((6, 64)); w = mx.random.normal((128, 64))
print(json.dumps({"mask": mask, "timed": timed, "takes": [cpu_blas.takes(m) for m in range(1, 33)],
                  "kernel": cpu_blas.few_row_kernel(),
                  "verdicts": {v.variant: v.status for v in verdicts.all_verdicts() if v.kernel == cpu_blas.KERNEL}}))
"""


def _child(tmp_path, how: str) -> dict:
    import json

    env = {**os.environ, "EDGESPEC_HOME": str(tmp_path / "home"), "EDGESPEC_KERNEL_CHECKS": "on"}
    r = subprocess.run([sys.executable, "-c", _CHILD, how], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_shim
def test_the_kernel_takes_only_the_row_classes_it_wins_and_times_them_once(tmp_path):
    first = _child(tmp_path, "fake")
    assert first["timed"] == [lo for lo, _ in cpu_blas.ROW_CLASSES]
    assert first["mask"] == 0b111 and first["kernel"] == 3
    assert first["takes"] == [m <= 3 for m in range(1, 33)]
    assert first["verdicts"]["rows=1-1"] == "native" and first["verdicts"]["rows=4-5"] == "slower"
    again = _child(tmp_path, "fake")  # a new process on the same machine: the verdicts are kept
    assert again["timed"] == [] and again["mask"] == 0b111


@needs_shim
def test_the_real_timing_gives_a_verdict_for_every_class(tmp_path):
    out = _child(tmp_path, "real")
    assert set(out["verdicts"]) == {f"rows={lo}-{hi}" for lo, hi in cpu_blas.ROW_CLASSES}
    for lo, hi in cpu_blas.ROW_CLASSES:  # the mask says what the verdicts say, class by class
        used = out["verdicts"][f"rows={lo}-{hi}"] == "native"
        assert all(out["takes"][m - 1] == used for m in range(lo, hi + 1))


@needs_shim
def test_off_by_setting_every_class_is_the_kernels(tmp_path):
    env = {**os.environ, "EDGESPEC_HOME": str(tmp_path / "home"), "EDGESPEC_KERNEL_CHECKS": "off"}
    code = "from edgespec.kernels import cpu_blas; print(cpu_blas.apply_verdicts(), cpu_blas.few_row_kernel())"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(0xFFFFFFFF), "32"]
    assert not (tmp_path / "home" / "kernels").exists()


@needs_shim
@pytest.mark.parametrize("mask", [0, 0b111, 0xFFFFFFFF])
def test_greedy_decoding_equals_plain_whatever_rows_the_kernel_takes(mask, monkeypatch):
    """Which BLAS computes a product changes rounding only: auto's greedy text is plain's (a
    tiny model whose products the shim's kernel may take: weights of 64 rows and more)."""
    from conftest import make_tiny_engine, random_prompts

    set_mask, get_mask = cpu_blas._mask_calls()
    before = get_mask()
    monkeypatch.setattr(cpu_blas, "_TAKEN", mask)
    set_mask(mask)
    try:
        engine = make_tiny_engine(seed=3, scale=3.0)
        for p in random_prompts(6, seed=5):
            ref = engine.generate(p, max_tokens=20, mode="plain").tokens
            assert engine.generate(p, max_tokens=20, mode="auto").tokens == ref
            assert engine.generate(p, max_tokens=20, mode="lookahead").tokens == ref
    finally:
        set_mask(before)
