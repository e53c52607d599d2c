// Launch planning and host driver of the fused policy-loss CUDA kernels, shared by the CUDA launchers
// (policy_loss.cu) and the CUDA emulator's bindings (rollout_corr_testing/cuda_emulator/emu_policy_loss.cpp):
// boundary checks, outputs, params and launch shapes are decided here once, so the emulator runs the launchers' real
// decisions; `launch(kernel, grid, block, params)` is the only backend-specific part. A .cuh (host code) so that the
// emulator's kernel-override folders, which copy csrc/cuda/*.cuh, carry it too.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "launch_config.h"
#include "policy_loss_host.h"
#include "policy_loss_kernels.cuh"

namespace rollout_corr {

// One block per row (grid-stride beyond the grid limit), threads to cover the row in one sweep (a power of two in
// [32, 512]). knobs: the emulator's overrides (0 = this choice).
struct PolicyLossLaunchPlan {
  dim3 grid, block;
};
inline PolicyLossLaunchPlan plan_policy_loss_launch(int64_t rows, int64_t cols, const LaunchKnobs& knobs) {
  TORCH_CHECK(knobs.threads == 0 || (knobs.threads >= 32 && knobs.threads <= 1024 && knobs.threads % 32 == 0),
              "threads must be 0 or a multiple of 32 in [32, 1024], got ", knobs.threads);
  TORCH_CHECK(knobs.max_blocks >= 0, "max_blocks must be >= 0, got ", knobs.max_blocks);
  const int threads = knobs.threads > 0 ? static_cast<int>(knobs.threads) : row_block_threads(cols, 1);
  return {dim3(static_cast<unsigned>(capped_grid(row_grid_blocks(rows), knobs))), dim3(threads)};
}

// Outputs of a launch: uninitialised on the GPU; NaN-poisoned under the emulator, so that any element a kernel
// forgets to write shows up.
enum class OutputInit { kEmpty, kPoisoned };

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& opts, OutputInit init) {
  return init == OutputInit::kEmpty ? at::empty(sizes, opts)
                                    : at::full(sizes, std::numeric_limits<double>::quiet_NaN(), opts);
}

// The undefined-loss flag the kernel set: an asynchronous device assert on the GPU (no host sync); on CPU tensors
// (the emulator) the same named ValueError as the CPU kernels.
template <typename scalar_t, typename acc_t>
void check_undefined_flag(const at::Tensor& undefined, const PolicyLossParams<scalar_t, acc_t>& p) {
  if (undefined.is_cpu()) {
    if (*undefined.const_data_ptr<int32_t>() != 0) raise_undefined_policy_loss(p);
  } else {
    at::_assert_async(undefined[0] == 0, kMsgUndefinedLoss);
  }
}

template <typename Launch>
std::tuple<at::Tensor, at::Tensor> run_policy_loss_rows(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                        const at::Tensor& advantages, const at::Tensor& response_mask,
                                                        const c10::optional<at::Tensor>& weights, double clip_low,
                                                        double clip_high, double clip_c, int64_t loss_kind,
                                                        const c10::optional<at::Tensor>& cu_seqlens, double param_a,
                                                        double param_b, bool with_loss_mat, const LaunchKnobs& knobs,
                                                        OutputInit init, Launch&& launch) {
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);  // first: names a layout mistake as such
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind, param_a, param_b);
  const auto opts = log_prob.options().dtype(policy_acc_dtype(log_prob.scalar_type()));
  auto loss_mat = with_loss_mat ? new_output(log_prob.sizes(), opts, init) : at::empty({0}, opts);
  auto rows = new_output({layout.rows, kPgRowCols}, opts, init);
  if (layout.rows == 0) return {loss_mat, rows};
  const at::Tensor w = defined_or_empty(weights);
  const at::Tensor undefined = new_undefined_flag(log_prob);
  const PolicyLossLaunchPlan plan = plan_policy_loss_launch(layout.rows, tokens_per_sequence(layout), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_rows", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_params<scalar_t, acc_t>(log_prob, old_log_prob, advantages, response_mask, w,
                                                            loss_mat, rows, undefined, layout, clip_low, clip_high,
                                                            clip_c, loss_kind, param_a, param_b);
    launch(policy_loss_rows_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
    check_undefined_flag(undefined, p);
  });
  return {loss_mat, rows};
}

template <typename Launch>
at::Tensor run_policy_loss_backward(const c10::optional<at::Tensor>& grad_loss_mat,
                                    const c10::optional<at::Tensor>& grad_rows_loss, const at::Tensor& log_prob,
                                    const at::Tensor& old_log_prob, const at::Tensor& advantages,
                                    const at::Tensor& response_mask, const c10::optional<at::Tensor>& weights,
                                    double clip_low, double clip_high, double clip_c, int64_t loss_kind,
                                    const c10::optional<at::Tensor>& cu_seqlens, double param_a, double param_b, const LaunchKnobs& knobs,
                                    OutputInit init, Launch&& launch) {
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);  // first: names a layout mistake as such
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind, param_a, param_b);
  const at::Tensor g_mat = defined_or_empty(grad_loss_mat);
  const at::Tensor g_rows = defined_or_empty(grad_rows_loss);
  check_policy_loss_grads(g_mat, g_rows, log_prob, layout.rows);
  auto grad = new_output(log_prob.sizes(), log_prob.options(), init);
  if (log_prob.numel() == 0 || layout.rows == 0) return grad;
  const at::Tensor w = defined_or_empty(weights);
  const PolicyLossLaunchPlan plan = plan_policy_loss_launch(layout.rows, tokens_per_sequence(layout), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_backward_params<scalar_t, acc_t>(g_mat, g_rows, log_prob, old_log_prob,
                                                                     advantages, response_mask, w, grad, layout,
                                                                     clip_low, clip_high, clip_c, loss_kind, param_a, param_b);
    launch(policy_loss_backward_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
  });
  return grad;
}

}  // namespace rollout_corr
