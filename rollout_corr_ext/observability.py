"""Mismatch observability: verl's rollout-vs-actor debug metrics, exact over data-parallel ranks.

verl 0.9.1 ``verl/utils/debug/metrics.py`` (``calculate_debug_metrics``) compares the probabilities the actor and the
rollout engine give each response token: p = exp(log pi_actor), q = exp(log pi_rollout), and over the response tokens

* ``training/rollout_probs_diff_valid``: 1 (0 when there is no response token; the others are then NaN),
* ``training/rollout_probs_diff_max`` / ``_mean`` / ``_std``: of |p - q| (std with Bessel's correction, as
  ``torch.std``),
* ``training/rollout_actor_probs_pearson_corr``: Pearson's correlation of p and q (the CISPO paper's mismatch
  check, arXiv:2506.13585).

verl computes them on each rank's micro-batch; :func:`debug_metrics` computes them from fp64 sums that add across
ranks, so with ``dp_group`` every rank gets the value of the whole data-parallel batch (one SUM and one MAX
all-reduce of a few numbers, whatever the batch size).
"""

from __future__ import annotations

import math
from typing import Dict

import torch
import torch.distributed as dist

__all__ = ["DEBUG_METRIC_KEYS", "debug_metrics"]

#: verl's keys, in its order.
DEBUG_METRIC_KEYS = ("training/rollout_probs_diff_valid", "training/rollout_probs_diff_max",
                     "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
                     "training/rollout_actor_probs_pearson_corr")


def _check(name: str, t, ref: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the shape of log_prob {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but log_prob is on {ref.device}")


def debug_metrics(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                  dp_group=None) -> Dict[str, torch.Tensor]:
    """verl's ``calculate_debug_metrics`` on tensors (any shape, e.g. ``[B, T]`` or a packed ``[T]`` stream):
    ``log_prob`` the actor's (verl's ``old_log_probs``), ``rollout_log_prob`` the engine's, ``response_mask``
    (a token counts where it is non-zero). Returns 0-dim fp64 tensors under verl's keys, in verl's order (no host
    sync); with ``dp_group``, the values of the batch summed over that group. Inputs are not modified."""
    if not isinstance(log_prob, torch.Tensor) or not log_prob.is_floating_point():
        raise TypeError(f"log_prob must be a floating-point torch.Tensor, got "
                        f"{getattr(log_prob, 'dtype', type(log_prob))}")
    _check("rollout_log_prob", rollout_log_prob, log_prob)
    _check("response_mask", response_mask, log_prob)
    if not rollout_log_prob.is_floating_point():
        raise TypeError(f"rollout_log_prob must be floating point, got {rollout_log_prob.dtype}")
    with torch.no_grad():
        valid = response_mask != 0
        zero = torch.zeros((), dtype=torch.float64, device=log_prob.device)
        p = torch.where(valid, log_prob.detach().double().exp(), zero)
        q = torch.where(valid, rollout_log_prob.detach().double().exp(), zero)
        d = (p - q).abs()
        n = valid.sum().double()
        sums = torch.stack([n, d.sum(), (d * d).sum(), p.sum(), q.sum(), (p * p).sum(), (q * q).sum(),
                            (p * q).sum()])
        dmax = torch.where(valid, d, torch.full_like(d, -math.inf)).amax() if d.numel() else zero - math.inf
        dmax = dmax.reshape(1)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)
            dist.all_reduce(dmax, op=dist.ReduceOp.MAX, group=dp_group)
        n, sd, sdd, sp, sq, spp, sqq, spq = sums.unbind()
        nan = torch.full((), math.nan, dtype=torch.float64, device=log_prob.device)
        has = n > 0
        mean = sd / n.clamp(min=1)
        # Bessel-corrected variance from the sums (fp64: |p - q| <= 1, so the sums stay well conditioned)
        var = (sdd - n * mean * mean) / (n - 1).clamp(min=1)
        std = torch.where(n > 1, var.clamp(min=0).sqrt(), nan)
        cov = spq - sp * sq / n.clamp(min=1)
        vp = spp - sp * sp / n.clamp(min=1)
        vq = sqq - sq * sq / n.clamp(min=1)
        corr = cov / (vp * vq).sqrt()
        out = {
            DEBUG_METRIC_KEYS[0]: has.double(),
            DEBUG_METRIC_KEYS[1]: torch.where(has, dmax[0], nan),
            DEBUG_METRIC_KEYS[2]: torch.where(has, mean, nan),
            DEBUG_METRIC_KEYS[3]: torch.where(has, std, nan),
            DEBUG_METRIC_KEYS[4]: torch.where(has, corr, nan),
        }
    return out
