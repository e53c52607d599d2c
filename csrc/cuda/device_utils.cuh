// Device helpers shared by the kernel families. Only the device API that the CUDA emulator
// (rollout_corr_testing/cuda_emulator) implements may be used here: thread/block indices, __syncthreads, __shfl_*_sync,
// static __shared__ arrays, atomics and the math functions.
#pragma once

#include <cstdint>

#include "rc_macros.h"

// Shared memory through these two macros: on the GPU plain __shared__ declarations; under the CUDA emulator a
// per-block arena that is poisoned before every block, so a read of a slot nobody wrote shows up as NaN.
#ifndef RC_SHARED_ARRAY
#define RC_SHARED_ARRAY(T, name, count) __shared__ T name[count]
#endif
#ifndef RC_DYNAMIC_SHARED
#define RC_DYNAMIC_SHARED(T, name)                       \
  extern __shared__ __align__(16) unsigned char rc_dynamic_smem_[]; \
  T* const name = reinterpret_cast<T*>(rc_dynamic_smem_)
#endif

// Between a thread's load of a shared slot and its store back to the same slot (a sort's compare-and-swap): nothing
// on the GPU. Under the CUDA emulator an opaque call: GCC's AddressSanitizer pass, which gives racecheck its view of
// every access, drops a store's check as redundant when a load of the same address dominates it in the same block,
// so without the call racecheck would not see the store.
#ifndef RC_SHARED_STORE_AFTER_LOAD
#define RC_SHARED_STORE_AFTER_LOAD()
#endif

namespace rollout_corr {

constexpr unsigned kFullWarpMask = 0xffffffffu;
constexpr int kWarpSize = 32;

// A 16-byte (or narrower) aligned pack of elements, for vectorized global loads and stores.
template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

template <typename acc_t>
__device__ RC_FORCEINLINE acc_t warp_sum(acc_t v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarpMask, v, offset);
  return v;
}

template <typename acc_t>
__device__ RC_FORCEINLINE acc_t warp_max(acc_t v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const acc_t o = __shfl_xor_sync(kFullWarpMask, v, offset);
    v = o > v ? o : v;
  }
  return v;
}

}  // namespace rollout_corr
