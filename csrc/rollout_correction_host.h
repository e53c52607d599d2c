// Host side of the rollout-correction ops shared by the CPU and CUDA backends and the CUDA emulator's bindings:
// the typed configuration arguments of the schemas (csrc/ops.cpp), their checks with named messages, the decoded
// torch-free rc::Config, and the boundary checks of the tensors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/DefaultDtype.h>

#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "rollout_correction_params.h"
#include "token_view_host.h"

namespace rollout_corr {

// The configuration arguments every rollout op takes (RC_ROLLOUT_CONFIG in rollout_correction_layout.def), held
// by value.
#define RC_CONFIG_MEMBER(name, schema, type) std::decay_t<type> name;
struct RolloutConfigArgs {
  RC_ROLLOUT_CONFIG(RC_CONFIG_MEMBER)
};
#undef RC_CONFIG_MEMBER

inline bool is_rollout_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline bool is_rollout_mask_dtype(at::ScalarType t) {
  return is_rollout_float_dtype(t) || t == at::kBool || t == at::kByte || t == at::kChar || t == at::kShort ||
         t == at::kInt || t == at::kLong;
}

// fp64 when either log-prob input is fp64, else fp32 (the dtype of the weights and of seq_stats).
inline at::ScalarType rollout_acc_dtype(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob) {
  return (log_prob.scalar_type() == at::kDouble || rollout_log_prob.scalar_type() == at::kDouble) ? at::kDouble
                                                                                                  : at::kFloat;
}

inline void check_rollout_config(const RolloutConfigArgs& a) {
  TORCH_CHECK(a.is_level >= rc::is_level::none && a.is_level <= rc::is_level::geometric,
              "is_level must be 0 (none), 1 (token), 2 (sequence) or 3 (geometric), got ", a.is_level);
  if (a.is_level != rc::is_level::none) {
    TORCH_CHECK(std::isfinite(a.is_upper) && a.is_upper > 0, "is_upper must be finite and > 0, got ", a.is_upper);
    TORCH_CHECK(std::isfinite(a.is_metric_lower) && a.is_metric_lower > 0,
                "is_metric_lower must be finite and > 0, got ", a.is_metric_lower);
    // IcePop's band, or TIS's lower clamp (0: one-sided)
    TORCH_CHECK(std::isfinite(a.is_lower) && a.is_lower >= 0 && a.is_lower <= a.is_upper,
                "is_lower must be finite and in [0, is_upper], got ", a.is_lower);
  }
  if (a.veto_threshold.has_value()) {
    TORCH_CHECK(std::isfinite(*a.veto_threshold) && *a.veto_threshold > 0,
                "veto_threshold must be None or finite and > 0, got ", *a.veto_threshold);
  }
  const size_t n = a.rs_level.size();
  TORCH_CHECK(a.rs_stat.size() == n && a.rs_lower.size() == n && a.rs_upper.size() == n &&
                  a.rs_apply_lower.size() == n,
              "rs_level, rs_stat, rs_lower, rs_upper and rs_apply_lower must have one entry per RS criterion, got ",
              n, ", ", a.rs_stat.size(), ", ", a.rs_lower.size(), ", ", a.rs_upper.size(), ", ",
              a.rs_apply_lower.size());
  TORCH_CHECK(n <= static_cast<size_t>(rc::kMaxCriteria), "at most ", rc::kMaxCriteria, " RS criteria, got ", n);
  bool token_stat_seen[4] = {false, false, false, false};
  for (size_t i = 0; i < n; ++i) {
    const int64_t level = a.rs_level[i], stat = a.rs_stat[i];
    TORCH_CHECK(level >= rc::rs_level::token && level <= rc::rs_level::seq_max, "rs_level[", i,
                "] must be 0 (token), 1 (seq_sum), 2 (seq_mean) or 3 (seq_max), got ", level);
    TORCH_CHECK(stat >= rc::rs_stat::k1 && stat <= rc::rs_stat::ratio, "rs_stat[", i,
                "] must be 0 (k1), 1 (k2), 2 (k3) or 3 (ratio), got ", stat);
    TORCH_CHECK(!(level == rc::rs_level::seq_max && (stat == rc::rs_stat::k1 || stat == rc::rs_stat::ratio)),
                "rs criterion ", i, ": seq_max is defined for k2 and k3 only");
    if (level == rc::rs_level::token) {
      TORCH_CHECK(!token_stat_seen[stat], "rs criterion ", i, ": a token-level criterion of this statistic is given "
                  "twice");
      token_stat_seen[stat] = true;
    }
    TORCH_CHECK(!std::isnan(a.rs_upper[i]) && !std::isnan(a.rs_lower[i]), "rs_lower[", i, "] and rs_upper[", i,
                "] must not be NaN");
    TORCH_CHECK(!a.rs_apply_lower.get(i) || a.rs_lower[i] <= a.rs_upper[i], "rs criterion ", i, ": rs_lower ",
                a.rs_lower[i], " > rs_upper ", a.rs_upper[i]);
  }
}

// The typed schema arguments, checked (every backend's entry point starts here).
inline RolloutConfigArgs checked_rollout_config(RolloutConfigArgs a) {
  check_rollout_config(a);
  return a;
}

// From RC_ROLLOUT_CONFIG, for the CPU, CUDA and emulator bindings and both schemas:
//   RC_ROLLOUT_CONFIG_PARAMS  the C++ parameters *with a leading comma*: f(const at::Tensor& x RC_ROLLOUT_CONFIG_PARAMS)
//   RC_ROLLOUT_CONFIG_ARGS    those parameters gathered into a checked RolloutConfigArgs
//   RC_ROLLOUT_CONFIG_SCHEMA  the schema fragment, a string literal with a leading ", "
#define RC_CONFIG_PARAM(name, schema, type) , type name
#define RC_CONFIG_INIT(name, schema, type) name,
#define RC_CONFIG_SCHEMA(name, schema, type) ", " #schema " " #name
#define RC_ROLLOUT_CONFIG_PARAMS RC_ROLLOUT_CONFIG(RC_CONFIG_PARAM)
#define RC_ROLLOUT_CONFIG_ARGS checked_rollout_config(RolloutConfigArgs{RC_ROLLOUT_CONFIG(RC_CONFIG_INIT)})
#define RC_ROLLOUT_CONFIG_SCHEMA RC_ROLLOUT_CONFIG(RC_CONFIG_SCHEMA)

template <typename acc_t>
rc::Config<acc_t> decode_rollout_config(const RolloutConfigArgs& a) {
  rc::Config<acc_t> c{};
  c.is_level = static_cast<int>(a.is_level);
  c.is_mask = a.is_mask;
  c.is_lower = static_cast<acc_t>(a.is_lower);
  c.is_upper = static_cast<acc_t>(a.is_level != rc::is_level::none ? a.is_upper : INFINITY);
  c.is_metric_lower = static_cast<acc_t>(a.is_metric_lower);
  c.log_is_upper = static_cast<acc_t>(std::log(a.is_upper));
  c.log_is_metric_lower = static_cast<acc_t>(std::log(a.is_metric_lower));
  c.veto_on = a.veto_threshold.has_value();
  c.veto_log = static_cast<acc_t>(c.veto_on ? std::log(*a.veto_threshold) : -INFINITY);
  c.exclude_nonfinite = a.exclude_nonfinite;
  c.num_rs = static_cast<int>(a.rs_level.size());
  c.num_token_crit = 0;
  for (int i = 0; i < c.num_rs; ++i) {
    c.crit_level[i] = static_cast<int>(a.rs_level[i]);
    c.crit_stat[i] = static_cast<int>(a.rs_stat[i]);
    c.crit_lower[i] = static_cast<acc_t>(a.rs_lower[i]);
    c.crit_upper[i] = static_cast<acc_t>(a.rs_upper[i]);
    c.crit_apply_lower[i] = a.rs_apply_lower.get(i);
    if (c.crit_level[i] == rc::rs_level::token) c.token_crit[c.num_token_crit++] = i;
  }
  return c;
}

inline void check_rollout_inputs(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                 const at::Tensor& mask) {
  TORCH_CHECK(log_prob.dim() == 2 || log_prob.dim() == 1,
              "log_prob must be 2-D [batch, response_length] (or the 1-D packed token stream with cu_seqlens), got "
              "shape ", log_prob.sizes());
  TORCH_CHECK(is_rollout_float_dtype(log_prob.scalar_type()),
              "log_prob must be float16, bfloat16, float32 or float64, got ", log_prob.scalar_type());
  TORCH_CHECK(is_rollout_float_dtype(rollout_log_prob.scalar_type()),
              "rollout_log_prob must be float16, bfloat16, float32 or float64, got ", rollout_log_prob.scalar_type());
  TORCH_CHECK(rollout_log_prob.sizes() == log_prob.sizes(), "rollout_log_prob must have log_prob's shape ",
              log_prob.sizes(), ", got ", rollout_log_prob.sizes());
  TORCH_CHECK(mask.sizes() == log_prob.sizes(), "mask must have log_prob's shape ", log_prob.sizes(), ", got ",
              mask.sizes());
  TORCH_CHECK(is_rollout_mask_dtype(mask.scalar_type()), "mask must be bool, integer or floating point, got ",
              mask.scalar_type());
  TORCH_CHECK(rollout_log_prob.device() == log_prob.device(), "rollout_log_prob is on ", rollout_log_prob.device(),
              " but log_prob is on ", log_prob.device());
  TORCH_CHECK(mask.device() == log_prob.device(), "mask is on ", mask.device(), " but log_prob is on ",
              log_prob.device());
}

inline void check_seq_stats(const at::Tensor& seq_stats, int64_t rows, const at::Tensor& log_prob,
                            at::ScalarType acc) {
  TORCH_CHECK(seq_stats.dim() == 2 && seq_stats.size(0) == rows && seq_stats.size(1) == rc::seq::kCols,
              "seq_stats must be [", rows, ", ", static_cast<int>(rc::seq::kCols), "], got ", seq_stats.sizes());
  TORCH_CHECK(seq_stats.scalar_type() == acc, "seq_stats must be ", acc, ", got ", seq_stats.scalar_type());
  TORCH_CHECK(seq_stats.device() == log_prob.device(), "seq_stats is on ", seq_stats.device(), " but log_prob is on ",
              log_prob.device());
}

// Outputs of pass 2 before any kernel runs: weights [B, T] (or [0] without an IS level) in the accumulation dtype,
// mask_out [B, T] in the mask's dtype, the SUM vector (zeros) and the MAX vector (-inf), fp64. weights and mask_out
// come from the given CPU allocators when there are any (the CPU kernels' reused blocks), the default one otherwise.
struct RolloutPassOutputs {
  at::Tensor weights, mask_out, sums, maxes;
};
inline at::Tensor empty_from(at::IntArrayRef sizes, const at::TensorOptions& opts, c10::Allocator* cpu_allocator) {
  if (cpu_allocator == nullptr) return at::empty(sizes, opts);
  return at::detail::empty_generic(sizes, cpu_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(opts.dtype()), c10::nullopt);
}
inline RolloutPassOutputs new_rollout_pass_outputs(const at::Tensor& log_prob, const at::Tensor& mask,
                                                   at::ScalarType acc, const RolloutConfigArgs& a,
                                                   c10::Allocator* weights_allocator = nullptr,
                                                   c10::Allocator* mask_allocator = nullptr) {
  const int num_rs = static_cast<int>(a.rs_level.size());
  const auto f64 = log_prob.options().dtype(at::kDouble);
  RolloutPassOutputs o;
  const bool has_weights = a.is_level != rc::is_level::none;
  o.weights = has_weights ? empty_from(log_prob.sizes(), log_prob.options().dtype(acc), weights_allocator)
                          : at::empty({0}, log_prob.options().dtype(acc));
  o.mask_out = empty_from(log_prob.sizes(), mask.options(), mask_allocator);
  o.sums = at::zeros({rc::sum_size(num_rs)}, f64);
  o.maxes = at::full({rc::max_size(num_rs)}, -INFINITY, f64);
  return o;
}

template <typename acc_t>
RolloutParams<acc_t> make_rollout_params(const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                         const at::Tensor& mask, const SeqLayout& layout,
                                         const RolloutConfigArgs& a) {
  RolloutParams<acc_t> p{};
  p.log_prob = token_view(log_prob);
  p.rollout_log_prob = token_view(rollout_log_prob);
  p.mask = token_view(mask);
  p.row_offsets = layout.offsets.defined() ? layout.offsets.const_data_ptr<int64_t>() : nullptr;
  p.rows = layout.rows;
  p.cols = layout.cols;
  p.num_sums = rc::sum_size(static_cast<int>(a.rs_level.size()));
  p.num_maxes = rc::max_size(static_cast<int>(a.rs_level.size()));
  p.cfg = decode_rollout_config<acc_t>(a);
  // verl's count has the mask's dtype (int / bool: int64 + 1e-8 -> torch's default dtype); only fp64 keeps the 1e-8
  // (rollout_corr_ext/_layout.py count_keeps_eps)
  const at::ScalarType count_dtype =
      at::isFloatingType(mask.scalar_type()) ? mask.scalar_type() : c10::get_default_dtype_as_scalartype();
  p.cfg.count_eps = count_dtype == at::kDouble ? static_cast<acc_t>(rc::k_eps) : acc_t(0);
  return p;
}

// ---- rollout_check: what the reduced SUM partials say about the whole batch ----------------------------------------

inline void check_rollout_check_inputs(const at::Tensor& sums, const c10::optional<at::Tensor>& agree,
                                       const at::Tensor& log_prob, const at::Tensor& rollout_log_prob,
                                       const at::Tensor& mask) {
  check_rollout_inputs(log_prob, rollout_log_prob, mask);
  TORCH_CHECK(sums.dim() == 1 && sums.numel() >= rc::sum_slot::kCritBase && sums.scalar_type() == at::kDouble,
              "sums must be the 1-D float64 SUM partials of rollout_token_pass, got ", sums.scalar_type(), " ",
              sums.sizes());
  TORCH_CHECK(sums.device() == log_prob.device(), "sums is on ", sums.device(), " but log_prob is on ",
              log_prob.device());
  if (agree.has_value()) {
    TORCH_CHECK(agree->numel() == 1 && agree->device() == log_prob.device(),
                "agree must be a one-element tensor on log_prob's device");
  }
}

enum class RolloutStatus { kOk, kConfigMismatch, kBadMask, kNonFinite, kNoValidToken };

inline constexpr const char* kMsgConfigMismatch =
    "compute_rollout_correction: the ranks of dp_group pass different rollout-correction settings (config "
    "fingerprints differ: RolloutCorrectionConfig fields or nonfinite); every data-parallel rank must use the same "
    "config";
inline constexpr const char* kMsgBadMask =
    "response_mask must hold only 0 and 1 (bool, integer or floating point); other values would weight tokens, "
    "which the rollout correction does not define";
inline constexpr const char* kMsgNonFinite =
    "log_prob / rollout_log_prob hold NaN or +-inf at valid response_mask positions; fix the inputs or pass "
    "nonfinite='exclude' to drop those tokens (counted in rollout_corr/nonfinite_token_fraction)";
inline constexpr const char* kMsgNoValidToken =
    "response_mask has no valid token (over the whole data-parallel batch); nothing to correct";

// CPU only (reads the values).
inline RolloutStatus rollout_status(const at::Tensor& sums, const c10::optional<at::Tensor>& agree,
                                    bool exclude_nonfinite, bool allow_empty) {
  const at::Tensor s = sums.contiguous();  // the slots by offset: a strided or expanded view would be read wrongly
  const double* S = s.const_data_ptr<double>();
  if (agree.has_value() && !agree->item<bool>()) return RolloutStatus::kConfigMismatch;
  if (S[rc::sum_slot::bad_mask] > 0) return RolloutStatus::kBadMask;
  if (!exclude_nonfinite && S[rc::sum_slot::nonfinite] > 0) return RolloutStatus::kNonFinite;
  if (!allow_empty && !(S[rc::sum_slot::tokens] > 0)) return RolloutStatus::kNoValidToken;
  return RolloutStatus::kOk;
}

// " (first on this rank: name[b, t] = v)" for the first true position of `hit` in `values`, or "" when none.
inline std::string first_position(const at::Tensor& hit, const char* name, const at::Tensor& values) {
  const auto idx = at::nonzero(hit);
  if (idx.size(0) == 0) return "";
  std::string where = std::string(" (first on this rank: ") + name + "[";
  at::Tensor value = values;
  for (int64_t d = 0; d < idx.size(1); ++d) {
    const int64_t i = idx[0][d].item<int64_t>();
    where += (d ? ", " : "") + std::to_string(i);
    value = value[i];
  }
  return where + "] = " + std::to_string(value.item<double>()) + ")";
}

// Raise the ValueError of a failed check, naming this rank's first offending position where there is one.
[[noreturn]] inline void raise_rollout_status(RolloutStatus status, const at::Tensor& log_prob,
                                              const at::Tensor& rollout_log_prob, const at::Tensor& mask) {
  std::string where;
  switch (status) {
    case RolloutStatus::kConfigMismatch: TORCH_CHECK_VALUE(false, kMsgConfigMismatch);
    case RolloutStatus::kBadMask:
      where = first_position((mask != 0) & (mask != 1), "response_mask", mask);
      TORCH_CHECK_VALUE(false, kMsgBadMask, where.empty() ? " (on another rank)" : where);
    case RolloutStatus::kNonFinite: {
      const auto valid = mask != 0;
      where = first_position(valid & at::logical_not(at::isfinite(log_prob)), "log_prob", log_prob);
      if (where.empty())
        where = first_position(valid & at::logical_not(at::isfinite(rollout_log_prob)), "rollout_log_prob",
                               rollout_log_prob);
      TORCH_CHECK_VALUE(false, kMsgNonFinite, where.empty() ? " (on another rank)" : where);
    }
    case RolloutStatus::kNoValidToken:
    default: TORCH_CHECK_VALUE(false, kMsgNoValidToken);
  }
}

// Dispatch over the two accumulation types (the inputs are read through dtype-tagged views).
#define RC_DISPATCH_ROLLOUT_ACC(ACC, NAME, ...)                                \
  [&] {                                                                        \
    if ((ACC) == at::kDouble) {                                                \
      using acc_t = double;                                                    \
      return __VA_ARGS__();                                                    \
    }                                                                          \
    TORCH_CHECK((ACC) == at::kFloat, NAME, ": unsupported accumulation type"); \
    using acc_t = float;                                                       \
    return __VA_ARGS__();                                                      \
  }()

}  // namespace rollout_corr
