"""Running a case on the GPU: the op on fresh inputs, every output against the float64 reference; and the tuner's
check of a winner's forced knobs (check_knobs)."""
from __future__ import annotations

import numpy as np

from .. import dtypes, reference
from ..sweeps import DEFAULT_ROWS, NORM_OPS, Case
from .compare import (FP8_BITWISE_SHARE, TOLERANCE, Result, delta_scale, delta_tolerance, dx_scale_of, fp8_ulps,
                      rel_l2, tolerance)
from .inputs import (_branch_inputs, _given_out, _gpu_rng, _inputs, _lead, _parallel_inputs, _traits_of, cupy_array,
                     delta_inputs, poisoned_allocations, row_tensor, standard_normal)

CHECK_ELEMENTS = 2**24  # check_knobs' rows (DEFAULT_ROWS) are capped at this many elements


def run_case(case: Case, rng=None, source: str | None = None) -> list:
    """Runs one case on the current GPU; a Result per output. `source`: an
    edited kernel file the norm op compiles in place of the shipped one."""
    from ..attention_delta import attention_delta

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
    from ..norm import layer_norm, rms_norm

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


def _as_given(stats, dtype: str):
    """A forward's float64 statistics as the backward under test is given them: rounded to `dtype` (what a
    forward returns), back in float64 for the reference, which then differentiates at the op's own inputs
    (fp32 LayerNorm rows far from zero mean: at the mean the op refines from them, reference.backward_mean).
    An fp32 mean is off by up to half an ulp of |mean|; beside a row's tiny spread (N = 2, two nearly equal
    values) the exact statistics would count that error of the inputs as the kernel's (dx 1.9e-5 against
    1e-5 in 5% of fresh draws of such a case)."""
    return stats.astype(dtype).astype(np.float64)  # numpy or CuPy, as the reference made them


def _run_backward(case: Case, rng, source=None) -> list:
    import cupy

    from ..norm import layer_norm_backward, rms_norm_backward

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
        # fp32 rows: the op takes the given mean's rounding off on rows far from zero mean (REFINE_MEAN),
        # which N = 2 rows of two nearly equal values are; the reference differentiates where the op does.
        mean64 = reference.backward_mean(x, mean64, rstd64, input_dtype=case.dtype)
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
        # The statistics each reference above takes: the op's (from y), or the given ones (refined as the op
        # refines them).
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


def check_knobs(job, knobs: dict, seed: int = 0, asarray=None) -> list:
    """What fails the float64 check when the op of `job` (a search_space.Job: key, dtype, n) runs with `knobs`
    forced, as the tuner checks its winner: a line per output beyond TOLERANCE (empty: it passes).
    run_case checks dispatch's own choice; this feeds inputs of the
    same kind (rows offset from zero, allocations poisoned with NaN) through
    `traits=` and compares with cunorm.reference, at the checker's row counts.
    `asarray` moves the host-drawn inputs to the op: cupy.asarray by default;
    numpy.asarray runs the op's numpy path."""
    from ..norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    if asarray is None:
        import cupy

        asarray = cupy.asarray
    k, n, eps = job.key, job.n, 1e-5
    gen = np.random.default_rng(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        wide = np.float64 if job.dtype == "float64" else np.float32  # fp64 inputs use all their bits
        return asarray((gen.standard_normal(shape, dtype=wide) * scale + shift).astype(
            dtypes.numpy_dtype(job.dtype)))

    failures = []
    for m in sorted({min(r, max(1, CHECK_ELEMENTS // n)) for r in DEFAULT_ROWS}):
        # Rows far from zero mean, so that a one-pass variance would show.
        x = draw(m, n, shift=gen.uniform(1, 3, (m, 1)).astype(np.float32))
        w, b = draw(n, scale=0.5, shift=1.0), None if k.rms else draw(n, scale=0.5)
        res = draw(m, n) if k.residual else None
        scales = {}
        if k.backward:
            dy = draw(m, n)
            stats = reference.rms_norm(x, w, eps)[1:] if k.rms else reference.layer_norm(x, w, None, eps)[1:]
            rounded = [asarray(s.astype(dtypes.compute_dtype(job.dtype))) for s in stats]  # as a forward returns
            with poisoned_allocations():
                got = (rms_norm_backward(dy, x, *rounded, w, dresidual=res, traits=knobs) if k.rms else
                       layer_norm_backward(dy, x, *rounded, w, dresidual=res, traits=knobs))
            refs = (reference.rms_norm_backward(dy, x, *stats, w, dresidual=res) if k.rms else
                    reference.layer_norm_backward(dy, x, *stats, w, dresidual=res))
            names = ("dx", "dweight", "dbias")
            # dx is a difference of terms of size |rstd * dy * w|: judged against them, as the checker does.
            scales["dx"] = dx_scale_of(dy, w, False, stats[-1])
        else:
            h = reference.add_residual(x, res)
            with poisoned_allocations():
                got = (rms_norm(x, w, eps, residual=res, return_stats=True, traits=knobs) if k.rms else
                       layer_norm(x, w, b, eps, residual=res, return_stats=True, traits=knobs))
            y, *stats = reference.rms_norm(h, w, eps) if k.rms else reference.layer_norm(h, w, b, eps)
            refs = (y, *([h] if k.residual else []), *stats)
            names = ("y", *(["residual_out"] if k.residual else []), *(["rstd"] if k.rms else ["mean", "rstd"]))
        for name, value, ref in zip(names, got, refs):
            tol = TOLERANCE[dtypes.compute_dtype(job.dtype)] if name in ("mean", "rstd") else tolerance(job.dtype,
                                                                                                       job.dtype)
            error = rel_l2(value, ref, scales.get(name, 0.0))
            if not error <= tol:  # NaN fails too
                failures.append(f"{name} at {m} rows: rel-L2 {error:.1e} > {tol:.0e}")
    return failures
