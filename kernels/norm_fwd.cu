// Row normalization forward over the last axis, with h = x (+ residual):
//   LayerNorm  y = (h - mean) * rstd * g + beta
//   RMSNorm    y = h * rstd * g,         rstd = 1 / sqrt(mean(h^2) + eps)
// where g is gamma, or 1 + gamma for a zero-centered weight. With a residual,
// h is summed in fp32 (compute_t: fp64 for fp64 x) and also stored (residual_out).
//
// Each row lives in registers (LDGS vectors of ELTS_PER_LDG elements per
// thread), so it is read from memory exactly once; the next STAGES - 1 rows are
// in flight meanwhile (see for_each_row). LayerNorm's mean and variance are
// exact two-pass sums in compute_t over the registers, never E[h^2] - E[h]^2.
#include "cunorm_common.cuh"
#include "norm_traits.cuh"
#include "norm_rows.cuh"
#include "row_reducer.cuh"

// fp8 outputs: y is stored as y / scale, rounded to nearest even and saturated, with the scale given for the
// tensor (QUANT_TENSOR), or the amax of |y| over the row (QUANT_ROW) or over each 128 columns (QUANT_GROUP)
// divided by the format's largest value, those scales stored beside y. AMAX: the largest |y| of the whole
// call is also stored (for delayed scaling; NaN is ignored, as fmaxf does).
#define CN_QUANT ${QUANT}
#define CN_AMAX ${AMAX}
enum QuantMode : int { QUANT_NONE = 0, QUANT_TENSOR = 1, QUANT_ROW = 2, QUANT_GROUP = 3 };
constexpr int QUANT = CN_QUANT;
constexpr bool AMAX = CN_AMAX;
constexpr int QUANT_GROUP_COLS = 128;
template <typename T> struct FormatMax { static constexpr float value = 1.f; };
template <> struct FormatMax<cn_fp8e4m3> { static constexpr float value = Fp8Format<cn_fp8e4m3>::MAX; };
template <> struct FormatMax<cn_fp8e5m2> { static constexpr float value = Fp8Format<cn_fp8e5m2>::MAX; };
constexpr int GROUP_LANES = QUANT_GROUP_COLS / ELTS_PER_LDG;  // the lanes holding one group (QUANT_GROUP)
static_assert(QUANT != QUANT_GROUP || (ALIGNED_ROWS && COLS % QUANT_GROUP_COLS == 0 && GROUP_LANES <= LANES_PER_ROW &&
                                       GROUP_LANES * ELTS_PER_LDG == QUANT_GROUP_COLS),
              "128-column scaling needs aligned rows, N a multiple of 128, loads of >= 4 elements and a group's "
              "lanes within a row's");
static_assert(QUANT == QUANT_NONE || FormatMax<output_t>::value > 1.f, "scaled outputs are fp8");

// The branch before the residual add (cunorm.reference.branch_input): h = x * rowscale[row] * keep / (1 - p)
// (+ residual), keep drawn per element from the seed (cn_keep_bits), h stored as residual_out with or
// without a residual; DROPOUT_MASK also stores the keep mask, a byte an element, row-major over x's shape.
#define CN_BRANCH ${BRANCH}
constexpr bool BRANCH = CN_BRANCH;
constexpr bool DROPOUT = ${DROPOUT};
constexpr bool ROWSCALE = ${ROWSCALE};
constexpr bool DROPOUT_MASK = ${DROPOUT_MASK};
typedef ${ROWSCALE_T} rowscale_t;
static_assert(BRANCH == (DROPOUT || ROWSCALE), "BRANCH is DROPOUT or ROWSCALE");
static_assert(!DROPOUT_MASK || DROPOUT, "a dropout mask needs dropout");

// The parallel block (cunorm.reference.parallel_input): X1, a second branch input summed into h, dropped out
// with a mask of its own (Philox stream 1; DROPOUT_MASK stores it too, in keep1_out); PARALLEL, a second
// output y1 = xhat * g1 (+ beta1) from the same statistics, g1 = gamma1 or 1 + gamma1 (ZERO_CENTERED).
#define CN_X1 ${X1}
#define CN_PARALLEL ${PARALLEL}
constexpr bool X1 = CN_X1;
constexpr bool PARALLEL = CN_PARALLEL;
constexpr bool HAS_BIAS1 = ${HAS_BIAS1};
typedef ${X1_T} x1_t;
typedef ${WEIGHT1_T} weight1_t;
typedef ${BIAS1_T} bias1_t;
static_assert(!X1 || !ROWSCALE, "x1: not with a row scale");
static_assert(!REGISTER_AHEAD, "rows ahead in registers: a backward knob (traits' rule)");
static_assert(!PARALLEL || (QUANT == QUANT_NONE && !AMAX && !PER_HEAD), "y1: not with fp8 or per-head weights");
static_assert(!HAS_BIAS1 || PARALLEL, "beta1 needs gamma1");
constexpr bool STORES_H = HAS_RESIDUAL || BRANCH || X1;  // h in compute_t, stored as residual_out

// Dynamic shared memory: [staged x][staged residual][gamma slots][beta slots][staged x1][gamma1 slots]
// [beta1 slots].
constexpr int SMEM_BYTES = RowPipe<input_t>::BYTES + RowPipe<residual_t, HAS_RESIDUAL>::BYTES +
                           RowWeights<weight_t, HAS_WEIGHT>::BYTES + RowWeights<bias_t, HAS_BIAS>::BYTES +
                           RowPipe<x1_t, X1>::BYTES + RowWeights<weight1_t, PARALLEL>::BYTES +
                           RowWeights<bias1_t, HAS_BIAS1>::BYTES;
static_assert(SMEM_BYTES == ${SMEM_BYTES}, "cunorm.Traits.smem_bytes disagrees with the kernel");

// A thread's running row sum in SUM_CHAINS chains (norm_traits.cuh). Chain 0 is the total itself, so with one
// chain the adds are the single running sum's they were before the knob. fold() adds the other chains into it,
// pairwise, with IEEE adds: the kernels build with -ftz, and a plain add would flush a chain's subnormal sum of
// squares (rows of tiny values, eps = 0) that cn_fma_keep_subnormal kept.
struct SumChains {
  compute_t& first;
  compute_t rest[SUM_CHAINS > 1 ? SUM_CHAINS - 1 : 1];
  __device__ __forceinline__ explicit SumChains(compute_t& total) : first(total) {
#pragma unroll
    for (int c = 0; c < SUM_CHAINS - 1; ++c) rest[c] = 0;
  }
  // Element e of a vector adds into chain e % SUM_CHAINS.
  __device__ __forceinline__ compute_t& operator[](int e) {
    return e % SUM_CHAINS == 0 ? first : rest[e % SUM_CHAINS - 1];
  }
  __device__ __forceinline__ void fold() {  // (c0 + c1) + (c2 + c3)
    auto add = [](compute_t a, compute_t b) { return cn_fma_keep_subnormal(b, compute_t(1), a); };
    if constexpr (SUM_CHAINS == 4) first = add(add(first, rest[0]), add(rest[1], rest[2]));
    else if constexpr (SUM_CHAINS == 2) first = add(first, rest[0]);
  }
};

// Row tensors (x, residual, y, residual_out; x1, y1) may alias one another (in place)
// and so are not __restrict__.
extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA, MIN_CTAS_PER_SM) CN_CLUSTER_DIMS
norm_fwd(const input_t* x, const residual_t* residual, const weight_t* __restrict__ gamma,
         const bias_t* __restrict__ beta, output_t* y, residual_out_t* residual_out,
         compute_t* __restrict__ mean_out, compute_t* __restrict__ rstd_out,  // may be null
         long long rows, row_stride_t ldx, row_stride_t ldr, row_stride_t ldy, row_stride_t ldro,
         long long gamma_stride, long long beta_stride, compute_t eps
#if CN_PER_HEAD
         , long long heads, long long gamma_head_stride, long long beta_head_stride
#endif
#if CN_QUANT || CN_AMAX
         , const float* __restrict__ qscale, float* __restrict__ qscales, float* __restrict__ amax
#endif
#if CN_BRANCH
         , unsigned long long seed, unsigned drop_threshold, compute_t keep_scale,
         const rowscale_t* __restrict__ rowscale, unsigned char* __restrict__ keep_out
#endif
#if CN_X1
         , const x1_t* x1, row_stride_t ldx1, unsigned char* __restrict__ keep1_out
#endif
#if CN_PARALLEL
         , const weight1_t* __restrict__ gamma1, const bias1_t* __restrict__ beta1, output_t* y1, row_stride_t ldy1,
         long long gamma1_stride, long long beta1_stride
#endif
) {
#if !CN_PER_HEAD
  constexpr long long heads = 1, gamma_head_stride = 0, beta_head_stride = 0;
#endif
#if !(CN_QUANT || CN_AMAX)
  const float* const qscale = nullptr;
  float* const qscales = nullptr;
#endif
#if !CN_BRANCH
  constexpr unsigned long long seed = 0;
  constexpr unsigned drop_threshold = 0;
  constexpr compute_t keep_scale = 1;
  const rowscale_t* const rowscale = nullptr;
  unsigned char* const keep_out = nullptr;
#endif
#if !CN_X1
  const x1_t* const x1 = nullptr;
  const row_stride_t ldx1{};
  unsigned char* const keep1_out = nullptr;
#endif
#if !CN_PARALLEL
  const weight1_t* const gamma1 = nullptr;
  const bias1_t* const beta1 = nullptr;
  output_t* const y1 = nullptr;
  const row_stride_t ldy1{};
  constexpr long long gamma1_stride = 0, beta1_stride = 0;
#endif
  using InVec = Vec<input_t, ELTS_PER_LDG>;
  using ResVec = Vec<residual_t, ELTS_PER_LDG>;
  using SumVec = Vec<compute_t, ELTS_PER_LDG>;
  const Coords at(x, ldx);
  CN_ROW_REDUCER_OF(MERGED_MOMENTS ? 4 : 1, MERGED_MOMENTS, reducer);
  CN_DYNAMIC_SMEM(smem);

  unsigned char* next = smem;
  RowPipe<input_t> xs(next, x, ldx, rows, at);
  next += xs.BYTES;
  RowPipe<residual_t, HAS_RESIDUAL> rs(next, residual, ldr, rows, at);
  next += rs.BYTES;
  const RowWeights<weight_t, HAS_WEIGHT> w(gamma, gamma_stride, next, at, heads, gamma_head_stride);
  next += w.BYTES;
  const RowWeights<bias_t, HAS_BIAS> b(beta, beta_stride, next, at, heads, beta_head_stride);
  next += b.BYTES;
  RowPipe<x1_t, X1> x1s(next, x1, ldx1, rows, at);
  next += x1s.BYTES;
  const RowWeights<weight1_t, PARALLEL> w1(gamma1, gamma1_stride, next, at, 1, 0);
  next += w1.BYTES;
  const RowWeights<bias1_t, HAS_BIAS1> b1(beta1, beta1_stride, next, at, 1, 0);

  constexpr compute_t inv_cols = compute_t(1) / compute_t(COLS);
#if CN_QUANT == 2
  CN_ROW_MAX_REDUCER(row_max);
#endif
  float thread_amax = 0.f;  // AMAX
  for_each_row(rows, at, [&](long long row, bool row_ok, int stage) {
    InVec v[LDGS];
    ResVec r[LDGS];  // unused (and optimized away) without a residual
    Vec<x1_t, ELTS_PER_LDG> v1[LDGS];  // unused without x1
    xs.read(stage, row, v, at);
    if constexpr (HAS_RESIDUAL) rs.read(stage, row, r, at);
    if constexpr (X1) x1s.read(stage, row, v1, at);
    mask_row(v, at);
    SumVec h[LDGS];  // x (or the branch) + residual in compute_t (optimized away without either)
    if constexpr (HAS_RESIDUAL) mask_row(r, at);
    // The keep bits of LDG step `it` as a mask row's bytes (DROPOUT_MASK).
    auto store_keep = [&](unsigned char* mask, unsigned keep, int it) {
      if (!row_ok) return;
#pragma unroll
      for (int e = 0; e < ELTS_PER_LDG; ++e)
        if (at.valid(it, e)) mask[row * COLS + at.column(it, e)] = static_cast<unsigned char>((keep >> e) & 1u);
    };
    if constexpr (BRANCH) {
      const compute_t rsc = ROWSCALE ? (row_ok ? compute_t(to_float(rowscale[row])) : compute_t(0)) : compute_t(1);
#pragma unroll
      for (int it = 0; it < LDGS; ++it) {
        const unsigned keep =
            DROPOUT ? cn_keep_bits<ELTS_PER_LDG>(row * COLS + at.column(it, 0), seed, drop_threshold) : ~0u;
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          compute_t x0 = v[it].get(e);
          if constexpr (ROWSCALE) x0 *= rsc;
          if constexpr (DROPOUT) x0 = (keep >> e) & 1u ? x0 * keep_scale : compute_t(0);
          if constexpr (HAS_RESIDUAL) x0 += r[it].get(e);
          h[it].set(e, x0);
        }
        if constexpr (DROPOUT_MASK) store_keep(keep_out, keep, it);
      }
    } else if constexpr (HAS_RESIDUAL || X1) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it)
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e)
          h[it].set(e, HAS_RESIDUAL ? v[it].get(e) + r[it].get(e) : compute_t(v[it].get(e)));
    }
    if constexpr (X1) {  // the parallel branch: dropped out with its own mask (stream 1), added to h
      mask_row(v1, at);
#pragma unroll
      for (int it = 0; it < LDGS; ++it) {
        const unsigned keep =
            DROPOUT ? cn_keep_bits<ELTS_PER_LDG, 1>(row * COLS + at.column(it, 0), seed, drop_threshold) : ~0u;
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          compute_t x1e = v1[it].get(e);
          if constexpr (DROPOUT) x1e = (keep >> e) & 1u ? x1e * keep_scale : compute_t(0);
          h[it].set(e, h[it].get(e) + x1e);
        }
        if constexpr (DROPOUT_MASK) store_keep(keep1_out, keep, it);
      }
    }
    // Element e of LDG step `it` of h; zero outside the row.
    auto value = [&](int it, int e) -> compute_t {
      if constexpr (STORES_H) return h[it].get(e);
      else return v[it].get(e);
    };

    // MERGED_MOMENTS' code sits in generic lambdas run through this: a dependent `if constexpr` is not
    // instantiated, so the other forwards keep their one-value reducer and the code they were measured with.
    auto if_merged = [&](auto&& f) {
      if constexpr (MERGED_MOMENTS) f(Flag<true>());
    };
    compute_t mean = 0;
    // The row's sum (padding holds 0); MERGED_MOMENTS: the CTA's sum and its count of row elements.
    compute_t sum[MERGED_MOMENTS ? 2 : 1] = {0};
    if constexpr (!RMS) {
      SumChains row_sum(sum[0]);
#pragma unroll
      for (int it = 0; it < LDGS; ++it)
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) row_sum[e] += value(it, e);
      row_sum.fold();
      if constexpr (MERGED_MOMENTS) {
        if_merged([&](auto) {
          with_edges(at, [&](auto edges) {
#pragma unroll
            for (int it = 0; it < LDGS; ++it) {
              if (!at.in_row(it)) continue;
              if (whole<decltype(edges)::value>(it, at)) {
                sum[1] += ELTS_PER_LDG;
              } else {
#pragma unroll
                for (int e = 0; e < ELTS_PER_LDG; ++e) sum[1] += at.valid(it, e) ? 1 : 0;
              }
            }
          });
          reducer.template allreduce<false, false>(sum, at);
          mean = sum[1] > 0 ? sum[0] / sum[1] : compute_t(0);  // the CTA's: its deviations' centre
        });
      } else {
        reducer.allreduce(sum, at);
        // REFINE_MEAN: rounded on its own, or ptxas fuses it into every h - mean (an FMA with the exact
        // product), and a row of one value would not sum its deviations exactly (y = beta bit for bit).
        mean = REFINE_MEAN ? cn_mul_rn(sum[0], inv_cols) : sum[0] * inv_cols;
      }
    }
    // The sum of squared deviations (RMSNorm: of h), each multiplied by SCALE first; with SQUARE false the sum
    // of the deviations themselves. Squares below fp32's smallest normal are kept (the kernels build with
    // -ftz=true: a thread's first square would be lost). ACROSS_CLUSTER false: over the CTA's part of the row.
    // With two totals (SQUARE), the second sums the deviations themselves too.
    auto sum_deviations = [&](auto scale, auto square, auto row_only, auto across_cluster, auto& total) {
      constexpr compute_t SCALE = decltype(scale)::value;
      constexpr bool SQUARE = decltype(square)::value;
      constexpr bool BOTH = sizeof(total) == 2 * sizeof(compute_t);
      static_assert(!BOTH || SQUARE, "deviations beside their squares");
      SumChains first(total[0]), second(total[BOTH]);  // second: the deviations themselves (BOTH only)
      auto add = [&](int e, compute_t d) {
        first[e] = SQUARE ? cn_fma_keep_subnormal(d, d, first[e]) : first[e] + d;
        if constexpr (BOTH) second[e] += d;
      };
      with_edges(at, [&](auto edges) {
        constexpr bool EDGES = decltype(edges)::value;
#pragma unroll
        for (int it = 0; it < LDGS; ++it) {
          if (!at.in_row(it)) continue;
          if (RMS || whole<EDGES>(it, at)) {  // RMSNorm: padding holds 0, which adds nothing
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) {
              add(e, SCALE == 1 ? value(it, e) - mean : (value(it, e) - mean) * SCALE);
            }
          } else {  // a row end (general kernel): padding holds 0, not the mean
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) {
              add(e, at.valid(it, e) ? (SCALE == 1 ? value(it, e) - mean : (value(it, e) - mean) * SCALE)
                                     : compute_t(0));
            }
          }
        }
      });
      first.fold();
      if constexpr (BOTH) second.fold();
      reducer.template allreduce<decltype(row_only)::value, decltype(across_cluster)::value>(total, at);
    };
    compute_t sq[1] = {0};
    if constexpr (MERGED_MOMENTS) {
      // One cluster exchange for both moments: each CTA's sum, count, and squared deviations S2 and
      // deviations D about its own mean c (rounded: D holds what rounding left). About the row's mean m,
      // sum (h - m)^2 = sum over CTAs of S2 + 2 (c - m) D + n (c - m)^2, taken with every c - m as s - b,
      // s = c - c0 and b = m - c0 (c0 rank 0's mean): differences of nearby values, no E[h^2] - E[h]^2
      // cancellation. The row's sum adds the CTAs' sums in rank order, as a plain cluster sum does.
      if_merged([&](auto merged) {
        constexpr int PAIR = decltype(merged)::value ? 2 : 1;  // dependent: instantiated only here
        compute_t dev[PAIR] = {0, 0};
        sum_deviations(PowerOfTwo<0>(), Flag<true>(), Flag<false>(), Flag<false>(), dev);
        const compute_t mine[2 * PAIR] = {sum[0], sum[1], dev[0], dev[1]};
        compute_t total = 0, within = 0, first_centre = 0, n_s = 0, n_s2 = 0, s_d = 0, d_sum = 0;
        reducer.each_cta(mine, [&](int r, const auto& cta) {
          const compute_t count = cta[1];
          const compute_t centre = count > 0 ? cta[0] / count : compute_t(0);  // c, as that CTA took it
          if (r == 0) first_centre = centre;
          const compute_t shift = count > 0 ? centre - first_centre : compute_t(0);  // s
          total += cta[0];
          within += cta[2];
          n_s += count * shift;
          n_s2 += count * shift * shift;
          s_d += shift * cta[3];
          d_sum += cta[3];
        });
        mean = REFINE_MEAN ? cn_mul_rn(total, inv_cols) : total * inv_cols;
        const compute_t b = mean - first_centre;
        // sum n (s - b)^2 + 2 (s - b) D (the counts sum to COLS): the CTAs' means' spread about the row's
        const compute_t between = n_s2 - 2 * b * n_s + compute_t(COLS) * b * b + 2 * (s_d - b * d_sum);
        sq[0] = within + (between < 0 ? compute_t(0) : between);  // NaN stays NaN (a non-finite row)
      });
    } else {
      sum_deviations(PowerOfTwo<0>(), Flag<true>(), Flag<false>(), Flag<true>(), sq);
    }
    // A row holding inf or NaN has a sum of squares that is not finite: all of its outputs, mean and rstd
    // included, are NaN (documented; RMSNorm would otherwise give rstd = 0 and zeros beside the NaN).
    bool finite = cn_isfinite(sq[0]);
    compute_t rstd = finite ? cn_rsqrt(sq[0] * inv_cols + eps) : cn_nan<compute_t>();
    if constexpr (sizeof(compute_t) == 4) {
      // So do finite rows whose squares overflow fp32 (deviations of about sqrt(3.4e38 / N) and more): such
      // rows, rare, are summed again with each deviation scaled by 2^-96 (exact; no scaled deviation
      // overflows, and what underflows is below 2^-40 of the sum). Only such rows' warps (and those sharing
      // their shuffles) take the branch: the CTA's other rows skip it. Rows whose rstd would fall below
      // fp32's smallest normal (std past 2^126), which -ftz=true flushes to 0, stay NaN.
      if (reducer.row_group_any(!finite)) {
        compute_t scaled[1] = {0};
        sum_deviations(PowerOfTwo<-96>(), Flag<true>(), Flag<true>(), Flag<true>(), scaled);
        constexpr compute_t UNSCALE = PowerOfTwo<-96>::value;  // var + eps = (scaled/N + eps UNSCALE^2) / UNSCALE^2
        const compute_t r = cn_rsqrt(scaled[0] * inv_cols + eps * UNSCALE * UNSCALE);
        if (!finite && cn_isfinite(scaled[0]) && r >= PowerOfTwo<-30>::value) {
          rstd = UNSCALE * r;
          finite = true;
        }
      }
    }
    // REFINE_MEAN: on rows whose mean is REFINE_MIN_OFFSET standard deviations (eps left out) or more from
    // zero, not those summed again above, corr, the mean of h - mean, corrects the mean and the variance. A
    // row of one value is such a row: its deviations are equal and summed exactly, corr is their exact
    // quotient, and h - mean - corr is 0 (y = beta bit for bit), unless its squared deviations overflowed
    // (values past about 1e23): rows summed again above keep the first mean. A row of zeros (and a row past
    // the end) would pass the test (0 >= 0) for nothing (corr = 0 there): left out, so that padding rows do not
    // send their row group through the extra reduction.
    compute_t corr = 0;
    if constexpr (REFINE_MEAN) {
      const bool offset = mean != compute_t(0) && cn_isfinite(sq[0]) &&
                          mean * mean * compute_t(COLS) >= REFINE_MIN_OFFSET * REFINE_MIN_OFFSET * sq[0];
      if (reducer.reduction_group_any(offset)) {
        // MERGED_MOMENTS: such rows' squared deviations again, two-pass about the row's mean (a row of one
        // value then gets a variance of exactly 0 below: y = beta bit for bit).
        if constexpr (MERGED_MOMENTS) {
          compute_t again[1] = {0};
          sum_deviations(PowerOfTwo<0>(), Flag<true>(), Flag<false>(), Flag<true>(), again);
          if (offset) sq[0] = again[0];
        }
        compute_t dev[1] = {0};
        sum_deviations(PowerOfTwo<0>(), Flag<false>(), Flag<false>(), Flag<true>(), dev);
        if (offset) {
          corr = (COLS & (COLS - 1)) == 0 ? dev[0] * inv_cols : cn_div_rn(dev[0], compute_t(COLS));
          rstd = cn_rsqrt(fmax(sq[0] * inv_cols - corr * corr, compute_t(0)) + eps);
        }
      }
    }
    // xhat of element e of LDG step `it`: (h - mean [- corr]) * rstd, not h * rstd - mean * rstd: exact even
    // when |mean| >> std. A row of one element normalizes to 0 (y = beta), whatever eps. NaN rows stay NaN.
    auto xhat_at = [&](int it, int e) -> compute_t {
      if constexpr (!RMS && COLS == 1) return 0 * rstd;
      else if constexpr (REFINE_MEAN) return (value(it, e) - mean - corr) * rstd;
      else return (value(it, e) - mean) * rstd;
    };
    // xhat * g of element e of LDG step `it` (wv: gamma's vector there); y adds beta.
    auto scaled_at = [&](int it, int e, const auto& wv) -> compute_t {
      const compute_t xhat = xhat_at(it, e);
      return HAS_WEIGHT ? xhat * scale_of(wv.get(e)) : xhat;
    };
    float inv_scale = 1.f;  // QUANT: what y is multiplied by before rounding to fp8
    if constexpr (QUANT == QUANT_TENSOR) inv_scale = 1.f / *qscale;
#if CN_QUANT == 2
    {  // the row's amax, then its scale: every thread takes part (the reduction holds barriers)
      compute_t m[1] = {0};
      with_edges(at, [&](auto edges) {
        constexpr bool EDGES = decltype(edges)::value;
#pragma unroll
        for (int it = 0; it < LDGS; ++it) {
          if (!at.in_row(it)) continue;
          const auto wv = w(it, at, row);
          const auto bv = b(it, at, row);
#pragma unroll
          for (int e = 0; e < ELTS_PER_LDG; ++e)
            if (whole<EDGES>(it, at) || at.valid(it, e))
              m[0] = fmaxf(m[0], fabsf(HAS_BIAS ? scaled_at(it, e, wv) + bv.get(e) : scaled_at(it, e, wv)));
        }
      });
      row_max.allreduce(m, at);
      const float scale = m[0] > 0.f ? m[0] / FormatMax<output_t>::value : 1.f;
      inv_scale = 1.f / scale;
      if (row_ok && at.row_leader()) qscales[row] = scale;
    }
#endif

    if (row_ok) {
      with_edges(at, [&](auto edges) {
        constexpr bool EDGES = decltype(edges)::value;
#pragma unroll
        for (int it = 0; it < LDGS; ++it) {
          const bool here = at.in_row(it);
          if constexpr (QUANT != QUANT_GROUP) {
            if (!here) continue;
          }
          const auto wv = w(it, at, row);
          const auto bv = b(it, at, row);
          compute_t out[ELTS_PER_LDG];
#pragma unroll
          for (int e = 0; e < ELTS_PER_LDG; ++e) {
            const compute_t scaled = scaled_at(it, e, wv);
            out[e] = HAS_BIAS ? scaled + bv.get(e) : scaled;
          }
          if constexpr (AMAX) {
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e)
              if (here && (whole<EDGES>(it, at) || at.valid(it, e))) thread_amax = fmaxf(thread_amax, fabsf(out[e]));
          }
          if constexpr (QUANT == QUANT_GROUP) {  // the group's lanes hold its 128 columns: a butterfly over them
            float m = 0.f;
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) m = here ? fmaxf(m, fabsf(out[e])) : m;
            m = lane_group_max<GROUP_LANES>(m);  // a row's lanes agree on row_ok; other rows' need not
            if (!here) continue;
            const float scale = m > 0.f ? m / FormatMax<output_t>::value : 1.f;
            if (at.lane % GROUP_LANES == 0)
              qscales[row * (COLS / QUANT_GROUP_COLS) + at.vec(it) / GROUP_LANES] = scale;
            inv_scale = 1.f / scale;
          }
          if constexpr (QUANT != QUANT_NONE) {
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) out[e] *= inv_scale;
          }
          Vec<output_t, ELTS_PER_LDG> o;
          o.set_all(out);
          store_vec<EDGES>(o, at.frame(y, row, ldy), it, at);
          if constexpr (STORES_H) {
            compute_t hs[ELTS_PER_LDG];
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) hs[e] = h[it].get(e);
            Vec<residual_out_t, ELTS_PER_LDG> ho;
            ho.set_all(hs);
            store_vec<EDGES>(ho, at.frame(residual_out, row, ldro), it, at);
          }
          if constexpr (PARALLEL) {
            const auto w1v = w1(it, at, row);
            const auto b1v = b1(it, at, row);
            compute_t out1[ELTS_PER_LDG];
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) {
              const compute_t scaled = xhat_at(it, e) * scale_of(w1v.get(e));
              out1[e] = HAS_BIAS1 ? scaled + b1v.get(e) : scaled;
            }
            Vec<output_t, ELTS_PER_LDG> o1;
            o1.set_all(out1);
            store_vec<EDGES>(o1, at.frame(y1, row, ldy1), it, at);
          }
        }
      });
      if (at.row_leader()) {
        if (mean_out) mean_out[row] = finite ? (REFINE_MEAN ? mean + corr : mean) : rstd;  // NaN rows: NaN
        if (rstd_out) rstd_out[row] = rstd;
      }
    }
  }, xs, rs, x1s);
  if constexpr (AMAX) {  // max of non-negative floats: their bits order as unsigned integers
    const float m = warp_max(thread_amax);
#if CN_QUANT || CN_AMAX
    if (at.lane == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
#endif
  }
  finish_cluster();
}
