"""The floating-point types cunorm kernels read and write, by name."""
from __future__ import annotations

import numpy as np

try:  # bf16 arrays are ml_dtypes.bfloat16 (CuPy 14 accepts them)
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

# name -> (C++ storage type in kernels/cunorm_common.cuh, bytes)
CXX_TYPES = {"float32": ("float", 4), "float16": ("cn_half", 2), "bfloat16": ("cn_bf16", 2), "float64": ("double", 8),
             "float8_e4m3fn": ("cn_fp8e4m3", 1), "float8_e5m2": ("cn_fp8e5m2", 1)}
FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")  # outputs only (forward `out_dtype`, with a scaling)
NAMES = tuple(n for n in CXX_TYPES if n not in FP8_NAMES)  # what every tensor may be


# Other names of our dtypes: the short ones the CLI takes, and torch's spellings.
ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
           "fp64": "float64", "double": "float64", "torch.float32": "float32", "torch.float16": "float16",
           "torch.bfloat16": "bfloat16", "torch.float64": "float64", "fp8_e4m3": "float8_e4m3fn",
           "e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
           "torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2"}
FP8 = {}  # name -> numpy (ml_dtypes) dtype
try:
    FP8 = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
except NameError:  # pragma: no cover - ml_dtypes is a dependency
    pass


def name_of(dtype) -> str:
    """Canonical name of a supported dtype (a numpy or ml_dtypes dtype, a
    torch dtype, or a name such as "bfloat16" or "bf16"); ValueError for
    anything else."""
    if isinstance(dtype, str) and dtype in CXX_TYPES:
        return dtype
    alias = ALIASES.get(dtype if isinstance(dtype, str) else str(dtype) if type(dtype).__module__ == "torch"
                        else None)
    if alias is not None:
        return alias
    if type(dtype).__module__ == "torch":
        raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(NAMES)}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(NAMES)}") from None
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bfloat16"
    if dt == np.float32:
        return "float32"
    if dt == np.float16:
        return "float16"
    if dt == np.float64:
        return "float64"
    for name, fp8 in FP8.items():
        if dt == fp8:
            return name
    raise ValueError(f"unsupported dtype {dt}; expected one of {', '.join(NAMES)}")


def numpy_dtype(name: str) -> np.dtype:
    if name in FP8:
        return FP8[name]
    if name == "bfloat16":
        if BFLOAT16 is None:
            raise ImportError("bfloat16 needs the ml_dtypes package")
        return BFLOAT16
    return np.dtype(name)


VECTOR_BYTES = 16  # the widest single load or store


def vector_elements(itemsize_bytes: int) -> int:
    """Elements of that size in the widest vector (at least 1)."""
    return max(1, VECTOR_BYTES // itemsize_bytes)


def itemsize(name: str) -> int:
    return CXX_TYPES[name][1]


def cxx_type(name: str) -> str:
    return CXX_TYPES[name][0]


def compute_dtype(input_dtype: str) -> str:
    """What the normalization kernels compute and keep statistics in for x of `input_dtype`."""
    return "float64" if input_dtype == "float64" else "float32"
