// Host driver of the log-prob CUDA kernels, shared by the CUDA launchers (logprob.cu) and the CUDA emulator's
// bindings (rollout_corr_testing/cuda_emulator/emu_logprob.cpp): boundary checks, outputs, params and launch shapes
// (threads, blocks, vector width) are decided here once, so the emulator runs the launchers' real decisions;
// `launch(kernel, grid, block, params)` is the only backend-specific part. A .cuh (host code) so that the
// emulator's kernel-override folders, which copy csrc/cuda/*.cuh, carry it too.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <tuple>

#include "launch_config.h"
#include "logprob_host.h"
#include "logprob_kernels.cuh"

namespace rollout_corr {

constexpr int kHeaderThreads = 256;

// The vector width of a launch: 16-byte accesses when every row is 16-byte aligned. A test may force 1, or the
// wide width where alignment allows it.
template <typename scalar_t>
int logprob_vec_width(int aligned_width, const LaunchKnobs& k) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  if (k.vec == 0) return aligned_width;
  TORCH_CHECK(k.vec == 1 || k.vec == kWide, "vec must be 0, 1 or ", kWide, ", got ", k.vec);
  TORCH_CHECK(k.vec == 1 || aligned_width == kWide, "vec=", k.vec, " needs 16-byte aligned rows");
  return static_cast<int>(k.vec);
}

inline int logprob_threads(int64_t cols, int vec, const LaunchKnobs& k) {
  if (k.threads == 0) return row_block_threads(cols, vec);
  TORCH_CHECK(k.threads >= 32 && k.threads <= 1024 && k.threads % 32 == 0,
              "threads must be a multiple of 32 in [32, 1024], got ", k.threads);
  return static_cast<int>(k.threads);
}

template <typename Launch>
at::Tensor run_vocab_row_stats(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z,
                               bool with_entropy, const LaunchKnobs& knobs, Launch&& launch) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  const auto target_c = target.contiguous();
  auto record = new_shard_record(logits, with_sum_z);
  launch(shard_header_kernel, dim3(1), dim3(kHeaderThreads),
         make_shard_header_params(record, target_c, logits, vocab_start, vocab_size, inv_temperature,
                                  ignore_index, with_sum_z, with_entropy));
  if (logits.size(0) == 0) return record;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_row_stats", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    constexpr int kWide = 16 / sizeof(scalar_t);
    const auto p = make_row_stats_params<scalar_t, acc_t>(logits, target_c, record, vocab_start, vocab_size,
                                                          inv_temperature, ignore_index, with_sum_z);
    const int vec = logprob_vec_width<scalar_t>(pick_vec_width<scalar_t>(p.logits, p.logits_row_stride), knobs);
    const dim3 grid(static_cast<unsigned>(capped_grid(row_grid_blocks(p.rows), knobs)));
    const dim3 block(logprob_threads(p.valid_cols, vec, knobs));
    if (vec == kWide) {
      if (with_sum_z) launch(vocab_row_stats_kernel<scalar_t, acc_t, kWide, true>, grid, block, p);
      else launch(vocab_row_stats_kernel<scalar_t, acc_t, kWide, false>, grid, block, p);
    } else {
      if (with_sum_z) launch(vocab_row_stats_kernel<scalar_t, acc_t, 1, true>, grid, block, p);
      else launch(vocab_row_stats_kernel<scalar_t, acc_t, 1, false>, grid, block, p);
    }
  });
  return record;
}

template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_merge_row_stats(
    const at::Tensor& gathered, const at::Tensor& target, int64_t ignore_index, int64_t vocab_size,
    double inv_temperature, bool with_sum_z, const LaunchKnobs& knobs, Launch&& launch) {
  MergeIO io = prepare_merge(gathered, target, vocab_size, inv_temperature, with_sum_z);
  const int64_t rows = io.target.size(0);
  AT_DISPATCH_FLOATING_TYPES(io.gathered.scalar_type(), "merge_row_stats", [&] {
    const auto p = make_merge_params<scalar_t>(io, ignore_index, vocab_size, inv_temperature, true);
    const int threads = knobs.threads > 0 ? logprob_threads(rows, 1, knobs) : kMergeThreads;
    // At least one block: its first thread checks the shard headers even when there are no rows.
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((rows + threads - 1) / threads, 65535));
    launch(merge_row_stats_kernel<scalar_t>, dim3(static_cast<unsigned>(capped_grid(blocks, knobs))), dim3(threads),
           p);
  });
  return {io.logp, io.entropy, io.mean_logp, io.row_state, io.status};
}

template <typename Launch>
void run_logprob_backward_into(const at::Tensor& grad_logits, const c10::optional<at::Tensor>& grad_logp,
                               const c10::optional<at::Tensor>& grad_entropy,
                               const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                               const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                               const LaunchKnobs& knobs, Launch&& launch) {
  const auto in = prepare_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                                   vocab_size, inv_temperature);
  if (logits.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "logprob_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    constexpr int kWide = 16 / sizeof(scalar_t);
    const auto p = make_backward_params<scalar_t, acc_t>(grad_logits, logits, in.target, in.state, in.g_lp, in.g_h,
                                                         in.g_m, vocab_start, vocab_size, inv_temperature,
                                                         ignore_index);
    const int aligned = std::min(pick_vec_width<scalar_t>(p.logits, p.logits_row_stride),
                                 pick_vec_width<scalar_t>(p.grad_logits, p.grad_row_stride));
    const int vec = logprob_vec_width<scalar_t>(aligned, knobs);
    const dim3 grid(static_cast<unsigned>(capped_grid(row_grid_blocks(p.rows), knobs)));
    const dim3 block(logprob_threads(p.local_vocab, vec, knobs));
    if (vec == kWide) launch(logprob_backward_kernel<scalar_t, acc_t, kWide>, grid, block, p);
    else launch(logprob_backward_kernel<scalar_t, acc_t, 1>, grid, block, p);
  });
}

}  // namespace rollout_corr
