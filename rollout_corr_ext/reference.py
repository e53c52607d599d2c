"""Pure-PyTorch oracle of every op in ``rollout_corr_ext``.

Two roles:

* the **oracle** the tests compare the C++/CUDA kernels against (run it in fp64 where it matters), and
* the **fallback backend** used when the compiled extension is not importable (``backend() == "reference"``).

Every function here mirrors the contract of the ``torch.ops.rollout_corr.*`` op of the same name
(same arguments, same outputs, same dtypes), written with plain tensor ops so that it is obviously right.
Sections: vocab-parallel log-probs (DESIGN §2); rollout correction (DESIGN §3); policy losses (DESIGN §4).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

# ---------------------------------------------------------------------------------------------------------
# §2 Vocab-parallel log-probs and entropy
# ---------------------------------------------------------------------------------------------------------

#: Columns of the per-row record that ``vocab_row_stats`` produces (the last one only with ``with_sum_z``).
ROW_STAT_MAX, ROW_STAT_SUMEXP, ROW_STAT_SUMEXP_Z, ROW_STAT_TARGET_Z, ROW_STAT_SUM_Z = range(5)
#: Columns of the per-row state saved for backward: log-sum-exp and the softmax mean of z (= S/D).
ROW_STATE_LSE, ROW_STATE_MEAN_Z = range(2)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (for gradcheck); every other dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _valid_cols(vocab_start: int, vocab_size: int, local_vocab: int) -> int:
    """Number of real (non-padding) columns of a shard that starts at global column ``vocab_start``."""
    return max(0, min(local_vocab, vocab_size - vocab_start))


def vocab_row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
    with_sum_z: bool,
) -> torch.Tensor:
    """Per-row softmax statistics of one vocab shard, z = logits * inv_temperature.

    ``logits`` is ``[N, V_local]``, ``target`` ``[N]`` holds **global** ids. Returns ``[N, 4]`` (or ``[N, 5]``
    with ``with_sum_z``): m = max z, d = sum exp(z - m), s = sum exp(z - m) z, y = z[target] when the target
    lies in this shard (else -inf), and sum z. Padding columns (global id >= vocab_size) are excluded.
    """
    acc = _acc_dtype(logits.dtype)
    n, local_vocab = logits.shape
    cols = _valid_cols(vocab_start, vocab_size, local_vocab)
    z = logits[:, :cols].to(acc) * inv_temperature
    out = torch.empty(n, 5 if with_sum_z else 4, dtype=acc, device=logits.device)
    if cols == 0:
        out[:, ROW_STAT_MAX] = -math.inf
        out[:, ROW_STAT_SUMEXP] = 0
        out[:, ROW_STAT_SUMEXP_Z] = 0
    else:
        m = z.amax(dim=1, keepdim=True)
        e = torch.exp(z - m)
        out[:, ROW_STAT_MAX] = m.squeeze(1)
        out[:, ROW_STAT_SUMEXP] = e.sum(1)
        out[:, ROW_STAT_SUMEXP_Z] = (e * z).sum(1)
    local = target - vocab_start
    in_shard = (local >= 0) & (local < cols) & (target != ignore_index)
    picked = z.gather(1, local.clamp(0, max(cols - 1, 0)).unsqueeze(1)).squeeze(1) if cols else z.new_zeros(n)
    out[:, ROW_STAT_TARGET_Z] = torch.where(in_shard, picked, torch.full_like(picked, -math.inf))
    if with_sum_z:
        out[:, ROW_STAT_SUM_Z] = z.sum(1)
    return out


def merge_row_stats(
    stats: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the records of all shards ``[R, N, K]`` into (logp, entropy, mean_logp, row_state).

    M = max_r m_r, D = sum_r d_r e^(m_r - M), S = sum_r s_r e^(m_r - M), y = max_r y_r;
    logp = y - M - log D, H = M + log D - S/D, mean_logp = sum z / vocab_size - (M + log D) (0 without sum z).
    Ignored rows give 0 everywhere. row_state = [lse, S/D] is what backward needs.
    """
    m = stats[..., ROW_STAT_MAX]
    big_m = m.amax(0)
    # A shard made only of padding has d = 0 and m = -inf; its scale must be 0, not exp(nan).
    scale = torch.where(stats[..., ROW_STAT_SUMEXP] > 0, torch.exp(m - big_m), torch.zeros_like(m))
    d = (stats[..., ROW_STAT_SUMEXP] * scale).sum(0)
    s = (stats[..., ROW_STAT_SUMEXP_Z] * scale).sum(0)
    y = stats[..., ROW_STAT_TARGET_Z].amax(0)
    lse = big_m + torch.log(d)
    mean_z = s / d
    valid = target != ignore_index
    zero = torch.zeros_like(lse)
    logp = torch.where(valid, y - lse, zero)
    entropy = torch.where(valid, lse - mean_z, zero)
    if stats.shape[-1] > ROW_STAT_SUM_Z:
        sum_z = stats[..., ROW_STAT_SUM_Z].sum(0)
        mean_logp = torch.where(valid, sum_z / vocab_size - lse, zero)
    else:
        mean_logp = zero.clone()
    row_state = torch.stack([lse, mean_z], dim=1)
    return logp, entropy, mean_logp, row_state


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
    """Gradient w.r.t. one shard ``[N, V_local]`` of logits, in the logits dtype. With p = softmax(z):

    d logp / dx_i = (1[i = y] - p_i) / T;  d H / dx_i = -p_i (z_i - S/D) / T;  d mean_logp / dx_i = (1/V - p_i) / T.
    Padding columns and ignored rows get 0.
    """
    acc = _acc_dtype(logits.dtype)
    n, local_vocab = logits.shape
    cols = _valid_cols(vocab_start, vocab_size, local_vocab)
    z = logits[:, :cols].to(acc) * inv_temperature
    lse = row_state[:, ROW_STATE_LSE].to(acc).unsqueeze(1)
    mean_z = row_state[:, ROW_STATE_MEAN_Z].to(acc).unsqueeze(1)
    p = torch.exp(z - lse)
    valid = (target != ignore_index).to(acc).unsqueeze(1)

    def _g(g: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.zeros(n, 1, dtype=acc, device=logits.device) if g is None else g.to(acc).reshape(n, 1)

    g_lp, g_h, g_m = _g(grad_logp), _g(grad_entropy), _g(grad_mean_logp)
    grad = -(g_lp + g_m) * p - g_h * p * (z - mean_z) + g_m / vocab_size
    local = target - vocab_start
    hit = (local >= 0) & (local < cols) & (target != ignore_index)
    rows = torch.nonzero(hit).squeeze(1)
    if cols:
        grad[rows, local[rows]] += g_lp.squeeze(1)[rows]
    grad = grad * valid * inv_temperature
    out = torch.zeros(n, local_vocab, dtype=logits.dtype, device=logits.device)
    out[:, :cols] = grad.to(logits.dtype)
    return out


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
    """In-place variant: overwrites ``logits`` with its own gradient (``inplace_backward=True``)."""
    grad = logprob_backward(
        grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
        vocab_start, vocab_size, inv_temperature, ignore_index,
    )
    logits.copy_(grad)


def log_probs_dense(
    full_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The textbook oracle on the whole (gathered) vocab: ``log_softmax`` + ``gather``, differentiable.

    Returns (logp, entropy, cross_entropy_loss) with any leading shape; run it in fp64 for the reference.
    ``cross_entropy_loss`` applies label smoothing over the true vocab the way megatron-core defines it
    (smoothing = eps * V / (V - 1); loss = (1 - smoothing) * nll - smoothing * mean_i logp_i), but over
    the **global** vocab.
    """
    v = full_logits.shape[-1] if vocab_size is None else vocab_size
    z = full_logits[..., :v] / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    logp = torch.where(valid, logp, zero)
    entropy = torch.where(valid, entropy, zero)
    loss = -logp
    if label_smoothing > 0:
        smoothing = label_smoothing * v / (v - 1)
        mean_logp = torch.where(valid, logp_all.mean(-1), zero)
        loss = (1.0 - smoothing) * loss - smoothing * mean_logp
    return logp, entropy, loss


# ---------------------------------------------------------------------------------------------------------
# §3 Rollout correction (IS weights, RS masks, metrics)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# §4 Policy losses
# ---------------------------------------------------------------------------------------------------------

# Semantics reference: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``,
# ``compute_policy_loss_reinforce``, ``agg_loss``) and Megatron-LM RL ``calculate_grpo_loss``
# (``megatron/rl/rl_utils.py``). ``policy_loss_rows`` is the op contract (one elementwise pass that a fused
# kernel replaces); the ``*_dense`` functions are the textbook oracles the tests compare it against.

#: Columns of the per-row partials of ``policy_loss_rows``: sum of m*loss, sum of m, sum of m*1[upper/ratio
#: clip], sum of m*1[dual clip], sum of m*(old_logp - logp) (the ``ppo_kl`` numerator).
PG_ROW_LOSS_SUM, PG_ROW_TOKENS, PG_ROW_CLIP, PG_ROW_CLIP_LOWER, PG_ROW_KL_SUM = range(5)
#: ``loss_kind`` of ``policy_loss_rows``.
PG_KIND_PPO_CLIP, PG_KIND_REINFORCE = 0, 1
#: verl's ``masked_mean`` denominator guard (``mask.sum() + 1e-8``), kept so metrics match key for key.
MASKED_MEAN_EPS = 1e-8


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_sum`` integrand: ``where(mask, v, 0) * mask`` (NaN outside the mask never leaks)."""
    return torch.where(mask != 0, values, torch.zeros_like(values)) * mask


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
    """Per-token policy loss and the per-row partials every aggregation mode and metric is built from.

    All inputs ``[B, T]``; ``weights`` (rollout IS weights, treated as constants) may be None.
    ``loss_kind == PG_KIND_PPO_CLIP``: r = exp(clamp20(lp - lp_old)); L = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high)), and for A < 0, L = min(L, -A clip_c) (dual clip); then L * w.
    ``loss_kind == PG_KIND_REINFORCE``: L = -A lp w (``old_log_prob`` is the rollout policy, used for ppo_kl).

    Returns ``loss_mat [B, T]`` (differentiable in ``log_prob``; masked positions hold the raw value, the
    mask is applied by the aggregation) and ``rows [B, 5]`` (columns ``PG_ROW_*``; only the loss column
    carries a gradient). One pass over the inputs: this is the contract of the fused loss kernel.
    """
    acc = _acc_dtype(log_prob.dtype)
    lp = log_prob.to(acc)
    adv = advantages.to(acc)
    m = response_mask.to(acc)
    neg_kl = torch.clamp(lp - old_log_prob.to(acc), -20.0, 20.0)
    zeros = torch.zeros_like(lp)
    if loss_kind == PG_KIND_PPO_CLIP:
        ratio = torch.exp(neg_kl)
        loss1 = -adv * ratio
        loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        clipped1 = torch.maximum(loss1, loss2)
        loss3 = -adv * clip_c
        negative = adv < 0
        loss = torch.where(negative, torch.minimum(loss3, clipped1), clipped1)
        clip = (loss2 > loss1).to(acc)
        clip_lower = ((clipped1 > loss3) & negative).to(acc)
        kl = -neg_kl
    elif loss_kind == PG_KIND_REINFORCE:
        loss = -adv * lp
        clip = clip_lower = zeros
        # verl's reinforce loss logs ppo_kl = mean(rollout_lp - lp) without the +-20 clamp.
        kl = old_log_prob.to(acc) - lp
    else:
        raise ValueError(f"loss_kind must be PG_KIND_PPO_CLIP or PG_KIND_REINFORCE, got {loss_kind}")
    if weights is not None:
        loss = loss * weights.detach().to(acc)
    with torch.no_grad():
        stats = torch.stack(
            [m.sum(-1), _masked(clip, m).sum(-1), _masked(clip_lower, m).sum(-1), _masked(kl, m).sum(-1)], dim=-1)
    rows = torch.cat([_masked(loss, m).sum(-1, keepdim=True), stats], dim=-1)
    return loss, rows


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
    + entropy_weight exp(lp) lp, with k3 = exp(ref - lp) - (ref - lp) - 1. Returns (loss, kl_term, ratios,
    entropy_term, truncated_from_above, truncated_from_below).
    """
    ratios = (current_logprobs - old_logprobs).exp()
    clamped = ratios.clamp(1 - clamp_eps_lower, 1 + clamp_eps_upper)
    adv = advantages.reshape(-1, 1)
    ref_diff = ref_logprobs - current_logprobs
    kl_term = ref_diff.exp() - ref_diff - 1
    entropy_term = current_logprobs.exp() * current_logprobs
    w = 1.0 if is_weights is None else is_weights
    loss = -w * torch.min(ratios * adv, clamped * adv) + kl_beta * kl_term + entropy_weight * entropy_term
    return loss, kl_term, ratios, entropy_term, ratios > 1 + clamp_eps_upper, ratios < 1 - clamp_eps_lower
