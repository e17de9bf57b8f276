"""The one place that validates and normalizes array arguments.

Every error names the argument it is about. GPU arrays are CuPy arrays or
anything with __dlpack__ (taken zero-copy); numpy arrays select the float64
reference on the CPU.
"""
from __future__ import annotations

import numpy as np

from . import dtypes


class Arg:
    """One validated argument: the array, its name, and where it lives."""

    __slots__ = ("name", "array", "on_gpu")

    def __init__(self, name: str, array, on_gpu: bool):
        self.name, self.array, self.on_gpu = name, array, on_gpu

    @property
    def dtype_name(self) -> str:
        return dtypes.name_of(self.array.dtype)


def take(obj, name: str) -> Arg:
    """Wraps a numpy array, a CuPy array or a __dlpack__ object; TypeError otherwise."""
    if isinstance(obj, np.ndarray):
        return Arg(name, obj, False)
    if type(obj).__module__.startswith("cupy"):
        import cupy

        if isinstance(obj, cupy.ndarray):
            return Arg(name, obj, True)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        import cupy

        device_type = int(obj.__dlpack_device__()[0])
        if device_type != 2:  # kDLCUDA
            raise TypeError(f"{name}: a __dlpack__ array on a non-CUDA device (DLPack device type {device_type}); "
                            f"pass a numpy array for the CPU reference or a CUDA array")
        return Arg(name, cupy.from_dlpack(obj), True)
    raise TypeError(f"{name}: expected a cupy or numpy array (or a CUDA array with __dlpack__), "
                    f"got {type(obj).__name__}")


def take_all(required: dict, optional: dict) -> tuple:
    """Takes every argument, then checks they all live in one place: all
    numpy, or all on the same GPU. Returns ({name: Arg or None}, on_gpu)."""
    args = {name: take(obj, name) for name, obj in required.items()}
    args.update({name: None if obj is None else take(obj, name) for name, obj in optional.items()})
    present = [a for a in args.values() if a is not None]
    first = present[0]
    for a in present[1:]:
        if a.on_gpu != first.on_gpu:
            where = lambda x: "a GPU array" if x.on_gpu else "a numpy array"  # noqa: E731
            raise TypeError(f"{a.name}: is {where(a)} but {first.name} is {where(first)}; "
                            f"pass all arrays on the GPU or all as numpy")
        if a.on_gpu and a.array.device.id != first.array.device.id:
            raise ValueError(f"{a.name}: is on GPU {a.array.device.id} but {first.name} is on GPU "
                             f"{first.array.device.id}")
    return args, first.on_gpu


def check_dtype(arg: Arg, allowed=dtypes.NAMES) -> str:
    try:
        name = dtypes.name_of(arg.array.dtype)
    except ValueError:
        name = None
    if name not in allowed:
        raise TypeError(f"{arg.name}: dtype {arg.array.dtype} is not supported; expected one of {', '.join(allowed)}")
    return name


def check_shape(arg: Arg, shape: tuple, what: str):
    if tuple(arg.array.shape) != tuple(shape):
        raise ValueError(f"{arg.name}: shape {tuple(arg.array.shape)} does not match {what} {tuple(shape)}")


def check_aligned(arg: Arg, alignment: int):
    if arg.array.data.ptr % alignment:
        raise ValueError(f"{arg.name}: data pointer is not {alignment}-byte aligned (an offset view?); "
                         f"pass an aligned copy")
