// CPU kernels of the vocab-parallel log-prob op (docs/logprobs.md).
//
// Rows run in parallel (at::parallel_for). Each row is streamed once in blocks of 8-16 KiB (read in place
// for fp32 and bf16; fp16 widened into a small L1 buffer): the block's max is taken, then exp and the sums run over
// it in max-shifted log2 coordinates, and the block summary is merged into the row's (online softmax,
// logprob_math.h). While a block's exp pass runs, the 16 KiB after it are prefetched, so max passes read cache. So
// the shard is read from memory once, with one exp per element: exp2_lanes of vec_math.h, at 16 lanes in the
// AVX-512 copies, 8 in the AVX2 + FMA copies and 4 in the x86-64 baseline, picked at load time (cpu_isa()).
// (A one-pass variant, summing each block against the row's running max, measured no faster here and needs a
// bounded headroom to keep the entropy's rounding, so the two passes stay.)
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "logprob_host.h"
#include "logprob_math.h"
#include "logprob_params.h"
#include "reused_buffer.h"
#include "vec_math.h"

namespace rollout_corr {
namespace {
using namespace cpu;

constexpr int64_t kBlock = 2048;  // columns per block: 8 KiB of fp32, L1-resident between the block's two passes

// Columns per forward block. fp32 blocks are 8 KiB: with the 16 KiB being prefetched beside them they stay within a
// 48 KiB L1 (16 KiB fp32 blocks measured 7 % slower on a Zen 5 core). bf16, summarised in place, takes 16 KiB
// (8192 columns) and pays the per-block work (horizontal sums, the merge's exps) a quarter as often: 7.3 -> 8.4-8.9
// G elements/s per core there. fp16 is widened into an fp32 buffer of kBlock columns.
template <typename scalar_t>
constexpr int64_t forward_block_cols() {
  return std::is_same<scalar_t, at::BFloat16>::value ? 4 * kBlock : kBlock;
}

// The logits kPrefetchBytes ahead of the block being summed, fetched into cache while its exp pass runs, so that the
// max pass of each block reads cache instead of waiting on memory with the FP units idle (the exp pass is
// compute-bound, the max pass is not). 16 KiB, not one 8 KiB fp32 block: one exp pass is too short to bring a whole
// block in from memory (the fp32 forward went from 57 % to 75-81 % of the plain read on a Zen 5 core). Past the
// row's end it runs into the next row, which is where the thread reads next. The address is formed as an integer:
// a prefetch never faults, and past the tensor's end it is simply dropped.
constexpr uintptr_t kPrefetchBytes = 16384;
struct AheadBlock {
  uintptr_t base;
  int64_t elem_bytes;
  template <typename scalar_t>
  static RC_FORCEINLINE AheadBlock of(const scalar_t* block_start) {
    return {reinterpret_cast<uintptr_t>(block_start) + kPrefetchBytes, sizeof(scalar_t)};
  }
  RC_FORCEINLINE void prefetch(int64_t element) const {
    __builtin_prefetch(reinterpret_cast<const void*>(base + static_cast<uintptr_t>(element * elem_bytes)), 0, 3);
  }
};

// d += 2^t and s += 2^t t, where an element without mass adds 0 to s, not 0 * -inf: t is clamped where the exp is
// exactly 0 (clamp_exp2_arg), so s takes a plain FMA and no lane needs a mask.
template <CpuIsa I, typename VF>
RC_FORCEINLINE VF clamp_exp2_arg_on(VF t) {
#if RC_CPU_HAS_AVX2_PATH
  if constexpr (I == CpuIsa::kAvx2) return clamp_exp2_arg_avx2(t);
#endif
  return clamp_exp2_arg(t);
}

template <CpuIsa I, typename VF>
RC_FORCEINLINE void add_exp2_mass(VF t, VF& d, VF& s) {
  t = clamp_exp2_arg_on<I>(t);
  const VF e = exp2_scaled(t);
  d += e;
  s += e * t;
}
#if RC_CPU_HAS_AVX512_PATH
template <CpuIsa I>
RC_CPU_AVX512_INLINE void add_exp2_mass(v16f t, v16f& d, v16f& s) {
  __mmask16 has_mass;  // the exp's own floor mask: no separate compare (a NaN lane poisons s too, as it does d)
  const v16f e = exp2_lanes(t, &has_mass);
  d += e;
  s = (v16f)_mm512_mask3_fmadd_ps((__m512)e, (__m512)t, (__m512)s, has_mass);
}
#endif

// d += 2^t alone (with_entropy=False): 0 where t is -inf or below the exp's floor.
template <CpuIsa I, typename VF>
RC_FORCEINLINE void add_exp2(VF t, VF& d) {
  d += exp2_scaled(clamp_exp2_arg_on<I>(t));
}
#if RC_CPU_HAS_AVX512_PATH
template <CpuIsa I>
RC_CPU_AVX512_INLINE void add_exp2(v16f t, v16f& d) {
  d += exp2_lanes(t);
}
#endif

// One lane of the copy's own exp (block tails).
template <typename VF>
RC_FORCEINLINE float exp2_scalar(float t) {
  return exp2_lanes(VF{} + t)[0];
}

// How the summary loops read a block as fp32 lanes: kVecs vectors per load. fp32 is one vector per load. bf16 is
// read where it lies: one load of 2L values as L 32-bit words holds two vectors, the even elements (word << 16) and
// the odd ones (word & 0xffff0000), exactly widened with no shuffle and no buffer (a block's max and sums do not
// depend on the order of its elements).
template <typename scalar_t>
struct LaneSource;
template <>
struct LaneSource<float> {
  static constexpr int kVecs = 1;
  template <typename VF>
  static RC_FORCEINLINE void load(const float* x, VF* v) {
    v[0] = load_vec<VF>(x);
  }
};
template <>
struct LaneSource<at::BFloat16> {
  static constexpr int kVecs = 2;
  template <typename VF>
  static RC_FORCEINLINE void load(const at::BFloat16* x, VF* v) {
    typename VecOf<VF>::u32 w;
    std::memcpy(&w, x, sizeof(w));
    v[0] = (VF)(w << 16);
    v[1] = (VF)(w & 0xffff0000u);
  }
};

// How the sums loop turns logits into log2 coordinates t = (x - m) c, c = log2(e) / T. Exact form: a subtraction
// and a product, so t = 0 exactly at the max. Fused form (the AVX-512 and AVX2 copies, where the FMA is one
// instruction on every CPU that runs them): t' = x c - M in one FMA, M = fl(m c), so every element carries the same
// offset delta = m c - M (exactly representable: it is the rounding error of the product) that block_sums takes out
// of the block's sums afterwards. One instruction less per vector: 10.3 -> 11.4 G elements/s per core for the AVX-512
// exp pass alone on a Zen 5 core, with t as accurate as before (one rounding of x c - M, against two of (x - m) c).
template <CpuIsa I, bool kFused, typename VF = isa_vec<I>>
struct Log2Shift {
  VF m, c;
  RC_FORCEINLINE Log2Shift(float m_, float c_, float) : m(VF{} + m_), c(VF{} + c_) {}
  RC_FORCEINLINE VF operator()(VF x) const { return (x - m) * c; }
};
#if RC_CPU_HAS_AVX512_PATH
template <>
struct Log2Shift<CpuIsa::kAvx512, true> {
  __m512 c, minus_mc;
  RC_CPU_AVX512_INLINE Log2Shift(float, float c_, float minus_mc_)
      : c(_mm512_set1_ps(c_)), minus_mc(_mm512_set1_ps(minus_mc_)) {}
  RC_CPU_AVX512_INLINE v16f operator()(v16f x) const { return (v16f)_mm512_fmadd_ps((__m512)x, c, minus_mc); }
};
#endif
#if RC_CPU_HAS_AVX2_PATH
template <>
struct Log2Shift<CpuIsa::kAvx2, true> {
  __m256 c, minus_mc;
  RC_CPU_AVX2_INLINE Log2Shift(float, float c_, float minus_mc_)
      : c(_mm256_set1_ps(c_)), minus_mc(_mm256_set1_ps(minus_mc_)) {}
  RC_CPU_AVX2_INLINE v8f operator()(v8f x) const { return (v8f)_mm256_fmadd_ps((__m256)x, c, minus_mc); }
};
#endif
// Whether a block whose max is m may take the fused form: |m c| < 2^23, so that |delta| <= ulp(M) / 2 <= 1/2 and no
// element's 2^t' can overflow; a larger max takes the exact form.
RC_FORCEINLINE bool fused_shift_fits(float m, float c) { return std::fabs(m * c) < 8388608.0f; }

// Whether a block holds a -inf logit, read as the summary loops read it.
// The max of -x through max_lanes (MAXPS on AVX-512: GCC lowers a lane-wise == into a vector mask badly there),
// looked at every 512 columns from the block's end, so a top-k / top-p mask (mostly -inf) or -inf padding at the
// row's end is found at once.
template <CpuIsa I, typename scalar_t>
RC_FORCEINLINE bool block_has_neg_inf(const scalar_t* x, int64_t n) {
  using VF = isa_vec<I>;
  constexpr int64_t kStep = lanes_of<VF>() * LaneSource<scalar_t>::kVecs;
  constexpr int64_t kChunk = 512;
  const int64_t vec_end = n / kStep * kStep;
  for (int64_t i = vec_end; i < n; ++i) {
    if (static_cast<float>(x[i]) == -INFINITY) return true;
  }
  VF neg_max = VF{} - INFINITY;
  for (int64_t chunk_end = vec_end; chunk_end > 0; chunk_end -= kChunk) {
    for (int64_t i = std::max<int64_t>(0, chunk_end - kChunk); i < chunk_end; i += kStep) {
      VF v[LaneSource<scalar_t>::kVecs];
      LaneSource<scalar_t>::load(x + i, v);
      for (const VF& lane_values : v) neg_max = max_lanes(-lane_values, neg_max);
    }
    if (hmax_vec(neg_max) == INFINITY) return true;
  }
  return false;
}

// sum (x - m)/T over a block, times kSumZScale, in fp64 (no term or partial sum overflows there), for the rare blocks
// whose fp32 sum left the range at logits of magnitude near fp32's maximum.
template <typename scalar_t>
float scaled_sum_z_exact(const scalar_t* x, int64_t n, float m, float it) {
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) sum += static_cast<double>(static_cast<float>(x[j])) - static_cast<double>(m);
  return static_cast<float>(sum * static_cast<double>(it) * kSumZScale);
}

// The sums of a block whose max m is finite, in log2 units: t = (x - m) c with c = log2(e) / T, so that
// e^{(x - m)/T} = 2^t; d = sum 2^t, s = sum 2^t t, z = sum t, converted to the summary's natural units once per
// block (s only with kSumS: the entropy's; z only with kSumZ, then scaled as the summary's sz is). A one-hot block
// (one element with mass) gives d = 1 and s = 0 exactly in both forms of Log2Shift.
template <bool kSumZ, bool kSumS, bool kFused, CpuIsa I, typename scalar_t>
RC_FORCEINLINE RowSummary<float> block_sums(const scalar_t* x, int64_t n, float m, float it, const AheadBlock& ahead) {
  using VF = isa_vec<I>;
  constexpr int64_t kLanes = lanes_of<VF>();
  constexpr int kVecs = LaneSource<scalar_t>::kVecs;
  constexpr int64_t kStep = kLanes * kUnroll;
  const float c = it * 1.44269504088896341f;
  const float minus_mc = -(m * c);
  const Log2Shift<I, kFused> to_log2(m, c, minus_mc);
  // kUnroll vectors in flight per iteration, but only kSumAcc accumulators: a vector's exp takes longer than an add's
  // latency, and more accumulators would not fit the 16 AVX2 registers beside the polynomial's constants.
  constexpr int kSumAcc = 2;
  VF vd[kSumAcc], vs[kSumAcc], vz[kSumAcc];
  for (int k = 0; k < kSumAcc; ++k) vd[k] = vs[k] = vz[k] = VF{};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep)
    for (int k = 0; k < kUnroll; k += kVecs) {
      ahead.prefetch(i + k * kLanes);
      VF v[kVecs];
      LaneSource<scalar_t>::load(x + i + k * kLanes, v);
      for (int j = 0; j < kVecs; ++j) {
        const VF t = to_log2(v[j]);
        if constexpr (kSumS) {
          add_exp2_mass<I>(t, vd[(k + j) % kSumAcc], vs[(k + j) % kSumAcc]);
        } else {
          add_exp2<I>(t, vd[(k + j) % kSumAcc]);
        }
        if (kSumZ) vz[(k + j) % kSumAcc] += t;
      }
    }
  float d = 0.f, s = 0.f, z = 0.f;
  for (int k = 0; k < kSumAcc; ++k) {
    d += hsum_vec(vd[k]);
    s += hsum_vec(vs[k]);
    z += hsum_vec(vz[k]);
  }
  if constexpr (kFused) {
    if (i > 0) {
      // The vector part's sums were taken at t' = t + delta: d' = 2^delta d, s' = 2^delta (s + delta d) and
      // z' = z + i delta. delta is the loop's own t' at x = m (the FMA rounds once, so std::fma gives the same bits)
      // and 2^delta the loop's own exp of it, so a one-hot block, d' = 2^delta and s' = fl(2^delta delta), comes
      // back to d = 1 and s = 0 exactly. delta d' is rounded on its own, not fused into the subtraction, for the
      // same reason.
      const float delta = std::fma(m, c, minus_mc);
      const float scale = exp2_lanes(VF{} + delta)[0];
      if constexpr (kSumS) {
        float delta_d = delta * d;
        __asm__("" : "+x"(delta_d));  // rounded on its own: the compiler may not fuse it into the subtraction
        s = (s - delta_d) / scale;
      }
      d = d / scale;
      if (kSumZ) z -= static_cast<float>(i) * delta;
    }
  }
  for (; i < n; ++i) {
    const float t = (static_cast<float>(x[i]) - m) * c;
    const float e = exp2_scalar<VF>(t);
    d += e;
    if (kSumS) s += mass_times(e, t);
    if (kSumZ) z += t;
  }
  const float to_natural = static_cast<float>(static_cast<double>(it) / static_cast<double>(c));  // ~ ln 2
  float sz = 0.f;
  if (kSumZ) {
    // z is exact up to fp32 rounding unless a term or the sum left the fp32 range (-inf, or a sum past 2^100 that
    // the scaled record could hold but the next merge might overflow): such blocks are summed again.
    sz = to_natural * z;
    if (std::fabs(sz) <= 0x1p100f) {
      sz *= static_cast<float>(kSumZScale);
    } else {  // a -inf logit (the sum is -inf, rightly: found in one vector pass) or an overflow (summed again)
      sz = block_has_neg_inf<I>(x, n) ? -INFINITY : scaled_sum_z_exact(x, n, m, it);
    }
  }
  return {m, d, to_natural * s, sz, n};
}

// Summary of n raw logits read as fp32 lanes (relative to their own max). The max ignores NaN; a NaN then makes d
// NaN (exp propagates it), a +inf makes every (x - m) of the block NaN or -inf: both poison the row, as they must.
template <bool kSumZ, bool kSumS, CpuIsa I, typename scalar_t>
RC_FORCEINLINE RowSummary<float> block_summary(const scalar_t* x, int64_t n, float it, const AheadBlock& ahead) {
  using VF = isa_vec<I>;
  constexpr int64_t kLanes = lanes_of<VF>();
  constexpr int kVecs = LaneSource<scalar_t>::kVecs;
  constexpr int64_t kStep = kLanes * kUnroll;
  int64_t i = 0;
  VF vm[kUnroll];
  for (int k = 0; k < kUnroll; ++k) vm[k] = VF{} - INFINITY;
  for (; i + kStep <= n; i += kStep)
    for (int k = 0; k < kUnroll; k += kVecs) {
      VF v[kVecs];
      LaneSource<scalar_t>::load(x + i + k * kLanes, v);
      for (int j = 0; j < kVecs; ++j) vm[k + j] = max_lanes(v[j], vm[k + j]);
    }
  float m = -INFINITY;
  for (int k = 0; k < kUnroll; ++k) m = std::max(m, hmax_vec(vm[k]));
  for (int64_t j = i; j < n; ++j) {
    const float xj = static_cast<float>(x[j]);
    m = xj > m ? xj : m;
  }
  if (m == -INFINITY) {  // only -inf (and perhaps NaN): no mass; keep a NaN visible
    bool nan = false;
    for (int64_t j = 0; j < n; ++j) nan |= static_cast<float>(x[j]) != static_cast<float>(x[j]);
    return {m, nan ? NAN : 0.f, 0.f, n > 0 ? -INFINITY : 0.f, n};
  }
#if RC_CPU_HAS_AVX512_PATH  // where the FMA copies exist (elsewhere cpu_isa() is always the baseline)
  if constexpr (I != CpuIsa::kBaseline) {
    if (fused_shift_fits(m, it * 1.44269504088896341f)) {
      return block_sums<kSumZ, kSumS, true, I>(x, n, m, it, ahead);
    }
  }
#endif
  return block_sums<kSumZ, kSumS, false, I>(x, n, m, it, ahead);
}

// fp64 (gradcheck, oracle-grade runs): the scalar online update of logprob_math.h, element by element.
template <bool kSumZ, bool kSumS, CpuIsa I>
RC_FORCEINLINE RowSummary<double> block_summary(const double* x, int64_t n, double it, const AheadBlock&) {
  RowSummary<double> r = summary_empty<double>();
  for (int64_t j = 0; j < n; ++j) summary_add<kSumZ>(r, x[j], it);
  return r;
}

// base - p w, or base where p = 2^t is 0 (an element without mass: w may be -inf there).
template <typename VF>
RC_FORCEINLINE VF base_minus_exp2_times(VF t, VF w, VF base) {
  const VF p = exp2_lanes(t);
  return p > 0.f ? base - p * w : base;
}
#if RC_CPU_HAS_AVX512_PATH
RC_CPU_AVX512_INLINE v16f base_minus_exp2_times(v16f t, v16f w, v16f base) {
  __mmask16 has_mass;
  const v16f p = exp2_lanes(t, &has_mass);
  return (v16f)_mm512_mask3_fnmadd_ps((__m512)p, (__m512)w, (__m512)base, has_mass);
}
#endif

// In place over the block buffer: x -> d/dx of (g_lp logp + g_h H + g_m mean_logp) without the target term
// (the caller adds it at the target column). With zm = (x - M)/T and p = e^{zm - log D} = 2^t,
// t = (x - M) c - log2(D), c = log2(e)/T, the gradient (g_m/V - (g_lp + g_m) p - g_h p (zm - mean_z)) / T is
// base - p w with base = g_m/(V T) and w = ((g_lp + g_m) + g_h (zm - mean_z)) / T. The logits after the block are
// prefetched as in the forward, so the next block's copy into the buffer reads cache (fp32 in-place backward on a
// Zen 5 core: 11.5 -> 6.3 ms for 2048 x 32000, faster than a plain copy of the shard).
template <CpuIsa I>
RC_FORCEINLINE void block_grad(float* x, int64_t n, float max_x, float log_d, float mean_z, float g_lp_plus_m,
                               float g_h, float g_m_over_v, float it, const AheadBlock& ahead) {
  using VF = isa_vec<I>;
  constexpr int64_t kLanes = lanes_of<VF>();
  constexpr float kLog2e = 1.44269504088896341f;
  const float c = it * kLog2e, log2_d = log_d * kLog2e;
  const float base = g_m_over_v * it, w_const = g_lp_plus_m * it, w_slope = g_h * it;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    ahead.prefetch(i);
    const VF u = load_vec<VF>(x + i) - max_x;
    const VF w = (u * it - mean_z) * w_slope + w_const;
    store_vec(x + i, base_minus_exp2_times(u * c - log2_d, w, VF{} + base));
  }
  for (; i < n; ++i) {
    const float u = x[i] - max_x;
    const float p = exp2_scalar<VF>(u * c - log2_d);
    x[i] = p > 0.f ? base - p * ((u * it - mean_z) * w_slope + w_const) : base;
  }
}

template <CpuIsa I>
RC_FORCEINLINE void block_grad(double* x, int64_t n, double max_x, double log_d, double mean_z, double g_lp_plus_m,
                               double g_h, double g_m_over_v, double it, const AheadBlock&) {
  for (int64_t i = 0; i < n; ++i) {
    const double zm = (x[i] - max_x) * it;
    const double p = std::exp(zm - log_d);
    x[i] = ((g_m_over_v - g_lp_plus_m * p) - g_h * mass_times(p, zm - mean_z)) * it;
  }
}

// A block of logits into the accumulation buffer (16-bit types widened a vector at a time), and a block of
// gradients back to the logits dtype.
template <typename VF, typename scalar_t, typename acc_t>
RC_FORCEINLINE void load_block(const scalar_t* x, acc_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<acc_t>(x[i]);
}
template <typename VF>
RC_FORCEINLINE void load_block(const at::BFloat16* x, float* out, int64_t n) {
  widen_16bit<Bf16Bits, VF>(reinterpret_cast<const uint16_t*>(x), out, n);
}
template <typename VF>
RC_FORCEINLINE void load_block(const at::Half* x, float* out, int64_t n) {
  widen_16bit<HalfBits, VF>(reinterpret_cast<const uint16_t*>(x), out, n);
}
template <typename VF, typename scalar_t, typename acc_t>
RC_FORCEINLINE void store_block(const acc_t* buf, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(buf[i]);
}
template <typename VF>
RC_FORCEINLINE void store_block(const float* buf, at::BFloat16* out, int64_t n) {
  narrow_bf16<VF>(buf, reinterpret_cast<uint16_t*>(out), n);
}

// One row's record. Multiversioned per dtype pair via the non-template wrappers below.
template <CpuIsa I, typename scalar_t, typename acc_t, bool kSumZ, bool kSumS>
RC_FORCEINLINE void row_stats_one_row(const RowStatsParams<scalar_t, acc_t>& p, int64_t row) {
  acc_t buf[kBlock];
  const scalar_t* x = p.logits + row * p.logits_row_stride;
  RowSummary<acc_t> st = summary_empty<acc_t>();
  constexpr int64_t kCols = forward_block_cols<scalar_t>();
  for (int64_t c0 = 0; c0 < p.valid_cols; c0 += kCols) {
    const int64_t n = std::min(kCols, p.valid_cols - c0);
    const AheadBlock ahead = AheadBlock::of(x + c0);
    RowSummary<acc_t> block;
    if constexpr (std::is_same<scalar_t, acc_t>::value || std::is_same<scalar_t, at::BFloat16>::value) {
      block = block_summary<kSumZ, kSumS, I>(x + c0, n, p.inv_temperature, ahead);  // summarised where it lies
    } else {
      load_block<isa_vec<I>>(x + c0, buf, n);
      block = block_summary<kSumZ, kSumS, I>(static_cast<const acc_t*>(buf), n, p.inv_temperature, ahead);
    }
    st = summary_merge(st, block, p.inv_temperature);
  }
  write_row_record(p, row, x, st);
}

template <CpuIsa I, typename scalar_t, typename acc_t>
RC_FORCEINLINE void backward_one_row(const LogprobBackwardParams<scalar_t, acc_t>& p, int64_t row) {
  acc_t buf[kBlock];
  const scalar_t* x = p.logits + row * p.logits_row_stride;
  scalar_t* gx = p.grad_logits + row * p.grad_row_stride;
  const int64_t t = p.target[row];
  if (t == p.ignore_index) {
    std::fill(gx, gx + p.local_vocab, scalar_t(0));
    return;
  }
  const acc_t* state = p.row_state + row * kRowStateCols;
  const acc_t max_x = state[kStateMax], log_d = state[kStateLogSumExp], mean_z = state[kStateMeanZ];
  const acc_t g_lp = p.grad_logp ? p.grad_logp[row] : acc_t(0);
  const acc_t g_h = p.grad_entropy ? p.grad_entropy[row] : acc_t(0);
  const acc_t g_m = p.grad_mean_logp ? p.grad_mean_logp[row] : acc_t(0);
  const acc_t g_m_over_v = g_m / static_cast<acc_t>(p.vocab_size);
  const acc_t it = p.inv_temperature;
  const int64_t local = t - p.vocab_start;
  for (int64_t c0 = 0; c0 < p.valid_cols; c0 += kBlock) {
    const int64_t n = std::min(kBlock, p.valid_cols - c0);
    load_block<isa_vec<I>>(x + c0, buf, n);  // read the whole block before writing: grad may alias logits
    const bool has_target = local >= c0 && local < c0 + n;
    const acc_t x_target = has_target ? buf[local - c0] : acc_t(0);
    block_grad<I>(buf, n, max_x, log_d, mean_z, g_lp + g_m, g_h, g_m_over_v, it, AheadBlock::of(x + c0));
    if (has_target) {
      const acc_t zm = (x_target - max_x) * it;
      const acc_t prob = exp_acc(zm - log_d);
      buf[local - c0] = logprob_grad_element(zm, prob, true, g_lp, g_h, g_m_over_v, g_m, mean_z) * it;
    }
    store_block<isa_vec<I>>(buf, gx + c0, n);
  }
  std::fill(gx + p.valid_cols, gx + p.local_vocab, scalar_t(0));  // padding columns
}

// Non-template entry points, one copy per ISA (one per dtype pair): AVX-512 (16 lanes), AVX2 + FMA (8) and the
// x86-64 baseline (4), the widest the CPU runs picked by cpu::cpu_isa() (ROLLOUT_CORR_CPU_ISA=avx2 or baseline
// narrows it, to compare the paths in one build).
#define RC_DEFINE_ROW_KERNELS_AT(scalar_t, acc_t, suffix, ATTR, ISA)                                         \
  ATTR void row_stats_rows_##suffix(const RowStatsParams<scalar_t, acc_t>& p, bool sum_z, bool sum_s,       \
                                    int64_t begin, int64_t end) {                                            \
    if (sum_z && sum_s) {                                                                                    \
      for (int64_t r = begin; r < end; ++r) row_stats_one_row<ISA, scalar_t, acc_t, true, true>(p, r);       \
    } else if (sum_z) {                                                                                      \
      for (int64_t r = begin; r < end; ++r) row_stats_one_row<ISA, scalar_t, acc_t, true, false>(p, r);      \
    } else if (sum_s) {                                                                                      \
      for (int64_t r = begin; r < end; ++r) row_stats_one_row<ISA, scalar_t, acc_t, false, true>(p, r);      \
    } else {                                                                                                 \
      for (int64_t r = begin; r < end; ++r) row_stats_one_row<ISA, scalar_t, acc_t, false, false>(p, r);     \
    }                                                                                                        \
  }                                                                                                          \
  ATTR void backward_rows_##suffix(const LogprobBackwardParams<scalar_t, acc_t>& p, int64_t begin,           \
                                   int64_t end) {                                                            \
    for (int64_t r = begin; r < end; ++r) backward_one_row<ISA>(p, r);                                       \
  }
#define RC_DEFINE_ROW_KERNELS(scalar_t, acc_t, suffix)                                                       \
  RC_DEFINE_ROW_KERNELS_AT(scalar_t, acc_t, suffix##_baseline, , CpuIsa::kBaseline)                         \
  RC_DEFINE_ROW_KERNELS_AT(scalar_t, acc_t, suffix##_avx2, RC_CPU_AVX2, CpuIsa::kAvx2)                      \
  RC_DEFINE_ROW_KERNELS_AT(scalar_t, acc_t, suffix##_avx512, RC_CPU_AVX512, CpuIsa::kAvx512)                \
  inline void row_stats_rows(const RowStatsParams<scalar_t, acc_t>& p, bool sum_z, bool sum_s, int64_t b,    \
                             int64_t e) {                                                                    \
    switch (cpu_isa()) {                                                                                     \
      case CpuIsa::kAvx512: return row_stats_rows_##suffix##_avx512(p, sum_z, sum_s, b, e);                  \
      case CpuIsa::kAvx2: return row_stats_rows_##suffix##_avx2(p, sum_z, sum_s, b, e);                      \
      default: return row_stats_rows_##suffix##_baseline(p, sum_z, sum_s, b, e);                             \
    }                                                                                                        \
  }                                                                                                          \
  inline void backward_rows(const LogprobBackwardParams<scalar_t, acc_t>& p, int64_t b, int64_t e) {         \
    switch (cpu_isa()) {                                                                                     \
      case CpuIsa::kAvx512: return backward_rows_##suffix##_avx512(p, b, e);                                 \
      case CpuIsa::kAvx2: return backward_rows_##suffix##_avx2(p, b, e);                                     \
      default: return backward_rows_##suffix##_baseline(p, b, e);                                            \
    }                                                                                                        \
  }

RC_DEFINE_ROW_KERNELS(float, float, f32)
RC_DEFINE_ROW_KERNELS(double, double, f64)
RC_DEFINE_ROW_KERNELS(at::BFloat16, float, bf16)
RC_DEFINE_ROW_KERNELS(at::Half, float, f16)
#undef RC_DEFINE_ROW_KERNELS
#undef RC_DEFINE_ROW_KERNELS_AT

// Rows per task: enough columns per task to amortize scheduling.
inline int64_t grain_for(int64_t local_vocab) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, local_vocab));
}

at::Tensor vocab_row_stats_cpu(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z,
                               bool with_entropy) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  const auto target_c = target.contiguous();
  auto record = new_shard_record(logits, with_sum_z);
  const ShardHeaderParams h = make_shard_header_params(record, target_c, logits, vocab_start, vocab_size,
                                                       inv_temperature, ignore_index, with_sum_z, with_entropy);
  uint64_t hash = 0;  // wrapping sum: order-independent, so the same on every backend
  for (int64_t r = 0; r < h.rows; ++r) hash += target_fingerprint(r, h.target[r]);
  write_shard_header(h, hash);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_row_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_row_stats_params<scalar_t, acc_t>(logits, target_c, record, vocab_start, vocab_size,
                                                          inv_temperature, ignore_index, with_sum_z);
    at::parallel_for(0, p.rows, grain_for(p.local_vocab),
                     [&](int64_t b, int64_t e) { row_stats_rows(p, with_sum_z, with_entropy, b, e); });
  });
  return record;
}

// The first row (lowest index) that failed for each reason, for the error message.
struct FirstFailures {
  std::atomic<int64_t> row[kMergeStatusSlots];
  FirstFailures() {
    for (auto& r : row) r.store(std::numeric_limits<int64_t>::max());
  }
  void note(int slot, int64_t r) {
    int64_t cur = row[slot].load();
    while (r < cur && !row[slot].compare_exchange_weak(cur, r)) {
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_row_stats_cpu(
    const at::Tensor& gathered, const at::Tensor& target, int64_t ignore_index, int64_t vocab_size,
    double inv_temperature, bool with_sum_z) {
  MergeIO io = prepare_merge(gathered, target, vocab_size, inv_temperature, with_sum_z);
  const int64_t shard_bytes = io.gathered.size(1) * static_cast<int64_t>(io.gathered.element_size());
  const LayoutCheck layout = check_shard_headers(io.gathered.const_data_ptr(), io.gathered.size(0), shard_bytes,
                                                 vocab_size);
  TORCH_CHECK(layout.code == kLayoutOk, layout_error_message(layout, io.gathered, vocab_size));
  const int64_t rows = io.target.size(0);
  FirstFailures fails;
  AT_DISPATCH_FLOATING_TYPES(io.gathered.scalar_type(), "merge_row_stats_cpu", [&] {
    const auto p = make_merge_params<scalar_t>(io, ignore_index, vocab_size, inv_temperature, false);
    at::parallel_for(0, rows, 4096, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int code = merge_one_row(p, r);
        if (code != 0) fails.note(code - 1, r);
      }
    });
  });
  const int64_t none = std::numeric_limits<int64_t>::max();
  const int64_t bad_target = fails.row[kStatusTarget].load();
  TORCH_CHECK(bad_target == none, "target holds ids outside [0, vocab_size=", vocab_size,
              ") that are not ignore_index=", ignore_index, ": target.flatten()[", bad_target,
              "] = ", io.target.const_data_ptr<int64_t>()[bad_target]);
  const int64_t bad_value = fails.row[kStatusNonFinite].load();
  TORCH_CHECK(bad_value == none, "logits hold NaN or +inf in row ", bad_value,
              " of the flattened logits (logits.reshape(-1, V_local)[", bad_value,
              "], on this rank or another rank of the tensor-parallel group); rows whose target is ignore_index "
              "are exempt");
  const int64_t no_mass = fails.row[kStatusNoFiniteLogit].load();
  TORCH_CHECK(no_mass == none, "every logit of row ", no_mass,
              " (logits.reshape(-1, V_local)[", no_mass, "], over all tensor-parallel shards) is -inf: its "
              "softmax is undefined; give such positions target = ignore_index");
  return {io.logp, io.entropy, io.mean_logp, io.row_state, io.status};
}

void logprob_backward_into_cpu(const at::Tensor& grad_logits, const c10::optional<at::Tensor>& grad_logp,
                               const c10::optional<at::Tensor>& grad_entropy,
                               const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                               const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index) {
  const auto in = prepare_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                                   vocab_size, inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "logprob_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_backward_params<scalar_t, acc_t>(grad_logits, logits, in.target, in.state, in.g_lp, in.g_h,
                                                         in.g_m, vocab_start, vocab_size, inv_temperature,
                                                         ignore_index);
    at::parallel_for(0, p.rows, grain_for(p.local_vocab), [&](int64_t b, int64_t e) { backward_rows(p, b, e); });
  });
}

at::Tensor logprob_backward_cpu(const c10::optional<at::Tensor>& grad_logp,
                                const c10::optional<at::Tensor>& grad_entropy,
                                const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature, int64_t ignore_index) {
  // From the one-block cache (reused_buffer.h): a fresh [N, V_local] buffer would cost a page fault per 4 KiB.
  at::Tensor grad = cpu::reused_empty({logits.size(0), logits.size(1)}, logits.scalar_type(),
                                     cpu::ReusedUse::kLogprobGrad);
  logprob_backward_into_cpu(grad, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index);
  return grad;
}

void logprob_backward_inplace_cpu(const at::Tensor& logits, const c10::optional<at::Tensor>& grad_logp,
                                  const c10::optional<at::Tensor>& grad_entropy,
                                  const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& target,
                                  const at::Tensor& row_state, int64_t vocab_start, int64_t vocab_size,
                                  double inv_temperature, int64_t ignore_index) {
  check_inplace_target(logits);
  logprob_backward_into_cpu(logits, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index);
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("vocab_row_stats", &vocab_row_stats_cpu);
  m.impl("merge_row_stats", &merge_row_stats_cpu);
  m.impl("logprob_backward", &logprob_backward_cpu);
  m.impl("logprob_backward_", &logprob_backward_inplace_cpu);
}

}  // namespace rollout_corr
