"""Planning a GPU normalization call: lay the arrays out as rows
(`cunorm.layout`), pick traits and compile (`cunorm.plan`), and pack the
launches into a `launch.CallPlan` that every later call with the same cache
key reuses."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import numpy as np

from .. import dispatch, dtypes, layout, plan, scratch
from ..launch import CallPlan, Launch, Output, span
from ..traits import Traits
from ..traits_rules import QUANT_GROUP_COLS
from .calls import BACKWARD, BRANCH_ARRAYS, FORWARD, Direction

MAX_GRID_CTAS = 2**31 - 1  # gridDim.x


class Family:
    """The normalization kernel family, for cunorm.plan."""

    traits_class = Traits

    @staticmethod
    def choose(arch: int, gpu=None, **call) -> Traits:
        return dispatch.choose(arch=arch, gpu=gpu, **call)[0]

    @staticmethod
    def from_knobs(knobs: dict, **call) -> Traits:
        return dispatch.from_knobs(knobs, **call)

    @staticmethod
    def what_runs(arch: int, spills, gpu=None, **call) -> Traits:
        """What runs a call, given `spills(traits)` (dispatch.what_runs)."""
        return dispatch.what_runs(arch, spills, gpu, **call)[0]


@dataclass
class Prepared:
    """A validated GPU call: its row tensors (outputs to be allocated stand in
    as fresh contiguous rows), the dispatch call and what explain reports."""

    base: dict
    rows: dict  # name -> layout.Rows (None: absent)
    n: int
    row_count: int
    in_place: dict = field(default_factory=dict)
    heads: int = 1  # x.shape[-2] where weights are per head

    def row_list(self) -> list:
        return [r for r in self.rows.values() if r is not None]

    def resolve(self, traits, device_id: int, source: str | None = None):
        return plan.resolve(Family, traits, self.base, device_id, source)

    def grid_groups(self, kernel, t: Traits, most: int | None = None, least: int = 1) -> int:
        """Row groups of the grid: of a persistent one, one wave of CTAs (at most `most`
        groups; at least `least` where there are fewer rows, the rest with
        none: a grid-finalize backward's sum), each walking many rows; a multiple of the shift period
        (general kernel), so that every row of a thread sits at the same
        offset from a vector boundary, and (backward with weights per head) of
        the heads, so that every row of a CTA row (warp_m) has the same head.
        Without `t.persistent`, a group a CTA, up to the grid's size limit."""
        groups = max(-(-self.row_count // t.rows_per_cta), least)
        resident = kernel.resident_clusters if t.persistent else MAX_GRID_CTAS // t.ctas_per_row
        groups = min(groups, resident, most or groups)  # a group is one cluster (CTAS_PER_ROW CTAs)
        x = self.rows["x"]
        period = 1 if t.aligned_rows else layout.shift_period(x.ld, x.rows, t.elts_per_ldg)
        if t.per_head and t.backward:
            period = math.lcm(period, self.heads)
        step = period // math.gcd(period, t.rows_per_cta)
        # Down to whole periods (CTAs left over would run as a second wave, doubling the time), or up to one.
        return max(step, groups // step * step)


# A backward of at most FUSE_ROW_ELEMENTS elements sums its partial rows itself (one cooperative launch, a
# grid-wide barrier between the rows and the sum; `Traits.grid_finalize`). Its grid has `fused_parts` partial
# rows, at least FUSE_LEAST_GROUPS CTAs where they fit (those past the rows add rows of zeros) so that the
# sum is spread wide. Measured on an H100 (bf16, N = 4096, kernel time; PERFORMANCE.md, version 28):
# within 0.8 µs of two launches up to 256 rows, LayerNorm 1.8-2.3 µs under them at 512-1024 (RMSNorm 1.2
# under, then 0.15 over), 7 µs over at 2048; and a launch less of host time per call. Larger calls keep
# norm_bwd_finalize, whose many CTAs pay for its launch.
FUSE_ROW_ELEMENTS = 1 << 22
FUSE_LEAST_GROUPS = 32


def fused_parts(t: Traits, row_count: int) -> tuple:
    """(wanted, fitting) partial rows of a one-launch backward. Wanted: about sqrt(16 * rows), a power of
    2, balancing the rows each CTA walks against the partial rows the grid sums (measured best at N = 4096:
    64 at 128-256 rows, 128 at 512-1024), at least FUSE_LEAST_GROUPS; at most the fitting ones, those whose
    sums fit the stream's block of working memory (scratch.ARENA_BYTES: a larger call would allocate, and
    clear its ticket, every time)."""
    quantities = 4 if t.parallel else 2
    fits = max(1, scratch.ARENA_BYTES // quantities // (dtypes.itemsize(t.compute_dtype) * t.hidden_size))
    wanted = max(FUSE_LEAST_GROUPS, 1 << math.ceil(math.log2(math.sqrt(16 * max(1, row_count)))))
    return min(wanted, fits), fits


def one_launch(t: Traits, row_count: int) -> bool:
    """Whether a backward of `row_count` rows with traits `t` sums its partial rows in its own launch."""
    return (t.backward and (t.has_weight or t.has_bias) and not t.uses_cluster
            and row_count * t.hidden_size <= FUSE_ROW_ELEMENTS)


def _grid_finalize(p: Prepared, t: Traits, device_id: int, source: str | None) -> tuple:
    """(traits, kernels) of the one-launch backward of this call, or (None, None) where it keeps the
    finalize kernel: large calls, clusters, an edited kernel file, a variant that spills."""
    if source is not None or not one_launch(t, p.row_count):
        return None, None
    fused = t.replace(grid_finalize=True)
    kernels = plan.kernels_for(fused, device_id)
    if kernels["norm_bwd"].local_bytes:
        return None, None
    return fused, kernels


# The per-call scalars of a forward call: eps as float32 bits and as float64 bits (`norm.eps_scalars`); a
# kernel takes eps in its compute type. With a branch, then the seed, the 32-bit dropout threshold and
# 1 / (1 - p) as float32 and float64 bits (`norm._branch_bits`).
EPS_SCALARS = ("eps", "eps64")
BRANCH_SCALARS = ("seed", "drop_threshold", "keep_scale", "keep_scale64")


def eps_slot(t: Traits) -> tuple:
    return ("f64", "eps64") if t.compute_dtype == "float64" else ("f32", "eps")


def _branch_slots(t: Traits) -> list:
    """The branch's kernel parameters both directions take: seed, threshold, keep scale (compute type),
    rowscale."""
    keep = ("f64", "keep_scale64") if t.compute_dtype == "float64" else ("f32", "keep_scale")
    return [("i64", "seed"), ("u32", "drop_threshold"), keep, ("ptr", "rowscale")]


F32 = np.dtype(np.float32)


def check_outputs(d: Direction, outputs: list, rows: dict, args: dict, n: int):
    """`layout.check_outputs` of given outputs (row views) against the row
    inputs' views `rows` and the weight-like arguments, in the direction's order."""
    weights = [w for w in (args.get(k) for k in d.weights) if w is not None]
    layout.check_outputs(outputs, [r for r in rows.values() if r is not None] + weights, n, d.in_place)


def prepare(d: Direction, args: dict, outputs: dict, base: dict) -> Prepared:
    """Row views of the inputs (copies for layouts the kernels cannot read),
    given outputs checked for overlap, the vector widths the layout allows.
    Row tensors whose leading axes need more than one row stride but share at
    most three are read in place through them (`layout.three_axis_rows`)."""
    n = base["hidden_size"]
    for k in d.weights:
        if args.get(k) is not None:
            layout.check_elements(args[k])
    rows, out_rows, three = _row_views(d, args, outputs, n, dtypes.itemsize(base["input_dtype"]))
    if three:
        base = dict(base, row_axes=3)
    check_outputs(d, [r for r in out_rows.values() if r.array is not None], rows, args, n)
    rows.update(out_rows)
    present = [r for r in rows.values() if r is not None]
    max_vector, aligned_vector = layout.vector_widths(present, n, dtypes.itemsize(base["input_dtype"]))
    base = dict(base, max_vector=max_vector, aligned_vector=aligned_vector)
    heads = args["x"].array.shape[-2] if base.get("per_head") else 1
    return Prepared(base, rows, n, rows["x"].rows, d.in_place, heads)


def _row_views(d: Direction, args: dict, outputs: dict, n: int, x_itemsize: int) -> tuple:
    """(row views of the row inputs, of the outputs (fresh ones where None
    is given), whether they run through three axes): one row stride per
    tensor where each has one (copies of inputs that have none), else the
    axes the call's row tensors share (`layout.three_axis_rows`)."""
    given = {name: a for name, a in outputs.items() if a is not None}
    laid = {name: args[name] for name in d.row_inputs if args.get(name) is not None} | given
    for a in laid.values():
        layout.check_elements(a)
    three = layout.three_axis_rows({name: a.array for name, a in laid.items()}, n, outputs=set(given))
    if three is not None:
        rows = {name: three.get(name) for name in d.row_inputs}
        out_rows = {name: three[name] if name in given else layout.fresh_three_axis_rows(name, rows["x"], n)
                    for name in outputs}
        return rows, out_rows, True
    rows = {name: None if args.get(name) is None else layout.rows_of(args[name], n) for name in d.row_inputs}
    offset = layout.mirrored_offset(rows["x"], x_itemsize)
    out_rows = {name: layout.rows_of(a, n, output=True) if a is not None else
                layout.fresh_rows(name, rows["x"].rows, n, offset) for name, a in outputs.items()}
    return rows, out_rows, False


def forward_prepare(args: dict, base: dict) -> Prepared:
    outputs = {"y" if args["out"] is None else "out": args["out"]}
    if base.get("weight1_dtype"):
        outputs["y1"] = None
    if (args["residual"] is not None or base.get("dropout") or base.get("rowscale_dtype")
            or base.get("x1_dtype")):
        outputs["residual_out"] = None  # h: with a residual, or after a branch or x1
    p = prepare(FORWARD, args, outputs, base)
    if base.get("quant") == "group" and not (p.base["aligned_vector"] == p.base["max_vector"]
                                             and p.base["aligned_vector"] >= 4):
        raise ValueError("scaling: 'group' reads rows in aligned vectors of >= 4 elements: x (and the residual) "
                         "must start on a 16-byte boundary with a row stride to match (pass a contiguous copy)")
    return p


def backward_prepare(args: dict, base: dict) -> Prepared:
    outputs = {"dx" if args["out"] is None else "out": args["out"]}
    if base.get("dx0_dtype"):  # after a branch: the branch input's gradient too
        outputs["dx0"] = None
    if base.get("dx1_dtype"):  # x1's gradient under dropout
        outputs["dx1"] = None
    return prepare(BACKWARD, args, outputs, base)


def _weight_layout(a, t: Traits) -> tuple:
    """(copied per call?, stride in elements, stride between heads) of a
    weight as the kernel reads it. The general kernel reads any non-negative
    stride (0 broadcasts one value) in place; the aligned kernel loads whole
    vectors, so a strided, broadcast or unaligned weight is copied for it
    (N elements, or [heads, N] per head; documented). A one-dimensional
    weight serves every head (stride 0 between heads)."""
    if a is None:
        return False, 0, 0
    w = a.array
    stride = w.strides[-1] // w.itemsize if w.shape[-1] > 1 else 1
    heads = w.shape[0] if w.ndim == 2 else 1
    head_stride = w.strides[0] // w.itemsize if heads > 1 else 0
    vector_bytes = min(16, t.elts_per_ldg * w.itemsize)
    if t.aligned_rows and (stride != 1 or w.ptr % vector_bytes or (head_stride * w.itemsize) % vector_bytes):
        return True, 1, w.shape[-1] if heads > 1 else 0
    return False, stride, head_stride


def _ld(r, t: Traits) -> tuple:
    """A row tensor's row-stride parameter: its row stride, or its three axes (RowAxes)."""
    if t.row_axes == 3:
        return ("axes", (0, 0, 0, 1, 1) if r is None else r.axes)
    return ("i64", 0 if r is None else r.ld)


def _overlap_check(d: Direction, n: int):
    """The exact `out=` overlap check of a first call, for a cached plan whose
    cheap extent test found an input's extent meeting out's."""
    from .. import arrays

    def check(objs: dict):
        taken = {name: None if o is None else arrays.take(o, name) for name, o in objs.items()}
        rows, out_rows, _ = _row_views(d, taken, {"out": taken["out"]}, n, taken["x"].array.itemsize)
        check_outputs(d, [out_rows["out"]], rows, taken, n)

    return check


def _spans(names: tuple, args: dict) -> dict:
    """Byte extents of the call's arrays named in `names` (what a cached call checks `out=` against)."""
    return {name: span(a.array.shape, a.array.strides, a.array.itemsize)
            for name, a in args.items() if a is not None and name in names}


def _absent(names: tuple, args: dict) -> tuple:
    """The call's arrays that are None: None in its cache key too, so their pointers are constants."""
    return tuple(name for name in names if args.get(name) is None)


def _like(name: str, a, shape: tuple, dtype, kind, offset: int = 0):
    """`name` (argument `a` in the plan's names) when an output of `shape` and `dtype` (at `offset`) may be
    allocated like it (`torch.empty_like`): of the plan's `kind` (arrays of several kinds may share a call),
    C-contiguous, the same shape and dtype, no offset; else None. The cache key holds a's kind, shape,
    strides and dtype, so this holds for every call of the plan."""
    if a is None or offset:
        return None
    t = a.array
    same = t.kind is kind and tuple(t.shape) == tuple(shape) and t.dtype == dtype and t.c_contiguous
    return name if same else None


def _picker(picks: list):
    """The result of a call from its outputs: picks are ("made", index) (an
    allocated output), ("arg", index) (a given `out=`) or None (an absent gradient)."""
    def one(pick):
        return None if pick is None else pick[0], None if pick is None else pick[1]

    picks = [one(p) for p in picks]
    if picks == [("made", 0)]:
        return None  # CallPlan: the call returns its first output
    if len(picks) == 1:
        src, i = picks[0]
        return (lambda objs, made: made[i]) if src == "made" else (lambda objs, made: objs[i])
    if all(src == "made" for src, _ in picks):  # the common case, at C speed
        get = operator.itemgetter(*(i for _, i in picks))
        return lambda objs, made: get(made)

    def result(objs, made):
        return tuple(None if src is None else made[i] if src == "made" else objs[i] for src, i in picks)

    return result


def forward_plan(args: dict, base: dict, traits, rms: bool, return_stats: bool, source: str | None = None,
                 extended: bool = False) -> tuple:
    """(CallPlan, Prepared) of a validated forward call on the GPU. `extended`: the call names the branch
    and parallel arrays (BRANCH_ARRAYS) after its direction's (as its cache key's values do)."""
    X, W, B, R, O = (args[k] for k in FORWARD.arrays[:5])
    x = X.array
    device = x.device_id
    p = forward_prepare(args, base)
    t, kernels = p.resolve(traits, device, source)
    shape, lead = tuple(x.shape), tuple(x.shape[:-1])
    y_row = p.rows["y" if O is None else "out"]
    outputs, picks = [], []
    if O is None:
        picks.append(("made", len(outputs)))
        y_dtype = dtypes.numpy_dtype(base["output_dtype"])
        like = _like("x", X, shape, y_dtype, X.array.kind, y_row.offset)
        outputs.append(Output("y", shape, y_dtype, y_row.offset, like))
    else:
        picks.append(("arg", FORWARD.arrays.index("out")))
    if t.parallel:  # y1, the second output
        picks.append(("made", len(outputs)))
        outputs.append(Output("y1", shape, dtypes.numpy_dtype(base["output_dtype"]), p.rows["y1"].offset))
    if t.stores_h:  # h
        picks.append(("made", len(outputs)))
        outputs.append(Output("residual_out", shape, dtypes.numpy_dtype(base["residual_out_dtype"]),
                              p.rows["residual_out"].offset))
    zeros = []
    if t.quant in ("row", "group"):  # fp8 y's scales
        picks.append(("made", len(outputs)))
        outputs.append(Output("scales", lead if t.quant == "row" else lead + (p.n // QUANT_GROUP_COLS,), F32))
    if t.amax:  # the call's largest |y|: atomically raised from 0
        picks.append(("made", len(outputs)))
        outputs.append(Output("amax", (), F32))
        zeros.append("amax")
    if t.dropout_mask:  # the keep mask (and x1's), a byte an element, row-major over x's shape
        for name in ("keep", "keep1") if t.x1_dtype is not None else ("keep",):
            picks.append(("made", len(outputs)))
            outputs.append(Output(name, shape, np.dtype(np.bool_)))
    if return_stats:
        stats_dtype = np.dtype(t.compute_dtype)
        for name in ("rstd",) if rms else ("mean", "rstd"):
            picks.append(("made", len(outputs)))
            outputs.append(Output(name, lead, stats_dtype))
    (copy_w, w_stride, w_heads), (copy_b, b_stride, b_heads) = _weight_layout(W, t), _weight_layout(B, t)
    (copy_w1, w1_stride, _), (copy_b1, b1_stride, _) = (_weight_layout(args.get(k), t) for k in ("weight1", "bias1"))
    copies = [name for name in FORWARD.row_inputs if p.rows[name] is not None and p.rows[name].copied]
    copies += ["weight"] * copy_w + ["bias"] * copy_b + ["weight1"] * copy_w1 + ["bias1"] * copy_b1
    launches = []
    if p.row_count:
        k = kernels["norm_fwd"]
        launches.append(Launch(k, p.grid_groups(k, t) * t.ctas_per_row, [
            ("ptr", "x"), ("ptr", "residual"), ("ptr", "weight"), ("ptr", "bias"), ("ptr", "y"),
            ("ptr", "residual_out"), ("ptr", "mean"), ("ptr", "rstd"), ("i64", p.row_count), _ld(p.rows["x"], t),
            _ld(p.rows["residual"], t), _ld(y_row, t), _ld(p.rows.get("residual_out"), t), ("i64", w_stride),
            ("i64", b_stride), eps_slot(t)] + ([("i64", p.heads), ("i64", w_heads), ("i64", b_heads)]
                                               if t.per_head else [])
            + ([("ptr", "scale"), ("ptr", "scales"), ("ptr", "amax")] if t.quant != "none" else [])
            + (_branch_slots(t) + [("ptr", "keep")] if t.branch else [])
            + ([("ptr", "x1"), _ld(p.rows["x1"], t), ("ptr", "keep1")] if t.x1_dtype is not None else [])
            + ([("ptr", "weight1"), ("ptr", "bias1"), ("ptr", "y1"), _ld(p.rows["y1"], t), ("i64", w1_stride),
                ("i64", b1_stride)] if t.parallel else [])))
    names = FORWARD.arrays + (BRANCH_ARRAYS["forward"] if extended else ())
    if t.branch and args["rowscale"] is not None and not args["rowscale"].array.c_contiguous:
        copies.append("rowscale")  # read by row number
    return CallPlan(x.kind, device, names, tuple(launches), outputs=outputs, copies=copies, zeros=zeros,
                    given_out=None if O is None else ("out", "y"), spans=_spans(names, args),
                    full_overlap_check=_overlap_check(FORWARD, p.n), aliases=FORWARD.in_place["out"],
                    scalars=EPS_SCALARS + (BRANCH_SCALARS if t.branch else ()), result=_picker(picks),
                    absent=_absent(names, args)), p


def backward_plan(args: dict, base: dict, traits, rms: bool, source: str | None = None, extended: bool = False,
                  has_x1: bool = False) -> tuple:
    """(CallPlan, Prepared) of a validated backward call on the GPU. `extended` as in `forward_plan`;
    `has_x1`: x1's gradient follows dx0 (dx itself without dropout)."""
    X, W, O = args["x"], args["weight"], args["out"]
    x = X.array
    device, n = x.device_id, base["hidden_size"]
    p = backward_prepare(args, base)
    t, kernels = p.resolve(traits, device, source)
    dx_row = p.rows["dx" if O is None else "out"]
    outputs, picks = [], []
    if O is None:
        picks.append(("made", 0))
        outputs.append(Output("dx", tuple(x.shape), x.dtype, dx_row.offset, _like("x", X, tuple(x.shape), x.dtype,
                                                                                  x.kind, dx_row.offset)))
    else:
        picks.append(("arg", BACKWARD.arrays.index("out")))
    if t.branch:  # dx0, the branch input's gradient, after dx
        picks.append(("made", len(outputs)))
        outputs.append(Output("dx0", tuple(x.shape), dtypes.numpy_dtype(t.dx0_dtype), p.rows["dx0"].offset))
    if t.dx1_dtype is not None:  # x1's gradient under dropout
        picks.append(("made", len(outputs)))
        outputs.append(Output("dx1", tuple(x.shape), dtypes.numpy_dtype(t.dx1_dtype), p.rows["dx1"].offset))
    elif has_x1:  # without dropout x1's gradient is dx itself
        picks.append(picks[0])
    # RMSNorm returns (dx, dweight), and dbias only when it had a bias; LayerNorm always (dx, dweight, dbias);
    # the second weight's likewise after them.
    grads = [("dweight", t.has_weight, base["weight_dtype"]),
             ("dbias", t.has_bias, base["bias_dtype"])][:1 if rms and not t.has_bias else 2]
    if t.parallel:
        has_b1 = t.bias1_dtype is not None
        grads += [("dweight1", True, t.weight1_dtype), ("dbias1", has_b1, t.bias1_dtype)][:1 if rms and not has_b1
                                                                                       else 2]
    for name, present, dtype in grads:
        picks.append(("made", len(outputs)) if present else None)
        if present:  # per head: [heads, N]
            g_shape, g_dtype = (p.heads, n) if t.per_head else (n,), dtypes.numpy_dtype(dtype)
            outputs.append(Output(name, g_shape, g_dtype, like=_like("weight", W, g_shape, g_dtype, x.kind)))
    copy_w, w_stride, w_heads = _weight_layout(W, t)
    B = args.get("bias")  # the forward's bias, read by the memory-efficient backward
    copy_b, b_stride, b_heads = _weight_layout(B, t)
    copies = [name for name in BACKWARD.row_inputs if p.rows[name] is not None and p.rows[name].copied]
    # mean and rstd are read by row number in the compute dtype: a strided view, or statistics of the other
    # float dtype, are copied (documented).
    stats_dtype = np.dtype(t.compute_dtype)
    for s in ("mean", "rstd"):
        a = None if args[s] is None else args[s].array
        if a is not None and (not a.c_contiguous or a.dtype != stats_dtype):
            copies.append(s if a.dtype == stats_dtype else (s, stats_dtype))
    copy_w1, w1_stride, _ = _weight_layout(args.get("weight1"), t)
    copies += ["weight"] * copy_w + ["bias"] * copy_b + ["weight1"] * copy_w1
    launches, scratch, zeros = [], [], []
    sums = t.has_weight or t.has_bias
    if p.row_count:
        rows_per_part = t.rows_per_cta if t.per_head else 1  # partial rows: per CTA row, or per CTA
        wanted, fits = fused_parts(t, p.row_count)
        most, least = max(1, wanted // rows_per_part), max(1, min(FUSE_LEAST_GROUPS, fits // rows_per_part))
        fused, fused_kernels = _grid_finalize(p, t, device, source)
        if fused is not None and p.grid_groups(fused_kernels["norm_bwd"], fused, most, least) > \
                fused_kernels["norm_bwd"].resident_clusters:  # whole periods or heads past one wave: not at once
            fused = None
        if fused is not None:
            t, kernels = fused, fused_kernels
        k = kernels["norm_bwd"]
        groups = p.grid_groups(k, t, most, least) if fused else p.grid_groups(k, t)
        parts = groups * rows_per_part
        if sums:  # column sums, one [parts, N] compute_t block each for dgamma and dbeta (and the second's)
            part_bytes = dtypes.itemsize(t.compute_dtype) * parts * n
            scratch += [("dgamma_part", part_bytes), ("dbeta_part", part_bytes)]
            if t.parallel:
                scratch += [("dgamma1_part", part_bytes), ("dbeta1_part", part_bytes)]
        launches.append(Launch(k, groups * t.ctas_per_row, [
            ("ptr", "dy"), ("ptr", "x"), ("ptr", "dresidual"), ("ptr", "mean"), ("ptr", "rstd"), ("ptr", "weight"),
            ("ptr", "dx"), ("ptr", "dgamma_part"), ("ptr", "dbeta_part"), ("i64", p.row_count),
            _ld(p.rows["x"], t), _ld(p.rows["dy"], t), _ld(p.rows["dresidual"], t), _ld(dx_row, t),
            ("i64", w_stride)] + ([("i64", p.heads), ("i64", w_heads)] if t.per_head else [])
            + ([("ptr", "bias"), ("i64", b_stride), ("i64", b_heads)] if t.from_output else [])
            + ([("ptr", "control"), ("i32", parts), ("ptr", "dweight"), ("ptr", "dbias")] if fused else [])
            + (_branch_slots(t) + [("ptr", "dx0"), _ld(p.rows["dx0"], t)] if t.branch else [])
            + ([("ptr", "dy1"), _ld(p.rows["dy1"], t), ("ptr", "weight1"), ("i64", w1_stride), ("ptr", "dgamma1_part"),
                ("ptr", "dbeta1_part")] + ([("ptr", "dweight1"), ("ptr", "dbias1")] if fused else [])
               if t.parallel else [])
            + ([("ptr", "dx1"), _ld(p.rows["dx1"], t)] if t.dx1_dtype is not None else []),
            cooperative=fused is not None))
        if sums and fused is None:
            fin = kernels["norm_bwd_finalize"]
            launches.append(Launch(fin, -(-n // t.finalize_cols_per_cta) * p.heads, [
                ("ptr", "dgamma_part"), ("ptr", "dbeta_part"), ("i32", parts), ("ptr", "dweight"),
                ("ptr", "dbias")] + ([("i32", p.heads)] if t.per_head else [])
                + ([("ptr", "dgamma1_part"), ("ptr", "dbeta1_part"), ("ptr", "dweight1"), ("ptr", "dbias1")]
                   if t.parallel else [])))
    else:  # no rows: empty dx, and the column sums of nothing are zero
        zeros = [o.name for o in outputs if o.name in ("dweight", "dbias", "dweight1", "dbias1")]
    if t.branch and args["rowscale"] is not None and not args["rowscale"].array.c_contiguous:
        copies.append("rowscale")  # read by row number
    names = BACKWARD.arrays + (BRANCH_ARRAYS["backward"] if extended else ())
    return CallPlan(x.kind, device, names, tuple(launches), anchor="x", outputs=outputs, scratch=scratch,
                    copies=copies, zeros=zeros, given_out=None if O is None else ("out", "dx"),
                    spans=_spans(names, args),
                    full_overlap_check=_overlap_check(BACKWARD, p.n), aliases=BACKWARD.in_place["out"],
                    scalars=BRANCH_SCALARS if t.branch else (), result=_picker(picks),
                    absent=_absent(names, args)), p
