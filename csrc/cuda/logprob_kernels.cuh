// CUDA kernels of the vocab-parallel log-prob op (docs/logprobs.md). Device code only: no ATen, no CUDA runtime
// calls, so the CUDA emulator compiles this very file for the CPU. Launch planning: logprob_launch.cuh (shared
// with the emulator); launchers: logprob.cu. Per-element and merge math: logprob_math.h (shared with the CPU).
#pragma once

#include "device_utils.cuh"
#include "logprob_math.h"
#include "logprob_params.h"

namespace rollout_corr {

// Merge of row summaries across the 32 lanes of a warp (butterfly: every lane ends with the result). sz and n only
// travel when the label-smoothing column is wanted.
template <typename acc_t, bool kSumZ>
__device__ RC_FORCEINLINE RowSummary<acc_t> warp_merge_summary(RowSummary<acc_t> st, acc_t inv_t) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    RowSummary<acc_t> other;
    other.m = __shfl_xor_sync(kFullWarpMask, st.m, offset);
    other.d = __shfl_xor_sync(kFullWarpMask, st.d, offset);
    other.s = __shfl_xor_sync(kFullWarpMask, st.s, offset);
    if (kSumZ) {
      other.sz = __shfl_xor_sync(kFullWarpMask, st.sz, offset);
      other.n = __shfl_xor_sync(kFullWarpMask, st.n, offset);
    } else {
      other.sz = acc_t(0);
      other.n = 0;
    }
    st = summary_merge(st, other, inv_t);
  }
  return st;
}

// One block per row (grid-stride over rows). Each thread folds its strided share of the row into a summary (one
// exp per element, fp32), lanes merge by butterfly shuffles, warps through shared memory. The shard is read
// exactly once, with 16-byte loads when kVec > 1.
template <typename scalar_t, typename acc_t, int kVec, bool kSumZ>
__global__ void vocab_row_stats_kernel(RowStatsParams<scalar_t, acc_t> p) {
  RC_SHARED_ARRAY(acc_t, warp_m, kWarpSize);
  RC_SHARED_ARRAY(acc_t, warp_d, kWarpSize);
  RC_SHARED_ARRAY(acc_t, warp_s, kWarpSize);
  RC_SHARED_ARRAY(acc_t, warp_sz, kWarpSize);
  RC_SHARED_ARRAY(int64_t, warp_n, kWarpSize);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const acc_t it = p.inv_temperature;

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const scalar_t* x = p.logits + row * p.logits_row_stride;
    RowSummary<acc_t> st = summary_empty<acc_t>();
    const int64_t num_vec = p.valid_cols / kVec;
    const auto* xv = reinterpret_cast<const AlignedVector<scalar_t, kVec>*>(x);
    for (int64_t v = threadIdx.x; v < num_vec; v += blockDim.x) {
      const AlignedVector<scalar_t, kVec> pack = RC_LDG(xv + v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) summary_add<kSumZ>(st, static_cast<acc_t>(pack.val[e]), it);
    }
    for (int64_t c = num_vec * kVec + threadIdx.x; c < p.valid_cols; c += blockDim.x) {
      summary_add<kSumZ>(st, static_cast<acc_t>(RC_LDG(x + c)), it);
    }

    st = warp_merge_summary<acc_t, kSumZ>(st, it);
    if (lane == 0) {
      warp_m[warp] = st.m;
      warp_d[warp] = st.d;
      warp_s[warp] = st.s;
      warp_sz[warp] = st.sz;
      warp_n[warp] = st.n;
    }
    __syncthreads();
    if (warp == 0) {
      st = summary_empty<acc_t>();
      if (lane < num_warps) st = {warp_m[lane], warp_d[lane], warp_s[lane], warp_sz[lane], warp_n[lane]};
      st = warp_merge_summary<acc_t, kSumZ>(st, it);
      if (lane == 0) write_row_record(p, row, x, st);
    }
    __syncthreads();  // the warp_* slots are rewritten for the next row (a fast warp would overwrite them)
  }
}

// One block: the 64-byte header of the shard record, with the wrapping sum of the targets' fingerprints (an
// order-independent reduction, so every backend writes the same value).
__global__ void shard_header_kernel(ShardHeaderParams p) {
  RC_SHARED_ARRAY(unsigned long long, warp_hash, kWarpSize);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  unsigned long long h = 0;
  for (int64_t r = threadIdx.x; r < p.rows; r += blockDim.x) h += target_fingerprint(r, RC_LDG(p.target + r));
  h = warp_sum(h);
  if (lane == 0) warp_hash[warp] = h;
  __syncthreads();
  if (warp == 0) {
    h = warp_sum(lane < num_warps ? warp_hash[lane] : 0ull);
    if (lane == 0) write_shard_header(p, h);
  }
}

// One thread per row: merge the R shard records (tiny; R = tensor-parallel size). Failures are reported in
// status (the host turns them into asynchronous asserts); block 0's first thread checks the shard headers.
template <typename acc_t>
__global__ void merge_row_stats_kernel(MergeParams<acc_t> p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const LayoutCheck c = check_shard_headers(p.gathered, p.shards,
                                              p.shard_len * static_cast<int64_t>(sizeof(acc_t)), p.vocab_size);
    if (c.code != kLayoutOk) RC_STG(p.status + kStatusLayout, 1);
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int code = merge_one_row(p, row);
    if (code != 0) RC_STG(p.status + (code - 1), 1);  // every writer stores the same value
  }
}

// The gradient of one element, or 0 for padding columns and ignored rows.
template <typename acc_t>
struct BackwardRow {
  bool ignored;
  int64_t local;  // the target's column in this shard (may be out of range)
  acc_t max_x, log_d, mean_z, g_lp, g_h, g_m, g_m_over_v, it;
};

template <typename scalar_t, typename acc_t>
__device__ RC_FORCEINLINE BackwardRow<acc_t> backward_row(const LogprobBackwardParams<scalar_t, acc_t>& p,
                                                          int64_t row) {
  BackwardRow<acc_t> b;
  const int64_t t = RC_LDG(p.target + row);
  b.ignored = t == p.ignore_index;
  b.local = t - p.vocab_start;
  const acc_t* state = p.row_state + row * kRowStateCols;
  b.max_x = RC_LDG(state + kStateMax);
  b.log_d = RC_LDG(state + kStateLogSumExp);
  b.mean_z = RC_LDG(state + kStateMeanZ);
  b.g_lp = (b.ignored || p.grad_logp == nullptr) ? acc_t(0) : RC_LDG(p.grad_logp + row);
  b.g_h = (b.ignored || p.grad_entropy == nullptr) ? acc_t(0) : RC_LDG(p.grad_entropy + row);
  b.g_m = (b.ignored || p.grad_mean_logp == nullptr) ? acc_t(0) : RC_LDG(p.grad_mean_logp + row);
  b.g_m_over_v = b.g_m / static_cast<acc_t>(p.vocab_size);
  b.it = p.inv_temperature;
  return b;
}

template <typename acc_t>
__device__ RC_FORCEINLINE acc_t backward_element(const BackwardRow<acc_t>& b, acc_t x, int64_t c,
                                                 int64_t valid_cols) {
  if (b.ignored || c >= valid_cols) return acc_t(0);
  const acc_t zm = (x - b.max_x) * b.it;
  const acc_t prob = rc_exp(zm - b.log_d);
  return logprob_grad_element(zm, prob, c == b.local, b.g_lp, b.g_h, b.g_m_over_v, b.g_m, b.mean_z) * b.it;
}

// One block per row: one read and one write of the shard, no reduction. Every element is read and written by the
// same thread, so grad_logits may alias logits (in-place backward).
template <typename scalar_t, typename acc_t, int kVec>
__global__ void logprob_backward_kernel(LogprobBackwardParams<scalar_t, acc_t> p) {
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const scalar_t* x = p.logits + row * p.logits_row_stride;
    scalar_t* gx = p.grad_logits + row * p.grad_row_stride;
    const BackwardRow<acc_t> b = backward_row(p, row);
    const int64_t num_vec = p.local_vocab / kVec;
    const auto* xv = reinterpret_cast<const AlignedVector<scalar_t, kVec>*>(x);
    auto* gv = reinterpret_cast<AlignedVector<scalar_t, kVec>*>(gx);
    for (int64_t v = threadIdx.x; v < num_vec; v += blockDim.x) {
      const AlignedVector<scalar_t, kVec> in = RC_LDG(xv + v);
      AlignedVector<scalar_t, kVec> out;
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        out.val[e] = static_cast<scalar_t>(backward_element(b, static_cast<acc_t>(in.val[e]), v * kVec + e,
                                                            p.valid_cols));
      RC_STG(gv + v, out);
    }
    for (int64_t c = num_vec * kVec + threadIdx.x; c < p.local_vocab; c += blockDim.x)
      RC_STG(gx + c, static_cast<scalar_t>(backward_element(b, static_cast<acc_t>(RC_LDG(x + c)), c, p.valid_cols)));
  }
}

}  // namespace rollout_corr
