// The sampling replay's value keys and integer masses (docs/sampling_replay.md), RC_HD: the CPU kernels
// (csrc/cpu/sampling.cpp), the CUDA kernels (csrc/cuda/sampling_kernels.cuh) and the CUDA emulator compute them
// with this one code, so that a top-p decision (a comparison of integer mass sums) is the same on every backend.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

#include "rc_macros.h"

namespace rollout_corr {

// a * b + c, fused where the CPU kernels' FMA copies fuse it. GCC contracts a * b + c into one FMA in the AVX2 and
// AVX-512 copies of the CPU kernels (and rounds twice in the baseline copy, which has no FMA); nvcc would contract
// too, but where it chooses to. Spelling the fused operations out makes the device's exp polynomial bitwise the CPU
// FMA copies' (checked on 4M values against GCC 12's contraction: tests/test_cuda_emulator_sampling.py compares the
// emulated masses with the CPU kernel's). The emulator fuses with std::fma (it is built without -mfma).
#if defined(__CUDA_ARCH__)
#define RC_FMA(a, b, c) __fma_rn((a), (b), (c))
#elif defined(RC_CUDA_EMULATOR)
#define RC_FMA(a, b, c) std::fma((a), (b), (c))
#else
#define RC_FMA(a, b, c) ((a) * (b) + (c))
#endif

// The bits of a value read as another type of the same size: a memcpy, which host and device compilers turn into a
// register move (no aliasing through a reinterpreted pointer).
template <typename To, typename From>
RC_HD RC_FORCEINLINE To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: the two types must have the same size");
  To out;
  memcpy(&out, &v, sizeof out);
  return out;
}

// The order-preserving integer key of a value (-0.0 as 0.0): sampling.py's _ordered_key. The negative values' bits
// are flipped so that integer order is value order; NaN patterns land above +inf (positive NaN) or below -inf.
RC_HD RC_FORCEINLINE int64_t ordered_key(float z) {
  const int32_t bits = bits_as<int32_t>(z + 0.0f);
  return bits < 0 ? static_cast<int64_t>(bits ^ 0x7FFFFFFF) : static_cast<int64_t>(bits);
}
RC_HD RC_FORCEINLINE int64_t ordered_key(double z) {
  const int64_t bits = bits_as<int64_t>(z + 0.0);
  return bits < 0 ? (bits ^ 0x7FFFFFFFFFFFFFFFLL) : bits;
}

// The same key shifted to unsigned (the candidates' sort keys, radix digits), and back.
RC_HD RC_FORCEINLINE uint32_t ordered_u32(float v) { return static_cast<uint32_t>(ordered_key(v) + 0x80000000LL); }
RC_HD RC_FORCEINLINE uint64_t ordered_u64(double v) {
  return static_cast<uint64_t>(ordered_key(v)) + 0x8000000000000000ull;
}
RC_HD RC_FORCEINLINE float from_ordered_u32(uint32_t u) {
  return bits_as<float>((u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u);
}
RC_HD RC_FORCEINLINE double from_ordered_u64(uint64_t u) {
  const uint64_t b = (u & 0x8000000000000000ull) ? (u & 0x7FFFFFFFFFFFFFFFull) : ~u;
  return bits_as<double>(static_cast<int64_t>(b));
}

// A candidate's sort key: value descending, then column ascending, as one descending integer order.
RC_HD RC_FORCEINLINE uint64_t candidate_key(float z, int64_t col) {
  return (static_cast<uint64_t>(ordered_u32(z)) << 32) | (0xFFFFFFFFull - static_cast<uint64_t>(col));
}
RC_HD RC_FORCEINLINE float candidate_value(uint64_t key) { return from_ordered_u32(static_cast<uint32_t>(key >> 32)); }
RC_HD RC_FORCEINLINE int64_t candidate_col(uint64_t key) {
  return static_cast<int64_t>(0xFFFFFFFFull - (key & 0xFFFFFFFFull));
}

// e^x for x in [-60, 0]: x = k ln2 + r (|r| <= ln2 / 2, ln2 split in two so k ln2 is exact), e^r by its Taylor
// series to r^13 (the next term is below 2^-57 of the sum), 2^k put into the exponent bits. Plain arithmetic (the
// roundings by the 1.5 * 2^52 trick, no libm call), so the CPU kernels' ISA copies vectorise it; within 2 ulp of exp.
RC_HD RC_FORCEINLINE double exp_nonpositive(double x) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: adding and subtracting it rounds to an integer
  const double kf = RC_FMA(x, 1.4426950408889634, kMagic) - kMagic;
  const double r = RC_FMA(-kf, 1.90821492927058770002e-10, RC_FMA(-kf, 6.93147180369123816490e-01, x));
  double p = 1.0 / 6227020800.0;
  p = RC_FMA(p, r, 1.0 / 479001600.0);
  p = RC_FMA(p, r, 1.0 / 39916800.0);
  p = RC_FMA(p, r, 1.0 / 3628800.0);
  p = RC_FMA(p, r, 1.0 / 362880.0);
  p = RC_FMA(p, r, 1.0 / 40320.0);
  p = RC_FMA(p, r, 1.0 / 5040.0);
  p = RC_FMA(p, r, 1.0 / 720.0);
  p = RC_FMA(p, r, 1.0 / 120.0);
  p = RC_FMA(p, r, 1.0 / 24.0);
  p = RC_FMA(p, r, 1.0 / 6.0);
  p = RC_FMA(p, r, 0.5);
  p = RC_FMA(p, r, 1.0);
  p = RC_FMA(p, r, 1.0);
  const double scale = bits_as<double>((static_cast<int64_t>(kf) + 1023) << 52);
  return p * scale;
}

// e^rel of a value rel = z - z_max <= 0 as the masses use it: exp_nonpositive, 0 below e^-60.
RC_HD RC_FORCEINLINE double mass_exp(double rel) { return rel < -60.0 ? 0.0 : exp_nonpositive(rel); }

// The integer mass round(e * 2^40) of a mass_exp e (round half to even, exact below 2^51): e * 2^40 is exact, so
// fusing the product into the addition (the FMA copies do) rounds the same.
RC_HD RC_FORCEINLINE int64_t mass_of(double e) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  return static_cast<int64_t>((e * 1099511627776.0 + kMagic) - kMagic);
}

// The top-p mass of a value rel = z - z_max <= 0: round(e^rel * 2^40) as an integer (sampling.py's masses; their sums
// do not depend on the order or the sharding); 0 below e^-60 (it would round to 0 anyway). A double holding an
// integer, for the CPU kernel's vectorised loop.
RC_HD RC_FORCEINLINE double top_p_mass(double rel) {
  constexpr double kMagic = 6755399441055744.0;
  const double x = rel < -60.0 ? -60.0 : rel;
  const double v = exp_nonpositive(x) * 1099511627776.0;  // 2^40
  return rel < -60.0 ? 0.0 : (v + kMagic) - kMagic;
}

}  // namespace rollout_corr
