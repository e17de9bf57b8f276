"""cunorm inside torch models (imports torch; install the `torch` extra).

`LayerNorm` and `RMSNorm` are drop-ins for torch.nn's (same constructor
arguments, parameters and state_dict) with a fused residual add,
zero-centered weights and `out_dtype`; `layer_norm`, `rms_norm` and
`attention_delta` are the functional forms; `replace_norms(model)` swaps a
model's torch.nn norms for them in place. Everything runs through the
torch.library custom ops in `cunorm.torch.ops` (`cunorm::norm_fwd`,
`cunorm::norm_bwd`, `cunorm::attention_delta`), which have fake
implementations for torch.compile and allocate through torch, on torch's
current stream, so that a warmed-up call can be captured in a CUDA graph.
"""
from .modules import LayerNorm, RMSNorm, attention_delta, layer_norm, replace_norms, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "attention_delta", "layer_norm", "replace_norms", "rms_norm"]
