"""Tier C for several rows a warp (lanes_per_row < 32: short rows such as q/k heads): rows that share a warp
stay apart, and the checker's forced cases (`sweeps.short_row_cases`) against the float64 reference."""
import pytest

import cunorm
from cunorm import check, dtypes, sweeps

pytestmark = pytest.mark.gpu

CASES = [c for op in sweeps.NORM_OPS for c in sweeps.short_row_cases(op)]


def _buffer(shape, dtype, rng):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(dtypes.numpy_dtype(dtype)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_short_row_cases(case, rng):
    bad = [f"{r.output}: {r.error:.3e} > {r.tolerance:.0e}" for r in check.run_case(case, rng) if not r.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("lanes", [4, 8, 16])
@pytest.mark.parametrize("rms", [False, True])
def test_rows_sharing_a_warp_stay_apart(rms, lanes, rng):
    """Several rows a warp (lanes_per_row < 32): each row's y, statistics and dx are bitwise those of the row
    alone in its call (first, last, and mid-warp rows), so no lane reads across its row's lanes."""
    import cupy

    n, m = 128, 45  # 45 rows fill no whole warp or CTA
    x, dy = _buffer((m, n), "bfloat16", rng), _buffer((m, n), "bfloat16", rng)
    w = cupy.asarray(rng.standard_normal(n) * 0.5 + 1).astype(x.dtype)
    knobs = dict(lanes_per_row=lanes, warps_m=4, stages=3)

    def run(xs, dys):
        if rms:
            y, rstd = cunorm.rms_norm(xs, w, return_stats=True, traits=knobs)
            return (y, rstd, *cunorm.rms_norm_backward(dys, xs, rstd, w, traits=knobs))
        y, mean, rstd = cunorm.layer_norm(xs, w, return_stats=True, traits=knobs)
        return (y, mean, rstd, *cunorm.layer_norm_backward(dys, xs, mean, rstd, w, traits=knobs)[:1])

    whole = run(x, dy)
    assert check.rel_l2(whole[0], (cunorm.reference.rms_norm(x, w) if rms else
                                   cunorm.reference.layer_norm(x, w))[0]) < check.TOLERANCE["bfloat16"]
    n_rowwise = 3 if rms else 4  # y, statistics, dx (dweight sums over rows)
    for i in (0, 1, lanes // 4 + 1, 31, m - 1):
        alone = run(x[i:i + 1].copy(), dy[i:i + 1].copy())
        for a, b in zip(whole[:n_rowwise], alone[:n_rowwise]):
            assert cupy.array_equal(a[i:i + 1], b), (i, a.dtype)
