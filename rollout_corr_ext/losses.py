"""Policy losses and loss aggregation (docs/megatron.md, "Loss modes"), in the calling convention of verl 0.9.1.

Every policy loss has the signature of verl's ``compute_policy_loss_vanilla``::

    loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                       rollout_is_weights=None)

with ``[B, T]`` inputs, a scalar ``loss`` and ``metrics`` a dict of **0-dim tensors** (no host sync; verl calls
``.item()`` on each). The per-token work of the PPO family (ratio, clip, dual clip, IS weight, clip
indicators, the per-row partials every aggregation mode needs) is one fused op,
:func:`rollout_corr_ext.ops.policy_loss_rows` (contract: :func:`rollout_corr_ext.fallback.policy_loss_rows`,
which also is its fallback); aggregation then only touches ``[B]`` vectors.

Semantics reference: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``agg_loss``,
``compute_policy_loss_vanilla``, ``compute_policy_loss_reinforce``, ``compute_policy_loss_bypass_mode``) and
Megatron-LM RL ``calculate_grpo_loss`` (``megatron/rl/rl_utils.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, NamedTuple, Optional, Tuple, Union

import torch

from . import _checks, _layout as LY, ops
from ._checks import check_mask, refuse_where, safe_div, safe_div_grad
from .logprobs import all_gather, as_real

if TYPE_CHECKING:  # pragma: no cover
    from .config import RolloutCorrectionConfig

#: The policy losses (verl 0.9.1's registry names; docs/policy_losses.md).
POLICY_LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                     "cispo", "bypass_mode")

#: The aggregation modes of verl 0.9.1 ``agg_loss``.
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Number = Union[int, float, torch.Tensor]


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def _finite_real(name: str, value, minimum: Optional[float] = None) -> float:
    """A finite real-number argument (``as_real``'s types), >= ``minimum`` when given; NaN and inf are refused (a
    run-time assert while torch.compile traces: :func:`_checks.assert_traced_number`)."""
    v = as_real(name, value)
    at_least = "" if minimum is None else f" and >= {minimum}"
    if torch.compiler.is_compiling():
        _checks.assert_traced_number(v, lambda t: torch.isfinite(t) & (t >= (-math.inf if minimum is None else minimum)),
                                     f"{name} must be finite{at_least}")
        return v
    if not math.isfinite(v) or (minimum is not None and not v >= minimum):
        raise ValueError(f"{name} must be finite{at_least}, got {value!r}")
    return v


def _check_dp_size(dp_size) -> None:
    """verl's data-parallel size, a multiplier of the loss: an int in [1, 2**63)."""
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or not 1 <= dp_size < 2 ** 63:
        raise ValueError(f"dp_size must be an int in [1, 2**63), got {dp_size!r}")


def _positive_or_none(name: str, value) -> None:
    """A global normaliser: None, a finite real number > 0, or a one-element real tensor (verl passes 0-d tensors).

    A CPU tensor is read here; on an accelerator the check is an asynchronous device assert (no host sync).
    A negative normaliser would flip the loss sign, 0 would zero the loss and its gradient, NaN/inf poison it.
    """
    if value is None:
        return
    msg = f"{name} must be a finite number > 0 (or None)"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{msg}: a tensor must be a one-element real tensor, got dtype {value.dtype} and "
                             f"shape {tuple(value.shape)}")
        if value.device.type == "cpu" and not torch.compiler.is_compiling():  # traced: the assert below
            v = value.detach().reshape(()).item()
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{msg}, got tensor({v})")
        else:
            value = value.detach().reshape(())
            torch._assert_async(torch.isfinite(value) & (value > 0), f"{msg}, got a tensor outside that range")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{msg}, got {type(value).__name__} {value!r}")
    if torch.compiler.is_compiling():
        _checks.assert_traced_number(value, lambda t: torch.isfinite(t) & (t > 0), msg)
        return
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{msg}, got {value!r}")


#: The global normalisers of :func:`agg_loss` (verl's ``global_batch_info`` keys).
_NORMALISERS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")

#: Field names of verl 0.9.1's actor configs (``ActorConfig`` and its FSDP / Megatron / VeOmni / TorchTitan
#: subclasses, and the keys of its actor YAML). ``PolicyLossConfig.from_dict`` ignores them in a plain dict.
VERL_ACTOR_FIELDS = frozenset((
    "calculate_entropy", "calculate_sum_pi_squared", "checkpoint", "clip_ratio", "clip_ratio_c", "clip_ratio_high",
    "clip_ratio_low", "data_loader_seed", "engine", "entropy_checkpointing", "entropy_coeff",
    "entropy_from_logits_chunk_size", "entropy_from_logits_with_chunking", "freeze_vision_tower", "fsdp_config",
    "global_batch_info", "grad_clip", "kl_loss_coef", "kl_loss_type", "loss_agg_mode", "loss_scale_factor",
    "megatron", "model_config", "optim", "pad_to_length", "policy_loss", "ppo_epochs",
    "ppo_infer_max_token_len_per_gpu", "ppo_infer_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
    "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_mini_batch_size", "profile", "profiler", "qat",
    "rollout_n", "shuffle", "strategy", "tau_neg", "tau_pos", "torchtitan", "ulysses_sequence_parallel_size",
    "use_dynamic_bsz", "use_fused_kernels", "use_kl_loss", "use_prefix_grouper", "use_remove_padding",
    "use_rollout_log_probs", "use_torch_compile", "veomni",
))


#: verl 0.9.1's defaults for a missing ``clip_ratio_c``: PPO's dual clip, DPPO's ratio truncation
DUAL_CLIP_C = 3.0
DPPO_RATIO_CAP = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """What verl's ``ActorConfig`` carries for the policy loss, validated when built.

    Args:
        clip_ratio: PPO epsilon, used for both sides unless ``clip_ratio_low`` / ``clip_ratio_high`` are set.
        clip_ratio_low, clip_ratio_high: asymmetric clip ("clip-higher"): r is clipped to [1 - low, 1 + high].
        clip_ratio_c: PPO's dual-clip bound c (> 1, checked when a PPO loss reads it, as verl asserts): for A < 0
            the loss is capped at -A c (arXiv:1912.09729); DPPO's truncation of the ratio at c (any c > 0); the
            other losses do not read it (any c > 0). None:
            the loss's own default, as verl's losses read a missing key: 3.0 for PPO's dual clip, 20.0 for
            ``dppo_tv`` / ``dppo_kl``.
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: verl's ``global_batch_info``, the global
            normalisers of :func:`agg_loss` (None: local micro-batch values; ``dp_size > 1`` needs the matching
            global count). Set them per step with :meth:`with_global_batch` (the config is immutable).
        rollout_correction: a :class:`~rollout_corr_ext.config.RolloutCorrectionConfig` for the bypass and
            decoupled flows (None: no rollout correction).
        loss_mode: the policy loss (verl's ``actor.policy_loss.loss_mode``): one of :data:`POLICY_LOSS_MODES`
            (docs/policy_losses.md). Read by :func:`compute_policy_loss` and the megatron / verl adapters.
        tau_pos, tau_neg: SAPO's gate temperatures (verl's ``actor.tau_pos`` / ``tau_neg``).
        dro_beta: DRO's quadratic log-ratio penalty (required for ``loss_mode="dro"``).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov's fraction of tokens and covariance bounds.
        kl_cov_ratio, ppo_kl_coef: KL-Cov's fraction of tokens and the coefficient of their |log-ratio| penalty.
        opsm_delta: DeepSeek-V3.2's off-policy sequence masking (:func:`off_policy_sequence_mask`) with threshold
            delta, applied by :func:`compute_policy_loss` before any loss (None: off).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = None
    dp_size: int = 1
    batch_num_tokens: Optional[Number] = None
    global_batch_size: Optional[Number] = None
    loss_scale_factor: Optional[Number] = None
    rollout_correction: Optional["RolloutCorrectionConfig"] = None
    loss_mode: str = "vanilla"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: Optional[float] = None
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    opsm_delta: Optional[float] = None

    def __post_init__(self):
        traced = torch.compiler.is_compiling()  # a config built while tracing: its numbers may be symbols

        def number(name, v, ok, ok_tensor, requirement):
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{name} must be {requirement}, got {v!r}")
            if traced:
                _checks.assert_traced_number(v, ok_tensor, f"{name} must be {requirement}")
                return
            if not ok(as_real(name, v)):  # as_real names an int past the float range
                raise ValueError(f"{name} must be {requirement}, got {v!r}")

        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, name)
            if v is None and name != "clip_ratio":
                continue
            number(name, v, lambda x: x >= 0 and math.isfinite(x), lambda t: torch.isfinite(t) & (t >= 0),
                   "a finite float >= 0")
        c = self.clip_ratio_c
        if c is not None:  # > 1 for PPO's dual clip: ratio_cap, where the loss is known
            number("clip_ratio_c", c, lambda x: x > 0.0, lambda t: t > 0.0, "> 0")
        _check_dp_size(self.dp_size)
        _positive_or_none("batch_num_tokens", self.batch_num_tokens)
        _positive_or_none("global_batch_size", self.global_batch_size)
        _positive_or_none("loss_scale_factor", self.loss_scale_factor)
        if self.loss_mode not in POLICY_LOSS_MODES:
            raise ValueError(f"loss_mode must be one of {POLICY_LOSS_MODES}, got {self.loss_mode!r}")
        positive = (lambda x: x > 0 and math.isfinite(x), lambda t: torch.isfinite(t) & (t > 0))
        for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio"):
            number(name, getattr(self, name), *positive, "a finite float > 0")
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"):
            number(name, getattr(self, name), math.isfinite, torch.isfinite, "a finite float")
        b = self.dro_beta
        if b is not None:
            number("dro_beta", b, *positive, "a finite float > 0 (or None)")
        d = self.opsm_delta
        if d is not None:
            number("opsm_delta", d, lambda x: x >= 0 and math.isfinite(x), lambda t: torch.isfinite(t) & (t >= 0),
                   "a finite float >= 0 (or None)")
        if self.loss_mode == "dro" and b is None:
            raise ValueError("loss_mode='dro' needs dro_beta (a finite float > 0)")
        rc = self.rollout_correction
        if rc is not None:
            from .config import RolloutCorrectionConfig

            if not isinstance(rc, RolloutCorrectionConfig):
                # verl's RolloutCorrectionConfig, an OmegaConf DictConfig or a dict: converted (validated) once here.
                try:
                    rc = RolloutCorrectionConfig.from_dict(rc)
                except TypeError:
                    raise TypeError(f"rollout_correction must be a RolloutCorrectionConfig or a mapping of its "
                                    f"fields, got {type(self.rollout_correction).__name__}") from None
                object.__setattr__(self, "rollout_correction", rc)

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def ratio_cap(self, kind: int) -> float:
        """``clip_ratio_c`` for the fused kind ``kind``, or, when None, that loss's default in verl 0.9.1
        (``config.get("clip_ratio_c", ...)``: 20.0 in ``compute_policy_loss_dppo_tv`` / ``_dppo_kl``, 3.0 in
        ``compute_policy_loss_vanilla``)."""
        dppo = kind in (LY.PG_KIND_DPPO_TV, LY.PG_KIND_DPPO_KL)
        c = self.clip_ratio_c
        if c is None:
            return DPPO_RATIO_CAP if dppo else DUAL_CLIP_C
        if kind == LY.PG_KIND_PPO_CLIP:  # PPO's dual clip: c > 1, as verl's compute_policy_loss_vanilla asserts;
            # DPPO caps at any c > 0, and the other kinds do not read c (verl's gspo, cispo, ... accept any)
            msg = "clip_ratio_c (the dual-clip bound c of PPO's loss) must be > 1.0"
            if torch.compiler.is_compiling():
                _checks.assert_traced_number(c, lambda t: t > 1.0, msg)
            elif not c > 1.0:
                raise ValueError(f"{msg}, got {c!r} (only PPO's dual clip needs c > 1; DPPO caps at any c > 0)")
        return float(c)

    @property
    def global_batch_info(self) -> Dict[str, Any]:
        """The keyword arguments of :func:`agg_loss` (verl's ``config.global_batch_info``)."""
        return dict(dp_size=self.dp_size, batch_num_tokens=self.batch_num_tokens,
                    global_batch_size=self.global_batch_size, loss_scale_factor=self.loss_scale_factor)

    @classmethod
    def from_dict(cls, data: Any) -> "PolicyLossConfig":
        """Build from a dict / OmegaConf ``DictConfig`` of these fields, or from verl's actor config.

        verl's ``ActorConfig`` (a dataclass with attribute access and ``.get``), its ``DictConfig`` form (Hydra
        ``_target_``) and a dict carrying verl's ``global_batch_info`` / ``policy_loss`` are read as verl reads them
        in its policy losses: ``clip_ratio``, ``clip_ratio_low`` / ``clip_ratio_high`` (None: ``clip_ratio``),
        ``clip_ratio_c`` (absent: the loss's own default, as in verl: see :meth:`ratio_cap`); the normalisers only
        from ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
        ``loss_scale_factor``; verl's trainer copies the top-level
        ``loss_scale_factor`` there); ``policy_loss.rollout_correction`` only when ``policy_loss.loss_mode`` is
        ``"bypass_mode"`` (the only loss of verl that reads it). Every other verl field is ignored.

        A plain dict of this class's fields is validated as the constructor does; verl's actor field names and
        ``_target_`` are ignored; any other key is a ``ValueError`` naming it (a typo must not fall back to a
        default silently).
        """
        from .config import VERL_ONLY_KEYS, config_items

        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        d, typed = config_items(data, "PolicyLossConfig.from_dict")
        names = {f.name for f in dataclasses.fields(cls)}
        out = {k: v for k, v in d.items() if k in names}
        verl_shaped = "_target_" in d or "global_batch_info" in d or "policy_loss" in d
        if verl_shaped:
            for k in _NORMALISERS:
                out.pop(k, None)
            info = d.get("global_batch_info")
            info = config_items(info, "global_batch_info")[0] if info is not None else {}
            unknown = sorted(set(info) - set(_NORMALISERS))
            if unknown:
                raise ValueError(f"global_batch_info: unknown key(s) {unknown}; allowed: {list(_NORMALISERS)}")
            out.update({k: v for k, v in info.items() if v is not None})
            policy_loss = d.get("policy_loss")
            if policy_loss is not None:
                pl = config_items(policy_loss, "policy_loss")[0]
                if "rollout_correction" not in out and pl.get("loss_mode", "vanilla") == "bypass_mode":
                    out["rollout_correction"] = pl.get("rollout_correction")
                for k in ("dro_beta", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"):
                    if pl.get(k) is not None:
                        out[k] = pl[k]
                if "ppo_kl_coef" in pl and pl.get("ppo_kl_coef") is None:
                    out["ppo_kl_coef"] = 1.0  # verl's kl_cov reads a None coefficient as 1.0 (not its default 0.1)
                # verl's registry name; under register_policy_losses(replace=False) it carries a prefix. A name we do
                # not know is verl's own choice of function (its registry picked the function being called).
                mode = pl.get("loss_mode")
                if isinstance(mode, str):
                    mode = mode[len("rollout_corr_"):] if mode.startswith("rollout_corr_") else mode
                    if mode in POLICY_LOSS_MODES:
                        out["loss_mode"] = mode
            for k in ("tau_pos", "tau_neg"):
                if out.get(k) is None:
                    out.pop(k, None)
            if out.get("clip_ratio_c") is None:
                out.pop("clip_ratio_c", None)
        if not (verl_shaped or typed):  # a typed config (a dataclass) has its own schema: extra fields are its own
            unknown = sorted(k for k in d if k not in names and k not in VERL_ONLY_KEYS and k not in VERL_ACTOR_FIELDS)
            if unknown:
                raise ValueError(f"unknown PolicyLossConfig field(s) {unknown}; allowed: {sorted(names)} (and "
                                 f"verl's actor config fields, which are ignored)")
        dp = out.get("dp_size")
        if isinstance(dp, numbers.Integral) and not isinstance(dp, bool):
            out["dp_size"] = int(dp)
        return cls(**out)

    def with_global_batch(self, **kwargs) -> "PolicyLossConfig":
        """A copy with new global normalisers (``dp_size``, ``batch_num_tokens``, ...); validated again."""
        unknown = set(kwargs) - {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}
        if unknown:
            raise TypeError(f"with_global_batch got unknown fields {sorted(unknown)}")
        return dataclasses.replace(self, **kwargs)


def as_policy_config(config) -> PolicyLossConfig:
    if config is None:
        return PolicyLossConfig()
    if isinstance(config, PolicyLossConfig):
        return config
    if isinstance(config, Mapping) or _is_dictconfig(config) or (
            dataclasses.is_dataclass(config) and not isinstance(config, type)):
        return PolicyLossConfig.from_dict(config)  # a dict of our fields, verl's ActorConfig, a DictConfig
    raise TypeError(f"config must be a PolicyLossConfig, a mapping of its fields, verl's actor config or None, got "
                    f"{type(config).__name__}")


def _is_dictconfig(obj) -> bool:
    try:
        from omegaconf import DictConfig  # type: ignore
    except ImportError:
        return False
    return isinstance(obj, DictConfig)


# ---------------------------------------------------------------------------------------------------------
# Input checks (named; inputs are never modified)
# ---------------------------------------------------------------------------------------------------------


def _check_float(name: str, t, ref: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the shape of log_prob {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but log_prob is on {ref.device}")


def _check_cu_seqlens(cu_seqlens, log_prob: torch.Tensor, name: str = "log_prob") -> None:
    """The packed layout at the API boundary (the op checks the values: named errors on CPU, asserts on CUDA);
    ``name``: the caller's name for the token tensor."""
    if cu_seqlens is None:
        if log_prob.dim() != 2:
            raise ValueError(f"{name} must be [batch, response_length], got shape {tuple(log_prob.shape)} (a packed "
                             f"token stream needs cu_seqlens)")
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [num_sequences + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != log_prob.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {name} is on {log_prob.device}")
    if log_prob.dim() != 1:
        raise ValueError(f"with cu_seqlens, {name} must be the 1-D packed token stream [T], got shape "
                         f"{tuple(log_prob.shape)}")


def padded_horizon(log_prob: torch.Tensor, cu_seqlens):
    """The padded length seq-mean-token-sum-norm divides by: T, or packed the longest segment (the width the same
    sequences would be padded to; a 0-dim tensor, so no host read)."""
    if cu_seqlens is None:
        return log_prob.shape[-1]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    return lens.max().clamp(min=1) if lens.numel() else 1


def segment_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of a packed [T] tensor (differentiable)."""
    cu = cu_seqlens.to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=x.device), cu[1:] - cu[:-1],
                                  output_size=x.shape[0])
    return torch.zeros(cu.numel() - 1, dtype=x.dtype, device=x.device).index_add(0, seg, x)


def check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None,
                         old_name: str = "old_log_prob", cu_seqlens=None) -> None:
    if not isinstance(log_prob, torch.Tensor) or not log_prob.is_floating_point():
        raise TypeError(f"log_prob must be a floating-point torch.Tensor, got {getattr(log_prob, 'dtype', type(log_prob))}")
    _check_cu_seqlens(cu_seqlens, log_prob)
    _check_float(old_name, old_log_prob, log_prob)
    _check_float("advantages", advantages, log_prob)
    check_mask("response_mask", response_mask, log_prob)  # its values: the policy-loss kernel, as it reads them
    if rollout_is_weights is not None:
        _check_float("rollout_is_weights", rollout_is_weights, log_prob)


def check_loss_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


# ---------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------


def _times_dp(loss: torch.Tensor, dp_size: int) -> torch.Tensor:
    """``loss * dp_size``, with no op (no autograd node) for the common ``dp_size == 1``."""
    return loss if dp_size == 1 else loss * dp_size


class RowAggregation:
    """verl's ``agg_loss`` over per-row partials, for one ``loss_agg_mode`` and its normalisers (checked here):
    :meth:`value` is the loss, a function of ``row_loss_sum[b] = sum_t m*L`` and ``row_tokens[b] = sum_t m`` (and the
    padded length ``horizon`` for ``seq-mean-token-sum-norm``), which is what lets the fused kernel emit ``[B, K]``
    partials instead of a ``[B, T]`` loss matrix. The loss is linear in ``row_loss_sum``; :meth:`grad` is its
    gradient there, the ops autograd runs through :meth:`value`, in the same order (the same bits:
    tests/test_policy_losses_all.py), so that the kernel and its aggregation can be one autograd node
    (:func:`ops.policy_loss`)."""

    __slots__ = ("mode", "horizon", "dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")

    def __init__(self, loss_agg_mode: str, horizon, *, dp_size: int = 1, batch_num_tokens: Optional[Number] = None,
                 global_batch_size: Optional[Number] = None, loss_scale_factor: Optional[Number] = None):
        check_loss_agg_mode(loss_agg_mode)
        _check_dp_size(dp_size)
        # a Fraction (a real number torch cannot divide by, nor trace) is its float
        batch_num_tokens, global_batch_size, loss_scale_factor = (
            float(x) if isinstance(x, numbers.Rational) and not isinstance(x, int) else x
            for x in (batch_num_tokens, global_batch_size, loss_scale_factor))
        _positive_or_none("batch_num_tokens", batch_num_tokens)
        _positive_or_none("global_batch_size", global_batch_size)
        _positive_or_none("loss_scale_factor", loss_scale_factor)
        # A one-element tensor normaliser must not broadcast the scalar loss to shape [1].
        batch_num_tokens, global_batch_size, loss_scale_factor = (
            x.reshape(()) if isinstance(x, torch.Tensor) else x
            for x in (batch_num_tokens, global_batch_size, loss_scale_factor))
        if dp_size > 1 and loss_agg_mode == "token-mean" and batch_num_tokens is None:
            raise ValueError("batch_num_tokens (the global count of valid tokens) is required when dp_size > 1")
        if dp_size > 1 and loss_agg_mode.startswith("seq-") and global_batch_size is None:
            raise ValueError("global_batch_size (the global count of sequences) is required when dp_size > 1")
        self.mode, self.horizon, self.dp_size = loss_agg_mode, horizon, dp_size
        self.batch_num_tokens, self.global_batch_size, self.loss_scale_factor = (
            batch_num_tokens, global_batch_size, loss_scale_factor)

    def terms(self, row_tokens: torch.Tensor, dtype) -> tuple:
        """What the loss needs of the token counts: (the divisor of the summed loss or None, the rows kept or None,
        each row's divisor or None, the final divisor or None), tensor normalisers already in ``dtype`` on the rows'
        device, for :meth:`value` and :meth:`grad` (one copy for both)."""
        tiny = torch.finfo(dtype).tiny

        def like_rows(x, name):
            """The normaliser ``name`` in ``dtype``: it must stay a normal number there (1e-300 is 0 in fp32, a
            subnormal's reciprocal overflows: an inf loss and gradient, silently; the knob fuzz)."""
            msg = (f"{name} must be at least {tiny:.4g}, the smallest normal {dtype} (the loss is divided by it in "
                   f"that type)")
            if isinstance(x, torch.Tensor):
                x = x.to(dtype=dtype, device=row_tokens.device)
                if x.device.type == "cpu" and not torch.compiler.is_compiling():
                    if not float(x) >= tiny:
                        raise ValueError(f"{msg}, got {float(x)!r} there")
                else:
                    torch._assert_async(x >= tiny, msg)
            elif x is not None and not torch.compiler.is_compiling() and not x >= tiny:
                raise ValueError(f"{msg}, got {x!r}")
            return x

        norm = None
        if self.mode == "seq-mean-token-sum-norm":
            norm = self.horizon if self.loss_scale_factor is None else like_rows(self.loss_scale_factor,
                                                                                  "loss_scale_factor")
            if isinstance(norm, torch.Tensor):  # the whole sequences' horizon under context parallelism
                norm = norm.to(dtype=dtype, device=row_tokens.device)
        if self.mode == "token-mean":
            return (_checks.ordered_sum(row_tokens) if self.batch_num_tokens is None
                    else like_rows(self.batch_num_tokens, "batch_num_tokens")), None, None, None
        if self.mode == "token-sum":
            return None, None, None, None
        valid = row_tokens > 0  # rows RS rejected entirely do not count
        den = valid.to(dtype).sum() if self.global_batch_size is None else like_rows(self.global_batch_size,
                                                                                     "global_batch_size")
        # verl's per-sequence token-mean
        row_div = row_tokens + LY.MASKED_MEAN_EPS if self.mode == "seq-mean-token-mean" else None
        return den, valid, row_div, norm

    def value(self, row_loss_sum: torch.Tensor, row_tokens: torch.Tensor, terms=None) -> torch.Tensor:
        """The loss (``terms``: :meth:`terms` of ``row_tokens``, when already computed)."""
        den, keep, row_div, norm = self.terms(row_tokens, row_loss_sum.dtype) if terms is None else terms
        x = row_loss_sum if row_div is None else row_loss_sum / row_div
        if keep is not None:
            # A row without tokens is left out by a select, not by a product: its 0 / (0 + eps) is NaN wherever eps
            # rounds away (16-bit rows), and NaN * 0 would still be NaN.
            x = torch.where(keep, x, 0)
        loss = _checks.ordered_sum(x)  # rows past 32768 (packed): the same bits at any thread count
        if den is not None:
            loss = safe_div(loss, den)
        # Data-parallel gradient averaging divides by dp_size; multiplying by it makes the result the global mean.
        loss = _times_dp(loss, self.dp_size)
        return loss if norm is None else safe_div(loss, norm)  # horizon 0: an empty response dimension

    def grad(self, grad_loss: torch.Tensor, row_tokens: torch.Tensor, terms=None) -> torch.Tensor:
        """d(loss)/d(row_loss_sum) times ``grad_loss`` ([B]; stride 0 for the token modes): :meth:`value`'s ops
        differentiated in reverse, each as autograd's formula computes it."""
        den, keep, row_div, norm = self.terms(row_tokens, grad_loss.dtype) if terms is None else terms
        g = grad_loss
        if norm is not None:
            g = safe_div_grad(g, norm)
        if self.dp_size != 1:
            g = g * self.dp_size
        if den is not None:
            g = safe_div_grad(g, den)
        g = g.expand(row_tokens.shape)  # sum
        if keep is not None:
            g = torch.where(keep, g, 0)
        return g if row_div is None else g / row_div


def aggregate_rows(
    row_loss_sum: torch.Tensor,
    row_tokens: torch.Tensor,
    loss_agg_mode: str,
    horizon: int,
    *,
    dp_size: int = 1,
    batch_num_tokens: Optional[Number] = None,
    global_batch_size: Optional[Number] = None,
    loss_scale_factor: Optional[Number] = None,
) -> torch.Tensor:
    """:func:`agg_loss` from per-row partials: ``row_loss_sum[b] = sum_t m*L``, ``row_tokens[b] = sum_t m``
    (:class:`RowAggregation`)."""
    return RowAggregation(loss_agg_mode, horizon, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                          global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor).value(
                              row_loss_sum, row_tokens)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[Number] = None,
    global_batch_size: Optional[Number] = None,
    loss_scale_factor: Optional[Number] = None,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Aggregate a ``[B, T]`` loss matrix into a scalar, exactly as verl 0.9.1 ``agg_loss`` defines it (same
    parameters in the same order: verl's positional calls work). Packed: ``loss_mat`` ``[T]`` with ``cu_seqlens``
    ``[B + 1]`` (sequences = segments; ``seq-mean-token-sum-norm``'s default divisor is the longest segment, the
    length the same sequences would be padded to).

    * ``token-mean``: sum(m L) / N * dp_size, N = ``batch_num_tokens`` (global valid tokens) or the local count.
    * ``token-sum``: sum(m L) * dp_size.
    * ``seq-mean-token-sum``: sum_b sum_t(m L) / S * dp_size over rows with >= 1 valid token,
      S = ``global_batch_size`` or the local count of such rows.
    * ``seq-mean-token-mean``: as above with each row's token-mean sum_t(m L) / (n_b + 1e-8).
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``loss_scale_factor`` (default: T, the padded length).

    ``dp_size > 1`` requires the matching global normaliser (ValueError otherwise), as in verl. The one
    difference from verl: where verl computes 0/0 (every token masked, no global normaliser) this returns 0
    with a zero gradient, so a micro-batch whose rows were all rejected by RS cannot poison the step.
    """
    if not isinstance(loss_mat, torch.Tensor) or not loss_mat.is_floating_point():
        raise ValueError(f"loss_mat must be a floating-point [batch, response_length] tensor, got "
                         f"{getattr(loss_mat, 'shape', type(loss_mat))}")
    _check_cu_seqlens(cu_seqlens, loss_mat, "loss_mat")
    if cu_seqlens is not None:  # the values too (no op runs here to check them): a named error, a device assert on CUDA
        _checks.check_cu_seqlens(loss_mat, cu_seqlens)
    check_mask("loss_mask", loss_mask, loss_mat, "loss_mat")
    check_loss_agg_mode(loss_agg_mode)
    # 16-bit losses are aggregated in fp32 (in fp16 the eps of a masked row's token-mean rounds away, and partial
    # sums round at every op), and the scalar comes back in the loss's dtype.
    acc = loss_mat.dtype if loss_mat.dtype in (torch.float32, torch.float64) else torch.float32
    x = loss_mat.to(acc)
    m = loss_mask.to(acc)
    # its weights as the sums read them (a float mask in acc: fp64 1e300 is inf in fp32; an integer one its sign)
    _checks.check_weight_mask("loss_mask", m if loss_mask.is_floating_point() else loss_mask)
    if cu_seqlens is None:
        row_loss_sum, row_tokens = _checks.row_sums(_checks.masked(x, m)), _checks.row_sums(m)
    else:
        row_loss_sum, row_tokens = segment_sum(_checks.masked(x, m), cu_seqlens), segment_sum(m, cu_seqlens)
    loss = aggregate_rows(row_loss_sum, row_tokens, loss_agg_mode, padded_horizon(loss_mat, cu_seqlens), dp_size=dp_size,
                          batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                          loss_scale_factor=loss_scale_factor)
    return loss.to(loss_mat.dtype)


# ---------------------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------------------


def refuse_grad(fn: str, **named) -> None:
    """The policy objective differentiates ``log_prob`` only: pi_old (or pi_rollout), the advantages and the IS
    weights are constants of it (verl detaches the IS weights itself; PPO's ratio is pi_theta over a fixed
    pi_old). A caller whose constant requires grad would otherwise silently get no gradient for it, so that is a
    ValueError naming the argument (nothing is checked when grad mode is off: no gradient is asked for)."""
    if not torch.is_grad_enabled():
        return
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{fn}: {name} requires grad, but it is a constant of the policy loss (only log_prob is "
                             f"differentiated, so its gradient would be silently dropped); pass {name}.detach()")


def policy_loss_step(kind: int, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, cfg, weights,
                 old_name: str = "old_log_prob", cu_seqlens=None, fn: str = "policy loss",
                 weights_name: str = "rollout_is_weights", params=(0.0, 0.0), metric_keys=None, clip=None,
                 rows_grad: bool = True):
    """``(loss, metrics, rows)`` of the fused kind ``kind``. ``rows_grad=False`` (a caller that reads ``rows`` for
    metrics only): ``rows`` comes back detached and the kernel and the aggregation are one autograd node
    (:func:`ops.policy_loss`); otherwise its loss column is differentiable, for a caller that aggregates it again."""
    refuse_grad(fn, **{old_name: old_log_prob, "advantages": advantages, weights_name: weights})
    clip_low, clip_high = (cfg.clip_low, cfg.clip_high) if clip is None else clip
    aggregation = RowAggregation(loss_agg_mode, padded_horizon(log_prob, cu_seqlens), **cfg.global_batch_info)
    # An undefined loss at a response token (NaN / +inf log-probs, ...) is an error raised by the op itself (CPU: a
    # ValueError naming the token; CUDA: an asynchronous device assert), so nothing here reads a value on the host.
    if rows_grad:
        _, rows = ops.policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
                                       clip_high, cfg.ratio_cap(kind), kind, cu_seqlens, *params, with_loss_mat=False,
                                       first_order=fn)
        loss = aggregation.value(rows[:, LY.PG_ROW_LOSS_SUM], rows[:, LY.PG_ROW_TOKENS])
    else:
        loss, rows = ops.policy_loss(log_prob, old_log_prob, advantages, response_mask, weights, clip_low, clip_high,
                                     cfg.ratio_cap(kind), kind, aggregation, cu_seqlens, *params, first_order=fn)
    if metric_keys is None:
        metric_keys = _PPO_METRICS if kind == LY.PG_KIND_PPO_CLIP else ("actor/ppo_kl",)
    return loss, _row_metrics(rows, metric_keys), rows


#: Which row column each verl metric is the masked mean of (None: verl logs a constant 0).
_METRIC_COLUMNS = {"actor/ppo_kl": LY.PG_ROW_KL_SUM, "actor/pg_clipfrac": LY.PG_ROW_CLIP,
                   "actor/pg_clipfrac_lower": LY.PG_ROW_CLIP_LOWER}
_PPO_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def _row_metrics(rows, keys, zero=()) -> Dict[str, torch.Tensor]:
    """verl's ``masked_mean`` of each metric's token values, from the row partials (``zero``: keys verl logs as 0)."""
    if not keys:
        return {}
    tokens = _checks.ordered_sum(rows[:, LY.PG_ROW_TOKENS]) + LY.MASKED_MEAN_EPS  # verl's masked_mean denominator
    out = {}
    for k in keys:
        out[k] = torch.zeros((), dtype=rows.dtype, device=rows.device) if k in zero else (
            _checks.ordered_sum(rows[:, _METRIC_COLUMNS[k]]) / tokens)
    return {k: v.detach() for k, v in out.items()}


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[PolicyLossConfig] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clip with asymmetric ratios and dual clip; rollout IS weights multiply each token's loss after clipping.

    r = exp(clamp(lp - lp_old, -20, 20)); L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
    for A < 0, L = min(L, -A c); then L * w (w treated as a constant), aggregated by :func:`agg_loss` with the
    config's global normalisers. Metrics (0-dim tensors over the valid tokens of this call):
    ``actor/pg_clipfrac`` (upper/ratio clip active), ``actor/pg_clipfrac_lower`` (dual clip active),
    ``actor/ppo_kl`` (mean of lp_old - lp, clamped).
    """
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
                         cu_seqlens=cu_seqlens)
    check_loss_agg_mode(loss_agg_mode)
    cfg = as_policy_config(config)
    loss, metrics, _ = policy_loss_step(LY.PG_KIND_PPO_CLIP, old_log_prob, log_prob, advantages, response_mask,
                                        loss_agg_mode, cfg, rollout_is_weights, cu_seqlens=cu_seqlens,
                                        fn="compute_policy_loss_vanilla", rows_grad=False)
    return loss, metrics


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Optional[PolicyLossConfig] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """REINFORCE with importance sampling ("pure IS"): L = -A lp w, no clipping (verl's default agg mode).

    ``rollout_log_prob`` only feeds the metric ``actor/ppo_kl`` = mean(rollout_lp - lp) over valid tokens.
    """
    check_policy_inputs(rollout_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
                         old_name="rollout_log_prob", cu_seqlens=cu_seqlens)
    check_loss_agg_mode(loss_agg_mode)
    cfg = as_policy_config(config)
    loss, metrics, _ = policy_loss_step(LY.PG_KIND_REINFORCE, rollout_log_prob, log_prob, advantages, response_mask,
                                        loss_agg_mode, cfg, rollout_is_weights, old_name="rollout_log_prob",
                                        cu_seqlens=cu_seqlens, fn="compute_policy_loss_reinforce", rows_grad=False)
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------
# The rest of verl 0.9.1's registry (docs/policy_losses.md): one fused kind each where the loss is per token, and the
# sequence-level quantities (GSPO's mean log-ratio, GMPO's geometric mean) from exact row sums, over seq_group too.
# ---------------------------------------------------------------------------------------------------------


def _row_sums(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """Per-row (packed: per-segment) sums, in the row-major order whatever ``x``'s layout (a transposed input's
    elementwise results keep its strides, and torch sums a strided row in another order: an ulp apart)."""
    x = x.contiguous()
    return _checks.row_sums(x) if cu_seqlens is None else segment_sum(x, cu_seqlens)


def _per_token(row_values: torch.Tensor, like: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """A per-row value at every token of its row (a broadcast view when padded)."""
    if cu_seqlens is None:
        return row_values.unsqueeze(-1).expand(like.shape)
    cu = cu_seqlens.to(torch.int64)
    return torch.repeat_interleave(row_values, cu[1:] - cu[:-1], output_size=like.shape[0])


def _seq_all_reduce(x: torch.Tensor, seq_group) -> torch.Tensor:
    """Row sums over a sequence split across ranks (context parallelism): summed over ``seq_group``."""
    if seq_group is not None and torch.distributed.get_world_size(seq_group) > 1:
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=seq_group)
    return x


def _seq_world(seq_group) -> int:
    """The number of context-parallel ranks a sequence is split over (1: whole sequences on this rank)."""
    return 1 if seq_group is None else torch.distributed.get_world_size(seq_group)


class _WholeSums(NamedTuple):
    """What a whole-batch loss needs of the whole sequences under context parallelism (:func:`_whole_sums`)."""

    sums: Tuple[torch.Tensor, ...]  # the batch sums the caller gave, over every rank's tokens, each in its dtype
    row_tokens: torch.Tensor  # [B]: each sequence's sum of the mask, over all of its pieces
    horizon: Any  # the padded length seq-mean-token-sum-norm divides by (None: not needed)


def _whole_sums(sums, m, log_prob, cu_seqlens, loss_agg_mode, cfg, seq_group) -> _WholeSums:
    """One SUM all-reduce over ``seq_group`` (fp64, so counts stay exact) of this rank's batch sums ``sums`` (0-dim
    tensors), its per-sequence mask sums and, for ``seq-mean-token-sum-norm`` without ``loss_scale_factor``, the
    parts of the padded length (padded: this rank's width, summed to the whole width; packed: each segment's length,
    summed per sequence, the longest whole sequence taken). Returned in ``m``'s dtype (each batch sum in its own): with them,
    :func:`aggregate_rows` of this rank's row loss sums is this rank's share of the one-process loss (the shares of
    the ``seq_group`` ranks add up to it)."""
    acc = m.dtype
    if cu_seqlens is not None:  # the values, before the first use (the op, which checks them too, runs later)
        _checks.check_cu_seqlens(log_prob, cu_seqlens)
    row_tokens = _row_sums(m, cu_seqlens)
    parts = ([torch.stack(list(sums)).double()] if len(sums) else []) + [row_tokens.double()]
    horizon = None
    with_horizon = loss_agg_mode == "seq-mean-token-sum-norm" and cfg.loss_scale_factor is None
    if with_horizon:
        if cu_seqlens is None:
            parts.append(row_tokens.new_full((1,), float(log_prob.shape[-1]), dtype=torch.float64))
        else:
            cu = cu_seqlens.to(torch.int64)
            parts.append((cu[1:] - cu[:-1]).double())
    flat = _seq_all_reduce(torch.cat(parts), seq_group)
    n, b = len(sums), row_tokens.shape[0]
    if with_horizon:
        rest = flat[n + b:]
        horizon = rest[0] if cu_seqlens is None else (rest.max().clamp(min=1) if rest.numel() else 1)
    return _WholeSums(tuple(flat[i].to(x.dtype) for i, x in enumerate(sums)), flat[n:n + b].to(acc), horizon)


def _share_of_whole(loss: torch.Tensor, seq_world: int) -> torch.Tensor:
    """A context-parallel rank's share of a loss ``loss`` that every rank of ``seq_group`` computed whole (its
    value the one-process loss, its gradient that of the whole loss on this rank's tokens): the value ``loss /
    seq_world``, so that the shares add up to the loss, with the gradient of ``loss`` itself."""
    if seq_world == 1:
        return loss
    whole = loss.detach()
    return whole / seq_world + (loss - whole)


def _prologue(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
              cu_seqlens):
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, cu_seqlens=cu_seqlens)
    check_loss_agg_mode(loss_agg_mode)
    return as_policy_config(config)


#: loss_mode -> the fused kind, for the losses that are one kind per token (GSPO: with its sequence ratio as a
#: per-row constant). geo_mean, clip_cov and kl_cov need whole-batch steps of their own (:data:`WHOLE_BATCH_LOSSES`).
TOKEN_LOSS_KINDS = {"vanilla": LY.PG_KIND_PPO_CLIP, "dppo_tv": LY.PG_KIND_DPPO_TV, "dppo_kl": LY.PG_KIND_DPPO_KL,
                    "gspo": LY.PG_KIND_GSPO, "sapo": LY.PG_KIND_SAPO, "gpg": LY.PG_KIND_REINFORCE,
                    "dro": LY.PG_KIND_DRO, "cispo": LY.PG_KIND_CISPO}

#: verl's metrics of each per-token loss: (its keys, those verl logs as a constant 0). GSPO's ppo_kl comes from its
#: sequence sums (:func:`_token_metrics`).
_TOKEN_LOSS_METRICS = {
    "vanilla": (_PPO_METRICS, ()), "dppo_tv": (_PPO_METRICS, ()), "dppo_kl": (_PPO_METRICS, ()),
    "gspo": (_PPO_METRICS, ("actor/ppo_kl", "actor/pg_clipfrac_lower")),
    "sapo": (_PPO_METRICS, ("actor/pg_clipfrac", "actor/pg_clipfrac_lower")), "gpg": ((), ()),
    "dro": (("actor/ppo_kl",), ()), "cispo": (_PPO_METRICS, ("actor/pg_clipfrac_lower",)),
}

#: The aggregation verl forces on a loss whatever ``loss_agg_mode`` says.
_FORCED_AGG = {"sapo": "seq-mean-token-mean"}


def _kind_params(mode: str, cfg: "PolicyLossConfig") -> Tuple[int, Tuple[float, float]]:
    """``(kind, (param_a, param_b))`` of the per-token loss ``mode`` for :func:`ops.policy_loss_rows`."""
    if mode == "sapo":
        return LY.PG_KIND_SAPO, (float(cfg.tau_pos), float(cfg.tau_neg))
    if mode == "dro":
        return LY.PG_KIND_DRO, (_require_dro_beta(cfg), 0.0)
    return TOKEN_LOSS_KINDS[mode], (0.0, 0.0)


def _token_metrics(mode: str, rows: torch.Tensor, gspo_x_sum=None) -> Dict[str, torch.Tensor]:
    """verl's metrics of the per-token loss ``mode`` from the row partials (GSPO: ``gspo_x_sum``, this rank's sum of
    the masked log-ratios, gives ``actor/ppo_kl`` over this rank's tokens, as the other metrics)."""
    keys, zero = _TOKEN_LOSS_METRICS[mode]
    metrics = _row_metrics(rows, keys, zero)
    if gspo_x_sum is not None:
        tokens = _checks.ordered_sum(rows[:, LY.PG_ROW_TOKENS]) + LY.MASKED_MEAN_EPS
        metrics["actor/ppo_kl"] = (-gspo_x_sum / tokens).detach()
    return metrics


def _per_token_loss(mode):
    """verl's loss ``mode``, one fused kind per token, aggregated by ``loss_agg_mode`` (or the mode verl forces)."""
    name = "compute_policy_loss_" + mode

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None, *, cu_seqlens=None):
        cfg = _prologue(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights, cu_seqlens)
        kind, params = _kind_params(mode, cfg)
        loss, _, rows = policy_loss_step(kind, old_log_prob, log_prob, advantages, response_mask,
                                         _FORCED_AGG.get(mode, loss_agg_mode), cfg, rollout_is_weights,
                                         cu_seqlens=cu_seqlens, fn=name, params=params, metric_keys=(),
                                         rows_grad=False)
        return loss, _token_metrics(mode, rows)

    loss_fn.__name__ = loss_fn.__qualname__ = name
    return loss_fn


compute_policy_loss_dppo_tv = _per_token_loss("dppo_tv")
compute_policy_loss_dppo_tv.__doc__ = """DPPO-Binary-TV (arXiv:2602.04879, verl ``dppo_tv``): a token whose probability moved
    by more than eps (``clip_ratio_high`` up for A > 0, ``clip_ratio_low`` down for A <= 0) is masked; the rest get
    L = -A sg(min(r, clip_ratio_c)) log pi. Metrics: ``actor/pg_clipfrac`` (masked), ``actor/pg_clipfrac_lower``
    (kept with r > c), ``actor/ppo_kl``."""
compute_policy_loss_dppo_kl = _per_token_loss("dppo_kl")
compute_policy_loss_dppo_kl.__doc__ = """DPPO-Binary-KL (verl ``dppo_kl``): as ``dppo_tv`` with the Bernoulli KL
    p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) <= eps as the trust region (a token
    moving against the advantage's push is always kept)."""
compute_policy_loss_sapo = _per_token_loss("sapo")
compute_policy_loss_sapo.__doc__ = """SAPO (arXiv:2511.20347, verl ``sapo``): L = -A (4 / tau) sigmoid(tau (r - 1)),
    tau = ``tau_pos`` for A > 0 else ``tau_neg``; always aggregated seq-mean-token-mean (as verl does, whatever
    ``loss_agg_mode`` says). Clip metrics are 0, as in verl."""
compute_policy_loss_cispo = _per_token_loss("cispo")
compute_policy_loss_cispo.__doc__ = """CISPO (arXiv:2506.13585, verl ``cispo``): L = -sg(clip(r, 1 - eps_low,
    1 + eps_high)) A log pi: every token keeps a gradient, its IS weight clipped. ``actor/pg_clipfrac``: r clipped."""
compute_policy_loss_dro = _per_token_loss("dro")
compute_policy_loss_dro.__doc__ = """DRO (verl ``dro``): L = -(A log pi - beta / 2 (log pi - log pi_old)^2),
    beta = ``dro_beta`` (required). Metric: ``actor/ppo_kl`` (unclamped)."""


def _require_dro_beta(cfg) -> float:
    if cfg.dro_beta is None:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO (got None)")
    return float(cfg.dro_beta)


def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None, *, cu_seqlens=None):
    """GPG (verl ``gpg``): L = -A log pi (times the IS weights); no metrics, as in verl."""
    cfg = _prologue("compute_policy_loss_gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                    config, rollout_is_weights, cu_seqlens)
    refuse_grad("compute_policy_loss_gpg", old_log_prob=old_log_prob)
    # GPG logs nothing, so old_log_prob (the kernel's kl column only) is not read: the kernel gets log_prob in its
    # place (the same memory, read once) and the unused kl column is 0.
    loss, _, _ = policy_loss_step(LY.PG_KIND_REINFORCE, log_prob.detach(), log_prob, advantages, response_mask,
                                  loss_agg_mode, cfg, rollout_is_weights, cu_seqlens=cu_seqlens,
                                  fn="compute_policy_loss_gpg", metric_keys=(), rows_grad=False)
    return loss, {}


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None, *, cu_seqlens=None, seq_group=None):
    """GSPO (arXiv:2507.18071, verl ``gspo``): the sequence ratio s = exp(mean_t (log pi - log pi_old)) (capped at
    e^10) in PPO's clip, with each token's gradient s d log pi. The mean is over the whole sequence: exact for
    packed rows and, with ``seq_group``, for sequences split across context-parallel ranks, where each rank returns
    its share of the one-process loss (its rows aggregated with the whole sequences' token counts: the shares add up
    to the loss, each rank's gradient is the one-process gradient on its tokens). Metrics:
    ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (0, as in verl)."""
    fn = "compute_policy_loss_gspo"
    cfg = _prologue(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                    cu_seqlens)
    refuse_grad(fn, old_log_prob=old_log_prob)  # the sequence ratio below is a constant built from it
    seq_log_ratio, x_sum = gspo_sequence_log_ratio(log_prob, old_log_prob, response_mask, cu_seqlens=cu_seqlens,
                                                   seq_group=seq_group)
    share = _seq_world(seq_group) > 1
    loss, _, rows = policy_loss_step(LY.PG_KIND_GSPO, seq_log_ratio, log_prob, advantages, response_mask, loss_agg_mode,
                                     cfg, rollout_is_weights, cu_seqlens=cu_seqlens, fn=fn, metric_keys=(),
                                     rows_grad=share)
    if share:  # this rank's share of the one-process loss: its rows with the whole sequences' counts (policy_step's)
        with torch.no_grad():
            counts = _whole_sums((), response_mask.to(rows.dtype), log_prob, cu_seqlens, loss_agg_mode, cfg, seq_group)
        loss = aggregate_rows(rows[:, LY.PG_ROW_LOSS_SUM], counts.row_tokens, loss_agg_mode,
                              _horizon(counts, log_prob, cu_seqlens), **cfg.global_batch_info)
    return loss, _token_metrics("gspo", rows, x_sum)


def gspo_sequence_log_ratio(log_prob, old_log_prob, response_mask, *, cu_seqlens=None, seq_group=None):
    """GSPO's per-sequence mean log-ratio mean_t (log pi - log pi_old) (verl: sum / clamp(len, 1)), at every token
    of its sequence (what the GSPO kind reads in place of ``old_log_prob``), and this rank's sum of the masked
    log-ratios (for ``actor/ppo_kl``). Whole sequences: packed segments, and ``seq_group`` (context parallelism:
    one all-reduce of [2, B] sums). A constant: computed under no_grad."""
    acc = _checks.acc_dtype(log_prob.dtype)
    with torch.no_grad():
        m = response_mask.to(acc)
        x = _checks.masked(log_prob.detach().to(acc) - old_log_prob.to(acc), m).contiguous()  # row-major sums
        sums = _seq_all_reduce(torch.stack([_row_sums(x, cu_seqlens), _row_sums(m, cu_seqlens)]), seq_group)
        seq = sums[0] / sums[1].clamp(min=1)
        return _per_token(seq, log_prob, cu_seqlens), _checks.ordered_sum(x)


def _nonzero(m: torch.Tensor) -> torch.Tensor:
    """``m != 0`` as a bool tensor, by a cast: the same truth values (NaN included) at a fraction of a comparison's
    cost."""
    return m if m.dtype == torch.bool else m.bool()


def _masked_by(x: torch.Tensor, nz: torch.Tensor, m: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`_checks.masked` (verl's ``where(m != 0, x, 0) * m``, the same values) given ``nz = m != 0``: one new
    tensor (or ``out``, which may be ``x``), the product taken in place. Not differentiable (callers run under
    no_grad)."""
    if out is None:
        return torch.where(nz, x, 0.0).mul_(m)
    return torch.where(nz, x, out.new_zeros(()), out=out).mul_(m)


def _geo_mean_step(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                   rollout_is_weights=None, *, cu_seqlens=None, seq_group=None):
    """GMPO (arXiv:2507.20673, verl ``geo_mean``): per sequence L = -mean_t(A) exp(mean_t(clip_sgn(x))) times the
    geometric mean of the IS weights, x = log pi - log pi_old clipped on the side the advantage's sign picks;
    the batch loss is the mean over sequences (``loss_agg_mode`` is ignored, as in verl), or with
    ``global_batch_size`` their sum / global_batch_size * dp_size (the same mean, exact across data-parallel
    ranks). Metrics: ``actor/pg_clipfrac`` (x clipped, A > 0), ``actor/pg_clipfrac_lower`` (A < 0), ``actor/ppo_kl``.

    ``seq_group`` (context parallelism: the ranks hold pieces of the same sequences): every per-sequence sum (of the
    clipped log-ratios, the mask, the advantages, the log IS weights) and the metrics' sums are summed over it in one
    all-reduce of ``[7, B]`` (``[6, B]`` without IS weights), so the loss and the metrics are those of the whole
    sequences. Each rank returns its share of the loss, ``L / cp`` (the shares add up to the one-process ``L``),
    with the gradient of the whole ``L`` on its own tokens (the other ranks' sums enter as constants); the metrics
    are the one-process values on every rank."""
    fn = "compute_policy_loss_geo_mean"
    cfg = _prologue(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                    cu_seqlens)
    refuse_grad(fn, rollout_is_weights=rollout_is_weights)
    _, _, rows = policy_loss_step(LY.PG_KIND_GEO_MEAN, old_log_prob, log_prob, advantages, response_mask, "token-sum",
                              cfg, None, cu_seqlens=cu_seqlens, fn=fn, metric_keys=())
    acc = rows.dtype
    cp = _seq_world(seq_group)
    with torch.no_grad():
        m = response_mask.to(acc)
        nz = _nonzero(m)  # one mask test for both masked sums
        adv_sum = _row_sums(_masked_by(advantages.to(acc), nz, m), cu_seqlens)
        logw_sum = None
        if rollout_is_weights is not None:
            logw = torch.add(rollout_is_weights.detach().to(acc), 1e-10).log_()  # log(w + 1e-10), one buffer
            logw_sum = _row_sums(_masked_by(logw, nz, m), cu_seqlens)
            del logw
        whole_rows = rows.detach()
        if cp > 1:  # the whole sequences' sums: rows' columns, the advantages' and log-weights' sums, one all-reduce
            parts = [rows.detach().t(), adv_sum.unsqueeze(0)] + ([] if logw_sum is None else [logw_sum.unsqueeze(0)])
            summed = _seq_all_reduce(torch.cat(parts).double(), seq_group).to(acc)
            whole_rows, adv_sum = summed[:LY.PG_ROW_COLS].t(), summed[LY.PG_ROW_COLS]
            logw_sum = None if logw_sum is None else summed[LY.PG_ROW_COLS + 1]
    if logw_sum is not None:  # log(w + 1e-10) of a weight below -1e-10 (or NaN) under the mask: verl's loss is NaN
        refuse_where(torch.isnan(logw_sum),
                     lambda at: f"{fn}: sequence {at[0]} has a rollout_is_weights value below 0 (or NaN) under its "
                                f"mask: the geometric mean of its IS weights, exp(mean log(w + 1e-10)), is undefined. "
                                f"IS weights must be >= 0",
                     f"{fn}: rollout_is_weights must be >= 0 under the mask (the geometric mean's log)")
    tokens = whole_rows[:, LY.PG_ROW_TOKENS] + LY.MASKED_MEAN_EPS
    g = rows[:, LY.PG_ROW_LOSS_SUM]
    if cp > 1:  # the whole sum's value, differentiable in this rank's terms only
        g = whole_rows[:, LY.PG_ROW_LOSS_SUM] + (g - g.detach())
    seq_loss = -(adv_sum / tokens) * torch.exp(g / tokens)
    if logw_sum is not None:
        seq_loss = seq_loss * torch.exp(logw_sum / tokens)
    # finite inputs can still overflow exp (a mean clipped log-ratio past ~88 in fp32): an undefined loss, refused as
    # the kernel refuses an undefined token loss (the same on every CP rank: the whole sequences' values)
    refuse_where(~torch.isfinite(seq_loss.detach()),
                 lambda at: f"{fn}: sequence {at[0]}'s value -mean(A) exp(mean clipped log-ratio) is not finite "
                            f"({float(seq_loss.detach()[at])}): the mean clipped log-ratio "
                            f"({float(g.detach()[at] / tokens[at])}) "
                            f"overflows exp; mask the sequence out or fix its log-probs",
                 f"{fn}: a sequence's value -mean(A) exp(mean clipped log-ratio) is not finite")
    if cfg.global_batch_size is None:
        if cfg.dp_size > 1:
            raise ValueError("geo_mean with dp_size > 1 needs global_batch_size (the global count of sequences)")
        # past one block of sequences, in the fixed order (verl's torch.mean below it)
        n_seq = seq_loss.numel()
        if 0 < n_seq <= _checks.ORDERED_SUM_BLOCK:
            loss = seq_loss.mean()
        else:
            loss = _checks.ordered_sum(seq_loss) / max(n_seq, 1)
    else:
        gbs = cfg.global_batch_size
        loss = safe_div(_checks.ordered_sum(seq_loss), gbs.reshape(()) if isinstance(gbs, torch.Tensor) else gbs) \
            * cfg.dp_size
    return _share_of_whole(loss, cp), _row_metrics(whole_rows, _PPO_METRICS), rows


#: The candidate filter of :func:`_top_set`: elements per block maximum (a power of 2).
_TOPK_SHIFT = 7
_TOPK_BLOCK = 1 << _TOPK_SHIFT


def _top_set(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of ``k`` largest values of a 1-D tensor (NaN ranked largest, as torch.topk ranks it), in no
    fixed order, and which of several equal values at the k-th is taken is not fixed either (:func:`_top_by_rule`
    sorts the set and settles those ties itself). On the CPU torch.topk runs over candidate blocks only.

    The k largest of the block maxima (blocks of :data:`_TOPK_BLOCK`) are k elements of distinct blocks, so the
    k-th largest element is at least the least of them, M: a block whose maximum is below M holds none of the top
    k and is dropped whole (a NaN M or maximum drops nothing). The kept blocks and the tail go to one torch.topk,
    whose positions map back. On the bench's 2^21 tokens a full top-k costs ~17 ms on the 2-core VM (its 32 MiB
    work vector is mapped afresh on every call); the candidates are k blocks, more only where block maxima tie at
    M. Elsewhere (CUDA, small inputs, under torch.compile) this is torch.topk itself; the CPU path sizes its
    candidates from the data (one ``nonzero``: no device to wait for on the CPU).
    """
    n = flat.numel()
    s = _TOPK_BLOCK
    nb = n // s
    if flat.device.type != "cpu" or 64 * k > n or nb < 2 * k or torch.compiler.is_compiling():
        return torch.topk(flat, k, sorted=True).indices
    blocks = flat[: nb * s].view(nb, s)
    block_max = blocks.amax(-1)  # NaN-propagating: a block holding a NaN is kept
    least = torch.topk(block_max, k, sorted=False).values.min()  # NaN when one of them is: keep every block
    cb = (block_max < least).logical_not_().nonzero().squeeze(1)
    vals = blocks[cb].reshape(-1)
    head = vals.numel()
    if nb * s < n:
        vals = torch.cat([vals, flat[nb * s:]])
    at = torch.topk(vals, k, sorted=False).indices
    return torch.where(at < head, cb[(at >> _TOPK_SHIFT).clamp(max=max(0, cb.numel() - 1))] * s + (at & (s - 1)),
                       at - head + nb * s)


def _positions_of(flat: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The positions of ``flat`` (1-D, CPU) holding the value ``v`` ([1], not NaN), ascending. Only the blocks of
    :data:`_TOPK_BLOCK` whose maximum reaches ``v`` are compared (one pass of block maxima, then those blocks): the
    positions tied at a top-k boundary are few next to the tensor."""
    s = _TOPK_BLOCK
    nb = flat.numel() // s
    blocks = flat[:nb * s].view(nb, s)
    near = (blocks.amax(-1) < v).logical_not_().nonzero().squeeze(1)  # a NaN maximum hides nothing
    at = (blocks[near] == v).nonzero()  # row-major: ascending positions
    tail = (flat[nb * s:] == v).nonzero().squeeze(1) + nb * s
    return torch.cat([near[at[:, 0]] * s + at[:, 1], tail])


def _top_by_rule(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the ``k`` largest values of a 1-D tensor, in the order (value descending, position
    ascending): a top-k whose ties are taken by the lower position, on every device (torch.topk leaves that order to
    its algorithm). -inf entries are padding: which of them come last is not fixed. No host sync on a GPU.

    A top-(k + 1) set by :func:`_top_set` gives the right values, so every position above the k-th value ``v``. On
    the CPU, when the (k + 1)-th value is below ``v`` (or ``v`` is -inf) the candidates hold every position at ``v``
    and sorting them is all; otherwise the positions at ``v`` are the first ones of the tensor: on the CPU found in
    the blocks whose maximum reaches ``v`` (:func:`_positions_of`), on a GPU (where the test and a nonzero would be
    host reads) a cumulative count of
    ``flat == v`` (one more pass)."""
    n = flat.numel()
    idx = _top_set(flat, min(k + 1, n)).sort().values
    idx = idx[torch.sort(flat[idx], descending=True, stable=True).indices]
    vals = flat[idx]
    v = vals[k - 1:k]  # the k-th largest value, [1]
    if flat.device.type == "cpu" and not torch.compiler.is_compiling():
        vk = float(v)
        if k == n or vk == -math.inf or vk != vk or float(vals[k]) < vk:  # a NaN k-th value (undefined inputs,
            return idx[:k]  # refused by the op after the selection): torch.topk's order, NaN first
        # the values above v, then the first positions holding v (no cumulative count)
        n_above = int((vals[:k] > v).sum())
        return torch.cat([idx[:n_above], _positions_of(flat, v)[:k - n_above]])
    idx, vals = idx[:k], vals[:k]
    n_above = (vals > v).sum()
    j = torch.arange(k, device=flat.device)
    nth_tied = torch.searchsorted((flat == v).cumsum(0), (j - n_above + 1).clamp(min=1))
    return torch.where(j < n_above, idx, nth_tied.clamp(max=n - 1))


def _top_positions(score: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor, k_max: int, *,
                   seq_group=None, cu_seqlens=None, weight: Optional[torch.Tensor] = None, overwrite: bool = False,
                   seq_positions: Optional[torch.Tensor] = None):
    """The ``count`` eligible positions with the largest score, as ``(idx, keep, weight_sum)``: the flat positions
    of this rank's top-k of k_max and which of them are selected, with no host sync on a GPU: ``count`` is a 0-dim
    tensor, ``k_max >= count`` a bound known without reading data (a top-k of k_max, not a sort of every token).
    ``weight_sum``: the sum of ``weight`` over the selected tokens of every rank (None without ``weight`` or
    ``seq_group``).

    The selection is the first ``count`` eligible tokens in the order: score descending, then sequence (row, packed
    segment) ascending, then context-parallel rank (in ``seq_group``) ascending, then position in this rank's piece
    ascending. In one process that is (score descending, position ascending in the row-major / packed stream), and
    under context parallelism it is the same order whenever rank r holds the r-th contiguous piece of every
    sequence. ``seq_positions`` (each token's position in its whole sequence, or in the whole packed stream, as the
    ranks split it: megatron's load-balanced chunks) replaces (rank, local position) by that position, so the order
    is the one-process order whatever the split. Eligible scores must be > -inf (clip_cov's lie in (lb, ub);
    kl_cov's are finite where its op accepts the inputs).

    ``seq_group`` with more than one rank: ``k_max`` must be the global ``count`` itself (the same int on every
    rank). Each rank's own top-``count`` under that order (a rank can hold no more of the selection) goes into one
    all-gather of ``[count, 4]`` fp64 records per rank (score, sequence, position, weight); every rank sorts the
    ``cp * count`` records by the order above and keeps its own among the first ``count``.

    ``overwrite``: ``score`` (contiguous) may be overwritten (its ineligible entries set to -inf in place)."""
    if overwrite:
        flat = torch.where(eligible, score, score.new_full((), -math.inf), out=score).view(-1)
    else:
        flat = torch.where(eligible, score, -math.inf).reshape(-1)
    elig = eligible.reshape(-1)
    k = min(max(1, int(k_max)), flat.numel())
    idx = _top_by_rule(flat, k) if k else torch.zeros(0, dtype=torch.int64, device=flat.device)
    cp = _seq_world(seq_group)
    if cp == 1:
        keep = (torch.arange(k, device=flat.device) < count) & elig[idx]
        return idx, keep, None
    big = int(k_max)
    record = torch.full((big, 4), math.inf, dtype=torch.float64, device=flat.device)
    record[:, 0] = -math.inf
    record[:, 3] = 0.0
    record[:k, 0] = flat[idx].double() + 0.0  # -0.0 as 0.0: they tie (a constant side's covariances), one GPU
    # sort may order them
    record[:k, 1] = _row_of(idx, score, cu_seqlens).double()
    record[:k, 2] = (idx if seq_positions is None else seq_positions.reshape(-1)[idx]).double()
    if weight is not None:
        record[:k, 3] = torch.where(elig[idx], weight.reshape(-1)[idx], 0).double()
    got = all_gather(record.reshape(-1), seq_group, cp).view(cp * big, 4)
    rank = torch.arange(cp, device=flat.device, dtype=torch.float64).repeat_interleave(big)
    # stable sorts, the last key primary: (score desc, sequence, rank, local position), or with seq_positions
    # (score desc, sequence, position in the whole sequence)
    keys = (got[:, 2], rank, got[:, 1]) if seq_positions is None else (rank, got[:, 2], got[:, 1])
    order = torch.argsort(keys[0], stable=True)
    for key in keys[1:]:
        order = order[torch.argsort(key[order], stable=True)]
    order = order[torch.argsort(got[order, 0], descending=True, stable=True)]
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), device=order.device)
    selected = place < count
    me = torch.distributed.get_rank(seq_group)
    keep = selected[me * big: me * big + k] & elig[idx]
    weight_sum = None if weight is None else torch.where(selected, got[:, 3], 0.0).sum()
    return idx, keep, weight_sum


#: Scratch slots (ops.scratch_empty) of the whole-batch losses' [B, T] temporaries: 0 and 1 are two of the
#: accumulation dtype; one slot per other temporary that is alive at the same time as another; the last holds the
#: fp64 conversions of the masked sums (:func:`_masked_total`).
_SLOT_WEIGHTS, _SLOT_MASK, _SLOT_VALID, _SLOT_ELIGIBLE, _SLOT_TEST, _SLOT_SUM = 2, 3, 4, 5, 6, 7


def _in_dtype(x: torch.Tensor, dtype: torch.dtype, slot: int) -> torch.Tensor:
    """``x.to(dtype)``: ``x`` itself when it has that dtype, else a copy in scratch ``slot``. A bool is read as its
    uint8 bytes, clamped to 1: torch's CPU bool-to-float copy is several times slower than the uint8 copy and a
    clamp together (benchmarks/bench_torch_masks.py); the clamp gives 1 for any nonzero byte, as torch reads a bool
    (one viewed from uint8 data may hold 2 or 255)."""
    if x.dtype == dtype:
        return x
    out = ops.scratch_empty(x.shape, dtype, x.device, slot)
    return out.copy_(x.view(torch.uint8)).clamp_(max=1) if x.dtype == torch.bool else out.copy_(x)


# torch's CPU comparisons write a float 0 / 1 about four times faster than a bool, and the float-to-bool copy is cheap;
# counting the float flags is four times cheaper than counting the bools (benchmarks/bench_torch_masks.py). On a GPU
# the float flags cost a few bytes per token more: one path for every device.


def _valid(response_mask: torch.Tensor, m: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """The tokens with a mask value > 0, as bools: a bool ``response_mask`` itself (read only; torch's ops read any
    nonzero byte as True), else ``m > 0`` (``m``: the mask in the compute type) through its float flags, left in
    ``tmp``."""
    if response_mask.dtype == torch.bool:
        return response_mask
    return _flag(torch.gt, m, 0, ops.scratch_empty(m.shape, torch.bool, m.device, _SLOT_VALID), tmp)


def _flag(op, x: torch.Tensor, other, out: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``op(x, other)`` (a torch comparison) into the bool ``out``, through its float 0 / 1 in the ``[B, T]`` ``tmp``
    (may be ``x`` itself, then overwritten; it holds the flags afterwards)."""
    return out.copy_(op(x, other, out=tmp))


def _masked_total(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, dtype=None) -> torch.Tensor:
    """The masked sum of the whole-batch statistics, ``sum(where(w != 0, x, 0) * w)``, as ``nansum(x * w)`` into
    ``out`` (may be ``x``): a value the mask drops (w = 0) is x * 0, which is 0, or NaN for a NaN / inf x and then
    skipped, so nothing it holds reaches the sum; a kept value enters as the select's would (an inf stays inf). They
    part only at a NaN the mask keeps, which the select would carry into the sum and nansum skips: the policy-loss
    op that follows raises for that same response token, so that sum is never used. On the CPU about half the
    select's cost (benchmarks/bench_torch_masks.py). ``dtype``: summed in that type (the products in ``out``'s)."""
    buf = None
    if dtype is not None and dtype != x.dtype and x.numel() > _checks.ORDERED_SUM_BLOCK:
        buf = ops.scratch_empty((8 * _checks.ORDERED_SUM_BLOCK,), dtype, x.device, _SLOT_SUM)
    return _checks.ordered_sum(torch.mul(x, w, out=out), nan=True, dtype=dtype, buf=buf)


def _mean_parts(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The covariance means' masked sum ``sum(x * w)`` (:func:`_masked_total`) as two fp64 parts, high and low:
    ``hi / den + lo / den`` is the mean, and for equal values it is that value exactly, so a constant side's
    covariances are 0 and the tie rule picks, in one process and under context parallelism alike (the parts of each
    rank add up exactly). n copies of an fp32 value sum exactly in fp64 (below 2^29 of them); an fp64 value is split
    into its fp32 rounding and the rest (each exact in an fp64 sum of up to 2^24 copies; a value past fp32's range
    is its own high part). An fp32 sum, verl's, of n equal values is an ulp off: its covariances are rounding noise,
    which picks tokens by the other side's order, and another noise under context parallelism. ``w``: 0 / 1 flags or
    weights (a weight's product may round); ``out`` (x's dtype) is overwritten."""
    if x.dtype != torch.float64:
        return _masked_total(x, w, out, torch.float64), x.new_zeros((), dtype=torch.float64)
    hi = x.to(torch.float32).to(torch.float64)
    hi = torch.where(torch.isinf(hi), x, hi)
    return _masked_total(hi, w, out), _masked_total(torch.sub(x, hi, out=out), w, out)


def _mean(parts: Tuple[torch.Tensor, torch.Tensor], den: torch.Tensor) -> torch.Tensor:
    """The mean of :func:`_mean_parts` over the count ``den`` (fp64)."""
    return parts[0] / den + parts[1] / den


def _count(flags: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``count_nonzero(valid)`` (int64) from its float 0 / 1 copy ``flags``: an fp32 sum of ones is exact below
    2^24 elements (every partial sum an integer under 2^24; the size is known without reading data), and far
    cheaper on the CPU than counting the bools."""
    if flags.dtype == torch.float32 and flags.numel() >= 2 ** 24:
        return torch.count_nonzero(valid)
    return flags.sum().to(torch.int64)


def _token_cap(ratio, total: torch.Tensor, most) -> torch.Tensor:
    """The covariance losses' token cap, verl's ``max(1, int(ratio * total))`` (clip_cov: total = the mask sum,
    kl_cov: the valid-token count), as an fp64 0-dim tensor: the product in fp64 as verl's Python floats form it (an
    fp32 product rounds 100 * 0.29 up to 29 where verl takes 28), and at most ``most``, the tokens there are (a
    larger cap selects them all; a ratio whose product overflows is such a cap, not an error)."""
    prod = total.double() * ratio
    most = torch.as_tensor(most, dtype=torch.float64, device=prod.device)
    return torch.where(prod < most, prod.floor(), most).clamp(min=1)


def _cap_bound(ratio, numel: int) -> int:
    """A bound on :func:`_token_cap` known without the data: ``int(ratio * numel) + 1``, at most ``numel``."""
    x = numel * ratio
    return numel if not x < numel else int(x) + 1


def _clip_cov_step(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                   rollout_is_weights=None, *, cu_seqlens=None, seq_group=None, seq_positions=None):
    """Clip-Cov (arXiv:2505.22617, verl ``clip_cov``): PPO clip (log-ratio unbounded, no dual clip) whose tokens
    with covariance cov = (A - mean A)(log pi - mean log pi) in (``clip_cov_lb``, ``clip_cov_ub``), not already
    clipped, lose their gradient, at most max(1, int(``clip_cov_ratio`` * tokens)) of them. verl draws those at
    random when more qualify; here the ones with the largest covariance are taken (equal covariances: the earlier
    token, :func:`_top_positions`), so a run is reproducible. Equal to verl whenever no more tokens qualify than
    the cap. The cap is read from the data (a host sync on CUDA) unless ``response_mask`` is bool. Metrics:
    ``actor/pg_clipfrac`` (tokens cut), ``actor/ppo_kl``.

    ``seq_group`` (context parallelism): the means, the token count, the cap and the metrics are those of the whole
    micro-batch (one all-reduce of B + 7 numbers, B + 8 or 2B + 7 for seq-mean-token-sum-norm), the tokens cut
    are the global selection (one all-gather of ``[cap, 4]`` fp64 per rank; the cap is read on the host, a sync on
    CUDA) and each rank returns its share of the loss: :func:`aggregate_rows` of its own rows with the whole
    sequences' token counts, so the shares add up to the one-process loss and each rank's gradient is the
    one-process gradient on its tokens."""
    fn = "compute_policy_loss_clip_cov"
    cfg = _prologue(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                    cu_seqlens)
    # the IS weights reach the kernel inside its own (detached) weights below: checked here, or dropped silently
    refuse_grad(fn, old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights)
    acc = _checks.acc_dtype(log_prob.dtype)
    cp = _seq_world(seq_group)
    whole = None
    with torch.no_grad():
        # [B, T] temporaries in reused blocks on the CPU (ops.scratch_empty, one slot each): two of acc for the
        # masked sums, the ratios, then the covariance (its top-k masking in place) and the cut tokens; the
        # kernel's weights; the masks.
        shape, dev = log_prob.shape, log_prob.device
        m = _in_dtype(response_mask, acc, _SLOT_MASK)
        s0, s1 = ops.scratch_empty(shape, acc, dev, 0), ops.scratch_empty(shape, acc, dev, 1)
        valid = _valid(response_mask, m, s0)
        lp, adv = log_prob.detach().to(acc), advantages.to(acc)
        # the means as verl_F.masked_mean forms them, sum(x * mask) / (mask.sum() + 1e-8), the denominator in verl's
        # type (fp32 for a bool / int / fp32 mask: the eps rounds away, and with the sums below the mean of equal
        # values is that value, so their covariances are 0, not the +-1e-9 a strict cov > clip_cov_lb = 0 would
        # cut); the covariance in acc (verl subtracts the 0-dim mean in x's dtype)
        if response_mask.dtype == torch.float64 and acc != torch.float64:
            # the cap and the count in fp64, too (100 weights of 0.1: 9.999999 in fp32)
            m_sum = _checks.ordered_sum(response_mask)
            adv_sum, lp_sum = ((_checks.ordered_sum(x.double() * response_mask, nan=True),
                                x.new_zeros((), dtype=torch.float64)) for x in (adv, lp))
        else:
            m_sum = _checks.ordered_sum(m)
            adv_sum, lp_sum = _mean_parts(adv, m, s0), _mean_parts(lp, m, s1)  # (hi, lo): a constant side exact
        if cp > 1:  # the micro-batch's sums over every rank's tokens, and the kernel's ppo_kl numerator (unclamped)
            kl_sum = _masked_total(torch.sub(old_log_prob.to(acc), lp, out=s0), m, s0)
            tokens = torch.tensor(float(m.numel()), dtype=torch.float64, device=dev)  # the cap's upper bound
            whole = _whole_sums((m_sum, *adv_sum, *lp_sum, kl_sum, tokens), m, log_prob, cu_seqlens, loss_agg_mode,
                                cfg, seq_group)
            m_sum, kl_sum, tokens = whole.sums[0], whole.sums[5], whole.sums[6]
            adv_sum, lp_sum = whole.sums[1:3], whole.sums[3:5]
        count_dtype = response_mask.dtype if response_mask.dtype.is_floating_point else torch.get_default_dtype()
        den = m_sum.to(count_dtype) + LY.MASKED_MEAN_EPS  # verl_F.masked_mean's denominator, in verl's type
        # verl's clip_by_origin: -A clip(r) > -A r, i.e. A clip(r) < A r (negation is exact and flips the order;
        # NaN compares false either way)
        ratio = torch.sub(lp, old_log_prob.to(acc), out=s0).exp_()
        adv_r = torch.mul(adv, ratio, out=s1)
        eligible = ops.scratch_empty(shape, torch.bool, dev, _SLOT_ELIGIBLE)
        # the bounds within acc's range (a clip_ratio of 1e39 is no bound; clamp_ refuses a bound past the dtype's
        # range): the same clip for every ratio acc holds
        big = torch.finfo(acc).max
        clipped = ratio.clamp_(max(1 - cfg.clip_low, -big), min(1 + cfg.clip_high, big)).mul_(adv)
        _flag(torch.lt, clipped, adv_r, eligible, clipped)  # clipped (its float flags over the products)
        del ratio, adv_r, clipped
        cov = torch.sub(adv, _mean(adv_sum, den), out=s0).mul_(torch.sub(lp, _mean(lp_sum, den), out=s1))
        # (cov < ub) & (cov > lb) & valid & ~(clipped & valid), without the repeated mask
        test = ops.scratch_empty(shape, torch.bool, dev, _SLOT_TEST)
        eligible.logical_not_().logical_and_(valid)
        eligible.logical_and_(_flag(torch.lt, cov, cfg.clip_cov_ub, test, s1))
        eligible.logical_and_(_flag(torch.gt, cov, cfg.clip_cov_lb, test, s1))
        del test
        if cp == 1 and response_mask.dtype == torch.bool:  # count <= ratio * numel: a bound known without the data
            count = _token_cap(cfg.clip_cov_ratio, m_sum, m.numel())
            bound = _cap_bound(cfg.clip_cov_ratio, m.numel())
        elif cp == 1 and torch.compiler.is_compiling():  # traced: no host read (it would break the graph); the
            # mask sum asserted at run time, and every token a bound (mask weights may exceed 1)
            torch._assert_async(torch.isfinite(m_sum), "response_mask: the mask weights' sum is NaN or inf (a "
                                "weight NaN or inf, or a sum past the dtype's range); a weight must be finite and >= 0")
            count = _token_cap(cfg.clip_cov_ratio, m_sum, m.numel())
            bound = m.numel()
        else:  # CP: the global cap, the same int on every rank (the records' length); mask weights may exceed 1
            # (verl counts sum(mask)): read the mask sum and the token count (one host sync on CUDA only)
            count = _token_cap(cfg.clip_cov_ratio, m_sum, m.numel() if whole is None else tokens)
            s, c = torch.stack([m_sum.double(), count]).tolist()  # one read
            if not math.isfinite(s):  # a NaN / inf mask weight: named here (this rank's), not taken as a cap
                _checks.check_weight_mask("response_mask", m)  # as summed (in acc)
                raise ValueError("response_mask: the mask weights' sum is NaN or inf (a weight NaN or inf on another "
                                 "rank, or a sum past the dtype's range); a weight must be finite and >= 0")
            bound = int(c)
        idx, keep, cut_sum = _top_positions(cov, eligible, count, bound, seq_group=seq_group,
                                            cu_seqlens=cu_seqlens, weight=m, overwrite=True,
                                            seq_positions=_seq_positions(seq_positions, log_prob, cp, fn))
        del cov, eligible
        # The kernel's weights (alive until the backward): the cut indicator's complement corr (1, 0 at the cut
        # tokens) times the IS weights, written only where a token is cut (1 * w == w).
        corr = (~keep).to(acc)
        w = ops.scratch_empty(shape, acc, dev, _SLOT_WEIGHTS)
        if rollout_is_weights is None:
            w.fill_(1.0)
            w.view(-1)[idx] = corr
        else:
            w.copy_(rollout_is_weights.detach())
            w_flat = w.view(-1)
            w_flat[idx] = corr * w_flat[idx]
        if cut_sum is None and response_mask.dtype == torch.bool:
            # masked_mean(corr == 0, m): the cut tokens' mask values, each 0 or 1 here (m's bytes clamped), so their
            # sum is the count in any order (exact below 2^24): the dense sum's bits without the dense pass
            cut_sum = torch.where(keep, m.reshape(-1)[idx], 0.0).sum()
        if cut_sum is None:
            # masked_mean(corr == 0, m): the cut tokens' mask values (weights: their sum rounds by order), summed over
            # the same dense [B, T] as before
            cut = s1.zero_()
            cut.view(-1)[idx] = torch.where(keep, m.reshape(-1)[idx], 0.0)
            cut_sum = _checks.ordered_sum(cut)
        del s0, s1
        clipfrac = cut_sum.to(acc) / den
    # Under context parallelism the loss is aggregated again below, over the whole sequences' token counts.
    loss, _, rows = policy_loss_step(LY.PG_KIND_PPO_UNBOUNDED, old_log_prob, log_prob, advantages, response_mask,
                                     loss_agg_mode, cfg, w, cu_seqlens=cu_seqlens, fn=fn, metric_keys=(),
                                     rows_grad=whole is not None)
    if whole is None:
        ppo_kl = _row_metrics(rows, ("actor/ppo_kl",))["actor/ppo_kl"]
    else:
        loss = aggregate_rows(rows[:, LY.PG_ROW_LOSS_SUM], whole.row_tokens, loss_agg_mode,
                              _horizon(whole, log_prob, cu_seqlens), **cfg.global_batch_info)
        # as _row_metrics divides in one process (the count in the rows' type + 1e-8), not by den (the covariance
        # means' count, in verl's type: without the 1e-8 for a bool mask)
        ppo_kl = kl_sum / (m_sum.to(kl_sum.dtype) + LY.MASKED_MEAN_EPS)
    return loss, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl}, rows


def _seq_positions(seq_positions, log_prob: torch.Tensor, cp: int, fn: str) -> Optional[torch.Tensor]:
    """The covariance losses' ``seq_positions`` checked (an integer tensor of log_prob's shape), or None; read only
    under context parallelism (one process orders tokens by their own positions)."""
    if seq_positions is None:
        return None
    if not isinstance(seq_positions, torch.Tensor) or seq_positions.is_floating_point() or \
            seq_positions.dtype == torch.bool or tuple(seq_positions.shape) != tuple(log_prob.shape) or \
            seq_positions.device != log_prob.device:
        raise ValueError(f"{fn}: seq_positions must be an integer tensor of log_prob's shape {tuple(log_prob.shape)} "
                         f"on {log_prob.device}, got {getattr(seq_positions, 'dtype', type(seq_positions))} "
                         f"{tuple(getattr(seq_positions, 'shape', ()))}")
    return seq_positions if cp > 1 else None


def _horizon(whole: "_WholeSums", log_prob, cu_seqlens):
    """The padded length of :func:`aggregate_rows`: the whole sequences' when it was reduced (the local one is then
    not read)."""
    return whole.horizon if whole.horizon is not None else padded_horizon(log_prob, cu_seqlens)


def _row_of(idx: torch.Tensor, log_prob: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """The row (padded) or segment (packed) of each flat token position ``idx``."""
    if cu_seqlens is None:
        return torch.div(idx, max(1, log_prob.shape[-1]), rounding_mode="floor")
    return torch.searchsorted(cu_seqlens.to(torch.int64), idx, right=True) - 1


def _kl_cov_step(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None, *, cu_seqlens=None, seq_group=None, seq_positions=None):
    """KL-Cov (arXiv:2505.22617, verl ``kl_cov``): L = -A r (log-ratio unbounded, no clip), plus
    ``ppo_kl_coef`` |log pi - log pi_old| on the max(1, int(``kl_cov_ratio`` * tokens)) valid tokens with the
    largest covariance (A - mean A)(log pi - mean log pi) (means over the valid tokens; equal covariances: the
    earlier token, :func:`_top_positions`). Metric: ``actor/ppo_kl`` = mean |log pi - log pi_old|, as verl logs it.

    ``seq_group`` (context parallelism): the means, the token count, the metric and the sequences' token counts are
    those of the whole micro-batch (one all-reduce of B + 7 numbers, B + 8 or 2B + 7 for
    seq-mean-token-sum-norm), the penalised tokens are the global top-k (one all-gather of ``[k, 4]`` fp64 per rank;
    k is read on the host, a sync on CUDA), and each rank returns its share of the loss (:func:`aggregate_rows` of
    its own rows with the whole sequences' token counts: the shares add up to the one-process loss, and each rank's
    gradient is the one-process gradient on its tokens)."""
    fn = "compute_policy_loss_kl_cov"
    cfg = _prologue(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                    cu_seqlens)
    refuse_grad(fn, old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights)
    acc = _checks.acc_dtype(log_prob.dtype)
    cp = _seq_world(seq_group)
    whole = None
    with torch.no_grad():
        # [B, T] temporaries in reused blocks on the CPU (ops.scratch_empty, one slot each): two of acc for the
        # masked sums, then the covariance (its top-k masking in place) and the |log-ratio| metric; the masks.
        shape, dev = log_prob.shape, log_prob.device
        m = _in_dtype(response_mask, acc, _SLOT_MASK)
        lp, adv = log_prob.detach().to(acc), advantages.to(acc)
        s0, s1 = ops.scratch_empty(shape, acc, dev, 0), ops.scratch_empty(shape, acc, dev, 1)
        valid = _valid(response_mask, m, s0)
        flags = m if valid is response_mask else s0  # valid's float flags
        n = _count(flags, valid)  # valid.sum() as int64, from its float flags

        def abs_kl_sum(out):  # actor/ppo_kl's numerator: masked_sum(|lp - lp_old|, m), in ``out``
            return _masked_total(torch.sub(lp, old_log_prob.to(acc), out=out).abs_(), m, out)

        # sums, for now: over the tokens with m > 0, unweighted (valid's float flags as the weights), as (hi, lo)
        # parts (a constant side's covariances are then 0)
        mean_a, mean_lp = _mean_parts(adv, flags, s1), _mean_parts(lp, flags, s1)
        if cp > 1:  # the micro-batch's sums over every rank's tokens
            sums = (n.to(acc), *mean_a, *mean_lp, abs_kl_sum(s0), _checks.ordered_sum(m))
            whole = _whole_sums(sums, m, log_prob, cu_seqlens, loss_agg_mode, cfg, seq_group)
            n, kl_sum, m_sum = whole.sums[0], whole.sums[5], whole.sums[6]
            mean_a, mean_lp = whole.sums[1:3], whole.sums[3:5]
            n = n.round().to(torch.int64)  # the count in the dtype one process has (the cap is computed from it)
        mean_a = _mean(mean_a, n.clamp(min=1))
        mean_lp = _mean(mean_lp, n.clamp(min=1))
        cov = torch.sub(adv, mean_a, out=s0).mul_(torch.sub(lp, mean_lp, out=s1))
        count = _token_cap(cfg.kl_cov_ratio, n, n)
        # the global k under context parallelism (the same int on every rank), else a bound known without the data
        bound = int(count.item()) if cp > 1 else _cap_bound(cfg.kl_cov_ratio, valid.numel())
        idx, keep, _ = _top_positions(cov, valid, count, bound, seq_group=seq_group, cu_seqlens=cu_seqlens,
                                      overwrite=True, seq_positions=_seq_positions(seq_positions, log_prob, cp, fn))
        if whole is None:  # in cov's buffer
            kl_sum, m_sum = abs_kl_sum(cov), _checks.ordered_sum(m)
        ppo_kl = kl_sum / (m_sum + LY.MASKED_MEAN_EPS)
        del cov, s0, s1
        # The penalty lives on the selected tokens only, masked as agg_loss masks every token (where(m != 0, v, 0) *
        # m): its per-token factor.
        # 1e308 is inf in fp32: an inf loss (and NaN gradients), silently
        _checks.check_finite_in(cfg.ppo_kl_coef, acc, f"{fn}: ppo_kl_coef must be finite in the compute type ({acc})")
        scale = cfg.ppo_kl_coef * keep.to(acc)
        if rollout_is_weights is not None:
            scale = scale * rollout_is_weights.detach().reshape(-1)[idx].to(acc)
        m_sel = m.reshape(-1)[idx]
        scale = torch.where(m_sel != 0, scale, torch.zeros_like(scale)) * m_sel
        row_idx = _row_of(idx, log_prob, cu_seqlens)
    loss_sums, rows = _RowsWithPenalty.apply(ops.first_order_only(log_prob, fn), old_log_prob, advantages,
                                             response_mask, rollout_is_weights, cu_seqlens, idx, row_idx, scale)
    with torch.no_grad():  # agg_loss's token counts (after the op, which checks cu_seqlens)
        row_tokens = _row_sums(m, cu_seqlens) if whole is None else whole.row_tokens
    horizon = padded_horizon(log_prob, cu_seqlens) if whole is None else _horizon(whole, log_prob, cu_seqlens)
    loss = aggregate_rows(loss_sums, row_tokens, loss_agg_mode, horizon, **cfg.global_batch_info)
    return loss, {"actor/ppo_kl": ppo_kl}, rows


def _penalty_overflow(log_prob: torch.Tensor, cu_seqlens, idx: torch.Tensor, i: int) -> str:
    """kl_cov's error for the ``i``-th selected token, whose penalty overflowed, named as the kernel names a token."""
    flat = int(idx[i])
    at = (flat,) if cu_seqlens is not None or log_prob.dim() == 1 else divmod(flat, max(1, log_prob.shape[-1]))
    return (f"compute_policy_loss_kl_cov: the penalty ppo_kl_coef * |log_prob - old_log_prob| * weight at response "
            f"token {tuple(at)} is past the float range (a token loss past it is refused by every loss)")


class _RowsWithPenalty(torch.autograd.Function):
    """kl_cov's per-row loss sums: the kernel's (-A r, unbounded; its rows returned too, not differentiable) plus,
    on the selected tokens ``idx`` (rows ``row_idx``), ``scale * |log pi - log pi_old|``. One autograd node, so the
    penalty's gradient (k values) is added in place into the kernel's gradient: no dense [B, T] gradient of the k
    tokens built and summed with it."""

    @staticmethod
    def forward(ctx, log_prob, old_log_prob, advantages, response_mask, weights, cu_seqlens, idx, row_idx, scale):
        weights = None if weights is None else weights.detach()
        _, rows = ops.policy_loss_rows(log_prob, old_log_prob, advantages, response_mask, weights, math.inf, math.inf,
                                       math.inf, LY.PG_KIND_PPO_UNBOUNDED, cu_seqlens, with_loss_mat=False)
        x = log_prob.reshape(-1)[idx].to(scale.dtype) - old_log_prob.reshape(-1)[idx].to(scale.dtype)
        x = torch.where(scale != 0, x, torch.zeros_like(x))  # a token that adds nothing: its x (maybe NaN) unread
        token = scale * x.abs()
        # a penalty past the float range is a token loss past it, refused by every kind (the kernel's rule)
        _checks.refuse_where(~torch.isfinite(token), lambda at: _penalty_overflow(log_prob, cu_seqlens, idx, at[0]),
                             "compute_policy_loss_kl_cov: a selected token's penalty ppo_kl_coef * |log_prob - "
                             "old_log_prob| * weight is past the float range")
        penalty = torch.zeros(rows.shape[0], dtype=scale.dtype, device=rows.device).index_add(0, row_idx, token)
        ctx.save_for_backward(log_prob, old_log_prob, advantages, response_mask, weights, cu_seqlens, idx, row_idx,
                              scale, x)
        ctx.mark_non_differentiable(rows)
        ctx.set_materialize_grads(False)
        return rows[:, LY.PG_ROW_LOSS_SUM] + penalty, rows

    @staticmethod
    def backward(ctx, grad_sums, _grad_rows):
        if grad_sums is None or not ctx.needs_input_grad[0]:
            return (None,) * 9
        log_prob, old_log_prob, advantages, response_mask, weights, cu_seqlens, idx, row_idx, scale, x = \
            ctx.saved_tensors
        # idx counts row-major tokens: the gradient written there must be row-major (the fallback's follows the
        # inputs' layout; a transposed mask made .view(-1) fail)
        grad = ops.policy_loss_backward(grad_sums, log_prob, old_log_prob, advantages, response_mask, weights,
                                        math.inf, math.inf, math.inf, LY.PG_KIND_PPO_UNBOUNDED, cu_seqlens).contiguous()
        # d(scale |x|)/dx = scale sgn(x) (0 at x = 0, as torch's abs), times the row's gradient
        pen = grad_sums[row_idx] * scale * torch.sgn(x)
        if grad.dtype not in (torch.float16, torch.bfloat16):
            grad.view(-1).index_add_(0, idx, pen.to(grad.dtype))
            return (grad,) + (None,) * 8
        # 16-bit: the k selected tokens' kernel gradient again in fp32 (each token a row of one, with its row's
        # gradient), the penalty's added to it there, then one rounding, as every other token's gradient has
        def sel(t):
            t = t.detach().expand(log_prob.shape).reshape(-1)[idx].unsqueeze(1)
            return t.to(torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t

        g32 = ops.policy_loss_backward(grad_sums[row_idx].to(torch.float32).contiguous(), sel(log_prob),
                                       sel(old_log_prob), sel(advantages), sel(response_mask),
                                       None if weights is None else sel(weights), math.inf, math.inf, math.inf,
                                       LY.PG_KIND_PPO_UNBOUNDED, None)
        grad.view(-1).index_copy_(0, idx, (g32.reshape(-1).to(pen.dtype) + pen).to(grad.dtype))
        return (grad,) + (None,) * 8


def _without_rows(step, mode: str):
    """The public ``compute_policy_loss_<mode>`` of a whole-batch step: its ``(loss, metrics)``; :func:`policy_step`
    also reads the step's rows (their token counts)."""

    @functools.wraps(step)
    def loss_fn(*args, **kwargs):
        loss, metrics, _ = step(*args, **kwargs)
        return loss, metrics

    loss_fn.__name__ = loss_fn.__qualname__ = "compute_policy_loss_" + mode
    return loss_fn


#: The losses whose step needs whole-batch statistics (covariances over the batch, GMPO's mean over its sequences):
#: their own functions, each returning ``(loss, metrics, rows)``.
_WHOLE_BATCH_STEPS = {"geo_mean": _geo_mean_step, "clip_cov": _clip_cov_step, "kl_cov": _kl_cov_step}
WHOLE_BATCH_LOSSES = tuple(_WHOLE_BATCH_STEPS)
compute_policy_loss_geo_mean = _without_rows(_geo_mean_step, "geo_mean")
compute_policy_loss_clip_cov = _without_rows(_clip_cov_step, "clip_cov")
compute_policy_loss_kl_cov = _without_rows(_kl_cov_step, "kl_cov")


def _correction(log_prob, rollout_log_prob, response_mask, rc, dp_group, seq_group, cu_seqlens=None,
                rollout_name: str = "rollout_log_prob", **options):
    """:func:`compute_rollout_correction` under no_grad (``options``: its ``diagnostics``, ``nonfinite``, ``empty``)."""
    from .correction import compute_rollout_correction

    refuse_grad("rollout correction", **{rollout_name: rollout_log_prob})  # its weights and mask are constants

    with torch.no_grad():
        return compute_rollout_correction(log_prob.detach(), rollout_log_prob.detach(), response_mask, rc,
                                          dp_group=dp_group, seq_group=seq_group, cu_seqlens=cu_seqlens, **options)


def compute_policy_loss_bypass(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[PolicyLossConfig] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    dp_group=None,
    seq_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Bypass mode (two policies): ``old_log_prob`` **is** the rollout policy's log-prob.

    Rollout correction is computed here, under no_grad, from pi_theta (``log_prob`` detached) vs pi_rollout
    with ``config.rollout_correction``; its RS mask replaces ``response_mask``. Then, on
    ``config.rollout_correction.loss_type``:

    * ``"ppo_clip"``: PPO clip of pi_theta against pi_rollout; the IS weights are only logged (the clipped
      ratio already is the importance ratio, applying w too would count it twice).
    * ``"reinforce"``: L = -A lp w with the IS weights applied.

    ``rollout_is_weights`` is ignored (computed internally), as in verl. Metrics: the loss's plus every
    ``rollout_corr/*`` metric of the correction (global over ``dp_group``).
    """
    fn = "compute_policy_loss_bypass"
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, cu_seqlens=cu_seqlens)
    refuse_grad(fn, old_log_prob=old_log_prob)  # by this function's name for it (the step's: rollout_log_prob)
    step = policy_step(config, None, log_prob, advantages, response_mask, loss_agg_mode,
                       rollout_log_prob=old_log_prob, dp_group=dp_group, seq_group=seq_group, cu_seqlens=cu_seqlens,
                       flow="bypass", rows_grad=False, fn=fn)
    return step.loss, step.metrics


def off_policy_sequence_mask(
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    seq_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking (DeepSeek-V3.2 technical report): a sequence whose advantage is negative and whose
    sampled tokens drifted, mean_t (log pi_behaviour - log pi_theta) > ``delta`` (the k1 estimate of
    KL(pi_behaviour || pi_theta) on its own tokens), is left out of the loss. Decided per sequence: the sums run
    over every token of the sequence, packed rows (``cu_seqlens``) and sequences split over context-parallel ranks
    (``seq_group``: one all-reduce of [3, B] sums) included. The sequence's advantage is the mean of ``advantages``
    over its tokens (GRPO's per-sequence advantage).

    Returns ``(mask, masked_frac)``: ``response_mask`` with the dropped sequences zeroed (its dtype; the input is
    not modified) and the fraction of sequences with tokens that were dropped (a 0-dim tensor; no host sync).
    """
    mask, dropped, has = _opsm(log_prob, behaviour_log_prob, advantages, response_mask, delta, cu_seqlens, seq_group)
    return mask, dropped / has.clamp(min=1)


def _opsm(log_prob, behaviour_log_prob, advantages, response_mask, delta, cu_seqlens, seq_group):
    """:func:`off_policy_sequence_mask`'s mask, and its counts of dropped sequences and of sequences with tokens (0-dim,
    in the accumulation dtype): summed over micro-batches and ranks they give the pooled fraction."""
    check_policy_inputs(behaviour_log_prob, log_prob, advantages, response_mask, old_name="behaviour_log_prob",
                         cu_seqlens=cu_seqlens)
    d = _finite_real("delta", delta, minimum=0.0)
    acc = _checks.acc_dtype(log_prob.dtype)
    with torch.no_grad():
        m = response_mask.to(acc)
        drift = _checks.masked(behaviour_log_prob.to(acc) - log_prob.detach().to(acc), m)
        adv = _checks.masked(advantages.to(acc), m)
        sums = _seq_all_reduce(torch.stack([_row_sums(drift, cu_seqlens), _row_sums(adv, cu_seqlens),
                                            _row_sums(m, cu_seqlens)]), seq_group)
        has = sums[2] > 0
        n = sums[2].clamp(min=1)
        dropped = has & (sums[1] / n < 0) & (sums[0] / n > d)
        keep = _per_token(~dropped, log_prob, cu_seqlens)
        mask = torch.where(keep, response_mask, torch.zeros((), dtype=response_mask.dtype, device=response_mask.device))
    return mask, dropped.sum().to(acc), has.sum().to(acc)


def _opsm_aware(fn):
    """``fn`` (a ``compute_policy_loss_<name>``) honouring ``config.opsm_delta`` when called on its own (as the verl
    adapter and verl's registry call it): off-policy sequence masking with ``old_log_prob`` as the behaviour policy
    (verl's pi_old; pi_rollout in bypass mode) before the loss, metric ``actor/opsm_masked_frac``.
    :func:`policy_step` applies it itself (with ``rollout_log_prob`` when given) and runs the losses' own steps, not
    these wrappers."""
    import inspect

    sig = inspect.signature(fn)
    config_at = list(sig.parameters).index("config")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        # the config first, without binding the whole signature (a per-call cost when OPSM is off, the usual case)
        config = args[config_at] if len(args) > config_at else kwargs.get("config")
        if config is None or (isinstance(config, PolicyLossConfig) and config.opsm_delta is None):
            return fn(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        cfg = as_policy_config(a["config"])
        if cfg.opsm_delta is None:
            return fn(*args, **kwargs)
        behaviour = a["old_log_prob"] if "old_log_prob" in a else a["rollout_log_prob"]
        mask, frac = off_policy_sequence_mask(a["log_prob"], behaviour, a["advantages"], a["response_mask"],
                                              cfg.opsm_delta, cu_seqlens=a.get("cu_seqlens"),
                                              seq_group=a.get("seq_group"))
        a["response_mask"], a["config"] = mask, dataclasses.replace(cfg, opsm_delta=None)
        loss, metrics = fn(*bound.args, **bound.kwargs)
        metrics = dict(metrics)
        metrics["actor/opsm_masked_frac"] = frac
        return loss, metrics

    return wrapped


for _name in ("vanilla", "reinforce", "dppo_tv", "dppo_kl", "sapo", "cispo", "dro", "gpg", "gspo", "geo_mean",
              "clip_cov", "kl_cov"):
    globals()["compute_policy_loss_" + _name] = _opsm_aware(globals()["compute_policy_loss_" + _name])
del _name


#: The flows of :func:`policy_step`: no correction, bypass (pi_old = pi_rollout), decoupled (pi_old, pi_rollout).
POLICY_FLOWS = ("plain", "bypass", "decoupled")


class PolicyStep(NamedTuple):
    """One policy step (:func:`policy_step`), everything its callers report, each in its own convention.

    Attributes:
        loss: the scalar loss, aggregated by ``loss_agg_mode`` with the config's normalisers (a whole-batch loss:
            its own value; under context parallelism this rank's share of it, the shares of ``seq_group`` adding up
            to the one-process value).
        loss_metrics: the loss's verl metrics (0-dim tensors over this call's tokens; a whole-batch loss's over
            the whole sequences of ``seq_group``).
        rows: the ``[B, K]`` row partials of the fused kernel (``LY.PG_ROW_*``; the loss column carries the
            gradient); for a whole-batch loss those of its own kernel pass, of which the token counts are meant.
        mask: the mask the loss ran on (the correction's RS and OPSM applied).
        flow: one of :data:`POLICY_FLOWS`.
        whole_batch: the loss is one of :data:`WHOLE_BATCH_LOSSES` (``loss`` and ``loss_metrics`` are its own).
        correction_metrics: the correction's ``rollout_corr/*`` metrics, exact over ``dp_group`` (empty: none ran).
        opsm_frac: ``actor/opsm_masked_frac`` (None: ``opsm_delta`` is off).
        opsm_counts: its numerator and denominator (dropped sequences, sequences with tokens; None: off), for a
            caller that sums metrics over micro-batches (megatron's ``[sum, count]`` pairs).
        gspo_x_sum: GSPO's sum of this rank's masked log-ratios, its ``actor/ppo_kl`` numerator (None: not GSPO).
        prox_error: the proximal approximation's error metrics (empty unless ``versions`` and pi_old both came).
    """

    loss: torch.Tensor
    loss_metrics: Dict[str, torch.Tensor]
    rows: torch.Tensor
    mask: torch.Tensor
    flow: str
    whole_batch: bool
    correction_metrics: Dict[str, torch.Tensor]
    opsm_frac: Optional[torch.Tensor]
    gspo_x_sum: Optional[torch.Tensor]
    prox_error: Dict[str, torch.Tensor]
    opsm_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def metrics(self) -> Dict[str, torch.Tensor]:
        """Every metric in one new dict, as :func:`compute_policy_loss` returns them."""
        out = dict(self.loss_metrics)
        if self.opsm_frac is not None:
            out["actor/opsm_masked_frac"] = self.opsm_frac
        out.update(self.correction_metrics)
        out.update(self.prox_error)
        return out


def check_bypass_loss_mode(cfg: PolicyLossConfig, fn: str) -> None:
    """A config whose rollout correction selects the bypass flow runs ``rollout_correction.loss_type`` (PPO clip or
    REINFORCE against pi_rollout): a ``loss_mode`` naming another loss would be ignored, silently, so it is a
    ValueError naming ``fn``. (The functions named for the bypass loss, verl's ``compute_policy_loss_bypass_mode``
    and :func:`compute_policy_loss_bypass`, read only the correction's fields, as verl's does.)"""
    rc = cfg.rollout_correction
    if rc is not None and getattr(rc, "bypass_mode", False) and cfg.loss_mode not in ("vanilla", "bypass_mode"):
        raise ValueError(f"{fn}: the bypass flow's loss is rollout_correction.loss_type (PPO clip or REINFORCE "
                         f"against pi_rollout), not loss_mode={cfg.loss_mode!r}; set loss_mode='bypass_mode' (or "
                         f"'vanilla'), or use the plain flow with old_log_prob = rollout_log_prob for "
                         f"{cfg.loss_mode}")


def policy_step(
    config,
    old_log_prob: Optional[torch.Tensor],
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_log_prob: Optional[torch.Tensor] = None,
    dp_group=None,
    seq_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    versions: Optional[torch.Tensor] = None,
    current_version: Optional[int] = None,
    proximal: str = "loglinear",
    diagnostics=None,
    nonfinite: str = "error",
    empty: str = "error",
    flow: Optional[str] = None,
    loss_share: bool = True,
    rows_grad: bool = True,
    seq_positions: Optional[torch.Tensor] = None,
    fn: str = "policy_step",
) -> PolicyStep:
    """The policy step every entry point runs (:func:`compute_policy_loss`, megatron's ``loss_func``, the verl
    adapter's bypass loss): choose the flow, correct, mask, loss. The flow is ``flow``, or from
    ``config.rollout_correction``: None -> ``"plain"``, ``bypass_mode`` -> ``"bypass"``, else ``"decoupled"``.

    1. Decoupled with ``versions``: pi_old approximated from them (:func:`rollout_corr_ext.versions.proximal_log_prob`,
       ``proximal``) when ``old_log_prob`` is None, else the approximation's error metrics (over ``dp_group``).
    2. The rollout correction (bypass: of pi_theta detached, decoupled: of pi_old, vs ``rollout_log_prob``; its
       ``diagnostics``, ``nonfinite`` and ``empty`` as :func:`compute_rollout_correction` takes them): its RS mask
       replaces ``response_mask``; its IS weights multiply the loss in the decoupled flow and in bypass REINFORCE.
    3. ``config.opsm_delta``: :func:`off_policy_sequence_mask` (behaviour = ``rollout_log_prob`` when given, else
       pi_old).
    4. The loss: bypass, ``rollout_correction.loss_type`` against pi_rollout (a ``config.loss_mode`` other than
       ``vanilla`` / ``bypass_mode`` is refused when the flow comes from the config: :func:`check_bypass_loss_mode`);
       otherwise ``config.loss_mode``: a per-token loss in the fused kernel (GSPO with its sequence ratio over
       ``seq_group``), or a whole-batch loss's own function, exact over ``seq_group`` (each rank's ``loss`` is then
       its share of the one-process loss: the shares add up to it, and each rank's gradient is the one-process
       gradient on its tokens; the metrics are the one-process values).
    5. Context parallelism (``seq_group`` of more than one rank) and a per-token loss: with ``loss_share`` (the
       default) ``loss`` is this rank's share of the one-process loss too, as for the whole-batch losses:
       :func:`aggregate_rows` of its row loss sums with the whole sequences' token counts (one all-reduce of B
       numbers, B + 1 or 2B for ``seq-mean-token-sum-norm``), each rank's gradient the one-process gradient on its
       tokens; the per-token loss's metrics stay this rank's. ``loss_share=False``: this rank's own aggregate, no
       collective, for a caller that combines the ranks' row sums itself (megatron's ``loss_func``).

    ``seq_positions`` (context parallelism, clip_cov / kl_cov): each token's position in its whole sequence (or the
    whole packed stream), so that the covariance selection breaks exact ties in the one-process order whatever the
    split (:func:`_top_positions`); without it, by rank then local position.

    ``rows_grad=False``: the caller reads ``rows`` for metrics only (a per-token loss's ``rows`` is then detached, its
    kernel and aggregation one autograd node: :func:`policy_loss_step`). ``fn`` names the caller in error messages.
    Returns a :class:`PolicyStep`.
    """
    cfg = as_policy_config(config)
    rc = cfg.rollout_correction
    from .versions import PROXIMAL_METHODS

    if proximal not in PROXIMAL_METHODS:  # checked with or without versions: a typo is named, not kept for later
        raise ValueError(f"proximal must be one of {PROXIMAL_METHODS}, got {proximal!r}")
    if empty not in ("error", "nan"):  # likewise, with or without a correction
        raise ValueError(f"empty must be 'error' or 'nan', got {empty!r}")
    if flow is None:
        check_bypass_loss_mode(cfg, fn)
        flow = "plain" if rc is None else ("bypass" if getattr(rc, "bypass_mode", False) else "decoupled")
    elif flow not in POLICY_FLOWS:
        raise ValueError(f"flow must be one of {POLICY_FLOWS} or None, got {flow!r}")
    if flow != "plain":
        if rc is None:
            raise ValueError(f"{fn} needs config.rollout_correction (a RolloutCorrectionConfig); got None")
        if rollout_log_prob is None:
            raise ValueError("rollout_log_prob is required when config.rollout_correction is set")
    if flow == "bypass":
        if rc.loss_type not in ("ppo_clip", "reinforce"):  # the config validates this; kept for configs built otherwise
            raise ValueError(f"rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {rc.loss_type!r}")
    elif cfg.loss_mode == "bypass_mode":
        raise ValueError("loss_mode='bypass_mode' needs config.rollout_correction with bypass_mode=True (the bypass "
                         "flow: pi_old = pi_rollout)")
    whole = flow != "bypass" and cfg.loss_mode in WHOLE_BATCH_LOSSES
    prox_error: Dict[str, torch.Tensor] = {}
    if versions is not None and flow == "decoupled":  # asynchronous rollouts: the proximal policy from the versions
        from . import versions as _versions

        approx = _versions.proximal_log_prob(rollout_log_prob, log_prob, versions, current_version, proximal)
        if old_log_prob is None:
            old_log_prob = approx
        else:
            prox_error = _versions.proximal_error_metrics(approx, old_log_prob, response_mask, dp_group=dp_group)
    old, old_name = (rollout_log_prob, "rollout_log_prob") if flow == "bypass" else (old_log_prob, "old_log_prob")
    check_policy_inputs(old, log_prob, advantages, response_mask, old_name=old_name, cu_seqlens=cu_seqlens)
    if flow == "decoupled":
        _check_float("rollout_log_prob", rollout_log_prob, log_prob)
    check_loss_agg_mode(loss_agg_mode)

    mask, weights, correction_metrics = response_mask, None, {}
    if flow != "plain":
        result = _correction(log_prob if flow == "bypass" else old_log_prob, rollout_log_prob, response_mask, rc,
                             dp_group, seq_group, cu_seqlens, diagnostics=diagnostics, nonfinite=nonfinite,
                             empty=empty)
        mask, correction_metrics = result.response_mask, result.metrics
        if flow == "decoupled" or rc.loss_type == "reinforce":  # bypass PPO clip: the clipped ratio is the IS ratio
            weights = result.weights
    opsm_frac = opsm_counts = None
    if cfg.opsm_delta is not None:  # DeepSeek-V3.2's off-policy sequence masking, per whole sequence
        behaviour = rollout_log_prob if rollout_log_prob is not None else old
        mask, dropped, has = _opsm(log_prob, behaviour, advantages, mask, cfg.opsm_delta, cu_seqlens, seq_group)
        opsm_frac, opsm_counts = dropped / has.clamp(min=1), (dropped, has)
    gspo_x_sum = None
    share = not whole and loss_share and _seq_world(seq_group) > 1  # the loss aggregated again from the rows, below
    rows_grad = rows_grad or share
    if whole:
        order = {} if cfg.loss_mode == "geo_mean" else {"seq_positions": seq_positions}  # the covariance selections'
        loss, loss_metrics, rows = _WHOLE_BATCH_STEPS[cfg.loss_mode](old, log_prob, advantages, mask, loss_agg_mode,
                                                                     cfg, weights, cu_seqlens=cu_seqlens,
                                                                     seq_group=seq_group, **order)
    elif flow == "bypass":
        kind = LY.PG_KIND_REINFORCE if rc.loss_type == "reinforce" else LY.PG_KIND_PPO_CLIP
        loss, loss_metrics, rows = policy_loss_step(kind, old, log_prob, advantages, mask, loss_agg_mode, cfg, weights,
                                                    old_name=old_name, cu_seqlens=cu_seqlens, fn=fn,
                                                    rows_grad=rows_grad)
    else:
        kind, params = _kind_params(cfg.loss_mode, cfg)
        if kind == LY.PG_KIND_GSPO:  # the sequence ratio is a constant computed here: pi_old must be one too
            refuse_grad(fn, **{old_name: old})
            old, gspo_x_sum = gspo_sequence_log_ratio(log_prob, old, mask, cu_seqlens=cu_seqlens, seq_group=seq_group)
        loss_agg_mode = _FORCED_AGG.get(cfg.loss_mode, loss_agg_mode)
        loss, _, rows = policy_loss_step(kind, old, log_prob, advantages, mask, loss_agg_mode, cfg, weights,
                                         old_name=old_name, cu_seqlens=cu_seqlens, fn=fn, params=params,
                                         metric_keys=(), rows_grad=rows_grad)
        loss_metrics = _token_metrics(cfg.loss_mode, rows, gspo_x_sum)
    if share:  # this rank's share of the one-process loss
        with torch.no_grad():
            counts = _whole_sums((), mask.to(rows.dtype), log_prob, cu_seqlens, loss_agg_mode, cfg, seq_group)
        loss = aggregate_rows(rows[:, LY.PG_ROW_LOSS_SUM], counts.row_tokens, loss_agg_mode,
                              _horizon(counts, log_prob, cu_seqlens), **cfg.global_batch_info)
    return PolicyStep(loss, loss_metrics, rows, mask, flow, whole, correction_metrics, opsm_frac, gspo_x_sum,
                      prox_error, opsm_counts)


def compute_policy_loss_decoupled(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[PolicyLossConfig] = None,
    *,
    dp_group=None,
    seq_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Decoupled PPO (three policies): PPO clip of pi_theta against pi_old (the trainer's own recomputed
    log-probs), times w = IS(pi_old / pi_rollout) from ``config.rollout_correction``, over its RS mask.

    verl computes the correction once per training batch in the driver and hands the weights to
    :func:`compute_policy_loss_vanilla`; this is that flow in one call (pass ``dp_group`` so the weights'
    batch normalisation and the metrics are global). Without ``config.rollout_correction`` it is plain PPO.
    ``config.loss_mode`` other than ``"vanilla"`` puts that loss (GSPO, CISPO, ...) in PPO's place, with the same
    weights and mask.
    """
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, cu_seqlens=cu_seqlens)
    _check_float("rollout_log_prob", rollout_log_prob, log_prob)
    check_loss_agg_mode(loss_agg_mode)
    cfg = as_policy_config(config)
    rc = cfg.rollout_correction
    if getattr(rc, "bypass_mode", False):
        raise ValueError("config.rollout_correction.bypass_mode is True: use compute_policy_loss_bypass "
                         "(pi_old = pi_rollout), not the decoupled flow")
    # without a correction this is the plain flow, whose behaviour policy (OPSM's) is then pi_old
    step = policy_step(cfg, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                       rollout_log_prob=None if rc is None else rollout_log_prob, dp_group=dp_group,
                       seq_group=seq_group, cu_seqlens=cu_seqlens, rows_grad=False,
                       fn="compute_policy_loss_decoupled")
    return step.loss, step.metrics


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[PolicyLossConfig] = None,
    *,
    rollout_log_prob: Optional[torch.Tensor] = None,
    dp_group=None,
    seq_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    versions: Optional[torch.Tensor] = None,
    current_version: Optional[int] = None,
    proximal: str = "loglinear",
    seq_positions: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The one entry point a trainer needs: :func:`policy_step`, which picks the flow from
    ``config.rollout_correction``, in verl's ``(loss, metrics)`` form. Padded ``[B, T]`` inputs, or packed ``[T]``
    token streams with ``cu_seqlens`` ``[B + 1]`` (megatron's THD layout).

    * no correction config: the loss ``config.loss_mode`` names (default ``"vanilla"``: PPO) of pi_theta vs
      ``old_log_prob`` (``rollout_log_prob`` unused);
    * ``bypass_mode``: :func:`compute_policy_loss_bypass` with pi_old = ``rollout_log_prob``
      (``old_log_prob`` may be None and is ignored);
    * otherwise: :func:`compute_policy_loss_decoupled` (the ``loss_mode`` loss times the correction's IS weights).

    ``config.opsm_delta`` drops negative-advantage sequences that drifted from the behaviour policy
    (:func:`off_policy_sequence_mask`; behaviour = ``rollout_log_prob`` when given, else ``old_log_prob``) in each
    of these, after the correction's RS and before the loss; metric ``actor/opsm_masked_frac``.

    Asynchronous rollouts (:mod:`rollout_corr_ext.versions`): ``versions`` (the policy version that sampled each
    token, per token or per row) and ``current_version`` (the trainer's) add the staleness metrics
    ``rollout_corr/staleness_{mean,max,min}`` (exact over ``dp_group``). With ``old_log_prob=None`` the decoupled
    flow's pi_old is the proximal policy approximated from the versions (``proximal``: ``"loglinear"`` or
    ``"linear"``, AReaL's) between the behaviour log-probs (``rollout_log_prob``) and pi_theta, with no forward
    pass; when ``old_log_prob`` is given too, the approximation's error against it is logged
    (``rollout_corr/prox_approx_abs_error``, ``_imp_weight_error``).

    ``seq_group`` (context parallelism) with clip_cov / kl_cov: ``seq_positions`` as :func:`policy_step` takes it.
    """
    cfg = as_policy_config(config)
    staleness: Dict[str, torch.Tensor] = {}
    if versions is not None:
        from . import versions as _versions

        if current_version is None:
            raise ValueError("versions need current_version (the trainer's policy version)")
        if rollout_log_prob is None and old_log_prob is None:
            raise ValueError("versions need rollout_log_prob (the behaviour policy's log-probs)")
        stale = _versions.staleness_metrics(versions, current_version, response_mask, dp_group=dp_group)
        staleness = {k: v for k, v in stale.items() if not k.endswith("hist")}
    elif current_version is not None:
        raise ValueError("current_version is given without versions")
    step = policy_step(cfg, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                       rollout_log_prob=rollout_log_prob, dp_group=dp_group, seq_group=seq_group,
                       cu_seqlens=cu_seqlens, versions=versions, current_version=current_version, proximal=proximal,
                       rows_grad=False, seq_positions=seq_positions, fn="compute_policy_loss")
    metrics = step.metrics
    metrics.update(staleness)
    return step.loss, metrics


# ---------------------------------------------------------------------------------------------------------
# Megatron-LM RL's GRPO loss
# ---------------------------------------------------------------------------------------------------------


def _int_list(name, values):
    """Token offsets (a list / tuple of integers, or a 1-D integer torch or numpy array) as Python ints, else an
    error naming ``name`` (int() would truncate 4.7 to 4 and read "4" as 4: another packed layout, silently)."""
    def is_int(v):
        if isinstance(v, torch.Tensor):
            return v.numel() == 1 and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if isinstance(values, torch.Tensor):
        bad = values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool
    elif hasattr(values, "dtype") and hasattr(values, "ndim"):  # a numpy array
        bad = getattr(values.dtype, "kind", "") not in ("i", "u")
    else:
        bad = None
    if bad is not None:
        if bad or values.ndim > 1:
            raise ValueError(f"{name} must be a list or a 1-D integer tensor, got a {values.ndim}-D {values.dtype} "
                             f"array")
        return [int(v) for v in values.tolist()]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list or a 1-D integer tensor, got {type(values).__name__}")
    for i, v in enumerate(values):
        if not is_int(v):
            raise ValueError(f"{name}[{i}] must be an int, got {v!r}")
    return [int(v) for v in values]


def _grpo_packed(lp, advantages, seq_starts, seq_lengths):
    """Megatron-LM's packed bin: (sequence id per position, [in a sequence], cu_seqlens of the segments), or None."""
    if seq_starts is None and seq_lengths is None:
        return None
    if seq_starts is None or seq_lengths is None:
        raise ValueError("packed sequences need both seq_starts and seq_lengths (Megatron-LM passes both)")
    if lp.dim() != 2 or lp.shape[0] != 1:
        raise ValueError(f"with seq_starts / seq_lengths, current_logprobs must be the packed bin [1, bin_size], got "
                         f"shape {tuple(lp.shape)}")
    starts, lengths = _int_list("seq_starts", seq_starts), _int_list("seq_lengths", seq_lengths)
    n, size = len(lengths), lp.shape[1]
    if len(starts) == n + 1:
        # Megatron-LM's packer (megatron/rl/sequence_packing_utils.py, pack_sequences) ends the list with the bin's
        # padded end, a sentinel its calculate_grpo_loss zips away: it must lie past the last sequence's tokens
        end = starts[-1]
        if n and end < starts[-2] + lengths[-1] or not 0 <= end <= size + 1:
            raise ValueError(f"seq_starts has one entry more than seq_lengths ({n}): its last, {end}, must be the "
                             f"bin's padded end (Megatron-LM's sentinel), at or past the last sequence's end "
                             f"({starts[-2] + lengths[-1] if n else 0}) and at most {size + 1} (the {size} "
                             f"log-probs' tokens and one more)")
        starts = starts[:-1]
    elif len(starts) != n:
        raise ValueError(f"seq_starts has {len(starts)} entries but seq_lengths has {n} (one start per sequence, or "
                         f"with Megatron-LM's padded-end sentinel one more)")
    if not isinstance(advantages, torch.Tensor) or advantages.numel() != n:
        raise ValueError(f"advantages must be a tensor of one value per packed sequence ({n}), got "
                         f"{getattr(advantages, 'shape', type(advantages))}")
    # a sequence of length 0 (or 1) owns no log-prob: its end is its start (s - 1 would cut the one before it)
    ends = [min(max(s + ln - 1, s), size) for s, ln in zip(starts, lengths)]
    for i, (s, ln) in enumerate(zip(starts, lengths)):
        if s < 0 or ln < 0:
            raise ValueError(f"seq_starts[{i}] = {s} and seq_lengths[{i}] = {ln} must be >= 0")
        # its tokens past the bin's (the log-probs and one more: Megatron's are [1, bin_size - 1]) would be cut or
        # dropped silently; a sequence of length 0 may start where a full bin ends
        if s + ln > size + 1:
            raise ValueError(f"packed sequence {i} (seq_starts[{i}] = {s}, seq_lengths[{i}] = {ln}) runs past the "
                             f"bin: it ends at token {s + ln} > {size + 1} (the {size} log-probs' tokens and one more)")
        if i and s < max(starts[i - 1], ends[i - 1]):
            raise ValueError(f"packed sequence {i} (start {s}) overlaps sequence {i - 1} (tokens {starts[i - 1]} .. "
                             f"{ends[i - 1] - 1}), or seq_starts is not increasing")
    dev = lp.device
    bounds = sorted({0, size, *[min(s, size) for s in starts], *[max(e, 0) for e in ends]})
    cu = torch.tensor(bounds, dtype=torch.int64, device=dev)
    pos = torch.arange(size, device=dev)
    st = torch.tensor(starts, dtype=torch.int64, device=dev)
    en = torch.tensor(ends, dtype=torch.int64, device=dev)
    seq_id = torch.searchsorted(st, pos, right=True) - 1
    in_seq = (seq_id >= 0) & (pos < en[seq_id.clamp(min=0)]) if n else torch.zeros(size, dtype=torch.bool, device=dev)
    return seq_id, in_seq, cu


#: verl's ``kl_penalty`` estimators (``verl.trainer.ppo.core_algos.kl_penalty_forward``), by their names.
KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str,
               old_log_prob: Optional[torch.Tensor] = None) -> torch.Tensor:
    """verl's ``kl_penalty``: the per-token estimate of KL(pi_theta || pi_ref) (Schulman, "Approximating KL
    divergence", 2020): ``kl`` / ``k1`` log pi - log pi_ref; ``abs`` its absolute value; ``mse`` / ``k2`` half its
    square; ``low_var_kl`` / ``k3`` r - log r - 1 with r = pi_ref / pi, the log-ratio clamped to [-20, 20] and the
    estimate to [-10, 10] (verl's bounds); a trailing ``+`` (``k1+``, ``k3+``) keeps the value and takes k2's gradient
    (verl's straight-through, for an unbiased gradient on-policy); ``k2+`` / ``mse+`` are k2 itself (verl's value
    and gradient, but inf at an infinite difference, where verl's straight-through gives inf - inf = NaN).

    ``old_log_prob``: the IS-corrected estimate of DeepSeek-V3.2 (its technical report, "unbiased KL estimate"), the
    estimate times pi_theta / pi_old = exp(clamp(log pi - log pi_old, -20, 20)), unbiased for tokens drawn from pi_old
    (the ratio is differentiated too: E_old[grad(r k)] = grad E_theta[k]). It already corrects the gradient, so a
    ``+`` estimator with it is refused. Computed in fp32 for 16-bit inputs (rounded once to their dtype)."""
    if not isinstance(kl_penalty, str):
        raise TypeError(f"kl_penalty must be a str, got {type(kl_penalty).__name__}")
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    if base not in KL_PENALTY_TYPES:
        raise ValueError(f"kl_penalty must be one of {', '.join(KL_PENALTY_TYPES)} (optionally with a trailing '+'), "
                         f"got {kl_penalty!r}")
    _check_float("logprob", logprob, logprob)
    _check_float("ref_logprob", ref_logprob, logprob)
    if old_log_prob is not None:
        _check_float("old_log_prob", old_log_prob, logprob)
        # pi_old is the constant the tokens were drawn from: differentiated, the ratio's gradient would no longer be
        # the KL's (old_log_prob=logprob on-policy: plain k3's gradient, silently)
        refuse_grad("kl_penalty", old_log_prob=old_log_prob)
        if straight_through and base not in ("mse", "k2"):
            raise ValueError(f"kl_penalty={kl_penalty!r} with old_log_prob: the IS correction already makes the "
                             f"gradient unbiased; pass {base!r}")
    out_dtype = torch.promote_types(logprob.dtype, ref_logprob.dtype)
    acc = _checks.acc_dtype(out_dtype)
    lp, ref = logprob.to(acc), ref_logprob.to(acc)
    if base in ("kl", "k1"):
        est = lp - ref
    elif base == "abs":
        est = (lp - ref).abs()
    elif base in ("mse", "k2"):
        est = 0.5 * (lp - ref).square()
    else:
        x = torch.clamp(ref - lp, min=-20.0, max=20.0)
        est = torch.clamp(x.exp() - x - 1, min=-10.0, max=10.0)
    # "k2+" / "mse+": k2 itself, whose gradient the straight-through would take (verl's value and gradient; at an
    # infinite difference verl's inf - inf is NaN, k2's inf here)
    if straight_through and base not in ("mse", "k2"):
        st = 0.5 * (lp - ref).square()
        est = st - st.detach() + est.detach()
    if old_log_prob is not None:
        est = torch.exp(torch.clamp(lp - old_log_prob.to(acc), -20.0, 20.0)) * est
    return est.to(out_dtype)


class _WeightedPLogP(torch.autograd.Function):
    """``w (p log p)`` of the log-probs ``lp`` (p = e^lp; 0 at p = 0, its limit; the value is ``-w *
    entropy_term`` bit for bit) with its gradient ``w p (log p + 1)`` formed from ``w p``: autograd's chain through
    ``p`` forms ``w log p`` first, which overflowed fp32 at w = 1e38, log p = -5 (a -inf gradient where the value is
    -2.7e36; the knob fuzz). The gradient is autograd's up to rounding (log p + 1 is rounded once here, not in
    autograd's order): log p clamped to the lowest finite value (-max * 0 = -0 at p = 0), the clamp passing no
    gradient. First order only, as the policy-loss op it is added to."""

    @staticmethod
    def forward(ctx, lp, w):
        big = torch.finfo(lp.dtype).max
        p = lp.exp()
        ctx.save_for_backward(lp, w * p)
        return w * (p * lp.clamp(min=-big))

    @staticmethod
    def backward(ctx, grad):
        lp, wp = ctx.saved_tensors
        big = torch.finfo(lp.dtype).max
        return grad * (wp * lp.clamp(min=-big) + torch.where(lp > -big, wp, torch.zeros_like(wp))), None


def calculate_grpo_loss(
    current_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clamp_eps_lower: float,
    clamp_eps_upper: float,
    kl_beta: float,
    entropy_weight: float,
    inference_logprobs: Optional[torch.Tensor] = None,
    is_truncation_coef: Optional[float] = None,
    seq_starts=None,
    seq_lengths=None,
    *,
    rollout_correction: Optional["RolloutCorrectionConfig"] = None,
    response_mask: Optional[torch.Tensor] = None,
    dp_group=None,
    seq_group=None,
    kl_is_correction: bool = False,
):
    """Per-token GRPO loss in the form of Megatron-LM RL ``calculate_grpo_loss`` (unpacked ``[B, T]`` inputs,
    ``advantages`` ``[B]``), a drop-in for it:

    loss = -w min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A) + kl_beta k3 - entropy_weight H,  H = -exp(lp) lp,
    r = pi/pi_old, k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman's low-variance KL to pi_ref),
    w = min(pi_old/pi_inference, ``is_truncation_coef``) when ``inference_logprobs`` is given (TIS).

    Returns Megatron's 6-tuple (loss, kl_term, ratios, entropy_term, truncated_from_above, truncated_from_below), all
    ``[B, T]``; ``entropy_term`` is H = -p log p, >= 0, as Megatron-LM returns it since core 0.16 (0.15 returned p log
    p: the loss is the same). The ratio goes through the same fused elementwise op as the PPO family
    (``ops.policy_loss_rows`` without dual clip), whose log-ratio is clamped to +-20 before exp (verl's bound): tokens
    with |log pi - log pi_old| > 20 get the ratio e^{+-20} and the clipped objective's gradient there, where Megatron
    takes e^{log-ratio} as it is (finite up to ~88, inf beyond); identical elsewhere. As in Megatron,
    ``is_truncation_coef`` is used only with ``inference_logprobs``.

    With ``rollout_correction`` (a RolloutCorrectionConfig) the weights come from our rollout correction of
    pi_old vs pi_inference instead of the TIS line (``is_truncation_coef`` must then be None), tokens its RS
    rejects get loss 0, and a 7th item is returned: the :class:`RolloutCorrectionResult` (its
    ``response_mask`` is the mask to normalise the loss by, its ``metrics`` the ``rollout_corr/*`` values).
    ``response_mask`` ([B, T], default all valid) is then the mask the correction starts from. A token that is not
    live (``response_mask`` 0, outside every packed sequence, rejected by the RS) is never read: its loss, KL and
    entropy terms are 0 and its gradient exactly 0, whatever its log-probs hold (-inf, NaN); Megatron computes them
    everywhere and leaves the masking to its caller, which reads the same sums. At a live token with
    ``current_logprobs`` -inf the terms take their limits (surrogate ratio e^-20, entropy term 0, k3 +inf) and a
    term with a 0 coefficient is left out (Megatron's 0 * NaN); an undefined KL (ref NaN / +inf, ref and current
    both -inf) with ``kl_beta`` != 0 is refused.

    Packed, as Megatron-LM passes it: ``seq_starts`` / ``seq_lengths`` (lists or 1-D integer tensors, one entry per
    sequence; ``seq_starts`` may end with Megatron-LM's packer's sentinel, the bin's padded end, one entry more) with
    ``[1, bin_size]`` log-probs and ``advantages`` ``[num_sequences]``; sequence i owns the tokens ``[start_i,
    min(start_i + len_i - 1, bin_size))`` (log-probs are one shorter than the sequence; none for a length of 0 or 1) and
    every other position gets advantage 0, as in Megatron. Overlapping sequences are an error (Megatron's later one
    would silently overwrite). With ``rollout_correction`` the correction sees each sequence as one segment
    (sequence-level IS / RS exact per sequence, not per bin), positions outside every sequence masked out, and the
    returned result's tensors are the ``[bin_size]`` stream.

    ``kl_is_correction=True``: the IS-corrected KL of DeepSeek-V3.2, kl_term = (pi / pi_old) k3, an unbiased
    estimate of KL(pi || pi_ref) on tokens sampled from pi_old (plain k3 is unbiased only on-policy); the ratio is
    part of the gradient, taken as the surrogate's, exp(clamp(log pi - log pi_old, -20, 20)) (so its part of the
    gradient is 0 from |log-ratio| = 20 on).
    """
    lp = current_logprobs
    if not isinstance(kl_is_correction, bool):
        raise TypeError(f"kl_is_correction must be a bool, got {type(kl_is_correction).__name__}")
    check_policy_inputs(old_logprobs, lp, lp, torch.ones_like(lp, dtype=torch.bool), old_name="old_logprobs")
    refuse_grad("calculate_grpo_loss", old_logprobs=old_logprobs, advantages=advantages,
                inference_logprobs=inference_logprobs)
    _check_float("ref_logprobs", ref_logprobs, lp)
    packed = _grpo_packed(lp, advantages, seq_starts, seq_lengths)
    if packed is None and (not isinstance(advantages, torch.Tensor) or advantages.numel() != lp.shape[0]):
        raise ValueError(f"advantages must be a tensor of one value per sequence ({lp.shape[0]}), got "
                         f"{getattr(advantages, 'shape', type(advantages))}")
    clamp_eps_lower, clamp_eps_upper = (_finite_real(name, v, minimum=0.0) for name, v in (
        ("clamp_eps_lower", clamp_eps_lower), ("clamp_eps_upper", clamp_eps_upper)))
    kl_beta, entropy_weight = (_finite_real(name, v) for name, v in (("kl_beta", kl_beta),
                                                                     ("entropy_weight", entropy_weight)))
    if inference_logprobs is not None:
        _check_float("inference_logprobs", inference_logprobs, lp)
    if is_truncation_coef is not None:  # a real number > 0 (inf: no truncation), as the other numbers are read
        is_truncation_coef = as_real("is_truncation_coef", is_truncation_coef)
        if not is_truncation_coef > 0:
            raise ValueError(f"is_truncation_coef must be > 0 or None, got {is_truncation_coef!r}")
    if response_mask is not None:
        check_mask("response_mask", response_mask, lp)

    acc = _checks.acc_dtype(lp.dtype)
    for name, v in (("kl_beta", kl_beta), ("entropy_weight", entropy_weight)):  # the terms are formed in acc
        _checks.check_finite_in(v, acc, f"calculate_grpo_loss: {name} must be finite in the compute type ({acc})")
    if packed is None:
        adv = advantages.to(device=lp.device, dtype=acc).reshape(-1, 1).expand(lp.shape)
    else:
        seq_id, in_seq, cu = packed
        adv_seq = advantages.detach().to(device=lp.device, dtype=acc).reshape(-1)
        per_pos = adv_seq[seq_id.clamp(min=0)] if adv_seq.numel() else torch.zeros_like(seq_id, dtype=acc)
        adv = torch.where(in_seq, per_pos, torch.zeros((), dtype=acc, device=lp.device))
        adv = adv.reshape(lp.shape)
        in_seq = in_seq.reshape(lp.shape)
        response_mask = in_seq if response_mask is None else (response_mask != 0) & in_seq
    result = None
    weights = None
    if rollout_correction is not None:
        if inference_logprobs is None:
            raise ValueError("rollout_correction needs inference_logprobs (the rollout engine's log-probs)")
        if is_truncation_coef is not None:
            raise ValueError("pass either is_truncation_coef (Megatron's TIS) or rollout_correction, not both")
        if response_mask is None:
            response_mask = torch.ones_like(lp, dtype=torch.bool)
        if packed is None:
            result = _correction(old_logprobs, inference_logprobs, response_mask, rollout_correction, dp_group,
                                 seq_group, rollout_name="inference_logprobs")
            weights = result.weights
        else:
            result = _correction(old_logprobs.reshape(-1), inference_logprobs.reshape(-1), response_mask.reshape(-1),
                                 rollout_correction, dp_group, seq_group, cu_seqlens=cu,
                                 rollout_name="inference_logprobs")
            weights = result.weights.reshape(lp.shape)
    elif inference_logprobs is not None:
        weights = (old_logprobs.detach().to(acc) - inference_logprobs.to(acc)).exp()
        # a cap past the dtype's range truncates nothing (1e308 in fp32; inf): left out, so an overflowed weight
        # stays inf and is refused as without a cap
        if is_truncation_coef is not None and is_truncation_coef <= torch.finfo(weights.dtype).max:
            weights = weights.clamp(max=is_truncation_coef)

    # Megatron's per-token form has no mask: every token is a response token unless response_mask says otherwise
    # (the op raises on an undefined loss at a response token; masked tokens are not inspected).
    token_mask = response_mask if response_mask is not None else torch.ones_like(lp, dtype=torch.bool)
    pg_loss, _ = ops.policy_loss_rows(lp, old_logprobs, adv, token_mask, weights, float(clamp_eps_lower),
                                      float(clamp_eps_upper), math.inf, LY.PG_KIND_PPO_CLIP,
                                      first_order="calculate_grpo_loss")
    lp_acc = lp.to(acc)
    # the KL and entropy terms at the live tokens only (response tokens the correction kept): a masked token's
    # values (-inf, NaN) are never read, so they reach neither the loss nor the gradient (0 there)
    live = token_mask != 0
    if result is not None:
        live = live & (result.response_mask != 0).reshape(lp.shape)
    zero = torch.zeros((), dtype=acc, device=lp.device)
    lp_live = torch.where(live, lp_acc, zero)
    ref_live = torch.where(live, ref_logprobs.to(acc), zero)
    big = torch.finfo(acc).max
    ref_diff = ref_live - lp_live
    # pi = 0 under a finite pi_ref (log-ratio x = +inf): k3 = e^x - x - 1 is +inf there and its derivative in log pi
    # -inf (their limits), where e^x - x would read inf - inf = NaN. The linear term takes x clamped to the largest
    # finite value: the same value everywhere else, inf - max = inf there, and the clamp passes it no gradient.
    kl_term = ref_diff.exp() - ref_diff.clamp(max=big) - 1
    if kl_beta != 0:
        # k3 is undefined where pi_ref / pi is: a NaN / +inf ref log-prob, or pi = pi_ref = 0 (0 / 0, a NaN k3).
        # Two reductions find out (no [B, T] temporaries); the token is looked for only then. With kl_beta = 0
        # the term is not in the loss and nothing is refused.
        msg = ("calculate_grpo_loss: the KL term is undefined at a response token: ref_logprobs NaN or +inf, or "
               "ref_logprobs and current_logprobs both -inf (0 / 0); mask the token out or pass kl_beta=0")
        if kl_term.numel():
            _checks.refuse_unless(~kl_term.sum().isnan() & (ref_live.amax() != math.inf),
                                  lambda: live & (kl_term.isnan() | (ref_live == math.inf)),
                                  lambda at: msg.replace("at a response token", f"at response token {at}"), msg)
    if kl_is_correction:
        # DeepSeek-V3.2 technical report ("unbiased KL estimate"): the k3 estimate weighted by pi_theta / pi_old,
        # the tokens being drawn from pi_old; the ratio is differentiated too, so the gradient is that of
        # KL(pi_theta || pi_ref) itself (E_old[grad(r k3)] = grad E_theta[k3]).
        old_live = torch.where(live, old_logprobs.detach().to(acc), zero)
        kl_term = torch.exp(torch.clamp(lp_live - old_live, -20.0, 20.0)) * kl_term
    # the token's entropy term -p log p, as Megatron-LM returns it since "Fix the entropy sign" (core 0.16; 0.15
    # returned p log p), the loss subtracting entropy_weight times it. p log p is 0 at p = 0 (its limit; so is
    # that of its derivative, p (log p + 1)): log p clamped to the lowest finite value gives 0 * -max = -0 there
    # (-inf * 0 would read NaN), and the clamp passes it no gradient
    entropy_term = -(lp_live.exp() * lp_live.clamp(min=-big))
    # a term whose coefficient is 0 is left out, not multiplied by 0: an infinite KL at a token pi gives probability
    # 0 must not turn a defined loss into NaN when the KL is off (Megatron's 0 * inf)
    loss = pg_loss
    if kl_beta != 0:
        kl_loss = kl_beta * kl_term
        # a finite KL whose product with kl_beta overflows is a token loss past the float range, refused as the op
        # refuses one (an infinite KL, pi = 0 under pi_ref > 0, is its limit and stays inf)
        over = ("calculate_grpo_loss: kl_beta * the KL term is past the float range at a response token (a token "
                "loss past it is refused)")
        # on the CPU one sum decides (finite: nothing overflowed; else the token is looked for); on a device the
        # exact test, an asynchronous assert (an infinite KL is no error there either)
        if kl_loss.device.type != "cpu" or torch.compiler.is_compiling() or not bool(torch.isfinite(kl_loss.sum())):
            _checks.refuse_where(live & torch.isinf(kl_loss) & torch.isfinite(kl_term),
                                 lambda at: over.replace("at a response token", f"at response token {at}"), over)
        loss = loss + kl_loss
    if entropy_weight != 0:
        loss = loss + _WeightedPLogP.apply(lp_live, entropy_weight)
    loss = torch.where(live, loss, zero)
    with torch.no_grad():
        ratios = torch.exp(torch.clamp(lp_acc - old_logprobs.to(acc), -20.0, 20.0))
    above, below = ratios > 1 + clamp_eps_upper, ratios < 1 - clamp_eps_lower
    out = (loss, kl_term, ratios, entropy_term, above, below)
    return out + (result,) if result is not None else out
