"""Tier C: the real kernels on a GPU against the float64 reference."""
import numpy as np
import pytest

import cunorm
from cunorm import check, dispatch, dtypes
from conftest import assert_results_ok

pytestmark = pytest.mark.gpu

DTYPES = dtypes.NAMES
SIZES_QUICK = (768, 1024, 4096, 5120, 8192, 12288, 16384, 32768, 65536, 8, 40, 1000, 7168)


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """Compile every kernel of the tuned sweep in parallel first (cached per process)."""
    from conftest import gpu_available

    if gpu_available() is None:
        check.precompile(check.default_cases(sweeps=("tuned",), ops=check.NORM_OPS, rows=(37,)))


@pytest.mark.parametrize("n", dispatch.TUNED_SIZES + check.HEURISTIC_SAMPLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", check.NORM_OPS)
def test_against_reference(op, n, dtype, rng):
    for wdt in dict.fromkeys((dtype, "float32")):
        for rows in (1, 37, 300):
            assert_results_ok(check.run_case(check.Case(op, n, rows, dtype, wdt, has_bias=not op.startswith("rms")), rng))


@pytest.mark.parametrize("has_weight,has_bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("op", ["layer_norm", "layer_norm_backward"])
def test_optional_weight_and_bias(op, has_weight, has_bias, rng):
    for n in (1024, 8, 65536):
        assert_results_ok(check.run_case(check.Case(op, n, 37, "bfloat16", "bfloat16", has_weight, has_bias), rng))


def test_many_rows_and_leading_axes(rng):
    import cupy

    x = cupy.asarray(rng.standard_normal((3, 5, 77, 2048)).astype(np.float16))
    w = cupy.asarray(rng.standard_normal(2048).astype(np.float32))
    b = cupy.asarray(rng.standard_normal(2048).astype(np.float32))
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    assert y.shape == x.shape and y.dtype == x.dtype and mean.shape == (3, 5, 77)
    y_ref, _, _ = cunorm.reference.layer_norm(x, w, b)
    assert check.rel_l2(y, y_ref) < 1e-3
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(np.float16))
    dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
    ref = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
    assert dx.shape == x.shape and dw.dtype == np.float32
    for got, want in zip((dx, dw, db), ref):
        assert check.rel_l2(got, want) < 1e-3


@pytest.mark.parametrize("n,dtype", [(1024, "bfloat16"), (4096, "float32"), (65536, "bfloat16"), (1000, "float16")])
def test_backward_bitwise_deterministic(n, dtype, rng):
    import cupy

    case = check.Case("layer_norm_backward", n, 4096, dtype, dtype)
    x, w, _, _ = check._inputs(case, rng)
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(x.dtype))
    _, mean, rstd = cunorm.layer_norm(x, w, None, return_stats=True)
    runs = [cunorm.layer_norm_backward(dy, x, mean, rstd, w) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert cupy.array_equal(a.view(np.uint16 if a.itemsize == 2 else np.uint32),
                                    b.view(np.uint16 if b.itemsize == 2 else np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_far_from_zero_mean(dtype, rng):
    """|mean| >> std: a one-pass variance or an x*rstd - mean*rstd formulation loses digits here."""
    import cupy

    dt = dtypes.numpy_dtype(dtype)
    for n in (1024, 8192):
        # fp32 sums bound the mean's error by ~1e-7 * |mean| / std (documented): 100 sigma stays in tolerance.
        x = cupy.asarray((100 + rng.standard_normal((64, n)) * (8 if dtype == "bfloat16" else 1)).astype(dt))
        w = cupy.asarray(rng.standard_normal(n).astype(dt))
        y, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
        y_ref, _, rstd_ref = cunorm.reference.layer_norm(x, w)
        assert check.rel_l2(y, y_ref) < check.TOLERANCE[dtype]
        assert check.rel_l2(rstd, rstd_ref) < 1e-5
        dy = cupy.asarray(rng.standard_normal(x.shape).astype(dt))
        got = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
        want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
        for g, r in zip(got, want):
            assert check.rel_l2(g, r) < check.TOLERANCE[dtype]


@pytest.mark.parametrize("n", [1000, 4097, 65536])
def test_float64_statistics_of_either_width(n, rng):
    """A backward takes float32 or float64 statistics whatever x is: converted to its compute dtype (fp64 x with
    fp32 statistics is then fp32-accurate, fp32 x with fp64 statistics as accurate as with its own)."""
    import cupy

    for x_dtype, given in (("float64", "float32"), ("float32", "float64"), ("float64", "float64")):
        case = check.Case("layer_norm_backward", n, 37, x_dtype, x_dtype)
        x, w, _, _ = check._inputs(case, rng)
        dy = cupy.asarray(rng.standard_normal(x.shape)).astype(x.dtype)
        _, mean, rstd = cunorm.reference.layer_norm(x, w)
        stats = [cupy.asarray(s, dtype=given) for s in (mean, rstd)]
        got = cunorm.layer_norm_backward(dy, x, *stats, w)
        assert got[0].dtype == x.dtype
        want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
        tol = check.TOLERANCE["float32" if "float32" in (x_dtype, given) else "float64"]
        scale = check.dx_scale_of(dy, w, False, rstd)
        for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
            assert check.rel_l2(g, r, scale if name == "dx" else 0.0) < tol, (x_dtype, given, name)
        y, mean_out, rstd_out = cunorm.layer_norm(x, w, return_stats=True)
        assert y.dtype == x.dtype and mean_out.dtype == rstd_out.dtype == np.dtype(dtypes.compute_dtype(x_dtype))


def test_zero_rows_give_empty_outputs():
    import cupy

    x = cupy.empty((0, 1024), dtype=np.float32)
    w = cupy.ones(1024, dtype=np.float32)
    y, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True)
    assert y.shape == (0, 1024) and mean.shape == (0,)
    dx, dw, db = cunorm.layer_norm_backward(x, x, mean, rstd, w)
    assert dx.shape == (0, 1024) and float(abs(dw).sum()) == 0 and float(abs(db).sum()) == 0


def test_other_producers_come_back_as_cupy_arrays(rng):
    """A `__dlpack__` or `__cuda_array_interface__` producer that is neither
    CuPy nor torch is read zero-copy and gets CuPy arrays back."""
    import cupy

    x = cupy.asarray(rng.standard_normal((64, 4096)).astype(np.float32))

    class DLPackOnly:
        def __dlpack__(self, stream=None):
            return x.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return x.__dlpack_device__()

    class InterfaceOnly:
        __cuda_array_interface__ = x.__cuda_array_interface__

    ref = cunorm.reference.layer_norm(x)[0]
    for producer in (DLPackOnly(), InterfaceOnly()):
        y = cunorm.layer_norm(producer)
        assert isinstance(y, cupy.ndarray) and check.rel_l2(y, ref) < 1e-5


def test_runs_on_current_stream(rng, launches):
    import cupy

    x = cupy.asarray(rng.standard_normal((512, 4096)).astype(np.float32))
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        y, mean, rstd = cunorm.layer_norm(x, return_stats=True)
        cunorm.layer_norm_backward(x, x, mean, rstd)
        cunorm.attention_delta(x[:, :256], x[:, :256])  # strided rows, read in place
        s.synchronize()
    assert launches and all(p == s.ptr for _, _, p in launches)
    assert check.rel_l2(y, cunorm.reference.layer_norm(x)[0]) < 1e-5


@pytest.mark.parametrize("n, knobs", [(65536, {"warps_n": 4, "ctas_per_row": 8, "stages": 3}),
                                      (65537, {"warps_n": 6, "ctas_per_row": 8, "min_ctas_per_sm": 2}),
                                      (16384, {"warps_n": 4, "ctas_per_row": 4, "min_ctas_per_sm": 2}),
                                      (4096, {"warps_n": 4})])
def test_persistent_grid_is_one_wave(n, knobs, rng, launches):
    """A cluster's CTAs share a GPC, so fewer clusters than SMs / cluster size
    may fit at once; a grid past the resident count runs a second wave."""
    import cupy

    x = cupy.asarray(rng.standard_normal((2048, n)).astype(dtypes.BFLOAT16))
    dy = cupy.asarray(rng.standard_normal((2048, n)).astype(dtypes.BFLOAT16))
    y, mean, rstd = cunorm.layer_norm(x, return_stats=True, traits=knobs)
    dx, _, _ = cunorm.layer_norm_backward(dy, x, mean, rstd, traits=knobs)
    y_ref, mean_ref, rstd_ref = cunorm.reference.layer_norm(x)
    assert check.rel_l2(y, y_ref) < 8e-3
    assert check.rel_l2(dx, cunorm.reference.layer_norm_backward(dy, x, mean_ref, rstd_ref)[0]) < 8e-3
    (fwd, fwd_grid, _), (bwd, bwd_grid, _) = launches[:2]  # then the backward's finalize (not persistent)
    for k, grid in ((fwd, fwd_grid), (bwd, bwd_grid)):
        assert k.cluster == knobs.get("ctas_per_row", 1)
        assert 1 <= k.resident_clusters * k.cluster <= k.sm_count * k.blocks_per_sm
        if k.cluster == 1:
            assert k.resident_clusters == k.sm_count * k.blocks_per_sm
        assert grid % k.cluster == 0 and grid // k.cluster <= k.resident_clusters, (grid, k.resident_clusters)


@pytest.mark.parametrize("knobs", [{"warps_n": 4, "stages": 3}, {"warps_n": 4, "stages": 4, "warps_m": 2},
                                   {"warps_n": 2, "ctas_per_row": 2, "stages": 3}])
def test_many_rows_per_cta(knobs, rng):
    """Rows far beyond one wave of CTAs: every stage of the pipeline and both
    reducer buffers are reused many times."""
    import cupy

    case = check.Case("layer_norm", 1024, 50000, "bfloat16", "float32")
    x, w, b, _ = check._inputs(case, rng)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True, traits=knobs)
    y_ref, mean_ref, rstd_ref = cunorm.reference.layer_norm(x, w, b)
    assert check.rel_l2(y, y_ref) < 8e-3 and check.rel_l2(rstd, rstd_ref) < 1e-5
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(x.dtype))
    with check.poisoned_allocations():
        got = cunorm.layer_norm_backward(dy, x, mean, rstd, w, traits=knobs)
    want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
    for g, r, tol in zip(got, want, (8e-3, 1e-5, 1e-5)):
        assert check.rel_l2(g, r) < tol


UNSTAGED = (("stages", 1), ("persistent", False))


@pytest.mark.parametrize("case", [
    # Rows beyond 2^16 CTAs, the last of them part-filled (warps_m = 4).
    check.Case("layer_norm", 1024, 100_003, "bfloat16", "float32", knobs=(*UNSTAGED, ("warps_n", 2), ("warps_m", 4))),
    # The general kernel (odd N, an offset view) and fp32 weights over fp16 x.
    check.Case("layer_norm", 4097, 1001, "float16", "float32", layout="offset:3",
               knobs=(*UNSTAGED, ("warps_n", 8), ("warps_m", 2))),
    # A cluster row (4 CTAs), a residual, RMSNorm with a bias.
    check.Case("rms_norm", 65536, 37, "bfloat16", "bfloat16", residual_dtype="bfloat16",
               knobs=(*UNSTAGED, ("ctas_per_row", 4), ("warps_n", 16), ("bytes_per_ldg", 16))),
    # fp8 output scaled per row; q/k views of a fused buffer with weights per head.
    check.Case("rms_norm", 2048, 999, "bfloat16", "bfloat16", has_bias=False, out_dtype="float8_e4m3fn",
               scaling="row", knobs=(*UNSTAGED, ("warps_n", 2), ("bytes_per_ldg", 8))),
    check.Case("layer_norm", 128, 6 * 1000, "bfloat16", "bfloat16", layout="qkv", heads=3, per_head=True,
               knobs=(*UNSTAGED, ("warps_m", 4), ("lanes_per_row", 8), ("cache_weights", False))),
], ids=lambda c: c.label())
def test_unstaged_forward_grids(case, rng, launches):
    """persistent=False forwards (a CTA per row group, no staging) against the float64 reference, with the
    grid covering every row group: whatever the shape, layout, cluster or flag."""
    bad = [f"{r.output}: {r.error:.3e} > {r.tolerance:.0e}" for r in check.run_case(case, rng) if not r.ok]
    assert not bad, bad
    t = dispatch.from_knobs(dict(case.knobs), **check.case_call(case))
    grids = [grid // t.ctas_per_row for k, grid, _ in launches if k is not None]  # the case's forwards only
    groups = -(-case.rows // t.rows_per_cta)
    # General rows: down to whole shift periods (at most one vector's elements), the first CTAs taking the rest.
    fewest = groups if t.aligned_rows else groups - t.elts_per_ldg + 1
    assert grids and all(fewest <= g <= groups for g in grids), (grids, groups)


def test_forced_traits(rng):
    import cupy

    x = cupy.asarray(rng.standard_normal((100, 4096)).astype(dtypes.BFLOAT16))
    ref = cunorm.reference.layer_norm(x)[0]
    for knobs in ({"warps_n": 2}, {"warps_n": 4, "warps_m": 2}, {"warps_n": 4, "ctas_per_row": 2},
                  {"warps_n": 8, "bytes_per_ldg": 8}, {"warps_n": 4, "stages": 1}, {"warps_n": 4, "stages": 4},
                  {"warps_n": 2, "ctas_per_row": 4, "stages": 3, "cache_weights": False},
                  {"warps_n": 4, "min_ctas_per_sm": 2, "bytes_per_ldg": 4}):
        assert check.rel_l2(cunorm.layer_norm(x, traits=knobs), ref) < 8e-3
    t = cunorm.Traits(hidden_size=4096, input_dtype="bfloat16", output_dtype="bfloat16", warps_n=4,
                      has_weight=False, has_bias=False)
    assert check.rel_l2(cunorm.layer_norm(x, traits=t), ref) < 8e-3
    with pytest.raises(ValueError, match="traits: hidden_size"):
        cunorm.layer_norm(x, traits=t.replace(hidden_size=2048))
    with pytest.raises(ValueError, match="illegal traits"):
        cunorm.layer_norm(x, traits={"warps_n": 64})


@pytest.mark.parametrize("knobs", [
    {"warps_n": 4, "stages": 1}, {"warps_n": 4, "stages": 4, "smem_accumulators": True},
    {"warps_n": 4, "warps_m": 2, "stages": 2, "smem_accumulators": True},
    {"warps_n": 4, "warps_m": 2, "stages": 3, "cache_weights": False, "recompute": False},
    {"warps_n": 2, "ctas_per_row": 4, "stages": 2, "smem_accumulators": True},
    {"warps_n": 4, "ctas_per_row": 2, "stages": 1, "min_ctas_per_sm": 2}])
def test_backward_knobs(knobs, rng):
    """Every backward variant (staging, shared-memory sums, folds, clusters) against the reference."""
    import cupy

    for n, m in ((4096, 777), (1000, 50)):
        case = check.Case("layer_norm_backward", n, m, "bfloat16", "float32")
        x, w, _, _ = check._inputs(case, rng)
        dy = cupy.asarray(rng.standard_normal(x.shape).astype(x.dtype))
        _, mean, rstd = cunorm.reference.layer_norm(x, w)
        mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
        with check.poisoned_allocations():
            got = cunorm.layer_norm_backward(dy, x, mean, rstd, w, traits=knobs)
        want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
        for g, r, tol in zip(got, want, (8e-3, 1e-5, 1e-5)):
            assert check.rel_l2(g, r) < tol, (knobs, n)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_a_tuned_entry_that_spills_falls_back(zero_centered, rng, tmp_path, monkeypatch):
    """The backward entry of the sm_90 literal at N = 16384 spills for fp16
    RMSNorm (tier B shows it): the GPU path runs the first of dispatch.fallbacks
    (its shape at half the CTAs an SM, then at half its load width, then the
    heuristic's pick) that compiles spill-free, and the result is right. (No per-GPU table here: a GPU's own
    table may hold another entry.)"""
    from cunorm import tables

    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(tables, "SHIPPED_DIR", tmp_path / "none")
    tables.forget()
    try:
        _spilling_entry_falls_back(zero_centered, rng)
    finally:
        monkeypatch.undo()
        tables.forget()  # the plans chosen without the tables go too


def _spilling_entry_falls_back(zero_centered, rng):
    import cupy

    from cunorm import compiler, plan
    from cunorm.norm import plans

    case = check.Case("rms_norm_backward", 16384, 64, "float16", "float16", has_bias=False,
                      zero_centered=zero_centered)
    call = check.case_call(case)
    tuned, origin = dispatch.choose(arch=90, **call)
    assert origin == "tuned"
    dev = cupy.cuda.Device().id
    t, kernels = plan.resolve(plans.Family, None, call, dev)
    if cupy.cuda.Device(dev).compute_capability == "90":
        options = [o for o, _ in dispatch.fallbacks(tuned, origin, 90, **call)]
        clean = [o for o in options if not any(k.local_bytes for k in compiler.kernels_for(o, dev).values())]
        # The half-CTAs shape compiles clean here (the 2026-11-27 tier), so it is what runs.
        assert len(options) == 3 and clean[:1] == options[:1]
        assert options[1] == tuned.replace(bytes_per_ldg=tuned.bytes_per_ldg // 2)  # then at half its loads
        assert t != tuned and t == options[0]
    assert all(k.local_bytes == 0 for k in kernels.values())
    assert_results_ok(check.run_case(case, rng))


@pytest.mark.parametrize("n, dtype, per_head", [(4096, "bfloat16", False), (1000, "float32", False),
                                                 (4097, "float16", False), (768, "float64", False),
                                                 (128, "bfloat16", True)])
def test_small_backwards_are_one_launch(n, dtype, per_head, rng, launches):
    """A backward of few rows sums its partial rows itself (one cooperative
    launch, the finalize kernel's work included), a larger one keeps the
    finalize kernel; both against the float64 reference, the one-launch one
    bitwise equal call after call, and the ticket word is back at 0 after
    every call (the next call on the stream starts from it)."""
    import cupy

    from cunorm import kinds, scratch
    from cunorm.norm import plans

    heads = 4 if per_head else 1
    for rows, launched in ((37, 1), (plans.FUSE_ROW_ELEMENTS // n + heads, 2)):
        rows -= rows % heads
        shape = (rows // heads, heads, n) if per_head else (rows, n)
        x = cupy.asarray((rng.standard_normal(shape) + 1.0).astype(dtypes.numpy_dtype(dtype)))
        dy = cupy.asarray(rng.standard_normal(shape).astype(dtypes.numpy_dtype(dtype)))
        w = cupy.asarray(rng.standard_normal(shape[-2:] if per_head else (n,)).astype(np.float32))
        _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
        del launches[:], launches.cooperative[:]
        with check.poisoned_allocations():
            first = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
        assert len(launches) == launched
        assert launches.cooperative == ([True] if launched == 1 else [False, False])  # a grid barrier: all resident
        want = cunorm.reference.layer_norm_backward(dy, x, mean, rstd, w)
        for got, ref in zip(first, want):
            assert check.rel_l2(got, ref) < check.tolerance(dtypes.name_of(got.dtype), dtype)
        for _ in range(3):
            again = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
            for a, b in zip(again, first):
                assert bool((a.view(np.uint8) == b.view(np.uint8)).all())
        if launched == 1:  # its ticket, in this stream's block
            stream = cupy.cuda.get_current_stream().ptr
            control = scratch._arenas[(kinds.CupyKind, x.device.id, stream)][1]
            memory = cupy.cuda.UnownedMemory(control, 4, x)
            ticket = cupy.ndarray((1,), np.uint32, cupy.cuda.MemoryPointer(memory, 0))
            assert int(ticket[0]) == 0


def test_per_thread_default_stream_takes_fresh_scratch(rng):
    """CuPy's per-thread default stream is one handle for a stream per
    thread: calls on it take working memory of their own (never a block
    shared by threads whose kernels run at once), and give, from four threads
    at once, what one call on the legacy stream gives, bit for bit."""
    import threading

    import cupy

    from cunorm import scratch

    case = check.Case("layer_norm", 1024, 37, "float32", "float32")
    x, w, _, _ = check._inputs(case, rng)
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(np.float32))
    _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
    want = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
    cupy.cuda.Device().synchronize()
    results, errors = [None] * 4, []

    def work(i):
        try:
            with cupy.cuda.Stream.ptds:
                for _ in range(50):
                    r = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
                cupy.cuda.Stream.ptds.synchronize()
            results[i] = r
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in results:
        for a, b in zip(r, want):
            assert bool((a.view(np.uint8) == b.view(np.uint8)).all())
    assert cupy.cuda.Stream.ptds.ptr == scratch.PER_THREAD_STREAM
    assert not any(stream == scratch.PER_THREAD_STREAM for _, _, stream in scratch._arenas)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n, dtype, residual, rowscale, p, layout", [
    (4096, "bfloat16", "bfloat16", "float32", 0.25, "contiguous"),
    (1024, "float32", None, None, 0.5, "contiguous"),
    (4097, "float16", "float32", "bfloat16", 0.1, "contiguous"),  # general rows
    (768, "bfloat16", None, "float32", 0.0, "strided"),  # a row scale alone, rows one stride apart
    (1000, "float64", "float64", "float64", 0.3, "contiguous"),
])
def test_forward_branch_against_the_numpy_path(op, n, dtype, residual, rowscale, p, layout, rng):
    """Dropout and a row scale on the GPU forward: the keep mask bit for bit,
    and y, h (residual_out) and the statistics, against the same call on numpy
    arrays (the float64 reference, the same Philox mask); outputs poisoned."""
    import cupy

    rows, seed = 37, 0x0123456789ABCDEF
    dt = dtypes.numpy_dtype(dtype)
    host = {"x": (rng.standard_normal((rows, n)) + 0.5).astype(dt), "weight": rng.standard_normal(n).astype(np.float32)}
    if residual:
        host["residual"] = rng.standard_normal((rows, n)).astype(dtypes.numpy_dtype(residual))
    if rowscale:
        host["rowscale"] = rng.uniform(0.5, 2.0, rows).astype(dtypes.numpy_dtype(rowscale))
    kw = dict(dropout_p=p, seed=seed if p else None, return_dropout_mask=bool(p), return_stats=True)
    fn = getattr(cunorm, op)
    want = fn(**host, **kw)
    on_gpu = {k: cupy.asarray(v) for k, v in host.items()}
    if layout == "strided":  # x's rows one stride of n + 64 apart, on the device
        on_gpu["x"] = cupy.zeros((rows, n + 64), dt)[:, :n]
        on_gpu["x"][...] = cupy.asarray(host["x"])
    with check.poisoned_allocations():
        got = fn(**on_gpu, **kw)
    assert len(got) == len(want)
    y, h, *rest = got
    wy, wh, *wrest = want
    if p:
        keep, wkeep = rest.pop(0), wrest.pop(0)
        assert keep.dtype == np.bool_ and bool((keep.get() == wkeep).all())
    tol = check.tolerance(dtypes.name_of(y.dtype), dtype)
    assert check.rel_l2(y, wy) < tol and check.rel_l2(h, wh) < check.tolerance(dtypes.name_of(h.dtype), dtype)
    for s, ws in zip(rest, wrest):
        assert check.rel_l2(s, ws) < max(tol, 1e-5)
    # The backward: dx (h's gradient) and dx0 (the branch input's, the same mask drawn again) against numpy's.
    dy = rng.standard_normal((rows, n)).astype(dt)
    wstats = wrest[-1:] if op == "rms_norm" else wrest[-2:]
    bwd = getattr(cunorm, op + "_backward")
    bkw = dict(dropout_p=p, seed=seed if p else None, dx0_dtype="float32")
    want = bwd(dy, wh, *wstats, host["weight"], rowscale=host.get("rowscale"), **bkw)
    # Both backwards take the numpy path's h and statistics: the same inputs, bit for bit (h in bf16 may round
    # differently on the two paths, and dweight would carry that).
    with check.poisoned_allocations():
        got = bwd(cupy.asarray(dy), cupy.asarray(wh), *(cupy.asarray(s) for s in wstats),
                  cupy.asarray(host["weight"]), rowscale=None if rowscale is None else cupy.asarray(host["rowscale"]),
                  **bkw)
    assert len(got) == len(want) and got[1].dtype == np.float32
    for g, w_ in zip(got, want):
        if w_ is not None:
            assert check.rel_l2(g, w_) < max(check.tolerance(dtypes.name_of(g.dtype), dtype), 1e-5)
    if p:  # dropped elements get exactly 0
        assert bool((got[1][~cupy.asarray(wkeep)] == 0).all())


def test_branch_calls_are_cached_and_their_per_call_values_checked(rng):
    """A repeated call with dropout hits its cached plan (another seed, another
    p: per-call values, the mask drawn anew), dropout_p is checked on every
    call, and out= over the rowscale of a cache hit is refused."""
    import cupy

    from cunorm import plan

    x = cupy.asarray((rng.standard_normal((64, 1024)) + 1).astype(np.float32))
    rs = cupy.asarray(rng.uniform(0.5, 2, 64).astype(np.float32))
    cunorm.layer_norm(x, rowscale=rs, dropout_p=0.1, seed=1)
    planned = len(plan.CALLS)
    for p, seed in ((0.1, 2), (0.4, 2**63 + 5)):
        y, h = cunorm.layer_norm(x, rowscale=rs, dropout_p=p, seed=seed)
        want = cunorm.layer_norm(x.get(), rowscale=rs.get(), dropout_p=p, seed=seed)
        assert check.rel_l2(h, want[1]) < 1e-6 and check.rel_l2(y, want[0]) < 1e-5
    assert len(plan.CALLS) == planned
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        cunorm.layer_norm(x, rowscale=rs, dropout_p=1.5, seed=2)
    buf = cupy.zeros(64 * 1024 + 64, np.float32)
    out = buf[64:].reshape(64, 1024)
    cunorm.layer_norm(x, rowscale=cupy.ones(64, np.float32), dropout_p=0.1, seed=3, out=out)
    with pytest.raises(ValueError, match="out: shares memory with rowscale"):
        cunorm.layer_norm(x, rowscale=buf[64:128], dropout_p=0.1, seed=3, out=out)


def test_kernel_time_excludes_the_host():
    """bench's --kernel-time timer: a call that spends 2 ms on the host before queuing a short kernel takes
    >= 2 ms per call through the API (median_ms) and well under it as kernel time (kernel_ms): the calls run
    back to back behind the spin."""
    import time

    import cupy

    from cunorm import timing

    a = cupy.ones(1 << 20, cupy.float32)

    def call():
        end = time.perf_counter() + 2e-3
        while time.perf_counter() < end:
            pass
        a.__imul__(1.0)

    assert timing.median_ms(call, repeat=3, warmup=1, batch=4) >= 1.9
    assert timing.kernel_ms(call, repeat=3, warmup=1, batch=4) < 0.5


def test_compile_only_reports_what_the_gpu_loads():
    """compile_only's ptxas report (what tier B and `cunorm check --compile-only` decide on) against the loaded
    kernels, each traits compiled twice: on a GPU host NVRTC 12.9+ answers a repeated compile from the driver's
    cache, with no report, unless compile_only bypasses it. The wide backward (a 16-CTA cluster, skipped where
    this GPU holds none) kept 24 bytes of local memory on sm_90 with NVRTC 12.9 and 13.0."""
    from cunorm.compiler import ClusterNotResident, compile_only, device_arch, kernels_for

    arch = device_arch(0)
    traits = [cunorm.Traits(hidden_size=4096, input_dtype="bfloat16", warps_n=4)]
    if arch >= 90:
        traits.append(cunorm.Traits(hidden_size=196608, input_dtype="bfloat16", weight_dtype="float32",
                                    backward=True, warps_n=8, ctas_per_row=16, bytes_per_ldg=16, stages=1,
                                    cache_weights=False, pushed_exchange=True))
    for t in traits:
        try:
            loaded = kernels_for(t, 0)
        except (ClusterNotResident, ValueError):  # this GPU holds no such cluster, or refuses its shape
            assert t.ctas_per_row == 16
            continue
        for _ in range(2):
            report = {f.name: f for f in compile_only(t, arch).functions}
            assert set(report) == set(loaded), t.short()
            for name, k in loaded.items():
                assert report[name].registers == k.function.attributes["num_regs"], (t.short(), name)
                assert report[name].stack_frame == k.local_bytes, (t.short(), name)
