"""cunorm: row-wise normalization kernels (LayerNorm, RMSNorm, attention delta) for CuPy.

Importing cunorm makes no CUDA call; kernels compile on first use.
"""
from . import reference
from .attention_delta import DeltaTraits, attention_delta
from .compiler import CompileError, compile_only
from .explain import Explanation, explain
from .layout import batch_invariant, set_batch_invariant
from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward
from .source import render
from .traits import Traits

__version__ = "0.1.0"

__all__ = ["CompileError", "DeltaTraits", "Explanation", "Traits", "attention_delta", "batch_invariant",
           "compile_only", "explain", "layer_norm", "layer_norm_backward", "reference", "render", "rms_norm",
           "rms_norm_backward", "set_batch_invariant", "__version__"]
