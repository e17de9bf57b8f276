// Attention-backward row delta: D[r] = sum_k out[r, k] * grad_out[r, k], summed in
// acc_t: fp32, or fp64 when an input is fp64 (D is then fp64 too).
//
// THREADS_PER_ROW threads share a row, each summing VECS_PER_THREAD vectors of
// ELTS_PER_LDG elements; a thread handles ROWS_PER_THREAD rows at once and
// issues all their loads before the first product, so that many loads are in
// flight per thread (the seed's two-stage pipeline, unrolled over rows). The
// row's partial sums meet through a shuffle butterfly; fixed order, so the
// result is reproducible. Rows are addressed through up to three leading axes
// with their own strides per tensor (e.g. [B, M, H, K] views of a fused
// buffer, or [B, H, M, K] tensors), the last axis contiguous.
#include "cunorm_common.cuh"

typedef ${OUT_T} out_t;
typedef ${GRAD_T} grad_t;
typedef ${ACC_T} acc_t;
constexpr int HEAD_DIM = ${HEAD_DIM};
constexpr int THREADS_PER_ROW = ${THREADS_PER_ROW};
constexpr int THREADS_PER_CTA = ${THREADS_PER_CTA};
constexpr int ELTS_PER_LDG = ${ELTS_PER_LDG};
constexpr int ROWS_PER_THREAD = ${ROWS_PER_THREAD};

constexpr int VEC_K = HEAD_DIM / ELTS_PER_LDG;  // vectors in a row
constexpr int VECS_PER_THREAD = (VEC_K + THREADS_PER_ROW - 1) / THREADS_PER_ROW;
constexpr int ROWS_PER_CTA = THREADS_PER_CTA / THREADS_PER_ROW * ROWS_PER_THREAD;

static_assert(THREADS_PER_ROW >= 1 && THREADS_PER_ROW <= 32 && (THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0,
              "THREADS_PER_ROW must be a power of two <= 32");
static_assert(THREADS_PER_CTA % 32 == 0 && THREADS_PER_CTA <= 1024, "THREADS_PER_CTA: whole warps, <= 1024");
static_assert(HEAD_DIM % ELTS_PER_LDG == 0, "the head dim must be a multiple of the elements per load");
static_assert(ROWS_PER_THREAD >= 1, "ROWS_PER_THREAD must be >= 1");
static_assert(VECS_PER_THREAD == ${VECS_PER_THREAD}, "cunorm.DeltaTraits.vecs_per_thread disagrees");
static_assert(ROWS_PER_CTA == ${ROWS_PER_CTA}, "cunorm.DeltaTraits.rows_per_cta disagrees");

// Element offset of row r of a tensor whose rows span leading axes
// [d0, d1, d2] (d0 implied) with strides s0, s1, s2.
struct RowIndex {
  unsigned d1, d2;
  long long s0, s1, s2;
  __device__ __forceinline__ long long operator()(unsigned r) const {
    const unsigned i2 = r % d2, q = r / d2;
    return (q / d1) * s0 + (q % d1) * s1 + i2 * s2;
  }
};

extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA)
attention_delta(const out_t* __restrict__ out, const grad_t* __restrict__ grad, acc_t* __restrict__ delta,
                unsigned rows, unsigned d1, unsigned d2, long long os0, long long os1, long long os2,
                long long gs0, long long gs1, long long gs2) {
  using OVec = Vec<out_t, ELTS_PER_LDG>;
  using GVec = Vec<grad_t, ELTS_PER_LDG>;
  const RowIndex out_row{d1, d2, os0, os1, os2}, grad_row{d1, d2, gs0, gs1, gs2};
  const int sub = threadIdx.x % THREADS_PER_ROW;           // this thread's place in its row
  const int slot = threadIdx.x / THREADS_PER_ROW;          // which row of the CTA's group
  constexpr int ROW_STEP = THREADS_PER_CTA / THREADS_PER_ROW;

  for (unsigned long long first = static_cast<unsigned long long>(blockIdx.x) * ROWS_PER_CTA; first < rows;
       first += static_cast<unsigned long long>(gridDim.x) * ROWS_PER_CTA) {
    OVec o[ROWS_PER_THREAD][VECS_PER_THREAD];
    GVec g[ROWS_PER_THREAD][VECS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
      const unsigned long long row = first + r * ROW_STEP + slot;
      const bool row_ok = row < rows;
      const out_t* orow = out + (row_ok ? out_row(static_cast<unsigned>(row)) : 0);
      const grad_t* grow = grad + (row_ok ? grad_row(static_cast<unsigned>(row)) : 0);
#pragma unroll
      for (int j = 0; j < VECS_PER_THREAD; ++j) {
        const int v = sub + j * THREADS_PER_ROW;
        if (row_ok && (VEC_K % THREADS_PER_ROW == 0 || v < VEC_K)) {
          o[r][j].load(orow, v);
          g[r][j].load(grow, v);
        } else {
          o[r][j].zero();
          g[r][j].zero();
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
      acc_t acc = 0;
#pragma unroll
      for (int j = 0; j < VECS_PER_THREAD; ++j)
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) acc = cn_fma(acc_t(o[r][j].get(e)), acc_t(g[r][j].get(e)), acc);
      // Butterfly within the row's THREADS_PER_ROW lanes (aligned groups of a warp).
#pragma unroll
      for (int offset = THREADS_PER_ROW / 2; offset > 0; offset >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      const unsigned long long row = first + r * ROW_STEP + slot;
      if (sub == 0 && row < rows) delta[row] = acc;
    }
  }
}
