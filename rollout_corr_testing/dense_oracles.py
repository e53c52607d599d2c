"""Dense fp64 oracles of the whole features, written after verl's formulas with plain tensor ops: rollout correction
(``rollout_correction_dense``, verl 0.9.1 ``rollout_corr_helper``) and the policy losses (``ppo_clip_loss_dense``,
``agg_loss_dense``, ``grpo_loss_dense``, verl 0.9.1 ``core_algos`` / Megatron-LM ``calculate_grpo_loss``).

Test infrastructure: the package never imports this module. ``rollout_correction_dense`` reads the config's resolved
``is_spec`` / ``rs_criteria``; ``rollout_corr_testing.rollout_oracle`` is the fully independent oracle (public config
fields only, parsed on its own).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

#: verl's clamp on log-ratios before exp (``SAFETY_BOUND``) and ``masked_mean`` denominator guard.
RC_SAFETY_BOUND = 20.0
RC_EPS = 1e-8
MASKED_MEAN_EPS = 1e-8


def _rc_keep(stat: torch.Tensor, lower: float, upper: float, apply_lower: bool) -> torch.Tensor:
    keep = stat <= upper
    return keep & (stat >= lower) if apply_lower else keep


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked product: where(mask != 0, values, 0) * mask (NaN at masked positions never leaks)."""
    return torch.where(mask != 0, values, torch.zeros_like(values)) * mask


def _rc_quantile_sorted(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) for any size, via a sort (no 2^24 limit)."""
    s = values.sort().values
    pos = q * (s.numel() - 1)
    k0 = int(math.floor(pos))
    k1 = min(k0 + 1, s.numel() - 1)
    frac = pos - k0
    return s[k0] * (1 - frac) + s[k1] * frac


def rollout_correction_dense(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config,
    *,
    exclude_nonfinite: bool = False,
    dtype: torch.dtype = torch.float64,
    percentiles: bool = True,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, dict]:
    """The textbook oracle of the whole feature, one batch, fp64, written after verl's formulas line by line.

    Returns (weights or None, new response_mask in the input dtype, {metric name without prefix: 0-dim tensor}).
    Mask values are treated as 0/1 (nonzero = valid). ``config`` is a ``RolloutCorrectionConfig``. ``dtype`` and
    ``percentiles=False`` let the benchmark run it as a verl-style op-by-op fp32 baseline.
    """
    d = dtype
    m_in = response_mask != 0
    lp = log_prob.detach().to(d)
    rlp = rollout_log_prob.detach().to(d)
    finite = torch.isfinite(lp) & torch.isfinite(rlp)
    mb = m_in & finite if exclude_nonfinite else m_in
    m = mb.to(d)
    z = torch.zeros((), dtype=d)
    lp = torch.where(mb, lp, z)
    rlp = torch.where(mb, rlp, z)
    lr = lp - rlp
    n_row = m.sum(-1)
    n_tok = m.sum()


    def mmean(x, axis=None):  # verl_F.masked_mean
        return (torch.where(mb, x, z) * m).sum(axis) / (m.sum(axis) + RC_EPS)

    def clamp20(x):
        return x.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND)

    met: dict = {}
    seq_valid = n_row > 0

    # ---- IS (verl 0.9.1 compute_rollout_correction_weights + compute_is_metrics) -----------------------------
    weights = None
    spec = config.is_spec
    if spec is not None:
        if spec.level == "token":
            log_for_metrics = lr
            raw = torch.exp(clamp20(lr))
        else:
            s = (lr * m).sum(-1, keepdim=True)
            log_for_metrics = s if spec.level == "sequence" else s / (n_row.unsqueeze(-1) + RC_EPS)
            raw = torch.exp(clamp20(log_for_metrics)).expand_as(lr)
        raw = raw * m
        if spec.mode == "truncate":
            w = raw.clamp(max=spec.upper)
        else:
            w = torch.where((raw >= spec.lower) & (raw <= spec.upper), raw, torch.zeros_like(raw))
        up, lo_m = spec.upper, spec.metric_lower
        if spec.level == "token":
            met["rollout_is_mean"] = mmean(w)
            met["rollout_is_ratio_fraction_high"] = mmean((raw > up).to(d))
            met["rollout_is_ratio_fraction_low"] = mmean((raw < lo_m).to(d))
            met["rollout_is_max"] = w[mb].max()
            met["rollout_is_min"] = w[mb].min()
        else:
            met["rollout_is_max"] = torch.exp(log_for_metrics.max().clamp(max=RC_SAFETY_BOUND))
            met["rollout_is_min"] = torch.exp(log_for_metrics.min())
            met["rollout_is_mean"] = mmean(w)
            met["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(up)).to(d).mean()
            met["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(lo_m)).to(d).mean()
        wc = w.clamp(0.0, up)
        if n_tok > 1:
            var = mmean(wc * wc) - mmean(wc) ** 2
            met["rollout_is_std"] = var.clamp(min=0).sqrt()
        else:
            met["rollout_is_std"] = torch.zeros((), dtype=d)
        met["rollout_is_eff_sample_size"] = 1.0 / mmean((wc / (mmean(wc) + RC_EPS)) ** 2)
        seq_w = mmean(w, -1)
        met["rollout_is_seq_mean"] = seq_w.mean()
        met["rollout_is_seq_std"] = seq_w.std() if seq_w.numel() > 1 else torch.zeros((), dtype=d)
        met["rollout_is_seq_max"] = seq_w.max()
        met["rollout_is_seq_min"] = seq_w.min()
        met["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max()
        raw_seq = mmean(raw, -1)
        met["rollout_is_seq_fraction_high"] = (raw_seq > up).to(d).mean()
        met["rollout_is_seq_fraction_low"] = (raw_seq < lo_m).to(d).mean()
        if spec.mode == "mask":
            met["rollout_is_oob_ratio"] = mmean(((raw < spec.lower) | (raw > up)).to(d))
        # Percentiles of the raw (pre-truncation) weight over valid tokens (ours; exact order statistics here).
        if percentiles:
            raw_valid = raw[mb]
            for q in (5, 25, 50, 75, 95):
                met[f"rollout_is_p{q}"] = _rc_quantile_sorted(raw_valid, q / 100.0)
        if config.rollout_is_batch_normalize:
            if spec.level == "token":
                mean = mmean(w)
            else:
                mean = (seq_w * seq_valid.to(d)).sum() / seq_valid.to(d).sum().clamp(min=RC_EPS)
            if mean > 1e-8:
                w = w / mean
                met["rollout_is_batch_norm_factor"] = mean
            else:
                met["rollout_is_batch_norm_factor"] = torch.ones((), dtype=d)
        weights = w

    # ---- RS (verl 0.9.1 compute_rollout_rejection_mask + compute_rs_metrics; ratio criteria after 0.6.1) --------
    l = clamp20(lr)
    tok = {"k1": -l, "k2": 0.5 * l * l, "k3": torch.exp(l) - 1.0 - l, "ratio": torch.exp(l)}
    combined = torch.ones_like(lr)
    crits = config.rs_criteria
    for c in crits:
        if c.level == "token":
            stat = tok[c.stat]
            seq_values = mmean(stat, -1)
            keep = _rc_keep(stat, c.lower, c.upper, c.apply_lower)
        else:
            if c.stat == "ratio":
                s = (lr * m).sum(-1)
                seq_stat = torch.exp(clamp20(s if c.level == "seq_sum" else s / (n_row + RC_EPS)))
            elif c.level == "seq_sum":
                seq_stat = (torch.where(mb, tok[c.stat], z) * m).sum(-1)
            elif c.level == "seq_mean":
                seq_stat = mmean(tok[c.stat], -1)
            else:
                mx = tok[c.stat].masked_fill(~mb, -math.inf).max(-1).values
                seq_stat = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
            seq_values = seq_stat
            stat = seq_stat.unsqueeze(-1).expand_as(lr)
            keep = _rc_keep(seq_stat, c.lower, c.upper, c.apply_lower).unsqueeze(-1).expand_as(mb)
        p = f"rollout_rs_{c.name}"
        up, lo = c.upper, (c.lower if c.apply_lower else 0.0)
        sv = seq_values[seq_valid]
        met[f"{p}_mean"] = mmean(stat)
        if c.level != "token":
            met[f"{p}_max"], met[f"{p}_min"] = sv.max(), sv.min()
            met[f"{p}_fraction_high"] = (sv > up).to(d).mean()
            met[f"{p}_fraction_low"] = (sv < lo).to(d).mean() if c.apply_lower else torch.zeros((), dtype=d)
        else:
            met[f"{p}_max"], met[f"{p}_min"] = stat[mb].max(), stat[mb].min()
            met[f"{p}_fraction_high"] = mmean((stat > up).to(d))
            met[f"{p}_fraction_low"] = mmean((stat < lo).to(d)) if c.apply_lower else torch.zeros((), dtype=d)
        if n_tok > 1:
            sc = stat.clamp(lo, up)
            met[f"{p}_std"] = (mmean(sc * sc) - mmean(sc) ** 2).clamp(min=0).sqrt()
        else:
            met[f"{p}_std"] = torch.zeros((), dtype=d)
        met[f"{p}_seq_mean"] = sv.mean()
        met[f"{p}_seq_std"] = sv.std() if sv.numel() > 1 else torch.zeros((), dtype=d)
        met[f"{p}_seq_max"] = sv.max()
        met[f"{p}_seq_min"] = sv.min()
        met[f"{p}_seq_max_deviation"] = sv.abs().max()
        met[f"{p}_seq_fraction_high"] = (sv > up).to(d).mean()
        if c.apply_lower:
            met[f"{p}_seq_fraction_low"] = (sv < lo).to(d).mean()
        keep_f = keep.to(d)
        combined = combined * keep_f
        seq_keep = (~(~keep & mb)).all(-1)
        met[f"{p}_masked_fraction"] = mmean(1.0 - keep_f)
        met[f"{p}_seq_masked_fraction"] = ((~seq_keep) & seq_valid).to(d).sum() / seq_valid.to(d).sum()
    if crits:
        met["rollout_rs_masked_fraction"] = mmean(1.0 - combined)
        met["rollout_rs_seq_masked_fraction"] = ((combined < 0.5) & mb).any(-1).to(d).mean()

    # ---- veto (verl 0.6.1 compute_rollout_correction_and_rejection_mask, step 4) ---------------------------------
    v = config.rollout_token_veto_threshold
    if v is not None:
        cat = (lr < math.log(v)) & mb
        has_cat = cat.any(-1, keepdim=True)
        met["rollout_is_veto_fraction"] = has_cat.to(d).mean()
        met["rollout_is_catastrophic_token_fraction"] = mmean(cat.to(d))
        combined = combined * (~has_cat).to(d)
    else:
        met["rollout_is_veto_fraction"] = torch.zeros((), dtype=d)
        met["rollout_is_catastrophic_token_fraction"] = torch.zeros((), dtype=d)
    dropped = (combined < 0.5) & mb
    met["masked_fraction"] = dropped.to(d).sum() / (n_tok + RC_EPS)
    met["seq_masked_fraction"] = (dropped.any(-1) & seq_valid).to(d).sum() / seq_valid.to(d).sum()
    if exclude_nonfinite:
        nonfin = (m_in & ~finite).to(d).sum()
        met["nonfinite_token_fraction"] = nonfin / (n_tok + nonfin + RC_EPS)

    # ---- off-policy diagnostics (verl 0.9.1 compute_offpolicy_metrics) --------------------------------------------
    mlp = mmean(lp, -1)
    met["training_ppl"] = torch.exp(-mlp).mean()
    met["training_log_ppl"] = (-mlp).mean()
    met["kl"] = mmean(rlp - lp)
    met["k3_kl"] = mmean(torch.exp(lr) - lr - 1)
    mrlp = mmean(rlp, -1)
    met["rollout_ppl"] = torch.exp(-mrlp).mean()
    met["rollout_log_ppl"] = (-mrlp).mean()
    lpd = mrlp - mlp
    met["log_ppl_diff"] = lpd.mean()
    met["log_ppl_abs_diff"] = lpd.abs().mean()
    met["log_ppl_diff_max"] = lpd.max()
    met["log_ppl_diff_min"] = lpd.min()
    met["ppl_ratio"] = torch.exp(lpd).mean()
    met["chi2_token"] = mmean(torch.exp(l) ** 2) - 1.0
    s = (lr * m).sum(-1)
    met["chi2_seq"] = torch.exp(2.0 * clamp20(s)).mean() - 1.0

    new_mask = torch.where(combined > 0.5, response_mask, torch.zeros_like(response_mask))
    if exclude_nonfinite:
        new_mask = torch.where(mb, new_mask, torch.zeros_like(new_mask))
    return weights, new_mask, met


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
