"""Tier C: the sum_chains knob (a forward thread's row sums in 2 or 4 independent chains, added pairwise). It
changes the order of the adds, so the rounding: every output (poisoned first) is checked against float64, with
each tensor's dtype and layout drawn apart from the others', and the results are a row's own whatever the rows
around it."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok, bits

pytestmark = pytest.mark.gpu

# (op, N, x dtype, weight dtype, knobs, other case fields): the H200 entry's shape of LayerNorm's general forward
# at 32769 (cluster rows, pushed exchanges, unchecked whole steps), general rows one row a CTA and folded, staged
# and unstaged, RMSNorm on an offset view, fp32 with a residual of another dtype, merged moments (two totals a
# chain), fp16 aligned rows with fp32 weights, fp64.
CASES = [
    ("layer_norm", 32769, "bfloat16", "bfloat16", dict(warps_n=4, ctas_per_row=8, bytes_per_ldg=8, stages=2,
                                                       cache_weights=False, pushed_exchange=True,
                                                       unchecked_whole_steps=True), {}),
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


@pytest.mark.parametrize("n", [4096, 4097])
@pytest.mark.parametrize("rms", [False, True])
def test_a_rows_result_is_its_own(rms, n, rng):
    """The same 37 rows alone and as the last rows of a call of 300 give the same bits with 4 chains (the
    chains split a thread's elements, never rows). Alone, the rows are the last of a copy of the batch whose
    other rows are NaN: each starts at the offset it has in the batch (the general kernel, N = 4097, holds a
    row's elements by where it starts: README, batch invariance), and a row that read past its ends would
    turn NaN. The last row sits near 1000 with a spread of a few units, where a one-pass E[x^2] - mean^2
    loses the variance: its statistics against float64 (the precision of the sums is
    test_sum_chains_pass_the_check's)."""
    import cupy

    import cunorm

    knobs = dict(warps_n=4, bytes_per_ldg=8, stages=2, sum_chains=4)
    case = check.Case("rms_norm" if rms else "layer_norm", n, 300, "bfloat16", "bfloat16", has_bias=not rms)
    x, w, _, _ = check._inputs(case, rng)
    x[-1] = (x[-1].astype(cupy.float32) + 1000).astype(x.dtype)  # far from zero mean
    neighbours = x.copy()  # a fresh allocation: the same offsets modulo the vectors as x
    neighbours[:-37] = cupy.nan

    def run(rows):
        if rms:
            return list(cunorm.rms_norm(rows, w, return_stats=True, traits=knobs))
        return list(cunorm.layer_norm(rows, w, w, return_stats=True, traits=knobs))

    with check.poisoned_allocations():
        whole, alone = run(x), run(neighbours[-37:])
    assert len(whole) == (2 if rms else 3)
    assert all((bits(a[-37:]) == bits(b)).all() for a, b in zip(whole, alone))
    h = cupy.asnumpy(x[-1]).astype(np.float64)
    mean = 0.0 if rms else h.mean()
    rstd = 1 / np.sqrt(((h - mean) ** 2).mean() + (1e-6 if rms else 1e-5))  # the ops' default eps
    assert float(whole[-1][-1]) == pytest.approx(rstd, rel=1e-5)
    if not rms:
        assert float(whole[1][-1]) == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("sum_chains", [2, 4])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n, knobs", [(128, dict(warps_m=4, bytes_per_ldg=16, stages=1)),
                                      (4097, dict(warps_n=4, bytes_per_ldg=16, stages=2))])
def test_rows_scaled_by_1e19_to_1e_18_keep_their_statistics(n, knobs, op, sum_chains, rng, poisoned):
    """fp32 rows scaled per row by 1, 1e18, 1e19 or 1e-18, eps = 0 (as tests/test_gpu_range.py, here with the
    chains forced): the squares of the 1e-18 rows are subnormal, and the chains' fold must keep them (the
    kernels flush subnormals in plain adds), the overflowing rows take the scaled second sum; mean and rstd
    within 2e-6 of float64 on every kind of row, y within fp32's tolerance."""
    import cupy

    import cunorm
    from cunorm import reference

    m = 67
    base = (0.5 + 2.0 * rng.standard_normal((m, n))).astype(np.float32)
    scales = rng.choice((1.0, 1e18, 1e19, 1e-18), size=m)
    scales[:4] = (1.0, 1e18, 1e19, 1e-18)
    x = cupy.asarray((base.astype(np.float64) * scales[:, None]).astype(np.float32))
    w = cupy.asarray((1 + 0.5 * rng.standard_normal(n)).astype(np.float32))
    y, *stats = getattr(cunorm, op)(x, w, eps=0.0, return_stats=True, out=poisoned(x.shape, np.float32),
                                    traits={**knobs, "sum_chains": sum_chains})
    ref = getattr(reference, op)(x, w, eps=0.0)
    assert bool(cupy.isfinite(y).all()) and check.rel_l2(y, ref[0]) <= check.TOLERANCE["float32"]
    for s in (1.0, 1e18, 1e19, 1e-18):
        rows = cupy.asarray(scales == s)
        for name, got, want in zip(("mean", "rstd") if op == "layer_norm" else ("rstd",), stats, ref[1:]):
            assert check.rel_l2(got[rows], want[rows]) <= 2e-6, (s, name)
