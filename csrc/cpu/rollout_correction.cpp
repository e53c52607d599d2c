// CPU kernels of the rollout-correction op (DESIGN §3): two passes over [B, T].
//
// Pass 1 (rollout_seq_stats): one read of log_prob / rollout_log_prob / mask -> per-row aggregates [B, 18].
// Pass 2 (rollout_token_pass): one read of the same inputs + the (context-parallel reduced) per-row aggregates ->
// IS weights, the RS + veto mask (in the mask's dtype) and the packed metric partials (fp64 SUM vector with the
// 4096-bin histogram, fp64 MAX vector). Rows run in parallel (at::parallel_for); each thread accumulates its
// rows' partials in a private buffer (fp64), merged once at the end, so the result does not depend on timing.
// Per-element math in the accumulation type (fp32; fp64 for fp64 inputs) through rollout_math.h, the same
// header the CUDA kernels use. The contract is rollout_corr_ext/reference.py (rollout_seq_stats,
// rollout_token_pass).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "rollout_host.h"
#include "rollout_math.h"

namespace rollout_corr {
namespace {

template <typename mask_t>
RC_FORCEINLINE bool nonzero(mask_t v) {
  return static_cast<float>(v) != 0.f;
}
template <>
RC_FORCEINLINE bool nonzero<bool>(bool v) {
  return v;
}
template <>
RC_FORCEINLINE bool nonzero<int64_t>(int64_t v) {
  return v != 0;
}
template <>
RC_FORCEINLINE bool nonzero<int32_t>(int32_t v) {
  return v != 0;
}
template <>
RC_FORCEINLINE bool nonzero<double>(double v) {
  return v != 0.0;
}

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

template <typename scalar_t, typename mask_t>
void seq_stats_rows(const scalar_t* lp, const scalar_t* rlp, const mask_t* mask, int64_t T,
                    const rc::Config<at::opmath_type<scalar_t>>& c, at::opmath_type<scalar_t>* out, int64_t b0,
                    int64_t b1) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t b = b0; b < b1; ++b) {
    const scalar_t* lpr = lp + b * T;
    const scalar_t* rlpr = rlp + b * T;
    const mask_t* mr = mask + b * T;
    // Row sums in fp64 (cheap on the CPU; the reference sums rows pairwise in fp32).
    double n = 0, lr_s = 0, k1 = 0, k2 = 0, k3 = 0, lp_s = 0, rlp_s = 0, wraw = 0, wtok = 0, rej_any = 0, nonfin = 0;
    double rej[4] = {0, 0, 0, 0};
    acc_t max_k2 = -INFINITY, max_k3 = -INFINITY, neg_min_lr = -INFINITY;
    for (int64_t t = 0; t < T; ++t) {
      if (!nonzero(mr[t])) continue;
      const acc_t a = static_cast<acc_t>(lpr[t]), q = static_cast<acc_t>(rlpr[t]);
      const bool fin = rc::rc_isfinite(a) && rc::rc_isfinite(q);
      if (!fin) {
        nonfin += 1;
        if (c.exclude_nonfinite) continue;
      }
      const acc_t lr = a - q, l = rc::clamp20(lr), rho = rc::rc_exp(l), k3v = rc::k3_of(l);
      const acc_t k2v = acc_t(0.5) * l * l;
      n += 1;
      lr_s += lr;
      k1 -= l;
      k2 += k2v;
      k3 += k3v;
      lp_s += a;
      rlp_s += q;
      wraw += rho;
      if (c.is_level == rc::kIsToken) wtok += rc::is_weight(rho, c);
      if (c.has_token_crit) {
        bool any = false;
        for (int i = 0; i < c.num_rs; ++i) {
          if (c.crit_level[i] != rc::kLevelToken) continue;
          const acc_t s = rc::token_stat(c.crit_stat[i], l, rho, k3v);
          if (!rc::crit_keep(s, c.crit_lower[i], c.crit_upper[i], c.crit_apply_lower[i])) {
            rej[c.crit_stat[i]] += 1;
            any = true;
          }
        }
        rej_any += any;
      }
      max_k2 = std::max(max_k2, k2v);
      max_k3 = std::max(max_k3, k3v);
      neg_min_lr = std::max(neg_min_lr, -lr);
    }
    acc_t* o = out + b * rc::kSeqCols;
    const double sums[rc::kSeqNumSum] = {n, lr_s, k1, k2, k3, lp_s, rlp_s, wraw, wtok, rej_any, rej[0], rej[1],
                                         rej[2], rej[3], nonfin};
    for (int k = 0; k < rc::kSeqNumSum; ++k) o[k] = static_cast<acc_t>(sums[k]);
    o[rc::kSeqMaxK2] = max_k2;
    o[rc::kSeqMaxK3] = max_k3;
    o[rc::kSeqNegMinLR] = neg_min_lr;
  }
}

at::Tensor rollout_seq_stats_cpu(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, at::ArrayRef<double> params) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask, params);
  const auto lp = log_prob.contiguous(), rlp = rollout_log_prob.contiguous(), m = mask.contiguous();
  const int64_t B = lp.size(0), T = lp.size(1);
  const auto acc = lp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto out = at::empty({B, rc::kSeqCols}, lp.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "rollout_seq_stats_cpu", [&] {
    using lp_t = scalar_t;
    using acc_t = at::opmath_type<lp_t>;
    const auto cfg = rc::decode_config<acc_t>(params.data(), static_cast<int64_t>(params.size()));
    RC_DISPATCH_MASK_TYPES(m.scalar_type(), "rollout_seq_stats_cpu_mask", [&] {
      using mask_t = scalar_t;
      at::parallel_for(0, B, std::max<int64_t>(1, 32768 / std::max<int64_t>(T, 1)), [&](int64_t b0, int64_t b1) {
        seq_stats_rows<lp_t, mask_t>(lp.data_ptr<lp_t>(), rlp.data_ptr<lp_t>(), m.data_ptr<mask_t>(), T, cfg,
                                     out.data_ptr<acc_t>(), b0, b1);
      });
    });
  });
  return out;
}

// Per-thread partial buffers: SUM and MAX vectors, merged in thread order at the end.
struct Partials {
  std::vector<double> sums, maxes;
  Partials(int64_t ns, int64_t nm) : sums(ns, 0.0), maxes(nm, kNegInf) {}
};

RC_FORCEINLINE void upd_max(double& m, double v) { m = v > m ? v : m; }

template <typename scalar_t, typename mask_t>
void token_pass_rows(const scalar_t* lp, const scalar_t* rlp, const mask_t* mask, const at::opmath_type<scalar_t>* st,
                     int64_t T, const rc::Config<at::opmath_type<scalar_t>>& c, bool with_rows,
                     at::opmath_type<scalar_t>* weights, mask_t* mask_out, Partials& P, int64_t b0, int64_t b1) {
  using acc_t = at::opmath_type<scalar_t>;
  double* S = P.sums.data();
  double* M = P.maxes.data();
  const bool tok_is = c.is_level == rc::kIsToken;
  for (int64_t b = b0; b < b1; ++b) {
    const acc_t* str = st + b * rc::kSeqCols;
    rc::RowValues<acc_t> r;
    rc::row_values(str, c, r);
    const bool row_dropped = r.seq_rej_any || r.veto;
    const scalar_t* lpr = lp + b * T;
    const scalar_t* rlpr = rlp + b * T;
    const mask_t* mr = mask + b * T;
    mask_t* mo = mask_out + b * T;
    acc_t* wr = weights ? weights + b * T : nullptr;
    double is_w = 0, is_wc = 0, is_wc2 = 0, is_hi = 0, is_lo = 0, is_oob = 0, k3raw = 0, rho2 = 0, cat = 0;
    double c_stat[rc::kMaxCrit] = {}, c_sc[rc::kMaxCrit] = {}, c_sc2[rc::kMaxCrit] = {}, c_hi[rc::kMaxCrit] = {},
           c_lo[rc::kMaxCrit] = {};
    double* hist = S + rc::kSHist;
    for (int64_t t = 0; t < T; ++t) {
      const mask_t mv = mr[t];
      bool valid = nonzero(mv);
      const acc_t a = static_cast<acc_t>(lpr[t]), q = static_cast<acc_t>(rlpr[t]);
      if (valid && c.exclude_nonfinite) valid = rc::rc_isfinite(a) && rc::rc_isfinite(q);
      if (!valid) {
        if (wr) wr[t] = acc_t(0);
        mo[t] = mask_t(0);
        continue;
      }
      const acc_t lr = a - q, l = rc::clamp20(lr), rho = rc::rc_exp(l), k3v = rc::k3_of(l);
      if (tok_is) {
        const acc_t w = rc::is_weight(rho, c);
        const acc_t wc = w < acc_t(0) ? acc_t(0) : (w > c.is_upper ? c.is_upper : w);
        wr[t] = w;
        is_w += w;
        is_wc += wc;
        is_wc2 += wc * wc;
        is_hi += rho > c.is_upper;
        is_lo += rho < c.is_metric_lower;
        if (c.is_mask) is_oob += (rho < c.is_lower) || (rho > c.is_upper);
        upd_max(M[rc::kMIsW], w);
        upd_max(M[rc::kMIsNegW], -w);
        hist[rc::hist_index(l)] += 1.0;
      } else if (wr) {
        wr[t] = r.w;
      }
      bool tok_rej = false;
      if (c.has_token_crit) {
        for (int i = 0; i < c.num_rs; ++i) {
          if (c.crit_level[i] != rc::kLevelToken) continue;
          const acc_t s = rc::token_stat(c.crit_stat[i], l, rho, k3v);
          const acc_t lo = c.crit_lower[i], up = c.crit_upper[i];
          const bool apply_lower = c.crit_apply_lower[i];
          tok_rej |= !rc::crit_keep(s, lo, up, apply_lower);
          const acc_t cmin = apply_lower ? lo : acc_t(0);
          const acc_t sc = s < cmin ? cmin : (s > up ? up : s);
          c_stat[i] += s;
          c_sc[i] += sc;
          c_sc2[i] += sc * sc;
          c_hi[i] += s > up;
          if (apply_lower) c_lo[i] += s < lo;
          double* Mc = M + rc::kMBase + i * rc::kRsMax;
          upd_max(Mc[rc::kRmStat], s);
          upd_max(Mc[rc::kRmNegStat], -s);
        }
      }
      mo[t] = (tok_rej || row_dropped) ? mask_t(0) : mv;
      k3raw += l == lr ? k3v : rc::k3_of(lr);  // k3_kl uses the unclamped ratio
      rho2 += rho * rho;
      if (c.veto_on) cat += lr < c.veto_log;
    }
    S[rc::kSIsW] += is_w;
    S[rc::kSIsWc] += is_wc;
    S[rc::kSIsWc2] += is_wc2;
    S[rc::kSIsHigh] += is_hi;
    S[rc::kSIsLow] += is_lo;
    S[rc::kSIsOob] += is_oob;
    S[rc::kSK3Raw] += k3raw;
    S[rc::kSRho2] += rho2;
    S[rc::kSCatTok] += cat;
    for (int i = 0; i < c.num_rs; ++i) {
      if (c.crit_level[i] != rc::kLevelToken) continue;
      double* Sc = S + rc::kSBase + i * rc::kRsSum;
      Sc[rc::kRsStat] += c_stat[i];
      Sc[rc::kRsSc] += c_sc[i];
      Sc[rc::kRsSc2] += c_sc2[i];
      Sc[rc::kRsHigh] += c_hi[i];
      Sc[rc::kRsLow] += c_lo[i];
    }
    if (with_rows) rc::add_row_partials(c, str, r, S, M);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rollout_token_pass_cpu(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const at::Tensor& seq_stats, at::ArrayRef<double> params, bool row_partials_flag) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask, params);
  check_seq_stats(seq_stats, log_prob);
  const auto lp = log_prob.contiguous(), rlp = rollout_log_prob.contiguous(), m = mask.contiguous();
  const auto st = seq_stats.contiguous();
  const int64_t B = lp.size(0), T = lp.size(1);
  const int num_rs = static_cast<int>(params[rc::kPNumRs]);
  const int64_t ns = rc::sum_size(num_rs), nm = rc::max_size(num_rs);
  const bool has_w = static_cast<int>(params[rc::kPIsLevel]) != rc::kIsNone;
  const auto acc = lp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto weights = has_w ? at::empty({B, T}, lp.options().dtype(acc)) : at::empty({0}, lp.options().dtype(acc));
  auto mask_out = at::empty_like(m);
  auto sums = at::zeros({ns}, lp.options().dtype(at::kDouble));
  auto maxes = at::full({nm}, kNegInf, lp.options().dtype(at::kDouble));
  std::vector<Partials> parts;
  const int nthreads = at::get_num_threads();
  parts.reserve(nthreads);
  for (int i = 0; i < nthreads; ++i) parts.emplace_back(ns, nm);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "rollout_token_pass_cpu", [&] {
    using lp_t = scalar_t;
    using acc_t = at::opmath_type<lp_t>;
    const auto cfg = rc::decode_config<acc_t>(params.data(), static_cast<int64_t>(params.size()));
    RC_DISPATCH_MASK_TYPES(m.scalar_type(), "rollout_token_pass_cpu_mask", [&] {
      using mask_t = scalar_t;
      at::parallel_for(0, B, std::max<int64_t>(1, 32768 / std::max<int64_t>(T, 1)), [&](int64_t b0, int64_t b1) {
        Partials& P = parts[at::get_thread_num()];
        token_pass_rows<lp_t, mask_t>(lp.data_ptr<lp_t>(), rlp.data_ptr<lp_t>(), m.data_ptr<mask_t>(),
                                      st.data_ptr<acc_t>(), T, cfg, row_partials_flag,
                                      has_w ? weights.data_ptr<acc_t>() : nullptr, mask_out.data_ptr<mask_t>(), P,
                                      b0, b1);
      });
    });
  });
  double* S = sums.data_ptr<double>();
  double* M = maxes.data_ptr<double>();
  for (const auto& P : parts) {
    for (int64_t k = 0; k < ns; ++k) S[k] += P.sums[k];
    for (int64_t k = 0; k < nm; ++k) M[k] = std::max(M[k], P.maxes[k]);
  }
  return {weights, mask_out, sums, maxes};
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("rollout_seq_stats", &rollout_seq_stats_cpu);
  m.impl("rollout_token_pass", &rollout_token_pass_cpu);
}

}  // namespace rollout_corr
