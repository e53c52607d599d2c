// CUDA launchers of the rollout-correction op (docs/rollout_correction.md): device guard, current stream, launch
// checks.
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
                                  const at::Tensor& mask, const c10::optional<at::Tensor>& cu_seqlens
                                  RC_ROLLOUT_CONFIG_PARAMS) {
  const c10::cuda::CUDAGuard guard(log_prob.device());
  return run_rollout_seq_stats(log_prob, rollout_log_prob, mask, cu_seqlens, RC_ROLLOUT_CONFIG_ARGS, LaunchKnobs{},
                               current_stream_launch());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rollout_token_pass_cuda(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& seq_stats RC_ROLLOUT_CONFIG_PARAMS,
    bool row_partials) {
  const c10::cuda::CUDAGuard guard(log_prob.device());
  return run_rollout_token_pass(log_prob, rollout_log_prob, mask, cu_seqlens, seq_stats, RC_ROLLOUT_CONFIG_ARGS,
                                row_partials, LaunchKnobs{}, current_stream_launch());
}

// No host sync: the conditions become asynchronous device asserts (the message surfaces at the next sync).
at::Tensor rollout_check_cuda(const at::Tensor& sums, const c10::optional<at::Tensor>& agree,
                              const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
                              bool exclude_nonfinite, bool allow_empty) {
  check_rollout_check_inputs(sums, agree, log_prob, rollout_log_prob, mask);
  const c10::cuda::CUDAGuard guard(log_prob.device());
  if (agree.has_value()) at::_assert_async(agree->reshape({}).to(at::kBool), kMsgConfigMismatch);
  at::_assert_async(sums[rc::sum_slot::bad_mask] == 0, kMsgBadMask);
  if (!exclude_nonfinite) at::_assert_async(sums[rc::sum_slot::nonfinite] == 0, kMsgNonFinite);
  if (!allow_empty) at::_assert_async(sums[rc::sum_slot::tokens] > 0, kMsgNoValidToken);
  return sums.clone();
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("rollout_seq_stats", &rollout_seq_stats_cuda);
  m.impl("rollout_token_pass", &rollout_token_pass_cuda);
  m.impl("rollout_check", &rollout_check_cuda);
}

}  // namespace rollout_corr
