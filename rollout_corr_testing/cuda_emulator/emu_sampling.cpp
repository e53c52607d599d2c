// Emulated CUDA launchers of the sampling-replay kernels: the very kernels of csrc/cuda/sampling_kernels.cuh,
// compiled by g++ against cuda_emu.h, through the same host driver and launch planning as the CUDA launchers
// (sampling_launch.cuh), exposed as CPU ops torch.ops.rollout_corr_emu.<op> with the schemas of
// torch.ops.rollout_corr.<op> plus knobs the tests sweep: `threads` (0 = the launcher's choice), `schedule` (the
// turnstile order, emu_launch.h) and `max_blocks` (0 = one block per row; fewer exercises the grid-stride loops).
// Outputs the kernels fill are poisoned (NaN, or an implausible integer) before the launch.
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <torch/library.h>

#include "emu_launch.h"
#include "sampling_launch.cuh"

namespace rollout_corr {
namespace {

LaunchKnobs emu_knobs(int64_t threads, int64_t schedule, int64_t max_blocks) {
  apply_schedule(schedule);
  LaunchKnobs k;
  k.threads = threads;
  k.max_blocks = max_blocks;
  return k;
}

at::Tensor row_topk_emu(const at::Tensor& values, int64_t k, int64_t threads, int64_t schedule, int64_t max_blocks) {
  return run_row_topk(values, k, emu_knobs(threads, schedule, max_blocks), true, EmuLaunch{});
}

void floor_fill_emu(const at::Tensor& x, const at::Tensor& floor, double temperature, const at::Tensor& out,
                    int64_t threads, int64_t schedule, int64_t max_blocks) {
  run_floor_fill(x, floor, temperature, out, emu_knobs(threads, schedule, max_blocks), EmuLaunch{});
}

void floor_zero_emu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& floor, double temperature,
                    int64_t threads, int64_t schedule, int64_t max_blocks) {
  run_floor_zero(grad, x, floor, temperature, emu_knobs(threads, schedule, max_blocks), EmuLaunch{});
}

at::Tensor mass_histogram_emu(const at::Tensor& z, const at::Tensor& z_max, const at::Tensor& floor,
                              const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& probes, int64_t threads,
                              int64_t schedule, int64_t max_blocks) {
  return run_mass_histogram(z, z_max, floor, lo, hi, probes, emu_knobs(threads, schedule, max_blocks), EmuLaunch{});
}

at::Tensor count_at_least_emu(const at::Tensor& z, const at::Tensor& floor, int64_t threads, int64_t schedule,
                              int64_t max_blocks) {
  return run_count_at_least(z, floor, emu_knobs(threads, schedule, max_blocks), true, EmuLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_candidates_emu(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& target_col, int64_t width, double temperature,
    int64_t valid_cols, int64_t threads, int64_t schedule, int64_t max_blocks) {
  return run_row_candidates(x, k, target_col, width, temperature, valid_cols, emu_knobs(threads, schedule, max_blocks),
                            true, EmuLaunch{});
}

at::Tensor scatter_rows_emu(const at::Tensor& values, const at::Tensor& index, int64_t cols, at::ScalarType dtype,
                            int64_t threads, int64_t schedule, int64_t max_blocks) {
  return run_scatter_rows(values, index, cols, dtype, emu_knobs(threads, schedule, max_blocks), EmuLaunch{});
}

std::tuple<at::Tensor, at::Tensor> candidate_decide_emu(const at::Tensor& cand, const at::Tensor& z_max,
                                                       const at::Tensor& z_t, const at::Tensor& sum_all,
                                                       const at::Tensor& k, const at::Tensor& floor,
                                                       const at::Tensor& top_p, int64_t threads, int64_t schedule,
                                                       int64_t max_blocks) {
  return run_candidate_decide(cand, z_max, z_t, sum_all, k, floor, top_p, emu_knobs(threads, schedule, max_blocks),
                              true, EmuLaunch{});
}

}  // namespace

// The real ops' schemas (csrc/ops.cpp) plus the launch knobs.
TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def("row_topk(Tensor values, int k, int threads=0, int schedule=0, int max_blocks=0) -> Tensor");
  m.def("floor_fill(Tensor x, Tensor floor, float temperature, Tensor(a!) out, int threads=0, int schedule=0, "
        "int max_blocks=0) -> ()");
  m.def("floor_zero_(Tensor(a!) grad, Tensor x, Tensor floor, float temperature, int threads=0, int schedule=0, "
        "int max_blocks=0) -> ()");
  m.def("mass_histogram(Tensor z, Tensor z_max, Tensor floor, Tensor lo, Tensor hi, Tensor probes, int threads=0, "
        "int schedule=0, int max_blocks=0) -> Tensor");
  m.def("count_at_least(Tensor z, Tensor floor, int threads=0, int schedule=0, int max_blocks=0) -> Tensor");
  m.def("row_candidates(Tensor x, Tensor k, Tensor target_col, int width, float temperature, int valid_cols, "
        "int threads=0, int schedule=0, int max_blocks=0) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("scatter_rows(Tensor values, Tensor index, int cols, ScalarType dtype, int threads=0, int schedule=0, "
        "int max_blocks=0) -> Tensor");
  m.def("candidate_decide(Tensor cand, Tensor z_max, Tensor z_t, Tensor sum_all, Tensor k, Tensor floor, "
        "Tensor top_p, int threads=0, int schedule=0, int max_blocks=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollout_corr_emu, CPU, m) {
  m.impl("row_topk", &row_topk_emu);
  m.impl("floor_fill", &floor_fill_emu);
  m.impl("floor_zero_", &floor_zero_emu);
  m.impl("mass_histogram", &mass_histogram_emu);
  m.impl("count_at_least", &count_at_least_emu);
  m.impl("row_candidates", &row_candidates_emu);
  m.impl("scatter_rows", &scatter_rows_emu);
  m.impl("candidate_decide", &candidate_decide_emu);
}

}  // namespace rollout_corr
