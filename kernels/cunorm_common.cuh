// cunorm common device code: storage types, converters, vectors, reductions.
//
// Inlined by the renderer (cunorm/render.py) in place of its #include line, so
// the rendered text is the whole program. It needs no CUDA header: half and
// bfloat16 conversions are single PTX instructions, which keeps compilation
// free of a CUDA toolkit (only NVRTC is needed).
#pragma once

// 16-bit floats as raw bits; arithmetic is done in fp32 (fp64 for fp64 inputs:
// the kernels' compute_t).
struct cn_half { unsigned short bits; };
struct cn_bf16 { unsigned short bits; };
// 8-bit floats (outputs only): OCP FP8 E4M3 (no inf, max 448) and E5M2 (max 57344).
struct cn_fp8e4m3 { unsigned char bits; };
struct cn_fp8e5m2 { unsigned char bits; };
template <typename T> struct Fp8Format;
template <> struct Fp8Format<cn_fp8e4m3> {
  static constexpr int MAN = 3, BIAS = 7;
  static constexpr float MAX = 448.f, MIN_NORMAL = 0.015625f, SUB_SCALE = 512.f;  // 2^-6, 2^(BIAS-1+MAN)
};
template <> struct Fp8Format<cn_fp8e5m2> {
  static constexpr int MAN = 2, BIAS = 15;
  static constexpr float MAX = 57344.f, MIN_NORMAL = 6.103515625e-05f, SUB_SCALE = 65536.f;  // 2^-14, 2^16
};

// f rounded to nearest even in the 8-bit format, saturated to its finite range (NaN stays NaN): what
// cvt.rn.satfinite does on sm_89+, written out for older GPUs.
template <typename T>
__device__ __forceinline__ unsigned fp8_bits_soft(float f) {
  using F = Fp8Format<T>;
  const unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
  float a = fabsf(f);
  if (a != a) return sign | 0x7fu;
  a = fminf(a, F::MAX);
  if (a < F::MIN_NORMAL) return sign | static_cast<unsigned>(__float2int_rn(a * F::SUB_SCALE));  // subnormal
  const unsigned b = __float_as_uint(a);
  constexpr int DROP = 23 - F::MAN;
  unsigned e = (b >> 23) - 127 + F::BIAS, keep = (b & 0x7fffffu) >> DROP;
  const unsigned rest = b & ((1u << DROP) - 1), half = 1u << (DROP - 1);
  keep += rest > half || (rest == half && (keep & 1u));
  if (keep >> F::MAN) {
    keep = 0;
    ++e;
  }
  return sign | (e << F::MAN) | keep;
}
// Two values at once: lo in the low byte, hi in the high byte.
template <typename T>
__device__ __forceinline__ unsigned fp8x2_bits(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short r;
  if constexpr (Fp8Format<T>::MAN == 3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return fp8_bits_soft<T>(lo) | (fp8_bits_soft<T>(hi) << 8);
#endif
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(cn_half v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float to_float(cn_bf16 v) {
  return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}
__device__ __forceinline__ double to_float(double v) { return v; }  // fp64 stays fp64

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ cn_half from_float<cn_half>(float f) {
  cn_half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ cn_bf16 from_float<cn_bf16>(float f) {
  cn_bf16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ double from_float<double>(float f) { return f; }
// From fp64 results: fp64 and fp32 round once; 16-bit types through fp32 (cvt has no f64 -> bf16 form).
template <typename T> __device__ __forceinline__ T from_float(double d) { return from_float<T>(float(d)); }
template <> __device__ __forceinline__ double from_float<double>(double d) { return d; }

// Arithmetic of either compute type, so that a kernel written once serves
// fp32 (fast intrinsics, as before) and fp64 inputs.
__device__ __forceinline__ float cn_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double cn_fma(double a, double b, double c) { return fma(a, b, c); }
// fma that keeps subnormal results and operands whatever -ftz says (cupy.RawModule compiles with -ftz=true).
__device__ __forceinline__ float cn_fma_keep_subnormal(float a, float b, float c) { return __fmaf_ieee_rn(a, b, c); }
__device__ __forceinline__ double cn_fma_keep_subnormal(double a, double b, double c) { return fma(a, b, c); }
// Correctly rounded on their own: never fused by ptxas into a neighbouring add (an FMA keeps the exact product).
// The double forms let fp64 kernels compile the (discarded) REFINE_MEAN code.
__device__ __forceinline__ float cn_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double cn_mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float cn_div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double cn_div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float cn_rsqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double cn_rsqrt(double v) { return 1.0 / sqrt(v); }  // correctly rounded steps
__device__ __forceinline__ bool cn_isfinite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool cn_isfinite(double v) {
  return (__double_as_longlong(v) & 0x7ff0000000000000ll) != 0x7ff0000000000000ll;
}
template <typename T> __device__ __forceinline__ T cn_nan();
template <> __device__ __forceinline__ float cn_nan<float>() { return __uint_as_float(0x7fc00000u); }
template <> __device__ __forceinline__ double cn_nan<double>() { return __longlong_as_double(0x7ff8000000000000ll); }

// The widest single access a vector of BYTES bytes can be moved with.
template <int BYTES> struct RawChunk;
template <> struct RawChunk<1> { using type = unsigned char; };
template <> struct RawChunk<2> { using type = unsigned short; };
template <> struct RawChunk<4> { using type = unsigned int; };
template <> struct RawChunk<8> { using type = uint2; };
template <> struct RawChunk<16> { using type = uint4; };

// Element i of a packed array of 32-bit words, as fp32, and back. 16-bit
// elements stay two to a register: an array of 16-bit values would take a
// whole register per element.
// value_t: what an element reads as (fp32; fp64 for fp64 elements).
template <typename T> struct Packed;
template <> struct Packed<double> {
  using value_t = double;
  static __device__ __forceinline__ double get(const unsigned* w, int i) {
    return __hiloint2double(static_cast<int>(w[2 * i + 1]), static_cast<int>(w[2 * i]));
  }
  static __device__ __forceinline__ void set(unsigned* w, int i, double v) {
    w[2 * i] = static_cast<unsigned>(__double2loint(v));
    w[2 * i + 1] = static_cast<unsigned>(__double2hiint(v));
  }
  static __device__ __forceinline__ void set2(unsigned* w, int i, double lo, double hi) {
    set(w, i, lo);
    set(w, i + 1, hi);
  }
};
template <> struct Packed<float> {
  using value_t = float;
  static __device__ __forceinline__ float get(const unsigned* w, int i) { return __uint_as_float(w[i]); }
  static __device__ __forceinline__ void set(unsigned* w, int i, float v) { w[i] = __float_as_uint(v); }
  static __device__ __forceinline__ void set2(unsigned* w, int i, float lo, float hi) {
    w[i] = __float_as_uint(lo);
    w[i + 1] = __float_as_uint(hi);
  }
};
template <> struct Packed<cn_bf16> {
  using value_t = float;
  static __device__ __forceinline__ float get(const unsigned* w, int i) {
    return __uint_as_float(i % 2 ? w[i / 2] & 0xffff0000u : w[i / 2] << 16);
  }
  static __device__ __forceinline__ void set(unsigned* w, int i, float v) {
    const unsigned bits = from_float<cn_bf16>(v).bits;
    w[i / 2] = i % 2 ? (w[i / 2] & 0xffffu) | (bits << 16) : (w[i / 2] & 0xffff0000u) | bits;
  }
  // Elements i (even) and i + 1 in one instruction.
  static __device__ __forceinline__ void set2(unsigned* w, int i, float lo, float hi) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i / 2]) : "f"(hi), "f"(lo));
  }
};
template <> struct Packed<cn_half> {
  using value_t = float;
  static __device__ __forceinline__ float get(const unsigned* w, int i) {
    return to_float(cn_half{static_cast<unsigned short>(i % 2 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu)});
  }
  static __device__ __forceinline__ void set(unsigned* w, int i, float v) {
    const unsigned bits = from_float<cn_half>(v).bits;
    w[i / 2] = i % 2 ? (w[i / 2] & 0xffffu) | (bits << 16) : (w[i / 2] & 0xffff0000u) | bits;
  }
  static __device__ __forceinline__ void set2(unsigned* w, int i, float lo, float hi) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i / 2]) : "f"(hi), "f"(lo));
  }
};

// 8-bit floats, four to a word; written only (outputs).
template <typename T>
struct PackedFp8 {
  using value_t = float;
  static __device__ __forceinline__ void set(unsigned* w, int i, float v) {
    const int shift = 8 * (i % 4);
    w[i / 4] = (w[i / 4] & ~(0xffu << shift)) | ((fp8x2_bits<T>(v, 0.f) & 0xffu) << shift);
  }
  // Elements i (even) and i + 1 in one instruction (sm_89+).
  static __device__ __forceinline__ void set2(unsigned* w, int i, float lo, float hi) {
    const int shift = 8 * (i % 4);
    w[i / 4] = (w[i / 4] & ~(0xffffu << shift)) | (fp8x2_bits<T>(lo, hi) << shift);
  }
};
template <> struct Packed<cn_fp8e4m3> : PackedFp8<cn_fp8e4m3> {};
template <> struct Packed<cn_fp8e5m2> : PackedFp8<cn_fp8e5m2> {};

// N consecutive elements moved as 16-byte (or narrower) accesses. A vector
// wider than 16 bytes (e.g. 8 fp32 weights beside 8 bf16 inputs) becomes
// several 16-byte accesses.
template <typename T, int N>
struct Vec {
  static constexpr int BYTES = int(sizeof(T)) * N;
  static constexpr int CHUNK_BYTES = BYTES < 16 ? BYTES : 16;
  static constexpr int CHUNKS = BYTES / CHUNK_BYTES;
  static constexpr int WORDS = BYTES < 4 ? 1 : BYTES / 4;
  static constexpr int ELTS = N;
  using chunk_t = typename RawChunk<CHUNK_BYTES>::type;
  union {
    chunk_t raw[CHUNKS];
    unsigned words[WORDS];  // a lone 16-bit element sits in the low half
    T elts[N];              // element-wise access at a row's ends
  };

  // Loads vector number `vec` of a row that starts at `row`.
  __device__ __forceinline__ void load(const T* row, long long vec) {
    const chunk_t* src = reinterpret_cast<const chunk_t*>(row + vec * N);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) raw[c] = src[c];
  }
  // As load, through L2 only (ld.cg): for data other CTAs of the grid wrote during this launch.
  __device__ __forceinline__ void load_cg(const T* row, long long vec) {
    const chunk_t* src = reinterpret_cast<const chunk_t*>(row + vec * N);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) raw[c] = __ldcg(src + c);
  }
  __device__ __forceinline__ void store(T* row, long long vec) const {
    chunk_t* dst = reinterpret_cast<chunk_t*>(row + vec * N);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) dst[c] = raw[c];
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) words[i] = 0u;
  }
  // Hides the register contents from the optimizer, so values derived from
  // them before this point are recomputed after it instead of being kept
  // live (fp32 copies of packed 16-bit data cost registers).
  __device__ __forceinline__ void opaque() {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) asm volatile("" : "+r"(words[i]));
  }
  __device__ __forceinline__ T raw_elt(int i) const { return elts[i]; }
  __device__ __forceinline__ void set_raw(int i, T v) { elts[i] = v; }
  __device__ __forceinline__ void set_raw_zero(int i) { elts[i] = T{}; }
  using value_t = typename Packed<T>::value_t;
  __device__ __forceinline__ value_t get(int i) const { return Packed<T>::get(words, i); }
  __device__ __forceinline__ void set(int i, value_t v) { Packed<T>::set(words, i, v); }
  __device__ __forceinline__ void add(int i, value_t v) { set(i, get(i) + v); }
  // All elements at once (fp32 or fp64 values): 16-bit types convert two per instruction.
  template <typename F>
  __device__ __forceinline__ void set_all(const F (&v)[N]) {
    if constexpr (N % 2 == 0) {
#pragma unroll
      for (int i = 0; i < N; i += 2) Packed<T>::set2(words, i, v[i], v[i + 1]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) set(i, v[i]);
    }
  }
};

// The 32-bit shared-state-space address of `local` (a __shared__ address), as PTX's shared:: operands take it.
__device__ __forceinline__ unsigned shared_address(const void* local) {
  return static_cast<unsigned>(__cvta_generic_to_shared(local));
}

// Asynchronous global -> shared copies (sm_80+): the data skips registers, so
// rows in flight cost shared memory instead. Copies the first `src_bytes`
// (0..BYTES) bytes and fills the rest with zeros; with 0 it reads nothing
// (src must still be a mapped address).
template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(void* smem, const void* gmem, int src_bytes) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async moves 4, 8 or 16 bytes");
  const unsigned dst = shared_address(smem);
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(gmem), "n"(BYTES), "r"(src_bytes)
                 : "memory");
}
// A word another CTA releases (atomics, then this load): read at GPU scope with acquire order.
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Reductions over each aligned group of LANES lanes of a warp (32: the whole warp); every lane of the warp
// takes part. max is exact: every lane gets the same bits.
template <int LANES = 32>
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// max over this thread's aligned group of LANES lanes, where only that group need take part: the rest of the
// warp may hold another row, one past the end that skips the work (several rows a warp).
template <int LANES>
__device__ __forceinline__ float lane_group_max(float v) {
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of 2 up to 32");
  const unsigned group =
      LANES == 32 ? 0xffffffffu : ((1u << (LANES % 32)) - 1u) << (threadIdx.x % 32u / LANES * LANES);
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(group, v, offset));
  return v;
}

// The sum over LANES lanes STRIDE apart (lane ^ STRIDE, ^ 2 * STRIDE, ...): by default a warp's
// neighbouring lanes. Every lane takes part.
template <int LANES = 32, int STRIDE = 1, typename F>
__device__ __forceinline__ F warp_sum(F v) {
  static_assert(LANES * STRIDE <= 32 && (LANES & (LANES - 1)) == 0 && (STRIDE & (STRIDE - 1)) == 0,
                "a power-of-two butterfly within one warp");
  // A butterfly leaves the same bits in every lane: each step adds the same
  // two numbers on both partners, and floating-point addition is commutative.
#pragma unroll
  for (int offset = LANES / 2 * STRIDE; offset >= STRIDE; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Thread-block clusters (sm_90+): barrier and distributed shared memory reads,
// in PTX so that no cooperative_groups header is needed.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The shared-memory address, in the CTA of cluster rank `rank`, of `local` (a __shared__ address here).
__device__ __forceinline__ unsigned cluster_address(const void* local, unsigned rank) {
  unsigned remote = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
#endif
  return remote;
}
// Pushed exchanges (PUSHED_EXCHANGE): a CTA writes its partials into each peer's shared memory with st.async,
// whose bytes count down the receiver's mbarrier; the receiver waits on its own mbarrier, not on a cluster
// barrier (whose release first waits for the CTA's outstanding global stores).
// Makes bars[0..N) mbarriers whose phases complete on one arrival (and the bytes that arrival announces),
// visible to the cluster's st.async once a cluster barrier has followed.
template <int N>
__device__ __forceinline__ void init_mbarriers(unsigned long long* bars) {
#if __CUDA_ARCH__ >= 900
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bars + i)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// The one arrival of `bar`'s current phase, which then completes once `bytes` more have landed.
__device__ __forceinline__ void mbarrier_arrive_expecting(unsigned long long* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes) : "memory");
#endif
}
// Writes v at `remote` (a shared::cluster address) and counts its bytes on the mbarrier at `remote_bar`, in
// the same CTA as `remote`.
__device__ __forceinline__ void store_async(unsigned remote, float v, unsigned remote_bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
               "r"(__float_as_uint(v)), "r"(remote_bar) : "memory");
#endif
}
__device__ __forceinline__ void store_async(unsigned remote, double v, unsigned remote_bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" ::"r"(remote),
               "l"(__double_as_longlong(v)), "r"(remote_bar) : "memory");
#endif
}
// Waits for the phase of `bar` with parity `phase` to complete; what landed for it is then visible here.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned phase) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred landed;\n"
      "CN_WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 landed, [%0], %1;\n\t"
      "@!landed bra CN_WAIT_%=;\n}" ::"r"(shared_address(bar)), "r"(phase) : "memory");
#endif
}
// Reads the value at `local` in the CTA of cluster rank `rank`.
__device__ __forceinline__ float load_cluster_shared(const float* local, unsigned rank) {
  float v = 0.f;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_address(local, rank)) : "memory");
#endif
  return v;
}
__device__ __forceinline__ double load_cluster_shared(const double* local, unsigned rank) {
  double v = 0.0;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(cluster_address(local, rank)) : "memory");
#endif
  return v;
}
// Reads the two values at `local` (aligned to twice their size) in the CTA of cluster rank `rank`: one load,
// not two (the float and double overloads differ only in their asm operand types).
__device__ __forceinline__ void load_cluster_shared_pair(const float* local, unsigned rank, float& a, float& b) {
  a = b = 0.f;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(cluster_address(local, rank))
               : "memory");
#endif
}
__device__ __forceinline__ void load_cluster_shared_pair(const double* local, unsigned rank, double& a, double& b) {
  a = b = 0.0;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v2.f64 {%0, %1}, [%2];" : "=d"(a), "=d"(b) : "r"(cluster_address(local, rank))
               : "memory");
#endif
}

// Dropout masks (cunorm.reference.dropout_keep): element i of a tensor (flat
// index in C order over its logical shape) takes word i % 4 of Philox4x32-10
// with counter (i / 4 as two 32-bit halves, STREAM, 0) and key (the seed's two
// halves), and is kept when that word is >= the threshold floor(p * 2^32).
// STREAM 0 draws x's mask, 1 the parallel branch x1's.
template <unsigned STREAM = 0>
__device__ __forceinline__ uint4 cn_philox(unsigned long long block, unsigned long long seed) {
  unsigned c0 = static_cast<unsigned>(block), c1 = static_cast<unsigned>(block >> 32), c2 = STREAM, c3 = 0u;
  unsigned k0 = static_cast<unsigned>(seed), k1 = static_cast<unsigned>(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return make_uint4(c0, c1, c2, c3);
}

// Bit e set when element first + e (e < N, consecutive flat indices) is kept: one Philox block per four
// elements, drawn again only where the block changes.
template <int N, unsigned STREAM = 0>
__device__ __forceinline__ unsigned cn_keep_bits(long long first, unsigned long long seed, unsigned threshold) {
  unsigned bits = 0u;
  uint4 w = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const unsigned long long i = static_cast<unsigned long long>(first + e);
    if (e == 0 || (i & 3ull) == 0ull) w = cn_philox<STREAM>(i >> 2, seed);
    const unsigned k = static_cast<unsigned>(i & 3ull);
    const unsigned word = k == 0u ? w.x : k == 1u ? w.y : k == 2u ? w.z : w.w;
    bits |= (word >= threshold ? 1u : 0u) << e;
  }
  return bits;
}
