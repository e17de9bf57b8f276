// LayerNorm forward: y = (x - mean) * rstd * gamma + beta over the last axis.
//
// Each row lives in registers (LDGS vectors of ELTS_PER_LDG elements per
// thread), so x is read from memory exactly once; the next STAGES - 1 rows are
// in flight meanwhile (see for_each_row). Mean and variance are exact
// two-pass sums in fp32 over the registers, never E[x^2] - E[x]^2.
#include "cunorm_common.cuh"
#include "norm_traits.cuh"

extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA, MIN_CTAS_PER_SM) CN_CLUSTER_DIMS
layer_norm_fwd(const input_t* __restrict__ x, const weight_t* __restrict__ gamma,
               const weight_t* __restrict__ beta, output_t* __restrict__ y,
               float* __restrict__ mean_out, float* __restrict__ rstd_out,  // may be null
               long long rows, long long ldx, long long ldy, float eps) {
  using InVec = Vec<input_t, ELTS_PER_LDG>;
  using WVec = Vec<weight_t, ELTS_PER_LDG>;
  using OutVec = Vec<output_t, ELTS_PER_LDG>;
  const Coords at;
  CN_ROW_REDUCER(1, reducer);

  const RowWeights<weight_t, HAS_WEIGHT> w(gamma, at);
  const RowWeights<weight_t, HAS_BIAS> b(beta, at);

  constexpr float inv_cols = 1.f / float(COLS);
  static_assert(PIPE_SLOTS * int(sizeof(InVec)) == ${SMEM_BYTES}, "cunorm.Traits.smem_bytes disagrees");
  CN_DYNAMIC_SMEM(smem);
  RowPipe<input_t> xs(reinterpret_cast<InVec*>(smem), x, ldx, rows, at);

  for_each_row(rows, at, [&](long long row, bool row_ok, int stage) {
    InVec v[LDGS];
    xs.read(stage, row, v, at);

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
        const WVec wv = w(it, at), bv = b(it, at);
        float out[ELTS_PER_LDG];
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          // (x - mean) * rstd, not x * rstd - mean * rstd: exact even when |mean| >> std.
          const float xhat = (v[it].get(e) - mean) * rstd;
          out[e] = HAS_WEIGHT ? (HAS_BIAS ? fmaf(xhat, wv.get(e), bv.get(e)) : xhat * wv.get(e))
                              : (HAS_BIAS ? xhat + bv.get(e) : xhat);
        }
        OutVec o;
        o.set_all(out);
        o.store(y + row * ldy, at.vec(it));
      }
      if (at.row_leader()) {
        if (mean_out) mean_out[row] = mean;
        if (rstd_out) rstd_out[row] = rstd;
      }
    }
  }, xs);
  finish_cluster();
}
