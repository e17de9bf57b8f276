"""Tier C: the register_sum_steps knob (a backward's column sums of its first load steps in registers, the
rest in shared memory). Each column sum is added in the same order wherever it lives, so every output is the
same bits as with all sums in shared memory and as with all in registers, on the same grid (a setting that
changes the CTAs an SM changes the grid's row groups, and so the order the partial rows are summed in)."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok, backward_runner, bits_and_grids

pytestmark = pytest.mark.gpu

# (op, N, x dtype, knobs, other case fields): one row a CTA, folded rows (WARPS_M = 2), a cluster row with
# pushed exchanges, general rows folded by columns, general rows of one row a CTA and of a cluster (their
# register steps stored element by element beside the shifted slots), fp32 with dresidual (dgamma summed after
# the reduction, REFINE_MEAN), zero-centered RMSNorm with a bias, a second weight and bias.
CASES = [
    ("layer_norm_backward", 12288, "bfloat16", dict(warps_n=8, bytes_per_ldg=8), {}),
    ("layer_norm_backward", 4096, "float16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8, stages=2), {}),
    ("rms_norm_backward", 16384, "bfloat16", dict(warps_n=8, ctas_per_row=2, bytes_per_ldg=8, pushed_exchange=True),
     dict(has_bias=False)),
    ("layer_norm_backward", 4097, "bfloat16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8), {}),
    ("layer_norm_backward", 4097, "bfloat16", dict(warps_n=4, bytes_per_ldg=8), {}),
    ("layer_norm_backward", 8193, "float16", dict(warps_n=4, ctas_per_row=2, bytes_per_ldg=8, pushed_exchange=True), {}),
    ("layer_norm_backward", 2048, "float32", dict(warps_n=4), dict(residual_dtype="float32")),
    ("rms_norm_backward", 6144, "bfloat16", dict(warps_n=8, bytes_per_ldg=8, cache_weights=False),
     dict(has_bias=True, zero_centered=True)),
    ("layer_norm_backward", 2048, "bfloat16", dict(warps_n=4, bytes_per_ldg=8),
     dict(weight1_dtype="bfloat16", bias1_dtype="bfloat16")),
]


@pytest.mark.parametrize("op, n, dtype, knobs, fields", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_sums_in_registers_give_the_shared_memory_sums_bits(op, n, dtype, knobs, fields):
    """Every output (poisoned first) against float64 with a quarter, half and all but one of the load steps'
    sums in registers, and its float64 error the same to the last bit as with every sum in shared memory and
    with every sum in registers, on the same inputs (runs of one seed). 37 rows: fewer than any setting's grid
    holds row groups, so each partial row sums the same rows whatever the occupancy (a CTA walks one row group;
    test_the_outputs_are_the_same_bits walks several and compares the outputs themselves)."""
    from cunorm import dispatch

    seed = int(np.random.SeedSequence().entropy % 2**63)
    weight = "float32" if dtype == "float32" else "bfloat16"
    shape = {"stages": 1, **knobs}
    probe = check.Case(op, n, 37, dtype, weight, **fields)
    ldgs = dispatch.from_knobs(dict(shape, smem_accumulators=True), **check.case_call(probe)).ldgs
    settings = [dict(smem_accumulators=False), dict(smem_accumulators=True)] + [
        dict(smem_accumulators=True, register_sum_steps=k) for k in sorted({max(1, ldgs // 4), ldgs // 2, ldgs - 1})]
    errors = {}
    for setting in settings:
        case = check.Case(op, n, 37, dtype, weight, knobs=tuple(sorted({**shape, **setting}.items())), **fields)
        results = check.run_case(case, np.random.default_rng(seed))
        assert_results_ok(results)
        errors[tuple(sorted(setting.items()))] = [(r.output, r.error) for r in results]
    first = next(iter(errors.values()))
    sums = {"dweight"} | ({"dbias"} if fields.get("has_bias", op.startswith("layer")) else set()) | (
        {"dweight1", "dbias1"} if "weight1_dtype" in fields else set())  # every column sum is compared
    assert sums <= {name for name, _ in first} and all(e == first for e in errors.values()), f"seed {seed}: {errors}"


BITWISE = [(4096 * 3, "bfloat16", dict(warps_n=8, bytes_per_ldg=8)),  # one row a CTA
           (4097, "bfloat16", dict(warps_n=4, bytes_per_ldg=8)),  # general rows, one row a CTA
           (4097, "float16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8)),  # general rows folded by columns
           (8193, "bfloat16", dict(warps_n=4, ctas_per_row=2, bytes_per_ldg=8, pushed_exchange=True))]


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n, dtype, knobs", BITWISE, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in BITWISE])
def test_the_outputs_are_the_same_bits(n, dtype, knobs, rms, rng, launches):
    """dx, dweight (and LayerNorm's dbias) of one call of 300 rows (several a CTA), with every sum in shared
    memory, with every sum in registers and with 1, half and all but one of the load steps' sums in registers:
    dx the same bits in every setting; the column sums the same bits wherever the grid is (a grid of other
    occupancy groups the rows into other partial rows, which sums them in another order: RMSNorm 8193 at 2
    and 3 CTAs an SM on an H200, PERFORMANCE.md version 72), and at least one setting with sums in registers
    shares its grid with one without."""
    from cunorm import dispatch

    case = check.Case("rms_norm_backward" if rms else "layer_norm_backward", n, 300, dtype, "bfloat16",
                      has_bias=not rms)
    run = backward_runner(case, rng)
    shape = {"stages": 1, "smem_accumulators": True, **knobs}
    ldgs = dispatch.from_knobs(shape, **check.case_call(case)).ldgs
    settings = [dict(shape, smem_accumulators=False)] + [dict(shape, register_sum_steps=k)
                                                          for k in sorted({0, 1, ldgs // 2, ldgs - 1})]

    outs, grids = bits_and_grids(run, settings, launches)
    assert all(len(o) == (2 if rms else 3) for o in outs)
    assert all((o[0] == outs[0][0]).all() for o in outs), "dx"
    for i, j in [(i, j) for i in range(len(settings)) for j in range(i) if grids[i] == grids[j]]:
        assert all((a == b).all() for a, b in zip(outs[i][1:], outs[j][1:])), (settings[i], settings[j], grids)
    baselines = {grids[0], grids[1]}  # every sum in registers, every sum in shared memory
    assert any(g in baselines for g in grids[2:]), f"no setting with sums in registers shares a grid: {grids}"
