"""Asynchronous rollouts: per-token policy versions (docs/policy_losses.md, "Policy versions").

In asynchronous RL one batch mixes tokens sampled by several policy versions: the rollout engine tags each token
with the version v_b of the weights that drew it, and the trainer is at version v_theta. This module gives

* :func:`staleness_metrics`: the token-weighted lag v_theta - v_b (mean, max, a histogram), exact over data-parallel
  ranks (one SUM and one MAX all-reduce of a few numbers);
* :func:`proximal_log_prob`: the decoupled loss's proximal policy pi_prox (the policy one step behind, v_theta - 1)
  without a forward pass, interpolated from the behaviour and current log-probs by version (AReaL's proximal
  log-probability approximation, ``compute_prox_logp_approximations`` in AReaL's ``areal/trainer/ppo/actor.py``
  (``areal/engine/ppo/actor.py`` before; checked against it at 4aef98d: equal in fp32, closer to the exact value for
  bf16 / fp64 inputs, where AReaL computes in the inputs' type and alpha in fp32); AReaL, arXiv:2505.24298): alpha = (v_prox - v_b) / (v_theta - v_b) clamped to [0, 1] (0 where v_theta <= v_b or v_b < 0,
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

from ._checks import check_cu_seqlens, check_mask_kind, ordered_sum, refuse_ambiguous_per_sequence, refuse_where
from .fallback.rollout_correction import MSG_NO_VALID_TOKEN

__all__ = ["PROXIMAL_METHODS", "proximal_log_prob", "staleness_metrics", "proximal_error_metrics",
           "compute_rollout_correction_by_lag", "policy_lag", "check_current_version", "check_versions_dtype"]

PROXIMAL_METHODS = ("loglinear", "linear")
#: The largest ``max_lag`` of :func:`staleness_metrics` (its histogram is a tensor of max_lag + 2 fp64 counts).
MAX_HISTOGRAM_LAG = 2 ** 24


def check_versions_dtype(versions, name: str = "versions") -> torch.Tensor:
    """``versions`` itself if it is an integer tensor (a policy version is a count: a float would be truncated, a
    bool read as 0 / 1), else a TypeError naming ``name``."""
    if not isinstance(versions, torch.Tensor) or versions.is_floating_point() or versions.dtype == torch.bool \
            or versions.is_complex():
        raise TypeError(f"{name} must be an integer tensor (one policy version per token or per row), got "
                        f"{getattr(versions, 'dtype', type(versions))}")
    return versions


def _versions(versions, like: torch.Tensor, name: str = "versions") -> torch.Tensor:
    """Per-token versions in ``like``'s shape (a per-row ``[B]`` tensor is broadcast along the tokens)."""
    check_versions_dtype(versions, name)
    if versions.device != like.device:
        raise ValueError(f"{name} is on {versions.device} but the log-probs are on {like.device}")
    if tuple(versions.shape) == tuple(like.shape):
        return versions
    if like.dim() == 2 and tuple(versions.shape) == (like.shape[0],):
        return versions.unsqueeze(-1).expand(like.shape)
    raise ValueError(f"{name} must have the log-probs' shape {tuple(like.shape)} (or one value per row), got "
                     f"{tuple(versions.shape)}")


def check_current_version(current_version, name: str = "current_version") -> int:
    """The trainer's policy version: an int in [0, 2**63) (the lags are int64), else an error naming ``name``."""
    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise TypeError(f"{name} must be an int, got {type(current_version).__name__}")
    if not 0 <= current_version < 2 ** 63:
        raise ValueError(f"{name} must be in [0, 2**63), got {current_version}")
    return current_version


def _refused(lag: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    """The versions no response token may have: newer than the trainer (lag < 0), or negative (not generated)."""
    return (lag < 0) | (versions < 0)


def policy_lag(versions: torch.Tensor, current_version: int, valid: torch.Tensor,
               name: str = "versions", refuse=refuse_where) -> torch.Tensor:
    """The lag ``current_version - versions`` (int64), checking that no ``valid`` token is newer than the trainer
    or has a negative version (which marks a token the engine did not generate, :func:`proximal_log_prob`: a
    response token has the version that drew it; counted, it would read as a lag past v_theta): a ValueError naming
    the first on CPU, an asynchronous device assert on CUDA (no host sync). ``refuse``: how the check is made
    (``refuse_where``'s signature; the diagnostics defer it to their reduce)."""
    v64 = versions.to(torch.int64)
    lag = current_version - v64
    bad = (valid != 0) & _refused(lag, v64)  # a mask of any dtype (an int mask of 2 & True would be 0)

    def describe(at):
        v = int(versions[at])
        why = ("negative (a token the engine did not generate; a response token needs the version that drew it)"
               if v < 0 else f"newer than current_version {current_version}")
        return f"{name} at response token {at} is {v}, {why}"

    refuse(bad, describe, f"{name}: a response token's version is negative or newer than current_version")
    return lag


def proximal_log_prob(behaviour_log_prob: torch.Tensor, log_prob: torch.Tensor, versions: torch.Tensor,
                      current_version: int, method: str = "loglinear") -> torch.Tensor:
    """The proximal policy's log-probs from the versions (module docstring), a constant (no gradient), in the
    accumulation dtype (fp64 when either input is fp64, else fp32). ``versions``: per token, or per row ``[B]``; negative
    versions mark tokens the engine did not generate (alpha 0: pi_prox = pi_b)."""
    if method not in PROXIMAL_METHODS:
        raise ValueError(f"method must be one of {PROXIMAL_METHODS}, got {method!r}")
    v_theta = check_current_version(current_version)
    for name, t in (("behaviour_log_prob", behaviour_log_prob), ("log_prob", log_prob)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if behaviour_log_prob.shape != log_prob.shape or behaviour_log_prob.device != log_prob.device:
        raise ValueError(f"behaviour_log_prob {tuple(behaviour_log_prob.shape)} on {behaviour_log_prob.device} must "
                         f"match log_prob {tuple(log_prob.shape)} on {log_prob.device}")
    v = _versions(versions, log_prob)
    acc = torch.float64 if torch.float64 in (behaviour_log_prob.dtype, log_prob.dtype) else torch.float32
    with torch.no_grad():
        lag = v_theta - v.to(torch.int64)  # in integers: versions past 2^24 keep their lags in fp32 too
        live = (lag > 0) & (v >= 0)
        lag_f = torch.where(live, lag, torch.ones_like(lag)).to(torch.float64)
        alpha64 = torch.where(live, (lag_f - 1.0) / lag_f, torch.zeros_like(lag_f))
        alpha = alpha64.to(acc)
        lb, lt = behaviour_log_prob.detach().to(acc), log_prob.detach().to(acc)
        if method == "loglinear":  # lb = -inf: -inf, not -inf + inf; 1 - alpha = 1 / lag, never the 0 of an fp32
            # alpha rounded to 1 (lag >= 2^25: 0 * -inf was NaN; the review)
            mixed = torch.where(torch.isfinite(lb) & torch.isfinite(lt), lb + alpha * (lt - lb),
                                (1.0 / lag_f).to(acc) * lb + alpha * lt)
        else:  # log((1 - a) e^lb + a e^lt), as a log-sum-exp (no underflow for very negative log-probs), with
            # log(1 - a) = -log(lag) and log(a) = log1p(-1 / lag) from the integer lag in fp64: 1 - a of an fp32 a
            # kept no digits at large lags (lag 1e6: 0.013 off; 2^25: a rounded to 1, pi_theta returned)
            mixed = torch.logaddexp((-torch.log(lag_f)).to(acc) + lb, torch.log1p(-1.0 / lag_f).to(acc) + lt)
        # alpha 0 is pi_b and alpha 1 pi_theta exactly, whatever the other log-prob holds (NaN, +-inf)
        return torch.where(alpha64 == 0, lb, torch.where(alpha64 == 1, lt, mixed))


def staleness_metrics(versions: torch.Tensor, current_version: int, response_mask: torch.Tensor, *,
                      max_lag: int = 8, dp_group=None, prefix: str = "rollout_corr/staleness_") -> Dict[str,
                                                                                                        torch.Tensor]:
    """Token-weighted policy lag v_theta - v_b over the response tokens (``response_mask`` non-zero): ``mean``,
    ``max``, ``min``, and ``hist`` (a ``[max_lag + 2]`` tensor of token counts for lag 0, 1, ..., max_lag and
    > max_lag; a negative lag, a token newer than the trainer, is an error). 0-dim fp64 tensors (no host sync);
    with ``dp_group`` the values of the whole data-parallel batch."""
    v_theta = check_current_version(current_version)
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or not 0 <= max_lag <= MAX_HISTOGRAM_LAG:
        raise ValueError(f"max_lag must be an int in [0, {MAX_HISTOGRAM_LAG}] (the histogram has max_lag + 2 "
                         f"buckets), got {max_lag!r}")
    check_mask_kind("response_mask", response_mask)
    v = _versions(versions, response_mask)
    reduce = dp_group is not None and dist.get_world_size(dp_group) > 1
    with torch.no_grad():
        valid = response_mask != 0
        refusal = []
        # over ranks the refusal is counted into the reduce and decided on the sum: every rank raises alike (one
        # rank raising alone left the others waiting in the all-reduce; the versions fuzz)
        lag = policy_lag(v, v_theta, valid, refuse=(lambda *a: refusal.append(a)) if reduce else refuse_where)
        lagf = torch.where(valid, lag, torch.zeros_like(lag)).double()
        n = valid.sum().double()
        bucket = torch.where(valid, lag.clamp(0, max_lag + 1), torch.full_like(lag, max_lag + 2))
        hist = torch.bincount(bucket.reshape(-1), minlength=max_lag + 3)[:max_lag + 2].double()
        refused = [refusal[0][0].sum().double()] if refusal else []
        sums = torch.cat([torch.stack([n, lagf.sum()] + refused), hist])
        neg_inf = torch.full((), -math.inf, dtype=torch.float64, device=lagf.device)
        maxes = torch.stack([torch.where(valid, lag.double(), neg_inf).amax() if lag.numel() else neg_inf,
                             torch.where(valid, -lag.double(), neg_inf).amax() if lag.numel() else neg_inf])
        if reduce:
            dist.all_reduce(sums, group=dp_group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dp_group)
            (bad, describe, message), count = refusal[0], sums[2]
            if count.device.type != "cpu":
                torch._assert_async(count == 0, message)
            elif float(count) > 0:
                refuse_where(bad, describe, message)  # this rank's first, if it holds one
                raise ValueError(f"{message} (at {int(count)} response tokens of other ranks)")
            sums = torch.cat([sums[:2], sums[3:]])
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
    for name, t in (("approx_log_prob", approx_log_prob), ("old_log_prob", old_log_prob)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if not isinstance(response_mask, torch.Tensor) or response_mask.is_complex():
        raise TypeError(f"response_mask must be a bool, integer or float tensor, got "
                        f"{getattr(response_mask, 'dtype', type(response_mask))}")
    if approx_log_prob.shape != old_log_prob.shape or response_mask.shape != old_log_prob.shape:
        raise ValueError(f"approx_log_prob {tuple(approx_log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} "
                         f"and response_mask {tuple(response_mask.shape)} must have one shape")
    with torch.no_grad():
        valid = response_mask != 0
        d = torch.where(valid, approx_log_prob.detach().double() - old_log_prob.detach().double(),
                        torch.zeros((), dtype=torch.float64, device=old_log_prob.device))
        # sums in the tokens' logical order (ordered_sum): the same bits in any layout and at any thread count
        sums = torch.stack([valid.sum().double(), ordered_sum(d.abs()), ordered_sum(torch.expm1(d).abs())])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)
        n = sums[0]
        nan = torch.full((), math.nan, dtype=torch.float64, device=sums.device)  # a mean of nothing, as elsewhere
        return {prefix + "abs_error": torch.where(n > 0, sums[1] / n.clamp(min=1), nan),
                prefix + "imp_weight_error": torch.where(n > 0, sums[2] / n.clamp(min=1), nan)}


def compute_rollout_correction_by_lag(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                                      response_mask: torch.Tensor, lag_configs, versions: torch.Tensor,
                                      current_version: int, *, dp_group=None, seq_group=None,
                                      nonfinite: str = "error", cu_seqlens=None):
    """Rollout correction whose IS / RS thresholds depend on the policy lag (docs/policy_losses.md, "Policy
    versions"). ``lag_configs``: ``[(lag_0, config_0), (lag_1, config_1), ...]`` with 0 = lag_0 < lag_1 < ...: a
    response token whose lag v_theta - v_b lies in [lag_i, lag_{i+1}) is corrected by ``config_i`` (the last
    bucket is open). Each bucket is one :func:`~rollout_corr_ext.compute_rollout_correction` over the batch with
    the other buckets' tokens masked out, so every token's weight and rejection are exactly those its bucket's
    config gives it, and each bucket's metrics are exact over ``dp_group`` / ``seq_group``; they are returned under
    ``rollout_corr/lag_<lo>-<hi>/`` (``lag_<lo>+`` for the last) beside ``rollout_corr/staleness_*``.

    Each bucket's correction sees only the sequences with a response token in that bucket (a sequence of another
    bucket must not enter its sequence-level statistics as an empty row; a sequence without response tokens is in
    no bucket, on every context-parallel rank). A sequence-level IS level or RS criterion, the token veto or batch
    normalisation judges a sequence by the tokens of its bucket: with such a config ``versions`` must be one per row
    (``[B]``, or one per packed sequence), so a sequence falls into one bucket whole; so must they under context
    parallelism. ``rollout_corr/lag_<...>/tokens`` counts each bucket's response tokens; an empty bucket (over the
    whole batch) has no other metrics. Costs one small all-reduce (two under CP with ``dp_group``) and one host
    read (the bucket counts, and whether any response token is newer than the trainer: every rank raises alike),
    then one correction (its passes and collectives) per non-empty bucket.

    Returns a :class:`~rollout_corr_ext.RolloutCorrectionResult`: weights (None when no bucket has IS; else, at each
    token, its bucket's: the IS weights as :func:`compute_rollout_correction` gives them, where a token the RS
    rejects keeps its weight and leaves the mask, or 1 at the response tokens of a bucket without IS, 0 at its other
    tokens), the response mask with every bucket's rejections, the metrics. Use the weights with the mask."""
    from .config import RolloutCorrectionConfig
    from .correction import PREFIX, RolloutCorrectionResult, check_correction_inputs, compute_rollout_correction

    v_theta = check_current_version(current_version)
    if not isinstance(lag_configs, (list, tuple)) or not lag_configs:
        raise ValueError("lag_configs must be a non-empty list of (lag, config) pairs, the first lag 0")
    lags, cfgs = [], []
    for item in lag_configs:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise ValueError(f"lag_configs: each entry is a (lag, config) pair, got {item!r}")
        lag, cfg = item
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"lag_configs: a lag must be an int >= 0, got {lag!r}")
        if isinstance(cfg, dict) or hasattr(cfg, "keys"):
            cfg = RolloutCorrectionConfig.from_dict(cfg)
        if not isinstance(cfg, RolloutCorrectionConfig):
            raise TypeError(f"lag_configs: a config must be a RolloutCorrectionConfig or a dict, got "
                            f"{type(cfg).__name__}")
        lags.append(lag)
        cfgs.append(cfg)
    if lags[0] != 0 or any(b <= a for a, b in zip(lags, lags[1:])):
        raise ValueError(f"lag_configs: the lags must start at 0 and increase strictly, got {lags}")
    # the inputs as compute_rollout_correction checks them, before any bucket's slice of them is taken
    check_correction_inputs(log_prob, rollout_log_prob, response_mask, cfgs[0], nonfinite,
                            cu_seqlens.to(log_prob.device) if isinstance(cu_seqlens, torch.Tensor) and
                            isinstance(log_prob, torch.Tensor) else cu_seqlens)  # host cu_seqlens are moved below
    packed = cu_seqlens is not None
    cp = seq_group is not None and dist.get_world_size(seq_group) > 1
    if packed:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {type(cu_seqlens).__name__}")
        # the layout compute_rollout_correction takes (no tokens after the last sequence), checked before it is read
        cu = check_cu_seqlens(response_mask.reshape(-1), cu_seqlens.to(response_mask.device))
        n_seq = cu.shape[0] - 1
        seg = torch.searchsorted(cu[1:], torch.arange(response_mask.numel(), device=cu.device), right=True)
    per_row = isinstance(versions, torch.Tensor) and response_mask.dim() == 2 and not packed and \
        tuple(versions.shape) == (response_mask.shape[0],)
    per_seq = False
    # The refusals that depend on this rank's layout (which the ranks of a group may hold differently: its packed
    # sequences' count against its token count) are decided on every rank alike: each is kept here and counted into
    # the all-reduce below, then every rank raises (one refusing alone left the others waiting in that all-reduce)
    refused = None
    if packed and isinstance(versions, torch.Tensor) and versions.dim() == 1 and versions.shape[0] == n_seq:
        per_seq = True
        if response_mask.dim() == 1:
            try:
                refuse_ambiguous_per_sequence("versions", n_seq, cu, response_mask.numel(),
                                              "give the stream as [1, T] (log-probs, response_mask and per-token "
                                              "versions) to say which")
            except ValueError as e:
                refused, per_seq = str(e), False
    # the token veto rejects a whole sequence for any token under it: a sequence-level decision too
    whole = [c for c in cfgs if (c.is_spec is not None and c.is_spec.level != "token") or c.rollout_is_batch_normalize
             or any(r.level != "token" for r in c.rs_criteria) or c.rollout_token_veto_threshold is not None]
    if refused is None and whole and not (per_row or per_seq):
        refused = ("lag_configs: a sequence-level IS level, RS criterion, token veto or batch normalisation needs one "
                   "version per sequence (versions [B], or one per packed sequence), so that each sequence falls into "
                   "one lag bucket whole")
    if refused is None and cp and not (per_row or per_seq):
        refused = ("lag_configs under context parallelism (seq_group) need one version per sequence (versions [B]): "
                   "the ranks must agree on which sequences each bucket holds")
    dp = dp_group is not None and dist.get_world_size(dp_group) > 1
    if refused is not None and not (cp or dp):
        raise ValueError(refused)
    if refused is not None:  # counted below; until then the versions are read as if every token had lag 0
        versions, per_row = torch.full(response_mask.shape, v_theta, dtype=torch.int64,
                                       device=response_mask.device), False
    unit_versions = None
    if per_row or per_seq:  # the per-row / per-sequence versions, checked as the per-token ones are below
        unit_versions = _versions(versions, versions)
    if per_seq:  # per token
        if versions.device != response_mask.device:
            raise ValueError(f"versions is on {versions.device} but the log-probs are on {response_mask.device}")
        versions = torch.repeat_interleave(versions, cu[1:] - cu[:-1], output_size=int(response_mask.numel()))
        versions = versions.reshape(response_mask.shape)
    v = _versions(versions, response_mask)
    valid = response_mask != 0
    lag = v_theta - v.to(torch.int64)
    any_is = any(c.is_spec is not None for c in cfgs)
    wdtype = torch.float64 if torch.float64 in (log_prob.dtype, rollout_log_prob.dtype) else torch.float32
    weights = torch.zeros(response_mask.shape, dtype=wdtype, device=response_mask.device) if any_is else None
    mask_out = torch.zeros_like(response_mask)
    metrics: Dict[str, torch.Tensor] = {}
    insides, counts = [], []
    for i, lo in enumerate(lags):
        hi = lags[i + 1] if i + 1 < len(lags) else None
        inside = (lag >= lo) if hi is None else (lag >= lo) & (lag < hi)
        insides.append(inside)
        counts.append((inside & valid).sum())
    # which buckets hold response tokens anywhere in the batch (and how many), and whether a response token anywhere
    # is newer than the trainer: small all-reduces and one host read, so that every rank runs the same corrections
    # (an empty bucket has nothing to correct) or raises alike. Under context parallelism each sequence's response
    # tokens are counted over the ranks too: a sequence without any is in no bucket on every rank.
    newer = (valid & _refused(lag, v)).sum()  # policy_lag's refusal, counted
    counts = torch.stack(counts + [newer, torch.tensor(float(refused is not None), device=newer.device)]).to(
        torch.float64)
    unit_tokens = None
    if cp:  # dp_group, when given, holds the context-parallel ranks too (as compute_rollout_correction's)
        unit_tokens = (valid.sum(1) if not packed else torch.zeros(n_seq + 1, dtype=torch.int64, device=cu.device)
                       .index_add_(0, seg, valid.reshape(-1).to(torch.int64))[:n_seq]).to(torch.float64)
        both = torch.cat([unit_tokens.to(counts.device)] + ([] if dp else [counts]))
        dist.all_reduce(both, group=seq_group)
        unit_tokens = both[:unit_tokens.numel()]
        if not dp:
            counts = both[unit_tokens.numel():]
    if dp:
        dist.all_reduce(counts, group=dp_group)
    totals = counts.tolist()
    if refused is not None:
        raise ValueError(refused)
    if totals[-1]:
        raise ValueError("compute_rollout_correction_by_lag: refused on another rank of the group, which names the "
                         "reason (the layout of its versions or packed sequences); every rank raises alike")
    totals, counts = totals[:-1], counts[:-1]
    if totals[-1]:
        policy_lag(v, v_theta, valid)  # names the token where this rank holds it
        raise ValueError(f"versions: a response token on another rank is negative or newer than current_version "
                         f"{v_theta}")
    if not any(totals[:-1]):  # compute_rollout_correction's error (its text), on every rank alike, from the host
        raise ValueError(MSG_NO_VALID_TOKEN)  # read above (its own is a device assert on CUDA)
    counts = counts[:-1]
    for i, (lo, cfg) in enumerate(zip(lags, cfgs)):
        hi = lags[i + 1] if i + 1 < len(lags) else None
        tag = PREFIX + (f"lag_{lo}-{hi - 1}/" if hi is not None else f"lag_{lo}+/")
        metrics[tag + "tokens"] = counts[i]
        if totals[i] == 0:
            continue
        inside = insides[i]
        part = torch.where(inside, response_mask, torch.zeros_like(response_mask))
        # the bucket's correction sees the sequences with a response token in it, and only those: a sequence of
        # another bucket must not enter its sequence-level statistics as an empty row
        unit_in = None
        if cp:  # by the sequence's version and its response tokens over the ranks: every rank picks the same ones
            unit_lag = v_theta - unit_versions.to(device=response_mask.device, dtype=torch.int64)
            unit_in = (unit_lag >= lo) & ((unit_lag < hi) if hi is not None else True) & \
                (unit_tokens.to(response_mask.device) > 0)
        if not packed:
            rows = (part != 0).any(1) if unit_in is None else unit_in
            sel = rows.nonzero().squeeze(1)
            res = compute_rollout_correction(log_prob[sel], rollout_log_prob[sel], part[sel], cfg,
                                             dp_group=dp_group, seq_group=seq_group, nonfinite=nonfinite)
            full_mask = torch.zeros_like(response_mask)
            full_mask[sel] = res.response_mask
            full_w = None
            if res.weights is not None:
                full_w = torch.zeros(response_mask.shape, dtype=wdtype, device=response_mask.device)
                full_w[sel] = res.weights.to(wdtype)
        else:
            flat_part = part.reshape(-1)
            has = torch.zeros(n_seq + 1, dtype=torch.int64, device=cu.device).index_add_(
                0, seg, (flat_part != 0).to(torch.int64))[:n_seq] > 0
            if unit_in is not None:
                has = unit_in.to(cu.device)
            tok = torch.cat([has, has.new_zeros(1)])[seg]
            idx = tok.nonzero().squeeze(1)
            lengths = (cu[1:] - cu[:-1])[has]
            sub_cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(cu_seqlens.dtype)
            flat = [t.reshape(-1) for t in (log_prob, rollout_log_prob)]
            res = compute_rollout_correction(flat[0][idx], flat[1][idx], flat_part[idx], cfg, dp_group=dp_group,
                                             seq_group=seq_group, nonfinite=nonfinite, cu_seqlens=sub_cu)
            full_mask = torch.zeros_like(flat_part)
            full_mask[idx] = res.response_mask
            full_mask = full_mask.reshape(response_mask.shape)
            full_w = None
            if res.weights is not None:
                full_w = torch.zeros(flat_part.shape, dtype=wdtype, device=response_mask.device)
                full_w[idx] = res.weights.to(wdtype)
                full_w = full_w.reshape(response_mask.shape)
        mask_out = torch.where(inside, full_mask, mask_out)
        if weights is not None:  # a bucket without IS leaves its tokens' weight at 1
            w = full_w if full_w is not None else (part != 0).to(wdtype)
            weights = torch.where(inside, w, weights)
        metrics.update({tag + k[len(PREFIX):]: val for k, val in res.metrics.items()})
    stale = staleness_metrics(v, v_theta, response_mask, dp_group=dp_group if dp_group is not None else seq_group,
                              prefix=PREFIX + "staleness_")
    stale.pop(PREFIX + "staleness_hist")
    metrics.update(stale)
    return RolloutCorrectionResult(weights, mask_out, metrics)
