// LayerNorm forward: y = (x - mean) * rstd * gamma + beta over the last axis.
//
// Each row lives in registers (LDGS vectors of ELTS_PER_LDG elements per
// thread), so x is read from memory exactly once. Mean and variance are exact
// two-pass sums in fp32 over the registers, never E[x^2] - E[x]^2.
#include "cunorm_common.cuh"
#include "norm_traits.cuh"

extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA) CN_CLUSTER_DIMS
layer_norm_fwd(const input_t* __restrict__ x, const weight_t* __restrict__ gamma,
               const weight_t* __restrict__ beta, output_t* __restrict__ y,
               float* __restrict__ mean_out, float* __restrict__ rstd_out,  // may be null
               long long rows, long long ldx, long long ldy, float eps) {
  using InVec = Vec<input_t, ELTS_PER_LDG>;
  using WVec = Vec<weight_t, ELTS_PER_LDG>;
  using OutVec = Vec<output_t, ELTS_PER_LDG>;
  const Coords at;
  CN_ROW_REDUCER(1, reducer);

  WVec w[LDGS], b[LDGS];
#pragma unroll
  for (int it = 0; it < LDGS; ++it) {
    if (HAS_WEIGHT && at.in_row(it)) w[it].load(gamma, at.vec(it));
    if (HAS_BIAS && at.in_row(it)) b[it].load(beta, at.vec(it));
  }

  constexpr float inv_cols = 1.f / float(COLS);
  // Every CTA runs the same number of iterations (barriers inside); rows past
  // the end are computed on zeros and not stored.
  for (long long first = at.group * ROWS_PER_CTA; first < rows; first += at.groups * ROWS_PER_CTA) {
    const long long row = first + at.warp_m;
    const bool row_ok = row < rows;

    InVec v[LDGS];
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      if (row_ok && at.in_row(it)) v[it].load(x + row * ldx, at.vec(it));
      else v[it].zero();
    }

    float sum[1] = {0.f};
#pragma unroll
    for (int it = 0; it < LDGS; ++it)
#pragma unroll
      for (int e = 0; e < ELTS_PER_LDG; ++e) sum[0] += v[it].get(e);
    reducer.allreduce(sum, at);
    const float mean = sum[0] * inv_cols;

    float sq[1] = {0.f};
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      if (!at.in_row(it)) continue;  // padding lanes hold 0, not the mean
#pragma unroll
      for (int e = 0; e < ELTS_PER_LDG; ++e) {
        const float d = v[it].get(e) - mean;
        sq[0] += d * d;
      }
    }
    reducer.allreduce(sq, at);
    const float rstd = rsqrtf(sq[0] * inv_cols + eps);

    if (row_ok) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) {
        if (!at.in_row(it)) continue;
        OutVec o;
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          float t = (v[it].get(e) - mean) * rstd;
          if (HAS_WEIGHT) t *= w[it].get(e);
          if (HAS_BIAS) t += b[it].get(e);
          o.set(e, t);
        }
        o.store(y + row * ldy, at.vec(it));
      }
      if (at.row_leader()) {
        if (mean_out) mean_out[row] = mean;
        if (rstd_out) rstd_out[row] = rstd;
      }
    }
  }
  finish_cluster();
}
