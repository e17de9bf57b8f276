"""Tier C: the sum_chains knob (a forward thread's row sums in 2 or 4 independent chains, added pairwise). It
changes the order of the adds, so the rounding: every output (poisoned first) is checked against float64, with
each tensor's dtype and layout drawn apart from the others', and the results are a row's own whatever the rows
around it."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok

pytestmark = pytest.mark.gpu

# (op, N, x dtype, weight dtype, knobs, other case fields): the H200 entry's shape of LayerNorm's general forward
# at 32769 (cluster rows, pushed exchanges, unchecked whole steps), general rows one row a CTA and folded, staged
# and unstaged, RMSNorm on an offset view, fp32 with a residual of another dtype, merged moments (two totals a
# chain), fp16 aligned rows with fp32 weights, fp64.
CASES = [
    ("layer_norm", 32769, "bfloat16", "bfloat16", dict(warps_n=4, ctas_per_row=8, bytes_per_ldg=8, stages=2,
                                                       pushed_exchange=True, unchecked_whole_steps=True), {}),
    ("layer_norm", 4097, "bfloat16", "float32", dict(warps_n=4, bytes_per_ldg=8, stages=3), dict(layout="offset:3")),
    ("layer_norm", 769, "float16", "bfloat16", dict(warps_m=4, bytes_per_ldg=8, stages=1, persistent=False,
                                                    min_ctas_per_sm=4), dict(out_dtype="float32")),
    ("rms_norm", 8193, "bfloat16", "bfloat16", dict(warps_n=8, bytes_per_ldg=16, stages=2),
     dict(layout="offset:1", out_dtype="float16")),
    ("layer_norm", 4097, "float32", "bfloat16", dict(warps_n=4, bytes_per_ldg=16, stages=1),
     dict(residual_dtype="bfloat16", residual_out_dtype="float32", layout="stride:8")),
    ("layer_norm", 16385, "bfloat16", "bfloat16", dict(warps_n=4, ctas_per_row=4, bytes_per_ldg=8, stages=1,
                                                       merged_moments=True), dict(layout="offset:1")),
    ("rms_norm", 4096, "float16", "float32", dict(warps_n=4, bytes_per_ldg=16, stages=1, persistent=False,
                                                  min_ctas_per_sm=2), dict(zero_centered=True)),
    ("layer_norm", 1025, "float64", "float64", dict(warps_n=2, bytes_per_ldg=16, stages=1), {}),
]


def _chains(dtype: str, knobs: dict) -> list:
    """The chain counts a vector of these loads holds (2 and 4, as far as its elements go)."""
    elts = knobs["bytes_per_ldg"] // np.dtype(dtype).itemsize
    return [c for c in (2, 4) if c <= elts]


@pytest.mark.parametrize("op, n, dtype, weight, knobs, fields", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_sum_chains_pass_the_check(op, n, dtype, weight, knobs, fields):
    """37 rows (fewer than a row group's CTAs at most shapes) and 300 rows, each chain count, every output
    against float64."""
    chains = _chains(dtype, knobs)
    assert chains, "the knob acts here"
    for sum_chains in chains:
        for rows in (37, 300):
            case = check.Case(op, n, rows, dtype, weight, **fields,
                              knobs=tuple(sorted({**knobs, "sum_chains": sum_chains}.items())))
            results = check.run_case(case, np.random.default_rng())
            assert_results_ok(results)
            assert len(results) >= 2, case


@pytest.mark.parametrize("rms", [False, True])
def test_a_rows_result_is_its_own(rms, rng):
    """The same 37 rows alone and as the last rows of a call of 300 give the same bits with 4 chains (the
    chains split a thread's elements, never rows), and a row of large offset keeps LayerNorm's accuracy."""
    import cupy

    import cunorm

    n, knobs = 4097, dict(warps_n=4, bytes_per_ldg=8, stages=2, sum_chains=4)
    case = check.Case("rms_norm" if rms else "layer_norm", n, 300, "bfloat16", "bfloat16", has_bias=not rms)
    x, w, _, _ = check._inputs(case, rng)
    x[-1] = (x[-1].astype(cupy.float32) + 1000).astype(x.dtype)  # far from zero mean

    def run(rows):
        if rms:
            return list(cunorm.rms_norm(rows, w, return_stats=True, traits=knobs))
        return list(cunorm.layer_norm(rows, w, w, return_stats=True, traits=knobs))

    def bits(a):
        return cupy.asnumpy(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)

    with check.poisoned_allocations():
        whole, alone = run(x), run(x[-37:].copy())
    assert len(whole) == (2 if rms else 3)
    assert all((bits(a[-37:]) == bits(b)).all() for a, b in zip(whole, alone))
    h = cupy.asnumpy(x[-1]).astype(np.float64)
    mean = 0.0 if rms else h.mean()
    rstd = 1 / np.sqrt(((h - mean) ** 2).mean() + (1e-6 if rms else 1e-5))  # the ops' default eps
    assert float(whole[-1][-1]) == pytest.approx(rstd, rel=1e-5)
    if not rms:
        assert float(whole[1][-1]) == pytest.approx(mean, rel=1e-6)
