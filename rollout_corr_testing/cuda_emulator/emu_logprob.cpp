// Emulated CUDA launchers of the log-prob kernel family: the very kernels of csrc/cuda/logprob_kernels.cuh,
// compiled by g++ against cuda_emu.h and exposed as CPU ops torch.ops.rollout_corr_emu.*. They take the
// arguments of the real ops plus knobs the tests sweep: `threads` (0 = the launcher's choice), `vec`
// (0 = the launcher's choice, else 1 or the 16-byte width) and `schedule` (0 ascending, 1 descending).
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "logprob_host.h"
#include "launch_config.h"
#include "logprob_kernels.cuh"

namespace rollout_corr {
namespace {

struct EmuKnobs {
  int64_t threads, vec, schedule;
};

void apply_schedule(int64_t schedule) {
  TORCH_CHECK(schedule == 0 || schedule == 1, "schedule must be 0 (ascending) or 1 (descending)");
  emu::set_schedule(schedule == 0 ? emu::Schedule::kAscending : emu::Schedule::kDescending);
}

template <typename scalar_t>
int choose_vec(int64_t vec, int launcher_choice) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  if (vec == 0) return launcher_choice;
  TORCH_CHECK(vec == 1 || vec == kWide, "vec must be 0, 1 or ", kWide);
  TORCH_CHECK(vec == 1 || launcher_choice == kWide, "vec=", vec, " needs 16-byte aligned rows");
  return static_cast<int>(vec);
}

int choose_threads(int64_t threads, int launcher_choice) {
  if (threads == 0) return launcher_choice;
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0, "threads must be a multiple of 32 in [32, 1024]");
  return static_cast<int>(threads);
}

// Emulated grids are capped so a test can ask for fewer blocks than rows (exercising the grid-stride loops).
dim3 row_grid(int64_t rows, int64_t max_blocks) {
  const int64_t blocks = row_grid_blocks(rows);
  return dim3(static_cast<unsigned>(max_blocks > 0 ? std::min(blocks, max_blocks) : blocks));
}

at::Tensor vocab_row_stats_emu(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z,
                               int64_t threads, int64_t vec, int64_t schedule, int64_t max_blocks) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  apply_schedule(schedule);
  const auto target_c = target.contiguous();
  auto stats = new_row_stats(logits, with_sum_z);
  if (logits.size(0) == 0) return stats;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_row_stats_emu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_row_stats_params<scalar_t, acc_t>(logits, target_c, stats, vocab_start, vocab_size,
                                                          inv_temperature, ignore_index);
    constexpr int kWide = 16 / sizeof(scalar_t);
    const int v = choose_vec<scalar_t>(vec, pick_vec_width<scalar_t>(p.logits, p.logits_row_stride));
    const int t = choose_threads(threads, row_block_threads(p.valid_cols, v));
    if (v == kWide) {
      emu::launch(vocab_row_stats_kernel<scalar_t, acc_t, kWide>, row_grid(p.rows, max_blocks), dim3(t), 0, p);
    } else {
      emu::launch(vocab_row_stats_kernel<scalar_t, acc_t, 1>, row_grid(p.rows, max_blocks), dim3(t), 0, p);
    }
  });
  return stats;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_row_stats_emu(const at::Tensor& stats,
                                                                               const at::Tensor& target,
                                                                               int64_t ignore_index, int64_t vocab_size,
                                                                               int64_t threads, int64_t schedule) {
  apply_schedule(schedule);
  const MergeIO io = prepare_merge(stats, target, vocab_size);
  const int64_t rows = stats.size(1);
  if (rows == 0) return {io.logp, io.entropy, io.mean_logp, io.row_state};
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "merge_row_stats_emu", [&] {
    const auto p = make_merge_params<scalar_t>(io.stats, io.target, io.logp, io.entropy, io.mean_logp, io.row_state,
                                               ignore_index, vocab_size);
    const int t = choose_threads(threads, kMergeThreads);
    const int64_t blocks = std::min<int64_t>((rows + t - 1) / t, 65535);
    emu::launch(merge_row_stats_kernel<scalar_t>, dim3(static_cast<unsigned>(blocks)), dim3(t), 0, p);
  });
  return {io.logp, io.entropy, io.mean_logp, io.row_state};
}

void logprob_backward_into_emu(const at::Tensor& grad_logits, const c10::optional<at::Tensor>& grad_logp,
                               const c10::optional<at::Tensor>& grad_entropy,
                               const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                               const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index, int64_t threads,
                               int64_t vec, int64_t schedule, int64_t max_blocks) {
  const auto in = prepare_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                                   vocab_size, inv_temperature);
  apply_schedule(schedule);
  if (logits.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "logprob_backward_emu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_backward_params<scalar_t, acc_t>(grad_logits, logits, in.target, in.state, in.g_lp, in.g_h,
                                                         in.g_m, vocab_start, vocab_size, inv_temperature,
                                                         ignore_index);
    constexpr int kWide = 16 / sizeof(scalar_t);
    const int launcher_vec = std::min(pick_vec_width<scalar_t>(p.logits, p.logits_row_stride),
                                      pick_vec_width<scalar_t>(p.grad_logits, p.grad_row_stride));
    const int v = choose_vec<scalar_t>(vec, launcher_vec);
    const int t = choose_threads(threads, row_block_threads(p.local_vocab, v));
    if (v == kWide) {
      emu::launch(logprob_backward_kernel<scalar_t, acc_t, kWide>, row_grid(p.rows, max_blocks), dim3(t), 0, p);
    } else {
      emu::launch(logprob_backward_kernel<scalar_t, acc_t, 1>, row_grid(p.rows, max_blocks), dim3(t), 0, p);
    }
  });
}

at::Tensor logprob_backward_emu(const c10::optional<at::Tensor>& grad_logp,
                                const c10::optional<at::Tensor>& grad_entropy,
                                const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature, int64_t ignore_index, int64_t threads,
                                int64_t vec, int64_t schedule, int64_t max_blocks) {
  // Poisoned output: any element the kernel forgets to write shows up as NaN.
  auto grad = at::full_like(logits, std::numeric_limits<double>::quiet_NaN(), at::MemoryFormat::Contiguous);
  logprob_backward_into_emu(grad, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index, threads, vec, schedule, max_blocks);
  return grad;
}

void logprob_backward_inplace_emu(const at::Tensor& logits, const c10::optional<at::Tensor>& grad_logp,
                                  const c10::optional<at::Tensor>& grad_entropy,
                                  const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& target,
                                  const at::Tensor& row_state, int64_t vocab_start, int64_t vocab_size,
                                  double inv_temperature, int64_t ignore_index, int64_t threads, int64_t vec,
                                  int64_t schedule, int64_t max_blocks) {
  logprob_backward_into_emu(logits, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index, threads, vec, schedule, max_blocks);
}

}  // namespace

TORCH_LIBRARY(rollout_corr_emu, m) {
  m.def(
      "vocab_row_stats(Tensor logits, Tensor target, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index, bool with_sum_z, int threads=0, int vec=0, int schedule=0, int max_blocks=0) -> Tensor");
  m.def(
      "merge_row_stats(Tensor stats, Tensor target, int ignore_index, int vocab_size, int threads=0, "
      "int schedule=0) -> (Tensor, Tensor, Tensor, Tensor)");
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
