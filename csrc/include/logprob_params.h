// Torch-free parameter blocks and record layouts of the log-prob kernels: raw pointers, sizes and element strides
// only, so the kernels compile without ATen (and therefore also under the CUDA emulator).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rollout_corr {

// ---- the shard record: what one rank contributes to the one all-gather ------------------------------------------
//
// A flat buffer in the accumulation dtype: a 64-byte header (kShardHeaderSlots int64 values, bit-copied), then
// `rows` records of kRowStatCols (or kRowStatColsWithSumZ) values. The header lets every rank check, after the
// all-gather and without another collective, that the shards tile [0, vocab_size) and describe the same rows and
// targets (docs/logprobs.md, "Layout checks"). Every slot, column and constant is declared once, in
// logprob_layout.def (also read by rollout_corr_ext/_layout.py); the enums below are generated from it.
enum ShardHeaderSlot : int {
#define RC_LP_HDR(name) kHdr##name,
#include "logprob_layout.def"
  kShardHeaderSlots
};
// Columns of a row record. The max is kept in raw logit units (before 1/T), everything else in max-shifted,
// temperature-scaled coordinates, so no large value is ever subtracted from another (no cancellation) and a
// temperature below 1 cannot overflow the max. The last column (kRowSumZ) exists only with label smoothing.
enum RowStatColumn : int {
#define RC_LP_ROW_STAT(name) kRow##name,
#include "logprob_layout.def"
  kRowStatColsWithSumZ
};
constexpr int kRowStatCols = kRowSumZ;
// Columns of the per-row state saved for backward (12 B per row in fp32).
enum RowStateColumn : int {
#define RC_LP_ROW_STATE(name) kState##name,
#include "logprob_layout.def"
  kRowStateCols
};
// Status slots of the merge (CUDA reports through them; the CPU merge raises instead). A slot is set to 1 when any
// row (or the header check) fails for that reason.
enum MergeStatusSlot : int {
#define RC_LP_STATUS(name) kStatus##name,
#include "logprob_layout.def"
  kMergeStatusSlots
};
// kShardMagic, kFormatNoEntropy (the merge then writes NaN for the entropy of every row that is not ignored, so that
// a value nobody computed cannot be read as one) and kSumZScale.
#define RC_LP_CONST(name, value) constexpr auto k##name = value;
#include "logprob_layout.def"
static_assert(sizeof(kShardMagic) == 8 && sizeof(kFormatNoEntropy) == 4 && sizeof(kSumZScale) == 8,
              "logprob_layout.def: the magic is an int64, the flag an int, the scale a double");
constexpr int64_t kShardHeaderBytes = int64_t(kShardHeaderSlots) * 8;

template <typename scalar_t, typename acc_t>
struct RowStatsParams {
  const scalar_t* logits;  // [rows, local_vocab], row stride logits_row_stride, unit column stride
  const int64_t* target;   // [rows], global ids
  acc_t* records;          // [rows, stats_cols] contiguous (just after the header)
  int64_t rows;
  int64_t local_vocab;
  int64_t logits_row_stride;
  int64_t valid_cols;  // columns before the padding starts (<= local_vocab)
  int64_t vocab_start;
  int64_t ignore_index;
  int stats_cols;  // kRowStatCols, or kRowStatColsWithSumZ
  acc_t inv_temperature;
};

// The header of one shard record: every field but the target fingerprint is known on the host.
struct ShardHeaderParams {
  int64_t* header;        // kShardHeaderSlots int64
  const int64_t* target;  // [rows]
  int64_t rows;
  int64_t vocab_start;
  int64_t local_vocab;
  int64_t valid_cols;
  int64_t vocab_size;
  int64_t format;
};

template <typename acc_t>
struct MergeParams {
  const acc_t* gathered;  // [shards, shard_len]: each row is one rank's shard record
  const int64_t* target;  // [rows]
  acc_t* logp;
  acc_t* entropy;
  acc_t* mean_logp;
  acc_t* row_state;  // [rows, kRowStateCols]
  int32_t* status;   // [kMergeStatusSlots] or nullptr (CPU: the caller raises from the returned codes)
  int64_t rows;
  int64_t shards;
  int64_t shard_len;  // header + rows * stats_cols, in acc_t elements
  int64_t header_len;  // kShardHeaderBytes / sizeof(acc_t)
  int64_t vocab_size;
  int64_t ignore_index;
  int stats_cols;
  acc_t inv_temperature;
};

template <typename scalar_t, typename acc_t>
struct LogprobBackwardParams {
  const scalar_t* logits;  // may alias grad_logits (in-place backward): each element is read before written
  scalar_t* grad_logits;   // same shape as logits, row stride grad_row_stride
  const int64_t* target;
  const acc_t* row_state;  // [rows, kRowStateCols]
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
