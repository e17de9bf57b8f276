"""The checker's cases: what a case is (`Case`: op, size, rows, every
tensor's dtype and layout, flags) and the sweeps `cunorm check` and the GPU
tier draw them from (tuned sizes, the general kernel, flags, q/k views, fp8
outputs, the memory-efficient backward, and a pairwise covering array over
every tensor's dtype, layout and flag). `cunorm.check` runs and judges them.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from . import dispatch, dtypes, pairwise
from .attention_delta import max_head_dim

DEFAULT_ROWS = (1, 37, 4096)
HEURISTIC_SAMPLE = (8, 40, 200, 1000, 1160, 4104, 7168)


DELTA_HEAD_DIMS = (1, 3, 8, 63, 64, 80, 96, 128, 192, 256, 512)
NORM_OPS = ("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward")
# The short names the CLI and the tools (check, bench, tune) give the norm ops: name -> (op, backward).
SHORT_NAMES = {"fwd": ("layer_norm", False), "bwd": ("layer_norm", True), "rms": ("rms_norm", False),
               "rms-bwd": ("rms_norm", True)}
OPS = NORM_OPS + ("attention_delta",)
SWEEPS = ("tuned", "general", "flags", "pairwise")
# Row layouts of x, residual, dy and dresidual: "contiguous", "offset:K" (a view
# K elements into its buffer), "stride:+D" (rows D elements apart beyond N).
# QKV_LAYOUT (cases with heads only): the k slot of a fused [2, S + 1, 3, heads, N] buffer, sliced to S: three
# leading axes whose strides do not merge.
LAYOUTS = ("contiguous",) + tuple(f"offset:{k}" for k in range(1, 8)) + ("stride:+13", "stride:+64")
QKV_LAYOUT = "qkv"
WEIGHT_LAYOUTS = ("contiguous", "broadcast", "strided", "offset")


@dataclass(frozen=True)
class Case:
    """One checker case. For attention_delta, hidden_size is the head dim,
    dtype the dtype of `out` and weight_dtype that of `grad_out`. For the norms:
    dtype is x's, out_dtype y's (forward) or dy's (backward; default: dtype),
    bias_dtype defaults to weight_dtype, residual_dtype (None: no residual) is
    the residual's (forward) or dresidual's (backward), residual_out_dtype
    (forward) that of residual_out (default: residual_dtype), in_place writes y
    over x (forward) or dx over dy (backward).

    Layouts, one per tensor: `layout` is x's; residual_layout (the residual or
    dresidual) and dy_layout default to it; out_layout None lets the op
    allocate y (dx), else `out=` is given in that layout; bias_layout defaults
    to weight_layout."""

    op: str  # one of OPS
    hidden_size: int
    rows: int
    dtype: str
    weight_dtype: str
    has_weight: bool = True
    has_bias: bool = True
    bias_dtype: str | None = None
    out_dtype: str | None = None
    residual_dtype: str | None = None
    residual_out_dtype: str | None = None
    zero_centered: bool = False
    layout: str = "contiguous"
    weight_layout: str = "contiguous"
    in_place: bool = False
    residual_layout: str | None = None
    dy_layout: str | None = None
    out_layout: str | None = None
    bias_layout: str | None = None
    heads: int = 0  # > 0: row tensors are [2, rows / (2 * heads), heads, N] (the "qkv" layout needs it)
    per_head: bool = False  # weight and bias of shape [heads, N] (needs heads)
    from_output: bool = False  # the memory-efficient backward: from the forward's output y (and its bias)
    scaling: str | None = None  # an fp8 out_dtype's scaling: "tensor", "row" or "group"
    return_amax: bool = False  # (fp8) the call's amax too
    dropout_p: float = 0.0  # dropout on the branch before the residual add (a seed drawn per run)
    rowscale_dtype: str | None = None  # a row scale of this dtype on that branch
    x1_dtype: str | None = None  # the parallel branch x1 (forward), or x1's gradient asked for (backward)
    weight1_dtype: str | None = None  # a second weight: the second output y1 (and its gradients)
    bias1_dtype: str | None = None  # a second bias beside it
    knobs: tuple | None = None  # ((knob, value), ...) passed as traits= (None: dispatch's choice)

    def label(self) -> str:
        if self.op == "attention_delta":
            return f"{self.op} K={self.hidden_size} M={self.rows} out={self.dtype} grad={self.weight_dtype}"
        extras = [("no-weight", not self.has_weight), ("no-bias", not self.has_bias and not self.rms),
                  ("bias", self.has_bias and self.rms),
                  (f"b={self.bias_dtype}", self.bias_dtype not in (None, self.weight_dtype)),
                  (f"out={self.out_dtype}", self.out_dtype not in (None, self.dtype)),
                  (f"residual={self.residual_dtype}", self.residual_dtype is not None),
                  (f"residual_out={self.residual_out_dtype}",
                   self.residual_out_dtype not in (None, self.residual_dtype)),
                  ("zero-centered", self.zero_centered), (self.layout, self.layout != "contiguous"),
                  (f"residual@{self.residual_layout}", self.residual_layout not in (None, self.layout)),
                  (f"dy@{self.dy_layout}", self.dy_layout not in (None, self.layout)),
                  (f"out@{self.out_layout}", self.out_layout is not None),
                  (f"weight={self.weight_layout}", self.weight_layout != "contiguous"),
                  (f"bias@{self.bias_layout}", self.bias_layout not in (None, self.weight_layout)),
                  ("in-place", self.in_place), (f"heads={self.heads}", self.heads > 0),
                  ("per-head-weights", self.per_head), ("from-output", self.from_output),
                  (f"scaling={self.scaling}", self.scaling is not None), ("amax", self.return_amax),
                  (f"dropout={self.dropout_p}", self.dropout_p > 0),
                  (f"rowscale={self.rowscale_dtype}", self.rowscale_dtype is not None),
                  (f"x1={self.x1_dtype}", self.x1_dtype is not None),
                  (f"weight1={self.weight1_dtype}", self.weight1_dtype is not None),
                  (f"bias1={self.bias1_dtype}", self.bias1_dtype is not None),
                  ("traits=" + ",".join(f"{k}={v}" for k, v in self.knobs or ()), self.knobs is not None)]
        flags = "".join(f" {text}" for text, on in extras if on)
        return f"{self.op} N={self.hidden_size} M={self.rows} x={self.dtype} w={self.weight_dtype}{flags}"

    @property
    def rms(self) -> bool:
        return self.op.startswith("rms_norm")

    @property
    def lead(self) -> tuple:
        """The leading shape of every row tensor of the case."""
        if not self.heads:
            return (self.rows,)
        if self.rows % (2 * self.heads):
            raise ValueError(f"heads={self.heads}: rows ({self.rows}) must be a multiple of 2 * heads")
        return (2, self.rows // (2 * self.heads), self.heads)

    @property
    def backward(self) -> bool:
        return self.op.endswith("_backward")

    def layout_of(self, tensor: str) -> str | None:
        """The layout of row tensor `tensor` ("x", "residual", "dy", "out")."""
        return {"x": self.layout, "residual": self.residual_layout or self.layout,
                "dy": self.dy_layout or self.layout, "out": self.out_layout}[tensor]


# The general-path sweep (any N, layouts, weights, dtype mixes, in place) and the flag sweep
# (RMSNorm, residual, zero-centered weight): sizes, and the dtype mixes drawn from.
GENERAL_SIZES = tuple(range(1, 34)) + (1536, 2304, 3840, 12800, 4097, 65537, 131072, 262144)
FLAG_SIZES = (1, 7, 768, 1024, 4096, 4097, 8192, 16384, 65536, 65537)


def _mixes(dtypes_) -> list:
    """(x, weight, bias, out) dtype mixes: every weight x bias pair beside each
    x, and every out dtype, with the rest following x."""
    mixes = []
    for x in dtypes_:
        mixes += [(x, w, b, x) for w in dtypes.NAMES for b in dtypes.NAMES]
        mixes += [(x, x, x, o) for o in dtypes.NAMES if o != x]
    return mixes


def general_cases(sizes=None, rows=(37,), dtypes_=dtypes.NAMES) -> list:
    """Issue-3 coverage for LayerNorm forward and backward: every N in
    GENERAL_SIZES (bf16 and fp32), every row layout, every dtype mix, weights
    absent, broadcast, strided and offset, and in place."""
    cases = []
    for op in ("layer_norm", "layer_norm_backward"):
        for n, m in itertools.product(sizes or GENERAL_SIZES, rows):
            for dt in dict.fromkeys(d for d in ("bfloat16", "float32") if d in dtypes_):
                cases.append(Case(op, n, m, dt, dt))
        for m in rows:
            for layout in LAYOUTS[1:]:
                for n in (1000, 4096):
                    cases.append(Case(op, n, m, "bfloat16", "float32", layout=layout))
            for x, w, b, o in _mixes(dtypes_):
                cases.append(Case(op, 1000, m, x, w, bias_dtype=b, out_dtype=o))
            for wl in WEIGHT_LAYOUTS[1:]:
                for n in (1024, 1001):
                    cases.append(Case(op, n, m, "bfloat16", "bfloat16", weight_layout=wl))
            for hw, hb in ((False, False), (True, False), (False, True)):
                for n in (1024, 33):
                    cases.append(Case(op, n, m, "bfloat16", "bfloat16", has_weight=hw, has_bias=hb))
            for n, layout in ((4096, "contiguous"), (4097, "contiguous"), (1000, "offset:3"), (1000, "stride:+13")):
                cases.append(Case(op, n, m, "bfloat16", "bfloat16", layout=layout, in_place=True))
    return cases


def flag_cases(sizes=None, rows=(37,), dtypes_=dtypes.NAMES) -> list:
    """Issue-4 coverage: RMSNorm and LayerNorm, forward and backward, with and
    without residual / dresidual and zero-centered weights over FLAG_SIZES
    (bf16), every (x, residual) dtype pair and weight dtype, odd layouts, in
    place and without weights."""
    cases = []
    for op in NORM_OPS:
        rms = op.startswith("rms")

        def case(n, m, x, w, **kw):
            return Case(op, n, m, x, w, has_bias=not rms, **kw)

        for n, m in itertools.product(sizes or FLAG_SIZES, rows):
            for res, zc in ((None, False), (None, True), ("bfloat16", True), ("float32", False)):
                cases.append(case(n, m, "bfloat16", "bfloat16", residual_dtype=res, zero_centered=zc))
        for m in rows:
            for x, res in itertools.product(dtypes_, dtypes.NAMES):
                cases.append(case(4097, m, x, x, residual_dtype=res, zero_centered=True))
            for x, w in itertools.product(dtypes_, dtypes.NAMES):
                cases.append(case(1000, m, x, w, residual_dtype="float32", out_dtype="float32" if x != w else None))
            for layout in ("offset:1", "offset:5", "stride:+13", "stride:+64"):
                for n in (1000, 4096):
                    cases.append(case(n, m, "bfloat16", "float32", residual_dtype="bfloat16", zero_centered=True,
                                      layout=layout))
            cases.append(case(4096, m, "bfloat16", "bfloat16", residual_dtype="bfloat16", in_place=True))
            cases.append(Case(op, 1001, m, "bfloat16", "bfloat16", has_weight=False, has_bias=False,
                              residual_dtype="float32"))
            if rms:  # RMSNorm with a bias (y = xhat * w + b)
                for n, res in ((1024, None), (4097, "float32"), (65536, "bfloat16")):
                    cases.append(Case(op, n, m, "bfloat16", "bfloat16", bias_dtype="float32", residual_dtype=res))
                cases.append(Case(op, 1000, m, "float32", "bfloat16", has_weight=False))
        cases += qkv_cases(op)
        if op.endswith("_backward"):
            cases += from_output_cases(op)
        else:
            cases += fp8_cases(op)
        cases += branch_cases(op, rows) + parallel_cases(op, rows) + short_row_cases(op)
    return cases


def short_row_cases(op: str) -> list:
    """Several rows a warp (lanes_per_row 4, 8, 16), forced: q/k views with weights per head, contiguous rows
    with a residual, RMSNorm's bias, fp8 outputs scaled per row and per 128 columns, fp32/fp16/bf16/fp64 x,
    row counts that fill no whole CTA; and the widths and dtypes each lane count serves."""
    rms = op.startswith("rms")
    fwd = not op.endswith("_backward")
    cases = []
    for lanes in (4, 8, 16):
        def case(n, rows, dt, wdt, **kw):
            knobs = (("lanes_per_row", lanes), ("warps_m", kw.pop("warps_m", 4)), ("stages", kw.pop("stages", 3)))
            return Case(op, n, rows, dt, wdt, knobs=knobs, **kw)

        cases += [case(128, 2 * 37 * 8, "bfloat16", "bfloat16", has_bias=not rms, heads=8, layout="qkv",
                       per_head=True, zero_centered=rms),
                  case(64, 1001, "float32", "bfloat16", has_bias=not rms, residual_dtype="float16",
                       **({} if fwd else {"dy_layout": "stride:+64"})),
                  case(32 * lanes, 333, "float16", "float32", has_bias=True, bias_dtype="bfloat16",
                       layout="offset:8", warps_m=2, stages=2),
                  case(32, 77, "float64", "float64", has_bias=not rms, out_dtype="float32", stages=1)]
        if fwd:
            cases.append(case(256, 200, "bfloat16", "bfloat16", has_bias=not rms, out_dtype="float8_e4m3fn",
                              residual_dtype="bfloat16", scaling="row", return_amax=True))
            if lanes == 16:  # a 128-column group spans 16 lanes of 8 elements
                cases.append(case(128, 200, "bfloat16", "bfloat16", has_bias=not rms, out_dtype="float8_e5m2",
                                  scaling="group", heads=4, layout="qkv"))
                # 201 rows: the last warp holds a row and one past the end, which skips the group's butterfly
                cases.append(case(256, 201, "bfloat16", "float32", has_bias=not rms, out_dtype="float8_e4m3fn",
                                  residual_dtype="float16", scaling="group", return_amax=True))
    return cases


def parallel_cases(op: str, rows=(37,)) -> list:
    """The parallel block: x1 (its own dropout mask) and a second weight and bias (y1 and its gradients),
    each alone and together, with and without dropout and a residual, every input width apart from x's,
    aligned and general rows, x offset from its contiguous x1 (and dy1), the one-launch and two-launch
    backwards."""
    rms = op.startswith("rms")
    cases = []
    for n, x, x1, w1, b1, res, p, layout in (
            (4096, "bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16", 0.1, "contiguous"),
            (4096, "bfloat16", None, "float32", None, None, 0.0, "contiguous"),
            (1024, "float32", "float16", None, None, None, 0.3, "contiguous"),
            (4097, "float16", "float32", "bfloat16", "float32", "float32", 0.2, "contiguous"),
            (768, "float64", "float64", "float64", "float64", None, 0.0, "contiguous"),
            (8192, "bfloat16", "float16", "bfloat16", "bfloat16", "bfloat16", 0.0, "contiguous"),
            (1000, "bfloat16", "bfloat16", "float32", "bfloat16", "bfloat16", 0.3, "offset:5")):
        for m in (*rows, 1024):
            cases.append(Case(op, n, m, x, x, has_bias=not rms, residual_dtype=res, dropout_p=p, x1_dtype=x1,
                              weight1_dtype=w1, bias1_dtype=b1, layout=layout))
    return cases


def branch_cases(op: str, rows=(37,)) -> list:
    """Dropout and a row scale before the residual add: with and without a residual, aligned, general and
    offset rows, the one-launch and two-launch backwards (few and many rows), fp32/fp16/bf16/fp64 x."""
    rms = op.startswith("rms")
    cases = []
    for n, x, res, p, scale, layout in (
            (4096, "bfloat16", "bfloat16", 0.1, "float32", "contiguous"),
            (4096, "bfloat16", None, 0.5, None, "contiguous"),
            (1024, "float16", "float32", 0.0, "float16", "contiguous"),
            (4097, "float32", "float32", 0.25, "bfloat16", "contiguous"),
            (1000, "bfloat16", "bfloat16", 0.3, None, "offset:5"),
            (768, "float64", "float64", 0.2, "float64", "contiguous"),
            (16384, "bfloat16", "bfloat16", 0.1, "float32", "contiguous")):
        for m in (*rows, 1024):
            cases.append(Case(op, n, m, x, x, has_bias=not rms, residual_dtype=res, dropout_p=p,
                              rowscale_dtype=scale, layout=layout))
    return cases


def fp8_cases(op: str) -> list:
    """fp8 outputs of a forward: both formats, every scaling, fp32/fp16/bf16 x, with and without a residual and
    the amax, aligned, general (row and tensor scaling) and cluster rows, q/k views."""
    rms = op.startswith("rms")
    cases = []
    for fmt, scaling, n, x, res, amax in (
            ("float8_e4m3fn", "tensor", 1024, "bfloat16", None, True),
            ("float8_e5m2", "tensor", 4097, "float32", "bfloat16", False),
            ("float8_e4m3fn", "row", 4096, "bfloat16", "bfloat16", True),
            ("float8_e5m2", "row", 4097, "float16", None, False),
            ("float8_e4m3fn", "row", 65536, "bfloat16", None, True),
            ("float8_e4m3fn", "group", 4096, "float32", "float32", True),
            ("float8_e5m2", "group", 1024, "bfloat16", None, False),
            ("float8_e4m3fn", "group", 16384, "bfloat16", "bfloat16", False),
            ("float8_e4m3fn", "row", 1, "float32", None, False)):
        cases.append(Case(op, n, 64, x, x, has_bias=not rms, out_dtype=fmt, residual_dtype=res, scaling=scaling,
                          return_amax=amax))
    cases.append(Case(op, 128, 64, "bfloat16", "bfloat16", has_bias=not rms, out_dtype="float8_e4m3fn", heads=4,
                      layout="qkv", scaling="group", return_amax=True))
    cases.append(Case(op, 128, 64, "bfloat16", "bfloat16", has_bias=True, out_dtype="float8_e5m2", heads=4,
                      layout="qkv", per_head=True, scaling="row"))
    return cases


def from_output_cases(op: str) -> list:
    """The memory-efficient backward (from y and the forward's bias): every input dtype, aligned and general
    rows, a cluster size, with and without weight and bias, zero-centered, dresidual, a weight per head."""
    rms = op.startswith("rms")
    m = 64
    cases = [Case(op, n, m, dt, wdt, has_bias=has_b, has_weight=has_w, zero_centered=zc, residual_dtype=res,
                  from_output=True)
             for n, dt, wdt, has_w, has_b, zc, res in (
                 (1024, "bfloat16", "bfloat16", True, True, False, None),
                 (4097, "float32", "bfloat16", True, True, True, None),
                 (4096, "float16", "float32", True, False, False, "float16"),
                 (16384, "bfloat16", "float32", True, True, False, "float32"),
                 (1000, "float64", "float64", True, True, True, None),
                 (768, "float32", "float32", False, True, False, None),
                 (33, "bfloat16", "bfloat16", True, not rms, False, None))]
    cases.append(Case(op, 128, m, "bfloat16", "bfloat16", has_bias=True, heads=4, layout="qkv", per_head=True,
                      from_output=True))
    return cases


QKV_HEAD_DIMS = (64, 100, 128, 256)  # 100: narrower loads (its rows are 4, not 8, elements aligned)


def qkv_cases(op: str) -> list:
    """Row tensors through three leading axes ([2, S, heads, N] views of a
    fused QKV buffer, layout "qkv"): x, the residual, dy and `out=` each in
    place or contiguous beside them, in place, fp32 and bf16, with and without
    a residual and a bias."""
    rms, backward = op.startswith("rms"), op.endswith("_backward")
    m, heads = 64, 4
    cases = []
    for n in QKV_HEAD_DIMS:
        for dt, res in (("bfloat16", None), ("float32", "bfloat16"), ("bfloat16", "float32")):
            cases.append(Case(op, n, m, dt, dt, has_bias=not rms or res is None, residual_dtype=res, heads=heads,
                              layout="qkv", residual_layout="contiguous" if res == "float32" else "qkv"))
    cases.append(Case(op, 128, m, "bfloat16", "float32", has_bias=not rms, heads=heads, layout="contiguous",
                      **({"dy_layout": "qkv"} if backward else {"residual_dtype": "bfloat16", "residual_layout": "qkv"})))
    cases.append(Case(op, 128, m, "bfloat16", "bfloat16", has_bias=not rms, heads=heads, layout="qkv",
                      out_layout="qkv"))
    cases.append(Case(op, 128, m, "float16", "float16", has_bias=not rms, heads=heads, layout="qkv", in_place=True))
    # Weights per head ([heads, N]), on q/k views and on contiguous rows, aligned and general (N = 100 in fp32
    # is aligned at 4 elements; 99 runs the general kernel).
    for n, dt, lay, wl in ((128, "bfloat16", "qkv", "contiguous"), (64, "float32", "qkv", "strided"),
                           (100, "float32", "contiguous", "contiguous"), (99, "bfloat16", "contiguous", "strided")):
        cases.append(Case(op, n, m, dt, dt, has_bias=True, heads=heads, layout=lay, weight_layout=wl, per_head=True,
                          zero_centered=rms))
    # Many more rows than the persistent grid holds, with head counts that divide neither the rows per CTA nor
    # the grid: each warp row must still keep one head (the grid's row stride a multiple of the heads), on
    # several CTAs a row too.
    for n, rows, h, dt in ((128, 72000, 3, "bfloat16"), (99, 12000, 3, "float32"), (8192, 400, 5, "bfloat16"),
                           (32768, 360, 6, "bfloat16")):
        cases.append(Case(op, n, rows, dt, dt, has_bias=True, heads=h, per_head=True))
    return cases


PAIRWISE_SIZES = (1024, 4097)  # aligned rows, general rows
PAIRWISE_LAYOUTS = ("contiguous", "offset:3", "stride:+13", "stride:+64")
OUT_LAYOUTS = (None, "contiguous", "offset:1", "stride:+8")  # None: the op allocates


def pairwise_factors(op: str, sizes=None, dtypes_=dtypes.NAMES) -> tuple:
    """(factors, off) of the pairwise sweep of a norm op: every tensor's dtype
    (None: absent), layout and flag is its own factor."""
    backward = op.endswith("_backward")
    d = tuple(dtypes_)
    f = {"n": tuple(sizes or PAIRWISE_SIZES), "x": d, "weight": (None,) + d, "residual": (None,) + d,
         "x_layout": PAIRWISE_LAYOUTS, "residual_layout": PAIRWISE_LAYOUTS, "out_layout": OUT_LAYOUTS,
         "weight_layout": WEIGHT_LAYOUTS, "zero_centered": (False, True)}
    if backward:
        f.update(dy=d, dy_layout=PAIRWISE_LAYOUTS)
    else:
        f.update(out=d, residual_out=d)
    f.update(bias=(None,) + d, bias_layout=WEIGHT_LAYOUTS)  # RMSNorm's bias too
    off = {("residual", None): ("residual_out", "residual_layout"), ("weight", None): ("zero_centered", "weight_layout"),
           ("bias", None): ("bias_layout",)}
    return f, off


@functools.lru_cache(maxsize=None)
def _pairwise_rows(op: str, sizes: tuple | None, dtypes_: tuple) -> tuple:
    factors, off = pairwise_factors(op, sizes, dtypes_)
    return tuple(pairwise.covering_array(factors, off))


def pairwise_cases(sizes=None, rows=(37,), dtypes_=dtypes.NAMES, ops=NORM_OPS) -> list:
    """Issue-12 coverage: for each norm op, a pairwise covering array over the
    dtype of every tensor of a call (x, weight, bias, residual, residual_out,
    y / dy, dresidual; dx follows x), the layout of every row tensor (x,
    residual, dy, a given `out=`), the weight and bias layouts and the
    zero-centered flag, at aligned and general hidden sizes."""
    cases = []
    for op in ops:
        if op not in NORM_OPS:
            continue
        backward = op.endswith("_backward")
        for row, m in itertools.product(_pairwise_rows(op, tuple(sizes) if sizes else None, tuple(dtypes_)), rows):
            w, b, r = row["weight"], row.get("bias"), row["residual"]
            cases.append(Case(op, row["n"], m, row["x"], w or "float32", has_weight=w is not None,
                              has_bias=b is not None, bias_dtype=b, out_dtype=row["dy" if backward else "out"],
                              residual_dtype=r, residual_out_dtype=None if backward or r is None
                              else row["residual_out"],
                              zero_centered=bool(w is not None and row["zero_centered"]), layout=row["x_layout"],
                              weight_layout=row["weight_layout"],
                              residual_layout=row["residual_layout"] if r is not None else None,
                              dy_layout=row.get("dy_layout"), out_layout=row["out_layout"],
                              bias_layout=row.get("bias_layout") if b is not None else None))
    return cases


def default_cases(sizes=None, rows=DEFAULT_ROWS, dtypes_=dtypes.NAMES, ops=OPS, heuristic=True,
                  sweeps=SWEEPS) -> list:
    """The "tuned" sweep: tuned sizes (plus a heuristic sample) x dtypes x
    {input-dtype, fp32} weights x rows for LayerNorm and RMSNorm; attention_delta:
    head dims x every (out, grad_out) dtype pair x rows. "general" and "flags"
    add general_cases and flag_cases (at 37 rows), "pairwise" pairwise_cases. `sizes` replaces every size
    list; `ops` filters."""
    ln_sizes = tuple(sizes) if sizes else dispatch.TUNED_SIZES + (HEURISTIC_SAMPLE if heuristic else ())
    cases = []
    if "tuned" in sweeps:
        for op in ops:
            if op == "attention_delta":
                head_dims = tuple(sizes) if sizes else DELTA_HEAD_DIMS
                for k, dt, gdt, m in itertools.product(head_dims, dtypes_, dtypes_, rows):
                    if k <= max_head_dim(max(dtypes.itemsize(dt), dtypes.itemsize(gdt))):  # what the op takes
                        cases.append(Case(op, k, m, dt, gdt))
                continue
            for n, dt, m in itertools.product(ln_sizes, dtypes_, rows):
                for wdt in dict.fromkeys((dt, "float32")):
                    cases.append(Case(op, n, m, dt, wdt, has_bias=not op.startswith("rms")))
    if "general" in sweeps:
        cases += [c for c in general_cases(sizes, dtypes_=dtypes_) if c.op in ops]
    if "flags" in sweeps:
        cases += [c for c in flag_cases(sizes, dtypes_=dtypes_) if c.op in ops]
    if "pairwise" in sweeps:
        cases += pairwise_cases(sizes, dtypes_=dtypes_, ops=ops)
    # The options narrow every sweep: only the sizes and input dtypes asked for.
    cases = [c for c in cases if c.dtype in dtypes_ and (not sizes or c.hidden_size in sizes)]
    return list(dict.fromkeys(cases))
