// CUDA kernels of the vocab-parallel log-prob op (DESIGN §2). Device code only: no ATen, no CUDA runtime
// calls, so the CUDA emulator compiles this very file for the CPU. Launchers: logprob.cu.
#pragma once

#include "device_utils.cuh"
#include "logprob_math.h"
#include "logprob_params.h"

namespace rollout_corr {

// One block per row (grid-stride over rows). Each thread folds its strided share of the row into an
// online-softmax summary (one exp per element, fp32), lanes merge by butterfly shuffles, warps through
// shared memory. The shard is read exactly once, with 16-byte loads when kVec > 1.
template <typename scalar_t, typename acc_t, int kVec>
__global__ void vocab_row_stats_kernel(RowStatsParams<scalar_t, acc_t> p) {
  RC_SHARED_ARRAY(acc_t, warp_m, kWarpSize);
  RC_SHARED_ARRAY(acc_t, warp_d, kWarpSize);
  RC_SHARED_ARRAY(acc_t, warp_s, kWarpSize);
  RC_SHARED_ARRAY(acc_t, warp_z, kWarpSize);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const scalar_t* x = p.logits + row * p.logits_row_stride;
    SoftmaxStats<acc_t> st = softmax_stats_empty<acc_t>();
    acc_t sum_z = acc_t(0);
    const int64_t num_vec = p.valid_cols / kVec;
    for (int64_t v = threadIdx.x; v < num_vec; v += blockDim.x) {
      const AlignedVector<scalar_t, kVec> pack = reinterpret_cast<const AlignedVector<scalar_t, kVec>*>(x)[v];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const acc_t z = static_cast<acc_t>(pack.val[e]) * p.inv_temperature;
        softmax_stats_add(st, z);
        sum_z += z;
      }
    }
    for (int64_t c = num_vec * kVec + threadIdx.x; c < p.valid_cols; c += blockDim.x) {
      const acc_t z = static_cast<acc_t>(x[c]) * p.inv_temperature;
      softmax_stats_add(st, z);
      sum_z += z;
    }

    st = warp_merge_stats(st);
    sum_z = warp_sum(sum_z);
    if (lane == 0) {
      warp_m[warp] = st.m;
      warp_d[warp] = st.d;
      warp_s[warp] = st.s;
      warp_z[warp] = sum_z;
    }
    __syncthreads();
    if (warp == 0) {
      const bool has = lane < num_warps;
      st.m = has ? warp_m[lane] : -INFINITY;
      st.d = has ? warp_d[lane] : acc_t(0);
      st.s = has ? warp_s[lane] : acc_t(0);
      sum_z = has ? warp_z[lane] : acc_t(0);
      st = warp_merge_stats(st);
      sum_z = warp_sum(sum_z);
      if (lane == 0) write_row_record(p, row, x, st, sum_z);
    }
    __syncthreads();  // the warp_* slots are rewritten for the next row
  }
}

// One thread per row: merge the R shard records (tiny; R = tensor-parallel size).
template <typename acc_t>
__global__ void merge_row_stats_kernel(MergeParams<acc_t> p) {
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    merge_one_row(p, row);
  }
}

// One block per row: one read and one write of the shard, no reduction. Every element is read and written
// by the same thread, so grad_logits may alias logits (in-place backward).
template <typename scalar_t, typename acc_t, int kVec>
__global__ void logprob_backward_kernel(LogprobBackwardParams<scalar_t, acc_t> p) {
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const scalar_t* x = p.logits + row * p.logits_row_stride;
    scalar_t* gx = p.grad_logits + row * p.grad_row_stride;
    const int64_t t = p.target[row];
    const bool ignored = t == p.ignore_index;
    const int64_t local = t - p.vocab_start;
    const acc_t lse = p.row_state[2 * row + kStateLse];
    const acc_t mean_z = p.row_state[2 * row + kStateMeanZ];
    const acc_t g_lp = (ignored || p.grad_logp == nullptr) ? acc_t(0) : p.grad_logp[row];
    const acc_t g_h = (ignored || p.grad_entropy == nullptr) ? acc_t(0) : p.grad_entropy[row];
    const acc_t g_m = (ignored || p.grad_mean_logp == nullptr) ? acc_t(0) : p.grad_mean_logp[row];
    const acc_t g_m_over_v = g_m / static_cast<acc_t>(p.vocab_size);
    const acc_t it = p.inv_temperature;

    const int64_t num_vec = p.local_vocab / kVec;
    for (int64_t v = threadIdx.x; v < num_vec; v += blockDim.x) {
      const AlignedVector<scalar_t, kVec> in = reinterpret_cast<const AlignedVector<scalar_t, kVec>*>(x)[v];
      AlignedVector<scalar_t, kVec> out;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int64_t c = v * kVec + e;
        acc_t g = acc_t(0);
        if (!ignored && c < p.valid_cols) {
          const acc_t z = static_cast<acc_t>(in.val[e]) * it;
          const acc_t prob = rc_exp(z - lse);
          g = logprob_grad_element(z, prob, c == local, g_lp, g_h, g_m_over_v, g_m, mean_z) * it;
        }
        out.val[e] = static_cast<scalar_t>(g);
      }
      reinterpret_cast<AlignedVector<scalar_t, kVec>*>(gx)[v] = out;
    }
    for (int64_t c = num_vec * kVec + threadIdx.x; c < p.local_vocab; c += blockDim.x) {
      acc_t g = acc_t(0);
      if (!ignored && c < p.valid_cols) {
        const acc_t z = static_cast<acc_t>(x[c]) * it;
        const acc_t prob = rc_exp(z - lse);
        g = logprob_grad_element(z, prob, c == local, g_lp, g_h, g_m_over_v, g_m, mean_z) * it;
      }
      gx[c] = static_cast<scalar_t>(g);
    }
  }
}

}  // namespace rollout_corr
