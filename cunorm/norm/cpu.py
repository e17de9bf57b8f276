"""The numpy path: validated calls on numpy arrays run the float64 reference
on the CPU and return numpy arrays in the dtypes the GPU path would."""
from __future__ import annotations

from .. import dtypes, reference
from . import calls


def _arr(a):
    return None if a is None else a.array


def forward(args: dict, base: dict, eps: float, rms: bool, return_stats: bool, branch=calls.NO_BRANCH):
    X, W, B, R, O = (args[k] for k in ("x", "weight", "bias", "residual", "out"))
    zc = base["zero_centered"]
    x0, keep = reference.branch_input(X.array, dropout_p=branch.dropout_p, seed=branch.seed,
                                      rowscale=_arr(args.get("rowscale")))
    h = reference.add_residual(x0, _arr(R))
    if rms:
        y, rstd = reference.rms_norm(h, _arr(W), eps, bias=_arr(B), zero_centered_weight=zc)
        stats = [rstd]
    else:
        y, mean, rstd = reference.layer_norm(h, _arr(W), _arr(B), eps, zero_centered_weight=zc)
        stats = [mean, rstd]
    quant = base.get("quant", "none")
    extras = []
    if quant != "none":  # fp8 y, its scales and amax, rounded as the kernels round them
        S = args.get("scale")
        y, scales, amax = reference.quantize_fp8(y, base["output_dtype"], quant, None if S is None else S.array)
        extras = ([scales] if scales is not None else []) + ([amax] if base.get("amax") else [])
    else:
        y = y.astype(dtypes.numpy_dtype(base["output_dtype"]))
    if O is not None:
        O.array[...] = y
        y = O.array
    values = [y]
    if R is not None:
        values.append(h.astype(dtypes.numpy_dtype(base["residual_out_dtype"])))
    elif branch.on:  # h, for the backward: residual_dtype's (default x's) without a residual
        values.append(h.astype(dtypes.numpy_dtype(branch.h_dtype)))
    values += extras
    if branch.return_mask:
        values.append(keep)
    if return_stats:
        values += [s.astype(dtypes.compute_dtype(base["input_dtype"])) for s in stats]
    return values[0] if len(values) == 1 else tuple(values)


def backward(args: dict, base: dict, rms: bool, branch=calls.NO_BRANCH, dx0_dtype: str | None = None):
    X, DY, W, DR, O = (args[k] for k in ("x", "dy", "weight", "dresidual", "out"))
    zc = base["zero_centered"]
    w_np, b_np = dtypes.numpy_dtype(base["weight_dtype"]), dtypes.numpy_dtype(base["bias_dtype"])
    if base.get("from_output"):  # X is the forward's output y
        dx, dw, db = reference.norm_backward_from_output(DY.array, X.array, args["rstd"].array, _arr(W),
                                                         _arr(args.get("bias")), rms=rms, dresidual=_arr(DR),
                                                         zero_centered_weight=zc)
    elif rms:
        dx, dw = reference.rms_norm_backward(DY.array, X.array, args["rstd"].array, _arr(W), dresidual=_arr(DR),
                                             zero_centered_weight=zc)
        db = reference.bias_grad(DY.array, _arr(W))
    else:
        dx, dw, db = reference.layer_norm_backward(DY.array, X.array, args["mean"].array, args["rstd"].array,
                                                   _arr(W), dresidual=_arr(DR), zero_centered_weight=zc)
    grads = []
    if branch.on:  # the branch input's gradient, from h's (dx: the residual's)
        keep = reference.dropout_keep(dx.shape, branch.dropout_p, branch.seed) if branch.dropout_p else None
        dx0 = reference.branch_grad(dx, keep, branch.dropout_p, _arr(args.get("rowscale")))
        grads.append(dx0.astype(dtypes.numpy_dtype(dx0_dtype)))
    dx = dx.astype(X.array.dtype)
    if O is not None:
        O.array[...] = dx
        dx = O.array
    dw = None if dw is None else dw.astype(w_np)
    if rms and not base["has_bias"]:
        return (dx, *grads, dw)
    return (dx, *grads, dw, db.astype(b_np) if base["has_bias"] else None)
