// CUDA launchers of the vocab-parallel log-prob op: device guard, current stream, launch checks. Checks, outputs,
// params and launch shapes: logprob_launch.cuh (shared with the CUDA emulator); device code: logprob_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_launch.cuh"
#include "logprob_launch.cuh"

namespace rollout_corr {
namespace {

at::Tensor vocab_row_stats_cuda(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z,
                                bool with_entropy) {
  const c10::cuda::CUDAGuard guard(logits.device());
  // The CUDA kernel is bound by memory, not by the entropy's FMA: it takes the sums either way (with_entropy only
  // sets the header flag, so the merge behaves as on every backend).
  return run_vocab_row_stats(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index, with_sum_z,
                             with_entropy, LaunchKnobs{}, current_stream_launch());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_row_stats_cuda(
    const at::Tensor& gathered, const at::Tensor& target, int64_t ignore_index, int64_t vocab_size,
    double inv_temperature, bool with_sum_z) {
  const c10::cuda::CUDAGuard guard(gathered.device());
  return run_merge_row_stats(gathered, target, ignore_index, vocab_size, inv_temperature, with_sum_z, LaunchKnobs{},
                             current_stream_launch());
}

at::Tensor logprob_backward_cuda(const c10::optional<at::Tensor>& grad_logp,
                                 const c10::optional<at::Tensor>& grad_entropy,
                                 const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                 const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                 int64_t vocab_size, double inv_temperature, int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  auto grad = at::empty({logits.size(0), logits.size(1)}, logits.options());
  run_logprob_backward_into(grad, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index, LaunchKnobs{}, current_stream_launch());
  return grad;
}

void logprob_backward_inplace_cuda(const at::Tensor& logits, const c10::optional<at::Tensor>& grad_logp,
                                   const c10::optional<at::Tensor>& grad_entropy,
                                   const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& target,
                                   const at::Tensor& row_state, int64_t vocab_start, int64_t vocab_size,
                                   double inv_temperature, int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  check_inplace_target(logits);
  run_logprob_backward_into(logits, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index, LaunchKnobs{}, current_stream_launch());
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("vocab_row_stats", &vocab_row_stats_cuda);
  m.impl("merge_row_stats", &merge_row_stats_cuda);
  m.impl("logprob_backward", &logprob_backward_cuda);
  m.impl("logprob_backward_", &logprob_backward_inplace_cuda);
}

}  // namespace rollout_corr
