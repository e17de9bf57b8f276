"""Which traits run a given LayerNorm call.

Two sources, in this order: the tuned table (knobs measured best on a GPU by
`cunorm tune`, a literal below), then a heuristic that derives legal traits for
any other hidden size. Both give only the knobs; the call supplies hidden size,
dtypes and flags, and `Traits` checks the result.
"""
from __future__ import annotations

import math

from . import dtypes
from .traits import CLUSTER_MIN_ARCH, KNOBS, Traits

# Hidden sizes with tuned entries (both directions, every input dtype).
TUNED_SIZES = (768, 1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 14336,
               15360, 16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536)

# (backward, hidden size, input element bytes) -> knobs in KNOBS order:
# (WARPS_M, WARPS_N, CTAS_PER_ROW, BYTES_PER_LDG, STAGES, CACHE_WEIGHTS, MIN_CTAS_PER_SM, SMEM_ACCUMULATORS
# [, RECOMPUTE: default True]).
# Measured with scripts/tune_table.sh on an H200 (bf16, M*N = 2^26; 2-byte inputs share the entries), 2026-11-22;
# the comment is the fraction of a same-run device-to-device copy the tuner measured. 4-byte inputs use the
# heuristic until tuned.
TUNED_ARCH = 90  # other architectures use the heuristic
TUNED: dict = {
    (False,   768, 2): (2, 2, 1, 8, 2, 1, 1, 0),  # 0.90 of copy
    (True ,   768, 2): (4, 1, 1, 16, 2, 1, 1, 0),  # 0.90 of copy
    (False,  1024, 2): (1, 4, 1, 16, 2, 1, 1, 0),  # 0.89 of copy
    (True ,  1024, 2): (4, 1, 1, 16, 2, 1, 1, 0),  # 0.86 of copy
    (False,  1536, 2): (4, 2, 1, 8, 2, 1, 2, 0),  # 0.90 of copy
    (True ,  1536, 2): (1, 2, 1, 16, 2, 1, 1, 0),  # 0.81 of copy
    (False,  2048, 2): (8, 4, 1, 8, 2, 1, 1, 0),  # 0.88 of copy
    (True ,  2048, 2): (1, 8, 1, 16, 2, 1, 1, 0),  # 0.81 of copy
    (False,  2304, 2): (1, 4, 1, 16, 2, 1, 2, 0),  # 0.91 of copy
    (True ,  2304, 2): (1, 4, 1, 8, 1, 0, 2, 0),  # 0.79 of copy
    (False,  3072, 2): (2, 4, 1, 16, 2, 1, 2, 0),  # 0.89 of copy
    (True ,  3072, 2): (1, 4, 1, 16, 2, 1, 2, 0),  # 0.79 of copy
    (False,  3840, 2): (1, 8, 1, 16, 2, 1, 1, 0),  # 0.90 of copy
    (True ,  3840, 2): (2, 16, 1, 16, 2, 1, 1, 0),  # 0.74 of copy
    (False,  4096, 2): (4, 4, 1, 8, 2, 1, 1, 0),  # 0.88 of copy
    (True ,  4096, 2): (1, 8, 1, 8, 1, 0, 1, 1),  # 0.85 of copy
    (False,  5120, 2): (4, 8, 1, 8, 2, 1, 1, 0),  # 0.88 of copy
    (True ,  5120, 2): (2, 8, 1, 8, 1, 0, 1, 1),  # 0.75 of copy
    (False,  6144, 2): (1, 8, 1, 16, 2, 1, 1, 0),  # 0.89 of copy
    (True ,  6144, 2): (1, 16, 1, 8, 1, 1, 2, 1),  # 0.80 of copy
    (False,  8192, 2): (2, 4, 1, 8, 2, 1, 1, 0),  # 0.88 of copy
    (True ,  8192, 2): (1, 16, 1, 16, 1, 0, 2, 1, 1),  # 0.74 of copy
    (False, 10240, 2): (2, 8, 1, 8, 2, 0, 1, 0),  # 0.87 of copy
    (True , 10240, 2): (1, 8, 2, 8, 1, 1, 2, 0),  # 0.63 of copy
    (False, 12288, 2): (1, 16, 1, 8, 3, 0, 2, 0),  # 0.87 of copy
    (True , 12288, 2): (1, 16, 2, 8, 1, 1, 2, 1, 1),  # 0.68 of copy
    (False, 12800, 2): (1, 16, 1, 8, 3, 1, 1, 0),  # 0.86 of copy
    (True , 12800, 2): (1, 8, 2, 8, 1, 1, 2, 1),  # 0.65 of copy
    (False, 14336, 2): (1, 16, 1, 16, 2, 1, 1, 0),  # 0.88 of copy
    (True , 14336, 2): (1, 32, 2, 16, 2, 1, 1, 0),  # 0.51 of copy
    (False, 15360, 2): (1, 16, 1, 16, 2, 1, 1, 0),  # 0.89 of copy
    (True , 15360, 2): (1, 32, 2, 8, 2, 1, 1, 0),  # 0.53 of copy
    (False, 16384, 2): (1, 16, 1, 16, 2, 1, 1, 0),  # 0.88 of copy
    (True , 16384, 2): (1, 16, 2, 8, 1, 1, 2, 1, 0),  # 0.70 of copy
    (False, 18432, 2): (1, 16, 1, 8, 2, 0, 1, 0),  # 0.87 of copy
    (True , 18432, 2): (1, 16, 2, 8, 2, 1, 1, 1),  # 0.55 of copy
    (False, 20480, 2): (1, 32, 1, 8, 2, 1, 1, 0),  # 0.87 of copy
    (True , 20480, 2): (1, 8, 4, 8, 1, 1, 2, 0),  # 0.39 of copy
    (False, 24576, 2): (1, 16, 1, 8, 2, 0, 1, 0),  # 0.83 of copy
    (True , 24576, 2): (1, 8, 4, 8, 2, 1, 2, 1),  # 0.41 of copy
    (False, 25600, 2): (1, 8, 2, 8, 4, 0, 2, 0),  # 0.64 of copy
    (True , 25600, 2): (1, 8, 4, 8, 1, 0, 2, 1),  # 0.39 of copy
    (False, 30720, 2): (1, 8, 2, 8, 1, 0, 2, 0),  # 0.69 of copy
    (True , 30720, 2): (1, 16, 4, 16, 1, 0, 2, 1),  # 0.36 of copy
    (False, 32768, 2): (1, 8, 2, 8, 1, 0, 2, 0),  # 0.71 of copy
    (True , 32768, 2): (1, 4, 8, 8, 1, 0, 2, 1),  # 0.39 of copy
    (False, 40960, 2): (1, 16, 2, 8, 2, 1, 1, 0),  # 0.59 of copy
    (True , 40960, 2): (1, 8, 8, 8, 1, 1, 1, 1),  # 0.34 of copy
    (False, 49152, 2): (1, 4, 8, 8, 2, 1, 2, 0),  # 0.42 of copy
    (True , 49152, 2): (1, 8, 8, 8, 2, 1, 2, 1),  # 0.37 of copy
    (False, 65536, 2): (1, 4, 8, 8, 3, 1, 1, 0),  # 0.38 of copy
    (True , 65536, 2): (1, 8, 8, 8, 1, 0, 2, 1),  # 0.40 of copy
}

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
    if best.threads_per_cta > 256:
        best = best.replace(cache_weights=False, smem_accumulators=backward)
    if best.ctas_per_row == 1:
        warps_m = max(1, MIN_THREADS_PER_CTA // best.threads_per_row)
        while warps_m > 1:
            try:
                best = best.replace(warps_m=warps_m)
                break
            except ValueError:
                warps_m //= 2
    # Rows in flight: as many stages as fit in STAGED_SMEM_BUDGET (two CTAs per SM).
    for stages in range(DEFAULT_STAGES, 0, -1):
        try:
            staged = best.replace(stages=stages)
        except ValueError:
            continue
        if staged.smem_bytes <= STAGED_SMEM_BUDGET or stages == 1:
            return staged
    return best
