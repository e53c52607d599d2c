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
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/reused_buffer.h"
#include "cpu/vec_math.h"
#include "sampling_host.h"
#include "sampling_math.h"

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
  check_row_topk(values, k);
  // Rows may be strided (a column slice of the logits); each row itself must be contiguous.
  const at::Tensor v = values.stride(1) == 1 || values.size(1) <= 1 ? values : values.contiguous();
  const auto acc = values.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({v.size(0), k}, v.options().dtype(acc));
  const int64_t rows = v.size(0), cols = v.size(1), ld = sampling_row_stride(v);
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
  check_floor_fill(x, floor, temperature, out);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
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

constexpr int64_t kMassBlock = 256;

// hist[r, b] = sum of the masses of row r's values z with z >= floor[r], z > -inf and lo[r] < key(z) <= hi[r], in
// bucket b = #{j : probes[r, j] < key(z)} (probes ascending, 2^L - 1 of them). Per block of 256 values: a count of
// those inside the bracket (after the first round of the search, most blocks have none and are skipped; where a
// few are, they are compacted first), then their masses, vectorised, then their buckets.
//
// Buckets: sampling.py's probes for 32-bit keys are the grid p_j = lo + floor(j D / 2^L), D = hi - lo, on which
// #{j : p_j < key} = floor((off 2^L - 1) / D), off = key - lo in [1, D] (floor(j D / 2^L) < off iff j D < off 2^L).
// A row whose probes are that grid (checked) takes the formula: one exact double division (numerator and D below
// 2^52, and a quotient within 2^L of a fraction 1 / D >= 2^-52 2^L from the next integer), vectorised. Other probes
// (the 64-bit keys' bisection points) take a proportional guess and step to the exact bucket.
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void mass_histogram_rows(const scalar_t* z, int64_t ld, int64_t cols, const acc_t* z_max,
                                        const acc_t* floor, const int64_t* lo, const int64_t* hi,
                                        const int64_t* probes, int64_t n_probes, int64_t* hist, int64_t b, int64_t e) {
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  alignas(64) double mass[kMassBlock];
  alignas(64) double rel[kMassBlock];
  alignas(64) int64_t keys[kMassBlock];
  alignas(64) int64_t bucket[kMassBlock];
  alignas(64) unsigned char in[kMassBlock];
  const int64_t stride = n_probes + 1;
  int levels = 0;
  while ((int64_t{1} << levels) < stride) ++levels;
  std::vector<int64_t> part(static_cast<size_t>(4 * stride));
  for (int64_t r = b; r < e; ++r) {
    const scalar_t* x = z + r * ld;
    const int64_t* pr = probes + r * n_probes;
    int64_t* h = hist + r * (n_probes + 1);
    const int64_t l = lo[r], u = hi[r];
    const acc_t f = floor[r];
    const double m = static_cast<double>(z_max[r]);
    // hi - lo as unsigned (fp64 keys may span more than int64)
    const uint64_t span = u > l ? static_cast<uint64_t>(u) - static_cast<uint64_t>(l) : 0;
    bool grid = span > 0 && levels <= 40 && span <= (uint64_t{1} << (52 - levels));
    for (int64_t j = 1; grid && j <= n_probes; ++j) {
      grid = pr[j - 1] == static_cast<int64_t>(static_cast<uint64_t>(l) + ((span * static_cast<uint64_t>(j)) >> levels));
    }
    const double dspan = static_cast<double>(span);
    const double scale = span ? static_cast<double>(stride) / dspan : 0.0;  // the guess needs no exactness
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
      int64_t cnt = len;
      if (4 * any < len) {  // a few inside (the rounds after the first): compact them, an exp for those only
        cnt = 0;
        for (int64_t i = len; i < kMassBlock; ++i) in[i] = 0;
        for (int64_t w0 = 0; w0 < len; w0 += 8) {  // the flags 8 at a time, one step per value inside
          uint64_t w;
          std::memcpy(&w, in + w0, sizeof w);
          for (; w; w &= w - 1) {  // each flag is one byte, 0 or 1: its lowest set bit marks one value
            const int64_t i = w0 + (__builtin_ctzll(w) >> 3);
            keys[cnt] = keys[i];
            rel[cnt] = static_cast<double>(static_cast<acc_t>(x[c0 + i])) - m;
            ++cnt;
          }
        }
        for (int64_t i = 0; i < cnt; ++i) mass[i] = top_p_mass(rel[i]);
        for (int64_t i = 0; i < cnt; ++i) in[i] = 1;
      } else {
        for (int64_t i = 0; i < len; ++i) {
          const double v = top_p_mass(static_cast<double>(static_cast<acc_t>(x[c0 + i])) - m);
          mass[i] = in[i] ? v : 0.0;
        }
      }
      if (grid) {
        for (int64_t i = 0; i < cnt; ++i) {
          // off in [1, D] inside the bracket; clamped there for the values outside it (their mass is 0)
          uint64_t off = static_cast<uint64_t>(keys[i]) - static_cast<uint64_t>(l);
          off = off < 1 ? 1 : (off > span ? span : off);
          bucket[i] = static_cast<int64_t>((static_cast<double>(off << levels) - 1.0) / dspan);
        }
      } else {
        for (int64_t i = 0; i < cnt; ++i) {
          if (!in[i]) {
            bucket[i] = 0;
            continue;
          }
          const double off = static_cast<double>(static_cast<uint64_t>(keys[i]) - static_cast<uint64_t>(l) - 1);
          int64_t g = std::min<int64_t>(n_probes, static_cast<int64_t>(off * scale));
          while (g > 0 && pr[g - 1] >= keys[i]) --g;
          while (g < n_probes && pr[g] < keys[i]) ++g;
          bucket[i] = g;
        }
      }
      // four interleaved copies: consecutive values often land in one bucket, and one copy would chain the adds
      for (int64_t i = 0; i < cnt; ++i) part[(i & 3) * stride + bucket[i]] += static_cast<int64_t>(mass[i]);
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
  const int64_t n_probes = check_mass_histogram(z, z_max, floor, lo, hi, probes);
  const int64_t rows = z.size(0), cols = z.size(1);
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
  check_count_at_least(z, floor);
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
  check_floor_zero(grad, x, floor, temperature);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
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


// ---------------------------------------------------------------------------------------------------------
// row_candidates: one streaming pass per row for the replay of top-k (+ top-p / min-p) sampling. Per row:
//   * z = x / T (fp32, IEEE division as the sampler's), its max and sum(exp(z - max)) (online, by blocks of 64):
//     log S's denominator;
//   * the max of every 64-value block. The k-th largest block max is at most the row's k-th largest value (k blocks
//     hold a value at least that large), so only the blocks whose max reaches it (or a bound just under it) can hold
//     a value >= the k-th largest: they are read again (from cache) and their values >= that bound become
//     candidates;
//   * the candidates' k-th largest, then all of them at or above it (ties kept whole), sorted by value descending
//     then column ascending: the shard's complete list of the values the top-k can keep.
// The rest of the replay (top-k across shards, min-p, top-p, the renormalised log-probs, entropy) runs on these
// few candidates per row (sampling.py): the logits are read once, as the plain forward reads them.

constexpr int64_t kCandBlock = 64;
// Columns whose two passes share L1: 8 KiB of fp32, 16 KiB of bf16 (read in place) or fp16, as the log-prob kernels.
template <typename scalar_t>
constexpr int64_t cand_chunk_cols() {
  return std::is_same<scalar_t, float>::value ? 2048 : 8192;
}
constexpr int64_t kCandPrefetchBytes = 16384;  // how far ahead the exp pass prefetches (as the log-prob kernels)

// A row of 16-bit logits widened to fp32, a vector at a time (exact).
template <typename VF>
RC_FORCEINLINE void widen_row(const at::BFloat16* x, float* out, int64_t n) {
  widen_16bit<Bf16Bits, VF>(reinterpret_cast<const uint16_t*>(x), out, n);
}
template <typename VF>
RC_FORCEINLINE void widen_row(const at::Half* x, float* out, int64_t n) {
  widen_16bit<HalfBits, VF>(reinterpret_cast<const uint16_t*>(x), out, n);
}
template <typename VF>
RC_FORCEINLINE void widen_row(const float*, float*, int64_t) {}

// The largest lane, by halving (a chain of lane extracts costs more than the block's own math).
RC_FORCEINLINE float hmax_tree(v4f v) {
  const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
  return a > b ? a : b;
}
RC_FORCEINLINE float hmax_tree(v8f v) {
  const v4f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3), hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return hmax_tree(lo > hi ? lo : hi);
}
RC_FORCEINLINE float hmax_tree(v16f v) {
  const v8f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax_tree(lo > hi ? lo : hi);
}
// One bit per lane of v: set where thr <= v and v > -inf (v >= thr, never -inf; NaN never). One compare per
// condition and a movemask on x86: GCC would otherwise build the lanes' -1 / 0 one by one.
template <typename VF>
RC_FORCEINLINE uint32_t kept_bits(VF v, VF thr) {
  uint32_t bits = 0;
  for (int l = 0; l < lanes_of<VF>(); ++l) {
    bits |= static_cast<uint32_t>(v[l] >= thr[l] && v[l] > -std::numeric_limits<float>::infinity()) << l;
  }
  return bits;
}
#if RC_CPU_HAS_AVX512_PATH
RC_CPU_AVX512_INLINE uint32_t kept_bits(v16f v, v16f thr) {
  const __m512 x = (__m512)v;
  return _mm512_cmp_ps_mask(x, (__m512)thr, _CMP_GE_OQ) &
         _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_GT_OQ);
}
RC_CPU_AVX2_INLINE uint32_t kept_bits(v8f v, v8f thr) {
  const __m256 x = (__m256)v;
  const __m256 c = _mm256_and_ps(_mm256_cmp_ps(x, (__m256)thr, _CMP_GE_OQ),
                                 _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_GT_OQ));
  return static_cast<uint32_t>(_mm256_movemask_ps(c));
}
inline uint32_t kept_bits(v4f v, v4f thr) {
  const __m128 x = (__m128)v;
  const __m128 c = _mm_and_ps(_mm_cmpge_ps(x, (__m128)thr),
                              _mm_cmpgt_ps(x, _mm_set1_ps(-std::numeric_limits<float>::infinity())));
  return static_cast<uint32_t>(_mm_movemask_ps(c));
}
#endif

// A lower bound of the k-th largest of v[0, n) (n >= k, no NaN) that at most a 2^-7 relative step under it: the
// k-th largest of the values' 16-bit key prefixes (sign, exponent, 7 mantissa bits), found by two rounds of a
// 256-bucket histogram. Branch-free counting, where nth_element pays a mispredicted branch per compare. At least k
// values are >= the result, so any value >= the true k-th largest is >= it as well.
RC_FORCEINLINE float kth_largest_bound(const float* v, int64_t n, int64_t k, uint32_t* keys) {
  // four interleaved histograms: block maxima share their top bits, and one counter would chain every increment
  uint32_t hist[4][256];
  std::memset(hist, 0, sizeof hist);
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = ordered_u32(v[i]);
    ++hist[i & 3][keys[i] >> 24];
  }
  int64_t above = 0;
  int b1 = 255;
  for (;; --b1) {
    const uint32_t h = hist[0][b1] + hist[1][b1] + hist[2][b1] + hist[3][b1];
    if (b1 == 0 || above + h >= static_cast<uint32_t>(k)) break;
    above += h;
  }
  std::memset(hist, 0, sizeof hist);
  for (int64_t i = 0; i < n; ++i) {
    if ((keys[i] >> 24) == static_cast<uint32_t>(b1)) ++hist[i & 3][(keys[i] >> 16) & 255u];
  }
  int b2 = 255;
  for (;; --b2) {
    const uint32_t h = hist[0][b2] + hist[1][b2] + hist[2][b2] + hist[3][b2];
    if (b2 == 0 || above + h >= static_cast<uint32_t>(k)) break;
    above += h;
  }
  const float bound = from_ordered_u32((static_cast<uint32_t>(b1) << 24) | (static_cast<uint32_t>(b2) << 16));
  // the prefix of -inf's key reads as a NaN pattern: the k-th largest is -inf there
  return std::isnan(bound) ? -std::numeric_limits<float>::infinity() : bound;
}

// The candidates by value descending, ties in their order of arrival (ascending column): a stable LSD radix sort
// of top - (value key), 8 bits a pass, only over the digits in which the keys differ (a few dozen keys within a
// binade or two: one to three passes, no comparison branch to mispredict, where std::sort paid about a microsecond
// a row).
RC_FORCEINLINE void sort_candidates(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp) {
  const size_t n = keys.size();
  if (n < 2) return;
  uint32_t top = 0, first = static_cast<uint32_t>(keys[0] >> 32), differ = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t v = static_cast<uint32_t>(keys[i] >> 32);
    top = v > top ? v : top;
    differ |= v ^ first;  // the bits in which some key differs (bf16 values leave the low 16 the same)
  }
  tmp.resize(n);
  uint64_t* src = keys.data();
  uint64_t* dst = tmp.data();
  // top - v is 0 below the lowest bit in which the keys differ and above the highest: those digits are skipped
  const int lo_bit = differ != 0 ? __builtin_ctz(differ) : 32;
  const int hi_bit = differ != 0 ? 31 - __builtin_clz(differ) : -1;
  for (int shift = 0; shift < 32; shift += 8) {
    if (shift + 8 <= lo_bit || shift > hi_bit) continue;
    uint32_t start[256] = {0};
    for (size_t i = 0; i < n; ++i) ++start[((top - static_cast<uint32_t>(src[i] >> 32)) >> shift) & 255u];
    uint32_t sum = 0;
    for (int d = 0; d < 256; ++d) {
      const uint32_t c = start[d];
      start[d] = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; ++i) dst[start[((top - static_cast<uint32_t>(src[i] >> 32)) >> shift) & 255u]++] = src[i];
    std::swap(src, dst);
  }
  if (src != keys.data()) std::copy(src, src + n, keys.data());
}

template <typename scalar_t>
struct CandidateParams {
  const scalar_t* x;
  int64_t ld, cols;       // row stride; the valid (non-padding) columns
  const int64_t* k;       // [N]: the row's top-k; <= 0: an ignored row, never read
  const int64_t* target;  // [N]: the target's local column, or -1
  float t;
  bool unit_t;
  int64_t width;
  float* values;    // [N, width]
  int64_t* index;   // [N, width]
  int64_t* count;   // [N]
  double* stats;    // [N, 3]: z max (NaN: the row holds NaN or +inf), sum exp(z - max), z of the target
};

// A 64-value block as kCandBlock / L fp32 vectors, in any order (its max and its sum do not depend on it): fp32
// as it lies; bf16 read in place, L 32-bit words holding two vectors (the even elements, word << 16, and the odd
// ones, word & 0xffff0000: exact, no shuffle); fp16 widened through a small buffer.
template <typename VF>
RC_FORCEINLINE void block_lanes(const float* x, VF* v) {
  for (int q = 0; q < static_cast<int>(kCandBlock / lanes_of<VF>()); ++q) v[q] = load_vec<VF>(x + q * lanes_of<VF>());
}
template <typename VF>
RC_FORCEINLINE void block_lanes(const at::BFloat16* x, VF* v) {
  constexpr int L = lanes_of<VF>();
  for (int q = 0; q < static_cast<int>(kCandBlock / L); q += 2) {
    typename VecOf<VF>::u32 w;
    std::memcpy(&w, x + q * L, sizeof(w));
    v[q] = (VF)(w << 16);
    v[q + 1] = (VF)(w & 0xffff0000u);
  }
}
template <typename VF>
RC_FORCEINLINE void block_lanes(const at::Half* x, VF* v) {
  alignas(64) float buf[kCandBlock];
  widen_row<VF>(x, buf, kCandBlock);
  block_lanes<VF>(static_cast<const float*>(buf), v);
}
// A block in column order as fp32 (16-bit types widened into buf).
template <typename VF>
RC_FORCEINLINE const float* block_in_order(const float* x, int64_t, float*) {
  return x;
}
template <typename VF, typename scalar_t>
RC_FORCEINLINE const float* block_in_order(const scalar_t* x, int64_t n, float* buf) {
  widen_row<VF>(x, buf, n);
  return buf;
}

template <CpuIsa I, typename scalar_t>
RC_FORCEINLINE void candidate_rows(const CandidateParams<scalar_t>& p, int64_t b, int64_t e) {
  using VF = isa_vec<I>;
  constexpr int L = lanes_of<VF>();
  constexpr int64_t B = kCandBlock;
  constexpr int kV = B / L;  // vectors per block
  static_assert(B % (2 * L) == 0, "a block is whole pairs of vectors");
  const float inf = std::numeric_limits<float>::infinity(), ninf = -inf;
  const int64_t cols = p.cols, width = p.width;
  const float t = p.t;
  // e^(z - m) = 2^((z - m) c2), z = x / T in fp32: the values the candidates carry (and the CUDA kernel sums), so
  // that a kept set of every value has the total's mass (scaling x - m by 1 / T instead rounds each term otherwise,
  // up to ulp(z) of an exponent: 1e-3 relative at |z| ~ 1e4)
  const float c2 = 1.44269504088896341f;
  const int64_t nblocks = (cols + B - 1) / B;
  std::vector<float> bmax(static_cast<size_t>(nblocks));
  std::vector<uint32_t> bkey(static_cast<size_t>(nblocks));
  std::vector<int64_t> qual(static_cast<size_t>(nblocks));
  int64_t* const qual_p = qual.data();
  uint32_t* const key_p = bkey.data();
  std::vector<uint64_t> keys, sorted_keys;
  keys.reserve(static_cast<size_t>(std::min<int64_t>(cols, 4 * width + B)));
  alignas(64) float wide[kCandBlock];
  float* const bmax_p = bmax.data();
  for (int64_t r = b; r < e; ++r) {
    float* vout = p.values + r * width;
    int64_t* iout = p.index + r * width;
    double* st = p.stats + r * 3;
    const int64_t k = p.k[r];
    std::fill(vout, vout + width, ninf);
    std::fill(iout, iout + width, int64_t(-1));
    p.count[r] = 0;
    st[0] = ninf;
    st[1] = 0.0;
    st[2] = ninf;
    if (k <= 0 || cols == 0) continue;
    const scalar_t* x = p.x + r * p.ld;
    const int64_t full = cols / B * B;

    // pass A, a chunk of cand_chunk_cols columns at a time: the max of every block (from memory), then, with the chunk in
    // L1, sum 2^((z - m) c2) at the running max m of z (rescaled when a chunk raises it), prefetching the next chunk's
    // start meanwhile (the exp pass is compute-bound, the max pass waits on memory otherwise). A NaN makes the sum
    // NaN (exp2 of NaN), a +inf is the max (bad); a chunk with nothing but -inf is scanned for NaN instead.
    float m = ninf;
    double s = 0.0;
    bool bad = false;
    int64_t nb = 0;
    constexpr int64_t kChunk = cand_chunk_cols<scalar_t>();
    for (int64_t c0 = 0; c0 < full; c0 += kChunk) {
      const int64_t c1 = std::min(full, c0 + kChunk);
      float cm = ninf;
      for (int64_t cb = c0; cb < c1; cb += B) {
        VF v[kV];
        block_lanes<VF>(x + cb, v);
        VF mx = v[0];  // a NaN lane does not move the max (max_lanes)
        for (int q = 1; q < kV; ++q) mx = max_lanes(v[q], mx);
        const float bm = hmax_tree(mx);
        bmax_p[nb++] = bm;
        cm = bm > cm ? bm : cm;
      }
      const float czm = p.unit_t ? cm : cm / t;  // x -> x / T is monotone, in fp32 too: the max of z
      if (czm == ninf) {  // every z of the chunk -inf (also a finite x whose quotient by T is): no mass
        for (int64_t i = c0; i < c1; ++i) bad |= std::isnan(static_cast<float>(x[i]));
        continue;
      }
      if (czm > m) {
        if (m > ninf) s *= std::exp2((static_cast<double>(m) - static_cast<double>(czm)) * static_cast<double>(c2));
        m = czm;
      }
      if (m == inf) {  // a +inf logit, or a finite one whose quotient by T overflows
        bad = true;
        break;
      }
      // (z - m) c2, two roundings but exact at z = m (and for every z within a factor 2 of m): z c2 - fl(m c2),
      // which the FMA copies would fuse, puts the product's rounding error into every term, up to ulp(m c2) / 2 of
      // an exponent (1e-4 relative at |m c2| ~ 4000), and the baseline copy a different one into each
      const VF mv = VF{} + m;
      VF s0 = VF{}, s1 = VF{};
      for (int64_t cb = c0; cb < c1; cb += B) {
        for (int64_t line = 0; line < B * static_cast<int64_t>(sizeof(scalar_t)); line += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(x + cb) + kCandPrefetchBytes + line, 0, 3);
        }
        VF v[kV];
        block_lanes<VF>(x + cb, v);
        if (!p.unit_t) {
          for (int q = 0; q < kV; ++q) v[q] = v[q] / t;
        }
        for (int q = 0; q < kV; q += 2) {
          s0 += exp2_lanes((v[q] - mv) * c2);
          s1 += exp2_lanes((v[q + 1] - mv) * c2);
        }
      }
      const VF s01 = s0 + s1;
      for (int l = 0; l < L; ++l) s += static_cast<double>(s01[l]);
    }
    if (!bad && full < cols) {  // the last, partial block
      float bm = ninf;
      for (int64_t i = full; i < cols; ++i) {
        const float xi = static_cast<float>(x[i]);
        bm = xi > bm ? xi : bm;
        bad |= std::isnan(xi);
      }
      bmax_p[nb++] = bm;
      const float bzm = p.unit_t ? bm : bm / t;
      if (bzm > m) {
        if (m > ninf) s *= std::exp2((static_cast<double>(m) - static_cast<double>(bzm)) * static_cast<double>(c2));
        m = bzm;
      }
      bad |= m == inf;
      if (!bad && m > ninf) {
        for (int64_t i = full; i < cols; ++i) {
          const float zi = p.unit_t ? static_cast<float>(x[i]) : static_cast<float>(x[i]) / t;
          s += std::exp2(static_cast<double>((zi - m) * c2));
        }
      }
    }
    bad |= std::isnan(s);
    const int64_t tc = p.target[r];  // read after the pass: the row is in cache now
    if (tc >= 0 && tc < cols) st[2] = p.unit_t ? static_cast<float>(x[tc]) : static_cast<float>(x[tc]) / t;
    if (bad) {
      st[0] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    st[0] = m;  // the max of z (-inf: every value -inf)
    st[1] = s;
    if (m == ninf) continue;  // every value -inf: no candidate (the caller names the row)

    // pass B: the blocks that can hold a value >= the k-th largest, their values >= the k-th largest block max
    float thr = ninf;
    if (nb >= k) {
      const float kth_block = kth_largest_bound(bmax_p, nb, k, key_p);
      thr = p.unit_t ? kth_block : kth_block / t;
    }
    keys.clear();
    // the blocks to read again, listed without a branch per block, then their lines fetched ahead of the reads
    int64_t nq = 0;
    for (int64_t j = 0; j < nb; ++j) {
      const float bj = bmax_p[j];
      qual_p[nq] = j;
      nq += static_cast<int64_t>((p.unit_t ? bj : bj / t) >= thr) & static_cast<int64_t>(bj > ninf);
    }
    const VF thr_v = VF{} + thr;
    for (int64_t q0 = 0; q0 < nq; ++q0) {
      if (q0 + 4 < nq) {
        const char* ahead = reinterpret_cast<const char*>(x + qual_p[q0 + 4] * B);
        for (int64_t line = 0; line < B * static_cast<int64_t>(sizeof(scalar_t)); line += 64) {
          __builtin_prefetch(ahead + line, 0, 3);
        }
      }
      const int64_t s0 = qual_p[q0] * B, len = std::min(B, cols - s0);
      if constexpr (std::is_same<scalar_t, at::BFloat16>::value) {
        if (len == B) {  // read in place: each pair of vectors holds the even and the odd columns of 2L values
          VF v[kV];
          block_lanes<VF>(x + s0, v);
          for (int q = 0; q < kV; q += 2) {
            if (!p.unit_t) {
              v[q] = v[q] / t;
              v[q + 1] = v[q + 1] / t;
            }
            const uint32_t even = kept_bits(v[q], thr_v), odd = kept_bits(v[q + 1], thr_v);
            for (uint32_t bits = even | odd; bits != 0; bits &= bits - 1) {  // lane j: columns 2j, 2j + 1, in order
              const int j = __builtin_ctz(bits);
              const int64_t col = s0 + q * L + 2 * j;
              if (even >> j & 1u) keys.push_back(candidate_key(v[q][j], col));
              if (odd >> j & 1u) keys.push_back(candidate_key(v[q + 1][j], col + 1));
            }
          }
          continue;
        }
      }
      const float* z = block_in_order<VF>(x + s0, len, wide);
      if (len == B) {
        for (int l = 0; l < B; l += L) {
          VF v = load_vec<VF>(z + l);
          if (!p.unit_t) v = v / t;
          for (uint32_t bits = kept_bits(v, thr_v); bits != 0; bits &= bits - 1) {
            const int q = __builtin_ctz(bits);
            keys.push_back(candidate_key(v[q], s0 + l + q));
          }
        }
      } else {
        for (int64_t i = 0; i < len; ++i) {
          const float v = p.unit_t ? z[i] : z[i] / t;
          if (v >= thr && v > ninf) keys.push_back(candidate_key(v, s0 + i));
        }
      }
    }
    // pass C: every candidate at or above the k-th largest, sorted
    sort_candidates(keys, sorted_keys);
    int64_t c = static_cast<int64_t>(keys.size());
    if (c > k) {  // every key tied with the k-th largest value stays
      const uint64_t kth = keys[k - 1] >> 32;
      while ((keys[c - 1] >> 32) < kth) --c;
    }
    for (int64_t i = 0; i < std::min(c, width); ++i) {
      vout[i] = from_ordered_u32(static_cast<uint32_t>(keys[i] >> 32));
      iout[i] = static_cast<int64_t>(0xFFFFFFFFull - (keys[i] & 0xFFFFFFFFull));
    }
    p.count[r] = c;
  }
}

#define RC_DEFINE_CAND(scalar_t, suffix)                                                                          \
  void cand_rows_##suffix(const CandidateParams<scalar_t>& p, int64_t b, int64_t e) {                             \
    candidate_rows<CpuIsa::kBaseline, scalar_t>(p, b, e);                                                         \
  }                                                                                                               \
  RC_CPU_AVX2 void cand_rows_##suffix##_avx2(const CandidateParams<scalar_t>& p, int64_t b, int64_t e) {          \
    candidate_rows<CpuIsa::kAvx2, scalar_t>(p, b, e);                                                             \
  }                                                                                                               \
  RC_CPU_AVX512 void cand_rows_##suffix##_avx512(const CandidateParams<scalar_t>& p, int64_t b, int64_t e) {      \
    candidate_rows<CpuIsa::kAvx512, scalar_t>(p, b, e);                                                           \
  }                                                                                                               \
  void cand_dispatch(const CandidateParams<scalar_t>& p, int64_t b, int64_t e) {                                  \
    switch (cpu_isa()) {                                                                                          \
      case CpuIsa::kAvx512: return cand_rows_##suffix##_avx512(p, b, e);                                          \
      case CpuIsa::kAvx2: return cand_rows_##suffix##_avx2(p, b, e);                                              \
      default: return cand_rows_##suffix(p, b, e);                                                                \
    }                                                                                                             \
  }
RC_DEFINE_CAND(float, f32)
RC_DEFINE_CAND(at::BFloat16, bf16)
RC_DEFINE_CAND(at::Half, f16)
#undef RC_DEFINE_CAND

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_candidates_cpu(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& target_col, int64_t width, double temperature,
    int64_t valid_cols) {
  check_row_candidates(x, k, target_col, width, temperature, valid_cols);
  const auto dt = x.scalar_type();
  const int64_t rows = x.size(0);
  const auto kc = k.contiguous(), tc = target_col.contiguous();
  at::Tensor values = at::empty({rows, width}, x.options().dtype(at::kFloat));
  at::Tensor index = at::empty({rows, width}, x.options().dtype(at::kLong));
  at::Tensor count = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor stats = at::empty({rows, 3}, x.options().dtype(at::kDouble));
  if (rows == 0) return {values, index, count, stats};
  const at::Tensor xc = x.stride(1) == 1 || x.size(1) <= 1 ? x : x.contiguous();
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    CandidateParams<scalar_t> p{xc.data_ptr<scalar_t>(), sampling_row_stride(xc),
                                valid_cols, kc.data_ptr<int64_t>(), tc.data_ptr<int64_t>(),
                                static_cast<float>(temperature), temperature == 1.0, width,
                                values.data_ptr<float>(), index.data_ptr<int64_t>(), count.data_ptr<int64_t>(),
                                stats.data_ptr<double>()};
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, valid_cols));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { cand_dispatch(p, b, e); });
  };
  if (dt == at::kFloat) {
    run(float{});
  } else if (dt == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(at::Half{});
  }
  return {values, index, count, stats};
}

// Values in descending order: fp32 through the candidates' radix sort, fp64 by comparison.
RC_FORCEINLINE void sort_descending(float* v, int64_t n, std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp) {
  keys.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keys[i] = static_cast<uint64_t>(ordered_u32(v[i])) << 32;
  sort_candidates(keys, tmp);
  for (int64_t i = 0; i < n; ++i) v[i] = from_ordered_u32(static_cast<uint32_t>(keys[i] >> 32));
}
RC_FORCEINLINE void sort_descending(double* v, int64_t n, std::vector<uint64_t>&, std::vector<uint64_t>&) {
  std::sort(v, v + n, std::greater<double>());
}

// A row of gathered lists, each sorted descending (the shards' candidates), in descending order into out: merged
// run by run (linear; tensor parallelism gives one run a rank) between two buffers, or sorted when there are many
// runs. Returns the row to read: v itself when it is one run.
template <typename acc_t>
RC_FORCEINLINE const acc_t* order_descending(const acc_t* v, int64_t n, std::vector<acc_t>& out,
                                             std::vector<acc_t>& spare, std::vector<uint64_t>& keys,
                                             std::vector<uint64_t>& tmp) {
  int64_t run_end[8];
  int runs = 0;
  for (int64_t i = 1; i <= n && runs < 8; ++i) {
    if (i == n || v[i] > v[i - 1]) run_end[runs++] = i;
  }
  if (runs == 1) return v;
  out.resize(static_cast<size_t>(n));
  if (run_end[runs - 1] != n) {  // more than 8 runs
    std::copy(v, v + n, out.begin());
    sort_descending(out.data(), n, keys, tmp);
    return out.data();
  }
  spare.resize(static_cast<size_t>(n));
  // merged prefix in `out` (after the first merge), the next run appended by a merge into `spare`, then swapped
  std::merge(v, v + run_end[0], v + run_end[0], v + run_end[1], out.begin(), std::greater<acc_t>());
  for (int r = 2; r < runs; ++r) {
    std::merge(out.begin(), out.begin() + run_end[r - 1], v + run_end[r - 1], v + run_end[r], spare.begin(),
               std::greater<acc_t>());
    out.swap(spare);
  }
  return out.data();
}

// The replay's decision on each row's gathered candidates (sorted descending, -inf padded; they hold every value
// top-k can keep), sampling.py's rules: tau = max(floor (min-p), the k-th largest), then top-p over the survivors
// in integer masses (top_p_mass, as the general search's histogram), the smallest v with M(<= v) > c, c =
// min(floor((1 - p) M), M - 1); then, in fp64 over the kept candidates, lse, the entropy, log S = lse_kept -
// lse_all (sum_all: sum exp(z - z_max) over the row) and the target's log-prob (-inf outside the kept set).
template <typename acc_t>
RC_FORCEINLINE void decide_rows(const acc_t* cand, int64_t width, const double* z_max, const double* z_t, const double* sum_all,
                 const int64_t* k, const acc_t* floor, const double* top_p, acc_t* tau_out, double* out, int64_t b,
                 int64_t e) {
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  std::vector<double> ex(static_cast<size_t>(width));  // e^(z - z_max) of each survivor (0 below e^-60)
  std::vector<acc_t> row, spare;
  std::vector<uint64_t> keys, tmp;
  for (int64_t r = b; r < e; ++r) {
    double* o = out + r * 4;
    tau_out[r] = ninf;
    o[0] = o[1] = o[2] = o[3] = 0.0;
    if (k[r] <= 0) continue;
    const acc_t* c = cand + r * width;
    c = order_descending(c, width, row, spare, keys, tmp);  // the shards' lists, gathered: merged
    const double m = z_max[r];
    acc_t tau = floor[r];
    const acc_t kth = c[std::min(k[r], width) - 1];
    tau = kth > tau ? kth : tau;
    int64_t n = 0;  // the survivors of min-p and top-k: a prefix of the sorted list
    while (n < width && c[n] >= tau && c[n] != ninf) ++n;
    for (int64_t i = 0; i < n; ++i) {
      const double rel = static_cast<double>(c[i]) - m;
      ex[i] = mass_exp(rel);
    }
    if (top_p[r] < 1.0) {  // masses exactly as top_p_mass gives them
      int64_t total = 0;
      for (int64_t i = 0; i < n; ++i) total += mass_of(ex[i]);
      const int64_t budget = std::min(static_cast<int64_t>(std::floor((1.0 - top_p[r]) * static_cast<double>(total))),
                                      total - 1);
      int64_t below = 0;  // M(<= v), from the smallest survivor up, a group of equal values at a time
      for (int64_t i = n - 1; i >= 0;) {
        int64_t j = i;
        for (; j >= 0 && c[j] == c[i]; --j) below += mass_of(ex[j]);
        if (below > budget) {
          tau = c[i] > tau ? c[i] : tau;
          break;
        }
        i = j;
      }
      while (n > 0 && c[n - 1] < tau) --n;
    }
    double s = 0.0, s_rel = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      s += ex[i];
      s_rel += ex[i] * (static_cast<double>(c[i]) - m);
    }
    const double log_kept = std::log(s);  // s >= 1: the row max is always kept
    const bool in = z_t[r] >= static_cast<double>(tau) && z_t[r] != -std::numeric_limits<double>::infinity();
    tau_out[r] = tau;
    o[0] = in ? (z_t[r] - m) - log_kept : -std::numeric_limits<double>::infinity();  // relative to m (ops.cpp)
    o[1] = log_kept - s_rel / s;  // H = -sum p log p, p = e / s, log p = rel - log_kept
    o[2] = std::min(log_kept - std::log(sum_all[r]), 0.0);
    o[3] = log_kept;
  }
}

// The ISA copies (the masses' exp polynomial vectorises over a row's candidates with FMA).
#define RC_DEFINE_DECIDE(acc_t, suffix)                                                                          \
  void decide_##suffix(const acc_t* c, int64_t w, const double* zm, const double* zt, const double* sa,         \
                       const int64_t* k, const acc_t* f, const double* tp, acc_t* tau, double* o, int64_t b,     \
                       int64_t e) {                                                                              \
    decide_rows<acc_t>(c, w, zm, zt, sa, k, f, tp, tau, o, b, e);                                                \
  }                                                                                                              \
  RC_CPU_AVX2 void decide_##suffix##_avx2(const acc_t* c, int64_t w, const double* zm, const double* zt,        \
                                          const double* sa, const int64_t* k, const acc_t* f, const double* tp, \
                                          acc_t* tau, double* o, int64_t b, int64_t e) {                         \
    decide_rows<acc_t>(c, w, zm, zt, sa, k, f, tp, tau, o, b, e);                                                \
  }                                                                                                              \
  RC_CPU_AVX512 void decide_##suffix##_avx512(const acc_t* c, int64_t w, const double* zm, const double* zt,    \
                                              const double* sa, const int64_t* k, const acc_t* f,               \
                                              const double* tp, acc_t* tau, double* o, int64_t b, int64_t e) {   \
    decide_rows<acc_t>(c, w, zm, zt, sa, k, f, tp, tau, o, b, e);                                                \
  }                                                                                                              \
  void decide_dispatch(const acc_t* c, int64_t w, const double* zm, const double* zt, const double* sa,         \
                       const int64_t* k, const acc_t* f, const double* tp, acc_t* tau, double* o, int64_t b,     \
                       int64_t e) {                                                                              \
    switch (cpu_isa()) {                                                                                         \
      case CpuIsa::kAvx512: return decide_##suffix##_avx512(c, w, zm, zt, sa, k, f, tp, tau, o, b, e);           \
      case CpuIsa::kAvx2: return decide_##suffix##_avx2(c, w, zm, zt, sa, k, f, tp, tau, o, b, e);               \
      default: return decide_##suffix(c, w, zm, zt, sa, k, f, tp, tau, o, b, e);                                 \
    }                                                                                                            \
  }
RC_DEFINE_DECIDE(float, f32)
RC_DEFINE_DECIDE(double, f64)
#undef RC_DEFINE_DECIDE

std::tuple<at::Tensor, at::Tensor> candidate_decide_cpu(const at::Tensor& cand, const at::Tensor& z_max,
                                                       const at::Tensor& z_t, const at::Tensor& sum_all,
                                                       const at::Tensor& k, const at::Tensor& floor,
                                                       const at::Tensor& top_p) {
  check_candidate_decide(cand, z_max, z_t, sum_all, k, floor, top_p);
  const int64_t rows = cand.size(0), width = cand.size(1);
  const auto cc = cand.contiguous(), zm = z_max.contiguous(), zt = z_t.contiguous(), sa = sum_all.contiguous();
  const auto kc = k.contiguous(), fl = floor.contiguous(), tp = top_p.contiguous();
  at::Tensor tau = at::empty({rows}, cand.options());
  at::Tensor out = at::empty({rows, 4}, cand.options().dtype(at::kDouble));
  if (rows == 0) return {tau, out};
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "candidate_decide_cpu", [&] {
    at::parallel_for(0, rows, 256, [&](int64_t b, int64_t e) {
      decide_dispatch(cc.data_ptr<scalar_t>(), width, zm.data_ptr<double>(), zt.data_ptr<double>(),
                      sa.data_ptr<double>(), kc.data_ptr<int64_t>(), fl.data_ptr<scalar_t>(), tp.data_ptr<double>(),
                      tau.data_ptr<scalar_t>(), out.data_ptr<double>(), b, e);
    });
  });
  return {tau, out};
}

// out [N, cols] (dtype) = 0, then out[r, index[r, w]] = values[r, w] where index >= 0: the replay's gradient, which
// is nonzero on the kept candidates only. Written into the log-prob gradient's reused block (reused_buffer.h).
template <typename scalar_t, typename acc_t>
void scatter_rows_impl(const acc_t* v, const int64_t* idx, int64_t width, int64_t cols, scalar_t* out, int64_t b,
                       int64_t e) {
  for (int64_t r = b; r < e; ++r) {
    scalar_t* o = out + r * cols;
    std::memset(static_cast<void*>(o), 0, static_cast<size_t>(cols) * sizeof(scalar_t));
    for (int64_t w = 0; w < width; ++w) {
      const int64_t c = idx[r * width + w];
      if (c >= 0) o[c] = static_cast<scalar_t>(v[r * width + w]);
    }
  }
}

at::Tensor scatter_rows_cpu(const at::Tensor& values, const at::Tensor& index, int64_t cols, at::ScalarType dtype) {
  check_scatter_rows(values, index, cols);
  const int64_t rows = values.size(0), width = values.size(1);
  const auto vc = values.contiguous(), ic = index.contiguous();
  if (rows > 0 && width > 0) {
    TORCH_CHECK(ic.max().item<int64_t>() < cols, "scatter_rows: an index is >= cols = ", cols);
  }
  at::Tensor out = cpu::reused_empty({rows, cols}, dtype, cpu::ReusedUse::kLogprobGrad);
  if (rows == 0 || cols == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "scatter_rows_cpu", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* ip = ic.data_ptr<int64_t>();
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    if (vc.scalar_type() == at::kDouble) {
      const double* vp = vc.data_ptr<double>();
      at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { scatter_rows_impl(vp, ip, width, cols, o, b, e); });
    } else {
      const float* vp = vc.data_ptr<float>();
      at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { scatter_rows_impl(vp, ip, width, cols, o, b, e); });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("row_candidates", &row_candidates_cpu);
  m.impl("scatter_rows", &scatter_rows_cpu);
  m.impl("candidate_decide", &candidate_decide_cpu);
  m.impl("floor_zero_", &floor_zero_cpu);
  m.impl("count_at_least", &count_at_least_cpu);
  m.impl("row_topk", &row_topk_cpu);
  m.impl("floor_fill", &floor_fill_cpu);
  m.impl("mass_histogram", &mass_histogram_cpu);
}

}  // namespace cpu
}  // namespace rollout_corr
