"""Kinds of GPU array a call may hold: CuPy arrays, torch tensors, and other
producers of `__cuda_array_interface__` or `__dlpack__`.

A kind answers what the host path asks of an array without building another
array around it: a cache key part and the data pointer (`keypart`, the one
per-call cost), a full description for a first call (`describe`), fresh
outputs through the kind's own allocator, the kind's current stream, and
copies. Results come back as the kind of x: torch tensors allocated by torch's
caching allocator and computed on torch's current stream for torch inputs,
CuPy arrays on CuPy's current stream for everything else.

torch is imported only when a torch tensor is handed in.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes

KEY_ALIGNMENT = 64  # pointers enter cache keys modulo this: every vector alignment a plan can depend on


class Tensor:
    """A GPU array as the host path sees it: pointer, shape, strides (bytes),
    dtype and device, read once from whatever produced it. `obj` is the
    producer's object (kept alive for the call), `kind` how to allocate beside it."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "itemsize", "device_id")

    def __init__(self, obj, kind, ptr: int, shape: tuple, strides: tuple, dtype, device_id: int):
        self.obj, self.kind, self.ptr = obj, kind, ptr
        self.shape, self.strides, self.dtype = tuple(shape), tuple(strides), np.dtype(dtype)
        self.itemsize, self.device_id = self.dtype.itemsize, device_id

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def c_contiguous(self) -> bool:
        expected = self.itemsize
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def __repr__(self):
        return f"Tensor({self.kind.name}, ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype})"


def _layout(specs) -> tuple:
    """(byte starts, total bytes) of outputs sharing one allocation: each
    starts `offset` elements past a 256-byte boundary."""
    starts, total = [], 0
    for shape, dt, offset, *_ in specs:
        starts.append(total + offset * dt.itemsize)
        total += -(-(math.prod(shape) + offset) * dt.itemsize // 256) * 256
    return starts, max(total, 256)


class CupyKind:
    """CuPy arrays: outputs from CuPy's memory pool, on CuPy's current stream."""

    name = "cupy"

    @staticmethod
    def keypart(a) -> tuple:
        mem = a.data
        ptr = mem.ptr
        return (a.shape, a.strides, a.dtype, ptr % KEY_ALIGNMENT, mem.device_id), ptr

    @classmethod
    def describe(cls, a) -> Tensor:
        return Tensor(a, cls, a.data.ptr, a.shape, a.strides, a.dtype, a.data.device_id)

    @staticmethod
    def allocation(specs, anchor: int, likes=None) -> object:
        """A function of (device, the call's arguments) making fresh outputs for
        `specs` ((shape, numpy dtype, offset in elements) each): one allocation
        carved into C-contiguous arrays, each `offset` elements past a 256-byte
        boundary. It returns ([array], [pointer]). `anchor`: the position of
        the argument of this kind that the call is for (on its device). `likes`: per output, the position
        of an argument C-contiguous with its shape and dtype, or None (unused here: one allocation)."""
        import cupy

        if not specs:
            return lambda device_id, objs: ([], [])
        if len(specs) == 1:
            return _as_lists(CupyKind.output(specs[0], anchor))
        specs = [_cupy_spec(spec) for spec in specs]
        starts, total = _layout(specs)
        alloc, ndarray = cupy.cuda.alloc, cupy.ndarray
        parts = [(shape, dt, start) for (shape, dt, *_), start in zip(specs, starts)]

        def make(device_id: int, objs):
            mem = alloc(total)
            base = mem.ptr
            return ([ndarray(shape, dt, mem + start if start else mem) for shape, dt, start in parts],
                    [base + start for start in starts])

        return make

    @staticmethod
    def output(spec, anchor: int, like=None) -> object:
        """As `allocation` for one output, returning (array, pointer): what a plan with one output calls."""
        import cupy

        shape, dt, _ = spec = _cupy_spec(spec)
        (start,), total = _layout([spec])
        alloc, ndarray = cupy.cuda.alloc, cupy.ndarray
        if start:
            def make_at(device_id: int, objs):
                mem = alloc(total)
                return ndarray(shape, dt, mem + start), mem.ptr + start

            return make_at

        def make(device_id: int, objs):
            mem = alloc(total)
            return ndarray(shape, dt, mem), mem.ptr

        return make

    @staticmethod
    def raw(device_id: int, nbytes: int) -> tuple:
        """Working memory: (what keeps it alive, its pointer)."""
        mem = _cupy_alloc(nbytes)
        return mem, mem.ptr

    @staticmethod
    def stream(device_id: int) -> int:
        return _cupy_stream().ptr

    @classmethod
    def stream_function(cls):
        return cls.stream

    @staticmethod
    def copy(obj, dtype=None):
        """A fresh C-contiguous copy (aligned like any new allocation) of an array of any kind, in `dtype`
        (a numpy dtype; None keeps the array's)."""
        import cupy

        return cupy.array(as_cupy(obj), dtype=dtype, copy=True, order="C")

    @staticmethod
    def zero(a):
        a.fill(0)


_FP8_DTYPES = tuple(dtypes.FP8.values())


def _cupy_spec(spec) -> tuple:
    """(shape, dtype, offset) of an output as CuPy holds it: CuPy has no fp8 dtype, so fp8 outputs come back
    as uint8 arrays of their bits (documented)."""
    shape, dt, offset = spec[:3]
    return shape, np.dtype(np.uint8) if dt in _FP8_DTYPES else dt, offset


def _as_lists(make_one):
    """An `allocation` function (lists of arrays and pointers) from a kind's `output` function."""
    def make(device_id: int, objs):
        a, ptr = make_one(device_id, objs)
        return [a], [ptr]

    return make


def _cupy_alloc(nbytes: int):
    import cupy

    global _cupy_alloc
    _cupy_alloc = cupy.cuda.alloc  # looked up once
    return _cupy_alloc(nbytes)


def _cupy_stream():
    import cupy

    global _cupy_stream
    _cupy_stream = cupy.cuda.get_current_stream  # looked up once
    return _cupy_stream()


def as_cupy(obj):
    """A CuPy view of any GPU array: DLPack first (it carries bf16, which
    __cuda_array_interface__ cannot name), else the array interface."""
    import cupy

    if isinstance(obj, cupy.ndarray):
        return obj
    return cupy.from_dlpack(obj) if hasattr(obj, "__dlpack__") else cupy.asarray(obj)


class TorchKind:
    """torch tensors: outputs from torch's caching allocator, on
    torch.cuda.current_stream() of the tensor's device."""

    name = "torch"
    _torch = None
    _dtypes: dict = {}
    _raw_stream = None

    @classmethod
    def load(cls):
        if cls._torch is None:
            import torch

            cls._dtypes = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                           torch.float64: np.dtype(np.float64)}
            if dtypes.BFLOAT16 is not None:
                cls._dtypes[torch.bfloat16] = dtypes.BFLOAT16
            cls._to_torch = {v: k for k, v in cls._dtypes.items()}
            cls._to_torch[np.dtype(np.bool_)] = torch.bool  # outputs only (a dropout mask)
            for name, dt in dtypes.FP8.items():  # outputs only: never an input dtype
                if hasattr(torch, name):
                    cls._to_torch[dt] = getattr(torch, name)
            # The raw stream handle without building a Stream object (about 30x cheaper); public API otherwise.
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            cls._raw_stream = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)
            cls._torch = torch
        return cls._torch

    @staticmethod
    def keypart(t) -> tuple:
        ptr = t.data_ptr()
        return (t.shape, t.stride(), t.dtype, ptr % KEY_ALIGNMENT, t.get_device()), ptr

    @classmethod
    def describe(cls, t) -> Tensor:
        torch = cls.load()
        if t.layout != torch.strided:
            raise TypeError(f"a {t.layout} tensor; pass a dense (strided) tensor")
        if t.device.type != "cuda":
            raise TypeError(f"a torch tensor on {t.device}; pass a CUDA tensor (or numpy arrays for the CPU "
                            f"reference)")
        dt = cls._dtypes.get(t.dtype)
        if dt is None:
            raise UnsupportedDtype(str(t.dtype).removeprefix("torch."))
        size = t.element_size()
        return Tensor(t, cls, t.data_ptr(), tuple(t.shape), tuple(s * size for s in t.stride()), dt,
                      t.get_device())

    @classmethod
    def allocation(cls, specs, anchor: int, likes=None) -> object:
        """As CupyKind.allocation, through torch's caching allocator: a tensor
        of its own for each output (outputs of a torch custom op may not share
        storage), made by the anchor's `new_empty` with the sizes as ints (a
        fraction of what `torch.empty` spends parsing a shape, dtype and
        device; every further view costs as much again), or, `offset`
        elements on, sliced from a longer one. An output with a `likes` position (an argument that the
        cache key shows C-contiguous with the output's shape and dtype) is `torch.empty_like` of it: no
        sizes or dtype to parse."""
        cls.load()
        likes = list(likes or [None] * len(specs))
        if len(specs) == 1:
            return _as_lists(cls.output(specs[0], anchor, likes[0]))
        if specs and None not in likes:  # every output like an argument (the plain backward)
            empty_like = cls._torch.empty_like

            def make_like(device_id: int, objs):
                out = [empty_like(objs[i]) for i in likes]
                return out, [t.data_ptr() for t in out]

            return make_like
        # new_empty's arguments: the sizes, or () for a 0-d output.
        made = [(tuple(shape), tuple(shape) or ((),), cls._to_torch[dt], offset) for shape, dt, offset in specs]

        def make(device_id: int, objs):
            a = objs[anchor]
            same = a.dtype
            out = []
            for shape, sizes, tdt, offset in made:
                if offset:
                    out.append(_empty_at(a, shape, tdt, offset))
                else:
                    out.append(a.new_empty(*sizes) if tdt is same else a.new_empty(*sizes, dtype=tdt))
            return out, [t.data_ptr() for t in out]

        return make

    @classmethod
    def output(cls, spec, anchor: int, like=None) -> object:
        """As `allocation` for one output, returning (tensor, pointer): what a plan with one output calls."""
        cls.load()
        shape, dt, offset = spec[:3]
        if like is not None:
            empty_like = cls._torch.empty_like

            def make_like(device_id: int, objs):
                t = empty_like(objs[like])
                return t, t.data_ptr()

            return make_like
        # new_empty's arguments: the sizes, or () for a 0-d output.
        sizes, tdt = tuple(shape) or ((),), cls._to_torch[dt]
        if offset:
            def make_at(device_id: int, objs):
                t = _empty_at(objs[anchor], shape, tdt, offset)
                return t, t.data_ptr()

            return make_at

        def make(device_id: int, objs):
            a = objs[anchor]
            t = a.new_empty(*sizes) if tdt is a.dtype else a.new_empty(*sizes, dtype=tdt)
            return t, t.data_ptr()

        return make

    @classmethod
    def raw(cls, device_id: int, nbytes: int) -> tuple:
        t = cls._torch.empty(nbytes, dtype=cls._torch.uint8, device=device_id)
        return t, t.data_ptr()

    @classmethod
    def stream(cls, device_id: int) -> int:
        return cls._raw_stream(device_id)

    @classmethod
    def stream_function(cls):
        cls.load()
        return cls._raw_stream

    @classmethod
    def copy(cls, obj, dtype=None):
        torch = cls.load()
        t = obj if isinstance(obj, torch.Tensor) else torch.from_dlpack(as_cupy(obj))
        if dtype is not None and cls._dtypes.get(t.dtype) != dtype:
            return t.to(cls._to_torch[np.dtype(dtype)], memory_format=torch.contiguous_format)
        return t.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def zero(a):
        a.zero_()


def _empty_at(a, shape: tuple, tdt, offset: int):
    """A fresh torch tensor of `shape` and dtype `tdt` beside `a`, `offset` elements past the start of its
    allocation: sliced from a longer one."""
    t = a.new_empty(math.prod(shape) + offset, dtype=tdt)[offset:]
    return t.view(shape) if len(shape) != 1 else t


class NumpyKind:
    """numpy arrays described like GPU ones, so that a numpy call is laid out
    and checked (layout, `out=` overlap, `traits=`) exactly as a GPU call
    would be before the reference computes it."""

    name = "numpy"

    @classmethod
    def describe(cls, a) -> Tensor:
        return Tensor(a, cls, a.__array_interface__["data"][0], a.shape, a.strides, a.dtype, -1)

    @staticmethod
    def copy(obj, dtype=None):
        return np.array(obj, dtype=dtype, copy=True, order="C")


class UnsupportedDtype(Exception):
    """A producer's dtype that has no numpy equivalent here (named for the error)."""


def kind_of(obj):
    """The kind of a GPU array, or None (numpy arrays, anything else)."""
    module = type(obj).__module__
    if module.startswith("cupy"):
        import cupy

        if isinstance(obj, cupy.ndarray):
            return CupyKind
    if module.startswith("torch"):
        torch = TorchKind.load()
        if isinstance(obj, torch.Tensor):
            return TorchKind
    return None


def dtype_error(name: str, e: UnsupportedDtype) -> TypeError:
    return TypeError(f"{name}: dtype {e.args[0]} is not supported; expected one of {', '.join(dtypes.NAMES)}")
