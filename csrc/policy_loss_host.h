// Host side of the fused policy-loss ops shared by the CPU and CUDA backends and the CUDA emulator's bindings:
// boundary checks with named messages, and the builders of the torch-free kernel parameter blocks.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <sstream>
#include <string>

#include "policy_loss_math.h"
#include "policy_loss_params.h"
#include "token_view_host.h"

namespace rollout_corr {

inline bool is_policy_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline bool is_policy_mask_dtype(at::ScalarType t) {
  return is_policy_float_dtype(t) || t == at::kBool || t == at::kByte || t == at::kChar || t == at::kShort ||
         t == at::kInt || t == at::kLong;
}

inline at::ScalarType policy_acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_token_input(const at::Tensor& t, const at::Tensor& log_prob, const char* name, bool is_mask) {
  TORCH_CHECK(t.sizes() == log_prob.sizes(), name, " must have the shape of log_prob ", log_prob.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(t.device() == log_prob.device(), name, " is on ", t.device(), " but log_prob is on ",
              log_prob.device());
  if (is_mask) {
    TORCH_CHECK(is_policy_mask_dtype(t.scalar_type()), name, " must be bool, integer or floating point, got ",
                t.scalar_type());
  } else {
    TORCH_CHECK(is_policy_float_dtype(t.scalar_type()), name, " must be float16, bfloat16, float32 or float64, got ",
                t.scalar_type());
  }
}

// A parameter in an error message with the digits that tell it apart (1 + 1e-8 printed as "1" would not say why it
// was refused): the shortest form that reads back as v, as Python's repr.
inline std::string all_digits(double v) {
  std::string text;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream out;
    out << std::setprecision(digits) << v;
    text = out.str();
    if (std::strtod(text.c_str(), nullptr) == v) break;
  }
  return text;
}

inline void check_policy_loss_inputs(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                     const at::Tensor& advantages, const at::Tensor& response_mask,
                                     const c10::optional<at::Tensor>& weights, double clip_low, double clip_high,
                                     double clip_c, int64_t loss_kind, double param_a, double param_b) {
  TORCH_CHECK(log_prob.dim() == 2 || log_prob.dim() == 1,
              "log_prob must be 2-D [batch, response_length] (or the 1-D packed token stream with cu_seqlens), got "
              "shape ", log_prob.sizes());
  TORCH_CHECK(is_policy_float_dtype(log_prob.scalar_type()),
              "log_prob must be float16, bfloat16, float32 or float64, got ", log_prob.scalar_type());
  check_token_input(old_log_prob, log_prob, "old_log_prob", false);
  check_token_input(advantages, log_prob, "advantages", false);
  check_token_input(response_mask, log_prob, "response_mask", true);
  if (weights.has_value() && weights->defined()) check_token_input(*weights, log_prob, "weights", false);
  TORCH_CHECK(loss_kind >= 0 && loss_kind < static_cast<int64_t>(kKindCount),
              "loss_kind must be a PG_KIND_* code, 0 .. ", static_cast<int64_t>(kKindCount) - 1, " (policy_loss_layout.def), got ",
              loss_kind);
  // SAPO's gate sigma(tau (r - 1)) 4 / tau and DRO's beta are formed in the compute type (fp32 below fp64 inputs):
  // a parameter past its range there (tau = 1e308 is inf in fp32), or a tau whose 4 / tau is, makes a loss or a
  // gradient NaN / inf at every token it reaches.
  const bool wide = log_prob.scalar_type() == at::kDouble;
  const auto in_range = [wide](double v, double numerator) {
    if (wide) return v > 0 && std::isfinite(v) && std::isfinite(numerator / v);
    const float f = static_cast<float>(v);
    return f > 0 && std::isfinite(f) && std::isfinite(static_cast<float>(numerator) / f);
  };
  if (loss_kind == kPolicyLossSapo)
    TORCH_CHECK(in_range(param_a, 4.0) && in_range(param_b, 4.0),
                "SAPO's temperatures (param_a = tau_pos, param_b = tau_neg) must be > 0 with tau and 4 / tau finite "
                "in the compute type (fp32 below fp64 inputs), got ", all_digits(param_a), ", ", all_digits(param_b));
  if (loss_kind == kPolicyLossDro)
    TORCH_CHECK(param_a > 0 && (wide ? std::isfinite(param_a) : std::isfinite(static_cast<float>(param_a))),
                "DRO's beta (param_a) must be finite and > 0 in the compute type (fp32 below fp64 inputs), got ",
                param_a);
  TORCH_CHECK(clip_low >= 0 && clip_high >= 0, "clip_low and clip_high must be >= 0, got clip_low=", clip_low,
              ", clip_high=", clip_high);
  // PPO's dual clip needs c > 1 (verl asserts it); DPPO truncates the ratio at c (any cap > 0, as verl reads it);
  // the other kinds do not read it.
  if (loss_kind == kPolicyLossPpoClip) {  // > 1 as compared: 1 + 1e-8 is 1 in fp32, the degenerate clip refused
    TORCH_CHECK(wide ? clip_c > 1.0 : static_cast<float>(clip_c) > 1.0f,
                "clip_c (the dual-clip bound c) must be > 1 in the compute type (fp32 below fp64 inputs; inf disables "
                "the dual clip), got ", all_digits(clip_c));
  } else {
    TORCH_CHECK(clip_c > 0.0, "clip_c (DPPO's ratio cap c; not read by the other kinds) must be > 0, got ", clip_c);
  }
}

// What makes a policy loss undefined (the CPU error names the token; CUDA asserts asynchronously).
inline constexpr const char* kMsgUndefinedLossWhat =
    "a response_mask weight NaN, inf or < 0, log_prob / old_log_prob NaN or +inf, both -inf (PPO), log_prob -inf "
    "(REINFORCE), non-finite advantages / rollout_is_weights (the IS weights), a token loss past the float range, "
    "or (the other kinds) a non-finite input (mask the token out, or fix the log-probs; a target at a -inf logit "
    "has log-prob -inf)";
inline constexpr const char* kMsgUndefinedLoss =
    "policy loss undefined at a response token: a response_mask weight NaN, inf or < 0, log_prob / old_log_prob NaN "
    "or +inf, both -inf (PPO), log_prob -inf (REINFORCE), non-finite advantages / rollout_is_weights (the IS "
    "weights), a token loss past the float range, or (the other kinds) a non-finite input (mask the token out, or "
    "fix the log-probs; a target at a -inf logit has log-prob -inf)";

template <typename acc_t>
PolicyLossConfig<acc_t> make_policy_loss_config(double clip_low, double clip_high, double clip_c, int64_t kind,
                                                double param_a, double param_b) {
  PolicyLossConfig<acc_t> c;
  // 1 - clip_low is formed in double, then rounded once, as the fallback's Python float bound is.
  c.ratio_lower = static_cast<acc_t>(1.0 - clip_low);
  c.ratio_upper = static_cast<acc_t>(1.0 + clip_high);
  c.eps_low = static_cast<acc_t>(clip_low);
  c.eps_high = static_cast<acc_t>(clip_high);
  c.clip_c = static_cast<acc_t>(clip_c);
  c.param_a = static_cast<acc_t>(param_a);
  c.param_b = static_cast<acc_t>(param_b);
  c.kind = static_cast<int32_t>(kind);
  return c;
}

inline at::Tensor defined_or_empty(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? *t : at::Tensor();
}

template <typename scalar_t, typename acc_t>
PolicyLossParams<scalar_t, acc_t> make_policy_loss_params(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                          const at::Tensor& advantages,
                                                          const at::Tensor& response_mask,
                                                          const at::Tensor& weights, const at::Tensor& loss_mat,
                                                          const at::Tensor& rows, const at::Tensor& undefined,
                                                          const SeqLayout& layout, double clip_low, double clip_high,
                                                          double clip_c, int64_t loss_kind, double param_a, double param_b) {
  PolicyLossParams<scalar_t, acc_t> p;
  p.log_prob = log_prob.const_data_ptr<scalar_t>();
  p.old_log_prob = token_view(old_log_prob);
  p.advantages = token_view(advantages);
  p.mask = token_view(response_mask);
  p.weights = token_view_or_absent(weights);
  p.loss_mat = loss_mat.numel() > 0 ? loss_mat.mutable_data_ptr<acc_t>() : nullptr;  // empty: not wanted
  p.row_partials = rows.mutable_data_ptr<acc_t>();
  p.undefined = undefined.mutable_data_ptr<int32_t>();
  p.row_offsets = layout.offsets.defined() ? layout.offsets.const_data_ptr<int64_t>() : nullptr;
  p.rows = layout.rows;
  p.cols = layout.cols;
  p.lp_row_stride = log_prob.dim() == 2 ? log_prob.stride(0) : 0;
  p.lp_col_stride = log_prob.stride(log_prob.dim() - 1);
  p.cfg = make_policy_loss_config<acc_t>(clip_low, clip_high, clip_c, loss_kind, param_a, param_b);
  return p;
}

// The flag the forward kernels set on an undefined response-token loss (one int32, zero-filled).
inline at::Tensor new_undefined_flag(const at::Tensor& log_prob) {
  return at::zeros({1}, log_prob.options().dtype(at::kInt));
}

// CPU: raise the ValueError of an undefined loss, naming the first response token whose loss is undefined (found
// again with the kernels' own test; this runs only when the flag is set).
template <typename scalar_t, typename acc_t>
void raise_undefined_policy_loss(const PolicyLossParams<scalar_t, acc_t>& p) {
  for (int64_t b = 0; b < p.rows; ++b) {
    const SeqSpan sp = seq_span(p.row_offsets, p.cols, b);
    for (int64_t c = sp.col0; c < sp.col0 + sp.len; ++c) {
      const int64_t r = sp.row;
      const acc_t lp = static_cast<acc_t>(p.log_prob[r * p.lp_row_stride + c * p.lp_col_stride]);
      const acc_t old_lp = view_load<acc_t>(p.old_log_prob, r, c), adv = view_load<acc_t>(p.advantages, r, c);
      const acc_t w = view_load_or<acc_t>(p.weights, r, c, acc_t(1));
      if (policy_loss_undefined(lp, old_lp, adv, w, view_load<acc_t>(p.mask, r, c), p.cfg.kind,
                                policy_loss_token(lp, old_lp, adv, w, p.cfg).loss)) {
        if (p.row_offsets != nullptr)  // packed: the token's index in the stream
          TORCH_CHECK_VALUE(false, "policy loss undefined at response token (", c, ") of sequence ", b, ": ",
                            kMsgUndefinedLossWhat);
        TORCH_CHECK_VALUE(false, "policy loss undefined at response token (", r, ", ", c, "): ",
                          kMsgUndefinedLossWhat);
      }
    }
  }
  TORCH_CHECK_VALUE(false, kMsgUndefinedLoss);
}

// Upstream gradients of the backward: grad_loss_mat [B, T] and grad_rows_loss [B] (the loss column of rows'
// gradient, usually a strided column view), either may be absent. Any float dtype, any strides.
inline void check_policy_loss_grads(const at::Tensor& grad_loss_mat, const at::Tensor& grad_rows_loss,
                                    const at::Tensor& log_prob, int64_t rows) {
  if (grad_loss_mat.defined()) check_token_input(grad_loss_mat, log_prob, "grad_loss_mat", false);
  if (grad_rows_loss.defined()) {
    TORCH_CHECK(grad_rows_loss.dim() == 1 && grad_rows_loss.size(0) == rows,
                "grad_rows_loss must have shape [", rows, "] (one value per sequence), got ",
                grad_rows_loss.sizes());
    TORCH_CHECK(grad_rows_loss.device() == log_prob.device(), "grad_rows_loss is on ", grad_rows_loss.device(),
                " but log_prob is on ", log_prob.device());
    TORCH_CHECK(is_policy_float_dtype(grad_rows_loss.scalar_type()),
                "grad_rows_loss must be float16, bfloat16, float32 or float64, got ", grad_rows_loss.scalar_type());
  }
}

template <typename scalar_t, typename acc_t>
PolicyLossBackwardParams<scalar_t, acc_t> make_policy_loss_backward_params(
    const at::Tensor& grad_loss_mat, const at::Tensor& grad_rows_loss, const at::Tensor& log_prob,
    const at::Tensor& old_log_prob, const at::Tensor& advantages, const at::Tensor& response_mask,
    const at::Tensor& weights, const at::Tensor& grad_log_prob, const SeqLayout& layout, double clip_low,
    double clip_high, double clip_c, int64_t loss_kind, double param_a, double param_b) {
  PolicyLossBackwardParams<scalar_t, acc_t> p;
  p.log_prob = log_prob.const_data_ptr<scalar_t>();
  p.old_log_prob = token_view(old_log_prob);
  p.advantages = token_view(advantages);
  p.mask = token_view(response_mask);
  p.weights = token_view_or_absent(weights);
  p.grad_loss_mat = token_view_or_absent(grad_loss_mat);
  p.grad_rows_loss = row_view_or_absent(grad_rows_loss);
  p.grad_log_prob = grad_log_prob.mutable_data_ptr<scalar_t>();
  p.row_offsets = layout.offsets.defined() ? layout.offsets.const_data_ptr<int64_t>() : nullptr;
  p.rows = layout.rows;
  p.cols = layout.cols;
  p.lp_row_stride = log_prob.dim() == 2 ? log_prob.stride(0) : 0;
  p.lp_col_stride = log_prob.stride(log_prob.dim() - 1);
  p.cfg = make_policy_loss_config<acc_t>(clip_low, clip_high, clip_c, loss_kind, param_a, param_b);
  return p;
}

}  // namespace rollout_corr
