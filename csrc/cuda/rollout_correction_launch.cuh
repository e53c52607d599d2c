// Launch planning and host driver of the rollout-correction CUDA kernels, shared by the CUDA launchers
// (rollout_correction.cu) and the CUDA emulator's bindings (rollout_corr_testing/cuda_emulator/
// emu_rollout_correction.cpp): boundary checks, outputs, scratch, params and launch shapes are decided here once;
// `launch(kernel, grid, block, params)` is the only backend-specific part. A .cuh (host code) so that the
// emulator's kernel-override folders, which copy csrc/cuda/*.cuh, carry it too: its "rollout_correction_kernels.cuh"
// include then resolves to the (mutated) copy next to it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "launch_config.h"
#include "rollout_correction_host.h"
#include "rollout_correction_kernels.cuh"

namespace rollout_corr {

constexpr int64_t kRolloutMaxGrid = 1024;  // pass-2 scratch rows; blocks grid-stride over the remaining rows
constexpr int kReduceThreads = 256;

// One block per row, threads to cover the row in one sweep (a power of two in [32, 512]); at most
// kRolloutMaxGrid blocks. knobs: the emulator's overrides (0 = this choice).
struct RolloutLaunchPlan {
  dim3 grid, block;
};
inline RolloutLaunchPlan plan_rollout_launch(int64_t rows, int64_t cols, const LaunchKnobs& knobs) {
  const int threads = knobs.threads > 0 ? static_cast<int>(knobs.threads) : row_block_threads(cols, 1);
  const int64_t blocks = capped_grid(std::max<int64_t>(1, std::min<int64_t>(rows, kRolloutMaxGrid)), knobs);
  return {dim3(static_cast<unsigned>(blocks)), dim3(threads)};
}

template <typename Launch>
at::Tensor run_rollout_seq_stats(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, const c10::optional<at::Tensor>& cu_seqlens,
                                 const RolloutConfigArgs& a, const LaunchKnobs& knobs, Launch&& launch) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask);
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);
  const auto acc = rollout_acc_dtype(log_prob, rollout_log_prob);
  auto out = at::empty({layout.rows, rc::seq::kCols}, log_prob.options().dtype(acc));
  if (layout.rows == 0) return out;
  RC_DISPATCH_ROLLOUT_ACC(acc, "rollout_seq_stats", [&] {
    auto p = make_rollout_params<acc_t>(log_prob, rollout_log_prob, mask, layout, a);
    p.seq_stats = out.mutable_data_ptr<acc_t>();
    const RolloutLaunchPlan plan =
        plan_rollout_launch(p.rows, tokens_per_sequence(layout), knobs);
    launch(rollout_seq_stats_kernel<acc_t>, plan.grid, plan.block, p);
  });
  return out;
}

template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_rollout_token_pass(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& seq_stats, const RolloutConfigArgs& a,
    bool row_partials, const LaunchKnobs& knobs, Launch&& launch) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask);
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);
  const auto acc = rollout_acc_dtype(log_prob, rollout_log_prob);
  check_seq_stats(seq_stats, layout.rows, log_prob, acc);
  const auto st = seq_stats.contiguous();
  RolloutPassOutputs o = new_rollout_pass_outputs(log_prob, mask, acc, a);
  if (layout.rows == 0) return {o.weights, o.mask_out, o.sums, o.maxes};
  const int64_t ns = o.sums.numel(), nm = o.maxes.numel();
  const RolloutLaunchPlan plan =
      plan_rollout_launch(layout.rows, tokens_per_sequence(layout), knobs);
  const int64_t grid = plan.grid.x;
  const auto f64 = log_prob.options().dtype(at::kDouble);
  auto block_sums = at::zeros({grid, ns}, f64);
  auto block_maxes = at::full({grid, nm}, -std::numeric_limits<double>::infinity(), f64);
  RC_DISPATCH_ROLLOUT_ACC(acc, "rollout_token_pass", [&] {
    auto p = make_rollout_params<acc_t>(log_prob, rollout_log_prob, mask, layout, a);
    p.seq_stats = const_cast<acc_t*>(st.const_data_ptr<acc_t>());
    p.weights = o.weights.numel() > 0 ? o.weights.mutable_data_ptr<acc_t>() : nullptr;
    p.mask_out = mutable_token_view(o.mask_out);
    p.block_sums = block_sums.mutable_data_ptr<double>();
    p.block_maxes = block_maxes.mutable_data_ptr<double>();
    p.row_partials = row_partials;
    launch(rollout_token_pass_kernel<acc_t>, plan.grid, plan.block, p);
  });
  RolloutReduceParams r{block_sums.const_data_ptr<double>(), block_maxes.const_data_ptr<double>(), grid, ns, nm,
                        o.sums.mutable_data_ptr<double>(), o.maxes.mutable_data_ptr<double>()};
  const auto reduce_blocks = static_cast<unsigned>((ns + nm + kReduceThreads - 1) / kReduceThreads);
  launch(rollout_reduce_partials_kernel, dim3(reduce_blocks), dim3(kReduceThreads), r);
  return {o.weights, o.mask_out, o.sums, o.maxes};
}

}  // namespace rollout_corr
