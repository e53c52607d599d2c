"""verl 0.9.1 drop-in: the rollout-correction helper and the policy losses with verl's signatures and return types,
computed by this package's kernels.

Every function here has the parameters of its verl namesake (names, order, defaults) and returns what verl returns:
metrics as Python ``float`` s with verl's exact key set, IS weights in a ``DataProto`` where verl returns one, the
mask in the input mask's dtype. So a verl code base swaps one import line::

    # from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from rollout_corr_ext.verl import compute_rollout_correction_and_add_to_batch

and :func:`register_policy_losses` puts the policy losses into verl's ``POLICY_LOSS_REGISTRY`` (all twelve of verl's
names, docs/policy_losses.md), so verl's actors compute them here without any other change.

Covered (verl module -> name):

* ``verl.trainer.ppo.rollout_corr_helper``: :func:`compute_rollout_correction_and_rejection_mask`,
  :func:`compute_rollout_correction_and_add_to_batch`, :func:`compute_rollout_correction_weights`,
  :func:`compute_rollout_rejection_mask`, :func:`compute_offpolicy_metrics`,
  :func:`compute_rollout_corr_metrics_from_logprobs`, :func:`apply_bypass_mode`; ``SAFETY_BOUND``,
  ``SUPPORTED_ROLLOUT_RS_OPTIONS``.
* ``verl.trainer.ppo.core_algos``: :func:`agg_loss`, :func:`compute_policy_loss_vanilla`,
  :func:`compute_policy_loss_reinforce`, :func:`compute_policy_loss_bypass_mode`, :func:`compute_policy_loss`
  (verl's deprecated 4-tuple form), and the other ten registered losses (``compute_policy_loss_dppo_tv``,
  ``_dppo_kl``, ``_gspo``, ``_sapo``, ``_gpg``, ``_clip_cov``, ``_kl_cov``, ``_geo_mean``, ``_dro``, ``_cispo``),
  :func:`kl_penalty` (with ``old_log_prob=``: DeepSeek-V3.2's IS-corrected KL).
* the log-prob functions verl's engines score with, replayed under ``configure(sampling=...)``:
  :func:`logprobs_from_logits`, :func:`vocab_parallel_log_probs_from_logits`, and for ``use_fused_kernels``
  :class:`FusedLinearForPPO` and :func:`linear_cross_entropy` (from hidden states, no logits tensor).

What verl's signatures cannot carry is set once with :func:`configure` (or :func:`configured`, a context manager):
the process groups (``dp_group`` / ``seq_group``: metrics and batch normalisation exact over the global batch),
``extra_metrics`` (add this package's keys: IS-weight percentiles, veto and total-masking fractions) and
``nonfinite``. Differences from verl are listed in ``docs/from_verl.md``.

verl is needed only by the functions that build or take a ``DataProto`` and by :func:`register_policy_losses`;
they import it when called and raise an ``ImportError`` naming themselves when it is missing. Everything else runs
without verl installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import numbers
import re
import warnings
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence,
                    Tuple, Union)

import torch
import torch.distributed as dist

from . import losses as _losses
from ._checks import check_mask
from .config import RolloutCorrectionConfig
from .correction import OFFPOLICY_KEYS, PREFIX, compute_rollout_correction
from .losses import PolicyLossConfig
from .losses import agg_loss as _agg_loss
from .losses import kl_penalty as _kl_penalty
from .sampling import VLLM_MIN_TEMPERATURE, SamplingParams, engine_family, vllm_engine_kwargs

if TYPE_CHECKING:  # pragma: no cover
    from verl.protocol import DataProto

__all__ = [
    "VERL_VERSION",
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "configure",
    "configured",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "apply_bypass_mode",
    "agg_loss",
    "kl_penalty",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_bypass_mode",
    "register_policy_losses",
    "restore_policy_losses",
    "rollout_correction_config",
    "policy_loss_config",
    "sampling_params",
    "logprobs_from_logits",
    "vocab_parallel_log_probs_from_logits",
    "linear_cross_entropy",
    "FusedLinearForPPO",
    "calculate_debug_metrics",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dro",
    "compute_policy_loss_cispo",
    "POLICY_LOSSES",
]

#: The verl release whose signatures, defaults, key sets and return types this module follows.
VERL_VERSION = "0.9.1"
#: verl's clamp of log-ratios before ``exp`` (the package uses the same bound).
SAFETY_BOUND = 20.0
#: verl's rejection criteria. The functions here also take this package's ratio criteria (``token``,
#: ``sequence``, ``geometric``); see docs/rollout_correction.md.
SUPPORTED_ROLLOUT_RS_OPTIONS = frozenset({
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
    "seq_mean_k3", "seq_max_k2", "seq_max_k3",
})

# ------------------------------------------------------------------------------------------------- settings

_SETTINGS: Dict[str, Any] = {"dp_group": None, "seq_group": None, "extra_metrics": False, "nonfinite": "error",
                             "sampling": None, "diagnostics": None, "current_version": None}



def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    """verl 0.9.1's ``agg_loss`` (same parameters, same order), backed by :func:`rollout_corr_ext.agg_loss`."""
    return _agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
                     loss_scale_factor)


def configure(**settings: Any) -> Dict[str, Any]:
    """Set what verl's signatures cannot pass; returns the previous settings (``configure(**previous)`` restores).

    Args (keyword only, each optional):
        dp_group: the process group one global batch is split over (with context parallelism: data parallel *with*
            CP). Metrics and batch normalisation are then exact over the global batch. ``None`` (default): this
            process's rows, except that under an initialised ``torch.distributed`` batch normalisation uses the
            default group, as verl does.
        seq_group: the context-parallel group (ranks holding slices of the same sequences), or ``None``.
        extra_metrics: ``True`` adds this package's metrics to verl's keys (``rollout_is_p5`` ... ``_p95``,
            ``rollout_is_veto_fraction``, ``rollout_is_catastrophic_token_fraction``, ``masked_fraction``,
            ``seq_masked_fraction``, and ``nonfinite_token_fraction`` with ``nonfinite="exclude"``). Default False:
            exactly verl's key set.
        nonfinite: ``"error"`` (default: NaN / inf log-probs at response tokens raise a ``ValueError``) or
            ``"exclude"`` (such tokens are dropped from the mask and the weights).
        sampling: a :class:`rollout_corr_ext.SamplingParams` (:func:`sampling_params` maps verl's rollout config) to
            replay the engine's truncation (docs/sampling_replay.md): :func:`logprobs_from_logits` then returns the
            log-probs of the truncated distribution (-inf for a token outside its kept set), and the rollout
            correction and the policy losses here leave every response token with a -inf log-prob out of the mask
            (a zero probability under a replayed distribution), reporting
            ``rollout_corr/sampling_out_of_support_fraction``. ``None`` (default): no replay; a -inf log-prob is
            treated as verl treats it.
        diagnostics: a :class:`rollout_corr_ext.MismatchDiagnostics` (its bucket settings; leave its tensors None):
            :func:`compute_rollout_correction_and_add_to_batch` then adds the mismatch diagnostics' metrics
            (docs/rollout_correction.md "Diagnostics") to the ones it returns, with the policy versions of the
            batch when it has them: ``batch.batch["rollout_versions"]`` (per token or per row), else verl's
            fully-async ``non_tensor_batch["min_global_steps"]`` (per row: the oldest weights that generated part of
            the trajectory, so the lag is the row's largest).
        current_version: the trainer's policy version for those lags (verl's fully-async trainer:
            ``current_param_version``); ``None``: ``batch.meta_info["global_steps"]``.
    """
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise TypeError(f"configure: unknown setting(s) {unknown}; allowed: {sorted(_SETTINGS)}")
    if "extra_metrics" in settings and not isinstance(settings["extra_metrics"], bool):
        raise ValueError(f"extra_metrics must be a bool, got {settings['extra_metrics']!r}")
    if "nonfinite" in settings and settings["nonfinite"] not in ("error", "exclude"):
        raise ValueError(f"nonfinite must be 'error' or 'exclude', got {settings['nonfinite']!r}")
    if settings.get("sampling") is not None and not isinstance(settings["sampling"], SamplingParams):
        raise TypeError(f"sampling must be a rollout_corr_ext.SamplingParams (or None), got "
                        f"{type(settings['sampling']).__name__}")
    diag = settings.get("diagnostics")
    if diag is not None:
        from .observability import MismatchDiagnostics

        if not isinstance(diag, MismatchDiagnostics):
            raise TypeError(f"diagnostics must be a rollout_corr_ext.MismatchDiagnostics (or None), got "
                            f"{type(diag).__name__}")
        if any(getattr(diag, k) is not None for k in ("entropy", "turn_ids", "versions", "positions")):
            raise ValueError("diagnostics: leave its tensors None here (the batch supplies them per call)")
    cv = settings.get("current_version")
    if cv is not None and (isinstance(cv, bool) or not isinstance(cv, int)):
        raise TypeError(f"current_version must be an int (or None), got {type(cv).__name__}")
    previous = dict(_SETTINGS)
    _SETTINGS.update(settings)
    return previous


@contextlib.contextmanager
def configured(**settings: Any) -> Iterator[None]:
    """:func:`configure` for the duration of a ``with`` block."""
    previous = configure(**settings)
    try:
        yield
    finally:
        _SETTINGS.clear()
        _SETTINGS.update(previous)


# ------------------------------------------------------------------------------------------------- helpers


def _require_verl(fn_name: str, module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"rollout_corr_ext.verl.{fn_name} needs verl ({module}), which cannot be imported: {exc}. "
                          f"Install it with `pip install --no-deps verl=={VERL_VERSION}` plus its light imports "
                          f"(see scripts/test.sh).") from exc


def _data_proto(fn_name: str):
    return _require_verl(fn_name, "verl.protocol").DataProto


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """verl's ``config.get(key, default)`` on a mapping, a DictConfig, verl's BaseConfig or a plain object."""
    if obj is None:
        return default
    if isinstance(obj, Mapping) or hasattr(obj, "get"):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _config_from_args(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
                      rollout_rs_threshold) -> RolloutCorrectionConfig:
    """Our config from verl's five helper arguments, with verl's conventions: no threshold switches IS off, and a
    threshold is not read (nor validated) for a feature that is off."""
    if rollout_is_threshold is None:
        rollout_is = None
    return RolloutCorrectionConfig(
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold if rollout_is is not None else None,
        rollout_is_batch_normalize=bool(rollout_is_batch_normalize),
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold if rollout_rs is not None else None,
    )


def rollout_correction_config(rollout_corr_config: Any) -> RolloutCorrectionConfig:
    """Our :class:`RolloutCorrectionConfig` from what verl's functions take: this package's config as is (every
    field honoured), or verl's ``RolloutCorrectionConfig`` / a ``DictConfig`` / a dict read the way verl's helper
    reads it: ``.get`` of ``rollout_is`` (None when absent), ``rollout_is_threshold`` (2.0),
    ``rollout_is_batch_normalize`` (False), ``rollout_rs`` (None), ``rollout_rs_threshold`` (None) and
    ``loss_type`` ("ppo_clip"); every other field (``_target_``, ``bypass_mode``, ...) is ignored."""
    if isinstance(rollout_corr_config, RolloutCorrectionConfig):
        return rollout_corr_config
    c = rollout_corr_config
    cfg = _config_from_args(_get(c, "rollout_is", None), _get(c, "rollout_is_threshold", 2.0),
                            _get(c, "rollout_is_batch_normalize", False), _get(c, "rollout_rs", None),
                            _get(c, "rollout_rs_threshold", None))
    loss_type = _get(c, "loss_type", "ppo_clip")
    return dataclasses.replace(cfg, loss_type=loss_type) if loss_type != cfg.loss_type else cfg


def policy_loss_config(config: Any) -> PolicyLossConfig:
    """Our :class:`PolicyLossConfig` from verl's actor config (dataclass, ``DictConfig`` or dict), a dict of our
    fields, our config itself, or None (defaults). See :meth:`PolicyLossConfig.from_dict`."""
    return _losses.as_policy_config(config)


def _weights_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype of verl's weights: log-ratio arithmetic, then ``* response_mask``."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _in_verl_dtype(weights: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """The weights (computed in fp32 / fp64) in verl's dtype (:func:`_weights_dtype`). In float16 a weight past
    65504 would become inf, silently: refused instead (verl raises there too, converting its threshold to float16
    in its clamp). One host read, for float16 weights only (bfloat16 has fp32's range)."""
    dtype = _weights_dtype(*tensors)
    out = weights.to(dtype)
    if dtype == torch.float16 and bool((torch.isinf(out) & torch.isfinite(weights)).any()):
        most = float(weights[torch.isfinite(weights)].max())
        raise ValueError(f"rollout_is_weights: a weight of {most:.6g} is past float16's range (65504): the weights "
                         f"take the log-probs' and response_mask's dtype, float16 here; keep rollout_is_threshold "
                         f"(or IcePop's upper bound) at most 65504, or pass float32 log-probs")
    return out


def _groups(cfg: RolloutCorrectionConfig) -> Tuple[Any, Any]:
    dp, seq = _SETTINGS["dp_group"], _SETTINGS["seq_group"]
    if (dp is None and seq is None and cfg.is_spec is not None and cfg.rollout_is_batch_normalize
            and dist.is_available() and dist.is_initialized()):
        dp = dist.group.WORLD  # verl normalises the weights over the default group (distributed_masked_mean)
    return dp, seq


def _replayed_mask(response_mask, *log_probs, log_ratio=None):
    """With sampling replay configured: ``response_mask`` without the tokens whose log-prob is -inf in any of
    ``log_probs`` (outside a replayed kept set), or whose ``log_ratio`` (log pi_old - log pi_rollout) is -inf or
    +inf (either side's -inf; NaN stays an error: both sides, or a NaN), and the fraction of response tokens that
    left (a 0-dim tensor); otherwise ``(response_mask, None)``."""
    if _SETTINGS["sampling"] is None:
        return response_mask, None
    out = torch.zeros_like(response_mask, dtype=torch.bool)
    for lp in log_probs:
        if isinstance(lp, torch.Tensor) and lp.shape == response_mask.shape:
            out |= lp.detach() == float("-inf")
    if isinstance(log_ratio, torch.Tensor) and log_ratio.shape == response_mask.shape:
        out |= log_ratio.detach().isinf()
    valid = response_mask != 0
    dp = _SETTINGS["dp_group"]
    counts = torch.stack([(valid & out).sum(), valid.sum()]).to(torch.float64)
    if dp is not None and dist.get_world_size(dp) > 1:
        dist.all_reduce(counts, group=dp)
    frac = counts[0] / counts[1].clamp_min(1.0)
    return torch.where(out, torch.zeros_like(response_mask), response_mask), frac


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str,
               old_log_prob: Optional[torch.Tensor] = None) -> torch.Tensor:
    """verl's ``core_algos.kl_penalty``: :func:`rollout_corr_ext.kl_penalty`, value for value (``old_log_prob=``:
    DeepSeek-V3.2's IS-corrected estimate). With :func:`configure` ``(sampling=...)``, a token whose log-prob is -inf
    in any of the inputs (and NaN in none) is outside a replayed kept set (the reference's own, under verl's engines, which replay
    it too): its estimate is 0 with gradient 0, so it leaves the KL as it leaves the loss, where the formula gives
    inf or NaN (-inf - -inf) and verl's ``kld * response_mask`` carries it into the rewards or the loss, a masked
    token's included. verl calls it as ``core_algos.kl_penalty`` (the reward's KL, ``algorithm.use_kl_in_reward``)
    and by name in ``verl.workers.utils.losses`` (the actor's ``use_kl_loss``): patch both in every process."""
    if _SETTINGS["sampling"] is None:
        return _kl_penalty(logprob, ref_logprob, kl_penalty, old_log_prob)
    given = [t for t in (logprob, ref_logprob, old_log_prob) if isinstance(t, torch.Tensor)]
    if len(given) < 2 + (old_log_prob is not None) or any(t.shape != logprob.shape for t in given):
        # not tensors, or not one shape: the plain function names the argument, as without replay
        return _kl_penalty(logprob, ref_logprob, kl_penalty, old_log_prob)
    out = torch.zeros((), dtype=torch.bool, device=logprob.device)
    nan = out
    for t in given:
        out = out | (t.detach() == float("-inf"))
        nan = nan | t.detach().isnan()
    out = out & ~nan  # a NaN is an error's value, never the replay's marker: it stays NaN

    def kept(t):  # 0 where the token left: finite arithmetic, and no gradient through where's other branch
        return None if t is None else torch.where(out, torch.zeros((), dtype=t.dtype, device=t.device), t)

    est = _kl_penalty(kept(logprob), kept(ref_logprob), kl_penalty, kept(old_log_prob))
    return torch.where(out, torch.zeros((), dtype=est.dtype, device=est.device), est)


def _with_replay_metric(metrics: Dict[str, Any], frac) -> Dict[str, Any]:
    if frac is not None:
        metrics = dict(metrics)
        metrics[PREFIX + "sampling_out_of_support_fraction"] = float(frac)
    return metrics


#: The correction's argument names in its errors (the pair first: "log_prob / rollout_log_prob hold NaN ...").
_CORRECTION_ARGS = re.compile(r"(?<![\w.])(log_prob / rollout_log_prob|rollout_log_prob|log_prob)(?![\w])")
#: The helpers' names for them: verl's old_log_prob, the log-ratio helpers' log_ratio (rollout_log_prob is 0 there).
_OLD_NAMES = {"log_prob": "old_log_prob", "log_prob / rollout_log_prob": "old_log_prob / rollout_log_prob"}
_RATIO_NAMES = {"log_prob": "log_ratio", "log_prob / rollout_log_prob": "log_ratio"}
#: compute_rollout_correction_and_add_to_batch's: the batch's keys.
_BATCH_NAMES = {"log_prob": "batch['old_log_probs']", "rollout_log_prob": "batch['rollout_log_probs']",
                "log_prob / rollout_log_prob": "batch['old_log_probs'] / batch['rollout_log_probs']"}


def _correct(log_prob, rollout_log_prob, response_mask, cfg: RolloutCorrectionConfig, diagnostics=None, *,
             log_ratio: bool = False, names: Optional[Dict[str, str]] = None):
    """The correction of the helpers; ``log_ratio``: ``log_prob`` is verl's log_ratio (``rollout_log_prob`` 0).
    ``names``: the caller's names of ``log_prob`` / ``rollout_log_prob`` in the errors (default: ``_RATIO_NAMES``
    with ``log_ratio``, else ``_OLD_NAMES``)."""
    if names is None:
        names = _RATIO_NAMES if log_ratio else _OLD_NAMES
    with _callers_names("", names, _CORRECTION_ARGS):
        return _correct_named(log_prob, rollout_log_prob, response_mask, cfg, diagnostics, log_ratio)


def _correct_named(log_prob, rollout_log_prob, response_mask, cfg, diagnostics, log_ratio):
    dp, seq = _groups(cfg)
    given = response_mask
    if log_ratio:
        response_mask, frac = _replayed_mask(response_mask, log_ratio=log_prob)
    else:
        response_mask, frac = _replayed_mask(response_mask, log_prob, rollout_log_prob)
    if frac is not None and diagnostics is not None:  # the correction sees the kept tokens only
        diagnostics = diagnostics.with_positions_in(given)
    with torch.no_grad():
        res = compute_rollout_correction(log_prob, rollout_log_prob, response_mask, cfg, dp_group=dp,
                                         seq_group=seq, nonfinite=_SETTINGS["nonfinite"], diagnostics=diagnostics)
    if frac is not None:
        res.metrics[PREFIX + "sampling_out_of_support_fraction"] = frac
    return res


def _is_keys(cfg: RolloutCorrectionConfig) -> List[str]:
    """verl's IS metric keys for ``cfg``, in verl's order (``compute_is_metrics``, then IcePop, then batch norm)."""
    spec = cfg.is_spec
    if spec is None:
        return []
    if spec.level == "token":
        head = ["mean", "ratio_fraction_high", "ratio_fraction_low", "max", "min"]
    else:
        head = ["max", "min", "mean", "ratio_fraction_high", "ratio_fraction_low"]
    keys = head + ["std", "eff_sample_size", "seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                   "seq_fraction_high", "seq_fraction_low"]
    if spec.mode == "mask":
        keys.append("oob_ratio")
    if cfg.rollout_is_batch_normalize:
        keys.append("batch_norm_factor")
    return ["rollout_is_" + k for k in keys]


def _rs_keys(cfg: RolloutCorrectionConfig) -> List[str]:
    """verl's RS metric keys for ``cfg``, in verl's order (per criterion, then the totals)."""
    keys: List[str] = []
    crits = cfg.rs_criteria
    for c in crits:
        names = ["mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max",
                 "seq_min", "seq_max_deviation", "seq_fraction_high"]
        if c.apply_lower:
            names.append("seq_fraction_low")
        names += ["masked_fraction", "seq_masked_fraction"]
        keys += [f"rollout_rs_{c.name}_{n}" for n in names]
    if crits:
        keys += ["rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"]
    return keys


def _select(metrics: Dict[str, torch.Tensor], keys: Sequence[str], *, extras: bool, prefixed: bool,
            head: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, float]:
    """``head`` (unprefixed keys) then ``metrics[PREFIX + k]`` for ``keys`` (and, with ``extras``, the package's
    further keys) as floats, with one host transfer for all of them."""
    names: List[str] = []
    values: List[torch.Tensor] = []
    for k, v in (head or {}).items():
        names.append(k)
        values.append(v)
    chosen = [PREFIX + k for k in keys]
    if extras:
        taken = set(chosen)
        chosen += [k for k in metrics if k not in taken]
    elif PREFIX + "sampling_out_of_support_fraction" in metrics:  # sampling replay configured: always reported
        chosen.append(PREFIX + "sampling_out_of_support_fraction")
    for k in chosen:
        names.append(k if prefixed else k[len(PREFIX):])
        values.append(metrics[k])
    if not values:
        return {}
    floats = torch.stack([v.detach().reshape(()).to(torch.float64) for v in values]).tolist()
    return dict(zip(names, floats))


# ------------------------------------------------------------------------------------------------- rollout_corr_helper


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Optional[Union[str, float]] = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """verl's ``compute_rollout_rejection_mask``: the RS mask from ``log_ratio`` = log(pi_train / pi_rollout) and
    verl's RS metrics (unprefixed floats). Returns ``(mask in response_mask's dtype, metrics)``."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string of comma-separated criteria")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(log_ratio, torch.Tensor) and log_ratio.dim() and log_ratio.shape[0] == 0:
        # verl's shortcut for an empty batch: the mask back, no metrics (a mask of another shape is still refused)
        check_mask("response_mask", response_mask, log_ratio, "log_ratio")
        return response_mask, {}
    cfg = RolloutCorrectionConfig(rollout_is=None, rollout_is_threshold=None, rollout_rs=rollout_rs,
                                  rollout_rs_threshold=rollout_rs_threshold)
    res = _correct(log_ratio, torch.zeros_like(log_ratio), response_mask, cfg, log_ratio=True)
    return res.response_mask, _select(res.metrics, _rs_keys(cfg), extras=False, prefixed=False)


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: Union[str, float] = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """verl's ``compute_rollout_correction_weights``: IS weights from ``log_ratio`` (TIS for a number, IcePop for
    ``"L_U"``; optional batch normalisation) and verl's IS metrics (unprefixed floats)."""
    if rollout_is is None:
        raise ValueError("rollout_is must be 'token' or 'sequence' (or this package's 'geometric'), got None")
    if rollout_is_threshold is None:
        raise ValueError("rollout_is_threshold must be a number (TIS) or a 'L_U' string (IcePop), got None")
    cfg = RolloutCorrectionConfig(rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
                                  rollout_is_batch_normalize=bool(rollout_is_batch_normalize), rollout_rs=None)
    res = _correct(log_ratio, torch.zeros_like(log_ratio), response_mask, cfg, log_ratio=True)
    keys = _is_keys(cfg)
    if _SETTINGS["extra_metrics"]:  # the percentiles (the other additions are about the mask)
        keys += [k[len(PREFIX):] for k in res.metrics if k.startswith(PREFIX + "rollout_is_p")]
    weights = _in_verl_dtype(res.weights, log_ratio, response_mask)
    return weights, _select(res.metrics, keys, extras=False, prefixed=False)


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[Union[str, float]] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Union[str, float]] = None,
) -> Tuple[Optional["DataProto"], torch.Tensor, Dict[str, float]]:
    """verl's ``compute_rollout_correction_and_rejection_mask``: ``(DataProto {"rollout_is_weights"} or None,
    mask with RS applied, {"rollout_corr/<name>": float})`` with verl's key set (see :func:`configure` for more)."""
    cfg = _config_from_args(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
                            rollout_rs_threshold)
    weights, mask, metrics = _correct_verl(old_log_prob, rollout_log_prob, response_mask, cfg)
    proto = None
    if weights is not None:
        proto = _data_proto("compute_rollout_correction_and_rejection_mask").from_dict(
            tensors={"rollout_is_weights": weights})
    return proto, mask, metrics


def _correct_verl(old_log_prob, rollout_log_prob, response_mask, cfg, diagnostics=None, names=None):
    """weights in verl's dtype (or None), the mask and verl's prefixed float metrics (with the diagnostics' when
    given). ``names``: as :func:`_correct`'s."""
    res = _correct(old_log_prob, rollout_log_prob, response_mask, cfg, diagnostics, names=names)
    keys = _is_keys(cfg) + _rs_keys(cfg) + list(OFFPOLICY_KEYS)
    if diagnostics is not None:
        from .observability import is_diagnostics_key

        keys += [k[len(PREFIX):] for k in res.metrics if is_diagnostics_key(k)]
    metrics = _select(res.metrics, keys, extras=_SETTINGS["extra_metrics"], prefixed=True)
    weights = None
    if res.weights is not None:
        weights = _in_verl_dtype(res.weights, old_log_prob, rollout_log_prob, response_mask)
    return weights, res.response_mask, metrics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
) -> Dict[str, Any]:
    """verl's ``compute_offpolicy_metrics``: KL, k3 KL, perplexities, log-ppl differences, ppl ratio, chi^2 (token
    and sequence) as unprefixed floats; ``rollout_log_prob=None``: ``training_ppl`` and ``training_log_ppl`` only."""
    return _offpolicy(old_log_prob, rollout_log_prob, response_mask, _OLD_NAMES)


def _offpolicy(old_log_prob, rollout_log_prob, response_mask, names) -> Dict[str, Any]:
    only_training = rollout_log_prob is None
    if only_training:  # old_log_prob alone: the pair in an error is that one argument
        names = dict(names, **{"log_prob / rollout_log_prob": names["log_prob"]})
    cfg = RolloutCorrectionConfig.disabled()
    res = _correct(old_log_prob, old_log_prob if only_training else rollout_log_prob, response_mask, cfg,
                   names=names)
    keys = OFFPOLICY_KEYS[:2] if only_training else OFFPOLICY_KEYS
    return _select(res.metrics, keys, extras=False, prefixed=False)


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> Dict[str, float]:
    """verl's ``compute_rollout_corr_metrics_from_logprobs``: :func:`compute_offpolicy_metrics` under
    ``rollout_corr/``."""
    return {PREFIX + k: v for k, v in _offpolicy(log_prob, rollout_log_prob, response_mask, {}).items()}


def compute_rollout_correction_and_add_to_batch(
    batch: "DataProto", rollout_corr_config: "RolloutCorrectionConfig"
) -> Tuple["DataProto", Dict]:
    """verl's ``compute_rollout_correction_and_add_to_batch``: reads ``old_log_probs``, ``rollout_log_probs`` and
    ``response_mask`` from ``batch``, writes the RS mask back to ``response_mask`` and adds ``rollout_is_weights``
    when an IS level is set. ``rollout_corr_config``: verl's config (read as verl reads it) or this package's."""
    cfg = rollout_correction_config(rollout_corr_config)
    diagnostics, bad_versions = _batch_diagnostics(batch)
    dp, _ = _groups(cfg)
    if bad_versions is not None and (dp is None or dist.get_world_size(dp) == 1):
        raise ValueError(bad_versions)  # no other rank to wait in a reduce: named here, on any device
    try:
        weights, mask, metrics = _correct_verl(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                                               batch.batch["response_mask"], cfg, diagnostics, _BATCH_NAMES)
    except ValueError as exc:
        # under DP a bad min_global_steps row went in as version -1, refused by the diagnostics' check on every rank
        # of the reduce (a local raise would leave the others waiting in it; on CUDA that check is a device assert):
        # named here as the caller wrote it
        if bad_versions is not None and "negative" in str(exc):
            raise ValueError(bad_versions) from exc
        raise
    batch.batch["response_mask"] = mask
    if weights is not None:
        proto = _data_proto("compute_rollout_correction_and_add_to_batch")
        batch = batch.union(proto.from_dict(tensors={"rollout_is_weights": weights}))
    return batch, metrics


def _batch_diagnostics(batch):
    """(the configured diagnostics with the batch's policy versions (see :func:`configure`) or None, the message
    naming a row of ``min_global_steps`` that is not an integer or None)."""
    spec = _SETTINGS["diagnostics"]
    if spec is None:
        return spec, None

    versions, bad = None, None
    if "rollout_versions" in batch.batch.keys():
        versions = batch.batch["rollout_versions"]
    elif getattr(batch, "non_tensor_batch", None) is not None and "min_global_steps" in batch.non_tensor_batch:
        versions, bad = _integer_versions(batch.non_tensor_batch["min_global_steps"],
                                          batch.batch["old_log_probs"].device, batch.batch["response_mask"])
    if versions is None:
        return spec, None
    current = _SETTINGS["current_version"]
    where = "configure(current_version=...)"
    if current is None:
        current, where = (batch.meta_info or {}).get("global_steps"), "batch.meta_info['global_steps']"
    if current is None:
        raise ValueError("the batch carries policy versions but no current version: configure(current_version=...) "
                         "or batch.meta_info['global_steps']")
    if isinstance(current, torch.Tensor) and current.numel() == 1 and not current.is_floating_point():
        current = current.item()
    if isinstance(current, bool) or not isinstance(current, numbers.Integral):  # 5.7 is not a step to truncate
        raise TypeError(f"{where} must be an integer (the trainer's policy version), got {current!r}")
    return dataclasses.replace(spec, versions=versions, current_version=int(current)), bad


def _integer_versions(values, device, response_mask) -> Tuple[torch.Tensor, Optional[str]]:
    """verl's fully-async ``non_tensor_batch["min_global_steps"]`` (one integer per row) as an int64 tensor, and a
    message naming the first row with a response token that is not an integer (None, NaN, 4.7: never cast, 4.7
    would become step 4), or None. Such a row is -1 in the tensor: without DP the caller raises the message at once;
    under DP the diagnostics refuse that version at a response token on every rank of their reduce (this row's own
    check would leave the other ranks waiting there; on CPU a ValueError the caller renames, on CUDA a device
    assert). A row without response tokens is never read, as any masked value."""
    import numpy as np

    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        return torch.as_tensor(arr.astype("int64"), device=device), None
    flat = arr.reshape(-1).tolist()  # Python numbers (an object array's items as they are)
    bad = [i for i, v in enumerate(flat)
           if isinstance(v, bool) or not (isinstance(v, numbers.Integral)
                                          or (isinstance(v, float) and math.isfinite(v) and v == int(v)))
           or not -2 ** 63 <= int(v) < 2 ** 63]
    msg = None
    # a layout that is not one value per row is refused later by name, with the versions' shape: no message of rows
    if bad and arr.shape == (response_mask.shape[0] if response_mask.dim() else -1,):
        rows = (response_mask != 0).reshape(len(flat), -1).any(-1).tolist()
        read = [i for i in bad if rows[i]]
        if read:
            msg = (f"non_tensor_batch['min_global_steps'] must hold one integer policy version per row, got "
                   f"{flat[read[0]]!r} at row {read[0]} ({len(read)} such rows with response tokens)")
    for i in bad:
        flat[i] = -1
    return torch.as_tensor(np.array([int(v) for v in flat], dtype=np.int64).reshape(arr.shape), device=device), msg


def apply_bypass_mode(
    batch: "DataProto",
    rollout_corr_config: Optional["RolloutCorrectionConfig"] = None,
    policy_loss_config: "PolicyLossConfig" = None,
) -> None:
    """verl's ``apply_bypass_mode``: ``old_log_probs`` := ``rollout_log_probs`` in ``batch``, and the actor's
    ``policy_loss_config`` gets ``rollout_correction`` and ``loss_mode = "bypass_mode"`` (which, after
    :func:`register_policy_losses`, is this package's :func:`compute_policy_loss_bypass_mode`)."""
    if "rollout_log_probs" not in batch.batch:
        raise ValueError("bypass_mode=True requires rollout_log_probs in the batch (configure the rollout worker "
                         "with calculate_log_probs=true)")
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    updates = (("rollout_correction", rollout_corr_config), ("loss_mode", "bypass_mode"))
    try:
        from omegaconf import DictConfig, open_dict  # type: ignore
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        DictConfig = None
    if DictConfig is not None and isinstance(policy_loss_config, DictConfig):
        with open_dict(policy_loss_config):
            for key, value in updates:
                policy_loss_config[key] = value
    elif isinstance(policy_loss_config, MutableMapping):
        for key, value in updates:
            policy_loss_config[key] = value
    else:  # an attribute config (verl's BaseConfig dataclasses allow this only for their mutable fields)
        for key, value in updates:
            setattr(policy_loss_config, key, value)


# ------------------------------------------------------------------------------------------------- core_algos

_PPO_KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
_PG_KEYS = ("actor/ppo_kl",)


def _loss_floats(metrics: Dict[str, torch.Tensor], keys: Sequence[str]) -> Dict[str, float]:
    if "actor/opsm_masked_frac" in metrics and "actor/opsm_masked_frac" not in keys:  # config.opsm_delta (ours)
        keys = list(keys) + ["actor/opsm_masked_frac"]
    floats = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
    return dict(zip(keys, floats))


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl's ``compute_policy_loss_vanilla`` (registry name ``"vanilla"``): PPO clip (asymmetric, dual clip),
    times ``rollout_is_weights`` when given, aggregated with ``config.global_batch_info``. ``config``: verl's actor
    config (or a DictConfig / dict / :class:`PolicyLossConfig`). Metrics: ``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` as floats."""
    cfg = policy_loss_config(config)
    response_mask, frac = _replayed_mask(response_mask, old_log_prob, log_prob)
    loss, metrics = _losses.compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                                        loss_agg_mode, cfg, rollout_is_weights)
    return loss, _with_replay_metric(_loss_floats(metrics, _PPO_KEYS), frac)


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl's ``compute_policy_loss_reinforce``: -A log pi (times ``rollout_is_weights``), no clipping. Metrics:
    ``actor/ppo_kl`` (mean of rollout_log_prob - log_prob) as a float."""
    cfg = policy_loss_config(config)
    response_mask, frac = _replayed_mask(response_mask, rollout_log_prob, log_prob)
    loss, metrics = _losses.compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                                          loss_agg_mode, cfg, rollout_is_weights)
    return loss, _with_replay_metric(_loss_floats(metrics, _PG_KEYS), frac)


def _bypass_rollout_correction(config: Any) -> Any:
    """Where verl's bypass loss finds its rollout-correction config: ``config.policy_loss.rollout_correction``
    (this package's :class:`PolicyLossConfig`: its ``rollout_correction``)."""
    if isinstance(config, PolicyLossConfig):
        return config.rollout_correction
    policy_loss = config.get("policy_loss") if isinstance(config, Mapping) else getattr(config, "policy_loss", None)
    return _get(policy_loss, "rollout_correction", None)


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl's ``compute_policy_loss_bypass_mode`` (registry name ``"bypass_mode"``): ``old_log_prob`` is the rollout
    policy's; the rollout correction of pi_theta (detached) vs pi_rollout runs here (config:
    ``config.policy_loss.rollout_correction``), its mask replaces ``response_mask``, then REINFORCE with the IS
    weights (``loss_type="reinforce"``) or PPO clip without them (``"ppo_clip"``). ``rollout_is_weights`` is
    ignored, as in verl. Metrics: the loss's, then verl's ``rollout_corr/*`` keys, as floats."""
    if config is None:
        raise ValueError("compute_policy_loss_bypass_mode needs config (the actor config carrying "
                         "policy_loss.rollout_correction)")
    source = _bypass_rollout_correction(config)
    if source is None:
        raise ValueError("rollout_correction config not found in config.policy_loss; with loss_mode='bypass_mode' "
                         "the actor config must carry policy_loss.rollout_correction (apply_bypass_mode sets it)")
    rc = rollout_correction_config(source)
    cfg = dataclasses.replace(policy_loss_config(config), rollout_correction=rc)
    fn = "compute_policy_loss_bypass_mode"
    _losses.check_policy_inputs(old_log_prob, log_prob, advantages, response_mask)
    _losses.check_loss_agg_mode(loss_agg_mode)
    _losses.refuse_grad(fn, old_log_prob=old_log_prob)  # by verl's name for it (the step's: rollout_log_prob)
    dp, seq = _groups(rc)
    response_mask, frac = _replayed_mask(response_mask, log_prob, old_log_prob)
    # the bypass flow whatever rc.bypass_mode says: verl's bypass loss reads only the correction's fields
    step = _losses.policy_step(cfg, None, log_prob, advantages, response_mask, loss_agg_mode,
                               rollout_log_prob=old_log_prob, dp_group=dp, seq_group=seq,
                               nonfinite=_SETTINGS["nonfinite"], flow="bypass", rows_grad=False, fn=fn)
    corr = dict(step.correction_metrics)
    if frac is not None:
        corr[PREFIX + "sampling_out_of_support_fraction"] = frac
    keys = _is_keys(rc) + _rs_keys(rc) + list(OFFPOLICY_KEYS)
    return step.loss, _select(corr, keys, extras=_SETTINGS["extra_metrics"], prefixed=True, head=step.loss_metrics)


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c=3.0,
    loss_agg_mode: str = "token-mean",
):
    """verl's deprecated ``compute_policy_loss``: PPO clip with explicit clip ranges, returning the 4-tuple
    ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` of tensors (no global normalisers). Emits a
    ``FutureWarning`` like verl's; prefer :func:`compute_policy_loss_vanilla`."""
    warnings.warn("rollout_corr_ext.verl.compute_policy_loss is deprecated (as in verl); use "
                  "compute_policy_loss_vanilla", FutureWarning, stacklevel=2)
    if cliprange is None and (cliprange_low is None or cliprange_high is None):
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    base = cliprange if cliprange is not None else cliprange_low
    cfg = PolicyLossConfig(clip_ratio=base, clip_ratio_low=cliprange_low, clip_ratio_high=cliprange_high,
                           clip_ratio_c=clip_ratio_c)
    response_mask, _ = _replayed_mask(response_mask, old_log_prob, log_prob)
    loss, metrics = _losses.compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                                        loss_agg_mode, cfg, None)
    return loss, metrics["actor/pg_clipfrac"], metrics["actor/ppo_kl"], metrics["actor/pg_clipfrac_lower"]


# ------------------------------------------------------------------------------------------------- sampling replay

#: verl's ``rollout.logprobs_mode`` values whose rollout log-probs are those of the distribution the engine drew from
_PROCESSED = ("processed_logprobs",)


def _require_processed_logprobs(rollout, sp: SamplingParams, truncates: bool) -> None:
    """Refuse a vLLM ``logprobs_mode`` whose log-probs are not those of the distribution drawn from (``sp``)."""
    mode = _get(rollout, "logprobs_mode", "processed_logprobs")  # an absent key: verl's default
    where = "rollout.logprobs_mode"
    engine_kwargs = vllm_engine_kwargs(rollout)
    if "logprobs_mode" in engine_kwargs:  # verl spreads engine_kwargs.vllm after its own logprobs_mode: this one wins
        mode, where = engine_kwargs["logprobs_mode"], "rollout.engine_kwargs.vllm.logprobs_mode"
    if mode is None:  # verl then passes nothing to the engine, which keeps its own default: vLLM's raw_logprobs
        mode = "None (the engine's default, vLLM's raw_logprobs)"
    if mode not in _PROCESSED:
        # vLLM's modes: raw_logprobs (of the raw logits: before temperature and truncation), raw_logits /
        # processed_logits (logits, not log-probs)
        what = "logits, not log-probs" if str(mode).endswith("_logits") else "the log-probs of its raw logits"
        drawn = (f"the truncated distribution (top_k={sp.top_k}, top_p={sp.top_p}, min_p={sp.min_p})" if truncates
                 else f"softmax(logits / {sp.temperature})"
                 + (" (vLLM raises a temperature below 0.01 to 0.01)"
                    if float(_get(rollout, "temperature", 1.0)) < VLLM_MIN_TEMPERATURE else ""))
        fix = (" (verl's default)" if where == "rollout.logprobs_mode"
               else " or leave it out (rollout.logprobs_mode then applies)")
        raise ValueError(f"{where}={mode!r}: the engine reports {what}, but draws from {drawn}, so "
                         f"rollout_log_probs are not the sampling log-probabilities and the trainer's log-probs would "
                         f"be compared with those of another distribution. Set {where}=processed_logprobs{fix}")


def sampling_params(config: Any, *, temperature_applied: bool = True) -> Optional[SamplingParams]:
    """The :class:`rollout_corr_ext.SamplingParams` that replays what verl's rollout engine sampled with, from verl's
    config: the trainer config (``actor_rollout_ref.rollout`` is read), the ``actor_rollout_ref`` config, or the
    rollout config itself (a dataclass, ``DictConfig`` or dict). Fields read: ``temperature``, ``top_k`` (-1 / 0:
    off), ``top_p``, ``min_p`` (refused unless 0: verl passes none to its engine), ``name`` (the engine),
    ``logprobs_mode`` and, for vLLM, ``engine_kwargs.vllm`` (its ``logprobs_mode`` overrides the rollout's, as in
    verl's server; lossy speculative decoding and custom logits processors are refused:
    :meth:`SamplingParams.from_verl`). ``None`` when there is nothing to replay: nothing truncates (top-k off,
    top_p = 1) and the replay's temperature is 1.

    ``temperature_applied`` (default True): verl's actor divides the logits by the rollout temperature before it
    computes log-probs, so the replay runs at temperature 1 on those logits, or at the engine's temperature over
    the configured one where the engine sampled at another (vLLM raises a temperature below 0.01 to 0.01:
    configured 0.005, replayed at 2 on logits / 0.005, :func:`rollout_corr_ext.sampling.engine_temperature`);
    False: the logits passed to :func:`logprobs_from_logits` are the raw ones and the replay divides them by the
    engine's temperature.

    The engine (``name``): a truncation is replayed for vLLM only (SGLang reports the log-probs of its untruncated
    distribution, and another engine's rules are not known here: :meth:`SamplingParams.from_verl` refuses both).
    Raises ``ValueError``, when vLLM drew from another distribution than the softmax of the raw logits (a
    truncation, or a temperature other than 1, replayed or not), if its log-probs are not those of the
    distribution it drew from (verl's ``logprobs_mode`` other than ``processed_logprobs``, e.g. vLLM's
    ``raw_logprobs``, or None, which leaves vLLM at its default ``raw_logprobs``; an absent key is verl's default,
    ``processed_logprobs``): the rollout log-probs are then of the raw logits, and the trainer's log-probs of the
    distribution drawn from (replayed, or the actor's own division by the temperature) would be compared with
    those of another distribution."""
    rollout = config
    for key in ("actor_rollout_ref", "rollout"):
        inner = _get(rollout, key, None)
        if inner is not None:
            rollout = inner
    sp = SamplingParams.from_verl(rollout)  # at the engine's temperature (vLLM's floor of 0.01 applied)
    top_k, top_p = sp.top_k, sp.top_p
    # what is left to apply to verl's actor logits, already divided by the configured temperature: 1, or the
    # engine's over the configured one where the engine sampled at another (vLLM at T = 0.005 draws at 0.01: 2)
    replay_t = sp.temperature / float(_get(rollout, "temperature", 1.0)) if temperature_applied else sp.temperature
    truncates = not (top_k is None and top_p == 1.0 and sp.min_p == 0.0)
    # vLLM drew from another distribution than softmax(raw logits): its log-probs must be those of the distribution
    # drawn from, also where the actor's own division by the temperature leaves nothing to replay. verl forwards
    # logprobs_mode to vLLM only (SGLang reports log softmax(logits / T) whatever it says; from_verl refused any
    # other engine's truncation)
    if engine_family(_get(rollout, "name", None)) == "vllm" and (truncates or sp.temperature != 1.0):
        _require_processed_logprobs(rollout, sp, truncates)
    if not truncates and replay_t == 1.0:
        return None
    return dataclasses.replace(sp, temperature=replay_t)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's ``verl.utils.torch_functional.logprobs_from_logits`` (same parameters; ``inplace_backward`` is
    accepted and has no effect: the backward here never writes into the logits): the log-probs of ``labels`` under
    ``softmax(logits)`` (the whole vocabulary on this rank), or, with :func:`configure` ``(sampling=...)``, under
    the truncated, renormalised distribution the engine drew from (-inf for a label outside the kept set; the
    losses and the rollout correction here then leave that token out). verl's engines import it by name, so patch
    their module: e.g. ``verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits``."""
    vocab = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() else None
    with _callers_names("logprobs_from_logits", {"target": "labels"}):
        return _scored(logits, labels, None, vocab)


# The argument names in the errors of the functions the drop-ins call (``target``, ``hidden``, ``weight``; not
# "hidden states", "the hidden-size", ``x.weight``), and the replay's prefix naming the function called.
_OUR_ARGS = re.compile(r"(?<![\w.])(target|hidden|weight)(?![\w-]| states)")
_OUR_PREFIX = re.compile(r"^(sampled_log_probs|sampled_linear_log_probs|linear_log_probs): ")


@contextlib.contextmanager
def _callers_names(fn: str, names: Dict[str, str], args: "re.Pattern" = _OUR_ARGS) -> Iterator[None]:
    """A drop-in's errors in its caller's terms: a TypeError / ValueError / RuntimeError raised inside names the
    drop-in ``fn`` and its arguments (``names``: ours -> the caller's, e.g. ``target`` -> ``labels``; ``args``
    finds our names in a message)."""
    try:
        yield
    except (TypeError, ValueError, RuntimeError) as exc:
        msg = _OUR_PREFIX.sub(f"{fn}: ", args.sub(lambda m: names.get(m.group(1), m.group(1)), str(exc)))
        if msg == str(exc):
            raise
        try:
            renamed = type(exc)(msg)
        except Exception:  # noqa: BLE001 - an error type that takes other arguments: raised as it is
            raise exc from None
        raise renamed.with_traceback(exc.__traceback__) from None


def _scored(logits, labels, group, vocab):
    """The two drop-ins' log-probs: plain, or replayed under the configured sampling (one shard of ``group``)."""
    from . import logprobs as _lp

    sampling = _SETTINGS["sampling"]
    if sampling is None:
        return _lp.vocab_parallel_log_probs(logits, labels, group, vocab_size=vocab)
    from .sampling import sampled_log_probs

    return sampled_log_probs(logits, labels, sampling, group, vocab_size=vocab).log_prob


def vocab_parallel_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's ``verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits`` (same parameters), what
    verl's megatron engine scores with: the log-probs of ``labels`` (global ids) from this rank's vocab shard
    ``[..., V / tp]`` over megatron-core's tensor-parallel group (``parallel_state``; not initialized: the logits
    hold the whole vocabulary), fp32 (fp64 for fp64 logits); with :func:`configure` ``(sampling=...)``, under the
    truncated, renormalised distribution the engine drew from, exactly under tensor parallelism (-inf outside the
    kept set), as :func:`logprobs_from_logits`. A label of -100 (megatron's padding label, which verl's engine
    does not pass) gives 0, where megatron-core's cross entropy gives -logsumexp. The engine imports it by name, so
    patch its module: ``verl.workers.engine.megatron.transformer_impl.vocab_parallel_log_probs_from_logits``."""
    group = None
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # no megatron-core: no tensor parallelism to follow
        ps = None
    if ps is not None and ps.model_parallel_is_initialized():
        group = ps.get_tensor_model_parallel_group()
    with _callers_names("vocab_parallel_log_probs_from_logits", {"target": "labels"}):
        return _scored(logits, labels, group, None)  # vocab: every shard's columns (the layout's default)


def _linear_scored(hidden, weight, labels, temperature, group):
    """The fused drop-ins' (log-prob, entropy) of ``labels`` under ``softmax(hidden @ weight.T / temperature)``
    (``weight``: this rank's vocab shard of ``group``), or under the configured replay of it, without the logits."""
    from . import linear as _linear

    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    sampling = _SETTINGS["sampling"]
    if sampling is None:
        return _linear.linear_log_probs(hidden, weight, labels, group, temperature=float(temperature),
                                        return_entropy=True)
    from .sampling import sampled_linear_log_probs

    # verl's fused kernels divide the logits by the actor's temperature themselves; the configured replay is of
    # those logits (sampling_params' temperature is what is left to apply: 1, or the engine's over the actor's)
    if isinstance(sampling.temperature, torch.Tensor):
        raise ValueError("configure(sampling=...): the fused drop-ins take one temperature, not a per-row tensor")
    replay = dataclasses.replace(sampling, temperature=float(temperature) * float(sampling.temperature))
    out = sampled_linear_log_probs(hidden, weight, labels, replay, group)
    return out.log_prob, out.entropy


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (same parameters; its Triton kernel, which
    ``use_fused_kernels=True`` with the triton backend and verl's megatron engine run): ``(log_probs, entropy)``, each
    ``[N]`` and fp32 (fp64 for fp64 inputs), of ``labels`` (global ids) under ``softmax(hidden @ weight.T /
    temperature)`` over ``dist_process_group``'s vocab shards (``weight``: this rank's, ``[V / tp, H]``), without the
    logits tensor (:func:`rollout_corr_ext.linear_log_probs`); differentiable in ``hidden`` and ``weight``, both
    outputs; ``hidden`` ``[..., H]`` and ``labels`` are flattened alike. With :func:`configure` ``(sampling=...)``, of
    the truncated, renormalised distribution the engine drew from (:func:`rollout_corr_ext.sampled_linear_log_probs`:
    -inf outside the kept set, exactly under tensor parallelism, and the entropy over the kept set). ``reduction``:
    "none" only (what verl passes). Patch where it is imported:
    ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (the FSDP engine's models import it when called),
    ``verl.models.mcore.model_forward_fused.linear_cross_entropy`` and
    ``verl.models.mcore.model_forward_1f1b_overlap.linear_cross_entropy`` (the megatron engine)."""
    if reduction != "none":
        raise ValueError(f"reduction must be 'none' (per-token log-probs and entropy, what verl passes), got "
                         f"{reduction!r}")
    # as verl's kernel: both flattened, row i of hidden scored against labels' element i (its megatron engine
    # passes hidden [s, b, H] with labels [b, s], b = 1)
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1 and hidden.shape[-1] > 0 and \
            isinstance(labels, torch.Tensor):
        hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        if labels.shape[0] != hidden.shape[0]:
            raise ValueError(f"labels must hold one id per row of hidden (both are flattened), got "
                             f"{labels.shape[0]} ids for {hidden.shape[0]} rows")
    with _callers_names("linear_cross_entropy", {"target": "labels"}):
        return _linear_scored(hidden, weight, labels, temperature, dist_process_group)


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (same constructor and ``forward``; what
    ``use_fused_kernels=True`` with the torch backend runs): ``forward(hidden_states, vocab_weights, input_ids,
    temperature)`` gives ``(log_probs, entropy)`` in ``input_ids``' shape, log-probs fp32 and the entropy in the
    hidden states' dtype as verl's, from ``softmax(hidden_states @ vocab_weights.T / temperature)`` without the
    logits tensor (``input_ids``: int64 or int32, as given); differentiable in both inputs, both outputs. With
    :func:`configure` ``(sampling=...)``, of the replayed distribution, as :func:`linear_cross_entropy`.
    ``chunk_size`` and ``impl_backend`` ("torch" or "liger") are checked and kept as verl's are; the computation is
    this package's either way. verl's models import the class when called: patch
    ``verl.utils.experimental.torch_functional.FusedLinearForPPO``."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"impl_backend must be 'torch' or 'liger' (verl's FusedLinearForPPO backends), got "
                             f"{impl_backend!r}")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be a 2-D or 3-D tensor, got "
                             f"{tuple(getattr(hidden_states, 'shape', ())) or type(hidden_states).__name__}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(f"input_ids must have hidden_states' shape without its last dimension, "
                             f"{tuple(hidden_states.shape[:-1])}, got {tuple(getattr(input_ids, 'shape', ()))}")
        # the ids as given (int64 or int32; a float or bool tensor is refused, as verl's gather refuses it)
        with _callers_names("FusedLinearForPPO", {"target": "input_ids", "hidden": "hidden_states",
                                                  "weight": "vocab_weights"}):
            log_prob, entropy = _linear_scored(hidden_states, vocab_weights, input_ids, temperature, None)
        return log_prob.float(), entropy.to(hidden_states.dtype)


# ------------------------------------------------------------------------------------------------- registry

def _verl_loss(name: str, default_mode: str = "token-mean") -> Callable:
    """verl's ``compute_policy_loss_<name>`` (registry name ``name``) over :mod:`rollout_corr_ext.losses`'s fused
    loss: same signature (``default_mode``: verl's default ``loss_agg_mode``), loss tensor and metrics as floats
    (docs/policy_losses.md)."""
    ours = getattr(_losses, "compute_policy_loss_" + name)

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=default_mode, config=None,
                rollout_is_weights=None):
        cfg = policy_loss_config(config)
        response_mask, frac = _replayed_mask(response_mask, old_log_prob, log_prob)
        loss, metrics = ours(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, cfg,
                             rollout_is_weights)
        return loss, _with_replay_metric(_loss_floats(metrics, tuple(metrics)) if metrics else {}, frac)

    loss_fn.__name__ = loss_fn.__qualname__ = "compute_policy_loss_" + name
    loss_fn.__doc__ = f"verl's ``compute_policy_loss_{name}`` on the fused kernels: see " \
                      f":func:`rollout_corr_ext.losses.compute_policy_loss_{name}`."
    return loss_fn


compute_policy_loss_dppo_tv = _verl_loss("dppo_tv")
compute_policy_loss_dppo_kl = _verl_loss("dppo_kl")
compute_policy_loss_gspo = _verl_loss("gspo", "seq-mean-token-mean")
compute_policy_loss_sapo = _verl_loss("sapo", "seq-mean-token-mean")
compute_policy_loss_gpg = _verl_loss("gpg")
compute_policy_loss_clip_cov = _verl_loss("clip_cov")
compute_policy_loss_kl_cov = _verl_loss("kl_cov")
compute_policy_loss_geo_mean = _verl_loss("geo_mean")
compute_policy_loss_dro = _verl_loss("dro")
compute_policy_loss_cispo = _verl_loss("cispo")


def calculate_debug_metrics(data: Any) -> dict:
    """verl's ``verl.utils.debug.metrics.calculate_debug_metrics(data)``: rollout-vs-actor probability metrics of a
    ``DataProto`` (``rollout_log_probs``, ``old_log_probs``, the mask from ``response_mask``, else the response
    part of ``attention_mask``, else every token), as Python floats under verl's keys; exact over the configured
    ``dp_group`` (:func:`configure`) instead of per rank (:func:`rollout_corr_ext.observability.debug_metrics`)."""
    from .observability import debug_metrics

    _data_proto("calculate_debug_metrics")
    batch = data.batch
    rollout, actor = batch["rollout_log_probs"], batch["old_log_probs"]
    if "response_mask" in batch.keys():
        mask = batch["response_mask"]
    elif "attention_mask" in batch.keys():
        mask = batch["attention_mask"][:, -batch["responses"].size(1):]
    else:
        mask = torch.ones_like(rollout)
    metrics = debug_metrics(actor, rollout, mask, dp_group=_SETTINGS["dp_group"])
    values = torch.stack(list(metrics.values())).tolist()
    out = dict(zip(metrics.keys(), values))
    out["training/rollout_probs_diff_valid"] = int(out["training/rollout_probs_diff_valid"])
    return out


#: verl registry name -> this module's loss.
POLICY_LOSSES: Dict[str, Callable] = {
    "vanilla": compute_policy_loss_vanilla,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "dro": compute_policy_loss_dro,
    "cispo": compute_policy_loss_cispo,
    "bypass_mode": compute_policy_loss_bypass_mode,
}


def register_policy_losses(replace: bool = True, prefix: str = "rollout_corr_") -> Dict[str, Optional[Callable]]:
    """Register this package's policy losses in verl's ``POLICY_LOSS_REGISTRY`` (``verl.trainer.ppo.core_algos``).

    All twelve of verl 0.9.1's losses (:data:`POLICY_LOSSES`). ``replace=True`` (default): under verl's own names
    (``"vanilla"``, ``"gspo"``, ..., ``"bypass_mode"``), so verl's actors (and ``apply_bypass_mode``) use them with
    no config change. ``replace=False``: under ``prefix + name`` (``"rollout_corr_vanilla"``, ...) next to verl's,
    selected with
    ``actor.policy_loss.loss_mode``. Returns the entries replaced (None where a name was free), for
    :func:`restore_policy_losses`. Raises ImportError when verl cannot be imported.
    """
    core_algos = _require_verl("register_policy_losses", "verl.trainer.ppo.core_algos")
    names = {(name if replace else prefix + name): fn for name, fn in POLICY_LOSSES.items()}
    previous = {name: core_algos.POLICY_LOSS_REGISTRY.get(name) for name in names}
    for name, fn in names.items():
        core_algos.register_policy_loss(name)(fn)
    return previous


def restore_policy_losses(previous: Mapping[str, Optional[Callable]]) -> None:
    """Undo :func:`register_policy_losses`: put back the entries it returned (removing names that were free)."""
    core_algos = _require_verl("restore_policy_losses", "verl.trainer.ppo.core_algos")
    for name, fn in previous.items():
        if fn is None:
            core_algos.POLICY_LOSS_REGISTRY.pop(name, None)
        else:
            core_algos.POLICY_LOSS_REGISTRY[name] = fn
