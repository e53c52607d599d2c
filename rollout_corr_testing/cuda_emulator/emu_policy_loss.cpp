// Emulated CUDA launchers of the fused policy-loss kernels: the very kernels of
// csrc/cuda/policy_loss_kernels.cuh, compiled by g++ against cuda_emu.h and exposed as CPU ops
// torch.ops.rollout_corr_emu.policy_loss_rows / policy_loss_backward. They take the arguments of the real ops
// plus knobs the tests sweep: `threads` (0 = the launcher's choice), `schedule` (0 ascending, 1 descending)
// and `max_blocks` (0 = one block per row; fewer exercises the grid-stride loop over rows).
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <limits>

#include "emu_launch.h"
#include "launch_config.h"  // the launchers' choices
#include "policy_loss_host.h"
#include "policy_loss_kernels.cuh"

namespace rollout_corr {
namespace {

struct PolicyEmuLaunch {
  dim3 grid, block;
};

PolicyEmuLaunch policy_emu_launch(int64_t rows, int64_t cols, int64_t threads, int64_t schedule, int64_t max_blocks) {
  TORCH_CHECK(threads == 0 || (threads >= 32 && threads <= 1024 && threads % 32 == 0),
              "threads must be 0 or a multiple of 32 in [32, 1024]");
  TORCH_CHECK(max_blocks >= 0, "max_blocks must be >= 0");
  apply_schedule(schedule);
  const int t = threads == 0 ? row_block_threads(cols, 1) : static_cast<int>(threads);
  const int64_t blocks = row_grid_blocks(rows);
  return {dim3(static_cast<unsigned>(max_blocks > 0 ? std::min(blocks, max_blocks) : blocks)), dim3(t)};
}

std::tuple<at::Tensor, at::Tensor> policy_loss_rows_emu(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                        const at::Tensor& advantages, const at::Tensor& response_mask,
                                                        const c10::optional<at::Tensor>& weights, double clip_low,
                                                        double clip_high, double clip_c, int64_t loss_kind,
                                                        int64_t threads, int64_t schedule, int64_t max_blocks) {
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind);
  const auto launch = policy_emu_launch(log_prob.size(0), log_prob.size(1), threads, schedule, max_blocks);
  // Poisoned outputs: any element the kernel forgets to write shows up as NaN.
  const auto opts = log_prob.options().dtype(policy_acc_dtype(log_prob.scalar_type()));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto loss_mat = at::full({log_prob.size(0), log_prob.size(1)}, nan, opts);
  auto rows = at::full({log_prob.size(0), kPgRowCols}, nan, opts);
  if (log_prob.size(0) == 0) return {loss_mat, rows};
  const at::Tensor w = defined_or_empty(weights);
  const at::Tensor undefined = new_undefined_flag(log_prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_rows_emu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_params<scalar_t, acc_t>(log_prob, old_log_prob, advantages, response_mask, w,
                                                            loss_mat, rows, undefined, clip_low, clip_high, clip_c,
                                                            loss_kind);
    emu::launch(policy_loss_rows_kernel<scalar_t, acc_t>, launch.grid, launch.block, 0, p);
    // The flag the emulated kernel set, checked as the CPU op checks it (the CUDA op asserts it asynchronously).
    if (*undefined.const_data_ptr<int32_t>() != 0) raise_undefined_policy_loss(p);
  });
  return {loss_mat, rows};
}

at::Tensor policy_loss_backward_emu(const c10::optional<at::Tensor>& grad_loss_mat,
                                    const c10::optional<at::Tensor>& grad_rows_loss, const at::Tensor& log_prob,
                                    const at::Tensor& old_log_prob, const at::Tensor& advantages,
                                    const at::Tensor& response_mask, const c10::optional<at::Tensor>& weights,
                                    double clip_low, double clip_high, double clip_c, int64_t loss_kind,
                                    int64_t threads, int64_t schedule, int64_t max_blocks) {
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind);
  const at::Tensor g_mat = defined_or_empty(grad_loss_mat);
  const at::Tensor g_rows = defined_or_empty(grad_rows_loss);
  check_policy_loss_grads(g_mat, g_rows, log_prob);
  const auto launch = policy_emu_launch(log_prob.size(0), log_prob.size(1), threads, schedule, max_blocks);
  auto grad = at::full({log_prob.size(0), log_prob.size(1)}, std::numeric_limits<double>::quiet_NaN(),
                       log_prob.options());
  if (log_prob.numel() == 0) return grad;
  const at::Tensor w = defined_or_empty(weights);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_backward_emu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_backward_params<scalar_t, acc_t>(g_mat, g_rows, log_prob, old_log_prob,
                                                                     advantages, response_mask, w, grad, clip_low,
                                                                     clip_high, clip_c, loss_kind);
    emu::launch(policy_loss_backward_kernel<scalar_t, acc_t>, launch.grid, launch.block, 0, p);
  });
  return grad;
}

}  // namespace

// A fragment: emu_logprob.cpp owns TORCH_LIBRARY(rollout_corr_emu), and every emu_*.cpp is one module.
TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def(
      "policy_loss_rows(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor response_mask, "
      "Tensor? weights, float clip_low, float clip_high, float clip_c, int loss_kind, int threads=0, "
      "int schedule=0, int max_blocks=0) -> (Tensor, Tensor)");
  m.def(
      "policy_loss_backward(Tensor? grad_loss_mat, Tensor? grad_rows_loss, Tensor log_prob, Tensor old_log_prob, "
      "Tensor advantages, Tensor response_mask, Tensor? weights, float clip_low, float clip_high, float clip_c, "
      "int loss_kind, int threads=0, int schedule=0, int max_blocks=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_corr_emu, CPU, m) {
  m.impl("policy_loss_rows", &policy_loss_rows_emu);
  m.impl("policy_loss_backward", &policy_loss_backward_emu);
}

}  // namespace rollout_corr
