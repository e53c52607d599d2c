// CUDA launchers of the rollout-correction op (DESIGN §3): device guard, current stream, launch checks.
// The shared host driver (checks, outputs, scratch, params, launch shapes): rollout_correction_launch.cuh;
// device code: rollout_correction_kernels.cuh (shared with the CUDA emulator).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_launch.cuh"
#include "rollout_correction_launch.cuh"

namespace rollout_corr {
namespace {

at::Tensor rollout_seq_stats_cuda(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                  const at::Tensor& mask, at::ArrayRef<double> params) {
  const c10::cuda::CUDAGuard guard(log_prob.device());
  return run_rollout_seq_stats(log_prob, rollout_log_prob, mask, params, 0, 0,
                               current_stream_launch());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rollout_token_pass_cuda(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const at::Tensor& seq_stats, at::ArrayRef<double> params, bool row_partials) {
  const c10::cuda::CUDAGuard guard(log_prob.device());
  return run_rollout_token_pass(log_prob, rollout_log_prob, mask, seq_stats, params, row_partials, 0, 0,
                                current_stream_launch());
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("rollout_seq_stats", &rollout_seq_stats_cuda);
  m.impl("rollout_token_pass", &rollout_token_pass_cuda);
}

}  // namespace rollout_corr
