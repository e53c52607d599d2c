// Dtype-tagged strided views of [rows, cols] token tensors, shared by the kernel families that read per-token
// inputs (policy loss, rollout correction) on the CPU, the GPU and the CUDA emulator. Torch-free.
//
// Inputs come in whatever dtype the caller has (fp32 advantages next to bf16 log-probs, bool or float masks,
// advantages expanded from [B] with a zero column stride), so kernels read them through a view that carries the
// element type as a runtime tag: no conversion copy, no materialised expansion, and one kernel instantiation per
// accumulation type instead of one per dtype combination. The switch on the tag is uniform across a launch (a
// warp never diverges on it); the CPU kernels load whole chunks per switch (view_load_chunk).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "rc_macros.h"

namespace rollout_corr {

enum class ViewDtype : int32_t {
  kFloat32 = 0,
  kFloat64,
  kFloat16,
  kBFloat16,
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
};

// A read-only [rows, cols] (or [rows], col_stride = 0) view of any supported dtype, in element strides.
struct TokenView {
  const void* data;  // nullptr: the input is absent (optional weights / upstream gradients)
  int64_t row_stride;
  int64_t col_stride;
  ViewDtype dtype;
};

// A writable [rows, cols] view (an output in the caller's dtype, e.g. the rejection-sampled mask).
struct MutableTokenView {
  void* data;
  int64_t row_stride;
  int64_t col_stride;
  ViewDtype dtype;
};

// Where sequence b lies in [rows, cols] views. Padded batches: row b, columns [0, cols). Packed batches (megatron's
// THD layout, `offsets` = cu_seqlens as int64): row 0 of 1-D views, columns [offsets[b], offsets[b + 1]), clamped
// into [0, cols] and made non-decreasing, so a malformed cu_seqlens (rejected by the host checks, asynchronously
// on CUDA) can never send a kernel out of bounds.
struct SeqSpan {
  int64_t row, col0, len;
};
RC_HD RC_FORCEINLINE SeqSpan seq_span(const int64_t* offsets, int64_t cols, int64_t b) {
  if (offsets == nullptr) return {b, 0, cols};
  int64_t s = RC_LDG(offsets + b), e = RC_LDG(offsets + b + 1);
  s = s < 0 ? 0 : (s > cols ? cols : s);
  e = e < s ? s : (e > cols ? cols : e);
  return {0, s, e - s};
}

// Apply `f(typed pointer)` to the view's data cast to its element type.
template <typename F>
RC_HD RC_FORCEINLINE auto view_visit(ViewDtype dtype, const void* data, F&& f) {
  switch (dtype) {
    case ViewDtype::kFloat64: return f(static_cast<const double*>(data));
    case ViewDtype::kFloat16: return f(static_cast<const c10::Half*>(data));
    case ViewDtype::kBFloat16: return f(static_cast<const c10::BFloat16*>(data));
    case ViewDtype::kBool: return f(static_cast<const bool*>(data));
    case ViewDtype::kUInt8: return f(static_cast<const uint8_t*>(data));
    case ViewDtype::kInt8: return f(static_cast<const int8_t*>(data));
    case ViewDtype::kInt16: return f(static_cast<const int16_t*>(data));
    case ViewDtype::kInt32: return f(static_cast<const int32_t*>(data));
    case ViewDtype::kInt64: return f(static_cast<const int64_t*>(data));
    case ViewDtype::kFloat32:
    default: return f(static_cast<const float*>(data));
  }
}

template <typename acc_t, typename T>
RC_HD RC_FORCEINLINE acc_t element_to(T v) {
  return static_cast<acc_t>(v);
}
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t element_to(c10::Half v) {
  return static_cast<acc_t>(static_cast<float>(v));
}
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t element_to(c10::BFloat16 v) {
  return static_cast<acc_t>(static_cast<float>(v));
}
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t element_to(bool v) {
  return static_cast<acc_t>(static_cast<uint8_t>(v));  // a bool is 0 or 1: a plain (vectorizable) conversion
}

// A direct pointer to n consecutive acc_t elements of one row when the view holds acc_t with unit column stride
// (the CPU kernels then read the input in place instead of converting a copy), else nullptr.
template <typename acc_t>
RC_FORCEINLINE const acc_t* view_row_ptr(const TokenView& v, int64_t row, int64_t col0) {
  constexpr ViewDtype kSame = sizeof(acc_t) == 8 ? ViewDtype::kFloat64 : ViewDtype::kFloat32;
  if (v.dtype != kSame || v.col_stride != 1) return nullptr;
  return static_cast<const acc_t*>(v.data) + row * v.row_stride + col0;
}

// Element (row, col) of a view, converted to acc_t (bool/integer masks become 0/1/... like Tensor.to(float)).
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t view_load(const TokenView& v, int64_t row, int64_t col) {
  const int64_t i = row * v.row_stride + col * v.col_stride;
  return view_visit(v.dtype, v.data, [&](auto* p) { return element_to<acc_t>(RC_LDG(p + i)); });
}

// An absent optional input reads as `absent` (1 for weights, 0 for upstream gradients).
template <typename acc_t>
RC_HD RC_FORCEINLINE acc_t view_load_or(const TokenView& v, int64_t row, int64_t col, acc_t absent) {
  return v.data == nullptr ? absent : view_load<acc_t>(v, row, col);
}

// Store `value` (a small integer-valued number: mask values 0 / 1) at (row, col) in the view's dtype.
template <typename acc_t>
RC_HD RC_FORCEINLINE void view_store(const MutableTokenView& v, int64_t row, int64_t col, acc_t value) {
  const int64_t i = row * v.row_stride + col * v.col_stride;
  switch (v.dtype) {
    case ViewDtype::kFloat64: RC_STG(static_cast<double*>(v.data) + i, static_cast<double>(value)); break;
    case ViewDtype::kFloat16:
      RC_STG(static_cast<c10::Half*>(v.data) + i, c10::Half(static_cast<float>(value)));
      break;
    case ViewDtype::kBFloat16:
      RC_STG(static_cast<c10::BFloat16*>(v.data) + i, c10::BFloat16(static_cast<float>(value)));
      break;
    case ViewDtype::kBool: RC_STG(static_cast<bool*>(v.data) + i, value != acc_t(0)); break;
    case ViewDtype::kUInt8: RC_STG(static_cast<uint8_t*>(v.data) + i, static_cast<uint8_t>(value)); break;
    case ViewDtype::kInt8: RC_STG(static_cast<int8_t*>(v.data) + i, static_cast<int8_t>(value)); break;
    case ViewDtype::kInt16: RC_STG(static_cast<int16_t*>(v.data) + i, static_cast<int16_t>(value)); break;
    case ViewDtype::kInt32: RC_STG(static_cast<int32_t*>(v.data) + i, static_cast<int32_t>(value)); break;
    case ViewDtype::kInt64: RC_STG(static_cast<int64_t*>(v.data) + i, static_cast<int64_t>(value)); break;
    case ViewDtype::kFloat32:
    default: RC_STG(static_cast<float*>(v.data) + i, static_cast<float>(value)); break;
  }
}

// CPU: n <= N consecutive elements of one row (from column col0) converted to acc_t, one switch per chunk. A full
// chunk (n == N, the common case) runs a fixed-trip unit-stride loop the compiler vectorizes; always inlined, so it
// is compiled for the caller's ISA clone.
template <int N, typename acc_t>
RC_FORCEINLINE void view_load_chunk(const TokenView& v, int64_t row, int64_t col0, int n, acc_t* __restrict__ out) {
  view_visit(v.dtype, v.data, [&](auto* p) RC_FORCEINLINE_LAMBDA {
    const auto* __restrict__ base = p + row * v.row_stride + col0 * v.col_stride;
    if (v.col_stride == 1 && n == N) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
      if constexpr (std::is_same_v<T, bool>) {  // a bool holds 0 or 1: read its byte (GCC vectorizes uint8 loads)
        const uint8_t* __restrict__ bytes = reinterpret_cast<const uint8_t*>(base);
        for (int k = 0; k < N; ++k) out[k] = static_cast<acc_t>(bytes[k]);
        return 0;
      }
      for (int k = 0; k < N; ++k) out[k] = element_to<acc_t>(base[k]);
    } else {
      for (int k = 0; k < n; ++k) out[k] = element_to<acc_t>(base[k * v.col_stride]);
    }
    return 0;
  });
}

// CPU: store n <= N values (0 / 1) into one row of a writable view, one switch per chunk.
template <int N, typename acc_t>
RC_FORCEINLINE void view_store_chunk(const MutableTokenView& v, int64_t row, int64_t col0, int n,
                                     const acc_t* __restrict__ values) {
  view_visit(v.dtype, v.data, [&](const auto* p) RC_FORCEINLINE_LAMBDA {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    T* __restrict__ base = const_cast<T*>(p) + row * v.row_stride + col0 * v.col_stride;
    auto convert = [](acc_t x) RC_FORCEINLINE_LAMBDA {
      if constexpr (std::is_same_v<T, bool>) {
        return x != acc_t(0);
      } else {
        return static_cast<T>(static_cast<float>(x));
      }
    };
    if (v.col_stride == 1 && n == N) {
      if constexpr (std::is_same_v<T, bool>) {
        uint8_t* __restrict__ bytes = reinterpret_cast<uint8_t*>(base);
        for (int k = 0; k < N; ++k) bytes[k] = static_cast<uint8_t>(values[k] != acc_t(0));
        return 0;
      }
      for (int k = 0; k < N; ++k) base[k] = convert(values[k]);
    } else {
      for (int k = 0; k < n; ++k) base[k * v.col_stride] = convert(values[k]);
    }
    return 0;
  });
}

}  // namespace rollout_corr
