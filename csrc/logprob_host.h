// Host side of the log-prob ops shared by the CPU and CUDA backends and the CUDA emulator's bindings:
// boundary checks with named messages, output allocation, the builders of the torch-free kernel parameter blocks,
// and the error messages of the merge's checks.
#pragma once

#include <cstring>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "logprob_math.h"
#include "logprob_params.h"

namespace rollout_corr {

inline bool is_supported_logits_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline at::ScalarType acc_dtype_for(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline int64_t valid_cols_of(int64_t vocab_start, int64_t vocab_size, int64_t local_vocab) {
  return std::max<int64_t>(0, std::min<int64_t>(local_vocab, vocab_size - vocab_start));
}

inline int stats_cols_for(bool with_sum_z) { return with_sum_z ? kRowStatColsWithSumZ : kRowStatCols; }

// Header length in accumulation-dtype elements (64 bytes).
inline int64_t header_len_for(at::ScalarType acc) {
  return kShardHeaderBytes / static_cast<int64_t>(c10::elementSize(acc));
}

inline int64_t record_format(int stats_cols, at::ScalarType acc, bool with_entropy) {
  return stats_cols + 16 * static_cast<int64_t>(c10::elementSize(acc)) + (with_entropy ? 0 : kFormatNoEntropy);
}

// The call settings every rank must share, 1/T and ignore_index, fingerprinted (target_fingerprint's mixer over the
// bits of 1/T and ignore_index) into the format slot's bits 16..62, above record_format's small integer: ranks that
// disagree fail the header check on every rank, instead of merging records taken at different temperatures into a
// wrong answer, or of one rank raising on a target that another ignores.
inline int64_t settings_fingerprint(double inv_temperature, int64_t ignore_index) {
  uint64_t bits;
  std::memcpy(&bits, &inv_temperature, sizeof(bits));
  return static_cast<int64_t>(target_fingerprint(static_cast<int64_t>(bits), ignore_index) & 0x7FFFFFFFFFFF0000ull);
}

// 1 / temperature in the type the kernels compute in (fp32 unless the logits are fp64): outside [min normal, max]
// it would overflow or flush there and every row fail or be flat. The Python entry points check the temperature
// first; a torch.compile trace (a symbolic temperature) leaves it to this check, on the value.
inline void check_inv_temperature_range(double inv_temperature, bool fp64) {
  if (fp64) return;
  constexpr double lo = std::numeric_limits<float>::min(), hi = std::numeric_limits<float>::max();
  TORCH_CHECK(inv_temperature >= lo && inv_temperature <= hi, "temperature = ", 1.0 / inv_temperature,
              " is out of range: the kernels compute in float32, where 1 / temperature must lie in [", lo, ", ", hi,
              "]");
}

inline void check_logits_target(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                                int64_t vocab_size, double inv_temperature) {
  TORCH_CHECK(logits.dim() == 2, "logits must be 2-D [rows, local_vocab], got ", logits.sizes());
  TORCH_CHECK(is_supported_logits_dtype(logits.scalar_type()),
              "logits must be float16, bfloat16, float32 or float64, got ", logits.scalar_type());
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) <= 1, "logits must be contiguous along the vocab dimension");
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64, got ", target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "target must have shape [",
              logits.size(0), "] (one id per logits row), got ", target.sizes());
  TORCH_CHECK(target.device() == logits.device(), "target is on ", target.device(), " but logits is on ",
              logits.device());
  TORCH_CHECK(vocab_start >= 0, "vocab_start must be >= 0, got ", vocab_start);
  TORCH_CHECK(vocab_size > 0, "vocab_size must be > 0, got ", vocab_size);
  TORCH_CHECK(std::isfinite(inv_temperature) && inv_temperature > 0,
              "inv_temperature (1 / temperature) must be finite and > 0, got ", inv_temperature);
  check_inv_temperature_range(inv_temperature, logits.scalar_type() == at::kDouble);
}

inline void check_row_state(const at::Tensor& row_state, const at::Tensor& logits) {
  TORCH_CHECK(row_state.dim() == 2 && row_state.size(0) == logits.size(0) && row_state.size(1) == kRowStateCols,
              "row_state must be [", logits.size(0), ", ", kRowStateCols, "], got ", row_state.sizes());
  TORCH_CHECK(row_state.device() == logits.device(), "row_state is on ", row_state.device(),
              " but logits is on ", logits.device());
}

// Per-row upstream gradient as a contiguous tensor of the accumulation dtype (autograd may hand us an
// expanded, stride-0 view), or an undefined tensor when absent.
inline at::Tensor prepare_row_grad(const c10::optional<at::Tensor>& g, const at::Tensor& logits,
                                   const char* name) {
  if (!g.has_value() || !g->defined()) return at::Tensor();
  TORCH_CHECK(g->numel() == logits.size(0), name, " must have one value per logits row (", logits.size(0),
              "), got shape ", g->sizes());
  TORCH_CHECK(g->device() == logits.device(), name, " is on ", g->device(), " but logits is on ",
              logits.device());
  return g->reshape({-1}).to(acc_dtype_for(logits.scalar_type())).contiguous();
}

template <typename acc_t>
inline const acc_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<acc_t>() : nullptr;
}

// ---- forward: the shard record ------------------------------------------------------------------------------

// The flat shard record [header_len + rows * stats_cols] in the accumulation dtype (header filled by the kernel).
inline at::Tensor new_shard_record(const at::Tensor& logits, bool with_sum_z) {
  const auto acc = acc_dtype_for(logits.scalar_type());
  return at::empty({header_len_for(acc) + logits.size(0) * stats_cols_for(with_sum_z)}, logits.options().dtype(acc));
}

inline ShardHeaderParams make_shard_header_params(const at::Tensor& record, const at::Tensor& target,
                                                  const at::Tensor& logits, int64_t vocab_start, int64_t vocab_size,
                                                  double inv_temperature, int64_t ignore_index, bool with_sum_z,
                                                  bool with_entropy) {
  ShardHeaderParams h;
  h.header = static_cast<int64_t*>(record.data_ptr());
  h.target = target.const_data_ptr<int64_t>();
  h.rows = logits.size(0);
  h.vocab_start = vocab_start;
  h.local_vocab = logits.size(1);
  h.valid_cols = valid_cols_of(vocab_start, vocab_size, logits.size(1));
  h.vocab_size = vocab_size;
  h.format = record_format(stats_cols_for(with_sum_z), record.scalar_type(), with_entropy) |
             settings_fingerprint(inv_temperature, ignore_index);
  return h;
}

template <typename scalar_t, typename acc_t>
RowStatsParams<scalar_t, acc_t> make_row_stats_params(const at::Tensor& logits, const at::Tensor& target,
                                                      const at::Tensor& record, int64_t vocab_start,
                                                      int64_t vocab_size, double inv_temperature,
                                                      int64_t ignore_index, bool with_sum_z) {
  RowStatsParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.target = target.const_data_ptr<int64_t>();
  p.records = record.mutable_data_ptr<acc_t>() + header_len_for(record.scalar_type());
  p.rows = logits.size(0);
  p.local_vocab = logits.size(1);
  p.logits_row_stride = logits.stride(0);
  p.valid_cols = valid_cols_of(vocab_start, vocab_size, logits.size(1));
  p.vocab_start = vocab_start;
  p.ignore_index = ignore_index;
  p.stats_cols = stats_cols_for(with_sum_z);
  p.inv_temperature = static_cast<acc_t>(inv_temperature);
  return p;
}

// ---- merge ----------------------------------------------------------------------------------------------------

// The merge's checked, contiguous inputs and its freshly allocated outputs.
struct MergeIO {
  at::Tensor gathered, target, logp, entropy, mean_logp, row_state, status;
  int stats_cols;
};

inline MergeIO prepare_merge(const at::Tensor& gathered, const at::Tensor& target, int64_t vocab_size,
                             double inv_temperature, bool with_sum_z) {
  TORCH_CHECK(gathered.dim() == 2, "gathered must be [shards, shard_record_len], got ", gathered.sizes());
  TORCH_CHECK(gathered.scalar_type() == at::kFloat || gathered.scalar_type() == at::kDouble,
              "gathered must be float32 or float64 (the accumulation dtype), got ", gathered.scalar_type());
  TORCH_CHECK(gathered.size(0) >= 1, "gathered must hold at least one shard record");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1, "target must be a 1-D int64 tensor, got ",
              target.scalar_type(), " ", target.sizes());
  TORCH_CHECK(target.device() == gathered.device(), "target is on ", target.device(), " but gathered is on ",
              gathered.device());
  TORCH_CHECK(vocab_size > 0, "vocab_size must be > 0, got ", vocab_size);
  TORCH_CHECK(std::isfinite(inv_temperature) && inv_temperature > 0,
              "inv_temperature (1 / temperature) must be finite and > 0, got ", inv_temperature);
  check_inv_temperature_range(inv_temperature, gathered.scalar_type() == at::kDouble);
  const int cols = stats_cols_for(with_sum_z);
  const int64_t rows = target.size(0);
  const int64_t expect = header_len_for(gathered.scalar_type()) + rows * cols;
  TORCH_CHECK(gathered.size(1) == expect, "gathered shard records must have length ", expect, " (",
              rows, " rows x ", cols, " columns + header), got ", gathered.size(1),
              ": the tensor-parallel ranks disagree on the number of rows or on the record format");
  const auto opts = gathered.options();
  return {gathered.contiguous(),
          target.contiguous(),
          at::empty({rows}, opts),
          at::empty({rows}, opts),
          at::empty({rows}, opts),
          at::empty({rows, kRowStateCols}, opts),
          at::zeros({kMergeStatusSlots}, opts.dtype(at::kInt)),
          cols};
}

template <typename acc_t>
MergeParams<acc_t> make_merge_params(const MergeIO& io, int64_t ignore_index, int64_t vocab_size,
                                     double inv_temperature, bool with_status) {
  MergeParams<acc_t> p;
  p.gathered = io.gathered.const_data_ptr<acc_t>();
  p.target = io.target.const_data_ptr<int64_t>();
  p.logp = io.logp.mutable_data_ptr<acc_t>();
  p.entropy = io.entropy.mutable_data_ptr<acc_t>();
  p.mean_logp = io.mean_logp.mutable_data_ptr<acc_t>();
  p.row_state = io.row_state.mutable_data_ptr<acc_t>();
  p.status = with_status ? io.status.mutable_data_ptr<int32_t>() : nullptr;
  p.rows = io.target.size(0);
  p.shards = io.gathered.size(0);
  p.shard_len = io.gathered.size(1);
  p.header_len = header_len_for(io.gathered.scalar_type());
  p.vocab_size = vocab_size;
  p.ignore_index = ignore_index;
  p.stats_cols = io.stats_cols;
  p.inv_temperature = static_cast<acc_t>(inv_temperature);
  return p;
}

// The CPU merge's error for a failed header check (every rank reaches the same one).
inline std::string layout_error_message(const LayoutCheck& c, const at::Tensor& gathered, int64_t vocab_size) {
  const int64_t shard_bytes = gathered.size(1) * static_cast<int64_t>(gathered.element_size());
  auto field = [&](int64_t r, int slot) { return shard_header(gathered.const_data_ptr(), r, shard_bytes)[slot]; };
  std::ostringstream os;
  os << "vocab_parallel_log_probs: the tensor-parallel shards do not fit together: ";
  switch (c.code) {
    case kLayoutBadMagic:
      os << "rank " << c.a << "'s record is not a log-prob shard record (different op or library version)";
      break;
    case kLayoutRows:
      os << "rank " << c.a << " has " << field(c.a, kHdrRows) << " rows but rank " << c.b << " has "
         << field(c.b, kHdrRows);
      break;
    case kLayoutFormat:
      os << "ranks " << c.a << " and " << c.b << " use different record formats or settings (temperature, "
         << "ignore_index, return_entropy / label smoothing and the logits dtype must agree across the group)";
      break;
    case kLayoutVocabSize:
      os << "rank " << c.b << " was given vocab_size=" << field(c.b, kHdrVocabSize) << " but this rank "
         << vocab_size << " (pass the true, global vocab_size on every rank)";
      break;
    case kLayoutTargets:
      os << "ranks " << c.a << " and " << c.b << " were given different targets (every rank of the group must pass "
         << "the same global token ids)";
      break;
    case kLayoutOverlap:
      os << "the vocab ranges of rank " << c.a << " [" << field(c.a, kHdrVocabStart) << ", "
         << field(c.a, kHdrVocabStart) + field(c.a, kHdrValidCols) << ") and rank " << c.b << " ["
         << field(c.b, kHdrVocabStart) << ", " << field(c.b, kHdrVocabStart) + field(c.b, kHdrValidCols)
         << ") overlap (check vocab_start: with uneven shards it must be passed explicitly)";
      break;
    default: {
      os << "the shards do not cover [0, vocab_size=" << vocab_size << ") exactly; shards (rank: vocab_start, "
         << "local columns, columns below vocab_size):";
      for (int64_t r = 0; r < gathered.size(0); ++r)
        os << " " << r << ": " << field(r, kHdrVocabStart) << ", " << field(r, kHdrLocalVocab) << ", "
           << field(r, kHdrValidCols) << ";";
      os << " (check vocab_start / vocab_size; with uneven shards both must be passed explicitly)";
    }
  }
  return os.str();
}

// ---- backward -------------------------------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
LogprobBackwardParams<scalar_t, acc_t> make_backward_params(const at::Tensor& grad_logits, const at::Tensor& logits,
                                                            const at::Tensor& target, const at::Tensor& state,
                                                            const at::Tensor& g_lp, const at::Tensor& g_h,
                                                            const at::Tensor& g_m, int64_t vocab_start,
                                                            int64_t vocab_size, double inv_temperature,
                                                            int64_t ignore_index) {
  LogprobBackwardParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.grad_logits = grad_logits.mutable_data_ptr<scalar_t>();
  p.target = target.const_data_ptr<int64_t>();
  p.row_state = state.const_data_ptr<acc_t>();
  p.grad_logp = ptr_or_null<acc_t>(g_lp);
  p.grad_entropy = ptr_or_null<acc_t>(g_h);
  p.grad_mean_logp = ptr_or_null<acc_t>(g_m);
  p.rows = logits.size(0);
  p.local_vocab = logits.size(1);
  p.logits_row_stride = logits.stride(0);
  p.grad_row_stride = grad_logits.stride(0);
  p.valid_cols = valid_cols_of(vocab_start, vocab_size, logits.size(1));
  p.vocab_start = vocab_start;
  p.vocab_size = vocab_size;
  p.ignore_index = ignore_index;
  p.inv_temperature = static_cast<acc_t>(inv_temperature);
  return p;
}

// Everything the backward of either backend needs, checked and converted once.
struct BackwardInputs {
  at::Tensor target, state, g_lp, g_h, g_m;
};

inline BackwardInputs prepare_backward(const c10::optional<at::Tensor>& grad_logp,
                                       const c10::optional<at::Tensor>& grad_entropy,
                                       const c10::optional<at::Tensor>& grad_mean_logp, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& row_state, int64_t vocab_start,
                                       int64_t vocab_size, double inv_temperature) {
  check_logits_target(logits, target, vocab_start, vocab_size, inv_temperature);
  check_row_state(row_state, logits);
  BackwardInputs in;
  in.target = target.contiguous();
  in.state = row_state.to(acc_dtype_for(logits.scalar_type())).contiguous();
  in.g_lp = prepare_row_grad(grad_logp, logits, "grad_logp");
  in.g_h = prepare_row_grad(grad_entropy, logits, "grad_entropy");
  in.g_m = prepare_row_grad(grad_mean_logp, logits, "grad_mean_logp");
  return in;
}

// The in-place backward writes every element once from the thread that read it; overlapping memory would make
// two elements share one address.
inline void check_inplace_target(const at::Tensor& logits) {
  const bool rows_overlap = logits.dim() == 2 && logits.size(0) > 1 && logits.stride(0) < logits.size(1);
  TORCH_CHECK(!rows_overlap && at::has_internal_overlap(logits) != at::MemOverlap::Yes,
              "inplace_backward: logits has internally overlapping memory (an expanded or stride-0 view); the "
              "gradient cannot be written in place. Pass a materialized tensor or inplace_backward=False");
}

}  // namespace rollout_corr
