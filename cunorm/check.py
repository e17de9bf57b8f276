"""The correctness checker behind `cunorm check` and the GPU test tier.

Each case draws fresh random inputs (never zeros; rows offset from zero so a
one-pass variance would show), poisons every allocation the op makes with NaN
bytes (so an unwritten element cannot pass), runs the op on the GPU and
compares each output with the float64 reference by relative L2 error.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import numpy as np

from . import dispatch, dtypes, reference
from .norm.plans import one_launch
# The cases and their sweeps live in cunorm.sweeps; re-exported here, where the tools have always found them.
from .sweeps import (DEFAULT_ROWS, DELTA_HEAD_DIMS, FLAG_SIZES, GENERAL_SIZES, HEURISTIC_SAMPLE,  # noqa: F401
                     LAYOUTS, NORM_OPS, OPS, OUT_LAYOUTS, PAIRWISE_LAYOUTS, PAIRWISE_SIZES, QKV_HEAD_DIMS,
                     QKV_LAYOUT, SHORT_NAMES, SWEEPS, WEIGHT_LAYOUTS, Case, default_cases, flag_cases, fp8_cases,
                     from_output_cases, general_cases, pairwise_cases, pairwise_factors, qkv_cases)

# Relative L2 error allowed for outputs written in each dtype (or computed in it: see `tolerance`).
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
# attention_delta sums in fp32 (fp64 for fp64 inputs) whatever the inputs: tighter than the output-dtype table.
DELTA_TOLERANCE_FP32, DELTA_TOLERANCE = 1e-6, 1e-5
@dataclass(frozen=True)
class Result:
    case: Case
    output: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.tolerance)  # NaN compares False

    def as_dict(self) -> dict:
        return {**asdict(self.case), "output": self.output, "error": self.error, "tolerance": self.tolerance,
                "ok": self.ok}


def tolerance(output_dtype: str, x_dtype: str) -> float:
    """The error allowed for an output stored in `output_dtype` by a norm
    kernel reading x of `x_dtype`: the output's rounding, or the compute
    type's (fp32, or fp64 for fp64 x) where that is the coarser."""
    return max(TOLERANCE[output_dtype], TOLERANCE[dtypes.compute_dtype(x_dtype)])


def delta_tolerance(out_dtype: str, grad_dtype: str) -> float:
    from .attention_delta import delta_dtype

    if delta_dtype(out_dtype, grad_dtype) == "float64":
        return TOLERANCE["float64"]
    return DELTA_TOLERANCE_FP32 if (out_dtype, grad_dtype) == ("float32", "float32") else DELTA_TOLERANCE


def standard_normal(gen, shape, dtype: str):
    """N(0, 1) draws for a tensor of `dtype`: drawn in float64 for a float64
    tensor (a float32 draw would leave its low bits zero, and an fp64 kernel
    that truncated to fp32 would pass), float32 otherwise."""
    return gen.standard_normal(shape, dtype="float64" if dtype == "float64" else "float32")


def rel_l2(out, ref, scale: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, scale) in float64; inf if out has any
    non-finite value. `scale` is the size of the terms the output is a
    difference of, where they can cancel far below it (the backward's dx)."""
    import cupy

    out = cupy.asarray(out).astype(np.float64)
    ref = cupy.asarray(ref).astype(np.float64)
    if out.shape != ref.shape or not bool(cupy.isfinite(out).all()):
        return float("inf")
    denom = max(float(cupy.linalg.norm(ref)), scale)
    return float(cupy.linalg.norm(out - ref)) / (denom if denom > 0 else 1.0)


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside is filled with 0xFF bytes: NaN in fp32,
    fp16 and bf16 alike. Working memory kept per stream is dropped first, so
    that a call's scratch is poisoned too (a partial sum left unwritten shows)."""
    import cupy

    from . import launch, scratch

    with launch._launch_lock:
        scratch.forget()
    allocator = cupy.cuda.get_allocator()

    def malloc(size):
        mem = allocator(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(allocator)


def _gpu_rng(rng):
    """A CuPy generator seeded from `rng`: inputs are drawn on the GPU (fast at
    4096 x 65536), and still follow the run's seed."""
    import cupy

    return cupy.random.RandomState(int(rng.integers(2**63)))


def delta_inputs(gen, rows: int, k: int, out_dtype: str, grad_dtype: str):
    """out ~ N(0, 1) and grad_out = out + N(0, 0.5^2): each row's dot product is
    well away from zero. With independent inputs a single row's sum can cancel
    to near zero, where no fp32 summation meets a relative bound."""
    o = standard_normal(gen, (rows, k), out_dtype)
    go = o + 0.5 * standard_normal(gen, (rows, k), grad_dtype)
    return o.astype(dtypes.numpy_dtype(out_dtype)), go.astype(dtypes.numpy_dtype(grad_dtype))


def _layout_rows(name: str, layout_name: str, rows: int, n: int):
    """The row view (no array) of a tensor in checker layout `layout_name`."""
    from . import layout

    kind, _, k = layout_name.partition(":")
    offset, ld = (int(k), n) if kind == "offset" else (0, n + int(k)) if kind == "stride" else (0, n)
    return layout.Rows(name, None, rows, ld, offset)


def _layout_tensor(layout_name: str, lead: tuple, n: int, dtype: str):
    """A stand-in (no memory) of a row tensor in checker layout `layout_name`
    with leading shape `lead`: its pointer (from an aligned buffer) and strides."""
    from .kinds import Tensor

    item = dtypes.itemsize(dtype)
    kind, _, k = layout_name.partition(":")
    if kind == "qkv":
        b, s, h = lead
        elems, offset = ((s + 1) * 3 * h * n, 3 * h * n, n, 1), h * n
    else:
        ld = n + int(k) if kind == "stride" else n
        elems = tuple(ld * math.prod(lead[i + 1:]) for i in range(len(lead))) + (1,)
        offset = int(k) if kind == "offset" else 0
    return Tensor(None, None, offset * item, lead + (n,), tuple(e * item for e in elems), dtypes.numpy_dtype(dtype), -1)


def delta_scale(o, go) -> float:
    """||rowsum(|o * grad_out|)||, the size of the terms each D is a sum of: an
    fp32 sum is accurate relative to them, not to a row whose terms cancel
    (few terms, K = 3, can cancel to a small D)."""
    return float(abs(np.linalg.norm(abs(reference._f64(o) * reference._f64(go)).sum(axis=-1))))


def case_call(case: Case) -> dict:
    """The dispatch call a norm case makes, derived without a GPU: the case's
    dtypes and flags, and the vector widths its layout allows (each row tensor
    in its own layout, beside fresh, contiguous outputs)."""
    from . import layout, norm

    n, m = case.hidden_size, case.rows
    res = case.residual_dtype
    branch = norm.calls.Branch(case.dropout_p, 0, case.rowscale_dtype is not None,
                               case.dropout_p > 0 and not case.backward, None if res else case.dtype,
                               x1=case.x1_dtype is not None)
    dx1 = case.dtype if case.backward and branch.x1 and case.dropout_p else None
    base = norm.call_base(rms=case.rms, backward=case.backward, hidden_size=n, input_dtype=case.dtype,
                          output_dtype=case.out_dtype or case.dtype,
                          weight_dtype=case.weight_dtype if case.has_weight else None,
                          bias_dtype=(case.bias_dtype or case.weight_dtype) if case.has_bias else None,
                          residual_dtype=res, residual_out_dtype=None if case.backward else case.residual_out_dtype,
                          zero_centered=case.zero_centered,
                          per_head=case.per_head and (case.has_weight or (case.has_bias and not case.backward)),
                          from_output=case.from_output, quant=case.scaling or "none", amax=case.return_amax,
                          branch=branch, rowscale_dtype=case.rowscale_dtype,
                          x1_dtype=None if case.backward else case.x1_dtype, weight1_dtype=case.weight1_dtype,
                          bias1_dtype=case.bias1_dtype, dx1_dtype=dx1)
    if branch.on and case.backward:
        base["dx0_dtype"] = case.dtype
    inputs = ["x"] + (["dy"] if case.backward else []) + (["residual"] if res is not None else [])
    if case.heads:  # leading axes [2, S, heads]: three-axis rows where a layout does not merge them
        named = {t: _layout_tensor(case.layout_of(t), case.lead, n, case.dtype) for t in inputs}
        if not case.in_place and case.layout_of("out") is not None:
            named["out"] = _layout_tensor(case.layout_of("out"), case.lead, n, case.dtype)
        three = layout.three_axis_rows(named, n)
        if three is not None:
            rows = list(three.values())
            if not case.in_place and case.layout_of("out") is None:
                rows.append(layout.fresh_three_axis_rows("out", three["x"], n))
            if res is not None and not case.backward:
                rows.append(layout.fresh_three_axis_rows("residual_out", three["x"], n))
            max_vector, aligned_vector = layout.vector_widths(rows, n, dtypes.itemsize(case.dtype))
            return dict(base, max_vector=max_vector, aligned_vector=aligned_vector, row_axes=3)
    rows = [_layout_rows(t, case.layout_of(t), m, n) for t in inputs]
    mirrored = layout.mirrored_offset(rows[0], dtypes.itemsize(case.dtype))
    if not case.in_place:
        given = case.layout_of("out")
        rows.append(layout.fresh_rows("out", m, n, mirrored) if given is None else _layout_rows("out", given, m, n))
    if case.x1_dtype is not None and not case.backward:  # x1, dy1 (the parallel block): contiguous in every case
        rows.append(_layout_rows("x1", "contiguous", m, n))
    if case.weight1_dtype is not None and case.backward:
        rows.append(_layout_rows("dy1", "contiguous", m, n))
    if (res is not None or branch.writes_h) and not case.backward:
        rows.append(layout.fresh_rows("residual_out", m, n, mirrored))
    if case.weight1_dtype is not None and not case.backward:
        rows.append(layout.fresh_rows("y1", m, n, mirrored))
    if branch.on and case.backward:
        rows.append(layout.fresh_rows("dx0", m, n, mirrored))
    if dx1 is not None:
        rows.append(layout.fresh_rows("dx1", m, n, mirrored))
    max_vector, aligned_vector = layout.vector_widths(rows, n, dtypes.itemsize(case.dtype))
    return dict(base, max_vector=max_vector, aligned_vector=aligned_vector)


def _lead(case: Case) -> tuple | None:
    return case.lead if case.heads else None


def _fill(view, values):
    view[...] = values
    return view


def row_tensor(gen, rows: int, n: int, dtype: str, layout: str, values, lead: tuple | None = None):
    """A (rows, n) array in `layout` holding `values` (a GPU array of that
    shape), shaped lead + (n,) when `lead` is given (`Case.lead`). The rest
    of its buffer is NaN: a kernel that reads past a row's ends and lets
    those lanes in cannot pass."""
    import cupy

    dt = dtypes.numpy_dtype(dtype)
    shape = (lead or (rows,)) + (n,)
    if layout == "qkv":
        if lead is None or len(lead) != 3:
            raise ValueError("layout: qkv needs a case with heads")
        b, s, h = lead
        buf = cupy.full((b, s + 1, 3, h, n), np.nan, dtype=dt)
        return _fill(buf[:, :s, 1], values.reshape(shape))
    if layout == "contiguous":
        return values.astype(dt).reshape(shape)
    kind, k = layout.split(":")
    k = int(k)
    if kind == "offset":
        buf = cupy.full(rows * n + k, np.nan, dtype=dt)
        return _fill(buf[k:].reshape(rows, n), values).reshape(shape)
    if kind == "stride":
        buf = cupy.full((rows, n + k), np.nan, dtype=dt)
        return _fill(buf[:, :n], values).reshape(shape)
    raise ValueError(f"layout: unknown {layout!r}; expected one of {', '.join(LAYOUTS)}")


def weight_vector(n: int, dtype: str, layout: str, values, heads: int = 0):
    """A weight of length n in `layout` (broadcast: the first value everywhere, stride 0); with `heads`, a
    weight per head, [heads, n] (`values` of that shape; contiguous, or "strided": every other column)."""
    import cupy

    dt = dtypes.numpy_dtype(dtype)
    if heads:
        if layout == "strided":
            buf = cupy.full((heads, 2 * n), np.nan, dtype=dt)
            return _fill(buf[:, ::2], values)
        return values.astype(dt)
    if layout == "contiguous":
        return values.astype(dt)
    if layout == "broadcast":
        return cupy.broadcast_to(values[:1].astype(dt), (n,))
    if layout == "strided":
        buf = cupy.full(2 * n, np.nan, dtype=dt)
        return _fill(buf[::2], values)
    if layout == "offset":
        buf = cupy.full(n + 1, np.nan, dtype=dt)
        return _fill(buf[1:], values)
    raise ValueError(f"weight_layout: unknown {layout!r}; expected one of {', '.join(WEIGHT_LAYOUTS)}")


def _inputs(case: Case, rng):
    """x (rows far from zero mean), weight, bias, residual for a case."""
    m, n = case.rows, case.hidden_size
    g = _gpu_rng(rng)
    sign = g.randint(0, 2, size=(m, 1)) * 2.0 - 1.0
    shift = sign * g.uniform(1, 3, size=(m, 1))  # rows far from zero mean
    xv = standard_normal(g, (m, n), case.dtype) * float(rng.uniform(0.5, 2.0)) + shift
    x = row_tensor(g, m, n, case.dtype, case.layout, xv, _lead(case))
    wshape = (case.heads, n) if case.per_head else n
    heads = case.heads if case.per_head else 0
    w = (weight_vector(n, case.weight_dtype, case.weight_layout,
                       (1.0 + 0.5 * standard_normal(g, wshape, case.weight_dtype)) * (0.5 if case.zero_centered else 1.0),
                       heads)
         if case.has_weight else None)
    bdt = case.bias_dtype or case.weight_dtype
    b = (weight_vector(n, bdt, case.bias_layout or case.weight_layout, 0.5 * standard_normal(g, wshape, bdt), heads)
         if case.has_bias else None)
    r = None
    if case.residual_dtype is not None and not case.backward:
        r = row_tensor(g, m, n, case.residual_dtype, case.layout_of("residual"),
                       standard_normal(g, (m, n), case.residual_dtype), _lead(case))
    return x, w, b, r


def _traits_of(case: Case) -> dict | None:
    """The `traits=` a case forces (its knobs), or None: dispatch's choice."""
    return None if case.knobs is None else dict(case.knobs)


def _given_out(case: Case, dtype: str):
    """The `out=` a case passes when it names an out_layout: NaN everywhere, so
    an element the op leaves unwritten cannot pass."""
    import cupy

    if case.out_layout is None:
        return None
    m, n = case.rows, case.hidden_size
    return row_tensor(None, m, n, dtype, case.out_layout, cupy.full((m, n), np.nan, dtype=np.float32), _lead(case))


def case_kernels(cases, arch: int, spills=None, gpu=None):
    """(traits, origin) of every distinct kernel the cases run on `arch`, in
    order; a ValueError (origin "unsupported") stands in for a case with no
    legal traits there. attention_delta cases count both its aligned and its
    narrowest (offset view) kernels. `spills(traits)`, when given, says
    whether traits compile with spills: a tuned entry or an unstaged forward
    that does is replaced by dispatch.fallback's pick, as the GPU path
    replaces it (`plan._plan`). `gpu`
    (cunorm.tables.GPU): the GPU model whose tuned tables the calls consult."""
    from .attention_delta import heuristic as delta_heuristic

    seen = set()
    for case in cases:
        if case.op == "attention_delta":
            found = [(delta_heuristic(case.hidden_size, case.dtype, case.weight_dtype, cap), "heuristic")
                     for cap in (16, 1)]
        else:
            try:
                call = case_call(case)
                if case.knobs is not None:  # forced: no spill fallback (the op runs them as given)
                    t = dispatch.from_knobs(dict(case.knobs), **call)
                    t.check_arch(arch)
                    found = [(t, "caller")]
                else:
                    found = [dispatch.choose(arch=arch, gpu=gpu, **call)]
            except ValueError as e:
                yield e, "unsupported"
                continue
            if spills is not None and dispatch.may_fall_back(*found[0]) and spills(found[0][0]):
                found = [(dispatch.fallback(arch, **call), "heuristic (the pick spills)")]
            traits, origin = found[0]
            if one_launch(traits, case.rows):  # small backwards run the one-launch variant, unless it spills
                fused = traits.replace(grid_finalize=True)
                if spills is None or not spills(fused):
                    found.append((fused, origin))
        for traits, origin in found:
            if traits not in seen:
                seen.add(traits)
                yield traits, origin


def source_ops(text: str) -> tuple:
    """The norm ops an edited kernel file serves, from the kernels it defines
    (norm_fwd: the forwards; norm_bwd: the backwards); ValueError otherwise."""
    from .source import defined_kernels

    kernels = defined_kernels(text)
    if "norm_fwd" in kernels:
        return ("layer_norm", "rms_norm")
    if "norm_bwd" in kernels:
        return ("layer_norm_backward", "rms_norm_backward")
    raise ValueError(f"source: defines neither norm_fwd nor norm_bwd (found {sorted(kernels) or 'no kernels'}); "
                     f"pass an edited copy of kernels/norm_fwd.cu or kernels/norm_bwd.cu")


def precompile(cases, device_id: int | None = None, workers: int = 16, source: str | None = None) -> int:
    """Compiles every distinct kernel the cases run, in parallel threads (the
    compile cache is thread-safe), so that running them is not compile-bound.
    Returns how many traits were compiled; cases with no legal traits are left
    to raise when run."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy

    from .compiler import device_arch, device_gpu, kernels_for

    dev = cupy.cuda.Device().id if device_id is None else device_id
    wanted = [t for t, source in case_kernels(cases, device_arch(dev), gpu=device_gpu(dev)) if source != "unsupported"]

    def build(t):
        with cupy.cuda.Device(dev):
            kernels_for(t, dev, source)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(build, wanted))
    return len(wanted)


def run_case(case: Case, rng=None, source: str | None = None) -> list:
    """Runs one case on the current GPU; a Result per output. `source`: an
    edited kernel file the norm op compiles in place of the shipped one."""
    from .attention_delta import attention_delta

    rng = rng or np.random.default_rng()
    if case.op == "attention_delta":
        o, go = delta_inputs(_gpu_rng(rng), case.rows, case.hidden_size, case.dtype, case.weight_dtype)
        with poisoned_allocations():
            d = attention_delta(o, go)
        tol = delta_tolerance(case.dtype, case.weight_dtype)
        return [Result(case, "delta", rel_l2(d, reference.attention_delta(o, go), delta_scale(o, go)), tol)]
    if case.op not in NORM_OPS:
        raise ValueError(f"unknown op {case.op!r}")
    return (_run_backward if case.backward else _run_forward)(case, rng, source)


def _run_forward(case: Case, rng, source=None) -> list:
    from .norm import layer_norm, rms_norm

    x, w, b, r = _inputs(case, rng)
    eps = 1e-5
    branch = _branch_inputs(case, x, rng)
    par = _parallel_inputs(case, rng, branch)
    x0 = x if branch is None else branch["x0"]
    h = reference.add_residual(x0 if par is None or par["x1_0"] is None else x0 + par["x1_0"], r)
    zc = case.zero_centered
    if case.rms:
        y_ref, rstd_ref = reference.rms_norm(h, w, eps, bias=b, zero_centered_weight=zc)
        y1_ref = None if par is None or par["w1"] is None else reference.rms_norm(
            h, par["w1"], eps, bias=par["b1"], zero_centered_weight=zc)[0]
        stats_ref = [("rstd", rstd_ref)]
    else:
        y_ref, mean_ref, rstd_ref = reference.layer_norm(h, w, b, eps, zero_centered_weight=zc)
        y1_ref = None if par is None or par["w1"] is None else reference.layer_norm(
            h, par["w1"], par["b1"], eps, zero_centered_weight=zc)[0]
        stats_ref = [("mean", mean_ref), ("rstd", rstd_ref)]
    fp8 = case.scaling is not None
    kwargs = dict(residual=r, zero_centered_weight=zc, return_stats=True, out_dtype=case.out_dtype,
                  out=x if case.in_place else (None if fp8 else _given_out(case, case.out_dtype or case.dtype)),
                  source=source, traits=_traits_of(case))
    if r is not None and case.residual_out_dtype is not None:
        kwargs["residual_dtype"] = case.residual_out_dtype
    if branch is not None:
        kwargs.update(branch["kwargs"], return_dropout_mask=case.dropout_p > 0)
    if par is not None:
        kwargs.update(x1=par["x1"], weight1=par["w1"], bias1=par["b1"])
    if fp8:
        kwargs.update(scaling=case.scaling, return_amax=case.return_amax)
        if case.scaling == "tensor":  # saturates some values: up to 1.5x the range's worth of |y| past it
            top = float(abs(y_ref).max()) / reference.FP8_MAX[case.out_dtype]
            kwargs["scale"] = cupy_array([top * float(rng.uniform(0.6, 1.2))], "float32")
    with poisoned_allocations():
        got = rms_norm(x, w, eps, bias=b, **kwargs) if case.rms else layer_norm(x, w, b, eps, **kwargs)
    got = list(got)
    y = got.pop(0)
    if fp8:
        return _fp8_results(case, y, y_ref, got, kwargs.get("scale"), h, stats_ref)
    results = [Result(case, "y", rel_l2(y, y_ref), tolerance(case.out_dtype or case.dtype, case.dtype))]
    if case.in_place and y is not x:
        results.append(Result(case, "y is x", float("inf"), 0.0))
    results += _untouched_outside(case, kwargs["out"])
    if kwargs["out"] is not None and y is not kwargs["out"]:
        results.append(Result(case, "y is out", float("inf"), 0.0))
    if y1_ref is not None:
        results.append(Result(case, "y1", rel_l2(got.pop(0), y1_ref), tolerance(case.out_dtype or case.dtype,
                                                                                 case.dtype)))
    if r is not None or branch is not None or case.x1_dtype is not None:
        ro_dtype = case.residual_out_dtype or case.residual_dtype or case.dtype
        ro = got.pop(0)
        results.append(Result(case, "residual_out", rel_l2(ro, h), tolerance(ro_dtype, case.dtype)))
        if dtypes.name_of(ro.dtype) != ro_dtype:
            results.append(Result(case, f"residual_out dtype {ro.dtype}", float("inf"), 0.0))
    if branch is not None and case.dropout_p > 0:  # the keep masks, bit for bit
        for name, want in (("keep mask", branch["keep"]), ("x1 keep mask", par and par["keep1"])):
            if want is None:
                continue
            keep = got.pop(0)
            wrong = float((keep != want).mean()) if keep.shape == want.shape else float("inf")
            results.append(Result(case, name, wrong, 0.0))
    stats_dtype = dtypes.compute_dtype(case.dtype)
    for (name, ref), value in zip(stats_ref, got):
        results.append(Result(case, name, rel_l2(value, ref), TOLERANCE[stats_dtype]))
        if dtypes.name_of(value.dtype) != stats_dtype:
            results.append(Result(case, f"{name} dtype {value.dtype}", float("inf"), 0.0))
    return results


def _branch_inputs(case: Case, x, rng):
    """None without dropout or a row scale; else the branch's op arguments (kwargs: dropout_p, a seed drawn
    from rng, rowscale), its float64 result x0 = x * rowscale * keep / (1 - p), and the keep mask (CuPy)."""
    import cupy

    if not case.dropout_p and case.rowscale_dtype is None:
        return None
    g = _gpu_rng(rng)
    rs = None
    if case.rowscale_dtype is not None:
        rs = (g.uniform(0.5, 2.0, case.lead)).astype(dtypes.numpy_dtype(case.rowscale_dtype))
    seed = int(rng.integers(2**63)) * 2 + 1 if case.dropout_p else None  # high key bits set
    x0 = reference._f64(x)
    if rs is not None:
        x0 = x0 * reference._f64(rs)[..., None]
    keep = None
    if case.dropout_p:
        keep = cupy.asarray(reference.dropout_keep(x.shape, case.dropout_p, seed))
        x0 = _dropped(x0, keep, case.dropout_p)
    return {"kwargs": dict(dropout_p=case.dropout_p, seed=seed, rowscale=rs), "x0": x0, "keep": keep, "rs": rs}


def _dropped(a, keep, p: float):
    """a * keep / (1 - p) (float64, CuPy): a branch after dropout."""
    import cupy

    return cupy.where(keep, a / (1.0 - p), 0.0)


def _parallel_inputs(case: Case, rng, branch):
    """None without the parallel block; else x1 (contiguous, its dtype) and its float64 branch (x1_0: x1 *
    keep1 / (1 - p), keep1 drawn from the branch's seed, stream 1), weight1 and bias1 (or None)."""
    import cupy

    if case.x1_dtype is None and case.weight1_dtype is None:
        return None
    g = _gpu_rng(rng)
    m, n = case.rows, case.hidden_size
    x1 = x1_0 = keep1 = None
    if case.x1_dtype is not None and not case.backward:
        x1 = row_tensor(g, m, n, case.x1_dtype, "contiguous", standard_normal(g, (m, n), case.x1_dtype), _lead(case))
        x1_0 = reference._f64(x1)
    if case.x1_dtype is not None and case.dropout_p:
        seed = branch["kwargs"]["seed"]
        keep1 = cupy.asarray(reference.dropout_keep((*case.lead, n), case.dropout_p, seed, stream=1))
        if x1_0 is not None:
            x1_0 = _dropped(x1_0, keep1, case.dropout_p)
    w1 = b1 = None
    if case.weight1_dtype is not None:
        w1 = weight_vector(n, case.weight1_dtype, "contiguous", 1.0 + 0.5 * standard_normal(g, n, case.weight1_dtype))
        if case.bias1_dtype is not None:
            b1 = weight_vector(n, case.bias1_dtype, "contiguous", 0.5 * standard_normal(g, n, case.bias1_dtype))
    return {"x1": x1, "x1_0": x1_0, "keep1": keep1, "w1": w1, "b1": b1}


def _grad_names(names: tuple, branch, case: Case) -> tuple:
    """A backward's result names: dx0 follows dx after a branch (dropout, a row scale), then dx1 (x1's);
    the second weight's gradients come last (dbias1 as dbias: RMSNorm's only with a bias)."""
    lead = (names[0],) + (("dx0",) if branch is not None else ()) + (("dx1",) if case.x1_dtype else ())
    tail = ()
    if case.weight1_dtype is not None:
        tail = ("dweight1", "dbias1")[:2 if case.bias1_dtype is not None or not case.rms else 1]
    return lead + names[1:] + tail


def _untouched_outside(case: Case, out) -> list:
    """For a given out= in the qkv layout (a slot of a NaN-filled fused buffer): a failing Result where the op
    wrote anything outside the view."""
    import cupy

    if out is None or case.in_place or case.out_layout != "qkv":
        return []
    probe = out.base.copy()
    probe[:, :out.shape[1], 1] = cupy.nan
    return [] if bool(cupy.isnan(probe).all()) else [Result(case, "writes outside out's view", float("inf"), 0.0)]


# fp32 y carries an absolute error of a few ulps of the row's largest terms; scaled to the fp8 range that is
# about FP8_MAX * 2^-20, which near zero exceeds the fp8 grid's spacing (subnormals): the unit there instead.
FP8_FLOOR = 2.0 ** -18
FP8_BITWISE_SHARE = 1e-3  # the share of fp8 elements allowed to differ in their bits from the reference's


def fp8_ulps(got, want, fmt: str) -> float:
    """The largest difference between two fp8 arrays (numpy, ml_dtypes) in units of the format's spacing at
    the larger magnitude of each pair, or of FP8_FLOOR x the format's largest value where that is coarser
    (values near zero, where the fp32 y's rounding outweighs the grid); NaN where one is NaN and the other is
    not, 0 where both are."""
    from .reference import FP8_MAX

    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if (nan_a != nan_b).any():
        return float("nan")
    a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
    man, min_normal = (3, 2.0 ** -6) if FP8_MAX[fmt] == 448.0 else (2, 2.0 ** -14)
    m = np.maximum(np.maximum(abs(a), abs(b)), min_normal)
    spacing = np.maximum(2.0 ** (np.floor(np.log2(m)) - man), FP8_FLOOR * FP8_MAX[fmt])
    return float((abs(a - b) / spacing).max(initial=0.0))


def cupy_array(values, dtype: str):
    import cupy

    return cupy.asarray(np.asarray(values, dtype=dtype))


def _fp8_results(case: Case, y, y_ref, got: list, scale, h, stats_ref) -> list:
    """An fp8 forward's results: y within one step of the fp8 grid of the float64 reference quantized as the
    kernels quantize (bitwise where the fp32 values agree), its scales and amax to fp32 accuracy, then
    residual_out and the statistics as usual."""
    import cupy

    q_ref, scales_ref, amax_ref = reference.quantize_fp8(cupy.asnumpy(y_ref), case.out_dtype, case.scaling,
                                                         None if scale is None else cupy.asnumpy(scale))
    host = cupy.asnumpy(y).view(dtypes.numpy_dtype(case.out_dtype))  # CuPy: uint8 bits
    results = [Result(case, "y (fp8 steps)", fp8_ulps(host, q_ref, case.out_dtype), 1.0)]
    # Bitwise where the fp32 values agree: only values within fp32 rounding of a rounding boundary may differ
    # (a truncating or otherwise misrounding kernel differs in a large share of the elements).
    same = (host.view(np.uint8) == q_ref.view(np.uint8)) | (np.isnan(host.astype(np.float32))
                                                          & np.isnan(q_ref.astype(np.float32)))
    results.append(Result(case, "y share not bitwise equal", float(1.0 - same.mean()), FP8_BITWISE_SHARE))
    if host.shape != tuple(y_ref.shape):
        results.append(Result(case, f"y shape {host.shape}", float("inf"), 0.0))
    if case.residual_dtype is not None:
        results.append(Result(case, "residual_out", rel_l2(got.pop(0), h),
                              tolerance(case.residual_out_dtype or case.residual_dtype, case.dtype)))
    if scales_ref is not None:
        results.append(Result(case, "scales", rel_l2(got.pop(0), cupy.asarray(scales_ref)), TOLERANCE["float32"]))
    if case.return_amax:
        results.append(Result(case, "amax", rel_l2(got.pop(0), cupy.asarray(amax_ref)), TOLERANCE["float32"]))
    for (name, ref), value in zip(stats_ref, got):
        results.append(Result(case, name, rel_l2(value, ref), TOLERANCE["float32"]))
    return results


def dx_scale_of(dy, w, zero_centered: bool, rstd) -> float:
    """||rstd * g||, the size of the terms dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    is made of. Nearly degenerate rows (N = 2: dx ~ eps / var) cancel far below
    it, where fp32 is accurate relative to the terms, not to dx. numpy or CuPy."""
    weight = reference._effective_weight(w, zero_centered)
    g = reference._f64(dy) * (weight if weight is not None else 1.0)
    terms = g * reference._f64(rstd)[..., None]
    return float((terms * terms).sum() ** 0.5)


def _as_given(stats, dtype: str):
    """A forward's float64 statistics as the backward under test is given them: rounded to `dtype` (what a
    forward returns), back in float64 for the reference, which then differentiates at the op's own inputs.
    An fp32 mean is off by up to half an ulp of |mean|; beside a row's tiny spread (N = 2, two nearly equal
    values) the exact statistics would count that error of the inputs as the kernel's (dx 1.9e-5 against
    1e-5 in 5% of fresh draws of such a case)."""
    return stats.astype(dtype).astype(np.float64)  # numpy or CuPy, as the reference made them


def _run_backward(case: Case, rng, source=None) -> list:
    import cupy

    from .norm import layer_norm_backward, rms_norm_backward

    x, w, b, _ = _inputs(case, rng)
    g = _gpu_rng(rng)
    m, n = case.rows, case.hidden_size
    dy = row_tensor(g, m, n, case.out_dtype or case.dtype, case.layout_of("dy"),
                    standard_normal(g, (m, n), case.out_dtype or case.dtype), _lead(case))
    dres = None
    if case.residual_dtype is not None:
        dres = row_tensor(g, m, n, case.residual_dtype, case.layout_of("residual"),
                          standard_normal(g, (m, n), case.residual_dtype), _lead(case))
    stats_dtype = dtypes.compute_dtype(case.dtype)  # what the forward returns the statistics in
    zc = case.zero_centered
    eps = 1e-5
    kwargs = dict(dresidual=dres, zero_centered_weight=zc, out=dy if case.in_place else _given_out(case, case.dtype),
                  source=source, traits=_traits_of(case))
    branch = _branch_inputs(case, x, rng)  # x stands for h here: the mask and row scale act on dx0 alone
    if branch is not None:
        kwargs.update(branch["kwargs"])
    par = _parallel_inputs(case, rng, branch)
    dy1 = None
    if par is not None:
        kwargs["has_x1"] = case.x1_dtype is not None
        if par["w1"] is not None:
            dy1 = row_tensor(g, m, n, case.out_dtype or case.dtype, "contiguous",
                             standard_normal(g, (m, n), case.out_dtype or case.dtype), _lead(case))
            kwargs.update(dy1=dy1, weight1=par["w1"], has_bias1=par["b1"] is not None, bias1_dtype=case.bias1_dtype)
    if case.from_output:
        # The op's inputs: y from the float64 forward in x's dtype and layout, its statistics rounded; the
        # reference is the float64 backward of those very inputs.
        fwd = (reference.rms_norm(x, w, eps, bias=b, zero_centered_weight=zc) if case.rms else
               reference.layer_norm(x, w, b, eps, zero_centered_weight=zc))
        y = row_tensor(g, m, n, case.dtype, case.layout, cupy.asarray(fwd[0]).reshape(m, n), _lead(case))
        rstd = cupy.asarray(fwd[-1], dtype=stats_dtype)
        refs = reference.norm_backward_from_output(dy, y, rstd, w, b, rms=case.rms, dresidual=dres,
                                                   zero_centered_weight=zc)
        dx_scale = dx_scale_of(dy, w, zc, rstd)
        op = rms_norm_backward if case.rms else layer_norm_backward
        with poisoned_allocations():
            got = op(dy, rstd=rstd, weight=w, y=y, bias=b, **kwargs)
        names = _grad_names(("dx", "dweight", "dbias")[:3 if case.has_bias or not case.rms else 2], branch, case)
        if len(got) != len(names):
            return [Result(case, f"{len(got)} results, not {len(names)}", float("inf"), 0.0)]
    elif case.rms:
        _, rstd64 = reference.rms_norm(x, w, eps, zero_centered_weight=zc)
        rstd64 = _as_given(rstd64, stats_dtype)
        rstd = cupy.asarray(rstd64, dtype=stats_dtype)
        refs = (*reference.rms_norm_backward(dy, x, rstd64, w, dresidual=dres, zero_centered_weight=zc),
                reference.bias_grad(dy, w))
        dx_scale = dx_scale_of(dy, w, zc, rstd)  # before the call: dx may be written over dy
        with poisoned_allocations():
            got = rms_norm_backward(dy, x, rstd, w, has_bias=case.has_bias, bias_dtype=case.bias_dtype, **kwargs)
        names = _grad_names(("dx", "dweight", "dbias")[:3 if case.has_bias else 2], branch, case)
        if len(got) != len(names):
            return [Result(case, f"{len(got)} results, not {len(names)}", float("inf"), 0.0)]
    else:
        _, mean64, rstd64 = reference.layer_norm(x, w, None, eps, zero_centered_weight=zc)
        mean64, rstd64 = _as_given(mean64, stats_dtype), _as_given(rstd64, stats_dtype)
        mean, rstd = cupy.asarray(mean64, dtype=stats_dtype), cupy.asarray(rstd64, dtype=stats_dtype)
        refs = reference.layer_norm_backward(dy, x, mean64, rstd64, w, dresidual=dres, zero_centered_weight=zc)
        dx_scale = dx_scale_of(dy, w, zc, rstd)  # before the call: dx may be written over dy
        with poisoned_allocations():
            got = layer_norm_backward(dy, x, mean, rstd, w, has_bias=case.has_bias, bias_dtype=case.bias_dtype,
                                      **kwargs)
        names = _grad_names(("dx", "dweight", "dbias"), branch, case)
    tol = {"dx": tolerance(case.dtype, case.dtype), "dweight": tolerance(case.weight_dtype, case.dtype),
           "dbias": tolerance(case.bias_dtype or case.weight_dtype, case.dtype),
           "dx0": tolerance(case.dtype, case.dtype), "dx1": tolerance(case.dtype, case.dtype)}
    if len(got) != len(names):
        return [Result(case, f"{len(got)} results, not {len(names)}", float("inf"), 0.0)]
    ref_of = dict(zip(("dx", "dweight", "dbias"), refs))
    if dy1 is not None:  # the second output's gradient joins g: the float64 backward of both, from the same xhat
        # The statistics each reference above takes: the op's (from y), or the exact ones.
        src, stats = (y, (rstd,)) if case.from_output else (x, (rstd64,) if case.rms else (rstd64, mean64))
        xhat = reference.recovered_xhat(src, stats[0], stats[1] if len(stats) > 1 else None, weight=w, bias=b,
                                        from_output=case.from_output, zero_centered_weight=zc)
        dx, dw, db, dw1, db1 = reference.parallel_backward(dy, dy1, xhat, stats[0], w, par["w1"], rms=case.rms,
                                                           dresidual=dres, zero_centered_weight=zc)
        ref_of.update(dx=dx, dweight=dw, dbias=db, dweight1=dw1, dbias1=db1)
        tol.update(dweight1=tolerance(case.weight1_dtype, case.dtype),
                   dbias1=tolerance(case.bias1_dtype or case.weight1_dtype, case.dtype))
        dx_scale = (dx_scale ** 2 + dx_scale_of(dy1, par["w1"], zc, rstd) ** 2) ** 0.5
    dx0_scale = 0.0
    if branch is not None:  # dx0 after dx: dx * keep / (1 - p) * rowscale (up to 2 here)
        dx0_scale = dx_scale / (1.0 - case.dropout_p) * (2.0 if branch["rs"] is not None else 1.0)
        ref_of["dx0"] = reference.branch_grad(ref_of["dx"], branch["keep"], case.dropout_p, branch["rs"])
    if case.x1_dtype is not None:  # x1's gradient: dx under its own mask, or dx itself without dropout
        ref_of["dx1"] = (reference.branch_grad(ref_of["dx"], par["keep1"], case.dropout_p) if case.dropout_p
                         else ref_of["dx"])
        if not case.dropout_p and got[names.index("dx1")] is not got[0]:
            return [Result(case, "dx1 is not dx (no dropout)", float("inf"), 0.0)]
    results = []
    for name, value in zip(names, got):
        ref = ref_of[name]
        present = {"dweight": case.has_weight, "dbias": case.has_bias,
                   "dbias1": case.bias1_dtype is not None}.get(name, True)
        if not present:
            if value is not None:
                results.append(Result(case, f"{name} (absent)", float("inf"), 0.0))
            continue
        floor = {"dx": dx_scale, "dx0": dx0_scale, "dx1": dx0_scale or dx_scale}.get(name, 0.0)
        results.append(Result(case, name, rel_l2(value, ref, floor), tol[name]))
    if case.in_place and got[0] is not dy:
        results.append(Result(case, "dx is dy", float("inf"), 0.0))
    results += _untouched_outside(case, kwargs["out"])
    if kwargs["out"] is not None and got[0] is not kwargs["out"]:
        results.append(Result(case, "dx is out", float("inf"), 0.0))
    return results
