"""attention_delta: tier A (traits, layouts, numpy path), B (compiles), C (GPU)."""
import itertools

import numpy as np
import pytest

import cunorm
from cunorm import DeltaTraits, check, compile_only, dtypes
from cunorm.attention_delta import heuristic
from cunorm.layout import common_axes

HEAD_DIMS = (1, 3, 8, 63, 64, 80, 96, 128, 192, 256, 512)
PAIRS = list(itertools.product(dtypes.NAMES, repeat=2))


# -- tier A -----------------------------------------------------------------
@pytest.mark.parametrize("changes,rule", [
    (dict(threads_per_row=3), "power of two"), (dict(threads_per_row=64), "power of two"),
    (dict(threads_per_cta=100), "whole warps"), (dict(elts_per_ldg=3), "ELTS_PER_LDG"),
    (dict(head_dim=60), "multiple of the elements per load"), (dict(rows_per_thread=0), "ROWS_PER_THREAD"),
    (dict(rows_per_thread=16), "elements per thread"), (dict(head_dim=0), "positive"),
])
def test_illegal_delta_traits(changes, rule):
    with pytest.raises(ValueError, match=rule):
        DeltaTraits(**{**dict(head_dim=64, threads_per_row=8, elts_per_ldg=8, rows_per_thread=4), **changes})


@pytest.mark.parametrize("k", HEAD_DIMS)
@pytest.mark.parametrize("pair", PAIRS)
def test_heuristic_is_legal_for_every_head_dim(k, pair):
    for cap in (16, 8, 2, 1):
        t = heuristic(k, *pair, max_elts_per_ldg=cap)
        assert t.head_dim == k and t.elts_per_ldg <= cap and k % t.elts_per_ldg == 0


def test_row_axes_merge_contiguous_leading_axes():
    # [B, M, H, K] view into a [B, M, H*K] buffer (strides in elements): all leading axes merge for
    # a contiguous grad, and stay apart for a [B, H, M, K]-ordered out.
    sizes, (a, b) = common_axes((2, 5, 3), (5 * 3 * 64, 3 * 64, 64), (5 * 3 * 64, 3 * 64, 64))
    assert sizes == [1, 1, 30] and a == [0, 0, 64] and b == [0, 0, 64]
    sizes, (a, b) = common_axes((2, 5, 3), (3 * 5 * 64, 64, 5 * 64), (5 * 3 * 64, 3 * 64, 64))
    assert sizes == [2, 5, 3] and a == [320 * 3, 64, 320] and b == [15 * 64, 3 * 64, 64]
    assert common_axes((2, 2, 2, 2), (1, 100, 10, 1000), (8, 4, 2, 1)) is None


def test_numpy_reference_path(rng):
    o = rng.standard_normal((2, 7, 33)).astype(np.float16)
    g = rng.standard_normal((2, 7, 33)).astype(np.float32)
    d = cunorm.attention_delta(o, g)
    assert d.dtype == np.float32 and d.shape == (2, 7)
    np.testing.assert_allclose(d, (o.astype(np.float64) * g).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("call,err,match", [
    (lambda: cunorm.attention_delta(np.ones((2, 4), np.float32), np.ones((2, 5), np.float32)), ValueError,
     "grad_out: shape"),
    (lambda: cunorm.attention_delta(np.ones((2, 4), np.int64), np.ones((2, 4), np.float32)), TypeError,
     "out: dtype int64"),
    (lambda: cunorm.attention_delta(np.ones((2, 4), np.float32), np.ones((2, 4), np.complex64)), TypeError,
     "grad_out: dtype complex64"),
    (lambda: cunorm.attention_delta([1.0], np.ones(1, np.float32)), TypeError, "out: expected"),
    (lambda: cunorm.attention_delta(np.ones((), np.float32), np.ones((), np.float32)), ValueError,
     "out: needs at least one axis"),
])
def test_delta_bad_inputs(call, err, match):
    with pytest.raises(err, match=match):
        call()


# -- tier B -----------------------------------------------------------------
@pytest.mark.nvrtc
def test_delta_variants_compile_clean():
    for k in HEAD_DIMS + (2, 7, 31, 1024):
        for pair in (("bfloat16", "bfloat16"), ("float32", "float16"), ("float32", "float32")):
            for cap in (16, 2, 1):
                for arch in (80, 90):
                    t = heuristic(k, *pair, max_elts_per_ldg=cap)
                    assert compile_only(t, arch).clean, t.short()


# -- tier C -----------------------------------------------------------------
def _pair(rng, shape, pair, cupy):
    o, g = check.delta_inputs(check._gpu_rng(rng), int(np.prod(shape[:-1])), shape[-1], *pair)
    return o.reshape(shape), g.reshape(shape)


def _tol(pair):
    return 1e-6 if pair == ("float32", "float32") else 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("k", HEAD_DIMS)
@pytest.mark.parametrize("pair", PAIRS)
def test_delta_against_reference(k, pair, rng):
    import cupy

    for rows in (1, 37, 100000):
        o, g = _pair(rng, (rows, k), pair, cupy)
        with check.poisoned_allocations():
            d = cunorm.attention_delta(o, g)
        err = check.rel_l2(d, cunorm.reference.attention_delta(o, g), check.delta_scale(o, g))
        assert err <= _tol(pair), (k, pair, rows, err)


@pytest.mark.gpu
@pytest.mark.parametrize("k", (64, 80, 128, 63))
def test_delta_layouts_without_copies(k, rng, monkeypatch):
    import cupy

    def no_copy(*args, **kwargs):
        raise AssertionError("attention_delta copied a layout it should read in place")

    b, m, h = 2, 50, 3
    # [B, M, H, K] views into a fused [B, M, 3*H*K] buffer (q, k, v side by side) ...
    fused = cupy.asarray(rng.standard_normal((b, m, 3 * h * k)).astype(dtypes.BFLOAT16))
    o = fused[:, :, h * k:2 * h * k].reshape(b, m, h, k)
    # ... against a [B, H, M, K] tensor seen as [B, M, H, K].
    g = cupy.asarray(rng.standard_normal((b, h, m, k)).astype(np.float32)).transpose(0, 2, 1, 3)
    assert not o.flags.c_contiguous and not g.flags.c_contiguous
    monkeypatch.setattr(cupy, "ascontiguousarray", no_copy)
    with check.poisoned_allocations():
        d = cunorm.attention_delta(o, g)
    monkeypatch.undo()
    assert d.shape == (b, m, h)
    assert check.rel_l2(d, cunorm.reference.attention_delta(o, g)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("offset", range(1, 8))
def test_delta_unaligned_views(offset, rng):
    import cupy

    k = 128
    flat = cupy.asarray(rng.standard_normal(300 * k + 8).astype(dtypes.BFLOAT16))
    o = flat[offset:offset + 300 * k].reshape(300, k)
    g = cupy.asarray(rng.standard_normal((300, k)).astype(np.float16))
    with check.poisoned_allocations():
        d = cunorm.attention_delta(o, g)
    assert check.rel_l2(d, cunorm.reference.attention_delta(o, g)) <= 1e-5


@pytest.mark.gpu
def test_delta_empty_and_forced_traits(rng):
    import cupy

    assert cunorm.attention_delta(cupy.ones((0, 64), np.float32), cupy.ones((0, 64), np.float32)).shape == (0,)
    z = cunorm.attention_delta(cupy.ones((3, 0), np.float32), cupy.ones((3, 0), np.float32))
    assert z.shape == (3,) and float(abs(z).sum()) == 0
    o, g = _pair(rng, (1000, 128), ("bfloat16", "bfloat16"), cupy)
    ref = cunorm.reference.attention_delta(o, g)
    for knobs in ({"threads_per_row": 32, "elts_per_ldg": 4, "rows_per_thread": 1, "threads_per_cta": 128},
                  {"threads_per_row": 4, "elts_per_ldg": 8, "rows_per_thread": 2, "threads_per_cta": 512}):
        assert check.rel_l2(cunorm.attention_delta(o, g, traits=knobs), ref) <= 1e-5
    with pytest.raises(ValueError, match="out: its pointer"):
        cunorm.attention_delta(o[:, 1:127], g[:, 1:127], traits={"threads_per_row": 8, "elts_per_ldg": 2})


@pytest.mark.gpu
def test_delta_reinterpreting_view_is_refused(rng):
    import cupy

    # A float32 view of float16 rows: the leading stride (10 bytes) is no whole number of float32 elements,
    # so the elements are misaligned for float32 loads (any kernel, a copy too, would fault on them).
    base = cupy.asarray(rng.standard_normal((64, 5)).astype(np.float16))
    o = base[:, :4].view(np.float32)
    assert o.strides[0] % o.itemsize
    g = cupy.ones(o.shape, np.float32)
    with pytest.raises(ValueError, match="out: pointer or strides"):
        cunorm.attention_delta(o, g)


@pytest.mark.gpu
def test_delta_head_dim_limit():
    import cupy

    with pytest.raises(ValueError, match="out: head dim 4096 exceeds"):
        cunorm.attention_delta(cupy.ones((2, 4096), np.float32), cupy.ones((2, 4096), np.float32))


@pytest.mark.gpu
def test_delta_bad_gpu_inputs():
    import cupy

    with pytest.raises(TypeError, match="grad_out: is a numpy array"):
        cunorm.attention_delta(cupy.ones((2, 8), np.float32), np.ones((2, 8), np.float32))
