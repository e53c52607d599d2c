// exp / log of one value in the accumulation type, for every kernel family's RC_HD math: the full-precision CUDA
// intrinsics on the device (the build does not use --use_fast_math), the std:: overloads on the host (CPU kernels,
// the CUDA emulator).
#pragma once

#include <cmath>

#include "rc_macros.h"

namespace rollout_corr {

// exp/log in the accumulation type: the CUDA float intrinsics on the device (expf/logf, full precision: the
// build does not use --use_fast_math), std:: overloads on the host (CPU merge, CUDA emulator).
RC_HD RC_FORCEINLINE float rc_exp(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}
RC_HD RC_FORCEINLINE double rc_exp(double x) {
#ifdef __CUDA_ARCH__
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
RC_HD RC_FORCEINLINE float rc_log(float x) {
#ifdef __CUDA_ARCH__
  return logf(x);
#else
  return std::log(x);
#endif
}
RC_HD RC_FORCEINLINE double rc_log(double x) {
#ifdef __CUDA_ARCH__
  return ::log(x);
#else
  return std::log(x);
#endif
}

}  // namespace rollout_corr
