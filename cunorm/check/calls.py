"""What a case runs, derived without a GPU: its dispatch call (dtypes, flags and the vector widths its
layout allows), the distinct kernels of a list of cases, and compiling them ahead of the runs."""
from __future__ import annotations

import math

from .. import dispatch, dtypes
from ..norm.plans import one_launch
from ..sweeps import Case


def _layout_rows(name: str, layout_name: str, rows: int, n: int):
    """The row view (no array) of a tensor in checker layout `layout_name`."""
    from .. import layout

    kind, _, k = layout_name.partition(":")
    offset, ld = (int(k), n) if kind == "offset" else (0, n + int(k)) if kind == "stride" else (0, n)
    return layout.Rows(name, None, rows, ld, offset)


def _layout_tensor(layout_name: str, lead: tuple, n: int, dtype: str):
    """A stand-in (no memory) of a row tensor in checker layout `layout_name`
    with leading shape `lead`: its pointer (from an aligned buffer) and strides."""
    from ..kinds import Tensor

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


def case_call(case: Case) -> dict:
    """The dispatch call a norm case makes, derived without a GPU: the case's
    dtypes and flags, and the vector widths its layout allows (each row tensor
    in its own layout, beside fresh, contiguous outputs)."""
    from .. import layout, norm

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


def case_kernels(cases, arch: int, spills=None, gpu=None):
    """(traits, origin) of every distinct kernel the cases run on `arch`, in
    order; a ValueError (origin "unsupported") stands in for a case with no
    legal traits there. attention_delta cases count both its aligned and its
    narrowest (offset view) kernels. `spills(traits)`, when given, says
    whether traits compile with spills: a tuned entry or an unstaged forward
    that does is replaced as the GPU path replaces it (`dispatch.what_runs`,
    `plan._plan`). `gpu`
    (cunorm.tables.GPU): the GPU model whose tuned tables the calls consult."""
    from ..attention_delta import heuristic as delta_heuristic

    seen = set()
    for case in cases:
        if case.op == "attention_delta":
            try:
                found = [(delta_heuristic(case.hidden_size, case.dtype, case.weight_dtype, cap), "heuristic")
                         for cap in (16, 1)]
            except ValueError as e:  # a head dim the op refuses for these dtypes (it raises too)
                yield e, "unsupported"
                continue
        else:
            try:  # a ValueError anywhere in choosing, the spill fallback's too, is the op's refusal as well
                call = case_call(case)
                if case.knobs is not None:  # forced: no spill fallback (the op runs them as given)
                    t = dispatch.from_knobs(dict(case.knobs), **call)
                    t.check_arch(arch)
                    found = [(t, dispatch.CALLER)]
                elif spills is None:
                    found = [dispatch.choose(arch=arch, gpu=gpu, **call)]
                else:
                    found = [dispatch.what_runs(arch, spills, gpu, **call)]
            except ValueError as e:
                yield e, "unsupported"
                continue
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
    from ..source import defined_kernels

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

    from ..compiler import device_arch, device_gpu, kernels_for

    dev = cupy.cuda.Device().id if device_id is None else device_id
    wanted = [t for t, source in case_kernels(cases, device_arch(dev), gpu=device_gpu(dev)) if source != "unsupported"]

    def build(t):
        with cupy.cuda.Device(dev):
            kernels_for(t, dev, source)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(build, wanted))
    return len(wanted)
