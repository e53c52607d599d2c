// CUDA launchers of the vocab-parallel log-prob op: boundary checks, params, launch on the current stream.
// Device code: logprob_kernels.cuh (shared with the CUDA emulator).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "logprob_host.h"
#include "launch_config.h"
#include "logprob_kernels.cuh"

namespace rollout_corr {
namespace {

template <typename scalar_t, typename acc_t>
void launch_row_stats(const RowStatsParams<scalar_t, acc_t>& p, int vec, cudaStream_t stream) {
  const int threads = row_block_threads(p.valid_cols, vec);
  const auto blocks = static_cast<unsigned>(row_grid_blocks(p.rows));
  constexpr int kWide = 16 / sizeof(scalar_t);
  if (vec == kWide) {
    vocab_row_stats_kernel<scalar_t, acc_t, kWide><<<blocks, threads, 0, stream>>>(p);
  } else {
    vocab_row_stats_kernel<scalar_t, acc_t, 1><<<blocks, threads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename acc_t>
void launch_backward(const LogprobBackwardParams<scalar_t, acc_t>& p, int vec, cudaStream_t stream) {
  const int threads = row_block_threads(p.local_vocab, vec);
  const auto blocks = static_cast<unsigned>(row_grid_blocks(p.rows));
  constexpr int kWide = 16 / sizeof(scalar_t);
  if (vec == kWide) {
    logprob_backward_kernel<scalar_t, acc_t, kWide><<<blocks, threads, 0, stream>>>(p);
  } else {
    logprob_backward_kernel<scalar_t, acc_t, 1><<<blocks, threads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor vocab_row_stats_cuda(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto target_c = target.contiguous();
  auto stats = new_row_stats(logits, with_sum_z);
  if (logits.size(0) == 0) return stats;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_row_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_row_stats_params<scalar_t, acc_t>(logits, target_c, stats, vocab_start, vocab_size,
                                                          inv_temperature, ignore_index);
    launch_row_stats(p, pick_vec_width<scalar_t>(p.logits, p.logits_row_stride), stream);
  });
  return stats;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_row_stats_cuda(const at::Tensor& stats,
                                                                                const at::Tensor& target,
                                                                                int64_t ignore_index,
                                                                                int64_t vocab_size) {
  const c10::cuda::CUDAGuard guard(stats.device());
  const MergeIO io = prepare_merge(stats, target, vocab_size);
  const int64_t rows = stats.size(1);
  if (rows == 0) return {io.logp, io.entropy, io.mean_logp, io.row_state};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "merge_row_stats_cuda", [&] {
    const auto p = make_merge_params<scalar_t>(io.stats, io.target, io.logp, io.entropy, io.mean_logp, io.row_state,
                                               ignore_index, vocab_size);
    const int64_t blocks = std::min<int64_t>((rows + kMergeThreads - 1) / kMergeThreads, 65535);
    merge_row_stats_kernel<scalar_t><<<static_cast<unsigned>(blocks), kMergeThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {io.logp, io.entropy, io.mean_logp, io.row_state};
}

void logprob_backward_into_cuda(const at::Tensor& grad_logits, const c10::optional<at::Tensor>& grad_logp,
                                const c10::optional<at::Tensor>& grad_entropy,
                                const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature, int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto in = prepare_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                                   vocab_size, inv_temperature);
  if (logits.size(0) == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "logprob_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_backward_params<scalar_t, acc_t>(grad_logits, logits, in.target, in.state, in.g_lp, in.g_h,
                                                         in.g_m, vocab_start, vocab_size, inv_temperature,
                                                         ignore_index);
    const int vec = std::min(pick_vec_width<scalar_t>(p.logits, p.logits_row_stride),
                             pick_vec_width<scalar_t>(p.grad_logits, p.grad_row_stride));
    launch_backward(p, vec, stream);
  });
}

at::Tensor logprob_backward_cuda(const c10::optional<at::Tensor>& grad_logp,
                                 const c10::optional<at::Tensor>& grad_entropy,
                                 const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                 const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                 int64_t vocab_size, double inv_temperature, int64_t ignore_index) {
  auto grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  logprob_backward_into_cuda(grad, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
                             vocab_start, vocab_size, inv_temperature, ignore_index);
  return grad;
}

void logprob_backward_inplace_cuda(const at::Tensor& logits, const c10::optional<at::Tensor>& grad_logp,
                                   const c10::optional<at::Tensor>& grad_entropy,
                                   const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& target,
                                   const at::Tensor& row_state, int64_t vocab_start, int64_t vocab_size,
                                   double inv_temperature, int64_t ignore_index) {
  logprob_backward_into_cuda(logits, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
                             vocab_start, vocab_size, inv_temperature, ignore_index);
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("vocab_row_stats", &vocab_row_stats_cuda);
  m.impl("merge_row_stats", &merge_row_stats_cuda);
  m.impl("logprob_backward", &logprob_backward_cuda);
  m.impl("logprob_backward_", &logprob_backward_inplace_cuda);
}

}  // namespace rollout_corr
