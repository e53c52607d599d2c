// Host side of the log-prob ops shared by the CPU and CUDA backends and the CUDA emulator's bindings:
// boundary checks with named messages, and the builders of the torch-free kernel parameter blocks.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "logprob_params.h"

namespace rollout_corr {

inline bool is_supported_logits_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline at::ScalarType acc_dtype_for(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline int64_t valid_cols_of(int64_t vocab_start, int64_t vocab_size, int64_t local_vocab) {
  return std::max<int64_t>(0, std::min<int64_t>(local_vocab, vocab_size - vocab_start));
}

inline void check_logits_target(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature) {
  TORCH_CHECK(logits.dim() == 2, "logits must be 2-D [rows, local_vocab], got ", logits.sizes());
  TORCH_CHECK(is_supported_logits_dtype(logits.scalar_type()),
              "logits must be float16, bfloat16, float32 or float64, got ", logits.scalar_type());
  TORCH_CHECK(logits.stride(1) == 1, "logits must be contiguous along the vocab dimension");
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64, got ", target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "target must have shape [",
              logits.size(0), "] (one id per logits row), got ", target.sizes());
  TORCH_CHECK(target.device() == logits.device(), "target is on ", target.device(), " but logits is on ",
              logits.device());
  TORCH_CHECK(vocab_start >= 0, "vocab_start must be >= 0, got ", vocab_start);
  TORCH_CHECK(vocab_size > 0, "vocab_size must be > 0, got ", vocab_size);
  TORCH_CHECK(inv_temperature > 0, "inv_temperature must be > 0, got ", inv_temperature);
}

inline void check_stats(const at::Tensor& stats, const at::Tensor& target) {
  TORCH_CHECK(stats.dim() == 3 && (stats.size(2) == 4 || stats.size(2) == 5),
              "stats must be [shards, rows, 4|5], got ", stats.sizes());
  TORCH_CHECK(stats.scalar_type() == at::kFloat || stats.scalar_type() == at::kDouble,
              "stats must be float32 or float64, got ", stats.scalar_type());
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == stats.size(1),
              "target must be int64 of shape [", stats.size(1), "], got ", target.scalar_type(), " ",
              target.sizes());
  TORCH_CHECK(target.device() == stats.device(), "target is on ", target.device(), " but stats is on ",
              stats.device());
}

inline void check_row_state(const at::Tensor& row_state, const at::Tensor& logits) {
  TORCH_CHECK(row_state.dim() == 2 && row_state.size(0) == logits.size(0) && row_state.size(1) == 2,
              "row_state must be [", logits.size(0), ", 2], got ", row_state.sizes());
  TORCH_CHECK(row_state.device() == logits.device(), "row_state is on ", row_state.device(),
              " but logits is on ", logits.device());
}

// Per-row upstream gradient as a contiguous tensor of the accumulation dtype (autograd may hand us an
// expanded, stride-0 view), or an undefined tensor when absent.
inline at::Tensor prepare_row_grad(const c10::optional<at::Tensor>& g, const at::Tensor& logits,
                                   const char* name) {
  if (!g.has_value() || !g->defined()) return at::Tensor();
  TORCH_CHECK(g->numel() == logits.size(0), name, " must have one value per logits row (", logits.size(0),
              "), got shape ", g->sizes());
  TORCH_CHECK(g->device() == logits.device(), name, " is on ", g->device(), " but logits is on ",
              logits.device());
  return g->reshape({-1}).to(acc_dtype_for(logits.scalar_type())).contiguous();
}

template <typename acc_t>
inline const acc_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<acc_t>() : nullptr;
}

// Parameter blocks. `target` must be contiguous int64; `stats`, `state` and the row grads are contiguous in the
// accumulation type (see prepare_row_grad).
template <typename scalar_t, typename acc_t>
RowStatsParams<scalar_t, acc_t> make_row_stats_params(const at::Tensor& logits, const at::Tensor& target,
                                                      const at::Tensor& stats, int64_t vocab_start,
                                                      int64_t vocab_size, double inv_temperature,
                                                      int64_t ignore_index) {
  RowStatsParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.target = target.const_data_ptr<int64_t>();
  p.stats = stats.mutable_data_ptr<acc_t>();
  p.rows = logits.size(0);
  p.local_vocab = logits.size(1);
  p.logits_row_stride = logits.stride(0);
  p.valid_cols = valid_cols_of(vocab_start, vocab_size, logits.size(1));
  p.vocab_start = vocab_start;
  p.ignore_index = ignore_index;
  p.stats_cols = static_cast<int>(stats.size(1));
  p.inv_temperature = static_cast<acc_t>(inv_temperature);
  return p;
}

template <typename acc_t>
MergeParams<acc_t> make_merge_params(const at::Tensor& stats, const at::Tensor& target, const at::Tensor& logp,
                                     const at::Tensor& entropy, const at::Tensor& mean_logp,
                                     const at::Tensor& row_state, int64_t ignore_index, int64_t vocab_size) {
  MergeParams<acc_t> p;
  p.stats = stats.const_data_ptr<acc_t>();
  p.target = target.const_data_ptr<int64_t>();
  p.logp = logp.mutable_data_ptr<acc_t>();
  p.entropy = entropy.mutable_data_ptr<acc_t>();
  p.mean_logp = mean_logp.mutable_data_ptr<acc_t>();
  p.row_state = row_state.mutable_data_ptr<acc_t>();
  p.rows = stats.size(1);
  p.shards = stats.size(0);
  p.vocab_size = vocab_size;
  p.ignore_index = ignore_index;
  p.stats_cols = static_cast<int>(stats.size(2));
  return p;
}

template <typename scalar_t, typename acc_t>
LogprobBackwardParams<scalar_t, acc_t> make_backward_params(const at::Tensor& grad_logits, const at::Tensor& logits,
                                                            const at::Tensor& target, const at::Tensor& state,
                                                            const at::Tensor& g_lp, const at::Tensor& g_h,
                                                            const at::Tensor& g_m, int64_t vocab_start,
                                                            int64_t vocab_size, double inv_temperature,
                                                            int64_t ignore_index) {
  LogprobBackwardParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.grad_logits = grad_logits.mutable_data_ptr<scalar_t>();
  p.target = target.const_data_ptr<int64_t>();
  p.row_state = state.const_data_ptr<acc_t>();
  p.grad_logp = ptr_or_null<acc_t>(g_lp);
  p.grad_entropy = ptr_or_null<acc_t>(g_h);
  p.grad_mean_logp = ptr_or_null<acc_t>(g_m);
  p.rows = logits.size(0);
  p.local_vocab = logits.size(1);
  p.logits_row_stride = logits.stride(0);
  p.grad_row_stride = grad_logits.stride(0);
  p.valid_cols = valid_cols_of(vocab_start, vocab_size, logits.size(1));
  p.vocab_start = vocab_start;
  p.vocab_size = vocab_size;
  p.ignore_index = ignore_index;
  p.inv_temperature = static_cast<acc_t>(inv_temperature);
  return p;
}

// Everything the backward of either backend needs, checked and converted once.
struct BackwardInputs {
  at::Tensor target, state, g_lp, g_h, g_m;
};

inline BackwardInputs prepare_backward(const c10::optional<at::Tensor>& grad_logp,
                                       const c10::optional<at::Tensor>& grad_entropy,
                                       const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                       int64_t vocab_size, double inv_temperature) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  check_row_state(row_state, logits);
  BackwardInputs in;
  in.target = target.contiguous();
  in.state = row_state.to(acc_dtype_for(logits.scalar_type())).contiguous();
  in.g_lp = prepare_row_grad(grad_logp, logits, "grad_logp");
  in.g_h = prepare_row_grad(grad_entropy, logits, "grad_entropy");
  in.g_m = prepare_row_grad(grad_mean_logp, logits, "grad_mean_logp");
  return in;
}

// The merge's checked, contiguous inputs and its four freshly allocated outputs.
struct MergeIO {
  at::Tensor stats, target, logp, entropy, mean_logp, row_state;
};

inline MergeIO prepare_merge(const at::Tensor& stats, const at::Tensor& target, int64_t vocab_size) {
  check_stats(stats, target);
  TORCH_CHECK(vocab_size > 0, "vocab_size must be > 0, got ", vocab_size);
  const int64_t rows = stats.size(1);
  return {stats.contiguous(),
          target.contiguous(),
          at::empty({rows}, stats.options()),
          at::empty({rows}, stats.options()),
          at::empty({rows}, stats.options()),
          at::empty({rows, 2}, stats.options())};
}

inline at::Tensor new_row_stats(const at::Tensor& logits, bool with_sum_z) {
  return at::empty({logits.size(0), with_sum_z ? 5 : 4}, logits.options().dtype(acc_dtype_for(logits.scalar_type())));
}

}  // namespace rollout_corr
