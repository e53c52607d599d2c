// Portability macros shared by the CPU sources, the CUDA kernels and the CUDA emulator.
#pragma once

#if defined(__CUDACC__) || defined(RC_CUDA_EMULATOR)
#define RC_HD __host__ __device__
#define RC_DEVICE __device__
#else
#define RC_HD
#define RC_DEVICE
#endif

#define RC_FORCEINLINE inline __attribute__((always_inline))
#if defined(__CUDACC__)
#define RC_FORCEINLINE_LAMBDA
#else
#define RC_FORCEINLINE_LAMBDA __attribute__((always_inline))
#endif

// Global-memory accesses of device code (and of the RC_HD functions that device code calls) go through these two
// macros: plain loads and stores on the GPU and the CPU; under the CUDA emulator (which defines them first) they
// are counted per launch, so the tests can measure bytes moved and sectors per warp-level request.
#ifndef RC_LDG
#define RC_LDG(ptr) (*(ptr))
#endif
#ifndef RC_STG
#define RC_STG(ptr, value) (*(ptr) = (value))
#endif
