"""Tier A/B: batch-invariant mode (`cunorm.set_batch_invariant`, CUNORM_BATCH_INVARIANT): calls take the
aligned kernel at the widest vector their rows all start on, never the general kernel; toggling it forgets
cached plans; its kernels compile clean. Its GPU results: test_gpu_batch_invariance.py."""
import os
import subprocess
import sys

import pytest

import cunorm
from cunorm import check, compile_only, dispatch, layout, plan, sweeps


@pytest.fixture
def invariant_mode():
    cunorm.set_batch_invariant(True)
    yield
    cunorm.set_batch_invariant(False)


def _choice(n, dtype, backward=False, layout_="contiguous", residual=None):
    op = "layer_norm_backward" if backward else "layer_norm"
    case = sweeps.Case(op, n, 37, dtype, dtype, layout=layout_, residual_dtype=residual)
    return dispatch.choose(arch=90, **check.case_call(case))[0]


def test_off_by_default_and_the_general_kernel_serves_odd_rows():
    assert cunorm.batch_invariant() is False
    t = _choice(4097, "float32")
    assert not t.aligned_rows and t.elts_per_ldg == 4


@pytest.mark.parametrize("n,dtype,widest", [(4097, "float32", 1), (4098, "float32", 2), (4097, "bfloat16", 1),
                                            (4100, "bfloat16", 4), (4096, "bfloat16", 8)])
@pytest.mark.parametrize("backward", [False, True])
def test_the_mode_takes_the_aligned_kernel_at_the_rows_vector(n, dtype, widest, backward, invariant_mode):
    t = _choice(n, dtype, backward)
    assert t.aligned_rows and t.elts_per_ldg <= widest
    assert _choice(1000, "bfloat16", backward, "offset:3").aligned_rows  # an offset view: narrower, aligned


def test_toggling_forgets_cached_plans_and_refuses_non_bools():
    plan.CALLS[("planted",)] = object()
    cunorm.set_batch_invariant(True)
    try:
        assert ("planted",) not in plan.CALLS and cunorm.batch_invariant() and layout.batch_invariant()
        plan.CALLS[("planted",)] = object()
        cunorm.set_batch_invariant(True)  # no change: nothing forgotten
        assert ("planted",) in plan.CALLS
    finally:
        cunorm.set_batch_invariant(False)
    assert ("planted",) not in plan.CALLS
    with pytest.raises(TypeError, match="on: expected a bool"):
        cunorm.set_batch_invariant("yes")


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", False)])
def test_the_environment_variable_sets_it_at_import(value, on):
    env = dict(os.environ, CUNORM_BATCH_INVARIANT=value)
    out = subprocess.run([sys.executable, "-c", "import cunorm; print(cunorm.batch_invariant())"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(on)


@pytest.mark.nvrtc
def test_the_modes_kernels_compile_clean(invariant_mode):
    """What the mode runs for odd rows up to 65536 (one- and two-element loads, clusters for the widest), both
    directions, with and without a residual: no spills. (Past 65536 elements rows may spill, in either mode:
    documented; the mode's fp32 backward at 65537 spills 4 bytes.)"""
    seen = set()
    for n in (33, 1001, 4097, 4098, 32769):
        for dtype in ("float32", "bfloat16", "float64"):
            for backward in (False, True):
                for variant in (_choice(n, dtype, backward), _choice(n, dtype, backward, residual=dtype)):
                    if variant not in seen:
                        seen.add(variant)
                        assert compile_only(variant, 90).clean, variant.short()
    assert len(seen) >= 40
