"""The pure-PyTorch policy-loss op (docs/megatron.md, "Loss modes"): ``policy_loss_rows``. Kinds and row columns
come from ``csrc/include/policy_loss_layout.def``.

Semantics: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``,
``compute_policy_loss_reinforce``, ``agg_loss``) and Megatron-LM RL ``calculate_grpo_loss``
(``megatron/rl/rl_utils.py``). ``policy_loss_rows`` is the op contract (one elementwise pass that the fused kernel
replaces); the tests hold it to the textbook oracles of ``rollout_corr_testing/dense_oracles.py``."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import _layout as LY
from .._checks import (acc_dtype as _acc_dtype, check_cu_seqlens as _check_cu_seqlens, masked as _masked,
                       row_sums as _row_sums,
                       refuse_where)


def _policy_token_terms(lp, old, adv, w, clip_low, clip_high, clip_c, loss_kind, param_a=0.0, param_b=0.0):
    """Per-token (loss, clip, clip_lower, kl) of the policy losses (formulas in ``policy_loss_layout.def``; each
    follows its verl 0.9.1 function in ``verl/trainer/ppo/core_algos.py``)."""
    acc = lp.dtype
    zeros = torch.zeros_like(lp)
    x = lp - old
    neg_kl = torch.clamp(x, -20.0, 20.0)
    clip = clip_lower = zeros
    kl = -neg_kl
    if loss_kind in (LY.PG_KIND_PPO_CLIP, LY.PG_KIND_GSPO, LY.PG_KIND_PPO_UNBOUNDED):
        if loss_kind == LY.PG_KIND_PPO_CLIP:
            ratio = torch.exp(neg_kl)
        elif loss_kind == LY.PG_KIND_GSPO:  # old is the row's mean log-ratio s: q = exp(min(s, 10)), dq/dlp = q
            ratio = torch.exp(torch.clamp(lp - lp.detach() + old, max=LY.GSPO_LOG_RATIO_MAX))
            kl = zeros
        else:  # unbounded: where exp(x) overflows only the clipped branch can be defined, and it passes no gradient
            # (autograd's 0 * inf would be NaN, as in verl's fp32 loss)
            overflows = x > math.log(torch.finfo(acc).max)
            ratio = torch.exp(torch.where(overflows, x.detach(), x))
            kl = -x
        loss1 = -adv * ratio
        loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        clipped1 = torch.maximum(loss1, loss2)
        clip = (loss2 > loss1).to(acc)
        loss = clipped1
        if loss_kind == LY.PG_KIND_PPO_CLIP:
            loss3 = -adv * clip_c
            negative = adv < 0
            loss = torch.where(negative, torch.minimum(loss3, clipped1), clipped1)
            clip_lower = ((clipped1 > loss3) & negative).to(acc)
    elif loss_kind in (LY.PG_KIND_DPPO_TV, LY.PG_KIND_DPPO_KL):
        ratio = torch.exp(neg_kl)
        truncated = torch.clamp(ratio, max=clip_c).detach()
        with torch.no_grad():
            p, p_old = torch.exp(lp), torch.exp(old)
            if loss_kind == LY.PG_KIND_DPPO_TV:
                pos, neg = (p - p_old) <= clip_high, (p - p_old) >= -clip_low
            else:
                e = LY.BERNOULLI_KL_EPS
                bkl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + e) / (1.0 - p + e))
                pos, neg = (bkl <= clip_high) | (p <= p_old), (bkl <= clip_low) | (p >= p_old)
            valid = torch.where(adv > 0, pos, neg).to(acc)
        loss = -adv * truncated * lp * valid
        clip = 1.0 - valid
        clip_lower = (ratio > clip_c).to(acc) * valid
    elif loss_kind == LY.PG_KIND_SAPO:
        tau = torch.where(adv > 0, torch.full_like(adv, param_a), torch.full_like(adv, param_b))
        loss = -(torch.sigmoid(tau * (torch.exp(neg_kl) - 1.0)) * (4.0 / tau)) * adv
    elif loss_kind == LY.PG_KIND_CISPO:
        ratio = torch.exp(neg_kl)
        clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        loss = -clipped.detach() * adv * lp
        clip = (ratio != clipped).to(acc)
    elif loss_kind == LY.PG_KIND_DRO:
        loss = -(lp * adv - 0.5 * param_a * x.square())
        kl = -x
    elif loss_kind == LY.PG_KIND_GEO_MEAN:
        sgn = torch.sign(adv)
        clamped = torch.clamp(x, -clip_low, clip_high)
        loss = sgn * torch.minimum(sgn * x, sgn * clamped)
        moved = (x != clamped).to(acc)
        clip, clip_lower, kl = moved * (adv > 0).to(acc), moved * (adv < 0).to(acc), -x
        return loss, clip, clip_lower, kl  # the IS weight is applied per sequence by the caller
    else:  # REINFORCE
        loss = -adv * lp
        # verl's reinforce loss logs ppo_kl = mean(rollout_lp - lp) without the +-20 clamp.
        kl = old - lp
    if w is not None:
        loss = loss * w
    return loss, clip, clip_lower, kl


def _undefined_loss_tokens(kind: int, old_log_prob, log_prob, advantages, response_mask, weights, loss=None):
    """Response tokens whose loss is undefined: NaN or +inf log-probs, a log-ratio -inf - (-inf) (PPO), a -inf
    log-prob under REINFORCE (an infinite loss), non-finite advantages or IS weights, a non-finite token loss; for
    the other kinds any non-finite input. Masked-out tokens are not inspected. Elementwise over [b, s]: small next to the
    vocab-sized log-prob pass."""
    inf = float("inf")
    lp, old = log_prob, old_log_prob
    adv = advantages if advantages.dim() == lp.dim() else advantages.unsqueeze(-1)
    # a float mask weights the token's loss (verl multiplies it in): NaN, inf or < 0 defines none
    bad = ~(response_mask > 0) | (response_mask == inf) | ~torch.isfinite(adv)
    if weights is not None:
        bad = bad | ~torch.isfinite(weights)
    if loss is not None:  # a token loss past the type's range (finite inputs whose product overflows), every kind
        bad = bad | ~torch.isfinite(loss)
    if kind in (LY.PG_KIND_PPO_CLIP, LY.PG_KIND_REINFORCE):
        bad = bad | lp.isnan() | (lp == inf) | old.isnan() | (old == inf)
        bad = bad | ((lp == -inf) & (old == -inf)) if kind == LY.PG_KIND_PPO_CLIP else bad | (lp == -inf)
    else:
        bad = bad | ~torch.isfinite(lp) | ~torch.isfinite(old)
    return bad & (response_mask != 0)


def _check_defined_loss(kind: int, old_log_prob, log_prob, advantages, response_mask, weights, loss=None):
    bad = _undefined_loss_tokens(kind, old_log_prob, log_prob, advantages, response_mask, weights, loss)
    what = ("a response_mask weight NaN, inf or < 0, log_prob / old_log_prob NaN or +inf, both -inf (PPO), log_prob "
            "-inf (REINFORCE), non-finite advantages / rollout_is_weights (the IS weights), a token loss past the "
            "float range, or (the other kinds) a non-finite input")
    refuse_where(bad, lambda at: f"policy loss undefined at response token {at}: {what} (mask the token out, or fix "
                                 f"the log-probs; a target at a -inf logit has log-prob -inf)",
                 f"policy loss undefined at a response token: {what}")


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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss and the per-row partials every aggregation mode and metric is built from.

    All inputs ``[B, T]`` (or the packed ``[T]`` stream with ``cu_seqlens`` ``[B + 1]``: one row of partials per
    segment); ``weights`` (rollout IS weights, treated as constants) may be None.
    ``loss_kind == LY.PG_KIND_PPO_CLIP``: r = exp(clamp20(lp - lp_old)); L = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high)), and for A < 0, L = min(L, -A clip_c) (dual clip); then L * w.
    ``loss_kind == LY.PG_KIND_REINFORCE``: L = -A lp w (``old_log_prob`` is the rollout policy, used for ppo_kl).
    The other kinds (DPPO, GSPO, SAPO, CISPO, DRO, GMPO, unbounded PPO) as ``csrc/include/policy_loss_layout.def``
    states them; ``param_a`` / ``param_b`` are SAPO's tau_pos / tau_neg and DRO's beta.

    Returns ``loss_mat [B, T]`` (differentiable in ``log_prob``; masked positions hold the raw value, the
    mask is applied by the aggregation) and ``rows [B, 5]`` (columns ``PG_ROW_*``; only the loss column
    carries a gradient). One pass over the inputs: this is the contract of the fused loss kernel.
    ``with_loss_mat=False``: ``loss_mat`` is an empty ``[0]`` tensor (callers that aggregate the rows only; the
    kernels then skip the masked tokens' reads).
    """
    acc = _acc_dtype(log_prob.dtype)
    if not (isinstance(loss_kind, int) and 0 <= loss_kind < LY.KIND_COUNT):
        raise ValueError(f"loss_kind must be a LY.PG_KIND_* code (0 .. {LY.KIND_COUNT - 1}), got {loss_kind}")
    # formed in acc, as the kernels form them: a parameter past acc's range (1e308 in fp32), or a tau whose 4 / tau
    # is, makes a loss or a gradient NaN / inf at every token it reaches
    def in_acc(v):
        return torch.tensor(float(v), dtype=torch.float64).to(acc)

    def tau_ok(v):
        t = in_acc(v)
        return bool(t > 0) and bool(torch.isfinite(t)) and bool(torch.isfinite(4.0 / t))

    if loss_kind == LY.PG_KIND_SAPO and not (tau_ok(param_a) and tau_ok(param_b)):
        raise ValueError(f"SAPO's temperatures (param_a = tau_pos, param_b = tau_neg) must be > 0 with tau and 4 / tau "
                         f"finite in the compute type (fp32 below fp64 inputs), got {param_a}, {param_b}")
    if loss_kind == LY.PG_KIND_PPO_CLIP and not bool(in_acc(clip_c) > 1):  # 1 + 1e-8 is 1 in fp32
        raise ValueError(f"clip_c (the dual-clip bound c) must be > 1 in the compute type (fp32 below fp64 inputs; "
                         f"inf disables the dual clip), got {clip_c}")
    if loss_kind == LY.PG_KIND_DRO and not (param_a > 0 and bool(torch.isfinite(in_acc(param_a)))):
        raise ValueError(f"DRO's beta (param_a) must be finite and > 0 in the compute type (fp32 below fp64 inputs), "
                         f"got {param_a}")
    lp, old, adv = log_prob.to(acc), old_log_prob.to(acc), advantages.to(acc)
    w = None if weights is None else weights.detach().to(acc)
    m = response_mask.to(acc)
    terms = (clip_low, clip_high, clip_c, loss_kind, param_a, param_b)
    loss, clip, clip_lower, kl = _policy_token_terms(lp, old, adv, w, *terms)
    # checked as computed, in acc (as the kernels load them): an fp64 1e300 is inf in fp32, -1e-50 is -0
    _check_defined_loss(loss_kind, old.detach(), lp.detach(), adv.detach(), m, w, loss.detach())
    # The row sums are built from inputs selected at the valid tokens, so that a masked-out token's NaN / -inf
    # never meets autograd's 0 * (local derivative) and the gradient there is exactly 0 (the kernels' rule).
    valid = m != 0
    zero, one = torch.zeros((), dtype=acc), torch.ones((), dtype=acc)
    loss_v = _policy_token_terms(torch.where(valid, lp, zero), torch.where(valid, old, zero),
                                 torch.where(valid, adv, zero), None if w is None else torch.where(valid, w, one),
                                 *terms)[0]
    if cu_seqlens is None:
        def row_sum(x):  # in one order for any layout and thread count, as the kernels' rows
            return _row_sums(x)
    else:
        cu = _check_cu_seqlens(log_prob, cu_seqlens)
        seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])

        def row_sum(x):  # a sum per segment (differentiable: index_add)
            return torch.zeros(cu.numel() - 1, dtype=x.dtype, device=x.device).index_add(0, seg, x)
    with torch.no_grad():
        stats = torch.stack(
            [row_sum(m), row_sum(_masked(clip, m)), row_sum(_masked(clip_lower, m)), row_sum(_masked(kl, m))], dim=-1)
    rows = torch.cat([row_sum(_masked(loss_v, m)).unsqueeze(-1), stats], dim=-1)
    return (loss if with_loss_mat else loss.new_empty((0,))), rows
