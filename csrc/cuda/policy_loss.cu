// CUDA launchers of the fused policy loss: boundary checks, params, launch on the current stream.
// Device code: policy_loss_kernels.cuh (shared with the CUDA emulator).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "launch_config.h"
#include "policy_loss_host.h"
#include "policy_loss_kernels.cuh"

namespace rollout_corr {
namespace {

std::tuple<at::Tensor, at::Tensor> policy_loss_rows_cuda(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                         const at::Tensor& advantages,
                                                         const at::Tensor& response_mask,
                                                         const c10::optional<at::Tensor>& weights, double clip_low,
                                                         double clip_high, double clip_c, int64_t loss_kind) {
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind);
  const c10::cuda::CUDAGuard guard(log_prob.device());
  auto [loss_mat, rows] = new_policy_loss_outputs(log_prob);
  if (log_prob.size(0) == 0) return {loss_mat, rows};
  const at::Tensor w = defined_or_empty(weights);
  const at::Tensor undefined = new_undefined_flag(log_prob);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_rows_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_params<scalar_t, acc_t>(log_prob, old_log_prob, advantages, response_mask, w,
                                                            loss_mat, rows, undefined, clip_low, clip_high, clip_c,
                                                            loss_kind);
    const int threads = row_block_threads(p.cols, 1);
    const auto blocks = static_cast<unsigned>(row_grid_blocks(p.rows));
    policy_loss_rows_kernel<scalar_t, acc_t><<<blocks, threads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  at::_assert_async(undefined[0] == 0, kMsgUndefinedLoss);  // no host sync
  return {loss_mat, rows};
}

at::Tensor policy_loss_backward_cuda(const c10::optional<at::Tensor>& grad_loss_mat,
                                     const c10::optional<at::Tensor>& grad_rows_loss, const at::Tensor& log_prob,
                                     const at::Tensor& old_log_prob, const at::Tensor& advantages,
                                     const at::Tensor& response_mask, const c10::optional<at::Tensor>& weights,
                                     double clip_low, double clip_high, double clip_c, int64_t loss_kind) {
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind);
  const at::Tensor g_mat = defined_or_empty(grad_loss_mat);
  const at::Tensor g_rows = defined_or_empty(grad_rows_loss);
  check_policy_loss_grads(g_mat, g_rows, log_prob);
  const c10::cuda::CUDAGuard guard(log_prob.device());
  auto grad = at::empty({log_prob.size(0), log_prob.size(1)}, log_prob.options());
  if (log_prob.numel() == 0) return grad;
  const at::Tensor w = defined_or_empty(weights);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_backward_params<scalar_t, acc_t>(g_mat, g_rows, log_prob, old_log_prob,
                                                                     advantages, response_mask, w, grad, clip_low,
                                                                     clip_high, clip_c, loss_kind);
    const int threads = row_block_threads(p.cols, 1);
    const auto blocks = static_cast<unsigned>(row_grid_blocks(p.rows));
    policy_loss_backward_kernel<scalar_t, acc_t><<<blocks, threads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("policy_loss_rows", &policy_loss_rows_cuda);
  m.impl("policy_loss_backward", &policy_loss_backward_cuda);
}

}  // namespace rollout_corr
