// CPU SIMD math shared by the CPU kernels of every family: one vectorized exp for the whole project.
// Written with GCC/Clang vector extensions; the kernels' outer loops are multiversioned with RC_CPU_MULTIVERSION
// (target_clones), and these always-inline helpers are compiled into each clone for its ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "rc_macros.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RC_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))  // v3: AVX2 + FMA
// An explicit AVX-512 copy of a function (called only after rc_cpu_has_avx512() says the CPU runs it).
#define RC_CPU_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))
#define RC_CPU_HAS_AVX512_PATH 1
#else
#define RC_CPU_MULTIVERSION
#define RC_CPU_AVX512
#define RC_CPU_HAS_AVX512_PATH 0
#endif

namespace rollout_corr {
namespace cpu {

// Whether to run the RC_CPU_AVX512 copies: the CPU has AVX-512 and ROLLOUT_CORR_CPU_ISA (read once) is not
// "avx2" (set it to compare the two paths in one build).
inline bool has_avx512() {
#if RC_CPU_HAS_AVX512_PATH
  static const bool yes = [] {
    const char* isa = std::getenv("ROLLOUT_CORR_CPU_ISA");
    if (isa != nullptr && std::strcmp(isa, "avx2") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  }();
  return yes;
#else
  return false;
#endif
}

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

// exp on fp32 lanes (any GCC vector width: VF the float vector, VI the int32 vector of the same lane count):
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2 (n rounded to nearest, ties to even), then a degree-7 Taylor polynomial (truncation < r^8/8! ~ 5e-9
// relative; measured max relative error 1e-7 over [-80, 80]). Inputs below -87 flush to 0 (exp(-87) ~ 1.6e-38 is
// below fp32's normal range anyway); above 88 they saturate at exp(88).
template <typename VF, typename VI>
RC_FORCEINLINE VF exp_vec(VF x) {
  const VF lo = VF{} - 87.0f, hi = VF{} + 88.0f;
  const VI underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = round(x / ln 2) with the 1.5 * 2^23 shifter: adding it leaves the rounded integer in the low mantissa bits
  // (|x / ln 2| <= 127 here), so no float-int conversions are needed.
  const VF shifter = VF{} + 12582912.0f;
  const VF tm = x * 1.44269504088896341f + shifter;
  const VF n = tm - shifter;
  const VI ni = (VI)tm - 0x4B400000;  // the shifter's bits
  const VF r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  VF p = VF{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI bits = (ni + 127) << 23;
  const VF res = p * (VF)bits;  // same-size vector cast: reinterprets the bits
  return underflow ? VF{} : res;
}

RC_FORCEINLINE v8f exp_v8(v8f x) { return exp_vec<v8f, v8i>(x); }

// 16 x fp32 lanes: one AVX-512 register (the rollout kernels' widest path, built with RC_CPU_AVX512).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// Width-generic helpers: the log-prob kernels are written once over VF (v8f: the AVX2 / baseline clones; v16f: the
// AVX-512 copy), so the same loop bodies run at the widest ISA the CPU has.
template <typename VF>
struct VecOf;
template <>
struct VecOf<v8f> {
  typedef v8i i32;
  typedef uint32_t u32 __attribute__((vector_size(32)));
  typedef uint16_t u16 __attribute__((vector_size(16)));
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
template <typename VF>
RC_FORCEINLINE float hsum_vec(VF v) {
  float s = 0.f;
  for (int l = 0; l < lanes_of<VF>(); ++l) s += v[l];
  return s;
}
template <typename VF>
RC_FORCEINLINE float hmax_vec(VF v) {
  float m = v[0];
  for (int l = 1; l < lanes_of<VF>(); ++l) m = v[l] > m ? v[l] : m;
  return m;
}
template <typename VF>
RC_FORCEINLINE VF exp_lanes(VF x) {
  return exp_vec<VF, typename VecOf<VF>::i32>(x);
}

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
