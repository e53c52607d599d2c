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

inline MutableTokenView mutable_token_view(at::Tensor& t) {
  if (t.dim() == 1) return MutableTokenView{t.mutable_data_ptr(), 0, t.stride(0), view_dtype_of(t.scalar_type())};
  return MutableTokenView{t.mutable_data_ptr(), t.stride(0), t.stride(1), view_dtype_of(t.scalar_type())};
}

}  // namespace rollout_corr
