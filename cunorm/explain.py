"""`cunorm.explain`: which kernel a call would run, with which traits, and why."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from . import dispatch, dtypes, layout, norm, plan
from .compiler import arch_number, device_arch, device_gpu
from .norm import calls, plans
from .source import check_source
from .traits import Traits
from .traits_rules import PORTABLE_CLUSTER

OPS = {"layer_norm": (norm.layer_norm, False, False), "rms_norm": (norm.rms_norm, True, False),
       "layer_norm_backward": (norm.layer_norm_backward, False, True),
       "rms_norm_backward": (norm.rms_norm_backward, True, True)}


@dataclass(frozen=True)
class Explanation:
    """What `op(*args, **kwargs)` would run. path: "fast" (aligned rows, 16-byte
    vectors), "narrow" (aligned rows, narrower vectors: the row tensors sit at
    different offsets from 16-byte boundaries), "general" (shifted rows with
    masked ends) or "reference" (numpy inputs, float64 on the CPU: traits and
    reasons then preview a GPU of `arch`); source: where the traits came from:
    a tuned table of this GPU model ("user table PATH", "shipped H200 table"),
    "tuned" (the sm_90 literal), "heuristic" or "caller"."""

    op: str
    path: str
    traits: object  # Traits, DeltaTraits, or None (nothing to launch)
    source: str
    reasons: tuple
    arch: int | None = None  # the GPU architecture the traits are for

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.path} path" + (f" (traits for sm_{self.arch})" if self.arch else "")]
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
        if layout.batch_invariant():
            why.append("batch-invariant mode takes the widest vector every row starts on "
                       "(cunorm.set_batch_invariant), never the general kernel")
        reasons.append(f"narrower loads ({max_vector * isz} bytes): " + "; ".join(why))
    e = t.elts_per_ldg
    if t.aligned_rows:
        reasons.append(f"{path_of(t, max_vector)} path: every row starts on a {max_vector * isz}-byte boundary and "
                       f"is whole {max_vector}-element vectors long ({e * isz}-byte loads)")
    else:
        why = layout.why_not_aligned(rows, p.n, max_vector) or [f"the chosen {e}-element vectors do not fit the rows"]
        reasons.append("general kernel: " + "; ".join(why))
    return reasons


# What runs where a measured entry compiles with spills (dispatch.without_spills).
SPILLING_ENTRY = ("if it compiles with spills for this dtype mix, its shape at half the CTAs an SM runs instead "
                  "where that compiles clean, else at half its load width, else the heuristic's pick")


def explain(op, *args, arch: int | str | None = None, **kwargs) -> Explanation:
    """Explains a call: `cunorm.explain(cunorm.layer_norm, x, w, b)` (or the
    op's name) takes the op's own arguments, validates them as the op would
    (raising the same errors) and returns an Explanation; nothing is launched
    or compiled. GPU arrays are explained for their GPU (or for `arch`, e.g.
    "sm_80", to preview another); numpy arrays run the reference, and their
    explanation previews what a GPU of `arch` (default sm_90) would run."""
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name == "attention_delta":
        return _explain_delta(*args, arch=arch, **kwargs)
    if name not in OPS:
        raise ValueError(f"op: expected one of {', '.join([*OPS, 'attention_delta'])} (or the function), got {op!r}")
    fn, rms, backward = OPS[name]
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    traits, source = a.pop("traits"), a.pop("source")
    if backward:
        call_args, on_gpu, base, _, _ = calls.backward_args(
            rms, a["dy"], a["x"], a.get("mean"), a["rstd"], a["weight"], a.get("has_bias", False),
            a.get("bias_dtype"), a["dresidual"], a["zero_centered_weight"], a["out"], a["y"], a["bias"],
            a["dropout_p"], a["seed"], a["rowscale"], a["dx0_dtype"])
    else:
        call_args, on_gpu, base, _, _ = calls.forward_args(
            rms, a["x"], a["weight"], a.get("bias"), a["eps"], a["residual"], a["residual_dtype"],
            a["zero_centered_weight"], a["out_dtype"], a["out"], a["scale"], a["scaling"], a["return_amax"],
            a["dropout_p"], a["seed"], a["rowscale"], a["return_dropout_mask"])
    prepare = plans.backward_prepare if backward else plans.forward_prepare
    reasons = []
    if on_gpu:
        dev = call_args["x"].array.device_id
        with plan.on_device(dev):
            p = prepare(call_args, base)
        arch = device_arch(dev) if arch is None else arch_number(arch)
    else:
        p = norm._check_as_on_gpu(prepare, call_args, base, None)
        arch = plan.PREVIEW_ARCH if arch is None else arch_number(arch)
        reasons.append(f"numpy inputs run the float64 reference on the CPU; on an sm_{arch} GPU this call would "
                       f"run what follows")
    if traits is None:
        gpu = device_gpu(dev) if on_gpu and arch == device_arch(dev) else None  # its tuned tables
        t, origin = dispatch.choose(arch=arch, gpu=gpu, **p.base)
    else:
        t, origin = plan.resolve_traits(plans.Family, traits, p.base, arch), dispatch.CALLER
    if source is not None:
        check_source(t, source)
        reasons.append(f"source: an edited {t.source_file} (the caller's), compiled in place of the shipped one")
    reasons += _layout_reasons(p, t)
    if backward and source is None and plans.one_launch(t, p.row_count):
        reasons.append(f"one launch: {p.row_count} rows of {t.hidden_size} are few enough that the grid sums "
                       f"its partial rows into dweight/dbias itself after a grid-wide barrier (a cooperative "
                       f"launch; no finalize kernel), on a grid of at least a few dozen CTAs and a capped number "
                       f"of partial rows (unless that variant spills or its grid cannot all be resident: then "
                       f"two launches)")
    if origin == "tuned":
        neighbour = dispatch.tuned_neighbour(t.hidden_size, t.input_dtype)
        general = not t.aligned_rows and dispatch.tuned_knobs(t.backward, neighbour, t.input_dtype, general=True)
        reasons.append(f"dispatch: the tuned entry for {'general rows beside ' if general else ''}N={neighbour} "
                       f"(sm_{dispatch.TUNED_ARCH}); {SPILLING_ENTRY} (`cunorm check --compile-only` lists where)")
    elif dispatch.measured(origin):
        reasons.append(f"dispatch: the entry for N={dispatch.tuned_neighbour(t.hidden_size, t.input_dtype)} in the "
                       f"{origin} (measured on this GPU model by cunorm tune); {SPILLING_ENTRY}")
    elif origin == "heuristic":
        reasons.append("dispatch: the heuristic (no tuned entry applies: other GPU, size, residual or layout)")
    if origin != dispatch.CALLER and not t.persistent:
        reasons.append(f"unstaged forward: a CTA per {'row' if t.rows_per_cta == 1 else f'{t.rows_per_cta} rows'}, "
                       f"read straight into registers, capped at {t.register_cap} "
                       f"registers a thread so that many CTAs share an SM (no persistent grid); if it compiles "
                       f"with spills for this dtype mix, the staged heuristic's pick runs instead")
    if t.ctas_per_row > PORTABLE_CLUSTER:
        why = (f"the heuristic takes one where the column sums fit shared memory across {t.ctas_per_row} CTAs but "
               f"not across {PORTABLE_CLUSTER}" if origin == dispatch.HEURISTIC else f"from the {origin}")
        reasons.append(f"a {t.ctas_per_row}-CTA (non-portable) cluster a row ({why}); on a GPU that holds no "
                       f"such cluster, " + ("the call fails to load (the caller's traits run as given)"
                                            if origin == dispatch.CALLER else
                                            f"the heuristic's pick within {PORTABLE_CLUSTER}-CTA clusters runs "
                                            f"instead"))
    path = path_of(t, p.base["max_vector"]) if on_gpu else "reference"
    return Explanation(name, path, t, origin, tuple(reasons), arch)


def _explain_delta(out, grad_out, *, traits=None, arch=None) -> Explanation:
    """explain for attention_delta: its vector width and why, what is copied."""
    from . import arrays
    from .attention_delta import _Family, dispatch_call, layout_of

    args, on_gpu = arrays.take_all({"out": out, "grad_out": grad_out}, {})
    laid, copies, reasons = layout_of(args if on_gpu else arrays.described(args), copy=False)
    call = None if laid is None else dispatch_call(laid, traits)
    if on_gpu:
        arch = device_arch(args["out"].array.device_id) if arch is None else arch_number(arch)
    else:
        arch = plan.PREVIEW_ARCH if arch is None else arch_number(arch)
        reasons.insert(0, f"numpy inputs run the float64 reference on the CPU; on an sm_{arch} GPU this call "
                          f"would run what follows")
    if call is None:  # no rows or an empty head dim: nothing to launch
        return Explanation("attention_delta", "none", None, "", tuple(reasons), arch)
    t = plan.resolve_traits(_Family, traits, call, arch)
    widest = 16 // max(dtypes.itemsize(t.out_dtype), dtypes.itemsize(t.grad_dtype))
    path = "reference" if not on_gpu else "fast" if t.elts_per_ldg >= min(widest, call["head_dim"]) else "narrow"
    reasons += [f"{name}: copied to a contiguous array ({why})" for name, why in copies.items()]
    reasons.append(f"{t.elts_per_ldg}-element loads ({t.vector_bytes(t.out_dtype)} bytes of out), "
                   f"{t.threads_per_row} threads a row, {t.rows_per_thread} rows a thread")
    origin = dispatch.CALLER if traits is not None else dispatch.HEURISTIC
    return Explanation("attention_delta", path, t, origin, tuple(reasons), arch)


def path_of(t: Traits, max_vector: int) -> str:
    """"fast", "narrow" or "general" (see Explanation), given the widest
    vector (elements) the call's layout allows."""
    if not t.aligned_rows:
        return "general"
    return "fast" if max_vector * dtypes.itemsize(t.input_dtype) == dtypes.VECTOR_BYTES else "narrow"
