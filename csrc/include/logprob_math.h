// Row-softmax math shared by the CPU and CUDA kernels of the vocab-parallel log-prob op (DESIGN §2).
//
// A row of z = x / T is summarised by the online-softmax triple (m, d, s):
//   m = max z,  d = sum exp(z - m),  s = sum exp(z - m) * z.
// Two summaries merge exactly by rescaling to the larger max (Milakov & Gimelshein 2018, "Online normalizer
// calculation for softmax"), which is how blocks, warps, threads and tensor-parallel shards are combined.
#pragma once

#include <cmath>
#include <cstdint>

#include "logprob_params.h"
#include "rc_macros.h"

namespace rollout_corr {

// exp/log in the accumulation type: the CUDA float intrinsics on the device (expf/logf, full precision: the
// build does not use --use_fast_math), std:: overloads on the host (CPU merge, CUDA emulator).
RC_HD RC_FORCEINLINE float rc_exp(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}
RC_HD RC_FORCEINLINE double rc_exp(double x) {
#ifdef __CUDA_ARCH__
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
RC_HD RC_FORCEINLINE float rc_log(float x) {
#ifdef __CUDA_ARCH__
  return logf(x);
#else
  return std::log(x);
#endif
}
RC_HD RC_FORCEINLINE double rc_log(double x) {
#ifdef __CUDA_ARCH__
  return ::log(x);
#else
  return std::log(x);
#endif
}

// Column layout of the per-row record written by vocab_row_stats (16 B, or 20 B with sum z).
enum RowStatColumn : int { kRowMax = 0, kRowSumExp = 1, kRowSumExpZ = 2, kRowTargetZ = 3, kRowSumZ = 4 };
// Column layout of the state saved for backward (8 B per row).
enum RowStateColumn : int { kStateLse = 0, kStateMeanZ = 1 };

template <typename acc_t>
struct SoftmaxStats {
  acc_t m;  // running max
  acc_t d;  // sum exp(z - m)
  acc_t s;  // sum exp(z - m) * z
};

template <typename acc_t>
RC_HD RC_FORCEINLINE SoftmaxStats<acc_t> softmax_stats_empty() {
  return {-INFINITY, acc_t(0), acc_t(0)};
}

// Exact merge of two summaries. An empty summary (d == 0, m == -inf) is the identity: guarding on d avoids
// exp(-inf - (-inf)) = NaN.
template <typename acc_t>
RC_HD RC_FORCEINLINE SoftmaxStats<acc_t> softmax_stats_merge(SoftmaxStats<acc_t> a, SoftmaxStats<acc_t> b) {
  if (b.d == acc_t(0)) return a;
  if (a.d == acc_t(0)) return b;
  const acc_t m = a.m > b.m ? a.m : b.m;
  const acc_t sa = rc_exp(a.m - m);
  const acc_t sb = rc_exp(b.m - m);
  return {m, a.d * sa + b.d * sb, a.s * sa + b.s * sb};
}

// Add one element to a summary (used by per-thread loops on the GPU). Rescales only when the max grows, so
// the common path costs one exp.
template <typename acc_t>
RC_HD RC_FORCEINLINE void softmax_stats_add(SoftmaxStats<acc_t>& st, acc_t z) {
  if (z > st.m) {
    const acc_t scale = rc_exp(st.m - z);  // exp(-inf) = 0 for the first element
    st.d = st.d * scale + acc_t(1);
    st.s = st.s * scale + z;
    st.m = z;
  } else {
    const acc_t e = rc_exp(z - st.m);
    st.d += e;
    st.s += e * z;
  }
}

// The per-row outputs of the merge over shards.
template <typename acc_t>
struct RowResult {
  acc_t logp;
  acc_t entropy;
  acc_t mean_logp;
  acc_t lse;
  acc_t mean_z;
};

// logp = y - lse, H = lse - S/D, mean_logp = sum z / V - lse; lse = M + log D. Ignored rows give zeros (the
// state still gets finite values so backward never reads NaN).
template <typename acc_t>
RC_HD RC_FORCEINLINE RowResult<acc_t> finish_row(SoftmaxStats<acc_t> st, acc_t target_z, acc_t sum_z,
                                                 bool has_sum_z, int64_t vocab_size, bool ignored) {
  RowResult<acc_t> r;
  r.lse = st.m + rc_log(st.d);
  r.mean_z = st.s / st.d;
  if (ignored) {
    r.logp = r.entropy = r.mean_logp = acc_t(0);
  } else {
    r.logp = target_z - r.lse;
    r.entropy = r.lse - r.mean_z;
    r.mean_logp = has_sum_z ? sum_z / acc_t(vocab_size) - r.lse : acc_t(0);
  }
  return r;
}

// d/dz_i of  g_lp * logp + g_h * H + g_m * mean_logp,  with p_i = exp(z_i - lse):
//   g_lp (1[i = y] - p_i) - g_h p_i (z_i - S/D) + g_m (1/V - p_i).
// The caller multiplies by 1/T (chain rule through z = x / T).
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t logprob_grad_element(acc_t z, acc_t p, bool is_target, acc_t g_lp, acc_t g_h,
                                                acc_t g_m_over_v, acc_t g_m, acc_t mean_z) {
  acc_t g = -(g_lp + g_m) * p - g_h * p * (z - mean_z) + g_m_over_v;
  if (is_target) g += g_lp;
  return g;
}

// Write one row's record (shared by the CPU loop and the CUDA kernel's lane 0). `x` is the row's logits: the
// target's z is re-read with the same scaling as the sweep so that y and the stats agree bit for bit.
template <typename scalar_t, typename acc_t>
RC_HD RC_FORCEINLINE void write_row_record(const RowStatsParams<scalar_t, acc_t>& p, int64_t row, const scalar_t* x,
                                           SoftmaxStats<acc_t> st, acc_t sum_z) {
  const int64_t t = p.target[row];
  const int64_t local = t - p.vocab_start;
  const bool in_shard = t != p.ignore_index && local >= 0 && local < p.valid_cols;
  acc_t* out = p.stats + row * p.stats_cols;
  out[kRowMax] = st.m;
  out[kRowSumExp] = st.d;
  out[kRowSumExpZ] = st.s;
  out[kRowTargetZ] = in_shard ? static_cast<acc_t>(x[local]) * p.inv_temperature : -INFINITY;
  if (p.stats_cols > kRowSumZ) out[kRowSumZ] = sum_z;
}

// Merge the shard records of one row and write its outputs (the CPU loop and the CUDA merge kernel call this).
template <typename acc_t>
RC_HD RC_FORCEINLINE void merge_one_row(const MergeParams<acc_t>& p, int64_t row) {
  SoftmaxStats<acc_t> st = softmax_stats_empty<acc_t>();
  acc_t y = -INFINITY, sum_z = acc_t(0);
  const bool has_sum_z = p.stats_cols > kRowSumZ;
  for (int64_t k = 0; k < p.shards; ++k) {
    const acc_t* rec = p.stats + (k * p.rows + row) * p.stats_cols;
    st = softmax_stats_merge(st, SoftmaxStats<acc_t>{rec[kRowMax], rec[kRowSumExp], rec[kRowSumExpZ]});
    y = rec[kRowTargetZ] > y ? rec[kRowTargetZ] : y;
    if (has_sum_z) sum_z += rec[kRowSumZ];
  }
  const RowResult<acc_t> r = finish_row(st, y, sum_z, has_sum_z, p.vocab_size, p.target[row] == p.ignore_index);
  p.logp[row] = r.logp;
  p.entropy[row] = r.entropy;
  p.mean_logp[row] = r.mean_logp;
  p.row_state[2 * row + kStateLse] = r.lse;
  p.row_state[2 * row + kStateMeanZ] = r.mean_z;
}

}  // namespace rollout_corr
