"""LayerNorm and RMSNorm, forward and backward.

A call is keyed by its arrays' layouts and its flags (`cunorm.plan.call_key`):
a repeated call runs its cached `launch.CallPlan` at once; a first call is
validated (`calls`), laid out and planned (`plans`), cached, then run the
same way. numpy arrays take the float64 reference (`cpu`). The flags in a
key are exactly the arguments that change what runs (eps is a per-call
value: checked when first seen, then looked up).
"""
from __future__ import annotations

from .. import arrays, plan
from ..launch import f32_bits, f64_bits
from ..reference import dropout_threshold
from ..source import check_source
from . import calls, cpu, plans
from .calls import call_base  # noqa: F401  (call_base: the checker's dispatch fields)


def _objs_and_ptrs(args: dict, names: tuple) -> tuple:
    objs = tuple(None if args.get(k) is None else args[k].array.obj for k in names)
    ptrs = [0 if args.get(k) is None else args[k].array.ptr for k in names]
    return objs, ptrs


_EPS: dict = {}  # eps as given -> (float32 bits, float64 bits) (plans.EPS_SCALARS): checked once per value
_CALLS = plan.CALLS
_call_key = plan.call_key


def _eps_bits(eps) -> tuple:
    try:
        bits = _EPS.get(eps)
    except TypeError:  # unhashable: checked below, and refused
        bits = None
    if bits is None:
        e = calls.check_eps(eps)
        bits = (f32_bits(e), f64_bits(e))
        if len(_EPS) < 256:
            _EPS[eps] = bits
    return bits


# Each public op first tries its cached plan (`plan.call_key`: the flags, then each array's layout), in
# its own body (a frame less: the hit path is counted in µs); a miss goes through `_forward` / `_backward`.
# The plain path is the one without dropout (dropout_p None or a zero number), a row scale, a mask, x1, a
# second weight or (backward) their gradients (a seed alone draws nothing and is ignored; anything but a
# number as dropout_p is refused by `calls.check_branch`).
_NUMBERS = (float, int)


def _check_as_on_gpu(prepare, args: dict, base: dict, traits, source=None):
    """The checks a GPU call makes that validation alone does not: the row
    layout, `out=` against the inputs, and `traits=` for the call (on an
    sm_90 GPU). numpy calls run them too, so both paths refuse the same things."""
    p = prepare(arrays.described(args), base)
    if traits is not None or source is not None:
        t = plan.resolve_traits(plans.Family, traits, p.base, plan.PREVIEW_ARCH)
        if source is not None:
            check_source(t, source)
    return p


def _forward_branch(rms, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight, return_stats,
                    out_dtype, out, traits, source, scale, scaling, return_amax, branch):
    """A forward with a branch or the parallel block: its cached plan, or `_forward`. `branch`: (dropout_p,
    seed, rowscale, return_dropout_mask, x1, weight1, bias1): keyed apart from the plain path, with rowscale,
    x1, weight1 and bias1 among the arrays, whether there is dropout and the mask among the flags; the
    per-call values (dropout_p, seed) are checked on every call (`_branch_call_bits`)."""
    p, seed, rowscale, return_mask, x1, weight1, bias1 = branch
    branch_bits = _branch_call_bits(p, seed)
    if branch_bits is None:  # not plain numbers: the full checks say why, or take them
        return _forward(rms, None, None, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight,
                        return_stats, out_dtype, out, traits, source, scale, scaling, return_amax, branch)
    values = (x, weight, bias, residual, out, scale, rowscale, x1, weight1, bias1)
    key, ptrs = _call_key(values, (rms, residual_dtype, zero_centered_weight, return_stats, out_dtype, scaling,
                                   return_amax, source, "branch", p > 0, bool(return_mask), traits))
    hit = _CALLS.get(key)
    if hit is not None:
        return hit.run(values, ptrs, _eps_bits(eps) + branch_bits)
    return _forward(rms, key, ptrs, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight,
                    return_stats, out_dtype, out, traits, source, scale, scaling, return_amax, branch)


def _forward(rms, key, ptrs, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight, return_stats,
             out_dtype, out, traits, source, scale=None, scaling=None, return_amax=False, branch=None):
    extended = branch is not None  # its cache key names the branch and parallel arrays
    args, on_gpu, base, eps, branch = calls.forward_args(rms, x, weight, bias, eps, residual, residual_dtype,
                                                         zero_centered_weight, out_dtype, out, scale, scaling,
                                                         return_amax, *(branch or ()))
    if not on_gpu:
        _check_as_on_gpu(plans.forward_prepare, args, base, traits, source)
        return cpu.forward(args, base, eps, rms, return_stats, branch)
    with plan.on_device(args["x"].array.device_id):
        call, _ = plans.forward_plan(args, base, traits, rms, bool(return_stats), source, extended=extended)
    plan.remember(key, call)
    bits = _eps_bits(eps) + (_branch_bits(branch.dropout_p, branch.seed) if branch.on else ())
    return call.run(*_objs_and_ptrs(args, call.names), bits)


def _branch_call_bits(p, seed):
    """`_branch_bits` of plain per-call values (a float or int dropout_p in [0, 1), an int seed below 2^64
    where p > 0), or None: anything else takes the full checks (`calls.check_branch`)."""
    if p.__class__ not in (float, int) or not 0 <= p < 1:
        return None
    if p and (seed.__class__ is not int or not 0 <= seed < 2**64):
        return None
    return _branch_bits(float(p), int(seed or 0))


def _branch_bits(p: float, seed: int) -> tuple:
    """The per-call scalars of a branch (`plans.BRANCH_SCALARS`): the seed, the dropout threshold, and
    1 / (1 - p) as float32 and float64 bits."""
    keep = 1.0 / (1.0 - p)
    return seed, dropout_threshold(p), f32_bits(keep), f64_bits(keep)


def _backward(rms, key, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight, out,
              traits, source, y=None, bias=None, branch=None):
    extended = branch is not None  # its cache key names the branch and parallel arrays
    args, on_gpu, base, branch, dx0_dtype = calls.backward_args(rms, dy, x, mean, rstd, weight, has_bias, bias_dtype,
                                                                dresidual, zero_centered_weight, out, y, bias,
                                                                *(branch or ()))
    if not on_gpu:
        _check_as_on_gpu(plans.backward_prepare, args, base, traits, source)
        return cpu.backward(args, base, rms, branch, dx0_dtype)
    with plan.on_device(args["x"].array.device_id):
        call, _ = plans.backward_plan(args, base, traits, rms, source, extended=extended, has_x1=branch.x1)
    plan.remember(key, call)
    return call.run(*_objs_and_ptrs(args, call.names),
                    _branch_bits(branch.dropout_p, branch.seed) if branch.on else ())


def _backward_branch(rms, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight, out,
                     traits, source, y, bias, branch):
    """A backward after a forward with a branch or the parallel block: keyed apart as the forward's
    (`_forward_branch`). `branch`: (dropout_p, seed, rowscale, dx0_dtype, dy1, weight1, has_bias1, bias1_dtype,
    has_x1, dx1_dtype)."""
    p, seed, rowscale, dx0_dtype, dy1, weight1, has_bias1, bias1_dtype, has_x1, dx1_dtype = branch
    branch_bits = _branch_call_bits(p, seed)
    if branch_bits is None:
        return _backward(rms, None, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight,
                         out, traits, source, y, bias, branch)
    values = (dy, x if y is None else y, mean, rstd, weight, dresidual, out, bias, rowscale, dy1, weight1)
    key, ptrs = _call_key(values, (3 if rms else 2, has_bias, bias_dtype, zero_centered_weight, y is None, source,
                                   "branch", p > 0, dx0_dtype, bool(has_bias1), bias1_dtype, bool(has_x1), dx1_dtype,
                                   traits))
    hit = _CALLS.get(key)
    if hit is not None:
        return hit.run(values, ptrs, branch_bits)
    return _backward(rms, key, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight,
                     out, traits, source, y, bias, branch)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, residual_dtype=None,
               zero_centered_weight=False, return_stats=False, out_dtype=None, out=None, scale=None, scaling=None,
               return_amax=False, dropout_p=0.0, seed=None, rowscale=None, return_dropout_mask=False, x1=None,
               weight1=None, bias1=None, traits=None, source=None):
    """LayerNorm over the last axis: y = (h - mean) / sqrt(var + eps) * w + bias,
    where h = x, or h = x + residual (summed in fp32) when a residual is given,
    and w = weight, or 1 + weight with `zero_centered_weight=True` (in fp32).

    Returns y (in `out_dtype`, default x's dtype; written into `out` when given,
    which may be x itself). With a residual, (y, residual_out) where
    residual_out = h in `residual_dtype` (default the residual's dtype). With
    `return_stats=True`, mean and rstd (float32, shape x.shape[:-1]) follow.

    x, residual and out: any hidden size, read and written in place when the
    last axis has unit stride and the leading axes merge into one row stride
    (other input layouts are copied first). weight and bias: optional, any
    dtype of fp32/fp16/bf16 each, any non-negative stride (0 broadcasts one
    value). CuPy arrays run on CuPy's current stream and return CuPy arrays;
    torch tensors run on torch's current stream and return torch tensors;
    numpy arrays run the float64 reference. eps >= 0; a row of one element
    normalizes to 0 (y = bias). NaN or inf in a row makes that row's outputs NaN.
    `traits`: a cunorm.Traits or a mapping of its knobs, to force a kernel.
    `source`: the text of an edited copy of kernels/norm_fwd.cu (norm_bwd.cu
    for the backwards), compiled and run in place of the shipped file, with
    every check of the shipped path (see README, "Your own kernel").

    fp8 output: `out_dtype` float8_e4m3fn or float8_e5m2 stores q = y / scale
    rounded to nearest even and saturated to the format's finite range, with
    `scaling` "tensor" (the float32 one-element array `scale=`, on x's
    device), "row" or "group" (scale = amax(|y|) / the format's largest value
    per row, or per 128 columns of a row; these scales, float32 of shape
    x.shape[:-1] or x.shape[:-1] + (N // 128,), follow y and residual_out in
    the result). `return_amax=True` appends the call's largest |y| (float32,
    0-d) for delayed scaling. torch tensors give torch float8 tensors, CuPy
    arrays uint8 arrays holding the fp8 bits (CuPy has no fp8 dtype), numpy
    arrays ml_dtypes float8 arrays.

    Dropout and a row scale on the branch before the residual add (cached
    apart; dropout_p and the seed are per-call values): h = x * rowscale * keep / (1 - dropout_p)
    [+ residual], rowscale of shape x.shape[:-1], keep drawn with probability
    1 - dropout_p from `seed` (an int; Philox4x32-10, counter-based, so the
    backward draws the same mask from the same seed: `reference.dropout_keep`
    says which elements). With either, residual_out = h is returned after y
    even without a residual (the backward takes it as x); with
    `return_dropout_mask=True` the keep mask (bool, x's shape) follows it.

    The parallel block (GPT-J / GPT-NeoX): `x1` (x's shape, any dtype) is a
    second branch summed into h, dropped out with a mask of its own (Philox
    stream 1; not with a row scale); h is then returned as residual_out, and
    with `return_dropout_mask=True` x1's mask follows x's. `weight1` (and
    `bias1`) give a second output y1 = xhat * w1 + bias1 from the same
    statistics (w1 = weight1, or 1 + weight1 when zero-centered; y1 in y's
    dtype; needs a weight; not with fp8 or per-head weights), returned right
    after y: (y, y1, residual_out, masks..., stats...).
    """
    if rowscale is None and x1 is None and weight1 is None and bias1 is None and not return_dropout_mask and (
            dropout_p is None or dropout_p.__class__ in _NUMBERS and not dropout_p):  # the plain cached path
        values = (x, weight, bias, residual, out, scale)
        key, ptrs = _call_key(values, (False, residual_dtype, zero_centered_weight, return_stats, out_dtype, scaling,
                                       return_amax, source, traits))
        hit = _CALLS.get(key)
        if hit is not None:
            bits = _EPS.get(eps) if eps.__class__ is float else None
            return hit.run(values, ptrs, bits or _eps_bits(eps))
        return _forward(False, key, ptrs, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight,
                        return_stats, out_dtype, out, traits, source, scale, scaling, return_amax)
    return _forward_branch(False, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight, return_stats,
                           out_dtype, out, traits, source, scale, scaling, return_amax,
                           (dropout_p, seed, rowscale, return_dropout_mask, x1, weight1, bias1))


def rms_norm(x, weight=None, eps=1e-6, *, bias=None, residual=None, residual_dtype=None, zero_centered_weight=False,
             return_stats=False, out_dtype=None, out=None, scale=None, scaling=None, return_amax=False, dropout_p=0.0,
             seed=None, rowscale=None, return_dropout_mask=False, x1=None, weight1=None, bias1=None, traits=None,
             source=None):
    """RMSNorm over the last axis: y = h * rstd * w (+ bias) with rstd = 1 / sqrt(mean(h^2) + eps),
    h = x or x + residual (fp32), w = weight or 1 + weight (`zero_centered_weight`).

    Returns y; with a residual (y, residual_out); with `return_stats=True` the
    float32 rstd is appended. Layouts, dtypes, `out=`, `traits=` and
    `source=` as in `layer_norm`, and fp8 outputs (`scale=`, `scaling=`,
    `return_amax=`) and the branch's dropout and row scale (`dropout_p=`,
    `seed=`, `rowscale=`, `return_dropout_mask=`) and the parallel block
    (`x1=`, `weight1=`, `bias1=`) too.
    """
    if rowscale is None and x1 is None and weight1 is None and bias1 is None and not return_dropout_mask and (
            dropout_p is None or dropout_p.__class__ in _NUMBERS and not dropout_p):  # the plain cached path
        values = (x, weight, bias, residual, out, scale)
        key, ptrs = _call_key(values, (True, residual_dtype, zero_centered_weight, return_stats, out_dtype, scaling,
                                       return_amax, source, traits))
        hit = _CALLS.get(key)
        if hit is not None:
            bits = _EPS.get(eps) if eps.__class__ is float else None
            return hit.run(values, ptrs, bits or _eps_bits(eps))
        return _forward(True, key, ptrs, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight,
                        return_stats, out_dtype, out, traits, source, scale, scaling, return_amax)
    return _forward_branch(True, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight, return_stats,
                           out_dtype, out, traits, source, scale, scaling, return_amax,
                           (dropout_p, seed, rowscale, return_dropout_mask, x1, weight1, bias1))


def layer_norm_backward(dy, x=None, mean=None, rstd=None, weight=None, *, y=None, bias=None, has_bias=True,
                        bias_dtype=None, dresidual=None, zero_centered_weight=False, out=None, dropout_p=0.0,
                        seed=None, rowscale=None, dx0_dtype=None, dy1=None, weight1=None, has_bias1=False,
                        bias1_dtype=None, has_x1=False, dx1_dtype=None, traits=None, source=None):
    """Gradients of `layer_norm` given dy and the forward's saved mean and rstd.

    x is what was normalized (residual_out when a residual was used). Returns
    (dx, dweight, dbias): dx in x's dtype (written into `out` when given, which
    may be dy or dresidual itself), plus dresidual when given (the skip path's
    gradient, so dx is then the gradient of both x and the residual); dweight
    (None without a weight) in the weight's dtype; dbias (None unless has_bias)
    in `bias_dtype` (default the weight's dtype, float32 without a weight).
    Accumulated in fp32, bitwise reproducible run to run. dweight does not change
    with zero_centered_weight.

    Memory-efficient form (the forward's input need not be kept): pass `y=`
    (the forward's output) instead of x and mean, with rstd, the weight and,
    if the forward had one, `bias=`: xhat = (y - bias) / weight. dx is then in
    y's dtype, and dbias is returned exactly when a bias is given. Inexact
    where the weight is near zero (xhat carries y's rounding divided by it);
    a zero multiplier gives xhat = 0 (lost: y = bias there).

    After a forward with dropout or a row scale: pass its residual_out as x
    and the same dropout_p, seed and rowscale;
    the result gains dx0, the gradient of the branch input, after dx (which
    is h's gradient: the residual's), in `dx0_dtype` (default x's dtype):
    (dx, dx0, dweight, dbias).

    After a forward with the parallel block: `has_x1=True` adds x1's
    gradient dx1 after dx0 (in `dx1_dtype`, default x's, under dropout; dx
    itself without dropout); `dy1` (y1's gradient, dy's shape and dtype) with
    `weight1` adds dweight1 and dbias1 (None unless `has_bias1`, in
    `bias1_dtype`, default weight1's) at the end:
    (dx, [dx0], [dx1], dweight, dbias, [dweight1, dbias1]).
    """
    if rowscale is not None or dx0_dtype is not None or dy1 is not None or weight1 is not None or has_bias1 \
            or bias1_dtype is not None or has_x1 or dx1_dtype is not None or not (
            dropout_p is None or dropout_p.__class__ in _NUMBERS and not dropout_p):  # not the plain path
        return _backward_branch(False, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight,
                                out, traits, source, y, bias, (dropout_p, seed, rowscale, dx0_dtype, dy1, weight1,
                                                               has_bias1, bias1_dtype, has_x1, dx1_dtype))
    values = (dy, x if y is None else y, mean, rstd, weight, dresidual, out, bias)
    key, ptrs = _call_key(values, (2, has_bias, bias_dtype, zero_centered_weight, y is None, source, traits))
    hit = _CALLS.get(key)
    if hit is not None:
        return hit.run(values, ptrs)
    return _backward(False, key, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight,
                     out, traits, source, y, bias)


def rms_norm_backward(dy, x=None, rstd=None, weight=None, *, y=None, bias=None, has_bias=False, bias_dtype=None,
                      dresidual=None, zero_centered_weight=False, out=None, dropout_p=0.0, seed=None, rowscale=None,
                      dx0_dtype=None, dy1=None, weight1=None, has_bias1=False, bias1_dtype=None, has_x1=False,
                      dx1_dtype=None, traits=None, source=None):
    """Gradients of `rms_norm`: (dx, dweight), as in `layer_norm_backward`;
    (dx, dweight, dbias) with `has_bias=True` (a forward with a bias). The
    memory-efficient form takes `y=` (and `bias=` if the forward had one)
    in place of x, and a forward with dropout or a row scale adds dx0 after
    dx, as in `layer_norm_backward`; the parallel block adds dx1 (`has_x1`)
    and, with `dy1` and `weight1`, dweight1 (and dbias1 with `has_bias1`)."""
    if rowscale is not None or dx0_dtype is not None or dy1 is not None or weight1 is not None or has_bias1 \
            or bias1_dtype is not None or has_x1 or dx1_dtype is not None or not (
            dropout_p is None or dropout_p.__class__ in _NUMBERS and not dropout_p):  # not the plain path
        return _backward_branch(True, dy, x, None, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight,
                                out, traits, source, y, bias, (dropout_p, seed, rowscale, dx0_dtype, dy1, weight1,
                                                               has_bias1, bias1_dtype, has_x1, dx1_dtype))
    values = (dy, x if y is None else y, None, rstd, weight, dresidual, out, bias)
    key, ptrs = _call_key(values, (3, has_bias, bias_dtype, zero_centered_weight, y is None, source, traits))
    hit = _CALLS.get(key)
    if hit is not None:
        return hit.run(values, ptrs)
    return _backward(True, key, dy, x, None, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight,
                     out, traits, source, y, bias)
