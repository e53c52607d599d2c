"""``RolloutCorrectionConfig``: what to correct (IS), what to reject (RS, veto), validated when built.

Semantics and defaults follow verl 0.9.1 (``verl/trainer/config/algorithm.py``, ``RolloutCorrectionConfig``;
threshold parsing in ``verl/trainer/ppo/rollout_corr_helper.py``, ``_parse_rollout_is_threshold`` and
``_parse_rollout_rs_thresholds``), plus the original API's spellings (``rollout_is_mode``,
``rollout_is_threshold_lower``, ``rollout_rs_threshold_lower``, ``rollout_token_veto_threshold``, the ratio RS
criteria ``token`` / ``sequence`` / ``geometric``, the ``geometric`` IS level) and its preset names.
docs/rollout_correction.md is the contract; ``docs/rollout_correction.md`` the user-facing table.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

__all__ = ["RolloutCorrectionConfig", "RSCriterion", "ISSpec", "IS_LEVELS", "RS_CRITERIA", "LOSS_TYPES",
           "VERL_ONLY_KEYS", "config_items"]

#: IS aggregation levels (verl 0.9.1 has token and sequence; geometric is the original API's).
IS_LEVELS: Tuple[str, ...] = ("token", "sequence", "geometric")
IS_MODES: Tuple[str, ...] = ("truncate", "mask", "two_sided")
LOSS_TYPES: Tuple[str, ...] = ("ppo_clip", "reinforce")

#: RS criterion name -> (level, statistic). verl 0.9.1's 11 divergence criteria
#: (``SUPPORTED_ROLLOUT_RS_OPTIONS``) and the original API's 3 ratio criteria.
RS_CRITERIA: Dict[str, Tuple[str, str]] = {
    "token_k1": ("token", "k1"),
    "token_k2": ("token", "k2"),
    "token_k3": ("token", "k3"),
    "seq_sum_k1": ("seq_sum", "k1"),
    "seq_sum_k2": ("seq_sum", "k2"),
    "seq_sum_k3": ("seq_sum", "k3"),
    "seq_mean_k1": ("seq_mean", "k1"),
    "seq_mean_k2": ("seq_mean", "k2"),
    "seq_mean_k3": ("seq_mean", "k3"),
    "seq_max_k2": ("seq_max", "k2"),
    "seq_max_k3": ("seq_max", "k3"),
    "token": ("token", "ratio"),
    "sequence": ("seq_sum", "ratio"),
    "geometric": ("seq_mean", "ratio"),
}

_FIELD_NAMES = (
    "rollout_is", "rollout_is_threshold", "rollout_is_mode", "rollout_is_threshold_lower",
    "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower",
    "rollout_token_veto_threshold", "bypass_mode", "loss_type",
)


@dataclass(frozen=True)
class ISSpec:
    """Resolved IS settings. ``mode`` "truncate" (TIS: min(w, upper)), "mask" (IcePop: w * 1[lower <= w <= upper]) or
    "two_sided" (two-sided TIS: clamp(w, lower, upper)).

    ``metric_lower`` is the lower bound the diagnostics use (verl 0.9.1 ``compute_is_metrics``: the IcePop lower
    bound, else 1/upper).
    """

    level: str
    mode: str
    lower: Optional[float]
    upper: float
    metric_lower: float


@dataclass(frozen=True)
class RSCriterion:
    """One resolved RS criterion. ``keep = (not apply_lower or stat >= lower) and stat <= upper``.

    Thresholds are in the statistic's own space: k1 -> log-ratio bounds (verl uses log of the "L_U" spec),
    k2/k3 -> an upper bound only, ratio -> ratio bounds. ``metric_lower`` is verl's clamp floor for ``_std``.
    """

    name: str
    level: str
    stat: str
    lower: float
    upper: float
    apply_lower: bool


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite_float(x: Union[int, float], field: str) -> float:
    """``float(x)``, refusing NaN, +-inf and ints too large for a float (a NaN bound would reject every token,
    an infinite one silently switches the bound off)."""
    try:
        v = float(x)
    except OverflowError:
        raise ValueError(f"{field} must be a finite number, got {x!r} (too large for a float)") from None
    if not math.isfinite(v):
        raise ValueError(f"{field} must be a finite number, got {x!r}")
    return v


#: The range of a bound compared as a value (every IS bound, the token veto, the RS bounds of the ratio, k2 and k3
#: criteria; k1's are compared as logarithms): a normal fp32 number
#: whose square is finite there, since the kernels compare, clamp and square the bounds (the metrics' clamped
#: statistics) in fp32 below fp64 inputs: 1e-300 is 0 in fp32 (every IS weight 0), a lower bound of 3.5e38 is inf
#: and 1e38's square overflows (a NaN / inf ``*_std``; the knob fuzz). Log-ratios are clamped to +-20, so a ratio
#: never leaves [2.1e-9, 4.9e8] and k2 / k3 sums stay far below 2^63: a bound past this range cannot mean more than
#: one at its edge. k1's bounds: any finite bound > 0.
RATIO_BOUND_RANGE = (2.0 ** -126, 2.0 ** 63)


def _ratio_bound(v: float, field: str, zero_ok: bool = False) -> None:
    lo, hi = RATIO_BOUND_RANGE
    if not (lo <= v <= hi or (zero_ok and v == 0)):
        raise ValueError(f"{field}: {v!r} is outside [{lo:.4g}, {hi:.4g}]{' (or 0)' if zero_ok else ''}: the kernels "
                         f"compare, clamp and square the bounds in fp32 below fp64 inputs")


def _optional_number(x: Any, field: str) -> Optional[float]:
    """None, or a finite number (named error otherwise)."""
    if x is None:
        return None
    if not _is_number(x):
        raise ValueError(f"{field} must be None or a finite number, got {x!r}")
    return _finite_float(x, field)


def _parse_float(text: str, field: str) -> float:
    # float() also accepts digit-group underscores ("1_0" == 10.0), which would misread a malformed 'L_U' spec.
    try:
        v = float(text) if "_" not in text else None
    except ValueError:
        v = None
    if v is None:
        raise ValueError(f"{field}: cannot parse {text!r} as a number")
    if not math.isfinite(v):  # "nan", "inf", "1e400"
        raise ValueError(f"{field} must hold finite numbers, got {text!r}")
    return v


def _split_spec(spec: Union[str, float, int], field: str) -> Tuple[Optional[float], float]:
    """'L_U' -> (L, U); 'U' or a number -> (None, U). Every bound is finite (named error otherwise)."""
    if isinstance(spec, bool) or not (_is_number(spec) or isinstance(spec, str)):
        raise ValueError(f"{field} must be a number or a 'L_U' / 'U' string, got {spec!r}")
    if _is_number(spec):
        return None, _finite_float(spec, field)
    text = spec.strip()
    if not text:
        raise ValueError(f"{field} must not be an empty string")
    if "_" in text:
        parts = text.split("_")
        if len(parts) != 2:
            raise ValueError(f"{field}: expected 'L_U' (one underscore), got {spec!r}")
        return _parse_float(parts[0].strip(), field), _parse_float(parts[1].strip(), field)
    return None, _parse_float(text, field)


#: Keys verl's config objects (and their Hydra YAML) carry that are not settings: ignored by every ``from_dict``.
VERL_ONLY_KEYS = frozenset({"_target_"})


def config_items(data: Any, what: str) -> Tuple[Dict[str, Any], bool]:
    """``(settings dict, typed)`` of a config given as a mapping, an OmegaConf ``DictConfig`` or a dataclass
    instance (verl's ``BaseConfig`` subclasses are both dataclasses and mappings). ``typed`` is True for a dataclass
    instance: its fields are its own schema, so fields a reader does not know may be ignored. Values are not copied
    (nested configs stay what they are); a ``DictConfig`` is resolved into plain containers."""
    try:  # without importing omegaconf eagerly
        from omegaconf import DictConfig, OmegaConf  # type: ignore

        if isinstance(data, DictConfig):
            return dict(OmegaConf.to_container(data, resolve=True)), False  # type: ignore[arg-type]
    except ImportError:
        pass
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}, True
    if isinstance(data, Mapping) or (hasattr(data, "keys") and hasattr(data, "__getitem__")):
        return {k: data[k] for k in data.keys()}, False
    raise TypeError(f"{what}: expected a mapping, an OmegaConf DictConfig or a dataclass config, got "
                    f"{type(data).__name__}")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction settings (docs/rollout_correction.md). Validated in ``__post_init__``; every error names the field.

    Immutable (a frozen dataclass): assigning a field raises ``dataclasses.FrozenInstanceError``; derive a changed
    config with ``dataclasses.replace(cfg, field=value)``, which validates again. Every threshold must be finite
    (NaN / +-inf are refused in every spelling, numbers and spec strings alike).

    Fields (defaults are verl 0.9.1's):
        rollout_is: None | "token" | "sequence" | "geometric" -- IS weight level (None: no weights).
        rollout_is_threshold: C > 0 for TIS (truncate at C), or "L_U" for IcePop (weights outside [L, U] -> 0).
        rollout_is_mode: original API: None (inferred from the threshold) | "truncate" | "mask" (IcePop); and ours,
            "two_sided": two-sided truncated IS, w = clamp(rho, L, U) at every level, threshold "L_U" or U
            (L = rollout_is_threshold_lower, or 1/U).
        rollout_is_threshold_lower: original API: IcePop lower bound with a numeric threshold (None = 1/C); the
            lower clamp of "two_sided".
        rollout_is_batch_normalize: divide the weights by their global mean (token level: masked mean;
            sequence levels: mean of per-sequence means).
        rollout_rs: None or comma-separated criteria (AND); duplicates removed, order kept.
        rollout_rs_threshold: one spec per criterion or one shared; k1/ratio: "L_U" or U (L = 1/U); k2/k3: U.
        rollout_rs_threshold_lower: original API: lower bound of the ratio criteria given as U only (None = 1/U;
            0 = no lower bound).
        rollout_token_veto_threshold: V > 0 or None; a sequence with any valid token ratio < V is rejected.
        bypass_mode: reuse rollout log-probs as the old policy (2 policies) -- consumed by the loss.
        loss_type: "ppo_clip" | "reinforce" -- consumed by the loss.
    """

    rollout_is: Optional[str] = "sequence"
    rollout_is_threshold: Optional[Union[str, float]] = 2.0
    rollout_is_mode: Optional[str] = None
    rollout_is_threshold_lower: Optional[float] = None
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[str, float]] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    # ------------------------------------------------------------------------------------------- validation

    def __post_init__(self) -> None:
        for name in ("rollout_is_batch_normalize", "bypass_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be None or one of {list(IS_LEVELS)}, got {self.rollout_is!r}")
        if self.rollout_is_mode is not None and self.rollout_is_mode not in IS_MODES:
            raise ValueError(f"rollout_is_mode must be None or one of {list(IS_MODES)}, got {self.rollout_is_mode!r}")
        v = _optional_number(self.rollout_token_veto_threshold, "rollout_token_veto_threshold")
        if v is not None and not v > 0:
            raise ValueError(f"rollout_token_veto_threshold must be None or a finite number > 0, got {v!r}")
        if v is not None:
            _ratio_bound(v, "rollout_token_veto_threshold")
        # Resolving validates; kept so the op never re-parses strings. The config is frozen, so the resolved view
        # cannot go stale (dataclasses.replace runs __post_init__ again).
        object.__setattr__(self, "_is_spec", self._resolve_is())
        object.__setattr__(self, "_rs_criteria", self._resolve_rs())

    def _resolve_is(self) -> Optional[ISSpec]:
        if self.rollout_is is None:  # as verl: with IS off its threshold fields are not read, so not judged either
            return None
        thr, lower_opt = self.rollout_is_threshold, self.rollout_is_threshold_lower
        _optional_number(lower_opt, "rollout_is_threshold_lower")
        if lower_opt is not None and not lower_opt > 0:
            raise ValueError(f"rollout_is_threshold_lower must be None or a finite number > 0, got {lower_opt!r}")
        if thr is None:
            raise ValueError(f"rollout_is_threshold is required when rollout_is={self.rollout_is!r} "
                             f"(a number C > 0 for TIS or a 'L_U' string for IcePop)")
        lower, upper = _split_spec(thr, "rollout_is_threshold")
        if not upper > 0:
            raise ValueError(f"rollout_is_threshold: the upper bound must be > 0, got {upper}")
        if lower is not None and self.rollout_is_mode == "two_sided":
            if lower_opt is not None:
                raise ValueError("rollout_is_threshold_lower is given twice: in the 'L_U' rollout_is_threshold "
                                 "and in rollout_is_threshold_lower; keep one")
            mode = "two_sided"
        elif lower is not None:  # "L_U": IcePop, as verl 0.9.1
            if self.rollout_is_mode == "truncate":
                raise ValueError("rollout_is_threshold: a 'L_U' spec means IcePop (mask mode) but "
                                 "rollout_is_mode='truncate'; use a single number for TIS")
            if lower_opt is not None:
                raise ValueError("rollout_is_threshold_lower is given twice: in the 'L_U' rollout_is_threshold "
                                 "and in rollout_is_threshold_lower; keep one")
            mode = "mask"
        else:
            mode = self.rollout_is_mode or "truncate"
            lower = lower_opt if mode in ("mask", "two_sided") else None
            if mode in ("mask", "two_sided") and lower is None:
                lower = 1.0 / upper
        if lower is not None:
            if not lower > 0:
                raise ValueError(f"rollout_is_threshold: the lower bound must be > 0, got {lower}")
            if lower > upper:
                raise ValueError(f"rollout_is_threshold: lower bound {lower} > upper bound {upper}")
        metric_lower = lower if lower is not None else (lower_opt if lower_opt is not None else 1.0 / upper)
        if not math.isfinite(metric_lower):  # 1 / upper past the float range: every bound the kernels read is finite
            raise ValueError(f"rollout_is_threshold: {upper!r} is too small, its reciprocal (the default lower "
                             f"bound) overflows; give rollout_is_threshold_lower or a threshold >= "
                             f"{1.0 / sys.float_info.max!r}")
        _ratio_bound(upper, "rollout_is_threshold")
        if lower_opt is not None:
            _ratio_bound(lower_opt, "rollout_is_threshold_lower")
        if lower is not None:  # an 'L_U' lower bound, or the lower bound given (or 1 / upper, in range)
            _ratio_bound(lower, "rollout_is_threshold" if lower_opt is None else "rollout_is_threshold_lower")
        return ISSpec(self.rollout_is, mode, lower, float(upper), float(metric_lower))

    def _resolve_rs(self) -> List[RSCriterion]:
        rs, spec = self.rollout_rs, self.rollout_rs_threshold
        lower_opt = self.rollout_rs_threshold_lower
        _optional_number(lower_opt, "rollout_rs_threshold_lower")
        if lower_opt is not None and lower_opt < 0:
            raise ValueError(f"rollout_rs_threshold_lower must be None or a finite number >= 0, got {lower_opt!r}")
        if rs is None:
            return []
        if not isinstance(rs, str):
            raise ValueError(f"rollout_rs must be None or a comma-separated string of criteria from "
                             f"{sorted(RS_CRITERIA)}, got {rs!r}")
        names: List[str] = []
        for part in rs.split(","):
            part = part.strip()
            if not part:
                continue
            if part not in RS_CRITERIA:
                raise ValueError(f"rollout_rs: unknown criterion {part!r}; allowed: {sorted(RS_CRITERIA)}")
            if part not in names:
                names.append(part)
        if not names:
            raise ValueError(f"rollout_rs must name at least one criterion from {sorted(RS_CRITERIA)}")
        if spec is None:
            raise ValueError(f"rollout_rs_threshold is required when rollout_rs={rs!r} (one spec per criterion "
                             f"or one shared: 'L_U' or U for k1/ratio criteria, U for k2/k3)")
        if _is_number(spec):
            raw = [repr(_finite_float(spec, "rollout_rs_threshold"))]
        elif isinstance(spec, str):
            raw = [p.strip() for p in spec.split(",") if p.strip()]
        else:
            raise ValueError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
        if len(raw) not in (1, len(names)):
            raise ValueError(f"rollout_rs_threshold has {len(raw)} specs but rollout_rs has {len(names)} criteria "
                             f"{names}; give 1 shared spec or exactly {len(names)}")
        if len(raw) == 1:
            raw = raw * len(names)
        if lower_opt is not None and all(RS_CRITERIA[n][1] in ("k2", "k3") for n in names):
            raise ValueError("rollout_rs_threshold_lower: k2/k3 criteria take an upper bound only")
        out = []
        for name, s in zip(names, raw):
            level, stat = RS_CRITERIA[name]
            field = f"rollout_rs_threshold (criterion {name!r})"
            lower, upper = _split_spec(s, field)
            if not upper > 0:
                raise ValueError(f"{field}: the upper bound must be > 0, got {upper}")
            if stat in ("k2", "k3"):
                if lower is not None:
                    raise ValueError(f"{field}: k2/k3 criteria take an upper bound only (a single number), "
                                     f"got {s!r}")
                _ratio_bound(upper, field)
                out.append(RSCriterion(name, level, stat, 0.0, float(upper), False))
                continue
            if lower is None:
                lower = lower_opt if lower_opt is not None else 1.0 / upper
            if stat == "k1" and not lower > 0:
                raise ValueError(f"{field}: the lower bound must be > 0 (k1 compares log-ratios), got {lower}")
            if stat == "ratio" and lower < 0:
                raise ValueError(f"{field}: the lower bound must be >= 0, got {lower}")
            if lower > upper:
                raise ValueError(f"{field}: lower bound {lower} > upper bound {upper}")
            if stat == "k1":  # verl: keep log(L) <= -clamp20(lr) <= log(U)
                out.append(RSCriterion(name, level, stat, math.log(lower), math.log(upper), True))
            else:
                _ratio_bound(lower, field, zero_ok=True)
                _ratio_bound(upper, field)
                out.append(RSCriterion(name, level, stat, float(lower), float(upper), True))
        return out

    # ------------------------------------------------------------------------------------------- resolved view

    @property
    def is_spec(self) -> Optional[ISSpec]:
        """The resolved IS settings, or None when no weights are computed."""
        return self._is_spec  # type: ignore[attr-defined]

    @property
    def rs_criteria(self) -> List[RSCriterion]:
        """The resolved RS criteria, in the order given (duplicates removed)."""
        return list(self._rs_criteria)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------- (de)serialise

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict of the fields (YAML / OmegaConf friendly: only str, float, bool, None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> "RolloutCorrectionConfig":
        """Build from a dict, an OmegaConf ``DictConfig`` or another typed config with these field names (verl's
        ``RolloutCorrectionConfig`` included).

        Known fields are validated as in the constructor; keys verl's configs carry that are not settings
        (``_target_``) are ignored. A typed config object (a dataclass, e.g. verl's) may carry more fields of its
        own: those are ignored too. In a plain dict or ``DictConfig`` any other key is an error (a typo must not
        silently fall back to a default). ``None`` gives :meth:`disabled`.
        """
        if data is None:
            return cls.disabled()
        if isinstance(data, cls):
            return data
        d, typed = config_items(data, "RolloutCorrectionConfig.from_dict")
        unknown = sorted(k for k in d if k not in _FIELD_NAMES and k not in VERL_ONLY_KEYS)
        if unknown and not typed:
            raise ValueError(f"unknown RolloutCorrectionConfig field(s) {unknown}; allowed: {list(_FIELD_NAMES)} "
                             f"(for the old flat keys use RolloutCorrectionConfig.from_legacy)")
        return cls(**{k: v for k, v in d.items() if k in _FIELD_NAMES})

    @classmethod
    def from_legacy(cls, data: Mapping[str, Any]) -> "RolloutCorrectionConfig":
        """Convert the old flat keys (verl <= 0.6 ``algorithm.*``) into a config.

        ``rollout_is_threshold`` (None = feature off), ``rollout_is_threshold_lower``, ``rollout_is_level``,
        ``rollout_is_mode``, ``rollout_is_veto_threshold``, ``rollout_is`` (bool: apply the weights) and the
        0.6.x keys ``rollout_rs_threshold_lower``, ``rollout_token_veto_threshold``, ``bypass_old_logprob_for_rollout``,
        ``use_pure_rollout_correction``, ``use_policy_gradient``. Current field names pass through. What has no
        exact equivalent is converted to the closest setting with a ``UserWarning`` that says what differs.
        """
        d = dict(data)
        out: Dict[str, Any] = {}
        notes: List[str] = []
        legacy_flat = "rollout_is_level" in d or isinstance(d.get("rollout_is"), bool)
        if legacy_flat:
            apply = d.pop("rollout_is", False)
            level = d.pop("rollout_is_level", "token")
            thr = d.get("rollout_is_threshold")
            veto = d.pop("rollout_is_veto_threshold", 1e-4)  # verl 0.6.0 default
            if thr is None:
                out["rollout_is"] = None
                d.pop("rollout_is_threshold", None)
                d.pop("rollout_is_mode", None)
                d.pop("rollout_is_threshold_lower", None)
                out["rollout_is_threshold"] = None
                if veto is not None:
                    notes.append("rollout_is_threshold=None switched the whole legacy feature off, the veto "
                                 "included; rollout_is_veto_threshold is ignored")
            else:
                out["rollout_is"] = level
                if not apply:
                    notes.append("rollout_is=False (compute weights and metrics but do not apply them) has no "
                                 "config equivalent: the weights are computed; do not pass them to the loss")
                if veto is not None:
                    out["rollout_token_veto_threshold"] = veto
                    notes.append("rollout_is_veto_threshold zeroed the IS weights of a vetoed sequence; it now "
                                 "removes the sequence from response_mask (rollout_token_veto_threshold)")
        if "bypass_old_logprob_for_rollout" in d:
            out["bypass_mode"] = bool(d.pop("bypass_old_logprob_for_rollout"))
        for key in ("use_pure_rollout_correction", "use_policy_gradient"):
            if key in d:
                out["loss_type"] = "reinforce" if d.pop(key) else "ppo_clip"
        if d.get("rollout_rs") in ("token", "sequence", "geometric") and d.get("rollout_rs_threshold") is None:
            # verl 0.6.1: "If None and rollout_rs is enabled, uses rollout_is_threshold".
            d["rollout_rs_threshold"] = d.get("rollout_is_threshold", out.get("rollout_is_threshold", 2.0))
            notes.append("rollout_rs_threshold=None fell back to rollout_is_threshold; it is now explicit")
        for key, value in d.items():
            if key not in _FIELD_NAMES:
                raise ValueError(f"from_legacy: unknown key {key!r}; known legacy keys: rollout_is (bool), "
                                 f"rollout_is_threshold, rollout_is_threshold_lower, rollout_is_level, "
                                 f"rollout_is_mode, rollout_is_veto_threshold, bypass_old_logprob_for_rollout, "
                                 f"use_pure_rollout_correction, use_policy_gradient; current fields: "
                                 f"{list(_FIELD_NAMES)}")
            out[key] = value
        for note in notes:
            warnings.warn(f"RolloutCorrectionConfig.from_legacy: {note}", UserWarning, stacklevel=2)
        return cls(**out)

    # ------------------------------------------------------------------------------------------- presets
    # verl 0.9.1 (verl/trainer/config/algorithm.py), same arguments and defaults.

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Decoupled (3 policies), token-level TIS."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Decoupled, sequence-level TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Decoupled, token-level IcePop: weights outside [threshold_lower, threshold] set to 0."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", rollout_rs=None)

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Bypass (2 policies), REINFORCE, token-level IcePop."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", rollout_rs=None,
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0,
                            rs_threshold: Optional[Union[str, float]] = "0.5_2.0") -> "RolloutCorrectionConfig":
        """Decoupled, sequence TIS + seq_sum_k1 rejection."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_sum_k1",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: Optional[Union[str, float]] = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Decoupled, geometric-mean rejection (seq_mean_k1), no IS weights."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def bypass_ppo_clip(cls) -> "RolloutCorrectionConfig":
        """Bypass, PPO-clip (the ratio is the IS correction), no weights, no rejection."""
        return cls(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: Optional[Union[str, float]] = "0.999_1.001"
                               ) -> "RolloutCorrectionConfig":
        """Bypass, PPO-clip + seq_mean_k1 rejection."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Bypass, PPO-clip + seq_mean_k3 rejection."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Bypass, REINFORCE + sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: Optional[Union[str, float]] = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Bypass, REINFORCE + seq_mean_k1 rejection."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0,
                                 rs_threshold: Optional[Union[str, float]] = "0.999_1.001"
                                 ) -> "RolloutCorrectionConfig":
        """Decoupled, sequence TIS + seq_mean_k1 rejection."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0,
                                   rs_threshold: Optional[Union[str, float]] = "0.999_1.001"
                                   ) -> "RolloutCorrectionConfig":
        """Decoupled, token TIS + seq_mean_k1 rejection."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0,
                                 rs_threshold: Optional[Union[str, float]] = "0.999_1.001"
                                 ) -> "RolloutCorrectionConfig":
        """Bypass, REINFORCE + sequence TIS + seq_mean_k1 rejection."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0,
                                   rs_threshold: Optional[Union[str, float]] = "0.999_1.001"
                                   ) -> "RolloutCorrectionConfig":
        """Bypass, REINFORCE + token TIS + seq_mean_k1 rejection."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Decoupled, seq_mean_k3 rejection, no IS weights."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
                                ) -> "RolloutCorrectionConfig":
        """Decoupled, sequence TIS + seq_mean_k3 rejection."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
                                  ) -> "RolloutCorrectionConfig":
        """Decoupled, token TIS + seq_mean_k3 rejection."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def two_sided_tis(cls, threshold: float = 2.0, threshold_lower: float = 0.5, level: str = "token"
                      ) -> "RolloutCorrectionConfig":
        """Decoupled, two-sided truncated IS: w = clamp(rho, threshold_lower, threshold) at ``level`` ("token" or
        "sequence"); a token the rollout over-sampled keeps a floor weight instead of a vanishing one."""
        return cls(rollout_is=level, rollout_is_threshold=threshold, rollout_is_mode="two_sided",
                   rollout_is_threshold_lower=threshold_lower, rollout_rs=None)

    @classmethod
    def disabled(cls) -> "RolloutCorrectionConfig":
        """Metrics only: no weights, no rejection."""
        return cls(rollout_is=None, rollout_rs=None)

    # The original API's preset names (verl's first RolloutCorrectionConfig, before the decoupled_/bypass_
    # renames), same arguments and defaults; bypass_old_logprob_for_rollout -> bypass_mode,
    # use_pure_rollout_correction -> loss_type="reinforce".

    @classmethod
    def token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Token-level TIS."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def token_tis(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Alias of :meth:`token_is`."""
        return cls.token_is(threshold=threshold)

    @classmethod
    def seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Sequence-level TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: float = 2.0,
                  rs_threshold_lower: Optional[float] = None) -> "RolloutCorrectionConfig":
        """Sequence TIS + sequence-ratio rejection (keep rs_threshold_lower <= prod rho <= rs_threshold)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="sequence",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower)

    @classmethod
    def seq_mis(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Alias of :meth:`seq_is_rs` with no lower bound (rs_threshold_lower = 0)."""
        return cls.seq_is_rs(is_threshold=threshold, rs_threshold=threshold, rs_threshold_lower=0)

    @classmethod
    def geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
               veto_threshold: float = 1e-4) -> "RolloutCorrectionConfig":
        """Geometric-mean ratio rejection + per-token veto, no IS weights."""
        return cls(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
                   rollout_rs_threshold_lower=rs_threshold_lower, rollout_token_veto_threshold=veto_threshold)

    @classmethod
    def geo_mis(cls, rs_threshold: float = 1.001, rs_threshold_lower: float = 0.999,
                veto_threshold: float = 1e-4) -> "RolloutCorrectionConfig":
        """Alias of :meth:`geo_rs` with an explicit lower bound 0.999."""
        return cls.geo_rs(rs_threshold=rs_threshold, rs_threshold_lower=rs_threshold_lower,
                          veto_threshold=veto_threshold)

    @classmethod
    def ppo_is_bypass(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Bypass mode, PPO loss, token TIS weights."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_rs=None, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def pure_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Bypass mode, pure policy gradient (REINFORCE) with sequence TIS weights."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None, bypass_mode=True,
                   loss_type="reinforce")


#: Every preset name (verl 0.9.1's 19, then the original API's, then ours).
PRESETS: Tuple[str, ...] = (
    "decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "bypass_pg_token_icepop",
    "decoupled_seq_is_rs", "decoupled_geo_rs", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs",
    "bypass_pg_is", "bypass_pg_geo_rs", "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis",
    "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis", "disabled",
    "token_is", "token_tis", "seq_is", "seq_is_rs", "seq_mis", "geo_rs", "geo_mis", "ppo_is_bypass", "pure_is",
    "two_sided_tis",
)
__all__.append("PRESETS")
