"""cunorm in a few lines: LayerNorm forward/backward and the attention row delta.

Run on a machine with a CUDA GPU:  python examples/quickstart.py
Without one, the same calls on numpy arrays run the float64 reference.
"""
import numpy as np

import cunorm

try:
    import cupy as xp

    xp.cuda.runtime.getDeviceCount()
    on_gpu = True
except Exception:  # no GPU: numpy arrays take the reference path
    xp, on_gpu = np, False

from ml_dtypes import bfloat16

rng = np.random.default_rng(0)
x = xp.asarray(rng.standard_normal((1024, 4096)).astype(bfloat16))
w = xp.asarray(rng.standard_normal(4096).astype(np.float32))  # fp32 weights beside bf16 activations
b = xp.asarray(rng.standard_normal(4096).astype(np.float32))

y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
dy = xp.asarray(rng.standard_normal(y.shape).astype(bfloat16))
dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
print("layer_norm:", y.dtype, y.shape, "dweight:", dw.dtype, dw.shape)

# The same call against the float64 reference (bf16 output: expect a few 1e-3).
host = (lambda a: a.get()) if on_gpu else (lambda a: a)  # noqa: E731
ref = cunorm.reference.layer_norm(host(x), host(w), host(b))[0]
err = np.linalg.norm(host(y).astype(np.float64) - ref) / np.linalg.norm(ref)
print(f"relative L2 error vs float64: {err:.1e}")

# Attention backward's row delta on [B, M, H, K] views of a fused buffer.
qkv = xp.asarray(rng.standard_normal((2, 128, 3 * 8 * 64)).astype(bfloat16))
o = qkv[:, :, 8 * 64:16 * 64].reshape(2, 128, 8, 64)
do = xp.asarray(rng.standard_normal((2, 128, 8, 64)).astype(bfloat16))
print("attention_delta:", cunorm.attention_delta(o, do).shape)

# What runs, and the exact source: for reading, re-templating and bug reports. Rendering needs nothing;
# compiling needs NVRTC (CuPy), not a GPU.
t = cunorm.Traits(hidden_size=4096, input_dtype="bfloat16", weight_dtype="float32", warps_n=4)
print(cunorm.explain(cunorm.layer_norm, x, w, b))
print(cunorm.render(t)[:400], "...")
try:
    print(cunorm.compile_only(t, arch="sm_90").functions)
except ImportError as e:  # no CuPy, so no NVRTC
    print(f"compile_only needs NVRTC: {e}")
