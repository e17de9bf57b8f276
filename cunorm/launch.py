"""What a planned call does on every repeat: launches with arguments packed
once, outputs from the caller's allocator, and the one check that depends on
addresses.

`Launch` holds a kernel's parameters in one array of 8-byte slots written at
planning; a call writes only its pointers and per-call scalars into their
slots and hands the array to cuLaunchKernel (CuPy's driver binding): no
argument objects, no CuPy kernel wrapper. `CallPlan.run` is the whole of a
repeated call: copies the plan asks for, fresh outputs, the `out=` overlap
test, working memory (`scratch.scratch_pointer`), the launches, the result; a
plan of one plain launch replaces it with a closure that does only what such a
call needs (`CallPlan._one_launch_run`). Names are resolved to positions once,
when the plan is built, so a call moves lists, not dictionaries.
"""
from __future__ import annotations

import array
import math
import operator
import struct
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from . import scratch
from .kinds import kind_of

_SLOT_TYPES = ("ptr", "i64", "i32", "u32", "f32", "f64", "axes")
AXES_SLOTS = 6  # a RowAxes parameter (kernels/norm_traits.cuh): three i64 strides, two u32 sizes, their dividers
_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")


def divider(d: int) -> tuple:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for every n < 2^31 (1 <= d < 2^31): the
    kernels' `divide`, a row's three-axis indices without a division instruction."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divider: {d} is outside [1, 2^31)")
    shift = (d - 1).bit_length()  # the least s with 2^s >= d
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def f32_bits(value: float) -> int:
    """The bits of `value` as a float32, in the low half of a slot."""
    return _U32.unpack(_F32.pack(value))[0]


def f64_bits(value: float) -> int:
    """The bits of `value` as a float64: a whole slot."""
    return _U64.unpack(_F64.pack(value))[0]


class Launch:
    """One kernel launch. `args` lists the kernel's parameters in order:
    ("ptr", name) (a pointer among the call's values; 0 when absent),
    ("i64" | "i32" | "u32", int, or the name of a per-call integer),
    ("f32" | "f64", float, or the name of a per-call scalar: its bits,
    `f32_bits` / `f64_bits`), ("axes", (s0, s1,
    s2, d1, d2)) (a RowAxes struct, AXES_SLOTS slots, with the dividers of d1 and d2). Each parameter has
    slots of 8 bytes of its own. `bind` turns names into positions and lays
    the slots out: the per-call ones first, in one run, then the constants
    (written once; cuLaunchKernel finds each parameter through its own
    pointer, so the slots need not follow the parameters' order). A call
    writes the per-call run with one `struct.pack_into` and launches.
    `cooperative`: launched with cuLaunchCooperativeKernel, which runs every
    CTA of the grid at once or refuses (a kernel with a grid-wide barrier)."""

    def __init__(self, kernel, grid: int, args: list, cooperative: bool = False):
        self.kernel, self.grid, self.args, self.cooperative = kernel, grid, args, cooperative
        self.function = kernel.function.kernel.ptr
        self.threads, self.smem = kernel.threads, kernel.smem
        for kind, _ in args:
            if kind not in _SLOT_TYPES:
                raise ValueError(f"unknown parameter kind {kind!r}")
        self.bind({})

    def bind(self, positions: dict):
        """Resolves the names of pointers and per-call scalars to positions in
        the call's values (a name with no position is a constant 0) and lays
        out the slots: the parameters a call writes first, then the rest."""
        picks, per_call = [], set()
        for i, (kind, value) in enumerate(self.args):
            at = positions.get(value) if isinstance(value, str) else None
            if at is not None:
                picks.append(at)
                per_call.add(i)
        order = sorted(range(len(self.args)), key=lambda i: i not in per_call)  # stable: per-call ones first
        firsts, total = [0] * len(self.args), 0
        for i in order:
            firsts[i] = total
            total += AXES_SLOTS if self.args[i][0] == "axes" else 1
        self.firsts = firsts
        packed = np.zeros(max(1, total), np.uint64)
        for i, (kind, value) in zip(firsts, self.args):
            if isinstance(value, str):  # a pointer or a per-call scalar: written by each call (or 0)
                continue
            if kind == "axes":
                (m1, sh1), (m2, sh2) = divider(value[3]), divider(value[4])
                packed.view(np.int64)[i:i + 3] = value[:3]
                packed.view(np.uint32)[2 * (i + 3):2 * (i + 6)] = (*value[3:], m1, m2, sh1, sh2)
            elif kind == "i64":
                packed.view(np.int64)[i] = value
            elif kind in ("i32", "u32"):
                packed.view(np.uint32)[2 * i] = np.uint32(value % 2**32)
            elif kind == "f32":
                packed.view(np.float32)[2 * i] = value
            elif kind == "f64":
                packed.view(np.float64)[i] = value
        self.slots = array.array("Q", packed.tobytes())
        address = self.slots.buffer_info()[0]
        # The parameter array cuLaunchKernel reads: the address of each parameter's first slot.
        self._params = array.array("Q", (address + 8 * i for i in firsts))
        self.params = self._params.buffer_info()[0]
        # A call packs _get(values), always a tuple (itemgetter of one position gives no tuple; of none, nothing).
        self._pack = struct.Struct(f"<{len(picks)}Q").pack_into
        if len(picks) > 1:
            self._get = operator.itemgetter(*picks)
        elif picks:
            at = picks[0]
            self._get = lambda values: (values[at],)
        else:
            self._get = lambda values: ()

    def __call__(self, values: list, stream: int):  # CallPlan.run and its one-launch closure do the same inline
        self._pack(self.slots, 0, *self._get(values))
        if self.cooperative:
            _launch_cooperative(self.function, self.grid, 1, 1, self.threads, 1, 1, self.smem, stream, self.params)
        else:
            _launch(self.function, self.grid, 1, 1, self.threads, 1, 1, self.smem, stream, self.params, 0)


def _same_view(a, b) -> bool:
    """Whether two arrays at one pointer are the same view: shape, strides and dtype (each kind's key part)."""
    ka, kb = kind_of(a), kind_of(b)
    return ka is kb and ka is not None and ka.keypart(a)[0][:3] == kb.keypart(b)[0][:3]


_launch_lock = threading.Lock()  # packed slots and arenas: filled and launched together (one lock: all threads)


def _current_device() -> int:
    from cupy_backends.cuda.api.runtime import getDevice

    global _current_device
    _current_device = getDevice  # looked up once
    return getDevice()


def _launch(*args):
    from cupy_backends.cuda.api.driver import launchKernel

    global _launch
    _launch = launchKernel  # looked up once
    launchKernel(*args)


def _launch_cooperative(*args):
    from cupy_backends.cuda.api.driver import launchCooperativeKernel

    global _launch_cooperative
    _launch_cooperative = launchCooperativeKernel  # looked up once
    launchCooperativeKernel(*args)


@dataclass(frozen=True)
class Output:
    """An array a call allocates: `offset` elements past an aligned start (so
    that it sits at x's offset from a vector boundary)."""

    name: str
    shape: tuple
    dtype: np.dtype
    offset: int = 0
    like: str | None = None  # an argument C-contiguous with this shape and dtype (per the key): empty_like


def span(shape: tuple, strides: tuple, itemsize: int) -> int:
    """Bytes from an array's first element to one past its last (non-negative strides)."""
    if math.prod(shape) == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


class CallPlan:
    """Everything a repeated call with one cache key does.

    names: the call's array arguments in key order; anchor: the one whose
    kind the call has (outputs are made beside it; default the first).
    launches: Launch objects whose pointers name arguments, outputs or
    scratch. outputs: allocated per call through the caller's kind. scratch:
    (name, bytes) of working memory, carved from one block (`scratch.scratch_pointer`);
    a launch may also name "control": words that are 0 at its start and that
    it leaves at 0. copies: arguments copied to fresh contiguous arrays on every
    call (layouts the kernels cannot read in place): a name, or (name, numpy
    dtype) to convert while copying. zeros: outputs filled
    with 0 (column sums of no rows). given_out: (argument, output) when
    `out=` replaces that output; checked against the inputs' `spans`
    (disjoint extents pass at once, and so does an input named in `aliases`
    that is exactly out's view: same pointer, shape, strides and dtype, which
    the exact test allows too; anything else goes to `full_overlap_check(objs)`,
    the first call's exact test, which raises).
    scalars: names of per-call scalars (their bits). result(objs, outputs): the
    return value (None, the default: the first output). absent: arguments the cache key holds as None, whose
    pointers the launches take as the constant 0 (fewer slots a call).
    """

    def __init__(self, kind, device_id: int, names: tuple, launches: tuple, *, anchor=None, outputs=(), scratch=(),
                 copies=(), zeros=(), given_out=None, spans=None, full_overlap_check=None, aliases=(), scalars=(),
                 result=None, absent=()):
        self.kind, self.device_id, self.names, self.launches = kind, device_id, tuple(names), tuple(launches)
        self.outputs, self.scratch, self.zeros = tuple(outputs), tuple(scratch), tuple(zeros)
        self.given_out, self.full_overlap_check, self.result = given_out, full_overlap_check, result
        self.copies = tuple((self.names.index(c), None) if isinstance(c, str) else (self.names.index(c[0]), c[1])
                            for c in copies)
        self.spans = tuple((self.names.index(k), s) for k, s in (spans or {}).items() if s)
        self.out_at = None if given_out is None else self.names.index(given_out[0])
        self.out_span = dict(self.spans).get(self.out_at, 0)
        self.alias_at = frozenset(self.names.index(a) for a in aliases if a in self.names)
        specs = [(o.shape, o.dtype, o.offset) for o in self.outputs]
        likes = [None if o.like is None else self.names.index(o.like) for o in self.outputs]
        anchor_at = self.names.index(anchor or self.names[0])
        self.make_outputs = kind.allocation(specs, anchor_at, likes) if any(i is not None for i in likes) else \
            kind.allocation(specs, anchor_at)
        stream_function = getattr(kind, "stream_function", None)  # the kind's stream of a device, resolved once
        self.stream_of = getattr(kind, "stream", None) if stream_function is None else stream_function()
        # Positions of every pointer a launch may name: arguments, outputs, scratch, the control words (with
        # scratch), then the scalars.
        positions = {name: i for i, name in enumerate(self.names) if name not in absent}  # absent: constant 0
        at = len(self.names)  # values: the arguments' pointers, then these
        for o in self.outputs:
            positions[o.name] = at
            at += 1
        self.scratch_starts, total = [], 0
        for name, nbytes in self.scratch:
            positions[name] = at
            at += 1
            self.scratch_starts.append(total)
            total += -(-nbytes // 256) * 256
        self.scratch_bytes = total
        self.control = any(("ptr", "control") in launch.args for launch in self.launches)
        if self.scratch_bytes:  # the control words come with the scratch block
            positions["control"] = at
            at += 1
        elif self.control:
            raise ValueError("a launch names the control words of a plan without scratch")
        for name in scalars:
            positions[name] = at
            at += 1
        if given_out is not None:
            positions[given_out[1]] = self.out_at
        self.zero_at = tuple(positions[z] - len(self.names) for z in self.zeros)
        for launch in self.launches:
            launch.bind(positions)
        # Per launch: what Launch.__call__ reads (after bind), so that run launches without a frame per kernel.
        self._calls = tuple((k._pack, k._get, k.slots, k.cooperative, k.function, k.grid, k.threads, k.smem, k.params)
                            for k in self.launches)
        self._plain = given_out is None and not self.copies and not self.zeros  # run skips their steps
        if self._plain and len(self._calls) == 1 and not self.scratch_bytes and not self._calls[0][3]:
            self.run = self._one_launch_run(specs, anchor_at, likes)  # the common plan (a plain forward)

    def _one_launch_run(self, specs: list, anchor: int, likes: list):
        """`run` of a plan with one plain launch and no `out=`, copies, zeroed outputs or scratch, with
        everything it reads bound once (closure cells, not attribute lookups), and, where the call returns
        its one output (`result` None), that output made by the kind's `output` (no lists, no picker). It
        saves about a microsecond of a repeated call's ten on a GPU host (`docs/PERFORMANCE.md` version 64).
        `_launch` and `_current_device` stay module globals, looked up per call (tests spy on them); another
        current device takes the general run. A kind's `output(spec, anchor, like)` is optional."""
        (pack, get, slots, _, function, grid, threads, smem, params), = self._calls
        device_id, make_outputs, stream_of, result = self.device_id, self.make_outputs, self.stream_of, self.result
        plan, lock = weakref.ref(self), _launch_lock  # a weak reference: the plan holds this closure
        output_of = getattr(self.kind, "output", None)
        make_one = output_of(specs[0], anchor, likes[0]) if (
            result is None and len(specs) == 1 and output_of is not None) else None

        def run(objs: tuple, ptrs: list, scalars: tuple = ()):
            if _current_device() != device_id:
                return CallPlan.run(plan(), objs, ptrs, scalars)
            if make_one is not None:
                made, made_ptr = make_one(device_id, objs)
                values = ptrs + [made_ptr]
            else:
                made, made_ptrs = make_outputs(device_id, objs)
                values = ptrs + made_ptrs
            values += scalars
            stream = stream_of(device_id)
            lock.acquire()
            try:
                pack(slots, 0, *get(values))
                _launch(function, grid, 1, 1, threads, 1, 1, smem, stream, params, 0)
            finally:
                lock.release()
            if make_one is not None:
                return made
            return made[0] if result is None else result(objs, made)

        return run

    def run(self, objs: tuple, ptrs: list, scalars: tuple = ()):
        """The call: `objs` its array arguments in `names` order (None:
        absent), `ptrs` their data pointers (0: absent), `scalars` the
        bits of the per-call scalars (`f32_bits`, `f64_bits`)."""
        if _current_device() != self.device_id:
            import cupy

            with cupy.cuda.Device(self.device_id):
                return self.run(objs, ptrs, scalars)
        copies = None  # live until the launches are queued (stream-ordered pools)
        if not self._plain:  # out= (its overlap test), copies, zeroed outputs
            if self.out_at is not None:
                self._check_out(objs, ptrs)
            if self.copies:
                ptrs, copies = list(ptrs), []
                for i, dtype in self.copies:
                    if objs[i] is not None:
                        copy = self.kind.copy(objs[i], dtype)
                        copies.append(copy)
                        ptrs[i] = self.kind.describe(copy).ptr
        made, made_ptrs = self.make_outputs(self.device_id, objs)
        if not self._plain:
            for i in self.zero_at:
                self.kind.zero(made[i])
        if self.launches:
            values = ptrs + made_ptrs
            stream = self.stream_of(self.device_id)
            _launch_lock.acquire()  # not `with`: half the cost, on every call
            try:
                if self.scratch_bytes:
                    keep, base, control = scratch.scratch_pointer(self.kind, self.device_id, stream,
                                                                  self.scratch_bytes, self.control)
                    values += [base + start for start in self.scratch_starts]
                    values.append(control)
                values += scalars
                # Launch.__call__, inline (a frame less a kernel): the per-call slots, then the launch.
                for pack, get, slots, cooperative, function, grid, threads, smem, params in self._calls:
                    pack(slots, 0, *get(values))
                    if cooperative:
                        _launch_cooperative(function, grid, 1, 1, threads, 1, 1, smem, stream, params)
                    else:
                        _launch(function, grid, 1, 1, threads, 1, 1, smem, stream, params, 0)
            finally:
                _launch_lock.release()
        return made[0] if self.result is None else self.result(objs, made)

    def _check_out(self, objs: tuple, ptrs: list):
        o0 = ptrs[self.out_at]
        o1 = o0 + self.out_span
        for i, s in self.spans:
            p = ptrs[i]
            if i == self.out_at or not p:
                continue
            if not (o1 <= p or p + s <= o0):  # extents meet: in place, or the exact test decides (and raises)
                if p == o0 and i in self.alias_at and _same_view(objs[i], objs[self.out_at]):
                    continue
                self.full_overlap_check(dict(zip(self.names, objs)))
                return
