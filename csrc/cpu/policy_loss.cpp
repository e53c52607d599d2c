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

// The common layout, read without a dtype switch per element: a view in the accumulation dtype whose row is
// contiguous or broadcast (column stride 1 or 0). {nullptr, 0} otherwise (or absent): the generic path.
template <typename acc_t>
struct RowPtr {
  const acc_t* p;
  int64_t step;
};
template <typename acc_t>
RowPtr<acc_t> row_ptr(const TokenView& v, int64_t row, int64_t col0) {
  constexpr ViewDtype kAcc = sizeof(acc_t) == 8 ? ViewDtype::kFloat64 : ViewDtype::kFloat32;
  if (v.data == nullptr || v.dtype != kAcc || (v.col_stride != 0 && v.col_stride != 1)) return {nullptr, 0};
  return {static_cast<const acc_t*>(v.data) + row * v.row_stride + col0 * v.col_stride, v.col_stride};
}

// Calls f(mask_ptr) with the mask's row as a typed pointer when it is contiguous; returns false otherwise.
template <typename F>
bool with_mask_row(const TokenView& m, int64_t row, int64_t col0, F&& f) {
  if (m.col_stride != 1) return false;
  view_visit(m.dtype, m.data, [&](auto* base) { f(base + row * m.row_stride + col0); });
  return true;
}

// The fast layout's typed rows of old_log_prob, advantages and weights (either params block), and whether the row
// qualifies (log_prob contiguous too, every present input in the fast layout).
template <typename acc_t>
struct FastRows {
  RowPtr<acc_t> old, adv, w;
  bool ok;
};
template <typename acc_t, typename P>
FastRows<acc_t> fast_rows(const P& p, const SeqSpan& sp) {
  FastRows<acc_t> f{row_ptr<acc_t>(p.old_log_prob, sp.row, sp.col0), row_ptr<acc_t>(p.advantages, sp.row, sp.col0),
                    row_ptr<acc_t>(p.weights, sp.row, sp.col0), false};
  f.ok = p.lp_col_stride == 1 && f.old.p != nullptr && f.adv.p != nullptr &&
         (p.weights.data == nullptr || f.w.p != nullptr);
  return f;
}

// One row of the forward on the fast layout: the same per-token math (policy_loss_token), typed loads.
template <typename scalar_t, typename acc_t>
bool forward_row_fast(const PolicyLossParams<scalar_t, acc_t>& p, const SeqSpan& sp,
                      PolicyRowPartials<acc_t>& partials) {
  const FastRows<acc_t> f = fast_rows<acc_t>(p, sp);
  if (!f.ok) return false;
  const RowPtr<acc_t>&old = f.old, &adv = f.adv, &w = f.w;
  const scalar_t* lp = p.log_prob + sp.row * p.lp_row_stride + sp.col0;
  acc_t* out = p.loss_mat + sp.row * p.cols + sp.col0;
  bool undefined = false;
  const bool ok = with_mask_row(p.mask, sp.row, sp.col0, [&](auto* m) {
    for (int64_t t = 0; t < sp.len; ++t) {
      const acc_t l = static_cast<acc_t>(lp[t]), o = old.p[t * old.step], a = adv.p[t * adv.step];
      const acc_t wt = w.p == nullptr ? acc_t(1) : w.p[t * w.step];
      const acc_t mt = element_to<acc_t>(m[t]);
      const PolicyTokenResult<acc_t> r = policy_loss_token(l, o, a, wt, p.cfg);
      out[t] = r.loss;
      policy_row_partials_add(partials, r, mt);
      undefined |= policy_loss_undefined(l, o, a, wt, mt, p.cfg.kind, r.loss);
    }
  });
  if (ok && undefined) *p.undefined = 1;
  return ok;
}

// One row of the backward on the fast layout (policy_loss_backward_token's rule, typed loads).
template <typename scalar_t, typename acc_t>
bool backward_row_fast(const PolicyLossBackwardParams<scalar_t, acc_t>& p, int64_t seq, const SeqSpan& sp) {
  const FastRows<acc_t> f = fast_rows<acc_t>(p, sp);
  if (!f.ok || p.grad_loss_mat.data != nullptr) return false;
  const RowPtr<acc_t>&old = f.old, &adv = f.adv, &w = f.w;
  const scalar_t* lp = p.log_prob + sp.row * p.lp_row_stride + sp.col0;
  scalar_t* grad = p.grad_log_prob + sp.row * p.cols + sp.col0;
  const acc_t g_row = view_load_or<acc_t>(p.grad_rows_loss, seq, 0, acc_t(0));
  return with_mask_row(p.mask, sp.row, sp.col0, [&](auto* m) {
    for (int64_t t = 0; t < sp.len; ++t) {
      const acc_t mt = element_to<acc_t>(m[t]);
      const acc_t upstream = mt != acc_t(0) ? g_row * mt : acc_t(0);
      acc_t g = acc_t(0);
      if (upstream != acc_t(0)) {
        const acc_t wt = w.p == nullptr ? acc_t(1) : w.p[t * w.step];
        g = upstream * policy_loss_token_grad(static_cast<acc_t>(lp[t]), old.p[t * old.step], adv.p[t * adv.step],
                                              wt, p.cfg);
      }
      grad[t] = static_cast<scalar_t>(g);
    }
  });
}

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
        if (!forward_row_fast(p, sp, partials))
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
        if (!backward_row_fast(p, r, sp))
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
