"""Tier C: the parallel block (x1 and a second output, issue 20) on a GPU against the numpy path (the float64
reference with the same Philox masks); outputs poisoned. Dtypes and flags of every tensor drawn apart."""
import numpy as np
import pytest

import cunorm
from cunorm import check, dtypes

pytestmark = pytest.mark.gpu


def _close(got, want, dtype_of_x: str):
    """Every output against the numpy path's: masks bit for bit, arrays by the relative L2 error of their dtype."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        elif w.dtype == np.bool_:
            assert g.dtype == np.bool_ and bool((g.get() == w).all())
        else:
            assert check.rel_l2(g, w) < max(check.tolerance(dtypes.name_of(g.dtype), dtype_of_x), 1e-5), g.shape


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n, x_dt, x1_dt, res_dt, w_dt, w1_dt, b1_dt, p, rows, from_output", [
    (4096, "bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16", 0.2, 37, False),
    (4096, "bfloat16", None, None, "float32", "bfloat16", None, 0.0, 256, False),  # a second output alone
    (1024, "float32", "float16", None, "float32", None, None, 0.5, 37, False),  # x1 alone, under dropout
    (4097, "float16", "float32", "float32", "bfloat16", "float32", "float16", 0.1, 37, False),  # general rows
    (768, "float64", "float64", "float64", "float64", "float64", "float64", 0.3, 5, False),
    (8192, "bfloat16", "float16", "float32", "bfloat16", "float32", "bfloat16", 0.0, 2048, True),  # two launches
    (1000, "float16", None, "float16", "float16", "float16", "float32", 0.25, 9, True),
])
def test_parallel_block_against_the_numpy_path(op, n, x_dt, x1_dt, res_dt, w_dt, w1_dt, b1_dt, p, rows,
                                               from_output, rng):
    """Forward (y, y1, h, both masks, statistics), then the backward ((dx, [dx0], [dx1], dweight, dbias,
    [dweight1, dbias1]), from x or from y), each against the same call on numpy arrays."""
    import cupy

    seed = 0xFEDCBA9876543210
    rms = op == "rms_norm"
    dt = dtypes.numpy_dtype
    host = {"x": (rng.standard_normal((rows, n)) + 0.5).astype(dt(x_dt)),
            "weight": (rng.standard_normal(n) + 1).astype(dt(w_dt)), "bias": rng.standard_normal(n).astype(dt(w_dt))}
    if x1_dt:
        host["x1"] = rng.standard_normal((rows, n)).astype(dt(x1_dt))
    if res_dt:
        host["residual"] = rng.standard_normal((rows, n)).astype(dt(res_dt))
    if w1_dt:
        host["weight1"] = (rng.standard_normal(n) + 1).astype(dt(w1_dt))
        if b1_dt:
            host["bias1"] = rng.standard_normal(n).astype(dt(b1_dt))
    kw = dict(dropout_p=p, seed=seed if p else None, return_dropout_mask=bool(p), return_stats=True)
    fn = getattr(cunorm, op)
    want = fn(**host, **kw)
    with check.poisoned_allocations():
        got = fn(**{k: cupy.asarray(v) for k, v in host.items()}, **kw)
    _close(got, want, x_dt)
    # The backward takes the numpy path's forward outputs on both sides: the same inputs, bit for bit.
    want = list(want)
    wy = want[0]
    wh = want[1 + bool(w1_dt)] if (x1_dt or res_dt or p) else host["x"]
    wstats = want[-1:] if rms else want[-2:]
    dy, dy1, dres = (rng.standard_normal((rows, n)).astype(dt(x_dt)) for _ in range(3))
    bkw = dict(dropout_p=p, seed=seed if p else None, has_x1=bool(x1_dt), dresidual=dres)
    if p:
        bkw["dx0_dtype"] = "float32"
        if x1_dt:
            bkw["dx1_dtype"] = x1_dt
    if w1_dt:
        bkw.update(dy1=dy1, weight1=host["weight1"], has_bias1=bool(b1_dt))
    if rms:
        bkw["has_bias"] = True
    if from_output:
        bkw["bias"] = host["bias"]
    bwd = getattr(cunorm, op + "_backward")

    def call(dy_, x_, st, w, **extra):
        if from_output:
            return bwd(dy_, y=x_, rstd=st[-1], weight=w, **extra)
        return bwd(dy_, x_, *st, w, **extra)

    x_in = wy if from_output else wh
    want = call(dy, x_in, wstats, host["weight"], **bkw)
    gpu = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in bkw.items()}
    with check.poisoned_allocations():
        got = call(cupy.asarray(dy), cupy.asarray(x_in), [cupy.asarray(s) for s in wstats],
                   cupy.asarray(host["weight"]), **gpu)
    _close(got, want, x_dt)
    if x1_dt and not p:
        assert got[1] is got[0]  # x1's gradient is dx itself


def test_parallel_calls_are_cached(rng):
    """A repeated parallel call hits its cached plan, with the seed a per-call value."""
    import cupy

    from cunorm import plan

    x, x1 = (cupy.asarray(rng.standard_normal((64, 1024)).astype(np.float32)) for _ in range(2))
    w, w1 = (cupy.asarray((rng.standard_normal(1024) + 1).astype(np.float32)) for _ in range(2))
    cunorm.layer_norm(x, w, x1=x1, weight1=w1, dropout_p=0.1, seed=1)
    planned = len(plan.CALLS)
    for seed in (2, 3):
        got = cunorm.layer_norm(x, w, x1=x1, weight1=w1, dropout_p=0.1, seed=seed)
        want = cunorm.layer_norm(x.get(), w.get(), x1=x1.get(), weight1=w1.get(), dropout_p=0.1, seed=seed)
        for g, wt in zip(got, want):
            assert check.rel_l2(g, wt) < 1e-5
    assert len(plan.CALLS) == planned
