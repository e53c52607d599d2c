"""The whole Python op surface: typed wrappers over ``torch.ops.rollout_corr.*``, fake kernels and autograd.

Every wrapper calls the compiled op when the extension is active and the function of the same name in
:mod:`rollout_corr_ext.reference` otherwise, so the layers above never care which backend runs.
Fake (meta) kernels are registered once the library is loaded, so ``torch.compile`` and meta tensors work.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference

_compiled = False


def _on_extension_loaded() -> None:
    """Called by the package once ``torch.ops.rollout_corr`` exists: switch to it and register fakes."""
    global _compiled
    if _compiled:
        return
    _register_fakes()
    _compiled = True


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register_fakes() -> None:
    @torch.library.register_fake("rollout_corr::vocab_row_stats")
    def _(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index, with_sum_z):
        torch._check(logits.dim() == 2, lambda: f"logits must be 2-D, got {logits.dim()}-D")
        torch._check(target.shape[0] == logits.shape[0], lambda: "target must have one id per logits row")
        acc = _stats_dtype(logits.dtype)
        k = 5 if with_sum_z else 4
        return logits.new_empty((reference.header_len(acc) + logits.shape[0] * k,), dtype=acc)

    @torch.library.register_fake("rollout_corr::merge_row_stats")
    def _(gathered, target, ignore_index, vocab_size, inv_temperature, with_sum_z):
        torch._check(gathered.dim() == 2, lambda: f"gathered must be 2-D, got {gathered.dim()}-D")
        n = target.shape[0]
        return (
            gathered.new_empty((n,)),
            gathered.new_empty((n,)),
            gathered.new_empty((n,)),
            gathered.new_empty((n, reference.ROW_STATE_COLS)),
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

    if hasattr(torch.ops.rollout_corr, "policy_loss_rows"):
        _register_policy_loss_ops()


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
) -> torch.Tensor:
    """The flat shard record (header + ``[N, 4|5]`` max-shifted row summaries) of one shard ``[N, V_local]``."""
    if _compiled:
        return torch.ops.rollout_corr.vocab_row_stats.default(
            logits, target, vocab_start, vocab_size, inv_temperature, ignore_index, with_sum_z
        )
    return reference.vocab_row_stats(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index,
                                     with_sum_z)


def merge_row_stats(
    gathered: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int, inv_temperature: float,
    with_sum_z: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``[R, record_len]`` shard records into (logp, entropy, mean_logp, row_state ``[N, 3]``, status ``[4]``).

    Raises on CPU for a bad shard layout, out-of-range targets, NaN / +inf logits and rows of only -inf; on CUDA
    the same conditions set ``status`` (the caller asserts it asynchronously).
    """
    if _compiled:
        return torch.ops.rollout_corr.merge_row_stats.default(gathered, target, ignore_index, vocab_size,
                                                              inv_temperature, with_sum_z)
    return reference.merge_row_stats(gathered, target, ignore_index, vocab_size, inv_temperature, with_sum_z)


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
    if _compiled:
        return torch.ops.rollout_corr.logprob_backward.default(
            grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state, vocab_start, vocab_size,
            inv_temperature, ignore_index,
        )
    return reference.logprob_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
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
    if _compiled:
        torch.ops.rollout_corr.logprob_backward_.default(
            logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state, vocab_start, vocab_size,
            inv_temperature, ignore_index,
        )
        return
    reference.logprob_backward_(logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state,
                                vocab_start, vocab_size, inv_temperature, ignore_index)


# ---------------------------------------------------------------------------------------------------------
# §3 rollout correction: pass 1 (per-sequence aggregates) and pass 2 (weights, mask, packed metric partials)
# ---------------------------------------------------------------------------------------------------------

_rollout_fakes_registered = False


def _rollout_compiled(name: str, device: torch.device) -> bool:
    """True when the compiled library has the op with a kernel for ``device`` (else the reference runs)."""
    global _rollout_fakes_registered
    if not (_compiled and hasattr(torch.ops.rollout_corr, name)):
        return False
    key = "CUDA" if device.type == "cuda" else "CPU"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"rollout_corr::{name}", key):
        return False
    if not _rollout_fakes_registered:
        _rollout_fakes_registered = True
        _register_rollout_fakes()
    return True


def _register_rollout_fakes() -> None:
    @torch.library.register_fake("rollout_corr::rollout_seq_stats")
    def _(log_prob, rollout_log_prob, mask, params):
        return log_prob.new_empty((log_prob.shape[0], reference.RC_SEQ_COLS), dtype=_stats_dtype(log_prob.dtype))

    if hasattr(torch.ops.rollout_corr, "rollout_token_pass"):
        @torch.library.register_fake("rollout_corr::rollout_token_pass")
        def _(log_prob, rollout_log_prob, mask, seq_stats, params, row_partials):
            n_sum, n_max = reference.rc_partial_sizes(int(params[reference.RC_P_NUM_RS]))
            has_w = int(params[reference.RC_P_IS_LEVEL]) != reference.RC_IS_NONE
            w_shape = tuple(log_prob.shape) if has_w else (0,)
            return (
                log_prob.new_empty(w_shape, dtype=_stats_dtype(log_prob.dtype)),
                torch.empty_like(mask),
                log_prob.new_empty((n_sum,), dtype=torch.float64),
                log_prob.new_empty((n_max,), dtype=torch.float64),
            )


def rollout_seq_stats(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, params: list
) -> torch.Tensor:
    """Pass 1: per-sequence aggregates ``[B, RC_SEQ_COLS]`` of a ``[B, T]`` slice (see the reference)."""
    if _rollout_compiled("rollout_seq_stats", log_prob.device):
        return torch.ops.rollout_corr.rollout_seq_stats.default(log_prob, rollout_log_prob, mask, params)
    return reference.rollout_seq_stats(log_prob, rollout_log_prob, mask, params)


def rollout_token_pass(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    seq_stats: torch.Tensor,
    params: list,
    row_partials: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 2: (weights, mask_out, SUM partials fp64, MAX partials fp64) of a ``[B, T]`` slice."""
    if _rollout_compiled("rollout_token_pass", log_prob.device):
        return torch.ops.rollout_corr.rollout_token_pass.default(
            log_prob, rollout_log_prob, mask, seq_stats, params, row_partials
        )
    return reference.rollout_token_pass(log_prob, rollout_log_prob, mask, seq_stats, params, row_partials)


# ---------------------------------------------------------------------------------------------------------
# §4 policy losses: the fused per-token loss + per-row partials, and its backward
# ---------------------------------------------------------------------------------------------------------


def _register_policy_loss_ops() -> None:
    """Fakes of both ops and the autograd formula of ``policy_loss_rows`` (gradient in ``log_prob`` only)."""

    @torch.library.register_fake("rollout_corr::policy_loss_rows")
    def _(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c, loss_kind):
        acc = _stats_dtype(log_prob.dtype)
        return (log_prob.new_empty(tuple(log_prob.shape), dtype=acc),
                log_prob.new_empty((log_prob.shape[0], reference.PG_ROW_KL_SUM + 1), dtype=acc))

    @torch.library.register_fake("rollout_corr::policy_loss_backward")
    def _(grad_loss_mat, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
          clip_high, clip_c, loss_kind):
        return log_prob.new_empty(tuple(log_prob.shape))

    def setup_context(ctx, inputs, output):
        log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c, loss_kind = inputs
        ctx.save_for_backward(log_prob, old_log_prob, advantages, response_mask, weights)
        ctx.scalars = (clip_low, clip_high, clip_c, loss_kind)

    def backward(ctx, grad_loss_mat, grad_rows):
        log_prob, old_log_prob, advantages, response_mask, weights = ctx.saved_tensors
        grad_log_prob = None
        if ctx.needs_input_grad[0]:
            # Only the loss column of rows carries a gradient (the others are detached metric partials).
            grad_rows_loss = None if grad_rows is None else grad_rows[:, reference.PG_ROW_LOSS_SUM]
            grad_log_prob = torch.ops.rollout_corr.policy_loss_backward.default(
                grad_loss_mat, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights,
                *ctx.scalars)
        # advantages and weights are constants of the loss (the reference detaches the weights).
        return grad_log_prob, None, None, None, None, None, None, None, None

    torch.library.register_autograd("rollout_corr::policy_loss_rows", backward, setup_context=setup_context)


def _policy_loss_compiled(device: torch.device) -> bool:
    """True when the compiled library has the fused loss with a kernel for ``device`` (else the reference runs)."""
    if not (_compiled and hasattr(torch.ops.rollout_corr, "policy_loss_rows")):
        return False
    key = "CUDA" if device.type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key("rollout_corr::policy_loss_rows", key)


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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss ``[B, T]`` and per-row partials ``[B, 5]`` (``reference.PG_ROW_*``) in one pass.

    Same contract as :func:`rollout_corr_ext.reference.policy_loss_rows`: ``loss_mat`` and the loss column of
    ``rows`` are differentiable in ``log_prob`` only: ``advantages`` and ``weights`` (may be None) are constants.
    """
    if _policy_loss_compiled(log_prob.device):
        if weights is not None:
            weights = weights.detach()
        return torch.ops.rollout_corr.policy_loss_rows.default(
            log_prob, old_log_prob, advantages, response_mask, weights, float(clip_low), float(clip_high),
            float(clip_c), int(loss_kind))
    return reference.policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
                                      clip_high, clip_c, loss_kind)
