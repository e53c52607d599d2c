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

#: Columns of the per-row record that ``vocab_row_stats`` produces (the last one only with ``with_sum_z``).
ROW_STAT_MAX, ROW_STAT_SUMEXP, ROW_STAT_SUMEXP_Z, ROW_STAT_TARGET_Z, ROW_STAT_SUM_Z = range(5)
#: Columns of the per-row state saved for backward: log-sum-exp and the softmax mean of z (= S/D).
ROW_STATE_LSE, ROW_STATE_MEAN_Z = range(2)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (for gradcheck); every other dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _valid_cols(vocab_start: int, vocab_size: int, local_vocab: int) -> int:
    """Number of real (non-padding) columns of a shard that starts at global column ``vocab_start``."""
    return max(0, min(local_vocab, vocab_size - vocab_start))


def vocab_row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    ignore_index: int,
    with_sum_z: bool,
) -> torch.Tensor:
    """Per-row softmax statistics of one vocab shard, z = logits * inv_temperature.

    ``logits`` is ``[N, V_local]``, ``target`` ``[N]`` holds **global** ids. Returns ``[N, 4]`` (or ``[N, 5]``
    with ``with_sum_z``): m = max z, d = sum exp(z - m), s = sum exp(z - m) z, y = z[target] when the target
    lies in this shard (else -inf), and sum z. Padding columns (global id >= vocab_size) are excluded.
    """
    acc = _acc_dtype(logits.dtype)
    n, local_vocab = logits.shape
    cols = _valid_cols(vocab_start, vocab_size, local_vocab)
    z = logits[:, :cols].to(acc) * inv_temperature
    out = torch.empty(n, 5 if with_sum_z else 4, dtype=acc, device=logits.device)
    if cols == 0:
        out[:, ROW_STAT_MAX] = -math.inf
        out[:, ROW_STAT_SUMEXP] = 0
        out[:, ROW_STAT_SUMEXP_Z] = 0
    else:
        m = z.amax(dim=1, keepdim=True)
        e = torch.exp(z - m)
        out[:, ROW_STAT_MAX] = m.squeeze(1)
        out[:, ROW_STAT_SUMEXP] = e.sum(1)
        out[:, ROW_STAT_SUMEXP_Z] = (e * z).sum(1)
    local = target - vocab_start
    in_shard = (local >= 0) & (local < cols) & (target != ignore_index)
    picked = z.gather(1, local.clamp(0, max(cols - 1, 0)).unsqueeze(1)).squeeze(1) if cols else z.new_zeros(n)
    out[:, ROW_STAT_TARGET_Z] = torch.where(in_shard, picked, torch.full_like(picked, -math.inf))
    if with_sum_z:
        out[:, ROW_STAT_SUM_Z] = z.sum(1)
    return out


def merge_row_stats(
    stats: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the records of all shards ``[R, N, K]`` into (logp, entropy, mean_logp, row_state).

    M = max_r m_r, D = sum_r d_r e^(m_r - M), S = sum_r s_r e^(m_r - M), y = max_r y_r;
    logp = y - M - log D, H = M + log D - S/D, mean_logp = sum z / vocab_size - (M + log D) (0 without sum z).
    Ignored rows give 0 everywhere. row_state = [lse, S/D] is what backward needs.
    """
    m = stats[..., ROW_STAT_MAX]
    big_m = m.amax(0)
    # A shard made only of padding has d = 0 and m = -inf; its scale must be 0, not exp(nan).
    scale = torch.where(stats[..., ROW_STAT_SUMEXP] > 0, torch.exp(m - big_m), torch.zeros_like(m))
    d = (stats[..., ROW_STAT_SUMEXP] * scale).sum(0)
    s = (stats[..., ROW_STAT_SUMEXP_Z] * scale).sum(0)
    y = stats[..., ROW_STAT_TARGET_Z].amax(0)
    lse = big_m + torch.log(d)
    mean_z = s / d
    valid = target != ignore_index
    zero = torch.zeros_like(lse)
    logp = torch.where(valid, y - lse, zero)
    entropy = torch.where(valid, lse - mean_z, zero)
    if stats.shape[-1] > ROW_STAT_SUM_Z:
        sum_z = stats[..., ROW_STAT_SUM_Z].sum(0)
        mean_logp = torch.where(valid, sum_z / vocab_size - lse, zero)
    else:
        mean_logp = zero.clone()
    row_state = torch.stack([lse, mean_z], dim=1)
    return logp, entropy, mean_logp, row_state


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
    """Gradient w.r.t. one shard ``[N, V_local]`` of logits, in the logits dtype. With p = softmax(z):

    d logp / dx_i = (1[i = y] - p_i) / T;  d H / dx_i = -p_i (z_i - S/D) / T;  d mean_logp / dx_i = (1/V - p_i) / T.
    Padding columns and ignored rows get 0.
    """
    acc = _acc_dtype(logits.dtype)
    n, local_vocab = logits.shape
    cols = _valid_cols(vocab_start, vocab_size, local_vocab)
    z = logits[:, :cols].to(acc) * inv_temperature
    lse = row_state[:, ROW_STATE_LSE].to(acc).unsqueeze(1)
    mean_z = row_state[:, ROW_STATE_MEAN_Z].to(acc).unsqueeze(1)
    p = torch.exp(z - lse)
    valid = (target != ignore_index).to(acc).unsqueeze(1)

    def _g(g: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.zeros(n, 1, dtype=acc, device=logits.device) if g is None else g.to(acc).reshape(n, 1)

    g_lp, g_h, g_m = _g(grad_logp), _g(grad_entropy), _g(grad_mean_logp)
    grad = -(g_lp + g_m) * p - g_h * p * (z - mean_z) + g_m / vocab_size
    local = target - vocab_start
    hit = (local >= 0) & (local < cols) & (target != ignore_index)
    rows = torch.nonzero(hit).squeeze(1)
    if cols:
        grad[rows, local[rows]] += g_lp.squeeze(1)[rows]
    grad = grad * valid * inv_temperature
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


def log_probs_dense(
    full_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The textbook oracle on the whole (gathered) vocab: ``log_softmax`` + ``gather``, differentiable.

    Returns (logp, entropy, cross_entropy_loss) with any leading shape; run it in fp64 for the reference.
    ``cross_entropy_loss`` applies label smoothing over the true vocab the way megatron-core defines it
    (smoothing = eps * V / (V - 1); loss = (1 - smoothing) * nll - smoothing * mean_i logp_i), but over
    the **global** vocab.
    """
    v = full_logits.shape[-1] if vocab_size is None else vocab_size
    z = full_logits[..., :v] / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    logp = torch.where(valid, logp, zero)
    entropy = torch.where(valid, entropy, zero)
    loss = -logp
    if label_smoothing > 0:
        smoothing = label_smoothing * v / (v - 1)
        mean_logp = torch.where(valid, logp_all.mean(-1), zero)
        loss = (1.0 - smoothing) * loss - smoothing * mean_logp
    return logp, entropy, loss


# ---------------------------------------------------------------------------------------------------------
# §3 Rollout correction (IS weights, RS masks, metrics)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# §4 Policy losses
# ---------------------------------------------------------------------------------------------------------
