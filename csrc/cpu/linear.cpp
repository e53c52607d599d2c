// The fused linear log-probs' GEMM (rollout_corr_ext/linear.py): out[M, N] (fp32) = a[M, K] @ b[K, N] + beta * out
// for bf16 / fp16 a and b, every product accumulated in fp32 and never rounded to 16 bits. torch's CPU matmul of
// 16-bit inputs rounds its result to the inputs' dtype (and its out_dtype= overloads are CUDA-only), which would
// put a bf16 rounding (up to half a unit in the last place of the logit, 0.03 at |z| ~ 8) into every log-prob of
// the chunked path; verl's fused path keeps its chunk logits in fp32 for the same reason.
//
// The call is MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32 (16-bit inputs, fp32 output), which the torch
// wheels ship inside libtorch_cpu. It is declared weak: a torch build without MKL resolves it to null, and the op
// then widens its inputs to fp32 and runs the fp32 GEMM (same values, more memory).
//
// MKL's working memory grows with the depth K of one call, and MKL keeps it in its own pool for the life of the
// process (measured on the development machine, an AMD EPYC: 50 MiB for one 2048 x 2048 x 2048 call at 2 threads,
// 32 MiB -- fp32 copies of both operands -- at 1 thread, 91 MiB at 8; 6 / 4 / 16 MiB with K = 256). So the call
// is cut along K into slices of kDepthSlice, each summed into out in fp32 (beta = 1 after the first): the same
// fp32 accumulation, and MKL's buffers of (M + N) x kDepthSlice instead of (M + N) x K.
//
// hilo_add_ is the fused path's 16-bit gradient accumulator (rollout_corr_ext/linear.py, docs/logprobs.md): a sum
// held as the pair hi (the gradient's own 16-bit dtype: the result) + lo (bf16, the residual hi leaves), about 17
// significant bits, in half the memory of an fp32 accumulator whose result would need a 16-bit copy besides.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>

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
// The depth of one MKL call (see the top of the file): a multiple of every GEMM kernel's depth block.
constexpr int64_t kDepthSlice = 256;

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
  const auto* pa = reinterpret_cast<const uint16_t*>(ac.data_ptr());
  const auto* pb = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  // Element offset of depth k0 in each operand: along a row of a (no-trans) or down its rows (trans); b the reverse.
  const int64_t a_step = va.first == kNoTrans ? 1 : va.second, b_step = vb.first == kNoTrans ? vb.second : 1;
  for (int64_t k0 = 0; k0 < k; k0 += kDepthSlice) {
    const int64_t kk = std::min(kDepthSlice, k - k0);
    gemm(kRowMajor, va.first, vb.first, static_cast<int>(m), static_cast<int>(n), static_cast<int>(kk), 1.0f,
         pa + k0 * a_step, static_cast<int>(va.second), pb + k0 * b_step, static_cast<int>(vb.second),
         k0 == 0 ? static_cast<float>(beta) : 1.0f, out.data_ptr<float>(), static_cast<int>(out.stride(0)));
  }
}

// x as fp32, whatever its dtype (bf16 / fp16 / fp32).
template <typename T>
inline float to_f32(T v) { return static_cast<float>(v); }

// One row: (hi, lo) += x, hi the nearest value of its dtype to the fp32 sum s = (hi + lo) + x, lo = bf16(s - hi).
// hi + lo is exact in fp32 (hi has 8 or 11 significant bits, |lo| <= half an ulp of hi and 8 bits: at most 20 bits
// in all), s - hi is exact (Sterbenz), so each call adds one fp32 rounding of s and one bf16 rounding of the
// residual: at most 2^-24 |s| + 2^-17 |s| (bf16 hi; fp16 hi: 2^-20 |s|, or 2^-34 where hi is subnormal). A hi
// that overflows its dtype (fp16 past 65504) keeps lo = 0, so the pair stays +-inf rather than turning NaN.
template <typename Hi, typename X>
inline void hilo_add_row(Hi* hi, c10::BFloat16* lo, const X* x, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    const float s = (static_cast<float>(hi[c]) + static_cast<float>(lo[c])) + to_f32(x[c]);
    const Hi h = static_cast<Hi>(s);
    const float hf = static_cast<float>(h);
    hi[c] = h;
    lo[c] = static_cast<c10::BFloat16>(std::isfinite(hf) ? s - hf : 0.0f);
  }
}

void hilo_add_cpu(at::Tensor& hi, at::Tensor& lo, const at::Tensor& x, const std::optional<at::Tensor>& index) {
  TORCH_CHECK(hi.dim() == 2 && lo.dim() == 2 && x.dim() == 2, "hilo_add_: hi, lo and x must be 2-D, got ",
              hi.sizes(), ", ", lo.sizes(), ", ", x.sizes());
  TORCH_CHECK(hi.sizes() == lo.sizes(), "hilo_add_: lo must have hi's shape ", hi.sizes(), ", got ", lo.sizes());
  TORCH_CHECK(hi.scalar_type() == at::kBFloat16 || hi.scalar_type() == at::kHalf,
              "hilo_add_: hi must be bfloat16 or float16, got ", hi.scalar_type());
  TORCH_CHECK(lo.scalar_type() == at::kBFloat16, "hilo_add_: lo must be bfloat16, got ", lo.scalar_type());
  TORCH_CHECK(x.scalar_type() == hi.scalar_type() || x.scalar_type() == at::kFloat,
              "hilo_add_: x must have hi's dtype or float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == hi.size(1), "hilo_add_: x must have hi's ", hi.size(1), " columns, got ", x.size(1));
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&hi, &lo, &x}) {
    TORCH_CHECK(t->size(1) <= 1 || t->stride(1) == 1, "hilo_add_: hi, lo and x must have unit column stride, got ",
                t->strides());
  }
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor idx;
  if (index.has_value()) {
    idx = index->contiguous();
    TORCH_CHECK(idx.dim() == 1 && idx.size(0) == rows && idx.scalar_type() == at::kLong,
                "hilo_add_: index must be an int64 [", rows, "] (x's rows), got ", idx.scalar_type(), " ",
                idx.sizes());
    if (rows > 0) {
      TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < hi.size(0),
                  "hilo_add_: index must lie in [0, ", hi.size(0), ")");
    }
  } else {
    TORCH_CHECK(rows == hi.size(0), "hilo_add_: x must have hi's ", hi.size(0), " rows, got ", rows);
  }
  if (rows == 0 || cols == 0) return;
  const int64_t* ip = idx.defined() ? idx.data_ptr<int64_t>() : nullptr;
  auto* lp = lo.data_ptr<c10::BFloat16>();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(hi.scalar_type(), "hilo_add_", [&] {
    auto* hp = hi.data_ptr<scalar_t>();
    auto run = [&](const auto* xp) {
      // Rows of hi / lo are distinct (index: the kept rows of a batch), so rows run in parallel.
      at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / cols), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t j = ip == nullptr ? r : ip[r];
          hilo_add_row(hp + j * hi.stride(0), lp + j * lo.stride(0), xp + r * x.stride(0), cols);
        }
      });
    };
    if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>()); else run(x.data_ptr<scalar_t>());
  });
}

}  // namespace

// Declared in ops.cpp (its schema is there).
bool mm_f32_uses_mkl() { return cblas_gemm_bf16bf16f32 != nullptr && cblas_gemm_f16f16f32 != nullptr; }

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("mm_f32_", &mm_f32_cpu);
  m.impl("hilo_add_", &hilo_add_cpu);
}

}  // namespace rollout_corr
