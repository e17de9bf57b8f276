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
    masks = [keep]
    if branch.x1:  # the parallel branch, its own mask
        x1, keep1 = reference.branch_input(args["x1"].array, dropout_p=branch.dropout_p, seed=branch.seed, stream=1)
        x0 = x0 + x1
        masks.append(keep1)
    h = reference.add_residual(x0, _arr(R))
    W1, B1 = _arr(args.get("weight1")), _arr(args.get("bias1"))
    if rms:
        y, rstd = reference.rms_norm(h, _arr(W), eps, bias=_arr(B), zero_centered_weight=zc)
        seconds = [reference.rms_norm(h, W1, eps, bias=B1, zero_centered_weight=zc)[0]] if W1 is not None else []
        stats = [rstd]
    else:
        y, mean, rstd = reference.layer_norm(h, _arr(W), _arr(B), eps, zero_centered_weight=zc)
        seconds = [reference.layer_norm(h, W1, B1, eps, zero_centered_weight=zc)[0]] if W1 is not None else []
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
    values = [y] + [y1.astype(y.dtype) for y1 in seconds]
    if R is not None:
        values.append(h.astype(dtypes.numpy_dtype(base["residual_out_dtype"])))
    elif branch.writes_h:  # h, for the backward: residual_dtype's (default x's) without a residual
        values.append(h.astype(dtypes.numpy_dtype(branch.h_dtype)))
    values += extras
    if branch.return_mask:
        values += masks
    if return_stats:
        values += [s.astype(dtypes.compute_dtype(base["input_dtype"])) for s in stats]
    return values[0] if len(values) == 1 else tuple(values)


def backward(args: dict, base: dict, rms: bool, branch=calls.NO_BRANCH, dx0_dtype: str | None = None):
    X, DY, W, DR, O = (args[k] for k in ("x", "dy", "weight", "dresidual", "out"))
    zc = base["zero_centered"]
    w_np, b_np = dtypes.numpy_dtype(base["weight_dtype"]), dtypes.numpy_dtype(base["bias_dtype"])
    mean = _arr(args.get("mean"))
    mean = reference.backward_mean(X.array, mean, args["rstd"].array, input_dtype=base["input_dtype"], rms=rms,
                                   from_output=bool(base.get("from_output")))  # refined on offset rows
    if base.get("from_output"):  # X is the forward's output y
        dx, dw, db = reference.norm_backward_from_output(DY.array, X.array, args["rstd"].array, _arr(W),
                                                         _arr(args.get("bias")), rms=rms, dresidual=_arr(DR),
                                                         zero_centered_weight=zc)
    elif rms:
        dx, dw = reference.rms_norm_backward(DY.array, X.array, args["rstd"].array, _arr(W), dresidual=_arr(DR),
                                             zero_centered_weight=zc)
        db = reference.bias_grad(DY.array, _arr(W))
    else:
        dx, dw, db = reference.layer_norm_backward(DY.array, X.array, mean, args["rstd"].array,
                                                   _arr(W), dresidual=_arr(DR), zero_centered_weight=zc)
    seconds = []
    if args.get("weight1") is not None:  # the second output: its gradient joins g (dresidual counted once)
        xhat = reference.recovered_xhat(X.array, args["rstd"].array, mean,
                                        weight=_arr(W), bias=_arr(args.get("bias")),
                                        from_output=bool(base.get("from_output")), zero_centered_weight=zc)
        dx, dw, db, dw1, db1 = reference.parallel_backward(DY.array, args["dy1"].array, xhat, args["rstd"].array,
                                                           _arr(W), args["weight1"].array, rms=rms,
                                                           dresidual=_arr(DR), zero_centered_weight=zc)
        has_b1 = base.get("bias1_dtype") is not None
        seconds = [dw1.astype(dtypes.numpy_dtype(base["weight1_dtype"]))]
        if has_b1 or not rms:
            seconds.append(db1.astype(dtypes.numpy_dtype(base["bias1_dtype"])) if has_b1 else None)
    grads = []
    if branch.on:  # the branch input's gradient, from h's (dx: the residual's)
        keep = reference.dropout_keep(dx.shape, branch.dropout_p, branch.seed) if branch.dropout_p else None
        dx0 = reference.branch_grad(dx, keep, branch.dropout_p, _arr(args.get("rowscale")))
        grads.append(dx0.astype(dtypes.numpy_dtype(dx0_dtype)))
    dx1 = None
    if branch.x1 and branch.dropout_p:  # x1's gradient, its own mask
        keep1 = reference.dropout_keep(dx.shape, branch.dropout_p, branch.seed, stream=1)
        dx1 = reference.branch_grad(dx, keep1, branch.dropout_p).astype(dtypes.numpy_dtype(base["dx1_dtype"]))
    dx = dx.astype(X.array.dtype)
    if O is not None:
        O.array[...] = dx
        dx = O.array
    if branch.x1:  # without dropout x1's gradient is dx itself
        grads.append(dx if dx1 is None else dx1)
    dw = None if dw is None else dw.astype(w_np)
    if rms and not base["has_bias"]:
        return (dx, *grads, dw, *seconds)
    return (dx, *grads, dw, db.astype(b_np) if base["has_bias"] else None, *seconds)

