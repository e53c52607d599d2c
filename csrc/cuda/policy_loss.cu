// CUDA launchers of the fused policy loss: device guard, current stream, launch checks. The shared host driver
// (checks, outputs, params, launch shapes): policy_loss_launch.cuh; device code: policy_loss_kernels.cuh (shared
// with the CUDA emulator).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_launch.cuh"
#include "policy_loss_launch.cuh"

namespace rollout_corr {
namespace {

std::tuple<at::Tensor, at::Tensor> policy_loss_rows_cuda(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                         const at::Tensor& advantages,
                                                         const at::Tensor& response_mask,
                                                         const c10::optional<at::Tensor>& weights, double clip_low,
                                                         double clip_high, double clip_c, int64_t loss_kind,
                                                         const c10::optional<at::Tensor>& cu_seqlens, double param_a,
                                                         double param_b, bool with_loss_mat) {
  const c10::cuda::CUDAGuard guard(log_prob.device());
  return run_policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                              loss_kind, cu_seqlens, param_a, param_b, with_loss_mat, LaunchKnobs{},
                              OutputInit::kEmpty, current_stream_launch());
}

at::Tensor policy_loss_backward_cuda(const c10::optional<at::Tensor>& grad_loss_mat,
                                     const c10::optional<at::Tensor>& grad_rows_loss, const at::Tensor& log_prob,
                                     const at::Tensor& old_log_prob, const at::Tensor& advantages,
                                     const at::Tensor& response_mask, const c10::optional<at::Tensor>& weights,
                                     double clip_low, double clip_high, double clip_c, int64_t loss_kind,
                                     const c10::optional<at::Tensor>& cu_seqlens, double param_a, double param_b) {
  const c10::cuda::CUDAGuard guard(log_prob.device());
  return run_policy_loss_backward(grad_loss_mat, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask,
                                  weights, clip_low, clip_high, clip_c, loss_kind, cu_seqlens, param_a, param_b, LaunchKnobs{}, OutputInit::kEmpty,
                                  current_stream_launch());
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("policy_loss_rows", &policy_loss_rows_cuda);
  m.impl("policy_loss_backward", &policy_loss_backward_cuda);
}

}  // namespace rollout_corr
