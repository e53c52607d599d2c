// Row-softmax math shared by the CPU kernels, the CUDA kernels and the CUDA emulator of the vocab-parallel log-prob
// op (docs/logprobs.md).
//
// A run of logits x of one row is summarised by (m, d, s, sz, n) with z = x / T:
//   m = max x,  d = sum e^{(x - m)/T},  s = sum e^{(x - m)/T} (x - m)/T,  sz = sum (x - m)/T,  n = count.
// Two summaries merge exactly by rebasing both to the larger max (Milakov & Gimelshein 2018, "Online normalizer
// calculation for softmax"), which is how lanes, warps, CPU blocks and tensor-parallel shards are combined.
// Everything but m is relative to m, so logits of any finite magnitude (1e30, the fp16 maximum) never cancel, and
// the results are those of fp64 torch.log_softmax to fp32 rounding:
//   logp = (y - M)/T - log D,   H = log D - S/D,   mean_i logp_i = SZ/V - log D.
// sz is carried scaled by 2^-32 (kSumZScale) in summaries and records: one term (x - m)/T, or the sum over a row,
// can leave the fp32 range at logit spreads near fp32's maximum ((-3e38 - 3e38)/T) while the mean over the vocab,
// which the label-smoothing loss needs, is representable. A power of two: the scaled terms and sums round exactly as
// the unscaled ones would, and no term overflows below |x - m|/T = 2^160.
// Non-finite logits:
//   -inf (top-k / top-p masks, padding): p = 0; they add nothing to d and s (never e^{-inf - (-inf)} nor 0 * -inf),
//        and -inf to sz (so the label-smoothing mean is -inf, as torch's); a summary of only -inf is the identity
//        of the merge (d = 0). A target at a -inf column gets logp = -inf.
//   NaN or +inf: d or s becomes NaN, or m = +inf; the merge reports the row (summary_is_poisoned).
#pragma once

#include <cmath>
#include <cstdint>

#include "logprob_params.h"
#include "rc_macros.h"
#include "scalar_math.h"

namespace rollout_corr {

template <typename acc_t>
struct RowSummary {
  acc_t m;    // max x (raw logits)
  acc_t d;    // sum e^{(x - m)/T}
  acc_t s;    // sum e^{(x - m)/T} (x - m)/T
  acc_t sz;   // sum (x - m)/T, times kSumZScale
  int64_t n;  // elements summarised
};

// The scale of sz (2^-32) and its inverse, applied once to the merged mean.
constexpr double kSumZUnscale = 4294967296.0;

// (x - m)/T times kSumZScale, with no intermediate overflow: x and m are scaled first (exactly, in the normal range),
// so this rounds as (x - m)/T does, times 2^-32. -inf for x = -inf.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t scaled_shift(acc_t x, acc_t m, acc_t inv_t) {
  return (x * acc_t(kSumZScale) - m * acc_t(kSumZScale)) * inv_t;
}

template <typename acc_t>
RC_HD RC_FORCEINLINE RowSummary<acc_t> summary_empty() {
  return {-INFINITY, acc_t(0), acc_t(0), acc_t(0), 0};
}

// p * v where p = 0 means "no mass here": 0 even when v is -inf (the limit e^t t -> 0 as t -> -inf).
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t mass_times(acc_t p, acc_t v) {
  return p > acc_t(0) ? p * v : acc_t(0);
}

// The summary expressed relative to a larger max `to` (raw units). An empty or all -inf summary (d == 0) stays
// empty; its sz is -inf when it holds elements (they were -inf) and 0 otherwise.
template <typename acc_t>
RC_HD RC_FORCEINLINE RowSummary<acc_t> summary_rebase(RowSummary<acc_t> a, acc_t to, acc_t inv_t) {
  if (a.d == acc_t(0)) return {to, acc_t(0), acc_t(0), a.n > 0 ? acc_t(-INFINITY) : acc_t(0), a.n};
  const acc_t delta = (a.m - to) * inv_t;  // <= 0; -inf only when the difference overflows
  const acc_t scale = rc_exp(delta);
  RowSummary<acc_t> r;
  r.m = to;
  r.d = a.d * scale;
  r.s = mass_times(scale, a.s + a.d * delta);
  r.sz = a.sz + static_cast<acc_t>(a.n) * scaled_shift(a.m, to, inv_t);
  r.n = a.n;
  return r;
}

// Exact merge of two summaries.
template <typename acc_t>
RC_HD RC_FORCEINLINE RowSummary<acc_t> summary_merge(RowSummary<acc_t> a, RowSummary<acc_t> b, acc_t inv_t) {
  const acc_t m = a.m > b.m ? a.m : b.m;
  if (a.d == acc_t(0) && b.d == acc_t(0)) {  // neither has mass: keep the -inf marker of sz
    return {m, acc_t(0), acc_t(0), (a.n + b.n) > 0 ? acc_t(-INFINITY) : acc_t(0), a.n + b.n};
  }
  const RowSummary<acc_t> ra = summary_rebase(a, m, inv_t);
  const RowSummary<acc_t> rb = summary_rebase(b, m, inv_t);
  return {m, ra.d + rb.d, ra.s + rb.s, ra.sz + rb.sz, a.n + b.n};
}

// Fold one logit into a summary (the per-thread loop of the CUDA kernel). Costs one exp; rescales only when the
// max grows. sz only with kSumZ (label smoothing): the record without it has no column for it.
template <bool kSumZ, typename acc_t>
RC_HD RC_FORCEINLINE void summary_add(RowSummary<acc_t>& st, acc_t x, acc_t inv_t) {
  if (x == acc_t(-INFINITY)) {  // no mass
    if (kSumZ) st.sz = acc_t(-INFINITY);
  } else if (x > st.m) {  // a new max (+inf included: it poisons the row through m)
    if (st.d == acc_t(0)) {
      if (kSumZ) st.sz = st.n > 0 ? acc_t(-INFINITY) : acc_t(0);
      st.d = acc_t(1);
      st.s = acc_t(0);
    } else {
      const acc_t delta = (st.m - x) * inv_t;
      const acc_t scale = rc_exp(delta);
      st.s = mass_times(scale, st.s + st.d * delta);
      st.d = st.d * scale + acc_t(1);
      if (kSumZ) st.sz += static_cast<acc_t>(st.n) * scaled_shift(st.m, x, inv_t);
    }
    st.m = x;
  } else {  // x <= m, or NaN (which makes d NaN)
    const acc_t delta = (x - st.m) * inv_t;
    const acc_t e = rc_exp(delta);
    st.d += e;
    st.s += mass_times(e, delta);
    if (kSumZ) st.sz += scaled_shift(x, st.m, inv_t);
  }
  st.n += 1;
}

// A summary that saw NaN or +inf.
template <typename acc_t>
RC_HD RC_FORCEINLINE bool summary_is_poisoned(const RowSummary<acc_t>& st) {
  return !(st.d == st.d) || !(st.s == st.s) || st.m == acc_t(INFINITY);
}

// Order-dependent fingerprint of one target id (splitmix64's finalizer over (row, id)); the header holds the
// wrapping sum over rows, so ranks given different targets are told apart without moving the targets.
RC_HD RC_FORCEINLINE uint64_t target_fingerprint(int64_t row, int64_t t) {
  uint64_t z = static_cast<uint64_t>(t) + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(row) + 1ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

RC_HD RC_FORCEINLINE void write_shard_header(const ShardHeaderParams& p, uint64_t target_hash) {
  int64_t* h = p.header;
  RC_STG(h + kHdrMagic, kShardMagic);
  RC_STG(h + kHdrRows, p.rows);
  RC_STG(h + kHdrVocabStart, p.vocab_start);
  RC_STG(h + kHdrLocalVocab, p.local_vocab);
  RC_STG(h + kHdrValidCols, p.valid_cols);
  RC_STG(h + kHdrVocabSize, p.vocab_size);
  RC_STG(h + kHdrTargetHash, static_cast<int64_t>(target_hash));
  RC_STG(h + kHdrFormat, p.format);
}

// Write one row's record (shared by the CPU loop and the CUDA kernel's lane 0). `x` is the row's logits.
template <typename scalar_t, typename acc_t>
RC_HD RC_FORCEINLINE void write_row_record(const RowStatsParams<scalar_t, acc_t>& p, int64_t row, const scalar_t* x,
                                           const RowSummary<acc_t>& st) {
  const int64_t t = RC_LDG(p.target + row);
  const int64_t local = t - p.vocab_start;
  const bool in_shard = t != p.ignore_index && local >= 0 && local < p.valid_cols;
  acc_t* out = p.records + row * p.stats_cols;
  RC_STG(out + kRowMax, st.m);
  RC_STG(out + kRowSumExp, st.d);
  RC_STG(out + kRowSumExpZ, st.s);
  RC_STG(out + kRowTargetX, in_shard ? static_cast<acc_t>(RC_LDG(x + local)) : acc_t(-INFINITY));
  if (p.stats_cols > kRowSumZ) RC_STG(out + kRowSumZ, st.sz);
}

// ---- the merge over shards -------------------------------------------------------------------------------------

// What the header check found: code (LayoutError) and the two ranks involved (-1 when not applicable).
enum LayoutError : int {
  kLayoutOk = 0,
  kLayoutBadMagic,        // rank a's buffer is not a shard record (a different op or version)
  kLayoutRows,            // ranks a and b hold different numbers of rows
  kLayoutFormat,          // ranks a and b use different record formats (entropy/smoothing columns, dtype)
  kLayoutVocabSize,       // ranks a and b were given different vocab_size
  kLayoutTargets,         // ranks a and b hold different targets
  kLayoutOverlap,         // the vocab ranges of ranks a and b overlap
  kLayoutCoverage,        // the shards do not cover [0, vocab_size) (a gap, or a shard past the end)
};
struct LayoutCheck {
  int code;
  int64_t a, b;
};

RC_HD RC_FORCEINLINE const int64_t* shard_header(const void* gathered, int64_t shard, int64_t shard_bytes) {
  return reinterpret_cast<const int64_t*>(static_cast<const char*>(gathered) + shard * shard_bytes);
}

// Every rank runs this on the same gathered headers, so every rank reaches the same verdict.
RC_HD inline LayoutCheck check_shard_headers(const void* gathered, int64_t shards, int64_t shard_bytes,
                                             int64_t vocab_size) {
  const int64_t* h0 = shard_header(gathered, 0, shard_bytes);
  int64_t covered = 0;
  for (int64_t r = 0; r < shards; ++r) {
    const int64_t* h = shard_header(gathered, r, shard_bytes);
    if (RC_LDG(h + kHdrMagic) != kShardMagic) return {kLayoutBadMagic, r, -1};
    if (RC_LDG(h + kHdrRows) != RC_LDG(h0 + kHdrRows)) return {kLayoutRows, 0, r};
    if (RC_LDG(h + kHdrFormat) != RC_LDG(h0 + kHdrFormat)) return {kLayoutFormat, 0, r};
    if (RC_LDG(h + kHdrVocabSize) != vocab_size) return {kLayoutVocabSize, 0, r};
    if (RC_LDG(h + kHdrTargetHash) != RC_LDG(h0 + kHdrTargetHash)) return {kLayoutTargets, 0, r};
    const int64_t start = RC_LDG(h + kHdrVocabStart), len = RC_LDG(h + kHdrValidCols);
    for (int64_t q = 0; q < r; ++q) {
      const int64_t* g = shard_header(gathered, q, shard_bytes);
      const int64_t qs = RC_LDG(g + kHdrVocabStart), ql = RC_LDG(g + kHdrValidCols);
      if (len > 0 && ql > 0 && start < qs + ql && qs < start + len) return {kLayoutOverlap, q, r};
    }
    covered += len;
  }
  // Disjoint ranges inside [0, vocab_size) (valid_cols clips at vocab_size) that add up to vocab_size tile it.
  if (covered != vocab_size) return {kLayoutCoverage, -1, -1};
  for (int64_t r = 0; r < shards; ++r) {
    const int64_t* h = shard_header(gathered, r, shard_bytes);
    if (RC_LDG(h + kHdrVocabStart) < 0) return {kLayoutCoverage, r, -1};
  }
  return {kLayoutOk, -1, -1};
}

// Merge the shard records of one row and write its outputs (the CPU loop and the CUDA merge kernel call this).
// Returns 0, or 1 + the MergeStatusSlot that makes the row invalid (its outputs are then NaN).
template <typename acc_t>
RC_HD inline int merge_one_row(const MergeParams<acc_t>& p, int64_t row) {
  const int64_t t = RC_LDG(p.target + row);
  acc_t* state = p.row_state + row * kRowStateCols;
  if (t == p.ignore_index) {  // ignored rows give zeros; the finite state keeps backward clear of NaN
    RC_STG(p.logp + row, acc_t(0));
    RC_STG(p.entropy + row, acc_t(0));
    RC_STG(p.mean_logp + row, acc_t(0));
    RC_STG(state + kStateMax, acc_t(0));
    RC_STG(state + kStateLogSumExp, acc_t(0));
    RC_STG(state + kStateMeanZ, acc_t(0));
    return 0;
  }
  const acc_t it = p.inv_temperature;
  RowSummary<acc_t> st = summary_empty<acc_t>();
  acc_t y = -INFINITY;
  bool poisoned = false;
  const int64_t shard_bytes = p.shard_len * static_cast<int64_t>(sizeof(acc_t));
  for (int64_t k = 0; k < p.shards; ++k) {
    const acc_t* shard = p.gathered + k * p.shard_len;
    const acc_t* rec = shard + p.header_len + row * p.stats_cols;
    RowSummary<acc_t> r;
    r.m = RC_LDG(rec + kRowMax);
    r.d = RC_LDG(rec + kRowSumExp);
    r.s = RC_LDG(rec + kRowSumExpZ);
    r.sz = p.stats_cols > kRowSumZ ? RC_LDG(rec + kRowSumZ) : acc_t(0);
    r.n = RC_LDG(shard_header(p.gathered, k, shard_bytes) + kHdrValidCols);
    poisoned |= summary_is_poisoned(r);
    st = summary_merge(st, r, it);
    const acc_t yk = RC_LDG(rec + kRowTargetX);
    y = yk > y ? yk : y;
  }
  int code = 0;
  if (t < 0 || t >= p.vocab_size) {
    code = 1 + kStatusTarget;
  } else if (poisoned || summary_is_poisoned(st)) {
    code = 1 + kStatusNonFinite;
  } else if (st.d == acc_t(0)) {
    code = 1 + kStatusNoFiniteLogit;
  }
  if (code != 0) {
    const acc_t nan = static_cast<acc_t>(NAN);
    RC_STG(p.logp + row, nan);
    RC_STG(p.entropy + row, nan);
    RC_STG(p.mean_logp + row, nan);
    RC_STG(state + kStateMax, nan);
    RC_STG(state + kStateLogSumExp, nan);
    RC_STG(state + kStateMeanZ, nan);
    return code;
  }
  // Records taken with with_entropy=False (the shards agree on the format: check_shard_headers) hold no entropy sums:
  // the entropy is NaN, the state's mean 0 (a backward without an entropy gradient does not read it).
  const bool no_entropy = (RC_LDG(shard_header(p.gathered, 0, shard_bytes) + kHdrFormat) & kFormatNoEntropy) != 0;
  const acc_t log_d = rc_log(st.d);
  const acc_t mean_z = no_entropy ? acc_t(0) : st.s / st.d;  // softmax mean of (z - M/T)
  // (y - M)/T through the scaled difference: y - M alone overflows at spreads past fp32's maximum (-3e38 - 3e38)
  // where (y - M)/T need not (T = 100). y = -inf (a masked target): -inf.
  RC_STG(p.logp + row, scaled_shift(y, st.m, it) * acc_t(kSumZUnscale) - log_d);
  RC_STG(p.entropy + row, no_entropy ? static_cast<acc_t>(NAN) : log_d - mean_z);
  const acc_t mean_z_all = st.sz / static_cast<acc_t>(p.vocab_size) * acc_t(kSumZUnscale);  // SZ / V, unscaled
  RC_STG(p.mean_logp + row, p.stats_cols > kRowSumZ ? mean_z_all - log_d : acc_t(0));
  RC_STG(state + kStateMax, st.m);
  RC_STG(state + kStateLogSumExp, log_d);
  RC_STG(state + kStateMeanZ, mean_z);
  return 0;
}

// ---- backward ------------------------------------------------------------------------------------------------

// d/dz_i of  g_lp logp + g_h H + g_m mean_logp,  with zm_i = z_i - M/T and p_i = e^{zm_i - log D}:
//   g_lp (1[i = y] - p_i) - g_h p_i (zm_i - S/D) + g_m (1/V - p_i).
// A -inf column has p = 0 and gets g_m / V (the label-smoothing term; 0 without smoothing); the target column of a
// masked target keeps its g_lp, as torch.log_softmax's gradient does. The caller multiplies by 1/T.
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t logprob_grad_element(acc_t zm, acc_t p, bool is_target, acc_t g_lp, acc_t g_h,
                                                acc_t g_m_over_v, acc_t g_m, acc_t mean_z) {
  acc_t g = g_m_over_v - (g_lp + g_m) * p - g_h * mass_times(p, zm - mean_z);
  if (is_target) g += g_lp;
  return g;
}

}  // namespace rollout_corr
