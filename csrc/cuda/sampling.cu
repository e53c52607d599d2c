// CUDA launchers of the sampling-replay ops: device guard, current stream, launch checks. The shared host driver
// (checks, outputs, params, launch shapes): sampling_launch.cuh; device code: sampling_kernels.cuh (shared with the
// CUDA emulator).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_launch.cuh"
#include "sampling_launch.cuh"

namespace rollout_corr {
namespace {

at::Tensor row_topk_cuda(const at::Tensor& values, int64_t k) {
  const c10::cuda::CUDAGuard guard(values.device());
  return run_row_topk(values, k, LaunchKnobs{}, false, current_stream_launch());
}

void floor_fill_cuda(const at::Tensor& x, const at::Tensor& floor, double temperature, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  run_floor_fill(x, floor, temperature, out, LaunchKnobs{}, current_stream_launch());
}

void floor_zero_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& floor, double temperature) {
  const c10::cuda::CUDAGuard guard(x.device());
  run_floor_zero(grad, x, floor, temperature, LaunchKnobs{}, current_stream_launch());
}

at::Tensor mass_histogram_cuda(const at::Tensor& z, const at::Tensor& z_max, const at::Tensor& floor,
                               const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& probes) {
  const c10::cuda::CUDAGuard guard(z.device());
  return run_mass_histogram(z, z_max, floor, lo, hi, probes, LaunchKnobs{}, current_stream_launch());
}

at::Tensor count_at_least_cuda(const at::Tensor& z, const at::Tensor& floor) {
  const c10::cuda::CUDAGuard guard(z.device());
  return run_count_at_least(z, floor, LaunchKnobs{}, false, current_stream_launch());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_candidates_cuda(const at::Tensor& x, const at::Tensor& k,
                                                                               const at::Tensor& target_col,
                                                                               int64_t width, double temperature,
                                                                               int64_t valid_cols) {
  const c10::cuda::CUDAGuard guard(x.device());
  return run_row_candidates(x, k, target_col, width, temperature, valid_cols, LaunchKnobs{}, false,
                            current_stream_launch());
}

at::Tensor scatter_rows_cuda(const at::Tensor& values, const at::Tensor& index, int64_t cols, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(values.device());
  return run_scatter_rows(values, index, cols, dtype, LaunchKnobs{}, current_stream_launch());
}

std::tuple<at::Tensor, at::Tensor> candidate_decide_cuda(const at::Tensor& cand, const at::Tensor& z_max,
                                                        const at::Tensor& z_t, const at::Tensor& sum_all,
                                                        const at::Tensor& k, const at::Tensor& floor,
                                                        const at::Tensor& top_p) {
  const c10::cuda::CUDAGuard guard(cand.device());
  return run_candidate_decide(cand, z_max, z_t, sum_all, k, floor, top_p, LaunchKnobs{}, false,
                              current_stream_launch());
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CUDA, m) {
  m.impl("row_topk", &row_topk_cuda);
  m.impl("floor_fill", &floor_fill_cuda);
  m.impl("floor_zero_", &floor_zero_cuda);
  m.impl("mass_histogram", &mass_histogram_cuda);
  m.impl("count_at_least", &count_at_least_cuda);
  m.impl("row_candidates", &row_candidates_cuda);
  m.impl("scatter_rows", &scatter_rows_cuda);
  m.impl("candidate_decide", &candidate_decide_cuda);
}

}  // namespace rollout_corr
