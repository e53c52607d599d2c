// Emulated CUDA launchers of the rollout-correction kernel family: the very kernels of
// csrc/cuda/rollout_correction_kernels.cuh, compiled by g++ against cuda_emu.h, through the same host driver as
// the CUDA launchers (rollout_correction_launch.cuh), exposed as CPU ops torch.ops.rollout_corr_emu.rollout_*.
// Knobs the tests sweep: `threads` (0 = the launcher's choice), `schedule` (0 ascending, 1 descending) and
// `max_blocks` (0 = the launcher's grid; smaller exercises the grid-stride loops and several scratch rows).
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <torch/library.h>

#include "rollout_correction_launch.cuh"

namespace rollout_corr {
namespace {

struct EmuLaunch {
  template <typename Kernel, typename Params>
  void operator()(Kernel kernel, dim3 grid, dim3 block, const Params& p) const {
    emu::launch(kernel, grid, block, 0, p);
  }
};

void set_schedule(int64_t schedule) {
  TORCH_CHECK(schedule == 0 || schedule == 1, "schedule must be 0 (ascending) or 1 (descending)");
  emu::set_schedule(schedule == 0 ? emu::Schedule::kAscending : emu::Schedule::kDescending);
}

void check_threads(int64_t threads) {
  TORCH_CHECK(threads == 0 || (threads >= 32 && threads <= 1024 && threads % 32 == 0),
              "threads must be 0 or a multiple of 32 in [32, 1024]");
}

at::Tensor rollout_seq_stats_emu(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, at::ArrayRef<double> params, int64_t threads,
                                 int64_t schedule, int64_t max_blocks) {
  check_threads(threads);
  set_schedule(schedule);
  return run_rollout_seq_stats(log_prob, rollout_log_prob, mask, params, threads, max_blocks, EmuLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rollout_token_pass_emu(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const at::Tensor& seq_stats, at::ArrayRef<double> params, bool row_partials, int64_t threads, int64_t schedule,
    int64_t max_blocks) {
  check_threads(threads);
  set_schedule(schedule);
  return run_rollout_token_pass(log_prob, rollout_log_prob, mask, seq_stats, params, row_partials, threads,
                                max_blocks, EmuLaunch{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def(
      "rollout_seq_stats(Tensor log_prob, Tensor rollout_log_prob, Tensor mask, float[] params, int threads=0, "
      "int schedule=0, int max_blocks=0) -> Tensor");
  m.def(
      "rollout_token_pass(Tensor log_prob, Tensor rollout_log_prob, Tensor mask, Tensor seq_stats, float[] params, "
      "bool row_partials, int threads=0, int schedule=0, int max_blocks=0) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollout_corr_emu, CPU, m) {
  m.impl("rollout_seq_stats", &rollout_seq_stats_emu);
  m.impl("rollout_token_pass", &rollout_token_pass_emu);
}

}  // namespace rollout_corr
