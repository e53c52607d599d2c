"""The pure-PyTorch implementation of every op: what runs when the compiled extension is not built
(``backend() == "fallback"``) and for devices the build has no kernels for.

Every function mirrors the contract of the ``torch.ops.rollout_corr.*`` op of the same name (same arguments, same
outputs, same dtypes); :mod:`rollout_corr_ext.ops` picks between the two. Production code only: the test oracles
live in the ``rollout_corr_testing`` package and share nothing with this module or the kernels.
Sections: vocab-parallel log-probs (docs/logprobs.md); rollout correction (docs/rollout_correction.md); policy losses (docs/megatron.md, "Loss modes").
"""

from __future__ import annotations

import math
import struct
from typing import Optional, Tuple

import torch

from . import _layout as LY

# ---------------------------------------------------------------------------------------------------------
# §2 Vocab-parallel log-probs and entropy
# ---------------------------------------------------------------------------------------------------------

# The record layout (LY.HDR_*, ROW_STAT_*, ROW_STATE_*, STATUS_*, ...) and the policy-loss codes (LY.PG_*) come from
# their one declaration (csrc/include/*_layout.def, read by _layout.py).
from ._checks import acc_dtype as _acc_dtype, check_cu_seqlens as _check_cu_seqlens, masked as _masked  # noqa: E402


def _valid_cols(vocab_start: int, vocab_size: int, local_vocab: int) -> int:
    """Number of real (non-padding) columns of a shard that starts at global column ``vocab_start``."""
    return max(0, min(local_vocab, vocab_size - vocab_start))




def _signed64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _lshr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def target_fingerprint(target: torch.Tensor) -> int:
    """Wrapping sum over rows of splitmix64's finalizer of (row, id): the header's target fingerprint."""
    t = target.reshape(-1).to(torch.int64).cpu()
    rows = torch.arange(t.numel(), dtype=torch.int64)
    z = t + _signed64(0x9E3779B97F4A7C15) * (rows + 1)
    z = (z ^ _lshr(z, 30)) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ _lshr(z, 27)) * _signed64(0x94D049BB133111EB)
    z = z ^ _lshr(z, 31)
    return int(z.sum()) if t.numel() else 0


def _mix64(row: int, t: int) -> int:
    """target_fingerprint's mixer (splitmix64's finalizer over (row, id)) on Python ints, as uint64."""
    m = (1 << 64) - 1
    z = (t + 0x9E3779B97F4A7C15 * (row + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def settings_fingerprint(inv_temperature: float, ignore_index: int) -> int:
    """The call settings every rank must share (1/T, ignore_index) in the format slot's bits 16..62
    (settings_fingerprint in csrc/logprob_host.h, the same bits)."""
    bits = struct.unpack("<q", struct.pack("<d", float(inv_temperature)))[0]
    return _mix64(bits, int(ignore_index)) & 0x7FFFFFFFFFFF0000


def vocab_row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
    with_sum_z: bool,
    with_entropy: bool = True,
) -> torch.Tensor:
    """The shard record of one vocab shard ``[N, V_local]`` (``target`` ``[N]`` holds **global** ids).

    A flat tensor in the accumulation dtype: the 64-byte header (int64 slots ``HDR_*``), then per row, with
    m = max x and zm = (x - m) * inv_temperature over the shard's non-padding columns: m, d = sum e^zm,
    s = sum e^zm zm, y = x[target] when the target lies in this shard (else -inf)[, sz = 2^-32 sum zm]. -inf logits
    add nothing to d and s; a shard of only -inf has d = 0 (the merge's identity). ``with_entropy=False`` sets the
    header's LY.FORMAT_NO_ENTROPY flag (the compiled CPU kernels then skip s; the fallback takes it anyway).
    """
    acc = _acc_dtype(logits.dtype)
    n, local_vocab = logits.shape
    cols = _valid_cols(vocab_start, vocab_size, local_vocab)
    k = 5 if with_sum_z else 4
    x = logits[:, :cols].to(acc)
    rec = torch.zeros(n, k, dtype=acc, device=logits.device)
    if cols > 0:
        m = x.amax(dim=1)
        empty = m == -math.inf
        zm = (x - torch.where(empty, torch.zeros_like(m), m).unsqueeze(1)) * inv_temperature
        e = torch.exp(zm)
        rec[:, LY.ROW_STAT_MAX] = m
        rec[:, LY.ROW_STAT_SUM_EXP] = torch.where(empty, torch.zeros_like(m), e.sum(1))
        rec[:, LY.ROW_STAT_SUM_EXP_Z] = torch.where(empty, torch.zeros_like(m),
                                                torch.where(e > 0, e * zm, torch.zeros_like(zm)).sum(1))
        if with_sum_z:  # scaled by 2^-32 before the subtraction: no term or sum leaves the range (LY.SUM_Z_SCALE)
            mz = torch.where(empty, torch.zeros_like(m), m).unsqueeze(1) * LY.SUM_Z_SCALE
            zs = (x * LY.SUM_Z_SCALE - mz) * inv_temperature
            rec[:, LY.ROW_STAT_SUM_Z] = torch.where(empty, torch.full_like(m, -math.inf), zs.sum(1))
    else:
        rec[:, LY.ROW_STAT_MAX] = -math.inf
    local = target - vocab_start
    in_shard = (local >= 0) & (local < cols) & (target != ignore_index)
    picked = x.gather(1, local.clamp(0, max(cols - 1, 0)).unsqueeze(1)).squeeze(1) if cols else x.new_zeros(n)
    rec[:, LY.ROW_STAT_TARGET_X] = torch.where(in_shard, picked, torch.full_like(picked, -math.inf))
    elem = torch.empty((), dtype=acc).element_size()
    header = torch.tensor([LY.SHARD_MAGIC, n, vocab_start, local_vocab, cols, vocab_size,
                           _signed64(target_fingerprint(target)),
                           (k + 16 * elem + (0 if with_entropy else LY.FORMAT_NO_ENTROPY))
                           | settings_fingerprint(inv_temperature, ignore_index)], dtype=torch.int64)
    return torch.cat([header.view(acc).to(logits.device), rec.reshape(-1)])



def merge_row_stats(
    gathered: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int, inv_temperature: float,
    with_sum_z: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the shard records of all ranks ``[R, record_len]`` into (logp, entropy, mean_logp, row_state, status).

    M = max_r m_r; every other sum is rebased to M: D = sum_r d_r e^{(m_r - M)/T}, S = sum_r e^{(m_r - M)/T}
    (s_r + d_r (m_r - M)/T), SZ = sum_r (sz_r + n_r (m_r - M)/T) (scaled by LY.SUM_Z_SCALE, as sz is); then
    logp = (y - M)/T - log D, H = log D - S/D, mean_logp = SZ / vocab_size - log D. Ignored rows give 0. Records
    taken with ``with_entropy=False`` (the LY.FORMAT_NO_ENTROPY flag) give a NaN entropy and a 0 mean in the row state.
    Errors (bad layout, target out of range, NaN/+inf, a row of only -inf) raise, naming the position.
    """
    acc = gathered.dtype
    r_count = gathered.shape[0]
    k = 5 if with_sum_z else 4
    hl = LY.header_len(acc)
    n = target.shape[0]
    if gathered.shape[1] != hl + n * k:
        raise RuntimeError(f"gathered shard records must have length {hl + n * k}, got {gathered.shape[1]}: the "
                           f"tensor-parallel ranks disagree on the number of rows or on the record format")
    headers = gathered[:, :hl].cpu().reshape(-1).clone().view(torch.int64).view(r_count, -1).tolist()
    why = LY.layout_error(headers, vocab_size)
    if why is not None:
        raise RuntimeError("vocab_parallel_log_probs: the tensor-parallel shards do not fit together: " + why)
    rec = gathered[:, hl:].reshape(r_count, n, k)
    m, d, s = rec[..., LY.ROW_STAT_MAX], rec[..., LY.ROW_STAT_SUM_EXP], rec[..., LY.ROW_STAT_SUM_EXP_Z]
    poisoned = ((d != d) | (s != s) | (m == math.inf)).any(0)
    big_m = m.amax(0)
    mass = d > 0
    delta = torch.where(mass, (m - big_m) * inv_temperature, torch.zeros_like(m))
    scale = torch.where(mass, torch.exp(delta), torch.zeros_like(m))
    d_tot = (d * scale).sum(0)
    s_tot = torch.where(scale > 0, scale * (s + d * delta), torch.zeros_like(s)).sum(0)
    y = rec[..., LY.ROW_STAT_TARGET_X].amax(0)
    ignored = target == ignore_index
    bad_target = ~ignored & ((target < 0) | (target >= vocab_size))
    if bool(bad_target.any()):
        pos = int(torch.nonzero(bad_target)[0])
        raise RuntimeError(f"target holds ids outside [0, vocab_size={vocab_size}) that are not "
                           f"ignore_index={ignore_index}: target.flatten()[{pos}] = {int(target[pos])}")
    bad_value = ~ignored & (poisoned | (d_tot != d_tot))
    if bool(bad_value.any()):
        pos = int(torch.nonzero(bad_value)[0])
        raise RuntimeError(f"logits hold NaN or +inf in row {pos} of the flattened logits (logits.reshape(-1, "
                           f"V_local)[{pos}], on this rank or another rank of the tensor-parallel group)")
    no_mass = ~ignored & (d_tot == 0)
    if bool(no_mass.any()):
        pos = int(torch.nonzero(no_mass)[0])
        raise RuntimeError(f"every logit of row {pos} (logits.reshape(-1, V_local)[{pos}], over all "
                           f"tensor-parallel shards) is -inf: its softmax is undefined")
    one = torch.ones_like(d_tot)
    log_d = torch.log(torch.where(ignored, one, d_tot))
    mean_z = torch.where(ignored, one, s_tot) / torch.where(ignored, one, d_tot)
    zero = torch.zeros_like(log_d)
    # (y - M)/T with y and M scaled first: y - M alone overflows at spreads past fp32's maximum where (y - M)/T need not
    y_shift = (y * LY.SUM_Z_SCALE - big_m * LY.SUM_Z_SCALE) * inv_temperature / LY.SUM_Z_SCALE
    logp = torch.where(ignored, zero, y_shift - log_d)
    if headers[0][LY.HDR_FORMAT] & LY.FORMAT_NO_ENTROPY:
        mean_z = torch.zeros_like(mean_z)
        entropy = torch.where(ignored, zero, torch.full_like(zero, math.nan))
    else:
        entropy = torch.where(ignored, zero, log_d - mean_z)
    if with_sum_z:
        n_r = torch.tensor([h[LY.HDR_VALID_COLS] for h in headers], dtype=acc, device=gathered.device).unsqueeze(1)
        sz = rec[..., LY.ROW_STAT_SUM_Z]
        delta_s = torch.where(mass, (m * LY.SUM_Z_SCALE - big_m * LY.SUM_Z_SCALE) * inv_temperature, torch.zeros_like(m))
        term = torch.where(mass, sz + n_r * delta_s, torch.where(n_r > 0, torch.full_like(sz, -math.inf),
                                                                   torch.zeros_like(sz)))
        mean_logp = torch.where(ignored, zero, term.sum(0) / vocab_size / LY.SUM_Z_SCALE - log_d)
    else:
        mean_logp = zero.clone()
    row_state = torch.stack([torch.where(ignored, zero, big_m), torch.where(ignored, zero, log_d),
                             torch.where(ignored, zero, mean_z)], dim=1)
    status = torch.zeros(4, dtype=torch.int32, device=gathered.device)
    return logp, entropy, mean_logp, row_state, status


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
    """Gradient w.r.t. one shard ``[N, V_local]`` of logits, in the logits dtype. With zm = (x - M)/T and
    p = e^{zm - log D}:

    d logp / dx_i = (1[i = y] - p_i) / T;  d H / dx_i = -p_i (zm_i - S/D) / T (0 where p = 0);
    d mean_logp / dx_i = (1/V - p_i) / T. Padding columns and ignored rows get 0.
    """
    acc = _acc_dtype(logits.dtype)
    n, local_vocab = logits.shape
    cols = _valid_cols(vocab_start, vocab_size, local_vocab)
    x = logits[:, :cols].to(acc)
    state = row_state.to(acc)
    zm = (x - state[:, LY.ROW_STATE_MAX:LY.ROW_STATE_MAX + 1]) * inv_temperature
    p = torch.exp(zm - state[:, LY.ROW_STATE_LOG_SUM_EXP:LY.ROW_STATE_LOG_SUM_EXP + 1])
    ent = torch.where(p > 0, p * (zm - state[:, LY.ROW_STATE_MEAN_Z:LY.ROW_STATE_MEAN_Z + 1]), torch.zeros_like(p))
    valid = (target != ignore_index).unsqueeze(1)

    def _g(g: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.zeros(n, 1, dtype=acc, device=logits.device) if g is None else g.to(acc).reshape(n, 1)

    g_lp, g_h, g_m = _g(grad_logp), _g(grad_entropy), _g(grad_mean_logp)
    grad = g_m / vocab_size - (g_lp + g_m) * p - g_h * ent
    local = target - vocab_start
    hit = (local >= 0) & (local < cols) & (target != ignore_index)
    rows = torch.nonzero(hit).squeeze(1)
    if cols:
        grad[rows, local[rows]] += g_lp.squeeze(1)[rows]
    grad = torch.where(valid, grad * inv_temperature, torch.zeros_like(grad))
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


# ---------------------------------------------------------------------------------------------------------
# §3 Rollout correction: pass 1 (per-sequence aggregates), pass 2 (weights, mask, partials), the batch check.
# Layouts: rollout_corr_ext/_layout.py (read from csrc/include/rollout_correction_layout.def). Formulas: verl
# 0.9.1 verl/trainer/ppo/rollout_corr_helper.py, the veto after verl 0.6.1.
# ---------------------------------------------------------------------------------------------------------

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


def _crit_centre(stat: int) -> float:
    """What a criterion's std sums are centred on: 1 for ratio statistics, 0 for k1 / k2 / k3."""
    return 1.0 if stat == LY.RS_STAT["ratio"] else 0.0


def _token_is_weight(rho, is_mask, is_lower, is_upper):
    if is_mask:
        return torch.where((rho >= is_lower) & (rho <= is_upper), rho, torch.zeros_like(rho))
    return rho.clamp(max=is_upper)


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


def _row_values(st, a, crits):
    n = st[:, _SEQ["tokens"]]
    lr_sum = st[:, _SEQ["log_ratio"]]
    eps = LY.EPS
    log_w = lr_sum if int(a.is_level) == LY.IS_LEVEL["sequence"] else lr_sum / (n + eps)
    raw = torch.exp(_clamp20(log_w))
    w = _token_is_weight(raw, a.is_mask, a.is_lower, a.is_upper)
    values, keeps = [], []
    seq_rejected = torch.zeros_like(n, dtype=torch.bool)
    for level, stat, lower, upper, apply_lower in crits:
        if level == _TOKEN:  # per-row mean of the token statistic (verl masked_mean(axis=-1))
            v = st[:, _SEQ[_STAT_COL[stat]]] / (n + eps)
            keep = None
        else:
            if stat == LY.RS_STAT["ratio"]:
                v = torch.exp(_clamp20(lr_sum if level == _SEQ_SUM else lr_sum / (n + eps)))
            elif level == _SEQ_MAX:  # verl: -inf (no valid token) -> 0
                m = st[:, _SEQ["max_k2" if stat == _K2 else "max_k3"]]
                v = torch.where(n > 0, m, torch.zeros_like(m))
            else:
                s = st[:, _SEQ[_STAT_COL[stat]]]
                v = s if level == _SEQ_SUM else s / (n + eps)
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
    Weights and mask_out in the inputs' layout (packed: ``[T]``). ``config_and_row_partials``: the configuration
    arguments (``_layout.RolloutOpArgs``, schema order), then ``row_partials``."""
    *config, row_partials = config_and_row_partials
    a = LY.RolloutOpArgs(*config)
    if cu_seqlens is not None:
        cu = _check_cu_seqlens(log_prob, cu_seqlens)
        m_pad, inside = _padded(mask, cu)
        w, m_out, S, M = rollout_token_pass(_padded(log_prob, cu)[0], _padded(rollout_log_prob, cu)[0], m_pad, None,
                                            seq_stats, *a, row_partials)
        return (w[inside] if w.numel() or inside.numel() == 0 else w, m_out[inside], S, M)
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
    n, lr_sum, log_w, raw_b, w_b, values, keeps, seq_rejected, veto = _row_values(
        st, a, crits)

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
        centre = _crit_centre(stat)
        S[LY.crit_sum(i, "clamped_dev")] += tsum(sc - centre)
        S[LY.crit_sum(i, "clamped_dev_sq")] += tsum((sc - centre) ** 2)
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
        _row_partials(S, M, st, a, crits, n, lr_sum, log_w, raw_b, w_b, values, keeps, seq_rejected, veto)
    return weights, mask_out, S, M


def _row_partials(S, M, st, a, crits, n, lr_sum, log_w, raw_b, w_b, values, keeps, seq_rejected, veto) -> None:
    """The ROW terms of pass 2, once per sequence: per-row values in the stats dtype, sums in fp64."""
    f = lambda x: x.to(torch.float64)  # noqa: E731
    nd = f(n)
    sv = n > 0
    svd = f(sv)
    ninf = torch.tensor(-math.inf, dtype=torch.float64, device=n.device)
    eps = LY.EPS
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
            x = st[:, _SEQ["token_weight"]] / (n + eps)  # verl: masked_mean(weights, mask, axis=-1)
            raw_mean = st[:, _SEQ["rho"]] / (n + eps)
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
            x = w_b * n / (n + eps)
            raw_mean = raw_b * n / (n + eps)
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
            centre = _crit_centre(stat)
            S[LY.crit_sum(i, "clamped_dev")] += (nd * (f(sc) - centre)).sum()
            S[LY.crit_sum(i, "clamped_dev_sq")] += (nd * (f(sc) - centre) ** 2).sum()
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
    mean_lp = st[:, _SEQ["log_prob"]] / (n + eps)
    mean_rlp = st[:, _SEQ["rollout_log_prob"]] / (n + eps)
    lpd = -lr_sum / (n + eps)  # mean rollout logp - mean training logp, without the cancellation
    S[_SUM["log_ratio"]] += f(lr_sum).sum()
    S[_SUM["training_ppl"]] += f(torch.exp(-mean_lp)).sum()
    S[_SUM["training_log_ppl"]] += f(-mean_lp).sum()
    S[_SUM["rollout_ppl"]] += f(torch.exp(-mean_rlp)).sum()
    S[_SUM["rollout_log_ppl"]] += f(-mean_rlp).sum()
    S[_SUM["log_ppl_diff"]] += f(lpd).sum()
    S[_SUM["log_ppl_abs_diff"]] += f(lpd.abs()).sum()
    S[_SUM["ppl_ratio"]] += f(torch.exp(lpd)).sum()
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
_MSG_NO_VALID = "response_mask has no valid token (over the whole data-parallel batch); nothing to correct"


def _first(hit: torch.Tensor, name: str, values: torch.Tensor) -> str:
    idx = torch.nonzero(hit)
    if idx.numel() == 0:
        return " (on another rank)"
    b, t = idx[0].tolist()
    return f" (first on this rank: {name}[{b}, {t}] = {float(values[b, t])})"


def rollout_check(sums: torch.Tensor, agree: Optional[torch.Tensor], log_prob: torch.Tensor,
                  rollout_log_prob: torch.Tensor, mask: torch.Tensor, exclude_nonfinite: bool) -> torch.Tensor:
    """The batch-level checks of the reduced partials (see the schema); returns a copy of ``sums``."""
    if sums.device.type == "cuda":
        if agree is not None:
            torch._assert_async(agree.reshape(()).bool(), _MSG_CONFIG_MISMATCH)
        torch._assert_async(sums[_SUM["bad_mask"]] == 0, _MSG_BAD_MASK)
        if not exclude_nonfinite:
            torch._assert_async(sums[_SUM["nonfinite"]] == 0, _MSG_NONFINITE)
        torch._assert_async(sums[_SUM["tokens"]] > 0, _MSG_NO_VALID)
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
    if not float(sums[_SUM["tokens"]]) > 0:
        raise ValueError(_MSG_NO_VALID)
    return sums.clone()


# ---------------------------------------------------------------------------------------------------------
# §4 Policy losses
# ---------------------------------------------------------------------------------------------------------

# Semantics reference: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``,
# ``compute_policy_loss_reinforce``, ``agg_loss``) and Megatron-LM RL ``calculate_grpo_loss``
# (``megatron/rl/rl_utils.py``). ``policy_loss_rows`` is the op contract (one elementwise pass that a fused
# kernel replaces); the ``*_dense`` functions are the textbook oracles the tests compare it against.

def _policy_token_terms(lp, old, adv, w, clip_low, clip_high, clip_c, loss_kind):
    """Per-token (loss, clip, clip_lower, kl) of the policy losses (formulas in :func:`policy_loss_rows`)."""
    acc = lp.dtype
    neg_kl = torch.clamp(lp - old, -20.0, 20.0)
    if loss_kind == LY.PG_KIND_PPO_CLIP:
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
    else:
        loss = -adv * lp
        clip = clip_lower = torch.zeros_like(lp)
        # verl's reinforce loss logs ppo_kl = mean(rollout_lp - lp) without the +-20 clamp.
        kl = old - lp
    if w is not None:
        loss = loss * w
    return loss, clip, clip_lower, kl


def _undefined_loss_tokens(kind: int, old_log_prob, log_prob, advantages, response_mask, weights):
    """Response tokens whose loss is undefined: NaN or +inf log-probs, a log-ratio -inf - (-inf) (PPO), a -inf
    log-prob under REINFORCE (an infinite loss), non-finite advantages or IS weights. Masked-out tokens are not
    inspected. Elementwise over [b, s]: small next to the vocab-sized log-prob pass."""
    inf = float("inf")
    lp, old = log_prob, old_log_prob
    bad = lp.isnan() | (lp == inf) | old.isnan() | (old == inf)
    bad = bad | ((lp == -inf) & (old == -inf)) if kind == LY.PG_KIND_PPO_CLIP else bad | (lp == -inf)
    adv = advantages if advantages.dim() == lp.dim() else advantages.unsqueeze(-1)
    bad = bad | ~torch.isfinite(adv)
    if weights is not None:
        bad = bad | ~torch.isfinite(weights)
    return bad & (response_mask != 0)


def _check_defined_loss(kind: int, old_log_prob, log_prob, advantages, response_mask, weights):
    bad = _undefined_loss_tokens(kind, old_log_prob, log_prob, advantages, response_mask, weights)
    what = ("log_prob / old_log_prob NaN or +inf, both -inf (PPO), log_prob -inf (REINFORCE), or non-finite "
            "advantages / IS weights")
    if bad.device.type == "cpu":
        if bool(bad.any()):
            pos = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"policy loss undefined at response token {pos}: {what} (mask the token out, or fix the "
                             f"log-probs; a target at a -inf logit has log-prob -inf)")
    else:  # no host sync: an asynchronous device assert
        torch._assert_async(~bad.any(), f"policy loss undefined at a response token: {what}")


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
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss and the per-row partials every aggregation mode and metric is built from.

    All inputs ``[B, T]`` (or the packed ``[T]`` stream with ``cu_seqlens`` ``[B + 1]``: one row of partials per
    segment); ``weights`` (rollout IS weights, treated as constants) may be None.
    ``loss_kind == LY.PG_KIND_PPO_CLIP``: r = exp(clamp20(lp - lp_old)); L = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high)), and for A < 0, L = min(L, -A clip_c) (dual clip); then L * w.
    ``loss_kind == LY.PG_KIND_REINFORCE``: L = -A lp w (``old_log_prob`` is the rollout policy, used for ppo_kl).

    Returns ``loss_mat [B, T]`` (differentiable in ``log_prob``; masked positions hold the raw value, the
    mask is applied by the aggregation) and ``rows [B, 5]`` (columns ``PG_ROW_*``; only the loss column
    carries a gradient). One pass over the inputs: this is the contract of the fused loss kernel.
    """
    acc = _acc_dtype(log_prob.dtype)
    if loss_kind not in (LY.PG_KIND_PPO_CLIP, LY.PG_KIND_REINFORCE):
        raise ValueError(f"loss_kind must be LY.PG_KIND_PPO_CLIP or LY.PG_KIND_REINFORCE, got {loss_kind}")
    _check_defined_loss(loss_kind, old_log_prob.detach(), log_prob.detach(), advantages.detach(), response_mask,
                        None if weights is None else weights.detach())
    lp, old, adv = log_prob.to(acc), old_log_prob.to(acc), advantages.to(acc)
    w = None if weights is None else weights.detach().to(acc)
    m = response_mask.to(acc)
    loss, clip, clip_lower, kl = _policy_token_terms(lp, old, adv, w, clip_low, clip_high, clip_c, loss_kind)
    # The row sums are built from inputs selected at the valid tokens, so that a masked-out token's NaN / -inf
    # never meets autograd's 0 * (local derivative) and the gradient there is exactly 0 (the kernels' rule).
    valid = m != 0
    zero, one = torch.zeros((), dtype=acc), torch.ones((), dtype=acc)
    loss_v = _policy_token_terms(torch.where(valid, lp, zero), torch.where(valid, old, zero),
                                 torch.where(valid, adv, zero), None if w is None else torch.where(valid, w, one),
                                 clip_low, clip_high, clip_c, loss_kind)[0]
    if cu_seqlens is None:
        def row_sum(x):
            return x.sum(-1)
    else:
        cu = _check_cu_seqlens(log_prob, cu_seqlens)
        seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])

        def row_sum(x):  # a sum per segment (differentiable: index_add)
            return torch.zeros(cu.numel() - 1, dtype=x.dtype, device=x.device).index_add(0, seg, x)
    with torch.no_grad():
        stats = torch.stack(
            [row_sum(m), row_sum(_masked(clip, m)), row_sum(_masked(clip_lower, m)), row_sum(_masked(kl, m))], dim=-1)
    rows = torch.cat([row_sum(_masked(loss_v, m)).unsqueeze(-1), stats], dim=-1)
    return loss, rows


