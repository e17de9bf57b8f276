"""What the row-normalization kernels allow: the GPU's limits and the kernels', and every static_assert of the
kernels (norm_traits.cuh, norm_fwd.cu, norm_bwd.cu) restated over a `cunorm.traits.Traits` (`check`, and
`check_arch` for one GPU), so illegal traits fail in Python, with the rule named, before anything is compiled
or launched."""
from __future__ import annotations

from . import dtypes

THREADS_PER_WARP = 32
MAX_THREADS_PER_CTA = 1024
REGISTERS_PER_SM = 65536
# Elements of a row one thread holds in registers: a hard cap (above it the compiler spills; the compile tier
# checks every tuned entry).
MAX_ELTS_PER_THREAD = 64  # the general kernel may hold one vector more (see Traits.max_elts_per_thread)
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # per CTA, by arch
DEFAULT_SMEM_LIMIT = 99 * 1024
CLUSTER_MIN_ARCH = 90
# CTAs a row may span: a thread-block cluster of up to PORTABLE_CLUSTER, or 16 (non-portable: the compiler
# allows it per kernel before launch; fewer such clusters may be resident, where GPCs are smaller).
PORTABLE_CLUSTER = 8
CTAS_PER_ROW_CHOICES = (1, 2, 4, 8, 16)
MIN_ARCH = 80  # cp.async and the bf16/f16x2 conversion instructions
LANES_PER_ROW = (4, 8, 16, 32)  # lanes of a warp sharing a row: below 32, a warp holds several (short) rows
QUANT_MODES = ("none", "tensor", "row", "group")  # fp8 output scalings, as kernels/norm_fwd.cu numbers them
QUANT_GROUP_COLS = 128


def ctas_for_registers(threads_per_cta: int, registers: int) -> int:
    """MIN_CTAS_PER_SM that caps a thread of a `threads_per_cta` CTA at about `registers` registers."""
    return max(1, REGISTERS_PER_SM // (threads_per_cta * registers))


def check(t) -> None:
    """Raise a ValueError naming the rule `t` (a cunorm.traits.Traits) breaks, if any: the kernels'
    static_asserts, and the limits no GPU exceeds (shared memory within sm_90's 227 KB; `check_arch` applies
    the GPU's own)."""
    def rule(ok: bool, message: str):
        if not ok:
            raise ValueError(f"illegal traits {t.short()}: {message}")

    rule(isinstance(t.hidden_size, int) and t.hidden_size >= 1, "hidden_size must be a positive int")
    rule(t.compute_dtype == dtypes.compute_dtype(t.input_dtype),
         f"compute_dtype must be {dtypes.compute_dtype(t.input_dtype)} for {t.input_dtype} x "
         f"(float64 exactly for float64 x)")
    rule(t.warps_m >= 1 and t.warps_n >= 1, "WARPS_M and WARPS_N must be >= 1")
    rule(t.threads_per_cta <= MAX_THREADS_PER_CTA, "at most 1024 threads per CTA (WARPS_M * WARPS_N * 32)")
    rule(t.bytes_per_ldg in (2, 4, 8, 16), "BYTES_PER_LDG must be 2, 4, 8 or 16")
    rule(t.bytes_per_ldg % dtypes.itemsize(t.input_dtype) == 0,
         "BYTES_PER_LDG must hold whole input elements")
    rule(not t.aligned_rows or t.hidden_size % t.elts_per_ldg == 0,
         f"aligned rows must be whole vectors long: the hidden size must be a multiple of the elements per "
         f"load ({t.elts_per_ldg})")
    rule(t.ctas_per_row in CTAS_PER_ROW_CHOICES,
         "CTAS_PER_ROW must be 1, 2, 4, 8 (a portable cluster) or 16 (a non-portable one: the GPU "
         "may hold none, and then the kernel cannot load)")
    rule(t.ctas_per_row == 1 or t.warps_m == 1, "several CTAs per row need WARPS_M == 1")
    rule(t.warps_n == 1 or t.warps_m < 16, "rows of several warps need WARPS_M < 16 (a named barrier each)")
    rule(t.lanes_per_row in LANES_PER_ROW, "LANES_PER_ROW must be 4, 8, 16 or 32")
    rule(t.lanes_per_row == THREADS_PER_WARP or (t.warps_n == 1 and t.ctas_per_row == 1),
         "several rows a warp (LANES_PER_ROW < 32) need WARPS_N == 1 and CTAS_PER_ROW == 1")
    rule(t.lanes_per_row == THREADS_PER_WARP or t.aligned_rows,
         "several rows a warp (LANES_PER_ROW < 32) need aligned rows")
    rule(t.elts_per_thread <= t.max_elts_per_thread,
         f"{t.elts_per_thread} elements per thread exceed the register budget of {t.max_elts_per_thread}")
    rule(1 <= t.stages <= 8, "STAGES must be 1..8")
    rule(t.persistent or (not t.backward and t.stages == 1),
         "a grid of a CTA per row group (PERSISTENT = false) is a forward of one stage")
    rule(t.stages == 1 or all(t.elts_per_ldg * dtypes.itemsize(d) >= 4 for d in t.staged_dtypes),
         "staged rows need vectors of >= 4 bytes of every staged row tensor (cp.async moves 4-16 bytes)")
    rule(t.row_axes in (1, 3), "ROW_AXES must be 1 or 3")
    rule(t.row_axes == 1 or t.aligned_rows, "rows through three leading axes must be aligned rows")
    rule(not t.per_head or not t.cache_weights, "per-head weights are read per row, not held "
         "(cache_weights must be False)")
    rule(t.backward or not t.from_output, "from_output is a backward flag")
    rule(not t.grid_finalize or (t.backward and (t.has_weight or t.has_bias)),
         "GRID_FINALIZE needs column sums (a backward with a weight or a bias)")
    rule(not t.grid_finalize or t.ctas_per_row == 1,
         "GRID_FINALIZE needs CTAS_PER_ROW == 1 (a cooperative grid of whole-row CTAs, no clusters)")
    rule(not t.dropout_mask or (t.dropout and not t.backward), "a dropout mask needs a forward's dropout")
    rule((t.dx0_dtype is not None) == (t.backward and t.branch),
         "dx0_dtype is given exactly for a backward with dropout or a row scale")
    rule(not t.branch or t.quant == "none", "dropout and a row scale: not with fp8 outputs (yet)")
    rule(not t.backward or t.x1_dtype is None, "x1_dtype is a forward field (the backward: dx1_dtype)")
    rule(t.x1_dtype is None or t.rowscale_dtype is None, "x1: not with a row scale")
    rule((t.dx1_dtype is not None) <= (t.backward and t.dropout),
         "dx1_dtype is given only for a backward with dropout")
    rule(t.bias1_dtype is None or t.parallel, "a second bias needs a second weight")
    rule(not t.parallel or (t.quant == "none" and not t.per_head),
         "a second weight: not with fp8 outputs or per-head weights")
    fp8 = t.output_dtype in dtypes.FP8_NAMES and not t.backward
    rule(t.quant in QUANT_MODES, f"QUANT must be one of {', '.join(QUANT_MODES)}")
    rule(fp8 == (t.quant != "none"), "an fp8 output (forward) needs a scaling (quant), and only it has one")
    rule(not t.amax or fp8, "amax is kept for fp8 outputs only")
    rule(not fp8 or t.compute_dtype == "float32", "fp8 outputs are of fp32, fp16 or bf16 x")
    rule(t.quant != "group" or (t.aligned_rows and t.hidden_size % QUANT_GROUP_COLS == 0
                                and 4 <= t.elts_per_ldg and QUANT_GROUP_COLS % t.elts_per_ldg == 0
                                and QUANT_GROUP_COLS // t.elts_per_ldg <= t.lanes_per_row),
         "128-column scaling needs aligned rows, N a multiple of 128, loads of >= 4 elements and a group's "
         "lanes within a row's")
    rule(not t.zero_centered or t.has_weight, "a zero-centered weight needs a weight")
    rule(1 <= t.min_ctas_per_sm and t.min_ctas_per_sm * t.threads_per_cta <= 2048,
         "MIN_CTAS_PER_SM must be >= 1 and fit 2048 threads per SM")
    rule(t.smem_footprint <= SMEM_LIMIT[90], f"{_smem_words(t)} exceed 227 KB")
    rule(t.backward or not t.smem_accumulators, "smem_accumulators is a backward knob")
    rule(t.backward or t.recompute, "recompute is a backward knob")
    rule(type(t.register_sum_steps) is int and t.register_sum_steps >= 0  # (not a bool: it renders as one)
         and (t.register_sum_steps == 0 or (t.smem_accumulators and t.register_sum_steps < t.ldgs)),
         f"register_sum_steps must be 0, or with smem_accumulators 1 .. ldgs - 1 ({t.ldgs - 1})")
    rule(not t.merged_moments or (not t.backward and not t.rms and t.ctas_per_row > 1),
         "merged_moments is a knob of LayerNorm forwards of cluster rows (ctas_per_row > 1)")
    rule(type(t.unchecked_whole_steps) is bool, "unchecked_whole_steps must be True or False")
    rule(type(t.sum_chains) is int and (t.sum_chains == 1 or (  # (not a bool: it renders as one)
        t.sum_chains in (2, 4) and not t.backward and t.sum_chains <= t.elts_per_ldg)),
         f"sum_chains must be 1, or for a forward 2 or 4, at most elts_per_ldg ({t.elts_per_ldg})")
    rule(not t.pushed_exchange or t.ctas_per_row > 1, "pushed_exchange is a knob of cluster rows "
         "(ctas_per_row > 1)")
    rule(type(t.register_ahead) is bool and (not t.register_ahead or (t.backward and t.stages == 1)),
         "register_ahead must be True or False, and True only for a backward with stages=1")  # (all persistent)
    rule(type(t.stats_ahead) is bool and (not t.stats_ahead or t.register_ahead),
         "stats_ahead must be True or False, and True only with register_ahead")


def check_arch(t, arch: int) -> None:
    """The rules that depend on the GPU: sm_80 or newer; clusters need sm_90; shared memory within the GPU's
    per-CTA limit."""
    if arch < MIN_ARCH:
        raise ValueError(f"illegal traits {t.short()}: the normalization kernels need sm_{MIN_ARCH} or newer "
                         f"(cp.async, bf16 conversions), not sm_{arch}")
    if t.uses_cluster and arch < CLUSTER_MIN_ARCH:
        raise ValueError(f"illegal traits {t.short()}: CTAS_PER_ROW > 1 needs thread-block clusters "
                         f"(sm_{CLUSTER_MIN_ARCH} or newer), not sm_{arch}")
    limit = SMEM_LIMIT.get(arch, DEFAULT_SMEM_LIMIT)
    if t.smem_footprint > limit:
        raise ValueError(f"illegal traits {t.short()}: {_smem_words(t)} exceed sm_{arch}'s {limit}")


def _smem_words(t) -> str:
    """The shared memory a CTA takes, in words for an error."""
    return f"{t.smem_bytes} bytes of dynamic and up to {t.static_smem_bytes} of static shared memory"
