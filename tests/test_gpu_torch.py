"""Tier C, torch tensors through the core API: torch tensors in, torch tensors
out (torch's allocator, torch's current stream), the plan cache across
pointers and layouts, and `out=` given as a torch tensor."""
import pytest

import cunorm
from cunorm import check, plan

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch", reason="torch is not installed (the torch tests need it)")


def _cp(t):
    import cupy

    return None if t is None else cupy.from_dlpack(t)  # zero-copy (DLPack carries bf16)


def _tensor(shape, dtype, rng, offset=0.0):
    return torch.from_numpy(rng.standard_normal(shape) + offset).to("cuda", dtype)  # float64 draws


def _assert_fresh(t, like, dtype):
    assert isinstance(t, torch.Tensor) and t.device == like.device and t.dtype == dtype
    assert t.is_contiguous()


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}
STATS = {torch.float64: torch.float64}  # the statistics' dtype (float32 for the rest)


@pytest.mark.parametrize("n", [1024, 4097])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_takes_and_gives_torch_tensors(dtype, n, rng):
    x = _tensor((3, 37, n), dtype, rng, offset=2.0)
    w, b = _tensor(n, torch.float32, rng), _tensor(n, dtype, rng)
    r = _tensor((3, 37, n), torch.bfloat16, rng)
    y, h, mean, rstd = cunorm.layer_norm(x, w, b, residual=r, residual_dtype=torch.float32, return_stats=True)
    for t, dt in ((y, dtype), (h, torch.float32)):
        _assert_fresh(t, x, dt)
        assert t.shape == x.shape
    for s in (mean, rstd):
        _assert_fresh(s, x, STATS.get(dtype, torch.float32))
        assert s.shape == x.shape[:-1]
    ref_h = cunorm.reference.add_residual(_cp(x), _cp(r))
    y_ref, mean_ref, rstd_ref = cunorm.reference.layer_norm(ref_h, _cp(w), _cp(b))
    assert check.rel_l2(_cp(h), ref_h) < 1e-6
    assert check.rel_l2(_cp(y), y_ref) < TOL[dtype]
    assert check.rel_l2(_cp(mean), mean_ref) < 1e-5 and check.rel_l2(_cp(rstd), rstd_ref) < 1e-5
    dy = _tensor(x.shape, dtype, rng)
    # h is float32: float64 statistics (of float64 x) are rounded for its fp32 backward.
    dx, dw, db = cunorm.layer_norm_backward(dy, h, mean, rstd, w)
    _assert_fresh(dx, x, torch.float32)
    _assert_fresh(dw, x, torch.float32)
    _assert_fresh(db, x, torch.float32)
    want = cunorm.reference.layer_norm_backward(_cp(dy), _cp(h), _cp(mean), _cp(rstd), _cp(w))
    for got, ref in zip((dx, dw, db), want):
        assert check.rel_l2(_cp(got), ref) < 1e-5
    y, rstd = cunorm.rms_norm(x, w, return_stats=True)
    _assert_fresh(y, x, dtype)
    _assert_fresh(rstd, x, STATS.get(dtype, torch.float32))
    y_ref, rstd_ref = cunorm.reference.rms_norm(_cp(x), _cp(w))
    assert check.rel_l2(_cp(y), y_ref) < TOL[dtype]
    assert check.rel_l2(_cp(rstd), rstd_ref) < (TOL[dtype] if dtype == torch.float64 else 1e-5)
    dx, dw = cunorm.rms_norm_backward(dy, x, rstd, w)
    _assert_fresh(dx, x, dtype)
    _assert_fresh(dw, x, torch.float32)
    want = cunorm.reference.rms_norm_backward(_cp(dy), _cp(x), _cp(rstd), _cp(w))
    assert check.rel_l2(_cp(dx), want[0]) < TOL[dtype] and check.rel_l2(_cp(dw), want[1]) < max(TOL[dtype], 1e-5)
    o, g = x[..., :128], dy[..., :128]  # strided rows, read in place
    d = cunorm.attention_delta(o, g)
    _assert_fresh(d, x, STATS.get(dtype, torch.float32))  # float64 for float64 inputs, as the statistics
    assert d.shape == x.shape[:-1]
    assert check.rel_l2(_cp(d), cunorm.reference.attention_delta(_cp(o), _cp(g))) < 1e-5


def test_results_are_on_torchs_current_stream(rng):
    """A producer kernel on a non-default torch stream, then cunorm on that
    stream: cunorm reads what the producer wrote (large arrays, many times:
    a missing stream order shows as stale values)."""
    s = torch.cuda.Stream()
    w = _tensor(8192, torch.bfloat16, rng)
    for i in range(20):
        src = _tensor((2048, 8192), torch.bfloat16, rng)
        with torch.cuda.stream(s):
            x = src * 3.0 + float(i)  # the producer: queued on s
            y, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
            dx, dw, _ = cunorm.layer_norm_backward(x, x, mean, rstd, w)
            d = cunorm.attention_delta(x[:, :128], x[:, 128:256])
        s.synchronize()
        ref = torch.nn.functional.layer_norm(x.double(), (8192,), w.double())
        assert float((y.double() - ref).norm() / ref.norm()) < 8e-3
        assert float((mean.double() - x.double().mean(-1)).abs().max()) < 1e-2
        ref_d = (x[:, :128].double() * x[:, 128:256].double()).sum(-1)
        assert float((d.double() - ref_d).norm() / ref_d.norm()) < 1e-5


def test_launches_use_torchs_stream(rng, launches):
    s = torch.cuda.Stream()
    x = _tensor((64, 1024), torch.float16, rng)
    with torch.cuda.stream(s):
        y, mean, rstd = cunorm.layer_norm(x, return_stats=True)
        cunorm.layer_norm_backward(x, x, mean, rstd)
        cunorm.attention_delta(x, x)
    s.synchronize()
    assert launches and all(p == s.cuda_stream for _, _, p in launches)


def test_plan_reused_for_new_pointers_never_for_new_layouts(rng):
    """Same layout at a new address: a cache hit, reading its own arrays. A
    misaligned view after an aligned one, another row stride or another
    dtype: a plan of its own, and still right."""
    plan.CALLS.clear()
    buf = _tensor((64, 4096 + 8), torch.bfloat16, rng, offset=1.0)
    other = _tensor((64, 4096 + 8), torch.bfloat16, rng, offset=1.0)
    cases = [buf[:, :4096], other[:, :4096], buf.clone()[:, :4096],  # aligned, then two hits at new addresses ...
             buf[:, 1:4097],  # ... then one element on: general rows
             buf[:, 4:4100],  # 8 bytes on: narrower vectors
             buf.view(-1)[:64 * 4096].view(64, 4096),  # contiguous rows
             buf[:, :4096].float()]  # another dtype
    keys = []
    for x in cases:
        y = cunorm.layer_norm(x)
        ref = cunorm.reference.layer_norm(_cp(x))[0]
        assert check.rel_l2(_cp(y), ref) < 8e-3
        keys.append(len(plan.CALLS))
    assert keys == [1, 1, 1, 2, 3, 4, 5]


def test_out_given_as_a_torch_tensor(rng):
    x = _tensor((37, 1000), torch.float16, rng)
    out = torch.empty((37, 1000 + 24), dtype=torch.float32, device="cuda")[:, 3:1003]
    for _ in range(2):  # the first call plans, the second hits
        y = cunorm.rms_norm(x, out=out)
        assert y is out
        assert check.rel_l2(_cp(out), cunorm.reference.rms_norm(_cp(x))[0]) < 1e-5
    _, rstd = cunorm.rms_norm(x, return_stats=True)
    dy = _tensor(x.shape, torch.float16, rng)
    want = cunorm.reference.rms_norm_backward(_cp(dy), _cp(x), _cp(rstd))[0]
    dx, _ = cunorm.rms_norm_backward(dy, x, rstd, out=dy)  # in place
    assert dx is dy and check.rel_l2(_cp(dx), want) < 1e-3
    both = _tensor((38, 1000), torch.float16, rng)
    with pytest.raises(ValueError, match="out: shares memory with x"):
        cunorm.rms_norm(both[:37], out=both[1:])


def test_bad_torch_input_names_the_argument():
    x = torch.ones((4, 64), device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match="x: dtype int32 is not supported"):
        cunorm.layer_norm(x.int())
    with pytest.raises(TypeError, match="weight: a torch tensor on cpu"):
        cunorm.layer_norm(x.float(), torch.ones(64))


def test_fp8_outputs_are_torch_float8_tensors(rng):
    """torch tensors in, torch float8 tensors out (CuPy callers get uint8 bits), with the row scales."""
    x = _tensor((64, 1024), torch.bfloat16, rng)
    w = _tensor(1024, torch.bfloat16, rng)
    q, scales, amax = cunorm.rms_norm(x, w, out_dtype=torch.float8_e4m3fn, scaling="row", return_amax=True)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scales.shape == (64,) and amax.shape == ()
    y = torch.nn.functional.rms_norm(x.double(), (1024,), w.double())
    assert float(((q.double() * scales.double()[:, None]) - y).norm() / y.norm()) < 2 ** -4
    assert abs(float(amax) / float(y.abs().max()) - 1) < 1e-2
    import cupy

    bits = cunorm.rms_norm(cupy.from_dlpack(x), cupy.from_dlpack(w), out_dtype="float8_e4m3fn", scaling="row")[0]
    assert bits.dtype == cupy.uint8 and bool((bits == cupy.from_dlpack(q.view(torch.uint8))).all())


def test_scratch_is_reused_per_stream_and_never_by_a_graph(rng):
    """The backward's working memory is one block per stream, reused call
    after call: two streams interleaved give, bit for bit, what one call at
    a time gives. A CUDA graph captures fresh memory of its own, so a replay
    stays right after eager calls on its stream have grown (and freed) that
    stream's block."""
    from cunorm import kinds, scratch

    scratch._arenas.clear()
    n = 4096
    w = _tensor(n, torch.bfloat16, rng)
    xs = [_tensor((16, n), torch.bfloat16, rng, offset=1.0) for _ in range(2)]
    dys = [_tensor((16, n), torch.bfloat16, rng) for _ in range(2)]
    stats = [cunorm.layer_norm(x, w, return_stats=True)[1:] for x in xs]
    alone = [cunorm.layer_norm_backward(dy, x, m, r, w) for dy, x, (m, r) in zip(dys, xs, stats)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = [[], []]
    for _ in range(10):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i].append(cunorm.layer_norm_backward(dys[i], xs[i], *stats[i], w))
    torch.cuda.synchronize()
    for i in range(2):
        for result in got[i]:
            for a, b in zip(result, alone[i]):
                assert torch.equal(a, b)
    assert {(kinds.TorchKind, 0, s.cuda_stream) for s in streams} <= set(scratch._arenas)

    s = streams[0]
    g = torch.cuda.CUDAGraph()
    before = dict(scratch._arenas)
    with torch.cuda.graph(g, stream=s):
        captured = cunorm.layer_norm_backward(dys[0], xs[0], *stats[0], w)
    assert scratch._arenas == before  # the capture took memory of its own
    # A call with more scratch than s's block holds (more partial rows, still under ARENA_BYTES): the block
    # is replaced, and the old one freed, before the replay.
    wide = _tensor((2000, 1024), torch.bfloat16, rng)
    ones = torch.ones(1024, device="cuda")
    wm, wr = cunorm.layer_norm(wide, return_stats=True)[1:]
    key, _ = plan.call_key((wide, wide, wm, wr, ones, None, None, None), (2, True, None, False, True, None, None))
    with torch.cuda.stream(s):
        for _ in range(3):
            cunorm.layer_norm_backward(wide, wide, wm, wr, ones)
        g.replay()
    s.synchronize()
    block = before[(kinds.TorchKind, 0, s.cuda_stream)][2]
    assert block < plan.CALLS[key].scratch_bytes <= scratch.ARENA_BYTES  # the case this test is about
    assert scratch._arenas[(kinds.TorchKind, 0, s.cuda_stream)][2] > block
    for a, b in zip(captured, alone[0]):
        assert torch.equal(a, b)


def test_outputs_are_made_beside_the_argument_of_the_calls_kind(rng):
    """dy as a CuPy array beside torch x: the call is torch's (x's kind), and
    its outputs are torch tensors on x's device, offset outputs included."""
    x = _tensor((5, 4097), torch.float16, rng)[:, 1:]  # general rows: dx sits at x's offset
    y, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    dy = _tensor((5, 4096), torch.float16, rng)
    for _ in range(2):  # the first call plans, the second hits
        dx, dw, db = cunorm.layer_norm_backward(_cp(dy), x, mean, rstd)
        assert isinstance(dx, torch.Tensor) and dx.dtype == torch.float16 and dx.shape == x.shape
        assert dw is None and isinstance(db, torch.Tensor) and db.dtype == torch.float32  # no weight: fp32 dbias
        want = cunorm.reference.layer_norm_backward(_cp(dy), _cp(x), _cp(mean), _cp(rstd))
        assert check.rel_l2(_cp(dx), want[0]) < 1e-3 and check.rel_l2(_cp(db), want[2]) < 1e-5


@pytest.mark.parametrize("anchor", ["torch", "cupy"])
def test_arrays_of_both_kinds_in_one_call(anchor, rng):
    """x of one kind, weights (and dy) of the other: results come back as x's kind, from x's allocator, and
    match the float64 reference, on a first call and on a cache hit (outputs are never made like an argument
    of the other kind)."""
    n = 1024
    x, dy = _tensor((64, n), torch.float32, rng, offset=1.0), _tensor((64, n), torch.float32, rng)
    w, b = _tensor(n, torch.float32, rng), _tensor(n, torch.float32, rng)
    own, other = (lambda t: t, _cp) if anchor == "torch" else (_cp, lambda t: t)
    kind = torch.Tensor if anchor == "torch" else type(_cp(x))
    ref_y, ref_mean, ref_rstd = cunorm.reference.layer_norm(_cp(x).get(), _cp(w).get(), _cp(b).get())
    ref_grads = cunorm.reference.layer_norm_backward(_cp(dy).get(), _cp(x).get(), ref_mean, ref_rstd, _cp(w).get())
    for _ in range(2):  # the second call is a cache hit
        y, mean, rstd = cunorm.layer_norm(own(x), other(w), other(b), return_stats=True)
        assert isinstance(y, kind) and check.rel_l2(_cp(y) if anchor == "torch" else y, ref_y) < 1e-5
        grads = cunorm.layer_norm_backward(other(dy), own(x), mean, rstd, other(w))
        for got, want in zip(grads, ref_grads):
            assert isinstance(got, kind) and check.rel_l2(_cp(got) if anchor == "torch" else got, want) < 1e-5
