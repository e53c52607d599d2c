"""The independent fp64 oracle of the log-prob family: ``torch.log_softmax`` on the whole (gathered) vocab.

Written from the definitions only (no record, no merge, nothing shared with the kernels or the fallback), and
differentiable, so tests take the oracle's gradient from autograd.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


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
    valid = target != ignore_index
    # Ignored positions are not inspected: their logits (NaN, all -inf, anything) are replaced by zeros, so they
    # give 0 and a zero gradient without NaN reaching autograd.
    x = torch.where(valid.unsqueeze(-1), full_logits[..., :v], torch.zeros((), dtype=full_logits.dtype))
    # log_softmax is shift-invariant: subtract the (constant) row max before dividing by the temperature, so that
    # x / T cannot overflow for |x| near the dtype's maximum (1.6e308 / 0.5 is inf even in fp64).
    z = (x - x.amax(-1, keepdim=True).detach()) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    safe = torch.where(valid, target, torch.zeros_like(target))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    # H = -sum p log p over the columns with mass: a -inf column (p = 0) adds 0, and no 0 * -inf reaches autograd.
    p_all = logp_all.exp()
    entropy = -(p_all * torch.where(p_all > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    zero = torch.zeros_like(logp)
    logp = torch.where(valid, logp, zero)
    entropy = torch.where(valid, entropy, zero)
    loss = -logp
    if label_smoothing > 0:
        smoothing = label_smoothing * v / (v - 1)
        mean_logp = torch.where(valid, logp_all.mean(-1), zero)
        loss = (1.0 - smoothing) * loss - smoothing * mean_logp
    return logp, entropy, loss
