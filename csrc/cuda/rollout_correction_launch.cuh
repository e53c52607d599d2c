// Host driver of the rollout-correction CUDA kernels, shared by the CUDA launchers (rollout_correction.cu) and
// the CUDA emulator's bindings (rollout_corr_testing/cuda_emulator/emu_rollout.cpp): boundary checks, outputs, scratch, params
// and launch shapes are decided here once; `launch(kernel, grid, block, params)` is the only backend-specific part.
// A .cuh (host code) so that the emulator's kernel-override folders, which copy csrc/cuda/*.cuh, carry it too:
// its "rollout_correction_kernels.cuh" include then resolves to the (mutated) copy next to it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "launch_config.h"
#include "rollout_correction_kernels.cuh"
#include "rollout_host.h"

namespace rollout_corr {

constexpr int64_t kRolloutMaxGrid = 1024;  // pass-2 scratch rows; blocks grid-stride over the remaining rows
constexpr int kReduceThreads = 256;

inline int rollout_block_threads(int64_t cols, int64_t threads_override) {
  return threads_override > 0 ? static_cast<int>(threads_override) : row_block_threads(cols, 1);
}

inline int64_t rollout_grid(int64_t rows, int64_t max_blocks) {
  int64_t g = std::max<int64_t>(1, std::min<int64_t>(rows, kRolloutMaxGrid));
  return max_blocks > 0 ? std::min(g, max_blocks) : g;
}

template <typename Launch>
at::Tensor run_rollout_seq_stats(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, at::ArrayRef<double> params, int64_t threads,
                                 int64_t max_blocks, Launch&& launch) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask, params);
  const auto lp = log_prob.contiguous(), rlp = rollout_log_prob.contiguous(), m = mask.contiguous();
  const int64_t B = lp.size(0), T = lp.size(1);
  const auto acc = lp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto out = at::empty({B, rc::kSeqCols}, lp.options().dtype(acc));
  if (B == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "rollout_seq_stats", [&] {
    using lp_t = scalar_t;
    using acc_t = at::opmath_type<lp_t>;
    RC_DISPATCH_MASK_TYPES(m.scalar_type(), "rollout_seq_stats_mask", [&] {
      using mask_t = scalar_t;
      RolloutParams<lp_t, mask_t, acc_t> p{};
      p.log_prob = lp.data_ptr<lp_t>();
      p.rollout_log_prob = rlp.data_ptr<lp_t>();
      p.mask = m.data_ptr<mask_t>();
      p.seq_stats = out.data_ptr<acc_t>();
      p.rows = B;
      p.cols = T;
      p.cfg = rc::decode_config<acc_t>(params.data(), static_cast<int64_t>(params.size()));
      launch(rollout_seq_stats_kernel<lp_t, mask_t, acc_t>, dim3(static_cast<unsigned>(rollout_grid(B, max_blocks))),
             dim3(rollout_block_threads(T, threads)), p);
    });
  });
  return out;
}

template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_rollout_token_pass(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const at::Tensor& seq_stats, at::ArrayRef<double> params, bool row_partials, int64_t threads, int64_t max_blocks,
    Launch&& launch) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask, params);
  check_seq_stats(seq_stats, log_prob);
  const auto lp = log_prob.contiguous(), rlp = rollout_log_prob.contiguous(), m = mask.contiguous();
  const auto st = seq_stats.contiguous();
  const int64_t B = lp.size(0), T = lp.size(1);
  const int num_rs = static_cast<int>(params[rc::kPNumRs]);
  const int64_t ns = rc::sum_size(num_rs), nm = rc::max_size(num_rs);
  const bool has_w = static_cast<int>(params[rc::kPIsLevel]) != rc::kIsNone;
  const auto acc = lp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto f64 = lp.options().dtype(at::kDouble);
  auto weights = has_w ? at::empty({B, T}, lp.options().dtype(acc)) : at::empty({0}, lp.options().dtype(acc));
  auto mask_out = at::empty_like(m);
  auto sums = at::zeros({ns}, f64);
  auto maxes = at::full({nm}, -std::numeric_limits<double>::infinity(), f64);
  if (B == 0) return {weights, mask_out, sums, maxes};
  const int64_t grid = rollout_grid(B, max_blocks);
  auto block_sums = at::zeros({grid, ns}, f64);
  auto block_maxes = at::full({grid, nm}, -std::numeric_limits<double>::infinity(), f64);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "rollout_token_pass", [&] {
    using lp_t = scalar_t;
    using acc_t = at::opmath_type<lp_t>;
    RC_DISPATCH_MASK_TYPES(m.scalar_type(), "rollout_token_pass_mask", [&] {
      using mask_t = scalar_t;
      RolloutParams<lp_t, mask_t, acc_t> p{};
      p.log_prob = lp.data_ptr<lp_t>();
      p.rollout_log_prob = rlp.data_ptr<lp_t>();
      p.mask = m.data_ptr<mask_t>();
      p.seq_stats = st.data_ptr<acc_t>();
      p.weights = has_w ? weights.data_ptr<acc_t>() : nullptr;
      p.mask_out = mask_out.data_ptr<mask_t>();
      p.block_sums = block_sums.data_ptr<double>();
      p.block_maxes = block_maxes.data_ptr<double>();
      p.rows = B;
      p.cols = T;
      p.num_sums = ns;
      p.num_maxes = nm;
      p.row_partials = row_partials;
      p.cfg = rc::decode_config<acc_t>(params.data(), static_cast<int64_t>(params.size()));
      launch(rollout_token_pass_kernel<lp_t, mask_t, acc_t>, dim3(static_cast<unsigned>(grid)),
             dim3(rollout_block_threads(T, threads)), p);
    });
  });
  RolloutReduceParams r{block_sums.data_ptr<double>(), block_maxes.data_ptr<double>(), grid, ns, nm,
                        sums.data_ptr<double>(), maxes.data_ptr<double>()};
  const auto reduce_blocks = static_cast<unsigned>((ns + nm + kReduceThreads - 1) / kReduceThreads);
  launch(rollout_reduce_partials_kernel, dim3(reduce_blocks), dim3(kReduceThreads), r);
  return {weights, mask_out, sums, maxes};
}

}  // namespace rollout_corr
