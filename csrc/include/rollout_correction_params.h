// Torch-free parameter blocks and named layouts of the rollout-correction kernels (docs/rollout_correction.md).
// Every slot and
// code comes from rollout_correction_layout.def (which Python parses too), so C++ and Python cannot disagree.
#pragma once

#include <cstdint>

#include "rc_macros.h"
#include "token_view.h"

namespace rollout_corr {
namespace rc {

// ---- constants and codes ----------------------------------------------------------------------------------------
#define RC_CONST(name, value) constexpr double k_##name = value;
#include "rollout_correction_layout.def"
constexpr int kHistBins = static_cast<int>(k_hist_bins);
constexpr int kMaxCriteria = static_cast<int>(k_max_criteria);
constexpr int kMaxTokenCriteria = static_cast<int>(k_max_token_criteria);

namespace is_level {
#define RC_CODE(group, name, value) RC_CODE_##group(name, value)
#define RC_CODE_is_level(name, value) constexpr int name = value;
#define RC_CODE_rs_level(name, value)
#define RC_CODE_rs_stat(name, value)
#include "rollout_correction_layout.def"
#undef RC_CODE_is_level
#undef RC_CODE_rs_level
#undef RC_CODE_rs_stat
}  // namespace is_level
namespace rs_level {
#define RC_CODE(group, name, value) RC_CODE_##group(name, value)
#define RC_CODE_is_level(name, value)
#define RC_CODE_rs_level(name, value) constexpr int name = value;
#define RC_CODE_rs_stat(name, value)
#include "rollout_correction_layout.def"
#undef RC_CODE_is_level
#undef RC_CODE_rs_level
#undef RC_CODE_rs_stat
}  // namespace rs_level
namespace rs_stat {
#define RC_CODE(group, name, value) RC_CODE_##group(name, value)
#define RC_CODE_is_level(name, value)
#define RC_CODE_rs_level(name, value)
#define RC_CODE_rs_stat(name, value) constexpr int name = value;
#include "rollout_correction_layout.def"
#undef RC_CODE_is_level
#undef RC_CODE_rs_level
#undef RC_CODE_rs_stat
}  // namespace rs_stat

// ---- slots --------------------------------------------------------------------------------------------------------
// seq_stats columns: seq::tokens ... (sums), then the maxima; seq::kNumSums sums, seq::kCols columns.
namespace seq {
enum Col : int {
#define RC_SEQ_SUM(name) name,
#define RC_SEQ_MAX(name) name,
#include "rollout_correction_layout.def"
  kColCount
};
enum SumCount : int {
#define RC_SEQ_SUM(name) sum_##name,
#include "rollout_correction_layout.def"
  kSumCount
};
constexpr int kCols = kColCount;
constexpr int kNumSums = kSumCount;
}  // namespace seq

// The SUM vector: slots, then the histogram, then one block of crit_sum_slot slots per criterion.
namespace sum_slot {
enum Slot : int {
#define RC_SUM(name, source) name,
#include "rollout_correction_layout.def"
  kCount
};
constexpr int kHist = kCount;                  // first histogram bin
constexpr int kCritBase = kCount + kHistBins;  // first criterion block
}  // namespace sum_slot
namespace max_slot {
enum Slot : int {
#define RC_MAX(name, source) name,
#include "rollout_correction_layout.def"
  kCount
};
}  // namespace max_slot
namespace crit_sum_slot {
enum Slot : int {
#define RC_CRIT_SUM(name, source) name,
#include "rollout_correction_layout.def"
  kCount
};
}  // namespace crit_sum_slot
namespace crit_max_slot {
enum Slot : int {
#define RC_CRIT_MAX(name, source) name,
#include "rollout_correction_layout.def"
  kCount
};
}  // namespace crit_max_slot

inline constexpr int64_t sum_size(int num_rs) { return sum_slot::kCritBase + static_cast<int64_t>(num_rs) * crit_sum_slot::kCount; }
inline constexpr int64_t max_size(int num_rs) { return max_slot::kCount + static_cast<int64_t>(num_rs) * crit_max_slot::kCount; }

// The block of criterion i in the SUM / MAX vectors.
template <typename T>
RC_HD RC_FORCEINLINE T* crit_sums(T* sums, int i) { return sums + sum_slot::kCritBase + i * crit_sum_slot::kCount; }
template <typename T>
RC_HD RC_FORCEINLINE T* crit_maxes(T* maxes, int i) { return maxes + max_slot::kCount + i * crit_max_slot::kCount; }

// ---- per-token accumulators of the token loop (the TOKEN-sourced slots, by name) ---------------------------------
namespace tok_sum {
enum Slot : int {
#define RC_SUM(name, source) RC_SUM_##source(name)
#define RC_SUM_TOKEN(name) name,
#define RC_SUM_ROW(name)
#include "rollout_correction_layout.def"
#undef RC_SUM_TOKEN
#undef RC_SUM_ROW
  kCount
};
}  // namespace tok_sum
namespace tok_max {
enum Slot : int {
#define RC_MAX(name, source) RC_MAX_##source(name)
#define RC_MAX_TOKEN(name) name,
#define RC_MAX_ROW(name)
#include "rollout_correction_layout.def"
#undef RC_MAX_TOKEN
#undef RC_MAX_ROW
  kCount
};
}  // namespace tok_max
namespace tok_crit_sum {
enum Slot : int {
#define RC_CRIT_SUM(name, source) RC_CRIT_SUM_##source(name)
#define RC_CRIT_SUM_TOKEN(name) name,
#define RC_CRIT_SUM_ROW(name)
#include "rollout_correction_layout.def"
#undef RC_CRIT_SUM_TOKEN
#undef RC_CRIT_SUM_ROW
  kCount
};
}  // namespace tok_crit_sum
namespace tok_crit_max {
enum Slot : int {
#define RC_CRIT_MAX(name, source) RC_CRIT_MAX_##source(name)
#define RC_CRIT_MAX_TOKEN(name) name,
#define RC_CRIT_MAX_ROW(name)
#include "rollout_correction_layout.def"
#undef RC_CRIT_MAX_TOKEN
#undef RC_CRIT_MAX_ROW
  kCount
};
}  // namespace tok_crit_max

// ---- the configuration, decoded once by the host from the op's typed arguments -------------------------------------
// Thresholds are held in the accumulation type: the oracle compares acc-dtype tensors with Python floats, which
// torch rounds to the tensor's dtype, so the bounds are rounded the same way.
template <typename acc_t>
struct Config {
  int is_level;  // is_level::*
  bool is_mask;  // IcePop (weights outside [is_lower, is_upper] -> 0) instead of TIS (min(w, is_upper))
  acc_t is_lower, is_upper, is_metric_lower, log_is_upper, log_is_metric_lower;
  bool veto_on;
  acc_t veto_log;  // log V
  bool exclude_nonfinite;
  int num_rs;
  int crit_level[kMaxCriteria];  // rs_level::*
  int crit_stat[kMaxCriteria];   // rs_stat::*
  acc_t crit_lower[kMaxCriteria];
  acc_t crit_upper[kMaxCriteria];
  bool crit_apply_lower[kMaxCriteria];
  // The token-level criteria in order (at most one per statistic), as indices into crit_*.
  int num_token_crit;
  int token_crit[kMaxTokenCriteria];
  // verl's masked_mean divides by count + 1e-8 with the count in the mask's dtype (bool / int: int64 + 1e-8 ->
  // torch's default dtype): an fp64 count keeps the 1e-8, any other loses it to rounding (count >= 1). k_eps or 0.
  acc_t count_eps;
};

}  // namespace rc

// Kernel parameters of both passes. Inputs are dtype-tagged strided views (any float dtype for the log-probs, any
// mask dtype, no conversion copy); outputs are contiguous. Two layouts: padded ([rows, cols] views, sequence b in
// row b) and packed (megatron's THD layout: 1-D views of `cols` tokens, sequence b in columns [offsets[b],
// offsets[b + 1]) of row 0, `row_offsets` = cu_seqlens).
template <typename acc_t>
struct RolloutParams {
  TokenView log_prob;
  TokenView rollout_log_prob;
  TokenView mask;
  const int64_t* row_offsets;  // packed: [rows + 1] cu_seqlens (int64); nullptr: padded
  acc_t* seq_stats;     // [rows, rc::seq::kCols]: written by pass 1, read by pass 2
  acc_t* weights;       // padded [rows, cols] / packed [cols], or nullptr (no IS level)
  MutableTokenView mask_out;  // the mask's layout and dtype
  double* block_sums;   // CUDA: [grid, num_sums] scratch, zero-filled by the launcher
  double* block_maxes;  // CUDA: [grid, num_maxes] scratch, -inf-filled by the launcher
  int64_t rows;
  int64_t cols;
  int64_t num_sums;
  int64_t num_maxes;
  bool row_partials;    // add the per-sequence (ROW) terms: false on all but one rank of a context-parallel group
  rc::Config<acc_t> cfg;
};

// Where sequence b lies in the views (token_view.h: padded row b, or a packed segment of row 0).
template <typename acc_t>
RC_HD RC_FORCEINLINE SeqSpan seq_span(const RolloutParams<acc_t>& p, int64_t b) {
  return seq_span(p.row_offsets, p.cols, b);
}
// Index of (row, col) in the contiguous weights output (padded [rows, cols]; packed [cols], row 0).
template <typename acc_t>
RC_HD RC_FORCEINLINE int64_t weight_index(const RolloutParams<acc_t>& p, const SeqSpan& s, int64_t t) {
  return s.row * p.cols + s.col0 + t;
}

struct RolloutReduceParams {
  const double* block_sums;
  const double* block_maxes;
  int64_t blocks;
  int64_t num_sums;
  int64_t num_maxes;
  double* sums;
  double* maxes;
};

}  // namespace rollout_corr
