// Host side of the sampling-replay ops shared by the CPU kernels (csrc/cpu/sampling.cpp), the CUDA launchers
// (csrc/cuda/sampling_launch.cuh) and the CUDA emulator's bindings: the boundary checks, with named messages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

namespace rollout_corr {

inline at::ScalarType sampling_acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The distance between rows of a [rows, cols] tensor whose rows are each contiguous (any stride(1) when cols <= 1):
// stride(0), which a one-column view (x[:, :1]) keeps too; only a single row has no meaningful one.
inline int64_t sampling_row_stride(const at::Tensor& t) {
  return t.size(0) <= 1 ? std::max<int64_t>(1, t.size(1)) : t.stride(0);
}

inline void check_row_topk(const at::Tensor& values, int64_t k) {
  TORCH_CHECK(values.dim() == 2, "row_topk: values must be 2-D [rows, cols], got ", values.dim(), "-D");
  TORCH_CHECK(k >= 1, "row_topk: k must be >= 1, got ", k);
  TORCH_CHECK(at::isFloatingType(values.scalar_type()), "row_topk: values must be a float tensor, got ",
              values.scalar_type());
}

inline void check_floor_fill(const at::Tensor& x, const at::Tensor& floor, double temperature, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.sizes() == out.sizes(), "floor_fill: x and out must be 2-D of one "
              "shape, got ", x.sizes(), " and ", out.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && out.scalar_type() == x.scalar_type(), "floor_fill: x and out "
              "must be float tensors of one dtype, got ", x.scalar_type(), " and ", out.scalar_type());
  const auto acc = sampling_acc_dtype(x.scalar_type());
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == x.size(0) && floor.scalar_type() == acc, "floor_fill: floor must "
              "be [rows] in ", acc, ", got ", floor.sizes(), " ", floor.scalar_type());
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "floor_fill: temperature must be finite and > 0, got ",
              temperature);
  if (x.size(0) == 0 || x.size(1) == 0) return;
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "floor_fill: each row of x must be contiguous");
  TORCH_CHECK(out.stride(1) == 1 || x.size(1) == 1, "floor_fill: each row of out must be contiguous");
}

inline void check_floor_zero(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& floor, double temperature) {
  TORCH_CHECK(x.dim() == 2 && grad.dim() == 2 && x.sizes() == grad.sizes(), "floor_zero_: grad and x must be 2-D of "
              "one shape, got ", grad.sizes(), " and ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && grad.scalar_type() == x.scalar_type(), "floor_zero_: grad and x "
              "must be float tensors of one dtype, got ", grad.scalar_type(), " and ", x.scalar_type());
  const auto acc = sampling_acc_dtype(x.scalar_type());
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == x.size(0) && floor.scalar_type() == acc, "floor_zero_: floor "
              "must be [rows] in ", acc, ", got ", floor.sizes(), " ", floor.scalar_type());
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "floor_zero_: temperature must be finite and > 0, got ",
              temperature);
  if (x.size(0) == 0 || x.size(1) == 0) return;
  TORCH_CHECK((x.stride(1) == 1 && grad.stride(1) == 1) || x.size(1) == 1, "floor_zero_: each row must be contiguous");
}

// Returns P, the probes per row.
inline int64_t check_mass_histogram(const at::Tensor& z, const at::Tensor& z_max, const at::Tensor& floor,
                                    const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& probes) {
  TORCH_CHECK(z.dim() == 2 && at::isFloatingType(z.scalar_type()), "mass_histogram: z must be a 2-D float tensor, "
              "got ", z.scalar_type(), " ", z.sizes());
  const auto acc = sampling_acc_dtype(z.scalar_type());
  const int64_t rows = z.size(0);
  TORCH_CHECK(probes.dim() == 2 && probes.size(0) == rows && probes.scalar_type() == at::kLong,
              "mass_histogram: probes must be [rows, P] int64");
  const int64_t n_probes = probes.size(1);
  TORCH_CHECK(n_probes >= 1 && ((n_probes + 1) & n_probes) == 0, "mass_histogram: P + 1 must be a power of 2, got P = ",
              n_probes);
  for (const auto* t : {&z_max, &floor}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == acc,
                "mass_histogram: z_max and floor must be [rows] in ", acc);
  }
  for (const auto* t : {&lo, &hi}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kLong,
                "mass_histogram: lo and hi must be [rows] int64 keys");
  }
  return n_probes;
}

inline void check_count_at_least(const at::Tensor& z, const at::Tensor& floor) {
  TORCH_CHECK(z.dim() == 2 && at::isFloatingType(z.scalar_type()), "count_at_least: z must be a 2-D float tensor, "
              "got ", z.scalar_type(), " ", z.sizes());
  const auto acc = sampling_acc_dtype(z.scalar_type());
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == z.size(0) && floor.scalar_type() == acc,
              "count_at_least: floor must be [rows] in ", acc);
}

// k is read on the host (one synchronisation): a k above width would not fit the lists.
inline void check_row_candidates(const at::Tensor& x, const at::Tensor& k, const at::Tensor& target_col, int64_t width,
                                 double temperature, int64_t valid_cols) {
  TORCH_CHECK(x.dim() == 2, "row_candidates: x must be 2-D [rows, cols], got ", x.dim(), "-D");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "row_candidates: x must be float32, "
              "bfloat16 or float16 (fp64 runs the PyTorch path), got ", dt);
  const int64_t rows = x.size(0);
  TORCH_CHECK(k.dim() == 1 && k.size(0) == rows && k.scalar_type() == at::kLong, "row_candidates: k must be [rows] "
              "int64, got ", k.sizes(), " ", k.scalar_type());
  TORCH_CHECK(target_col.dim() == 1 && target_col.size(0) == rows && target_col.scalar_type() == at::kLong,
              "row_candidates: target_col must be [rows] int64, got ", target_col.sizes(), " ", target_col.scalar_type());
  TORCH_CHECK(width >= 1, "row_candidates: width must be >= 1, got ", width);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "row_candidates: temperature must be finite and > 0, "
              "got ", temperature);
  TORCH_CHECK(valid_cols >= 0 && valid_cols <= x.size(1), "row_candidates: valid_cols must be in [0, ", x.size(1),
              "], got ", valid_cols);
  TORCH_CHECK(valid_cols < (int64_t(1) << 32), "row_candidates: more than 2^32 columns");
  TORCH_CHECK(rows == 0 || k.max().item<int64_t>() <= width, "row_candidates: every k must be <= width = ", width);
}

// The index range (< cols) is checked by each backend: at once on the CPU, by a device flag on CUDA.
inline void check_scatter_rows(const at::Tensor& values, const at::Tensor& index, int64_t cols) {
  TORCH_CHECK(values.dim() == 2 && index.sizes() == values.sizes() && index.scalar_type() == at::kLong,
              "scatter_rows: values [N, W] and index [N, W] int64 expected, got ", values.sizes(), " and ",
              index.sizes(), " ", index.scalar_type());
  TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble, "scatter_rows: values must "
              "be float32 or float64, got ", values.scalar_type());
  TORCH_CHECK(cols >= 0, "scatter_rows: cols must be >= 0, got ", cols);
}

inline void check_candidate_decide(const at::Tensor& cand, const at::Tensor& z_max, const at::Tensor& z_t,
                                   const at::Tensor& sum_all, const at::Tensor& k, const at::Tensor& floor,
                                   const at::Tensor& top_p) {
  TORCH_CHECK(cand.dim() == 2 && (cand.scalar_type() == at::kFloat || cand.scalar_type() == at::kDouble),
              "candidate_decide: cand must be [rows, C] float32 / float64, got ", cand.scalar_type(), " ", cand.sizes());
  const int64_t rows = cand.size(0), width = cand.size(1);
  for (const auto* t : {&z_max, &z_t, &sum_all, &top_p}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kDouble,
                "candidate_decide: z_max, z_t, sum_all and top_p must be [rows] float64");
  }
  TORCH_CHECK(k.dim() == 1 && k.size(0) == rows && k.scalar_type() == at::kLong, "candidate_decide: k must be [rows] "
              "int64");
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == rows && floor.scalar_type() == cand.scalar_type(),
              "candidate_decide: floor must be [rows] in cand's dtype");
  TORCH_CHECK(width >= 1 || rows == 0, "candidate_decide: cand must have at least one column");
}

}  // namespace rollout_corr
