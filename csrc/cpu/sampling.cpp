// Sampling replay (docs/sampling_replay.md), CPU: the k largest values of every row, the candidates of the
// threshold search (rollout_corr_ext/sampling.py). One streaming read per row: a block of 64 values is skipped
// after one vectorised count of those above the running k-th largest; past the first blocks almost every block is
// (a row of i.i.d. values accepts about k ln(V / k) of them), so a row costs about one compare per value, against
// torch.topk's partial sort. And floor_fill: the logits with
// everything under each row's replayed threshold at -inf, one pass (the chunked floored log-probs' mask).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <vector>

#include "cpu/vec_math.h"

namespace rollout_corr {
namespace cpu {
namespace {

constexpr int64_t kTopkBlock = 64;

// Values of the block [x, x + kTopkBlock) strictly above thr: a compare-and-add loop the ISA copies vectorise (no
// branch, no float reduction). NaN compares false: it is never a candidate (the caller rejects NaN rows itself).
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE int count_above(const scalar_t* x, acc_t thr) {
  int c = 0;
  for (int64_t j = 0; j < kTopkBlock; ++j) c += static_cast<acc_t>(x[j]) > thr;
  return c;
}

// Rows [b, e) of values [rows, cols] (row stride ld) -> out [rows, k], each row descending, -inf after its values.
// Values above the running threshold (the k-th largest kept so far) are appended to a buffer, branch-free; when it
// is full, nth_element keeps its k largest and raises the threshold. A heap would pay a sift per accepted value;
// this pays one store, and a selection per buffer of 4k. The result is the multiset of the k largest (a value
// equal to the threshold is not appended: the buffer already holds k values at or above it).
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void topk_rows(const scalar_t* values, int64_t ld, int64_t cols, int64_t k, acc_t* out, int64_t b,
                              int64_t e) {
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  const int64_t cap = std::max<int64_t>(4 * k, 256);
  std::vector<acc_t> buf(static_cast<size_t>(cap + kTopkBlock));
  acc_t* bp = buf.data();
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* x = values + r * ld;
    acc_t thr = ninf;
    int64_t m = 0;
    auto shrink = [&]() RC_FORCEINLINE_LAMBDA {  // keep the k largest, the threshold their minimum
      if (m > k) {
        std::nth_element(bp, bp + (k - 1), bp + m, std::greater<acc_t>());
        m = k;
        thr = bp[k - 1];
      } else if (m == k) {
        thr = *std::min_element(bp, bp + k);
      }
    };
    int64_t j = 0;
    for (; j + kTopkBlock <= cols; j += kTopkBlock) {
      if (count_above<scalar_t, acc_t>(x + j, thr) == 0) continue;
      for (int64_t i = 0; i < kTopkBlock; ++i) {
        const acc_t v = static_cast<acc_t>(x[j + i]);
        bp[m] = v;
        m += v > thr;
      }
      if (m >= cap) shrink();
    }
    for (; j < cols; ++j) {
      const acc_t v = static_cast<acc_t>(x[j]);
      bp[m] = v;
      m += v > thr;
    }
    shrink();
    const int64_t got = std::min(m, k);
    std::sort(bp, bp + got, std::greater<acc_t>());
    std::copy(bp, bp + got, out + r * k);
    std::fill(out + r * k + got, out + (r + 1) * k, ninf);
  }
}

#if RC_CPU_HAS_AVX512_PATH
// AVX-512: 16 values per compare, and the ones above the threshold appended with one compress-store (no branch per
// value, no scalar pass over a block that holds a candidate). The all-lanes masked (maskz) conversions: GCC 12 warns
// about the undefined pass-through of the unmasked ones.
RC_CPU_AVX512_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
RC_CPU_AVX512_INLINE __m512 load16(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
}
RC_CPU_AVX512_INLINE __m512 load16(const at::Half* p) {
  return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename scalar_t>
RC_CPU_AVX512 void topk_rows_avx512_f32acc(const scalar_t* values, int64_t ld, int64_t cols, int64_t k, float* out,
                                           int64_t b, int64_t e) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t cap = std::max<int64_t>(4 * k, 256);
  std::vector<float> buf(static_cast<size_t>(cap + 16));
  float* bp = buf.data();
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* x = values + r * ld;
    float thr = ninf;
    int64_t m = 0;
    auto shrink = [&]() {
      if (m > k) {
        std::nth_element(bp, bp + (k - 1), bp + m, std::greater<float>());
        m = k;
        thr = bp[k - 1];
      } else if (m == k) {
        thr = *std::min_element(bp, bp + k);
      }
    };
    __m512 t = _mm512_set1_ps(thr);
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      const __m512 v = load16(x + j);
      const __mmask16 mk = _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ);  // NaN: false
      if (mk == 0) continue;
      _mm512_mask_compressstoreu_ps(bp + m, mk, v);
      m += __builtin_popcount(static_cast<unsigned>(mk));
      if (m >= cap) {
        shrink();
        t = _mm512_set1_ps(thr);
      }
    }
    for (; j < cols; ++j) {
      const float v = static_cast<float>(x[j]);
      bp[m] = v;
      m += v > thr;
    }
    shrink();
    const int64_t got = std::min(m, k);
    std::sort(bp, bp + got, std::greater<float>());
    std::copy(bp, bp + got, out + r * k);
    std::fill(out + r * k + got, out + (r + 1) * k, ninf);
  }
}
// fp64 values keep the generic loop (8 lanes; logits are rarely fp64)
RC_CPU_AVX512 void topk_rows_avx512_f32acc(const double* values, int64_t ld, int64_t cols, int64_t k, double* out,
                                           int64_t b, int64_t e) {
  topk_rows<double, double>(values, ld, cols, k, out, b, e);
}
#define RC_TOPK_AVX512(scalar_t, acc_t, v, ld, c, k, o, b, e) topk_rows_avx512_f32acc(v, ld, c, k, o, b, e)
#else
#define RC_TOPK_AVX512(scalar_t, acc_t, v, ld, c, k, o, b, e) topk_rows<scalar_t, acc_t>(v, ld, c, k, o, b, e)
#endif

#define RC_DEFINE_TOPK(scalar_t, acc_t, suffix)                                                                  \
  void topk_rows_##suffix(const scalar_t* v, int64_t ld, int64_t c, int64_t k, acc_t* o, int64_t b, int64_t e) { \
    topk_rows<scalar_t, acc_t>(v, ld, c, k, o, b, e);                                                            \
  }                                                                                                              \
  RC_CPU_AVX2 void topk_rows_##suffix##_avx2(const scalar_t* v, int64_t ld, int64_t c, int64_t k, acc_t* o,      \
                                             int64_t b, int64_t e) {                                             \
    topk_rows<scalar_t, acc_t>(v, ld, c, k, o, b, e);                                                            \
  }                                                                                                              \
  RC_CPU_AVX512 void topk_rows_##suffix##_avx512(const scalar_t* v, int64_t ld, int64_t c, int64_t k, acc_t* o,  \
                                                 int64_t b, int64_t e) {                                         \
    RC_TOPK_AVX512(scalar_t, acc_t, v, ld, c, k, o, b, e);                                                       \
  }                                                                                                              \
  void topk_dispatch(const scalar_t* v, int64_t ld, int64_t c, int64_t k, acc_t* o, int64_t b, int64_t e) {      \
    switch (cpu_isa()) {                                                                                         \
      case CpuIsa::kAvx512: return topk_rows_##suffix##_avx512(v, ld, c, k, o, b, e);                            \
      case CpuIsa::kAvx2: return topk_rows_##suffix##_avx2(v, ld, c, k, o, b, e);                                \
      default: return topk_rows_##suffix(v, ld, c, k, o, b, e);                                                  \
    }                                                                                                            \
  }
RC_DEFINE_TOPK(float, float, f32)
RC_DEFINE_TOPK(double, double, f64)
RC_DEFINE_TOPK(at::BFloat16, float, bf16)
RC_DEFINE_TOPK(at::Half, float, f16)
#undef RC_DEFINE_TOPK
#undef RC_TOPK_AVX512

at::Tensor row_topk_cpu(const at::Tensor& values, int64_t k) {
  TORCH_CHECK(values.dim() == 2, "row_topk: values must be 2-D [rows, cols], got ", values.dim(), "-D");
  TORCH_CHECK(k >= 1, "row_topk: k must be >= 1, got ", k);
  TORCH_CHECK(at::isFloatingType(values.scalar_type()), "row_topk: values must be a float tensor, got ",
              values.scalar_type());
  // Rows may be strided (a column slice of the logits); each row itself must be contiguous.
  const at::Tensor v = values.stride(1) == 1 || values.size(1) <= 1 ? values : values.contiguous();
  const auto acc = values.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({v.size(0), k}, v.options().dtype(acc));
  const int64_t rows = v.size(0), cols = v.size(1), ld = v.size(1) <= 1 ? std::max<int64_t>(1, cols) : v.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "row_topk_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* src = v.data_ptr<scalar_t>();
    acc_t* dst = out.data_ptr<acc_t>();
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { topk_dispatch(src, ld, cols, k, dst, b, e); });
  });
  return out;
}

// out[r, c] = x[r, c], or -inf where z = x / T (in acc_t; x itself when T == 1) is under floor[r]: the kept set
// {z >= floor} of sampling replay, one read and one write (out may be x).
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void floor_fill_rows(const scalar_t* x, int64_t ldx, const acc_t* floor, acc_t t, bool unit_t,
                                    scalar_t* out, int64_t ldo, int64_t cols, int64_t b, int64_t e) {
  const scalar_t ninf = static_cast<scalar_t>(-std::numeric_limits<acc_t>::infinity());
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* xr = x + r * ldx;
    scalar_t* o = out + r * ldo;
    const acc_t f = floor[r];
    if (unit_t) {
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<acc_t>(xr[c]) < f ? ninf : xr[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<acc_t>(xr[c]) / t < f ? ninf : xr[c];
    }
  }
}

// grad[r, c] = 0 where z = x / T (x the logits) is under floor[r]: the gradient of the kept set's softmax computed
// on the unmasked logits, with the columns outside the kept set zeroed (one read of x, a read and write of grad).
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void floor_zero_rows(scalar_t* grad, int64_t ldg, const scalar_t* x, int64_t ldx, const acc_t* floor,
                                    acc_t t, bool unit_t, int64_t cols, int64_t b, int64_t e) {
  const scalar_t zero = static_cast<scalar_t>(0);
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* xr = x + r * ldx;
    scalar_t* g = grad + r * ldg;
    const acc_t f = floor[r];
    if (unit_t) {
      for (int64_t c = 0; c < cols; ++c) g[c] = static_cast<acc_t>(xr[c]) < f ? zero : g[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) g[c] = static_cast<acc_t>(xr[c]) / t < f ? zero : g[c];
    }
  }
}

#define RC_DEFINE_FLOOR(scalar_t, acc_t, suffix)                                                                 \
  void floor_rows_##suffix(const scalar_t* x, int64_t lx, const acc_t* f, acc_t t, bool u, scalar_t* o,          \
                           int64_t lo, int64_t c, int64_t b, int64_t e) {                                        \
    floor_fill_rows<scalar_t, acc_t>(x, lx, f, t, u, o, lo, c, b, e);                                            \
  }                                                                                                              \
  RC_CPU_AVX2 void floor_rows_##suffix##_avx2(const scalar_t* x, int64_t lx, const acc_t* f, acc_t t, bool u,    \
                                              scalar_t* o, int64_t lo, int64_t c, int64_t b, int64_t e) {        \
    floor_fill_rows<scalar_t, acc_t>(x, lx, f, t, u, o, lo, c, b, e);                                            \
  }                                                                                                              \
  RC_CPU_AVX512 void floor_rows_##suffix##_avx512(const scalar_t* x, int64_t lx, const acc_t* f, acc_t t, bool u, \
                                                  scalar_t* o, int64_t lo, int64_t c, int64_t b, int64_t e) {    \
    floor_fill_rows<scalar_t, acc_t>(x, lx, f, t, u, o, lo, c, b, e);                                            \
  }                                                                                                              \
  void zero_rows_##suffix(scalar_t* g, int64_t lg, const scalar_t* x, int64_t lx, const acc_t* f, acc_t t, bool u, \
                          int64_t c, int64_t b, int64_t e) {                                                     \
    floor_zero_rows<scalar_t, acc_t>(g, lg, x, lx, f, t, u, c, b, e);                                            \
  }                                                                                                              \
  RC_CPU_AVX2 void zero_rows_##suffix##_avx2(scalar_t* g, int64_t lg, const scalar_t* x, int64_t lx,             \
                                             const acc_t* f, acc_t t, bool u, int64_t c, int64_t b, int64_t e) { \
    floor_zero_rows<scalar_t, acc_t>(g, lg, x, lx, f, t, u, c, b, e);                                            \
  }                                                                                                              \
  RC_CPU_AVX512 void zero_rows_##suffix##_avx512(scalar_t* g, int64_t lg, const scalar_t* x, int64_t lx,         \
                                                 const acc_t* f, acc_t t, bool u, int64_t c, int64_t b,          \
                                                 int64_t e) {                                                    \
    floor_zero_rows<scalar_t, acc_t>(g, lg, x, lx, f, t, u, c, b, e);                                            \
  }                                                                                                              \
  void zero_dispatch(scalar_t* g, int64_t lg, const scalar_t* x, int64_t lx, const acc_t* f, acc_t t, bool u,     \
                     int64_t c, int64_t b, int64_t e) {                                                          \
    switch (cpu_isa()) {                                                                                         \
      case CpuIsa::kAvx512: return zero_rows_##suffix##_avx512(g, lg, x, lx, f, t, u, c, b, e);                  \
      case CpuIsa::kAvx2: return zero_rows_##suffix##_avx2(g, lg, x, lx, f, t, u, c, b, e);                      \
      default: return zero_rows_##suffix(g, lg, x, lx, f, t, u, c, b, e);                                        \
    }                                                                                                            \
  }                                                                                                              \
  void floor_dispatch(const scalar_t* x, int64_t lx, const acc_t* f, acc_t t, bool u, scalar_t* o, int64_t lo,   \
                      int64_t c, int64_t b, int64_t e) {                                                         \
    switch (cpu_isa()) {                                                                                         \
      case CpuIsa::kAvx512: return floor_rows_##suffix##_avx512(x, lx, f, t, u, o, lo, c, b, e);                 \
      case CpuIsa::kAvx2: return floor_rows_##suffix##_avx2(x, lx, f, t, u, o, lo, c, b, e);                     \
      default: return floor_rows_##suffix(x, lx, f, t, u, o, lo, c, b, e);                                       \
    }                                                                                                            \
  }
RC_DEFINE_FLOOR(float, float, f32)
RC_DEFINE_FLOOR(double, double, f64)
RC_DEFINE_FLOOR(at::BFloat16, float, bf16)
RC_DEFINE_FLOOR(at::Half, float, f16)
#undef RC_DEFINE_FLOOR

void floor_fill_cpu(const at::Tensor& x, const at::Tensor& floor, double temperature, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.sizes() == out.sizes(), "floor_fill: x and out must be 2-D of one "
              "shape, got ", x.sizes(), " and ", out.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && out.scalar_type() == x.scalar_type(), "floor_fill: x and out "
              "must be float tensors of one dtype, got ", x.scalar_type(), " and ", out.scalar_type());
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == x.size(0) && floor.scalar_type() == acc, "floor_fill: floor must "
              "be [rows] in ", acc, ", got ", floor.sizes(), " ", floor.scalar_type());
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "floor_fill: temperature must be finite and > 0, got ",
              temperature);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  TORCH_CHECK(x.stride(1) == 1 || cols == 1, "floor_fill: each row of x must be contiguous");
  TORCH_CHECK(out.stride(1) == 1 || cols == 1, "floor_fill: each row of out must be contiguous");
  const auto f = floor.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "floor_fill_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const acc_t* fl = f.data_ptr<acc_t>();
    const acc_t t = static_cast<acc_t>(temperature);
    const bool unit = temperature == 1.0;
    const int64_t lx = x.stride(0), lo = out.stride(0);
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { floor_dispatch(src, lx, fl, t, unit, dst, lo, cols, b, e); });
  });
}

// The order-preserving integer key of a value (-0.0 as 0.0): sampling.py's _ordered_key.
RC_FORCEINLINE int64_t ordered_key(float z) {
  int32_t bits;
  const float v = z + 0.0f;
  std::memcpy(&bits, &v, sizeof bits);
  return bits < 0 ? static_cast<int64_t>(bits ^ 0x7FFFFFFF) : static_cast<int64_t>(bits);
}
RC_FORCEINLINE int64_t ordered_key(double z) {
  int64_t bits;
  const double v = z + 0.0;
  std::memcpy(&bits, &v, sizeof bits);
  return bits < 0 ? (bits ^ 0x7FFFFFFFFFFFFFFFLL) : bits;
}

// e^x for x in [-60, 0]: x = k ln2 + r (|r| <= ln2 / 2, ln2 split in two so k ln2 is exact), e^r by its Taylor
// series to r^13 (the next term is below 2^-57 of the sum), 2^k put into the exponent bits. Plain arithmetic (the
// roundings by the 1.5 * 2^52 trick, no libm call), so the ISA copies vectorise it; within 2 ulp of exp.
RC_FORCEINLINE double exp_nonpositive(double x) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: adding and subtracting it rounds to an integer
  const double kf = (x * 1.4426950408889634 + kMagic) - kMagic;
  const double r = (x - kf * 6.93147180369123816490e-01) - kf * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t bits = (static_cast<int64_t>(kf) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The top-p mass of a value rel = z - z_max <= 0: round(e^rel * 2^40) as an integer (sampling.py's masses; their sums
// do not depend on the order or the sharding); 0 below e^-60 (it would round to 0 anyway).
RC_FORCEINLINE double top_p_mass(double rel) {
  constexpr double kMagic = 6755399441055744.0;
  const double x = rel < -60.0 ? -60.0 : rel;
  const double v = exp_nonpositive(x) * 1099511627776.0;  // 2^40
  return rel < -60.0 ? 0.0 : (v + kMagic) - kMagic;  // round half to even, exact below 2^51
}

constexpr int64_t kMassBlock = 64;

// hist[r, b] = sum of the masses of row r's values z with z >= floor[r], z > -inf and lo[r] < key(z) <= hi[r], in
// bucket b = #{j : probes[r, j] < key(z)} (probes ascending, 2^L - 1 of them). Per block of 64 values: a count of
// those inside the bracket (after the first round of the search, most blocks have none and are skipped), then
// their masses, vectorised, and the bucket search for each of them.
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void mass_histogram_rows(const scalar_t* z, int64_t ld, int64_t cols, const acc_t* z_max,
                                        const acc_t* floor, const int64_t* lo, const int64_t* hi,
                                        const int64_t* probes, int64_t n_probes, int64_t* hist, int64_t b, int64_t e) {
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  alignas(64) double mass[kMassBlock];
  alignas(64) int64_t keys[kMassBlock];
  alignas(64) unsigned char in[kMassBlock];
  const int64_t stride = n_probes + 1;
  std::vector<int64_t> part(static_cast<size_t>(4 * stride));
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* x = z + r * ld;
    const int64_t* pr = probes + r * n_probes;
    int64_t* h = hist + r * (n_probes + 1);
    const int64_t l = lo[r], u = hi[r];
    const acc_t f = floor[r];
    const double m = static_cast<double>(z_max[r]);
    // buckets per key: hi - lo as unsigned (fp64 keys may span more than int64); the guess needs no exactness
    const double scale = u > l ? static_cast<double>(n_probes + 1) /
                                     static_cast<double>(static_cast<uint64_t>(u) - static_cast<uint64_t>(l)) : 0.0;
    std::fill(part.begin(), part.end(), 0);
    for (int64_t c0 = 0; c0 < cols; c0 += kMassBlock) {
      const int64_t len = std::min(kMassBlock, cols - c0);
      int any = 0;
      for (int64_t i = 0; i < len; ++i) {
        const acc_t v = static_cast<acc_t>(x[c0 + i]);
        const int64_t key = ordered_key(v);
        const bool ok = (v >= f) & (v != ninf) & (key > l) & (key <= u);  // NaN: v >= f is false
        keys[i] = key;
        in[i] = ok;
        any += ok;
      }
      if (any == 0) continue;
      for (int64_t i = 0; i < len; ++i) mass[i] = top_p_mass(static_cast<double>(static_cast<acc_t>(x[c0 + i])) - m);
      for (int64_t i = 0; i < len; ++i) {
        if (!in[i]) continue;
        // The probes split (lo, hi] into near-equal parts: start at the proportional bucket, then step to the
        // exact one (#{probes < key}), usually no step at all.
        const double off = static_cast<double>(static_cast<uint64_t>(keys[i]) - static_cast<uint64_t>(l) - 1);
        int64_t bucket = std::min<int64_t>(n_probes, static_cast<int64_t>(off * scale));
        while (bucket > 0 && pr[bucket - 1] >= keys[i]) --bucket;
        while (bucket < n_probes && pr[bucket] < keys[i]) ++bucket;
        // four interleaved copies: consecutive values often land in one bucket, and one copy would chain the adds
        part[(i & 3) * stride + bucket] += static_cast<int64_t>(mass[i]);
      }
    }
    for (int64_t j = 0; j < stride; ++j) h[j] += part[j] + part[stride + j] + part[2 * stride + j] + part[3 * stride + j];
  }
}

#define RC_DEFINE_MASS(scalar_t, acc_t, suffix)                                                                   \
  void mass_rows_##suffix(const scalar_t* z, int64_t ld, int64_t c, const acc_t* zm, const acc_t* f,               \
                          const int64_t* lo, const int64_t* hi, const int64_t* pr, int64_t np, int64_t* h, int64_t b, \
                          int64_t e) {                                                                             \
    mass_histogram_rows<scalar_t, acc_t>(z, ld, c, zm, f, lo, hi, pr, np, h, b, e);                                \
  }                                                                                                                \
  RC_CPU_AVX2 void mass_rows_##suffix##_avx2(const scalar_t* z, int64_t ld, int64_t c, const acc_t* zm,            \
                                             const acc_t* f, const int64_t* lo, const int64_t* hi,                 \
                                             const int64_t* pr, int64_t np, int64_t* h, int64_t b, int64_t e) {     \
    mass_histogram_rows<scalar_t, acc_t>(z, ld, c, zm, f, lo, hi, pr, np, h, b, e);                                \
  }                                                                                                                \
  RC_CPU_AVX512 void mass_rows_##suffix##_avx512(const scalar_t* z, int64_t ld, int64_t c, const acc_t* zm,        \
                                                 const acc_t* f, const int64_t* lo, const int64_t* hi,             \
                                                 const int64_t* pr, int64_t np, int64_t* h, int64_t b, int64_t e) { \
    mass_histogram_rows<scalar_t, acc_t>(z, ld, c, zm, f, lo, hi, pr, np, h, b, e);                                \
  }                                                                                                                \
  void mass_dispatch(const scalar_t* z, int64_t ld, int64_t c, const acc_t* zm, const acc_t* f, const int64_t* lo,  \
                     const int64_t* hi, const int64_t* pr, int64_t np, int64_t* h, int64_t b, int64_t e) {          \
    switch (cpu_isa()) {                                                                                           \
      case CpuIsa::kAvx512: return mass_rows_##suffix##_avx512(z, ld, c, zm, f, lo, hi, pr, np, h, b, e);          \
      case CpuIsa::kAvx2: return mass_rows_##suffix##_avx2(z, ld, c, zm, f, lo, hi, pr, np, h, b, e);              \
      default: return mass_rows_##suffix(z, ld, c, zm, f, lo, hi, pr, np, h, b, e);                                \
    }                                                                                                              \
  }
RC_DEFINE_MASS(float, float, f32)
RC_DEFINE_MASS(double, double, f64)
RC_DEFINE_MASS(at::BFloat16, float, bf16)
RC_DEFINE_MASS(at::Half, float, f16)
#undef RC_DEFINE_MASS

at::Tensor mass_histogram_cpu(const at::Tensor& z, const at::Tensor& z_max, const at::Tensor& floor,
                              const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& probes) {
  TORCH_CHECK(z.dim() == 2 && at::isFloatingType(z.scalar_type()), "mass_histogram: z must be a 2-D float tensor, "
              "got ", z.scalar_type(), " ", z.sizes());
  const auto acc = z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t rows = z.size(0), cols = z.size(1);
  TORCH_CHECK(probes.dim() == 2 && probes.size(0) == rows && probes.scalar_type() == at::kLong,
              "mass_histogram: probes must be [rows, P] int64");
  const int64_t n_probes = probes.size(1);
  TORCH_CHECK(n_probes >= 1 && ((n_probes + 1) & n_probes) == 0, "mass_histogram: P + 1 must be a power of 2, got P = ",
              n_probes);
  for (const auto* t : {&z_max, &floor}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == acc,
                "mass_histogram: z_max and floor must be [rows] in ", acc);
  }
  for (const auto* t : {&lo, &hi}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kLong,
                "mass_histogram: lo and hi must be [rows] int64 keys");
  }
  at::Tensor hist = at::zeros({rows, n_probes + 1}, z.options().dtype(at::kLong));
  if (rows == 0 || cols == 0) return hist;
  const at::Tensor zc = z.stride(1) == 1 ? z : z.contiguous();
  const auto zm = z_max.contiguous(), fl = floor.contiguous(), l = lo.contiguous(), u = hi.contiguous();
  const auto pr = probes.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "mass_histogram_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      mass_dispatch(zc.data_ptr<scalar_t>(), zc.stride(0), cols, zm.data_ptr<acc_t>(), fl.data_ptr<acc_t>(),
                    l.data_ptr<int64_t>(), u.data_ptr<int64_t>(), pr.data_ptr<int64_t>(), n_probes,
                    hist.data_ptr<int64_t>(), b, e);
    });
  });
  return hist;
}

// counts[r] = #{c : acc(z[r, c]) >= floor[r]}: the run of values tied at a shard's candidate-list end (one
// vectorised compare-and-add pass).
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void count_rows(const scalar_t* z, int64_t ld, int64_t cols, const acc_t* floor, int64_t* counts,
                               int64_t b, int64_t e) {
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* x = z + r * ld;
    const acc_t f = floor[r];
    int64_t c = 0;
    for (int64_t j = 0; j < cols; ++j) c += static_cast<acc_t>(x[j]) >= f;
    counts[r] = c;
  }
}

#define RC_DEFINE_COUNT(scalar_t, acc_t, suffix)                                                                  \
  void count_rows_##suffix(const scalar_t* z, int64_t ld, int64_t c, const acc_t* f, int64_t* o, int64_t b,      \
                           int64_t e) {                                                                          \
    count_rows<scalar_t, acc_t>(z, ld, c, f, o, b, e);                                                           \
  }                                                                                                              \
  RC_CPU_AVX2 void count_rows_##suffix##_avx2(const scalar_t* z, int64_t ld, int64_t c, const acc_t* f,          \
                                              int64_t* o, int64_t b, int64_t e) {                                \
    count_rows<scalar_t, acc_t>(z, ld, c, f, o, b, e);                                                           \
  }                                                                                                              \
  RC_CPU_AVX512 void count_rows_##suffix##_avx512(const scalar_t* z, int64_t ld, int64_t c, const acc_t* f,      \
                                                  int64_t* o, int64_t b, int64_t e) {                            \
    count_rows<scalar_t, acc_t>(z, ld, c, f, o, b, e);                                                           \
  }                                                                                                              \
  void count_dispatch(const scalar_t* z, int64_t ld, int64_t c, const acc_t* f, int64_t* o, int64_t b,           \
                      int64_t e) {                                                                               \
    switch (cpu_isa()) {                                                                                         \
      case CpuIsa::kAvx512: return count_rows_##suffix##_avx512(z, ld, c, f, o, b, e);                           \
      case CpuIsa::kAvx2: return count_rows_##suffix##_avx2(z, ld, c, f, o, b, e);                               \
      default: return count_rows_##suffix(z, ld, c, f, o, b, e);                                                 \
    }                                                                                                            \
  }
RC_DEFINE_COUNT(float, float, f32)
RC_DEFINE_COUNT(double, double, f64)
RC_DEFINE_COUNT(at::BFloat16, float, bf16)
RC_DEFINE_COUNT(at::Half, float, f16)
#undef RC_DEFINE_COUNT

at::Tensor count_at_least_cpu(const at::Tensor& z, const at::Tensor& floor) {
  TORCH_CHECK(z.dim() == 2 && at::isFloatingType(z.scalar_type()), "count_at_least: z must be a 2-D float tensor, "
              "got ", z.scalar_type(), " ", z.sizes());
  const auto acc = z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == z.size(0) && floor.scalar_type() == acc,
              "count_at_least: floor must be [rows] in ", acc);
  const int64_t rows = z.size(0), cols = z.size(1);
  at::Tensor counts = at::zeros({rows}, z.options().dtype(at::kLong));
  if (rows == 0 || cols == 0) return counts;
  const at::Tensor zc = z.stride(1) == 1 ? z : z.contiguous();
  const auto fl = floor.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "count_at_least_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      count_dispatch(zc.data_ptr<scalar_t>(), zc.stride(0), cols, fl.data_ptr<acc_t>(), counts.data_ptr<int64_t>(),
                     b, e);
    });
  });
  return counts;
}

void floor_zero_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& floor, double temperature) {
  TORCH_CHECK(x.dim() == 2 && grad.dim() == 2 && x.sizes() == grad.sizes(), "floor_zero_: grad and x must be 2-D of "
              "one shape, got ", grad.sizes(), " and ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && grad.scalar_type() == x.scalar_type(), "floor_zero_: grad and x "
              "must be float tensors of one dtype, got ", grad.scalar_type(), " and ", x.scalar_type());
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(floor.dim() == 1 && floor.size(0) == x.size(0) && floor.scalar_type() == acc, "floor_zero_: floor "
              "must be [rows] in ", acc, ", got ", floor.sizes(), " ", floor.scalar_type());
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "floor_zero_: temperature must be finite and > 0, got ",
              temperature);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  TORCH_CHECK((x.stride(1) == 1 && grad.stride(1) == 1) || cols == 1, "floor_zero_: each row must be contiguous");
  const auto f = floor.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "floor_zero_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* src = x.data_ptr<scalar_t>();
    const acc_t* fl = f.data_ptr<acc_t>();
    const acc_t t = static_cast<acc_t>(temperature);
    const bool unit = temperature == 1.0;
    const int64_t lg = grad.stride(0), lx = x.stride(0);
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { zero_dispatch(g, lg, src, lx, fl, t, unit, cols, b, e); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("floor_zero_", &floor_zero_cpu);
  m.impl("count_at_least", &count_at_least_cpu);
  m.impl("row_topk", &row_topk_cpu);
  m.impl("floor_fill", &floor_fill_cpu);
  m.impl("mass_histogram", &mass_histogram_cpu);
}

}  // namespace cpu
}  // namespace rollout_corr
