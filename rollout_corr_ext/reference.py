"""Pure-PyTorch oracle of every op in ``rollout_corr_ext``.

Two roles:

* the **oracle** the tests compare the C++/CUDA kernels against (run it in fp64 where it matters), and
* the **fallback backend** used when the compiled extension is not importable (``backend() == "reference"``).

Every function here mirrors the contract of the ``torch.ops.rollout_corr.*`` op of the same name
(same arguments, same outputs, same dtypes), written with plain tensor ops so that it is obviously right.
Sections: vocab-parallel log-probs (DESIGN §2); rollout correction (DESIGN §3); policy losses (DESIGN §4).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

# ---------------------------------------------------------------------------------------------------------
# §2 Vocab-parallel log-probs and entropy
# ---------------------------------------------------------------------------------------------------------

#: Layout of the shard record (csrc/include/logprob_params.h): a 64-byte header of int64 slots, then per row
#: (max x, sum exp, sum exp * z, target x[, sum z]) in max-shifted coordinates.
(HDR_MAGIC, HDR_ROWS, HDR_VOCAB_START, HDR_LOCAL_VOCAB, HDR_VALID_COLS, HDR_VOCAB_SIZE, HDR_TARGET_HASH,
 HDR_FORMAT) = range(8)
HEADER_SLOTS, HEADER_BYTES, SHARD_MAGIC = 8, 64, 0x52434C5052303031
ROW_STAT_MAX, ROW_STAT_SUMEXP, ROW_STAT_SUMEXP_Z, ROW_STAT_TARGET_X, ROW_STAT_SUM_Z = range(5)
#: Columns of the per-row state saved for backward: max x, log D, softmax mean of (z - M/T).
ROW_STATE_MAX, ROW_STATE_LOG_D, ROW_STATE_MEAN_Z = range(3)
ROW_STATE_COLS = 3
#: Status slots of the merge (CUDA): target out of range, NaN/+inf logits, no finite logit, shard layout.
STATUS_TARGET, STATUS_NONFINITE, STATUS_NO_FINITE_LOGIT, STATUS_LAYOUT = range(4)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (for gradcheck); every other dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _valid_cols(vocab_start: int, vocab_size: int, local_vocab: int) -> int:
    """Number of real (non-padding) columns of a shard that starts at global column ``vocab_start``."""
    return max(0, min(local_vocab, vocab_size - vocab_start))


def header_len(acc: torch.dtype) -> int:
    """Length of the shard-record header in elements of the accumulation dtype."""
    return HEADER_BYTES // torch.empty((), dtype=acc).element_size()


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


def vocab_row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
    with_sum_z: bool,
) -> torch.Tensor:
    """The shard record of one vocab shard ``[N, V_local]`` (``target`` ``[N]`` holds **global** ids).

    A flat tensor in the accumulation dtype: the 64-byte header (int64 slots ``HDR_*``), then per row, with
    m = max x and zm = (x - m) * inv_temperature over the shard's non-padding columns: m, d = sum e^zm,
    s = sum e^zm zm, y = x[target] when the target lies in this shard (else -inf)[, sz = sum zm]. -inf logits add
    nothing to d and s; a shard of only -inf has d = 0 (the merge's identity).
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
        rec[:, ROW_STAT_MAX] = m
        rec[:, ROW_STAT_SUMEXP] = torch.where(empty, torch.zeros_like(m), e.sum(1))
        rec[:, ROW_STAT_SUMEXP_Z] = torch.where(empty, torch.zeros_like(m),
                                                torch.where(e > 0, e * zm, torch.zeros_like(zm)).sum(1))
        if with_sum_z:
            rec[:, ROW_STAT_SUM_Z] = torch.where(empty, torch.full_like(m, -math.inf), zm.sum(1))
    else:
        rec[:, ROW_STAT_MAX] = -math.inf
    local = target - vocab_start
    in_shard = (local >= 0) & (local < cols) & (target != ignore_index)
    picked = x.gather(1, local.clamp(0, max(cols - 1, 0)).unsqueeze(1)).squeeze(1) if cols else x.new_zeros(n)
    rec[:, ROW_STAT_TARGET_X] = torch.where(in_shard, picked, torch.full_like(picked, -math.inf))
    elem = torch.empty((), dtype=acc).element_size()
    header = torch.tensor([SHARD_MAGIC, n, vocab_start, local_vocab, cols, vocab_size,
                           _signed64(target_fingerprint(target)), k + 16 * elem], dtype=torch.int64)
    return torch.cat([header.view(acc).to(logits.device), rec.reshape(-1)])


def _layout_error(headers, vocab_size: int) -> Optional[str]:
    """The verdict of the shard-header check (the same rules as check_shard_headers in logprob_math.h)."""
    h0 = headers[0]
    for r, h in enumerate(headers):
        if h[HDR_MAGIC] != SHARD_MAGIC:
            return f"rank {r}'s record is not a log-prob shard record (different op or library version)"
        if h[HDR_ROWS] != h0[HDR_ROWS]:
            return f"rank 0 has {h0[HDR_ROWS]} rows but rank {r} has {h[HDR_ROWS]}"
        if h[HDR_FORMAT] != h0[HDR_FORMAT]:
            return f"ranks 0 and {r} use different record formats (return_entropy / label smoothing / logits dtype)"
        if h[HDR_VOCAB_SIZE] != vocab_size:
            return (f"rank {r} was given vocab_size={h[HDR_VOCAB_SIZE]} but this rank {vocab_size} (pass the true, "
                    f"global vocab_size on every rank)")
        if h[HDR_TARGET_HASH] != h0[HDR_TARGET_HASH]:
            return f"ranks 0 and {r} were given different targets (every rank must pass the same global token ids)"
        for q in range(r):
            g = headers[q]
            if (h[HDR_VALID_COLS] > 0 and g[HDR_VALID_COLS] > 0 and h[HDR_VOCAB_START] < g[HDR_VOCAB_START]
                    + g[HDR_VALID_COLS] and g[HDR_VOCAB_START] < h[HDR_VOCAB_START] + h[HDR_VALID_COLS]):
                return f"the vocab ranges of rank {q} and rank {r} overlap (check vocab_start)"
    if sum(h[HDR_VALID_COLS] for h in headers) != vocab_size or any(h[HDR_VOCAB_START] < 0 for h in headers):
        shards = "; ".join(f"{r}: {h[HDR_VOCAB_START]}, {h[HDR_LOCAL_VOCAB]}, {h[HDR_VALID_COLS]}"
                           for r, h in enumerate(headers))
        return (f"the shards do not cover [0, vocab_size={vocab_size}) exactly; shards (rank: vocab_start, local "
                f"columns, columns below vocab_size): {shards}")
    return None


def merge_row_stats(
    gathered: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int, inv_temperature: float,
    with_sum_z: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the shard records of all ranks ``[R, record_len]`` into (logp, entropy, mean_logp, row_state, status).

    M = max_r m_r; every other sum is rebased to M: D = sum_r d_r e^{(m_r - M)/T}, S = sum_r e^{(m_r - M)/T}
    (s_r + d_r (m_r - M)/T), SZ = sum_r (sz_r + n_r (m_r - M)/T); then logp = (y - M)/T - log D, H = log D - S/D,
    mean_logp = SZ / vocab_size - log D. Ignored rows give 0. Errors (bad layout, target out of range, NaN/+inf, a
    row of only -inf) raise, naming the position.
    """
    acc = gathered.dtype
    r_count = gathered.shape[0]
    k = 5 if with_sum_z else 4
    hl = header_len(acc)
    n = target.shape[0]
    if gathered.shape[1] != hl + n * k:
        raise RuntimeError(f"gathered shard records must have length {hl + n * k}, got {gathered.shape[1]}: the "
                           f"tensor-parallel ranks disagree on the number of rows or on the record format")
    headers = gathered[:, :hl].cpu().reshape(-1).clone().view(torch.int64).view(r_count, -1).tolist()
    why = _layout_error(headers, vocab_size)
    if why is not None:
        raise RuntimeError("vocab_parallel_log_probs: the tensor-parallel shards do not fit together: " + why)
    rec = gathered[:, hl:].reshape(r_count, n, k)
    m, d, s = rec[..., ROW_STAT_MAX], rec[..., ROW_STAT_SUMEXP], rec[..., ROW_STAT_SUMEXP_Z]
    poisoned = ((d != d) | (s != s) | (m == math.inf)).any(0)
    big_m = m.amax(0)
    mass = d > 0
    delta = torch.where(mass, (m - big_m) * inv_temperature, torch.zeros_like(m))
    scale = torch.where(mass, torch.exp(delta), torch.zeros_like(m))
    d_tot = (d * scale).sum(0)
    s_tot = torch.where(scale > 0, scale * (s + d * delta), torch.zeros_like(s)).sum(0)
    y = rec[..., ROW_STAT_TARGET_X].amax(0)
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
    logp = torch.where(ignored, zero, (y - big_m) * inv_temperature - log_d)
    entropy = torch.where(ignored, zero, log_d - mean_z)
    if with_sum_z:
        n_r = torch.tensor([h[HDR_VALID_COLS] for h in headers], dtype=acc, device=gathered.device).unsqueeze(1)
        sz = rec[..., ROW_STAT_SUM_Z]
        term = torch.where(mass, sz + n_r * delta, torch.where(n_r > 0, torch.full_like(sz, -math.inf),
                                                                 torch.zeros_like(sz)))
        mean_logp = torch.where(ignored, zero, term.sum(0) / vocab_size - log_d)
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
    zm = (x - state[:, ROW_STATE_MAX:ROW_STATE_MAX + 1]) * inv_temperature
    p = torch.exp(zm - state[:, ROW_STATE_LOG_D:ROW_STATE_LOG_D + 1])
    ent = torch.where(p > 0, p * (zm - state[:, ROW_STATE_MEAN_Z:ROW_STATE_MEAN_Z + 1]), torch.zeros_like(p))
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
# §3 Rollout correction (IS weights, RS masks, metrics)
# ---------------------------------------------------------------------------------------------------------

# Semantics reference: verl 0.9.1 ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
# ``compute_is_metrics``, ``compute_rollout_rejection_mask``, ``compute_rs_metrics``, ``compute_offpolicy_metrics``)
# and verl 0.6.1's same file for the veto and the ratio criteria. Two functions are the contract of the two fused
# kernels (DESIGN §3): ``rollout_seq_stats`` (pass 1: per-sequence aggregates) and ``rollout_token_pass`` (pass 2:
# weights, mask, packed metric partials). ``rollout_correction_dense`` is the straightforward fp64 oracle of the
# whole feature that the tests compare the two-pass pipeline against.

#: verl's clamp on log-ratios before exp (``SAFETY_BOUND``).
RC_SAFETY_BOUND = 20.0
#: verl's ``masked_mean`` denominator guard (``mask.sum() + 1e-8``).
RC_EPS = 1e-8

#: Columns of ``rollout_seq_stats`` ``[B, RC_SEQ_COLS]``. The first ``RC_SEQ_NUM_SUM`` are sums over the row's
#: valid tokens (all-reduced with SUM over ``seq_group``), the rest maxima (all-reduced with MAX).
(RC_SEQ_N, RC_SEQ_LR, RC_SEQ_K1, RC_SEQ_K2, RC_SEQ_K3, RC_SEQ_LP, RC_SEQ_RLP, RC_SEQ_WRAW, RC_SEQ_WTOK,
 RC_SEQ_REJ_TOKEN, RC_SEQ_REJ_K1, RC_SEQ_REJ_K2, RC_SEQ_REJ_K3, RC_SEQ_REJ_RATIO, RC_SEQ_NONFINITE,
 RC_SEQ_MAX_K2, RC_SEQ_MAX_K3, RC_SEQ_NEG_MIN_LR) = range(18)
RC_SEQ_NUM_SUM, RC_SEQ_COLS = 15, 18

#: Packed parameters (a flat float list): header, then ``RC_P_CRIT`` values per RS criterion.
(RC_P_IS_LEVEL, RC_P_IS_MASK, RC_P_IS_LOWER, RC_P_IS_UPPER, RC_P_IS_METRIC_LOWER, RC_P_VETO_ON, RC_P_VETO_LOG,
 RC_P_EXCLUDE_NONFINITE, RC_P_NUM_RS) = range(9)
RC_P_HEADER, RC_P_CRIT = 9, 5
RC_IS_NONE, RC_IS_TOKEN, RC_IS_SEQUENCE, RC_IS_GEOMETRIC = range(4)
RC_LEVEL_TOKEN, RC_LEVEL_SEQ_SUM, RC_LEVEL_SEQ_MEAN, RC_LEVEL_SEQ_MAX = range(4)
RC_STAT_K1, RC_STAT_K2, RC_STAT_K3, RC_STAT_RATIO = range(4)

#: Fixed log-space histogram of the raw IS weight: ``RC_HIST_BINS`` bins of width 40 / RC_HIST_BINS over
#: log w in [-20, 20]. A percentile read at the bin's geometric centre is within a factor exp(width / 2)
#: (< 0.49 %) of the exact order statistic.
RC_HIST_BINS = 4096
RC_HIST_LO, RC_HIST_HI = -RC_SAFETY_BOUND, RC_SAFETY_BOUND

#: Global slots of the SUM partial vector (then the histogram, then ``RC_RS_SUM`` slots per criterion).
(RC_S_N, RC_S_ROWS, RC_S_SEQ_VALID, RC_S_NONFINITE,
 RC_S_IS_W, RC_S_IS_WC, RC_S_IS_WC2, RC_S_IS_HIGH, RC_S_IS_LOW, RC_S_IS_OOB,
 RC_S_IS_SEQ, RC_S_IS_SEQ2, RC_S_IS_SEQ_HIGH, RC_S_IS_SEQ_LOW,
 RC_S_RS_REJ_TOK, RC_S_RS_REJ_SEQ, RC_S_VETO_SEQ, RC_S_CAT_TOK, RC_S_FINAL_REJ_TOK, RC_S_FINAL_REJ_SEQ,
 RC_S_LR, RC_S_K3RAW, RC_S_RHO2, RC_S_TRAIN_PPL, RC_S_TRAIN_LOGPPL, RC_S_ROLL_PPL, RC_S_ROLL_LOGPPL,
 RC_S_LPD, RC_S_ABS_LPD, RC_S_PPL_RATIO, RC_S_CHI2_SEQ) = range(31)
RC_S_HIST, RC_S_BASE = 31, 31 + RC_HIST_BINS
#: Per-criterion SUM slots (offset ``RC_S_BASE + c * RC_RS_SUM``).
(RC_RS_STAT, RC_RS_SC, RC_RS_SC2, RC_RS_HIGH, RC_RS_LOW, RC_RS_SEQ, RC_RS_SEQ2, RC_RS_SEQ_HIGH, RC_RS_SEQ_LOW,
 RC_RS_REJ_TOK, RC_RS_REJ_SEQ) = range(11)
RC_RS_SUM = 11
#: Global slots of the MAX partial vector (minima are stored negated), then ``RC_RS_MAX`` per criterion.
(RC_M_IS_W, RC_M_IS_NEG_W, RC_M_IS_LOG, RC_M_IS_NEG_LOG, RC_M_IS_SEQ, RC_M_IS_NEG_SEQ, RC_M_IS_SEQ_DEV,
 RC_M_LPD, RC_M_NEG_LPD) = range(9)
RC_M_BASE = 9
(RC_RM_STAT, RC_RM_NEG_STAT, RC_RM_SEQ, RC_RM_NEG_SEQ, RC_RM_SEQ_DEV) = range(5)
RC_RS_MAX = 5


def rc_partial_sizes(num_rs: int) -> Tuple[int, int]:
    """Lengths of the (SUM, MAX) partial vectors for ``num_rs`` RS criteria."""
    return RC_S_BASE + num_rs * RC_RS_SUM, RC_M_BASE + num_rs * RC_RS_MAX


def _rc_criteria(params) -> list:
    n = int(params[RC_P_NUM_RS])
    out = []
    for c in range(n):
        o = RC_P_HEADER + c * RC_P_CRIT
        out.append((int(params[o]), int(params[o + 1]), float(params[o + 2]), float(params[o + 3]),
                    bool(params[o + 4])))
    return out


def _rc_keep(stat: torch.Tensor, lower: float, upper: float, apply_lower: bool) -> torch.Tensor:
    keep = stat <= upper
    return keep & (stat >= lower) if apply_lower else keep


def _rc_token_values(log_prob, rollout_log_prob, mask, params):
    """Per-token quantities shared by both passes (fp32, or fp64 for fp64 inputs)."""
    acc = _acc_dtype(log_prob.dtype)
    lp = log_prob.detach().to(acc)
    rlp = rollout_log_prob.detach().to(acc)
    in_mask = mask != 0
    finite = torch.isfinite(lp) & torch.isfinite(rlp)
    valid = in_mask & finite if params[RC_P_EXCLUDE_NONFINITE] else in_mask
    zero = torch.zeros((), dtype=acc, device=lp.device)
    lr = torch.where(valid, lp - rlp, zero)
    lp = torch.where(valid, lp, zero)
    rlp = torch.where(valid, rlp, zero)
    l = lr.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND)
    rho = torch.exp(l)
    return valid, in_mask & ~finite, lp, rlp, lr, l, rho


def _rc_token_stat(stat_code: int, l: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    if stat_code == RC_STAT_K1:
        return -l
    if stat_code == RC_STAT_K2:
        return 0.5 * l * l
    if stat_code == RC_STAT_K3:
        return torch.expm1(l) - l  # = e^l - 1 - l; expm1 avoids the fp32 cancellation of exp(l) - 1
    return rho


def _rc_token_is_weight(rho: torch.Tensor, params) -> torch.Tensor:
    upper = params[RC_P_IS_UPPER]
    if params[RC_P_IS_MASK]:
        return torch.where((rho >= params[RC_P_IS_LOWER]) & (rho <= upper), rho, torch.zeros_like(rho))
    return rho.clamp(max=upper)


def rollout_seq_stats(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, params: list
) -> torch.Tensor:
    """Pass 1: per-sequence aggregates ``[B, RC_SEQ_COLS]`` (fp32; fp64 for fp64 inputs) of one ``[B, T]`` slice.

    lr = log_prob - rollout_log_prob, l = clamp20(lr), over the row's valid tokens (mask != 0, and finite when
    ``params[RC_P_EXCLUDE_NONFINITE]``): n, sum lr, sum k1 = -l, sum k2 = l^2 / 2, sum k3 = e^l - 1 - l,
    sum log_prob, sum rollout_log_prob, sum e^l (raw token ratio), sum of the token-level IS weight
    (TIS / IcePop of e^l; 0 unless the IS level is token), the number of valid tokens rejected by any token-level
    RS criterion and by each of token_k1 / token_k2 / token_k3 / token (ratio), the number of masked positions
    with a non-finite log-prob; then max k2, max k3, max(-lr) (minima negated so one MAX reduces them; -inf on a
    row without valid tokens). Every column reduces over context-parallel slices with SUM (first
    ``RC_SEQ_NUM_SUM``) or MAX (the rest).
    """
    valid, nonfinite, lp, rlp, lr, l, rho = _rc_token_values(log_prob, rollout_log_prob, mask, params)
    acc = lr.dtype
    vf = valid.to(acc)
    b = lr.shape[0]
    out = torch.empty(b, RC_SEQ_COLS, dtype=acc, device=lr.device)
    out[:, RC_SEQ_N] = vf.sum(1)
    out[:, RC_SEQ_LR] = lr.sum(1)
    out[:, RC_SEQ_K1] = (-l).sum(1)
    k2 = 0.5 * l * l
    k3 = torch.expm1(l) - l
    out[:, RC_SEQ_K2] = (k2 * vf).sum(1)
    out[:, RC_SEQ_K3] = (k3 * vf).sum(1)
    out[:, RC_SEQ_LP] = lp.sum(1)
    out[:, RC_SEQ_RLP] = rlp.sum(1)
    out[:, RC_SEQ_WRAW] = (rho * vf).sum(1)
    if int(params[RC_P_IS_LEVEL]) == RC_IS_TOKEN:
        out[:, RC_SEQ_WTOK] = (_rc_token_is_weight(rho, params) * vf).sum(1)
    else:
        out[:, RC_SEQ_WTOK] = 0
    rej_any = torch.zeros_like(valid)
    out[:, RC_SEQ_REJ_K1:RC_SEQ_REJ_RATIO + 1] = 0
    for level, stat, lower, upper, apply_lower in _rc_criteria(params):
        if level != RC_LEVEL_TOKEN:
            continue
        rej = ~_rc_keep(_rc_token_stat(stat, l, rho), lower, upper, apply_lower) & valid
        out[:, RC_SEQ_REJ_K1 + stat] = rej.to(acc).sum(1)
        rej_any |= rej
    out[:, RC_SEQ_REJ_TOKEN] = rej_any.to(acc).sum(1)
    out[:, RC_SEQ_NONFINITE] = nonfinite.to(acc).sum(1)
    ninf = torch.full((), -math.inf, dtype=acc, device=lr.device)
    out[:, RC_SEQ_MAX_K2] = torch.where(valid, k2, ninf).amax(1) if lr.shape[1] else -math.inf
    out[:, RC_SEQ_MAX_K3] = torch.where(valid, k3, ninf).amax(1) if lr.shape[1] else -math.inf
    out[:, RC_SEQ_NEG_MIN_LR] = torch.where(valid, -lr, ninf).amax(1) if lr.shape[1] else -math.inf
    return out


def _rc_row_values(seq_stats: torch.Tensor, params):
    """Per-row quantities both the token pass and the row partials need (in the stats dtype)."""
    n = seq_stats[:, RC_SEQ_N]
    lr_sum = seq_stats[:, RC_SEQ_LR]
    level = int(params[RC_P_IS_LEVEL])
    lg = lr_sum if level == RC_IS_SEQUENCE else lr_sum / (n + RC_EPS)  # sequence: log prod rho; geometric: mean
    raw = torch.exp(lg.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND))
    if params[RC_P_IS_MASK]:
        w = torch.where((raw >= params[RC_P_IS_LOWER]) & (raw <= params[RC_P_IS_UPPER]), raw, torch.zeros_like(raw))
    else:
        w = raw.clamp(max=params[RC_P_IS_UPPER])
    crit_vals, crit_keep = [], []
    seq_rej_any = torch.zeros_like(n, dtype=torch.bool)
    for level_c, stat, lower, upper, apply_lower in _rc_criteria(params):
        if level_c == RC_LEVEL_TOKEN:  # per-row mean of the token statistic (verl: masked_mean(axis=-1))
            col = {RC_STAT_K1: RC_SEQ_K1, RC_STAT_K2: RC_SEQ_K2, RC_STAT_K3: RC_SEQ_K3}.get(stat, RC_SEQ_WRAW)
            v = seq_stats[:, col] / (n + RC_EPS)
            keep = None
        else:
            if stat == RC_STAT_RATIO:
                x = lr_sum if level_c == RC_LEVEL_SEQ_SUM else lr_sum / (n + RC_EPS)
                v = torch.exp(x.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND))
            elif level_c == RC_LEVEL_SEQ_MAX:  # verl: -inf (no valid token) -> 0
                m = seq_stats[:, RC_SEQ_MAX_K2 if stat == RC_STAT_K2 else RC_SEQ_MAX_K3]
                v = torch.where(n > 0, m, torch.zeros_like(m))
            else:
                s = seq_stats[:, {RC_STAT_K1: RC_SEQ_K1, RC_STAT_K2: RC_SEQ_K2, RC_STAT_K3: RC_SEQ_K3}[stat]]
                v = s if level_c == RC_LEVEL_SEQ_SUM else s / (n + RC_EPS)
            keep = _rc_keep(v, lower, upper, apply_lower)
            seq_rej_any |= ~keep
        crit_vals.append(v)
        crit_keep.append(keep)
    veto = torch.zeros_like(seq_rej_any)
    if params[RC_P_VETO_ON]:  # any valid token with lr < log V  <=>  max(-lr) > -log V
        veto = seq_stats[:, RC_SEQ_NEG_MIN_LR] > -params[RC_P_VETO_LOG]
    return n, lr_sum, lg, raw, w, crit_vals, crit_keep, seq_rej_any, veto


def _rc_hist_index(logw: torch.Tensor) -> torch.Tensor:
    scale = RC_HIST_BINS / (RC_HIST_HI - RC_HIST_LO)
    logw = torch.nan_to_num(logw, nan=RC_HIST_LO)  # NaN only reaches here when the op is about to raise
    return ((logw - RC_HIST_LO) * scale).floor().clamp(0, RC_HIST_BINS - 1).to(torch.int64)


def rollout_token_pass(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    seq_stats: torch.Tensor,
    params: list,
    row_partials: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 2: IS weights, the RS + veto mask and the packed metric partials of one ``[B, T]`` slice.

    ``seq_stats`` are the (context-parallel reduced) aggregates of :func:`rollout_seq_stats`. Returns
    ``weights`` (``[B, T]`` fp32, fp64 for fp64 inputs, 0 at padding; ``[0]`` when there is no IS level),
    ``mask_out`` (``mask`` where kept, else 0, in ``mask``'s dtype), ``sums`` (fp64 ``[S]``) and ``maxes``
    (fp64 ``[M]``), sizes from :func:`rc_partial_sizes`. Token terms accumulate in the row in fp32, rows in fp64.
    Row terms (sequence weights, per-sequence metrics, ppl, ...) are added only when ``row_partials`` (one
    rank of each context-parallel group), so a SUM / MAX over data-parallel ranks gives the global values.
    """
    valid, _, lp, rlp, lr, l, rho = _rc_token_values(log_prob, rollout_log_prob, mask, params)
    acc = lr.dtype
    dev = lr.device
    vf = valid.to(acc)
    crits = _rc_criteria(params)
    n_sum, n_max = rc_partial_sizes(len(crits))
    sums = torch.zeros(n_sum, dtype=torch.float64, device=dev)
    maxes = torch.full((n_max,), -math.inf, dtype=torch.float64, device=dev)
    ninf = torch.full((), -math.inf, dtype=acc, device=dev)
    has_t = lr.numel() > 0  # a DP rank may hold no rows (or rows of length 0): its maxima are -inf

    def tsum(x):  # sum over valid tokens: fp32 within a row, fp64 across rows
        return (x * vf).sum(1).to(torch.float64).sum()

    def tmax(x):
        return torch.where(valid, x, ninf).amax().to(torch.float64) if has_t else sums.new_tensor(-math.inf)

    n, lr_sum, lg, raw_b, w_b, crit_vals, crit_keep, seq_rej_any, veto = _rc_row_values(seq_stats.to(acc), params)
    level = int(params[RC_P_IS_LEVEL])
    upper, lower, mlower = params[RC_P_IS_UPPER], params[RC_P_IS_LOWER], params[RC_P_IS_METRIC_LOWER]

    # --- IS weights and their token terms -------------------------------------------------------------------
    if level == RC_IS_NONE:
        weights = lr.new_zeros(0)
    elif level == RC_IS_TOKEN:
        w = _rc_token_is_weight(rho, params)
        weights = w * vf
        wc = w.clamp(0.0, upper)
        sums[RC_S_IS_W] += tsum(w)
        sums[RC_S_IS_WC] += tsum(wc)
        sums[RC_S_IS_WC2] += tsum(wc * wc)
        sums[RC_S_IS_HIGH] += tsum((rho > upper).to(acc))
        sums[RC_S_IS_LOW] += tsum((rho < mlower).to(acc))
        if params[RC_P_IS_MASK]:
            sums[RC_S_IS_OOB] += tsum(((rho < lower) | (rho > upper)).to(acc))
        maxes[RC_M_IS_W] = tmax(w)
        maxes[RC_M_IS_NEG_W] = tmax(-w)
        idx = _rc_hist_index(l).reshape(-1)
        sums[RC_S_HIST:RC_S_HIST + RC_HIST_BINS].index_add_(0, idx, vf.reshape(-1).to(torch.float64))
    else:
        weights = w_b.unsqueeze(1) * vf

    # --- RS: token criteria recomputed per token, sequence criteria broadcast; then the veto -----------------
    tok_rej = torch.zeros_like(valid)
    for c, (level_c, stat, lo, up, apply_lower) in enumerate(crits):
        if level_c != RC_LEVEL_TOKEN:
            continue
        s = _rc_token_stat(stat, l, rho)
        tok_rej |= ~_rc_keep(s, lo, up, apply_lower)
        o = RC_S_BASE + c * RC_RS_SUM
        sc = s.clamp(lo if apply_lower else 0.0, up)
        sums[o + RC_RS_STAT] += tsum(s)
        sums[o + RC_RS_SC] += tsum(sc)
        sums[o + RC_RS_SC2] += tsum(sc * sc)
        sums[o + RC_RS_HIGH] += tsum((s > up).to(acc))
        if apply_lower:
            sums[o + RC_RS_LOW] += tsum((s < lo).to(acc))
        om = RC_M_BASE + c * RC_RS_MAX
        maxes[om + RC_RM_STAT] = tmax(s)
        maxes[om + RC_RM_NEG_STAT] = tmax(-s)
    keep = valid & ~tok_rej & ~(seq_rej_any | veto).unsqueeze(1)
    mask_out = torch.where(keep, mask, torch.zeros_like(mask))

    # --- off-policy token terms (verl compute_offpolicy_metrics) + veto ----------------------------------------
    sums[RC_S_K3RAW] += tsum(torch.expm1(lr) - lr)  # k3_kl uses the unclamped ratio
    sums[RC_S_RHO2] += tsum(rho * rho)
    if params[RC_P_VETO_ON]:
        sums[RC_S_CAT_TOK] += tsum((lr < params[RC_P_VETO_LOG]).to(acc))

    if row_partials:
        _rc_row_partials(sums, maxes, seq_stats.to(acc), params, crits, n, lr_sum, lg, raw_b, w_b, crit_vals,
                         crit_keep, seq_rej_any, veto)
    return weights, mask_out, sums, maxes


def _rc_row_partials(sums, maxes, seq_stats, params, crits, n, lr_sum, lg, raw_b, w_b, crit_vals, crit_keep,
                     seq_rej_any, veto) -> None:
    """Row terms of pass 2 (added once per sequence): per-row values in the stats dtype, squares and sums in fp64
    (sum x^2 - (sum x)^2 / n cancels badly in fp32 when the spread is small)."""
    d = torch.float64
    f = lambda x: x.to(d)  # noqa: E731
    nd = f(n)
    sv = n > 0
    svd = f(sv)
    ninf = torch.tensor(-math.inf, dtype=d, device=n.device)
    level = int(params[RC_P_IS_LEVEL])
    upper, lower, mlower = params[RC_P_IS_UPPER], params[RC_P_IS_LOWER], params[RC_P_IS_METRIC_LOWER]
    sums[RC_S_N] += nd.sum()
    sums[RC_S_ROWS] += float(n.shape[0])
    sums[RC_S_SEQ_VALID] += svd.sum()
    sums[RC_S_NONFINITE] += f(seq_stats[:, RC_SEQ_NONFINITE]).sum()

    def rmax(x, where=None):
        x = f(x)
        if where is not None:
            x = torch.where(where, x, ninf)
        return x.amax() if x.numel() else ninf

    if level != RC_IS_NONE:
        if level == RC_IS_TOKEN:
            x = seq_stats[:, RC_SEQ_WTOK] / (n + RC_EPS)  # verl: masked_mean(weights, mask, axis=-1)
            raw_mean = seq_stats[:, RC_SEQ_WRAW] / (n + RC_EPS)
        else:
            wc = w_b.clamp(0.0, upper)
            sums[RC_S_IS_W] += (nd * f(w_b)).sum()
            sums[RC_S_IS_WC] += (nd * f(wc)).sum()
            sums[RC_S_IS_WC2] += (nd * f(wc) ** 2).sum()
            sums[RC_S_IS_HIGH] += f(lg > math.log(upper)).sum()  # over all rows, as verl's .float().mean()
            sums[RC_S_IS_LOW] += f(lg < math.log(mlower)).sum()
            if params[RC_P_IS_MASK]:
                sums[RC_S_IS_OOB] += (nd * f((raw_b < lower) | (raw_b > upper))).sum()
            maxes[RC_M_IS_LOG] = torch.maximum(maxes[RC_M_IS_LOG], rmax(lg))
            maxes[RC_M_IS_NEG_LOG] = torch.maximum(maxes[RC_M_IS_NEG_LOG], rmax(-lg))
            idx = _rc_hist_index(lg.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND))
            sums[RC_S_HIST:RC_S_HIST + RC_HIST_BINS].index_add_(0, idx, nd)
            x = w_b * n / (n + RC_EPS)
            raw_mean = raw_b * n / (n + RC_EPS)
        sums[RC_S_IS_SEQ] += f(x).sum()
        sums[RC_S_IS_SEQ2] += (f(x) ** 2).sum()
        sums[RC_S_IS_SEQ_HIGH] += f(raw_mean > upper).sum()
        sums[RC_S_IS_SEQ_LOW] += f(raw_mean < mlower).sum()
        maxes[RC_M_IS_SEQ] = rmax(x)
        maxes[RC_M_IS_NEG_SEQ] = rmax(-x)
        maxes[RC_M_IS_SEQ_DEV] = rmax((x - 1.0).abs())

    for c, (level_c, stat, lo, up, apply_lower) in enumerate(crits):
        o = RC_S_BASE + c * RC_RS_SUM
        om = RC_M_BASE + c * RC_RS_MAX
        v = crit_vals[c]
        if level_c != RC_LEVEL_TOKEN:
            sc = v.clamp(lo if apply_lower else 0.0, up)
            sums[o + RC_RS_STAT] += (nd * f(v)).sum()
            sums[o + RC_RS_SC] += (nd * f(sc)).sum()
            sums[o + RC_RS_SC2] += (nd * f(sc) ** 2).sum()
            sums[o + RC_RS_HIGH] += f((v > up) & sv).sum()
            if apply_lower:
                sums[o + RC_RS_LOW] += f((v < lo) & sv).sum()
            maxes[om + RC_RM_STAT] = rmax(v, sv)
            maxes[om + RC_RM_NEG_STAT] = rmax(-v, sv)
            rej_rows = ~crit_keep[c] & sv
            sums[o + RC_RS_REJ_TOK] += (nd * f(rej_rows)).sum()
        else:
            rej_cnt = seq_stats[:, RC_SEQ_REJ_K1 + stat]
            sums[o + RC_RS_REJ_TOK] += f(rej_cnt).sum()
            rej_rows = (rej_cnt > 0) & sv
        sums[o + RC_RS_REJ_SEQ] += f(rej_rows).sum()
        sums[o + RC_RS_SEQ] += (f(v) * svd).sum()
        sums[o + RC_RS_SEQ2] += (f(v) ** 2 * svd).sum()
        sums[o + RC_RS_SEQ_HIGH] += f((v > up) & sv).sum()
        if apply_lower:
            sums[o + RC_RS_SEQ_LOW] += f((v < lo) & sv).sum()
        maxes[om + RC_RM_SEQ] = rmax(v, sv)
        maxes[om + RC_RM_NEG_SEQ] = rmax(-v, sv)
        maxes[om + RC_RM_SEQ_DEV] = rmax(v.abs(), sv)

    rej_tok = seq_stats[:, RC_SEQ_REJ_TOKEN]
    sums[RC_S_RS_REJ_TOK] += torch.where(seq_rej_any, nd, f(rej_tok)).sum()
    sums[RC_S_RS_REJ_SEQ] += f((seq_rej_any & sv) | (rej_tok > 0)).sum()
    sums[RC_S_VETO_SEQ] += f(veto).sum()
    dropped = seq_rej_any | veto
    sums[RC_S_FINAL_REJ_TOK] += torch.where(dropped, nd, f(rej_tok)).sum()
    sums[RC_S_FINAL_REJ_SEQ] += f(sv & (dropped | (rej_tok > 0))).sum()

    # Off-policy row terms (verl compute_offpolicy_metrics): per-sequence means, averaged over all rows.
    mlp = seq_stats[:, RC_SEQ_LP] / (n + RC_EPS)
    mrlp = seq_stats[:, RC_SEQ_RLP] / (n + RC_EPS)
    lpd = -lr_sum / (n + RC_EPS)  # = mean rollout logp - mean training logp, without the cancellation
    sums[RC_S_LR] += f(lr_sum).sum()
    sums[RC_S_TRAIN_PPL] += f(torch.exp(-mlp)).sum()
    sums[RC_S_TRAIN_LOGPPL] += f(-mlp).sum()
    sums[RC_S_ROLL_PPL] += f(torch.exp(-mrlp)).sum()
    sums[RC_S_ROLL_LOGPPL] += f(-mrlp).sum()
    sums[RC_S_LPD] += f(lpd).sum()
    sums[RC_S_ABS_LPD] += f(lpd.abs()).sum()
    sums[RC_S_PPL_RATIO] += f(torch.exp(lpd)).sum()
    sums[RC_S_CHI2_SEQ] += f(torch.exp(2.0 * lr_sum.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND))).sum()
    maxes[RC_M_LPD] = rmax(lpd)
    maxes[RC_M_NEG_LPD] = rmax(-lpd)


def _rc_quantile_sorted(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) for any size, via a sort (no 2^24 limit)."""
    s = values.sort().values
    pos = q * (s.numel() - 1)
    k0 = int(math.floor(pos))
    k1 = min(k0 + 1, s.numel() - 1)
    frac = pos - k0
    return s[k0] * (1 - frac) + s[k1] * frac


def rollout_correction_dense(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config,
    *,
    exclude_nonfinite: bool = False,
    dtype: torch.dtype = torch.float64,
    percentiles: bool = True,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, dict]:
    """The textbook oracle of the whole feature, one batch, fp64, written after verl's formulas line by line.

    Returns (weights or None, new response_mask in the input dtype, {metric name without prefix: 0-dim tensor}).
    Mask values are treated as 0/1 (nonzero = valid). ``config`` is a ``RolloutCorrectionConfig``. ``dtype`` and
    ``percentiles=False`` let the benchmark run it as a verl-style op-by-op fp32 baseline.
    """
    d = dtype
    m_in = response_mask != 0
    lp = log_prob.detach().to(d)
    rlp = rollout_log_prob.detach().to(d)
    finite = torch.isfinite(lp) & torch.isfinite(rlp)
    mb = m_in & finite if exclude_nonfinite else m_in
    m = mb.to(d)
    z = torch.zeros((), dtype=d)
    lp = torch.where(mb, lp, z)
    rlp = torch.where(mb, rlp, z)
    lr = lp - rlp
    n_row = m.sum(-1)
    n_tok = m.sum()
    rows = float(lr.shape[0])

    def mmean(x, axis=None):  # verl_F.masked_mean
        return (torch.where(mb, x, z) * m).sum(axis) / (m.sum(axis) + RC_EPS)

    def clamp20(x):
        return x.clamp(-RC_SAFETY_BOUND, RC_SAFETY_BOUND)

    met: dict = {}
    seq_valid = n_row > 0

    # ---- IS (verl 0.9.1 compute_rollout_correction_weights + compute_is_metrics) -----------------------------
    weights = None
    spec = config.is_spec
    if spec is not None:
        if spec.level == "token":
            log_for_metrics = lr
            raw = torch.exp(clamp20(lr))
        else:
            s = (lr * m).sum(-1, keepdim=True)
            log_for_metrics = s if spec.level == "sequence" else s / (n_row.unsqueeze(-1) + RC_EPS)
            raw = torch.exp(clamp20(log_for_metrics)).expand_as(lr)
        raw = raw * m
        if spec.mode == "truncate":
            w = raw.clamp(max=spec.upper)
        else:
            w = torch.where((raw >= spec.lower) & (raw <= spec.upper), raw, torch.zeros_like(raw))
        up, lo_m = spec.upper, spec.metric_lower
        if spec.level == "token":
            met["rollout_is_mean"] = mmean(w)
            met["rollout_is_ratio_fraction_high"] = mmean((raw > up).to(d))
            met["rollout_is_ratio_fraction_low"] = mmean((raw < lo_m).to(d))
            met["rollout_is_max"] = w[mb].max()
            met["rollout_is_min"] = w[mb].min()
        else:
            met["rollout_is_max"] = torch.exp(log_for_metrics.max().clamp(max=RC_SAFETY_BOUND))
            met["rollout_is_min"] = torch.exp(log_for_metrics.min())
            met["rollout_is_mean"] = mmean(w)
            met["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(up)).to(d).mean()
            met["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(lo_m)).to(d).mean()
        wc = w.clamp(0.0, up)
        if n_tok > 1:
            var = mmean(wc * wc) - mmean(wc) ** 2
            met["rollout_is_std"] = var.clamp(min=0).sqrt()
        else:
            met["rollout_is_std"] = torch.zeros((), dtype=d)
        met["rollout_is_eff_sample_size"] = 1.0 / mmean((wc / (mmean(wc) + RC_EPS)) ** 2)
        seq_w = mmean(w, -1)
        met["rollout_is_seq_mean"] = seq_w.mean()
        met["rollout_is_seq_std"] = seq_w.std() if seq_w.numel() > 1 else torch.zeros((), dtype=d)
        met["rollout_is_seq_max"] = seq_w.max()
        met["rollout_is_seq_min"] = seq_w.min()
        met["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max()
        raw_seq = mmean(raw, -1)
        met["rollout_is_seq_fraction_high"] = (raw_seq > up).to(d).mean()
        met["rollout_is_seq_fraction_low"] = (raw_seq < lo_m).to(d).mean()
        if spec.mode == "mask":
            met["rollout_is_oob_ratio"] = mmean(((raw < spec.lower) | (raw > up)).to(d))
        # Percentiles of the raw (pre-truncation) weight over valid tokens (ours; exact order statistics here).
        if percentiles:
            raw_valid = raw[mb]
            for q in (5, 25, 50, 75, 95):
                met[f"rollout_is_p{q}"] = _rc_quantile_sorted(raw_valid, q / 100.0)
        if config.rollout_is_batch_normalize:
            if spec.level == "token":
                mean = mmean(w)
            else:
                mean = (seq_w * seq_valid.to(d)).sum() / seq_valid.to(d).sum().clamp(min=RC_EPS)
            if mean > 1e-8:
                w = w / mean
                met["rollout_is_batch_norm_factor"] = mean
            else:
                met["rollout_is_batch_norm_factor"] = torch.ones((), dtype=d)
        weights = w

    # ---- RS (verl 0.9.1 compute_rollout_rejection_mask + compute_rs_metrics; ratio criteria after 0.6.1) --------
    l = clamp20(lr)
    tok = {"k1": -l, "k2": 0.5 * l * l, "k3": torch.exp(l) - 1.0 - l, "ratio": torch.exp(l)}
    combined = torch.ones_like(lr)
    crits = config.rs_criteria
    for c in crits:
        if c.level == "token":
            stat = tok[c.stat]
            seq_values = mmean(stat, -1)
            keep = _rc_keep(stat, c.lower, c.upper, c.apply_lower)
        else:
            if c.stat == "ratio":
                s = (lr * m).sum(-1)
                seq_stat = torch.exp(clamp20(s if c.level == "seq_sum" else s / (n_row + RC_EPS)))
            elif c.level == "seq_sum":
                seq_stat = (torch.where(mb, tok[c.stat], z) * m).sum(-1)
            elif c.level == "seq_mean":
                seq_stat = mmean(tok[c.stat], -1)
            else:
                mx = tok[c.stat].masked_fill(~mb, -math.inf).max(-1).values
                seq_stat = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
            seq_values = seq_stat
            stat = seq_stat.unsqueeze(-1).expand_as(lr)
            keep = _rc_keep(seq_stat, c.lower, c.upper, c.apply_lower).unsqueeze(-1).expand_as(mb)
        p = f"rollout_rs_{c.name}"
        up, lo = c.upper, (c.lower if c.apply_lower else 0.0)
        sv = seq_values[seq_valid]
        met[f"{p}_mean"] = mmean(stat)
        if c.level != "token":
            met[f"{p}_max"], met[f"{p}_min"] = sv.max(), sv.min()
            met[f"{p}_fraction_high"] = (sv > up).to(d).mean()
            met[f"{p}_fraction_low"] = (sv < lo).to(d).mean() if c.apply_lower else torch.zeros((), dtype=d)
        else:
            met[f"{p}_max"], met[f"{p}_min"] = stat[mb].max(), stat[mb].min()
            met[f"{p}_fraction_high"] = mmean((stat > up).to(d))
            met[f"{p}_fraction_low"] = mmean((stat < lo).to(d)) if c.apply_lower else torch.zeros((), dtype=d)
        if n_tok > 1:
            sc = stat.clamp(lo, up)
            met[f"{p}_std"] = (mmean(sc * sc) - mmean(sc) ** 2).clamp(min=0).sqrt()
        else:
            met[f"{p}_std"] = torch.zeros((), dtype=d)
        met[f"{p}_seq_mean"] = sv.mean()
        met[f"{p}_seq_std"] = sv.std() if sv.numel() > 1 else torch.zeros((), dtype=d)
        met[f"{p}_seq_max"] = sv.max()
        met[f"{p}_seq_min"] = sv.min()
        met[f"{p}_seq_max_deviation"] = sv.abs().max()
        met[f"{p}_seq_fraction_high"] = (sv > up).to(d).mean()
        if c.apply_lower:
            met[f"{p}_seq_fraction_low"] = (sv < lo).to(d).mean()
        keep_f = keep.to(d)
        combined = combined * keep_f
        seq_keep = (~(~keep & mb)).all(-1)
        met[f"{p}_masked_fraction"] = mmean(1.0 - keep_f)
        met[f"{p}_seq_masked_fraction"] = ((~seq_keep) & seq_valid).to(d).sum() / seq_valid.to(d).sum()
    if crits:
        met["rollout_rs_masked_fraction"] = mmean(1.0 - combined)
        met["rollout_rs_seq_masked_fraction"] = ((combined < 0.5) & mb).any(-1).to(d).mean()

    # ---- veto (verl 0.6.1 compute_rollout_correction_and_rejection_mask, step 4) ---------------------------------
    v = config.rollout_token_veto_threshold
    if v is not None:
        cat = (lr < math.log(v)) & mb
        has_cat = cat.any(-1, keepdim=True)
        met["rollout_is_veto_fraction"] = has_cat.to(d).mean()
        met["rollout_is_catastrophic_token_fraction"] = mmean(cat.to(d))
        combined = combined * (~has_cat).to(d)
    else:
        met["rollout_is_veto_fraction"] = torch.zeros((), dtype=d)
        met["rollout_is_catastrophic_token_fraction"] = torch.zeros((), dtype=d)
    dropped = (combined < 0.5) & mb
    met["masked_fraction"] = dropped.to(d).sum() / (n_tok + RC_EPS)
    met["seq_masked_fraction"] = (dropped.any(-1) & seq_valid).to(d).sum() / seq_valid.to(d).sum()
    if exclude_nonfinite:
        nonfin = (m_in & ~finite).to(d).sum()
        met["nonfinite_token_fraction"] = nonfin / (n_tok + nonfin + RC_EPS)

    # ---- off-policy diagnostics (verl 0.9.1 compute_offpolicy_metrics) --------------------------------------------
    mlp = mmean(lp, -1)
    met["training_ppl"] = torch.exp(-mlp).mean()
    met["training_log_ppl"] = (-mlp).mean()
    met["kl"] = mmean(rlp - lp)
    met["k3_kl"] = mmean(torch.exp(lr) - lr - 1)
    mrlp = mmean(rlp, -1)
    met["rollout_ppl"] = torch.exp(-mrlp).mean()
    met["rollout_log_ppl"] = (-mrlp).mean()
    lpd = mrlp - mlp
    met["log_ppl_diff"] = lpd.mean()
    met["log_ppl_abs_diff"] = lpd.abs().mean()
    met["log_ppl_diff_max"] = lpd.max()
    met["log_ppl_diff_min"] = lpd.min()
    met["ppl_ratio"] = torch.exp(lpd).mean()
    met["chi2_token"] = mmean(torch.exp(l) ** 2) - 1.0
    s = (lr * m).sum(-1)
    met["chi2_seq"] = torch.exp(2.0 * clamp20(s)).mean() - 1.0

    new_mask = torch.where(combined > 0.5, response_mask, torch.zeros_like(response_mask))
    if exclude_nonfinite:
        new_mask = torch.where(mb, new_mask, torch.zeros_like(new_mask))
    return weights, new_mask, met



# ---------------------------------------------------------------------------------------------------------
# §4 Policy losses
# ---------------------------------------------------------------------------------------------------------

# Semantics reference: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``,
# ``compute_policy_loss_reinforce``, ``agg_loss``) and Megatron-LM RL ``calculate_grpo_loss``
# (``megatron/rl/rl_utils.py``). ``policy_loss_rows`` is the op contract (one elementwise pass that a fused
# kernel replaces); the ``*_dense`` functions are the textbook oracles the tests compare it against.

#: Columns of the per-row partials of ``policy_loss_rows``: sum of m*loss, sum of m, sum of m*1[upper/ratio
#: clip], sum of m*1[dual clip], sum of m*(old_logp - logp) (the ``ppo_kl`` numerator).
PG_ROW_LOSS_SUM, PG_ROW_TOKENS, PG_ROW_CLIP, PG_ROW_CLIP_LOWER, PG_ROW_KL_SUM = range(5)
#: ``loss_kind`` of ``policy_loss_rows``.
PG_KIND_PPO_CLIP, PG_KIND_REINFORCE = 0, 1
#: verl's ``masked_mean`` denominator guard (``mask.sum() + 1e-8``), kept so metrics match key for key.
MASKED_MEAN_EPS = 1e-8


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_sum`` integrand: ``where(mask, v, 0) * mask`` (NaN outside the mask never leaks)."""
    return torch.where(mask != 0, values, torch.zeros_like(values)) * mask


def _policy_token_terms(lp, old, adv, w, clip_low, clip_high, clip_c, loss_kind):
    """Per-token (loss, clip, clip_lower, kl) of the policy losses (formulas in :func:`policy_loss_rows`)."""
    acc = lp.dtype
    neg_kl = torch.clamp(lp - old, -20.0, 20.0)
    if loss_kind == PG_KIND_PPO_CLIP:
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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss and the per-row partials every aggregation mode and metric is built from.

    All inputs ``[B, T]``; ``weights`` (rollout IS weights, treated as constants) may be None.
    ``loss_kind == PG_KIND_PPO_CLIP``: r = exp(clamp20(lp - lp_old)); L = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high)), and for A < 0, L = min(L, -A clip_c) (dual clip); then L * w.
    ``loss_kind == PG_KIND_REINFORCE``: L = -A lp w (``old_log_prob`` is the rollout policy, used for ppo_kl).

    Returns ``loss_mat [B, T]`` (differentiable in ``log_prob``; masked positions hold the raw value, the
    mask is applied by the aggregation) and ``rows [B, 5]`` (columns ``PG_ROW_*``; only the loss column
    carries a gradient). One pass over the inputs: this is the contract of the fused loss kernel.
    """
    acc = _acc_dtype(log_prob.dtype)
    if loss_kind not in (PG_KIND_PPO_CLIP, PG_KIND_REINFORCE):
        raise ValueError(f"loss_kind must be PG_KIND_PPO_CLIP or PG_KIND_REINFORCE, got {loss_kind}")
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
    with torch.no_grad():
        stats = torch.stack(
            [m.sum(-1), _masked(clip, m).sum(-1), _masked(clip_lower, m).sum(-1), _masked(kl, m).sum(-1)], dim=-1)
    rows = torch.cat([_masked(loss_v, m).sum(-1, keepdim=True), stats], dim=-1)
    return loss, rows


def ppo_clip_loss_dense(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Textbook oracle, line for line the formula of verl 0.9.1 ``compute_policy_loss_vanilla``.

    Returns (pg_losses [B, T], pg_clipfrac, pg_clipfrac_lower, ppo_kl).
    """
    m = response_mask.to(log_prob.dtype)

    def masked_mean(v):
        return _masked(v, m).sum() / (m.sum() + MASKED_MEAN_EPS)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(m.dtype))
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean((torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0)).to(m.dtype))
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if weights is not None:
        pg_losses = pg_losses * weights
    return pg_losses, pg_clipfrac, pg_clipfrac_lower, ppo_kl


def agg_loss_dense(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """Textbook oracle of verl 0.9.1 ``agg_loss`` (same formulas, same global normalisers).

    One deliberate difference: where verl divides 0 by 0 (every token masked and no global normaliser
    given) this returns 0, so a micro-batch whose rows were all rejected does not turn the step into NaN.
    """
    m = loss_mask.to(loss_mat.dtype)

    def safe_div(num, den):
        den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
        return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))

    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = m.sum()
        return safe_div(_masked(loss_mat, m).sum(), batch_num_tokens) * dp_size
    if loss_agg_mode == "token-sum":
        return _masked(loss_mat, m).sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = _masked(loss_mat, m).sum(-1)
        seq_mask = (m.sum(-1) > 0).to(m.dtype)
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = safe_div(_masked(seq_losses, seq_mask).sum(), global_batch_size) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        tokens = m.sum(-1)
        seq_losses = _masked(loss_mat, m).sum(-1) / (tokens + MASKED_MEAN_EPS)
        seq_mask = (tokens > 0).to(m.dtype)
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return safe_div(_masked(seq_losses, seq_mask).sum(), global_batch_size) * dp_size
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def grpo_loss_dense(
    current_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clamp_eps_lower: float,
    clamp_eps_upper: float,
    kl_beta: float,
    entropy_weight: float,
    is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Textbook oracle of Megatron-LM RL ``calculate_grpo_loss`` (unpacked ``[B, T]``, advantages ``[B]``):

    r = exp(lp - lp_old); loss = -w min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A) + beta k3(ref || lp)
    + entropy_weight exp(lp) lp, with k3 = exp(ref - lp) - (ref - lp) - 1. Returns (loss, kl_term, ratios,
    entropy_term, truncated_from_above, truncated_from_below).
    """
    ratios = (current_logprobs - old_logprobs).exp()
    clamped = ratios.clamp(1 - clamp_eps_lower, 1 + clamp_eps_upper)
    adv = advantages.reshape(-1, 1)
    ref_diff = ref_logprobs - current_logprobs
    kl_term = ref_diff.exp() - ref_diff - 1
    entropy_term = current_logprobs.exp() * current_logprobs
    w = 1.0 if is_weights is None else is_weights
    loss = -w * torch.min(ratios * adv, clamped * adv) + kl_beta * kl_term + entropy_weight * entropy_term
    return loss, kl_term, ratios, entropy_term, ratios > 1 + clamp_eps_upper, ratios < 1 - clamp_eps_lower
