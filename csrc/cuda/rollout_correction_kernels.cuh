// CUDA kernels of the rollout-correction op (docs/rollout_correction.md). Device code only: no ATen, no CUDA runtime
// calls, no
// CUB / cooperative groups / inline PTX, so the CUDA emulator compiles this very file for the CPU.
// Launch planning and host driver: rollout_correction_launch.cuh; per-token and per-sequence math:
// rollout_correction_math.h (the functions the CPU kernels call, here with one token per thread).
//
// Both passes run one block per row (grid-stride over rows). Token terms accumulate per thread in the
// accumulation type, then reduce across the block (warp shuffles, then shared memory). Pass 2 writes every
// block's partials into its own row of a [grid, S] / [grid, M] fp64 scratch (no global atomics on the partials,
// so the result is deterministic), and rollout_reduce_partials_kernel folds the rows in order.
#pragma once

#include "device_utils.cuh"
#include "rollout_correction_math.h"

namespace rollout_corr {

// Reduce N sums and K maxima across the block; the results land in out_sum / out_max (shared), valid for every
// thread after the trailing barrier. `red` holds N + K slots per warp.
template <typename acc_t, int N, int K>
__device__ RC_FORCEINLINE void block_reduce_sum_max(acc_t* s, acc_t* m, acc_t* red, acc_t* out_sum, acc_t* out_max) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) s[k] = warp_sum(s[k]);
#pragma unroll
  for (int k = 0; k < K; ++k) m[k] = warp_max(m[k]);
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

constexpr int kSeqPassSums = rc::seq::kNumSums;
constexpr int kSeqPassMaxes = rc::seq::kCols - rc::seq::kNumSums;

// Pass 1: per-row aggregates (rc::seq columns).
template <typename acc_t>
__global__ void rollout_seq_stats_kernel(RolloutParams<acc_t> p) {
  RC_SHARED_ARRAY(acc_t, red, kWarpSize * (kSeqPassSums + kSeqPassMaxes));
  RC_SHARED_ARRAY(acc_t, out_sum, kSeqPassSums);
  RC_SHARED_ARRAY(acc_t, out_max, kSeqPassMaxes);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const SeqSpan sp = seq_span(p, row);
    rc::SeqAcc<acc_t> acc;
    rc::seq_acc_init(acc);
    for (int64_t t = threadIdx.x; t < sp.len; t += blockDim.x) {
      const int64_t col = sp.col0 + t;
      rc::seq_stats_token(p.cfg, view_load<acc_t>(p.log_prob, sp.row, col),
                          view_load<acc_t>(p.rollout_log_prob, sp.row, col), view_load<acc_t>(p.mask, sp.row, col), acc);
    }
    block_reduce_sum_max<acc_t, kSeqPassSums, kSeqPassMaxes>(acc.sum, acc.max, red, out_sum, out_max);
    if (threadIdx.x < rc::seq::kCols) {
      const int k = threadIdx.x;
      RC_STG(p.seq_stats + row * rc::seq::kCols + k, k < kSeqPassSums ? out_sum[k] : out_max[k - kSeqPassSums]);
    }
    // No barrier here: out_sum / out_max are rewritten only after the first barrier of the next row's reduction,
    // which every reader of this row's values must reach first (and `red` only after this row's last barrier).
  }
}

// Pass 2's token accumulator as two flat arrays (what the block reduction needs), by slot name.
template <typename acc_t>
struct FlatTokenAcc {
  static constexpr int kSums = rc::tok_sum::kCount + rc::kMaxTokenCriteria * rc::tok_crit_sum::kCount;
  static constexpr int kMaxes = rc::tok_max::kCount + rc::kMaxTokenCriteria * rc::tok_crit_max::kCount;
};

template <typename acc_t>
RC_HD RC_FORCEINLINE void flatten(const rc::TokenAcc<acc_t>& t, acc_t* s, acc_t* m) {
  for (int k = 0; k < rc::tok_sum::kCount; ++k) s[k] = t.sum[k];
  for (int j = 0; j < rc::kMaxTokenCriteria; ++j)
    for (int k = 0; k < rc::tok_crit_sum::kCount; ++k) s[rc::tok_sum::kCount + j * rc::tok_crit_sum::kCount + k] = t.crit_sum[j][k];
  for (int k = 0; k < rc::tok_max::kCount; ++k) m[k] = t.max[k];
  for (int j = 0; j < rc::kMaxTokenCriteria; ++j)
    for (int k = 0; k < rc::tok_crit_max::kCount; ++k) m[rc::tok_max::kCount + j * rc::tok_crit_max::kCount + k] = t.crit_max[j][k];
}

template <typename acc_t>
RC_HD RC_FORCEINLINE void unflatten(const acc_t* s, const acc_t* m, rc::TokenAcc<acc_t>& t) {
  for (int k = 0; k < rc::tok_sum::kCount; ++k) t.sum[k] = s[k];
  for (int j = 0; j < rc::kMaxTokenCriteria; ++j)
    for (int k = 0; k < rc::tok_crit_sum::kCount; ++k) t.crit_sum[j][k] = s[rc::tok_sum::kCount + j * rc::tok_crit_sum::kCount + k];
  for (int k = 0; k < rc::tok_max::kCount; ++k) t.max[k] = m[k];
  for (int j = 0; j < rc::kMaxTokenCriteria; ++j)
    for (int k = 0; k < rc::tok_crit_max::kCount; ++k) t.crit_max[j][k] = m[rc::tok_max::kCount + j * rc::tok_crit_max::kCount + k];
}

// Pass 2: weights, mask, and this block's partial rows of the SUM / MAX vectors.
template <typename acc_t>
__global__ void rollout_token_pass_kernel(RolloutParams<acc_t> p) {
  constexpr int kSums = FlatTokenAcc<acc_t>::kSums;
  constexpr int kMaxes = FlatTokenAcc<acc_t>::kMaxes;
  RC_SHARED_ARRAY(acc_t, red, kWarpSize * (kSums + kMaxes));
  RC_SHARED_ARRAY(acc_t, out_sum, kSums);
  RC_SHARED_ARRAY(acc_t, out_max, kMaxes);
  RC_SHARED_ARRAY(unsigned int, hist, rc::kHistBins);
  const rc::Config<acc_t>& c = p.cfg;
  double* S = p.block_sums + static_cast<int64_t>(blockIdx.x) * p.num_sums;
  double* M = p.block_maxes + static_cast<int64_t>(blockIdx.x) * p.num_maxes;
  for (int k = threadIdx.x; k < rc::kHistBins; k += blockDim.x) hist[k] = 0u;
  __syncthreads();

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const SeqSpan sp = seq_span(p, row);
    const acc_t* st = p.seq_stats + row * rc::seq::kCols;
    rc::RowValues<acc_t> r;
    rc::row_values(st, c, r);
    const bool row_dropped = r.seq_rejected || r.veto;
    rc::TokenAcc<acc_t> acc;
    rc::token_acc_init(acc);
    for (int64_t t = threadIdx.x; t < sp.len; t += blockDim.x) {
      const int64_t col = sp.col0 + t;
      const rc::TokenOut<acc_t> o =
          rc::token_pass_token(c, r, row_dropped, view_load<acc_t>(p.log_prob, sp.row, col),
                               view_load<acc_t>(p.rollout_log_prob, sp.row, col),
                               view_load<acc_t>(p.mask, sp.row, col), acc);
      if (p.weights) RC_STG(p.weights + weight_index(p, sp, t), o.weight);
      view_store(p.mask_out, sp.row, col, o.mask);
      if (o.hist) atomicAdd(&hist[rc::hist_index(o.log_w)], 1u);
    }
    acc_t s[kSums];
    acc_t m[kMaxes];
    flatten(acc, s, m);
    block_reduce_sum_max<acc_t, kSums, kMaxes>(s, m, red, out_sum, out_max);
    if (threadIdx.x == 0) {
      unflatten(out_sum, out_max, acc);
      rc::fold_token_acc(c, acc, S, M);
      if (p.row_partials) rc::add_row_partials(c, st, r, S, M);
    }
    // No barrier here (see the pass-1 kernel): thread 0 reads out_* before it reaches the next row's first barrier.
  }
  // This block's histogram into its partial row (each bin is owned by one thread).
  for (int k = threadIdx.x; k < rc::kHistBins; k += blockDim.x)
    rc::add_to(S[rc::sum_slot::kHist + k], static_cast<double>(hist[k]));
}

// Fold the per-block partial rows in block order (deterministic): one thread per slot.
__global__ void rollout_reduce_partials_kernel(RolloutReduceParams p) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < p.num_sums + p.num_maxes;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (k < p.num_sums) {
      double t = 0.0;
      for (int64_t b = 0; b < p.blocks; ++b) t += RC_LDG(p.block_sums + b * p.num_sums + k);
      RC_STG(p.sums + k, t);
    } else {
      const int64_t j = k - p.num_sums;
      double t = -INFINITY;
      for (int64_t b = 0; b < p.blocks; ++b) {
        const double v = RC_LDG(p.block_maxes + b * p.num_maxes + j);
        t = v > t ? v : t;
      }
      RC_STG(p.maxes + j, t);
    }
  }
}

}  // namespace rollout_corr
