// Host side of the rollout-correction ops shared by the CPU and CUDA backends: boundary checks with named
// messages and the packed-parameter decoding (torch-free kernels take rc::Config by value).
#pragma once

#include <ATen/ATen.h>

#include "rollout_math.h"

namespace rollout_corr {

inline bool is_supported_logprob_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline bool is_supported_mask_dtype(at::ScalarType t) {
  return t == at::kBool || t == at::kByte || t == at::kChar || t == at::kShort || t == at::kInt || t == at::kLong ||
         t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

inline void check_rollout_inputs(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, at::ArrayRef<double> params) {
  TORCH_CHECK(log_prob.dim() == 2, "log_prob must be 2-D [batch, response_length], got ", log_prob.sizes());
  TORCH_CHECK(is_supported_logprob_dtype(log_prob.scalar_type()),
              "log_prob must be float16, bfloat16, float32 or float64, got ", log_prob.scalar_type());
  TORCH_CHECK(rollout_log_prob.scalar_type() == log_prob.scalar_type(), "rollout_log_prob must have log_prob's dtype ",
              log_prob.scalar_type(), ", got ", rollout_log_prob.scalar_type());
  TORCH_CHECK(rollout_log_prob.sizes() == log_prob.sizes(), "rollout_log_prob must have shape ", log_prob.sizes(),
              ", got ", rollout_log_prob.sizes());
  TORCH_CHECK(mask.sizes() == log_prob.sizes(), "mask must have shape ", log_prob.sizes(), ", got ", mask.sizes());
  TORCH_CHECK(is_supported_mask_dtype(mask.scalar_type()), "mask must be bool, integer or float, got ",
              mask.scalar_type());
  TORCH_CHECK(rollout_log_prob.device() == log_prob.device() && mask.device() == log_prob.device(),
              "log_prob, rollout_log_prob and mask must be on one device, got ", log_prob.device(), ", ",
              rollout_log_prob.device(), ", ", mask.device());
  TORCH_CHECK(params.size() >= static_cast<size_t>(rc::kPHeader), "params is too short: ", params.size());
  const int num_rs = static_cast<int>(params[rc::kPNumRs]);
  TORCH_CHECK(num_rs >= 0 && num_rs <= rc::kMaxCrit, "at most ", rc::kMaxCrit, " RS criteria, got ", num_rs);
  TORCH_CHECK(params.size() == static_cast<size_t>(rc::kPHeader + rc::kPCrit * num_rs), "params must hold ",
              rc::kPHeader + rc::kPCrit * num_rs, " values for ", num_rs, " criteria, got ", params.size());
}

inline void check_seq_stats(const at::Tensor& seq_stats, const at::Tensor& log_prob) {
  const auto acc = log_prob.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(seq_stats.dim() == 2 && seq_stats.size(0) == log_prob.size(0) && seq_stats.size(1) == rc::kSeqCols,
              "seq_stats must be [", log_prob.size(0), ", ", rc::kSeqCols, "], got ", seq_stats.sizes());
  TORCH_CHECK(seq_stats.scalar_type() == acc, "seq_stats must be ", acc, ", got ", seq_stats.scalar_type());
  TORCH_CHECK(seq_stats.device() == log_prob.device(), "seq_stats is on ", seq_stats.device(), " but log_prob is on ",
              log_prob.device());
}

// Dispatch over the mask dtypes (the output mask keeps the caller's dtype).
#define RC_DISPATCH_MASK_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

}  // namespace rollout_corr
