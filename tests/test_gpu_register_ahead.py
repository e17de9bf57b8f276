"""Tier C: the register_ahead knob (an unstaged backward loads its next row into registers when it takes the
current one) and stats_ahead (the next row's mean and rstd too). Only when the loads are issued changes, not what
is added in which order: every output is the same bits as without the knobs on the same grid (a knob that changes
the CTAs an SM changes the grid's row groups, and so the order the partial rows are summed in), and dx the same
bits on any grid."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok, backward_runner, bits, bits_and_grids, launch_grids

pytestmark = pytest.mark.gpu

# (op, N, x dtype, weight dtype, knobs, other case fields): the H200 entries' shapes at 10240 (cluster rows,
# pushed exchanges, sums of a step in registers) and 2048; folded rows (WARPS_M = 2); general rows of one row a
# CTA and of a cluster on offset views; fp32 with dresidual of another dtype (dgamma after the reduction,
# REFINE_MEAN); zero-centered RMSNorm with a bias, dx over dy (in place); the memory-efficient backward from y;
# a second weight and bias; dropout and a row scale (dx0); fp64; per-tensor layouts drawn apart.
CASES = [
    ("layer_norm_backward", 10240, "bfloat16", "bfloat16",
     dict(warps_n=4, ctas_per_row=4, bytes_per_ldg=8, smem_accumulators=True, register_sum_steps=1,
          pushed_exchange=True), {}),
    ("layer_norm_backward", 2048, "bfloat16", "float32", dict(warps_n=4, bytes_per_ldg=16, cache_weights=False,
                                                              recompute=False), dict(dy_layout="stride:8")),
    ("rms_norm_backward", 4096, "float16", "bfloat16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8),
     dict(has_bias=False, out_dtype="bfloat16")),
    ("layer_norm_backward", 4097, "bfloat16", "bfloat16", dict(warps_n=4, bytes_per_ldg=8, smem_accumulators=True),
     dict(layout="offset:3")),
    ("rms_norm_backward", 8193, "float16", "float16", dict(warps_n=4, ctas_per_row=2, bytes_per_ldg=8,
                                                          pushed_exchange=True), dict(layout="offset:1")),
    ("layer_norm_backward", 2048, "float32", "bfloat16", dict(warps_n=4, bytes_per_ldg=16),
     dict(residual_dtype="bfloat16", residual_layout="stride:4")),
    ("rms_norm_backward", 6144, "bfloat16", "float32", dict(warps_n=8, bytes_per_ldg=8, cache_weights=False),
     dict(has_bias=True, zero_centered=True, in_place=True)),
    ("layer_norm_backward", 3072, "bfloat16", "bfloat16", dict(warps_n=4, bytes_per_ldg=8),
     dict(from_output=True)),
    ("layer_norm_backward", 2048, "bfloat16", "bfloat16", dict(warps_n=4, bytes_per_ldg=8),
     dict(weight1_dtype="bfloat16", bias1_dtype="bfloat16")),
    ("rms_norm_backward", 1024, "bfloat16", "bfloat16", dict(warps_n=2, bytes_per_ldg=8),
     dict(has_bias=False, dropout_p=0.25, rowscale_dtype="float32")),
    ("layer_norm_backward", 1025, "float64", "float64", dict(warps_n=8, bytes_per_ldg=16), {}),
]


# Knob off, rows ahead, rows and their statistics ahead.
AHEAD_SETTINGS = [dict(register_ahead=False), dict(register_ahead=True), dict(register_ahead=True, stats_ahead=True)]


@pytest.mark.parametrize("op, n, dtype, weight, knobs, fields", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_rows_ahead_pass_the_check_with_the_plain_kernels_errors(op, n, dtype, weight, knobs, fields, launches):
    """Every output (poisoned first) against float64 with the knobs off, rows ahead, and rows and statistics
    ahead (AHEAD_SETTINGS), at 37 rows and 301 rows (at 301 more rows than the grid's row groups at every case
    here: threads load rows ahead, and the last one's load is past the end); on the same inputs (runs of one
    seed) and the same grids, the float64 errors the same to the last bit. One-launch backwards (no cluster, up
    to plans.FUSE_ROW_ELEMENTS) have a grid of their own that the registers do not move: there the grids must
    be the same."""
    from cunorm.norm.plans import FUSE_ROW_ELEMENTS

    seed = int(np.random.SeedSequence().entropy % 2**63)
    shape = {"stages": 1, **knobs}
    for rows in (37, 301):
        errors, grids = [], []
        for ahead in AHEAD_SETTINGS:
            case = check.Case(op, n, rows, dtype, weight, knobs=tuple(sorted({**shape, **ahead}.items())), **fields)
            launch_grids(launches)
            results = check.run_case(case, np.random.default_rng(seed))
            grids.append(launch_grids(launches))
            assert_results_ok(results)
            assert len(results) >= 2, case
            errors.append([(r.output, r.error) for r in results])
        for grid, error in zip(grids[1:], errors[1:]):
            if knobs.get("ctas_per_row", 1) == 1 and rows * n <= FUSE_ROW_ELEMENTS:
                assert grids[0] == grid, grids
            if grids[0] == grid:
                assert errors[0] == error, f"seed {seed}: {errors}"


BITWISE = [(10240, "bfloat16", dict(warps_n=4, ctas_per_row=4, bytes_per_ldg=8, smem_accumulators=True,
                                    register_sum_steps=1, pushed_exchange=True)),
           (4096, "bfloat16", dict(warps_n=8, bytes_per_ldg=8, smem_accumulators=True, min_ctas_per_sm=2)),
           (4097, "float16", dict(warps_n=4, warps_m=2, bytes_per_ldg=16)),
           (2048, "bfloat16", dict(warps_n=4, bytes_per_ldg=16, recompute=False))]


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n, dtype, knobs", BITWISE, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in BITWISE])
def test_the_outputs_are_the_same_bits(n, dtype, knobs, rms, rng, launches):
    """dx, dweight (and LayerNorm's dbias) of one call of 2000 rows (several a CTA; one launch at 2048, two
    elsewhere) with the knobs off, rows ahead, and rows and statistics ahead: dx the same bits; the column sums
    the same bits where the launches' grids are the same (the knobs' registers can move the CTAs an SM, and so
    the row groups). Then a row's dx is its own: the last 37 rows alone (views of the same arrays: each row at
    its own offset) give the bits they have in the batch, though their CTAs walk them, and load ahead, with
    another stride."""
    case = check.Case("rms_norm_backward" if rms else "layer_norm_backward", n, 2000, dtype, "bfloat16",
                      has_bias=not rms)
    run = backward_runner(case, rng)
    settings = [dict(knobs, stages=1, **ahead) for ahead in AHEAD_SETTINGS]
    outs, grids = bits_and_grids(run, settings, launches)
    assert all(len(out) == (2 if rms else 3) for out in outs)
    plain, plain_grid = outs[0], grids[0]
    for setting, ahead, grid in zip(settings[1:], outs[1:], grids[1:]):
        assert (plain[0] == ahead[0]).all(), ("dx", setting)
        if plain_grid == grid:
            assert all((a == b).all() for a, b in zip(plain[1:], ahead[1:])), ("column sums", setting)
        with check.poisoned_allocations():
            tail = run(setting, slice(-37, None))
        assert (bits(tail[0]) == ahead[0][-37:]).all(), ("a row's dx alone and in the batch", setting)
