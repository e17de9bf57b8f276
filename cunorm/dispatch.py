"""Which traits run a given normalization call.

Sources, in this order: the tuned tables of this GPU model (`cunorm.tables`:
the user's, written by `cunorm tune`, then one shipped for the model), the
sm_90 literal in tuned.py (knobs measured best on an H200 and an H100, for
calls without a residual: TUNED for aligned rows, and for general rows
TUNED_GENERAL, then TUNED, at the aligned neighbour's size), then the heuristic
(`cunorm.heuristic`), which derives legal traits for any other call. A table's entry serves the
calls of its key (direction, RMSNorm or LayerNorm, residual or not, input
element bytes), general rows taking the entry of their aligned neighbour.
All give only the knobs; the call supplies hidden size, dtypes, flags and what
its layout allows (`cunorm.layout.vector_widths`), and `Traits` checks the result.
"""
from __future__ import annotations

from . import dtypes
from .compiler import ClusterNotResident
from .heuristic import UNSTAGED_EXCLUDED_FIELDS, has_wide_weights, heuristic, late_dgamma_registers
from .traits import KNOB_DEFAULTS, KNOBS, Traits
from .traits_rules import CLUSTER_MIN_ARCH
from .tuned import TUNED, TUNED_ARCH, TUNED_GENERAL  # the measured tables, a literal of their own

# Hidden sizes with tuned entries (both directions, every input dtype).
TUNED_SIZES = (768, 1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 14336,
               15360, 16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536)




def tuned_knobs(backward: bool, hidden_size: int, input_dtype: str, general: bool = False):
    """The tuned knobs for aligned rows of `hidden_size` (general=True: for the
    general kernel's rows whose aligned neighbour it is), or None."""
    return (TUNED_GENERAL if general else TUNED).get((backward, hidden_size, dtypes.itemsize(input_dtype)))


def tuned_neighbour(hidden_size: int, input_dtype: str) -> int:
    """The size whose tuned entry a call borrows: N rounded down to whole 16-byte vectors."""
    return hidden_size - hidden_size % dtypes.vector_elements(dtypes.itemsize(input_dtype))


def call_fields(*, max_vector: int | None = None, aligned_vector: int | None = None, **fields) -> tuple:
    """Splits a call into Traits fields and the layout's vector widths
    (elements of x; by default those of contiguous, aligned arrays)."""
    if "weight_dtype" in fields:
        fields.setdefault("bias_dtype", fields["weight_dtype"])
    if max_vector is None:
        max_vector = dtypes.vector_elements(dtypes.itemsize(fields["input_dtype"]))
    if aligned_vector is None:
        aligned_vector = max_vector
        while fields["hidden_size"] % aligned_vector:
            aligned_vector //= 2
    return fields, max_vector, aligned_vector


def from_knobs(knobs: dict, **call) -> Traits:
    """Traits for a call with the given knobs; aligned_rows follows from the
    chosen vector width and the layout."""
    fields, max_vector, aligned_vector = call_fields(**call)
    itemsize = dtypes.itemsize(fields["input_dtype"])
    if fields.get("per_head") and "cache_weights" not in knobs:  # per-head weights are read where used
        knobs = dict(knobs, cache_weights=False)
    bytes_per_ldg = knobs.get("bytes_per_ldg", KNOB_DEFAULTS["bytes_per_ldg"])
    elts = bytes_per_ldg // itemsize
    if elts > max_vector:
        raise ValueError(f"traits: bytes_per_ldg={bytes_per_ldg} ({elts} elements) is wider than this call's layout "
                         f"allows ({max_vector * itemsize} bytes): its row tensors sit at different offsets from "
                         f"{elts}-element boundaries")
    return Traits(**fields, **{**KNOB_DEFAULTS, **knobs}, aligned_rows=elts <= aligned_vector)


# Origins of a choice besides the tables' (Table.origin); CALLER: knobs or traits the caller gave.
HEURISTIC, TUNED_LITERAL, CALLER = "heuristic", "tuned", "caller"
# A spilling pick's replacements (`fallbacks`): its own shape without its statistics ahead, without its rows ahead
# in registers, at half the CTAs an SM or at half its load width (origin: the pick's origin and NOT_STATS_AHEAD,
# NOT_AHEAD, HALF_CTAS or HALF_LOADS), or the heuristic's.
HALF_CTAS, HEURISTIC_FALLBACK = "at half its CTAs an SM (the pick spills)", "heuristic (the pick spills)"
HALF_LOADS = "at half its load width (the pick spills)"
NOT_AHEAD = "without its rows ahead in registers (the pick spills)"
NOT_STATS_AHEAD = "without its rows' statistics ahead in registers (the pick spills)"
# A pick whose 16-CTA cluster this GPU holds none of runs the heuristic's pick within portable clusters.
PORTABLE_FALLBACK = "heuristic within portable clusters (this GPU holds no 16-CTA cluster)"


def measured(origin: str) -> bool:
    """Whether a choice came from measured knobs (a table or the literal), not the heuristic or the caller."""
    return origin not in (HEURISTIC, CALLER)


def choose(*, arch: int = CLUSTER_MIN_ARCH, tuned: bool = True, gpu=None, unstaged: bool = True,
           portable_clusters: bool = False, **call) -> tuple:
    """(Traits, origin) for a call: origin names the table the knobs came from
    (a table's `origin`, "tuned" for the literal in tuned.py) or "heuristic".
    `gpu` (cunorm.tables.GPU) adds that model's tables. A call without aligned
    rows (odd N, offset views, odd row strides) takes the knobs of its aligned
    neighbour (N rounded down to whole 16-byte vectors): a general-rows entry
    from any source, else an aligned entry, when legal for the call (an
    aligned row's knobs can be far off on the general kernel: H100 tables'
    65536 entries read 0.44-0.68 of copy at 65537, the literal's general
    ones 0.69-0.78). tuned=False: the heuristic only; unstaged=False:
    without the heuristic's unstaged forward; portable_clusters=True: without
    the heuristic's 16-CTA clusters (a measured entry of 16 CTAs is still
    returned: `without_spills` replaces it where the GPU holds none).
    Measured knobs or an unstaged forward that compile with spills for the
    call's dtype mix are replaced by a `fallbacks` pick where they are compiled
    (`plan`, `check.case_kernels`): spills are known only then."""
    fields, max_vector, aligned_vector = call_fields(**call)
    n, input_dtype, backward = fields["hidden_size"], fields["input_dtype"], fields.get("backward", False)
    aligned = aligned_vector == max_vector
    generals = (False,) if aligned else (True, False)
    if tuned:
        from .tables import Key, tables_for

        neighbour, nbytes = tuned_neighbour(n, input_dtype), dtypes.itemsize(input_dtype)
        rms, residual = fields.get("rms", False), fields.get("has_residual", False)
        # General rows: a general-rows entry of any source (measured on such rows) before an aligned one.
        for general in generals:
            for table in tables_for(gpu):
                knobs = table.knobs(Key(backward, rms, residual, neighbour, nbytes, general))
                t = None if knobs is None else _fit(knobs, call, general, aligned, arch)
                if t is not None:
                    return t, table.origin
            if arch == TUNED_ARCH and not residual:
                knobs = tuned_knobs(backward, neighbour, input_dtype, general)
                t = None if knobs is None else _fit(dict(zip(KNOBS, knobs)), call, general, aligned, arch)
                if t is not None:
                    return t, TUNED_LITERAL
    return heuristic(arch=arch, elts_per_ldg=max_vector, aligned_rows=aligned, unstaged=unstaged,
                     portable_clusters=portable_clusters, **fields), HEURISTIC


def may_fall_back(traits: Traits, origin: str) -> bool:
    """Whether dispatch's pick is replaced (`without_spills`) where it compiles with spills: measured knobs
    (tuned for one dtype mix) and the unstaged forward (its register cap is tight for some mixes); never the
    caller's knobs, which run as given."""
    return origin != CALLER and (measured(origin) or not traits.persistent)


def fallback(arch: int, **call) -> Traits:
    """The last resort for a call whose pick spills (`fallbacks`) or whose cluster no SM group here holds: the
    heuristic without the unstaged forward, within portable clusters."""
    return choose(arch=arch, tuned=False, unstaged=False, portable_clusters=True, **call)[0]


def fallbacks(spilled: Traits, origin: str, arch: int, **call) -> list:
    """[(traits, origin)] to try, in order, for a call whose pick `spilled` (from `origin`) compiles with
    spills: a measured pick with `stats_ahead` without it first (two values fewer a thread), one with
    `register_ahead` without it (the same shape, a row's vectors fewer registers a thread), then a measured
    persistent shape at half its CTAs an SM (twice the registers a thread: general rows borrow knobs measured
    on aligned rows, whose kernel needs fewer; 36 of the 47 measured picks that spill on general rows compile
    clean so, docs/runs/2026-11-26-general-rows-spilling-picks.txt), then at half its load width (the same
    elements a thread in twice the load steps: the two H200 entries that spill with fp32 weights, LayerNorm
    forward 262144 and backward 196608 with bf16 x, compile clean so and read 0.600 and 0.473 of copy through
    dispatch, where the heuristic's pick read 0.449 and 0.379, docs/runs/2026-11-29-h200-spill-fallbacks.txt),
    then `fallback`'s pick."""
    plain = fallback(arch, **call)
    out = []
    if spilled != plain and spilled.persistent:
        changes = [(dict(stats_ahead=False), NOT_STATS_AHEAD)] if spilled.stats_ahead else []
        if spilled.register_ahead:
            changes.append((dict(register_ahead=False, stats_ahead=False), NOT_AHEAD))
        if spilled.min_ctas_per_sm > 1:
            changes.append((dict(min_ctas_per_sm=spilled.min_ctas_per_sm // 2), HALF_CTAS))
        if spilled.bytes_per_ldg > 4:
            changes.append((dict(bytes_per_ldg=spilled.bytes_per_ldg // 2), HALF_LOADS))
        for change, why in changes:
            try:
                replacement = spilled.replace(**change)
                replacement.check_arch(arch)  # more shared memory than the pick (weight slots, register sums')
            except ValueError:  # no such shape: half the load width below sum_chains' chains, or too few bytes
                continue        # a load to stage
            if replacement != plain:  # the heuristic's own pick runs under its own origin, last
                out.append((replacement, f"{origin} {why}"))
    return out + [(plain, HEURISTIC_FALLBACK)]


def without_spills(pick: Traits, origin: str, spills, arch: int, **call) -> tuple:
    """(traits, origin) that runs a call: `pick` unless it may fall back (`may_fall_back`) and spills
    (`spills(traits)`: compiles it), else the first of `fallbacks` that does not spill, or the last. The
    one place that decides, for the GPU path (`plan._plan`: the loaded kernels' local memory) and the
    checker (`check.case_kernels`: the ptxas report). The GPU path's `spills` loads the kernels: it raises
    ClusterNotResident for a 16-CTA pick this GPU holds no cluster of, and `fallback`'s pick runs (a
    fallback that raises it is passed over)."""
    try:
        pick_spills = spills(pick)
    except ClusterNotResident:
        return fallback(arch, **call), PORTABLE_FALLBACK
    if not (may_fall_back(pick, origin) and pick_spills):
        return pick, origin
    for traits, why in fallbacks(pick, origin, arch, **call):
        try:
            if not spills(traits):
                break
        except ClusterNotResident:  # a halved shape of a 16-CTA pick; the last fallback is portable
            continue
    return traits, why


def what_runs(arch: int, spills, gpu=None, **call) -> tuple:
    """(traits, origin) that run a call: dispatch's pick (`choose`, with `gpu`'s tables), replaced where it
    spills (`without_spills`, given `spills(traits)`). The one composition of the two: the GPU path
    (`plan._plan`, through norm/plans.Family), the tuner's incumbent (`tune.what_runs`) and the checker
    (`check.case_kernels`) ask it."""
    return without_spills(*choose(arch=arch, gpu=gpu, **call), spills, arch, **call)


def _serves_unstaged(call: dict, measured_layout: bool) -> bool:
    """Whether a measured unstaged entry (a table key's plain call: weights as wide as x, no fp8 scaling, no
    per-head weights) serves `call`: rows of the layout it was measured on (an aligned entry's grid on the
    general kernel read 0.36-0.81 of copy at 12289 and 32769 on an H100, where the staged picks beside it read
    0.63-0.85), and not calls whose registers differ (wider weights, fp8 scaling's reductions, per-head
    weights: such picks spilled at 13312-65536 and fell back to the heuristic) or that no unstaged grid serves."""
    return (measured_layout and not call.get("per_head") and call.get("quant", "none") in ("none", None)
            and not has_wide_weights(call["input_dtype"], call)
            and not any(call.get(k) for k in UNSTAGED_EXCLUDED_FIELDS))


def _fit(knobs: dict, call: dict, general: bool, aligned: bool, arch: int) -> Traits | None:
    """Measured knobs made to fit a call, or None where they cannot: a measured shape may not suit every
    dtype mix, layout or GPU (registers, shared memory, clusters)."""
    input_dtype = call["input_dtype"]
    if call.get("per_head"):  # per-head weights are read where used
        knobs = dict(knobs, cache_weights=False)
    try:
        t = from_knobs(knobs, **call)
        if t.aligned_rows != aligned:
            raise ValueError("the layout needs narrower loads than the tuned entry")
        if not t.persistent and not _serves_unstaged(call, general or aligned):
            raise ValueError("an unstaged entry measured on another kind of call")
        if not general and not t.aligned_rows and t.threads_per_cta > 256:
            t = t.replace(cache_weights=False)  # shifted rows take an extra vector and masks: registers
        if t.parallel:  # a second weight (and bias) held beside the first would spill: both re-read instead
            t = t.replace(cache_weights=False)
        if has_wide_weights(input_dtype, call):
            # Wider weights than the tuned case: never hold them, and no 64-register CTAs.
            t = t.replace(cache_weights=False)
            if t.threads_per_cta > 512:
                raise ValueError("1024-thread CTAs spill with wide weights")
        t.check_arch(arch)
        return late_dgamma_registers(t)
    except ValueError:
        return None
