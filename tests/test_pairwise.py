"""Tier A: the pairwise covering arrays behind the checker's dtype and layout
sweep, and that a call carries its residual and residual_out dtypes apart."""
import itertools

import numpy as np
import pytest

from cunorm import check, dtypes, norm, pairwise, sweeps


def test_covering_array_covers_every_pair():
    factors = {"a": (1, 2, 3), "b": ("x", "y"), "c": (None, 1, 2), "d": (True, False), "e": (0, 1, 2, 3)}
    off = {("c", None): ("d",)}
    rows = pairwise.covering_array(factors, off)
    assert not pairwise.uncovered_pairs(rows, factors, off)
    assert len(rows) < len(list(itertools.product(*factors.values()))) // 4
    # A pair whose one value switches the other factor off is not asked for.
    assert (("c", None), ("d", True)) not in pairwise.required_pairs(factors, off)
    # uncovered_pairs can fail: drop a row and something is missing.
    assert pairwise.uncovered_pairs(rows[1:], factors, off)


def test_covering_array_is_deterministic():
    factors = {"a": (1, 2, 3), "b": (1, 2, 3), "c": (1, 2, 3), "d": (1, 2, 3)}
    assert pairwise.covering_array(factors, seed=3) == pairwise.covering_array(factors, seed=3)


@pytest.mark.parametrize("op", check.NORM_OPS)
def test_pairwise_sweep_draws_every_tensor_independently(op):
    """Every pair of tensor dtypes (and layouts) appears in some case of the
    sweep, residual against residual_out included."""
    factors, off = check.pairwise_factors(op)
    rows = sweeps._pairwise_rows(op, None, dtypes.NAMES)
    assert not pairwise.uncovered_pairs(list(rows), factors, off)
    cases = [c for c in check.pairwise_cases(ops=(op,))]
    assert len(cases) == len(rows)
    if not op.endswith("_backward"):
        pairs = {(c.residual_dtype, c.residual_out_dtype) for c in cases if c.residual_dtype}
        assert pairs >= set(itertools.product(dtypes.NAMES, dtypes.NAMES))
    assert {c.hidden_size for c in cases} == set(check.PAIRWISE_SIZES)
    assert any(check.case_call(c)["aligned_vector"] < check.case_call(c)["max_vector"] for c in cases)


def test_residual_and_residual_out_dtypes_are_two_fields():
    """The root of a wrong-result bug: a bf16 residual with residual_dtype=fp32
    was read as fp32, because one field carried both dtypes."""
    x = np.ones((2, 64), dtype=dtypes.BFLOAT16)
    r = np.ones((2, 64), dtype=dtypes.BFLOAT16)
    w = np.ones(64, dtype=np.float32)
    _, _, base, _, _ = norm.calls.forward_args(True, x, w, None, 1e-6, r, np.float32, False, None, None)
    assert base["residual_dtype"] == "bfloat16" and base["residual_out_dtype"] == "float32"
    _, _, base, _, _ = norm.calls.forward_args(True, x, w, None, 1e-6, r, None, False, None, None)
    assert base["residual_dtype"] == base["residual_out_dtype"] == "bfloat16"
    case = check.Case("rms_norm", 1024, 32, "bfloat16", "float32", has_bias=False, residual_dtype="bfloat16",
                      residual_out_dtype="float32")
    call = check.case_call(case)
    assert (call["residual_dtype"], call["residual_out_dtype"]) == ("bfloat16", "float32")


def test_numpy_residual_out_in_its_own_dtype(rng):
    import cunorm

    x = rng.standard_normal((3, 64)).astype(dtypes.BFLOAT16)
    r = rng.standard_normal((3, 64)).astype(dtypes.BFLOAT16)
    y, h = cunorm.rms_norm(x, None, residual=r, residual_dtype=np.float32)
    assert h.dtype == np.float32 and y.dtype == x.dtype
    np.testing.assert_array_equal(h, x.astype(np.float32) + r.astype(np.float32))
