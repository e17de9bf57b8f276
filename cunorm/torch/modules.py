"""Drop-in torch modules and functional forms over the custom ops: LayerNorm
and RMSNorm with torch.nn's constructor arguments, parameters and state_dict,
plus a fused residual add, zero-centered weights and `out_dtype`; and
`replace_norms`, which swaps a model's norms for them in place."""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor, nn

from . import ops


def _shape(normalized_shape) -> tuple:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


def _rows(x: Tensor, shape: tuple) -> Tensor:
    """x with its trailing `shape` dims as one (a view where torch can make one)."""
    k = len(shape)
    if tuple(x.shape[x.dim() - k:]) != shape:
        raise ValueError(f"x: trailing dims {tuple(x.shape[x.dim() - k:])} do not match normalized_shape {shape}")
    return x if k == 1 else x.reshape(*x.shape[:x.dim() - k], math.prod(shape))


def _flat(p: Tensor | None) -> Tensor | None:
    return p if p is None or p.dim() == 1 else p.reshape(-1)


def _norm(x, normalized_shape, weight, bias, eps, residual, residual_dtype, zero_centered_weight, out_dtype, rms,
          dropout_p=0.0, seed=None, rowscale=None, x1=None, weight1=None, bias1=None):
    shape = _shape(normalized_shape if normalized_shape is not None else x.shape[-1])
    rows = _rows(x, shape)
    res = None if residual is None else _rows(residual, shape)
    if dropout_p and seed is None:  # from torch's default generator: torch.manual_seed makes it repeat
        seed = int(torch.randint(0, 2**62, (1,)).item())
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError(f"seed: an int in [0, 2**63) through cunorm.torch (a custom op's int), got {seed!r}")
    if rowscale is not None:
        rowscale = rowscale.reshape(rows.shape[:-1])
    y, residual_out, _, _, y1 = ops.norm_fwd(rows, _flat(weight), _flat(bias), res, float(eps), rms,
                                             bool(zero_centered_weight), out_dtype,
                                             residual_dtype if residual is not None else None, rowscale,
                                             float(dropout_p), int(seed or 0), None if x1 is None else _rows(x1, shape),
                                             _flat(weight1), _flat(bias1))
    outs = [y.view(x.shape)] + ([y1.view(x.shape)] if weight1 is not None else [])
    outs += [residual_out.view(x.shape)] if residual is not None else []
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm(x: Tensor, normalized_shape=None, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, *, residual: Tensor | None = None, residual_dtype: torch.dtype | None = None,
               zero_centered_weight: bool = False, out_dtype: torch.dtype | None = None, dropout_p: float = 0.0,
               seed: int | None = None, rowscale: Tensor | None = None, x1: Tensor | None = None,
               weight1: Tensor | None = None, bias1: Tensor | None = None):
    """torch.nn.functional.layer_norm's arguments (normalized_shape defaults to
    the last dim), differentiable, plus a fused residual: with `residual`,
    returns (y, residual_out), residual_out = x + residual (in fp32, stored in
    `residual_dtype`, default the residual's) being what was normalized.
    Dropout and a row scale on x before the add (flash-attention's
    dropout_add_layer_norm): x * rowscale * keep / (1 - dropout_p), the mask
    drawn from `seed` (default: one drawn from torch's generator), not stored:
    the backward draws it again. rowscale (x.shape[:-1]) is not differentiated.
    The parallel block: x1 is added to h (dropped out with its own mask),
    and weight1 (and bias1) make a second output y1 after y: (y, y1) or
    (y, y1, residual_out)."""
    return _norm(x, normalized_shape, weight, bias, eps, residual, residual_dtype, zero_centered_weight, out_dtype,
                 rms=False, dropout_p=dropout_p, seed=seed, rowscale=rowscale, x1=x1, weight1=weight1, bias1=bias1)


def rms_norm(x: Tensor, normalized_shape=None, weight: Tensor | None = None, eps: float | None = None, *,
             bias: Tensor | None = None, residual: Tensor | None = None, residual_dtype: torch.dtype | None = None,
             zero_centered_weight: bool = False, out_dtype: torch.dtype | None = None, dropout_p: float = 0.0,
             seed: int | None = None, rowscale: Tensor | None = None, x1: Tensor | None = None,
             weight1: Tensor | None = None, bias1: Tensor | None = None):
    """torch.nn.functional.rms_norm's arguments (eps None: the machine epsilon
    of x's dtype, as torch), differentiable, plus a bias (y = xhat * w + b)
    and the residual, zero-centered, out_dtype, dropout, rowscale and
    parallel-block (x1, weight1, bias1) options of `layer_norm`."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _norm(x, normalized_shape, weight, bias, eps, residual, residual_dtype, zero_centered_weight, out_dtype,
                 rms=True, dropout_p=dropout_p, seed=seed, rowscale=rowscale, x1=x1, weight1=weight1, bias1=bias1)


def attention_delta(out: Tensor, grad_out: Tensor) -> Tensor:
    """D = rowsum(out * grad_out), float32, shape out.shape[:-1]."""
    return ops.attention_delta(out, grad_out)


class _Norm(nn.Module):
    """What LayerNorm and RMSNorm share: normalized_shape, eps,
    elementwise_affine, the weight (ones, or zeros when zero-centered: the
    multiplier is then 1 + weight), and the cunorm options."""

    def __init__(self, normalized_shape, eps, elementwise_affine: bool, bias: bool, device, dtype, *,
                 zero_centered_weight: bool, residual_dtype, out_dtype):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.zero_centered_weight = zero_centered_weight
        self.residual_dtype, self.out_dtype = residual_dtype, out_dtype
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            (nn.init.zeros_ if self.zero_centered_weight else nn.init.ones_)(self.weight)
        if getattr(self, "bias", None) is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        extra = ", zero_centered_weight=True" if self.zero_centered_weight else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{extra}"


class LayerNorm(_Norm):
    """torch.nn.LayerNorm on cunorm's kernels. forward(x) -> y;
    forward(x, residual) -> (y, residual_out), residual_out = x + residual
    (summed in fp32, stored in `residual_dtype`, default the residual's)
    being what is normalized: feed it to the next block as its residual."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, zero_centered_weight: bool = False,
                 residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         zero_centered_weight=zero_centered_weight, residual_dtype=residual_dtype,
                         out_dtype=out_dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual,
                          residual_dtype=self.residual_dtype, zero_centered_weight=self.zero_centered_weight,
                          out_dtype=self.out_dtype)


class RMSNorm(_Norm):
    """torch.nn.RMSNorm on cunorm's kernels (eps None: the machine epsilon of
    the input's dtype, as torch); forward(x, residual=None) as LayerNorm's."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None, *, zero_centered_weight: bool = False, residual_dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype,
                         zero_centered_weight=zero_centered_weight, residual_dtype=residual_dtype,
                         out_dtype=out_dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, residual=residual,
                        residual_dtype=self.residual_dtype, zero_centered_weight=self.zero_centered_weight,
                        out_dtype=self.out_dtype)


def _from_layer_norm(m: nn.LayerNorm) -> LayerNorm:
    return _adopt(LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, getattr(m, "bias", None) is not None,
                            device="meta"), m)


def _from_rms_norm(m: nn.RMSNorm) -> RMSNorm:
    return _adopt(RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta"), m)


def _adopt(new: _Norm, old: nn.Module) -> _Norm:
    """`new` holding `old`'s parameter objects (not copies), in its training mode."""
    for name in ("weight", "bias"):
        if name in new._parameters:
            new._parameters[name] = getattr(old, name, None)
    new.train(old.training)
    return new


CONVERTERS = {nn.LayerNorm: _from_layer_norm}
if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    CONVERTERS[nn.RMSNorm] = _from_rms_norm


def replace_norms(module: nn.Module, converters: dict | None = None) -> list:
    """Swaps, in place, every submodule whose type is a key of `converters`
    (default: torch.nn.LayerNorm and torch.nn.RMSNorm, exact types) for what
    its converter returns (the cunorm module, holding the same parameter
    tensors and eps). Returns [(qualified name, replaced module)]. A converter
    for another class, e.g. a Hugging Face RMSNorm, is a function of the old
    module (see the README's torch section)."""
    table = dict(CONVERTERS if converters is None else converters)
    replaced = []
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            convert = table.get(type(child))
            if convert is None:
                continue
            setattr(parent, name, convert(child))
            replaced.append((f"{parent_name}.{name}" if parent_name else name, child))
    return replaced
