// Where a thread of the row-normalization kernels sits and how it moves its rows: its coordinates
// (Coords), the general kernel's row edges, whole-vector loads and stores, the staged-row pipeline
// (RowPipe, for_each_row) and the weights at a thread's columns (RowWeights). Over norm_traits.cuh.
#pragma once

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
  // Rows between one row of this thread and its next (a persistent grid's walk: for_each_row).
  __device__ __forceinline__ long long row_stride() const { return groups * ROWS_PER_CTA; }
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
// when read (REGISTER_AHEAD: when the row before is read). A shifted row's
// ends are copied as whole chunks (the bytes before the row lie in the same
// allocation, which is aligned; those past it in the next row: see
// tail_inside) and masked after reading (mask_row). The last row's end is
// copied exactly: up to the row's end, cp.async filling the rest with zeros,
// and a chunk that the row ends inside element by element (a zero-filling
// cp.async still counts as a whole-chunk access).
template <typename T, bool ACTIVE = true>
struct RowPipe {
  using V = Vec<T, ELTS_PER_LDG>;
  static constexpr bool AHEAD = REGISTER_AHEAD && ACTIVE;  // held: the next row, loading (REGISTER_AHEAD)
  const T* base;
  row_stride_t ld;
  long long rows;
  V* slots;  // this thread's slot of stage 0, LDG step 0
  V held[AHEAD ? LDGS : 1];

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
  // REGISTER_AHEAD: starts loading this thread's first row (for_each_row).
  __device__ __forceinline__ void prime(long long row, const Coords& at) {
    if constexpr (AHEAD) load_row(held, base, row, ld, rows, at);
  }
  // This thread's vectors of `row`, which `stage` holds (once its copies
  // landed); lanes outside the row are masked by mask_row, not here.
  // REGISTER_AHEAD: the held row, and the loads of the thread's next one
  // started; so one read a row the thread walks, in order (a pipe may stop
  // being read for good from some row on, as a residual's past the end).
  __device__ __forceinline__ void read(int stage, long long row, V (&v)[LDGS], const Coords& at) {
    if constexpr (AHEAD) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) v[it] = held[it];
      load_row(held, base, row + at.row_stride(), ld, rows, at);
    } else if constexpr (STAGES > 1) {
#pragma unroll
      for (int it = 0; it < LDGS; ++it) v[it] = slots[stage * STAGE_SLOTS + it * THREADS_PER_ROW];
    } else {
      load_row(v, base, row, ld, rows, at);
    }
  }
};

// A statistic of the rows a thread walks (the backward's mean or rstd), one value a row; 0 for rows past the
// end (and when not ACTIVE: RMSNorm's mean). A pipe of for_each_row like RowPipe, with its one-read-a-row
// rule: STATS_AHEAD holds the next row's value, loading while the current row is reduced and stored, so the
// row's first use of it does not wait on the load.
template <typename T, bool ACTIVE = true>
struct RowStat {
  static constexpr bool AHEAD = STATS_AHEAD && ACTIVE;
  const T* values;
  long long rows;
  T held;

  __device__ __forceinline__ RowStat(const T* values_, long long rows_) : values(values_), rows(rows_), held(0) {}
  __device__ __forceinline__ T load(long long row) const { return ACTIVE && row < rows ? values[row] : T(0); }
  __device__ __forceinline__ void fetch(int, long long, const Coords&) {}  // (nothing staged)
  __device__ __forceinline__ void prime(long long row, const Coords&) {
    if constexpr (AHEAD) held = load(row);
  }
  __device__ __forceinline__ T read(long long row, const Coords& at) {
    if constexpr (AHEAD) {
      const T v = held;
      held = load(row + at.row_stride());
      return v;
    } else {
      return load(row);
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
  const long long stride = at.row_stride();
  const long long first = at.group * ROWS_PER_CTA + at.warp_m;
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    (pipes.fetch(k, first + k * stride, at), ...);
    if constexpr (STAGES > 1) cp_async_commit();
  }
  if constexpr (STAGES == 1) (pipes.prime(first, at), ...);
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
