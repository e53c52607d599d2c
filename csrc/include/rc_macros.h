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
