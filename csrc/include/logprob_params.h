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
// targets (DESIGN §2).
enum ShardHeaderSlot : int {
  kHdrMagic = 0,     // kShardMagic: catches a buffer that is not a shard record
  kHdrRows,          // N
  kHdrVocabStart,    // global id of the shard's first column
  kHdrLocalVocab,    // columns of the shard (padding included)
  kHdrValidCols,     // columns before the padding starts (those below vocab_size)
  kHdrVocabSize,     // the true vocab size this rank was given
  kHdrTargetHash,    // order-dependent fingerprint of the targets (target_fingerprint)
  kHdrFormat,        // stats_cols + 16 * sizeof(acc_t) [+ kFormatNoEntropy], and in bits 16..62 the settings
                     // fingerprint (1/T, ignore_index)
};
// Format flag: the records' entropy sums (kRowSumExpZ) were not taken (with_entropy=False); the merge then writes NaN
// for the entropy of every row that is not ignored, so that a value nobody computed cannot be read as one.
constexpr int64_t kFormatNoEntropy = 256;
constexpr int kShardHeaderSlots = 8;
constexpr int64_t kShardHeaderBytes = kShardHeaderSlots * 8;
constexpr int64_t kShardMagic = 0x52434c5052303032LL;  // "RCLPR002" (002: sz scaled by 2^-32)

// Columns of a row record. The max is kept in raw logit units (before 1/T), everything else in max-shifted,
// temperature-scaled coordinates, so no large value is ever subtracted from another (no cancellation) and a
// temperature below 1 cannot overflow the max:
//   m = max x,  d = sum e^{(x - m)/T},  s = sum e^{(x - m)/T} (x - m)/T,  y = x[target] (or -inf),
//   sz = sum (x - m)/T  (label smoothing only).
enum RowStatColumn : int { kRowMax = 0, kRowSumExp = 1, kRowSumExpZ = 2, kRowTargetX = 3, kRowSumZ = 4 };
constexpr int kRowStatCols = 4;
constexpr int kRowStatColsWithSumZ = 5;

// Columns of the per-row state saved for backward (12 B per row in fp32): M = max x over the whole vocab,
// log D, and S/D = the softmax mean of (z - M/T).
enum RowStateColumn : int { kStateMax = 0, kStateLogSumExp = 1, kStateMeanZ = 2 };
constexpr int kRowStateCols = 3;

// Status slots of the merge (CUDA reports through them; the CPU merge raises instead). A slot is set to 1 when any
// row (or the header check) fails for that reason.
enum MergeStatusSlot : int { kStatusTarget = 0, kStatusNonFinite, kStatusNoFiniteLogit, kStatusLayout };
constexpr int kMergeStatusSlots = 4;

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
