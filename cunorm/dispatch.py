"""Which traits run a given LayerNorm call.

Two sources, in this order: the tuned table (knobs measured best on a GPU by
`python -m cunorm.tune`, the literal in tuned.py), then a heuristic that derives legal traits for
any other hidden size. Both give only the knobs; the call supplies hidden size,
dtypes and flags, and `Traits` checks the result.
"""
from __future__ import annotations

import math

from . import dtypes
from .traits import CLUSTER_MIN_ARCH, DEFAULT_SMEM_LIMIT, KNOBS, SMEM_LIMIT, Traits
from .tuned import TUNED, TUNED_ARCH  # the measured table, a literal of its own

# Hidden sizes with tuned entries (both directions, every input dtype).
TUNED_SIZES = (768, 1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 14336,
               15360, 16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536)


# The heuristic aims for this many vector loads of x per thread: enough bytes
# in flight per thread, few enough registers for several CTAs per SM.
TARGET_LDGS = {False: 4, True: 4}
MIN_THREADS_PER_CTA = 128
DEFAULT_STAGES = 3
STAGED_SMEM_BUDGET = 100 * 1024
# Above 512 threads a CTA gets fewer than 128 registers per thread; wider rows
# are split across a cluster instead.
MAX_HEURISTIC_WARPS_N = {False: 16, True: 8}  # the backward holds twice the row (x and dy)


def tuned_knobs(backward: bool, hidden_size: int, input_dtype: str):
    return TUNED.get((backward, hidden_size, dtypes.itemsize(input_dtype)))


def choose(hidden_size: int, input_dtype: str, weight_dtype: str, output_dtype: str, *, has_weight: bool = True,
           has_bias: bool = True, backward: bool = False, arch: int = CLUSTER_MIN_ARCH) -> tuple:
    """(Traits, source) for a call, source being "tuned" or "heuristic"."""
    base = dict(hidden_size=hidden_size, input_dtype=input_dtype, weight_dtype=weight_dtype,
                output_dtype=output_dtype, has_weight=has_weight, has_bias=has_bias, backward=backward)
    knobs = tuned_knobs(backward, hidden_size, input_dtype) if arch == TUNED_ARCH else None
    if knobs is not None:
        try:  # a tuned shape may not suit every dtype mix or GPU (registers, shared memory, clusters)
            t = Traits(**base, **dict(zip(KNOBS, knobs)))
            if dtypes.itemsize(weight_dtype) > dtypes.itemsize(input_dtype):
                # Wider weights than the tuned case: never hold them, and no 64-register CTAs.
                t = t.replace(cache_weights=False)
                if t.threads_per_cta > 512:
                    raise ValueError("1024-thread CTAs spill with wide weights")
            t.check_arch(arch)
            return t, "tuned"
        except ValueError:
            pass
    return heuristic(arch=arch, **base), "heuristic"


def heuristic(*, hidden_size: int, input_dtype: str, backward: bool = False, arch: int = CLUSTER_MIN_ARCH,
              **rest) -> Traits:
    """Legal traits for any hidden size: the candidate with the fewest idle
    vector slots and the load count closest to TARGET_LDGS, preferring fewer
    CTAs per row; then enough rows per CTA to reach MIN_THREADS_PER_CTA."""
    itemsize = dtypes.itemsize(input_dtype)
    # Widest load that divides the row.
    bytes_per_ldg = next(b for b in (16, 8, 4, 2) if b >= itemsize and hidden_size % (b // itemsize) == 0)
    ctas_options = (1, 2, 4, 8) if arch >= CLUSTER_MIN_ARCH else (1,)
    best, best_cost = None, math.inf
    for ctas in ctas_options:
        # Without clusters, a row must fit one CTA (of at most 16 warps: wider CTAs get 64 registers a thread).
        max_warps_n = MAX_HEURISTIC_WARPS_N[backward] if arch >= CLUSTER_MIN_ARCH else 16
        for warps_n in range(1, max_warps_n + 1):
            try:
                t = Traits(hidden_size=hidden_size, input_dtype=input_dtype, backward=backward, warps_n=warps_n,
                           ctas_per_row=ctas, bytes_per_ldg=bytes_per_ldg, **rest)
            except ValueError:
                continue
            slots = t.ldgs * t.vec_cols_per_ldg
            idle = (slots - t.vec_cols) / slots
            # Fewer loads than the target cost latency hiding; more cost registers (and spill).
            ratio = math.log2(t.ldgs / TARGET_LDGS[backward])
            cost = (4.0 * idle + (-ratio if ratio < 0 else 3.0 * ratio) + 0.25 * (ctas - 1)
                    + 0.5 * (warps_n & (warps_n - 1) != 0))
            if cost < best_cost:
                best, best_cost = t, cost
    if best is None:
        raise ValueError(f"x: hidden size {hidden_size} ({input_dtype}, {'backward' if backward else 'forward'}) "
                         f"does not fit the register-resident kernel on sm_{arch} (at most 8 CTAs of a "
                         f"cluster on sm_90, one CTA before it)")
    # Wide CTAs get few registers per thread: there, weights are re-read instead
    # of held, and the backward keeps its column sums in shared memory.
    smem_sums = backward and best.threads_per_cta > 256
    if best.threads_per_cta > 256:
        best = best.replace(cache_weights=False)
    if best.ctas_per_row == 1:
        warps_m = max(1, MIN_THREADS_PER_CTA // best.threads_per_row)
        while warps_m > 1:
            try:
                best = best.replace(warps_m=warps_m)
                break
            except ValueError:
                warps_m //= 2
    # Rows in flight: as many stages as fit in STAGED_SMEM_BUDGET (two CTAs per SM) and the GPU's limit.
    # Wide backward CTAs keep their column sums in shared memory when that fits too (registers are scarce).
    limit = SMEM_LIMIT.get(arch, DEFAULT_SMEM_LIMIT)
    budget = min(STAGED_SMEM_BUDGET, limit)
    for sums_in_smem in (True, False) if smem_sums else (False,):
        for stages in range(DEFAULT_STAGES, 0, -1):
            try:
                staged = best.replace(stages=stages, smem_accumulators=sums_in_smem)
            except ValueError:
                continue
            # Unstaged, the column sums may take all of the GPU's shared memory (one CTA per SM).
            if staged.smem_bytes <= (limit if stages == 1 else budget):
                staged.check_arch(arch)
                return staged
    raise ValueError(f"x: hidden size {hidden_size} ({input_dtype}, {'backward' if backward else 'forward'}) "
                     f"needs more shared memory than sm_{arch} has")
