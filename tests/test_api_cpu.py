"""Tier A: the numpy path (float64 reference on the CPU) and argument checks."""
import numpy as np
import pytest

import cunorm
from cunorm import dtypes, reference


def test_numpy_forward_and_backward(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32) + 1
    w = rng.standard_normal(64).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and mean.shape == (2, 3)
    assert mean.dtype == np.float32 and rstd.dtype == np.float32
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
    assert dx.dtype == np.float32 and dw.shape == (64,) and db.shape == (64,)
    np.testing.assert_allclose(db, dy.reshape(-1, 64).astype(np.float64).sum(0), rtol=1e-5)


def test_numpy_float64_is_computed_and_returned_in_float64(rng):
    """float64, numpy's default dtype, runs end to end: outputs and statistics in float64, within 1e-12 of the
    reference computed independently here; float64 mixes with the other dtypes; the backward asks for the
    float32 or float64 statistics."""
    x = rng.standard_normal((6, 100)) * 3 + 7
    w, b = rng.standard_normal(100), rng.standard_normal(100)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    assert y.dtype == mean.dtype == rstd.dtype == np.float64
    mu = x.mean(-1, keepdims=True)
    ref = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-12
    dy = rng.standard_normal(x.shape)
    dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
    assert dx.dtype == dw.dtype == db.dtype == np.float64
    np.testing.assert_allclose(db, dy.sum(0), rtol=1e-13)
    with pytest.raises(TypeError, match="mean: dtype float16 is not supported; expected one of float32, float64"):
        cunorm.layer_norm_backward(dy, x, mean.astype(np.float16), rstd, w)
    # Mixed: fp32 x with fp64 weights computes in fp32 (stats float32); fp64 x with bf16 weights in fp64.
    y32, _, rstd32 = cunorm.layer_norm(x.astype(np.float32), w, b, return_stats=True)
    assert y32.dtype == rstd32.dtype == np.float32
    y16 = cunorm.rms_norm(x, w.astype(dtypes.BFLOAT16), out_dtype="bfloat16")
    assert y16.dtype == dtypes.BFLOAT16
    d = cunorm.attention_delta(x, dy.astype(np.float32))
    assert d.dtype == np.float64 and np.allclose(d, (x * dy.astype(np.float32)).sum(-1), rtol=1e-13)


def test_numpy_rows_at_the_ends_of_the_range(rng):
    """The numpy path (float64 throughout) meets the range the README promises for the GPU: fp32 rows
    scaled by 1e18 or 1e-18 normalize as the unscaled ones (eps = 0), and their backward scales as
    1 / scale; fp16 rows up to 60000 stay finite."""
    base = (0.5 + 2 * rng.standard_normal((4, 1000))).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(1000)).astype(np.float32)
    dy = rng.standard_normal(base.shape).astype(np.float32)
    for op, backward in ((cunorm.layer_norm, cunorm.layer_norm_backward), (cunorm.rms_norm, cunorm.rms_norm_backward)):
        y0, *stats0 = op(base, w, eps=0.0, return_stats=True)
        dx0 = backward(dy, base, *stats0, w)[0]
        for scale in (1e18, 1e-18):
            x = (base.astype(np.float64) * scale).astype(np.float32)
            y, *stats = op(x, w, eps=0.0, return_stats=True)
            np.testing.assert_allclose(y, y0, rtol=1e-4, atol=1e-5)
            dx = backward(dy, x, *stats, w)[0]
            assert np.isfinite(dx).all()
            np.testing.assert_allclose(dx * np.float64(scale), dx0, rtol=1e-4, atol=1e-5 * np.abs(dx0).max())
        x16 = rng.uniform(-60000, 60000, size=(4, 1000)).astype(np.float16)
        assert np.isfinite(op(x16, w.astype(np.float16))).all()


def test_numpy_rows_of_mean_1e4_within_1e_5(rng):
    """The numpy path on fp32 rows of mean 1e4 and std 1, with and without an fp32 residual: y from the
    float64 statistics, then the backward from the forward's fp32 mean and rstd (whose rounding it undoes,
    as the kernels do), every gradient within 1e-5 of float64; a row of one value gives y = bias exactly."""
    def rel_l2(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        return np.linalg.norm(got - want) / np.linalg.norm(want) if np.isfinite(got).all() else np.inf

    m, n = 6, 1024
    x = (1e4 * rng.choice([-1.0, 1.0], size=(m, 1)) + rng.standard_normal((m, n))).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    xhat = (x - x.mean(axis=-1, keepdims=True, dtype=np.float64)) / x.std(axis=-1, keepdims=True, dtype=np.float64)
    dy = (xhat + 0.5 * rng.standard_normal((m, n))).astype(np.float32)  # mean(g * xhat) O(1): dx sees the mean
    for res in (None, rng.standard_normal((m, n)).astype(np.float32)):
        outs = cunorm.layer_norm(x, w, b, residual=res, return_stats=True)
        y, src, (mean, rstd) = (outs[0], x, outs[1:]) if res is None else (outs[0], outs[1], outs[2:])
        assert mean.dtype == np.float32
        h = x.astype(np.float64) + (0.0 if res is None else res)
        y_ref, mean_ref, rstd_ref = reference.layer_norm(h, w, b, 1e-5)
        assert rel_l2(y, y_ref) <= 1e-5
        # The backward normalizes what it is given: src (with a residual, h rounded to fp32, whose own
        # statistics sit about 1e-5 from h's at N = 1024) with the rstd given; the mean's rounding it undoes.
        grads = cunorm.layer_norm_backward(dy, src, mean, rstd, w)
        mean_src = src.astype(np.float64).mean(axis=-1)
        for got, want in zip(grads, reference.layer_norm_backward(dy, src, mean_src, rstd, w)):
            assert rel_l2(got, want) <= 1e-5
    flat = np.full((2, n), 1e4 + 0.37, dtype=np.float32)
    np.testing.assert_array_equal(cunorm.layer_norm(flat, w, b), np.broadcast_to(b, (2, n)))


def test_numpy_backward_refines_only_rows_far_from_zero_mean(rng):
    """The numpy backward takes a given mean as is on rows within 4 std of zero (as the kernels do): a mean of
    0.5 on centred rows is used, not replaced by x's own; on a row 1e4 from zero it is."""
    m, n = 4, 256
    x = rng.standard_normal((m, n)).astype(np.float32)
    x[3] += np.float32(1e4)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    mean = np.full(m, 0.5, np.float32)
    mean[3] = np.float32(x[3].astype(np.float64).mean())
    rstd = (1 / x.astype(np.float64).std(axis=-1)).astype(np.float32)
    dx = cunorm.layer_norm_backward(dy, x, mean, rstd, w)[0]
    given = reference.layer_norm_backward(dy, x, mean, rstd, w)[0]
    own = reference.layer_norm_backward(dy, x, x.astype(np.float64).mean(axis=-1), rstd, w)[0]
    np.testing.assert_allclose(dx[:3], given[:3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(dx[:3], own[:3], rtol=1e-3, atol=1e-3)  # the given mean 0.5 matters there
    np.testing.assert_allclose(dx[3], own[3], rtol=1e-4, atol=1e-5)


def test_numpy_bf16_and_out_dtype(rng):
    x = rng.standard_normal((4, 32)).astype(dtypes.BFLOAT16)
    y = cunorm.layer_norm(x, out_dtype="float32")
    assert y.dtype == np.float32
    assert cunorm.layer_norm(x).dtype == dtypes.BFLOAT16


def test_backward_optional_outputs(rng):
    x = rng.standard_normal((4, 16)).astype(np.float16)
    _, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    dx, dw, db = cunorm.layer_norm_backward(x, x, mean, rstd, has_bias=False)
    assert dw is None and db is None and dx.dtype == np.float16
    dx, dw, db = cunorm.layer_norm_backward(x, x, mean, rstd)
    assert dw is None and db.dtype == np.float32


def test_numpy_rms_residual_and_return_conventions(rng):
    x = rng.standard_normal((5, 24)).astype(dtypes.BFLOAT16)
    r = rng.standard_normal((5, 24)).astype(np.float32)
    w = rng.standard_normal(24).astype(np.float16)
    y, h, rstd = cunorm.rms_norm(x, w, residual=r, zero_centered_weight=True, return_stats=True)
    assert y.dtype == dtypes.BFLOAT16 and h.dtype == np.float32 and rstd.shape == (5,)
    h64 = x.astype(np.float64) + r
    ref = h64 / np.sqrt((h64 ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + w.astype(np.float64))
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(h, h64, rtol=1e-6)
    y2, h2 = cunorm.layer_norm(x, w, residual=r, residual_dtype="bfloat16")
    assert h2.dtype == dtypes.BFLOAT16
    dx, dw = cunorm.rms_norm_backward(y.astype(np.float32), h, rstd, w, dresidual=r, zero_centered_weight=True)
    assert dx.dtype == np.float32 and dw.dtype == np.float16
    out = np.empty((5, 24), np.float32)
    assert cunorm.layer_norm(x, out=out) is out


def test_zero_rows(rng):
    x = np.empty((0, 16), np.float32)
    y, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    assert y.shape == (0, 16) and mean.shape == (0,)


@pytest.mark.parametrize("call,err,match", [
    (lambda x: cunorm.layer_norm([1.0, 2.0]), TypeError, "x: expected a cupy or numpy array"),
    (lambda x: cunorm.layer_norm(x.astype(np.complex64)), TypeError, "x: dtype complex64"),
    (lambda x: cunorm.layer_norm(x.astype(np.longdouble)), TypeError, "x: dtype float128"),
    (lambda x: cunorm.layer_norm(x.astype(np.int32)), TypeError, "x: dtype int32"),
    (lambda x: cunorm.layer_norm(x, np.ones(7, np.float32)), ValueError, "weight: shape"),
    (lambda x: cunorm.layer_norm(x, np.ones(8, np.int32)), TypeError, "weight: dtype int32"),
    (lambda x: cunorm.layer_norm(x, np.ones(8, np.float32), np.ones(8, np.int16)), TypeError,
     "bias: dtype int16"),
    (lambda x: cunorm.layer_norm(x, np.ones((2, 4), np.float32)), ValueError, "weight: shape"),
    (lambda x: cunorm.layer_norm(x, residual=x[:2]), ValueError, "residual: shape"),
    (lambda x: cunorm.layer_norm(x, residual_dtype="float32"), ValueError, "residual_dtype: given without"),
    (lambda x: cunorm.layer_norm(x, residual=x, residual_dtype="int8"), TypeError, "residual_dtype: unsupported"),
    (lambda x: cunorm.rms_norm(x, zero_centered_weight=True), ValueError, "zero_centered_weight: needs a weight"),
    (lambda x: cunorm.rms_norm_backward(x, x, x[:, 0], dresidual=x[:, :4]), ValueError, "dresidual: shape"),
    (lambda x: cunorm.rms_norm_backward(x, x, x[:, 0], zero_centered_weight=True), ValueError,
     "zero_centered_weight: needs a weight"),
    (lambda x: cunorm.layer_norm(x, out=np.ones((4, 8), np.float16), out_dtype="float32"), TypeError,
     "out: dtype float16 differs from out_dtype float32"),
    (lambda x: cunorm.layer_norm(x, out=np.ones((4, 9), np.float32)), ValueError, "out: shape"),
    (lambda x: cunorm.layer_norm_backward(x, x, x[:, 0], x[:, 0], out=np.ones((4, 8), np.float16)), TypeError,
     "out: dtype float16 must be x's dtype"),
    (lambda x: cunorm.layer_norm(x, eps=-1), ValueError, "eps"),
    (lambda x: cunorm.layer_norm(x, eps=float("nan")), ValueError, "eps"),
    (lambda x: cunorm.layer_norm(x, eps="a"), TypeError, "eps"),
    (lambda x: cunorm.layer_norm(np.float32(1.0)), TypeError, "x: expected"),
    (lambda x: cunorm.layer_norm(np.ones((), np.float32)), ValueError, "x: needs at least one axis"),
    (lambda x: cunorm.layer_norm(np.ones((3, 0), np.float32)), ValueError, "x: the last axis"),
    (lambda x: cunorm.layer_norm(x, out_dtype="int8"), TypeError, "out_dtype: unsupported dtype"),
    (lambda x: cunorm.layer_norm_backward(x[:2], x, x[:, 0], x[:, 0]), ValueError, "dy: shape"),
    (lambda x: cunorm.layer_norm_backward(x, x, x[:2, 0], x[:, 0]), ValueError, "mean: shape"),
    (lambda x: cunorm.layer_norm_backward(x, x, x[:, 0], x[:, 0].astype(np.float16)), TypeError, "rstd: dtype"),
    (lambda x: cunorm.layer_norm_backward(x, x, x[:, 0], x[:, 0], np.ones(3, np.float32)), ValueError,
     "weight: shape"),
])
def test_bad_input_names_the_argument(call, err, match):
    x = np.ones((4, 8), np.float32)
    with pytest.raises(err, match=match):
        call(x)


def test_cpu_dlpack_object_is_refused():
    class CpuTensor:
        def __dlpack__(self, stream=None):
            raise AssertionError("not reached")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match="x: a __dlpack__ array on a non-CUDA device"):
        cunorm.layer_norm(CpuTensor())


def test_import_makes_no_cuda_call():
    import subprocess
    import sys

    code = ("import sys, cunorm; cunorm.layer_norm; "
            "assert 'cupy' not in sys.modules, 'importing cunorm imported cupy'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arrays_on_different_gpus_are_refused(monkeypatch):
    """take_all's device rule, without two GPUs: fake GPU arrays on devices 0 and 1."""
    from types import SimpleNamespace

    from cunorm import arrays

    def fake_take(obj, name):
        return arrays.Arg(name, obj, True)

    monkeypatch.setattr(arrays, "take", fake_take)
    on = lambda dev: SimpleNamespace(device_id=dev)  # noqa: E731
    arrays.take_all({"x": on(0)}, {"weight": on(0), "bias": None})
    with pytest.raises(ValueError, match="weight: is on GPU 1 but x is on GPU 0"):
        arrays.take_all({"x": on(0)}, {"weight": on(1)})


class _FakeGpuArray:
    """A numpy array posing as a GPU one of a kind of its own (`_FakeKind`):
    enough for cache keys, row views and overlap checks without a GPU."""

    def __init__(self, a):
        self.a = a


class _FakeKind:
    name = "fake"

    @staticmethod
    def keypart(f):
        a = f.a
        return (a.shape, a.strides, a.dtype, a.ctypes.data % 64, 0), a.ctypes.data

    @classmethod
    def describe(cls, f):
        from cunorm.kinds import Tensor

        a = f.a
        return Tensor(f, cls, a.ctypes.data, a.shape, a.strides, a.dtype, 0)

    @staticmethod
    def copy(f):
        return _FakeGpuArray(np.array(f.a, copy=True))

    @staticmethod
    def allocation(specs, anchor):
        return lambda device_id, objs: ([], [])


@pytest.fixture
def fake_gpu(monkeypatch):
    """_FakeGpuArray taken as a GPU array of _FakeKind, on device 0."""
    from cunorm import kinds, launch, plan

    real = kinds.kind_of
    monkeypatch.setattr(kinds, "kind_of", lambda obj: _FakeKind if isinstance(obj, _FakeGpuArray) else real(obj))
    monkeypatch.setattr(plan, "kind_of", kinds.kind_of)
    monkeypatch.setattr(plan, "_keyparts", {})
    monkeypatch.setattr(launch, "_current_device", lambda: 0)


def test_call_key_covers_out(fake_gpu):
    """A call with out= has a cache key: out's layout is part of it, its
    address only modulo the key's alignment."""
    from cunorm import kinds, plan

    buf = np.zeros((3, 64, 256), np.float32)
    x, out1, out2 = (_FakeGpuArray(b) for b in buf)
    key = lambda out: plan.call_key((x, None, None, None, out), (False, None, False, None, None))[0]  # noqa: E731
    assert key(out1) is not None and key(out1) == key(out2) != key(None)
    assert key(out1) != key(_FakeGpuArray(np.zeros((64, 512), np.float32)[:, :256]))  # another row stride
    assert key(out1) != key(_FakeGpuArray(buf.reshape(-1)[1:1 + 64 * 256].reshape(64, 256)))  # 4 bytes on
    assert key(np.zeros((64, 256), np.float32)) is None  # numpy: not a GPU call
    assert plan.call_key((x, out1), (None,))[1] == [buf[0].ctypes.data, buf[1].ctypes.data]
    assert kinds.KEY_ALIGNMENT >= 2 * 16  # a vector of 16 bytes of 2-byte x spans 32 bytes of fp32


def test_call_key_covers_knob_mappings(fake_gpu):
    """traits= as a mapping of knobs is part of the cache key (in any order):
    forced kernels are cached like dispatched ones. Unhashable knob values
    make the call uncacheable, not an error."""
    from cunorm import plan

    x = _FakeGpuArray(np.zeros((64, 256), np.float32))
    key = lambda traits: plan.call_key((x, None), (False, traits))[0]  # noqa: E731
    assert key({"warps_n": 4, "stages": 2}) == key({"stages": 2, "warps_n": 4}) is not None
    assert key({"warps_n": 4}) != key({"warps_n": 8}) and key({"warps_n": 4}) != key(None)
    assert key({"warps_n": [4]}) is None


@pytest.mark.parametrize("backward", [False, True])
def test_cached_out_rechecks_overlap_as_the_first_call(backward, fake_gpu):
    """A cached plan with out= redoes the overlap check with the first call's
    rule and error, and returns the call's own out."""
    from cunorm import arrays
    from cunorm.launch import CallPlan
    from cunorm.norm import calls, plans

    n = 64
    buf, stats = np.zeros((65, n), np.float32), np.zeros((2, 64), np.float32)
    w_buf = np.zeros((64, n), np.float32)
    d = calls.BACKWARD if backward else calls.FORWARD
    prepare = plans.backward_prepare if backward else plans.forward_prepare
    base = calls.call_base(rms=False, backward=backward, hidden_size=n, input_dtype="float32",
                           output_dtype="float32", weight_dtype="float32", bias_dtype="float32",
                           residual_dtype=None, zero_centered=False)

    def objs_of(out, **given):
        given = dict(x=buf[:64], dy=np.zeros((64, n), np.float32), mean=stats[0], rstd=stats[1],
                     weight=w_buf[0], bias=np.zeros(n, np.float32), out=out) | given
        return tuple(None if given.get(k) is None else _FakeGpuArray(given[k]) for k in d.arrays)

    def args_of(objs):
        return {k: None if o is None else arrays.take(o, k) for k, o in zip(d.arrays, objs)}

    first_objs = objs_of(np.zeros((64, n), np.float32))
    prepare(args_of(first_objs), base)
    role = "dx" if backward else "y"
    call = CallPlan(_FakeKind, 0, d.arrays, (), given_out=("out", role), spans=plans._spans(d.arrays, args_of(first_objs)),
                    full_overlap_check=plans._overlap_check(d, n), result=lambda objs, made: objs[-1])
    ptrs = lambda objs: [None if o is None else o.a.ctypes.data for o in objs]  # noqa: E731
    overlapping = [buf[1:], w_buf] + ([buf[:64], stats.reshape(-1)[:n * 2].reshape(2, n)] if backward else [])
    for out in overlapping:
        objs = objs_of(out)
        with pytest.raises(ValueError, match="out: shares memory with") as first:
            prepare(args_of(objs), base)
        with pytest.raises(ValueError) as hit:
            call.run(objs, ptrs(objs))
        assert str(hit.value) == str(first.value)
    objs = list(objs_of(None))
    objs[d.arrays.index("out")] = objs[d.arrays.index("dy" if backward else "x")]  # in place
    assert call.run(tuple(objs), ptrs(objs)) is objs[-1]


def test_qk_views_of_a_fused_buffer_and_rmsnorm_bias_on_the_numpy_path(rng):
    """q/k views [B, S, H, D] of a fused QKV buffer (leading strides that do not merge) are laid out through
    three axes, checked like GPU calls (in place allowed, an out= interleaved with x refused), and RMSNorm takes a
    bias: y = xhat * w + b, whose gradient the backward returns with has_bias=True."""
    qkv = rng.standard_normal((2, 5, 3, 4, 64)).astype(np.float32)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    ex = cunorm.explain("rms_norm", q, w, out=q)
    assert "3-axis-rows" in str(ex) and "copied" not in str(ex) and "unstaged forward: a CTA per 8 rows" in str(ex)
    q64 = q.astype(np.float64)
    want = q64 / np.sqrt((q64 ** 2).mean(-1, keepdims=True) + 1e-6) * w + b
    y, rstd = cunorm.rms_norm(q, w, bias=b, return_stats=True)
    assert y.shape == q.shape and np.abs(y - want).max() < 1e-5
    assert cunorm.rms_norm(q, w, bias=b, out=q) is q and np.abs(q - want).max() < 1e-5
    with pytest.raises(ValueError, match="out: shares memory with x"):  # interleaved extents: refused
        cunorm.rms_norm(k, w, out=qkv[:, :, 2])
    dy = rng.standard_normal(q.shape).astype(np.float32)
    dx, dw, db = cunorm.rms_norm_backward(dy, k, rstd, w, has_bias=True)
    np.testing.assert_allclose(db, dy.astype(np.float64).sum((0, 1, 2)), rtol=1e-5)
    assert len(cunorm.rms_norm_backward(dy, k, rstd, w)) == 2


def test_weights_per_head_on_the_numpy_path(rng):
    """A weight (and bias) of shape x.shape[-2:] ([heads, D]) normalizes head h of every row with its own
    row of weights; the backward returns dweight and dbias per head. A 1-D bias beside a per-head weight
    serves every head. Other 2-D weights are refused naming the argument."""
    x = rng.standard_normal((3, 5, 4, 32)).astype(np.float32)
    w, b = rng.standard_normal((4, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    xhat = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    assert np.abs(y - (xhat * w + b)).max() < 1e-5
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
    assert dw.shape == db.shape == (4, 32)
    np.testing.assert_allclose(dw, (dy * xhat).sum((0, 1)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, dy.astype(np.float64).sum((0, 1)), rtol=1e-5, atol=1e-5)
    _, rstd = cunorm.rms_norm(x, w, return_stats=True)
    assert cunorm.rms_norm_backward(dy, x, rstd, w)[1].shape == (4, 32)
    with pytest.raises(ValueError, match=r"weight: shape \(5, 32\) does not match x.shape\[-2:\]"):
        cunorm.layer_norm(x, np.ones((5, 32), np.float32))
    with pytest.raises(ValueError, match="weight: shape"):
        cunorm.layer_norm(x[0, 0, 0], np.ones((1, 32), np.float32))


def test_memory_efficient_backward_from_the_output_on_the_numpy_path(rng):
    """layer_norm_backward / rms_norm_backward from y (and the forward's bias) instead of x and mean equal
    the backward from x; dbias comes exactly with a bias; mixing the two forms is refused naming the
    argument."""
    x = rng.standard_normal((6, 40)) + 2
    w, b = rng.uniform(0.5, 1.5, 40), rng.standard_normal(40)
    dy = rng.standard_normal(x.shape)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    for got, want in zip(cunorm.layer_norm_backward(dy, rstd=rstd, weight=w, y=y, bias=b),
                         cunorm.layer_norm_backward(dy, x, mean, rstd, w)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    y, rstd = cunorm.rms_norm(x, w, return_stats=True)
    got = cunorm.rms_norm_backward(dy, rstd=rstd, weight=w, y=y)
    assert len(got) == 2
    for g, want in zip(got, cunorm.rms_norm_backward(dy, x, rstd, w)):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)
    assert cunorm.layer_norm_backward(dy, rstd=rstd, weight=w, y=y)[2] is None  # no bias given: no dbias
    with pytest.raises(TypeError, match="x: give x and the forward's statistics, or y="):
        cunorm.layer_norm_backward(dy, x, mean, rstd, w, y=y)
    with pytest.raises(TypeError, match="bias: only with y="):
        cunorm.layer_norm_backward(dy, x, mean, rstd, w, bias=b)
    with pytest.raises(ValueError, match=r"rstd: shape \(5,\) does not match y.shape\[:-1\]"):
        cunorm.rms_norm_backward(dy, rstd=rstd[:5], weight=w, y=y)


def test_fp8_outputs_on_the_numpy_path(rng):
    """fp8 y, rounded as the kernels round it: y / scale in float32, saturated to the format's finite range,
    nearest even (checked here against an independent rounding of a few values); the per-row and per-group
    scales are amax / format max; amax is the largest |y|; bad combinations name their argument."""
    import ml_dtypes

    x = rng.standard_normal((6, 256)).astype(np.float32) * 3
    w = rng.standard_normal(256).astype(np.float32)
    y = cunorm.rms_norm(x, w)
    q, scales, amax = cunorm.rms_norm(x, w, out_dtype="float8_e4m3fn", scaling="row", return_amax=True)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and scales.shape == (6,) and amax.shape == ()
    np.testing.assert_allclose(scales, np.abs(y).max(-1) / 448, rtol=1e-6)
    assert float(amax) == np.abs(y).max() and np.abs(q.astype(np.float32)).max() == 448
    deq = q.astype(np.float64) * scales[:, None]
    assert np.abs(deq - y).max() <= np.abs(y).max() * 2.0 ** -4  # e4m3: 3 mantissa bits
    q, g = cunorm.layer_norm(x, w, out_dtype="e5m2", scaling="group")
    assert g.shape == (6, 2) and q.dtype == np.dtype(ml_dtypes.float8_e5m2)
    # A per-tensor scale that saturates: values past 448 * scale store 448, never NaN or inf.
    scale = np.array([float(np.abs(y).max()) / 448 / 2], np.float32)
    q = cunorm.rms_norm(x, w, out_dtype="float8_e4m3fn", scale=scale).astype(np.float32)
    assert np.isfinite(q).all() and np.abs(q).max() == 448
    exact = (y / scale[0]).astype(np.float32)
    small = np.abs(exact) < 448
    assert np.array_equal(q[small], np.clip(exact, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                          .astype(np.float32)[small])
    with pytest.raises(ValueError, match="scaling: float8_e4m3fn output needs scaling="):
        cunorm.rms_norm(x, w, out_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="scaling: only for an fp8 out_dtype"):
        cunorm.rms_norm(x, w, scaling="row")
    with pytest.raises(ValueError, match="scaling: 'group' scales 128 columns"):
        cunorm.rms_norm(x[:, :200], w[:200], out_dtype="float8_e4m3fn", scaling="group")
    with pytest.raises(TypeError, match="residual_dtype: float8_e4m3fn is only an output"):
        cunorm.rms_norm(x, w, residual=x, residual_dtype="float8_e4m3fn")
    with pytest.raises(TypeError, match="x: dtype float8_e4m3fn is not supported"):
        cunorm.rms_norm(q.astype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(TypeError, match="out_dtype: float8_e4m3fn needs x of float32"):
        cunorm.rms_norm(x.astype(np.float64), out_dtype="float8_e4m3fn", scaling="row")


def test_three_axis_outputs_and_per_head_mixes_are_checked(rng):
    """An out= through three axes whose rows would share memory is refused; a per-head bias needs a per-head
    weight (the backward's dbias follows the weight); traits= given as knobs for a per-head call leave the
    weights unheld."""
    from numpy.lib.stride_tricks import as_strided

    qkv = rng.standard_normal((2, 5, 3, 4, 64)).astype(np.float32)
    q, w = qkv[:, :, 0], np.ones(64, np.float32)
    broadcast = as_strided(np.zeros(4096, np.float32), shape=q.shape, strides=(0, 3072, 256, 4))
    with pytest.raises(ValueError, match=r"out: strides \(0, 3072, 256, 4\) make rows overlap"):
        cunorm.rms_norm(q, w, out=broadcast)
    interleaved = as_strided(np.zeros(4096, np.float32), shape=q.shape, strides=(1536, 256, 128, 4))
    with pytest.raises(ValueError, match="make rows overlap"):
        cunorm.rms_norm(q, w, out=interleaved)
    x = rng.standard_normal((3, 5, 4, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=r"bias: a bias per head \(4, 64\) needs a weight per head"):
        cunorm.layer_norm(x, w, np.ones((4, 64), np.float32))
    ex = cunorm.explain("layer_norm", x, np.ones((4, 64), np.float32), traits={"warps_n": 2})
    assert "CACHE_WEIGHTS=0" in str(ex)


def test_fp8_steps_measure_the_grid():
    """check.fp8_ulps: one step of the fp8 grid at the larger value; near zero the fp32 floor; NaN against a
    number fails."""
    import ml_dtypes

    from cunorm import check

    e5 = lambda v: np.array(v, np.float32).astype(ml_dtypes.float8_e5m2)  # noqa: E731
    assert check.fp8_ulps(e5([-1536.0]), e5([-1792.0]), "float8_e5m2") == 1.0  # a near-tie rounded either way
    assert check.fp8_ulps(e5([1024.0]), e5([1792.0]), "float8_e5m2") == 3.0
    assert check.fp8_ulps(e5([3 * 2.0 ** -16]), e5([0.0]), "float8_e5m2") < 1.0  # under the fp32 floor
    assert np.isnan(check.fp8_ulps(e5([np.nan]), e5([1.0]), "float8_e5m2"))
    assert check.fp8_ulps(e5([np.nan]), e5([np.nan]), "float8_e5m2") == 0.0


def test_fp8_group_scaling_and_per_head_bias_refusals(rng):
    """128-column scaling needs rows in aligned vectors: an offset view is refused naming scaling (on the numpy
    path as on the GPU); the memory-efficient backward refuses a per-head bias beside a 1-D weight; a zero
    multiplier there gives xhat = 0, not NaN."""
    x = rng.standard_normal((4, 257)).astype(np.float32)
    with pytest.raises(ValueError, match="scaling: 'group' reads rows in aligned vectors"):
        cunorm.rms_norm(x[:, 1:], out_dtype="float8_e4m3fn", scaling="group")
    x4 = rng.standard_normal((2, 3, 4, 64))
    w, b = np.ones(64), np.ones((4, 64))
    y, rstd = cunorm.rms_norm(x4, w, return_stats=True)
    with pytest.raises(ValueError, match=r"bias: a bias per head \(4, 64\) needs a weight per head"):
        cunorm.rms_norm_backward(y, rstd=rstd, weight=w, y=y, bias=b)
    w0 = np.ones(64)
    w0[3] = 0.0
    y, rstd = cunorm.rms_norm(x4, w0, return_stats=True)
    dx, dw = cunorm.rms_norm_backward(y, rstd=rstd, weight=w0, y=y)
    assert np.isfinite(dx).all() and np.isfinite(dw).all() and dw[3] == 0.0


def test_explain_names_an_unstaged_forward():
    x = np.ones((8, 4096), np.float32)
    ex = cunorm.explain("layer_norm", x)
    assert not ex.traits.persistent and "unstaged forward: a CTA per row" in str(ex) and "64 registers" in str(ex)
    assert "unstaged" not in str(cunorm.explain("layer_norm_backward", x, x, x[:, 0], x[:, 0]))
