// Emulated CUDA launchers of the rollout-correction kernel family: the very kernels of
// csrc/cuda/rollout_correction_kernels.cuh, compiled by g++ against cuda_emu.h, through the same host driver and
// launch planning as the CUDA launchers (rollout_correction_launch.cuh), exposed as CPU ops
// torch.ops.rollout_corr_emu.rollout_* with the schemas of torch.ops.rollout_corr.rollout_* plus knobs the tests
// sweep: `threads` (0 = the launcher's choice), `schedule` (0 ascending, 1 descending) and `max_blocks`
// (0 = the launcher's grid; smaller exercises the grid-stride loops and several scratch rows).
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <torch/library.h>

#include "emu_launch.h"
#include "rollout_correction_launch.cuh"

namespace rollout_corr {
namespace {

LaunchKnobs emu_knobs(int64_t threads, int64_t schedule, int64_t max_blocks) {
  TORCH_CHECK(threads == 0 || (threads >= 32 && threads <= 1024 && threads % 32 == 0),
              "threads must be 0 or a multiple of 32 in [32, 1024]");
  apply_schedule(schedule);
  LaunchKnobs k;
  k.threads = threads;
  k.max_blocks = max_blocks;
  return k;
}

at::Tensor rollout_seq_stats_emu(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, const c10::optional<at::Tensor>& cu_seqlens
                                 RC_ROLLOUT_CONFIG_PARAMS, int64_t threads, int64_t schedule, int64_t max_blocks) {
  const LaunchKnobs knobs = emu_knobs(threads, schedule, max_blocks);
  return run_rollout_seq_stats(log_prob, rollout_log_prob, mask, cu_seqlens, RC_ROLLOUT_CONFIG_ARGS, knobs,
                               EmuLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rollout_token_pass_emu(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& seq_stats RC_ROLLOUT_CONFIG_PARAMS,
    bool row_partials, int64_t threads, int64_t schedule, int64_t max_blocks) {
  const LaunchKnobs knobs = emu_knobs(threads, schedule, max_blocks);
  return run_rollout_token_pass(log_prob, rollout_log_prob, mask, cu_seqlens, seq_stats, RC_ROLLOUT_CONFIG_ARGS,
                                row_partials, knobs, EmuLaunch{});
}

}  // namespace

// The real ops' schemas (the configuration from RC_ROLLOUT_CONFIG_SCHEMA) plus the launch knobs.
TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def("rollout_seq_stats(Tensor log_prob, Tensor rollout_log_prob, Tensor mask, Tensor? cu_seqlens"
        RC_ROLLOUT_CONFIG_SCHEMA ", int threads=0, int schedule=0, int max_blocks=0) -> Tensor");
  m.def("rollout_token_pass(Tensor log_prob, Tensor rollout_log_prob, Tensor mask, Tensor? cu_seqlens, "
        "Tensor seq_stats" RC_ROLLOUT_CONFIG_SCHEMA ", bool row_partials, int threads=0, int schedule=0, "
        "int max_blocks=0) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollout_corr_emu, CPU, m) {
  m.impl("rollout_seq_stats", &rollout_seq_stats_emu);
  m.impl("rollout_token_pass", &rollout_token_pass_emu);
}

}  // namespace rollout_corr
