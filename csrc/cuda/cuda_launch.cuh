// The launch callable the shared host drivers (*_launch.cuh) take on a real GPU: every kernel goes on the current
// stream with a launch check. The CUDA emulator passes its own callable to the same drivers.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

namespace rollout_corr {

struct CudaLaunch {
  cudaStream_t stream;
  template <typename Kernel, typename Params>
  void operator()(Kernel kernel, dim3 grid, dim3 block, const Params& p) const {
    kernel<<<grid, block, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

inline CudaLaunch current_stream_launch() { return CudaLaunch{at::cuda::getCurrentCUDAStream()}; }

}  // namespace rollout_corr
