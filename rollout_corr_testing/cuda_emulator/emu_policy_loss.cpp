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
#include "policy_loss_launch.cuh"

namespace rollout_corr {
namespace {

LaunchKnobs emu_knobs(int64_t threads, int64_t schedule, int64_t max_blocks) {
  apply_schedule(schedule);
  LaunchKnobs k;
  k.threads = threads;
  k.max_blocks = max_blocks;
  return k;
}

std::tuple<at::Tensor, at::Tensor> policy_loss_rows_emu(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                        const at::Tensor& advantages, const at::Tensor& response_mask,
                                                        const c10::optional<at::Tensor>& weights, double clip_low,
                                                        double clip_high, double clip_c, int64_t loss_kind,
                                                        const c10::optional<at::Tensor>& cu_seqlens, double param_a,
                                                        double param_b, bool with_loss_mat, int64_t threads,
                                                        int64_t schedule, int64_t max_blocks) {
  return run_policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                              loss_kind, cu_seqlens, param_a, param_b, with_loss_mat, emu_knobs(threads, schedule, max_blocks), OutputInit::kPoisoned,
                              EmuLaunch{});
}

at::Tensor policy_loss_backward_emu(const c10::optional<at::Tensor>& grad_loss_mat,
                                    const c10::optional<at::Tensor>& grad_rows_loss, const at::Tensor& log_prob,
                                    const at::Tensor& old_log_prob, const at::Tensor& advantages,
                                    const at::Tensor& response_mask, const c10::optional<at::Tensor>& weights,
                                    double clip_low, double clip_high, double clip_c, int64_t loss_kind,
                                    const c10::optional<at::Tensor>& cu_seqlens, double param_a, double param_b, int64_t threads, int64_t schedule,
                                    int64_t max_blocks) {
  return run_policy_loss_backward(grad_loss_mat, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask,
                                  weights, clip_low, clip_high, clip_c, loss_kind, cu_seqlens, param_a, param_b,
                                  emu_knobs(threads, schedule, max_blocks), OutputInit::kPoisoned, EmuLaunch{});
}

}  // namespace

// A fragment: emu_logprob.cpp owns TORCH_LIBRARY(rollout_corr_emu), and every emu_*.cpp is one module.
TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def(
      "policy_loss_rows(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor response_mask, "
      "Tensor? weights, float clip_low, float clip_high, float clip_c, int loss_kind, Tensor? cu_seqlens=None, "
      "float param_a=0., float param_b=0., bool with_loss_mat=True, int threads=0, int schedule=0, "
      "int max_blocks=0) -> (Tensor, Tensor)");
  m.def(
      "policy_loss_backward(Tensor? grad_loss_mat, Tensor? grad_rows_loss, Tensor log_prob, Tensor old_log_prob, "
      "Tensor advantages, Tensor response_mask, Tensor? weights, float clip_low, float clip_high, float clip_c, "
      "int loss_kind, Tensor? cu_seqlens=None, float param_a=0., float param_b=0., int threads=0, int schedule=0, "
      "int max_blocks=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_corr_emu, CPU, m) {
  m.impl("policy_loss_rows", &policy_loss_rows_emu);
  m.impl("policy_loss_backward", &policy_loss_backward_emu);
}

}  // namespace rollout_corr
