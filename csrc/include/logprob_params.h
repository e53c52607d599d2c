// Torch-free parameter blocks of the log-prob kernels: raw pointers, sizes and element strides only, so the
// kernels compile without ATen (and therefore also under the CUDA emulator).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rollout_corr {

template <typename scalar_t, typename acc_t>
struct RowStatsParams {
  const scalar_t* logits;  // [rows, local_vocab], row stride logits_row_stride, unit column stride
  const int64_t* target;   // [rows], global ids
  acc_t* stats;            // [rows, stats_cols] contiguous
  int64_t rows;
  int64_t local_vocab;
  int64_t logits_row_stride;
  int64_t valid_cols;  // columns before the padding starts (<= local_vocab)
  int64_t vocab_start;
  int64_t ignore_index;
  int stats_cols;  // 4, or 5 with sum z
  acc_t inv_temperature;
};

template <typename acc_t>
struct MergeParams {
  const acc_t* stats;  // [shards, rows, stats_cols] contiguous
  const int64_t* target;
  acc_t* logp;
  acc_t* entropy;
  acc_t* mean_logp;
  acc_t* row_state;  // [rows, 2]
  int64_t rows;
  int64_t shards;
  int64_t vocab_size;
  int64_t ignore_index;
  int stats_cols;
};

template <typename scalar_t, typename acc_t>
struct LogprobBackwardParams {
  const scalar_t* logits;  // may alias grad_logits (in-place backward): each element is read before written
  scalar_t* grad_logits;   // same strides as logits
  const int64_t* target;
  const acc_t* row_state;  // [rows, 2]
  const acc_t* grad_logp;  // [rows] or nullptr
  const acc_t* grad_entropy;
  const acc_t* grad_mean_logp;
  int64_t rows;
  int64_t local_vocab;
  int64_t logits_row_stride;
  int64_t grad_row_stride;
  int64_t valid_cols;
  int64_t vocab_start;
  int64_t vocab_size;
  int64_t ignore_index;
  acc_t inv_temperature;
};

}  // namespace rollout_corr
