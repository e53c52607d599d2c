// Operator schemas of the rollout_corr library. Backends register their kernels in their own files with
// TORCH_LIBRARY_IMPL(rollout_corr, CPU|CUDA, m); the Python op surface is rollout_corr_ext/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "cpu/reused_buffer.h"
#include "cpu/vec_math.h"
#include "rollout_correction_host.h"

extern "C" {
// `import rollout_corr_ext._C` loads this shared object, which runs the static registrations below. The module
// itself exposes nothing: every entry point is a torch.ops.rollout_corr.* operator.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace rollout_corr {

static bool built_with_cuda() {
#ifdef RC_WITH_CUDA
  return true;
#else
  return false;
#endif
}

static int64_t cpu_cache_bytes(bool release) { return cpu::ReusedBlockAllocator::retained_bytes_all(release); }

static at::Tensor cpu_scratch(at::IntArrayRef sizes, at::ScalarType dtype, int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < cpu::kScratchSlots, "cpu_scratch: slot must be in [0, ", cpu::kScratchSlots,
              "), got ", slot);
  return cpu::reused_empty(sizes, dtype, static_cast<cpu::ReusedUse>(static_cast<int>(cpu::ReusedUse::kScratch0) + slot));
}

bool mm_f32_uses_mkl();  // csrc/cpu/linear.cpp

static std::string cpu_isa() {
  switch (cpu::cpu_isa()) {
    case cpu::CpuIsa::kAvx512: return "avx512";
    case cpu::CpuIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

TORCH_LIBRARY(rollout_corr, m) {
  m.def("built_with_cuda() -> bool", &built_with_cuda);
  // Bytes the CPU kernels keep for their next large outputs (the out-of-place log-prob gradient, rollout weights and
  // mask: csrc/cpu/reused_buffer.h); with release, they are given back to the system first.
  m.def("cpu_cache_bytes(bool release) -> int", &cpu_cache_bytes);
  // An uninitialised contiguous CPU tensor from the reused block of scratch `slot` (0 to 7): a temporary that a
  // step frees and asks for again at the same size, written in pages already mapped (csrc/cpu/reused_buffer.h).
  // A block is handed out again only after the tensor holding it was freed.
  m.def("cpu_scratch(int[] size, ScalarType dtype, int slot) -> Tensor", &cpu_scratch);
  // The copy of the CPU log-prob kernels this process runs: "avx512", "avx2" or "baseline" (csrc/cpu/vec_math.h).
  m.def("cpu_isa() -> str", &cpu_isa);

  // §2 vocab-parallel log-probs. One read of a [N, V_local] shard -> the flat shard record [header + N * (4|5)]
  // (a 64-byte header: rows, vocab range, target fingerprint; then per row max x, sum exp, sum exp*z, target x
  // [, sum z], in max-shifted coordinates) that is all-gathered over the TP group, then merged. with_entropy=False:
  // the entropy sums may be skipped (the CPU kernels skip them: one FMA per element less), the header says so and
  // the merge returns NaN entropies.
  m.def(
      "vocab_row_stats(Tensor logits, Tensor target, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index, bool with_sum_z, bool with_entropy=True) -> Tensor");
  // [R, record_len] records of all shards -> (logp, entropy, mean_logp, row_state [N, 3] = (max x, log D, S/D),
  // status [4] int32). Checks that the shards tile the vocab and agree on rows and targets, that targets are in
  // range and rows hold no NaN / +inf and at least one finite logit: the CPU kernel raises a named error, the CUDA
  // kernel sets the status slots (asserted asynchronously by the caller).
  m.def(
      "merge_row_stats(Tensor gathered, Tensor target, int ignore_index, int vocab_size, float inv_temperature, "
      "bool with_sum_z) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Gradient of g_lp*logp + g_H*H + g_m*mean_logp w.r.t. the shard: one read, one write, no collective.
  m.def(
      "logprob_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor? grad_mean_logp, Tensor logits, "
      "Tensor target, Tensor row_state, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index) -> Tensor");
  // Same, written into the logits buffer (inplace_backward=True).
  m.def(
      "logprob_backward_(Tensor(a!) logits, Tensor? grad_logp, Tensor? grad_entropy, Tensor? grad_mean_logp, "
      "Tensor target, Tensor row_state, int vocab_start, int vocab_size, float inv_temperature, "
      "int ignore_index) -> ()");

  // §3 rollout correction, two passes over a padded [B, T] batch, or over a packed token stream [T] with
  // cu_seqlens [B + 1] (megatron's THD layout; sequences reduced segment by segment, no unpacking). log_prob,
  // rollout_log_prob: any float dtypes; mask: bool, integer or float holding 0/1. The typed configuration
  // arguments (RC_ROLLOUT_CONFIG_SCHEMA), their codes and every output slot: csrc/include/rollout_correction_layout.def.
  // Pass 1: per-sequence aggregates [B, K] (sums, then maxima), all-reduced over the context-parallel group
  // between the passes.
  m.def("rollout_seq_stats(Tensor log_prob, Tensor rollout_log_prob, Tensor mask, Tensor? cu_seqlens"
        RC_ROLLOUT_CONFIG_SCHEMA ") -> Tensor");
  // Pass 2: (IS weights [B, T] or [0], mask in mask's dtype, fp64 SUM partials, fp64 MAX partials). row_partials:
  // add the per-sequence terms (false on all but one rank of a context-parallel group).
  m.def("rollout_token_pass(Tensor log_prob, Tensor rollout_log_prob, Tensor mask, Tensor? cu_seqlens, Tensor seq_stats"
        RC_ROLLOUT_CONFIG_SCHEMA ", bool row_partials) -> (Tensor, Tensor, Tensor, Tensor)");
  // Checks the (reduced) SUM partials: a batch with no valid token, non-finite log-probs at valid positions
  // (unless excluded; allow_empty: a batch with no valid token passes), mask values other than 0/1, ranks with
  // different configs (agree false). CPU: raises a ValueError naming the first offending position of this rank's
  // inputs; CUDA: asynchronous device asserts. Returns a copy of sums, which the metrics are computed from (so the
  // check is part of any traced graph).
  m.def(
      "rollout_check(Tensor sums, Tensor? agree, Tensor log_prob, Tensor rollout_log_prob, Tensor mask, "
      "bool exclude_nonfinite, bool allow_empty=False) -> Tensor");

  // §4 fused policy loss, one pass over [B, T] (or a packed [T] stream with cu_seqlens [B + 1]): (loss_mat in
  // log_prob's shape, rows [B, 5] = loss sum, tokens, clip, dual clip, kl sum per sequence), in fp32 (fp64 for
  // fp64 log_prob). loss_kind: a PG_KIND_* of policy_loss_layout.def (0 PPO clip + dual clip, 1 REINFORCE, DPPO, GSPO,
  // SAPO, CISPO, DRO, GMPO, unbounded PPO); param_a / param_b: SAPO's tau_pos / tau_neg, DRO's beta.
  // with_loss_mat=False: loss_mat is an empty [0] tensor, and tokens whose mask is 0 need not be read (the
  // callers that aggregate the row sums only: one write and, for padding, every read less).
  m.def(
      "policy_loss_rows(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor response_mask, "
      "Tensor? weights, float clip_low, float clip_high, float clip_c, int loss_kind, Tensor? cu_seqlens=None, "
      "float param_a=0., float param_b=0., bool with_loss_mat=True) -> (Tensor, Tensor)");
  // d/d log_prob of sum(grad_loss_mat * loss_mat) + sum_b grad_rows_loss[b] * rows[b, 0], in log_prob's dtype.
  m.def(
      "policy_loss_backward(Tensor? grad_loss_mat, Tensor? grad_rows_loss, Tensor log_prob, Tensor old_log_prob, "
      "Tensor advantages, Tensor response_mask, Tensor? weights, float clip_low, float clip_high, float clip_c, "
      "int loss_kind, Tensor? cu_seqlens=None, float param_a=0., float param_b=0.) -> Tensor");

  // §5 sampling replay: the k largest values of each row of [N, C] (rows may be strided, each row contiguous),
  // descending, in fp32 (fp64 for fp64 values), -inf after a row's values when C < k; NaN is never a candidate.
  // The per-shard candidates of the top-k / top-p threshold search. CPU kernel; other devices run torch.topk
  // through the Python wrapper (rollout_corr_ext/ops.py).
  m.def("row_topk(Tensor values, int k) -> Tensor");
  // out = x with -inf where z = x / temperature (fp32; fp64 for fp64 x) is under the row's floor [N] (fp32 / fp64):
  // the kept set of a replayed row, {z >= floor}. Rows of x and out contiguous; out may be x. CPU kernel; other
  // devices run torch.where through the Python wrapper.
  m.def("floor_fill(Tensor x, Tensor floor, float temperature, Tensor(a!) out) -> ()");
  // grad = 0 where x / temperature is under the row's floor (grad and x of one shape and dtype): the replayed
  // log-probs' gradient, taken on the unmasked logits, with the columns outside the kept set zeroed.
  m.def("floor_zero_(Tensor(a!) grad, Tensor x, Tensor floor, float temperature) -> ()");
  // One round of the top-p search without top-k: [N, P + 1] int64, per row the integer masses round(exp(z - z_max)
  // * 2^40) of the values z >= floor with lo < key(z) <= hi, bucketed by how many of the row's P ascending probes
  // lie under key(z) (key: the order-preserving integer of the value in fp32 / fp64; P + 1 a power of 2). z: any
  // float dtype (bf16 / fp16 widened exactly); z_max, floor in fp32 (fp64 for fp64 z).
  m.def("mass_histogram(Tensor z, Tensor z_max, Tensor floor, Tensor lo, Tensor hi, Tensor probes) -> Tensor");
  // [N] int64: per row the number of values z >= floor (z any float dtype, compared in fp32 / fp64; floor in that
  // dtype): the run of values tied at the end of a shard's candidate list.
  m.def("count_at_least(Tensor z, Tensor floor) -> Tensor");
  // The replay of top-k sampling in one read of the logits x [N, C] (fp32 / bf16 / fp16; rows contiguous): per row
  // with k[r] >= 1 (<= 0: an ignored row, never read), z = x / temperature in fp32, and
  //   values [N, width] fp32, index [N, width] int64: every z >= the row's k-th largest over its first valid_cols
  //     columns (ties kept whole; -inf never), sorted by value descending then column ascending, -inf / -1 padded;
  //   count [N] int64: how many there are (> width: the list holds the first width of them);
  //   stats [N, 3] fp64: max z (NaN if the row holds NaN or +inf, -inf if every value is -inf),
  //     sum exp(z - max z), z at target_col[r] (-inf where target_col is -1).
  // CPU kernel; other devices (and fp64) run torch ops through the Python wrapper.
  m.def("row_candidates(Tensor x, Tensor k, Tensor target_col, int width, float temperature, int valid_cols) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  // [N, cols] of dtype: 0, with values[r, w] at column index[r, w] where that is >= 0 (the replay's gradient, which
  // lives on the kept candidates only). CPU kernel (the log-prob gradient's reused block); torch elsewhere.
  m.def("scatter_rows(Tensor values, Tensor index, int cols, ScalarType dtype) -> Tensor");
  // The replay's decision on each row's candidates cand [N, C] (fp32 / fp64, in any order, -inf padded, holding
  // every value >= the row's k-th largest): tau [N] (cand's dtype; the kept set is {z >= tau, z > -inf}) =
  // max(floor (the min-p threshold, or -inf), the k-th largest, the top-p threshold where top_p < 1: the smallest
  // v with M(<= v) > min(floor((1 - p) M), M - 1) in integer masses round(exp(z - z_max) 2^40)), and out [N, 4] fp64:
  // the target's log-prob under the kept set's softmax ((z_t - z_max) - log_kept; -inf outside it), the entropy over
  // it, log S = log_kept - log(sum_all) (<= 0), log_kept = log(sum_kept exp(z - z_max)) (>= 0). Every log-prob is
  // formed relative to z_max, never as z - (z_max + log_kept): for |z| past ~2^52 that sum rounds log_kept away.
  // Rows with k <= 0 are skipped (zeros, tau -inf).
  m.def("candidate_decide(Tensor cand, Tensor z_max, Tensor z_t, Tensor sum_all, Tensor k, Tensor floor, "
        "Tensor top_p) -> (Tensor, Tensor)");

  // §6 the fused linear log-probs' GEMM and gradient accumulator. mm_f32_: out [M, N] fp32 = a [M, K] @ b [K, N] + beta * out, a and b both bf16 or
  // both fp16 (any strides with one of them 1), products accumulated in fp32 and never rounded to 16 bits; out
  // with unit column stride. CPU kernel (MKL's 16-bit GEMM with fp32 output: csrc/cpu/linear.cpp); CUDA runs
  // torch's out_dtype matmul through the Python wrapper (rollout_corr_ext/ops.py).
  m.def("mm_f32_(Tensor(a!) out, Tensor a, Tensor b, float beta) -> ()");
  // The fused path's 16-bit gradient accumulator: (hi, lo) += x row by row, x [R, C] (hi's dtype or fp32) added to
  // rows index[i] (distinct; all R = N rows when index is None) of hi [N, C] (bf16 / fp16) and lo [N, C] (bf16):
  // s = (hi + lo) + x in fp32, hi = s rounded to hi's dtype, lo = bf16(s - hi) (0 where hi overflows). Unit column
  // strides. CPU kernel; other devices run the fallback's torch ops.
  m.def("hilo_add_(Tensor(a!) hi, Tensor(b!) lo, Tensor x, Tensor? index) -> ()");
  // Whether the CPU kernel of mm_f32_ calls MKL (false: it widens its inputs to fp32 first: more memory, same values).
  m.def("mm_f32_uses_mkl() -> bool", &mm_f32_uses_mkl);
}

}  // namespace rollout_corr
