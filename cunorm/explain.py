"""`cunorm.explain`: which kernel a call would run, with which traits, and why."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from . import dispatch, dtypes, layout, norm, plan
from .norm import calls, plans
from .compiler import device_arch
from .traits import Traits

OPS = {"layer_norm": (norm.layer_norm, False, False), "rms_norm": (norm.rms_norm, True, False),
       "layer_norm_backward": (norm.layer_norm_backward, False, True),
       "rms_norm_backward": (norm.rms_norm_backward, True, True)}


@dataclass(frozen=True)
class Explanation:
    """What `op(*args, **kwargs)` would run. path: "fast" (aligned rows, 16-byte
    vectors), "narrow" (aligned rows, narrower vectors: the row tensors sit at
    different offsets from 16-byte boundaries), "general" (shifted rows with
    masked ends) or "reference" (numpy inputs, float64 on the CPU); source:
    "tuned", "heuristic" or "caller"."""

    op: str
    path: str
    traits: Traits | None
    source: str
    reasons: tuple

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.path} path"]
        if self.traits is not None:
            lines.append(f"  traits ({self.source}): {self.traits.short()}")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)

    __repr__ = __str__


def _layout_reasons(p, t: Traits) -> list:
    x_dtype = t.input_dtype
    isz = dtypes.itemsize(x_dtype)
    widest = dtypes.vector_elements(isz)
    rows = p.row_list()
    reasons = [f"{r.name}: {r.copied}" for r in rows if r.copied]
    max_vector = p.base["max_vector"]
    if max_vector < widest:
        why = [r for r in layout.why_not_aligned(rows, p.n, widest) if "different offsets" in r]
        reasons.append(f"narrower loads ({max_vector * isz} bytes): " + "; ".join(why))
    e = t.elts_per_ldg
    if t.aligned_rows:
        reasons.append(f"{path_of(t, max_vector)} path: every row starts on a {max_vector * isz}-byte boundary and "
                       f"is whole {max_vector}-element vectors long ({e * isz}-byte loads)")
    else:
        why = layout.why_not_aligned(rows, p.n, max_vector) or [f"the chosen {e}-element vectors do not fit the rows"]
        reasons.append("general kernel: " + "; ".join(why))
    return reasons


def explain(op, *args, **kwargs) -> Explanation:
    """Explains a call: `cunorm.explain(cunorm.layer_norm, x, w, b)` (or the
    op's name) takes the op's own arguments, validates them as the op would
    (raising the same errors) and returns an Explanation; nothing is launched
    or compiled."""
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)} (or the function), got {op!r}")
    fn, rms, backward = OPS[name]
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    traits = a.pop("traits")
    if backward:
        call_args, on_gpu, base = calls.backward_args(rms, a["dy"], a["x"], a.get("mean"), a["rstd"], a["weight"],
                                                      a.get("has_bias", False), a.get("bias_dtype"),
                                                      a["dresidual"], a["zero_centered_weight"], a["out"])
    else:
        call_args, on_gpu, base, _ = calls.forward_args(rms, a["x"], a["weight"], a.get("bias"), a["eps"],
                                                        a["residual"], a["residual_dtype"],
                                                        a["zero_centered_weight"], a["out_dtype"], a["out"])
    if not on_gpu:
        return Explanation(name, "reference", None, "", ("numpy inputs run the float64 reference on the CPU",))

    dev = call_args["x"].array.device_id
    with plan.on_device(dev):
        p = (plans.backward_prepare if backward else plans.forward_prepare)(call_args, base)
    arch = device_arch(dev)
    if traits is None:
        t, source = dispatch.choose(arch=arch, **p.base)
    else:
        t, source = plan.resolve_traits(plans.Family, traits, p.base, arch), "caller"
    reasons = _layout_reasons(p, t)
    if source == "tuned":
        neighbour = dispatch.tuned_neighbour(t.hidden_size, t.input_dtype)
        general = not t.aligned_rows and dispatch.tuned_knobs(t.backward, neighbour, t.input_dtype, general=True)
        reasons.append(f"dispatch: the tuned entry for {'general rows beside ' if general else ''}N={neighbour} "
                       f"(sm_{dispatch.TUNED_ARCH})")
    elif source == "heuristic":
        reasons.append("dispatch: the heuristic (no tuned entry applies: other GPU, size, residual or layout)")
    return Explanation(name, path_of(t, p.base["max_vector"]), t, source, tuple(reasons))


def path_of(t: Traits, max_vector: int) -> str:
    """"fast", "narrow" or "general" (see Explanation), given the widest
    vector (elements) the call's layout allows."""
    if not t.aligned_rows:
        return "general"
    return "fast" if max_vector * dtypes.itemsize(t.input_dtype) == dtypes.VECTOR_BYTES else "narrow"
