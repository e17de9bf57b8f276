"""Validation of a normalization call: every argument checked, named in its
errors, and the call reduced to its dispatch fields (`call_base`). Both the
GPU path and the numpy path start here, so they refuse the same things."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .. import arrays, dtypes

STATS_DTYPES = ("float32", "float64")  # what a backward takes mean and rstd in
ABSENT_DTYPE = "float32"  # the dtype named for an absent weight, bias or residual (keeps one compile per shape)


@dataclass(frozen=True)
class Direction:
    """What a direction's call lays out and checks its `out=` against."""

    arrays: tuple  # a call's arrays, in signature order ("out" last)
    row_inputs: tuple  # inputs read as row tensors, x first
    weights: tuple  # weight-like inputs (vectors, statistics): read, never written
    in_place: dict  # {output name: the inputs it may be exactly}


FORWARD = Direction(("x", "weight", "bias", "residual", "out", "scale"), ("x", "residual", "x1"),
                    ("weight", "bias", "scale", "rowscale", "weight1", "bias1"), {"out": ("x",)})
# The arrays a call with a branch (dropout, a row scale) or the parallel block (x1, a second weight) names
# after its direction's.
BRANCH_ARRAYS = {"forward": ("rowscale", "x1", "weight1", "bias1"), "backward": ("rowscale", "dy1", "weight1")}
SCALINGS = ("tensor", "row", "group")  # fp8 output scalings (traits_rules.QUANT_MODES less "none")
# The backward's "x" is y, the forward's output, in the memory-efficient form (`from_output`), which also
# reads the forward's bias.
BACKWARD = Direction(("dy", "x", "mean", "rstd", "weight", "dresidual", "out", "bias"),
                     ("x", "dy", "dresidual", "dy1"), ("weight", "mean", "rstd", "bias", "rowscale", "weight1"),
                     {"out": ("dy", "dresidual")})


def hidden_size(x: arrays.Arg) -> int:
    if x.array.ndim < 1:
        raise ValueError(f"{x.name}: needs at least one axis (the normalized last axis), got a 0-d array")
    n = x.array.shape[-1]
    if n == 0:
        raise ValueError(f"{x.name}: the last axis (hidden size) is empty; there is nothing to normalize")
    return n


def check_eps(eps) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}") from None
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"eps: must be finite and >= 0, got {eps}")
    return e


@dataclass(frozen=True)
class Branch:
    """Dropout and a row scale on the branch added to the residual before the
    norm (h = x0 * rowscale * keep / (1 - p) [+ residual]; `reference.branch_input`):
    the per-call values; the rowscale array is the call's "rowscale" argument."""

    dropout_p: float = 0.0
    seed: int = 0
    rowscale: bool = False
    return_mask: bool = False
    h_dtype: str | None = None  # residual_out's dtype without a residual (residual_dtype=; default x's)
    x1: bool = False  # the parallel branch x1 (forward) or its gradient asked for (backward, has_x1)

    @property
    def on(self) -> bool:
        """Whether x's branch transforms it (dropout, a row scale)."""
        return bool(self.dropout_p) or self.rowscale

    @property
    def writes_h(self) -> bool:
        """(forward) Whether h is written as residual_out without a residual."""
        return self.on or self.x1


NO_BRANCH = Branch()


def check_branch(args: dict, dropout_p, seed, return_mask: bool, x_name: str = "x") -> Branch:
    """Validates dropout_p (None: 0), seed, rowscale (args["rowscale"]) and return_dropout_mask."""
    if dropout_p is None:
        dropout_p = 0.0
    try:  # a number: not text, a bool or an array (float() would take some of those)
        if isinstance(dropout_p, (str, bytes, bool)) or np.ndim(dropout_p) != 0:
            raise TypeError
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}") from None
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1), got {dropout_p}")
    if p and seed is None:
        raise ValueError("seed: dropout_p > 0 needs a seed (an int: the mask is drawn from it, and the backward "
                         "draws the same mask from it)")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
            raise TypeError(f"seed: expected an int in [0, 2**64), got {seed!r}")
    if return_mask and not p:
        raise ValueError("return_dropout_mask: only with dropout_p > 0")
    R, X = args.get("rowscale"), args[x_name]
    if R is not None:
        arrays.check_dtype(R)
        arrays.check_shape(R, tuple(X.array.shape[:-1]), f"{X.name}.shape[:-1] (a scale per row)")
    return Branch(p, int(seed or 0), R is not None, bool(return_mask))


def _vector_arg(a, n: int, x_shape: tuple | None = None) -> str:
    """Checks a weight-like argument (shape (N,), any dtype of ours, any
    non-negative stride; with `x_shape`, also x_shape[-2:], a weight per head:
    see `per_head`) and returns its dtype name; ABSENT_DTYPE for None."""
    if a is None:
        return ABSENT_DTYPE
    d = arrays.check_dtype(a)
    if not (x_shape is not None and len(x_shape) >= 2 and a.array.ndim == 2):
        arrays.check_shape(a, (n,), "x's last axis")
    else:
        arrays.check_shape(a, tuple(x_shape[-2:]), "x.shape[-2:] (a weight per head)")
    return d


def per_head(weight, bias=None) -> bool:
    """Whether a call's weight or bias is per head ([heads, N]: row r takes head r % heads, heads = x.shape[-2],
    for q/k-norm over the head dim); a one-dimensional bias beside a per-head weight serves every head. The
    backward's dbias follows the weight's form, so a per-head bias needs a per-head weight."""
    w2, b2 = (a is not None and a.array.ndim == 2 for a in (weight, bias))
    if b2 and not w2:
        raise ValueError(f"bias: a bias per head {tuple(bias.array.shape)} needs a weight per head (x.shape[-2:]) too")
    return w2 or b2


def _dtype_arg(name: str, value, default: str, fp8: bool = False) -> str:
    """A dtype argument's name; fp8 formats only where `fp8` (a forward's out_dtype)."""
    if value is None:
        return default
    try:
        got = dtypes.name_of(value)
    except ValueError as e:
        raise TypeError(f"{name}: {e}") from None
    if got in dtypes.FP8_NAMES and not fp8:
        raise TypeError(f"{name}: {got} is only an output of the forward (out_dtype=, with a scaling)")
    return got


def _zero_centered(flag, weight):
    if flag and weight is None:
        raise ValueError("zero_centered_weight: needs a weight (the multiplier is 1 + weight)")
    return bool(flag)


def _out_dtype(out, out_dtype, default: str, what: str) -> str:
    """The dtype of an output that may be given (`out=`) or asked for (`out_dtype=`)."""
    want = _dtype_arg("out_dtype", out_dtype, None, fp8=not what) if out_dtype is not None else None
    if out is None:
        return want or default
    if want in dtypes.FP8_NAMES:
        raise ValueError(f"out: not taken with an fp8 out_dtype ({want}); the fp8 y is returned")
    have = arrays.check_dtype(out)
    if want is not None and want != have:
        raise TypeError(f"out: dtype {have} differs from out_dtype {want}")
    if what and have != default:
        raise TypeError(f"out: dtype {have} must be {what} ({default})")
    return have


def call_base(*, rms: bool, backward: bool, hidden_size: int, input_dtype: str, output_dtype: str,
              weight_dtype: str | None, bias_dtype: str | None, residual_dtype: str | None,
              zero_centered: bool, residual_out_dtype: str | None = None, per_head: bool = False,
              from_output: bool = False, quant: str = "none", amax: bool = False, branch: Branch = NO_BRANCH,
              rowscale_dtype: str | None = None, x1_dtype: str | None = None, weight1_dtype: str | None = None,
              bias1_dtype: str | None = None, dx1_dtype: str | None = None) -> dict:
    """The dispatch fields of a call (absent arguments: None dtypes). The
    residual read (forward) or dresidual (backward) and the residual_out
    written (forward only) are two tensors with a dtype each: residual_out
    defaults to the residual's dtype; with a branch (dropout, a row scale)
    it is written without a residual too (`branch.h_dtype`), and with x1.
    The parallel block's dtypes (x1, weight1, bias1; dx1) join where given."""
    if residual_out_dtype is not None and (backward or residual_dtype is None):
        raise ValueError("residual_out_dtype: only a forward call with a residual writes residual_out")
    if branch.writes_h and not backward and residual_dtype is None:
        residual_out_dtype = branch.h_dtype
    flags = {}
    if branch.dropout_p:
        flags["dropout"] = True
    if branch.rowscale:
        flags["rowscale_dtype"] = rowscale_dtype
    if branch.return_mask:
        flags["dropout_mask"] = True
    for name, value in (("x1_dtype", x1_dtype), ("weight1_dtype", weight1_dtype), ("bias1_dtype", bias1_dtype),
                        ("dx1_dtype", dx1_dtype)):
        if value is not None:
            flags[name] = value
    return dict(hidden_size=hidden_size, input_dtype=input_dtype, output_dtype=output_dtype,
                weight_dtype=weight_dtype or ABSENT_DTYPE, bias_dtype=bias_dtype or ABSENT_DTYPE,
                residual_dtype=residual_dtype or ABSENT_DTYPE,
                residual_out_dtype=ABSENT_DTYPE if backward else (residual_out_dtype or residual_dtype
                                                                  or ABSENT_DTYPE),
                has_weight=weight_dtype is not None, has_bias=bias_dtype is not None, rms=rms,
                has_residual=residual_dtype is not None, zero_centered=zero_centered, backward=backward,
                per_head=per_head, **({"from_output": True} if from_output else {}),
                **({"quant": quant, "amax": amax} if quant != "none" else {}), **flags)


def _scaling(y_dtype: str, x_dtype: str, n: int, O, S, scaling, return_amax) -> tuple:
    """(quant, amax) of a forward call: how an fp8 y is scaled, and whether its amax is kept."""
    fp8 = y_dtype in dtypes.FP8_NAMES
    if scaling is None and S is not None:
        scaling = "tensor"
    if not fp8:
        for name, given in (("scaling", scaling), ("return_amax", return_amax or None)):
            if given is not None:
                raise ValueError(f"{name}: only for an fp8 out_dtype ({' or '.join(dtypes.FP8_NAMES)})")
        return "none", False
    if O is not None:
        raise ValueError(f"out: not taken with an fp8 out_dtype ({y_dtype}); the fp8 y is returned")
    if x_dtype == "float64":
        raise TypeError(f"out_dtype: {y_dtype} needs x of float32, float16 or bfloat16, not float64")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling: {y_dtype} output needs scaling= one of {', '.join(SCALINGS)} (or scale= for "
                         f"'tensor'), got {scaling!r}")
    if (scaling == "tensor") != (S is not None):
        raise ValueError("scale: give a float32 one-element array exactly with scaling='tensor'")
    if S is not None:
        arrays.check_dtype(S, ("float32",))
        if S.array.size != 1:
            raise ValueError(f"scale: one element (the per-tensor scale), got shape {tuple(S.array.shape)}")
    if scaling == "group" and n % 128:
        raise ValueError(f"scaling: 'group' scales 128 columns at a time; the hidden size {n} is not a multiple")
    return scaling, bool(return_amax)


def forward_args(rms, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight, out_dtype, out,
                 scale=None, scaling=None, return_amax=False, dropout_p=0.0, seed=None, rowscale=None,
                 return_dropout_mask=False, x1=None, weight1=None, bias1=None):
    """Validates a forward call. Returns (args, on_gpu, base, eps, branch)."""
    args, on_gpu = arrays.take_all({"x": x}, {"weight": weight, "bias": bias, "residual": residual, "out": out,
                                              "scale": scale, "rowscale": rowscale, "x1": x1, "weight1": weight1,
                                              "bias1": bias1})
    branch = check_branch(args, dropout_p, seed, return_dropout_mask)
    X, W, B, R, O = (args[k] for k in FORWARD.arrays[:5])
    x_dtype = arrays.check_dtype(X)
    n = hidden_size(X)
    w_dtype, b_dtype = _vector_arg(W, n, X.array.shape), _vector_arg(B, n, X.array.shape)
    x1_dtype = _parallel_branch(args, X)
    if x1_dtype is not None:
        branch = dataclasses.replace(branch, x1=True)
    w1_dtype, b1_dtype = _second_weight(args, n, per_head(W, B))
    if R is not None:
        arrays.check_dtype(R)
        arrays.check_shape(R, X.array.shape, "x's shape")
    elif branch.writes_h:  # residual_out = h is written without a residual too: residual_dtype is its dtype
        branch = dataclasses.replace(branch, h_dtype=_dtype_arg("residual_dtype", residual_dtype, x_dtype))
        residual_dtype = None
    elif residual_dtype is not None:
        raise ValueError("residual_dtype: given without a residual (or dropout_p / rowscale / x1)")
    res_dtype = R.dtype_name if R is not None else None  # the residual as read
    res_out_dtype = _dtype_arg("residual_dtype", residual_dtype, res_dtype)  # residual_out as written
    if O is not None:
        arrays.check_shape(O, X.array.shape, "x's shape")
    y_dtype = _out_dtype(O, out_dtype, x_dtype, "")
    quant, amax = _scaling(y_dtype, x_dtype, n, O, args["scale"], scaling, return_amax)
    base = call_base(rms=rms, backward=False, hidden_size=n, input_dtype=x_dtype, output_dtype=y_dtype,
                     weight_dtype=w_dtype if W is not None else None, bias_dtype=b_dtype if B is not None else None,
                     residual_dtype=res_dtype, residual_out_dtype=res_out_dtype,
                     zero_centered=_zero_centered(zero_centered_weight, W), per_head=per_head(W, B), quant=quant,
                     amax=amax, branch=branch,
                     rowscale_dtype=args["rowscale"].dtype_name if args["rowscale"] is not None else None,
                     x1_dtype=x1_dtype, weight1_dtype=w1_dtype, bias1_dtype=b1_dtype)
    if branch.on and quant != "none":
        raise ValueError("dropout_p / rowscale: not with an fp8 out_dtype (yet)")
    if w1_dtype is not None and quant != "none":
        raise ValueError("weight1: a second output is not made with an fp8 out_dtype")
    return args, on_gpu, base, check_eps(eps), branch


def _parallel_branch(args: dict, X) -> str | None:
    """x1's dtype (checked: x's shape, not beside a row scale), or None without one."""
    X1 = args.get("x1")
    if X1 is None:
        return None
    d = arrays.check_dtype(X1)
    arrays.check_shape(X1, X.array.shape, "x's shape")
    if args.get("rowscale") is not None:
        raise ValueError("rowscale: not with x1 (a row scale of the parallel branch is not defined)")
    return d


def _second_weight(args: dict, n: int, heads: bool) -> tuple:
    """(weight1's dtype, bias1's dtype) of the parallel block's second output (None: absent): vectors of N."""
    W1, B1 = args.get("weight1"), args.get("bias1")
    if W1 is None:
        if B1 is not None:
            raise ValueError("bias1: needs weight1 (the second output is xhat * weight1 + bias1)")
        return None, None
    _check_second_beside_first(args, heads)
    return _vector_arg(W1, n), None if B1 is None else _vector_arg(B1, n)


def _check_second_beside_first(args: dict, heads: bool):
    """A second weight needs the first, one weight for every row."""
    if heads:
        raise ValueError("weight1: a second output is not made beside per-head weights")
    if args.get("weight") is None:
        raise ValueError("weight1: a second output needs the first weight too")


def backward_args(rms, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight, out,
                  y=None, bias=None, dropout_p=0.0, seed=None, rowscale=None, dx0_dtype=None, dy1=None,
                  weight1=None, has_bias1=False, bias1_dtype=None, has_x1=False, dx1_dtype=None):
    """Validates a backward call. Returns (args, on_gpu, base, branch, dx0 dtype name or None); args["mean"]
    is None for RMSNorm. With `y` (the memory-efficient backward, from the forward's output) args["x"] is y
    (named so in errors), mean is not taken and args["bias"] is the forward's bias, whose presence decides
    dbias."""
    from_output = y is not None
    if from_output:
        if x is not None:
            raise TypeError("x: give x and the forward's statistics, or y= (its output, the memory-efficient "
                            "backward), not both")
        if mean is not None:
            raise TypeError("mean: not taken with y= (the memory-efficient backward needs rstd only)")
        args, on_gpu = arrays.take_all({"dy": dy, "y": y, "rstd": rstd},
                                       {"weight": weight, "dresidual": dresidual, "out": out, "bias": bias,
                                        "rowscale": rowscale, "dy1": dy1, "weight1": weight1})
        args["x"], args["mean"] = args.pop("y"), None
        has_bias = bias is not None
    else:
        if bias is not None:
            raise TypeError("bias: only with y= (the memory-efficient backward reads the forward's bias)")
        required = {"dy": dy, "x": x} | ({} if rms else {"mean": mean}) | {"rstd": rstd}
        args, on_gpu = arrays.take_all(required, {"weight": weight, "dresidual": dresidual, "out": out,
                                                  "rowscale": rowscale, "dy1": dy1, "weight1": weight1})
        args.setdefault("mean", None)
        args["bias"] = None
    branch = check_branch(args, dropout_p, seed, False)
    if dx0_dtype is not None and not branch.on:
        raise ValueError("dx0_dtype: only with dropout_p or rowscale (the branch input's gradient)")
    X, DY, W, DR, O = (args[k] for k in ("x", "dy", "weight", "dresidual", "out"))
    x_dtype = arrays.check_dtype(X)
    n = hidden_size(X)
    dy_dtype = arrays.check_dtype(DY)
    arrays.check_shape(DY, X.array.shape, f"{X.name}'s shape")
    lead = tuple(X.array.shape[:-1])
    # float32 or float64 statistics, whatever x is: the forward of a residual sum returns them in its x's
    # compute dtype, which residual_out (the backward's x) need not share. Converted to the backward's
    # compute dtype where they differ (`plans.backward_plan`; fp32 statistics limit fp64 dx to fp32 accuracy).
    for name in ("mean", "rstd"):
        if args[name] is not None:
            arrays.check_dtype(args[name], STATS_DTYPES)
            arrays.check_shape(args[name], lead, f"{X.name}.shape[:-1]")
    w_dtype = _vector_arg(W, n, X.array.shape)
    if DR is not None:
        arrays.check_dtype(DR)
        arrays.check_shape(DR, DY.array.shape, "dy's shape")
    if O is not None:
        arrays.check_shape(O, X.array.shape, f"{X.name}'s shape")
        _out_dtype(O, None, x_dtype, "x's dtype")
    has_bias = bool(has_bias)
    b_dtype = _dtype_arg("bias_dtype", bias_dtype, w_dtype) if has_bias else None
    B = args["bias"]
    if B is not None:  # from_output: dbias in the bias's dtype
        given = _vector_arg(B, n, X.array.shape)
        if bias_dtype is not None and b_dtype != given:
            raise TypeError(f"bias_dtype: {b_dtype} differs from the bias's dtype {given} (dbias takes the bias's)")
        b_dtype = given
    w1_dtype, b1_dtype = _second_output_grad(args, dy_dtype, n, per_head(W, B), has_bias1, bias1_dtype)
    if has_x1:
        branch = dataclasses.replace(branch, x1=True)
    elif dx1_dtype is not None:
        raise ValueError("dx1_dtype: only with has_x1=True (x1's gradient)")
    if dx1_dtype is not None and not branch.dropout_p:
        raise ValueError("dx1_dtype: only with dropout_p > 0 (without dropout x1's gradient is dx itself)")
    dx1 = _dtype_arg("dx1_dtype", dx1_dtype, x_dtype) if branch.x1 and branch.dropout_p else None
    base = call_base(rms=rms, backward=True, hidden_size=n, input_dtype=x_dtype, output_dtype=dy_dtype,
                     weight_dtype=w_dtype if W is not None else None, bias_dtype=b_dtype,
                     residual_dtype=DR.dtype_name if DR is not None else None,
                     zero_centered=_zero_centered(zero_centered_weight, W), per_head=per_head(W, B),
                     from_output=from_output, branch=branch,
                     rowscale_dtype=args["rowscale"].dtype_name if args["rowscale"] is not None else None,
                     weight1_dtype=w1_dtype, bias1_dtype=b1_dtype, dx1_dtype=dx1)
    dx0 = _dtype_arg("dx0_dtype", dx0_dtype, x_dtype) if branch.on else None
    if branch.on:
        base["dx0_dtype"] = dx0
    return args, on_gpu, base, branch, dx0


def _second_output_grad(args: dict, dy_dtype: str, n: int, heads: bool, has_bias1, bias1_dtype) -> tuple:
    """(weight1's dtype, dbias1's dtype or None) of a backward through the second output y1: dy1 (dy's shape
    and dtype) and weight1 come together; (None, None) without them."""
    DY1, W1 = args.get("dy1"), args.get("weight1")
    if (DY1 is None) != (W1 is None):
        missing = "weight1" if W1 is None else "dy1"
        raise ValueError(f"{missing}: dy1 (the second output's gradient) and weight1 come together")
    if W1 is None:
        if has_bias1 or bias1_dtype is not None:
            raise ValueError("has_bias1: only with weight1 and dy1 (a second output)")
        return None, None
    _check_second_beside_first(args, heads)
    got = arrays.check_dtype(DY1)
    arrays.check_shape(DY1, args["dy"].array.shape, "dy's shape")
    if got != dy_dtype:
        raise TypeError(f"dy1: dtype {got} must be dy's ({dy_dtype}): y and y1 share the output dtype")
    w1 = _vector_arg(W1, n)
    return w1, _dtype_arg("bias1_dtype", bias1_dtype, w1) if has_bias1 else None
