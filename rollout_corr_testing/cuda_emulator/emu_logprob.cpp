// Emulated CUDA launchers of the log-prob kernel family: the very kernels of csrc/cuda/logprob_kernels.cuh, compiled
// by g++ against cuda_emu.h, through the same host driver as the CUDA launchers (logprob_launch.cuh), exposed as
// CPU ops torch.ops.rollout_corr_emu.*. They take the arguments of the real ops plus knobs the tests sweep:
// `threads` (0 = the launcher's choice), `vec` (0 = the launcher's choice, else 1 or the 16-byte width),
// `schedule` (0 ascending, 1 descending) and `max_blocks` (0 = the launcher's grid).
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>

#include "emu_launch.h"
#include "logprob_launch.cuh"

namespace rollout_corr {
namespace {

at::Tensor vocab_row_stats_emu(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z,
                               bool with_entropy, int64_t threads, int64_t vec, int64_t schedule, int64_t max_blocks) {
  apply_schedule(schedule);
  return run_vocab_row_stats(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index, with_sum_z,
                             with_entropy, LaunchKnobs{threads, vec, max_blocks}, EmuLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_row_stats_emu(
    const at::Tensor& gathered, const at::Tensor& target, int64_t ignore_index, int64_t vocab_size,
    double inv_temperature, bool with_sum_z, int64_t threads, int64_t schedule, int64_t max_blocks) {
  apply_schedule(schedule);
  return run_merge_row_stats(gathered, target, ignore_index, vocab_size, inv_temperature, with_sum_z,
                             LaunchKnobs{threads, 0, max_blocks}, EmuLaunch{});
}

at::Tensor logprob_backward_emu(const c10::optional<at::Tensor>& grad_logp,
                                const c10::optional<at::Tensor>& grad_entropy,
                                const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature, int64_t ignore_index, int64_t threads,
                                int64_t vec, int64_t schedule, int64_t max_blocks) {
  apply_schedule(schedule);
  // Poisoned output: any element the kernel forgets to write shows up as NaN.
  auto grad = at::full({logits.size(0), logits.size(1)}, std::numeric_limits<double>::quiet_NaN(), logits.options());
  run_logprob_backward_into(grad, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index, LaunchKnobs{threads, vec, max_blocks},
                            EmuLaunch{});
  return grad;
}

void logprob_backward_inplace_emu(const at::Tensor& logits, const c10::optional<at::Tensor>& grad_logp,
                                  const c10::optional<at::Tensor>& grad_entropy,
                                  const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& target,
                                  const at::Tensor& row_state, int64_t vocab_start, int64_t vocab_size,
                                  double inv_temperature, int64_t ignore_index, int64_t threads, int64_t vec,
                                  int64_t schedule, int64_t max_blocks) {
  apply_schedule(schedule);
  check_inplace_target(logits);
  run_logprob_backward_into(logits, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index, LaunchKnobs{threads, vec, max_blocks},
                            EmuLaunch{});
}

}  // namespace

TORCH_LIBRARY(rollout_corr_emu, m) {
  m.def(
      "vocab_row_stats(Tensor logits, Tensor target, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index, bool with_sum_z, bool with_entropy=True, int threads=0, int vec=0, int schedule=0, "
      "int max_blocks=0) -> Tensor");
  m.def(
      "merge_row_stats(Tensor gathered, Tensor target, int ignore_index, int vocab_size, float inv_temperature, "
      "bool with_sum_z, int threads=0, int schedule=0, int max_blocks=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "logprob_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor? grad_mean_logp, Tensor logits, "
      "Tensor target, Tensor row_state, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index, int threads=0, int vec=0, int schedule=0, int max_blocks=0) -> Tensor");
  m.def(
      "logprob_backward_(Tensor(a!) logits, Tensor? grad_logp, Tensor? grad_entropy, Tensor? grad_mean_logp, "
      "Tensor target, Tensor row_state, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index, int threads=0, int vec=0, int schedule=0, int max_blocks=0) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_corr_emu, CPU, m) {
  m.impl("vocab_row_stats", &vocab_row_stats_emu);
  m.impl("merge_row_stats", &merge_row_stats_emu);
  m.impl("logprob_backward", &logprob_backward_emu);
  m.impl("logprob_backward_", &logprob_backward_inplace_emu);
}

}  // namespace rollout_corr
