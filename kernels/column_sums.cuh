// The backward's column sums (dgamma, dbeta; dgamma1, dbeta1): a thread's sums of a quantity in registers and
// shared-memory slots (ColumnSums), their fold into the CTA's partial row (fold_slots), and GRID_FINALIZE's sum
// of the partial rows across the grid (finalize_across_grid). Inlined by norm_bwd.cu after the constants these
// use (SLOT_OFFSET, SLOT_STEPS, ROWS_PER_CTA's slots, the row's column layout).
#pragma once

// This thread's column sums for one quantity: those of the first REG_STEPS load steps in registers (LDGS:
// all), the others' in shared memory.
template <int REG_STEPS>
struct ColumnSums {
  AccVec reg[REG_STEPS > 0 ? REG_STEPS : 1];
  AccVec* slots;  // this thread's slot of load step SLOT_OFFSET in shared memory (stride THREADS_PER_ROW)

  __device__ __forceinline__ ColumnSums(AccVec* smem, const Coords& at)
      : slots(smem + (at.warp_m * SLOT_STEPS) * THREADS_PER_ROW + at.warp_n * LANES_PER_ROW + at.lane) {
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      AccVec z;
      z.zero();
      put(it, z);
    }
  }
  // (`it` is a constant in the unrolled loops that call these: the branch folds away.)
  __device__ __forceinline__ AccVec get(int it) const {
    if (it < REG_STEPS) return reg[it];
    return slots[(it - SLOT_OFFSET) * THREADS_PER_ROW];
  }
  __device__ __forceinline__ void put(int it, const AccVec& v) {
    if (it < REG_STEPS) reg[it] = v;
    else slots[(it - SLOT_OFFSET) * THREADS_PER_ROW] = v;
  }
  // Registers to their shared-memory slots (before a fold of ROWS_PER_CTA rows: every step has a slot).
  __device__ __forceinline__ void spill_to_slots() {
    static_assert(REG_STEPS < 0 || SLOT_OFFSET == 0, "a fold of several rows needs every step's slots");
#pragma unroll
    for (int it = 0; it < REG_STEPS; ++it) slots[it * THREADS_PER_ROW] = reg[it];
  }
  // This thread's sums of the first `steps` load steps straight to the partial row (ROWS_PER_CTA == 1).
  __device__ __forceinline__ void store(compute_t* part, const Coords& at, int steps = LDGS) const {
#pragma unroll
    for (int it = 0; it < LDGS; ++it) {
      if (it >= steps) break;
      if (!at.in_row(it)) continue;
      if (ALIGNED_ROWS) {
        get(it).store(part, at.vec(it));
      } else {
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e)
          if (at.valid(it, e)) part[at.column(it, e)] = get(it).get(e);
      }
    }
  }
};

// Writes a quantity's slots to the partial row, summing the ROWS_PER_CTA rows
// of a CTA in row order. A loop over slots, not unrolled over load steps: the
// slots are in shared memory, and hoisted loads would spill. Aligned rows
// share one frame: whole vectors. Shifted rows put column j of CTA row m at
// element j + shift_m of the frame: element by element; with one row a CTA
// (a cluster's CTAs) only this CTA's slots (from load step SLOT_OFFSET on),
// otherwise every column.
__device__ __forceinline__ void fold_slots(const AccVec* slots, compute_t* part, const Coords& at, const void* x,
                                           row_stride_t ldx) {
  if constexpr (ALIGNED_ROWS || ROWS_PER_CTA == 1) {
    for (int s = threadIdx.x; s < SLOT_STEPS * THREADS_PER_ROW; s += THREADS_PER_CTA) {
      const int step = s / THREADS_PER_ROW + SLOT_OFFSET;
      const int vec = at.cta_rank * THREADS_PER_ROW + s % THREADS_PER_ROW + step * VEC_COLS_PER_LDG;
      if (vec * ELTS_PER_LDG >= at.shift + COLS) continue;
      AccVec sum = slots[s];
#pragma unroll
      for (int m = 1; m < ROWS_PER_CTA; ++m) {
        const AccVec v = slots[m * SLOT_STEPS * THREADS_PER_ROW + s];
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) sum.add(e, v.get(e));
      }
      if constexpr (ALIGNED_ROWS) {
        sum.store(part, vec);
      } else {
#pragma unroll
        for (int e = 0; e < ELTS_PER_LDG; ++e) {
          const int j = vec * ELTS_PER_LDG + e - at.shift;
          if (static_cast<unsigned>(j) < static_cast<unsigned>(COLS)) part[j] = sum.get(e);
        }
      }
    }
  } else {  // one CTA a row
    const compute_t* elts = reinterpret_cast<const compute_t*>(slots);
    for (int j = threadIdx.x; j < COLS; j += THREADS_PER_CTA) {
      compute_t sum = 0;
#pragma unroll
      for (int m = 0; m < ROWS_PER_CTA; ++m) {
        const int u = j + Coords::shift_of(x, ldx, at.group * ROWS_PER_CTA + m);
        const int vec = u / ELTS_PER_LDG;
        const int slot = (m * SLOT_STEPS + vec / VEC_COLS_PER_LDG) * THREADS_PER_ROW + vec % VEC_COLS_PER_LDG;
        sum += elts[slot * ELTS_PER_LDG + u % ELTS_PER_LDG];
      }
      part[j] = sum;
    }
  }
}

// GRID_FINALIZE (one launch): the host launches the grid cooperatively, so every CTA is resident and a
// grid-wide barrier cannot hang. Each CTA writes its partial row and raises the ticket; once all have, the
// whole grid sums the partial rows: a unit of LAST_VEC neighbouring columns per FIN_LANES lanes of a warp,
// the lanes taking interleaved partial rows, then a butterfly over them (a fixed order, whichever CTA runs
// it: bitwise reproducible), reading through L2 (ld.cg: the other CTAs' writes are there, not in this
// SM's L1). On its way out each CTA raises the ticket again; the last puts it back to 0 for the next
// launch on its stream. PER_HEAD: partial row p belongs to head p % heads, as in norm_bwd_finalize.
constexpr int LAST_VEC = COLS % (16 / int(sizeof(compute_t))) == 0 ? 16 / int(sizeof(compute_t)) : 1;
constexpr int FIN_LANES = 8;  // lanes a unit: 32 / FIN_LANES units a warp, neighbours (whole sectors a row)
__device__ __forceinline__ void finalize_across_grid(unsigned* ticket, int parts, long long heads,
                                                     const compute_t* gpart, const compute_t* bpart,
                                                     weight_t* dgamma, bias_t* dbeta, const compute_t* g1part,
                                                     const compute_t* b1part, weight1_t* dgamma1, bias1_t* dbeta1) {
  using SumVec = Vec<compute_t, LAST_VEC>;
  __syncthreads();  // the CTA's partial sums written, then published at GPU scope by the fence before the ticket
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ticket, 1u);
    while (load_acquire(ticket) < gridDim.x) __nanosleep(32);
  }
  __syncthreads();
  constexpr int ROW_VECS = COLS / LAST_VEC;
  constexpr int UNITS_PER_WARP = THREADS_PER_WARP / FIN_LANES;
  const long long units = heads * ROW_VECS;  // in vectors of LAST_VEC columns
  const int lane = threadIdx.x % THREADS_PER_WARP, sub = lane % FIN_LANES;
  const long long warps = static_cast<long long>(gridDim.x) * (THREADS_PER_CTA / THREADS_PER_WARP);
  // Whole warps step together (the butterfly takes every lane of the warp); lanes past the end add zeros.
  for (long long w = blockIdx.x * (THREADS_PER_CTA / THREADS_PER_WARP) + threadIdx.x / THREADS_PER_WARP;
       w * UNITS_PER_WARP < units; w += warps) {
    const long long j = w * UNITS_PER_WARP + lane / FIN_LANES;
    const bool ok = j < units;
    const long long head = PER_HEAD && ok ? j / ROW_VECS : 0;
    const long long v = ok ? (PER_HEAD ? j % ROW_VECS : j) : 0;
    SumVec g, b, g1, b1;
    g.zero();
    b.zero();
    g1.zero();
    b1.zero();
    if (ok) {
#pragma unroll 4
      for (long long p = head + sub * heads; p < parts; p += FIN_LANES * heads) {
        SumVec pg, pb, pg1, pb1;
        if (HAS_WEIGHT) pg.load_cg(gpart + p * COLS, v);
        if (HAS_BIAS) pb.load_cg(bpart + p * COLS, v);
        if (PARALLEL) pg1.load_cg(g1part + p * COLS, v);
        if (HAS_BIAS1) pb1.load_cg(b1part + p * COLS, v);
#pragma unroll
        for (int e = 0; e < LAST_VEC; ++e) {
          if (HAS_WEIGHT) g.add(e, pg.get(e));
          if (HAS_BIAS) b.add(e, pb.get(e));
          if (PARALLEL) g1.add(e, pg1.get(e));
          if (HAS_BIAS1) b1.add(e, pb1.get(e));
        }
      }
    }
#pragma unroll
    for (int e = 0; e < LAST_VEC; ++e) {
      if (HAS_WEIGHT) g.set(e, warp_sum<FIN_LANES>(g.get(e)));
      if (HAS_BIAS) b.set(e, warp_sum<FIN_LANES>(b.get(e)));
      if (PARALLEL) g1.set(e, warp_sum<FIN_LANES>(g1.get(e)));
      if (HAS_BIAS1) b1.set(e, warp_sum<FIN_LANES>(b1.get(e)));
    }
    if (ok && sub == 0) {
#pragma unroll
      for (int e = 0; e < LAST_VEC; ++e) {
        if (HAS_WEIGHT) dgamma[j * LAST_VEC + e] = from_float<weight_t>(g.get(e));
        if (HAS_BIAS) dbeta[j * LAST_VEC + e] = from_float<bias_t>(b.get(e));
        if (PARALLEL) dgamma1[j * LAST_VEC + e] = from_float<weight1_t>(g1.get(e));
        if (HAS_BIAS1) dbeta1[j * LAST_VEC + e] = from_float<bias1_t>(b1.get(e));
      }
    }
  }
  if (threadIdx.x == 0 && atomicAdd(ticket, 1u) == 2 * gridDim.x - 1) *ticket = 0u;  // every CTA is past the wait
}
