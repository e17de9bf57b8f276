// Kernel traits of the row-normalization family (LayerNorm and RMSNorm,
// forward and backward), filled in from cunorm.Traits.
//
// The independent knobs and flags are rendered from Python; everything else is
// derived here, and cunorm/traits.py derives the same quantities and
// cunorm/traits_rules.py states the same rules (the static_asserts at the end
// check that the two agree).
#pragma once

typedef ${INPUT_T} input_t;          // x (forward); x and dx (backward)
typedef ${WEIGHT_T} weight_t;        // gamma and dgamma
typedef ${BIAS_T} bias_t;            // beta and dbeta
typedef ${OUTPUT_T} output_t;        // y (forward), dy (backward)
typedef ${RESIDUAL_T} residual_t;    // residual (forward), dresidual (backward)
typedef ${RESIDUAL_OUT_T} residual_out_t;  // residual_out = x + residual (forward)
typedef ${COMPUTE_T} compute_t;     // statistics, sums and arithmetic: fp32, or fp64 for fp64 x

constexpr int COLS = ${HIDDEN_SIZE};
constexpr int WARPS_M = ${WARPS_M};
constexpr int WARPS_N = ${WARPS_N};
#define CN_CTAS_PER_ROW ${CTAS_PER_ROW}
constexpr int CTAS_PER_ROW = CN_CTAS_PER_ROW;
constexpr int BYTES_PER_LDG = ${BYTES_PER_LDG};
constexpr bool RMS = ${RMS};                      // RMSNorm (no mean) rather than LayerNorm
constexpr bool HAS_WEIGHT = ${HAS_WEIGHT};
constexpr bool HAS_BIAS = ${HAS_BIAS};
constexpr bool HAS_RESIDUAL = ${HAS_RESIDUAL};    // forward: residual added; backward: dresidual added
constexpr bool ZERO_CENTERED = ${ZERO_CENTERED};  // the weight multiplies as (1 + gamma)
// LayerNorm rows of fp32 precision (x, or in the forward what is summed into it, fp32): the fp32 mean's error
// (its sum's rounding and its own, a few ulps of |mean|: xhat's error in units of the std) is undone on rows
// whose mean lies REFINE_MIN_OFFSET standard deviations or more from zero. The forward's such rows' groups take
// one more row reduction, of h - mean; the backward, given the mean rounded to fp32, sums x - mean beside its
// other row sums and takes the mean of xhat off xhat. On the other rows the error stays within a few ulps of
// 4 std. Half-precision rows carry too few bits for it to matter.
constexpr bool REFINE_MEAN = ${REFINE_MEAN};
constexpr float REFINE_MIN_OFFSET = ${REFINE_MIN_OFFSET};
// A LayerNorm forward of a cluster row: its mean and squared deviations in one cluster exchange (norm_fwd.cu).
constexpr bool MERGED_MOMENTS = ${MERGED_MOMENTS};
static_assert(!MERGED_MOMENTS || (!RMS && CTAS_PER_ROW > 1), "merged moments are a LayerNorm cluster row's");
// A cluster row's exchanges pushed into the peers' shared memory (st.async, mbarriers: RowReducer) instead
// of a cluster barrier and loads from the peers'.
constexpr bool PUSHED_EXCHANGE = ${PUSHED_EXCHANGE};
static_assert(!PUSHED_EXCHANGE || (CTAS_PER_ROW > 1 && WARPS_M == 1), "pushed exchanges are a cluster row's");
// The load steps in which every thread's vector holds elements of the row skip the column check (WHOLE_STEPS,
// below), which the compiler cannot prove itself: it folds away at compile time. More loads go unpredicated and
// may be hoisted: fewer instructions, often more registers (a tuned knob; no effect with full tiles).
constexpr bool UNCHECKED_WHOLE_STEPS = ${UNCHECKED_WHOLE_STEPS};
// A forward thread's row sums (the mean's, the squares') in SUM_CHAINS independent chains of adds, element e of a
// vector into chain e % SUM_CHAINS, added pairwise at the end: shorter dependent chains where few warps an SM hide
// the adds' latency (a tuned knob; other chains, other rounding).
constexpr int SUM_CHAINS = ${SUM_CHAINS};
// An unstaged persistent kernel (STAGES == 1) loads its next row into registers when it takes the current one
// (RowPipe), so the loads overlap the current row's reduction and stores: a row's vectors more registers (a tuned
// knob of backwards; the same arithmetic, the same bits).
constexpr bool REGISTER_AHEAD = ${REGISTER_AHEAD};
// With REGISTER_AHEAD, the next row's statistics (the backward's mean and rstd: RowStat) are held ahead too, so the
// row's first use of them does not wait on their loads (a tuned knob; the same bits).
constexpr bool STATS_AHEAD = ${STATS_AHEAD};
// Every row starts on a vector boundary and is whole vectors long. Otherwise
// (the general kernel) a row is read in the aligned frame around it: vector v
// of a row covers the elements [v * E - shift, (v + 1) * E - shift), where
// shift is the row start's offset from a vector boundary, and the lanes
// outside the row are masked.
constexpr bool ALIGNED_ROWS = ${ALIGNED_ROWS};
constexpr bool CACHE_WEIGHTS = ${CACHE_WEIGHTS};
constexpr int MIN_CTAS_PER_SM = ${MIN_CTAS_PER_SM};
constexpr int STAGES = ${STAGES};  // rows in flight per thread (>= 2: staged in shared memory)
constexpr bool PERSISTENT = ${PERSISTENT};  // one wave of CTAs walking many rows, or (forward) a CTA a row group
// How a row tensor's rows are found: one row stride (1), or up to three leading
// axes with their own strides (3: e.g. q/k views [B, S, H, D] of a fused QKV
// buffer, whose leading strides do not merge into one). Aligned rows only.
// Weights of shape [heads, N] (per-head q/k-norm weights): row r takes head r % heads,
// read where used (never held or kept in shared memory).
#define CN_PER_HEAD ${PER_HEAD}
constexpr bool PER_HEAD = CN_PER_HEAD;
#define CN_ROW_AXES ${ROW_AXES}
constexpr int ROW_AXES = CN_ROW_AXES;

// Lanes of a warp sharing a row: 32, or fewer for short rows (several rows a warp, each reduced over its
// own lanes; WARPS_N == CTAS_PER_ROW == 1).
constexpr int LANES_PER_ROW = ${LANES_PER_ROW};

constexpr int THREADS_PER_WARP = 32;
constexpr int ROWS_PER_WARP = THREADS_PER_WARP / LANES_PER_ROW;
constexpr int THREADS_PER_ROW = WARPS_N * LANES_PER_ROW;
constexpr int ROWS_PER_CTA = WARPS_M * ROWS_PER_WARP;
constexpr int THREADS_PER_CTA = WARPS_M * WARPS_N * THREADS_PER_WARP;
constexpr int ELTS_PER_LDG = BYTES_PER_LDG / int(sizeof(input_t));
// Vectors a row touches: COLS / E when aligned; up to one more when shifted.
constexpr int VEC_COLS = ALIGNED_ROWS ? COLS / ELTS_PER_LDG : (COLS + 2 * ELTS_PER_LDG - 2) / ELTS_PER_LDG;
constexpr int VEC_COLS_PER_LDG = CTAS_PER_ROW * THREADS_PER_ROW;  // vectors one LDG step covers
constexpr int LDGS = (VEC_COLS + VEC_COLS_PER_LDG - 1) / VEC_COLS_PER_LDG;
constexpr int ELTS_PER_THREAD = LDGS * ELTS_PER_LDG;
// Whether every thread's every LDG lands inside the row (no column predicate).
constexpr bool FULL_TILES = ALIGNED_ROWS && VEC_COLS % VEC_COLS_PER_LDG == 0;
// LDG steps in which every thread's vector holds elements of the row (starts before its end, whatever the shift;
// shifted rows: those ending by N / E vectors, one step short of the exact count where N % E != 0).
constexpr int WHOLE_STEPS = ALIGNED_ROWS ? VEC_COLS / VEC_COLS_PER_LDG : COLS / ELTS_PER_LDG / VEC_COLS_PER_LDG;
static_assert((SUM_CHAINS == 1 || SUM_CHAINS == 2 || SUM_CHAINS == 4) && SUM_CHAINS <= ELTS_PER_LDG,
              "sum chains: 1, 2 or 4, each taking a vector's elements in turn");

static_assert(sizeof(compute_t) == 4 || sizeof(compute_t) == 8, "compute_t must be fp32 or fp64");
static_assert((sizeof(compute_t) == 8) == (sizeof(input_t) == 8), "compute_t is fp64 exactly for fp64 x");
static_assert(WARPS_M >= 1 && WARPS_N >= 1, "WARPS_M and WARPS_N must be >= 1");
static_assert(THREADS_PER_CTA <= 1024, "at most 1024 threads per CTA");
static_assert(BYTES_PER_LDG == 2 || BYTES_PER_LDG == 4 || BYTES_PER_LDG == 8 || BYTES_PER_LDG == 16,
              "BYTES_PER_LDG must be 2, 4, 8 or 16");
static_assert(BYTES_PER_LDG % sizeof(input_t) == 0, "BYTES_PER_LDG must hold whole input elements");
static_assert(!ALIGNED_ROWS || COLS % ELTS_PER_LDG == 0, "aligned rows must be whole vectors long");
static_assert(CTAS_PER_ROW == 1 || CTAS_PER_ROW == 2 || CTAS_PER_ROW == 4 || CTAS_PER_ROW == 8 || CTAS_PER_ROW == 16,
              "CTAS_PER_ROW must be 1, 2, 4, 8 (a portable cluster) or 16 (a non-portable one)");
static_assert(CTAS_PER_ROW == 1 || WARPS_M == 1, "several CTAs per row need WARPS_M == 1");
static_assert(STAGES >= 1 && STAGES <= 8, "STAGES must be 1..8");
static_assert(PERSISTENT || STAGES == 1, "a grid of a CTA per row group reads its rows straight into registers");
static_assert(!REGISTER_AHEAD || (STAGES == 1 && PERSISTENT), "rows ahead in registers: unstaged persistent kernels");
static_assert(!STATS_AHEAD || REGISTER_AHEAD, "statistics ahead: with rows ahead in registers");
static_assert(MIN_CTAS_PER_SM >= 1 && MIN_CTAS_PER_SM * THREADS_PER_CTA <= 2048,
              "MIN_CTAS_PER_SM must be >= 1 and fit 2048 threads per SM");
static_assert(LANES_PER_ROW == 4 || LANES_PER_ROW == 8 || LANES_PER_ROW == 16 || LANES_PER_ROW == 32,
              "LANES_PER_ROW must be 4, 8, 16 or 32");
static_assert(LANES_PER_ROW == THREADS_PER_WARP || (WARPS_N == 1 && CTAS_PER_ROW == 1),
              "several rows a warp (LANES_PER_ROW < 32) need WARPS_N == 1 and CTAS_PER_ROW == 1");
static_assert(LANES_PER_ROW == THREADS_PER_WARP || ALIGNED_ROWS, "several rows a warp (LANES_PER_ROW < 32) need aligned rows");
static_assert(ROW_AXES == 1 || ROW_AXES == 3, "ROW_AXES must be 1 or 3");
static_assert(!PER_HEAD || !CACHE_WEIGHTS, "per-head weights are read per row, not held");
static_assert(ROW_AXES == 1 || ALIGNED_ROWS, "rows through three leading axes must be aligned rows");
static_assert(!ZERO_CENTERED || HAS_WEIGHT, "a zero-centered weight needs a weight");
static_assert(!REFINE_MEAN || (!RMS && sizeof(compute_t) == 4), "REFINE_MEAN is for LayerNorm's fp32 statistics");

// The rows of one row tensor with ROW_AXES == 3: row r = (i0, i1, i2) in C
// order over leading sizes (d0, d1, d2) starts at i0 * s0 + i1 * s1 + i2 * s2.
// The host adds each size's divider (`cunorm.launch.divider`): a row's
// indices then cost two multiply-highs instead of two 32-bit divisions.
struct RowAxes {
  long long s0, s1, s2;
  unsigned d1, d2;
  unsigned magic1, magic2, shift1, shift2;
};
// n / d for n < 2^31, from d's divider (magic, shift).
__device__ __forceinline__ unsigned divide(unsigned n, unsigned magic, unsigned shift) {
  return (__umulhi(n, magic) + n) >> shift;
}
template <int AXES> struct RowStrideOf { using type = long long; };
template <> struct RowStrideOf<3> { using type = RowAxes; };
using row_stride_t = typename RowStrideOf<CN_ROW_AXES>::type;  // a row tensor's kernel parameter

// Elements from a row tensor's start to row `row`.
__device__ __forceinline__ long long row_offset(long long ld, long long row) { return row * ld; }
__device__ __forceinline__ long long row_offset(const RowAxes& a, long long row) {
  const unsigned r = static_cast<unsigned>(row);  // the host keeps rows below 2^31
  const unsigned q = divide(r, a.magic2, a.shift2), i0 = divide(q, a.magic1, a.shift1);
  return static_cast<long long>(i0) * a.s0 + static_cast<long long>(q - i0 * a.d1) * a.s1 +
         static_cast<long long>(r - q * a.d2) * a.s2;
}
// Whether rows are at least one vector apart (only the general kernel, with one row stride, asks).
__device__ __forceinline__ bool rows_a_vector_apart(long long ld) { return ld >= ELTS_PER_LDG; }
__device__ __forceinline__ bool rows_a_vector_apart(const RowAxes&) { return false; }

#if CN_CTAS_PER_ROW > 1
#define CN_CLUSTER_DIMS __cluster_dims__(CN_CTAS_PER_ROW, 1, 1)
#else
#define CN_CLUSTER_DIMS
#endif

// A compile-time flag as a value, for generic lambdas.
template <bool B>
struct Flag {
  static constexpr bool value = B;
};

// 2^E in compute_t as a compile-time value, for generic lambdas.
__host__ __device__ constexpr compute_t power_of_two(int e) {
  compute_t v = 1;
  for (; e > 0; --e) v *= 2;
  for (; e < 0; ++e) v /= 2;
  return v;
}
template <int E>
struct PowerOfTwo {
  static constexpr compute_t value = power_of_two(E);
};

// The multiplier of xhat: gamma, or 1 + gamma for a zero-centered weight.
__device__ __forceinline__ compute_t scale_of(compute_t gamma) { return ZERO_CENTERED ? compute_t(1) + gamma : gamma; }

// Python's derivation of the same traits (cunorm/traits.py) must agree.
static_assert(LDGS == ${LDGS}, "cunorm.Traits.ldgs disagrees with the kernel");
static_assert(WHOLE_STEPS == ${WHOLE_STEPS}, "cunorm.Traits.whole_steps disagrees with the kernel");
static_assert(ELTS_PER_THREAD == ${ELTS_PER_THREAD}, "cunorm.Traits.elts_per_thread disagrees with the kernel");
static_assert(THREADS_PER_CTA == ${THREADS_PER_CTA}, "cunorm.Traits.threads_per_cta disagrees with the kernel");
