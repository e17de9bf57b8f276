"""Tier C: rows past 65536 elements (issue 17). The backward's column sums live in shared memory across the
row's cluster: 8 CTAs at 131072, a 16-CTA (non-portable) cluster at 262144; where a GPU holds no such cluster,
the heuristic's pick within portable clusters runs."""
import numpy as np
import pytest

import cunorm
from cunorm import check, compiler, dispatch, plan
from cunorm.norm import plans
from conftest import assert_results_ok

pytestmark = pytest.mark.gpu

WIDE = (98304, 111104, 131072, 225280, 262144)


def _runs(case):
    """The traits and kernels the GPU path runs a case with."""
    import cupy

    return plan.resolve(plans.Family, None, check.case_call(case), cupy.cuda.Device().id)


@pytest.mark.parametrize("dtype, residual", [("bfloat16", None), ("bfloat16", "float32"), ("float16", "float16"),
                                             ("float32", None)])
@pytest.mark.parametrize("n", WIDE)
@pytest.mark.parametrize("op", ["layer_norm_backward", "rms_norm_backward"])
def test_wide_backward_rows_against_float64(op, n, dtype, residual, rng):
    """Every output of a wide backward (5 rows; dresidual of its own dtype where drawn) against the float64
    reference, outputs poisoned; 2-byte rows of 131072 and 262144 run spill-free (tier B compiles them)."""
    case = check.Case(op, n, 5, dtype, "float32" if dtype == "float32" else "bfloat16", residual_dtype=residual)
    assert_results_ok(check.run_case(case, rng))
    traits, kernels = _runs(case)
    if dtype != "float32" and n in (131072, 262144):
        assert traits.smem_accumulators and all(k.local_bytes == 0 for k in kernels.values()), traits.short()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_wide_backward_is_bitwise_repeatable_and_rows_do_not_see_their_batch(op, rng):
    """At 262144 (16-CTA clusters where the GPU holds them): a call repeated gives the same bits, and a row's dx
    is the same bits alone as in a batch of 5."""
    import cupy

    n = 262144
    x = cupy.asarray(rng.standard_normal((5, n)).astype(np.float32) + 0.5).astype(cupy.float16)
    dy = cupy.asarray(rng.standard_normal((5, n)).astype(np.float32)).astype(cupy.float16)
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    fwd, bwd = getattr(cunorm, op), getattr(cunorm, f"{op}_backward")
    _, *stats = fwd(x, w, return_stats=True)
    first, again = bwd(dy, x, *stats, w), bwd(dy, x, *stats, w)
    for a, b in zip(first, again):
        assert cupy.array_equal(a, b)
    alone = bwd(dy[2:3], x[2:3], *(s[2:3] for s in stats), w)
    assert cupy.array_equal(alone[0], first[0][2:3])


def test_a_gpu_without_sixteen_cta_clusters_runs_the_portable_pick(monkeypatch, rng):
    """Where the occupancy query finds no 16-CTA cluster (stood in for here), the 262144 backward runs the
    heuristic's pick within 8-CTA clusters, and its result is right."""
    real = compiler._resident_clusters

    def without_sixteen(fn, threads, smem, cluster, sm_count):
        if cluster > 8:
            raise compiler.ClusterNotResident("stand-in: no 16-CTA cluster fits")
        return real(fn, threads, smem, cluster, sm_count)

    case = check.Case("rms_norm_backward", 262144, 3, "bfloat16", "bfloat16", has_bias=False)
    call = check.case_call(case)
    assert dispatch.choose(arch=90, **call)[0].ctas_per_row == 16
    monkeypatch.setattr(compiler, "_resident_clusters", without_sixteen)
    monkeypatch.setattr(compiler, "_cache", {})
    monkeypatch.setattr(compiler, "_not_resident", {})  # the stand-in's refusals must not outlive the test
    plan.forget_choices()
    try:
        traits, _ = _runs(case)
        assert traits == dispatch.fallback(compiler.device_arch(0), **call) and traits.ctas_per_row <= 8
        assert_results_ok(check.run_case(case, rng))
    finally:
        monkeypatch.undo()
        plan.forget_choices()
