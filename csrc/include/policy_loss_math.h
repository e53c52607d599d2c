// Per-token policy-loss math shared by the CPU kernels, the CUDA kernels and the CUDA emulator (docs/megatron.md,
// "Loss modes").
//
// Semantics: rollout_corr_ext/fallback/policy_loss.py::policy_loss_rows, which follows verl 0.9.1
// verl/trainer/ppo/core_algos.py (compute_policy_loss_vanilla, compute_policy_loss_reinforce):
//   PPO clip:  r = exp(clamp(lp - lp_old, -20, 20)); L1 = -A r; L2 = -A clip(r, 1 - eps_lo, 1 + eps_hi);
//              L = max(L1, L2), and for A < 0 L = min(L, -A c) (dual clip, arXiv:1912.09729); then L w.
//   REINFORCE: L = -A lp w.
// The gradient replays torch autograd of that fallback exactly, tie rules included (torch.maximum/minimum
// split the gradient in half on ties, clamp passes it on the closed interval).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "policy_loss_params.h"
#include "token_view.h"
#include "rc_macros.h"
#include "scalar_math.h"

namespace rollout_corr {

constexpr double kPolicyLogRatioBound = 20.0;  // verl SAFETY_BOUND

// NaN-propagating max/min/clamp with torch.maximum / torch.minimum / torch.clamp semantics, so a NaN in a
// padded position stays NaN in loss_mat exactly as in the fallback.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t nan_max(acc_t a, acc_t b) {
  return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
}
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t nan_min(acc_t a, acc_t b) {
  return (a != a) ? a : ((b != b) ? b : (a < b ? a : b));
}
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t clamp_keep_nan(acc_t x, acc_t lo, acc_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);  // NaN fails both comparisons and passes through
}

// What one token contributes: its loss (before the mask) and the metric integrands.
template <typename acc_t>
struct PolicyTokenResult {
  acc_t loss;
  acc_t clip;        // 1[L2 > L1]  (pg_clipfrac)
  acc_t clip_lower;  // 1[A < 0 and max(L1, L2) > -A c]  (pg_clipfrac_lower)
  acc_t kl;          // lp_old - lp, clamped for PPO, raw for REINFORCE  (ppo_kl)
};

template <typename acc_t>
RC_HD RC_FORCEINLINE PolicyTokenResult<acc_t> policy_loss_token(acc_t lp, acc_t old_lp, acc_t adv, acc_t w,
                                                                const PolicyLossConfig<acc_t>& cfg) {
  PolicyTokenResult<acc_t> out;
  if (cfg.kind == kPolicyLossPpoClip) {
    const acc_t bound = static_cast<acc_t>(kPolicyLogRatioBound);
    const acc_t neg_kl = clamp_keep_nan(lp - old_lp, -bound, bound);
    const acc_t ratio = rc_exp(neg_kl);
    const acc_t loss1 = -adv * ratio;
    const acc_t loss2 = -adv * clamp_keep_nan(ratio, cfg.ratio_lower, cfg.ratio_upper);
    const acc_t clipped1 = nan_max(loss1, loss2);
    const acc_t loss3 = -adv * cfg.clip_c;
    const bool negative = adv < acc_t(0);
    out.loss = negative ? nan_min(loss3, clipped1) : clipped1;
    out.clip = loss2 > loss1 ? acc_t(1) : acc_t(0);
    out.clip_lower = (negative && clipped1 > loss3) ? acc_t(1) : acc_t(0);
    out.kl = -neg_kl;
  } else {
    out.loss = -adv * lp;
    out.clip = out.clip_lower = acc_t(0);
    out.kl = old_lp - lp;  // verl's reinforce loss logs ppo_kl without the +-20 clamp
  }
  out.loss = out.loss * w;
  return out;
}

// d loss / d lp of policy_loss_token, as torch autograd computes it through the fallback:
//   PPO:  w * (-A) * r * 1[-20 <= lp - lp_old <= 20] * 1[L1 >= L2] * dual,
//         dual = 1 for A >= 0, else 1 / 0.5 / 0 for max(L1, L2) < / == / > -A c.
//   (L1 < L2 only when r lies outside the clip range, where clip() passes no gradient; on the tie L1 == L2
//   with A != 0, r is inside the range and torch's two half-gradients add up to the whole.)
//   REINFORCE: -A w.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t policy_loss_token_grad(acc_t lp, acc_t old_lp, acc_t adv, acc_t w,
                                                  const PolicyLossConfig<acc_t>& cfg) {
  if (cfg.kind != kPolicyLossPpoClip) return -adv * w;
  const acc_t bound = static_cast<acc_t>(kPolicyLogRatioBound);
  const acc_t log_ratio = lp - old_lp;
  const acc_t neg_kl = clamp_keep_nan(log_ratio, -bound, bound);
  const acc_t ratio = rc_exp(neg_kl);
  const acc_t loss1 = -adv * ratio;
  const acc_t loss2 = -adv * clamp_keep_nan(ratio, cfg.ratio_lower, cfg.ratio_upper);
  // Outside the clamp (and for a NaN log-ratio) torch's clamp backward passes no gradient.
  const bool ratio_live = log_ratio >= -bound && log_ratio <= bound;
  acc_t g = (ratio_live && loss1 >= loss2) ? -adv * ratio : acc_t(0);
  if (adv < acc_t(0)) {
    const acc_t clipped1 = nan_max(loss1, loss2);
    const acc_t loss3 = -adv * cfg.clip_c;
    g = clipped1 < loss3 ? g : (clipped1 == loss3 ? acc_t(0.5) * g : acc_t(0));
  }
  return g * w;
}

// Running per-row partials. The mask multiplies (float masks weight tokens), and a token whose mask is 0
// contributes nothing even when its values are NaN: verl's masked_sum is where(m != 0, v, 0) * m.
template <typename acc_t>
struct PolicyRowPartials {
  acc_t v[kPgRowCols];
};

template <typename acc_t>
RC_HD RC_FORCEINLINE PolicyRowPartials<acc_t> policy_row_partials_zero() {
  PolicyRowPartials<acc_t> p;
  for (int k = 0; k < kPgRowCols; ++k) p.v[k] = acc_t(0);
  return p;
}

template <typename acc_t>
RC_HD RC_FORCEINLINE void policy_row_partials_add(PolicyRowPartials<acc_t>& p, const PolicyTokenResult<acc_t>& t,
                                                  acc_t m) {
  p.v[kPgRowTokens] += m;
  if (m != acc_t(0)) {
    p.v[kPgRowLossSum] += t.loss * m;
    p.v[kPgRowClip] += t.clip * m;
    p.v[kPgRowClipLower] += t.clip_lower * m;
    p.v[kPgRowKlSum] += t.kl * m;
  }
}

// A response token (mask != 0) whose loss is undefined: NaN or +inf log-probs, a log-ratio -inf - (-inf) (PPO), a
// -inf log-prob under REINFORCE (an infinite loss), non-finite advantages or IS weights. Masked tokens are never
// inspected (padding holds junk).
template <typename acc_t>
RC_HD RC_FORCEINLINE bool policy_loss_undefined(acc_t lp, acc_t old_lp, acc_t adv, acc_t w, acc_t m, int32_t kind) {
  const acc_t inf = static_cast<acc_t>(INFINITY);
  bool bad = (lp != lp) || lp == inf || (old_lp != old_lp) || old_lp == inf;
  bad = bad || (kind == kPolicyLossPpoClip ? (lp == -inf && old_lp == -inf) : lp == -inf);
  bad = bad || !(adv - adv == acc_t(0)) || !(w - w == acc_t(0));
  return bad && m != acc_t(0);
}

// The forward of one token: reads the inputs, writes loss_mat, folds the token into the row partials.
template <typename scalar_t, typename acc_t>
RC_HD RC_FORCEINLINE void policy_loss_forward_token(const PolicyLossParams<scalar_t, acc_t>& p, int64_t row,
                                                    int64_t col, PolicyRowPartials<acc_t>& partials) {
  const acc_t lp = static_cast<acc_t>(RC_LDG(p.log_prob + row * p.lp_row_stride + col * p.lp_col_stride));
  const acc_t old_lp = view_load<acc_t>(p.old_log_prob, row, col);
  const acc_t adv = view_load<acc_t>(p.advantages, row, col);
  const acc_t w = view_load_or<acc_t>(p.weights, row, col, acc_t(1));
  const acc_t m = view_load<acc_t>(p.mask, row, col);
  const PolicyTokenResult<acc_t> t = policy_loss_token(lp, old_lp, adv, w, p.cfg);
  RC_STG(p.loss_mat + row * p.cols + col, t.loss);
  policy_row_partials_add(partials, t, m);
  if (policy_loss_undefined(lp, old_lp, adv, w, m, p.cfg.kind)) RC_STG(p.undefined, 1);  // any writer: same value
}

// The backward of one token: upstream gradient of loss_mat plus the row-loss gradient through the mask.
// `seq` is the sequence (its row of rows / grad_rows_loss); (row, col) the token's position in the views.
template <typename scalar_t, typename acc_t>
RC_HD RC_FORCEINLINE void policy_loss_backward_token(const PolicyLossBackwardParams<scalar_t, acc_t>& p,
                                                     int64_t seq, int64_t row, int64_t col) {
  const acc_t lp = static_cast<acc_t>(RC_LDG(p.log_prob + row * p.lp_row_stride + col * p.lp_col_stride));
  const acc_t old_lp = view_load<acc_t>(p.old_log_prob, row, col);
  const acc_t adv = view_load<acc_t>(p.advantages, row, col);
  const acc_t w = view_load_or<acc_t>(p.weights, row, col, acc_t(1));
  const acc_t m = view_load<acc_t>(p.mask, row, col);
  acc_t upstream = view_load_or<acc_t>(p.grad_loss_mat, row, col, acc_t(0));
  if (m != acc_t(0)) upstream += view_load_or<acc_t>(p.grad_rows_loss, seq, 0, acc_t(0)) * m;
  // A token nothing differentiates (masked out, loss_mat unused) gets exactly 0, even where its own values are
  // NaN / -inf: 0 * NaN would leak a NaN into the gradient of a token that does not affect the loss.
  RC_STG(p.grad_log_prob + row * p.cols + col,
         static_cast<scalar_t>(upstream == acc_t(0) ? acc_t(0) : upstream * policy_loss_token_grad(lp, old_lp, adv, w, p.cfg)));
}

}  // namespace rollout_corr
