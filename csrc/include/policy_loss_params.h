// Torch-free parameter blocks of the fused policy-loss kernels (docs/megatron.md, "Loss modes"): raw pointers, sizes
// and element
// strides only, so the kernels compile without ATen (and therefore also under the CUDA emulator).
//
// Only log_prob (the differentiable input, and the one most often in bf16) gets a compile-time element type.
// The other inputs are read through the dtype-tagged strided views of token_view.h.
#pragma once

#include <cstdint>

#include "token_view.h"

namespace rollout_corr {

// loss_kind of policy_loss_rows and the columns of the per-row partials, generated from their one declaration,
// policy_loss_layout.def (also read by rollout_corr_ext/_layout.py: PG_KIND_*, PG_ROW_*).
enum PolicyLossKind : int32_t {
#define RC_PG_KIND(name, code) kPolicyLoss##name = code,
#include "policy_loss_layout.def"
};
enum PolicyRowColumn : int32_t {
#define RC_PG_ROW(name) kPgRow##name,
#include "policy_loss_layout.def"
  kPgRowCols
};
#define RC_PG_CONST(name, value) constexpr double k##name = value;
#include "policy_loss_layout.def"

// The scalar configuration, held in the accumulation type: the fallback compares acc-dtype tensors with
// Python floats, which torch rounds to the tensor's dtype, so the bounds are rounded the same way.
template <typename acc_t>
struct PolicyLossConfig {
  acc_t ratio_lower;  // 1 - clip_low
  acc_t ratio_upper;  // 1 + clip_high
  acc_t eps_low;      // clip_low itself (DPPO's divergence bounds, GMPO's log-ratio clamp)
  acc_t eps_high;     // clip_high itself
  acc_t clip_c;       // dual-clip bound (may be +inf: no dual clip); DPPO's truncation cap
  acc_t param_a;      // SAPO tau_pos, DRO beta (policy_loss_layout.def); 0 for the other kinds
  acc_t param_b;      // SAPO tau_neg
  int32_t kind;       // PolicyLossKind
};

template <typename scalar_t, typename acc_t>
struct PolicyLossParams {
  const scalar_t* log_prob;  // [rows, cols] with strides lp_row_stride, lp_col_stride
  TokenView old_log_prob;
  TokenView advantages;
  TokenView mask;
  TokenView weights;  // data == nullptr: no rollout IS weights
  acc_t* loss_mat;    // [rows, cols] contiguous; nullptr: not wanted (the row partials only)
  acc_t* row_partials;  // [rows, kPgRowCols] contiguous (one row per sequence)
  const int64_t* row_offsets;  // packed (1-D views, THD): [rows + 1] cu_seqlens; nullptr: padded [rows, cols]
  int32_t* undefined;   // set to 1 when a response token's loss is undefined (policy_loss_undefined)
  int64_t rows;
  int64_t cols;
  int64_t lp_row_stride;
  int64_t lp_col_stride;
  PolicyLossConfig<acc_t> cfg;
};

template <typename scalar_t, typename acc_t>
struct PolicyLossBackwardParams {
  const scalar_t* log_prob;
  TokenView old_log_prob;
  TokenView advantages;
  TokenView mask;
  TokenView weights;
  TokenView grad_loss_mat;   // [rows, cols] or absent
  TokenView grad_rows_loss;  // [rows] (col_stride 0) or absent
  scalar_t* grad_log_prob;   // log_prob's layout, contiguous
  const int64_t* row_offsets;  // as in PolicyLossParams
  int64_t rows;
  int64_t cols;
  int64_t lp_row_stride;
  int64_t lp_col_stride;
  PolicyLossConfig<acc_t> cfg;
};

}  // namespace rollout_corr
