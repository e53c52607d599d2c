"""Asynchronous rollouts: per-token policy versions (docs/policy_losses.md, "Policy versions").

In asynchronous RL one batch mixes tokens sampled by several policy versions: the rollout engine tags each token
with the version v_b of the weights that drew it, and the trainer is at version v_theta. This module gives

* :func:`staleness_metrics`: the token-weighted lag v_theta - v_b (mean, max, a histogram), exact over data-parallel
  ranks (one SUM and one MAX all-reduce of a few numbers);
* :func:`proximal_log_prob`: the decoupled loss's proximal policy pi_prox (the policy one step behind, v_theta - 1)
  without a forward pass, interpolated from the behaviour and current log-probs by version (AReaL's proximal
  log-probability approximation, ``areal/utils/functional``'s ``compute_prox_logp_approximations``; AReaL,
  arXiv:2505.24298): alpha = (v_prox - v_b) / (v_theta - v_b) clamped to [0, 1] (0 where v_theta <= v_b or v_b < 0,
  a prompt token), and

  - ``"loglinear"``: log pi_prox = log pi_b + alpha (log pi_theta - log pi_b);
  - ``"linear"``: log pi_prox = log((1 - alpha) pi_b + alpha pi_theta);

* :func:`proximal_error_metrics`: how far that approximation is from the real pi_old when the trainer also computed
  it (mean |log error| and mean |importance-weight error|, exact over data-parallel ranks).
"""

from __future__ import annotations

import math
from typing import Dict

import torch
import torch.distributed as dist

__all__ = ["PROXIMAL_METHODS", "proximal_log_prob", "staleness_metrics", "proximal_error_metrics"]

PROXIMAL_METHODS = ("loglinear", "linear")


def _versions(versions, like: torch.Tensor, name: str = "versions") -> torch.Tensor:
    """Per-token versions in ``like``'s shape (a per-row ``[B]`` tensor is broadcast along the tokens)."""
    if not isinstance(versions, torch.Tensor) or versions.is_floating_point() or versions.dtype == torch.bool \
            or versions.is_complex():
        raise TypeError(f"{name} must be an integer tensor (one policy version per token or per row), got "
                        f"{getattr(versions, 'dtype', type(versions))}")
    if versions.device != like.device:
        raise ValueError(f"{name} is on {versions.device} but the log-probs are on {like.device}")
    if tuple(versions.shape) == tuple(like.shape):
        return versions
    if like.dim() == 2 and tuple(versions.shape) == (like.shape[0],):
        return versions.unsqueeze(-1).expand(like.shape)
    raise ValueError(f"{name} must have the log-probs' shape {tuple(like.shape)} (or one value per row), got "
                     f"{tuple(versions.shape)}")


def _current(current_version) -> int:
    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise TypeError(f"current_version must be an int, got {type(current_version).__name__}")
    return current_version


def proximal_log_prob(behaviour_log_prob: torch.Tensor, log_prob: torch.Tensor, versions: torch.Tensor,
                      current_version: int, method: str = "loglinear") -> torch.Tensor:
    """The proximal policy's log-probs from the versions (module docstring), a constant (no gradient), in the
    accumulation dtype (fp64 for fp64 inputs, else fp32). ``versions``: per token, or per row ``[B]``; negative
    versions mark tokens the engine did not generate (alpha 0: pi_prox = pi_b)."""
    if method not in PROXIMAL_METHODS:
        raise ValueError(f"method must be one of {PROXIMAL_METHODS}, got {method!r}")
    v_theta = _current(current_version)
    for name, t in (("behaviour_log_prob", behaviour_log_prob), ("log_prob", log_prob)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if behaviour_log_prob.shape != log_prob.shape or behaviour_log_prob.device != log_prob.device:
        raise ValueError(f"behaviour_log_prob {tuple(behaviour_log_prob.shape)} on {behaviour_log_prob.device} must "
                         f"match log_prob {tuple(log_prob.shape)} on {log_prob.device}")
    v = _versions(versions, log_prob)
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        vb = v.to(acc)
        diff = float(v_theta) - vb
        gap = float(v_theta - 1) - vb
        live = (diff > 0) & (v >= 0)
        alpha = torch.where(live, gap / torch.where(live, diff, torch.ones_like(diff)), torch.zeros_like(diff))
        alpha = alpha.clamp(0.0, 1.0)
        lb, lt = behaviour_log_prob.detach().to(acc), log_prob.detach().to(acc)
        if method == "loglinear":
            return lb + alpha * (lt - lb)
        # log((1 - a) e^lb + a e^lt), as a log-sum-exp (no underflow for very negative log-probs)
        return torch.logaddexp(torch.log1p(-alpha) + lb, torch.log(alpha) + lt)


def staleness_metrics(versions: torch.Tensor, current_version: int, response_mask: torch.Tensor, *,
                      max_lag: int = 8, dp_group=None, prefix: str = "rollout_corr/staleness_") -> Dict[str,
                                                                                                        torch.Tensor]:
    """Token-weighted policy lag v_theta - v_b over the response tokens (``response_mask`` non-zero): ``mean``,
    ``max``, ``min``, and ``hist`` (a ``[max_lag + 2]`` tensor of token counts for lag 0, 1, ..., max_lag and
    > max_lag; a negative lag, a token newer than the trainer, is an error). 0-dim fp64 tensors (no host sync);
    with ``dp_group`` the values of the whole data-parallel batch."""
    v_theta = _current(current_version)
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")
    if not isinstance(response_mask, torch.Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    v = _versions(versions, response_mask)
    with torch.no_grad():
        valid = response_mask != 0
        lag = (v_theta - v.to(torch.int64))
        bad = valid & (lag < 0)
        if bad.device.type == "cpu":
            if bool(bad.any()):
                pos = tuple(int(i) for i in bad.nonzero()[0])
                raise ValueError(f"versions at response token {pos} is {int(v[pos])}, newer than current_version "
                                 f"{v_theta}")
        else:
            torch._assert_async(~bad.any(), "a response token's version is newer than current_version")
        lagf = torch.where(valid, lag, torch.zeros_like(lag)).double()
        n = valid.sum().double()
        bucket = torch.where(valid, lag.clamp(0, max_lag + 1), torch.full_like(lag, max_lag + 2))
        hist = torch.bincount(bucket.reshape(-1), minlength=max_lag + 3)[:max_lag + 2].double()
        sums = torch.cat([torch.stack([n, lagf.sum()]), hist])
        neg_inf = torch.full((), -math.inf, dtype=torch.float64, device=lagf.device)
        maxes = torch.stack([torch.where(valid, lag.double(), neg_inf).amax() if lag.numel() else neg_inf,
                             torch.where(valid, -lag.double(), neg_inf).amax() if lag.numel() else neg_inf])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dp_group)
        n, total, hist = sums[0], sums[1], sums[2:]
        nan = torch.full((), math.nan, dtype=torch.float64, device=lagf.device)
        has = n > 0
        return {prefix + "mean": torch.where(has, total / n.clamp(min=1), nan),
                prefix + "max": torch.where(has, maxes[0], nan),
                prefix + "min": torch.where(has, -maxes[1], nan),
                prefix + "hist": hist}


def proximal_error_metrics(approx_log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                           *, dp_group=None, prefix: str = "rollout_corr/prox_approx_") -> Dict[str, torch.Tensor]:
    """How far :func:`proximal_log_prob` is from the real pi_old, over the response tokens: ``abs_error`` =
    mean |log pi_approx - log pi_old|, ``imp_weight_error`` = mean |pi_approx / pi_old - 1| (the error of the IS
    weight the decoupled loss would use). 0-dim fp64; exact over ``dp_group`` (one SUM all-reduce)."""
    if approx_log_prob.shape != old_log_prob.shape or response_mask.shape != old_log_prob.shape:
        raise ValueError(f"approx_log_prob {tuple(approx_log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} "
                         f"and response_mask {tuple(response_mask.shape)} must have one shape")
    with torch.no_grad():
        valid = response_mask != 0
        d = torch.where(valid, approx_log_prob.detach().double() - old_log_prob.detach().double(),
                        torch.zeros((), dtype=torch.float64, device=old_log_prob.device))
        sums = torch.stack([valid.sum().double(), d.abs().sum(), torch.expm1(d).abs().sum()])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)
        n = sums[0].clamp(min=1)
        return {prefix + "abs_error": sums[1] / n, prefix + "imp_weight_error": sums[2] / n}
