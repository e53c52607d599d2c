// CPU kernels of the vocab-parallel log-prob op (DESIGN §2).
//
// Rows run in parallel (at::parallel_for). Each row is streamed once in blocks of kBlock columns: a block is
// converted to the accumulation type into a small buffer that stays in L1, its max is taken, then exp and
// the two sums run over the buffer, and the block summary is merged into the row's (online softmax). So the
// shard is read from memory once, with one exp per element. The inner loops are written over fixed-width
// lane arrays so the compiler vectorizes them; `target_clones` builds an AVX2 copy picked at load time.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "logprob_host.h"
#include "logprob_math.h"
#include "logprob_params.h"
#include "vec_math.h"

namespace rollout_corr {
namespace {
using namespace cpu;

constexpr int64_t kBlock = 512;  // columns per block: 2 KiB of fp32, comfortably L1-resident

// Block summary (max, sum exp(z - max), sum exp(z - max) z, sum z) of n fp32 values.
RC_FORCEINLINE void block_summary(const float* z, int64_t n, float& m, float& d, float& s, float& sum_z) {
  constexpr int64_t kStep = kVec * kUnroll;
  int64_t i = 0;
  v8f vm[kUnroll];
  for (int k = 0; k < kUnroll; ++k) vm[k] = v8f{} - INFINITY;
  for (; i + kStep <= n; i += kStep)
    for (int k = 0; k < kUnroll; ++k) {
      const v8f a = load_v8(z + i + k * kVec);
      vm[k] = a > vm[k] ? a : vm[k];
    }
  m = -INFINITY;
  for (int k = 0; k < kUnroll; ++k) m = std::max(m, hmax(vm[k]));
  for (int64_t j = i; j < n; ++j) m = std::max(m, z[j]);

  v8f vd[kUnroll], vs[kUnroll], vz[kUnroll];
  for (int k = 0; k < kUnroll; ++k) vd[k] = vs[k] = vz[k] = v8f{};
  for (i = 0; i + kStep <= n; i += kStep)
    for (int k = 0; k < kUnroll; ++k) {
      const v8f a = load_v8(z + i + k * kVec);
      const v8f e = exp_v8(a - m);
      vd[k] += e;
      vs[k] += e * a;
      vz[k] += a;
    }
  d = s = sum_z = 0.f;
  for (int k = 0; k < kUnroll; ++k) {
    d += hsum(vd[k]);
    s += hsum(vs[k]);
    sum_z += hsum(vz[k]);
  }
  for (int64_t j = i; j < n; ++j) {
    const float e = exp_acc(z[j] - m);
    d += e;
    s += e * z[j];
    sum_z += z[j];
  }
}

RC_FORCEINLINE void block_summary(const double* z, int64_t n, double& m, double& d, double& s, double& sum_z) {
  m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, z[j]);
  d = s = sum_z = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double e = std::exp(z[j] - m);
    d += e;
    s += e * z[j];
    sum_z += z[j];
  }
}

// In-place over the block buffer: z -> d/dz of (g_lp logp + g_h H + g_m mean_logp), times 1/T, without the
// target term (the caller adds g_lp * it at the target column).
RC_FORCEINLINE void block_grad(float* z, int64_t n, float lse, float mean_z, float g_lp_plus_m, float g_h,
                               float g_m_over_v, float it) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const v8f a = load_v8(z + i);
    const v8f p = exp_v8(a - lse);
    store_v8(z + i, ((g_m_over_v - g_lp_plus_m * p) - g_h * p * (a - mean_z)) * it);
  }
  for (; i < n; ++i) {
    const float p = exp_acc(z[i] - lse);
    z[i] = ((g_m_over_v - g_lp_plus_m * p) - g_h * p * (z[i] - mean_z)) * it;
  }
}

RC_FORCEINLINE void block_grad(double* z, int64_t n, double lse, double mean_z, double g_lp_plus_m, double g_h,
                               double g_m_over_v, double it) {
  for (int64_t i = 0; i < n; ++i) {
    const double p = std::exp(z[i] - lse);
    z[i] = ((g_m_over_v - g_lp_plus_m * p) - g_h * p * (z[i] - mean_z)) * it;
  }
}

template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void load_scaled(const scalar_t* x, acc_t* z, int64_t n, acc_t inv_t) {
  for (int64_t i = 0; i < n; ++i) z[i] = static_cast<acc_t>(x[i]) * inv_t;
}

// One row's record. Multiversioned per dtype pair via the non-template wrappers below.
template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void row_stats_one_row(const RowStatsParams<scalar_t, acc_t>& p, int64_t row) {
  acc_t buf[kBlock];
  const scalar_t* x = p.logits + row * p.logits_row_stride;
  SoftmaxStats<acc_t> st = softmax_stats_empty<acc_t>();
  acc_t sum_z = 0;
  for (int64_t c0 = 0; c0 < p.valid_cols; c0 += kBlock) {
    const int64_t n = std::min(kBlock, p.valid_cols - c0);
    load_scaled(x + c0, buf, n, p.inv_temperature);
    acc_t bm, bd, bs, bz;
    block_summary(buf, n, bm, bd, bs, bz);
    st = softmax_stats_merge(st, SoftmaxStats<acc_t>{bm, bd, bs});
    sum_z += bz;
  }
  write_row_record(p, row, x, st, sum_z);
}

template <typename scalar_t, typename acc_t>
RC_FORCEINLINE void backward_one_row(const LogprobBackwardParams<scalar_t, acc_t>& p, int64_t row) {
  acc_t buf[kBlock];
  const scalar_t* x = p.logits + row * p.logits_row_stride;
  scalar_t* gx = p.grad_logits + row * p.grad_row_stride;
  const int64_t t = p.target[row];
  if (t == p.ignore_index) {
    std::fill(gx, gx + p.local_vocab, scalar_t(0));
    return;
  }
  const acc_t lse = p.row_state[2 * row + kStateLse];
  const acc_t mean_z = p.row_state[2 * row + kStateMeanZ];
  const acc_t g_lp = p.grad_logp ? p.grad_logp[row] : acc_t(0);
  const acc_t g_h = p.grad_entropy ? p.grad_entropy[row] : acc_t(0);
  const acc_t g_m = p.grad_mean_logp ? p.grad_mean_logp[row] : acc_t(0);
  const acc_t g_m_over_v = g_m / static_cast<acc_t>(p.vocab_size);
  const acc_t it = p.inv_temperature;
  const int64_t local = t - p.vocab_start;
  for (int64_t c0 = 0; c0 < p.valid_cols; c0 += kBlock) {
    const int64_t n = std::min(kBlock, p.valid_cols - c0);
    load_scaled(x + c0, buf, n, it);  // read the whole block before writing: grad may alias logits
    const bool has_target = local >= c0 && local < c0 + n;
    const acc_t z_target = has_target ? buf[local - c0] : acc_t(0);
    block_grad(buf, n, lse, mean_z, g_lp + g_m, g_h, g_m_over_v, it);
    if (has_target) {
      const acc_t prob = exp_acc(z_target - lse);
      buf[local - c0] = logprob_grad_element(z_target, prob, true, g_lp, g_h, g_m_over_v, g_m, mean_z) * it;
    }
    for (int64_t i = 0; i < n; ++i) gx[c0 + i] = static_cast<scalar_t>(buf[i]);
  }
  std::fill(gx + p.valid_cols, gx + p.local_vocab, scalar_t(0));  // padding columns
}

// Non-template entry points so that target_clones can multiversion them (one per dtype).
#define RC_DEFINE_ROW_KERNELS(scalar_t, acc_t, suffix)                                                      \
  RC_CPU_MULTIVERSION void row_stats_rows_##suffix(const RowStatsParams<scalar_t, acc_t>& p, int64_t begin, \
                                                   int64_t end) {                                          \
    for (int64_t r = begin; r < end; ++r) row_stats_one_row(p, r);                                         \
  }                                                                                                         \
  RC_CPU_MULTIVERSION void backward_rows_##suffix(const LogprobBackwardParams<scalar_t, acc_t>& p,          \
                                                  int64_t begin, int64_t end) {                             \
    for (int64_t r = begin; r < end; ++r) backward_one_row(p, r);                                          \
  }

RC_DEFINE_ROW_KERNELS(float, float, f32)
RC_DEFINE_ROW_KERNELS(double, double, f64)
RC_DEFINE_ROW_KERNELS(at::BFloat16, float, bf16)
RC_DEFINE_ROW_KERNELS(at::Half, float, f16)
#undef RC_DEFINE_ROW_KERNELS

inline void row_stats_rows(const RowStatsParams<float, float>& p, int64_t b, int64_t e) { row_stats_rows_f32(p, b, e); }
inline void row_stats_rows(const RowStatsParams<double, double>& p, int64_t b, int64_t e) { row_stats_rows_f64(p, b, e); }
inline void row_stats_rows(const RowStatsParams<at::BFloat16, float>& p, int64_t b, int64_t e) { row_stats_rows_bf16(p, b, e); }
inline void row_stats_rows(const RowStatsParams<at::Half, float>& p, int64_t b, int64_t e) { row_stats_rows_f16(p, b, e); }
inline void backward_rows(const LogprobBackwardParams<float, float>& p, int64_t b, int64_t e) { backward_rows_f32(p, b, e); }
inline void backward_rows(const LogprobBackwardParams<double, double>& p, int64_t b, int64_t e) { backward_rows_f64(p, b, e); }
inline void backward_rows(const LogprobBackwardParams<at::BFloat16, float>& p, int64_t b, int64_t e) { backward_rows_bf16(p, b, e); }
inline void backward_rows(const LogprobBackwardParams<at::Half, float>& p, int64_t b, int64_t e) { backward_rows_f16(p, b, e); }

// Rows per task: enough columns per task to amortize scheduling.
inline int64_t grain_for(int64_t local_vocab) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, local_vocab)); }

at::Tensor vocab_row_stats_cpu(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index, bool with_sum_z) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  const auto target_c = target.contiguous();
  auto stats = new_row_stats(logits, with_sum_z);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_row_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_row_stats_params<scalar_t, acc_t>(logits, target_c, stats, vocab_start, vocab_size,
                                                          inv_temperature, ignore_index);
    at::parallel_for(0, p.rows, grain_for(p.local_vocab), [&](int64_t b, int64_t e) { row_stats_rows(p, b, e); });
  });
  return stats;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_row_stats_cpu(const at::Tensor& stats,
                                                                               const at::Tensor& target,
                                                                               int64_t ignore_index,
                                                                               int64_t vocab_size) {
  const MergeIO io = prepare_merge(stats, target, vocab_size);
  const int64_t rows = stats.size(1);
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "merge_row_stats_cpu", [&] {
    const auto p = make_merge_params<scalar_t>(io.stats, io.target, io.logp, io.entropy, io.mean_logp, io.row_state,
                                               ignore_index, vocab_size);
    at::parallel_for(0, rows, 4096, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) merge_one_row(p, r);
    });
  });
  return {io.logp, io.entropy, io.mean_logp, io.row_state};
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
  auto grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  logprob_backward_into_cpu(grad, grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start,
                            vocab_size, inv_temperature, ignore_index);
  return grad;
}

void logprob_backward_inplace_cpu(const at::Tensor& logits, const c10::optional<at::Tensor>& grad_logp,
                                  const c10::optional<at::Tensor>& grad_entropy,
                                  const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& target,
                                  const at::Tensor& row_state, int64_t vocab_start, int64_t vocab_size,
                                  double inv_temperature, int64_t ignore_index) {
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
