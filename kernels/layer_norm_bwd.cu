// LayerNorm backward: dx, and per-CTA fp32 partials of dgamma and dbeta, in
// one pass over x and dy; layer_norm_bwd_finalize then sums the partials.
//
// With xhat = (x - mean) * rstd and g = dy * gamma:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   dgamma = sum_rows(dy * xhat),  dbeta = sum_rows(dy)
// The grid is persistent (one wave): each CTA walks its rows, keeps its column
// sums in registers, and writes one partial row. Nothing is atomic, and every
// sum runs in a fixed order, so the results are bitwise reproducible.
#include "cunorm_common.cuh"
#include "norm_traits.cuh"

// Shared memory for folding the WARPS_M rows of partials of a CTA into one.
constexpr int WGRAD_SMEM_FLOATS = WARPS_M > 1 ? WARPS_M * COLS : 1;
static_assert(WGRAD_SMEM_FLOATS * 4 <= 48 * 1024, "WARPS_M * hidden size * 4 must fit in 48 KB of shared memory");
static_assert(${SMEM_BYTES} == (WARPS_M > 1 ? WARPS_M * COLS * 4 : 0), "cunorm.Traits.smem_bytes disagrees");

extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA) CN_CLUSTER_DIMS
layer_norm_bwd(const output_t* __restrict__ dy, const input_t* __restrict__ x,
               const float* __restrict__ mean, const float* __restrict__ rstd,
               const weight_t* __restrict__ gamma, input_t* __restrict__ dx,
               float* __restrict__ dgamma_part, float* __restrict__ dbeta_part,  // [groups, COLS]
               long long rows, long long ldx, long long lddy, long long lddx) {
  using InVec = Vec<input_t, ELTS_PER_LDG>;
  using GradVec = Vec<output_t, ELTS_PER_LDG>;
  using WVec = Vec<weight_t, ELTS_PER_LDG>;
  using AccVec = Vec<float, ELTS_PER_LDG>;
  const Coords at;
  CN_ROW_REDUCER(2, reducer);

  WVec w[LDGS];
  AccVec dgamma_acc[LDGS], dbeta_acc[LDGS];
#pragma unroll
  for (int it = 0; it < LDGS; ++it) {
    if (HAS_WEIGHT && at.in_row(it)) w[it].load(gamma, at.vec(it));
#pragma unroll
    for (int e = 0; e < ELTS_PER_LDG; ++e) dgamma_acc[it].elt[e] = dbeta_acc[it].elt[e] = 0.f;
  }

  constexpr float inv_cols = 1.f / float(COLS);
  for (long long first = at.group * ROWS_PER_CTA; first < rows; first += at.groups * ROWS_PER_CTA) {
    const long long row = first + at.warp_m;
    const bool row_ok = row < rows;

    // Rows past the end (and columns past the row) are zeros: g = 0 there, so
    // they add nothing to the row sums or the column partials.
    InVec xv[LDGS];
    GradVec dyv[LDGS];
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      if (row_ok && at.in_row(it)) {
        xv[it].load(x + row * ldx, at.vec(it));
        dyv[it].load(dy + row * lddy, at.vec(it));
      } else {
        xv[it].zero();
        dyv[it].zero();
      }
    }
    const float mu = row_ok ? mean[row] : 0.f;
    const float rs = row_ok ? rstd[row] : 0.f;

    float sums[2] = {0.f, 0.f};  // sum(g), sum(g * xhat)
#pragma unroll
    for (int it = 0; it < LDGS; ++it)
#pragma unroll
      for (int e = 0; e < ELTS_PER_LDG; ++e) {
        const float xhat = (xv[it].get(e) - mu) * rs;
        const float d = dyv[it].get(e);
        const float g = HAS_WEIGHT ? d * w[it].get(e) : d;
        sums[0] += g;
        sums[1] += g * xhat;
        dgamma_acc[it].elt[e] += d * xhat;
        dbeta_acc[it].elt[e] += d;
      }
    reducer.allreduce(sums, at);
    const float mean_g = sums[0] * inv_cols;
    const float mean_gx = sums[1] * inv_cols;

    if (row_ok) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) {
        if (!at.in_row(it)) continue;
        InVec o;
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          const float xhat = (xv[it].get(e) - mu) * rs;
          const float d = dyv[it].get(e);
          const float g = HAS_WEIGHT ? d * w[it].get(e) : d;
          o.set(e, rs * (g - mean_g - xhat * mean_gx));
        }
        o.store(dx + row * lddx, at.vec(it));
      }
    }
  }

  if constexpr (HAS_WEIGHT || HAS_BIAS) {
    float* gpart = dgamma_part + at.group * COLS;
    float* bpart = dbeta_part + at.group * COLS;
    if constexpr (WARPS_M == 1) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) {
        if (!at.in_row(it)) continue;
        if (HAS_WEIGHT) dgamma_acc[it].store(gpart, at.vec(it));
        if (HAS_BIAS) dbeta_acc[it].store(bpart, at.vec(it));
      }
    } else {
      // Fold the CTA's WARPS_M rows of partials, in warp order, through shared memory.
      __shared__ float fold[WGRAD_SMEM_FLOATS];
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        if ((pass == 0 && !HAS_WEIGHT) || (pass == 1 && !HAS_BIAS)) continue;
        AccVec* acc = pass == 0 ? dgamma_acc : dbeta_acc;
#pragma unroll
        for (int it = 0; it < LDGS; ++it)
          if (at.in_row(it)) acc[it].store(fold + at.warp_m * COLS, at.vec(it));
        __syncthreads();
        for (int c = threadIdx.x; c < COLS; c += THREADS_PER_CTA) {
          float s = 0.f;
#pragma unroll
          for (int m = 0; m < WARPS_M; ++m) s += fold[m * COLS + c];
          (pass == 0 ? gpart : bpart)[c] = s;
        }
        __syncthreads();
      }
    }
  }
  finish_cluster();
}

// Sums the [parts, COLS] partials column by column into dgamma and dbeta, in
// the weight dtype. A CTA owns 32 columns; its warps take interleaved rows of
// partials, then warp 0 adds the warps' results in order.
constexpr int FINALIZE_WARPS = ${FINALIZE_WARPS};

extern "C" __global__ void __launch_bounds__(FINALIZE_WARPS * 32)
layer_norm_bwd_finalize(const float* __restrict__ dgamma_part, const float* __restrict__ dbeta_part,
                        int parts, weight_t* __restrict__ dgamma, weight_t* __restrict__ dbeta) {
  __shared__ float warp_sums[2][FINALIZE_WARPS][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = blockIdx.x * 32 + lane;
  float sg = 0.f, sb = 0.f;
  if (col < COLS) {
    for (int p = warp; p < parts; p += FINALIZE_WARPS) {
      if (HAS_WEIGHT) sg += dgamma_part[static_cast<long long>(p) * COLS + col];
      if (HAS_BIAS) sb += dbeta_part[static_cast<long long>(p) * COLS + col];
    }
  }
  warp_sums[0][warp][lane] = sg;
  warp_sums[1][warp][lane] = sb;
  __syncthreads();
  if (warp == 0 && col < COLS) {
    sg = sb = 0.f;
#pragma unroll
    for (int w = 0; w < FINALIZE_WARPS; ++w) {
      sg += warp_sums[0][w][lane];
      sb += warp_sums[1][w][lane];
    }
    if (HAS_WEIGHT) dgamma[col] = from_float<weight_t>(sg);
    if (HAS_BIAS) dbeta[col] = from_float<weight_t>(sb);
  }
}
