// CPU SIMD math shared by the CPU kernels of every family: one vectorized exp for the whole project.
// Written with GCC/Clang vector extensions; the kernels' outer loops come as explicit copies (RC_CPU_AVX512,
// RC_CPU_AVX2 and the baseline, picked by cpu_isa()), and these always-inline helpers are compiled into each copy for
// its ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "rc_macros.h"
#include "switches.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// An explicit AVX-512 copy of a function (called only after rc_cpu_has_avx512() says the CPU runs it).
#define RC_CPU_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#include <immintrin.h>
#define RC_CPU_HAS_AVX512_PATH 1
// An AVX-512 helper for the width-generic loop bodies: plain inline, not always_inline, because GCC refuses to
// force a target-specific body into the generic template that calls it; once that template is inlined into its
// RC_CPU_AVX512 kernel, the helper is inlined there (the disassembly of the kernels shows no calls).
#define RC_CPU_AVX512_INLINE RC_CPU_AVX512 inline
// An explicit AVX2 + FMA copy (called only after cpu_isa() says the CPU runs it). Unlike a target_clones body, it
// may call AVX2 / FMA intrinsics: the FMA is then one rounding by construction, not by the compiler's contraction.
#define RC_CPU_AVX2 __attribute__((target("avx2,fma")))
#define RC_CPU_AVX2_INLINE RC_CPU_AVX2 inline
#define RC_CPU_HAS_AVX2_PATH 1
#else
#define RC_CPU_AVX512
#define RC_CPU_HAS_AVX512_PATH 0
#define RC_CPU_AVX2
#define RC_CPU_HAS_AVX2_PATH 0
#endif

namespace rollout_corr {
namespace cpu {

// The explicit copies a kernel may have, narrowest first.
enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The copy to run, decided once per process: the widest this CPU runs, narrowed by ROLLOUT_CORR_CPU_ISA
// ("avx512", "avx2" or "baseline"; a wider request than the CPU runs gets what it runs) so that one build can compare
// its paths. Every CPU kernel with explicit copies (log-probs, rollout correction) dispatches on it.
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
    CpuIsa widest = CpuIsa::kBaseline;
#if RC_CPU_HAS_AVX512_PATH
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) widest = CpuIsa::kAvx2;
    if (widest == CpuIsa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
      widest = CpuIsa::kAvx512;
    }
#endif
    const char* env = switch_value(kCpuIsaSwitch);
    CpuIsa asked = CpuIsa::kAvx512;
    if (env != nullptr) {
      if (std::strcmp(env, "baseline") == 0) {
        asked = CpuIsa::kBaseline;
      } else if (std::strcmp(env, "avx2") == 0) {
        asked = CpuIsa::kAvx2;
      } else if (std::strcmp(env, "avx512") != 0) {
        std::fprintf(stderr, "rollout_corr_ext: ROLLOUT_CORR_CPU_ISA=%s is not one of avx512, avx2, baseline; "
                     "ignored\n", env);
      }
    }
    return asked < widest ? asked : widest;
  }();
  return isa;
}

// Whether to run the RC_CPU_AVX512 copies.
inline bool has_avx512() { return cpu_isa() == CpuIsa::kAvx512; }

// Explicit SIMD through GCC/Clang vector extensions: 8 x fp32 lanes. Under target_clones the same code is
// compiled once for x86-64-v3 (AVX2 + FMA) and once for the x86-64 baseline (two SSE registers per vector).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kVec = 8;
constexpr int kUnroll = 4;  // independent vectors in flight: the exp polynomial is latency-bound otherwise

RC_FORCEINLINE v8f load_v8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
RC_FORCEINLINE void store_v8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
RC_FORCEINLINE float hsum(v8f v) {
  float s = 0.f;
  for (int l = 0; l < kVec; ++l) s += v[l];
  return s;
}
RC_FORCEINLINE float hmax(v8f v) {
  float m = v[0];
  for (int l = 1; l < kVec; ++l) m = v[l] > m ? v[l] : m;
  return m;
}
// The fp64 sum of the 8 lanes: both halves widened (two vcvtps2pd), added as 4 x fp64, then a 4-lane tree, in place
// of 8 dependent scalar conversions and adds. fp64 holds the sum of two fp32 values exactly unless their exponents
// are more than 29 apart, so this order and a sequential one agree in practice.
typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
RC_FORCEINLINE double hsum_f64(v8f v) {
  const v4f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3);
  const v4f hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const v4d s = __builtin_convertvector(lo, v4d) + __builtin_convertvector(hi, v4d);
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// 16 x fp32 lanes: one AVX-512 register (the rollout kernels' widest path, built with RC_CPU_AVX512).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// The lanes of each explicit copy: one register of its ISA. The baseline takes 4 (one SSE or NEON register): GCC
// lowers an 8-lane vector there to two halves moved through memory, and its max pass ran 16x slower that way.
template <CpuIsa I>
using isa_vec = typename std::conditional<
    I == CpuIsa::kAvx512, v16f, typename std::conditional<I == CpuIsa::kAvx2, v8f, v4f>::type>::type;

// Width-generic helpers: the log-prob kernels are written once over VF (isa_vec: v16f in the AVX-512 copy, v8f in
// the AVX2 copy, v4f in the baseline; the rollout kernels use v8f), so the same loop bodies run at every ISA.
template <typename VF>
struct VecOf;
template <>
struct VecOf<v8f> {
  typedef v8i i32;
  typedef uint32_t u32 __attribute__((vector_size(32)));
  typedef uint16_t u16 __attribute__((vector_size(16)));
};
template <>
struct VecOf<v4f> {
  typedef int32_t i32 __attribute__((vector_size(16)));
  typedef uint32_t u32 __attribute__((vector_size(16)));
  typedef uint16_t u16 __attribute__((vector_size(8)));
};
template <>
struct VecOf<v16f> {
  typedef v16i i32;
  typedef uint32_t u32 __attribute__((vector_size(64)));
  typedef uint16_t u16 __attribute__((vector_size(32)));
};
template <typename VF>
constexpr int lanes_of() {
  return static_cast<int>(sizeof(VF) / sizeof(float));
}
template <typename VF>
RC_FORCEINLINE VF load_vec(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename VF>
RC_FORCEINLINE void store_vec(float* p, VF v) {
  std::memcpy(p, &v, sizeof(v));
}
// A store that bypasses the caches (no read for ownership of the line first): for large outputs written once and
// not read back by the same pass. p must be aligned to sizeof(VF) (stream_aligned); call stream_fence() after the
// last one of a thread, before the data is handed to another.
template <typename VF>
RC_FORCEINLINE bool stream_aligned(const float* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(VF) == 0;
}
#if RC_CPU_HAS_AVX512_PATH
RC_CPU_AVX512_INLINE void stream_vec(float* p, v16f v) { _mm512_stream_ps(p, (__m512)v); }
RC_CPU_AVX2_INLINE void stream_vec(float* p, v8f v) { _mm256_stream_ps(p, (__m256)v); }
inline void stream_vec(float* p, v4f v) { _mm_stream_ps(p, (__m128)v); }  // SSE: the x86-64 baseline
#else
template <typename VF>
RC_FORCEINLINE void stream_vec(float* p, VF v) {
  store_vec(p, v);
}
#endif
RC_FORCEINLINE void stream_fence() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}
template <typename VF>
RC_FORCEINLINE float hsum_vec(VF v) {
  float s = 0.f;
  for (int l = 0; l < lanes_of<VF>(); ++l) s += v[l];
  return s;
}
// Whether any lane of a comparison result (-1 true, 0 false) is true: the lanes OR-ed as 64-bit words.
template <typename VI>
RC_FORCEINLINE bool any_lane(VI c) {
  long long w[sizeof(VI) / 8];
  std::memcpy(w, &c, sizeof(w));
  long long a = 0;
  for (int l = 0; l < static_cast<int>(sizeof(VI) / 8); ++l) a |= w[l];
  return a != 0;
}
template <typename VF>
RC_FORCEINLINE float hmax_vec(VF v) {
  float m = v[0];
  for (int l = 1; l < lanes_of<VF>(); ++l) m = v[l] > m ? v[l] : m;
  return m;
}

// a > b ? a : b lane-wise: b where a is NaN (a NaN logit does not move a running max). GCC compiles the generic form
// to a compare and a blend; MAXPS means exactly this (its second operand when either is NaN or both are zero), so
// the AVX-512 overload is one instruction: a bf16 block's max pass 0.027 -> 0.007 ns per element on a Zen 5 core.
template <typename VF>
RC_FORCEINLINE VF max_lanes(VF a, VF b) {
  return a > b ? a : b;
}
#if RC_CPU_HAS_AVX512_PATH
// (The all-lanes masked form, as for roundscale below: GCC 12 warns that _mm512_max_ps's undefined pass-through
// operand is used uninitialized.)
RC_CPU_AVX512_INLINE v16f max_lanes(v16f a, v16f b) {
  return (v16f)_mm512_mask_max_ps((__m512)a, 0xFFFF, (__m512)a, (__m512)b);
}
#endif

// 2^f for |f| <= 1/2 on fp32 lanes: the one polynomial behind every vectorized exp of the project. Degree 6, fitted
// to 2^f in relative error at Chebyshev nodes (1.6e-8 with the fp32 coefficients; evaluated in fp32 with FMA the
// measured maximum is 7.9e-8, under one ulp).
template <typename VF>
RC_FORCEINLINE VF exp2_poly(VF f) {
  VF p = VF{} + 1.533757750e-04f;
  p = p * f + 1.339985989e-03f;
  p = p * f + 9.618519805e-03f;
  p = p * f + 5.550329015e-02f;
  p = p * f + 2.402264625e-01f;
  p = p * f + 6.931471825e-01f;
  p = p * f + 1.0f;
  return p;
}

// exp on fp32 lanes for |x| <= 87 (and NaN, which propagates): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2 (n
// rounded to nearest, ties to even), then 2^(r / ln2) by exp2_poly. For callers whose inputs are bounded already
// (the rollout math's log-ratios are clamped to [-20, 20]), so no lane pays for clamps it cannot need.
template <typename VF, typename VI>
RC_FORCEINLINE VF exp_vec_bounded(VF x) {
  const VF shifter = VF{} + 12582912.0f;
  const VF tm = x * 1.44269504088896341f + shifter;
  const VF n = tm - shifter;
  const VF r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  const VI bits = (VI)(((typename VecOf<VF>::u32)tm << 23) + (127u << 23));
  return exp2_poly(r * 1.44269504088896341f) * (VF)bits;  // same-size vector cast: reinterprets the bits
}

// exp on fp32 lanes (any GCC vector width: VF the float vector, VI the int32 vector of the same lane count):
// exp_vec_bounded on the clamped input (measured max relative error 1.2e-7 over [-80, 80]). Inputs below -87 flush
// to 0 (exp(-87) ~ 1.6e-38 is below fp32's normal range anyway); above 88 they saturate at exp(88).
template <typename VF, typename VI>
RC_FORCEINLINE VF exp_vec(VF x) {
  const VF lo = VF{} - 87.0f, hi = VF{} + 88.0f;
  const VI underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const VF res = exp_vec_bounded<VF, VI>(x);
  return underflow ? VF{} : res;
}

RC_FORCEINLINE v8f exp_v8(v8f x) { return exp_vec<v8f, v8i>(x); }
template <typename VF>
RC_FORCEINLINE VF exp_lanes(VF x) {
  return exp_vec<VF, typename VecOf<VF>::i32>(x);
}

// Below this (log2 units) exp2_lanes returns 0: 2^-125 ~ 2.4e-38 is the smallest power the integer scaling of the
// generic path reaches exactly; the AVX-512 path flushes at the same point.
constexpr float kExp2Floor = -125.0f;
// The lower bound of exp2_scaled's argument (clamp_exp2_arg): at n = round(t) = -127 the scale's bits are exactly 0.
constexpr float kExp2Clamp = -127.0f;

// 2^t as p(t - n) 2^n with n = round(t), for t in [kExp2Clamp, 128] (NaN propagates; subnormal between -126.5 and
// -126). n comes from a 1.5 * 2^23 + 127 shifter: adding it leaves n + 127, the biased exponent of 2^n, in the low
// mantissa bits (no float-int conversion, no separate bias add), and shifting those bits left by 23 drops the rest.
// At n = -127 they are 0, so the result is exactly 0.
template <typename VF>
RC_FORCEINLINE VF exp2_scaled(VF t) {
  typedef typename VecOf<VF>::u32 VU;
  VF shifter = VF{} + (12582912.0f + 127.0f);
  // Opaque to GCC, which would otherwise turn tm - shifter into tm + (-shifter) and hold both constants: in the AVX2
  // copy that is one register too many, and GCC then keeps a sum accumulator on the stack (a store-to-load round
  // trip per add: the fp32 forward ran at 4.4 G elements/s per core that way).
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(shifter));
#endif
  const VF tm = t + shifter;
  const VF n = tm - shifter;
  const VU scale_bits = (VU)tm << 23;
  return exp2_poly(t - n) * (VF)scale_bits;  // a product, not a bit add: NaN stays NaN
}

// 2^t on fp32 lanes for t <= 128: 0 below kExp2Floor (and for -inf), NaN for NaN.
template <typename VF>
RC_FORCEINLINE VF exp2_lanes(VF t) {
  return t < kExp2Floor ? VF{} : exp2_scaled(t);
}

// max(t, kExp2Clamp), NaN kept (the comparison is false for NaN; GCC emits a compare and a blend). exp2_scaled of the
// result is exactly 0 below -126.5 (-inf included) with no floor test, so a caller that weights by it (s += e t) can
// use the clamped t in a plain FMA: an element without mass adds 0 * kExp2Clamp = 0, never 0 * -inf.
template <typename VF>
RC_FORCEINLINE VF clamp_exp2_arg(VF t) {
  return t < kExp2Clamp ? VF{} + kExp2Clamp : t;
}
#if RC_CPU_HAS_AVX2_PATH
// The same on the AVX2 copy's lanes in one MAXPS, which returns its second operand (t) when either is NaN.
RC_CPU_AVX2_INLINE v8f clamp_exp2_arg_avx2(v8f t) {
  return (v8f)_mm256_max_ps(_mm256_set1_ps(kExp2Clamp), (__m256)t);
}
#endif

#if RC_CPU_HAS_AVX512_PATH
// The same function on one AVX-512 register: round and scale in one instruction each, the floor as a zeroing mask
// (NLT_UQ keeps NaN lanes), returned too for callers that weight by the result. The generic lanes' values: same
// polynomial, same exact scaling; n = round(t) ties to even here and to odd there (their shifter is odd), so at an
// exact half-integer t the two evaluate p(1/2) 2^n and p(-1/2) 2^(n+1), both within the polynomial's error.
RC_CPU_AVX512_INLINE v16f exp2_lanes(v16f t, __mmask16* nonzero) {
  const __m512 tt = (__m512)t;
  const __m512 n = _mm512_mask_roundscale_ps(tt, 0xFFFF, tt, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p = (__m512)exp2_poly((v16f)_mm512_sub_ps(tt, n));
  *nonzero = _mm512_cmp_ps_mask(tt, _mm512_set1_ps(kExp2Floor), _CMP_NLT_UQ);
  return (v16f)_mm512_maskz_scalef_ps(*nonzero, p, n);
}
RC_CPU_AVX512_INLINE v16f exp2_lanes(v16f t) {
  __mmask16 nonzero;
  return exp2_lanes(t, &nonzero);
}
#endif

// 16-bit floats to fp32, a vector at a time (pure integer and float ops, so every clone vectorizes them).
// fp16 (IEEE binary16): exponent rebased by 112; subnormals through one float subtraction (exact: the result is
// a multiple of 2^-24 with at most 11 significant bits); inf / NaN keep an all-ones exponent (NaN payload kept).
// The classic branch-free conversion (F. Giesen, "half to float done quick"), written for vector lanes.
template <typename VF>
RC_FORCEINLINE VF half_bits_to_float(typename VecOf<VF>::u32 h) {
  typedef typename VecOf<VF>::u32 U;
  const U exp_mask = U{} + (0x7c00u << 13);
  U o = (h & 0x7fffu) << 13;
  const U e = o & exp_mask;
  o += (127u - 15u) << 23;
  o = (e == exp_mask) ? o + ((128u - 16u) << 23) : o;  // inf / NaN
  const VF sub = (VF)(o + (1u << 23)) - (VF{} + 6.103515625e-05f);  // 2^-14: subnormal or zero
  o = (e == 0u) ? (U)sub : o;
  return (VF)(o | ((h & 0x8000u) << 16));
}
// bf16: its bits are the upper half of the fp32's, exactly.
struct Bf16Bits {
  template <typename VF>
  static RC_FORCEINLINE VF to_float(typename VecOf<VF>::u32 h) {
    return (VF)(h << 16);
  }
};
struct HalfBits {
  template <typename VF>
  static RC_FORCEINLINE VF to_float(typename VecOf<VF>::u32 h) {
    return half_bits_to_float<VF>(h);
  }
};
template <typename Format, typename VF>
RC_FORCEINLINE void widen_16bit(const uint16_t* src, float* dst, int64_t n) {
  typedef typename VecOf<VF>::u32 U;
  typedef typename VecOf<VF>::u16 H;
  constexpr int L = lanes_of<VF>();
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    H h;
    std::memcpy(&h, src + i, sizeof(h));
    store_vec(dst + i, Format::template to_float<VF>(__builtin_convertvector(h, U)));
  }
  for (; i < n; ++i) dst[i] = Format::template to_float<VF>(U{} + static_cast<uint32_t>(src[i]))[0];
}

// fp32 to bf16, rounding to nearest even as c10::BFloat16 does (NaN stays a quiet NaN).
template <typename VF>
RC_FORCEINLINE void narrow_bf16(const float* src, uint16_t* dst, int64_t n) {
  typedef typename VecOf<VF>::u32 U;
  typedef typename VecOf<VF>::u16 H;
  constexpr int L = lanes_of<VF>();
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const VF f = load_vec<VF>(src + i);
    U u;
    std::memcpy(&u, &f, sizeof(u));
    U r = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
    r = (f != f) ? U{} + 0x7fc0u : r;
    const H h = __builtin_convertvector(r, H);
    std::memcpy(dst + i, &h, sizeof(h));
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    dst[i] = src[i] != src[i] ? uint16_t(0x7fc0) : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

// Scalar exp for block tails and the fp64 path.
RC_FORCEINLINE float exp_acc(float x) {
  v8f v = v8f{} + x;
  return exp_v8(v)[0];
}
RC_FORCEINLINE double exp_acc(double x) { return std::exp(x); }

}  // namespace cpu
}  // namespace rollout_corr
