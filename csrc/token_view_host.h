// Host side of the dtype-tagged token views (token_view.h): views of ATen tensors, strides as they are (no copy).
#pragma once

#include <ATen/ATen.h>

#include "token_view.h"

namespace rollout_corr {

inline ViewDtype view_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ViewDtype::kFloat32;
    case at::kDouble: return ViewDtype::kFloat64;
    case at::kHalf: return ViewDtype::kFloat16;
    case at::kBFloat16: return ViewDtype::kBFloat16;
    case at::kBool: return ViewDtype::kBool;
    case at::kByte: return ViewDtype::kUInt8;
    case at::kChar: return ViewDtype::kInt8;
    case at::kShort: return ViewDtype::kInt16;
    case at::kInt: return ViewDtype::kInt32;
    case at::kLong: return ViewDtype::kInt64;
    default: TORCH_CHECK(false, "no TokenView for dtype ", t);
  }
}

// A [rows, cols] view of a tensor of the same shape as log_prob, strides as they are (no copy). A 1-D tensor (a
// packed token stream) is one row: row 0, its tokens along the columns.
inline TokenView token_view(const at::Tensor& t) {
  if (t.dim() == 1) return TokenView{t.const_data_ptr(), 0, t.stride(0), view_dtype_of(t.scalar_type())};
  return TokenView{t.const_data_ptr(), t.stride(0), t.stride(1), view_dtype_of(t.scalar_type())};
}
inline TokenView token_view_or_absent(const at::Tensor& t) {
  return t.defined() ? token_view(t) : TokenView{nullptr, 0, 0, ViewDtype::kFloat32};
}
// A [rows] view read at column 0 of every row.
inline TokenView row_view_or_absent(const at::Tensor& t) {
  return t.defined() ? TokenView{t.const_data_ptr(), t.stride(0), 0, view_dtype_of(t.scalar_type())}
                     : TokenView{nullptr, 0, 0, ViewDtype::kFloat32};
}

// The batch layout: padded (log_prob [B, T], no cu_seqlens) or packed (megatron's THD: log_prob [T] tokens,
// cu_seqlens [B + 1] int32/int64 with cu_seqlens[0] = 0, non-decreasing, cu_seqlens[B] = T). `offsets`: the int64
// cu_seqlens the kernels read (undefined when padded). Checked on the host for CPU tensors, by asynchronous device
// asserts on CUDA (the kernels clamp the spans, so a bad cu_seqlens can never make them read out of bounds).
struct SeqLayout {
  int64_t rows, cols;
  at::Tensor offsets;
};
inline SeqLayout seq_layout(const at::Tensor& log_prob, const c10::optional<at::Tensor>& cu_seqlens) {
  if (!cu_seqlens.has_value() || !cu_seqlens->defined()) {
    TORCH_CHECK(log_prob.dim() == 2, "log_prob must be 2-D [batch, response_length] without cu_seqlens, got shape ",
                log_prob.sizes(), " (a 1-D packed token stream needs cu_seqlens)");
    return {log_prob.size(0), log_prob.size(1), at::Tensor()};
  }
  const at::Tensor& cu = *cu_seqlens;
  TORCH_CHECK(log_prob.dim() == 1, "with cu_seqlens, log_prob must be the 1-D packed token stream [total_tokens], "
              "got shape ", log_prob.sizes());
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1, "cu_seqlens must be 1-D [num_sequences + 1], got shape ", cu.sizes());
  TORCH_CHECK(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, "cu_seqlens must be int32 or int64, got ",
              cu.scalar_type());
  TORCH_CHECK(cu.device() == log_prob.device(), "cu_seqlens is on ", cu.device(), " but log_prob is on ",
              log_prob.device());
  const int64_t total = log_prob.size(0);
  at::Tensor off = cu.to(at::kLong).contiguous();
  const char* what = "cu_seqlens must start at 0, never decrease and end at the number of packed tokens";
  if (off.is_cpu()) {
    const int64_t* o = off.const_data_ptr<int64_t>();
    const int64_t n = off.numel();
    TORCH_CHECK_VALUE(o[0] == 0 && o[n - 1] == total, what, " (", total, "): got cu_seqlens[0] = ", o[0],
                      ", cu_seqlens[-1] = ", o[n - 1]);
    for (int64_t i = 1; i < n; ++i)
      TORCH_CHECK_VALUE(o[i] >= o[i - 1], what, ": cu_seqlens[", i, "] = ", o[i], " < cu_seqlens[", i - 1, "] = ",
                        o[i - 1]);
  } else {
    at::_assert_async((off[0] == 0).logical_and(off[-1] == total), what);
    if (off.numel() > 1) at::_assert_async((off.slice(0, 1) >= off.slice(0, 0, -1)).all(), what);
  }
  return {off.numel() - 1, total, off};
}

// Tokens of an average sequence (launch heuristics): padded rows, or the packed stream over the segments.
inline int64_t tokens_per_sequence(const SeqLayout& layout) {
  return layout.offsets.defined() ? layout.cols / (layout.rows > 0 ? layout.rows : 1) : layout.cols;
}

inline MutableTokenView mutable_token_view(at::Tensor& t) {
  if (t.dim() == 1) return MutableTokenView{t.mutable_data_ptr(), 0, t.stride(0), view_dtype_of(t.scalar_type())};
  return MutableTokenView{t.mutable_data_ptr(), t.stride(0), t.stride(1), view_dtype_of(t.scalar_type())};
}

}  // namespace rollout_corr
