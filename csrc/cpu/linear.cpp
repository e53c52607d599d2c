// The fused linear log-probs' GEMM (rollout_corr_ext/linear.py): out[M, N] (fp32) = a[M, K] @ b[K, N] + beta * out
// for bf16 / fp16 a and b, every product accumulated in fp32 and never rounded to 16 bits. torch's CPU matmul of
// 16-bit inputs rounds its result to the inputs' dtype (and its out_dtype= overloads are CUDA-only), which would
// put a bf16 rounding (up to half a unit in the last place of the logit, 0.03 at |z| ~ 8) into every log-prob of
// the chunked path; verl's fused path keeps its chunk logits in fp32 for the same reason.
//
// The call is MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32 (16-bit inputs, fp32 output), which the torch
// wheels ship inside libtorch_cpu. It is declared weak: a torch build without MKL resolves it to null, and the op
// then widens its inputs to fp32 and runs the fp32 GEMM (same values, more memory).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

extern "C" {
// MKL's LP64 interface (torch links MKL's LP64 libraries): MKL_INT = int; MKL_BF16 / MKL_F16 = unsigned short.
// Layout 101 = CblasRowMajor; transposes 111 = CblasNoTrans, 112 = CblasTrans.
__attribute__((weak)) void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k,
                                                  float alpha, const uint16_t* a, int lda, const uint16_t* b,
                                                  int ldb, float beta, float* c, int ldc);
__attribute__((weak)) void cblas_gemm_f16f16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                                const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                                                float* c, int ldc);
}

namespace rollout_corr {
namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// (transpose code, leading dimension) of a 2-D operand as a row-major BLAS matrix, or (0, 0) if neither of its
// strides is 1 with a usable leading dimension (the caller then passes a contiguous copy).
std::pair<int, int64_t> blas_view(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, cols)) return {kNoTrans, t.stride(0)};
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(1, rows)) return {kTrans, t.stride(1)};
  if (rows == 1 && t.stride(1) == 1) return {kNoTrans, std::max<int64_t>(1, cols)};
  if (cols == 1 && t.stride(0) == 1) return {kTrans, std::max<int64_t>(1, rows)};
  return {0, 0};
}

void mm_f32_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double beta) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2, "mm_f32_: a, b and out must be 2-D, got ", a.sizes(),
              ", ", b.sizes(), ", ", out.sizes());
  TORCH_CHECK(a.size(1) == b.size(0) && out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "mm_f32_: shapes do not multiply: a ", a.sizes(), " @ b ", b.sizes(), " into out ", out.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
              "mm_f32_: a and b must both be bfloat16 or both float16, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat, "mm_f32_: out must be float32, got ", out.scalar_type());
  TORCH_CHECK(out.stride(1) == 1 && out.stride(0) >= std::max<int64_t>(1, out.size(1)),
              "mm_f32_: out must have unit column stride, got strides ", out.strides());
  const int64_t m = out.size(0), n = out.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0) out.zero_(); else out.mul_(beta);
    return;
  }
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  auto gemm = bf16 ? cblas_gemm_bf16bf16f32 : cblas_gemm_f16f16f32;  // null without MKL (weak symbols)
  constexpr int64_t kIntMax = 2147483647;
  const bool fits = m <= kIntMax && n <= kIntMax && k <= kIntMax && out.stride(0) <= kIntMax;
  if (gemm == nullptr || !fits) {  // no MKL in this torch build: the fp32 GEMM of the widened inputs
    at::Tensor prod = at::mm(a.to(at::kFloat), b.to(at::kFloat));
    if (beta == 0.0) out.copy_(prod); else out.mul_(beta).add_(prod);
    return;
  }
  at::Tensor ac = a, bc = b;
  auto va = blas_view(ac), vb = blas_view(bc);
  if (va.first == 0 || va.second > kIntMax) { ac = a.contiguous(); va = {kNoTrans, std::max<int64_t>(1, k)}; }
  if (vb.first == 0 || vb.second > kIntMax) { bc = b.contiguous(); vb = {kNoTrans, std::max<int64_t>(1, n)}; }
  gemm(kRowMajor, va.first, vb.first, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f,
          reinterpret_cast<const uint16_t*>(ac.data_ptr()), static_cast<int>(va.second),
          reinterpret_cast<const uint16_t*>(bc.data_ptr()), static_cast<int>(vb.second), static_cast<float>(beta),
          out.data_ptr<float>(), static_cast<int>(out.stride(0)));
}

}  // namespace

// Declared in ops.cpp (its schema is there).
bool mm_f32_uses_mkl() { return cblas_gemm_bf16bf16f32 != nullptr && cblas_gemm_f16f16f32 != nullptr; }

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) { m.impl("mm_f32_", &mm_f32_cpu); }

}  // namespace rollout_corr
