"""Tier C: the register_sum_steps knob (a backward's column sums of its first load steps in registers, the
rest in shared memory). Each column sum is added in the same order wherever it lives, so every output is the
same bits as with all sums in shared memory and as with all in registers."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok

pytestmark = pytest.mark.gpu

# (op, N, x dtype, knobs, other case fields): one row a CTA, folded rows (WARPS_M = 2), a cluster row with
# pushed exchanges, general rows folded by columns, fp32 with dresidual (dgamma summed after the reduction,
# REFINE_MEAN), zero-centered RMSNorm with a bias, a second weight and bias.
CASES = [
    ("layer_norm_backward", 12288, "bfloat16", dict(warps_n=8, bytes_per_ldg=8), {}),
    ("layer_norm_backward", 4096, "float16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8, stages=2), {}),
    ("rms_norm_backward", 16384, "bfloat16", dict(warps_n=8, ctas_per_row=2, bytes_per_ldg=8, pushed_exchange=True),
     dict(has_bias=False)),
    ("layer_norm_backward", 4097, "bfloat16", dict(warps_n=4, warps_m=2, bytes_per_ldg=8), {}),
    ("layer_norm_backward", 2048, "float32", dict(warps_n=4), dict(residual_dtype="float32")),
    ("rms_norm_backward", 6144, "bfloat16", dict(warps_n=8, bytes_per_ldg=8, cache_weights=False),
     dict(has_bias=True, zero_centered=True)),
    ("layer_norm_backward", 2048, "bfloat16", dict(warps_n=4, bytes_per_ldg=8),
     dict(weight1_dtype="bfloat16", bias1_dtype="bfloat16")),
]


@pytest.mark.parametrize("op, n, dtype, knobs, fields", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_sums_in_registers_give_the_shared_memory_sums_bits(op, n, dtype, knobs, fields):
    """Every output (poisoned first) against float64 with a quarter, half and all but one of the load steps'
    sums in registers, and its error the same to the bit as with every sum in shared memory and with every sum
    in registers, on the same inputs (runs of one seed); 37 rows, so a persistent grid walks several rows a
    CTA."""
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
