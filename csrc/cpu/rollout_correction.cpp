// CPU kernels of the rollout-correction op (docs/rollout_correction.md): two passes over [B, T], the per-token and
// per-sequence
// math of rollout_correction_math.h (the same functions the CUDA kernels call).
//
// Rows run in parallel (at::parallel_for). Within a row, tokens are loaded a chunk at a time from the dtype-tagged
// input views (one dtype switch per chunk, unit-stride conversion loops) and evaluated 8 at a time: the token
// functions are instantiated with V = 8 x fp32 (GCC vector extensions, the project's SIMD exp of vec_math.h,
// multiversioned for AVX2) for fp32 accumulation and with V = double for fp64 inputs. A chunk's tail is padded
// with mask 0, which the token math neutralises, so there is no scalar tail loop. The metric sums are fp64 partials
// of fixed blocks of rows (a size set by the row length alone), merged in block order: the same bits at every thread
// count and schedule. Maxima and the histogram (integer counts) are order-free and stay per thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "reused_buffer.h"
#include "rollout_correction_host.h"
#include "rollout_correction_math.h"
#include "vec_math.h"

namespace rollout_corr {
namespace rc {

// The token math on CPU SIMD lanes of fp32 (8 lanes: AVX2 / baseline; 16 lanes: AVX-512).
template <typename VF, typename VI>
struct SimdLaneMath {
  using Cond = VI;
  static constexpr int kWidth = sizeof(VF) / sizeof(float);
  static RC_FORCEINLINE VF splat(double c) { return VF{} + static_cast<float>(c); }
  static RC_FORCEINLINE VI all_false() { return VI{}; }
  using Scalar = float;
  // The token math takes exp only of clamp20'd log-ratios: no clamps needed.
  static RC_FORCEINLINE VF exp(VF x) { return cpu::exp_vec_bounded<VF, VI>(x); }
  static RC_FORCEINLINE VF exp_exact(VF x) {
    for (int l = 0; l < kWidth; ++l) x[l] = std::exp(x[l]);
    return x;
  }
  static RC_FORCEINLINE bool any(VI c) { return cpu::any_lane(c); }
  // Histogram bins of the lanes (hist_index's arithmetic, vectorized; lanes are clamped log-weights, so f >= 0 and
  // truncation is the floor).
  static RC_FORCEINLINE VI hist_bins(VF log_w) {
    const VF f = (log_w - static_cast<float>(k_hist_lo)) * static_cast<float>(k_hist_bins / (k_hist_hi - k_hist_lo));
    const VF top = VF{} + static_cast<float>(kHistBins - 1);
    const VF safe = f > 0.0f ? (f < top ? f : top) : VF{};  // NaN -> 0
    return __builtin_convertvector(safe, VI);
  }
};
template <>
struct LaneMath<cpu::v8f> : SimdLaneMath<cpu::v8f, cpu::v8i> {};
template <>
struct LaneMath<cpu::v16f> : SimdLaneMath<cpu::v16f, cpu::v16i> {};

}  // namespace rc

namespace {

constexpr int kChunk = 64;  // tokens per load: 8 vectors, small enough to stay in L1 with every input
// Lane accumulators are fp32; every kFoldChunks chunks (32 tokens per lane) they are folded into fp64 row sums, so
// a row's sums carry the rounding of a 32-term fp32 sum, not of a T/8-term one (sum w^2 - (sum w)^2 / n cancels).
constexpr int kFoldChunks = 4;

// Lane helpers: a vector type V of acc_t lanes, or acc_t itself (one lane).
template <typename V, typename acc_t>
struct Lanes {
  static constexpr int kWidth = sizeof(V) / sizeof(acc_t);
  static RC_FORCEINLINE V load(const acc_t* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
  }
  static RC_FORCEINLINE void store(acc_t* p, V v) { std::memcpy(p, &v, sizeof(V)); }
  static RC_FORCEINLINE acc_t lane(const V& v, int l) {
    if constexpr (kWidth == 1) {
      return v;
    } else {
      return v[l];
    }
  }
  static RC_FORCEINLINE double sum(const V& v) {
    if constexpr (std::is_same_v<V, cpu::v8f>) {
      return cpu::hsum_f64(v);
    } else {
      double s = 0;
      for (int l = 0; l < kWidth; ++l) s += static_cast<double>(lane(v, l));
      return s;
    }
  }
  static RC_FORCEINLINE acc_t max(const V& v) {
    acc_t m = lane(v, 0);
    for (int l = 1; l < kWidth; ++l) m = lane(v, l) > m ? lane(v, l) : m;
    return m;
  }
};

// One chunk of a row's inputs as acc_t, padded with mask 0 past `n`: log-probs already in acc_t with unit stride
// are read in place, anything else is converted into the chunk's buffers.
//
// The mask is read first. A chunk whose mask is 0 everywhere (the padding of a right-padded batch, a third of the
// tokens of a typical RL batch) holds no valid token, and the token math adds exactly 0 to every sum and -inf to
// every max for an invalid lane, so skipping it changes no bit of any result: load() then reads no log-prob and
// returns false, and the caller only writes the chunk's zero outputs.
template <typename V, typename acc_t>
struct Chunk {
  alignas(64) acc_t a_buf[kChunk];
  alignas(64) acc_t q_buf[kChunk];
  alignas(64) acc_t m[kChunk];
  const acc_t* a;
  const acc_t* q;
  RC_FORCEINLINE bool load(const RolloutParams<acc_t>& p, int64_t row, int64_t col0, int n) {
    view_load_chunk<kChunk>(p.mask, row, col0, n, m);
    for (int k = n; k < kChunk; ++k) m[k] = acc_t(0);
    if (!any_nonzero(m)) return false;
    a = load_one(p.log_prob, row, col0, n, a_buf);
    q = load_one(p.rollout_log_prob, row, col0, n, q_buf);
    return true;
  }
  // Whether some mask value is not 0 (compared as numbers: -0.0 is 0, NaN is not), a lane vector at a time.
  static RC_FORCEINLINE bool any_nonzero(const acc_t* mv) {
    using Ln = Lanes<V, acc_t>;
    auto nonzero = Ln::load(mv) != rc::splat<V>(0);
    for (int k = Ln::kWidth; k < kChunk; k += Ln::kWidth) nonzero = nonzero | (Ln::load(mv + k) != rc::splat<V>(0));
    return rc::LaneMath<V>::any(nonzero);
  }
  static RC_FORCEINLINE const acc_t* load_one(const TokenView& v, int64_t row, int64_t col0, int n, acc_t* buf) {
    if (n == kChunk) {
      if (const acc_t* direct = view_row_ptr<acc_t>(v, row, col0)) return direct;
    }
    view_load_chunk<kChunk>(v, row, col0, n, buf);
    for (int k = n; k < kChunk; ++k) buf[k] = acc_t(0);
    return buf;
  }
};

// ---- pass 1 ----------------------------------------------------------------------------------------------------

template <typename V, typename acc_t, int kTokenCrit>
RC_FORCEINLINE void seq_stats_rows(const RolloutParams<acc_t>& p, int64_t begin, int64_t end) {
  using Ln = Lanes<V, acc_t>;
  const rc::Config<acc_t> cfg = p.cfg;  // a local copy: no store in the loop can alias it, so nothing is reloaded
  Chunk<V, acc_t> ch;
  for (int64_t row = begin; row < end; ++row) {
    const SeqSpan sp = seq_span(p, row);
    rc::SeqAcc<V> acc;
    rc::seq_acc_init(acc);
    double row_sum[rc::seq::kNumSums] = {};
    int chunks = 0;
    for (int64_t t0 = 0; t0 < sp.len; t0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, sp.len - t0));
      if (ch.load(p, sp.row, sp.col0 + t0, n)) {
        for (int k = 0; k < n; k += Ln::kWidth)
          rc::seq_stats_token<kTokenCrit>(cfg, Ln::load(ch.a + k), Ln::load(ch.q + k), Ln::load(ch.m + k), acc);
      }
      if (++chunks == kFoldChunks || t0 + kChunk >= sp.len) {
        for (int k = 0; k < rc::seq::kNumSums; ++k) {
          row_sum[k] += Ln::sum(acc.sum[k]);
          acc.sum[k] = rc::splat<V>(0);
        }
        chunks = 0;
      }
    }
    acc_t* out = p.seq_stats + row * rc::seq::kCols;
    for (int k = 0; k < rc::seq::kNumSums; ++k) out[k] = static_cast<acc_t>(row_sum[k]);
    for (int k = rc::seq::kNumSums; k < rc::seq::kCols; ++k) out[k] = Ln::max(rc::seq_max(acc, k));
  }
}

// ---- pass 2 ----------------------------------------------------------------------------------------------------

// Move the lane sums of `acc` into the fp64 row sums and zero them (the maxima stay in the lanes).
template <typename V, typename acc_t>
RC_FORCEINLINE void fold_lane_sums(rc::TokenAcc<V>& acc, rc::TokenAcc<double>& row, int num_token_crit) {
  using Ln = Lanes<V, acc_t>;
  for (int k = 0; k < rc::tok_sum::kCount; ++k) {
    row.sum[k] += Ln::sum(acc.sum[k]);
    acc.sum[k] = rc::splat<V>(0);
  }
  for (int j = 0; j < num_token_crit; ++j) {
    for (int k = 0; k < rc::tok_crit_sum::kCount; ++k) {
      row.crit_sum[j][k] += Ln::sum(acc.crit_sum[j][k]);
      acc.crit_sum[j][k] = rc::splat<V>(0);
    }
  }
}

// Count the flagged lanes of a token-pass result into the histogram (branch-free: unflagged lanes add 0).
template <typename V, typename acc_t>
RC_FORCEINLINE void add_to_histogram(const rc::TokenOut<V>& o, uint32_t* hist) {
  if constexpr (std::is_arithmetic_v<V>) {
    if (o.hist) hist[rc::hist_index(o.log_w)] += 1u;
  } else {
    const auto bins = rc::LaneMath<V>::hist_bins(o.log_w);
    for (int l = 0; l < Lanes<V, acc_t>::kWidth; ++l) hist[bins[l]] += static_cast<uint32_t>(o.hist[l] & 1);
  }
}

// Per-thread partial buffers: SUM and MAX vectors. The SUM vector's histogram bins (whole token counts, exact in
// fp64) accumulate over the thread's rows; its other slots are a block's scratch (rows_block below). The token
// histogram counts in uint32 (16 KiB, L1-resident; exact up to 2^32 tokens per thread), folded into the fp64 SUM
// vector at the end.
struct Partials {
  std::vector<double> sums, maxes;
  std::vector<uint32_t> hist;
  Partials(int64_t ns, int64_t nm)
      : sums(ns, 0.0), maxes(nm, -std::numeric_limits<double>::infinity()), hist(rc::kHistBins, 0u) {}
};

template <typename V, typename acc_t, int kTokenCrit>
RC_FORCEINLINE void token_pass_rows(const RolloutParams<acc_t>& p, Partials& P, int64_t begin, int64_t end) {
  using Ln = Lanes<V, acc_t>;
  const rc::Config<acc_t> c = p.cfg;  // a local copy: no store in the loop can alias it, so nothing is reloaded
  double* S = P.sums.data();
  uint32_t* hist = P.hist.data();
  double* M = P.maxes.data();
  Chunk<V, acc_t> ch;
  alignas(64) acc_t w_out[kChunk];
  alignas(64) acc_t m_out[kChunk];
  alignas(64) static constexpr acc_t kZeros[kChunk] = {};
  for (int64_t row = begin; row < end; ++row) {
    const SeqSpan sp = seq_span(p, row);
    const acc_t* st = p.seq_stats + row * rc::seq::kCols;
    rc::RowValues<acc_t> r;
    rc::row_values(st, c, r);
    const bool row_dropped = r.seq_rejected || r.veto;
    rc::TokenAcc<V> acc;
    rc::token_acc_init(acc);
    rc::TokenAcc<double> row_acc;  // fp64 row sums (folded from the lanes every kFoldChunks chunks)
    rc::token_acc_init(row_acc);
    int chunks = 0;
    for (int64_t t0 = 0; t0 < sp.len; t0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, sp.len - t0));
      if (ch.load(p, sp.row, sp.col0 + t0, n)) {
        for (int k = 0; k < n; k += Ln::kWidth) {
          const rc::TokenOut<V> o = rc::token_pass_token<kTokenCrit>(c, r, row_dropped, Ln::load(ch.a + k),
                                                                     Ln::load(ch.q + k), Ln::load(ch.m + k), acc);
          Ln::store(w_out + k, o.weight);
          Ln::store(m_out + k, o.mask);
          if (c.is_level == rc::is_level::token) add_to_histogram<V, acc_t>(o, hist);
        }
        if (p.weights) std::memcpy(p.weights + weight_index(p, sp, t0), w_out, n * sizeof(acc_t));
        view_store_chunk<kChunk>(p.mask_out, sp.row, sp.col0 + t0, n, m_out);
      } else {  // no valid token: weights and mask 0, nothing to add (the fold points below do not move)
        if (p.weights) std::memset(p.weights + weight_index(p, sp, t0), 0, n * sizeof(acc_t));
        view_store_chunk<kChunk>(p.mask_out, sp.row, sp.col0 + t0, n, kZeros);
      }
      if (++chunks == kFoldChunks || t0 + kChunk >= sp.len) {
        fold_lane_sums<V, acc_t>(acc, row_acc, rc::token_crit_count<kTokenCrit>(c));
        chunks = 0;
      }
    }
    // Lane maxima -> the row's, then everything into the partial vectors by slot name.
    for (int k = 0; k < rc::tok_max::kCount; ++k) row_acc.max[k] = Ln::max(acc.max[k]);
    for (int j = 0; j < rc::token_crit_count<kTokenCrit>(c); ++j)
      for (int k = 0; k < rc::tok_crit_max::kCount; ++k) row_acc.crit_max[j][k] = Ln::max(acc.crit_max[j][k]);
    rc::fold_token_acc(c, row_acc, S, M);
    if (p.row_partials) rc::add_row_partials(c, st, r, S, M);
  }
}

// The row loops with the token-criterion count as a constant for the common configs (none, one), read from the
// config otherwise.
template <typename V, typename acc_t>
RC_FORCEINLINE void seq_stats_rows_any(const RolloutParams<acc_t>& p, int64_t begin, int64_t end) {
  switch (p.cfg.num_token_crit) {
    case 0: return seq_stats_rows<V, acc_t, 0>(p, begin, end);
    case 1: return seq_stats_rows<V, acc_t, 1>(p, begin, end);
    default: return seq_stats_rows<V, acc_t, rc::kRuntimeCount>(p, begin, end);
  }
}
template <typename V, typename acc_t>
RC_FORCEINLINE void token_pass_rows_any(const RolloutParams<acc_t>& p, Partials& P, int64_t begin, int64_t end) {
  switch (p.cfg.num_token_crit) {
    case 0: return token_pass_rows<V, acc_t, 0>(p, P, begin, end);
    case 1: return token_pass_rows<V, acc_t, 1>(p, P, begin, end);
    default: return token_pass_rows<V, acc_t, rc::kRuntimeCount>(p, P, begin, end);
  }
}

// Non-template entry points. The fp32 path runs 8 lanes in three explicit copies, AVX-512, AVX2 + FMA and the x86-64
// baseline, picked by cpu::cpu_isa(): the one ISA choice (ROLLOUT_CORR_CPU_ISA narrows it) that governs the log-prob
// kernels too. (The AVX-512 copy keeps 8 lanes: 16 measured no faster here.)
RC_CPU_AVX512 void seq_stats_rows_f32_avx512(const RolloutParams<float>& p, int64_t begin, int64_t end) {
  seq_stats_rows_any<cpu::v8f, float>(p, begin, end);
}
RC_CPU_AVX2 void seq_stats_rows_f32_avx2(const RolloutParams<float>& p, int64_t begin, int64_t end) {
  seq_stats_rows_any<cpu::v8f, float>(p, begin, end);
}
void seq_stats_rows_f32(const RolloutParams<float>& p, int64_t begin, int64_t end) {
  seq_stats_rows_any<cpu::v8f, float>(p, begin, end);
}
RC_CPU_AVX512 void token_pass_rows_f32_avx512(const RolloutParams<float>& p, Partials& P, int64_t begin,
                                              int64_t end) {
  token_pass_rows_any<cpu::v8f, float>(p, P, begin, end);
}
RC_CPU_AVX2 void token_pass_rows_f32_avx2(const RolloutParams<float>& p, Partials& P, int64_t begin, int64_t end) {
  token_pass_rows_any<cpu::v8f, float>(p, P, begin, end);
}
void token_pass_rows_f32(const RolloutParams<float>& p, Partials& P, int64_t begin, int64_t end) {
  token_pass_rows_any<cpu::v8f, float>(p, P, begin, end);
}
void seq_stats_rows_f64(const RolloutParams<double>& p, int64_t begin, int64_t end) {
  seq_stats_rows<double, double, rc::kRuntimeCount>(p, begin, end);
}
void token_pass_rows_f64(const RolloutParams<double>& p, Partials& P, int64_t begin, int64_t end) {
  token_pass_rows<double, double, rc::kRuntimeCount>(p, P, begin, end);
}
inline void seq_stats_range(const RolloutParams<float>& p, int64_t b, int64_t e) {
  switch (cpu::cpu_isa()) {
    case cpu::CpuIsa::kAvx512: return seq_stats_rows_f32_avx512(p, b, e);
    case cpu::CpuIsa::kAvx2: return seq_stats_rows_f32_avx2(p, b, e);
    default: return seq_stats_rows_f32(p, b, e);
  }
}
inline void seq_stats_range(const RolloutParams<double>& p, int64_t b, int64_t e) { seq_stats_rows_f64(p, b, e); }
inline void token_pass_range(const RolloutParams<float>& p, Partials& P, int64_t b, int64_t e) {
  switch (cpu::cpu_isa()) {
    case cpu::CpuIsa::kAvx512: return token_pass_rows_f32_avx512(p, P, b, e);
    case cpu::CpuIsa::kAvx2: return token_pass_rows_f32_avx2(p, P, b, e);
    default: return token_pass_rows_f32(p, P, b, e);
  }
}
inline void token_pass_range(const RolloutParams<double>& p, Partials& P, int64_t b, int64_t e) {
  token_pass_rows_f64(p, P, b, e);
}

// Rows per task: about 32K tokens, enough to amortise scheduling.
inline int64_t rollout_grain(int64_t tokens_per_row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(tokens_per_row, 1));
}

// The SUM slots other than the histogram bins (the per-block partials): [0, kHist) and [kCritBase, ns).
constexpr int64_t kSlotsBeforeHist = rc::sum_slot::kHist;
inline int64_t block_sum_slots(int64_t ns) { return ns - rc::kHistBins; }
// Copy SUM's block slots into `out` and zero them in SUM (the histogram bins keep accumulating).
inline void take_block_sums(double* S, int64_t ns, double* out) {
  std::memcpy(out, S, kSlotsBeforeHist * sizeof(double));
  std::memcpy(out + kSlotsBeforeHist, S + rc::sum_slot::kCritBase,
              (ns - rc::sum_slot::kCritBase) * sizeof(double));
  std::fill(S, S + kSlotsBeforeHist, 0.0);
  std::fill(S + rc::sum_slot::kCritBase, S + ns, 0.0);
}
// Average tokens per sequence (packed batches: the stream over the segments).
template <typename acc_t>
int64_t tokens_per_row(const RolloutParams<acc_t>& p) {
  return p.row_offsets == nullptr ? p.cols : p.cols / std::max<int64_t>(p.rows, 1);
}

at::Tensor rollout_seq_stats_cpu(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask, const c10::optional<at::Tensor>& cu_seqlens
                                 RC_ROLLOUT_CONFIG_PARAMS) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask);
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);
  const RolloutConfigArgs a = RC_ROLLOUT_CONFIG_ARGS;
  const auto acc = rollout_acc_dtype(log_prob, rollout_log_prob);
  auto out = at::empty({layout.rows, rc::seq::kCols}, log_prob.options().dtype(acc));
  RC_DISPATCH_ROLLOUT_ACC(acc, "rollout_seq_stats", [&] {
    auto p = make_rollout_params<acc_t>(log_prob, rollout_log_prob, mask, layout, a);
    p.seq_stats = out.mutable_data_ptr<acc_t>();
    at::parallel_for(0, p.rows, rollout_grain(tokens_per_row(p)),
                     [&](int64_t b, int64_t e) { seq_stats_range(p, b, e); });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rollout_token_pass_cpu(
    const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& seq_stats RC_ROLLOUT_CONFIG_PARAMS,
    bool row_partials) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask);
  const SeqLayout layout = seq_layout(log_prob, cu_seqlens);
  const RolloutConfigArgs a = RC_ROLLOUT_CONFIG_ARGS;
  const auto acc = rollout_acc_dtype(log_prob, rollout_log_prob);
  check_seq_stats(seq_stats, layout.rows, log_prob, acc);
  const auto st = seq_stats.contiguous();
  // weights and mask_out in blocks kept from the previous step's outputs rather than fresh pages (reused_buffer.h);
  // the pass writes every element (skipped chunks included).
  RolloutPassOutputs o = new_rollout_pass_outputs(log_prob, mask, acc, a,
                                                  &cpu::ReusedBlockAllocator::get(cpu::ReusedUse::kRolloutWeights),
                                                  &cpu::ReusedBlockAllocator::get(cpu::ReusedUse::kRolloutMask));
  const int64_t ns = o.sums.numel(), nm = o.maxes.numel();
  std::vector<Partials> parts;
  const int nthreads = at::get_num_threads();
  parts.reserve(nthreads);
  for (int i = 0; i < nthreads; ++i) parts.emplace_back(ns, nm);
  // Blocks of `grain` rows (set by the layout, never by the thread count), each summed in row order into its own
  // slots of block_sums, then added in block order below.
  const int64_t nb = block_sum_slots(ns);
  std::vector<double> block_sums;
  RC_DISPATCH_ROLLOUT_ACC(acc, "rollout_token_pass", [&] {
    auto p = make_rollout_params<acc_t>(log_prob, rollout_log_prob, mask, layout, a);
    p.seq_stats = const_cast<acc_t*>(st.const_data_ptr<acc_t>());
    p.weights = o.weights.numel() > 0 ? o.weights.mutable_data_ptr<acc_t>() : nullptr;
    p.mask_out = mutable_token_view(o.mask_out);
    p.row_partials = row_partials;
    const int64_t grain = rollout_grain(tokens_per_row(p));
    const int64_t blocks = (p.rows + grain - 1) / grain;
    block_sums.assign(blocks * nb, 0.0);
    at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
      Partials& P = parts[at::get_thread_num()];
      for (int64_t blk = b; blk < e; ++blk) {
        token_pass_range(p, P, blk * grain, std::min(p.rows, (blk + 1) * grain));
        take_block_sums(P.sums.data(), ns, block_sums.data() + blk * nb);
      }
    });
  });
  double* S = o.sums.mutable_data_ptr<double>();
  double* M = o.maxes.mutable_data_ptr<double>();
  for (size_t i = 0; i < block_sums.size(); i += nb) {
    const double* B = block_sums.data() + i;
    for (int64_t k = 0; k < kSlotsBeforeHist; ++k) S[k] += B[k];
    for (int64_t k = rc::sum_slot::kCritBase; k < ns; ++k) S[k] += B[k - rc::kHistBins];
  }
  for (const auto& P : parts) {  // whole counts: exact in any order
    for (int k = 0; k < rc::kHistBins; ++k)
      S[rc::sum_slot::kHist + k] += static_cast<double>(P.hist[k]) + P.sums[rc::sum_slot::kHist + k];
    for (int64_t k = 0; k < nm; ++k) M[k] = std::max(M[k], P.maxes[k]);
  }
  return {o.weights, o.mask_out, o.sums, o.maxes};
}

// The check reads three scalars (one host read on the CPU, where it is free); only on failure does it look for
// the position to name.
at::Tensor rollout_check_cpu(const at::Tensor& sums, const c10::optional<at::Tensor>& agree,
                             const at::Tensor& log_prob, const at::Tensor& rollout_log_prob, const at::Tensor& mask,
                             bool exclude_nonfinite, bool allow_empty) {
  check_rollout_check_inputs(sums, agree, log_prob, rollout_log_prob, mask);
  const auto status = rollout_status(sums, agree, exclude_nonfinite, allow_empty);
  if (status != RolloutStatus::kOk) raise_rollout_status(status, log_prob, rollout_log_prob, mask);
  return sums.clone();
}

}  // namespace

TORCH_LIBRARY_IMPL(rollout_corr, CPU, m) {
  m.impl("rollout_seq_stats", &rollout_seq_stats_cpu);
  m.impl("rollout_token_pass", &rollout_token_pass_cpu);
  m.impl("rollout_check", &rollout_check_cpu);
}

}  // namespace rollout_corr
