"""Dense fp64 oracles of the policy losses, written after the peers' formulas with plain tensor ops:
``ppo_clip_loss_dense``, ``agg_loss_dense`` (verl 0.9.1 ``core_algos``) and ``grpo_loss_dense`` (Megatron-LM
``calculate_grpo_loss``).

Test infrastructure: the package never imports this module, and this module imports nothing from the package. The
rollout-correction oracle is ``rollout_corr_testing.rollout_oracle`` (public config fields only, parsed on its own).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

#: verl's ``masked_mean`` denominator guard.
MASKED_MEAN_EPS = 1e-8


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked product: where(mask != 0, values, 0) * mask (NaN at masked positions never leaks)."""
    return torch.where(mask != 0, values, torch.zeros_like(values)) * mask


def ppo_clip_loss_dense(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Textbook oracle, line for line the formula of verl 0.9.1 ``compute_policy_loss_vanilla``.

    Returns (pg_losses [B, T], pg_clipfrac, pg_clipfrac_lower, ppo_kl).
    """
    m = response_mask.to(log_prob.dtype)

    def masked_mean(v):
        return _masked(v, m).sum() / (m.sum() + MASKED_MEAN_EPS)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(m.dtype))
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean((torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0)).to(m.dtype))
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if weights is not None:
        pg_losses = pg_losses * weights
    return pg_losses, pg_clipfrac, pg_clipfrac_lower, ppo_kl


#: Per-token loss kinds of ``policy_loss_rows_dense`` (the names of docs/megatron.md's loss modes).
PPO_CLIP, REINFORCE = "ppo_clip", "reinforce"


def policy_loss_rows_dense(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c,
                           kind):
    """fp64 oracle of the fused policy-loss op's contract: ``(loss_mat [B, T], rows [B, 5])``.

    Per token (verl 0.9.1 ``compute_policy_loss_vanilla``, dual clip of Ye et al. 2020 "Mastering Complex Control
    in MOBA Games with Deep RL"): r = exp(clamp(lp - lp_old, -20, 20)), L1 = -A r, L2 = -A clip(r, 1 - clip_low,
    1 + clip_high), L = max(L1, L2), and for A < 0, min(L, -A c). ``kind == "reinforce"``: L = -A lp (verl's
    ``bypass_mode`` policy gradient with IS weights); its ppo_kl is mean(lp_old - lp) unclamped. Then L * w.

    ``rows`` columns: sum m L, sum m, sum m [L2 > L1], sum m [A < 0 and max(L1, L2) > -A c], sum m (lp_old - lp),
    with m the (possibly fractional) mask. ``loss_mat`` is L at every position (the mask is applied by the
    aggregation). Differentiable in ``log_prob``; masked positions are selected away before any arithmetic, so junk
    there (NaN) reaches neither the rows nor the gradient.
    """
    f = torch.float64
    m = response_mask.to(f)
    valid = m != 0

    def terms(lp, old, adv, w):
        lr = torch.clamp(lp - old, min=-20.0, max=20.0)
        if kind == PPO_CLIP:
            ratio = torch.exp(lr)
            l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
            l12 = torch.maximum(l1, l2)
            l3 = -adv * clip_c
            loss = torch.where(adv < 0, torch.minimum(l12, l3), l12)
            clip, clip_lower, kl = (l2 > l1).to(f), ((l12 > l3) & (adv < 0)).to(f), -lr
        elif kind == REINFORCE:
            loss = -adv * lp
            clip = clip_lower = torch.zeros_like(lp)
            kl = old - lp
        else:
            raise ValueError(f"kind: unknown {kind!r}")
        return (loss if w is None else loss * w), clip, clip_lower, kl

    lp, old, adv = log_prob.to(f), old_log_prob.to(f), advantages.to(f).expand_as(log_prob)
    w = None if weights is None else weights.detach().to(f)
    loss_mat = terms(lp, old, adv, w)[0]
    sel = [torch.where(valid, x, torch.zeros_like(x)) for x in (lp, old, adv)]
    loss, clip, clip_lower, kl = terms(*sel, None if w is None else torch.where(valid, w, torch.ones_like(w)))
    # Only the loss column carries a gradient: the others are metrics.
    rows = torch.stack([(loss * m).sum(-1), m.sum(-1)] + [(x * m).sum(-1).detach() for x in (clip, clip_lower, kl)],
                       dim=-1)
    return loss_mat, rows


def agg_loss_dense(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """Textbook oracle of verl 0.9.1 ``agg_loss`` (same formulas, same global normalisers).

    One deliberate difference: where verl divides 0 by 0 (every token masked and no global normaliser
    given) this returns 0, so a micro-batch whose rows were all rejected does not turn the step into NaN.
    """
    m = loss_mask.to(loss_mat.dtype)

    def safe_div(num, den):
        den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
        return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))

    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = m.sum()
        return safe_div(_masked(loss_mat, m).sum(), batch_num_tokens) * dp_size
    if loss_agg_mode == "token-sum":
        return _masked(loss_mat, m).sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = _masked(loss_mat, m).sum(-1)
        seq_mask = (m.sum(-1) > 0).to(m.dtype)
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = safe_div(_masked(seq_losses, seq_mask).sum(), global_batch_size) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        tokens = m.sum(-1)
        seq_losses = _masked(loss_mat, m).sum(-1) / (tokens + MASKED_MEAN_EPS)
        seq_mask = (tokens > 0).to(m.dtype)
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return safe_div(_masked(seq_losses, seq_mask).sum(), global_batch_size) * dp_size
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def grpo_loss_dense(
    current_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clamp_eps_lower: float,
    clamp_eps_upper: float,
    kl_beta: float,
    entropy_weight: float,
    is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Textbook oracle of Megatron-LM RL ``calculate_grpo_loss`` (unpacked ``[B, T]``, advantages ``[B]``):

    r = exp(lp - lp_old); loss = -w min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A) + beta k3(ref || lp)
    - entropy_weight H, H = -exp(lp) lp (megatron/rl/rl_utils.py since core 0.16, "Fix the entropy sign"), with
    k3 = exp(ref - lp) - (ref - lp) - 1. Returns (loss, kl_term, ratios, entropy_term, truncated_from_above,
    truncated_from_below).
    """
    ratios = (current_logprobs - old_logprobs).exp()
    clamped = ratios.clamp(1 - clamp_eps_lower, 1 + clamp_eps_upper)
    adv = advantages.reshape(-1, 1)
    ref_diff = ref_logprobs - current_logprobs
    kl_term = ref_diff.exp() - ref_diff - 1
    entropy_term = -current_logprobs.exp() * current_logprobs  # the entropy H = -p log p (Megatron-LM >= core 0.16)
    w = 1.0 if is_weights is None else is_weights
    loss = -w * torch.min(ratios * adv, clamped * adv) + kl_beta * kl_term - entropy_weight * entropy_term
    return loss, kl_term, ratios, entropy_term, ratios > 1 + clamp_eps_upper, ratios < 1 - clamp_eps_lower
