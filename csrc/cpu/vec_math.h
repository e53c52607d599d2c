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
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial (truncation < r^8/8! ~ 5e-9
// relative; measured max relative error 1e-7 over [-80, 80]). Inputs below -87 flush to 0 (exp(-87) ~ 1.6e-38 is
// below fp32's normal range anyway); above 88 they saturate at exp(88).
template <typename VF, typename VI>
RC_FORCEINLINE VF exp_vec(VF x) {
  const VF lo = VF{} - 87.0f, hi = VF{} + 88.0f;
  const VI underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const VF t = x * 1.44269504088896341f;
  const VI ni = __builtin_convertvector(t + ((t >= 0.0f) ? (VF{} + 0.5f) : (VF{} - 0.5f)), VI);
  const VF n = __builtin_convertvector(ni, VF);
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

// Scalar exp for block tails and the fp64 path.
RC_FORCEINLINE float exp_acc(float x) {
  v8f v = v8f{} + x;
  return exp_v8(v)[0];
}
RC_FORCEINLINE double exp_acc(double x) { return std::exp(x); }

}  // namespace cpu
}  // namespace rollout_corr
