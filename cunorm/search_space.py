"""What `cunorm tune` measures: the keys of a run (`Job`, `plan`: one per
direction, LayerNorm or RMSNorm, residual, hidden size and input element
bytes) and, per key, the candidate traits — the launch shapes screened first
(`candidates`) and the extras tried on the fastest of them (`refinements`).
cunorm/tune.py times them."""
from __future__ import annotations

import dataclasses
import itertools

from . import dtypes, tables
from .check import SHORT_NAMES
from .traits import KNOB_DEFAULTS, Traits
from .traits_rules import CTAS_PER_ROW_CHOICES, ctas_for_registers

SHAPES = dict(ctas_per_row=CTAS_PER_ROW_CHOICES, warps_n=(1, 2, 4, 8, 16, 32), warps_m=(1, 2, 4, 8), bytes_per_ldg=(16, 8),
              lanes_per_row=(32, 16, 8, 4))
EXTRAS = dict(stages=(1, 2, 3, 4), min_ctas_per_sm=(1, 2), cache_weights=(True, False),
              smem_accumulators=(False, True), recompute=(True, False))
SIZES = (1024, 4096, 8192, 16384)  # what `cunorm tune` tunes by default
OPS = {name: (backward, op == "rms_norm") for name, (op, backward) in SHORT_NAMES.items()}  # (backward, rms)
RESIDUAL = {"no": (False,), "yes": (True,), "both": (False, True)}  # residual variants per --residual


@dataclasses.dataclass(frozen=True)
class Job:
    """One key to measure and the call it is measured on: inputs, weights and
    bias of `dtype`, rows of `n`. A general key holds its aligned neighbour's
    size (what dispatch looks up), `n` the size asked for."""

    key: tables.Key
    dtype: str
    n: int

    @classmethod
    def of(cls, n: int, dtype: str, backward: bool = False, rms: bool = False, residual: bool = False) -> "Job":
        from .dispatch import tuned_neighbour

        nbytes = dtypes.itemsize(dtype)
        general = n % dtypes.vector_elements(nbytes) != 0
        return cls(tables.Key(backward, rms, residual, tuned_neighbour(n, dtype), nbytes, general), dtype, n)

    def label(self) -> str:
        k = self.key
        op = f"{'rms-' if k.rms else ''}{'bwd' if k.backward else 'fwd'}{'+residual' if k.residual else ''}"
        return f"{op} N={self.n} {self.dtype}"

    def call_fields(self, weight_dtype: str | None = None) -> dict:
        """The dispatch fields of the timed call (contiguous rows), as the op derives them; `weight_dtype`:
        the same call with weights (and bias) of another dtype, a mix the key's entry also serves."""
        from .check import Case, case_call

        op = f"{'rms_norm' if self.key.rms else 'layer_norm'}{'_backward' if self.key.backward else ''}"
        return case_call(Case(op, self.n, 1, self.dtype, weight_dtype or self.dtype, has_bias=not self.key.rms,
                              residual_dtype=self.dtype if self.key.residual else None))

    def workload(self):
        """The timed call, a bench.Case on M*N = bench.ELEMENTS: `call(traits=knobs)` runs it with knobs forced."""
        from . import bench

        op = f"{'rms_norm' if self.key.rms else 'layer_norm'}{'+residual' if self.key.residual else ''}"
        return next(bench.norm_cases((self.n,), self.dtype, ops=(op,),
                                     directions=("bwd" if self.key.backward else "fwd",)))


def plan(sizes=SIZES, ops=tuple(OPS), residuals=(False,), dtype_names=("bfloat16",)) -> tuple:
    """(jobs, notes): a Job per distinct key, and a note for each request that
    shares another's key: dtypes of one element size (the first named is
    measured) and general sizes beside one aligned neighbour (the first)."""
    measured, notes = {}, []
    for name in dtype_names:
        first = measured.setdefault(dtypes.itemsize(name), name)
        if first != name:
            notes.append(f"{name} shares {first}'s entries ({dtypes.itemsize(name)}-byte inputs): measured as {first}")
    jobs, first_size = {}, {}
    for dtype in measured.values():
        for n in sizes:
            for (backward, rms), residual in itertools.product((OPS[o] for o in ops), residuals):
                job = Job.of(n, dtype, backward, rms, residual)
                jobs.setdefault(job.key, job)
            key = Job.of(n, dtype).key
            first = first_size.setdefault((key.n, key.general, dtype), n)
            if first != n:
                notes.append(f"N={n} shares N={first}'s entries ({dtype}: the general rows beside N={key.n})")
    return list(jobs.values()), notes


def _legal(call: dict, arch: int, **knobs) -> Traits | None:
    from .dispatch import from_knobs

    try:
        t = from_knobs(knobs, **call)
        t.check_arch(arch)
    except ValueError:
        return None
    # Skip shapes that leave most of a CTA idle or hold too few elements per thread.
    if t.threads_per_cta < 64 or t.elts_per_thread < 8 or t.ldgs * t.vec_cols_per_ldg > 2 * t.vec_cols:
        return None
    return t


def candidates(hidden_size: int, dtype: str, backward: bool, arch: int = 90, rms: bool = False,
               residual: bool = False, warps_n=None) -> list:
    """Phase 1: launch shapes (CTAs per row, warps, load width; `warps_n`
    replaces SHAPES' WARPS_N values) with default extras, as the op builds
    them for contiguous rows: the general kernel where the load width does
    not divide N. Cluster rows are screened with pushed exchanges. A
    backward (`warps_n` not given) is also screened on the other WARPS_N up
    to SHAPES' largest that split its rows into whole loads a thread
    (`Traits.full_tiles`): rows of N = k * 2^j elements with an odd k
    (LayerNorm backward 14336 = 7 * 2048 on 2 CTAs of 14 warps, 15360 on 8
    of 3: +0.07-0.10 of copy on an H100, PERFORMANCE.md version 69), about
    twice the shapes there; a general key's rows never split so. Not the
    forward: its rows of 12-15 warps lost (version 41), and it screens each
    shape five ways."""
    from .heuristic import cluster_offered

    job = Job.of(hidden_size, dtype, backward, rms, residual)
    call = job.call_fields()
    out = []
    powers = warps_n or SHAPES["warps_n"]
    warp_counts = range(1, max(powers) + 1) if backward and not warps_n else powers
    for ctas, wn, wm, bpl, lanes in itertools.product(SHAPES["ctas_per_row"], warp_counts, SHAPES["warps_m"],
                                                      SHAPES["bytes_per_ldg"], SHAPES["lanes_per_row"]):
        if (ctas > 1 and wm > 1) or (lanes < 32 and (ctas > 1 or wn > 1)):  # several rows a warp: one warp wide
            continue
        t = _legal(call, arch, ctas_per_row=ctas, warps_n=wn, warps_m=wm, bytes_per_ldg=bpl, lanes_per_row=lanes)
        if t is None:
            continue
        if wn not in powers and not t.full_tiles:
            continue  # a warp count beyond the powers of two only where the row splits evenly
        if not cluster_offered(t, arch):
            continue  # as the heuristic offers 16-CTA clusters (a GPU holding none fails to load them: dropped)
        # A general key serves calls dispatch runs on the general kernel: a load width dividing N runs the
        # aligned one, whose knobs dispatch would not take for them.
        if job.key.general and t.aligned_rows:
            continue
        t = with_pushed_exchange(t)
        out.append(t)
        if not backward:  # the forward's shapes also unstaged (screening caps, weights held or not)
            out += _unstaged(t, UNSTAGED_SCREEN_CAPS, arch, caches=(False, True))
    return out


UNSTAGED_CAPS = (48, 64, 80, 128)  # registers a thread, an unstaged forward's refinements
# An unstaged shape is screened at two caps, with weights held in registers and re-read: a row of 40-64
# elements a thread spills under 64 registers, or with its weights held (and is dropped there), but not under
# 96 (2-3 CTAs an SM) or re-reading them, where it can rank among the KEEP refined (H100: LayerNorm 12800 and
# 15360 were missed without).
UNSTAGED_SCREEN_CAPS = (64, 96)


def _unstaged(shape: Traits, caps, arch: int, caches) -> list:
    """A forward shape without a persistent grid (a CTA a row group, rows straight into registers), its
    registers capped at each of `caps` (fewer registers: more CTAs an SM to overlap the rows' latencies),
    its weights held in registers or re-read as each of `caches` says."""
    out = []
    for cap, cache in itertools.product(caps, caches):
        try:
            t = shape.replace(persistent=False, stages=1, cache_weights=cache,
                              min_ctas_per_sm=ctas_for_registers(shape.threads_per_cta, cap))
            t.check_arch(arch)
        except ValueError:
            continue
        if t not in out:
            out.append(t)
    return out


def extra_combinations(backward: bool):
    """The extras' combinations (EXTRAS order) worth trying in a direction."""
    for stages, min_ctas, cache, smem_acc, recompute in itertools.product(*EXTRAS.values()):
        if backward or not (smem_acc or not recompute):  # both knobs only change the backward
            yield stages, min_ctas, cache, smem_acc, recompute


# The knobs `tune.rank` tries in its passes after the extras (`*_variants` below), each on the fastest few
# shapes: refinements start from their defaults.
LATER_PASS_KNOBS = ("register_sum_steps", "unchecked_whole_steps", "sum_chains", "register_ahead", "stats_ahead")


def refinements(shape: Traits, arch: int = 90) -> list:
    """Phase 1, on a fast shape: the extras (stages, register cap, weight caching, shared-memory sums); an
    unstaged forward's: its register caps, with weights held or re-read; a LayerNorm forward of cluster rows
    each of them with merged moments too; every refinement of cluster rows with the other exchange too."""
    shape = shape.replace(**{knob: KNOB_DEFAULTS[knob] for knob in LATER_PASS_KNOBS})  # (an incumbent's)
    if not shape.persistent:
        unstaged = _unstaged(shape, UNSTAGED_CAPS, arch, caches=(False, True))
        return _with_pushed_exchanges(_with_merged_moments(unstaged))
    from .heuristic import late_dgamma_registers

    out = []
    for values in extra_combinations(shape.backward):
        try:
            # as dispatch runs it: a late-dgamma backward keeps its register cap (the table entry measured
            # one CTA an SM where dispatch ran two, LayerNorm fp32 2048 with a residual)
            t = late_dgamma_registers(shape.replace(**dict(zip(EXTRAS, values))))
            t.check_arch(arch)
        except ValueError:
            continue
        if t.register_cap >= 64 and t not in out:  # a cap below 64 registers only spills
            out.append(t)
    return _with_pushed_exchanges(_with_merged_moments(out))


REGISTER_SUM_SHARES = (0.25, 0.5, 0.75)  # of a row's load steps, tried with their sums in registers (and 1 step)


def register_sum_variants(t: Traits) -> list:
    """A backward with shared-memory column sums (the fastest few of a key's extras) again with the sums of
    its first step, and of its first quarter, half and three quarters of load steps, in registers
    (`register_sum_steps`): a load and a store of shared memory fewer a quantity, row and step, for registers
    (LayerNorm's two sums took the shared-memory pipe to 82% on an H100 at 8192, PERFORMANCE.md version 67; on
    an H200 the tuner took one step at four keys, version 72). Legal wherever `t` is: the steps leave shared
    memory, they take none."""
    if not (t.backward and t.smem_accumulators and t.register_sum_steps == 0):
        return []
    steps = {1} | {int(t.ldgs * share) for share in REGISTER_SUM_SHARES}
    return [t.replace(register_sum_steps=k) for k in sorted(steps) if 0 < k < t.ldgs]


def unchecked_whole_steps_variants(t: Traits) -> list:
    """`t` again with its whole load steps unchecked (`unchecked_whole_steps`), where it has any and lacks
    full tiles (general rows; aligned rows of a partial last step): fewer instructions, often more registers.
    On an H200 it was worth +0.007 … +0.094 of copy at 21 of 36 general-rows picks and cost up to 0.12 at others
    (0.15 at an aligned partial-step backward; PERFORMANCE.md version 75), so it is measured per key."""
    if t.unchecked_whole_steps or t.full_tiles or t.whole_steps == 0:
        return []
    return [t.replace(unchecked_whole_steps=True)]


SUM_CHAIN_COUNTS = (2, 4)  # a forward's row sums in this many chains a thread, tried beside one (sum_chains)


def sum_chains_variants(t: Traits) -> list:
    """A forward again with its row sums in 2 and 4 chains a thread (`sum_chains`; at most a vector's
    elements): shorter dependent chains of adds, more registers. On an H200 two chains read 0.670 -> 0.761 of
    copy at LayerNorm's general forward 32769 and cost up to 0.016 elsewhere (PERFORMANCE.md version 77), so it
    is measured per key."""
    if t.backward or t.sum_chains != 1:
        return []
    return [t.replace(sum_chains=c) for c in SUM_CHAIN_COUNTS if c <= t.elts_per_ldg]


def register_ahead_variants(t: Traits) -> list:
    """An unstaged backward again with its next row loaded into registers while it reduces and
    stores the current one (`register_ahead`): more registers a thread. On an H200 at dispatch's own picks
    (PERFORMANCE.md version 83) it read +0.007 … +0.082 of copy at LayerNorm 2048, 4096, 10240 and 12800 and
    -0.03 at 14336; where the extra registers spill at the pick's cap, one CTA an SM fewer lost 0.03-0.09.
    Measured per key."""
    if not (t.backward and t.stages == 1 and not t.register_ahead):
        return []
    return [t.replace(register_ahead=True)]


def stats_ahead_variants(t: Traits) -> list:
    """A backward with its next row ahead in registers again with the next row's mean and rstd loaded ahead
    too (`stats_ahead`). An A/B of the change on an H200 (PERFORMANCE.md version 85)
    read +0.02 / +0.03 of copy at LayerNorm 16384 / 3840 and -0.05 … -0.08 at RMSNorm 6144 / 12800 and LayerNorm
    12800, so it is measured per key."""
    if not (t.register_ahead and not t.stats_ahead):
        return []
    return [t.replace(stats_ahead=True)]


def screened_ahead_variants(t: Traits) -> list:
    """A backward shape as the first round screened it (staged, default extras) unstaged with its next row
    ahead in registers: how a shape whose extras are never tried meets the knob."""
    if not t.backward:
        return []
    try:
        return register_ahead_variants(t.replace(stages=1))
    except ValueError:  # (no unstaged self)
        return []


def _with_merged_moments(refined: list) -> list:
    """The refinements, and those of LayerNorm forwards of cluster rows again with merged moments."""
    out = list(refined)
    for t in refined:
        try:
            out.append(t.replace(merged_moments=True))
        except ValueError:  # not such a forward
            pass
    return out


def with_pushed_exchange(shape: Traits) -> Traits:
    """A cluster row's shape with pushed exchanges: how cluster rows are screened, as the pushed exchange was
    faster than the barrier one for 20 of the 21 picks measured in version 61 (H200 and H100, bf16,
    16384-131072); the barrier one stays a refinement (the loss: an unstaged RMSNorm forward at 65536)."""
    return shape.replace(pushed_exchange=True) if shape.uses_cluster else shape


def _with_pushed_exchanges(refined: list) -> list:
    """The refinements, and those of cluster rows again with the other exchange (barrier or pushed)."""
    return list(refined) + [t.replace(pushed_exchange=not t.pushed_exchange) for t in refined if t.uses_cluster]
