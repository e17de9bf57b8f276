"""Tier C for every tensor a user has (any N, row layouts, weights, dtype mixes,
in place) and for the flags (RMSNorm, residual, zero-centered weights): the
case sweeps `cunorm check` runs, plus paths, determinism and bad input."""
import numpy as np
import pytest

import cunorm
from cunorm import check, dtypes, plan
from conftest import assert_results_ok

pytestmark = pytest.mark.gpu

GENERAL = check.general_cases()
FLAGS = check.flag_cases()
PAIRWISE = check.pairwise_cases()


@pytest.fixture(scope="module", autouse=True)
def _compiled(request):
    """Compile every kernel of the sweeps in parallel first (cached per process)."""
    from conftest import gpu_available

    if gpu_available() is None:
        check.precompile(GENERAL + FLAGS + PAIRWISE)


@pytest.mark.parametrize("case", GENERAL, ids=lambda c: c.label())
def test_general(case, rng):
    assert_results_ok(check.run_case(case, rng))


@pytest.mark.parametrize("case", FLAGS, ids=lambda c: c.label())
def test_flags(case, rng):
    assert_results_ok(check.run_case(case, rng))


@pytest.mark.parametrize("case", PAIRWISE, ids=lambda c: c.label())
def test_pairwise(case, rng):
    """Every tensor's dtype and layout drawn independently (all pairs covered)."""
    assert_results_ok(check.run_case(case, rng))


@pytest.mark.parametrize("n", [1024, 4096, 4097])
@pytest.mark.parametrize("rms", [True, False])
def test_residual_out_dtype_differs_from_the_residual(rms, n, rng):
    """A bf16 residual stream kept in fp32: residual_out = x + residual exactly
    (both bf16, so their fp32 sum is exact), and y normalizes it."""
    import cupy

    x = cupy.asarray(rng.standard_normal((32, n)).astype(dtypes.BFLOAT16))
    r = cupy.asarray(rng.standard_normal((32, n)).astype(dtypes.BFLOAT16))
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    op = cunorm.rms_norm if rms else cunorm.layer_norm
    with check.poisoned_allocations():
        y, h, *stats = op(x, w, residual=r, residual_dtype=np.float32, return_stats=True)
    assert h.dtype == np.float32 and y.dtype == x.dtype
    assert cupy.array_equal(h, x.astype(np.float32) + r.astype(np.float32))
    ref = (cunorm.reference.rms_norm(h, w) if rms else cunorm.reference.layer_norm(h, w))
    assert check.rel_l2(y, ref[0]) < check.TOLERANCE["bfloat16"]
    for got, want in zip(stats, ref[1:]):
        assert check.rel_l2(got, want) < check.TOLERANCE["float32"]


@pytest.fixture
def ran(monkeypatch):
    """The traits of every kernel launch the test makes, in order (the plan
    cache starts empty, so that every call plans)."""
    plan.CALLS.clear()  # every call plans (the dict is shared with the ops: cleared, not replaced)
    seen = []
    original = plan.resolve

    def spy(*args, **kwargs):
        found = original(*args, **kwargs)
        seen.append(found[0])
        return found

    monkeypatch.setattr(plan, "resolve", spy)
    return seen


def _buffer(shape, dtype, rng):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(dtypes.numpy_dtype(dtype)))


@pytest.mark.parametrize("make,path", [
    (lambda b: b[:, :4096], "fast"),                      # rows of a wider buffer, row stride N + 128
    (lambda b: b[:, 64:64 + 4096], "fast"),               # a slice of a fused buffer
    (lambda b: b[:, 1:4097], "general"),                  # an offset view: outputs mirror its offset
    (lambda b: b.reshape(-1)[:37 * 4097].reshape(37, 4097), "general"),  # odd N, contiguous
    (lambda b: b[:, :4097], "narrow"),                    # odd N, row stride N + 127: outputs sit elsewhere
    (lambda b: b.reshape(-1)[:37 * 4109].reshape(37, 4109)[:, :4096], "narrow"),  # row stride N + 13
])
def test_path_taken(make, path, ran, rng):
    """The fast kernel runs whenever the layout is eligible; the kernel that ran
    is the one explain reports."""
    x = make(_buffer((37, 4096 + 128), "bfloat16", rng))
    w = _buffer(x.shape[-1], "bfloat16", rng)
    y, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True)
    dy = make(_buffer((37, 4096 + 128), "bfloat16", rng))  # laid out as x
    dx, _, _ = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
    assert [t.aligned_rows for t in ran] == [path != "general"] * 2
    assert cunorm.explain(cunorm.layer_norm, x, w, w).path == path
    assert cunorm.explain(cunorm.layer_norm_backward, dy, x, mean, rstd, w).path == path
    assert y.flags.c_contiguous and dx.flags.c_contiguous
    assert check.rel_l2(y, cunorm.reference.layer_norm(x, w, w)[0]) < 8e-3


def test_fast_path_with_broadcast_weight(ran, rng):
    import cupy

    x = _buffer((64, 2048), "bfloat16", rng)
    w = cupy.broadcast_to(cupy.asarray([1.5], dtype=np.float32), (2048,))
    y = cunorm.layer_norm(x, w, w)
    assert ran[-1].aligned_rows
    assert check.rel_l2(y, cunorm.reference.layer_norm(x, w, w)[0]) < 8e-3


def test_repeated_calls_reuse_the_plan(ran, rng):
    """A second call of the same layout is planned once and still reads its own arrays."""
    import cupy

    xs = [_buffer((300, 4097), "bfloat16", rng) for _ in range(3)]
    w = _buffer(4097, "float32", rng)
    for x in xs:
        y, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True)
        assert check.rel_l2(y, cunorm.reference.layer_norm(x, w, w)[0]) < 8e-3
        dy = cupy.ones_like(x)
        dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
        want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
        assert check.rel_l2(dx, want[0]) < 8e-3 and check.rel_l2(dw, want[1]) < 1e-5
    assert len(ran) == 2  # one forward and one backward plan


def test_forced_knobs_reuse_the_plan(ran, rng):
    """traits= as a mapping is cached too: the tuner and the benchmarks time the
    kernel, not the host path (validation, layout, dispatch) on every call."""
    x = _buffer((300, 4097), "bfloat16", rng)
    knobs = {"warps_n": 4, "bytes_per_ldg": 8, "stages": 2}
    for _ in range(3):
        y = cunorm.layer_norm(x, traits=dict(knobs))
        assert check.rel_l2(y, cunorm.reference.layer_norm(x)[0]) < 8e-3
    assert len(ran) == 1 and ran[0].warps_n == 4 and not ran[0].aligned_rows


def test_explain_says_why(rng):
    buf = _buffer((8, 4200), "bfloat16", rng)
    e = cunorm.explain(cunorm.layer_norm, buf[:, :4096])
    assert e.path == "fast" and "fast path: every row starts on a 16-byte boundary" in str(e)
    e = cunorm.explain(cunorm.layer_norm, buf.reshape(-1)[:8 * 4109].reshape(8, 4109)[:, :4096])
    assert e.path == "narrow" and "y and x sit at different offsets from 8-element boundaries" in str(e)
    e = cunorm.explain(cunorm.layer_norm, buf[:, 3:4099])
    assert e.path == "general" and "x starts 3 elements past a 8-element boundary" in str(e)
    e = cunorm.explain("rms_norm", buf.reshape(-1)[:8 * 4097].reshape(8, 4097), buf[0, :4097])
    assert "hidden size 4097 is not a multiple of 8 elements" in str(e) and e.traits.rms
    e = cunorm.explain(cunorm.layer_norm, buf[:, :4096].T)
    assert "copied to a contiguous array" in str(e)
    assert cunorm.explain(cunorm.layer_norm, np.ones((2, 8), np.float32)).path == "reference"


@pytest.mark.parametrize("op,n,layout", [("layer_norm_backward", 4097, "contiguous"),
                                          ("layer_norm_backward", 1000, "offset:3"),
                                          ("rms_norm_backward", 65537, "contiguous"),
                                          ("layer_norm_backward", 33, "stride:+13"),
                                          ("rms_norm_backward", 4096, "offset:5")])
def test_general_backward_bitwise_deterministic(op, n, layout, rng):
    import cupy

    case = check.Case(op, n, 3000, "bfloat16", "float32", has_bias=op.startswith("layer"), layout=layout,
                      residual_dtype="bfloat16", zero_centered=True)
    x, w, _, _ = check._inputs(case, rng)
    g = check._gpu_rng(rng)
    dy = check.row_tensor(g, case.rows, n, "bfloat16", layout, g.standard_normal((case.rows, n), dtype="float32"))
    dres = check.row_tensor(g, case.rows, n, "bfloat16", layout, g.standard_normal((case.rows, n), dtype="float32"))
    if case.rms:
        _, rstd = cunorm.rms_norm(x, w, zero_centered_weight=True, return_stats=True)
        runs = [cunorm.rms_norm_backward(dy, x, rstd, w, dresidual=dres, zero_centered_weight=True)
                for _ in range(3)]
    else:
        _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True, zero_centered_weight=True)
        runs = [cunorm.layer_norm_backward(dy, x, mean, rstd, w, dresidual=dres, zero_centered_weight=True)
                for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            if a is None:
                continue
            assert cupy.array_equal(a.view(np.uint16 if a.itemsize == 2 else np.uint32),
                                    b.view(np.uint16 if b.itemsize == 2 else np.uint32))


def test_one_element_rows(rng):
    """N = 1: y = bias exactly, whatever x (no division by zero), and dx = 0."""
    import cupy

    x = _buffer((50, 1), "float32", rng)
    w, b = _buffer(1, "float32", rng), _buffer(1, "float32", rng)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    assert cupy.array_equal(y, cupy.broadcast_to(b, y.shape))
    dx, dw, db = cunorm.layer_norm_backward(_buffer((50, 1), "float32", rng), x, mean, rstd, w)
    assert float(abs(dx).max()) == 0 and float(abs(dw).max()) == 0


@pytest.mark.big_memory  # about 17 GB: beside the tier's other shards it could run out of memory
@pytest.mark.parametrize("n", [8192, 4097])
def test_int64_indexing(n, rng):
    """M * N past 2^31 elements: 64-bit row offsets, forward and backward."""
    import cupy

    m = 2**31 // n + 37
    x = cupy.empty((m, n), dtype=dtypes.BFLOAT16)
    x[...] = cupy.random.standard_normal((1, n), dtype=np.float32).astype(dtypes.BFLOAT16) + 1
    x[-3:] = _buffer((3, n), "bfloat16", rng)
    y, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    ref, mref, rref = cunorm.reference.layer_norm(x[-3:])
    assert check.rel_l2(y[-3:], ref) < 8e-3
    del y
    dy = cupy.empty_like(x)
    dy[...] = cupy.random.standard_normal((1, n), dtype=np.float32).astype(dtypes.BFLOAT16)
    dy[-3:] = _buffer((3, n), "bfloat16", rng)
    dx, _, _ = cunorm.layer_norm_backward(dy, x, mean, rstd, has_bias=False)
    want = cunorm.reference.layer_norm_backward(dy[-3:], x[-3:], mean[-3:], rstd[-3:])[0]
    assert check.rel_l2(dx[-3:], want) < 8e-3
    del x, dx, dy


def test_out_and_in_place(rng):
    import cupy

    x = _buffer((64, 1000), "float16", rng)
    ref = cunorm.reference.layer_norm(x)[0]
    out = cupy.empty((64, 1000), np.float32)
    assert cunorm.layer_norm(x, out=out) is out and check.rel_l2(out, ref) < 1e-5
    x2 = x.copy()
    assert cunorm.layer_norm(x2, out=x2) is x2 and check.rel_l2(x2, ref) < 1e-3
    buf = cupy.empty((65, 1000), np.float16)
    with pytest.raises(ValueError, match="out: shares memory with x"):
        cunorm.layer_norm(buf[:64], out=buf[1:])  # overlapping, not the same view
    with pytest.raises(TypeError, match="out: dtype float32 differs from out_dtype float16"):
        cunorm.layer_norm(x, out=out, out_dtype="float16")
    w_buf = cupy.ones(64 * 1000, np.float16)
    with pytest.raises(ValueError, match="out: shares memory with weight"):
        cunorm.layer_norm(x, w_buf[:1000], out=w_buf.reshape(64, 1000))
    dy = _buffer((64, 1000), "float16", rng)
    _, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd)[0]
    dx, _, _ = cunorm.layer_norm_backward(dy, x, mean, rstd, out=dy)
    assert dx is dy and check.rel_l2(dx, want) < 1e-3
    with pytest.raises(TypeError, match="out: dtype float32 must be x's dtype"):
        cunorm.layer_norm_backward(dy, x, mean, rstd, out=out)


def _value_error(call) -> str:
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


def test_out_calls_reuse_the_plan(ran, rng):
    """A call with out= is cached like any other: another out of the same
    layout is a cache hit, and the result lands in the new out."""
    import cupy


    x = _buffer((300, 4097), "bfloat16", rng)
    w = _buffer(4097, "float32", rng)
    outs = [cupy.empty_like(x) for _ in range(3)]
    for o in outs:
        assert cunorm.layer_norm(x, w, w, out=o) is o
    assert check.rel_l2(outs[0], cunorm.reference.layer_norm(x, w, w)[0]) < 8e-3
    _, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True)
    dy = _buffer((300, 4097), "bfloat16", rng)
    dxs = [cupy.empty_like(x) for _ in range(3)]
    for o in dxs:
        assert cunorm.layer_norm_backward(dy, x, mean, rstd, w, out=o)[0] is o
    assert check.rel_l2(dxs[0], cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)[0]) < 8e-3
    for first, later in (outs[:2], outs[::2], dxs[:2], dxs[::2]):
        assert cupy.array_equal(first.view(np.uint16), later.view(np.uint16))
    assert len(ran) == len(plan.CALLS) == 3  # forward with out=, forward without, backward with out=


def test_cached_out_overlap_is_refused(ran, rng):
    """A cached plan still checks out= for overlap: an out of the cached layout
    that shares memory with an input raises as on an uncached call, before
    anything is written."""
    import cupy

    buf = _buffer((65, 1000), "float16", rng)
    before = buf.copy()
    x, shifted = buf[:64], buf[1:]  # shifted by one row: the layout (and 16-byte alignment) of a fresh (64, 1000)
    fresh = lambda: cupy.empty((64, 1000), np.float16)  # noqa: E731

    uncached = _value_error(lambda: cunorm.layer_norm(x, out=shifted))
    assert uncached == "out: shares memory with x; in place, out may be exactly x (same view and dtype)"
    cunorm.layer_norm(x, out=fresh())
    planned = len(ran)
    assert _value_error(lambda: cunorm.layer_norm(x, out=shifted)) == uncached
    assert len(ran) == planned  # a cache hit

    w_buf = cupy.ones(64 * 1000, np.float16)
    w, w_out = w_buf[:1000], w_buf.reshape(64, 1000)
    uncached = _value_error(lambda: cunorm.layer_norm(x, w, out=w_out))
    assert uncached.startswith("out: shares memory with weight")
    cunorm.layer_norm(x, cupy.ones(1000, np.float16), out=fresh())
    planned = len(ran)
    assert _value_error(lambda: cunorm.layer_norm(x, w, out=w_out)) == uncached
    assert len(ran) == planned

    _, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    dy = _buffer((64, 1000), "float16", rng)
    uncached = _value_error(lambda: cunorm.layer_norm_backward(dy, x, mean, rstd, out=x))  # x is read, not written
    assert uncached == "out: shares memory with x; in place, out may be exactly dy or dresidual (same view and dtype)"
    cunorm.layer_norm_backward(dy, x, mean, rstd, out=fresh())
    planned = len(ran)
    assert _value_error(lambda: cunorm.layer_norm_backward(dy, x, mean, rstd, out=x)) == uncached
    assert _value_error(lambda: cunorm.layer_norm_backward(dy, x, mean, rstd, out=shifted)) == uncached
    assert len(ran) == planned
    assert cupy.array_equal(buf, before)


def test_in_place_after_caching(ran, rng):
    """out=x (forward) and dx into dy or dresidual (backward) from a cached plan."""

    w = _buffer(1000, "float16", rng)
    for _ in range(2):
        x = _buffer((64, 1000), "float16", rng)
        want = cunorm.reference.layer_norm(x, w, w)[0]
        assert cunorm.layer_norm(x, w, w, out=x) is x
        assert check.rel_l2(x, want) < 1e-3
    x = _buffer((64, 1000), "float16", rng)
    _, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True)
    for _ in range(2):
        dy = _buffer((64, 1000), "float16", rng)
        want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)[0]
        dx, _, _ = cunorm.layer_norm_backward(dy, x, mean, rstd, w, out=dy)
        assert dx is dy and check.rel_l2(dx, want) < 1e-3
    _, rstd = cunorm.rms_norm(x, w, return_stats=True)
    for _ in range(2):
        dy, dres = _buffer((64, 1000), "float16", rng), _buffer((64, 1000), "float16", rng)
        want = cunorm.reference.rms_norm_backward(dy, x, rstd, w, dresidual=dres)[0]
        dx, _ = cunorm.rms_norm_backward(dy, x, rstd, w, dresidual=dres, out=dres)
        assert dx is dres and check.rel_l2(dx, want) < 1e-3
    assert len(ran) == len(plan.CALLS) == 5  # the three in-place calls, and the two forwards with stats


def test_gpu_bad_inputs(rng):
    import cupy

    x = cupy.ones((4, 1024), dtype=np.float32)
    w = cupy.ones(1024, np.float32)
    with pytest.raises(ValueError, match="x: negative strides"):
        cunorm.layer_norm(x[:, ::-1])
    with pytest.raises(ValueError, match="x: pointer or strides"):
        cunorm.layer_norm(cupy.ones(4 * 1024 * 2 + 1, np.float16)[1:].view(np.float32).reshape(4, 1024))
    with pytest.raises(TypeError, match="weight: is a numpy array"):
        cunorm.layer_norm(x, np.ones(1024, np.float32))
    with pytest.raises(ValueError, match="weight: shape"):
        cunorm.layer_norm(x, cupy.ones(1000, np.float32))
    with pytest.raises(ValueError, match="weight: negative strides"):
        cunorm.layer_norm(x, w[::-1])
    with pytest.raises(TypeError, match="x: dtype complex64"):
        cunorm.layer_norm(x.astype(np.complex64))
    with pytest.raises(TypeError, match="x: dtype int32"):
        cunorm.rms_norm(x.astype(np.int32))
    with pytest.raises(ValueError, match="residual: shape"):
        cunorm.rms_norm(x, residual=x[:2])
    with pytest.raises(ValueError, match="dresidual: shape"):
        cunorm.rms_norm_backward(x, x, cupy.ones(4, np.float32), dresidual=x[:, :512])
    with pytest.raises(ValueError, match="zero_centered_weight: needs a weight"):
        cunorm.rms_norm(x, zero_centered_weight=True)
    with pytest.raises(ValueError, match="residual_dtype: given without a residual"):
        cunorm.layer_norm(x, residual_dtype="float32")
    with pytest.raises(ValueError, match="dy: shape"):
        cunorm.layer_norm_backward(x[:2], x, cupy.ones(4, np.float32), cupy.ones(4, np.float32))
    with pytest.raises(TypeError, match="rstd: dtype"):
        cunorm.layer_norm_backward(x, x, cupy.ones(4, np.float32), cupy.ones(4, np.float16))
    with pytest.raises(ValueError, match="out: strides"):
        cunorm.layer_norm(x, out=cupy.ones((1024, 4), np.float32).T)
    with pytest.raises(ValueError, match="x: the last axis"):
        cunorm.layer_norm(cupy.ones((4, 0), np.float32))


def test_non_row_layouts_are_copied(rng):
    """A transposed x (last-axis stride 64) and a 4-D x whose leading axes
    merge into four: copied (documented), correct. An axis-permuted 3-D x (two
    leading axes) is read in place through its strides."""
    x = _buffer((1000, 64), "bfloat16", rng).T
    assert check.rel_l2(cunorm.layer_norm(x), cunorm.reference.layer_norm(x)[0]) < 8e-3
    x4 = _buffer((3, 5, 7, 11, 32), "float32", rng).transpose(1, 0, 3, 2, 4)
    assert "copied" in str(cunorm.explain("rms_norm", x4))
    assert check.rel_l2(cunorm.rms_norm(x4), cunorm.reference.rms_norm(x4)[0]) < 1e-5
    x3 = _buffer((4, 300, 96), "float32", rng).transpose(1, 0, 2)
    assert "copied" not in str(cunorm.explain("rms_norm", x3))
    assert check.rel_l2(cunorm.rms_norm(x3), cunorm.reference.rms_norm(x3)[0]) < 1e-5


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_qk_norm_of_a_fused_qkv_buffer_in_place(dtype, per_head, rng):
    """q and k of a fused [B, S, 3, H, D] projection normalized in place over
    the head dim (Qwen3/OLMo2-style q/k-norm; per_head: an [H, D] weight, as
    quack's test_rmsnorm_qk), forward and backward through their own strides:
    the rest of the buffer is untouched, nothing copied."""
    import cupy

    b, s, h, d = 2, 33, 8, 128
    qkv = _buffer((b, s, 3, h, d), dtype, rng)
    before = qkv.copy()
    w = cupy.asarray(rng.standard_normal((h, d) if per_head else d) * 0.5 + 1).astype(qkv.dtype)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    assert "copied" not in str(cunorm.explain("rms_norm", q, w, out=q))
    want_q = cunorm.reference.rms_norm(q, w)[0]
    want_k = cunorm.reference.layer_norm(k, w)[0]
    assert cunorm.rms_norm(q, w, out=q) is q
    assert cunorm.layer_norm(k, w, out=k) is k
    tol = check.TOLERANCE[dtype]
    assert check.rel_l2(q, want_q) < tol and check.rel_l2(k, want_k) < tol
    assert cupy.array_equal(qkv[:, :, 2], before[:, :, 2])  # v untouched
    # Backward through the strided views: dy in k's slot, x in q's, dx into a fresh array.
    x, dy = before[:, :, 0], qkv[:, :, 1]
    _, rstd = cunorm.rms_norm(x, w, return_stats=True)
    dx, dw = cunorm.rms_norm_backward(dy, x, rstd, w)
    want = cunorm.reference.rms_norm_backward(dy, x, rstd, w)
    assert dx.shape == x.shape and check.rel_l2(dx, want[0], check.dx_scale_of(dy, w, False, rstd)) < tol
    assert dw.shape == w.shape and check.rel_l2(dw, want[1]) < tol


@pytest.mark.parametrize("n", [1, 1024, 4097, 65536])
@pytest.mark.parametrize("rms", [False, True])
def test_a_row_holding_inf_or_nan_is_all_nan(rms, n, rng):
    """As documented and as the numpy path: every output of such a row is NaN
    (RMSNorm used to give rstd = 0 and zeros beside the NaN); other rows are untouched."""
    import cupy

    x = cupy.asarray(rng.standard_normal((6, n)).astype(np.float32))
    x[1, n // 2], x[2, 0], x[3, n - 1] = np.inf, np.nan, -np.inf
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    op = cunorm.rms_norm if rms else cunorm.layer_norm
    y, *stats = op(x, w, return_stats=True)
    ref = (cunorm.reference.rms_norm if rms else cunorm.reference.layer_norm)(x, w)
    good = [0, 4, 5]
    for got, want in zip([y] + stats, ref):
        assert bool(cupy.isnan(got[1:4]).all())
        assert bool(cupy.isnan(want[1:4]).all())  # the reference agrees
        assert check.rel_l2(got[good], want[good]) < 1e-5
