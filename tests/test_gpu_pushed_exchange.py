"""Tier C: cluster rows with pushed exchanges (the pushed_exchange knob): each CTA stores its partials into its
peers' shared memory and waits on its own mbarrier, instead of a cluster barrier and remote loads. The sums
are the same in the same order, so every output is the same bits as with the barrier exchange."""
import numpy as np
import pytest

from cunorm import check
from conftest import assert_results_ok

pytestmark = pytest.mark.gpu

# (op, N, x dtype, CTAs a row, warps a CTA, other knobs, other case fields): forwards and backwards, 2 to 16
# CTAs, CTAs of one warp and of 16, merged moments, general rows, fp64 sums, an fp8 output with row scales
# (a maximum over the cluster) and residual variants.
CASES = [
    ("layer_norm", 12288, "float32", 2, 4, {}, {}),
    ("layer_norm", 4096, "bfloat16", 4, 1, {}, {}),
    ("layer_norm", 65536, "bfloat16", 4, 16, {}, dict(residual_dtype="float32")),
    ("layer_norm", 65536, "float32", 4, 16, dict(merged_moments=True), {}),
    ("layer_norm", 65537, "bfloat16", 8, 8, dict(merged_moments=True), {}),
    ("rms_norm", 32768, "float16", 8, 4, {}, {}),
    ("layer_norm", 16384, "float64", 4, 4, {}, {}),
    ("rms_norm", 16384, "bfloat16", 2, 16, {}, dict(out_dtype="float8_e4m3fn", scaling="row")),
    ("layer_norm_backward", 65536, "bfloat16", 8, 8, dict(smem_accumulators=True), {}),
    ("layer_norm_backward", 32769, "float32", 4, 8, {}, dict(residual_dtype="float32")),
    ("rms_norm_backward", 262144, "bfloat16", 16, 16, dict(smem_accumulators=True), dict(has_bias=False)),
]


@pytest.mark.parametrize("op, n, dtype, ctas, warps, knobs, fields", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}x{c[4]}" for c in CASES])
def test_pushed_exchanges_give_the_barrier_exchanges_bits(op, n, dtype, ctas, warps, knobs, fields):
    """Every output (poisoned first) against float64 with the knob on, and its error the same to the bit as with
    the barrier exchange on the same inputs (two runs of one seed); 37 rows, so a persistent grid walks several
    rows a cluster."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    errors = {}
    for pushed in (False, True):
        shape = dict(ctas_per_row=ctas, warps_n=warps, stages=1, cache_weights=False, pushed_exchange=pushed,
                     **knobs)
        case = check.Case(op, n, 37, dtype, "float32" if dtype in ("float32", "float64") else "bfloat16",
                          knobs=tuple(sorted(shape.items())), **fields)
        results = check.run_case(case, np.random.default_rng(seed))
        assert_results_ok(results)
        errors[pushed] = [(r.output, r.error) for r in results]
    assert errors[True] == errors[False], f"seed {seed}"
