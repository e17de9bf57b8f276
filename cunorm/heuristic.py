"""The heuristic: legal traits for any normalization call that no tuned table serves, derived from the call
(hidden size, dtypes, flags, the vector widths its layout allows) and the GPU's architecture, with the costs
and limits measured on H100s and H200s that steer it (`docs/PERFORMANCE.md`). Dispatch (`cunorm.dispatch`)
asks it last, and for the fallback of a pick that spills or whose cluster the GPU does not hold; `Traits`
asks it for a call given no knobs; the tuner (`cunorm.search_space`) takes its cluster rule and register
caps.
"""
from __future__ import annotations

import itertools
import math

from . import dtypes
from .traits import KNOB_DEFAULTS, Traits
from .traits_rules import (CLUSTER_MIN_ARCH, CTAS_PER_ROW_CHOICES, DEFAULT_SMEM_LIMIT, LANES_PER_ROW, PORTABLE_CLUSTER,
                           REGISTERS_PER_SM, SMEM_LIMIT, THREADS_PER_WARP, ctas_for_registers)

# Elements of a row a thread holds in registers that the heuristic stays within when it can (the hard cap:
# traits_rules.MAX_ELTS_PER_THREAD), keyed by "holds two rows" (the backward's x and dy, or the forward's fp32
# residual sum beside x).
PREFERRED_ELTS_PER_THREAD = {False: 64, True: 32}
# The heuristic aims for this many vector loads of x per thread: enough bytes
# in flight per thread, few enough registers for several CTAs per SM.
TARGET_LDGS = {False: 4, True: 4}
MIN_THREADS_PER_CTA = 128
NARROW_LOAD_COST = 1.75  # measured: q/k-norm rows of 128 bf16, 0.53 -> 0.62-0.64 of copy on an H100 with 8-byte loads
SHARED_WARP_COST = 0.25  # several rows a warp (lanes_per_row < 32): a tie-breaker towards whole-warp rows
# A row's lanes moving less than a 128-byte line per load (4 lanes of 16 bytes): measured on q/k rows of 128
# bf16, 4 lanes read 0.855 / 0.80 of copy on an H100 / H200 where 8 lanes read 0.872 / 0.834 (kernel time).
PARTIAL_LINE_COST = 1.5
# REFINE_MEAN's backward (fp32 LayerNorm) holds a third row sum and takes dgamma after its reduction: in CTAs of
# more than 512 threads (72 registers a thread or fewer) it spills (65537 general rows: 24 bytes in 26 warps x 4
# CTAs), so where a row takes such a last-resort shape it prefers more, narrower CTAs (13 warps x 8: no spill).
REFINED_WIDE_CTA_COST = 1.5
# A wide backward CTA (more than 256 threads) keeps its column sums in shared memory; where they do not fit even
# unstaged, they stay in registers its threads do not have: 131072 bf16 rows in 4 CTAs of 1024 threads spilled
# 1384-1448 bytes a thread and read 0.09-0.20 of copy on an H100, where 8 CTAs of 512 threads with the sums in
# shared memory compiled clean and read 0.64-0.76 (PERFORMANCE.md version 42 (d)). Such shapes come after every
# last resort whose sums fit.
WIDE_SUMS_IN_REGISTERS_COST = 100.0
# A 16-CTA (non-portable) cluster: a backward's, where its column sums then fit shared memory, after every
# portable last resort but before sums left in registers (262144 2-byte backwards). sm_90 only: other GPUs
# (and MIG slices) may hold no such cluster.
NON_PORTABLE_CLUSTER_COST = 90.0
NON_PORTABLE_CLUSTER_ARCH = 90
# Backwards of rows sharing warps, two loads a row or fewer, take 256-thread CTAs: N = 128 bf16 read 0.870 /
# 0.881 of copy on an H100 / H200 with 8 warps a CTA, 0.844 / 0.863 with 4 (at four loads, N = 256, the two
# were within 0.005 on an H100, and 8 warps leave no shared memory for staging).
SHARED_WARP_BACKWARD_THREADS = 256
DEFAULT_STAGES = 3
NARROW_TARGET_ELTS = 16  # loads under 8 bytes: at most this many elements a thread by the load target
STAGED_SMEM_BUDGET = 100 * 1024
# Above 512 threads a CTA gets fewer than 128 registers per thread; wider rows
# are split across a cluster instead.
MAX_HEURISTIC_WARPS_N = {False: 16, True: 8}  # the backward holds twice the row (x and dy)


def late_dgamma_registers(t: Traits) -> Traits:
    """LayerNorm's fp32 backward sums dgamma after its row reduction (Traits.late_dgamma), which lets ptxas
    take more registers than the CTAs an SM the staging budget assumes. Such kernels (up to 16 elements a
    thread) fit 128 registers of an SM's 65536 without spilling in the CTAs and dtypes below (the
    dispatched fp32 cases compiled on sm_90 and sm_80, in a review's enumeration of 2,791 kernels with
    their dtype mixes and flags): the cap keeps that occupancy. Dispatch applies it to tuned entries too. (Measured
    before REFINE_MEAN's backward, version 43: some capped shapes now spill a few bytes, e.g. N = 1024 with
    dresidual in 2 x 2 warps, 4 bytes; dispatch replaces a spilling tuned pick: dispatch.fallbacks.)"""
    held = ([t.output_dtype] + [t.weight_dtype] * t.has_weight + [t.bias_dtype] * t.has_bias
            + [t.weight1_dtype] * t.parallel + [t.residual_dtype] * t.has_residual)  # float64 ones: two words
    if (t.late_dgamma and all(dtypes.itemsize(d) <= 4 for d in held)
            and not t.per_head and not (t.parallel and not t.smem_accumulators) and t.min_ctas_per_sm == 1
            and t.threads_per_cta in (128, 256)):
        return t.replace(min_ctas_per_sm=ctas_for_registers(t.threads_per_cta, 128))
    return t


# Forwards (plain, or with a residual): a CTA per row, loaded straight into registers, no persistent grid,
# registers capped so that many CTAs share an SM (`unstaged_forward`). Measured on an H200 (bf16 and fp32, kernel time,
# PERFORMANCE.md version 37): bf16 LayerNorm 0.83-0.90 of copy -> 0.91-0.94 and RMSNorm 0.81-0.92 -> 0.92-0.95
# at N = 1024-10240, fp32 0.85-0.88 -> 0.95-0.97 at N = 768-8192. Rows of more than 10 warps gained only
# with a power-of-two count (bf16 16384: 2 CTAs of 16 warps an SM; fp32 16384: 1 of 32, 0.53 -> 0.80);
# bf16 12288-15360 lost up to 0.13 (2 CTAs of 12-15 warps).
UNSTAGED_MIN_N, UNSTAGED_MAX_N = 768, 16384  # whole-warp rows; shorter ones share warps (below)
UNSTAGED_ANY_WARPS = 10  # rows of up to this many warps; wider ones, a power of two
UNSTAGED_ELTS_PER_LDG = 4  # 8-byte loads of 2-byte x, 16-byte ones of fp32 (bf16: 8 bytes read as well as 16)
# Bytes of x a thread, by "holds two rows" (a residual: x and the residual, summed in fp32): 32 or 16 bf16
# elements. With a residual (PERFORMANCE.md version 38): H100 0.91-0.94 of copy -> 0.97-0.99, H200
# 0.87-0.91 -> 0.95-0.98; but rows of 32 warps (1024-thread CTAs, one an SM) lost on the H200 (LayerNorm bf16
# 16384 and fp32 8192: -0.04): with a residual, at most UNSTAGED_TWO_ROW_WARPS warps a row. The same shape
# serves fp8 outputs (RMSNorm + residual at 4096 with row scales: 0.902 / 0.890 -> 0.980 / 0.974 of copy on an
# H100 / H200, version 39).
UNSTAGED_BYTES_PER_THREAD = {False: 64, True: 32}
UNSTAGED_TWO_ROW_WARPS = 16
# 2-byte rows the 64-byte rule leaves at 11-15 warps (11264-15360) take UNSTAGED_WIDE_ROW_WARPS warps a row
# and UNSTAGED_WIDE_ROW_CTAS CTAs an SM (85 registers) where that holds them in whole vectors of up to
# UNSTAGED_WIDE_ROW_ELTS elements a thread (11264-14336; LayerNorm 15360 spilled at 60), on sm_90 (sm_80
# spilled at 14336). Forced shapes (run file 2026-11-26-unstaged-short-rows-fp8.txt section 9), H100 / H200:
# LayerNorm 12288 0.951 / 0.912, 14336 0.942 / 0.900; RMSNorm 0.958-0.962 / 0.920-0.929, where the tuned
# picks read 0.861-0.885 / 0.860-0.901; two CTAs an SM lost on the H200. 11264 and 13312 are not measured.
UNSTAGED_WIDE_ROW_WARPS, UNSTAGED_WIDE_ROW_CTAS, UNSTAGED_WIDE_ROW_ELTS, UNSTAGED_WIDE_ROW_MIN_ARCH = 8, 3, 56, 90
UNSTAGED_MIN_THREADS = 64
# Rows shorter than UNSTAGED_MIN_N without a residual share a warp (lanes_per_row < 32; 16-byte loads, two
# warps a CTA), as few lanes a row as hold these bytes of x a thread, by row axes: rows of a matrix, or
# three-axis rows (q/k heads of a fused QKV buffer, whose strided layout favoured fewer bytes a thread).
# Version 39, bf16: 2-D rows of 128-512 0.86-0.90 / 0.81-0.87 of copy -> 0.945-0.955 / 0.92-0.94 on an H100 /
# H200; q of a fused [16384, 3, 32, 128] buffer 0.869 / 0.839 -> 0.915 / 0.891, where a copy kernel of that
# view in place reads 0.92 / 0.90.
# 2-D rows of 256 bf16 read 0.929-0.934 / 0.954-0.956 of copy (H200 / H100) with 128 bytes a thread (4 lanes)
# where 64 bytes (8 lanes) read 0.900-0.923 / 0.934-0.949; a thread holding more than 64 bytes takes up to
# UNSTAGED_HELD_ROW_REGISTERS (64 elements of bf16 spill under 64 registers).
UNSTAGED_SHORT_BYTES_PER_THREAD = {1: 128, 3: 32}
UNSTAGED_SHORT_WARPS = 2
UNSTAGED_HELD_ROW_REGISTERS = 128
# A thread's register cap (32 warps an SM at 64). 2-byte rows of up to 16 elements a thread: 48 (LayerNorm
# bf16 at 768 and 1024 read 0.87 / 0.91 of copy under 64, 0.90 / 0.93 under 48). Weights wider than x (fp32
# gamma over bf16 x) spilled 4 bytes under 64.
UNSTAGED_REGISTERS, UNSTAGED_SHORT_REGISTERS, UNSTAGED_WIDE_WEIGHT_REGISTERS = 64, 48, 80
UNSTAGED_SHORT_ELTS = 16
# Calls no unstaged grid serves, measured or not: a branch (dropout, row scale) or a parallel block.
UNSTAGED_EXCLUDED_FIELDS = ("dropout", "rowscale_dtype", "x1_dtype", "weight1_dtype")


def has_wide_weights(input_dtype: str, fields: dict) -> bool:
    """Whether a call's weight or bias is wider than x (fp32 gamma over bf16 x): more registers."""
    itemsize = dtypes.itemsize(input_dtype)
    weights = ([fields.get("weight_dtype")] * fields.get("has_weight", True)
               + [fields.get("bias_dtype")] * fields.get("has_bias", True))
    return any(d is not None and dtypes.itemsize(d) > itemsize for d in weights)


def unstaged_forward(*, hidden_size: int, input_dtype: str, elts_per_ldg: int, aligned_rows: bool, arch: int,
                     **rest) -> Traits | None:
    """A forward's traits without a persistent grid (Traits.persistent), or None where the call is not one
    measured to gain: aligned rows of 2- or 4-byte x up to UNSTAGED_MAX_N elements, without a branch, x1 or
    a second output. Rows of UNSTAGED_MIN_N or more: UNSTAGED_ELTS_PER_LDG-element vectors (past
    UNSTAGED_ANY_WARPS warps a row, a power-of-two count, or UNSTAGED_WIDE_ROW_WARPS warps for 2-byte rows),
    with or without a residual (then up to UNSTAGED_TWO_ROW_WARPS warps a row) and fp8 scaling; shorter rows
    without a residual share warps (`_short_row_shape`)."""
    itemsize = dtypes.itemsize(input_dtype)
    if (not aligned_rows or itemsize not in (2, 4) or hidden_size > UNSTAGED_MAX_N
            or any(rest.get(k) for k in UNSTAGED_EXCLUDED_FIELDS)):
        return None
    two_rows = bool(rest.get("has_residual"))
    wide_weights = has_wide_weights(input_dtype, rest)
    if hidden_size < UNSTAGED_MIN_N:
        shape = None if two_rows else _short_row_shape(hidden_size, itemsize, elts_per_ldg, rest.get("row_axes", 1))
        if shape is None:
            return None
        held = hidden_size // shape["lanes_per_row"] * itemsize  # bytes of x a thread
        threads = UNSTAGED_SHORT_WARPS * THREADS_PER_WARP
        registers = UNSTAGED_REGISTERS if held <= UNSTAGED_BYTES_PER_THREAD[False] else UNSTAGED_HELD_ROW_REGISTERS
        shape = {**shape, "warps_m": UNSTAGED_SHORT_WARPS, "warps_n": 1}
    else:
        if elts_per_ldg < UNSTAGED_ELTS_PER_LDG:
            return None
        warps = -(-hidden_size // (UNSTAGED_BYTES_PER_THREAD[two_rows] // itemsize) // THREADS_PER_WARP)
        if two_rows and warps > UNSTAGED_TWO_ROW_WARPS:
            return None
        quant = rest.get("quant", "none") != "none"  # fp8 scaling's extra reductions spilled under 48
        if warps > UNSTAGED_ANY_WARPS and warps & (warps - 1):
            wide_threads = UNSTAGED_WIDE_ROW_WARPS * THREADS_PER_WARP
            if (two_rows or itemsize != 2 or arch < UNSTAGED_WIDE_ROW_MIN_ARCH
                    or hidden_size % (wide_threads * UNSTAGED_ELTS_PER_LDG)
                    or hidden_size // wide_threads > UNSTAGED_WIDE_ROW_ELTS):
                return None
            threads, registers = wide_threads, REGISTERS_PER_SM // (UNSTAGED_WIDE_ROW_CTAS * wide_threads)
        else:
            threads = max(UNSTAGED_MIN_THREADS, warps * THREADS_PER_WARP)
            if itemsize == 2 and not two_rows and not quant and hidden_size <= UNSTAGED_SHORT_ELTS * threads:
                registers = UNSTAGED_SHORT_REGISTERS
            else:
                registers = UNSTAGED_REGISTERS
        shape = {"warps_n": threads // THREADS_PER_WARP, "bytes_per_ldg": UNSTAGED_ELTS_PER_LDG * itemsize}
    if wide_weights:
        registers = max(registers, UNSTAGED_WIDE_WEIGHT_REGISTERS)
    try:
        t = Traits(hidden_size=hidden_size, input_dtype=input_dtype, aligned_rows=True, **rest,
                   **{**KNOB_DEFAULTS, **shape, "stages": 1, "persistent": False, "cache_weights": False,
                      "min_ctas_per_sm": ctas_for_registers(threads, registers)})
        t.check_arch(arch)
    except ValueError:
        return None
    return t


def _short_row_shape(hidden_size: int, itemsize: int, elts_per_ldg: int, row_axes: int) -> dict | None:
    """Knobs of a row shorter than UNSTAGED_MIN_N sharing a warp: the fewest lanes (LANES_PER_ROW) that
    hold it at UNSTAGED_SHORT_BYTES_PER_THREAD a thread in whole 16-byte vectors, or None."""
    per_thread = UNSTAGED_SHORT_BYTES_PER_THREAD[1 if row_axes == 1 else 3] // itemsize
    vector = dtypes.vector_elements(itemsize)
    if elts_per_ldg < vector:
        return None
    for lanes in LANES_PER_ROW:
        if lanes * per_thread >= hidden_size and hidden_size % (lanes * vector) == 0:
            return {"lanes_per_row": lanes, "bytes_per_ldg": vector * itemsize}
    return None


def _column_sums_fit_smem(t: Traits, arch: int) -> bool:
    """Whether a backward's column sums (and its weights' slots) fit the GPU's shared memory, unstaged."""
    try:
        return t.replace(stages=1, smem_accumulators=True).smem_footprint <= SMEM_LIMIT.get(arch, DEFAULT_SMEM_LIMIT)
    except ValueError:
        return False


def cluster_offered(t: Traits, arch: int, portable_only: bool = False) -> bool:
    """Whether the heuristic and the tuner offer traits' CTAs a row: a portable cluster always; a 16-CTA
    (non-portable) one to sm_90 backwards whose column sums then fit shared memory, unless `portable_only`."""
    if t.ctas_per_row <= PORTABLE_CLUSTER:
        return True
    return (not portable_only and t.backward and arch == NON_PORTABLE_CLUSTER_ARCH
            and _column_sums_fit_smem(t, arch))


def heuristic(*, hidden_size: int, input_dtype: str, elts_per_ldg: int | None = None, aligned_rows: bool = True,
              backward: bool = False, arch: int = CLUSTER_MIN_ARCH, unstaged: bool = True,
              portable_clusters: bool = False, **rest) -> Traits:
    """Legal traits for any hidden size: a forward unstaged_forward serves
    takes its traits (unless `unstaged` is False); otherwise the candidate with the fewest idle
    vector slots and the load count closest to TARGET_LDGS, preferring fewer
    CTAs per row and rows within the register budget; then enough rows per
    CTA to reach MIN_THREADS_PER_CTA. portable_clusters=True: no 16-CTA clusters."""
    itemsize = dtypes.itemsize(input_dtype)
    if elts_per_ldg is None:  # contiguous aligned rows: the widest vector that divides the row
        elts_per_ldg = dtypes.vector_elements(itemsize)
        while hidden_size % elts_per_ldg:
            elts_per_ldg //= 2
    if unstaged and not backward:
        pick = unstaged_forward(hidden_size=hidden_size, input_dtype=input_dtype, elts_per_ldg=elts_per_ldg,
                                aligned_rows=aligned_rows, arch=arch, **rest)
        if pick is not None:
            return pick
    two_rows = backward or rest.get("has_residual", False) or rest.get("x1_dtype") is not None
    ctas_options = CTAS_PER_ROW_CHOICES if arch >= CLUSTER_MIN_ARCH else (1,)
    best, best_cost = None, math.inf
    # The widest vector, and half of it (at NARROW_LOAD_COST): a short row (N = 128 in bf16: a q/k head) fills
    # a whole warp with 8-byte loads where 16-byte ones leave half of it idle.
    # Short aligned rows may also share a warp (lanes_per_row < 32: several rows a warp, one warp wide).
    for narrow, ctas, lanes in itertools.product((0, 1), ctas_options, LANES_PER_ROW[::-1]):
        if lanes < THREADS_PER_WARP and (ctas > 1 or not aligned_rows):
            continue
        bytes_per_ldg = (elts_per_ldg * itemsize) >> narrow
        # Without clusters, a row must fit one CTA (of at most 16 warps: wider CTAs get 64 registers a thread).
        max_warps_n = MAX_HEURISTIC_WARPS_N[backward] if arch >= CLUSTER_MIN_ARCH else 16
        for warps_n in range(1, 33) if lanes == THREADS_PER_WARP else (1,):
            try:
                t = Traits(hidden_size=hidden_size, input_dtype=input_dtype, backward=backward,
                           **{**KNOB_DEFAULTS, "warps_n": warps_n, "ctas_per_row": ctas,
                              "bytes_per_ldg": bytes_per_ldg, "stages": 1, "lanes_per_row": lanes,
                              "cache_weights": not (rest.get("per_head", False) or rest.get("weight1_dtype"))},
                           aligned_rows=aligned_rows, **rest)
            except ValueError:
                continue
            if not cluster_offered(t, arch, portable_only=portable_clusters):
                continue
            slots = t.ldgs * t.vec_cols_per_ldg
            idle = (slots - t.vec_cols) / slots
            # Fewer loads than the target cost latency hiding; more cost registers (and spill). Loads under 8
            # bytes (one- and two-element vectors of odd layouts) aim at the bytes of TARGET_LDGS 16-byte loads,
            # up to NARROW_TARGET_ELTS elements (rows with x1, a residual and dropout hold three rows).
            target = TARGET_LDGS[backward]
            if bytes_per_ldg < 8:
                target = min(target * 16 // bytes_per_ldg, max(target, NARROW_TARGET_ELTS // t.elts_per_ldg))
            ratio = math.log2(t.ldgs / target)
            cost = (4.0 * idle + (-ratio if ratio < 0 else 3.0 * ratio) + 0.25 * (ctas - 1)
                    + 0.5 * (warps_n & (warps_n - 1) != 0) + NARROW_LOAD_COST * narrow
                    + (lanes < THREADS_PER_WARP) * (SHARED_WARP_COST
                                                    + PARTIAL_LINE_COST * (lanes * bytes_per_ldg < 128)))
            # Last resorts, for rows nothing else holds: wider CTAs than the register file favours, more
            # elements per thread than fit without spilling.
            preferred = PREFERRED_ELTS_PER_THREAD[two_rows] // t.register_words
            cost += 20.0 * (warps_n > max_warps_n) + 40.0 * (t.elts_per_thread > preferred)
            cost += REFINED_WIDE_CTA_COST * (backward and t.refine_mean and t.threads_per_cta > 512)
            cost += NON_PORTABLE_CLUSTER_COST * (ctas > PORTABLE_CLUSTER)
            cost += WIDE_SUMS_IN_REGISTERS_COST * (backward and t.threads_per_cta > 256
                                                   and not _column_sums_fit_smem(t, arch))
            if cost < best_cost:
                best, best_cost = t, cost
    if best is None:
        raise ValueError(f"x: hidden size {hidden_size} ({input_dtype}, {'backward' if backward else 'forward'}) "
                         f"does not fit the register-resident kernel on sm_{arch} (at most 8 CTAs of a "
                         f"cluster from sm_90, 16 for sm_90 backwards whose column sums then fit shared memory; "
                         f"one CTA before sm_90)")
    # Wide CTAs get few registers per thread: there, weights are re-read instead
    # of held, and the backward keeps its column sums in shared memory.
    # (A second weight doubles the column sums: they go to shared memory too.)
    smem_sums = backward and (best.threads_per_cta > 256 or rest.get("weight1_dtype") is not None)
    if best.threads_per_cta > 256:
        try:
            best = best.replace(cache_weights=False)
        except ValueError:  # general rows whose weights would not fit shared memory (wide fp64 rows): registers
            pass
    if best.ctas_per_row == 1:
        shared = backward and best.lanes_per_row < THREADS_PER_WARP and best.ldgs <= 2
        warps_m = max(1, (SHARED_WARP_BACKWARD_THREADS if shared else MIN_THREADS_PER_CTA) // best.threads_per_cta)
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
            if staged.smem_footprint <= limit and (stages == 1 or staged.smem_bytes <= budget):
                staged.check_arch(arch)
                return late_dgamma_registers(staged)
    raise ValueError(f"x: hidden size {hidden_size} ({input_dtype}, {'backward' if backward else 'forward'}) "
                     f"needs more shared memory than sm_{arch} has")
