// CUDA kernels of the fused policy loss (docs/megatron.md, "Loss modes"). Device code only: no ATen, no CUDA runtime
// calls, so the
// CUDA emulator compiles this very file for the CPU. Launchers: policy_loss.cu.
#pragma once

#include "device_utils.cuh"
#include "policy_loss_math.h"
#include "policy_loss_params.h"

namespace rollout_corr {

// One block per row (grid-stride over rows). Each thread takes a strided share of the row's tokens (adjacent
// threads read adjacent tokens: coalesced), writes their loss and folds them into five fp32 partials; lanes
// reduce by butterfly shuffles, warps through shared memory, and thread 0 writes the row's record. Every input
// is read once and loss_mat written once: with fp32 inputs, weights and a bool mask that is 17 B read + 4 B
// written per token, plus 20 B per row. Without loss_mat (p.loss_mat == nullptr), a masked token's 1 B of mask.
template <typename scalar_t, typename acc_t>
__global__ void policy_loss_rows_kernel(PolicyLossParams<scalar_t, acc_t> p) {
  RC_SHARED_ARRAY(acc_t, warp_partials, kWarpSize * kPgRowCols);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    PolicyRowPartials<acc_t> partials = policy_row_partials_zero<acc_t>();
    const SeqSpan sp = seq_span(p.row_offsets, p.cols, row);
    for (int64_t t = threadIdx.x; t < sp.len; t += blockDim.x) policy_loss_forward_token(p, sp.row, sp.col0 + t, partials);

#pragma unroll
    for (int k = 0; k < kPgRowCols; ++k) partials.v[k] = warp_sum(partials.v[k]);
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < kPgRowCols; ++k) warp_partials[warp * kPgRowCols + k] = partials.v[k];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int k = 0; k < kPgRowCols; ++k) {
        const acc_t v = lane < num_warps ? warp_partials[lane * kPgRowCols + k] : acc_t(0);
        partials.v[k] = warp_sum(v);
      }
      if (lane == 0) {
#pragma unroll
        for (int k = 0; k < kPgRowCols; ++k) RC_STG(p.row_partials + row * kPgRowCols + k, partials.v[k]);
      }
    }
    __syncthreads();  // warp_partials is rewritten for the next row
  }
}

// Elementwise backward, one block per row: no reduction, each token's gradient depends on its own inputs and
// the row's upstream loss gradient only.
template <typename scalar_t, typename acc_t>
__global__ void policy_loss_backward_kernel(PolicyLossBackwardParams<scalar_t, acc_t> p) {
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const SeqSpan sp = seq_span(p.row_offsets, p.cols, row);
    for (int64_t t = threadIdx.x; t < sp.len; t += blockDim.x) policy_loss_backward_token(p, row, sp.row, sp.col0 + t);
  }
}

}  // namespace rollout_corr
