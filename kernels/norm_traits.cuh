// Kernel traits of the row-normalization family (LayerNorm and RMSNorm,
// forward and backward), filled in from cunorm.Traits.
//
// The independent knobs and flags are rendered from Python; everything else is
// derived here, and cunorm/traits.py derives the same quantities and states the
// same rules (the static_asserts at the end check that the two agree).
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

// Whether LDG step `it` can hold a vector across a row's ends (general
// kernel): step 0 (the head) and the step or two that can hold a row's last
// element, which the shift moves by at most one vector. A compile-time answer
// once loops are unrolled: an edge warp runs the aligned code at every other
// step, so that it is barely slower than the warps it shares barriers with.
__device__ __forceinline__ constexpr bool may_be_partial(int it) {
  return !ALIGNED_ROWS && (it == 0 || it == (COLS - 1) / ELTS_PER_LDG / VEC_COLS_PER_LDG ||
                           it == (COLS + ELTS_PER_LDG - 2) / ELTS_PER_LDG / VEC_COLS_PER_LDG);
}

// Where this thread sits: which row of the CTA, which column vector it starts
// at, and the shift of its rows. The host sizes the grid so that every row a
// thread walks has the same shift (see cunorm.layout), so the shift, the weight
// columns and the column sums of a thread stay put.
struct Coords {
  int lane;    // this thread's lane among the LANES_PER_ROW of its row in its warp
  int warp_m;  // this thread's row of the CTA (ROWS_PER_WARP rows a warp row)
  int warp_n;
  int cta_rank;            // rank of this CTA among the CTAS_PER_ROW sharing a row
  long long group;         // index of this CTA's row group (ROWS_PER_CTA rows)
  long long groups;        // row groups in the grid
  int col;                 // first vector column of this thread
  int shift;               // elements from this thread's row starts back to a vector boundary
  // Whether this warp holds a vector that straddles a row end (general kernel
  // only; at most two warps of a row). Only such warps take the element-wise
  // paths (see with_edges); the flag is warp-uniform, so the others branch
  // past that code instead of running it predicated off.
  bool edge;

  __device__ __forceinline__ Coords(const void* x, row_stride_t ldx) {
    const int warp = threadIdx.x / THREADS_PER_WARP, warp_lane = threadIdx.x % THREADS_PER_WARP;
    lane = warp_lane % LANES_PER_ROW;
    warp_m = warp / WARPS_N * ROWS_PER_WARP + warp_lane / LANES_PER_ROW;
    warp_n = warp % WARPS_N;
    cta_rank = blockIdx.x % CTAS_PER_ROW;
    group = blockIdx.x / CTAS_PER_ROW;
    groups = gridDim.x / CTAS_PER_ROW;
    col = cta_rank * THREADS_PER_ROW + warp_n * LANES_PER_ROW + lane;
    shift = shift_of(x, ldx, group * ROWS_PER_CTA + warp_m);
    edge = false;
    if constexpr (!ALIGNED_ROWS) {
      bool mine = false;
#pragma unroll
      for (int it = 0; it < LDGS; ++it) mine |= may_be_partial(it) && in_row(it) && !full(it);
      edge = __any_sync(0xffffffffu, mine);
    }
  }
  // The shift of `row` of a row tensor at `x` with row stride `ldx` (elements).
  static __device__ __forceinline__ int shift_of(const void* x, row_stride_t ldx, long long row) {
    if constexpr (ALIGNED_ROWS) return 0;
    const long long first = static_cast<long long>(reinterpret_cast<unsigned long long>(x) / sizeof(input_t));
    return static_cast<int>((first + row_offset(ldx, row)) % ELTS_PER_LDG);
  }
  // Vector column of LDG step `it`, and whether it holds any element of the row.
  __device__ __forceinline__ int vec(int it) const { return col + it * VEC_COLS_PER_LDG; }
  __device__ __forceinline__ bool in_row(int it) const {
    if (UNCHECKED_WHOLE_STEPS && it < WHOLE_STEPS) return true;
    if constexpr (ALIGNED_ROWS) return FULL_TILES || vec(it) < VEC_COLS;
    return vec(it) * ELTS_PER_LDG < shift + COLS;
  }
  // Whether every element of LDG step `it` lies in the row.
  __device__ __forceinline__ bool full(int it) const {
    if constexpr (ALIGNED_ROWS) return in_row(it);
    const int first = vec(it) * ELTS_PER_LDG;
    return first >= shift && first + ELTS_PER_LDG <= shift + COLS;
  }
  // Whether LDG step `it` reaches past the row's end (general kernel).
  __device__ __forceinline__ bool crosses_end(int it) const {
    return (vec(it) + 1) * ELTS_PER_LDG > shift + COLS;
  }
  // The row column of element e of LDG step `it`, and whether it is in the row.
  __device__ __forceinline__ int column(int it, int e) const { return vec(it) * ELTS_PER_LDG + e - shift; }
  __device__ __forceinline__ bool valid(int it, int e) const {
    if constexpr (ALIGNED_ROWS) return in_row(it);
    return static_cast<unsigned>(column(it, e)) < static_cast<unsigned>(COLS);
  }
  // The frame of `row`: this thread's vector of LDG step `it` starts
  // from_frame(it) vectors after it. General kernel: the row start moved back
  // by the shift, plus this thread's column, so that from_frame(it) is a
  // compile-time offset once loops are unrolled (one 64-bit address a row,
  // immediate offsets for every access). Aligned kernel: the row start, the
  // column added at each access, which keeps fewer registers live in the
  // register-capped shapes it is tuned to (the general form spills there).
  template <typename T>
  __device__ __forceinline__ T* frame(T* base, long long row, row_stride_t ld) const {
    if constexpr (ALIGNED_ROWS) return base + row_offset(ld, row);
    else return base + (row_offset(ld, row) - shift + col * ELTS_PER_LDG);
  }
  __device__ __forceinline__ int from_frame(int it) const {
    return ALIGNED_ROWS ? vec(it) : it * VEC_COLS_PER_LDG;
  }
  // Whether this thread writes per-row values (mean, rstd): one per row.
  __device__ __forceinline__ bool row_leader() const { return lane == 0 && warp_n == 0 && cta_rank == 0; }
};

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

// Runs f(Flag<EDGES>()) with EDGES = at.edge: warps with no vector across a
// row end run code in which a vector in the row is wholly in it, with the
// element-wise paths compiled out (every warp of the aligned kernel). The
// branch is warp-uniform but not CTA-uniform: f must not hold barriers.
template <typename F>
__device__ __forceinline__ void with_edges(const Coords& at, F&& f) {
  if (!ALIGNED_ROWS && at.edge) f(Flag<true>());
  else f(Flag<false>());
}

// Whether every element of LDG step `it` lies in the row, where the caller
// knows whether its warp has edges: outside edge warps, in the row is whole.
template <bool EDGES>
__device__ __forceinline__ bool whole(int it, const Coords& at) {
  return EDGES && may_be_partial(it) ? at.full(it) : at.in_row(it);
}

// Zeros (FILL: sets to `fill`) the lanes of this thread's vectors that lie outside the row (general
// kernel, edge warps): RowPipe::read reads whole vectors across a row's ends.
// Called once every read of the row has been issued, since it waits for the
// data: an edge warp then waits for memory once, as the other warps do.
// FILL: the backward's REFINE_MEAN fills x's with the row's mean.
template <bool FILL = false, typename V>
__device__ __forceinline__ void mask_row(V (&v)[LDGS], const Coords& at, compute_t fill = 0) {
  if constexpr (!ALIGNED_ROWS) {
    if (!at.edge) return;
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      if (!may_be_partial(it) || at.full(it)) continue;
#pragma unroll
      for (int e = 0; e < V::ELTS; ++e) {
        if (at.valid(it, e)) continue;
        if constexpr (FILL) v[it].set(e, fill);
        else v[it].set_raw_zero(e);
      }
    }
  }
}

// Whether a vector that crosses the end of `row` may be read whole: the
// elements past the end, up to the vector's end (fewer than a vector), then
// belong to the next row or the gap before it, inside the tensor. Not so for
// the last row (or rows closer than a vector), whose end may be the end of
// the allocation. (Bytes before a row's start, down to a vector boundary, are
// always in the same allocation, which is aligned.)
__device__ __forceinline__ bool tail_inside(long long row, row_stride_t ld, long long rows) {
  return row + 1 < rows && rows_a_vector_apart(ld);
}

// Loads this thread's vectors of `row` (zeros past the last row; lanes
// outside the row hold what lies there until mask_row). Whole vectors, also
// across the row's ends; element by element only at the end of the last row.
template <typename T>
__device__ __forceinline__ void load_row(Vec<T, ELTS_PER_LDG> (&v)[LDGS], const T* base, long long row,
                                         row_stride_t ld, long long rows, const Coords& at) {
  const bool row_ok = row < rows;
  const bool tail_ok = tail_inside(row, ld, rows);
  const T* f = at.frame(base, row, ld);
  with_edges(at, [&](auto edges) {
    constexpr bool EDGES = decltype(edges)::value;
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      const bool gather = EDGES && may_be_partial(it) && !tail_ok && at.crosses_end(it);
      if (row_ok && at.in_row(it) && !gather) {
        v[it].load(f, at.from_frame(it));
      } else {
        v[it].zero();
        if (gather && row_ok) {
#pragma unroll
          for (int e = 0; e < ELTS_PER_LDG; ++e)
            if (at.valid(it, e)) v[it].set_raw(e, f[at.from_frame(it) * ELTS_PER_LDG + e]);
        }
      }
    }
  });
}

// Stores this thread's vector of LDG step `it` of a row (frame `f`): whole
// vectors inside the row, single elements at its ends (never a byte outside
// the row). EDGES as in with_edges.
template <bool EDGES, typename T>
__device__ __forceinline__ void store_vec(const Vec<T, ELTS_PER_LDG>& v, T* f, int it, const Coords& at) {
  if (whole<EDGES>(it, at)) {
    v.store(f, at.from_frame(it));
  } else if (EDGES && at.in_row(it)) {
#pragma unroll
    for (int e = 0; e < ELTS_PER_LDG; ++e)
      if (at.valid(it, e)) f[at.from_frame(it) * ELTS_PER_LDG + e] = v.raw_elt(e);
  }
}

// Dynamic shared memory: staged rows (and the backward's column sums).
#define CN_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]

// Vector slots of one staged array in shared memory: [STAGES][ROWS_PER_CTA][LDGS][THREADS_PER_ROW].
constexpr int STAGE_SLOTS = ROWS_PER_CTA * LDGS * THREADS_PER_ROW;
constexpr int PIPE_SLOTS = STAGES > 1 ? STAGES * STAGE_SLOTS : 0;

// The rows of one row tensor a thread will read, STAGES - 1 rows ahead (none
// when not ACTIVE: an absent residual). Each thread copies exactly the vectors
// it later reads itself, so stages need no barrier: a thread waits only for
// its own copies. With STAGES == 1 rows are loaded straight into registers
// when read. A shifted row's ends are copied as whole chunks (the bytes
// before the row lie in the same allocation, which is aligned; those past it
// in the next row: see tail_inside) and masked after reading (mask_row). The
// last row's end is copied exactly: up to the row's end, cp.async filling the
// rest with zeros, and a chunk that the row ends inside element by element (a
// zero-filling cp.async still counts as a whole-chunk access).
template <typename T, bool ACTIVE = true>
struct RowPipe {
  using V = Vec<T, ELTS_PER_LDG>;
  const T* base;
  row_stride_t ld;
  long long rows;
  V* slots;  // this thread's slot of stage 0, LDG step 0

  __device__ __forceinline__ RowPipe(unsigned char* smem, const T* base_, row_stride_t ld_, long long rows_,
                                     const Coords& at)
      : base(base_), ld(ld_), rows(rows_),
        slots(reinterpret_cast<V*>(smem) + at.warp_m * LDGS * THREADS_PER_ROW + at.warp_n * LANES_PER_ROW +
              at.lane) {}

  static constexpr int BYTES = ACTIVE ? PIPE_SLOTS * int(sizeof(V)) : 0;  // its shared memory

  // Starts copying `row` into `stage`.
  __device__ __forceinline__ void fetch(int stage, long long row, const Coords& at) {
    if constexpr (STAGES > 1 && ACTIVE) {
      static_assert(V::CHUNK_BYTES >= 4, "cp.async moves 4-16 bytes: staged vectors need >= 4 bytes");
      constexpr int CHUNK_ELTS = V::CHUNK_BYTES / int(sizeof(T));
      const bool row_ok = row < rows;
      const bool tail_ok = tail_inside(row, ld, rows);
      const T* f = at.frame(base, row, ld);
      with_edges(at, [&](auto edges) {
        constexpr bool EDGES = decltype(edges)::value;
#pragma unroll
        for (int it = 0; it < LDGS; ++it) {
          V* dst = slots + stage * STAGE_SLOTS + it * THREADS_PER_ROW;
#pragma unroll
          for (int c = 0; c < V::CHUNKS; ++c) {
            int n = row_ok && at.in_row(it) ? V::CHUNK_BYTES : 0;  // bytes of this chunk to copy
            if (EDGES && may_be_partial(it) && n && !tail_ok) {  // the last row's ends: exactly the row
              const int chunk_first = at.vec(it) * ELTS_PER_LDG + c * CHUNK_ELTS;
              const int end = at.shift + COLS - chunk_first;  // row elements from the chunk's start on
              n = end <= 0 ? 0 : (end >= CHUNK_ELTS ? CHUNK_ELTS : end) * int(sizeof(T));
              if (n && end < CHUNK_ELTS) {
#pragma unroll
                for (int e = 0; e < CHUNK_ELTS; ++e) {
                  const int at_f = at.from_frame(it) * ELTS_PER_LDG + c * CHUNK_ELTS + e;  // from f
                  dst->elts[c * CHUNK_ELTS + e] = chunk_first + e < at.shift + COLS ? f[at_f] : T{};
                }
                continue;
              }
            }
            const T* src = n ? f + at.from_frame(it) * ELTS_PER_LDG + c * CHUNK_ELTS : base;
            cp_async_zfill<V::CHUNK_BYTES>(&dst->raw[c], src, n);
          }
        }
      });
    }
  }
  // This thread's vectors of `row`, which `stage` holds (once its copies
  // landed); lanes outside the row are masked by mask_row, not here.
  __device__ __forceinline__ void read(int stage, long long row, V (&v)[LDGS], const Coords& at) const {
    if constexpr (STAGES > 1) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) v[it] = slots[stage * STAGE_SLOTS + it * THREADS_PER_ROW];
    } else {
      load_row(v, base, row, ld, rows, at);
    }
  }
};

// Walks this CTA's rows (a persistent grid: row groups group, group + groups,
// ...; without PERSISTENT the grid covers the rows, one group a CTA, up to the
// grid's size limit), keeping STAGES - 1 rows of every pipe in flight, and calls
// body(row, row_ok, stage) once the stage holding `row` has landed. Every
// thread of a CTA runs the same number of iterations (the body may hold
// barriers); rows past the end arrive as zeros and are not to be stored.
template <typename Body, typename... Pipes>
__device__ __forceinline__ void for_each_row(long long rows, const Coords& at, Body&& body, Pipes&... pipes) {
  const long long stride = at.groups * ROWS_PER_CTA;
  const long long first = at.group * ROWS_PER_CTA + at.warp_m;
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    (pipes.fetch(k, first + k * stride, at), ...);
    if constexpr (STAGES > 1) cp_async_commit();
  }
  int stage = 0;
  for (long long row = first; row - at.warp_m < rows; row += stride) {
    if constexpr (STAGES > 1) {
      const int ahead = stage == 0 ? STAGES - 1 : stage - 1;  // the stage read one iteration ago
      (pipes.fetch(ahead, row + (STAGES - 1) * stride, at), ...);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
    }
    body(row, row < rows, stage);
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
  if constexpr (STAGES > 1) cp_async_wait<0>();
}

// gamma (or beta) at this thread's element positions. Columns outside the row
// and absent weights read as zeros: a padding lane must never hold garbage,
// since 0 * NaN is NaN. The aligned kernel loads whole vectors (the host hands
// it contiguous, aligned weights); the general one element by element, with
// the weight's stride (0 broadcasts), once per thread. CACHE_WEIGHTS holds
// them in registers; otherwise the general kernel keeps them in this thread's
// shared-memory slots and the aligned one re-reads them where used (L1/L2
// hits: every row reads the same vector), which frees registers.
template <typename T, bool PRESENT>
struct RowWeights {
  using V = Vec<T, ELTS_PER_LDG>;
  static constexpr bool HELD = CACHE_WEIGHTS && PRESENT;
  static constexpr bool IN_SMEM = !CACHE_WEIGHTS && PRESENT && !ALIGNED_ROWS && !PER_HEAD;
  static constexpr int BYTES = IN_SMEM ? STAGE_SLOTS * int(sizeof(V)) : 0;  // its shared memory
  const T* ptr;
  long long stride;
  long long heads, head_stride;  // PER_HEAD: [heads, N] weights, head_stride elements apart
  V held[HELD ? LDGS : 1];
  V* slots;    // IN_SMEM: [ROWS_PER_CTA][LDGS][THREADS_PER_ROW], this thread's first

  __device__ __forceinline__ RowWeights(const T* p, long long stride_, unsigned char* smem, const Coords& at,
                                        long long heads_, long long head_stride_)
      : ptr(p), stride(stride_), heads(heads_), head_stride(head_stride_),
        slots(reinterpret_cast<V*>(smem) + at.warp_m * LDGS * THREADS_PER_ROW + at.warp_n * LANES_PER_ROW +
              at.lane) {
    if constexpr (HELD) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) held[it] = fetch(it, at);
    }
    if constexpr (IN_SMEM) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) slots[it * THREADS_PER_ROW] = fetch(it, at);
    }
  }
  __device__ __forceinline__ V fetch(int it, const Coords& at, const T* from) const {
    V v;
    v.zero();
    if (PRESENT && at.in_row(it)) {
      if constexpr (ALIGNED_ROWS) {
        v.load(from, at.vec(it));
      } else {
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e)
          if (at.valid(it, e)) v.set_raw(e, from[at.column(it, e) * stride]);
      }
    }
    return v;
  }
  __device__ __forceinline__ V fetch(int it, const Coords& at) const { return fetch(it, at, ptr); }
  // The vector of LDG step `it` for `row` (`it` must be a compile-time constant when held).
  __device__ __forceinline__ V operator()(int it, const Coords& at, long long row) const {
    if constexpr (PER_HEAD) return fetch(it, at, ptr + (row % heads) * head_stride);
    else if constexpr (HELD) return held[it];
    else if constexpr (IN_SMEM) return slots[it * THREADS_PER_ROW];
    else return fetch(it, at);
  }
};

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

// The multiplier of xhat: gamma, or 1 + gamma for a zero-centered weight.
__device__ __forceinline__ compute_t scale_of(compute_t gamma) { return ZERO_CENTERED ? compute_t(1) + gamma : gamma; }

// Python's derivation of the same traits (cunorm/traits.py) must agree.
static_assert(LDGS == ${LDGS}, "cunorm.Traits.ldgs disagrees with the kernel");
static_assert(WHOLE_STEPS == ${WHOLE_STEPS}, "cunorm.Traits.whole_steps disagrees with the kernel");
static_assert(ELTS_PER_THREAD == ${ELTS_PER_THREAD}, "cunorm.Traits.elts_per_thread disagrees with the kernel");
static_assert(THREADS_PER_CTA == ${THREADS_PER_CTA}, "cunorm.Traits.threads_per_cta disagrees with the kernel");
