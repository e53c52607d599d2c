"""The pure-PyTorch rollout-correction ops (docs/rollout_correction.md): pass 1 ``rollout_seq_stats`` (per-sequence
aggregates), pass 2 ``rollout_token_pass`` (weights, mask, partials) and ``rollout_check``. Slots, codes and the
configuration arguments come from ``csrc/include/rollout_correction_layout.def``. Formulas: verl 0.9.1
``verl/trainer/ppo/rollout_corr_helper.py``; the veto after verl 0.6.1."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _layout as LY
from .._checks import check_cu_seqlens as _check_cu_seqlens

_SEQ, _SUM, _MAX = LY.SEQ, LY.SUM, LY.MAX
_TOKEN, _SEQ_SUM, _SEQ_MAX = LY.RS_LEVEL["token"], LY.RS_LEVEL["seq_sum"], LY.RS_LEVEL["seq_max"]
_K1, _K2, _K3 = LY.RS_STAT["k1"], LY.RS_STAT["k2"], LY.RS_STAT["k3"]
_REJECTED_COL = {_K1: "rejected_k1", _K2: "rejected_k2", _K3: "rejected_k3", LY.RS_STAT["ratio"]: "rejected_ratio"}
_STAT_COL = {_K1: "k1", _K2: "k2", _K3: "k3", LY.RS_STAT["ratio"]: "rho"}


def _acc(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _criteria(a):
    """The RS criteria of the configuration ``a`` as (level, stat, lower, upper, apply_lower) tuples."""
    return list(zip([int(x) for x in a.rs_level], [int(x) for x in a.rs_stat], [float(x) for x in a.rs_lower],
                    [float(x) for x in a.rs_upper], [bool(x) for x in a.rs_apply_lower]))


def _keep(stat: torch.Tensor, lower: float, upper: float, apply_lower: bool) -> torch.Tensor:
    keep = stat <= upper
    return keep & (stat >= lower) if apply_lower else keep


def _clamp20(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-LY.SAFETY_BOUND, LY.SAFETY_BOUND)


def _token_values(log_prob, rollout_log_prob, mask, exclude_nonfinite):
    # row-major first: torch's row sums follow the layout, and the kernels give the same bits in any layout
    log_prob, rollout_log_prob, mask = (x.contiguous() for x in (log_prob, rollout_log_prob, mask))
    acc = _acc(log_prob, rollout_log_prob)
    lp = log_prob.detach().to(acc)
    rlp = rollout_log_prob.detach().to(acc)
    nonzero = mask != 0
    bad_mask = nonzero & (mask != 1)
    finite = torch.isfinite(lp) & torch.isfinite(rlp)
    valid = nonzero & finite if exclude_nonfinite else nonzero
    zero = torch.zeros((), dtype=acc, device=lp.device)
    lr = torch.where(valid, lp - rlp, zero)
    lp = torch.where(valid, lp, zero)
    rlp = torch.where(valid, rlp, zero)
    l = _clamp20(lr)
    rho = torch.exp(l)
    return valid, nonzero & ~finite, bad_mask, lp, rlp, lr, l, rho


def _token_stat(stat: int, l: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    if stat == _K1:
        return -l
    if stat == _K2:
        return 0.5 * l * l
    if stat == _K3:
        return torch.expm1(l) - l  # e^l - 1 - l without the cancellation of exp(l) - 1
    return rho


def _crit_centre(v: torch.Tensor, n: torch.Tensor, lower: float, upper: float, apply_lower: bool) -> torch.Tensor:
    """A token criterion's per-row centre of its std sums: the row's mean statistic ``v`` clamped as the std clamps
    a token (deviations near 0 keep E[x^2] - E[x]^2 free of fp32 cancellation), 0 for a row without tokens."""
    return torch.where(n > 0, v.clamp(lower if apply_lower else 0.0, upper), torch.zeros_like(v))


def _token_is_weight(rho, is_mask, is_lower, is_upper):
    if is_mask:
        return torch.where((rho >= is_lower) & (rho <= is_upper), rho, torch.zeros_like(rho))
    # TIS: clamp(rho, is_lower, is_upper); is_lower is 0 (a no-op on a weight) unless two-sided.
    return rho.clamp(min=is_lower, max=is_upper)


def _padded(x: torch.Tensor, cu: torch.Tensor):
    """The fallback's way to a packed stream: a padded [B, max_len] copy (0 past each end) and its validity.
    (The kernels reduce segment by segment instead.)"""
    lens = cu[1:] - cu[:-1]
    width = int(lens.max()) if lens.numel() else 0
    pos = torch.arange(width, device=x.device)
    inside = pos.unsqueeze(0) < lens.unsqueeze(1)
    idx = (cu[:-1].unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(x.shape[0] - 1, 0))
    taken = x[idx] if x.numel() else x.new_zeros(idx.shape)
    return torch.where(inside, taken, torch.zeros((), dtype=x.dtype, device=x.device)), inside


def rollout_seq_stats(log_prob, rollout_log_prob, mask, cu_seqlens, *config):
    """Pass 1: per-sequence aggregates ``[B, SEQ_COLS]`` (columns: ``_layout.SEQ``); packed: one row per segment.
    ``config``: the op's configuration arguments (``_layout.RolloutOpArgs``, schema order)."""
    a = LY.RolloutOpArgs(*config)
    if cu_seqlens is not None:
        cu = _check_cu_seqlens(log_prob, cu_seqlens)
        return rollout_seq_stats(_padded(log_prob, cu)[0], _padded(rollout_log_prob, cu)[0], _padded(mask, cu)[0],
                                 None, *a)
    valid, nonfinite, bad_mask, lp, rlp, lr, l, rho = _token_values(log_prob, rollout_log_prob, mask,
                                                                     a.exclude_nonfinite)
    acc = lr.dtype
    vf = valid.to(acc)
    out = torch.zeros(lr.shape[0], LY.SEQ_COLS, dtype=acc, device=lr.device)
    k2 = 0.5 * l * l
    k3 = torch.expm1(l) - l
    out[:, _SEQ["tokens"]] = vf.sum(1)
    out[:, _SEQ["log_ratio"]] = lr.sum(1)
    out[:, _SEQ["k1"]] = (-l).sum(1)
    out[:, _SEQ["k2"]] = (k2 * vf).sum(1)
    out[:, _SEQ["k3"]] = (k3 * vf).sum(1)
    out[:, _SEQ["log_prob"]] = lp.sum(1)
    out[:, _SEQ["rollout_log_prob"]] = rlp.sum(1)
    out[:, _SEQ["rho"]] = (rho * vf).sum(1)
    if int(a.is_level) == LY.IS_LEVEL["token"]:
        out[:, _SEQ["token_weight"]] = (_token_is_weight(rho, a.is_mask, a.is_lower, a.is_upper) * vf).sum(1)
    rejected_any = torch.zeros_like(valid)
    for level, stat, lower, upper, apply_lower in _criteria(a):
        if level != _TOKEN:
            continue
        rejected = ~_keep(_token_stat(stat, l, rho), lower, upper, apply_lower) & valid
        out[:, _SEQ[_REJECTED_COL[stat]]] = rejected.to(acc).sum(1)
        rejected_any |= rejected
    out[:, _SEQ["rejected"]] = rejected_any.to(acc).sum(1)
    out[:, _SEQ["nonfinite"]] = nonfinite.to(acc).sum(1)
    out[:, _SEQ["bad_mask"]] = bad_mask.to(acc).sum(1)
    ninf = torch.full((), -math.inf, dtype=acc, device=lr.device)
    has_cols = lr.shape[1] > 0
    out[:, _SEQ["max_k2"]] = torch.where(valid, k2, ninf).amax(1) if has_cols else -math.inf
    out[:, _SEQ["max_k3"]] = torch.where(valid, k3, ninf).amax(1) if has_cols else -math.inf
    out[:, _SEQ["neg_min_log_ratio"]] = torch.where(valid, -lr, ninf).amax(1) if has_cols else -math.inf
    return out


def _count_eps(mask_dtype: torch.dtype) -> float:
    """The 1e-8 verl's masked_mean adds to a count in the mask's dtype, where it survives (``LY.count_keeps_eps``);
    the kernels' ``Config::count_eps``."""
    return LY.EPS if LY.count_keeps_eps(mask_dtype) else 0.0


def _row_den(n, count_eps: float):
    """A row mean's denominator (``row_den`` of rollout_correction_math.h): n + count_eps, eps for an empty row."""
    return torch.where(n > 0, n + count_eps, torch.full_like(n, LY.EPS))


def _row_values(st, a, crits, count_eps: float):
    n = st[:, _SEQ["tokens"]]
    lr_sum = st[:, _SEQ["log_ratio"]]
    den = _row_den(n, count_eps)
    log_w = lr_sum if int(a.is_level) == LY.IS_LEVEL["sequence"] else lr_sum / den
    raw = torch.exp(_clamp20(log_w))
    w = _token_is_weight(raw, a.is_mask, a.is_lower, a.is_upper)
    values, keeps = [], []
    seq_rejected = torch.zeros_like(n, dtype=torch.bool)
    for level, stat, lower, upper, apply_lower in crits:
        if level == _TOKEN:  # per-row mean of the token statistic (verl masked_mean(axis=-1))
            v = st[:, _SEQ[_STAT_COL[stat]]] / den
            keep = None
        else:
            if stat == LY.RS_STAT["ratio"]:
                v = torch.exp(_clamp20(lr_sum if level == _SEQ_SUM else lr_sum / den))
            elif level == _SEQ_MAX:  # verl: -inf (no valid token) -> 0
                m = st[:, _SEQ["max_k2" if stat == _K2 else "max_k3"]]
                v = torch.where(n > 0, m, torch.zeros_like(m))
            else:
                s = st[:, _SEQ[_STAT_COL[stat]]]
                v = s if level == _SEQ_SUM else s / den
            keep = _keep(v, lower, upper, apply_lower)
            seq_rejected |= ~keep
        values.append(v)
        keeps.append(keep)
    veto = torch.zeros_like(seq_rejected)
    if a.veto_threshold is not None:  # a valid token with lr < log V  <=>  max(-lr) > -log V
        veto = st[:, _SEQ["neg_min_log_ratio"]] > -math.log(a.veto_threshold)
    return n, lr_sum, log_w, raw, w, values, keeps, seq_rejected, veto


def _wc_centre(st: torch.Tensor, is_upper: float) -> torch.Tensor:
    """Token-level IS: each row's mean clamped weight from pass 1 (0 for a row without tokens), the centre of its
    deviation sums."""
    n = st[:, _SEQ["tokens"]]
    mean_w = st[:, _SEQ["token_weight"]] / torch.where(n > 0, n, torch.ones_like(n))
    return torch.where(n > 0, mean_w, torch.zeros_like(mean_w)).clamp(0.0, is_upper)


def _hist_index(log_w: torch.Tensor) -> torch.Tensor:
    scale = LY.HIST_BINS / (LY.HIST_HI - LY.HIST_LO)
    log_w = torch.nan_to_num(log_w, nan=LY.HIST_LO)
    return ((log_w - LY.HIST_LO) * scale).floor().clamp(0, LY.HIST_BINS - 1).to(torch.int64)


def rollout_token_pass(log_prob, rollout_log_prob, mask, cu_seqlens, seq_stats, *config_and_row_partials):
    """Pass 2: (weights or ``[0]``, mask_out, SUM partials, MAX partials); slots: ``_layout.SUM`` / ``MAX``.
    Weights and mask_out row-major in the inputs' shape (packed: ``[T]``). ``config_and_row_partials``: the
    configuration arguments (``_layout.RolloutOpArgs``, schema order), then ``row_partials``."""
    *config, row_partials = config_and_row_partials
    a = LY.RolloutOpArgs(*config)
    if cu_seqlens is not None:
        cu = _check_cu_seqlens(log_prob, cu_seqlens)
        m_pad, inside = _padded(mask, cu)
        w, m_out, S, M = rollout_token_pass(_padded(log_prob, cu)[0], _padded(rollout_log_prob, cu)[0], m_pad, None,
                                            seq_stats, *a, row_partials)
        return (w[inside] if w.dim() == 2 else w, m_out[inside], S, M)  # 1-D: the no-IS placeholder [0]
    valid, _, _, lp, rlp, lr, l, rho = _token_values(log_prob, rollout_log_prob, mask, a.exclude_nonfinite)
    acc = lr.dtype
    dev = lr.device
    vf = valid.to(acc)
    crits = _criteria(a)
    n_sum, n_max = LY.partial_sizes(len(crits))
    S = torch.zeros(n_sum, dtype=torch.float64, device=dev)
    M = torch.full((n_max,), -math.inf, dtype=torch.float64, device=dev)
    ninf = torch.full((), -math.inf, dtype=acc, device=dev)
    has_tokens = lr.numel() > 0
    level = int(a.is_level)

    def tsum(x):  # over valid tokens: within a row in acc, across rows in fp64
        return (x * vf).sum(1).to(torch.float64).sum()

    def tmax(x):
        return torch.where(valid, x, ninf).amax().to(torch.float64) if has_tokens else S.new_tensor(-math.inf)

    st = seq_stats.to(acc)
    count_eps = _count_eps(mask.dtype)
    n, lr_sum, log_w, raw_b, w_b, values, keeps, seq_rejected, veto = _row_values(st, a, crits, count_eps)

    if level == LY.IS_LEVEL["none"]:
        weights = lr.new_zeros(0)
    elif level == LY.IS_LEVEL["token"]:
        w = _token_is_weight(rho, a.is_mask, a.is_lower, a.is_upper)
        weights = w * vf
        wc = w.clamp(0.0, a.is_upper)
        S[_SUM["is_weight"]] += tsum(w)
        centre = _wc_centre(st, a.is_upper).unsqueeze(1)  # deviations from the row's mean: no cancellation in the std
        S[_SUM["is_wc_dev"]] += tsum(wc - centre)
        S[_SUM["is_wc_dev_sq"]] += tsum((wc - centre) ** 2)
        S[_SUM["is_wc_centre_dev"]] += tsum(centre * (wc - centre))
        S[_SUM["is_high"]] += tsum((rho > a.is_upper).to(acc))
        S[_SUM["is_low"]] += tsum((rho < a.is_metric_lower).to(acc))
        if a.is_mask:
            S[_SUM["is_out_of_band"]] += tsum(((rho < a.is_lower) | (rho > a.is_upper)).to(acc))
        M[_MAX["is_weight"]] = tmax(w)
        M[_MAX["neg_is_weight"]] = tmax(-w)
        S[LY.SUM_HIST:LY.SUM_CRIT_BASE].index_add_(0, _hist_index(l).reshape(-1), vf.reshape(-1).to(torch.float64))
    else:
        weights = w_b.unsqueeze(1) * vf

    token_rejected = torch.zeros_like(valid)
    for i, (lvl, stat, lower, upper, apply_lower) in enumerate(crits):
        if lvl != _TOKEN:
            continue
        s = _token_stat(stat, l, rho)
        token_rejected |= ~_keep(s, lower, upper, apply_lower)
        sc = s.clamp(lower if apply_lower else 0.0, upper)
        S[LY.crit_sum(i, "stat")] += tsum(s)
        centre = _crit_centre(values[i], n, lower, upper, apply_lower).unsqueeze(1)
        S[LY.crit_sum(i, "clamped_dev")] += tsum(sc - centre)
        S[LY.crit_sum(i, "clamped_dev_sq")] += tsum((sc - centre) ** 2)
        S[LY.crit_sum(i, "centre_dev")] += tsum(centre * (sc - centre))
        S[LY.crit_sum(i, "high")] += tsum((s > upper).to(acc))
        if apply_lower:
            S[LY.crit_sum(i, "low")] += tsum((s < lower).to(acc))
        M[LY.crit_max(i, "stat")] = tmax(s)
        M[LY.crit_max(i, "neg_stat")] = tmax(-s)
    keep = valid & ~token_rejected & ~(seq_rejected | veto).unsqueeze(1)
    mask_out = keep.to(mask.dtype)

    S[_SUM["k3_raw"]] += tsum(torch.expm1(lr) - lr)  # k3_kl uses the unclamped ratio
    S[_SUM["rho_sq"]] += tsum(rho * rho)
    if a.veto_threshold is not None:
        S[_SUM["catastrophic"]] += tsum((lr < math.log(a.veto_threshold)).to(acc))
    if row_partials:
        _row_partials(S, M, st, a, crits, n, lr_sum, log_w, raw_b, w_b, values, keeps, seq_rejected, veto, count_eps)
    return weights, mask_out, S, M


def _row_partials(S, M, st, a, crits, n, lr_sum, log_w, raw_b, w_b, values, keeps, seq_rejected, veto,
                  count_eps: float) -> None:
    """The ROW terms of pass 2, once per sequence: per-row values in the stats dtype, sums in fp64."""
    f = lambda x: x.to(torch.float64)  # noqa: E731
    nd = f(n)
    sv = n > 0
    svd = f(sv)
    ninf = torch.tensor(-math.inf, dtype=torch.float64, device=n.device)
    den = _row_den(n, count_eps)
    level = int(a.is_level)

    def rmax(x, where=None):
        x = f(x)
        if where is not None:
            x = torch.where(where, x, ninf)
        return x.amax() if x.numel() else ninf

    S[_SUM["tokens"]] += nd.sum()
    S[_SUM["rows"]] += float(n.shape[0])
    S[_SUM["valid_rows"]] += svd.sum()
    S[_SUM["nonfinite"]] += f(st[:, _SEQ["nonfinite"]]).sum()
    S[_SUM["bad_mask"]] += f(st[:, _SEQ["bad_mask"]]).sum()
    if level != LY.IS_LEVEL["none"]:
        if level == LY.IS_LEVEL["token"]:
            x = st[:, _SEQ["token_weight"]] / den  # verl: masked_mean(weights, mask, axis=-1)
            raw_mean = st[:, _SEQ["rho"]] / den
            centre = f(_wc_centre(st, a.is_upper))
            S[_SUM["is_wc_centre"]] += (nd * centre).sum()
            S[_SUM["is_wc_centre_sq"]] += (nd * centre * centre).sum()
        else:
            wc = w_b.clamp(0.0, a.is_upper)
            S[_SUM["seq_is_weight"]] += (nd * f(w_b)).sum()
            S[_SUM["seq_is_wc"]] += (nd * f(wc)).sum()
            S[_SUM["seq_is_wc_sq"]] += (nd * f(wc) ** 2).sum()
            S[_SUM["seq_is_high"]] += f(log_w > math.log(a.is_upper)).sum()
            S[_SUM["seq_is_low"]] += f(log_w < math.log(a.is_metric_lower)).sum()
            if a.is_mask:
                S[_SUM["seq_is_out_of_band"]] += (nd * f((raw_b < a.is_lower) | (raw_b > a.is_upper))).sum()
            M[_MAX["is_log_weight"]] = torch.maximum(M[_MAX["is_log_weight"]], rmax(log_w))
            M[_MAX["neg_is_log_weight"]] = torch.maximum(M[_MAX["neg_is_log_weight"]], rmax(-log_w))
            S[LY.SUM_HIST:LY.SUM_CRIT_BASE].index_add_(0, _hist_index(_clamp20(log_w)), nd)
            x = w_b * n / den
            raw_mean = raw_b * n / den
        S[_SUM["is_seq_mean"]] += f(x).sum()
        S[_SUM["is_seq_mean_sq"]] += (f(x) ** 2).sum()
        S[_SUM["is_seq_high"]] += f(raw_mean > a.is_upper).sum()
        S[_SUM["is_seq_low"]] += f(raw_mean < a.is_metric_lower).sum()
        M[_MAX["is_seq_mean"]] = rmax(x)
        M[_MAX["neg_is_seq_mean"]] = rmax(-x)
        M[_MAX["is_seq_deviation"]] = rmax((x - 1.0).abs())

    for i, (lvl, stat, lower, upper, apply_lower) in enumerate(crits):
        v = values[i]
        if lvl != _TOKEN:
            sc = v.clamp(lower if apply_lower else 0.0, upper)
            S[LY.crit_sum(i, "stat")] += (nd * f(v)).sum()
            S[LY.crit_sum(i, "centre")] += (nd * f(sc)).sum()  # the row's own value: its centre, no deviation
            S[LY.crit_sum(i, "centre_sq")] += (nd * f(sc) ** 2).sum()
            S[LY.crit_sum(i, "high")] += f((v > upper) & sv).sum()
            if apply_lower:
                S[LY.crit_sum(i, "low")] += f((v < lower) & sv).sum()
            M[LY.crit_max(i, "stat")] = rmax(v, sv)
            M[LY.crit_max(i, "neg_stat")] = rmax(-v, sv)
            rejected_rows = ~keeps[i] & sv
            S[LY.crit_sum(i, "rejected_tokens")] += (nd * f(rejected_rows)).sum()
        else:
            count = st[:, _SEQ[_REJECTED_COL[stat]]]
            S[LY.crit_sum(i, "rejected_tokens")] += f(count).sum()
            rejected_rows = (count > 0) & sv
            centre = f(_crit_centre(v, n, lower, upper, apply_lower))
            S[LY.crit_sum(i, "centre")] += (nd * centre).sum()
            S[LY.crit_sum(i, "centre_sq")] += (nd * centre * centre).sum()
        S[LY.crit_sum(i, "rejected_rows")] += f(rejected_rows).sum()
        S[LY.crit_sum(i, "seq")] += (f(v) * svd).sum()
        S[LY.crit_sum(i, "seq_sq")] += (f(v) ** 2 * svd).sum()
        S[LY.crit_sum(i, "seq_high")] += f((v > upper) & sv).sum()
        if apply_lower:
            S[LY.crit_sum(i, "seq_low")] += f((v < lower) & sv).sum()
        M[LY.crit_max(i, "seq")] = rmax(v, sv)
        M[LY.crit_max(i, "neg_seq")] = rmax(-v, sv)
        M[LY.crit_max(i, "seq_deviation")] = rmax(v.abs(), sv)

    rejected_tokens = st[:, _SEQ["rejected"]]
    S[_SUM["rs_rejected_tokens"]] += torch.where(seq_rejected, nd, f(rejected_tokens)).sum()
    S[_SUM["rs_rejected_rows"]] += f((seq_rejected & sv) | (rejected_tokens > 0)).sum()
    S[_SUM["veto_rows"]] += f(veto).sum()
    dropped = seq_rejected | veto
    S[_SUM["final_rejected_tokens"]] += torch.where(dropped, nd, f(rejected_tokens)).sum()
    S[_SUM["final_rejected_rows"]] += f(sv & (dropped | (rejected_tokens > 0))).sum()

    # Off-policy row terms (verl compute_offpolicy_metrics): per-sequence means, averaged over all rows.
    mean_lp = st[:, _SEQ["log_prob"]] / den
    mean_rlp = st[:, _SEQ["rollout_log_prob"]] / den
    lpd = -lr_sum / den  # mean rollout logp - mean training logp, without the cancellation
    S[_SUM["log_ratio"]] += f(lr_sum).sum()
    # the perplexities' exps in fp64, as their sums (a row mean below -88 overflows fp32's exp)
    S[_SUM["training_ppl"]] += torch.exp(-f(mean_lp)).sum()
    S[_SUM["training_log_ppl"]] += f(-mean_lp).sum()
    S[_SUM["rollout_ppl"]] += torch.exp(-f(mean_rlp)).sum()
    S[_SUM["rollout_log_ppl"]] += f(-mean_rlp).sum()
    S[_SUM["log_ppl_diff"]] += f(lpd).sum()
    S[_SUM["log_ppl_abs_diff"]] += f(lpd.abs()).sum()
    S[_SUM["ppl_ratio"]] += torch.exp(f(lpd)).sum()
    S[_SUM["chi2_seq"]] += f(torch.exp(2.0 * _clamp20(lr_sum))).sum()
    M[_MAX["log_ppl_diff"]] = rmax(lpd)
    M[_MAX["neg_log_ppl_diff"]] = rmax(-lpd)


_MSG_CONFIG_MISMATCH = (
    "compute_rollout_correction: the ranks of dp_group pass different rollout-correction settings (config "
    "fingerprints differ: RolloutCorrectionConfig fields or nonfinite); every data-parallel rank must use the "
    "same config")
_MSG_BAD_MASK = ("response_mask must hold only 0 and 1 (bool, integer or floating point); other values would weight "
                 "tokens, which the rollout correction does not define")
_MSG_NONFINITE = ("log_prob / rollout_log_prob hold NaN or +-inf at valid response_mask positions; fix the inputs "
                  "or pass nonfinite='exclude' to drop those tokens (counted in rollout_corr/nonfinite_token_fraction)")
#: also raised from the host by versions.compute_rollout_correction_by_lag (its counts are read there anyway)
MSG_NO_VALID_TOKEN = "response_mask has no valid token (over the whole data-parallel batch); nothing to correct"


def _first(hit: torch.Tensor, name: str, values: torch.Tensor) -> str:
    idx = torch.nonzero(hit)
    if idx.numel() == 0:
        return " (on another rank)"
    b, t = idx[0].tolist()
    return f" (first on this rank: {name}[{b}, {t}] = {float(values[b, t])})"


def rollout_check(sums: torch.Tensor, agree: Optional[torch.Tensor], log_prob: torch.Tensor,
                  rollout_log_prob: torch.Tensor, mask: torch.Tensor, exclude_nonfinite: bool,
                  allow_empty: bool = False) -> torch.Tensor:
    """The batch-level checks of the reduced partials (see the schema); returns a copy of ``sums``."""
    if sums.device.type == "cuda":
        if agree is not None:
            torch._assert_async(agree.reshape(()).bool(), _MSG_CONFIG_MISMATCH)
        torch._assert_async(sums[_SUM["bad_mask"]] == 0, _MSG_BAD_MASK)
        if not exclude_nonfinite:
            torch._assert_async(sums[_SUM["nonfinite"]] == 0, _MSG_NONFINITE)
        if not allow_empty:
            torch._assert_async(sums[_SUM["tokens"]] > 0, MSG_NO_VALID_TOKEN)
        return sums.clone()
    if agree is not None and not bool(agree):
        raise ValueError(_MSG_CONFIG_MISMATCH)
    if float(sums[_SUM["bad_mask"]]) > 0:
        raise ValueError(_MSG_BAD_MASK + _first((mask != 0) & (mask != 1), "response_mask", mask))
    if not exclude_nonfinite and float(sums[_SUM["nonfinite"]]) > 0:
        valid = mask != 0
        where = _first(valid & ~torch.isfinite(log_prob), "log_prob", log_prob)
        if "first" not in where:
            where = _first(valid & ~torch.isfinite(rollout_log_prob), "rollout_log_prob", rollout_log_prob)
        raise ValueError(_MSG_NONFINITE + where)
    if not allow_empty and not float(sums[_SUM["tokens"]]) > 0:
        raise ValueError(MSG_NO_VALID_TOKEN)
    return sums.clone()


def row_rejections(seq_stats: torch.Tensor, a, mask_dtype: torch.dtype):
    """Which criterion dropped tokens of each row, from the (context-parallel reduced) row statistics: one bool
    ``[B]`` per RS criterion of ``a`` in order (a token-level criterion: the row lost at least one token to it),
    then the veto. The rules the token pass applies (``_row_values``) for a response mask of ``mask_dtype``."""
    st = seq_stats  # in the kernels' accumulation dtype, so the decisions are theirs
    crits = _criteria(a)
    *_, keeps, _, veto = _row_values(st, a, crits, _count_eps(mask_dtype))
    out = []
    for (level, stat, *_rest), keep in zip(crits, keeps):
        out.append(st[:, _SEQ[_REJECTED_COL[stat]]] > 0 if level == _TOKEN else ~keep)
    return out + [veto]
