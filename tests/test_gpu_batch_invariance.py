"""Tier C: batch invariance. A row's y, mean and rstd (forward) and dx (backward) are bitwise the same
whatever the number of rows in its call (1, 255, 256, 4096) and wherever it sits in the batch: for aligned
rows always, for every row in batch-invariant mode (`cunorm.set_batch_invariant`), for every op."""
import numpy as np
import pytest

import cunorm
from cunorm import dtypes

pytestmark = pytest.mark.gpu

BATCHES = (1, 255, 256, 4096)


@pytest.fixture
def invariant_mode():
    cunorm.set_batch_invariant(True)
    yield
    cunorm.set_batch_invariant(False)


def _bits(a):
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _run(op: str, x, dy, res, w, b):
    """Every row-wise result of one call (statistics kept where the op returns them)."""
    if op == "layer_norm":
        return cunorm.layer_norm(x, w, b, residual=res, return_stats=True)
    if op == "rms_norm":
        return cunorm.rms_norm(x, w, residual=res, return_stats=True)
    if op == "layer_norm_backward":
        _, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
        return cunorm.layer_norm_backward(dy, x, mean, rstd, w, dresidual=res)[:1] + (mean, rstd)
    _, rstd = cunorm.rms_norm(x, w, return_stats=True)
    return cunorm.rms_norm_backward(dy, x, rstd, w, dresidual=res)[:1] + (rstd,)


def _check(op, n, dtype, residual, rng):
    import cupy

    big = max(BATCHES) if n <= 8192 else 256
    dt = dtypes.numpy_dtype(dtype)

    def draw(rows):
        return cupy.asarray(rng.standard_normal((rows, n)).astype(np.float32)).astype(dt)

    rows = {t: draw(big) for t in ("x", "dy", "res")}
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32) * 0.5 + 1).astype(dt)
    b = cupy.asarray(rng.standard_normal(n).astype(np.float32)).astype(dt)
    # The reference results: each probed row alone in a call of one row (a fresh, aligned allocation).
    probes = sorted({0, 1, 2, 3, 5, 127, 254, 255, big - 1} & set(range(big)))
    alone = {i: _run(op, *(rows[t][i:i + 1].copy() if t != "res" or residual else None for t in ("x", "dy", "res")),
                     w, b) for i in probes}
    for m in BATCHES:
        if m > big:
            continue
        # The batch: rows[0:m] copied to a fresh allocation, so the probed rows sit at their index's offset.
        got = _run(op, *(rows[t][:m].copy() if t != "res" or residual else None for t in ("x", "dy", "res")), w, b)
        for i in (p for p in probes if p < m):
            for k, (a, want) in enumerate(zip(got, alone[i])):
                if a is None or a.ndim == 0:
                    continue
                assert cupy.array_equal(_bits(a[i:i + 1]), _bits(want)), (op, n, dtype, m, i, k)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"])
@pytest.mark.parametrize("n,dtype", [(4097, "float32"), (4097, "bfloat16"), (4098, "float32"), (1001, "float16"),
                                     (65537, "float32"), (4096, "bfloat16"), (768, "float64")])
def test_batch_invariant_mode(op, n, dtype, residual, invariant_mode, rng):
    _check(op, n, dtype, residual, rng)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"])
@pytest.mark.parametrize("n,dtype", [(1024, "bfloat16"), (4096, "float32"), (8192, "float16"), (65536, "bfloat16")])
def test_aligned_rows_are_batch_invariant_in_either_mode(op, n, dtype, rng):
    assert not cunorm.batch_invariant()
    _check(op, n, dtype, True, rng)
