// Row normalization backward: dx, and per-CTA partials (compute_t) of dgamma and
// dbeta, in one pass over x and dy; norm_bwd_finalize then sums the partials
// (or, GRID_FINALIZE, the whole grid does after a grid-wide barrier: one launch).
//
// With xhat = (x - mean) * rstd (RMSNorm: x * rstd) and g = dy * gamma (or
// dy * (1 + gamma) for a zero-centered weight):
//   LayerNorm  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   RMSNorm    dx = rstd * (g - xhat * mean(g * xhat))
// plus dresidual when given (the skip path's gradient of the residual sum).
//   dgamma = sum_rows(dy * xhat),  dbeta = sum_rows(dy)
// The grid is persistent (one wave, rows staged as in norm_fwd.cu): each CTA
// walks its rows, keeps its column sums (in registers, or in shared memory
// with SMEM_ACCUMULATORS, the first REGISTER_SUM_STEPS load steps' still in
// registers), and writes one partial row. No sum is atomic (the
// atomics, GRID_FINALIZE's ticket, only count CTAs through a barrier), and
// every sum runs in a fixed order, so the results are bitwise reproducible.
#include "cunorm_common.cuh"
#include "norm_traits.cuh"
#include "norm_rows.cuh"
#include "row_reducer.cuh"
static_assert(PERSISTENT, "the backward's CTAs each sum their rows' column partials: a persistent grid");
static_assert(SUM_CHAINS == 1, "sum chains are a forward's");

constexpr bool SMEM_ACCUMULATORS = ${SMEM_ACCUMULATORS};
// With SMEM_ACCUMULATORS, the column sums of the first REGISTER_SUM_STEPS load steps stay in registers: each
// step moved there saves a shared-memory load and store a quantity a row, for its registers, and (one row a
// CTA: nothing to fold) its slots.
constexpr int REGISTER_SUM_STEPS = ${REGISTER_SUM_STEPS};
static_assert(REGISTER_SUM_STEPS >= 0 && REGISTER_SUM_STEPS < LDGS && (SMEM_ACCUMULATORS || REGISTER_SUM_STEPS == 0),
              "REGISTER_SUM_STEPS: 0 .. LDGS - 1, with SMEM_ACCUMULATORS");
constexpr bool RECOMPUTE = ${RECOMPUTE};  // recompute xhat and g after the reduction instead of holding them
// The memory-efficient backward: `x` holds the forward's output y, and xhat = (y - beta) / g (g = gamma or
// 1 + gamma; beta only with HAS_BIAS), so the forward's input need not be kept. Inexact where g is near 0.
#define CN_FROM_OUTPUT ${FROM_OUTPUT}
constexpr bool FROM_OUTPUT = CN_FROM_OUTPUT;
// The partial rows summed by the grid itself after a grid-wide barrier (a cooperative launch), instead of
// by norm_bwd_finalize: one launch for small calls.
#define CN_GRID_FINALIZE ${GRID_FINALIZE}
constexpr bool GRID_FINALIZE = CN_GRID_FINALIZE;
static_assert(!GRID_FINALIZE || HAS_WEIGHT || HAS_BIAS, "GRID_FINALIZE needs column sums");
static_assert(!GRID_FINALIZE || CTAS_PER_ROW == 1, "GRID_FINALIZE needs CTAS_PER_ROW == 1 (no clusters)");
// The forward's branch (dropout, a row scale before the residual add; see norm_fwd.cu): dx is h's
// gradient (the residual's), and dx0 = dx * keep / (1 - p) * rowscale[row] the branch input's, the keep
// mask drawn again from the seed (cn_keep_bits).
#define CN_BRANCH ${BRANCH}
constexpr bool BRANCH = CN_BRANCH;
constexpr bool DROPOUT = ${DROPOUT};
constexpr bool ROWSCALE = ${ROWSCALE};
typedef ${ROWSCALE_T} rowscale_t;
typedef ${DX0_T} dx0_t;
static_assert(BRANCH == (DROPOUT || ROWSCALE), "BRANCH is DROPOUT or ROWSCALE");
// The forward's parallel block (see norm_fwd.cu): PARALLEL, a second output y1 = xhat * g1 (+ beta1), whose
// gradient dy1 joins dy (g = dy * g + dy1 * g1) and gives dgamma1 (and dbeta1, HAS_BIAS1) as more column
// sums; DX1, x1's gradient under dropout, dx1 = dx * keep1 / (1 - p) (Philox stream 1; without dropout it
// is dx, and nothing is written).
#define CN_PARALLEL ${PARALLEL}
#define CN_DX1 ${DX1}
constexpr bool PARALLEL = CN_PARALLEL;
constexpr bool HAS_BIAS1 = ${HAS_BIAS1};
constexpr bool DX1 = CN_DX1;
typedef ${WEIGHT1_T} weight1_t;
typedef ${BIAS1_T} bias1_t;
typedef ${DX1_T} dx1_t;
static_assert(!HAS_BIAS1 || PARALLEL, "dbeta1 needs gamma1");
static_assert(!PARALLEL || !PER_HEAD, "gamma1: not with per-head weights");
static_assert(!DX1 || DROPOUT, "dx1 is written under dropout only");
using AccVec = Vec<compute_t, ELTS_PER_LDG>;
// Column-sum slots of a CTA in shared memory: [COLUMN_SUMS (dgamma, dbeta[, dgamma1, dbeta1])][ROWS_PER_CTA]
// [SLOT_STEPS][THREADS_PER_ROW] vectors. Used by the accumulators themselves, or (in registers) to fold
// ROWS_PER_CTA rows into one. One row a CTA, the REGISTER_SUM_STEPS steps' sums go from registers straight to
// the partial row: slots from load step SLOT_OFFSET on.
constexpr int COLUMN_SUMS = PARALLEL ? 4 : 2;
constexpr int SLOT_OFFSET = ROWS_PER_CTA == 1 ? REGISTER_SUM_STEPS : 0;  // (0 without SMEM_ACCUMULATORS)
constexpr int SLOT_STEPS = LDGS - SLOT_OFFSET;
constexpr int ACC_SLOTS = ROWS_PER_CTA * SLOT_STEPS * THREADS_PER_ROW;
constexpr int ACC_BYTES = (SMEM_ACCUMULATORS || ROWS_PER_CTA > 1) ? COLUMN_SUMS * ACC_SLOTS * int(sizeof(AccVec)) : 0;
// Dynamic shared memory: [column-sum slots][staged x][staged dy][staged dresidual][gamma slots][beta slots]
// [staged dy1][gamma1 slots].
constexpr int SMEM_BYTES = ACC_BYTES + RowPipe<input_t>::BYTES + RowPipe<output_t>::BYTES +
                           RowPipe<residual_t, HAS_RESIDUAL>::BYTES + RowWeights<weight_t, HAS_WEIGHT>::BYTES +
                           RowWeights<bias_t, FROM_OUTPUT && HAS_BIAS>::BYTES + RowPipe<output_t, PARALLEL>::BYTES +
                           RowWeights<weight1_t, PARALLEL>::BYTES;
static_assert(SMEM_BYTES == ${SMEM_BYTES}, "cunorm.Traits.smem_bytes disagrees with the kernel");
// Row sums: [sum(g),] sum(g * xhat) (at GX)[, REFINE_MEAN's sum(x - mean) (at CENTRED)]. REFINE_MEAN (see
// norm_traits.cuh): the mean given is the forward's rounded to fp32, off the row's by up to |mean| * 2^-24,
// which moves every xhat by delta, the mean of xhat. Its sum rides in the reduction the row takes anyway; on
// rows far from zero mean delta then comes off xhat: in dx through the row's constants, in dgamma's column
// sums, which such kernels take after the reduction (LATE_DGAMMA; GATED kernels' plain loop, below, takes
// them before it: no row of its CTA is refined).
enum : int { GX = RMS ? 0 : 1, CENTRED = GX + 1 };
constexpr int SUMS = CENTRED + (REFINE_MEAN ? 1 : 0);
static_assert(!REFINE_MEAN || !FROM_OUTPUT, "REFINE_MEAN: xhat from x and the mean");
// LayerNorm's dgamma column sums taken in the second loop, after the row reduction: fewer values live across
// it (cunorm.Traits.late_dgamma: fp32 x in aligned 16-byte rows, no branch), or REFINE_MEAN's, whose xhat is
// known only then (cunorm.Traits.dgamma_after_reduction).
constexpr bool LATE_DGAMMA = ${LATE_DGAMMA};
static_assert(!LATE_DGAMMA || (!RMS && !FROM_OUTPUT), "LATE_DGAMMA: LayerNorm's xhat from x");
static_assert(!REFINE_MEAN || LATE_DGAMMA, "REFINE_MEAN's dgamma needs the row's delta");

#include "column_sums.cuh"

// REFINE_MEAN: whether a row with these statistics lies far enough from zero mean to be refined (false for
// NaN statistics and for rows past the end, whose mean and rstd are 0).
__device__ __forceinline__ bool refines_row(compute_t mean, compute_t rstd) {
  return fabs(mean) * rstd >= REFINE_MIN_OFFSET;
}

// REFINE_MEAN: whether any row this CTA walks (for_each_row's) is one to refine (refines_row). A cluster's
// CTAs walk the same rows and agree.
__device__ __forceinline__ bool walks_offset_rows(const compute_t* mean, const compute_t* rstd, long long rows,
                                                  const Coords& at) {
  const long long stride = at.groups * ROWS_PER_CTA;
  bool offset = false;
  for (long long i = threadIdx.x;; i += THREADS_PER_CTA) {  // the CTA's rows in increasing order
    const long long row = at.group * ROWS_PER_CTA + i / ROWS_PER_CTA * stride + i % ROWS_PER_CTA;
    if (row >= rows) break;
    offset |= refines_row(mean[row], rstd[row]);
  }
  return __syncthreads_or(offset);
}

// Row tensors (dy, x, dresidual, dx) may alias one another (in place) and so
// are not __restrict__.
extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA, MIN_CTAS_PER_SM) CN_CLUSTER_DIMS
norm_bwd(const output_t* dy, const input_t* x, const residual_t* dresidual,
         const compute_t* __restrict__ mean, const compute_t* __restrict__ rstd, const weight_t* __restrict__ gamma,
         input_t* dx, compute_t* __restrict__ dgamma_part, compute_t* __restrict__ dbeta_part,  // [groups, COLS]
         long long rows, row_stride_t ldx, row_stride_t lddy, row_stride_t ldres, row_stride_t lddx,
         long long gamma_stride
#if CN_PER_HEAD
         , long long heads, long long gamma_head_stride
#endif
#if CN_FROM_OUTPUT
         , const bias_t* __restrict__ beta, long long beta_stride, long long beta_head_stride
#endif
#if CN_GRID_FINALIZE
         , unsigned* ticket, int parts, weight_t* __restrict__ dgamma, bias_t* __restrict__ dbeta
#endif
#if CN_BRANCH
         , unsigned long long seed, unsigned drop_threshold, compute_t keep_scale,
         const rowscale_t* __restrict__ rowscale, dx0_t* dx0, row_stride_t lddx0
#endif
#if CN_PARALLEL
         , const output_t* dy1, row_stride_t lddy1, const weight1_t* __restrict__ gamma1, long long gamma1_stride,
         compute_t* __restrict__ dgamma1_part, compute_t* __restrict__ dbeta1_part
#if CN_GRID_FINALIZE
         , weight1_t* __restrict__ dgamma1, bias1_t* __restrict__ dbeta1
#endif
#endif
#if CN_DX1
         , dx1_t* dx1, row_stride_t lddx1
#endif
) {
#if !CN_PER_HEAD
  constexpr long long heads = 1, gamma_head_stride = 0;
#endif
#if !CN_PARALLEL
  const output_t* const dy1 = nullptr;
  const row_stride_t lddy1{};
  const weight1_t* const gamma1 = nullptr;
  constexpr long long gamma1_stride = 0;
  compute_t* const dgamma1_part = nullptr;
  compute_t* const dbeta1_part = nullptr;
#endif
#if CN_GRID_FINALIZE && !CN_PARALLEL
  weight1_t* const dgamma1 = nullptr;
  bias1_t* const dbeta1 = nullptr;
#endif
  using InVec = Vec<input_t, ELTS_PER_LDG>;
  using GradVec = Vec<output_t, ELTS_PER_LDG>;
  using ResVec = Vec<residual_t, ELTS_PER_LDG>;
  CN_DYNAMIC_SMEM(smem);
  AccVec* acc_smem = reinterpret_cast<AccVec*>(smem);
  const Coords at(x, ldx);
  CN_ROW_REDUCER(SUMS, reducer);

  // Load steps whose column sums stay in registers: all of them without SMEM_ACCUMULATORS.
  constexpr int STEPS_IN_REGISTERS = SMEM_ACCUMULATORS ? REGISTER_SUM_STEPS : LDGS;
  ColumnSums<STEPS_IN_REGISTERS> dgamma_acc(acc_smem, at), dbeta_acc(acc_smem + ACC_SLOTS, at);
  // PARALLEL's (registers, unused and optimized away, otherwise: their slots would lie past ACC_BYTES).
  ColumnSums<PARALLEL ? STEPS_IN_REGISTERS : LDGS> dgamma1_acc(acc_smem + 2 * ACC_SLOTS, at),
      dbeta1_acc(acc_smem + 3 * ACC_SLOTS, at);
  // Rows past the end (and columns past the row) arrive as zeros: g = 0
  // there, so they add nothing to the row sums or the column sums. (REFINE_MEAN: x holds the mean in the
  // lanes outside a row, so that they add nothing to sum(x - mean) either.)
  unsigned char* next = smem + ACC_BYTES;
  RowPipe<input_t> xs(next, x, ldx, rows, at);
  next += xs.BYTES;
  RowPipe<output_t> dys(next, dy, lddy, rows, at);
  next += dys.BYTES;
  RowPipe<residual_t, HAS_RESIDUAL> drs(next, dresidual, ldres, rows, at);
  next += drs.BYTES;
  const RowWeights<weight_t, HAS_WEIGHT> w(gamma, gamma_stride, next, at, heads, gamma_head_stride);
  next += w.BYTES;
#if CN_FROM_OUTPUT
  const RowWeights<bias_t, HAS_BIAS> bvals(beta, beta_stride, next, at, heads, beta_head_stride);
  next += bvals.BYTES;
#endif
  RowPipe<output_t, PARALLEL> dy1s(next, dy1, lddy1, rows, at);
  next += dy1s.BYTES;
  RowStat<compute_t> rstds(rstd, rows);
  RowStat<compute_t, !RMS && !FROM_OUTPUT> means(mean, rows);  // (RMSNorm and from y: xhat without a mean)
  const RowWeights<weight1_t, PARALLEL> w1(gamma1, gamma1_stride, next, at, 1, 0);
  // xhat of element e of LDG step `it` (v: x, or y FROM_OUTPUT; wv: gamma's vector there).
  auto xhat_of = [&](const InVec& v, const auto& wv, int it, int e, long long row, compute_t mu, compute_t rs) {
#if CN_FROM_OUTPUT
    compute_t shifted = v.get(e);
    if constexpr (HAS_BIAS) shifted -= compute_t(bvals(it, at, row).get(e));
    // A zero multiplier loses xhat (y = beta there): 0, not 0 / 0 or -beta / 0 (lanes outside the row and rows
    // past the end join the sums too).
    if constexpr (HAS_WEIGHT) {
      const compute_t g = scale_of(wv.get(e));
      return g == compute_t(0) ? compute_t(0) : shifted / g;
    }
    return shifted;
#else
    return (v.get(e) - mu) * rs;
#endif
  };

  constexpr compute_t inv_cols = compute_t(1) / compute_t(COLS);
  constexpr bool ZERO_XHAT = !RMS && COLS == 1;  // a row of one element normalizes to 0
  // REFINE_MEAN gated per CTA (GATED): where rows span a cluster, with more than 16 elements a thread and
  // registers to spare (threads x CTAs an SM <= 256), a CTA walks its rows in the refined loop only when one
  // of them is offset (walks_offset_rows), else in a plain loop without sum(x - mean), dgamma taken early. A
  // row's dx is the same bits in either loop (delta = 0 on rows not refined). Elsewhere the loop's second copy
  // costs more than the sum it saves, or spills (PERFORMANCE.md, version 46).
  constexpr bool GATED = REFINE_MEAN && !ZERO_XHAT && CTAS_PER_ROW > 1 && ELTS_PER_THREAD > 16 &&
                         THREADS_PER_CTA * MIN_CTAS_PER_SM <= 256;
  auto walk_rows = [&](auto refine) {  // refine: Flag<the refined loop>
    constexpr bool REFINED_LOOP = decltype(refine)::value;
    constexpr bool DGAMMA_LATE = GATED ? REFINED_LOOP : LATE_DGAMMA;
    constexpr int ROW_SUMS = REFINED_LOOP ? SUMS : CENTRED;
    for_each_row(rows, at, [&](long long row, bool row_ok, int stage) {
      InVec xv[LDGS];
      GradVec dyv[LDGS];
      GradVec dy1v[LDGS];  // unused without a second output
      xs.read(stage, row, xv, at);
      dys.read(stage, row, dyv, at);
      if constexpr (PARALLEL) dy1s.read(stage, row, dy1v, at);
      const compute_t rs = rstds.read(row, at);
      const compute_t mu = means.read(row, at);  // exact when |mu| >> std
      mask_row<REFINED_LOOP>(xv, at, mu);  // REFINE_MEAN: lanes outside the row add nothing to sum(x - mu)
      mask_row(dyv, at);
      if constexpr (PARALLEL) mask_row(dy1v, at);
      // g = dy * gamma (+ dy1 * gamma1) of element e of LDG step `it` (d: dy there; wv, w1v: the weights'
      // vectors there).
      auto g_of = [&](int it, int e, compute_t d, const auto& wv, const auto& w1v) -> compute_t {
        const compute_t g = HAS_WEIGHT ? d * scale_of(wv.get(e)) : d;
        if constexpr (PARALLEL) return cn_fma(compute_t(dy1v[it].get(e)), scale_of(w1v.get(e)), g);
        else return g;
      };

      compute_t sums[ROW_SUMS] = {};
#pragma unroll
      for (int it = 0; it < LDGS; ++it) {
        const auto wv = w(it, at, row);
        Vec<weight1_t, ELTS_PER_LDG> w1v;  // PARALLEL's (left unset and unused otherwise)
        if constexpr (PARALLEL) w1v = w1(it, at, row);
        AccVec dg = dgamma_acc.get(it), db = dbeta_acc.get(it);
        AccVec dg1 = dgamma1_acc.get(it), db1 = dbeta1_acc.get(it);
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          const compute_t xhat = ZERO_XHAT ? compute_t(0) : xhat_of(xv[it], wv, it, e, row, mu, rs);
          const compute_t d = dyv[it].get(e);
          const compute_t g = g_of(it, e, d, wv, w1v);
          if constexpr (!RMS) sums[0] += g;
          sums[GX] = cn_fma(g, xhat, sums[GX]);
          // (whole vectors outside the row hold zeros, not mu)
          if constexpr (REFINED_LOOP) if (at.in_row(it)) sums[CENTRED] += compute_t(xv[it].get(e)) - mu;
          if constexpr (!DGAMMA_LATE) dg.add(e, d * xhat);
          db.add(e, d);
          if constexpr (PARALLEL) {
            const compute_t d1 = dy1v[it].get(e);
            if constexpr (!DGAMMA_LATE) dg1.add(e, d1 * xhat);
            db1.add(e, d1);
          }
        }
        if (HAS_WEIGHT && !DGAMMA_LATE) dgamma_acc.put(it, dg);
        if (HAS_BIAS) dbeta_acc.put(it, db);
        if (PARALLEL && !DGAMMA_LATE) dgamma1_acc.put(it, dg1);
        if (HAS_BIAS1) dbeta1_acc.put(it, db1);
      }
      // RECOMPUTE: derive xhat and g again from the packed inputs below rather
      // than keep fp32 copies live across the reduction (fewer registers, more
      // instructions); otherwise the compiler keeps them.
      if constexpr (RECOMPUTE) {
#pragma unroll
        for (int it = 0; it < LDGS; ++it) {
          xv[it].opaque();
          dyv[it].opaque();
          if constexpr (PARALLEL) dy1v[it].opaque();
        }
      }
      reducer.allreduce(sums, at);
      // REFINE_MEAN: delta = mean(xhat) on rows far from zero mean (not NaN rows, nor rows past the end); the
      // true xhat is xhat - delta, so sum(g * xhat) loses delta * sum(g) and b gains -c * delta.
      bool refined = false;
      compute_t delta = 0;
      if constexpr (REFINED_LOOP && !ZERO_XHAT) {  // (a row of one element: xhat is 0 whatever the mean)
        refined = refines_row(mu, rs);
        if (refined) delta = sums[CENTRED] * rs * inv_cols;
      }
      const compute_t sum_gx = refined ? cn_fma(-delta, sums[0], sums[GX]) : sums[GX];
      // dx = rs * (g - mean(g) - xhat * mean(g * xhat)) = a * g + c * xhat + b (b = 0 for RMSNorm)
      const compute_t a = rs, plain_b = RMS ? compute_t(0) : -rs * sums[0] * inv_cols, c = -rs * sum_gx * inv_cols;
      const compute_t b = refined ? cn_fma(-c, delta, plain_b) : plain_b;

      if (row_ok) {
        ResVec dres[LDGS];  // unused (and optimized away) without a residual
        if constexpr (HAS_RESIDUAL) drs.read(stage, row, dres, at);  // lanes outside the row are not stored: no mask
        with_edges(at, [&](auto edges) {
#pragma unroll
          for (int it = 0; it < LDGS; ++it) {
            if (!at.in_row(it)) continue;
            const auto wv = w(it, at, row);
            Vec<weight1_t, ELTS_PER_LDG> w1v;
            if constexpr (PARALLEL) w1v = w1(it, at, row);
            compute_t out[ELTS_PER_LDG];
            AccVec dg = dgamma_acc.get(it), dg1 = dgamma1_acc.get(it);  // DGAMMA_LATE's
#pragma unroll
            for (int e = 0; e < ELTS_PER_LDG; ++e) {
              const compute_t xhat = ZERO_XHAT ? compute_t(0) : xhat_of(xv[it], wv, it, e, row, mu, rs);
              const compute_t g = g_of(it, e, dyv[it].get(e), wv, w1v);
              out[e] = ZERO_XHAT ? compute_t(0) : cn_fma(a, g, cn_fma(c, xhat, b));
              if constexpr (HAS_RESIDUAL) out[e] += dres[it].get(e);
              if constexpr (DGAMMA_LATE) {  // (the true xhat: REFINE_MEAN's delta off)
                dg.add(e, compute_t(dyv[it].get(e)) * (xhat - delta));
                if constexpr (PARALLEL) dg1.add(e, compute_t(dy1v[it].get(e)) * (xhat - delta));
              }
            }
            if (DGAMMA_LATE && HAS_WEIGHT) dgamma_acc.put(it, dg);
            if (DGAMMA_LATE && PARALLEL) dgamma1_acc.put(it, dg1);
            InVec o;
            o.set_all(out);
            store_vec<decltype(edges)::value>(o, at.frame(dx, row, lddx), it, at);
#if CN_BRANCH
            {
              const unsigned keep =
                  DROPOUT ? cn_keep_bits<ELTS_PER_LDG>(row * COLS + at.column(it, 0), seed, drop_threshold) : ~0u;
              const compute_t by = (DROPOUT ? keep_scale : compute_t(1)) *
                                   (ROWSCALE ? compute_t(to_float(rowscale[row])) : compute_t(1));
              compute_t out0[ELTS_PER_LDG];
#pragma unroll
              for (int e = 0; e < ELTS_PER_LDG; ++e) out0[e] = (keep >> e) & 1u ? out[e] * by : compute_t(0);
              Vec<dx0_t, ELTS_PER_LDG> o0;
              o0.set_all(out0);
              store_vec<decltype(edges)::value>(o0, at.frame(dx0, row, lddx0), it, at);
            }
#endif
#if CN_DX1
            {  // x1's gradient: its own keep mask (stream 1), no row scale
              const unsigned keep1 =
                  cn_keep_bits<ELTS_PER_LDG, 1>(row * COLS + at.column(it, 0), seed, drop_threshold);
              compute_t out1[ELTS_PER_LDG];
#pragma unroll
              for (int e = 0; e < ELTS_PER_LDG; ++e) out1[e] = (keep1 >> e) & 1u ? out[e] * keep_scale : compute_t(0);
              Vec<dx1_t, ELTS_PER_LDG> o1;
              o1.set_all(out1);
              store_vec<decltype(edges)::value>(o1, at.frame(dx1, row, lddx1), it, at);
            }
#endif
          }
        });
      }
    }, xs, dys, drs, dy1s, rstds, means);
  };
  if constexpr (GATED) {
    if (walks_offset_rows(mean, rstd, rows, at)) walk_rows(Flag<true>());
    else walk_rows(Flag<false>());
  } else {
    walk_rows(Flag<REFINE_MEAN>());
  }

  static_assert(!PARALLEL || !PER_HEAD, "");
  if constexpr (PER_HEAD && (HAS_WEIGHT || HAS_BIAS)) {
    // A partial row per CTA row, unfolded: the host sizes the grid so that each CTA row's rows share a
    // head (the grid's row stride is a multiple of heads), and the finalize sums each head's partial rows.
    const long long part = at.group * ROWS_PER_CTA + at.warp_m;
    if (HAS_WEIGHT) dgamma_acc.store(dgamma_part + part * COLS, at);
    if (HAS_BIAS) dbeta_acc.store(dbeta_part + part * COLS, at);
  } else if constexpr (HAS_WEIGHT || HAS_BIAS) {
    compute_t* gpart = dgamma_part + at.group * COLS;
    compute_t* bpart = dbeta_part + at.group * COLS;
    compute_t* g1part = dgamma1_part + at.group * COLS;  // PARALLEL
    compute_t* b1part = dbeta1_part + at.group * COLS;
    if constexpr (ROWS_PER_CTA == 1) {  // registers' sums straight to the partial row, then the slots'
      if (HAS_WEIGHT) dgamma_acc.store(gpart, at, STEPS_IN_REGISTERS);
      if (HAS_BIAS) dbeta_acc.store(bpart, at, STEPS_IN_REGISTERS);
      if (PARALLEL) dgamma1_acc.store(g1part, at, STEPS_IN_REGISTERS);
      if (HAS_BIAS1) dbeta1_acc.store(b1part, at, STEPS_IN_REGISTERS);
      if constexpr (SMEM_ACCUMULATORS) {
        __syncthreads();
        if (HAS_WEIGHT) fold_slots(acc_smem, gpart, at, x, ldx);
        if (HAS_BIAS) fold_slots(acc_smem + ACC_SLOTS, bpart, at, x, ldx);
        if (PARALLEL) fold_slots(acc_smem + 2 * ACC_SLOTS, g1part, at, x, ldx);
        if (HAS_BIAS1) fold_slots(acc_smem + 3 * ACC_SLOTS, b1part, at, x, ldx);
      }
    } else {
      dgamma_acc.spill_to_slots();
      dbeta_acc.spill_to_slots();
      if constexpr (PARALLEL) {
        dgamma1_acc.spill_to_slots();
        dbeta1_acc.spill_to_slots();
      }
      __syncthreads();
      if (HAS_WEIGHT) fold_slots(acc_smem, gpart, at, x, ldx);
      if (HAS_BIAS) fold_slots(acc_smem + ACC_SLOTS, bpart, at, x, ldx);
      if (PARALLEL) fold_slots(acc_smem + 2 * ACC_SLOTS, g1part, at, x, ldx);
      if (HAS_BIAS1) fold_slots(acc_smem + 3 * ACC_SLOTS, b1part, at, x, ldx);
    }
  }
  finish_cluster();
#if CN_GRID_FINALIZE
  finalize_across_grid(ticket, parts, heads, dgamma_part, dbeta_part, dgamma, dbeta, dgamma1_part, dbeta1_part, dgamma1,
                   dbeta1);
#endif
}

#if !CN_GRID_FINALIZE  // (norm_bwd's grid sums the partials itself instead)
// Sums the [parts, COLS] partials column by column into dgamma (weight dtype)
// and dbeta (bias dtype). A CTA owns FIN_COL_LANES * FIN_VEC columns: each
// lane FIN_VEC neighbours (one vector load per partial row), FIN_COL_LANES
// lanes side by side along the row, and the warp's other lanes, and the other
// warps, on other partial rows (narrow rows are split this fine so that the
// grid still fills the GPU: cunorm.Traits.finalize_col_lanes). Each lane sums
// its partial rows in order, a butterfly adds the warp's lanes of a column,
// then warp 0 adds the warps' results in warp order: a fixed order. PER_HEAD:
// [heads, COLS] outputs, partial row p belonging to head p % heads; a CTA
// owns its columns of one head.
constexpr int FINALIZE_WARPS = ${FINALIZE_WARPS};
constexpr int FIN_VEC = COLS % 4 == 0 ? 4 : 1;
constexpr int FIN_COL_LANES = ${FINALIZE_COL_LANES};
constexpr int FIN_ROW_LANES = THREADS_PER_WARP / FIN_COL_LANES;  // a warp's lanes on different partial rows
using FinVec = Vec<compute_t, FIN_VEC>;
static_assert(FIN_COL_LANES >= 1 && THREADS_PER_WARP % FIN_COL_LANES == 0, "FIN_COL_LANES divides a warp");
static_assert(FIN_COL_LANES * FIN_VEC == ${FINALIZE_COLS_PER_CTA}, "cunorm.Traits.finalize_cols_per_cta disagrees");

extern "C" __global__ void __launch_bounds__(FINALIZE_WARPS * 32)
norm_bwd_finalize(const compute_t* __restrict__ dgamma_part, const compute_t* __restrict__ dbeta_part, int parts,
                  weight_t* __restrict__ dgamma, bias_t* __restrict__ dbeta
#if CN_PER_HEAD
                  , int heads
#endif
#if CN_PARALLEL
                  , const compute_t* __restrict__ dgamma1_part, const compute_t* __restrict__ dbeta1_part,
                  weight1_t* __restrict__ dgamma1, bias1_t* __restrict__ dbeta1
#endif
) {
#if !CN_PER_HEAD
  constexpr int heads = 1;
#endif
#if !CN_PARALLEL
  const compute_t* const dgamma1_part = nullptr;
  const compute_t* const dbeta1_part = nullptr;
  weight1_t* const dgamma1 = nullptr;
  bias1_t* const dbeta1 = nullptr;
#endif
  constexpr int CTAS_PER_HEAD = (COLS / FIN_VEC + FIN_COL_LANES - 1) / FIN_COL_LANES;
  constexpr int ROW_STREAMS = FINALIZE_WARPS * FIN_ROW_LANES;  // lanes of the CTA on different partial rows
  __shared__ FinVec warp_sums[2][FINALIZE_WARPS][FIN_COL_LANES];  // a pair of quantities at a time
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col_lane = lane % FIN_COL_LANES, stream = warp * FIN_ROW_LANES + lane / FIN_COL_LANES;
  const int head = PER_HEAD ? blockIdx.x / CTAS_PER_HEAD : 0;
  // in units of FIN_VEC columns
  const int vec = (PER_HEAD ? blockIdx.x % CTAS_PER_HEAD : blockIdx.x) * FIN_COL_LANES + col_lane;
  const bool ok = vec < COLS / FIN_VEC;
  FinVec sg, sb, sg1, sb1;  // sg1, sb1: PARALLEL's
  sg.zero();
  sb.zero();
  sg1.zero();
  sb1.zero();
  if (ok) {
#pragma unroll 4  // (several partial rows' loads in flight a lane, added in order; the compiler's choice too)
    for (int p = head + stream * heads; p < parts; p += ROW_STREAMS * heads) {
      FinVec g, b, g1, b1;
      if (HAS_WEIGHT) g.load(dgamma_part + static_cast<long long>(p) * COLS, vec);
      if (HAS_BIAS) b.load(dbeta_part + static_cast<long long>(p) * COLS, vec);
      if (PARALLEL) g1.load(dgamma1_part + static_cast<long long>(p) * COLS, vec);
      if (HAS_BIAS1) b1.load(dbeta1_part + static_cast<long long>(p) * COLS, vec);
#pragma unroll
      for (int e = 0; e < FIN_VEC; ++e) {
        if (HAS_WEIGHT) sg.add(e, g.get(e));
        if (HAS_BIAS) sb.add(e, b.get(e));
        if (PARALLEL) sg1.add(e, g1.get(e));
        if (HAS_BIAS1) sb1.add(e, b1.get(e));
      }
    }
  }
#pragma unroll
  for (int e = 0; e < FIN_VEC; ++e) {  // the warp's lanes of a column, every lane (lanes past the row add zeros)
    if (HAS_WEIGHT) sg.set(e, warp_sum<FIN_ROW_LANES, FIN_COL_LANES>(sg.get(e)));
    if (HAS_BIAS) sb.set(e, warp_sum<FIN_ROW_LANES, FIN_COL_LANES>(sb.get(e)));
    if (PARALLEL) sg1.set(e, warp_sum<FIN_ROW_LANES, FIN_COL_LANES>(sg1.get(e)));
    if (HAS_BIAS1) sb1.set(e, warp_sum<FIN_ROW_LANES, FIN_COL_LANES>(sb1.get(e)));
  }
  // After the butterfly every lane of a column holds the same sums; the first stores them.
  const bool first_of_column = lane < FIN_COL_LANES;
  if (first_of_column) {
    warp_sums[0][warp][lane] = sg;
    warp_sums[1][warp][lane] = sb;
  }
  __syncthreads();
  if (warp == 0 && first_of_column && ok) {
    sg.zero();
    sb.zero();
#pragma unroll
    for (int w = 0; w < FINALIZE_WARPS; ++w)
#pragma unroll
      for (int e = 0; e < FIN_VEC; ++e) {
        sg.add(e, warp_sums[0][w][lane].get(e));
        sb.add(e, warp_sums[1][w][lane].get(e));
      }
#pragma unroll
    for (int e = 0; e < FIN_VEC; ++e) {
      if (HAS_WEIGHT) dgamma[head * COLS + vec * FIN_VEC + e] = from_float<weight_t>(sg.get(e));
      if (HAS_BIAS) dbeta[head * COLS + vec * FIN_VEC + e] = from_float<bias_t>(sb.get(e));
    }
  }
  if constexpr (PARALLEL) {  // the second pair in the same slots, once warp 0 has read the first
    __syncthreads();
    if (first_of_column) {
      warp_sums[0][warp][lane] = sg1;
      warp_sums[1][warp][lane] = sb1;
    }
    __syncthreads();
    if (warp == 0 && first_of_column && ok) {
      sg1.zero();
      sb1.zero();
#pragma unroll
      for (int w = 0; w < FINALIZE_WARPS; ++w)
#pragma unroll
        for (int e = 0; e < FIN_VEC; ++e) {
          sg1.add(e, warp_sums[0][w][lane].get(e));
          sb1.add(e, warp_sums[1][w][lane].get(e));
        }
#pragma unroll
      for (int e = 0; e < FIN_VEC; ++e) {
        dgamma1[head * COLS + vec * FIN_VEC + e] = from_float<weight1_t>(sg1.get(e));
        if (HAS_BIAS1) dbeta1[head * COLS + vec * FIN_VEC + e] = from_float<bias1_t>(sb1.get(e));
      }
    }
  }
}
#endif  // !CN_GRID_FINALIZE
