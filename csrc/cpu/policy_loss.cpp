// CPU kernels of the fused policy loss (docs/megatron.md, "Loss modes"): one pass over [B, T] writes the per-token
// loss and the
// per-row partials (loss sum, tokens, clip counts, kl sum) that every aggregation mode and metric needs; the
// backward is one more elementwise pass. Rows run in parallel (at::parallel_for), each row is summed serially
// in the accumulation type (fp32, fp64 for fp64 inputs), so results do not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "policy_loss_host.h"
#include "policy_loss_math.h"
#include "policy_loss_params.h"

namespace rollout_corr {
namespace {

// Rows per task: about 16K tokens each, enough to amortize scheduling.
inline int64_t policy_grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols)); }

std::tuple<at::Tensor, at::Tensor> policy_loss_rows_cpu(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                        const at::Tensor& advantages, const at::Tensor& response_mask,
                                                        const c10::optional<at::Tensor>& weights, double clip_low,
                                                        double clip_high, double clip_c, int64_t loss_kind,
                                                        const c10::optional<at::Tensor>& cu_seqlens, double param_a, double param_b) {
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);  // first: names a layout mistake as such
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind, param_a, param_b);
  auto [loss_mat, rows] = new_policy_loss_outputs(log_prob, layout.rows);
  const at::Tensor w = defined_or_empty(weights);
  const at::Tensor undefined = new_undefined_flag(log_prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_rows_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_params<scalar_t, acc_t>(log_prob, old_log_prob, advantages, response_mask, w,
                                                            loss_mat, rows, undefined, layout, clip_low, clip_high,
                                                            clip_c, loss_kind, param_a, param_b);
    at::parallel_for(0, p.rows, policy_grain(p.cols / std::max<int64_t>(1, p.row_offsets ? p.rows : 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        PolicyRowPartials<acc_t> partials = policy_row_partials_zero<acc_t>();
        const SeqSpan sp = seq_span(p.row_offsets, p.cols, r);
        for (int64_t t = 0; t < sp.len; ++t) policy_loss_forward_token(p, sp.row, sp.col0 + t, partials);
        for (int k = 0; k < kPgRowCols; ++k) p.row_partials[r * kPgRowCols + k] = partials.v[k];
      }
    });
    if (*undefined.const_data_ptr<int32_t>() != 0) raise_undefined_policy_loss(p);
  });
  return {loss_mat, rows};
}

at::Tensor policy_loss_backward_cpu(const c10::optional<at::Tensor>& grad_loss_mat,
                                    const c10::optional<at::Tensor>& grad_rows_loss, const at::Tensor& log_prob,
                                    const at::Tensor& old_log_prob, const at::Tensor& advantages,
                                    const at::Tensor& response_mask, const c10::optional<at::Tensor>& weights,
                                    double clip_low, double clip_high, double clip_c, int64_t loss_kind,
                                    const c10::optional<at::Tensor>& cu_seqlens, double param_a, double param_b) {
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);  // first: names a layout mistake as such
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind, param_a, param_b);
  const at::Tensor g_mat = defined_or_empty(grad_loss_mat);
  const at::Tensor g_rows = defined_or_empty(grad_rows_loss);
  check_policy_loss_grads(g_mat, g_rows, log_prob, layout.rows);
  auto grad = at::empty(log_prob.sizes(), log_prob.options());
  const at::Tensor w = defined_or_empty(weights);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_backward_params<scalar_t, acc_t>(g_mat, g_rows, log_prob, old_log_prob,
                                                                     advantages, response_mask, w, grad, layout,
                                                                     clip_low, clip_high, clip_c, loss_kind, param_a, param_b);
    at::parallel_for(0, p.rows, policy_grain(p.cols / std::max<int64_t>(1, p.row_offsets ? p.rows : 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const SeqSpan sp = seq_span(p.row_offsets, p.cols, r);
        for (int64_t t = 0; t < sp.len; ++t) policy_loss_backward_token(p, r, sp.row, sp.col0 + t);
      }
    });
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("policy_loss_rows", &policy_loss_rows_cpu);
  m.impl("policy_loss_backward", &policy_loss_backward_cpu);
}

}  // namespace rollout_corr
