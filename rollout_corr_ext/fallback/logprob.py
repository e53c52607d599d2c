"""The pure-PyTorch vocab-parallel log-prob ops (docs/logprobs.md): ``vocab_row_stats``, ``merge_row_stats``,
``logprob_backward(_)``. The record layout (``LY.HDR_*``, ``ROW_STAT_*``, ``ROW_STATE_*``, ``STATUS_*``) comes from
``csrc/include/logprob_layout.def``."""

from __future__ import annotations

import math
import struct
from typing import Optional, Tuple

import torch

from .. import _layout as LY
from .._checks import acc_dtype as _acc_dtype




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
