"""Tier C: the unchecked_whole_steps knob (the load steps whose every vector lies in the row skip the column
check). It changes which loads are predicated, not the arithmetic: every output is checked against float64, and
the same bits as with every step checked (the column sums wherever both run the same grid: a grid of other
occupancy sums the partial rows in another order)."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok, bits

pytestmark = pytest.mark.gpu

# (op, N, x dtype, knobs, other case fields), each with whole steps and a partial last step: general rows
# (shifted views too) one row a CTA and folded, 16-byte staged loads, a
# cluster row, fp32 with a residual, RMSNorm with register sums; aligned rows of a partial last step.
CASES = [
    ("layer_norm", 8193, "bfloat16", dict(warps_n=9, bytes_per_ldg=16, stages=2), {}),
    ("rms_norm", 769, "bfloat16", dict(warps_m=4, bytes_per_ldg=8, stages=1), dict(layout="offset:3")),
    ("layer_norm", 4097, "float32", dict(warps_n=4, stages=1), dict(residual_dtype="bfloat16", out_dtype="bfloat16",
                                                                    layout="offset:1")),
    ("layer_norm", 16385, "bfloat16", dict(warps_n=4, ctas_per_row=2, bytes_per_ldg=8, stages=1,
                                           pushed_exchange=True), dict(layout="offset:1")),
    ("rms_norm", 12800, "float16", dict(warps_n=16, bytes_per_ldg=16, stages=1), {}),
    ("layer_norm_backward", 1025, "bfloat16", dict(warps_n=2, warps_m=2, bytes_per_ldg=8, stages=1),
     dict(layout="offset:2", dy_layout="offset:6")),
    ("rms_norm_backward", 8193, "float16", dict(warps_n=8, bytes_per_ldg=8, stages=1, smem_accumulators=True,
                                                register_sum_steps=2), {}),
    ("layer_norm_backward", 4097, "float32", dict(warps_n=8, stages=1), dict(residual_dtype="float32")),
    ("layer_norm_backward", 16385, "bfloat16", dict(warps_n=8, ctas_per_row=2, bytes_per_ldg=8, stages=1,
                                                    smem_accumulators=True, pushed_exchange=True), {}),
    ("rms_norm_backward", 15360, "bfloat16", dict(warps_n=16, ctas_per_row=2, bytes_per_ldg=16, stages=2,
                                                  pushed_exchange=True), {}),
    ("layer_norm_backward", 2304, "bfloat16", dict(warps_n=4, bytes_per_ldg=8, stages=1), {}),
]


@pytest.mark.parametrize("op, n, dtype, knobs, fields", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_unchecked_whole_steps_pass_the_check_with_the_checked_errors(op, n, dtype, knobs, fields):
    """Every output (poisoned first) against float64 with the whole steps unchecked, and its float64 error the
    same to the last bit as with every step checked, on the same inputs (runs of one seed; 37 rows, fewer
    than either grid's row groups, so each partial row sums the same rows)."""
    from cunorm import dispatch

    seed = int(np.random.SeedSequence().entropy % 2**63)
    weight = "float32" if dtype == "float32" else "bfloat16"
    probe = check.Case(op, n, 37, dtype, weight, **fields)
    traits = dispatch.from_knobs(knobs, **check.case_call(probe))
    assert 0 < traits.whole_steps < traits.ldgs and not traits.full_tiles, traits.short()  # the knob acts here
    errors = []
    for unchecked in (False, True):
        case = check.Case(op, n, 37, dtype, weight, **fields,
                          knobs=tuple(sorted({**knobs, "unchecked_whole_steps": unchecked}.items())))
        results = check.run_case(case, np.random.default_rng(seed))
        assert_results_ok(results)
        errors.append([(r.output, r.error) for r in results])
    assert len(errors[0]) >= 2 and errors[0] == errors[1], f"seed {seed}: {errors}"


BITWISE = [(8193, "bfloat16", dict(warps_n=9, bytes_per_ldg=16, stages=2)),
           (4097, "float16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8, stages=1)),
           (2304, "bfloat16", dict(warps_n=4, bytes_per_ldg=8, stages=1)),
           (16385, "bfloat16", dict(warps_n=8, ctas_per_row=2, bytes_per_ldg=8, stages=1, pushed_exchange=True))]


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n, dtype, knobs", BITWISE, ids=[f"{c[0]}-{c[1]}" for c in BITWISE])
def test_the_outputs_are_the_same_bits(n, dtype, knobs, rms, rng):
    """The forward's outputs and statistics and the backward's dx of one call of 300 rows (several a CTA), and
    the backward's column sums of its first 37 rows (fewer than either grid's row groups, so each partial row
    sums the same rows whatever the occupancy), the same bits with the whole steps checked and unchecked."""
    import cupy

    import cunorm

    case = check.Case("rms_norm" if rms else "layer_norm", n, 300, dtype, "bfloat16", has_bias=not rms)
    x, w, _, _ = check._inputs(case, rng)
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(x.dtype)

    def run(unchecked):
        k = {**knobs, "unchecked_whole_steps": unchecked}
        if rms:
            y, rstd = cunorm.rms_norm(x, w, return_stats=True, traits=k)
            return [y, rstd], [cunorm.rms_norm_backward(g, a, r, w, traits=k)
                               for g, a, r in ((dy, x, rstd), (dy[:37], x[:37], rstd[:37]))]
        y, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True, traits=k)
        return [y, mean, rstd], [cunorm.layer_norm_backward(g, a, m, r, w, traits=k)
                                 for g, a, m, r in ((dy, x, mean, rstd), (dy[:37], x[:37], mean[:37], rstd[:37]))]

    with check.poisoned_allocations():
        (fwd0, (bwd0, few0)), (fwd1, (bwd1, few1)) = run(False), run(True)
    assert len(fwd0) == (2 if rms else 3) and len(few0) == (2 if rms else 3)
    assert all((bits(a) == bits(b)).all() for a, b in zip(fwd0, fwd1)), "forward"
    assert (bits(bwd0[0]) == bits(bwd1[0])).all(), "dx"
    assert all((bits(a) == bits(b)).all() for a, b in zip(few0, few1)), "37 rows: dx and the column sums"
    assert all(cupy.isfinite(a).all() for a in [*fwd1, *bwd1, *few1])
