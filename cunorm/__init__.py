"""cunorm: row-wise normalization kernels (LayerNorm, ...) for CuPy.

Importing cunorm makes no CUDA call; kernels compile on first use.
"""
from . import reference
from .attention_delta import DeltaTraits, attention_delta
from .compiler import CompileError, compile_only
from .layer_norm import layer_norm, layer_norm_backward
from .source import render
from .traits import Traits

__version__ = "0.1.0"

__all__ = ["CompileError", "DeltaTraits", "Traits", "attention_delta", "compile_only", "layer_norm",
           "layer_norm_backward", "reference", "render", "__version__"]
