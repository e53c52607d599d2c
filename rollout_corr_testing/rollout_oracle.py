"""An independent fp64 oracle of ``rollout_corr_ext.compute_rollout_correction``.

What it is
    :func:`rollout_correction_oracle` recomputes, in plain PyTorch and float64, everything the package's op
    returns for one process: the importance-sampling weights, the response mask after rejection sampling and the
    veto, and every ``rollout_corr/<name>`` metric. It takes the *public* configuration fields as keyword arguments
    (the names and defaults of ``docs/rollout_correction.md``'s field table) and parses the threshold specs itself.

Where the formulas come from
    verl 0.9.1, ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
    ``compute_is_metrics``, ``compute_rollout_rejection_mask``, ``compute_rs_metrics``,
    ``compute_offpolicy_metrics``, ``compute_rollout_correction_and_rejection_mask``) and
    ``verl/utils/torch_functional.py`` (``masked_sum`` / ``masked_mean``: Σ x·mask / (Σ mask + 1e-8)). What the
    project adds on top of verl (geometric IS, ``rollout_is_mode``, ``rollout_is_threshold_lower``, the ratio RS
    criteria ``token`` / ``sequence`` / ``geometric``, ``rollout_rs_threshold_lower``, the per-token veto,
    ``masked_fraction`` / ``seq_masked_fraction``, ``nonfinite="exclude"``, the ``rollout_is_p*`` percentiles) is
    written from ``docs/rollout_correction.md``, which is the spec for those extras.

Why it is independent
    It imports nothing from ``rollout_corr_ext`` (no ``RolloutCorrectionConfig``, no resolved ``is_spec`` /
    ``rs_criteria``, no layout, constants or helpers, no ``fallback/``) and nothing from the package's other test
    oracles. A shared misreading of a spec string, a shared wrong constant or a shared layout slot therefore cannot
    make the package and this oracle agree by construction. It is written as dense, obvious tensor code (one line per
    formula, fp64 throughout, exact order statistics for the percentiles) and is itself checked against verl's real
    helper on the configurations verl supports (``tests/test_rollout_oracle.py``).

Padding (mask 0) may hold anything, NaN included: every reduction selects valid positions with ``torch.where``, never
by multiplying with the mask (0 · NaN = NaN).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple, Union

import torch

__all__ = ["rollout_correction_oracle", "oracle_for_config", "CONFIG_FIELDS", "parse_is_threshold", "parse_rs_thresholds", "VERL_RS_CRITERIA",
           "RATIO_RS_CRITERIA", "PERCENTILES"]

F64 = torch.float64
CLAMP = 20.0  # verl's SAFETY_BOUND: log-ratios are clamped to [-20, 20] before exponentiating
EPS = 1e-8  # verl's masked_mean denominator guard

#: verl 0.9.1 SUPPORTED_ROLLOUT_RS_OPTIONS -> (level, statistic)
VERL_RS_CRITERIA = {
    "token_k1": ("token", "k1"), "token_k2": ("token", "k2"), "token_k3": ("token", "k3"),
    "seq_sum_k1": ("sum", "k1"), "seq_sum_k2": ("sum", "k2"), "seq_sum_k3": ("sum", "k3"),
    "seq_mean_k1": ("mean", "k1"), "seq_mean_k2": ("mean", "k2"), "seq_mean_k3": ("mean", "k3"),
    "seq_max_k2": ("max", "k2"), "seq_max_k3": ("max", "k3"),
}
#: the original API's ratio criteria (docs/rollout_correction.md, "RS criteria")
RATIO_RS_CRITERIA = {"token": ("token", "ratio"), "sequence": ("sum", "ratio"), "geometric": ("mean", "ratio")}
PERCENTILES = (5, 25, 50, 75, 95)


# ----------------------------------------------------------------------------------------------- spec parsing


def _num(text: str, what: str) -> float:
    text = text.strip()
    if not text or "_" in text:
        raise ValueError(f"{what}: not a number: {text!r}")
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{what}: bounds must be finite, got {text!r}")
    return v


def _lower_upper(spec: Union[str, float, int], what: str) -> Tuple[Optional[float], float]:
    """'L_U' -> (L, U); 'U' or a number -> (None, U)."""
    if isinstance(spec, bool):
        raise ValueError(f"{what}: a bool is not a threshold")
    if isinstance(spec, (int, float)):
        v = float(spec)
        if not math.isfinite(v):
            raise ValueError(f"{what}: bounds must be finite, got {spec!r}")
        return None, v
    if not isinstance(spec, str):
        raise ValueError(f"{what}: expected a number or a string, got {spec!r}")
    pieces = spec.strip().split("_")
    if len(pieces) == 1:
        return None, _num(pieces[0], what)
    if len(pieces) == 2:
        return _num(pieces[0], what), _num(pieces[1], what)
    raise ValueError(f"{what}: at most one '_' in a spec, got {spec!r}")


def parse_is_threshold(threshold, mode: Optional[str] = None, lower: Optional[float] = None):
    """The IS spec: returns (icepop: bool, L or None, U, L') where L' is the lower bound the diagnostics use.

    verl ``_parse_rollout_is_threshold``: a number or float-like string C is TIS at C; "L_U" is IcePop on [L, U].
    docs (original API): ``rollout_is_mode="mask"`` with a number C is IcePop on [lower or 1/C, C];
    ``rollout_is_threshold_lower`` with TIS only moves the ``*_fraction_low`` diagnostics (L' = lower or 1/C).
    verl ``compute_is_metrics``: L' is the IcePop lower bound, else 1/C.
    """
    if mode not in (None, "truncate", "mask"):
        raise ValueError(f"rollout_is_mode: unknown {mode!r}")
    lo, up = _lower_upper(threshold, "rollout_is_threshold")
    if not up > 0:
        raise ValueError("rollout_is_threshold: upper bound must be > 0")
    if lower is not None and not (math.isfinite(lower) and lower > 0):
        raise ValueError("rollout_is_threshold_lower must be a finite number > 0")
    if lo is not None:
        if mode == "truncate":
            raise ValueError("an 'L_U' rollout_is_threshold is IcePop; rollout_is_mode='truncate' contradicts it")
        if lower is not None:
            raise ValueError("the IcePop lower bound is given twice")
        icepop = True
    elif mode == "mask":
        icepop, lo = True, (lower if lower is not None else 1.0 / up)
    else:
        icepop = False
    if icepop and not (0 < lo <= up):
        raise ValueError("rollout_is_threshold: need 0 < L <= U")
    metric_lower = lo if icepop else (lower if lower is not None else 1.0 / up)
    return icepop, lo, up, metric_lower


def parse_rs_thresholds(rollout_rs: str, threshold, lower_override: Optional[float] = None) -> List[dict]:
    """The RS criteria, in order, duplicates dropped (verl ``compute_rollout_rejection_mask``), each with its bounds
    in the statistic's own space (verl ``_parse_rollout_rs_thresholds``): k1 keeps log L <= k1 <= log U, k2 / k3
    keep stat <= U, ratio criteria keep L <= ratio <= U. A spec "U" for k1 / ratio means L = 1/U, or
    ``rollout_rs_threshold_lower`` when given (docs; 0 = no lower bound, ratio criteria only)."""
    names: List[str] = []
    for part in rollout_rs.split(","):
        part = part.strip()
        if not part:
            continue
        if part not in VERL_RS_CRITERIA and part not in RATIO_RS_CRITERIA:
            raise ValueError(f"rollout_rs: unknown criterion {part!r}")
        if part not in names:
            names.append(part)
    if not names:
        raise ValueError("rollout_rs: no criterion")
    if threshold is None:
        raise ValueError("rollout_rs_threshold is required with rollout_rs")
    if isinstance(threshold, str):
        specs = [s.strip() for s in threshold.split(",") if s.strip()]
    else:
        specs = [threshold]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError("rollout_rs_threshold: give one spec, or one per criterion")
    stats = [{**VERL_RS_CRITERIA, **RATIO_RS_CRITERIA}[n][1] for n in names]
    if lower_override is not None:
        if not (math.isfinite(lower_override) and lower_override >= 0):
            raise ValueError("rollout_rs_threshold_lower must be a finite number >= 0")
        if all(s in ("k2", "k3") for s in stats):
            raise ValueError("rollout_rs_threshold_lower: k2/k3 criteria have no lower bound")
    out = []
    for name, spec, stat in zip(names, specs, stats):
        level = {**VERL_RS_CRITERIA, **RATIO_RS_CRITERIA}[name][0]
        lo, up = _lower_upper(spec, f"rollout_rs_threshold[{name}]")
        if not up > 0:
            raise ValueError(f"rollout_rs_threshold[{name}]: upper bound must be > 0")
        if stat in ("k2", "k3"):
            if lo is not None:
                raise ValueError(f"rollout_rs_threshold[{name}]: k2/k3 take an upper bound only")
            out.append(dict(name=name, level=level, stat=stat, lower=None, upper=up))
            continue
        if lo is None:
            lo = lower_override if lower_override is not None else 1.0 / up
        if (stat == "k1" and not lo > 0) or lo < 0 or lo > up:
            raise ValueError(f"rollout_rs_threshold[{name}]: bad bounds [{lo}, {up}]")
        if stat == "k1":  # verl compares -clamp(lr) with the logs of the ratio bounds
            out.append(dict(name=name, level=level, stat=stat, lower=math.log(lo), upper=math.log(up)))
        else:
            out.append(dict(name=name, level=level, stat=stat, lower=lo, upper=up))
    return out


# ----------------------------------------------------------------------------------------------- the oracle


def _order_stat_quantiles(values: torch.Tensor, qs) -> List[float]:
    """Quantiles with torch.quantile's default ('linear') rule, from an explicit sort (no 2^24 size limit):
    position q·(n-1), linear interpolation between the two neighbouring order statistics."""
    s = torch.sort(values.reshape(-1)).values
    n = s.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        i = int(math.floor(pos))
        j = min(i + 1, n - 1)
        frac = pos - i
        a, b = float(s[i]), float(s[j])
        out.append(a + (b - a) * frac)
    return out


def rollout_correction_oracle(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = "sequence",
    rollout_is_threshold: Optional[Union[str, float]] = 2.0,
    rollout_is_mode: Optional[str] = None,
    rollout_is_threshold_lower: Optional[float] = None,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Union[str, float]] = None,
    rollout_rs_threshold_lower: Optional[float] = None,
    rollout_token_veto_threshold: Optional[float] = None,
    bypass_mode: bool = False,
    loss_type: str = "ppo_clip",
    nonfinite: str = "error",
) -> Tuple[Optional[torch.Tensor], torch.Tensor, Dict[str, float]]:
    """fp64 rollout correction on one process.

    Returns ``(weights, mask, metrics)``: ``weights`` ``[B, T]`` float64 (0 at padding) or None without an IS level;
    ``mask`` the input mask's dtype with rejected / vetoed (and, with ``nonfinite="exclude"``, non-finite) tokens
    set to 0; ``metrics`` ``{"rollout_corr/<name>": float}`` with exactly the keys the docs list for the config.
    ``bypass_mode`` / ``loss_type`` are consumed by the loss, not here (accepted for a uniform field set).
    """
    del bypass_mode
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    if nonfinite not in ("error", "exclude"):
        raise ValueError(f"nonfinite: unknown {nonfinite!r}")
    if rollout_is is not None and rollout_is not in ("token", "sequence", "geometric"):
        raise ValueError(f"rollout_is: unknown level {rollout_is!r}")
    if log_prob.dim() != 2 or log_prob.shape != rollout_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError("log_prob, rollout_log_prob and response_mask must all be [B, T]")

    lp_in = log_prob.detach().to(F64)
    rlp_in = rollout_log_prob.detach().to(F64)
    m_f = response_mask.detach().to(F64)
    if torch.isnan(m_f).any() or not bool(((m_f == 0) | (m_f == 1)).all()):
        raise ValueError("response_mask must hold 0 and 1 only")
    given = m_f != 0

    finite = torch.isfinite(lp_in) & torch.isfinite(rlp_in)
    bad = given & ~finite
    if nonfinite == "error" and bool(bad.any()):
        raise ValueError("non-finite log-prob at a valid position")
    valid = given & finite  # nonfinite="exclude": such tokens are treated as padding from here on
    if not bool(valid.any()):
        raise ValueError("response_mask has no valid token")

    zero = torch.zeros((), dtype=F64)
    lp = torch.where(valid, lp_in, zero)
    rlp = torch.where(valid, rlp_in, zero)
    lr = torch.where(valid, lp_in - rlp_in, zero)  # log rho = log pi_train - log pi_rollout; 0 at padding
    lr_c = lr.clamp(-CLAMP, CLAMP)
    n_b = valid.sum(1).to(F64)  # valid tokens per row
    N = float(n_b.sum())
    B = lp.shape[0]
    row_ok = n_b > 0
    S = int(row_ok.sum())

    # verl's masked_mean is sum / (count + 1e-8) with the count in the mask's dtype: an fp64 float mask keeps the
    # 1e-8; a bool / int mask's count (int64 + 1e-8 -> fp32) and an fp32 (or 16-bit) mask's lose it to fp32 rounding
    # (count >= 1; an empty row's sum is 0 whatever it is divided by)
    # (a bool / int count is int64, + 1e-8 promotes it to torch's default dtype; a bf16 / fp16 count, which verl
    # rounds, is taken exact as the package documents)
    count_dtype = response_mask.dtype if response_mask.is_floating_point() else torch.get_default_dtype()
    keeps_eps = count_dtype == torch.float64
    den_N = N + EPS if keeps_eps else max(N, EPS)
    den_b = n_b + EPS if keeps_eps else n_b.clamp(min=EPS)

    def tmean(x: torch.Tensor) -> float:  # verl masked_mean over all valid tokens
        return float(torch.where(valid, x, zero).sum() / den_N)

    def rmean(x: torch.Tensor) -> torch.Tensor:  # verl masked_mean(axis=-1): per-row mean, 0 on padding rows
        return torch.where(valid, x, zero).sum(1) / den_b

    def rsum(x: torch.Tensor) -> torch.Tensor:  # verl masked_sum(axis=-1)
        return torch.where(valid, x, zero).sum(1)

    def tmax(x: torch.Tensor) -> float:
        return float(x[valid].max())

    def tmin(x: torch.Tensor) -> float:
        return float(x[valid].min())

    def std_unbiased(v: torch.Tensor) -> float:  # torch.std over >1 values, else 0 (verl)
        return float(v.std()) if v.numel() > 1 else 0.0

    def clamped_std(x: torch.Tensor, lo: float, hi: float) -> float:
        # verl compute_is_metrics / compute_rs_metrics: sqrt(max(E[c^2] - E[c]^2, 0)), c = clamp(x, lo, hi),
        # over valid tokens, 0 when there are fewer than 2; E = masked_mean (den_N above)
        if not N > 1:
            return 0.0
        c = x.clamp(min=lo, max=hi)

        def mean_n(v):
            return float(torch.where(valid, v, zero).sum() / den_N)

        return math.sqrt(max(mean_n(c * c) - mean_n(c) ** 2, 0.0))

    met: Dict[str, float] = {}
    weights: Optional[torch.Tensor] = None

    # ---- importance-sampling weights (verl compute_rollout_correction_weights + compute_is_metrics)
    if rollout_is is not None:
        if rollout_is_threshold is None:
            raise ValueError("rollout_is_threshold is required with an IS level")
        icepop, L, U, L_metric = parse_is_threshold(rollout_is_threshold, rollout_is_mode, rollout_is_threshold_lower)
        if rollout_is == "token":
            raw = torch.where(valid, torch.exp(lr_c), zero)
        else:
            # sequence: log of prod rho_t; geometric (docs): the row's mean log-ratio, over den_b as verl's
            # masked_mean. Padding rows: log weight 0.
            seq_log = rsum(lr) if rollout_is == "sequence" else rsum(lr) / den_b
            raw = torch.where(valid, torch.exp(seq_log.clamp(-CLAMP, CLAMP)).unsqueeze(1).expand_as(lr), zero)
        if icepop:
            w = torch.where((raw >= L) & (raw <= U), raw, zero)
        else:
            w = torch.clamp(raw, max=U)

        met["rollout_is_mean"] = tmean(w)
        if rollout_is == "token":
            met["rollout_is_ratio_fraction_high"] = tmean((raw > U).to(F64))
            met["rollout_is_ratio_fraction_low"] = tmean((raw < L_metric).to(F64))
            met["rollout_is_max"] = tmax(w)
            met["rollout_is_min"] = tmin(w)
        else:
            # over all B rows, in log space, unclamped (except the max's exp)
            met["rollout_is_max"] = math.exp(min(float(seq_log.max()), CLAMP))
            met["rollout_is_min"] = math.exp(float(seq_log.min()))
            met["rollout_is_ratio_fraction_high"] = float((seq_log > math.log(U)).to(F64).mean())
            met["rollout_is_ratio_fraction_low"] = float((seq_log < math.log(L_metric)).to(F64).mean())
        wc = w.clamp(min=0.0, max=U)
        met["rollout_is_std"] = clamped_std(w, 0.0, U)
        wc_norm = wc / (tmean(wc) + EPS)
        sq = tmean(wc_norm * wc_norm)  # 0 when every clamped weight is 0: no sample counts (the documented 0)
        met["rollout_is_eff_sample_size"] = 1.0 / sq if sq > 0 else 0.0
        x_b = rmean(w)  # per-row mean applied weight, all B rows (padding rows: 0)
        met["rollout_is_seq_mean"] = float(x_b.mean())
        met["rollout_is_seq_std"] = std_unbiased(x_b)
        met["rollout_is_seq_max"] = float(x_b.max())
        met["rollout_is_seq_min"] = float(x_b.min())
        met["rollout_is_seq_max_deviation"] = float((x_b - 1.0).abs().max())
        raw_b = rmean(raw)  # the row's raw (pre-TIS / IcePop) mean weight; padding rows 0 -> "low"
        met["rollout_is_seq_fraction_high"] = float((raw_b > U).to(F64).mean())
        met["rollout_is_seq_fraction_low"] = float((raw_b < L_metric).to(F64).mean())
        if icepop:
            met["rollout_is_oob_ratio"] = tmean(((raw < L) | (raw > U)).to(F64))
        # docs: exact percentiles of the raw weight over valid tokens
        for p, v in zip(PERCENTILES, _order_stat_quantiles(raw[valid], [p / 100.0 for p in PERCENTILES])):
            met[f"rollout_is_p{p}"] = v
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean_w = tmean(w)
            else:  # mean over valid rows of the per-row mean weight
                mean_w = float(torch.where(row_ok, x_b, zero).sum()) / max(float(S), EPS)
            if mean_w > 1e-8:
                w = w / mean_w
                met["rollout_is_batch_norm_factor"] = mean_w
            else:
                met["rollout_is_batch_norm_factor"] = 1.0
        weights = w

    # ---- rejection sampling (verl compute_rollout_rejection_mask + compute_rs_metrics; ratio criteria: docs)
    keep_all = torch.ones_like(valid)
    if rollout_rs is not None:
        crits = parse_rs_thresholds(rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower)
        tok = {
            "k1": -lr_c,
            "k2": 0.5 * lr_c * lr_c,
            "k3": torch.expm1(lr_c) - lr_c,  # e^l - 1 - l, without fp64 cancellation noise
            "ratio": torch.exp(lr_c),
        }
        for c in crits:
            name, level, stat, lo, hi = c["name"], c["level"], c["stat"], c["lower"], c["upper"]
            has_lower = lo is not None
            p = f"rollout_rs_{name}"
            if level == "token":
                tok_stat = tok[stat]
                keep = tok_stat <= hi
                if has_lower:
                    keep = keep & (tok_stat >= lo)
                row_vals = rmean(tok_stat)
            else:
                if stat == "ratio":
                    # docs: sequence exp(clamp20(sum lr)); geometric exp(clamp20(sum lr / n_b)), the row mean taken as
                    # verl's masked_mean (den_b), like the geometric IS level and every seq_mean_* criterion
                    s = rsum(lr) if level == "sum" else rsum(lr) / den_b
                    row_vals = torch.exp(s.clamp(-CLAMP, CLAMP))
                elif level == "sum":
                    row_vals = rsum(tok[stat])
                elif level == "mean":
                    row_vals = rmean(tok[stat])
                else:  # max over the row's valid tokens, 0 for an empty row
                    row_vals = torch.where(valid, tok[stat], torch.full_like(lr, -math.inf)).max(1).values
                    row_vals = torch.where(row_ok, row_vals, zero)
                row_keep = row_vals <= hi
                if has_lower:
                    row_keep = row_keep & (row_vals >= lo)
                tok_stat = row_vals.unsqueeze(1).expand_as(lr)
                keep = row_keep.unsqueeze(1).expand_as(valid)
            v_ok = row_vals[row_ok]  # the row values of the valid rows
            met[f"{p}_mean"] = tmean(tok_stat)
            if level == "token":
                met[f"{p}_max"] = tmax(tok_stat)
                met[f"{p}_min"] = tmin(tok_stat)
                met[f"{p}_fraction_high"] = tmean((tok_stat > hi).to(F64))
                met[f"{p}_fraction_low"] = tmean((tok_stat < lo).to(F64)) if has_lower else 0.0
            else:
                met[f"{p}_max"] = float(v_ok.max())
                met[f"{p}_min"] = float(v_ok.min())
                met[f"{p}_fraction_high"] = float((v_ok > hi).to(F64).mean())
                met[f"{p}_fraction_low"] = float((v_ok < lo).to(F64).mean()) if has_lower else 0.0
            met[f"{p}_std"] = clamped_std(tok_stat, lo if has_lower else 0.0, hi)
            met[f"{p}_seq_mean"] = float(v_ok.mean())
            met[f"{p}_seq_std"] = std_unbiased(v_ok)
            met[f"{p}_seq_max"] = float(v_ok.max())
            met[f"{p}_seq_min"] = float(v_ok.min())
            met[f"{p}_seq_max_deviation"] = float(v_ok.abs().max())
            met[f"{p}_seq_fraction_high"] = float((v_ok > hi).to(F64).mean())
            if has_lower:
                met[f"{p}_seq_fraction_low"] = float((v_ok < lo).to(F64).mean())
            rejected = valid & ~keep
            met[f"{p}_masked_fraction"] = float(rejected.sum()) / den_N
            met[f"{p}_seq_masked_fraction"] = float(rejected.any(1).sum()) / S
            keep_all = keep_all & keep
        rs_rejected = valid & ~keep_all
        met["rollout_rs_masked_fraction"] = float(rs_rejected.sum()) / den_N
        met["rollout_rs_seq_masked_fraction"] = float(rs_rejected.any(1).to(F64).mean())  # over all B rows

    # ---- the per-token veto (docs): a row with a valid token of ratio < V (unclamped) leaves the mask
    if rollout_token_veto_threshold is not None:
        V = float(rollout_token_veto_threshold)
        if not (math.isfinite(V) and V > 0):
            raise ValueError("rollout_token_veto_threshold must be a finite number > 0")
        catastrophic = valid & (lr < math.log(V))
    else:
        catastrophic = torch.zeros_like(valid)
    vetoed = catastrophic.any(1)
    met["rollout_is_veto_fraction"] = float(vetoed.sum()) / B
    met["rollout_is_catastrophic_token_fraction"] = float(catastrophic.sum()) / den_N

    final = valid & keep_all & ~vetoed.unsqueeze(1)
    removed = valid & ~final
    met["masked_fraction"] = float(removed.sum()) / den_N
    met["seq_masked_fraction"] = float(removed.any(1).sum()) / S
    if nonfinite == "exclude":
        met["nonfinite_token_fraction"] = float(bad.sum()) / float(given.sum())

    # ---- off-policy diagnostics (verl compute_offpolicy_metrics); "mean over rows" includes padding rows
    mlp_b = rmean(lp)
    mrlp_b = rmean(rlp)
    d_b = mrlp_b - mlp_b
    met["training_ppl"] = float(torch.exp(-mlp_b).mean())
    met["training_log_ppl"] = float((-mlp_b).mean())
    met["kl"] = tmean(rlp - lp)
    met["k3_kl"] = tmean(torch.expm1(lr) - lr)  # e^lr - lr - 1, unclamped
    met["rollout_ppl"] = float(torch.exp(-mrlp_b).mean())
    met["rollout_log_ppl"] = float((-mrlp_b).mean())
    met["log_ppl_diff"] = float(d_b.mean())
    met["log_ppl_abs_diff"] = float(d_b.abs().mean())
    met["log_ppl_diff_max"] = float(d_b.max())
    met["log_ppl_diff_min"] = float(d_b.min())
    met["ppl_ratio"] = float(torch.exp(d_b).mean())
    met["chi2_token"] = tmean(torch.exp(2.0 * lr_c)) - 1.0
    met["chi2_seq"] = float(torch.exp(2.0 * rsum(lr).clamp(-CLAMP, CLAMP)).mean()) - 1.0

    if response_mask.dtype == torch.bool:
        mask_out = final
    else:
        mask_out = final.to(response_mask.dtype)
    return weights, mask_out, {f"rollout_corr/{k}": float(v) for k, v in met.items()}


#: The public configuration fields, in docs/rollout_correction.md's order (the oracle's keyword arguments).
CONFIG_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_mode", "rollout_is_threshold_lower",
                 "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                 "rollout_token_veto_threshold", "bypass_mode", "loss_type")


def oracle_for_config(log_prob, rollout_log_prob, response_mask, config, nonfinite: str = "error"):
    """:func:`rollout_correction_oracle` on the public fields of any object that has them (a
    ``RolloutCorrectionConfig``); the config's resolved forms are never read."""
    fields = {name: getattr(config, name) for name in CONFIG_FIELDS}
    return rollout_correction_oracle(log_prob, rollout_log_prob, response_mask, nonfinite=nonfinite, **fields)
