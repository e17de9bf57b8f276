"""Tier A: the float64 references against finite differences of themselves."""
import numpy as np
import pytest

from cunorm import reference


def _fd(f, arr, h=1e-6):
    """Central finite differences of the scalar f() with respect to arr (perturbed in place)."""
    g = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + h
        up = f()
        arr[idx] = old - h
        down = f()
        arr[idx] = old
        g[idx] = (up - down) / (2 * h)
    return g


@pytest.mark.parametrize("shape", [(3, 8), (2, 2, 5), (1, 1)])
def test_backward_matches_finite_differences(shape, rng):
    x = rng.standard_normal(shape) + 2.0
    n = shape[-1]
    w, b = rng.standard_normal(n), rng.standard_normal(n)
    dy = rng.standard_normal(shape)
    eps = 1e-5
    _, mean, rstd = reference.layer_norm(x, w, b, eps)
    dx, dw, db = reference.layer_norm_backward(dy, x, mean, rstd, w)
    loss = lambda: float((reference.layer_norm(x, w, b, eps)[0] * dy).sum())  # noqa: E731
    fx, fw, fb = _fd(loss, x), _fd(loss, w), _fd(loss, b)
    np.testing.assert_allclose(dx, fx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, fw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, fb, rtol=1e-5, atol=1e-6)


def test_forward_statistics(rng):
    x = rng.standard_normal((4, 100)) * 3 + 7
    y, mean, rstd = reference.layer_norm(x, eps=0.0)
    np.testing.assert_allclose(mean, x.mean(-1))
    np.testing.assert_allclose(rstd, 1 / x.std(-1))
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.std(-1), 1, rtol=1e-12)


def test_backward_without_weight_matches_unit_weight(rng):
    x, dy = rng.standard_normal((5, 16)), rng.standard_normal((5, 16))
    _, mean, rstd = reference.layer_norm(x)
    dx, dw, db = reference.layer_norm_backward(dy, x, mean, rstd, None)
    dx1, _, db1 = reference.layer_norm_backward(dy, x, mean, rstd, np.ones(16))
    assert dw is None
    np.testing.assert_allclose(dx, dx1)
    np.testing.assert_allclose(db, db1)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("has_weight,zero_centered", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("has_residual,has_dresidual", [(False, False), (True, False), (True, True)])
def test_flagged_backward_matches_finite_differences(norm, has_weight, zero_centered, has_residual, has_dresidual,
                                                    rng):
    """Every flag combination of the references (the RMSNorm / residual / zero-centered
    issue builds on these): L = sum(y * dy) + sum(h * dres), h = x + residual,
    differentiated numerically and by the reference backward."""
    shape, eps = (3, 7), 1e-5
    x = rng.standard_normal(shape) + 1.5
    residual = rng.standard_normal(shape) if has_residual else None
    w = rng.standard_normal(shape[-1]) if has_weight else None
    b = rng.standard_normal(shape[-1]) if norm == "layer_norm" else None
    dy = rng.standard_normal(shape)
    dres = rng.standard_normal(shape) if has_dresidual else None

    def loss():
        h = reference.add_residual(x, residual)
        if norm == "layer_norm":
            y = reference.layer_norm(h, w, b, eps, zero_centered_weight=zero_centered)[0]
        else:
            y = reference.rms_norm(h, w, eps, zero_centered_weight=zero_centered)[0]
        return float((y * dy).sum() + ((h * dres).sum() if dres is not None else 0.0))

    h = reference.add_residual(x, residual)
    if norm == "layer_norm":
        _, mean, rstd = reference.layer_norm(h, w, b, eps, zero_centered_weight=zero_centered)
        dx, dw, db = reference.layer_norm_backward(dy, h, mean, rstd, w, dresidual=dres,
                                                   zero_centered_weight=zero_centered)
        np.testing.assert_allclose(db, _fd(loss, b), rtol=1e-5, atol=1e-6)
    else:
        _, rstd = reference.rms_norm(h, w, eps, zero_centered_weight=zero_centered)
        dx, dw = reference.rms_norm_backward(dy, h, rstd, w, dresidual=dres, zero_centered_weight=zero_centered)
    np.testing.assert_allclose(dx, _fd(loss, x), rtol=1e-5, atol=1e-6)
    if residual is not None:  # the residual's gradient is dx as well
        np.testing.assert_allclose(dx, _fd(loss, residual), rtol=1e-5, atol=1e-6)
    if w is not None:
        np.testing.assert_allclose(dw, _fd(loss, w), rtol=1e-5, atol=1e-6)
    else:
        assert dw is None


def test_zero_centered_weight_needs_a_weight():
    with pytest.raises(ValueError, match="zero_centered_weight: needs a weight"):
        reference.rms_norm(np.ones((2, 4)), None, zero_centered_weight=True)
