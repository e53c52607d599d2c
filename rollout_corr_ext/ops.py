"""The whole Python op surface: typed wrappers over ``torch.ops.rollout_corr.*``, fake kernels and autograd.

Every wrapper calls the compiled op when the extension is active and has kernels for the input's device, and the
function of the same name in :mod:`rollout_corr_ext.fallback` otherwise, so the layers above never care which
backend runs. Fake (meta) kernels are registered as soon as the library is loaded (at import), so ``torch.compile``
and meta tensors work on ``torch.ops.rollout_corr.*`` before any wrapper has run.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _layout as LY
from . import fallback

_compiled = False
_compiled_cuda = False


def on_extension_loaded() -> None:
    """Called by the package once ``torch.ops.rollout_corr`` exists: switch to it and register fakes."""
    global _compiled, _compiled_cuda
    if _compiled:
        return
    _register_fakes()
    _compiled = True
    _compiled_cuda = bool(torch.ops.rollout_corr.built_with_cuda())


def _has_kernel(device: torch.device) -> bool:
    """The compiled library has kernels for ``device`` (CPU always; CUDA when built with it; meta via the fakes)."""
    if not _compiled:
        return False
    return device.type in ("cpu", "meta") or (device.type == "cuda" and _compiled_cuda)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register_fakes() -> None:
    @torch.library.register_fake("rollout_corr::vocab_row_stats")
    def _(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index, with_sum_z, with_entropy=True):
        torch._check(logits.dim() == 2, lambda: f"logits must be 2-D, got {logits.dim()}-D")
        torch._check(target.shape[0] == logits.shape[0], lambda: "target must have one id per logits row")
        acc = _stats_dtype(logits.dtype)
        k = 5 if with_sum_z else 4
        return logits.new_empty((LY.header_len(acc) + logits.shape[0] * k,), dtype=acc)

    @torch.library.register_fake("rollout_corr::merge_row_stats")
    def _(gathered, target, ignore_index, vocab_size, inv_temperature, with_sum_z):
        torch._check(gathered.dim() == 2, lambda: f"gathered must be 2-D, got {gathered.dim()}-D")
        n = target.shape[0]
        return (
            gathered.new_empty((n,)),
            gathered.new_empty((n,)),
            gathered.new_empty((n,)),
            gathered.new_empty((n, LY.ROW_STATE_COLS)),
            gathered.new_empty((4,), dtype=torch.int32),
        )

    @torch.library.register_fake("rollout_corr::logprob_backward")
    def _(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start, vocab_size,
          inv_temperature, ignore_index):
        return logits.new_empty(tuple(logits.shape))

    @torch.library.register_fake("rollout_corr::logprob_backward_")
    def _(logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state, vocab_start, vocab_size,
          inv_temperature, ignore_index):
        return None

    _register_rollout_fakes()
    _register_policy_loss_ops()

    @torch.library.register_fake("rollout_corr::row_topk")
    def _(values, k):
        torch._check(values.dim() == 2, lambda: f"values must be 2-D, got {values.dim()}-D")
        torch._check(k >= 1, lambda: f"k must be >= 1, got {k}")
        return values.new_empty((values.shape[0], k), dtype=_stats_dtype(values.dtype))

    @torch.library.register_fake("rollout_corr::floor_fill")
    def _(x, floor, temperature, out):
        return None

    @torch.library.register_fake("rollout_corr::floor_zero_")
    def _(grad, x, floor, temperature):
        return None

    @torch.library.register_fake("rollout_corr::count_at_least")
    def _(z, floor):
        return z.new_empty((z.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("rollout_corr::mass_histogram")
    def _(z, z_max, floor, lo, hi, probes):
        return z.new_empty((z.shape[0], probes.shape[1] + 1), dtype=torch.int64)

    @torch.library.register_fake("rollout_corr::row_candidates")
    def _(x, k, target_col, width, temperature, valid_cols):
        torch._check(x.dim() == 2, lambda: f"x must be 2-D, got {x.dim()}-D")
        n = x.shape[0]
        return (x.new_empty((n, width), dtype=torch.float32), x.new_empty((n, width), dtype=torch.int64),
                x.new_empty((n,), dtype=torch.int64), x.new_empty((n, 3), dtype=torch.float64))

    @torch.library.register_fake("rollout_corr::candidate_decide")
    def _(cand, z_max, z_t, sum_all, k, floor, top_p):
        n = cand.shape[0]
        return cand.new_empty((n,)), cand.new_empty((n, 4), dtype=torch.float64)

    @torch.library.register_fake("rollout_corr::scatter_rows")
    def _(values, index, cols, dtype):
        return values.new_empty((values.shape[0], cols), dtype=dtype)

    @torch.library.register_fake("rollout_corr::mm_f32_")
    def _(out, a, b, beta):
        return None

    @torch.library.register_fake("rollout_corr::hilo_add_")
    def _(hi, lo, x, index):
        return None


# ---------------------------------------------------------------------------------------------------------
# §2 vocab-parallel log-probs: local row statistics, merge of the gathered records, backward
# ---------------------------------------------------------------------------------------------------------


def vocab_row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
    with_sum_z: bool,
    with_entropy: bool = True,
) -> torch.Tensor:
    """The flat shard record (header + ``[N, 4|5]`` max-shifted row summaries) of one shard ``[N, V_local]``.

    ``with_entropy=False``: the entropy sums may be skipped (the CPU kernels skip them); the header says so and
    ``merge_row_stats`` then returns NaN entropies."""
    if _has_kernel(logits.device):
        return torch.ops.rollout_corr.vocab_row_stats.default(
            logits, target, vocab_start, vocab_size, inv_temperature, ignore_index, with_sum_z, with_entropy
        )
    return fallback.vocab_row_stats(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index,
                                     with_sum_z, with_entropy)


def merge_row_stats(
    gathered: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int, inv_temperature: float,
    with_sum_z: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``[R, record_len]`` shard records into (logp, entropy, mean_logp, row_state ``[N, 3]``, status ``[4]``).

    Raises on CPU for a bad shard layout, out-of-range targets, NaN / +inf logits and rows of only -inf; on CUDA
    the same conditions set ``status`` (the caller asserts it asynchronously).
    """
    if _has_kernel(gathered.device):
        return torch.ops.rollout_corr.merge_row_stats.default(gathered, target, ignore_index, vocab_size,
                                                              inv_temperature, with_sum_z)
    return fallback.merge_row_stats(gathered, target, ignore_index, vocab_size, inv_temperature, with_sum_z)


def logprob_backward(
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    grad_mean_logp: Optional[torch.Tensor],
    logits: torch.Tensor,
    target: torch.Tensor,
    row_state: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
) -> torch.Tensor:
    """Gradient of sum(g_lp*logp + g_H*H + g_m*mean_logp) w.r.t. the shard, in the logits dtype."""
    if _has_kernel(logits.device):
        return torch.ops.rollout_corr.logprob_backward.default(
            grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start, vocab_size,
            inv_temperature, ignore_index,
        )
    return fallback.logprob_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
                                      vocab_start, vocab_size, inv_temperature, ignore_index)


def logprob_backward_(
    logits: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    grad_mean_logp: Optional[torch.Tensor],
    target: torch.Tensor,
    row_state: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
) -> None:
    """Like :func:`logprob_backward` but writes the gradient into ``logits`` (declared mutation)."""
    if _has_kernel(logits.device):
        torch.ops.rollout_corr.logprob_backward_.default(
            logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state, vocab_start, vocab_size,
            inv_temperature, ignore_index,
        )
        return
    fallback.logprob_backward_(logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state,
                                vocab_start, vocab_size, inv_temperature, ignore_index)


def cpu_cache_bytes(release: bool = False) -> int:
    """Bytes the compiled CPU kernels keep for their next large outputs: the out-of-place log-prob gradient and
    rollout correction's weights and mask, one block each (csrc/cpu/reused_buffer.h; 0 without the compiled
    kernels), the policy loss's per-token loss and the whole-batch losses' scratch blocks (:func:`scratch_empty`).
    With ``release`` they are given back to the system first, and the count of bytes freed is returned."""
    if not _compiled:
        return 0
    return int(torch.ops.rollout_corr.cpu_cache_bytes.default(bool(release)))


def scratch_empty(shape, dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
    """An uninitialised contiguous tensor for a temporary that never leaves its call. On the CPU (compiled kernels,
    eager) its storage is the reused block of scratch ``slot`` (0 to ``LY.SCRATCH_SLOTS - 1``; one per temporary
    alive at the same time):
    a step that frees it and asks again at the same size writes into pages already mapped instead of faulting in
    fresh ones (csrc/cpu/reused_buffer.h; a block is handed out again only once the tensor holding it is freed).
    Elsewhere ``torch.empty``."""
    if _compiled and device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.ops.rollout_corr.cpu_scratch.default(list(shape), dtype, int(slot))
    return torch.empty(shape, dtype=dtype, device=device)


def cpu_isa() -> str:
    """The copy of the compiled CPU log-prob kernels this process runs: ``"avx512"``, ``"avx2"`` (AVX2 + FMA) or
    ``"baseline"``, the widest the CPU runs unless ``ROLLOUT_CORR_CPU_ISA`` narrows it (read once per process);
    ``"none"`` without the compiled kernels."""
    if not _compiled:
        return "none"
    return str(torch.ops.rollout_corr.cpu_isa.default())


# ---------------------------------------------------------------------------------------------------------
# §3 rollout correction: pass 1 (per-sequence aggregates) and pass 2 (weights, mask, packed metric partials)
# ---------------------------------------------------------------------------------------------------------

#: The typed configuration arguments of the rollout ops, in schema order (declared once, in
#: csrc/include/rollout_correction_layout.def's RC_ROLLOUT_CONFIG).
RolloutOpArgs = LY.RolloutOpArgs
_NUM_CONFIG = len(RolloutOpArgs._fields)


def _rollout_acc(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (log_prob.dtype, rollout_log_prob.dtype) else torch.float32


def _register_rollout_fakes() -> None:
    def rows_of(log_prob, cu_seqlens):
        if cu_seqlens is None:
            torch._check(log_prob.dim() == 2, lambda: f"log_prob must be 2-D, got {log_prob.dim()}-D")
            return log_prob.shape[0]
        torch._check(log_prob.dim() == 1, lambda: "with cu_seqlens, log_prob must be 1-D (packed tokens)")
        return cu_seqlens.shape[0] - 1

    @torch.library.register_fake("rollout_corr::rollout_seq_stats")
    def _(log_prob, rollout_log_prob, mask, cu_seqlens, *config):
        torch._check(rollout_log_prob.shape == log_prob.shape, lambda: "rollout_log_prob must have log_prob's shape")
        torch._check(mask.shape == log_prob.shape, lambda: "mask must have log_prob's shape")
        return log_prob.new_empty((rows_of(log_prob, cu_seqlens), LY.SEQ_COLS),
                                  dtype=_rollout_acc(log_prob, rollout_log_prob))

    @torch.library.register_fake("rollout_corr::rollout_token_pass")
    def _(log_prob, rollout_log_prob, mask, cu_seqlens, seq_stats, *config_and_row_partials):
        a = RolloutOpArgs(*config_and_row_partials[:_NUM_CONFIG])
        torch._check(mask.shape == log_prob.shape, lambda: "mask must have log_prob's shape")
        torch._check(seq_stats.shape[0] == rows_of(log_prob, cu_seqlens),
                     lambda: "seq_stats must have one row per sequence")
        n_sum, n_max = LY.partial_sizes(len(a.rs_level))
        acc = _rollout_acc(log_prob, rollout_log_prob)
        w_shape = tuple(log_prob.shape) if a.is_level != LY.IS_LEVEL["none"] else (0,)
        return (
            log_prob.new_empty(w_shape, dtype=acc),
            mask.new_empty(tuple(mask.shape)),
            log_prob.new_empty((n_sum,), dtype=torch.float64),
            log_prob.new_empty((n_max,), dtype=torch.float64),
        )

    @torch.library.register_fake("rollout_corr::rollout_check")
    def _(sums, agree, log_prob, rollout_log_prob, mask, exclude_nonfinite, allow_empty=False):
        return torch.empty_like(sums)


def rollout_seq_stats(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
                      args: RolloutOpArgs, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pass 1: per-sequence aggregates ``[B, _layout.SEQ_COLS]`` of a padded ``[B, T]`` slice, or of a packed
    ``[T]`` token stream with ``cu_seqlens`` ``[B + 1]``."""
    if _has_kernel(log_prob.device):
        return torch.ops.rollout_corr.rollout_seq_stats.default(log_prob, rollout_log_prob, mask, cu_seqlens, *args)
    return fallback.rollout_seq_stats(log_prob, rollout_log_prob, mask, cu_seqlens, *args)


def rollout_token_pass(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    seq_stats: torch.Tensor,
    args: RolloutOpArgs,
    row_partials: bool,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 2: (weights, mask_out, SUM partials fp64, MAX partials fp64); weights and mask_out in the inputs'
    layout (padded ``[B, T]`` or packed ``[T]``)."""
    if _has_kernel(log_prob.device):
        return torch.ops.rollout_corr.rollout_token_pass.default(log_prob, rollout_log_prob, mask, cu_seqlens,
                                                                 seq_stats, *args, row_partials)
    return fallback.rollout_token_pass(log_prob, rollout_log_prob, mask, cu_seqlens, seq_stats, *args, row_partials)


def rollout_check(sums: torch.Tensor, agree: Optional[torch.Tensor], log_prob: torch.Tensor,
                  rollout_log_prob: torch.Tensor, mask: torch.Tensor, exclude_nonfinite: bool,
                  allow_empty: bool = False) -> torch.Tensor:
    """The batch checks of the reduced SUM partials (raise on CPU, device asserts on CUDA); returns a copy.
    ``allow_empty``: a batch without any valid token passes (``compute_rollout_correction(empty="nan")``)."""
    if _has_kernel(log_prob.device):
        return torch.ops.rollout_corr.rollout_check.default(sums, agree, log_prob, rollout_log_prob, mask,
                                                            exclude_nonfinite, allow_empty)
    return fallback.rollout_check(sums, agree, log_prob, rollout_log_prob, mask, exclude_nonfinite, allow_empty)


# ---------------------------------------------------------------------------------------------------------
# §4 policy losses: the fused per-token loss + per-row partials, and its backward
# ---------------------------------------------------------------------------------------------------------


def _register_policy_loss_ops() -> None:
    """Fakes of both ops and the autograd formula of ``policy_loss_rows`` (gradient in ``log_prob`` only)."""

    @torch.library.register_fake("rollout_corr::policy_loss_rows")
    def _(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c, loss_kind,
          cu_seqlens=None, param_a=0.0, param_b=0.0, with_loss_mat=True):
        acc = _stats_dtype(log_prob.dtype)
        rows = log_prob.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return (log_prob.new_empty(tuple(log_prob.shape) if with_loss_mat else (0,), dtype=acc),
                log_prob.new_empty((rows, LY.PG_ROW_KL_SUM + 1), dtype=acc))

    @torch.library.register_fake("rollout_corr::policy_loss_backward")
    def _(grad_loss_mat, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
          clip_high, clip_c, loss_kind, cu_seqlens=None, param_a=0.0, param_b=0.0):
        return log_prob.new_empty(tuple(log_prob.shape))

    register_policy_loss_autograd("rollout_corr")


_POLICY_LOSS_AUTOGRAD = set()


def register_policy_loss_autograd(namespace: str) -> None:
    """The autograd formula of ``<namespace>::policy_loss_rows``: the gradient reaches ``log_prob`` only, through
    ``<namespace>::policy_loss_backward``. Written once for the real op and the CUDA emulator's copy
    (``rollout_corr_emu``), whose schema adds trailing launch knobs, passed on to its backward."""
    if namespace in _POLICY_LOSS_AUTOGRAD:
        return
    backward_op = getattr(torch.ops, namespace).policy_loss_backward.default

    def backward(ctx, grad_loss_mat, grad_rows):
        grad_log_prob = _policy_loss_rows_grad(ctx, backward_op, grad_loss_mat, _loss_column(grad_rows),
                                               ctx.needs_input_grad[0])
        if grad_log_prob is not None and torch.is_grad_enabled():  # create_graph=True on the raw op: the backward
            # op has no second-order formula, so differentiating its gradient again raises (it came back None)
            grad_log_prob = NoDoubleBackward.apply(grad_log_prob, f"{namespace}::policy_loss_rows",
                                                   ctx.saved_tensors[0])
        return (grad_log_prob,) + (None,) * (len(ctx.needs_input_grad) - 1)

    torch.library.register_autograd(f"{namespace}::policy_loss_rows", backward,
                                    setup_context=_policy_loss_rows_setup_context)
    _POLICY_LOSS_AUTOGRAD.add(namespace)


class NoDoubleBackward(torch.autograd.Function):
    """Identity on a first-order gradient whose own backward raises: the ops' second-order terms are not
    implemented, so differentiating their gradients again (``create_graph=True``) is an error, never a silent 0.
    ``anchors`` are the inputs the gradient depends on (so that the identity is part of the double-backward graph)."""

    @staticmethod
    def forward(ctx, grad, what, *anchors):
        ctx.what = what
        return grad.clone()

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(f"{ctx.what}: double backward (differentiating the gradient again, e.g. after "
                           f"create_graph=True) is not supported")


class _FirstOrderOnly(torch.autograd.Function):
    """Identity in forward; in a backward run with ``create_graph=True`` the gradient passes through
    :class:`NoDoubleBackward`, whatever the backend below computed it with."""

    @staticmethod
    def forward(ctx, x, what):
        ctx.what = what
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None and torch.is_grad_enabled():  # create_graph=True
            grad = NoDoubleBackward.apply(grad, ctx.what, ctx.saved_tensors[0])
        return grad, None


def first_order_only(x: torch.Tensor, what: str) -> torch.Tensor:
    """``x`` unchanged; the gradient that reaches it cannot be differentiated again (a clear error names ``what``)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _FirstOrderOnly.apply(x, what)


def _policy_loss_rows_setup_context(ctx, inputs, output):
    """setup_context of ``policy_loss_rows``' autograd formula (the registered one and :class:`_PolicyLossRowsEager`):
    ``inputs`` the op's arguments, the emulator's trailing launch knobs included."""
    (log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c, loss_kind,
     cu_seqlens, param_a, param_b, with_loss_mat, *knobs) = inputs
    ctx.save_for_backward(log_prob, old_log_prob, advantages, response_mask, weights, cu_seqlens)
    # An output nothing differentiates (most callers use only the row sums) arrives as None, not as a zero
    # [B, T] tensor autograd would fill and the kernel read.
    ctx.set_materialize_grads(False)
    ctx.scalars = (clip_low, clip_high, clip_c, loss_kind)
    ctx.params = (param_a, param_b)
    ctx.with_loss_mat = with_loss_mat
    ctx.knobs = tuple(knobs)


def _policy_loss_rows_grad(ctx, backward_op, grad_loss_mat, grad_rows_loss, needed: bool):
    """The gradient in ``log_prob`` of ``policy_loss_rows`` (None when nothing needs it: ``needed``, whether
    ``log_prob`` wants one): through ``backward_op``. ``grad_rows_loss``: the gradient of the rows' loss column (only
    it carries one: the others are detached metric partials), or None."""
    log_prob, old_log_prob, advantages, response_mask, weights, cu_seqlens = ctx.saved_tensors
    if not ctx.with_loss_mat:
        grad_loss_mat = None  # the gradient of an empty loss_mat
    if not needed or (grad_loss_mat is None and grad_rows_loss is None):
        return None
    # advantages and weights are constants of the loss (callers detach the weights).
    return backward_op(grad_loss_mat, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights,
                       *ctx.scalars, cu_seqlens, *ctx.params, *ctx.knobs)


def _loss_column(grad_rows):
    return None if grad_rows is None else grad_rows[:, LY.PG_ROW_LOSS_SUM]


def _no_double_backward(grad, ctx):
    if grad is not None and torch.is_grad_enabled():  # create_graph=True
        grad = NoDoubleBackward.apply(grad, ctx.what, ctx.saved_tensors[0])
    return grad


class _PolicyLossRowsEager(torch.autograd.Function):
    """``policy_loss_rows`` with its registered autograd formula as one eager node whose gradient cannot be
    differentiated again (:func:`first_order_only`'s error): torch's ``register_autograd`` wrapper re-binds the
    op's 13-argument schema on every call (about 45 us here), and first_order_only would add a second node; at a
    micro-batch's size that overhead is most of a call. ``torch.compile`` keeps the registered path."""

    @staticmethod
    def forward(ctx, what, *inputs):
        # Straight to the backend: below autograd, not through the registered formula's wrapper (which, grad mode
        # being off inside forward, would only redispatch).
        with torch._C._AutoDispatchBelowAutograd():
            output = torch.ops.rollout_corr.policy_loss_rows.default(*inputs)
        _policy_loss_rows_setup_context(ctx, inputs, output)
        ctx.what = what
        return output

    @staticmethod
    def backward(ctx, grad_loss_mat, grad_rows):
        grad = _policy_loss_rows_grad(ctx, torch.ops.rollout_corr.policy_loss_backward.default, grad_loss_mat,
                                      _loss_column(grad_rows), ctx.needs_input_grad[1])
        return (None, _no_double_backward(grad, ctx)) + (None,) * (len(ctx.needs_input_grad) - 2)


class _PolicyLossEager(torch.autograd.Function):
    """``policy_loss_rows`` and the aggregation of its loss column into the loss, one eager node (first-order only,
    as :class:`_PolicyLossRowsEager`): the aggregation's handful of ops on ``[B]`` vectors, each an autograd node
    forward and backward, cost most of a micro-batch's call, and twice that from a cold cache. ``rows`` comes back
    detached (metrics only)."""

    @staticmethod
    def forward(ctx, what, aggregation, forward_op, backward_op, *inputs):
        with torch._C._AutoDispatchBelowAutograd():  # straight to the backend: no pass through the op's autograd
            loss_mat, rows = forward_op(*inputs)
        _policy_loss_rows_setup_context(ctx, inputs, (loss_mat, rows))
        row_tokens = rows[:, LY.PG_ROW_TOKENS]
        ctx.mark_non_differentiable(rows)  # so what ctx keeps of it makes no reference cycle
        ctx.what, ctx.aggregation, ctx.backward_op, ctx.row_tokens = what, aggregation, backward_op, row_tokens
        ctx.terms = aggregation.terms(row_tokens, rows.dtype)
        return aggregation.value(rows[:, LY.PG_ROW_LOSS_SUM], row_tokens, ctx.terms), rows

    @staticmethod
    def backward(ctx, grad_loss, unused_grad_rows):
        grad_rows_loss = None if grad_loss is None else ctx.aggregation.grad(grad_loss, ctx.row_tokens, ctx.terms)
        grad = _policy_loss_rows_grad(ctx, ctx.backward_op, None, grad_rows_loss, ctx.needs_input_grad[4])
        return (None,) * 4 + (_no_double_backward(grad, ctx),) + (None,) * (len(ctx.needs_input_grad) - 5)


def policy_loss_backward(grad_rows_loss: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                         advantages: torch.Tensor, response_mask: torch.Tensor, weights: Optional[torch.Tensor],
                         clip_low: float, clip_high: float, clip_c: float, loss_kind: int,
                         cu_seqlens: Optional[torch.Tensor] = None, param_a: float = 0.0,
                         param_b: float = 0.0) -> torch.Tensor:
    """d/d ``log_prob`` of ``sum_b grad_rows_loss[b] * rows[b, LY.PG_ROW_LOSS_SUM]`` of :func:`policy_loss_rows`
    (same arguments), for callers that run the op inside an autograd function of their own: the kernel's backward
    (its output may be a reused block, the caller's to write), or autograd through the fallback."""
    if _has_kernel(log_prob.device):
        return torch.ops.rollout_corr.policy_loss_backward.default(
            None, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights, float(clip_low),
            float(clip_high), float(clip_c), int(loss_kind), cu_seqlens, float(param_a), float(param_b))
    return policy_loss_backward_composed(grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights,
                                         clip_low, clip_high, clip_c, loss_kind, cu_seqlens, param_a, param_b)


def policy_loss_backward_composed(grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights,
                                  clip_low, clip_high, clip_c, loss_kind, cu_seqlens=None, param_a=0.0, param_b=0.0):
    """:func:`policy_loss_backward` as autograd through the fallback's rows (any layout: the caller's to make
    contiguous where it needs)."""
    with torch.enable_grad():
        x = log_prob.detach().requires_grad_(True)
        _, rows = fallback.policy_loss_rows(x, old_log_prob, advantages, response_mask, weights, clip_low, clip_high,
                                            clip_c, loss_kind, cu_seqlens, param_a, param_b)
        return torch.autograd.grad(rows[:, LY.PG_ROW_LOSS_SUM], x, grad_rows_loss)[0]


def policy_loss_rows(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    weights: Optional[torch.Tensor],
    clip_low: float,
    clip_high: float,
    clip_c: float,
    loss_kind: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    param_a: float = 0.0,
    param_b: float = 0.0,
    with_loss_mat: bool = True,
    *,
    first_order: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss (``[B, T]``, or ``[T]`` packed with ``cu_seqlens``) and per-sequence partials
    ``[B, 5]`` (``LY.PG_ROW_*``) in one pass; ``loss_kind`` a ``LY.PG_KIND_*`` (``param_a`` / ``param_b``: SAPO's
    tau_pos / tau_neg, DRO's beta).

    Same contract as :func:`rollout_corr_ext.fallback.policy_loss_rows`: ``loss_mat`` and the loss column of
    ``rows`` are differentiable in ``log_prob`` only: ``advantages`` and ``weights`` (may be None) are constants.
    ``first_order``: the gradient cannot be differentiated again, an error naming ``first_order`` says so
    (:func:`first_order_only`).
    """
    if _has_kernel(log_prob.device):
        if weights is not None:
            weights = weights.detach()
        args = (log_prob, old_log_prob, advantages, response_mask, weights, float(clip_low), float(clip_high),
                float(clip_c), int(loss_kind), cu_seqlens, float(param_a), float(param_b), bool(with_loss_mat))
        if first_order is None:
            return torch.ops.rollout_corr.policy_loss_rows.default(*args)
        if torch.is_grad_enabled() and log_prob.requires_grad and not torch.compiler.is_compiling():
            return _PolicyLossRowsEager.apply(first_order, *args)
        return torch.ops.rollout_corr.policy_loss_rows.default(first_order_only(log_prob, first_order), *args[1:])
    if first_order is not None:
        log_prob = first_order_only(log_prob, first_order)
    return fallback.policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
                                      clip_high, clip_c, loss_kind, cu_seqlens, param_a, param_b, with_loss_mat)


def policy_loss(log_prob, old_log_prob, advantages, response_mask, weights, clip_low: float, clip_high: float,
                clip_c: float, loss_kind: int, aggregation, cu_seqlens: Optional[torch.Tensor] = None,
                param_a: float = 0.0, param_b: float = 0.0, *, first_order: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss, rows)``: :func:`policy_loss_rows` (no loss matrix) with its loss column aggregated by
    ``aggregation`` (:class:`rollout_corr_ext.losses.RowAggregation`: ``value(row_loss_sum, row_tokens)`` and its
    gradient ``grad(grad_loss, row_tokens)``); ``rows`` detached, for metrics. Eager on the kernels with a gradient
    wanted: one autograd node (:class:`_PolicyLossEager`); otherwise (compile, the fallback backend, no grad) the op
    and ``aggregation.value`` through autograd, the same values (:func:`policy_loss_composed`)."""
    if _has_kernel(log_prob.device) and not torch.compiler.is_compiling():
        return policy_loss_node(torch.ops.rollout_corr.policy_loss_rows.default,
                                torch.ops.rollout_corr.policy_loss_backward.default, log_prob, old_log_prob,
                                advantages, response_mask, weights, clip_low, clip_high, clip_c, loss_kind,
                                aggregation, cu_seqlens, param_a, param_b, first_order=first_order)
    return policy_loss_composed(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high,
                                clip_c, loss_kind, aggregation, cu_seqlens, param_a, param_b, first_order=first_order)


def policy_loss_node(forward_op, backward_op, log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
                     clip_high, clip_c, loss_kind, aggregation, cu_seqlens=None, param_a=0.0, param_b=0.0, *,
                     first_order: str):
    """:func:`policy_loss` as one autograd node over ``forward_op`` / ``backward_op`` (``policy_loss_rows`` and
    ``policy_loss_backward`` of a namespace: the compiled ops, or the CUDA emulator's in tests) when a gradient is
    wanted; the forward op alone otherwise."""
    args = (log_prob, old_log_prob, advantages, response_mask, None if weights is None else weights.detach(),
            float(clip_low), float(clip_high), float(clip_c), int(loss_kind), cu_seqlens, float(param_a),
            float(param_b), False)
    if torch.is_grad_enabled() and log_prob.requires_grad:
        return _PolicyLossEager.apply(first_order, aggregation, forward_op, backward_op, *args)
    _, rows = forward_op(*args)
    return aggregation.value(rows[:, LY.PG_ROW_LOSS_SUM], rows[:, LY.PG_ROW_TOKENS]), rows


def policy_loss_composed(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                         loss_kind, aggregation, cu_seqlens=None, param_a=0.0, param_b=0.0, *, first_order: str):
    """:func:`policy_loss` as :func:`policy_loss_rows` and ``aggregation.value`` under autograd."""
    _, rows = policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high,
                               clip_c, loss_kind, cu_seqlens, param_a, param_b, False, first_order=first_order)
    return aggregation.value(rows[:, LY.PG_ROW_LOSS_SUM], rows[:, LY.PG_ROW_TOKENS]), rows.detach()


# ---------------------------------------------------------------------------------------------------------
# §5 sampling replay: the per-shard candidates of the threshold search (CPU and CUDA kernels)
# ---------------------------------------------------------------------------------------------------------


def row_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row of ``values`` ``[N, C]``, descending, fp32 (fp64 for fp64), -inf after a
    row's values when ``C < k``. The compiled CPU kernel streams each row once (csrc/cpu/sampling.cpp), the CUDA
    kernel selects by radix rounds (csrc/cuda/sampling_kernels.cuh); the fallback backend runs ``torch.topk``."""
    if _has_kernel(values.device):
        return torch.ops.rollout_corr.row_topk.default(values, int(k))
    return fallback.row_topk(values, k)


def floor_fill(x: torch.Tensor, floor: torch.Tensor, temperature: float, out: torch.Tensor) -> None:
    """``out`` = ``x`` with -inf where ``x / temperature`` (fp32; fp64 for fp64 ``x``) is under the row's ``floor``:
    the kept set ``{z >= floor}`` of a replayed row (CPU and CUDA kernels; ``torch.where`` on the fallback backend).
    ``out`` may be ``x``."""
    if _has_kernel(x.device):
        torch.ops.rollout_corr.floor_fill.default(x, floor, float(temperature), out)
        return
    fallback.floor_fill(x, floor, temperature, out)


def mass_histogram(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   probes: torch.Tensor) -> torch.Tensor:
    """One round of the top-p search: ``[N, P + 1]`` int64, per row the integer masses of the values ``z >= floor``
    with ``lo < key(z) <= hi``, bucketed by how many of the row's ascending ``probes`` lie under ``key(z)``
    (CPU and CUDA kernels; torch ops on the fallback backend)."""
    if _has_kernel(z.device):
        return torch.ops.rollout_corr.mass_histogram.default(z, z_max, floor, lo, hi, probes)
    return fallback.mass_histogram(z, z_max, floor, lo, hi, probes)


def count_at_least(z: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: per row the number of values ``z >= floor`` (compared in fp32 / fp64)."""
    if _has_kernel(z.device):
        return torch.ops.rollout_corr.count_at_least.default(z, floor)
    return fallback.count_at_least(z, floor)


def floor_zero_(grad: torch.Tensor, x: torch.Tensor, floor: torch.Tensor, temperature: float) -> None:
    """``grad`` = 0 (in place) where ``x / temperature`` is under the row's ``floor``."""
    if _has_kernel(x.device):
        torch.ops.rollout_corr.floor_zero_.default(grad, x, floor, float(temperature))
        return
    fallback.floor_zero_(grad, x, floor, temperature)


def row_candidates(x: torch.Tensor, k: torch.Tensor, target_col: torch.Tensor, width: int, temperature: float,
                   valid_cols: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The replay of top-k sampling from one read of the logits ``x`` ``[N, C]``: ``(values, index, count, stats)``
    (the contract: csrc/ops.cpp). The CPU and CUDA kernels (fp32 / bf16 / fp16; the CUDA kernel's lists hold at
    most 4096 candidates) read each row once; fp64 and the fallback backend run torch ops (fallback/sampling.py)."""
    if _has_kernel(x.device) and x.dtype != torch.float64:
        return torch.ops.rollout_corr.row_candidates.default(x, k, target_col, int(width), float(temperature),
                                                             int(valid_cols))
    return fallback.row_candidates(x, k, target_col, int(width), float(temperature), int(valid_cols))


def candidate_decide(cand: torch.Tensor, z_max: torch.Tensor, z_t: torch.Tensor, sum_all: torch.Tensor,
                     k: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The replay's decision on each row's candidates (any order): ``(tau, out)``, the kept set's threshold and
    ``[N, 4]`` fp64 (the target's log-prob, entropy, log S, log_kept) (the contract: csrc/ops.cpp; CPU and CUDA
    kernels, torch on the fallback backend)."""
    if _has_kernel(cand.device):
        return torch.ops.rollout_corr.candidate_decide.default(cand, z_max, z_t, sum_all, k, floor, top_p)
    return fallback.candidate_decide(cand, z_max, z_t, sum_all, k, floor, top_p)


def scatter_rows(values: torch.Tensor, index: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, cols]`` of ``dtype``: 0, and ``values[r, w]`` at column ``index[r, w]`` where that is >= 0 (the
    replay's gradient on its kept candidates). The CPU kernel writes into the log-prob gradient's reused block; the
    CUDA kernel writes the candidates into a zeroed output."""
    if _has_kernel(values.device):
        return torch.ops.rollout_corr.scatter_rows.default(values, index, int(cols), dtype)
    return fallback.scatter_rows(values, index, int(cols), dtype)


def mm_f32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 0.0) -> None:
    """``out`` (fp32, in place) = ``a @ b + beta * out`` for bf16 / fp16 ``a`` and ``b``: the products accumulated in
    fp32 and never rounded to 16 bits (torch's CPU matmul of 16-bit inputs returns a 16-bit result). The CPU kernel
    calls MKL's 16-bit GEMM with fp32 output (csrc/cpu/linear.cpp); CUDA runs torch's ``out_dtype`` matmul."""
    if _compiled and out.device.type in ("cpu", "meta"):
        torch.ops.rollout_corr.mm_f32_.default(out, a, b, float(beta))
        return
    fallback.mm_f32_(out, a, b, beta)


def hilo_add_(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor, index: Optional[torch.Tensor] = None) -> None:
    """``(hi, lo) += x`` row by row (into rows ``index`` of ``hi`` / ``lo``, distinct, or all rows): the fused path's
    16-bit gradient accumulator. ``hi`` (bf16 / fp16: the gradient returned) and ``lo`` (bf16: the residual hi leaves)
    hold a sum of about 17 significant bits; ``s = (hi + lo) + x`` in fp32, ``hi`` = s rounded to its dtype,
    ``lo = bf16(s - hi)``, so each call adds at most ``2^-17 |s|`` of error. ``x``: hi's dtype or fp32. The CPU
    kernel is in csrc/cpu/linear.cpp; CUDA runs the fallback's torch ops."""
    if _compiled and hi.device.type in ("cpu", "meta"):
        torch.ops.rollout_corr.hilo_add_.default(hi, lo, x, index)
        return
    fallback.hilo_add_(hi, lo, x, index)
