// The row reductions of the row-normalization kernels: sums (or maxima) over a row's lanes, warps and
// the CTAs of its cluster (RowReducer), and the cluster's last barrier. Over norm_rows.cuh (Coords).
#pragma once

// A barrier over the WARPS_N warps of warp row `warp_m` (barrier 0 is __syncthreads'). Not the .aligned
// form: other warp rows of the CTA may skip the code that holds it.
__device__ __forceinline__ void row_barrier(int warp_m) {
  static_assert(WARPS_N == 1 || WARPS_M < 16, "a named barrier for each warp row: at most 15 of them");
  asm volatile("barrier.sync %0, %1;" ::"r"(1 + warp_m), "n"(WARPS_N * 32) : "memory");
}

// Sums K values over the threads of one row (its LANES_PER_ROW lanes of all
// WARPS_N warps, and all CTAS_PER_ROW CTAs of a cluster); every thread of the
// row gets the same bits.
// Partials are added in a fixed order, so results are reproducible run to run.
// Two scratch buffers alternate: a buffer is rewritten only after a later
// barrier that every reader of its previous contents has passed. Each warp row
// reads and writes only its own slots, so its parity is its own (a row-only
// reduction flips it for that warp row alone). CTA_ONLY: the kernel also sums over
// its CTA's part of a row alone (no cluster barrier), so the CTAs' slots keep a
// parity of their own, flipped by cluster exchanges only.
// PUSHED_EXCHANGE: each CTA stores its values into every peer's slots (a row of
// slots a sender) with st.async and waits on its own mbarrier for the peers'
// to land. A slot is rewritten only after it was read: a peer sends exchange
// n + 2 only once it has received this CTA's n + 1, which this CTA sends only
// after a barrier that follows its threads' reads of n.
template <int K, bool MAX = false, bool CTA_ONLY = false>  // MAX: the maximum of non-negative values (fp8
struct RowReducer {                                          // scaling) instead of the sum
  static constexpr int EVEN_K = K > 1 ? K + (K & 1) : 1;  // a CTA's partials, padded for paired remote loads
  static constexpr int SENDERS = PUSHED_EXCHANGE ? CTAS_PER_ROW : 1;  // rows of CTA slots a parity
  compute_t (*warp_partials)[WARPS_M][WARPS_N][K];
  compute_t (*cta_partials)[EVEN_K];  // [parity * SENDERS + sender]
  unsigned long long* landed;         // PUSHED_EXCHANGE: [parity] mbarriers, a phase an exchange
  int parity = 0;
  int cluster_parity = 0;  // CTA_ONLY's
  unsigned phases = 0;     // PUSHED_EXCHANGE: bit p, the phase of landed[p] to wait for

  __device__ __forceinline__ RowReducer(compute_t (*warps)[WARPS_M][WARPS_N][K], compute_t (*ctas)[EVEN_K],
                                        unsigned long long* bars)
      : warp_partials(warps), cta_partials(ctas), landed(bars) {
    if constexpr (PUSHED_EXCHANGE) {
      if (threadIdx.x == 0) init_mbarriers<2>(landed);
      cluster_sync();  // the peers' mbarriers exist before anything is sent to them
    }
  }

  static __device__ __forceinline__ compute_t combine(compute_t a, compute_t b) {
    if constexpr (MAX) return a > b ? a : b;
    else return a + b;
  }
  static __device__ __forceinline__ compute_t combine_warp(compute_t v) {
    if constexpr (MAX) return warp_max<LANES_PER_ROW>(v);
    else return warp_sum<LANES_PER_ROW>(v);
  }

  // The CTAs' slots in use.
  __device__ __forceinline__ int cta_slots() const { return CTA_ONLY ? cluster_parity : parity; }

  // (PUSHED_EXCHANGE) Sends this CTA's J values (the same in every thread) to every CTA of the cluster, itself
  // included (thread r to rank r), and waits until every CTA's have landed here: then sender r's values are
  // cta_partials[slot * SENDERS + r]. The caller's barrier since its threads' last reads of `slot` comes first.
  template <int J>
  __device__ __forceinline__ void push_and_wait(const compute_t (&v)[J], int slot) {
    const int me = blockIdx.x % CTAS_PER_ROW;  // this CTA's rank (Coords::cta_rank)
    if (threadIdx.x == 0) mbarrier_arrive_expecting(&landed[slot], CTAS_PER_ROW * J * sizeof(compute_t));
    if (threadIdx.x < CTAS_PER_ROW) {
      const unsigned bar = cluster_address(&landed[slot], threadIdx.x);
#pragma unroll
      for (int k = 0; k < J; ++k)
        store_async(cluster_address(&cta_partials[slot * SENDERS + me][k], threadIdx.x), v[k], bar);
    }
    mbarrier_wait(&landed[slot], (phases >> slot) & 1u);
    phases ^= 1u << slot;
  }

  // ROW_ONLY: the threads of other rows of the CTA need not take part (its barrier is the row's own warps').
  // ACROSS_CLUSTER false (CTA_ONLY): the CTA's part of the row only. J values (the first J of the scratch's K).
  template <bool ROW_ONLY = false, bool ACROSS_CLUSTER = true, int J>
  __device__ __forceinline__ void allreduce(compute_t (&v)[J], const Coords& at) {
    static_assert(J >= 1 && J <= K, "RowReducer::allreduce: 1 to K values");
    static_assert(ACROSS_CLUSTER || CTA_ONLY, "a CTA-only reduction needs the CTAs' own parity");
#pragma unroll
    for (int k = 0; k < J; ++k) v[k] = combine_warp(v[k]);
    if constexpr (WARPS_N > 1) {
      if (at.lane == 0) {
#pragma unroll
        for (int k = 0; k < J; ++k) warp_partials[parity][at.warp_m][at.warp_n][k] = v[k];
      }
      if constexpr (ROW_ONLY && WARPS_M > 1) row_barrier(at.warp_m);
      else __syncthreads();
#pragma unroll
      for (int k = 0; k < J; ++k) {
        compute_t s = 0;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) s = combine(s, warp_partials[parity][at.warp_m][w][k]);
        v[k] = s;
      }
    }
    if constexpr (CTAS_PER_ROW > 1 && ACROSS_CLUSTER && PUSHED_EXCHANGE) {
      if constexpr (WARPS_N == 1) __syncwarp();  // a CTA of one warp: no barrier above
      push_and_wait(v, cta_slots());
      compute_t s[J] = {};  // rank by rank, in the same order as below
#pragma unroll
      for (int r = 0; r < CTAS_PER_ROW; ++r) {
#pragma unroll
        for (int k = 0; k < J; ++k) s[k] = combine(s[k], cta_partials[cta_slots() * SENDERS + r][k]);
      }
#pragma unroll
      for (int k = 0; k < J; ++k) v[k] = s[k];
      if constexpr (CTA_ONLY) cluster_parity ^= 1;
    } else if constexpr (CTAS_PER_ROW > 1 && ACROSS_CLUSTER) {
      if (threadIdx.x == 0) {
#pragma unroll
        for (int k = 0; k < J; ++k) cta_partials[cta_slots()][k] = v[k];
      }
      cluster_sync();
      // Each peer's values in pairs (one remote load for two; the scratch rows are padded to even K), added
      // rank by rank in the same order for every value.
      compute_t s[J] = {};
#pragma unroll
      for (int r = 0; r < CTAS_PER_ROW; ++r) {
#pragma unroll
        for (int k = 0; k < J; k += 2) {
          if (k + 1 < J) {
            compute_t a, b;
            load_cluster_shared_pair(&cta_partials[cta_slots()][k], r, a, b);
            s[k] = combine(s[k], a);
            s[k + 1] = combine(s[k + 1], b);
          } else {
            s[k] = combine(s[k], load_cluster_shared(&cta_partials[cta_slots()][k], r));
          }
        }
      }
#pragma unroll
      for (int k = 0; k < J; ++k) v[k] = s[k];
      if constexpr (CTA_ONLY) cluster_parity ^= 1;
    }
    parity ^= 1;
  }

  // (CTA_ONLY) Publishes this CTA's J values (the same in every thread) to its cluster and calls f(rank,
  // values) for the values of every CTA of the row, rank by rank (the same order in every thread: the same
  // bits): a fold other than a sum (merged moments).
  template <int J, typename F>
  __device__ __forceinline__ void each_cta(const compute_t (&v)[J], F&& f) {
    static_assert(CTA_ONLY && CTAS_PER_ROW > 1 && J >= 1 && J <= K, "RowReducer::each_cta: 1 to K values");
    if constexpr (PUSHED_EXCHANGE) {
      __syncthreads();  // this CTA's reads of the slots' last exchange come before its sends
      push_and_wait(v, cluster_parity);
#pragma unroll
      for (int r = 0; r < CTAS_PER_ROW; ++r) {
        compute_t peer[J];
#pragma unroll
        for (int k = 0; k < J; ++k) peer[k] = cta_partials[cluster_parity * SENDERS + r][k];
        f(r, peer);
      }
      cluster_parity ^= 1;
      return;
    }
    if (threadIdx.x == 0) {
#pragma unroll
      for (int k = 0; k < J; ++k) cta_partials[cluster_parity][k] = v[k];
    }
    cluster_sync();
    // Each peer's values in pairs (one remote load for two; the scratch rows are padded to even K).
#pragma unroll
    for (int r = 0; r < CTAS_PER_ROW; ++r) {
      compute_t peer[J];
#pragma unroll
      for (int k = 0; k < J; k += 2) {
        if (k + 1 < J) load_cluster_shared_pair(&cta_partials[cluster_parity][k], r, peer[k], peer[k + 1]);
        else peer[k] = load_cluster_shared(&cta_partials[cluster_parity][k], r);
      }
      f(r, peer);
    }
    cluster_parity ^= 1;
  }

  // Whether `flag`, the same for every thread of a row, holds for any row that shares this row's shuffles
  // (several rows a warp): those rows' threads get the same answer, so a branch on it may hold a
  // reduction over the row's own threads (allreduce<true>).
  __device__ __forceinline__ bool row_group_any(bool flag) const {
    if constexpr (WARPS_N == 1 && CTAS_PER_ROW == 1) return __any_sync(0xffffffffu, flag);
    else return flag;  // a warp (and a cluster) holds one row
  }

  // Whether `flag`, the same for every thread of a row, holds for any row that shares this row's reduction
  // (the CTA's rows where they span several warps, the warp's where they share one): a branch on it may hold
  // a full allreduce. CTAs holding several rows of several warps each vote at a barrier; the others need
  // none. (A row-only reduction in such a branch drew racecheck hazards, not explained, in a backward trial:
  // PERFORMANCE.md version 42; the overflow branch above uses one and ran clean.)
  __device__ __forceinline__ bool reduction_group_any(bool flag) const {
    if constexpr (WARPS_M > 1 && WARPS_N > 1) return __syncthreads_or(flag);
    else return row_group_any(flag);
  }
};

// Declares the scratch a RowReducer<K> needs and constructs it as `name`; CN_ROW_MAX_REDUCER one that
// takes maxima.
#define CN_ROW_MAX_REDUCER(name)                                  \
  __shared__ compute_t name##_warps[2][WARPS_M][WARPS_N][1];      \
  __shared__ compute_t name##_ctas[2 * RowReducer<1, true>::SENDERS][1]; \
  __shared__ unsigned long long name##_landed[2];                 \
  RowReducer<1, true> name(name##_warps, name##_ctas, name##_landed)

#define CN_ROW_REDUCER(K, name) CN_ROW_REDUCER_OF(K, false, name)
// CTA_ONLY: see RowReducer.
#define CN_ROW_REDUCER_OF(K, CTA_ONLY, name)                      \
  __shared__ compute_t name##_warps[2][WARPS_M][WARPS_N][K];      \
  __shared__ __align__(16) compute_t name##_ctas[2 * RowReducer<K>::SENDERS][RowReducer<K>::EVEN_K]; \
  __shared__ unsigned long long name##_landed[2];                 \
  RowReducer<K, false, CTA_ONLY> name(name##_warps, name##_ctas, name##_landed)

// A CTA must not exit while cluster peers may still read its shared memory.
__device__ __forceinline__ void finish_cluster() {
  if constexpr (CTAS_PER_ROW > 1) cluster_sync();
}
