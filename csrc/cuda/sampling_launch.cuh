// Launch planning and host driver of the sampling-replay CUDA kernels, shared by the CUDA launchers (sampling.cu) and
// the CUDA emulator's bindings (rollout_corr_testing/cuda_emulator/emu_sampling.cpp): boundary checks (the CPU
// kernels' own, csrc/sampling_host.h), outputs, params and launch shapes are decided here once, so the emulator
// runs the launchers' real decisions; `launch(kernel, grid, block, params)` is the only backend-specific part.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "launch_config.h"
#include "sampling_host.h"
#include "sampling_kernels.cuh"

namespace rollout_corr {

// Threads per block of the selecting kernels: enough warps for the shared-memory sorts and the row sweeps.
constexpr int kCandidateThreads = 256;
constexpr int kDecideThreads = 256;
constexpr int kTopkThreads = 512;

struct SamplingLaunchPlan {
  dim3 grid, block;
};

// One block per row (grid-stride beyond the grid limit or knobs.max_blocks); threads: the knob, else `threads`.
inline SamplingLaunchPlan plan_sampling_launch(int64_t rows, int threads, const LaunchKnobs& knobs) {
  TORCH_CHECK(knobs.threads == 0 || (knobs.threads >= 32 && knobs.threads <= 1024 && knobs.threads % 32 == 0),
              "threads must be 0 or a multiple of 32 in [32, 1024], got ", knobs.threads);
  TORCH_CHECK(knobs.max_blocks >= 0, "max_blocks must be >= 0, got ", knobs.max_blocks);
  const int t = knobs.threads > 0 ? static_cast<int>(knobs.threads) : threads;
  return {dim3(static_cast<unsigned>(capped_grid(row_grid_blocks(rows), knobs))), dim3(t)};
}

// An output the kernel must fill: uninitialised on the GPU; under the emulator (poison) NaN for floats and an
// implausible integer otherwise, so that an element a kernel forgets to write shows up.
inline at::Tensor sampling_output(at::IntArrayRef sizes, const at::TensorOptions& opts, bool poison) {
  if (!poison) return at::empty(sizes, opts);
  if (at::isFloatingType(opts.dtype().toScalarType())) {
    return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), opts);
  }
  return at::full(sizes, -777777, opts);
}

inline void check_same_device(const at::Tensor& ref, std::initializer_list<const at::Tensor*> others, const char* op) {
  for (const at::Tensor* t : others) {
    TORCH_CHECK(t->device() == ref.device(), op, ": every tensor must be on ", ref.device(), ", got one on ",
                t->device());
  }
}

template <typename Launch>
void run_floor_fill(const at::Tensor& x, const at::Tensor& floor, double temperature, const at::Tensor& out,
                    const LaunchKnobs& knobs, Launch&& launch) {
  check_floor_fill(x, floor, temperature, out);
  check_same_device(x, {&floor, &out}, "floor_fill");
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  const auto f = floor.contiguous();
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, row_block_threads(cols, 1), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "floor_fill", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const FloorParams<scalar_t, acc_t> p{x.const_data_ptr<scalar_t>(), sampling_row_stride(x),
                                         out.data_ptr<scalar_t>(), sampling_row_stride(out),
                                         f.const_data_ptr<acc_t>(), static_cast<acc_t>(temperature),
                                         temperature == 1.0, rows, cols};
    launch(floor_fill_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
  });
}

template <typename Launch>
void run_floor_zero(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& floor, double temperature,
                    const LaunchKnobs& knobs, Launch&& launch) {
  check_floor_zero(grad, x, floor, temperature);
  check_same_device(x, {&floor, &grad}, "floor_zero_");
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  const auto f = floor.contiguous();
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, row_block_threads(cols, 1), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "floor_zero_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const FloorParams<scalar_t, acc_t> p{x.const_data_ptr<scalar_t>(), sampling_row_stride(x),
                                         grad.data_ptr<scalar_t>(), sampling_row_stride(grad),
                                         f.const_data_ptr<acc_t>(), static_cast<acc_t>(temperature),
                                         temperature == 1.0, rows, cols};
    launch(floor_zero_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
  });
}

template <typename Launch>
at::Tensor run_count_at_least(const at::Tensor& z, const at::Tensor& floor, const LaunchKnobs& knobs, bool poison,
                              Launch&& launch) {
  check_count_at_least(z, floor);
  check_same_device(z, {&floor}, "count_at_least");
  const int64_t rows = z.size(0), cols = z.size(1);
  if (rows == 0 || cols == 0) return at::zeros({rows}, z.options().dtype(at::kLong));
  at::Tensor counts = sampling_output({rows}, z.options().dtype(at::kLong), poison);
  const at::Tensor zc = z.stride(1) == 1 ? z : z.contiguous();
  const auto f = floor.contiguous();
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, row_block_threads(cols, 1), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "count_at_least", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const CountParams<scalar_t, acc_t> p{zc.const_data_ptr<scalar_t>(), sampling_row_stride(zc), rows, cols,
                                         f.const_data_ptr<acc_t>(), counts.data_ptr<int64_t>()};
    launch(count_at_least_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
  });
  return counts;
}

// The output is zeroed first (a memset), then the kernel writes the kept candidates. An index >= cols sets a device
// flag: an asynchronous device assert on the GPU (no host sync), the CPU kernel's named error on CPU tensors.
template <typename Launch>
at::Tensor run_scatter_rows(const at::Tensor& values, const at::Tensor& index, int64_t cols, at::ScalarType dtype,
                            const LaunchKnobs& knobs, Launch&& launch) {
  check_scatter_rows(values, index, cols);
  check_same_device(values, {&index}, "scatter_rows");
  const int64_t rows = values.size(0), width = values.size(1);
  at::Tensor out = at::zeros({rows, cols}, values.options().dtype(dtype));
  if (rows == 0 || cols == 0 || width == 0) return out;
  const auto vc = values.contiguous(), ic = index.contiguous();
  at::Tensor bad = at::zeros({1}, values.options().dtype(at::kInt));
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, row_block_threads(width, 1), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "scatter_rows", [&] {
    using out_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "scatter_rows_values", [&] {
      using val_t = scalar_t;
      const ScatterParams<val_t, out_t> p{vc.const_data_ptr<val_t>(), ic.const_data_ptr<int64_t>(), rows, width, cols,
                                          out.data_ptr<out_t>(), bad.data_ptr<int32_t>()};
      launch(scatter_rows_kernel<val_t, out_t>, plan.grid, plan.block, p);
    });
  });
  static constexpr const char* kMsg = "scatter_rows: an index is >= cols";
  if (bad.is_cpu()) {
    TORCH_CHECK(*bad.const_data_ptr<int32_t>() == 0, "scatter_rows: an index is >= cols = ", cols);
  } else {
    at::_assert_async(bad[0] == 0, kMsg);
  }
  return out;
}

template <typename Launch>
at::Tensor run_mass_histogram(const at::Tensor& z, const at::Tensor& z_max, const at::Tensor& floor,
                              const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& probes,
                              const LaunchKnobs& knobs, Launch&& launch) {
  const int64_t n_probes = check_mass_histogram(z, z_max, floor, lo, hi, probes);
  check_same_device(z, {&z_max, &floor, &lo, &hi, &probes}, "mass_histogram");
  const int64_t rows = z.size(0), cols = z.size(1);
  // zeros: the buckets of a row the kernel skips stay 0, and the global-memory path adds into them
  at::Tensor hist = at::zeros({rows, n_probes + 1}, z.options().dtype(at::kLong));
  if (rows == 0 || cols == 0) return hist;
  const at::Tensor zc = z.stride(1) == 1 ? z : z.contiguous();
  const auto zm = z_max.contiguous(), fl = floor.contiguous(), l = lo.contiguous(), u = hi.contiguous();
  const auto pr = probes.contiguous();
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, row_block_threads(cols, 1), knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "mass_histogram", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const MassParams<scalar_t, acc_t> p{zc.const_data_ptr<scalar_t>(), sampling_row_stride(zc), rows, cols,
                                        zm.const_data_ptr<acc_t>(), fl.const_data_ptr<acc_t>(),
                                        l.const_data_ptr<int64_t>(), u.const_data_ptr<int64_t>(),
                                        pr.const_data_ptr<int64_t>(), n_probes, hist.data_ptr<int64_t>()};
    launch(mass_histogram_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
  });
  return hist;
}

// k above kTopkCap (the general search with a very large top-k): torch.topk with NaN as -inf, the fallback's
// definition, on the same device.
inline at::Tensor row_topk_by_torch(const at::Tensor& values, int64_t k) {
  const auto acc = sampling_acc_dtype(values.scalar_type());
  at::Tensor v = values.to(acc);
  v = v.masked_fill(v.isnan(), -std::numeric_limits<double>::infinity());
  at::Tensor top = std::get<0>(v.topk(std::min(k, v.size(1)), -1));
  if (top.size(1) < k) {
    top = at::cat({top, at::full({top.size(0), k - top.size(1)}, -std::numeric_limits<double>::infinity(),
                                 top.options())}, 1);
  }
  return top;
}

template <typename Launch>
at::Tensor run_row_topk(const at::Tensor& values, int64_t k, const LaunchKnobs& knobs, bool poison, Launch&& launch) {
  check_row_topk(values, k);
  if (k > kTopkCap) return row_topk_by_torch(values, k);
  TORCH_CHECK(values.size(1) < (int64_t(1) << 32), "row_topk: more than 2^32 columns");
  const at::Tensor v = values.stride(1) == 1 || values.size(1) <= 1 ? values : values.contiguous();
  const auto acc = sampling_acc_dtype(values.scalar_type());
  at::Tensor out = sampling_output({v.size(0), k}, v.options().dtype(acc), poison);
  const int64_t rows = v.size(0);
  if (rows == 0) return out;
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, kTopkThreads, knobs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "row_topk", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const TopkParams<scalar_t, acc_t> p{v.const_data_ptr<scalar_t>(), sampling_row_stride(v), rows, v.size(1), k,
                                        out.data_ptr<acc_t>()};
    launch(row_topk_kernel<scalar_t, acc_t>, plan.grid, plan.block, p);
  });
  return out;
}

// Tile width: 32 columns a warp step, as many steps as keep the tiles within the shared buffer.
inline int64_t candidate_tile_steps(int64_t cols) {
  const int64_t per_tile = (cols + kCandMaxTiles - 1) / kCandMaxTiles;
  return std::max<int64_t>(1, (per_tile + kWarpSize - 1) / kWarpSize);
}

template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_row_candidates(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& target_col, int64_t width, double temperature,
    int64_t valid_cols, const LaunchKnobs& knobs, bool poison, Launch&& launch) {
  check_row_candidates(x, k, target_col, width, temperature, valid_cols);
  check_same_device(x, {&k, &target_col}, "row_candidates");
  TORCH_CHECK(width <= kCandCap, "row_candidates: the CUDA kernel keeps at most ", kCandCap,
              " candidates per row (its shared-memory sort), got width = ", width);
  const int64_t rows = x.size(0);
  at::Tensor values = sampling_output({rows, width}, x.options().dtype(at::kFloat), poison);
  at::Tensor index = sampling_output({rows, width}, x.options().dtype(at::kLong), poison);
  at::Tensor count = sampling_output({rows}, x.options().dtype(at::kLong), poison);
  at::Tensor stats = sampling_output({rows, 3}, x.options().dtype(at::kDouble), poison);
  if (rows == 0) return {values, index, count, stats};
  const at::Tensor xc = x.stride(1) == 1 || x.size(1) <= 1 ? x : x.contiguous();
  const auto kc = k.contiguous(), tc = target_col.contiguous();
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, kCandidateThreads, knobs);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const CandidateParams<scalar_t> p{xc.const_data_ptr<scalar_t>(), sampling_row_stride(xc), rows, valid_cols,
                                      kc.const_data_ptr<int64_t>(), tc.const_data_ptr<int64_t>(),
                                      static_cast<float>(temperature), temperature == 1.0, width,
                                      candidate_tile_steps(valid_cols), values.data_ptr<float>(),
                                      index.data_ptr<int64_t>(), count.data_ptr<int64_t>(),
                                      stats.data_ptr<double>()};
    launch(row_candidates_kernel<scalar_t>, plan.grid, plan.block, p);
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(at::Half{});
  }
  return {values, index, count, stats};
}

template <typename Launch>
std::tuple<at::Tensor, at::Tensor> run_candidate_decide(const at::Tensor& cand, const at::Tensor& z_max,
                                                       const at::Tensor& z_t, const at::Tensor& sum_all,
                                                       const at::Tensor& k, const at::Tensor& floor,
                                                       const at::Tensor& top_p, const LaunchKnobs& knobs, bool poison,
                                                       Launch&& launch) {
  check_candidate_decide(cand, z_max, z_t, sum_all, k, floor, top_p);
  check_same_device(cand, {&z_max, &z_t, &sum_all, &k, &floor, &top_p}, "candidate_decide");
  const int64_t rows = cand.size(0), width = cand.size(1);
  TORCH_CHECK(width < (int64_t(1) << 32), "candidate_decide: more than 2^32 candidates per row");
  at::Tensor tau = sampling_output({rows}, cand.options(), poison);
  at::Tensor out = sampling_output({rows, 4}, cand.options().dtype(at::kDouble), poison);
  if (rows == 0) return {tau, out};
  const auto cc = cand.contiguous(), zm = z_max.contiguous(), zt = z_t.contiguous(), sa = sum_all.contiguous();
  const auto kc = k.contiguous(), fl = floor.contiguous(), tp = top_p.contiguous();
  const SamplingLaunchPlan plan = plan_sampling_launch(rows, kDecideThreads, knobs);
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "candidate_decide", [&] {
    const DecideParams<scalar_t> p{cc.const_data_ptr<scalar_t>(), rows, width, zm.const_data_ptr<double>(),
                                   zt.const_data_ptr<double>(), sa.const_data_ptr<double>(),
                                   kc.const_data_ptr<int64_t>(), fl.const_data_ptr<scalar_t>(),
                                   tp.const_data_ptr<double>(), tau.data_ptr<scalar_t>(), out.data_ptr<double>()};
    launch(candidate_decide_kernel<scalar_t>, plan.grid, plan.block, p);
  });
  return {tau, out};
}

}  // namespace rollout_corr
