"""How GPU arrays meet the normalization kernels' row model.

A row tensor is a pointer and a row stride: the last axis has unit stride and
the leading axes merge into one row axis. Such tensors are read and written
in place (slices of wider rows, offset views, fused buffers). Where the
leading axes of a call's row tensors do not merge into one but into at most
MAX_ROW_AXES (q/k views [B, S, H, D] of a fused QKV buffer), every row tensor
is read and written through its own strides of those axes (`RowAxes`, aligned
rows only); any other layout of an input is copied to a contiguous array
first (documented), and an output (`out=`) in such a layout is refused.

Vector width. The kernels read a row in vectors of E elements aligned to E in
memory. Every row tensor of a call must sit at the same offset from a vector
boundary on every row (same pointer and row stride modulo E), so E is the
widest power of two (up to 16 bytes of x) for which that holds. When, moreover,
every row starts on a boundary and N is a multiple of E, the fast kernel runs
(aligned rows); otherwise the general one, which shifts each row into the
aligned frame around it and masks its ends.

Batch invariance. The general kernel's lanes hold different elements of a row
at different shifts, so its sums run in an order that depends on where the row
starts: in a contiguous batch of odd-sized rows, on the row's index. In
batch-invariant mode (`set_batch_invariant`, or CUNORM_BATCH_INVARIANT=1 in
the environment) every call takes the aligned kernel at the widest E its rows
all start on (narrower loads, never the general kernel), so a row's results
depend only on N, the dtypes and that E: for a contiguous batch, not on how
many rows it holds or where the row sits. Aligned rows are batch invariant in
either mode.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from . import dtypes
from .arrays import Arg


@dataclass(frozen=True)
class Rows:
    """A row tensor as the kernels see it."""

    name: str
    array: object  # the kinds.Tensor the kernel reads (a contiguous copy if `copied`); None: not yet allocated
    rows: int
    ld: int  # elements from one row start to the next
    offset: int  # the pointer in elements (its position modulo E decides the row shift)
    copied: str = ""  # why a contiguous copy was made ("" when read in place)
    axes: tuple | None = None  # (s0, s1, s2, d1, d2) in elements when the call's rows run through three axes

    def strides(self) -> tuple:
        """Every stride between rows that matters (elements)."""
        if self.axes is None:
            return (self.ld,) if self.rows > 1 else ()
        s0, s1, s2, d1, d2 = self.axes
        return tuple(s for s, size in ((s0, self.rows // max(1, d1 * d2)), (s1, d1), (s2, d2)) if size > 1)


def fresh_rows(name: str, rows: int, n: int, offset: int) -> Rows:
    """An output cunorm allocates: contiguous, `offset` elements into an
    aligned allocation (CuPy's and torch's are 256-byte aligned). The offset
    mirrors x's position from a vector boundary, so that an offset view of x
    still meets its outputs on the same row shifts (`launch.Output`)."""
    return Rows(name, None, rows, n, offset)


MAX_ROW_AXES = 3  # leading axes the kernels index with their own strides (attention_delta and the norms)


def common_axes(shape: tuple, *strides: tuple) -> tuple | None:
    """Merges the leading axes of `shape` that are contiguous in every one of
    `strides` (element strides of the leading axes, one tuple per tensor).
    Returns ([d0, d1, d2], [[s0, s1, s2] per tensor]) with size-1 axes
    dropped and the outer ones padded with size 1, or None when more than
    MAX_ROW_AXES remain."""
    axes = [(n, [s[i] for s in strides]) for i, n in enumerate(shape) if n != 1]
    merged = []
    for n, st in axes:
        if merged and all(ps == n * s for ps, s in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    if len(merged) > MAX_ROW_AXES:
        return None
    while len(merged) < MAX_ROW_AXES:
        merged.insert(0, (1, [0] * len(strides)))
    return [n for n, _ in merged], [[st[i] for _, st in merged] for i in range(len(strides))]


def three_axis_rows(arrays: dict, n: int, outputs: set = frozenset()) -> dict | None:
    """{name: Rows} reading every array (kinds.Tensor, shape (..., n), the
    first one x) in place through the leading axes they share, when some
    array's leading axes do not merge into one row stride but all arrays'
    merge into at most MAX_ROW_AXES (with a unit last-axis stride); None
    otherwise (one row stride each does, or the layout needs copies). The
    arrays named in `outputs` are written: ValueError where their rows would
    overlap one another."""
    arrs = list(arrays.values())
    shape = tuple(arrs[0].shape)
    if len(shape) < 3 or any(n > 1 and a.strides[-1] != a.itemsize for a in arrs):
        return None
    if any(a.ptr % a.itemsize or any(s % a.itemsize for s in a.strides) for a in arrs):
        return None  # check_elements names it
    elem = [tuple(s // a.itemsize for s in a.strides[:-1]) for a in arrs]
    if all(row_stride(shape, e + (1,), n) is not None for e in elem):
        return None
    found = common_axes(shape[:-1], *elem)
    rows = math.prod(shape[:-1])
    if found is None or rows >= 2**31 or any(s < 0 for st in found[1] for s in st):
        return None
    sizes, strides = found
    for (name, a), st in zip(arrays.items(), strides):
        if name in outputs and not _rows_apart(sizes, st, n):
            raise ValueError(f"{name}: strides {a.strides} make rows overlap (a broadcast or interleaved view); "
                             f"an output's rows must not share memory")
    _, d1, d2 = sizes
    return {name: Rows(name, a, rows, st[2], a.ptr // a.itemsize, axes=(*st, d1, d2))
            for (name, a), st in zip(arrays.items(), strides)}


def _rows_apart(sizes: list, strides: list, n: int) -> bool:
    """Whether rows through these axes never share an element: each axis (innermost first, by stride) steps
    past everything the axes inside it cover (a sufficient test)."""
    extent = n
    for size, stride in sorted(((z, s) for z, s in zip(sizes, strides) if z > 1), key=lambda p: p[1]):
        if stride < extent:
            return False
        extent = stride * (size - 1) + extent
    return True


def fresh_three_axis_rows(name: str, x: Rows, n: int) -> Rows:
    """A fresh contiguous output beside three-axis rows: its strides in x's axes."""
    _, _, _, d1, d2 = x.axes
    return Rows(name, None, x.rows, n, 0, axes=(d1 * d2 * n, d2 * n, n, d1, d2))


def mirrored_offset(x: Rows, itemsize: int) -> int:
    """Where fresh outputs start beside x: x's offset from a 16-byte boundary, in elements."""
    return x.offset % dtypes.vector_elements(itemsize)


def check_elements(a: Arg):
    arr = a.array
    # C-contiguous (the common case, checked cheaply): strides are whole, positive elements.
    contiguous = arr.c_contiguous
    if arr.ptr % arr.itemsize or (not contiguous and any(s % arr.itemsize for s in arr.strides)):
        raise ValueError(f"{a.name}: pointer or strides {arr.strides} are not whole {arr.dtype} elements (a view "
                         f"reinterpreting another dtype?); the row stride must be a whole number of elements")
    if not contiguous and any(s < 0 for s, n in zip(arr.strides, arr.shape) if n > 1):
        raise ValueError(f"{a.name}: negative strides {arr.strides} are not supported; pass a copy "
                         f"(e.g. cupy.ascontiguousarray)")


def row_stride(shape: tuple, strides: tuple, n: int):
    """The row stride (elements) of an array whose last axis (length n) has
    unit stride and whose leading axes merge into one; None otherwise."""
    if n > 1 and strides[-1] != 1:
        return None
    lead = [(size, st) for size, st in zip(shape[:-1], strides[:-1]) if size != 1]
    if not lead:
        return n  # one row: any stride will do
    for (_, outer), (size, inner) in zip(lead, lead[1:]):
        if outer != inner * size:
            return None
    return lead[-1][1]


def rows_of(a: Arg, n: int, *, output: bool = False) -> Rows:
    """The row view of a GPU array of shape (..., n): in place when its layout
    allows, else (inputs only) a contiguous copy."""
    check_elements(a)
    arr = a.array
    rows = math.prod(arr.shape[:-1])
    ld = n if arr.c_contiguous else row_stride(arr.shape, tuple(s // arr.itemsize for s in arr.strides), n)
    if output:
        if ld is None:
            raise ValueError(f"{a.name}: strides {arr.strides} are not a unit last-axis stride with one row stride; "
                             f"the output must be written in place, so pass such an array")
        if rows > 1 and ld < n:
            raise ValueError(f"{a.name}: row stride {ld} is shorter than a row ({n}): rows would overlap")
        return Rows(a.name, arr, rows, ld, arr.ptr // arr.itemsize)
    if ld is None:
        why = (f"last-axis stride {arr.strides[-1] // arr.itemsize}" if n > 1 and arr.strides[-1] != arr.itemsize
               else "leading axes that merge neither into one row stride nor into three the call shares")
        copy = arr.kind.describe(arr.kind.copy(arr.obj))
        return Rows(a.name, copy, rows, n, copy.ptr // copy.itemsize, f"copied to a contiguous array ({why})")
    return Rows(a.name, arr, rows, ld, arr.ptr // arr.itemsize)


_batch_invariant = os.environ.get("CUNORM_BATCH_INVARIANT", "0") not in ("", "0")


def set_batch_invariant(on: bool = True):
    """Batch-invariant mode on or off (module docstring): calls planned from now on take the aligned kernel
    at the widest vector their rows all start on; cached plans are forgotten."""
    global _batch_invariant
    if not isinstance(on, bool):
        raise TypeError(f"on: expected a bool, got {type(on).__name__}")
    if on != _batch_invariant:
        from .plan import forget_choices

        _batch_invariant = on
        forget_choices()


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on."""
    return _batch_invariant


def vector_widths(row_tensors: list, n: int, x_itemsize: int) -> tuple:
    """(widest E every row tensor's shifts agree on, widest E with aligned
    rows), both powers of two of at most 16 bytes of x. The first row tensor is x.
    In batch-invariant mode both are the second: never the general kernel."""
    shifted, aligned = _vector_widths(row_tensors, n, x_itemsize)
    return (aligned, aligned) if _batch_invariant else (shifted, aligned)


def _vector_widths(row_tensors: list, n: int, x_itemsize: int) -> tuple:
    x = row_tensors[0]
    widest = dtypes.vector_elements(x_itemsize)
    if x.axes is not None:  # three-axis rows: aligned rows only, E dividing every pointer and stride
        bits = n
        for t in row_tensors:
            bits |= t.offset
            for s in t.strides():
                bits |= s
        e = _widest_dividing(bits, widest)
        return e, e
    # E divides every offset and row-stride difference from x's (and, for aligned rows, x's own and N):
    # the lowest set bit of their OR bounds it.
    spread = 0
    for t in row_tensors:
        spread |= (t.offset - x.offset) | ((t.ld - x.ld) if x.rows > 1 else 0)
    shifted = _widest_dividing(spread, widest)
    aligned = _widest_dividing(spread | n | x.offset | (x.ld if x.rows > 1 else 0), shifted)
    return shifted, aligned


def _widest_dividing(bits: int, cap: int) -> int:
    """The largest power of two <= cap dividing every number whose bits are OR-ed in `bits`."""
    low = bits & -bits if bits else cap
    return min(low, cap)


def why_not_aligned(row_tensors: list, n: int, e: int) -> list:
    """Why rows are not aligned to E elements (for explain)."""
    x = row_tensors[0]
    reasons = []
    if n % e:
        reasons.append(f"hidden size {n} is not a multiple of {e} elements")
    for t in row_tensors:
        if t.offset % e:
            reasons.append(f"{t.name} starts {t.offset % e} elements past a {e}-element boundary")
        for s in t.strides():
            if s % e:
                reasons.append(f"{t.name}'s row stride {s} is not a multiple of {e} elements")
        if t is not x and ((t.offset - x.offset) % e or (x.rows > 1 and (t.ld - x.ld) % e)):
            reasons.append(f"{t.name} and {x.name} sit at different offsets from {e}-element boundaries")
    return reasons


def shift_period(ld: int, rows: int, e: int) -> int:
    """Rows after which a row tensor's shift repeats: the grid's row stride must
    be a multiple of it, so that each thread's rows share one shift."""
    if rows <= 1:
        return 1
    return e // math.gcd(ld % e, e)


def _extent(arr) -> tuple:
    """[first byte, last byte + 1) of an array with non-negative strides."""
    if arr.size == 0:
        return (arr.ptr, arr.ptr)
    last = sum((n - 1) * s for n, s in zip(arr.shape, arr.strides))
    return arr.ptr, arr.ptr + last + arr.itemsize


def rows_overlap(a: Rows, b: Rows, n: int) -> bool:
    """Whether two row tensors share a byte: exact for equal row strides,
    else whether their extents meet."""
    a0, a1 = _extent(a.array)
    b0, b1 = _extent(b.array)
    if a1 <= b0 or b1 <= a0:
        return False
    la, lb = a.ld * a.array.itemsize, b.ld * b.array.itemsize
    if a.rows <= 1 or b.rows <= 1 or la != lb or la <= 0 or a.axes is not None or b.axes is not None:
        return True  # extents meet: taken as an overlap (three-axis rows: interleaved views are refused)
    # Row i of a against row j of b: d + k * L in (-nb, na) for some k = i - j in [-(rows_b - 1), rows_a - 1].
    d, na, nb = a.array.ptr - b.array.ptr, n * a.array.itemsize, n * b.array.itemsize
    k = max(-(b.rows - 1), (-nb - d) // la + 1)
    return k <= a.rows - 1 and d + k * la < na


def check_outputs(outputs: list, inputs: list, n: int, in_place: dict):
    """Outputs may not share memory with any input or each other, except an
    output that is exactly an input of its own dtype named in `in_place`
    ({output name: allowed input names}), which is read before it is written."""
    for i, o in enumerate(outputs):
        for t in inputs + outputs[:i]:
            if t is None or t.array.size == 0 or o.array.size == 0:
                continue
            same = (isinstance(t, Rows) and t.array.ptr == o.array.ptr and t.ld == o.ld and t.axes == o.axes
                    and t.array.dtype == o.array.dtype and t.rows == o.rows)
            if same and t.name in in_place.get(o.name, ()):
                continue
            overlap = rows_overlap(o, t, n) if isinstance(t, Rows) else _extents_meet(o.array, t.array)
            if overlap:
                allowed = in_place.get(o.name, ())
                hint = (f"; in place, {o.name} may be exactly {' or '.join(allowed)} (same view and dtype)"
                        if allowed else "")
                raise ValueError(f"{o.name}: shares memory with {t.name}{hint}")


def _extents_meet(a, b) -> bool:
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return not (a1 <= b0 or b1 <= a0)


def extents_disjoint(a, others: list) -> bool:
    """Whether array `a` shares no byte range with any of `others` (a cheap
    sufficient test for check_outputs: disjoint extents never overlap)."""
    a0, a1 = _extent(a)
    return all(b1 <= a0 or a1 <= b0 for b0, b1 in map(_extent, others))
