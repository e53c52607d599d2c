// CPU kernels of the fused policy loss (docs/megatron.md, "Loss modes"): one pass over [B, T] writes the per-token
// loss and the per-row partials (loss sum, tokens, clip counts, kl sum) that every aggregation mode and metric needs;
// the backward is one more elementwise pass. Rows run in parallel (at::parallel_for) and each row is summed by one
// thread in a fixed order, so results do not depend on the thread count.
//
// fp32 accumulation (fp32, bf16 and fp16 log-probs) runs the SIMD lane kernels of namespace f32 below, one loop per
// loss kind; fp64 inputs keep the scalar per-token rule of policy_loss_math.h (each row summed serially in fp64).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "policy_loss_host.h"
#include "policy_loss_math.h"
#include "policy_loss_params.h"
#include "reused_buffer.h"
#include "vec_math.h"

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
  acc_t* out = p.loss_mat == nullptr ? nullptr : p.loss_mat + sp.row * p.cols + sp.col0;
  bool undefined = false;
  const bool ok = with_mask_row(p.mask, sp.row, sp.col0, [&](auto* m) {
    for (int64_t t = 0; t < sp.len; ++t) {
      if (out == nullptr && element_to<acc_t>(m[t]) == acc_t(0)) continue;  // policy_loss_forward_token's skip
      const acc_t l = static_cast<acc_t>(lp[t]), o = old.p[t * old.step], a = adv.p[t * adv.step];
      const acc_t wt = w.p == nullptr ? acc_t(1) : w.p[t * w.step];
      const acc_t mt = element_to<acc_t>(m[t]);
      const PolicyTokenResult<acc_t> r = policy_loss_token(l, o, a, wt, p.cfg);
      if (out != nullptr) out[t] = r.loss;
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

// ---- fp32 accumulation (fp32, bf16 and fp16 log-probs): SIMD lanes, the loss kind a template argument ----------
//
// The per-token math of policy_loss_math.h, rewritten on GCC vector lanes of fp32 (16 in the AVX-512 copy, 8 in the
// AVX2 copy, 4 in the x86-64 baseline, picked by cpu::cpu_isa()), branch-free: every condition of the scalar rule is
// a lane mask and a select, so the sign of the advantage, the clip sides and the mask cost no branch. The kind is a
// template argument: one loop per kind, no switch per token. exp is the project's vectorized exp (vec_math.h; within
// 1.2e-7 relative of std::exp), log a Cephes-style polynomial (0.77 ulp measured). Tokens are read a chunk at a time
// from the dtype-tagged views (one dtype switch per chunk; fp32 unit-stride rows in place), so every layout and input
// dtype takes the same arithmetic: a strided input gives the same bits as a contiguous one. Row partials: fp32 lane
// sums, folded into fp64 every kFoldChunks chunks, rounded once to fp32 (independent of the thread count; the lane
// count, hence the copy, picks the summation order).
namespace f32 {

constexpr int kChunk = 64;      // tokens per load: a few vectors of every input, all in L1
constexpr int kFoldChunks = 4;  // lane sums of 256 tokens (16 per lane at 16 lanes) before the fp64 fold

// The lane types of one copy: VF fp32 lanes, VI the int32 lanes of its comparisons (-1 true, 0 false).
template <typename VF>
struct Lanes {
  using VI = typename cpu::VecOf<VF>::i32;
  using VU = typename cpu::VecOf<VF>::u32;
  static constexpr int kWidth = cpu::lanes_of<VF>();
  static RC_FORCEINLINE VF splat(float c) { return VF{} + c; }
  static RC_FORCEINLINE VF load(const float* p) { return cpu::load_vec<VF>(p); }
  static RC_FORCEINLINE void store(float* p, VF v) { cpu::store_vec(p, v); }
  // Selects and mask logic as bit operations on the lanes. GCC 12 expands `c ? a : b` and `c1 | c2` of comparisons
  // piecewise (lane by lane, through the stack) when it meets them combined in a generic template that an AVX-512
  // copy inlines (-Wvector-operation-performance); as bit operations they stay vector code (one vpternlogd each).
  static RC_FORCEINLINE VF sel(VI c, VF a, VF b) { return (VF)((VU)b ^ (((VU)a ^ (VU)b) & (VU)c)); }
  static RC_FORCEINLINE VI sel(VI c, VI a, VI b) { return (VI)((VU)b ^ (((VU)a ^ (VU)b) & (VU)c)); }
  static RC_FORCEINLINE VF one_if(VI c) { return (VF)((VU)c & (VU)splat(1.0f)); }
  static RC_FORCEINLINE VF keep_if(VI c, VF a) { return (VF)((VU)c & (VU)a); }  // a where c, else +0
  static RC_FORCEINLINE VI lor(VI a, VI b) { return (VI)((VU)a | (VU)b); }
  static RC_FORCEINLINE VI land(VI a, VI b) { return (VI)((VU)a & (VU)b); }
  static RC_FORCEINLINE bool any(VI c) { return cpu::any_lane(c); }
  static RC_FORCEINLINE double sum_f64(VF v) {
    double s = 0;
    for (int l = 0; l < kWidth; ++l) s += static_cast<double>(v[l]);
    return s;
  }
  // nan_max / nan_min / clamp_keep_nan of policy_loss_math.h, lane-wise (a NaN in a wins, then a NaN in b).
  static RC_FORCEINLINE VF nan_max(VF a, VF b) {
    const VF m = sel(a > b, a, b);  // b when either is NaN
    return sel(a != a, a, m);
  }
  static RC_FORCEINLINE VF nan_min(VF a, VF b) {
    const VF m = sel(a < b, a, b);
    return sel(a != a, a, m);
  }
  static RC_FORCEINLINE VF clamp_keep_nan(VF x, VF lo, VF hi) { return sel(x < lo, lo, sel(x > hi, hi, x)); }
  // Not finite (NaN or +-inf): x - x is NaN exactly then.
  static RC_FORCEINLINE VI not_finite(VF x) { return (x - x) != VF{}; }
  // exp of a log-ratio clamped to [-20, 20] (NaN propagates).
  static RC_FORCEINLINE VF exp_bounded(VF x) { return cpu::exp_vec_bounded<VF, VI>(x); }
  // exp of any value: 0 below -87 (where std::exp is below 1.7e-38), +-inf and NaN as std::exp; a lane above 88
  // (never, for log-probs) takes std::exp, so overflow gives +inf as in the scalar rule. Lane by lane: a lane's
  // result never depends on another's value (a masked token's junk switched the whole vector to std::exp, which
  // moved its neighbours' gradients by an ulp).
  static RC_FORCEINLINE VF exp_any(VF x) {
    VF y = cpu::exp_vec<VF, VI>(x);
    if (__builtin_expect(any(x > splat(88.0f)), 0)) {
      for (int l = 0; l < kWidth; ++l) {
        if (x[l] > 88.0f) y[l] = std::exp(x[l]);
      }
    }
    return y;
  }
  // Natural log (Cephes logf's reduction and polynomial): x = 2^e m, m in [sqrt(1/2), sqrt(2)); subnormals scaled
  // first; log(0) = -inf, log(inf) = inf, NaN for x < 0 and NaN.
  static RC_FORCEINLINE VF log(VF x) {
    const VI tiny = x < splat(1.17549435e-38f);  // subnormal (or <= 0: fixed below)
    const VF xs = sel(tiny, x * 8388608.0f, x);  // * 2^23
    const VU bits = (VU)xs;
    const VI e_raw = (VI)(bits >> 23) - 126;
    VF m = (VF)((bits & 0x007fffffu) | 0x3f000000u);  // [0.5, 1)
    const VI small = m < splat(0.707106781186547524f);
    const VF e = __builtin_convertvector(e_raw + small - (VI)((VU)tiny & 23u), VF);  // small is -1 where true
    m = sel(small, m + m - 1.0f, m - 1.0f);
    const VF z = m * m;
    VF y = splat(7.0376836292e-2f);
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y = y + e * -2.12194440e-4f;
    y = y - 0.5f * z;
    VF r = m + y;
    r = r + e * 0.693359375f;
    const VF inf = splat(INFINITY);
    r = sel(x == inf, inf, r);
    r = sel(x == VF{}, -inf, r);
    return sel(x < VF{}, splat(NAN), sel(x != x, x, r));
  }
};

// The scalar configuration as lanes, with the quotients the kinds use (the same roundings as the scalar rule:
// 4 / tau of the selected tau is 4 / tau_pos or 4 / tau_neg, 0.5 * beta * (x * x) groups as (0.5 * beta) * (x * x)).
template <typename VF>
struct Cfg {
  VF lower, upper, eps_low, eps_high, neg_eps_low, c, a, b, four_over_a, four_over_b, half_a;
  RC_FORCEINLINE explicit Cfg(const PolicyLossConfig<float>& k) {
    using L = Lanes<VF>;
    lower = L::splat(k.ratio_lower);
    upper = L::splat(k.ratio_upper);
    eps_low = L::splat(k.eps_low);
    eps_high = L::splat(k.eps_high);
    neg_eps_low = L::splat(-k.eps_low);
    c = L::splat(k.clip_c);
    a = L::splat(k.param_a);
    b = L::splat(k.param_b);
    four_over_a = L::splat(4.0f / k.param_a);
    four_over_b = L::splat(4.0f / k.param_b);
    half_a = L::splat(0.5f * k.param_a);
  }
};

template <typename VF>
struct TokenOut {
  VF loss, clip, clip_lower, kl;
};

// dppo_valid on lanes.
template <int K, typename VF>
RC_FORCEINLINE typename Lanes<VF>::VI dppo_valid(VF lp, VF old_lp, VF adv, const Cfg<VF>& c) {
  using L = Lanes<VF>;
  const VF p = L::exp_any(lp), p_old = L::exp_any(old_lp);
  const auto pos = adv > VF{};
  if constexpr (K == kPolicyLossDppoTv) {
    const VF d = p - p_old;
    return L::sel(pos, d <= c.eps_high, d >= c.neg_eps_low);
  } else {
    const VF e = L::splat(static_cast<float>(kBernoulliKlEps));
    const VF one = L::splat(1.0f);
    const VF kl = p_old * (old_lp - lp) + (one - p_old) * L::log((one - p_old + e) / (one - p + e));
    return L::sel(pos, L::lor(kl <= c.eps_high, p <= p_old), L::lor(kl <= c.eps_low, p >= p_old));
  }
}

// policy_loss_token on lanes, kind K.
template <int K, typename VF>
RC_FORCEINLINE TokenOut<VF> token(VF lp, VF old_lp, VF adv, VF w, const Cfg<VF>& c) {
  using L = Lanes<VF>;
  TokenOut<VF> o;
  o.clip = o.clip_lower = VF{};
  const VF bound = L::splat(static_cast<float>(kPolicyLogRatioBound));
  const VF x = lp - old_lp;
  const VF neg_kl = L::clamp_keep_nan(x, -bound, bound);
  if constexpr (K == kPolicyLossPpoClip || K == kPolicyLossGspo || K == kPolicyLossPpoUnbounded) {
    VF q;
    if constexpr (K == kPolicyLossPpoClip) {
      q = L::exp_bounded(neg_kl);
    } else if constexpr (K == kPolicyLossGspo) {  // old_lp is the row's mean log-ratio s
      const VF cap = L::splat(static_cast<float>(kGspoLogRatioMax));
      q = L::exp_any(L::sel(old_lp > cap, cap, old_lp));
    } else {
      q = L::exp_any(x);
    }
    const VF loss1 = -adv * q;
    const VF loss2 = -adv * L::clamp_keep_nan(q, c.lower, c.upper);
    const VF clipped1 = L::nan_max(loss1, loss2);
    o.clip = L::one_if(loss2 > loss1);
    if constexpr (K == kPolicyLossPpoClip) {
      const VF loss3 = -adv * c.c;
      const auto negative = adv < VF{};
      o.loss = L::sel(negative, L::nan_min(loss3, clipped1), clipped1);
      o.clip_lower = L::one_if(L::land(negative, clipped1 > loss3));
      o.kl = -neg_kl;
    } else {
      o.loss = clipped1;
      o.kl = K == kPolicyLossGspo ? VF{} : -x;
    }
  } else if constexpr (K == kPolicyLossDppoTv || K == kPolicyLossDppoKl) {
    const VF ratio = L::exp_bounded(neg_kl);
    const VF valid = L::one_if(dppo_valid<K>(lp, old_lp, adv, c));
    const auto over = ratio > c.c;
    const VF truncated = L::sel(over, c.c, ratio);
    o.loss = -adv * truncated * lp * valid;
    o.clip = L::splat(1.0f) - valid;
    o.clip_lower = L::keep_if(over, valid);
    o.kl = -neg_kl;
  } else if constexpr (K == kPolicyLossSapo) {
    const auto pos = adv > VF{};
    const VF tau = L::sel(pos, c.a, c.b);
    const VF z = tau * (L::exp_bounded(neg_kl) - 1.0f);
    const VF gate = (L::splat(1.0f) / (L::splat(1.0f) + L::exp_any(-z))) * L::sel(pos, c.four_over_a, c.four_over_b);
    o.loss = -gate * adv;
    o.kl = -neg_kl;
  } else if constexpr (K == kPolicyLossCispo) {
    const VF ratio = L::exp_bounded(neg_kl);
    const VF clipped = L::clamp_keep_nan(ratio, c.lower, c.upper);
    o.loss = -clipped * adv * lp;
    o.clip = L::one_if(ratio != clipped);
    o.kl = -neg_kl;
  } else if constexpr (K == kPolicyLossDro) {
    o.loss = -(lp * adv - c.half_a * (x * x));
    o.kl = -x;
  } else if constexpr (K == kPolicyLossGeoMean) {
    const auto pos = adv > VF{}, neg = adv < VF{};
    const VF s = L::sel(pos, L::splat(1.0f), L::keep_if(neg, L::splat(-1.0f)));
    const VF clamped = L::clamp_keep_nan(x, c.neg_eps_low, c.eps_high);
    o.loss = s * L::nan_min(s * x, s * clamped);
    const auto moved = x != clamped;
    o.clip = L::one_if(L::land(pos, moved));
    o.clip_lower = L::one_if(L::land(neg, moved));
    o.kl = -x;
    return o;  // the IS weight is applied per sequence by the caller
  } else {  // kPolicyLossReinforce
    o.loss = -adv * lp;
    o.kl = old_lp - lp;
  }
  o.loss = o.loss * w;
  return o;
}

// policy_loss_undefined on lanes (all false where m == 0).
template <int K, typename VF>
RC_FORCEINLINE typename Lanes<VF>::VI undefined(VF lp, VF old_lp, VF adv, VF w, VF m, VF loss) {
  using L = Lanes<VF>;
  // the mask weight first (policy_loss_undefined): NaN, inf or < 0 at a token whose mask is not 0
  typename L::VI bad = L::lor(L::lor(m != m, m < VF{}), m == L::splat(INFINITY));
  bad = L::lor(bad, L::lor(L::not_finite(adv), L::not_finite(w)));
  bad = L::lor(bad, L::not_finite(loss));
  if constexpr (K == kPolicyLossPpoClip || K == kPolicyLossReinforce) {
    const VF inf = L::splat(INFINITY);
    bad = L::lor(L::lor(bad, L::lor(lp != lp, lp == inf)), L::lor(old_lp != old_lp, old_lp == inf));
    if constexpr (K == kPolicyLossPpoClip) {
      bad = L::lor(bad, L::land(lp == -inf, old_lp == -inf));
    } else {
      bad = L::lor(bad, lp == -inf);
    }
  } else {
    bad = L::lor(L::lor(bad, L::not_finite(lp)), L::not_finite(old_lp));
  }
  return L::land(bad, m != VF{});
}

// max_branch_weight (policy_loss_math.h) on lanes.
template <typename VF>
RC_FORCEINLINE VF branch_weight(VF first, VF second, typename Lanes<VF>::VI inside) {
  using L = Lanes<VF>;
  return L::one_if(first > second) +
         L::keep_if(first == second, L::sel(inside, L::splat(1.0f), L::splat(0.5f)));
}

// policy_loss_token_grad on lanes, kind K.
template <int K, typename VF>
RC_FORCEINLINE VF token_grad(VF lp, VF old_lp, VF adv, VF w, const Cfg<VF>& c) {
  using L = Lanes<VF>;
  const VF bound = L::splat(static_cast<float>(kPolicyLogRatioBound));
  const VF x = lp - old_lp;
  const VF neg_kl = L::clamp_keep_nan(x, -bound, bound);
  const typename L::VI ratio_live = L::land(x > -bound, x < bound);  // torch 2.14's clamp: no gradient on a bound
  if constexpr (K == kPolicyLossPpoClip || K == kPolicyLossGspo || K == kPolicyLossPpoUnbounded) {
    VF q;
    typename L::VI live = ratio_live;
    if constexpr (K == kPolicyLossPpoClip) {
      q = L::exp_bounded(neg_kl);
    } else if constexpr (K == kPolicyLossGspo) {
      const VF cap = L::splat(static_cast<float>(kGspoLogRatioMax));
      q = L::exp_any(L::sel(old_lp > cap, cap, old_lp));
      live = old_lp < cap;
    } else {
      q = L::exp_any(x);
    }
    const VF loss1 = -adv * q;
    const VF loss2 = -adv * L::clamp_keep_nan(q, c.lower, c.upper);
    const VF bw = branch_weight<VF>(loss1, loss2, L::land(q > c.lower, q < c.upper));
    VF g = -adv * q * bw;
    if constexpr (K != kPolicyLossPpoUnbounded) {
      g = L::keep_if(live, g);
    } else {  // no bound on x: the clipped branch alone passes nothing, also where exp(x) overflowed (0 * inf)
      g = L::keep_if(bw > VF{}, g);
    }
    if constexpr (K == kPolicyLossPpoClip) {
      const VF clipped1 = L::nan_max(loss1, loss2);
      const VF loss3 = -adv * c.c;
      const VF dual = L::sel(clipped1 < loss3, g, L::keep_if(clipped1 == loss3, 0.5f * g));
      g = L::sel(adv < VF{}, dual, g);
    }
    return g * w;
  } else if constexpr (K == kPolicyLossDppoTv || K == kPolicyLossDppoKl) {
    const VF ratio = L::exp_bounded(neg_kl);
    const VF truncated = L::sel(ratio > c.c, c.c, ratio);
    return L::keep_if(dppo_valid<K>(lp, old_lp, adv, c), -adv * truncated * w);
  } else if constexpr (K == kPolicyLossSapo) {
    const auto pos = adv > VF{};
    const VF tau = L::sel(pos, c.a, c.b);
    const VF ratio = L::exp_bounded(neg_kl);
    const VF sig = L::splat(1.0f) / (L::splat(1.0f) + L::exp_any(-(tau * (ratio - 1.0f))));
    const VF g = -adv * L::sel(pos, c.four_over_a, c.four_over_b) * (sig * (1.0f - sig)) * tau * ratio * w;
    return L::keep_if(ratio_live, g);
  } else if constexpr (K == kPolicyLossCispo) {
    return -L::clamp_keep_nan(L::exp_bounded(neg_kl), c.lower, c.upper) * adv * w;
  } else if constexpr (K == kPolicyLossDro) {
    return -(adv - c.a * x) * w;
  } else if constexpr (K == kPolicyLossGeoMean) {
    const auto pos = adv > VF{};
    const VF s = L::sel(pos, L::splat(1.0f), L::splat(-1.0f));
    const VF g = branch_weight<VF>(-s * x, -s * L::clamp_keep_nan(x, c.neg_eps_low, c.eps_high),
                                   L::land(x > c.neg_eps_low, x < c.eps_high));
    return L::keep_if(adv != VF{}, g);
  } else {  // kPolicyLossReinforce
    return -adv * w;
  }
}

// The ops' inputs as dtype-tagged views (log_prob's too: the lane code does not depend on its dtype).
struct Inputs {
  TokenView lp, old, adv, mask, w;
};

// One chunk of a row as fp32: inputs already fp32 with unit stride are read in place (full chunks); anything else,
// and the last partial chunk (padded past n with mask 0 and finite values), is converted into the buffers.
// start_row finds the in-place rows once per row, so a full chunk of such inputs costs no call at all.
struct Chunk {
  alignas(64) float buf[5][kChunk];
  const float* v[5];       // lp, old, adv, mask, w
  const float* direct[5];  // the row's first element of each input read in place (nullptr: converted)
  int64_t row_col0 = 0;

  // Out of line (compiled once, not in every copy and kind): a call per converted input and chunk of 64 tokens.
  __attribute__((noinline)) static const float* load(const TokenView& view, int64_t row, int64_t col0, int n,
                                                    float* buf, float pad) {
    if (n == kChunk) {
      if (const float* direct = view_row_ptr<float>(view, row, col0)) return direct;
    }
    if (view.col_stride == 0) {  // an expanded input (advantages from [B]): one value for the whole chunk
      const float x = view_load<float>(view, row, col0);
      for (int k = 0; k < kChunk; ++k) buf[k] = x;
    } else {
      view_load_chunk<kChunk>(view, row, col0, n, buf);
    }
    for (int k = n; k < kChunk; ++k) buf[k] = pad;
    return buf;
  }
  RC_FORCEINLINE void start_row(const Inputs& in, int64_t row, int64_t col0) {
    const TokenView* views[5] = {&in.lp, &in.old, &in.adv, &in.mask, &in.w};
    for (int i = 0; i < 5; ++i) {
      direct[i] = views[i]->data == nullptr ? nullptr : view_row_ptr<float>(*views[i], row, col0);
    }
    row_col0 = col0;
  }
  RC_FORCEINLINE const float* get(int i, const TokenView& view, int64_t row, int64_t col0, int n, float pad) {
    if (direct[i] != nullptr && n == kChunk) return direct[i] + (col0 - row_col0);
    return load(view, row, col0, n, buf[i], pad);
  }
  // (start_row first, for the same row.)
  RC_FORCEINLINE const float* load_mask(const Inputs& in, int64_t row, int64_t col0, int n) {
    return v[3] = get(3, in.mask, row, col0, n, 0.0f);
  }
  // The other inputs (the mask was loaded first). Absent weights read as 1. Without log_probs (REINFORCE's
  // gradient, -A w, reads neither log-prob) the lp / old lanes alias the advantages' and are not read from memory.
  RC_FORCEINLINE void load_rest(const Inputs& in, int64_t row, int64_t col0, int n, bool log_probs = true) {
    v[2] = get(2, in.adv, row, col0, n, 0.0f);
    if (log_probs) {
      v[0] = get(0, in.lp, row, col0, n, 0.0f);
      v[1] = get(1, in.old, row, col0, n, 0.0f);
    } else {
      v[0] = v[1] = v[2];
    }
    if (in.w.data != nullptr) {
      v[4] = get(4, in.w, row, col0, n, 1.0f);
    } else {
      for (int k = 0; k < kChunk; ++k) buf[4][k] = 1.0f;
      v[4] = buf[4];
    }
  }
};

template <typename VF>
RC_FORCEINLINE bool any_nonzero(const float* m) {
  using L = Lanes<VF>;
  typename L::VI nz = L::load(m) != VF{};
  for (int k = L::kWidth; k < kChunk; k += L::kWidth) nz = L::lor(nz, L::load(m + k) != VF{});
  return L::any(nz);
}

struct FwdArgs {
  Inputs in;
  float* loss_mat;  // nullptr: not wanted, and chunks whose mask is all 0 are skipped (they add nothing)
  float* row_partials;
  const int64_t* row_offsets;
  int32_t* undefined;
  int64_t rows, cols;
  PolicyLossConfig<float> cfg;
};

// Which row partials a kind can make nonzero (token<K> leaves the others at 0): the lane loop skips the rest.
template <int K>
constexpr bool kind_has_clip() {
  return K == kPolicyLossPpoClip || K == kPolicyLossGspo || K == kPolicyLossPpoUnbounded || K == kPolicyLossDppoTv ||
         K == kPolicyLossDppoKl || K == kPolicyLossCispo || K == kPolicyLossGeoMean;
}
template <int K>
constexpr bool kind_has_clip_lower() {
  return K == kPolicyLossPpoClip || K == kPolicyLossDppoTv || K == kPolicyLossDppoKl || K == kPolicyLossGeoMean;
}

// policy_loss_undefined over one row, chunk by chunk (the exact rule): run only for a row whose cheap screen below
// saw a non-finite value.
template <typename VF, int K>
RC_FORCEINLINE bool row_undefined(const FwdArgs& p, const SeqSpan& sp, Chunk& ch, const Cfg<VF>& cfg) {
  using L = Lanes<VF>;
  typename L::VI bad{};
  ch.start_row(p.in, sp.row, sp.col0);
  for (int64_t t0 = 0; t0 < sp.len; t0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, sp.len - t0));
    ch.load_mask(p.in, sp.row, sp.col0 + t0, n);
    ch.load_rest(p.in, sp.row, sp.col0 + t0, n);
    for (int k = 0; k < kChunk; k += L::kWidth) {
      const VF lp = L::load(ch.v[0] + k), old = L::load(ch.v[1] + k), adv = L::load(ch.v[2] + k);
      const VF m = L::load(ch.v[3] + k), w = L::load(ch.v[4] + k);
      bad = L::lor(bad, undefined<K>(lp, old, adv, w, m, token<K>(lp, old, adv, w, cfg).loss));
    }
  }
  return L::any(bad);
}

template <typename VF, int K>
RC_FORCEINLINE void forward_rows(const FwdArgs& p, int64_t begin, int64_t end) {
  using L = Lanes<VF>;
  using VI = typename L::VI;
  constexpr int W = L::kWidth;
  const Cfg<VF> cfg(p.cfg);
  Chunk ch;
  alignas(64) float tail[kChunk];
  bool any_undefined = false;
  for (int64_t r = begin; r < end; ++r) {
    const SeqSpan sp = seq_span(p.row_offsets, p.cols, r);
    ch.start_row(p.in, sp.row, sp.col0);
    float* out = p.loss_mat == nullptr ? nullptr : p.loss_mat + sp.row * p.cols + sp.col0;
    double row[kPgRowCols] = {};
    VF s_tokens{}, s_loss{}, s_clip{}, s_lower{}, s_kl{};
    // The undefined-loss screen: every input and the loss of each response token summed into lanes, which stay
    // finite unless one of them is NaN or +-inf (or the sum overflows); a negative mask weight enters as +inf.
    // policy_loss_undefined needs one of those, so a row whose screen stays finite has no undefined token; any
    // other row is checked exactly (row_undefined).
    VF screen{};
    int chunks = 0;
    for (int64_t t0 = 0; t0 < sp.len; t0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, sp.len - t0));
      const float* mask = ch.load_mask(p.in, sp.row, sp.col0 + t0, n);
      const bool skip = out == nullptr && !any_nonzero<VF>(mask);  // adds nothing: the fold below still runs
      if (!skip) ch.load_rest(p.in, sp.row, sp.col0 + t0, n);
      float* o = out != nullptr && n == kChunk ? out + t0 : tail;
      for (int k = 0; k < kChunk && !skip; k += W) {
        const VF lp = L::load(ch.v[0] + k), old = L::load(ch.v[1] + k), adv = L::load(ch.v[2] + k);
        const VF m = L::load(ch.v[3] + k), w = L::load(ch.v[4] + k);
        const TokenOut<VF> t = token<K>(lp, old, adv, w, cfg);
        if (out != nullptr) L::store(o + k, t.loss);
        // policy_row_partials_add: the mask multiplies, a token whose mask is 0 adds nothing (even a NaN).
        const VI nz = m != VF{};
        s_tokens += m;
        s_loss += L::keep_if(nz, t.loss * m);
        if constexpr (kind_has_clip<K>()) s_clip += L::keep_if(nz, t.clip * m);
        if constexpr (kind_has_clip_lower<K>()) s_lower += L::keep_if(nz, t.clip_lower * m);
        s_kl += L::keep_if(nz, t.kl * m);
        screen += L::keep_if(nz, ((lp + old) + (adv + w)) + (t.loss + L::sel(m < VF{}, L::splat(INFINITY), m)));
      }
      if (out != nullptr && n < kChunk) std::memcpy(out + t0, tail, sizeof(float) * n);
      if (++chunks == kFoldChunks || t0 + kChunk >= sp.len) {
        row[kPgRowTokens] += L::sum_f64(s_tokens);
        row[kPgRowLossSum] += L::sum_f64(s_loss);
        row[kPgRowClip] += L::sum_f64(s_clip);
        row[kPgRowClipLower] += L::sum_f64(s_lower);
        row[kPgRowKlSum] += L::sum_f64(s_kl);
        s_tokens = s_loss = s_clip = s_lower = s_kl = VF{};
        chunks = 0;
      }
    }
    for (int k = 0; k < kPgRowCols; ++k) p.row_partials[r * kPgRowCols + k] = static_cast<float>(row[k]);
    if (__builtin_expect(L::any(L::not_finite(screen)), 0)) any_undefined |= row_undefined<VF, K>(p, sp, ch, cfg);
  }
  if (any_undefined) *p.undefined = 1;  // any writer: same value
}

struct BwdArgs {
  Inputs in;
  TokenView grad_loss_mat;   // absent: data == nullptr
  TokenView grad_rows_loss;  // absent: data == nullptr
  void* grad;                // log_prob's dtype (grad_dtype), [rows, cols] contiguous
  ViewDtype grad_dtype;
  const int64_t* row_offsets;
  int64_t rows, cols;
  PolicyLossConfig<float> cfg;
};

// Store n fp32 gradients in log_prob's dtype (one rounding, as static_cast<scalar_t> of the scalar path).
RC_FORCEINLINE void store_grad(const BwdArgs& p, int64_t offset, const float* g, int n) {
  switch (p.grad_dtype) {
    case ViewDtype::kBFloat16: {
      c10::BFloat16* out = static_cast<c10::BFloat16*>(p.grad) + offset;
      for (int k = 0; k < n; ++k) out[k] = static_cast<c10::BFloat16>(g[k]);
      break;
    }
    case ViewDtype::kFloat16: {
      c10::Half* out = static_cast<c10::Half*>(p.grad) + offset;
      for (int k = 0; k < n; ++k) out[k] = static_cast<c10::Half>(g[k]);
      break;
    }
    default: std::memcpy(static_cast<float*>(p.grad) + offset, g, sizeof(float) * n);
  }
}

template <typename VF, int K>
RC_FORCEINLINE void backward_rows(const BwdArgs& p, int64_t begin, int64_t end) {
  using L = Lanes<VF>;
  using VI = typename L::VI;
  constexpr int W = L::kWidth;
  const Cfg<VF> cfg(p.cfg);
  const bool has_gmat = p.grad_loss_mat.data != nullptr;
  const bool direct = p.grad_dtype == ViewDtype::kFloat32;
  Chunk ch;
  alignas(64) float gmat_buf[kChunk];
  alignas(64) float res[kChunk];
  for (int64_t r = begin; r < end; ++r) {
    const SeqSpan sp = seq_span(p.row_offsets, p.cols, r);
    ch.start_row(p.in, sp.row, sp.col0);
    const int64_t base = sp.row * p.cols + sp.col0;
    const VF g_row = L::splat(view_load_or<float>(p.grad_rows_loss, r, 0, 0.0f));
    for (int64_t t0 = 0; t0 < sp.len; t0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, sp.len - t0));
      const int64_t col0 = sp.col0 + t0;
      const float* m = ch.load_mask(p.in, sp.row, col0, n);
      float* o = (direct && n == kChunk) ? static_cast<float*>(p.grad) + base + t0 : res;
      // The gradient goes straight to memory (no read of its lines first: a third less traffic for a 4-byte
      // output), where the chunk is aligned for it.
      const bool stream = o != res && cpu::stream_aligned<VF>(o);
      if (!has_gmat && !any_nonzero<VF>(m)) {  // nothing differentiates the chunk: exactly 0, nothing else read
        if (stream) {
          for (int k = 0; k < kChunk; k += W) cpu::stream_vec(o + k, VF{});
        } else {
          std::memset(o, 0, sizeof(float) * kChunk);
        }
      } else {
        ch.load_rest(p.in, sp.row, col0, n, /*log_probs=*/K != kPolicyLossReinforce);
        const float* gm = has_gmat ? Chunk::load(p.grad_loss_mat, sp.row, col0, n, gmat_buf, 0.0f) : nullptr;
        for (int k = 0; k < kChunk; k += W) {
          const VF mv = L::load(m + k);
          VF upstream = has_gmat ? L::load(gm + k) : VF{};
          const VI nz = mv != VF{};
          upstream = L::sel(nz, upstream + g_row * mv, upstream);
          const VF g = token_grad<K>(L::load(ch.v[0] + k), L::load(ch.v[1] + k), L::load(ch.v[2] + k),
                                     L::load(ch.v[4] + k), cfg);
          // A token nothing differentiates gets exactly 0, even where its own values are NaN / -inf.
          const VF out = L::keep_if(upstream != VF{}, upstream * g);
          if (stream) {
            cpu::stream_vec(o + k, out);
          } else {
            L::store(o + k, out);
          }
        }
      }
      if (o == res) store_grad(p, base + t0, res, n);
    }
  }
  cpu::stream_fence();  // this thread's streamed stores are visible before parallel_for returns
}

// One function per (copy, kind): the kind's loop is compiled once per ISA, and no function holds every kind (GCC's
// passes grow faster than linearly in a function's size: one function per copy took minutes to build).
template <int K>
RC_CPU_AVX512 void forward_kind_avx512(const FwdArgs& p, int64_t b, int64_t e) { forward_rows<cpu::v16f, K>(p, b, e); }
template <int K>
RC_CPU_AVX2 void forward_kind_avx2(const FwdArgs& p, int64_t b, int64_t e) { forward_rows<cpu::v8f, K>(p, b, e); }
template <int K>
void forward_kind_baseline(const FwdArgs& p, int64_t b, int64_t e) { forward_rows<cpu::v4f, K>(p, b, e); }
template <int K>
RC_CPU_AVX512 void backward_kind_avx512(const BwdArgs& p, int64_t b, int64_t e) {
  backward_rows<cpu::v16f, K>(p, b, e);
}
template <int K>
RC_CPU_AVX2 void backward_kind_avx2(const BwdArgs& p, int64_t b, int64_t e) { backward_rows<cpu::v8f, K>(p, b, e); }
template <int K>
void backward_kind_baseline(const BwdArgs& p, int64_t b, int64_t e) { backward_rows<cpu::v4f, K>(p, b, e); }

// The copy cpu::cpu_isa() picks (vec_math.h), for kind K.
template <int K>
void forward_kind(const FwdArgs& p, int64_t b, int64_t e) {
  switch (cpu::cpu_isa()) {
    case cpu::CpuIsa::kAvx512: return forward_kind_avx512<K>(p, b, e);
    case cpu::CpuIsa::kAvx2: return forward_kind_avx2<K>(p, b, e);
    default: return forward_kind_baseline<K>(p, b, e);
  }
}
template <int K>
void backward_kind(const BwdArgs& p, int64_t b, int64_t e) {
  switch (cpu::cpu_isa()) {
    case cpu::CpuIsa::kAvx512: return backward_kind_avx512<K>(p, b, e);
    case cpu::CpuIsa::kAvx2: return backward_kind_avx2<K>(p, b, e);
    default: return backward_kind_baseline<K>(p, b, e);
  }
}

// Rows [b, e) of the forward / backward: the one switch on the kind, per range of rows.
inline void forward_range(const FwdArgs& p, int64_t b, int64_t e) {
  switch (p.cfg.kind) {
#define RC_PG_KIND(name, code) \
  case code: return forward_kind<code>(p, b, e);
#include "policy_loss_layout.def"
    default: return;
  }
}
inline void backward_range(const BwdArgs& p, int64_t b, int64_t e) {
  switch (p.cfg.kind) {
#define RC_PG_KIND(name, code) \
  case code: return backward_kind<code>(p, b, e);
#include "policy_loss_layout.def"
    default: return;
  }
}

}  // namespace f32

// The fp32-accumulation ops on the lane kernels (f32::); false for fp64, which keeps the scalar per-token path.
template <typename scalar_t>
bool f32_forward(const PolicyLossParams<scalar_t, float>& p, ViewDtype lp_dtype, int64_t grain) {
  const f32::FwdArgs a{{TokenView{p.log_prob, p.lp_row_stride, p.lp_col_stride, lp_dtype}, p.old_log_prob,
                        p.advantages, p.mask, p.weights},
                       p.loss_mat, p.row_partials, p.row_offsets, p.undefined, p.rows, p.cols, p.cfg};
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { f32::forward_range(a, begin, end); });
  return true;
}
inline bool f32_forward(const PolicyLossParams<double, double>&, ViewDtype, int64_t) { return false; }
template <typename scalar_t>
bool f32_backward(const PolicyLossBackwardParams<scalar_t, float>& p, ViewDtype lp_dtype, int64_t grain) {
  const f32::BwdArgs a{{TokenView{p.log_prob, p.lp_row_stride, p.lp_col_stride, lp_dtype}, p.old_log_prob,
                        p.advantages, p.mask, p.weights},
                       p.grad_loss_mat, p.grad_rows_loss, p.grad_log_prob, lp_dtype, p.row_offsets, p.rows, p.cols,
                       p.cfg};
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { f32::backward_range(a, begin, end); });
  return true;
}
inline bool f32_backward(const PolicyLossBackwardParams<double, double>&, ViewDtype, int64_t) { return false; }

std::tuple<at::Tensor, at::Tensor> policy_loss_rows_cpu(const at::Tensor& log_prob, const at::Tensor& old_log_prob,
                                                        const at::Tensor& advantages, const at::Tensor& response_mask,
                                                        const c10::optional<at::Tensor>& weights, double clip_low,
                                                        double clip_high, double clip_c, int64_t loss_kind,
                                                        const c10::optional<at::Tensor>& cu_seqlens, double param_a,
                                                        double param_b, bool with_loss_mat) {
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);  // first: names a layout mistake as such
  check_policy_loss_inputs(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           loss_kind, param_a, param_b);
  // loss_mat (log_prob's shape; empty when not wanted) and rows [B, 5], contiguous, in the accumulation dtype.
  // loss_mat, which callers drop soon, comes from a reused block: a step writes it into pages already mapped.
  const at::ScalarType acc = policy_acc_dtype(log_prob.scalar_type());
  const at::Tensor loss_mat = with_loss_mat
                                  ? cpu::reused_empty(log_prob.sizes(), acc, cpu::ReusedUse::kPolicyLossMat)
                                  : at::empty({0}, log_prob.options().dtype(acc));
  const at::Tensor rows = at::empty({layout.rows, kPgRowCols}, log_prob.options().dtype(acc));
  const at::Tensor w = defined_or_empty(weights);
  const at::Tensor undefined = new_undefined_flag(log_prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_rows_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_params<scalar_t, acc_t>(log_prob, old_log_prob, advantages, response_mask, w,
                                                            loss_mat, rows, undefined, layout, clip_low, clip_high,
                                                            clip_c, loss_kind, param_a, param_b);
    const int64_t grain = policy_grain(p.cols / std::max<int64_t>(1, p.row_offsets ? p.rows : 1));
    if (!f32_forward(p, view_dtype_of(log_prob.scalar_type()), grain)) {
      at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          PolicyRowPartials<acc_t> partials = policy_row_partials_zero<acc_t>();
          const SeqSpan sp = seq_span(p.row_offsets, p.cols, r);
          if (!forward_row_fast(p, sp, partials))
            for (int64_t t = 0; t < sp.len; ++t) policy_loss_forward_token(p, sp.row, sp.col0 + t, partials);
          for (int k = 0; k < kPgRowCols; ++k) p.row_partials[r * kPgRowCols + k] = partials.v[k];
        }
      });
    }
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
  // every element is written (masked tokens 0), so a freed gradient's block can serve the next step (page faults
  // of a fresh multi-MiB buffer cost as much as the whole backward at 256 x 8192)
  auto grad = cpu::reused_empty(log_prob.sizes(), log_prob.scalar_type(), cpu::ReusedUse::kPolicyGrad);
  const at::Tensor w = defined_or_empty(weights);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_prob.scalar_type(), "policy_loss_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_policy_loss_backward_params<scalar_t, acc_t>(g_mat, g_rows, log_prob, old_log_prob,
                                                                     advantages, response_mask, w, grad, layout,
                                                                     clip_low, clip_high, clip_c, loss_kind, param_a, param_b);
    const int64_t grain = policy_grain(p.cols / std::max<int64_t>(1, p.row_offsets ? p.rows : 1));
    if (!f32_backward(p, view_dtype_of(log_prob.scalar_type()), grain)) {
      at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const SeqSpan sp = seq_span(p.row_offsets, p.cols, r);
          if (!backward_row_fast(p, r, sp))
            for (int64_t t = 0; t < sp.len; ++t) policy_loss_backward_token(p, r, sp.row, sp.col0 + t);
        }
      });
    }
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("policy_loss_rows", &policy_loss_rows_cpu);
  m.impl("policy_loss_backward", &policy_loss_backward_cpu);
}

}  // namespace rollout_corr
