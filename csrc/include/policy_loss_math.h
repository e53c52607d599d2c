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
RC_HD RC_FORCEINLINE acc_t rc_sigmoid(acc_t z) {
  return acc_t(1) / (acc_t(1) + rc_exp(-z));
}

// The PPO-shaped core shared by PpoClip, Gspo and PpoUnbounded: L1 = -A q, L2 = -A clip(q), max(L1, L2).
template <typename acc_t>
struct ClippedPair {
  acc_t loss1, loss2, clipped1;
};
template <typename acc_t>
RC_HD RC_FORCEINLINE ClippedPair<acc_t> clipped_pair(acc_t q, acc_t adv, const PolicyLossConfig<acc_t>& cfg) {
  ClippedPair<acc_t> c;
  c.loss1 = -adv * q;
  c.loss2 = -adv * clamp_keep_nan(q, cfg.ratio_lower, cfg.ratio_upper);
  c.clipped1 = nan_max(c.loss1, c.loss2);
  return c;
}

// d max(first, second) / d first, the factor of the unclipped branch's slope in torch.maximum's backward (verl's
// PPO max and GMPO's min of sign-flipped values): 1 where first wins, 0 where second does, and on a tie half each;
// the clipped branch's own slope is 1 strictly inside the clip range and 0 at its bounds (torch 2.14's clamp), so a
// tie inside the range adds up to the whole and one at a bound to half. NaN: 0.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t max_branch_weight(acc_t first, acc_t second, bool inside) {
  return first > second ? acc_t(1) : (first == second ? (inside ? acc_t(1) : acc_t(0.5)) : acc_t(0));
}

// DPPO's trust-region mask (verl compute_policy_loss_dppo_tv / _kl): a token moves the policy only while the
// divergence of its Bernoulli (p vs p_old) stays within eps on the side the advantage pushes.
template <typename acc_t>
RC_HD RC_FORCEINLINE bool dppo_valid(acc_t lp, acc_t old_lp, acc_t adv, const PolicyLossConfig<acc_t>& cfg) {
  const acc_t p = rc_exp(lp), p_old = rc_exp(old_lp);
  if (cfg.kind == kPolicyLossDppoTv) {
    const acc_t d = p - p_old;
    return adv > acc_t(0) ? d <= cfg.eps_high : d >= -cfg.eps_low;
  }
  const acc_t e = static_cast<acc_t>(kBernoulliKlEps);
  const acc_t kl = p_old * (old_lp - lp) + (acc_t(1) - p_old) * rc_log((acc_t(1) - p_old + e) / (acc_t(1) - p + e));
  return adv > acc_t(0) ? (kl <= cfg.eps_high || p <= p_old) : (kl <= cfg.eps_low || p >= p_old);
}

template <typename acc_t>
RC_HD RC_FORCEINLINE PolicyTokenResult<acc_t> policy_loss_token(acc_t lp, acc_t old_lp, acc_t adv, acc_t w,
                                                                const PolicyLossConfig<acc_t>& cfg) {
  PolicyTokenResult<acc_t> out;
  out.clip = out.clip_lower = acc_t(0);
  const acc_t bound = static_cast<acc_t>(kPolicyLogRatioBound);
  const acc_t x = lp - old_lp;
  const acc_t neg_kl = clamp_keep_nan(x, -bound, bound);
  switch (cfg.kind) {
    case kPolicyLossPpoClip: {
      const ClippedPair<acc_t> c = clipped_pair(rc_exp(neg_kl), adv, cfg);
      const acc_t loss3 = -adv * cfg.clip_c;
      const bool negative = adv < acc_t(0);
      out.loss = negative ? nan_min(loss3, c.clipped1) : c.clipped1;
      out.clip = c.loss2 > c.loss1 ? acc_t(1) : acc_t(0);
      out.clip_lower = (negative && c.clipped1 > loss3) ? acc_t(1) : acc_t(0);
      out.kl = -neg_kl;
      break;
    }
    case kPolicyLossDppoTv:
    case kPolicyLossDppoKl: {
      const acc_t ratio = rc_exp(neg_kl);
      const acc_t valid = dppo_valid(lp, old_lp, adv, cfg) ? acc_t(1) : acc_t(0);
      const acc_t truncated = ratio > cfg.clip_c ? cfg.clip_c : ratio;
      out.loss = -adv * truncated * lp * valid;
      out.clip = acc_t(1) - valid;
      out.clip_lower = ratio > cfg.clip_c ? valid : acc_t(0);
      out.kl = -neg_kl;
      break;
    }
    case kPolicyLossGspo: {  // old_lp is the row's mean log-ratio s
      const acc_t cap = static_cast<acc_t>(kGspoLogRatioMax);
      const ClippedPair<acc_t> c = clipped_pair(rc_exp(old_lp > cap ? cap : old_lp), adv, cfg);
      out.loss = c.clipped1;
      out.clip = c.loss2 > c.loss1 ? acc_t(1) : acc_t(0);
      out.kl = acc_t(0);  // the caller's: it holds the real lp_old
      break;
    }
    case kPolicyLossSapo: {
      const acc_t tau = adv > acc_t(0) ? cfg.param_a : cfg.param_b;
      const acc_t gate = rc_sigmoid(tau * (rc_exp(neg_kl) - acc_t(1))) * (acc_t(4) / tau);
      out.loss = -gate * adv;
      out.kl = -neg_kl;
      break;
    }
    case kPolicyLossCispo: {
      const acc_t ratio = rc_exp(neg_kl);
      const acc_t clipped = clamp_keep_nan(ratio, cfg.ratio_lower, cfg.ratio_upper);
      out.loss = -clipped * adv * lp;
      out.clip = ratio != clipped ? acc_t(1) : acc_t(0);
      out.kl = -neg_kl;
      break;
    }
    case kPolicyLossDro:
      out.loss = -(lp * adv - acc_t(0.5) * cfg.param_a * (x * x));
      out.kl = -x;
      break;
    case kPolicyLossGeoMean: {
      const acc_t s = adv > acc_t(0) ? acc_t(1) : (adv < acc_t(0) ? acc_t(-1) : acc_t(0));
      const acc_t clamped = clamp_keep_nan(x, -cfg.eps_low, cfg.eps_high);
      out.loss = s * nan_min(s * x, s * clamped);
      const acc_t moved = x != clamped ? acc_t(1) : acc_t(0);
      out.clip = adv > acc_t(0) ? moved : acc_t(0);
      out.clip_lower = adv < acc_t(0) ? moved : acc_t(0);
      out.kl = -x;
      return out;  // the IS weight is applied per sequence by the caller (a geometric mean)
    }
    case kPolicyLossPpoUnbounded: {
      const ClippedPair<acc_t> c = clipped_pair(rc_exp(x), adv, cfg);
      out.loss = c.clipped1;
      out.clip = c.loss2 > c.loss1 ? acc_t(1) : acc_t(0);
      out.kl = -x;
      break;
    }
    default:  // kPolicyLossReinforce
      out.loss = -adv * lp;
      out.kl = old_lp - lp;  // verl's reinforce loss logs ppo_kl without the +-20 clamp
  }
  out.loss = out.loss * w;
  return out;
}

// d loss / d lp of policy_loss_token, as torch autograd computes it through verl's function (and our fallback):
//   PPO:  w * (-A) * r * 1[-20 < lp - lp_old < 20] * b * dual, b = max_branch_weight(L1, L2, r inside the clip
//         range): 1 for L1 > L2, 0 for L1 < L2 (r outside the range, where clip() passes no gradient), and on the
//         tie (r inside the range or on a bound) torch's two half-gradients: the whole inside, half on a bound;
//         dual = 1 for A >= 0, else 1 / 0.5 / 0 for max(L1, L2) < / == / > -A c.
//   REINFORCE: -A w.  DPPO: -A sg(min(r, c)) v w.  CISPO: -sg(clip(r)) A w.  DRO: -(A - beta x) w.
//   GSPO: w (-A) q 1[s < 10] b (the PPO rule on q).  PpoUnbounded: the PPO rule without bound and dual.
//   SAPO: -A 4 sigma (1 - sigma) r 1[|x| < 20] w.  GMPO: 1[A != 0] max_branch_weight(-sgn(A) x, -sgn(A) clamp(x), x inside
//   [-eps_lo, eps_hi]) (the token value's: torch.min of the two).
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t policy_loss_token_grad(acc_t lp, acc_t old_lp, acc_t adv, acc_t w,
                                                  const PolicyLossConfig<acc_t>& cfg) {
  const acc_t bound = static_cast<acc_t>(kPolicyLogRatioBound);
  const acc_t x = lp - old_lp;
  const acc_t neg_kl = clamp_keep_nan(x, -bound, bound);
  // Outside the clamp, at its bounds themselves (torch 2.14's clamp backward) and for a NaN log-ratio, torch's
  // clamp passes no gradient.
  const bool ratio_live = x > -bound && x < bound;
  switch (cfg.kind) {
    case kPolicyLossPpoClip: {
      const acc_t ratio = rc_exp(neg_kl);
      const ClippedPair<acc_t> c = clipped_pair(ratio, adv, cfg);
      const bool inside = ratio > cfg.ratio_lower && ratio < cfg.ratio_upper;
      acc_t g = ratio_live ? -adv * ratio * max_branch_weight(c.loss1, c.loss2, inside) : acc_t(0);
      if (adv < acc_t(0)) {
        const acc_t loss3 = -adv * cfg.clip_c;
        g = c.clipped1 < loss3 ? g : (c.clipped1 == loss3 ? acc_t(0.5) * g : acc_t(0));
      }
      return g * w;
    }
    case kPolicyLossDppoTv:
    case kPolicyLossDppoKl: {
      const acc_t ratio = rc_exp(neg_kl);
      const acc_t truncated = ratio > cfg.clip_c ? cfg.clip_c : ratio;
      return dppo_valid(lp, old_lp, adv, cfg) ? -adv * truncated * w : acc_t(0);
    }
    case kPolicyLossGspo: {
      const acc_t cap = static_cast<acc_t>(kGspoLogRatioMax);
      const acc_t q = rc_exp(old_lp > cap ? cap : old_lp);
      const ClippedPair<acc_t> c = clipped_pair(q, adv, cfg);
      const bool inside = q > cfg.ratio_lower && q < cfg.ratio_upper;
      return old_lp < cap ? -adv * q * max_branch_weight(c.loss1, c.loss2, inside) * w : acc_t(0);
    }
    case kPolicyLossSapo: {
      if (!ratio_live) return acc_t(0);
      const acc_t tau = adv > acc_t(0) ? cfg.param_a : cfg.param_b;
      const acc_t ratio = rc_exp(neg_kl);
      const acc_t sig = rc_sigmoid(tau * (ratio - acc_t(1)));
      return -adv * (acc_t(4) / tau) * (sig * (acc_t(1) - sig)) * tau * ratio * w;
    }
    case kPolicyLossCispo:
      return -clamp_keep_nan(rc_exp(neg_kl), cfg.ratio_lower, cfg.ratio_upper) * adv * w;
    case kPolicyLossDro:
      return -(adv - cfg.param_a * x) * w;
    case kPolicyLossGeoMean: {
      if (adv == acc_t(0)) return acc_t(0);
      const acc_t s = adv > acc_t(0) ? acc_t(1) : acc_t(-1);
      const bool inside = x > -cfg.eps_low && x < cfg.eps_high;
      return max_branch_weight(-s * x, -s * clamp_keep_nan(x, -cfg.eps_low, cfg.eps_high), inside);
    }
    case kPolicyLossPpoUnbounded: {
      const acc_t ratio = rc_exp(x);
      const ClippedPair<acc_t> c = clipped_pair(ratio, adv, cfg);
      const bool inside = ratio > cfg.ratio_lower && ratio < cfg.ratio_upper;
      const acc_t b = max_branch_weight(c.loss1, c.loss2, inside);
      // the clipped branch alone passes no gradient, also where exp(x) overflowed (0 * inf would be NaN; torch's
      // autograd, and so verl's fp32 loss, gives that NaN)
      return b > acc_t(0) ? -adv * ratio * b * w : acc_t(0);
    }
    default:  // kPolicyLossReinforce
      return -adv * w;
  }
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
// -inf log-prob under REINFORCE (an infinite loss), non-finite advantages or IS weights, a token loss past the
// type's range (finite inputs whose product overflows: -A lp w = 6e38 in fp32 gave an inf loss where the mean is
// finite). The kinds after REINFORCE (policy_loss_layout.def) take stricter terms: every input finite.
// Masked tokens are never inspected (padding holds junk).
template <typename acc_t>
RC_HD RC_FORCEINLINE bool policy_loss_undefined(acc_t lp, acc_t old_lp, acc_t adv, acc_t w, acc_t m, int32_t kind,
                                                acc_t loss) {
  if (m == acc_t(0)) return false;
  const acc_t inf = static_cast<acc_t>(INFINITY);
  // a float mask weights the token's loss (verl multiplies it in): NaN, inf or a negative weight defines none
  bool bad = !(m > acc_t(0)) || m == inf || !(adv - adv == acc_t(0)) || !(w - w == acc_t(0));
  bad = bad || !(loss - loss == acc_t(0));
  if (kind == kPolicyLossPpoClip || kind == kPolicyLossReinforce) {
    bad = bad || (lp != lp) || lp == inf || (old_lp != old_lp) || old_lp == inf;
    return bad || (kind == kPolicyLossPpoClip ? (lp == -inf && old_lp == -inf) : lp == -inf);
  }
  return bad || !(lp - lp == acc_t(0)) || !(old_lp - old_lp == acc_t(0));
}

// The forward of one token: reads the inputs, writes loss_mat (when wanted), folds the token into the row partials.
template <typename scalar_t, typename acc_t>
RC_HD RC_FORCEINLINE void policy_loss_forward_token(const PolicyLossParams<scalar_t, acc_t>& p, int64_t row,
                                                    int64_t col, PolicyRowPartials<acc_t>& partials) {
  const acc_t m = view_load<acc_t>(p.mask, row, col);
  // Without loss_mat a masked token contributes nothing (its partials are multiplied by 0, its values are not
  // checked): nothing else of it is read.
  if (p.loss_mat == nullptr && m == acc_t(0)) return;
  const acc_t lp = static_cast<acc_t>(RC_LDG(p.log_prob + row * p.lp_row_stride + col * p.lp_col_stride));
  const acc_t old_lp = view_load<acc_t>(p.old_log_prob, row, col);
  const acc_t adv = view_load<acc_t>(p.advantages, row, col);
  const acc_t w = view_load_or<acc_t>(p.weights, row, col, acc_t(1));
  const PolicyTokenResult<acc_t> t = policy_loss_token(lp, old_lp, adv, w, p.cfg);
  if (p.loss_mat != nullptr) RC_STG(p.loss_mat + row * p.cols + col, t.loss);
  policy_row_partials_add(partials, t, m);
  if (policy_loss_undefined(lp, old_lp, adv, w, m, p.cfg.kind, t.loss)) RC_STG(p.undefined, 1);  // any writer: same value
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
