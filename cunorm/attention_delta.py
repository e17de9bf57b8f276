"""Attention-backward row delta D = rowsum(dO * O): traits, dispatch, the op.

The traits mirror kernels/attention_delta.cu (its static_asserts are restated
here); the op shares validation, planning, compiling and launching with the
normalization family.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import arrays, dtypes, kinds, layout, plan, reference
from .launch import CallPlan, Launch, Output

MAX_HEAD_DIM = 2048  # 32 threads x 64 elements (MAX_ELTS_PER_THREAD) at one element per load; half for fp64
# Elements of each input one thread holds (VECS_PER_THREAD * ELTS_PER_LDG * ROWS_PER_THREAD); fp64 elements
# count twice (two registers each).
MAX_ELTS_PER_THREAD = 64
# Loads in flight per thread the heuristic aims for (both inputs, all rows).
TARGET_BYTES_IN_FLIGHT = 256
HEURISTIC_THREADS_PER_CTA = 256
MAX_ROWS_PER_THREAD = 4  # more only adds registers (and, at 8 fp32 rows, a spill)


def delta_dtype(out_dtype: str, grad_dtype: str) -> str:
    """D's dtype, and what the products are summed in: float64 when an input is float64, else float32."""
    return "float64" if "float64" in (out_dtype, grad_dtype) else "float32"


@dataclass(frozen=True)
class DeltaTraits:
    """Knobs of the attention-delta kernel. head_dim: K; out_dtype and
    grad_dtype: the two inputs; threads_per_row: threads sharing a row (power
    of two <= 32); elts_per_ldg: elements per vector load (both inputs);
    rows_per_thread: rows whose loads a thread issues together;
    threads_per_cta: CTA size."""

    KNOBS = ("threads_per_row", "elts_per_ldg", "rows_per_thread", "threads_per_cta")

    head_dim: int
    out_dtype: str = "bfloat16"
    grad_dtype: str = "bfloat16"
    threads_per_row: int = 8
    elts_per_ldg: int = 8
    rows_per_thread: int = 4
    threads_per_cta: int = HEURISTIC_THREADS_PER_CTA

    def __post_init__(self):
        for field in ("out_dtype", "grad_dtype"):
            object.__setattr__(self, field, dtypes.name_of(getattr(self, field)))
        self._check()

    @property
    def vec_k(self) -> int:
        return self.head_dim // self.elts_per_ldg

    @property
    def vecs_per_thread(self) -> int:
        return -(-self.vec_k // self.threads_per_row)

    @property
    def rows_per_cta(self) -> int:
        return self.threads_per_cta // self.threads_per_row * self.rows_per_thread

    @property
    def register_words(self) -> int:
        """Registers an element of the wider input takes (2 for fp64)."""
        return max(1, max(dtypes.itemsize(self.out_dtype), dtypes.itemsize(self.grad_dtype)) // 4)

    @property
    def delta_dtype(self) -> str:
        return delta_dtype(self.out_dtype, self.grad_dtype)

    @property
    def source_file(self) -> str:
        return "attention_delta.cu"

    def launches(self) -> dict:
        return {"attention_delta": (self.threads_per_cta, 0, 1)}

    def vector_bytes(self, dtype_name: str) -> int:
        return self.elts_per_ldg * dtypes.itemsize(dtype_name)

    def _check(self):
        def rule(ok: bool, message: str):
            if not ok:
                raise ValueError(f"illegal traits {self.short()}: {message}")

        rule(isinstance(self.head_dim, int) and self.head_dim >= 1, "head_dim must be a positive int")
        tpr = self.threads_per_row
        rule(1 <= tpr <= 32 and tpr & (tpr - 1) == 0, "THREADS_PER_ROW must be a power of two <= 32")
        rule(self.threads_per_cta % 32 == 0 and 32 <= self.threads_per_cta <= 1024,
             "THREADS_PER_CTA: whole warps, <= 1024")
        rule(self.elts_per_ldg in (1, 2, 4, 8, 16), "ELTS_PER_LDG must be 1, 2, 4, 8 or 16")
        for name in (self.out_dtype, self.grad_dtype):
            rule(self.vector_bytes(name) in (2, 4, 8, 16, 32, 64) and
                 (self.vector_bytes(name) <= 16 or self.vector_bytes(name) % 16 == 0),
                 f"a vector of {self.elts_per_ldg} {name} is not a whole number of 16-byte (or one narrower) loads")
        rule(self.head_dim % self.elts_per_ldg == 0, "the head dim must be a multiple of the elements per load")
        rule(self.rows_per_thread >= 1, "ROWS_PER_THREAD must be >= 1")
        rule(self.vecs_per_thread * self.elts_per_ldg * self.rows_per_thread * self.register_words
             <= MAX_ELTS_PER_THREAD, f"more than {MAX_ELTS_PER_THREAD // self.register_words} elements per thread")

    def check_arch(self, arch: int):
        pass  # nothing architecture-specific

    def replace(self, **changes) -> "DeltaTraits":
        return dataclasses.replace(self, **changes)

    def knobs(self) -> dict:
        return {k: getattr(self, k) for k in self.KNOBS}

    def short(self) -> str:
        return (f"K={self.head_dim} {self.out_dtype}*{self.grad_dtype} THREADS_PER_ROW={self.threads_per_row} "
                f"ELTS_PER_LDG={self.elts_per_ldg} ROWS_PER_THREAD={self.rows_per_thread} "
                f"THREADS_PER_CTA={self.threads_per_cta}")

    def template_values(self) -> dict:
        return {"OUT_T": dtypes.cxx_type(self.out_dtype), "GRAD_T": dtypes.cxx_type(self.grad_dtype),
                "ACC_T": dtypes.cxx_type(self.delta_dtype),
                "HEAD_DIM": self.head_dim, "THREADS_PER_ROW": self.threads_per_row,
                "THREADS_PER_CTA": self.threads_per_cta, "ELTS_PER_LDG": self.elts_per_ldg,
                "ROWS_PER_THREAD": self.rows_per_thread, "VECS_PER_THREAD": self.vecs_per_thread,
                "ROWS_PER_CTA": self.rows_per_cta}


def max_head_dim(widest_bytes: int) -> int:
    """The widest head dim a thread group holds, for inputs whose wider element is `widest_bytes`:
    MAX_HEAD_DIM, half for float64 (two registers an element)."""
    return MAX_HEAD_DIM // max(1, widest_bytes // 4)


def heuristic(head_dim: int, out_dtype: str, grad_dtype: str, max_elts_per_ldg: int = 16) -> DeltaTraits:
    """The widest legal vector (up to 16 bytes of the wider input, within what
    the layout's alignment allows), enough threads per row to cover it in one
    or two vectors each, and enough rows per thread for TARGET_BYTES_IN_FLIGHT."""
    wide = max(dtypes.itemsize(out_dtype), dtypes.itemsize(grad_dtype))
    elts = min(16 // wide, max_elts_per_ldg)
    while head_dim % elts:
        elts //= 2
    vec_k = head_dim // elts
    tpr = min(32, 1 << max(0, (vec_k - 1).bit_length()))
    vecs = -(-vec_k // tpr)
    bytes_per_row_thread = vecs * elts * (dtypes.itemsize(out_dtype) + dtypes.itemsize(grad_dtype))
    rows = max(1, min(MAX_ROWS_PER_THREAD, TARGET_BYTES_IN_FLIGHT // bytes_per_row_thread))
    while vecs * elts * rows * max(1, wide // 4) > MAX_ELTS_PER_THREAD:
        rows //= 2
    return DeltaTraits(head_dim=head_dim, out_dtype=out_dtype, grad_dtype=grad_dtype, threads_per_row=tpr,
                       elts_per_ldg=elts, rows_per_thread=max(1, rows), threads_per_cta=HEURISTIC_THREADS_PER_CTA)


class _Family:
    traits_class = DeltaTraits

    @staticmethod
    def choose(arch: int, head_dim: int, out_dtype: str, grad_dtype: str, max_elts_per_ldg: int,
               gpu=None) -> DeltaTraits:  # no tuned tables: gpu is unused
        return heuristic(head_dim, out_dtype, grad_dtype, max_elts_per_ldg)


def _max_elts(tensors, k: int, strides_per_tensor) -> int:
    """Widest vector (in elements) every pointer, leading stride and row
    length allows for 16-byte-or-narrower aligned loads."""
    best = 16
    for a, st in zip(tensors, strides_per_tensor):
        item = a.itemsize
        for e in (16, 8, 4, 2, 1):
            nbytes = e * item
            chunk = min(16, nbytes)
            if k % e == 0 and a.ptr % chunk == 0 and all((s * item) % chunk == 0 for s in st):
                break
        best = min(best, e)
    return best


NAMES = ("out", "grad_out")


def attention_delta(out, grad_out, *, traits=None):
    """D[..., i] = sum_k out[..., i, k] * grad_out[..., i, k], float32 (float64,
    summed in float64, when an input is float64).

    out and grad_out: the same shape [..., K], dtypes fp64/fp32/fp16/bf16 (may
    differ), head dim up to MAX_HEAD_DIM. GPU arrays with a contiguous last axis are read in place through
    their leading strides (up to three leading axes after merging contiguous
    ones); other layouts are copied first. K = 0 gives zeros, zero rows an
    empty result; neither launches a kernel. CuPy arrays give a CuPy array
    and torch tensors a torch tensor (on the kind's current stream); numpy
    inputs run the float64 reference on the CPU.
    """
    values = (out, grad_out)
    key, ptrs = plan.call_key(values, ("delta", traits))
    hit = plan.CALLS.get(key) if key is not None else None
    if hit is not None:
        return hit.run(values, ptrs)
    args, on_gpu = arrays.take_all({"out": out, "grad_out": grad_out}, {})
    O, G = args["out"], args["grad_out"]
    d_dtype = delta_dtype(arrays.check_dtype(O), arrays.check_dtype(G))
    if O.array.ndim < 1:
        raise ValueError("out: needs at least one axis (the head dim), got a 0-d array")
    arrays.check_shape(G, O.array.shape, "out's shape")
    if not on_gpu:
        if traits is not None:  # checked for the call as on a GPU, though the reference computes
            laid, _, _ = layout_of(arrays.described(args), copy=False)
            if laid is not None:
                plan.resolve_traits(_Family, traits, dispatch_call(laid, traits), plan.PREVIEW_ARCH)
        return reference.attention_delta(O.array, G.array).astype(d_dtype)
    with plan.on_device(O.array.device_id):
        call = _plan(args, traits)
    plan.remember(key, call)
    return call.run(tuple(a.array.obj for a in (O, G)), [a.array.ptr for a in (O, G)])


def layout_of(args: dict, copy: bool = True) -> tuple:
    """(dispatch call, {copied input: why}, reasons) of a validated call; the
    call is None when there is nothing to launch (no rows, or K = 0). The
    call's "tensors" and "strides" say what the kernel reads (with `copy`,
    the copies are made; without, they are described as fresh contiguous
    arrays, for explain)."""
    O = args["out"]
    lead, k = tuple(O.array.shape[:-1]), O.array.shape[-1]
    rows = math.prod(lead)
    if rows == 0 or k == 0:
        return None, {}, ["no rows or an empty head dim: the result is zeros, and nothing is launched"]
    if rows >= 2**32:
        raise ValueError(f"out: {rows} rows; at most 2**32 - 1 are supported")
    widest = max(O.array.itemsize, args["grad_out"].array.itemsize)
    max_k = max_head_dim(widest)
    if k > max_k:
        raise ValueError(f"out: head dim {k} exceeds {max_k}, the widest row a thread group holds"
                         + (" for float64" if widest == 8 else ""))

    def contiguous(t):
        if copy:
            return t.kind.describe(t.kind.copy(t.obj))
        strides = tuple(math.prod(t.shape[i + 1:]) * t.itemsize for i in range(t.ndim))
        return kinds.Tensor(None, t.kind, 0, t.shape, strides, t.dtype, t.device_id)

    tensors, copies = [], {}
    for name in NAMES:
        arr = args[name].array
        if arr.ptr % arr.itemsize or any(s % arr.itemsize for s in arr.strides):
            # A reinterpreting view: its elements are misaligned for their own type (even a copy faults).
            raise ValueError(f"{name}: pointer or strides {arr.strides} are not whole {arr.dtype} elements "
                             f"(a view reinterpreting another dtype?); build the array in its own dtype")
        if arr.strides[-1] != arr.itemsize and k > 1:
            arr = contiguous(arr)  # documented: a non-unit last-axis stride is copied
            copies[name] = "its last axis is not contiguous"
        tensors.append(arr)
    elem_strides = [tuple(s // t.itemsize for s in t.strides[:-1]) for t in tensors]
    axes = layout.common_axes(lead, *elem_strides)
    if axes is None:  # documented: more than three non-mergeable leading axes are copied
        tensors = [contiguous(t) for t in tensors]
        copies.update({n: f"more than {layout.MAX_ROW_AXES} leading axes after merging" for n in NAMES})
        elem_strides = [tuple(s // t.itemsize for s in t.strides[:-1]) for t in tensors]
        axes = layout.common_axes(lead, *elem_strides)
    sizes, strides = axes
    call = dict(head_dim=k, out_dtype=dtypes.name_of(O.array.dtype),
                grad_dtype=dtypes.name_of(args["grad_out"].array.dtype),
                max_elts_per_ldg=_max_elts(tensors, k, strides))
    reasons = []
    if call["max_elts_per_ldg"] < 16:
        reasons.append(f"pointers, leading strides and the head dim allow loads of at most "
                       f"{call['max_elts_per_ldg']} elements")
    return dict(call, tensors=tensors, sizes=sizes, strides=strides), copies, reasons


def dispatch_call(laid: dict, traits) -> dict:
    """The dispatch fields of a laid-out call (`layout_of`): the widest vector
    its layout allows caps dispatch's choice; the caller's knobs are checked
    against the layout instead."""
    keys = ("head_dim", "out_dtype", "grad_dtype") + (("max_elts_per_ldg",) if traits is None else ())
    return {k: laid[k] for k in keys}


def _plan(args: dict, traits) -> CallPlan:
    """The CallPlan of a validated GPU call: which inputs are copied, the
    traits (the layout's alignment caps the vector width), the launch."""
    O = args["out"]
    lead = tuple(O.array.shape[:-1])
    delta = Output("delta", lead, np.dtype(delta_dtype(dtypes.name_of(O.array.dtype),
                                                      dtypes.name_of(args["grad_out"].array.dtype))))
    kind, device = O.array.kind, O.array.device_id
    laid, copies, _ = layout_of(args)
    if laid is None:
        return CallPlan(kind, device, NAMES, (), outputs=(delta,), zeros=("delta",))
    tensors, sizes, (ost, gst) = laid.pop("tensors"), laid.pop("sizes"), laid.pop("strides")
    if traits is not None:  # the caller's knobs, checked against the layout below
        laid.pop("max_elts_per_ldg")
    t, kernels = plan.resolve(_Family, traits, laid, device)
    for a, st, name in zip(tensors, (ost, gst), NAMES):
        chunk = min(16, t.vector_bytes(dtypes.name_of(a.dtype)))
        if a.ptr % chunk or any((s * a.itemsize) % chunk for s in st):
            raise ValueError(f"{name}: its pointer or strides are not {chunk}-byte aligned, as "
                             f"traits {t.short()} need")
    kern = kernels["attention_delta"]
    rows = math.prod(lead)
    tiles = -(-rows // t.rows_per_cta)
    grid = min(tiles, kern.resident_clusters * 4)  # CTAs (no cluster): four waves' worth
    launch = Launch(kern, grid, [("ptr", "out"), ("ptr", "grad_out"), ("ptr", "delta"), ("u32", rows),
                                 ("u32", sizes[1]), ("u32", sizes[2]), *(("i64", s) for s in ost),
                                 *(("i64", s) for s in gst)])
    return CallPlan(kind, device, NAMES, (launch,), outputs=(delta,), copies=tuple(n for n in NAMES if n in copies))
