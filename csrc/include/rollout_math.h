// Rollout correction (DESIGN §3): layouts, decoded parameters and the per-token / per-row math shared by the
// CPU kernels, the CUDA kernels and the CUDA emulator. Torch-free. The layouts mirror the Python contract in
// rollout_corr_ext/reference.py (RC_SEQ_*, RC_P_*, RC_S_*, RC_M_*); formulas follow verl 0.9.1
// verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights, compute_is_metrics,
// compute_rollout_rejection_mask, compute_rs_metrics, compute_offpolicy_metrics) and verl 0.6.1 for the veto.
#pragma once

#include <cmath>
#include <cstdint>

#include "rc_macros.h"

namespace rollout_corr {
namespace rc {

// Per-sequence aggregates [B, kSeqCols]: the first kSeqNumSum columns are sums, the rest maxima.
enum SeqCol : int {
  kSeqN = 0, kSeqLR, kSeqK1, kSeqK2, kSeqK3, kSeqLP, kSeqRLP, kSeqWRaw, kSeqWTok, kSeqRejToken,
  kSeqRejK1, kSeqRejK2, kSeqRejK3, kSeqRejRatio, kSeqNonFinite, kSeqMaxK2, kSeqMaxK3, kSeqNegMinLR
};
constexpr int kSeqNumSum = 15;
constexpr int kSeqCols = 18;

// Packed parameter list.
enum ParamIdx : int {
  kPIsLevel = 0, kPIsMask, kPIsLower, kPIsUpper, kPIsMetricLower, kPVetoOn, kPVetoLog, kPExcludeNonFinite, kPNumRs
};
constexpr int kPHeader = 9;
constexpr int kPCrit = 5;
enum IsLevel : int { kIsNone = 0, kIsToken, kIsSequence, kIsGeometric };
enum CritLevel : int { kLevelToken = 0, kLevelSeqSum, kLevelSeqMean, kLevelSeqMax };
enum CritStat : int { kStatK1 = 0, kStatK2, kStatK3, kStatRatio };
constexpr int kMaxCrit = 16;

// SUM partials: globals, the histogram, then kRsSum per criterion. MAX partials: globals, then kRsMax per criterion.
enum SumSlot : int {
  kSN = 0, kSRows, kSSeqValid, kSNonFinite, kSIsW, kSIsWc, kSIsWc2, kSIsHigh, kSIsLow, kSIsOob, kSIsSeq, kSIsSeq2,
  kSIsSeqHigh, kSIsSeqLow, kSRsRejTok, kSRsRejSeq, kSVetoSeq, kSCatTok, kSFinalRejTok, kSFinalRejSeq, kSLR,
  kSK3Raw, kSRho2, kSTrainPpl, kSTrainLogPpl, kSRollPpl, kSRollLogPpl, kSLpd, kSAbsLpd, kSPplRatio, kSChi2Seq
};
constexpr int kHistBins = 4096;
constexpr int kSHist = 31;
constexpr int kSBase = kSHist + kHistBins;
enum RsSumSlot : int { kRsStat = 0, kRsSc, kRsSc2, kRsHigh, kRsLow, kRsSeq, kRsSeq2, kRsSeqHigh, kRsSeqLow, kRsRejTok,
                       kRsRejSeq };
constexpr int kRsSum = 11;
enum MaxSlot : int { kMIsW = 0, kMIsNegW, kMIsLog, kMIsNegLog, kMIsSeq, kMIsNegSeq, kMIsSeqDev, kMLpd, kMNegLpd };
constexpr int kMBase = 9;
enum RsMaxSlot : int { kRmStat = 0, kRmNegStat, kRmSeq, kRmNegSeq, kRmSeqDev };
constexpr int kRsMax = 5;

constexpr double kSafetyBound = 20.0;  // verl SAFETY_BOUND: log-ratios are clamped to [-20, 20] before exp
constexpr double kEps = 1e-8;          // verl masked_mean: sum / (count + 1e-8)
constexpr double kHistLo = -20.0, kHistHi = 20.0;

inline int64_t sum_size(int num_rs) { return kSBase + static_cast<int64_t>(num_rs) * kRsSum; }
inline int64_t max_size(int num_rs) { return kMBase + static_cast<int64_t>(num_rs) * kRsMax; }

// Decoded parameters. Thresholds are held in the accumulation type: the reference compares fp32 tensors with
// Python floats, which torch rounds to the tensor's dtype.
template <typename acc_t>
struct Config {
  int is_level;
  bool is_mask;
  acc_t is_lower, is_upper, is_metric_lower, log_is_upper, log_is_metric_lower;
  bool veto_on;
  acc_t veto_log;
  bool exclude_nonfinite;
  int num_rs;
  int crit_level[kMaxCrit];
  int crit_stat[kMaxCrit];
  acc_t crit_lower[kMaxCrit];
  acc_t crit_upper[kMaxCrit];
  bool crit_apply_lower[kMaxCrit];
  bool has_token_crit;
};

template <typename acc_t>
inline Config<acc_t> decode_config(const double* p, int64_t n) {
  Config<acc_t> c{};
  c.is_level = static_cast<int>(p[kPIsLevel]);
  c.is_mask = p[kPIsMask] != 0;
  c.is_lower = static_cast<acc_t>(p[kPIsLower]);
  c.is_upper = static_cast<acc_t>(p[kPIsUpper]);
  c.is_metric_lower = static_cast<acc_t>(p[kPIsMetricLower]);
  c.log_is_upper = static_cast<acc_t>(std::log(p[kPIsUpper]));
  c.log_is_metric_lower = static_cast<acc_t>(std::log(p[kPIsMetricLower]));
  c.veto_on = p[kPVetoOn] != 0;
  c.veto_log = static_cast<acc_t>(p[kPVetoLog]);
  c.exclude_nonfinite = p[kPExcludeNonFinite] != 0;
  c.num_rs = static_cast<int>(p[kPNumRs]);
  c.has_token_crit = false;
  for (int i = 0; i < c.num_rs && kPHeader + (i + 1) * kPCrit <= n; ++i) {
    const double* q = p + kPHeader + i * kPCrit;
    c.crit_level[i] = static_cast<int>(q[0]);
    c.crit_stat[i] = static_cast<int>(q[1]);
    c.crit_lower[i] = static_cast<acc_t>(q[2]);
    c.crit_upper[i] = static_cast<acc_t>(q[3]);
    c.crit_apply_lower[i] = q[4] != 0;
    c.has_token_crit |= c.crit_level[i] == kLevelToken;
  }
  return c;
}


template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t rc_exp(acc_t x) { return std::exp(x); }
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t rc_expm1(acc_t x) { return std::expm1(x); }
template <typename acc_t>
RC_HD RC_FORCEINLINE bool rc_isfinite(acc_t x) { return std::isfinite(x); }

// e^x - 1 - x without the cancellation of exp(x) - 1 near 0 (verl's k3 integrand). |x| < 0.25: Taylor series to
// x^9 (truncation < 0.25^8 / 10! relative, far below fp32 rounding); else expm1(x) - x, where no cancellation is left.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t k3_of(acc_t x) {
  if (x > acc_t(-0.25) && x < acc_t(0.25)) {
    acc_t p = acc_t(1.0 / 362880);
    p = p * x + acc_t(1.0 / 40320);
    p = p * x + acc_t(1.0 / 5040);
    p = p * x + acc_t(1.0 / 720);
    p = p * x + acc_t(1.0 / 120);
    p = p * x + acc_t(1.0 / 24);
    p = p * x + acc_t(1.0 / 6);
    p = p * x + acc_t(0.5);
    return p * x * x;
  }
  return rc_expm1(x) - x;
}

template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t clamp20(acc_t x) {
  const acc_t b = static_cast<acc_t>(kSafetyBound);
  return x < -b ? -b : (x > b ? b : x);
}

// RS statistic of one token: k1 = -l, k2 = l^2/2, k3 = e^l - 1 - l (as expm1(l) - l: no fp32 cancellation),
// ratio = e^l; l = clamp20(lr), rho = e^l.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t token_stat(int stat, acc_t l, acc_t rho, acc_t k3) {
  return stat == kStatK1 ? -l : (stat == kStatK2 ? static_cast<acc_t>(0.5) * l * l : (stat == kStatK3 ? k3 : rho));
}

template <typename acc_t>
RC_HD RC_FORCEINLINE bool crit_keep(acc_t s, acc_t lower, acc_t upper, bool apply_lower) {
  return s <= upper && (!apply_lower || s >= lower);
}

// Token-level IS weight: TIS min(rho, U), IcePop rho * 1[L <= rho <= U].
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t is_weight(acc_t rho, const Config<acc_t>& c) {
  if (c.is_mask) return (rho >= c.is_lower && rho <= c.is_upper) ? rho : acc_t(0);
  return rho < c.is_upper ? rho : c.is_upper;
}

// Fixed log-space histogram bin of log w in [-20, 20] (NaN only reaches here when the op is about to raise).
template <typename acc_t>
RC_HD RC_FORCEINLINE int hist_index(acc_t logw) {
  if (!(logw == logw)) return 0;
  const double scale = kHistBins / (kHistHi - kHistLo);
  double f = std::floor((static_cast<double>(logw) - kHistLo) * scale);
  f = f < 0 ? 0 : (f > kHistBins - 1 ? kHistBins - 1 : f);
  return static_cast<int>(f);
}

// Per-row quantities both passes need (the reference's _rc_row_values), from one row of reduced seq stats.
template <typename acc_t>
struct RowValues {
  acc_t n, lr_sum, lg, raw, w;
  bool seq_rej_any, veto;
  acc_t crit_val[kMaxCrit];
  bool crit_keep[kMaxCrit];
};

template <typename acc_t>
RC_HD inline void row_values(const acc_t* st, const Config<acc_t>& c, RowValues<acc_t>& r) {
  const acc_t eps = static_cast<acc_t>(kEps);
  r.n = st[kSeqN];
  r.lr_sum = st[kSeqLR];
  r.lg = c.is_level == kIsSequence ? r.lr_sum : r.lr_sum / (r.n + eps);
  r.raw = rc_exp(clamp20(r.lg));
  if (c.is_mask)
    r.w = (r.raw >= c.is_lower && r.raw <= c.is_upper) ? r.raw : acc_t(0);
  else
    r.w = r.raw < c.is_upper ? r.raw : c.is_upper;
  r.seq_rej_any = false;
  for (int i = 0; i < c.num_rs; ++i) {
    const int level = c.crit_level[i], stat = c.crit_stat[i];
    acc_t v;
    r.crit_keep[i] = true;
    if (level == kLevelToken) {  // per-row mean of the token statistic (verl masked_mean(axis=-1))
      const int col = stat == kStatK1 ? kSeqK1 : (stat == kStatK2 ? kSeqK2 : (stat == kStatK3 ? kSeqK3 : kSeqWRaw));
      v = st[col] / (r.n + eps);
    } else {
      if (stat == kStatRatio) {
        const acc_t x = level == kLevelSeqSum ? r.lr_sum : r.lr_sum / (r.n + eps);
        v = rc_exp(clamp20(x));
      } else if (level == kLevelSeqMax) {  // verl: -inf (no valid token) -> 0
        v = r.n > 0 ? st[stat == kStatK2 ? kSeqMaxK2 : kSeqMaxK3] : acc_t(0);
      } else {
        const acc_t s = st[stat == kStatK1 ? kSeqK1 : (stat == kStatK2 ? kSeqK2 : kSeqK3)];
        v = level == kLevelSeqSum ? s : s / (r.n + eps);
      }
      r.crit_keep[i] = crit_keep(v, c.crit_lower[i], c.crit_upper[i], c.crit_apply_lower[i]);
      r.seq_rej_any |= !r.crit_keep[i];
    }
    r.crit_val[i] = v;
  }
  // Veto: a valid token with lr < log V  <=>  max(-lr) > -log V.
  r.veto = c.veto_on && st[kSeqNegMinLR] > -c.veto_log;
}

RC_HD RC_FORCEINLINE void rc_upd_max(double& m, double v) { m = v > m ? v : m; }

// The row terms of pass 2 for one row (the reference's _rc_row_partials): per-row values in acc_t, sums in fp64,
// into this worker's SUM / MAX partial rows. Added once per sequence (one rank of a context-parallel group).
template <typename acc_t>
RC_HD inline void add_row_partials(const Config<acc_t>& c, const acc_t* st, const RowValues<acc_t>& r, double* S,
                                  double* M) {
  // The reference's _rc_row_partials for one row: per-row values in acc_t, sums in fp64.
  const acc_t eps = static_cast<acc_t>(kEps);
  const double nd = r.n;
  const bool sv = r.n > 0;
  S[kSN] += nd;
  S[kSRows] += 1;
  S[kSSeqValid] += sv;
  S[kSNonFinite] += st[kSeqNonFinite];
  if (c.is_level != kIsNone) {
    acc_t x, raw_mean;
    if (c.is_level == kIsToken) {
      x = st[kSeqWTok] / (r.n + eps);
      raw_mean = st[kSeqWRaw] / (r.n + eps);
    } else {
      const acc_t wc = r.w < acc_t(0) ? acc_t(0) : (r.w > c.is_upper ? c.is_upper : r.w);
      S[kSIsW] += nd * static_cast<double>(r.w);
      S[kSIsWc] += nd * static_cast<double>(wc);
      S[kSIsWc2] += nd * static_cast<double>(wc) * static_cast<double>(wc);
      S[kSIsHigh] += r.lg > c.log_is_upper;
      S[kSIsLow] += r.lg < c.log_is_metric_lower;
      if (c.is_mask) S[kSIsOob] += nd * ((r.raw < c.is_lower) || (r.raw > c.is_upper));
      rc_upd_max(M[kMIsLog], r.lg);
      rc_upd_max(M[kMIsNegLog], -r.lg);
      S[kSHist + hist_index(clamp20(r.lg))] += nd;
      x = r.w * r.n / (r.n + eps);
      raw_mean = r.raw * r.n / (r.n + eps);
    }
    S[kSIsSeq] += x;
    S[kSIsSeq2] += static_cast<double>(x) * static_cast<double>(x);
    S[kSIsSeqHigh] += raw_mean > c.is_upper;
    S[kSIsSeqLow] += raw_mean < c.is_metric_lower;
    rc_upd_max(M[kMIsSeq], x);
    rc_upd_max(M[kMIsNegSeq], -x);
    rc_upd_max(M[kMIsSeqDev], std::fabs(static_cast<double>(x - acc_t(1))));
  }
  for (int i = 0; i < c.num_rs; ++i) {
    double* Sc = S + kSBase + i * kRsSum;
    double* Mc = M + kMBase + i * kRsMax;
    const acc_t v = r.crit_val[i], lo = c.crit_lower[i], up = c.crit_upper[i];
    const bool apply_lower = c.crit_apply_lower[i];
    bool rej_row;
    if (c.crit_level[i] != kLevelToken) {
      const acc_t cmin = apply_lower ? lo : acc_t(0);
      const acc_t sc = v < cmin ? cmin : (v > up ? up : v);
      Sc[kRsStat] += nd * static_cast<double>(v);
      Sc[kRsSc] += nd * static_cast<double>(sc);
      Sc[kRsSc2] += nd * static_cast<double>(sc) * static_cast<double>(sc);
      Sc[kRsHigh] += (v > up) && sv;
      if (apply_lower) Sc[kRsLow] += (v < lo) && sv;
      if (sv) {
        rc_upd_max(Mc[kRmStat], v);
        rc_upd_max(Mc[kRmNegStat], -v);
      }
      rej_row = !r.crit_keep[i] && sv;
      Sc[kRsRejTok] += rej_row ? nd : 0.0;
    } else {
      const acc_t cnt = st[kSeqRejK1 + c.crit_stat[i]];
      Sc[kRsRejTok] += cnt;
      rej_row = cnt > 0 && sv;
    }
    Sc[kRsRejSeq] += rej_row;
    if (sv) {
      Sc[kRsSeq] += v;
      Sc[kRsSeq2] += static_cast<double>(v) * static_cast<double>(v);
      Sc[kRsSeqHigh] += v > up;
      if (apply_lower) Sc[kRsSeqLow] += v < lo;
      rc_upd_max(Mc[kRmSeq], v);
      rc_upd_max(Mc[kRmNegSeq], -v);
      rc_upd_max(Mc[kRmSeqDev], std::fabs(static_cast<double>(v)));
    }
  }
  const acc_t rej_tok = st[kSeqRejToken];
  S[kSRsRejTok] += r.seq_rej_any ? nd : static_cast<double>(rej_tok);
  S[kSRsRejSeq] += (r.seq_rej_any && sv) || rej_tok > 0;
  S[kSVetoSeq] += r.veto;
  const bool dropped = r.seq_rej_any || r.veto;
  S[kSFinalRejTok] += dropped ? nd : static_cast<double>(rej_tok);
  S[kSFinalRejSeq] += sv && (dropped || rej_tok > 0);
  // Off-policy row terms (verl compute_offpolicy_metrics): per-sequence means, averaged over all rows.
  const acc_t mlp = st[kSeqLP] / (r.n + eps), mrlp = st[kSeqRLP] / (r.n + eps);
  const acc_t lpd = -r.lr_sum / (r.n + eps);
  S[kSLR] += r.lr_sum;
  S[kSTrainPpl] += rc_exp(-mlp);
  S[kSTrainLogPpl] += -mlp;
  S[kSRollPpl] += rc_exp(-mrlp);
  S[kSRollLogPpl] += -mrlp;
  S[kSLpd] += lpd;
  S[kSAbsLpd] += (lpd < acc_t(0) ? -lpd : lpd);
  S[kSPplRatio] += rc_exp(lpd);
  S[kSChi2Seq] += rc_exp(acc_t(2) * clamp20(r.lr_sum));
  rc_upd_max(M[kMLpd], lpd);
  rc_upd_max(M[kMNegLpd], -lpd);
}

}  // namespace rc

// Torch-free parameter blocks of the CUDA kernels (the launcher fills raw pointers and sizes).
template <typename scalar_t, typename mask_t, typename acc_t>
struct RolloutParams {
  const scalar_t* log_prob;  // [rows, cols] contiguous
  const scalar_t* rollout_log_prob;
  const mask_t* mask;
  acc_t* seq_stats;     // [rows, rc::kSeqCols]: written by pass 1, read by pass 2
  acc_t* weights;       // [rows, cols] or nullptr (no IS level)
  mask_t* mask_out;     // [rows, cols]
  double* block_sums;   // [grid, num_sums], zero-filled by the launcher
  double* block_maxes;  // [grid, num_maxes], -inf-filled by the launcher
  int64_t rows;
  int64_t cols;
  int64_t num_sums;
  int64_t num_maxes;
  bool row_partials;
  rc::Config<acc_t> cfg;
};

struct RolloutReduceParams {
  const double* block_sums;
  const double* block_maxes;
  int64_t blocks;
  int64_t num_sums;
  int64_t num_maxes;
  double* sums;
  double* maxes;
};

}  // namespace rollout_corr
