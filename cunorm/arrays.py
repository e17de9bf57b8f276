"""The one place that validates and normalizes array arguments.

Every error names the argument it is about. GPU arrays are CuPy arrays,
torch tensors, or anything with __cuda_array_interface__ or __dlpack__ (taken
zero-copy, see `cunorm.kinds`); numpy arrays select the float64 reference on
the CPU.
"""
from __future__ import annotations

import numpy as np

from . import dtypes, kinds


class Arg:
    """One validated argument: the array, its name, and where it lives."""

    __slots__ = ("name", "array", "on_gpu")

    def __init__(self, name: str, array, on_gpu: bool):
        self.name, self.array, self.on_gpu = name, array, on_gpu

    @property
    def dtype_name(self) -> str:
        return dtypes.name_of(self.array.dtype)


def take(obj, name: str) -> Arg:
    """A numpy array (the CPU reference), or a GPU array of any kind described
    as a `kinds.Tensor` (pointer, shape, strides, dtype, device: no new array
    is built for CuPy arrays and torch tensors; other `__cuda_array_interface__`
    and `__dlpack__` producers are viewed as CuPy arrays). TypeError otherwise."""
    if isinstance(obj, np.ndarray):
        return Arg(name, obj, False)
    kind = kinds.kind_of(obj)
    if kind is None:
        if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__") and not hasattr(
                obj, "__cuda_array_interface__"):
            device_type = int(obj.__dlpack_device__()[0])
            if device_type != 2:  # kDLCUDA
                raise TypeError(f"{name}: a __dlpack__ array on a non-CUDA device (DLPack device type "
                                f"{device_type}); pass a numpy array for the CPU reference or a CUDA array")
        elif not hasattr(obj, "__cuda_array_interface__"):
            raise TypeError(f"{name}: expected a cupy or numpy array, a torch tensor (or a CUDA array with "
                            f"__cuda_array_interface__ or __dlpack__), got {type(obj).__name__}")
        obj, kind = kinds.as_cupy(obj), kinds.CupyKind
    try:
        return Arg(name, kind.describe(obj), True)
    except kinds.UnsupportedDtype as e:
        raise kinds.dtype_error(name, e) from None
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None


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
        if a.on_gpu and a.array.device_id != first.array.device_id:
            raise ValueError(f"{a.name}: is on GPU {a.array.device_id} but {first.name} is on GPU "
                             f"{first.array.device_id}")
    return args, first.on_gpu


def described(args: dict) -> dict:
    """numpy arguments described as GPU arrays are (`kinds.NumpyKind`), so that
    a numpy call goes through the GPU path's layout and traits checks."""
    return {k: None if a is None else Arg(a.name, kinds.NumpyKind.describe(a.array), True) for k, a in args.items()}


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
