// CPU SIMD math shared by the CPU kernels of every family: one vectorized exp for the whole project.
// Written with GCC/Clang vector extensions; the kernels' outer loops are multiversioned with RC_CPU_MULTIVERSION
// (target_clones), and these always-inline helpers are compiled into each clone for its ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "rc_macros.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RC_CPU_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define RC_CPU_MULTIVERSION
#endif

namespace rollout_corr {
namespace cpu {

// Explicit SIMD through GCC/Clang vector extensions: 8 x fp32 lanes. Under target_clones the same code is
// compiled once for AVX2 and once for the x86-64 baseline (two SSE registers per vector).
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

// exp on 8 fp32 lanes: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial
// (truncation < r^8/8! ~ 5e-9 relative; measured max relative error 1e-7 over [-80, 80]). Inputs below -87
// flush to 0 (exp(-87) ~ 1.6e-38 is below fp32's normal range anyway).
RC_FORCEINLINE v8f exp_v8(v8f x) {
  const v8f lo = v8f{} - 87.0f, hi = v8f{} + 88.0f;
  const v8i underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v8f t = x * 1.44269504088896341f;
  const v8i ni = __builtin_convertvector(t + ((t >= 0.0f) ? (v8f{} + 0.5f) : (v8f{} - 0.5f)), v8i);
  const v8f n = __builtin_convertvector(ni, v8f);
  const v8f r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  v8f p = v8f{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v8i bits = (ni + 127) << 23;
  const v8f res = p * (v8f)bits;  // same-size vector cast: reinterprets the bits
  return underflow ? v8f{} : res;
}

// Scalar exp for block tails and the fp64 path.
RC_FORCEINLINE float exp_acc(float x) {
  v8f v = v8f{} + x;
  return exp_v8(v)[0];
}
RC_FORCEINLINE double exp_acc(double x) { return std::exp(x); }

}  // namespace cpu
}  // namespace rollout_corr
