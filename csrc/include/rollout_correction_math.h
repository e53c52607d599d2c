// Rollout correction (docs/rollout_correction.md): the per-token and per-sequence math of both passes, written once
// and called by
// the CPU kernels, the CUDA kernels and therefore the CUDA emulator. Torch-free. Formulas follow verl 0.9.1
// verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights, compute_is_metrics,
// compute_rollout_rejection_mask, compute_rs_metrics, compute_offpolicy_metrics); the veto follows verl 0.6.1.
//
// Token functions are templates over a lane type V: one token (V = acc_t: a CUDA thread, the emulator, fp64 on the
// CPU) or a CPU SIMD vector of tokens (V = 8 x fp32, GCC vector extensions). They use only operators that mean
// the same for both (arithmetic, comparisons, !, &, |, ?: on conditions) plus LaneMath<V> for exp and
// reductions, so the CPU's vector lanes compute exactly what a GPU thread computes. Invalid tokens (mask 0,
// padding junk, NaN) are neutralised by selects, never by branches, so a lane never contributes anything.
#pragma once

#include <cmath>
#include <cstdint>

#include "rc_macros.h"
#include "rollout_correction_params.h"
#include "scalar_math.h"

namespace rollout_corr {
namespace rc {

// What the token math needs beyond operators, for one token; the CPU kernel specialises it for its vectors.
template <typename V>
struct LaneMath {
  using Cond = bool;
  using Scalar = V;  // the type of one lane
  RC_HD static RC_FORCEINLINE V splat(double c) { return static_cast<V>(c); }
  RC_HD static RC_FORCEINLINE bool all_false() { return false; }
  RC_HD static RC_FORCEINLINE V exp(V x) { return rc_exp(x); }
  RC_HD static RC_FORCEINLINE V exp_exact(V x) { return rc_exp(x); }  // also beyond the fast path's range
  RC_HD static RC_FORCEINLINE bool any(bool c) { return c; }
};

template <typename V, typename S>
RC_HD RC_FORCEINLINE V splat(S c) {
  return LaneMath<V>::splat(static_cast<double>(c));
}
template <typename V, typename C>
RC_HD RC_FORCEINLINE V select(C c, V a, V b) {
  return c ? a : b;
}
template <typename V>
RC_HD RC_FORCEINLINE V vmax(V a, V b) {
  return a > b ? a : b;
}
template <typename V>
RC_HD RC_FORCEINLINE auto is_finite(V x) {
  return x - x == splat<V>(0);  // false for NaN and +-inf
}

template <typename V>
RC_HD RC_FORCEINLINE V clamp20(V x) {
  const V b = splat<V>(k_safety_bound);
  return x < -b ? -b : (x > b ? b : x);
}

// k3 = e^l - 1 - l from rho = e^l without the cancellation of rho - 1 near 0: |l| < 1/2 uses l^2 K(l), K(l) =
// (e^l - 1 - l) / l^2 as a polynomial: on fp32 lanes a degree-6 fit at Chebyshev nodes (max relative error 5.9e-8
// evaluated in fp32, the same as the Taylor series it replaces), in fp64 the Taylor series to l^11 (truncation
// < 2^-12 / 12! relative); beyond, rho - 1 - l loses at most a few ulps (|rho - 1| >= 0.39).
template <typename V>
RC_HD RC_FORCEINLINE V k3_of(V l, V rho) {
  V p;
  if constexpr (sizeof(typename LaneMath<V>::Scalar) == 4) {
    p = splat<V>(2.493974171e-05);
    p = p * l + splat<V>(1.996218634e-04);
    p = p * l + splat<V>(1.388867269e-03);
    p = p * l + splat<V>(8.333181962e-03);
    p = p * l + splat<V>(4.166666791e-02);
    p = p * l + splat<V>(1.666666716e-01);
    p = p * l + splat<V>(0.5);
  } else {
    p = splat<V>(1.0 / 39916800);
    p = p * l + splat<V>(1.0 / 3628800);
    p = p * l + splat<V>(1.0 / 362880);
    p = p * l + splat<V>(1.0 / 40320);
    p = p * l + splat<V>(1.0 / 5040);
    p = p * l + splat<V>(1.0 / 720);
    p = p * l + splat<V>(1.0 / 120);
    p = p * l + splat<V>(1.0 / 24);
    p = p * l + splat<V>(1.0 / 6);
    p = p * l + splat<V>(0.5);
  }
  const V series = p * l * l;
  const V direct = rho - splat<V>(1) - l;
  return (l > splat<V>(-0.5)) & (l < splat<V>(0.5)) ? series : direct;
}

// RS statistic of one token (k1 = -l, k2 = l^2/2, k3, ratio = rho) and whether criterion bounds keep it.
// (A switch, not a select: the statistic is uniform across lanes and threads, so only its own arm runs.)
template <typename V>
RC_HD RC_FORCEINLINE V token_stat(int stat, V l, V rho, V k3) {
  switch (stat) {
    case rs_stat::k1: return -l;
    case rs_stat::k2: return splat<V>(0.5) * l * l;
    case rs_stat::k3: return k3;
    default: return rho;
  }
}
template <typename V, typename acc_t>
RC_HD RC_FORCEINLINE auto crit_keeps(V s, acc_t lower, acc_t upper, bool apply_lower) {
  auto keep = s <= splat<V>(upper);
  if (apply_lower) keep = keep & (s >= splat<V>(lower));
  return keep;
}

// Token-level IS weight: TIS clamp(rho, L, U) (L = 0, a no-op on a weight, unless two-sided), IcePop
// rho * 1[L <= rho <= U].
template <typename V, typename acc_t>
RC_HD RC_FORCEINLINE V token_is_weight(V rho, const Config<acc_t>& c) {
  const V upper = splat<V>(c.is_upper), lower = splat<V>(c.is_lower);
  if (c.is_mask) return (rho >= lower) & (rho <= upper) ? rho : splat<V>(0);
  const V capped = rho < upper ? rho : upper;
  return capped > lower ? capped : lower;
}

// The number of token-level criteria a token function loops over: kRuntimeCount reads it from the config; the CPU
// kernels instantiate the common counts as constants, so the loops unroll, every accumulator index is a constant
// and the compiler keeps the accumulators in registers instead of in memory.
constexpr int kRuntimeCount = -1;
template <int kCount, typename acc_t>
RC_HD RC_FORCEINLINE int token_crit_count(const Config<acc_t>& c) {
  return kCount == kRuntimeCount ? c.num_token_crit : kCount;
}

// ---- pass 1: per-sequence aggregates ------------------------------------------------------------------------------

// Running per-sequence aggregates of one thread (or one SIMD vector of lanes).
template <typename V>
struct SeqAcc {
  V sum[seq::kNumSums];
  V max[seq::kCols - seq::kNumSums];
};

template <typename V>
RC_HD RC_FORCEINLINE void seq_acc_init(SeqAcc<V>& s) {
  for (int k = 0; k < seq::kNumSums; ++k) s.sum[k] = splat<V>(0);
  for (int k = 0; k < seq::kCols - seq::kNumSums; ++k) s.max[k] = splat<V>(-INFINITY);
}
template <typename V>
RC_HD RC_FORCEINLINE V& seq_max(SeqAcc<V>& s, int col) {
  return s.max[col - seq::kNumSums];
}

// The classification every pass makes of a token: valid (mask 1, and finite when non-finite tokens are excluded),
// a mask value other than 0/1, a non-finite log-prob at a mask-1 position.
template <typename V>
struct TokenClass {
  typename LaneMath<V>::Cond valid, bad_mask, nonfinite;
};
template <typename V, typename acc_t>
RC_HD RC_FORCEINLINE TokenClass<V> classify_token(const Config<acc_t>& c, V a, V q, V m) {
  TokenClass<V> k;
  const auto nonzero = m != splat<V>(0);
  k.bad_mask = nonzero & (m != splat<V>(1));
  const auto finite = is_finite(a) & is_finite(q);
  k.nonfinite = nonzero & !finite;
  k.valid = c.exclude_nonfinite ? (nonzero & finite) : nonzero;
  return k;
}

// Fold one token (lanes) into the sequence aggregates.
template <int kTokenCrit = kRuntimeCount, typename V, typename acc_t>
RC_HD RC_FORCEINLINE void seq_stats_token(const Config<acc_t>& c, V a, V q, V m, SeqAcc<V>& s) {
  using L = LaneMath<V>;
  const V zero = splat<V>(0), one = splat<V>(1), neg_inf = splat<V>(-INFINITY);
  const TokenClass<V> k = classify_token(c, a, q, m);
  s.sum[seq::bad_mask] += select(k.bad_mask, one, zero);
  s.sum[seq::nonfinite] += select(k.nonfinite, one, zero);
  const V lr = select(k.valid, a - q, zero);  // invalid lanes: lr = 0, so l = 0, rho = 1, k2 = k3 = 0
  const V l = clamp20(lr);
  const V rho = L::exp(l);
  const V k3 = k3_of(l, rho);
  const V k2 = splat<V>(0.5) * l * l;
  s.sum[seq::tokens] += select(k.valid, one, zero);
  s.sum[seq::log_ratio] += lr;
  s.sum[seq::k1] -= l;
  s.sum[seq::k2] += k2;
  s.sum[seq::k3] += k3;
  s.sum[seq::log_prob] += select(k.valid, a, zero);
  s.sum[seq::rollout_log_prob] += select(k.valid, q, zero);
  s.sum[seq::rho] += select(k.valid, rho, zero);
  if (c.is_level == is_level::token) s.sum[seq::token_weight] += select(k.valid, token_is_weight(rho, c), zero);
  const int num_token_crit = token_crit_count<kTokenCrit>(c);
  if (num_token_crit > 0) {
    typename L::Cond rejected_any = L::all_false();
    for (int j = 0; j < num_token_crit; ++j) {
      const int i = c.token_crit[j];
      const int stat = c.crit_stat[i];
      const auto rejected = k.valid & !crit_keeps(token_stat(stat, l, rho, k3), c.crit_lower[i], c.crit_upper[i],
                                                 c.crit_apply_lower[i]);
      const V count = select(rejected, one, zero);
      switch (stat) {  // constant slots (a computed index would keep the whole accumulator block in memory)
        case rs_stat::k1: s.sum[seq::rejected_k1] += count; break;
        case rs_stat::k2: s.sum[seq::rejected_k2] += count; break;
        case rs_stat::k3: s.sum[seq::rejected_k3] += count; break;
        default: s.sum[seq::rejected_ratio] += count; break;
      }
      rejected_any = rejected_any | rejected;
    }
    s.sum[seq::rejected] += select(rejected_any, one, zero);
  }
  seq_max(s, seq::max_k2) = vmax(seq_max(s, seq::max_k2), select(k.valid, k2, neg_inf));
  seq_max(s, seq::max_k3) = vmax(seq_max(s, seq::max_k3), select(k.valid, k3, neg_inf));
  seq_max(s, seq::neg_min_log_ratio) = vmax(seq_max(s, seq::neg_min_log_ratio), select(k.valid, -lr, neg_inf));
}

// ---- per-sequence values both passes need (from one row of context-parallel reduced seq_stats) ----------------------

template <typename acc_t>
struct RowValues {
  acc_t n, lr_sum, log_w, raw_w, w;  // IS: log weight (sum or mean of lr), its e^clamp20, truncated / masked
  acc_t wc_centre;                   // token-level IS: the row's mean clamped weight (pass 1), 0 without tokens
  bool seq_rejected, veto;           // some sequence-level criterion rejects the row; the veto fires
  acc_t crit_value[kMaxCriteria];    // each criterion's per-sequence value (token level: its mean over the row)
  acc_t crit_centre[kMaxCriteria];   // token level: that mean clamped as the std clamps a token (its sums' centre:
                                     // deviations near 0 keep E[x^2] - E[x]^2 free of fp32 cancellation), 0 without
                                     // tokens
  bool crit_keep[kMaxCriteria];      // sequence-level criteria: the row passes
};

// A row mean's denominator, verl's masked_mean(axis=-1) for the mask's dtype: n + c.count_eps, and eps for a row
// without a valid token (whose sums are 0).
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t row_den(const Config<acc_t>& c, acc_t n) {
  return n > acc_t(0) ? n + c.count_eps : static_cast<acc_t>(k_eps);
}

template <typename acc_t>
RC_HD inline void row_values(const acc_t* st, const Config<acc_t>& c, RowValues<acc_t>& r) {
  r.n = RC_LDG(st + seq::tokens);
  const acc_t den = row_den(c, r.n);
  r.lr_sum = RC_LDG(st + seq::log_ratio);
  r.log_w = c.is_level == is_level::sequence ? r.lr_sum : r.lr_sum / den;
  r.raw_w = rc_exp(clamp20(r.log_w));
  if (c.is_mask)
    r.w = (r.raw_w >= c.is_lower && r.raw_w <= c.is_upper) ? r.raw_w : acc_t(0);
  else  // TIS, two-sided when is_lower > 0
    r.w = r.raw_w < c.is_upper ? (r.raw_w > c.is_lower ? r.raw_w : c.is_lower) : c.is_upper;
  r.wc_centre = acc_t(0);
  if (c.is_level == is_level::token && r.n > acc_t(0)) {
    const acc_t mean_w = RC_LDG(st + seq::token_weight) / r.n;
    r.wc_centre = mean_w < acc_t(0) ? acc_t(0) : (mean_w > c.is_upper ? c.is_upper : mean_w);
  }
  r.seq_rejected = false;
  for (int i = 0; i < c.num_rs; ++i) {
    const int level = c.crit_level[i], stat = c.crit_stat[i];
    acc_t v;
    r.crit_keep[i] = true;
    if (level == rs_level::token) {  // per-row mean of the token statistic (verl masked_mean(axis=-1))
      const int col = stat == rs_stat::k1 ? seq::k1 : (stat == rs_stat::k2 ? seq::k2 : (stat == rs_stat::k3 ? seq::k3 : seq::rho));
      v = RC_LDG(st + col) / den;
    } else {
      if (stat == rs_stat::ratio) {
        v = rc_exp(clamp20(level == rs_level::seq_sum ? r.lr_sum : r.lr_sum / den));
      } else if (level == rs_level::seq_max) {  // verl: -inf (no valid token) -> 0
        v = r.n > 0 ? RC_LDG(st + (stat == rs_stat::k2 ? seq::max_k2 : seq::max_k3)) : acc_t(0);
      } else {
        const acc_t s = RC_LDG(st + (stat == rs_stat::k1 ? seq::k1 : (stat == rs_stat::k2 ? seq::k2 : seq::k3)));
        v = level == rs_level::seq_sum ? s : s / den;
      }
      r.crit_keep[i] = crit_keeps(v, c.crit_lower[i], c.crit_upper[i], c.crit_apply_lower[i]);
      r.seq_rejected |= !r.crit_keep[i];
    }
    r.crit_value[i] = v;
    const acc_t lo = c.crit_apply_lower[i] ? c.crit_lower[i] : acc_t(0), up = c.crit_upper[i];
    r.crit_centre[i] = level == rs_level::token && r.n > acc_t(0) ? (v < lo ? lo : (v > up ? up : v)) : acc_t(0);
  }
  // Veto: a valid token with lr < log V  <=>  max(-lr) > -log V.
  r.veto = c.veto_on && RC_LDG(st + seq::neg_min_log_ratio) > -c.veto_log;
}

// ---- pass 2: weights, mask and the TOKEN-sourced metric terms -------------------------------------------------------

template <typename V>
struct TokenAcc {
  V sum[tok_sum::kCount];
  V max[tok_max::kCount];
  V crit_sum[kMaxTokenCriteria][tok_crit_sum::kCount];  // j-th token-level criterion
  V crit_max[kMaxTokenCriteria][tok_crit_max::kCount];
};

template <typename V>
RC_HD RC_FORCEINLINE void token_acc_init(TokenAcc<V>& t) {
  for (int k = 0; k < tok_sum::kCount; ++k) t.sum[k] = splat<V>(0);
  for (int k = 0; k < tok_max::kCount; ++k) t.max[k] = splat<V>(-INFINITY);
  for (int j = 0; j < kMaxTokenCriteria; ++j) {
    for (int k = 0; k < tok_crit_sum::kCount; ++k) t.crit_sum[j][k] = splat<V>(0);
    for (int k = 0; k < tok_crit_max::kCount; ++k) t.crit_max[j][k] = splat<V>(-INFINITY);
  }
}

// What pass 2 writes for a token (lanes), and the log-weight the caller bins into the histogram when hist is set.
template <typename V>
struct TokenOut {
  V weight;     // IS weight (0 where invalid)
  V mask;       // output mask value: 1 kept, 0 rejected / invalid
  V log_w;      // clamp20(lr): histogram coordinate (token-level IS)
  typename LaneMath<V>::Cond hist;  // this lane is a valid token of a token-level IS config
};

template <int kTokenCrit = kRuntimeCount, typename V, typename acc_t>
RC_HD RC_FORCEINLINE TokenOut<V> token_pass_token(const Config<acc_t>& c, const RowValues<acc_t>& r, bool row_dropped,
                                                  V a, V q, V m, TokenAcc<V>& t) {
  using L = LaneMath<V>;
  const V zero = splat<V>(0), one = splat<V>(1), neg_inf = splat<V>(-INFINITY);
  const TokenClass<V> k = classify_token(c, a, q, m);
  const V lr = select(k.valid, a - q, zero);
  const V l = clamp20(lr);
  const V rho = L::exp(l);
  const V k3 = k3_of(l, rho);
  TokenOut<V> out;
  out.log_w = l;
  out.hist = c.is_level == is_level::token ? k.valid : L::all_false();
  if (c.is_level == is_level::token) {
    const V upper = splat<V>(c.is_upper);
    const V w = token_is_weight(rho, c);
    const V wc = w < zero ? zero : (w > upper ? upper : w);
    out.weight = select(k.valid, w, zero);
    t.sum[tok_sum::is_weight] += out.weight;
    const V centre = splat<V>(r.wc_centre);
    const V dev = select(k.valid, wc - centre, zero);  // exact in fp32 when wc is near the centre (Sterbenz)
    t.sum[tok_sum::is_wc_dev] += dev;
    t.sum[tok_sum::is_wc_dev_sq] += dev * dev;
    t.sum[tok_sum::is_wc_centre_dev] += centre * dev;
    t.sum[tok_sum::is_high] += select(k.valid & (rho > upper), one, zero);
    t.sum[tok_sum::is_low] += select(k.valid & (rho < splat<V>(c.is_metric_lower)), one, zero);
    if (c.is_mask)
      t.sum[tok_sum::is_out_of_band] +=
          select(k.valid & ((rho < splat<V>(c.is_lower)) | (rho > upper)), one, zero);
    t.max[tok_max::is_weight] = vmax(t.max[tok_max::is_weight], select(k.valid, w, neg_inf));
    t.max[tok_max::neg_is_weight] = vmax(t.max[tok_max::neg_is_weight], select(k.valid, -w, neg_inf));
  } else {
    out.weight = select(k.valid, splat<V>(r.w), zero);
  }
  typename L::Cond keep = row_dropped ? L::all_false() : k.valid;
  const int num_token_crit = token_crit_count<kTokenCrit>(c);
  for (int j = 0; j < num_token_crit; ++j) {
    const int i = c.token_crit[j];
    const V s = token_stat(c.crit_stat[i], l, rho, k3);
    const V lower = splat<V>(c.crit_lower[i]), upper = splat<V>(c.crit_upper[i]);
    const bool apply_lower = c.crit_apply_lower[i];
    keep = keep & crit_keeps(s, c.crit_lower[i], c.crit_upper[i], apply_lower);
    const V clamp_min = apply_lower ? lower : zero;
    const V sc = s < clamp_min ? clamp_min : (s > upper ? upper : s);
    V* cs = t.crit_sum[j];
    V* cm = t.crit_max[j];
    cs[tok_crit_sum::stat] += select(k.valid, s, zero);
    const V centre = splat<V>(r.crit_centre[i]);
    const V dev = select(k.valid, sc - centre, zero);
    cs[tok_crit_sum::clamped_dev] += dev;
    cs[tok_crit_sum::clamped_dev_sq] += dev * dev;
    cs[tok_crit_sum::centre_dev] += centre * dev;
    cs[tok_crit_sum::high] += select(k.valid & (s > upper), one, zero);
    if (apply_lower) cs[tok_crit_sum::low] += select(k.valid & (s < lower), one, zero);
    cm[tok_crit_max::stat] = vmax(cm[tok_crit_max::stat], select(k.valid, s, neg_inf));
    cm[tok_crit_max::neg_stat] = vmax(cm[tok_crit_max::neg_stat], select(k.valid, -s, neg_inf));
  }
  out.mask = select(keep, one, zero);
  // k3_kl uses the unclamped ratio: only lanes with |lr| > 20 need another exp.
  const auto clamped = l != lr;
  V k3_raw = k3;
  if (L::any(clamped)) k3_raw = select(clamped, L::exp_exact(lr) - one - lr, k3);
  t.sum[tok_sum::k3_raw] += select(k.valid, k3_raw, zero);
  t.sum[tok_sum::rho_sq] += select(k.valid, rho * rho, zero);
  if (c.veto_on) t.sum[tok_sum::catastrophic] += select(k.valid & (lr < splat<V>(c.veto_log)), one, zero);
  return out;
}

// Fixed log-space histogram bin of log w in [hist_lo, hist_hi], computed in the accumulation type (so every
// backend bins alike). NaN only reaches here when the op is about to raise; it lands in bin 0.
template <typename acc_t>
RC_HD RC_FORCEINLINE int hist_index(acc_t log_w) {
  const acc_t f = (log_w - static_cast<acc_t>(k_hist_lo)) * static_cast<acc_t>(k_hist_bins / (k_hist_hi - k_hist_lo));
  if (!(f > acc_t(0))) return 0;  // also NaN
  return f < static_cast<acc_t>(kHistBins - 1) ? static_cast<int>(f) : kHistBins - 1;
}

// The partial SUM / MAX rows are global memory on the GPU (per-block scratch): through RC_LDG / RC_STG.
RC_HD RC_FORCEINLINE void upd_max(double& m, double v) {
  const double old = RC_LDG(&m);
  RC_STG(&m, v > old ? v : old);
}
RC_HD RC_FORCEINLINE void add_to(double& s, double v) { RC_STG(&s, RC_LDG(&s) + v); }

// Add the TOKEN terms of one reduced accumulator (scalars: acc_t on the GPU, fp64 on the CPU) into the SUM / MAX
// partial vectors, slot by name.
template <typename acc_t, typename T>
RC_HD inline void fold_token_acc(const Config<acc_t>& c, const TokenAcc<T>& t, double* S, double* M) {
#define RC_SUM(name, source) RC_SUM_##source(name)
#define RC_SUM_TOKEN(name) add_to(S[sum_slot::name], static_cast<double>(t.sum[tok_sum::name]));
#define RC_SUM_ROW(name)
#define RC_MAX(name, source) RC_MAX_##source(name)
#define RC_MAX_TOKEN(name) upd_max(M[max_slot::name], static_cast<double>(t.max[tok_max::name]));
#define RC_MAX_ROW(name)
#include "rollout_correction_layout.def"
#undef RC_SUM_TOKEN
#undef RC_SUM_ROW
#undef RC_MAX_TOKEN
#undef RC_MAX_ROW
  for (int j = 0; j < c.num_token_crit; ++j) {
    double* Sc = crit_sums(S, c.token_crit[j]);
    double* Mc = crit_maxes(M, c.token_crit[j]);
    const T* cs = t.crit_sum[j];
    const T* cm = t.crit_max[j];
#define RC_CRIT_SUM(name, source) RC_CRIT_SUM_##source(name)
#define RC_CRIT_SUM_TOKEN(name) add_to(Sc[crit_sum_slot::name], static_cast<double>(cs[tok_crit_sum::name]));
#define RC_CRIT_SUM_ROW(name)
#define RC_CRIT_MAX(name, source) RC_CRIT_MAX_##source(name)
#define RC_CRIT_MAX_TOKEN(name) upd_max(Mc[crit_max_slot::name], static_cast<double>(cm[tok_crit_max::name]));
#define RC_CRIT_MAX_ROW(name)
#include "rollout_correction_layout.def"
#undef RC_CRIT_SUM_TOKEN
#undef RC_CRIT_SUM_ROW
#undef RC_CRIT_MAX_TOKEN
#undef RC_CRIT_MAX_ROW
  }
}

// ---- pass 2: the ROW terms of one sequence -------------------------------------------------------------------------
// Added once per sequence (by one rank of a context-parallel group), from its reduced seq_stats row: per-row values
// in acc_t, sums in fp64.
template <typename acc_t>
RC_HD inline void add_row_partials(const Config<acc_t>& c, const acc_t* st, const RowValues<acc_t>& r, double* S,
                                   double* M) {
  const acc_t den = row_den(c, r.n);
  const double nd = r.n;
  const bool sv = r.n > 0;
  add_to(S[sum_slot::tokens], nd);
  add_to(S[sum_slot::rows], 1);
  add_to(S[sum_slot::valid_rows], sv);
  add_to(S[sum_slot::nonfinite], RC_LDG(st + seq::nonfinite));
  add_to(S[sum_slot::bad_mask], RC_LDG(st + seq::bad_mask));
  if (c.is_level != is_level::none) {
    acc_t x, raw_mean;  // the row's mean weight, and its mean raw (pre-truncation) weight
    if (c.is_level == is_level::token) {
      x = RC_LDG(st + seq::token_weight) / den;
      raw_mean = RC_LDG(st + seq::rho) / den;
      const double centre = r.wc_centre;
      add_to(S[sum_slot::is_wc_centre], nd * centre);
      add_to(S[sum_slot::is_wc_centre_sq], nd * centre * centre);
    } else {
      const acc_t wc = r.w < acc_t(0) ? acc_t(0) : (r.w > c.is_upper ? c.is_upper : r.w);
      add_to(S[sum_slot::seq_is_weight], nd * static_cast<double>(r.w));
      const double wcd = static_cast<double>(wc);
      add_to(S[sum_slot::seq_is_wc], nd * wcd);
      add_to(S[sum_slot::seq_is_wc_sq], nd * wcd * wcd);
      add_to(S[sum_slot::seq_is_high], r.log_w > c.log_is_upper);
      add_to(S[sum_slot::seq_is_low], r.log_w < c.log_is_metric_lower);
      if (c.is_mask) add_to(S[sum_slot::seq_is_out_of_band], nd * ((r.raw_w < c.is_lower) || (r.raw_w > c.is_upper)));
      upd_max(M[max_slot::is_log_weight], r.log_w);
      upd_max(M[max_slot::neg_is_log_weight], -r.log_w);
      add_to(S[sum_slot::kHist + hist_index(clamp20(r.log_w))], nd);
      x = r.w * r.n / den;
      raw_mean = r.raw_w * r.n / den;
    }
    add_to(S[sum_slot::is_seq_mean], x);
    add_to(S[sum_slot::is_seq_mean_sq], static_cast<double>(x) * static_cast<double>(x));
    add_to(S[sum_slot::is_seq_high], raw_mean > c.is_upper);
    add_to(S[sum_slot::is_seq_low], raw_mean < c.is_metric_lower);
    upd_max(M[max_slot::is_seq_mean], x);
    upd_max(M[max_slot::neg_is_seq_mean], -x);
    upd_max(M[max_slot::is_seq_deviation], std::fabs(static_cast<double>(x - acc_t(1))));
  }
  for (int i = 0; i < c.num_rs; ++i) {
    double* Sc = crit_sums(S, i);
    double* Mc = crit_maxes(M, i);
    const acc_t v = r.crit_value[i], lo = c.crit_lower[i], up = c.crit_upper[i];
    const bool apply_lower = c.crit_apply_lower[i];
    bool rejected_row;
    if (c.crit_level[i] != rs_level::token) {  // the token slots, filled per sequence and n_b-weighted
      const acc_t clamp_min = apply_lower ? lo : acc_t(0);
      const acc_t sc = v < clamp_min ? clamp_min : (v > up ? up : v);
      add_to(Sc[crit_sum_slot::stat], nd * static_cast<double>(v));
      const double scd = static_cast<double>(sc);  // the row's own value: its centre, no deviation
      add_to(Sc[crit_sum_slot::centre], nd * scd);
      add_to(Sc[crit_sum_slot::centre_sq], nd * scd * scd);
      add_to(Sc[crit_sum_slot::high], (v > up) && sv);
      if (apply_lower) add_to(Sc[crit_sum_slot::low], (v < lo) && sv);
      if (sv) {
        upd_max(Mc[crit_max_slot::stat], v);
        upd_max(Mc[crit_max_slot::neg_stat], -v);
      }
      rejected_row = !r.crit_keep[i] && sv;
      add_to(Sc[crit_sum_slot::rejected_tokens], rejected_row ? nd : 0.0);
    } else {
      const int stat = c.crit_stat[i];
      const acc_t count = RC_LDG(st + (stat == rs_stat::k1   ? seq::rejected_k1
                             : stat == rs_stat::k2 ? seq::rejected_k2
                             : stat == rs_stat::k3 ? seq::rejected_k3
                                                   : seq::rejected_ratio));
      add_to(Sc[crit_sum_slot::rejected_tokens], count);
      rejected_row = count > 0 && sv;
      const double centre = r.crit_centre[i];
      add_to(Sc[crit_sum_slot::centre], nd * centre);
      add_to(Sc[crit_sum_slot::centre_sq], nd * centre * centre);
    }
    add_to(Sc[crit_sum_slot::rejected_rows], rejected_row);
    if (sv) {
      add_to(Sc[crit_sum_slot::seq], v);
      add_to(Sc[crit_sum_slot::seq_sq], static_cast<double>(v) * static_cast<double>(v));
      add_to(Sc[crit_sum_slot::seq_high], v > up);
      if (apply_lower) add_to(Sc[crit_sum_slot::seq_low], v < lo);
      upd_max(Mc[crit_max_slot::seq], v);
      upd_max(Mc[crit_max_slot::neg_seq], -v);
      upd_max(Mc[crit_max_slot::seq_deviation], std::fabs(static_cast<double>(v)));
    }
  }
  const acc_t rejected_tokens = RC_LDG(st + seq::rejected);
  add_to(S[sum_slot::rs_rejected_tokens], r.seq_rejected ? nd : static_cast<double>(rejected_tokens));
  add_to(S[sum_slot::rs_rejected_rows], (r.seq_rejected && sv) || rejected_tokens > 0);
  add_to(S[sum_slot::veto_rows], r.veto);
  const bool dropped = r.seq_rejected || r.veto;
  add_to(S[sum_slot::final_rejected_tokens], dropped ? nd : static_cast<double>(rejected_tokens));
  add_to(S[sum_slot::final_rejected_rows], sv && (dropped || rejected_tokens > 0));
  // Off-policy row terms (verl compute_offpolicy_metrics): per-sequence means, averaged over all rows.
  const acc_t mean_lp = RC_LDG(st + seq::log_prob) / den, mean_rlp = RC_LDG(st + seq::rollout_log_prob) / den;
  const acc_t lpd = -r.lr_sum / den;
  add_to(S[sum_slot::log_ratio], r.lr_sum);
  // the perplexities' exps in fp64, as their sums: a row mean below -88 overflows fp32's exp (not fp64's)
  add_to(S[sum_slot::training_ppl], rc_exp(-static_cast<double>(mean_lp)));
  add_to(S[sum_slot::training_log_ppl], -mean_lp);
  add_to(S[sum_slot::rollout_ppl], rc_exp(-static_cast<double>(mean_rlp)));
  add_to(S[sum_slot::rollout_log_ppl], -mean_rlp);
  add_to(S[sum_slot::log_ppl_diff], lpd);
  add_to(S[sum_slot::log_ppl_abs_diff], (lpd < acc_t(0) ? -lpd : lpd));
  add_to(S[sum_slot::ppl_ratio], rc_exp(static_cast<double>(lpd)));
  add_to(S[sum_slot::chi2_seq], rc_exp(acc_t(2) * clamp20(r.lr_sum)));
  upd_max(M[max_slot::log_ppl_diff], lpd);
  upd_max(M[max_slot::neg_log_ppl_diff], -lpd);
}

}  // namespace rc
}  // namespace rollout_corr
