// CUDA kernels of the rollout-correction op (DESIGN §3). Device code only: no ATen, no CUDA runtime calls, no
// CUB / cooperative groups / inline PTX, so the CUDA emulator compiles this very file for the CPU.
// Launchers: rollout_correction.cu. Contract: rollout_corr_ext/reference.py (rollout_seq_stats,
// rollout_token_pass); per-element and per-row math: rollout_math.h (shared with the CPU kernels).
//
// Both passes run one block per row (grid-stride over rows). Token terms accumulate per thread in the
// accumulation type, then reduce across the block (warp shuffles, then shared memory). Pass 2 writes every
// block's partials into its own row of a [grid, S] / [grid, M] fp64 scratch (no global atomics, so the result is
// deterministic), and rollout_reduce_partials_kernel folds the rows in order.
#pragma once

#include "device_utils.cuh"
#include "rollout_math.h"

namespace rollout_corr {

constexpr int kSeqPassSums = rc::kSeqNumSum;                  // 15
constexpr int kSeqPassMaxes = rc::kSeqCols - rc::kSeqNumSum;  // 3
// Token terms of pass 2: IS (w, wc, wc^2, >U, <L', out of band), k3_kl, chi2_token, catastrophic; then
// (stat, clamped stat, its square, >upper, <lower) for each token-level statistic k1, k2, k3, ratio.
constexpr int kTokSums = 9 + 4 * 5;
constexpr int kTokMaxes = 2 + 4 * 2;

template <typename mask_t>
RC_HD RC_FORCEINLINE bool rc_nonzero(mask_t v) {
  return static_cast<float>(v) != 0.f;
}

// Reduce N sums and K maxima across the block; the results land in out_sum / out_max (shared), valid for every
// thread after the trailing barrier. `red` holds N + K slots per warp.
template <typename acc_t, int N, int K>
__device__ RC_FORCEINLINE void block_reduce_sum_max(acc_t (&s)[N], acc_t (&m)[K], acc_t* red, acc_t* out_sum,
                                                     acc_t* out_max) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) s[k] = warp_sum(s[k]);
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const acc_t o = __shfl_xor_sync(kFullWarpMask, m[k], offset);
      m[k] = o > m[k] ? o : m[k];
    }
  }
  if (lane == 0) {
    for (int k = 0; k < N; ++k) red[warp * (N + K) + k] = s[k];
    for (int k = 0; k < K; ++k) red[warp * (N + K) + N + k] = m[k];
  }
  __syncthreads();
  for (int k = threadIdx.x; k < N + K; k += blockDim.x) {
    if (k < N) {
      acc_t t = acc_t(0);
      for (int w = 0; w < num_warps; ++w) t += red[w * (N + K) + k];
      out_sum[k] = t;
    } else {
      acc_t t = -INFINITY;
      for (int w = 0; w < num_warps; ++w) t = red[w * (N + K) + k] > t ? red[w * (N + K) + k] : t;
      out_max[k - N] = t;
    }
  }
  __syncthreads();
}

// Pass 1: per-row aggregates (rc::SeqCol layout).
template <typename scalar_t, typename mask_t, typename acc_t>
__global__ void rollout_seq_stats_kernel(RolloutParams<scalar_t, mask_t, acc_t> p) {
  RC_SHARED_ARRAY(acc_t, red, kWarpSize * (kSeqPassSums + kSeqPassMaxes));
  RC_SHARED_ARRAY(acc_t, out_sum, kSeqPassSums);
  RC_SHARED_ARRAY(acc_t, out_max, kSeqPassMaxes);
  const rc::Config<acc_t>& c = p.cfg;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    acc_t s[kSeqPassSums];
    acc_t m[kSeqPassMaxes];
#pragma unroll
    for (int k = 0; k < kSeqPassSums; ++k) s[k] = acc_t(0);
#pragma unroll
    for (int k = 0; k < kSeqPassMaxes; ++k) m[k] = -INFINITY;
    const int64_t base = row * p.cols;
    for (int64_t t = threadIdx.x; t < p.cols; t += blockDim.x) {
      if (!rc_nonzero(p.mask[base + t])) continue;
      const acc_t a = static_cast<acc_t>(p.log_prob[base + t]);
      const acc_t q = static_cast<acc_t>(p.rollout_log_prob[base + t]);
      if (!(rc::rc_isfinite(a) && rc::rc_isfinite(q))) {
        s[rc::kSeqNonFinite] += acc_t(1);
        if (c.exclude_nonfinite) continue;
      }
      const acc_t lr = a - q, l = rc::clamp20(lr), rho = rc::rc_exp(l), k3v = rc::k3_of(l);
      const acc_t k2v = acc_t(0.5) * l * l;
      s[rc::kSeqN] += acc_t(1);
      s[rc::kSeqLR] += lr;
      s[rc::kSeqK1] -= l;
      s[rc::kSeqK2] += k2v;
      s[rc::kSeqK3] += k3v;
      s[rc::kSeqLP] += a;
      s[rc::kSeqRLP] += q;
      s[rc::kSeqWRaw] += rho;
      if (c.is_level == rc::kIsToken) s[rc::kSeqWTok] += rc::is_weight(rho, c);
      if (c.has_token_crit) {
        bool any = false;
        for (int i = 0; i < c.num_rs; ++i) {
          if (c.crit_level[i] != rc::kLevelToken) continue;
          const acc_t st = rc::token_stat(c.crit_stat[i], l, rho, k3v);
          if (!rc::crit_keep(st, c.crit_lower[i], c.crit_upper[i], c.crit_apply_lower[i])) {
            s[rc::kSeqRejK1 + c.crit_stat[i]] += acc_t(1);
            any = true;
          }
        }
        if (any) s[rc::kSeqRejToken] += acc_t(1);
      }
      m[0] = k2v > m[0] ? k2v : m[0];
      m[1] = k3v > m[1] ? k3v : m[1];
      m[2] = -lr > m[2] ? -lr : m[2];
    }
    block_reduce_sum_max<acc_t, kSeqPassSums, kSeqPassMaxes>(s, m, red, out_sum, out_max);
    if (threadIdx.x < rc::kSeqCols) {
      const int k = threadIdx.x;
      p.seq_stats[row * rc::kSeqCols + k] = k < kSeqPassSums ? out_sum[k] : out_max[k - kSeqPassSums];
    }
    __syncthreads();  // out_sum / out_max are rewritten for the next row
  }
}

// Pass 2: weights, mask, and this block's partial rows of the SUM / MAX vectors.
template <typename scalar_t, typename mask_t, typename acc_t>
__global__ void rollout_token_pass_kernel(RolloutParams<scalar_t, mask_t, acc_t> p) {
  RC_SHARED_ARRAY(acc_t, red, kWarpSize * (kTokSums + kTokMaxes));
  RC_SHARED_ARRAY(acc_t, out_sum, kTokSums);
  RC_SHARED_ARRAY(acc_t, out_max, kTokMaxes);
  RC_SHARED_ARRAY(unsigned int, hist, rc::kHistBins);
  const rc::Config<acc_t>& c = p.cfg;
  double* S = p.block_sums + static_cast<int64_t>(blockIdx.x) * p.num_sums;
  double* M = p.block_maxes + static_cast<int64_t>(blockIdx.x) * p.num_maxes;
  const bool tok_is = c.is_level == rc::kIsToken;
  for (int k = threadIdx.x; k < rc::kHistBins; k += blockDim.x) hist[k] = 0u;
  __syncthreads();

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const acc_t* st = p.seq_stats + row * rc::kSeqCols;
    rc::RowValues<acc_t> r;
    rc::row_values(st, c, r);
    const bool row_dropped = r.seq_rej_any || r.veto;
    acc_t s[kTokSums];
    acc_t m[kTokMaxes];
#pragma unroll
    for (int k = 0; k < kTokSums; ++k) s[k] = acc_t(0);
#pragma unroll
    for (int k = 0; k < kTokMaxes; ++k) m[k] = -INFINITY;
    const int64_t base = row * p.cols;
    for (int64_t t = threadIdx.x; t < p.cols; t += blockDim.x) {
      const mask_t mv = p.mask[base + t];
      bool valid = rc_nonzero(mv);
      const acc_t a = static_cast<acc_t>(p.log_prob[base + t]);
      const acc_t q = static_cast<acc_t>(p.rollout_log_prob[base + t]);
      if (valid && c.exclude_nonfinite) valid = rc::rc_isfinite(a) && rc::rc_isfinite(q);
      if (!valid) {
        if (p.weights) p.weights[base + t] = acc_t(0);
        p.mask_out[base + t] = mask_t(0);
        continue;
      }
      const acc_t lr = a - q, l = rc::clamp20(lr), rho = rc::rc_exp(l), k3v = rc::k3_of(l);
      if (tok_is) {
        const acc_t w = rc::is_weight(rho, c);
        const acc_t wc = w < acc_t(0) ? acc_t(0) : (w > c.is_upper ? c.is_upper : w);
        p.weights[base + t] = w;
        s[0] += w;
        s[1] += wc;
        s[2] += wc * wc;
        s[3] += rho > c.is_upper ? acc_t(1) : acc_t(0);
        s[4] += rho < c.is_metric_lower ? acc_t(1) : acc_t(0);
        if (c.is_mask) s[5] += (rho < c.is_lower || rho > c.is_upper) ? acc_t(1) : acc_t(0);
        m[0] = w > m[0] ? w : m[0];
        m[1] = -w > m[1] ? -w : m[1];
        atomicAdd(&hist[rc::hist_index(l)], 1u);
      } else if (p.weights) {
        p.weights[base + t] = r.w;
      }
      bool tok_rej = false;
      if (c.has_token_crit) {
        for (int i = 0; i < c.num_rs; ++i) {
          if (c.crit_level[i] != rc::kLevelToken) continue;
          const int j = c.crit_stat[i];
          const acc_t v = rc::token_stat(j, l, rho, k3v);
          const acc_t lo = c.crit_lower[i], up = c.crit_upper[i];
          const bool apply_lower = c.crit_apply_lower[i];
          tok_rej |= !rc::crit_keep(v, lo, up, apply_lower);
          const acc_t cmin = apply_lower ? lo : acc_t(0);
          const acc_t sc = v < cmin ? cmin : (v > up ? up : v);
          s[9 + 5 * j + 0] += v;
          s[9 + 5 * j + 1] += sc;
          s[9 + 5 * j + 2] += sc * sc;
          s[9 + 5 * j + 3] += v > up ? acc_t(1) : acc_t(0);
          if (apply_lower) s[9 + 5 * j + 4] += v < lo ? acc_t(1) : acc_t(0);
          m[2 + 2 * j] = v > m[2 + 2 * j] ? v : m[2 + 2 * j];
          m[3 + 2 * j] = -v > m[3 + 2 * j] ? -v : m[3 + 2 * j];
        }
      }
      p.mask_out[base + t] = (tok_rej || row_dropped) ? mask_t(0) : mv;
      s[6] += l == lr ? k3v : rc::k3_of(lr);  // k3_kl uses the unclamped ratio
      s[7] += rho * rho;
      if (c.veto_on) s[8] += lr < c.veto_log ? acc_t(1) : acc_t(0);
    }
    block_reduce_sum_max<acc_t, kTokSums, kTokMaxes>(s, m, red, out_sum, out_max);
    if (threadIdx.x == 0) {
      const int is_slots[6] = {rc::kSIsW, rc::kSIsWc, rc::kSIsWc2, rc::kSIsHigh, rc::kSIsLow, rc::kSIsOob};
      for (int k = 0; k < 6; ++k) S[is_slots[k]] += static_cast<double>(out_sum[k]);
      S[rc::kSK3Raw] += static_cast<double>(out_sum[6]);
      S[rc::kSRho2] += static_cast<double>(out_sum[7]);
      S[rc::kSCatTok] += static_cast<double>(out_sum[8]);
      rc::rc_upd_max(M[rc::kMIsW], static_cast<double>(out_max[0]));
      rc::rc_upd_max(M[rc::kMIsNegW], static_cast<double>(out_max[1]));
      for (int i = 0; i < c.num_rs; ++i) {
        if (c.crit_level[i] != rc::kLevelToken) continue;
        const int j = c.crit_stat[i];
        double* Sc = S + rc::kSBase + i * rc::kRsSum;
        double* Mc = M + rc::kMBase + i * rc::kRsMax;
        Sc[rc::kRsStat] += static_cast<double>(out_sum[9 + 5 * j + 0]);
        Sc[rc::kRsSc] += static_cast<double>(out_sum[9 + 5 * j + 1]);
        Sc[rc::kRsSc2] += static_cast<double>(out_sum[9 + 5 * j + 2]);
        Sc[rc::kRsHigh] += static_cast<double>(out_sum[9 + 5 * j + 3]);
        Sc[rc::kRsLow] += static_cast<double>(out_sum[9 + 5 * j + 4]);
        rc::rc_upd_max(Mc[rc::kRmStat], static_cast<double>(out_max[2 + 2 * j]));
        rc::rc_upd_max(Mc[rc::kRmNegStat], static_cast<double>(out_max[3 + 2 * j]));
      }
      if (p.row_partials) rc::add_row_partials(c, st, r, S, M);
    }
    __syncthreads();  // red / out_* are rewritten for the next row
  }
  // This block's histogram into its partial row (each bin is owned by one thread).
  for (int k = threadIdx.x; k < rc::kHistBins; k += blockDim.x) S[rc::kSHist + k] += static_cast<double>(hist[k]);
}

// Fold the per-block partial rows in block order (deterministic): one thread per slot.
__global__ void rollout_reduce_partials_kernel(RolloutReduceParams p) {
  const double* block_sums = p.block_sums;
  const double* block_maxes = p.block_maxes;
  const int64_t blocks = p.blocks, num_sums = p.num_sums, num_maxes = p.num_maxes;
  double* sums = p.sums;
  double* maxes = p.maxes;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < num_sums + num_maxes;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (k < num_sums) {
      double t = 0.0;
      for (int64_t b = 0; b < blocks; ++b) t += block_sums[b * num_sums + k];
      sums[k] = t;
    } else {
      const int64_t j = k - num_sums;
      double t = -INFINITY;
      for (int64_t b = 0; b < blocks; ++b) t = block_maxes[b * num_maxes + j] > t ? block_maxes[b * num_maxes + j] : t;
      maxes[j] = t;
    }
  }
}

}  // namespace rollout_corr
