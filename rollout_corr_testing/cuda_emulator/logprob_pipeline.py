"""The whole log-prob pipeline (per-shard row stats -> merge -> per-shard backward) on the emulated CUDA kernels,
compared with the fp64 oracle (``torch.log_softmax`` on the gathered vocab). Shared by the emulator tests and the
planted-bug self-test, so both judge the kernels by the values a user gets, not by the internal record layout."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from rollout_corr_testing.logprob_oracle import log_probs_dense


def emulated_log_probs(shards: Sequence[torch.Tensor], target: torch.Tensor, vocab_size: int, temperature: float,
                       grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                       grad_mean_logp: Optional[torch.Tensor], stats_knobs: Dict = None,
                       merge_knobs: Dict = None, backward_knobs: Dict = None, inplace: bool = False):
    """Returns (logp, entropy, mean_logp, grad over the concatenated shards), each from the emulated kernels."""
    emu = torch.ops.rollout_corr_emu
    stats_knobs, merge_knobs, backward_knobs = stats_knobs or {}, merge_knobs or {}, backward_knobs or {}
    inv_t = 1.0 / temperature
    with_sum_z = grad_mean_logp is not None
    starts, start = [], 0
    for s in shards:
        starts.append(start)
        start += s.shape[-1]
    records = torch.stack([emu.vocab_row_stats(s, target, v0, vocab_size, inv_t, -100, with_sum_z, **stats_knobs)
                           for s, v0 in zip(shards, starts)])
    logp, ent, mean_logp, state, status = emu.merge_row_stats(records, target, -100, vocab_size, inv_t, with_sum_z,
                                                              **merge_knobs)
    assert int(status.abs().sum()) == 0, f"merge status {status.tolist()}"
    grads = []
    for s, v0 in zip(shards, starts):
        if inplace:
            g = s.clone()
            emu.logprob_backward_(g, grad_logp, grad_entropy, grad_mean_logp, target, state, v0, vocab_size, inv_t,
                                  -100, **backward_knobs)
        else:
            g = emu.logprob_backward(grad_logp, grad_entropy, grad_mean_logp, s, target, state, v0, vocab_size,
                                     inv_t, -100, **backward_knobs)
        assert g.dtype == s.dtype
        grads.append(g)
    return logp, ent, mean_logp, torch.cat(grads, -1)


def oracle_log_probs(full: torch.Tensor, target: torch.Tensor, vocab_size: int, temperature: float,
                     grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                     grad_mean_logp: Optional[torch.Tensor]):
    """fp64 (logp, entropy, mean_logp, grad over the padded width) from autograd of log_softmax."""
    x = full.detach().double().clone().requires_grad_(True)
    logp, ent, _ = log_probs_dense(x, target, vocab_size=vocab_size, temperature=temperature)
    valid = target != -100
    z = torch.where(valid.unsqueeze(-1), x[..., :vocab_size], torch.zeros((), dtype=x.dtype)) / temperature
    mean_logp = torch.where(valid, torch.log_softmax(z, -1).mean(-1), torch.zeros_like(logp))
    loss = (logp * grad_logp.double()).sum()
    if grad_entropy is not None:
        loss = loss + (ent * grad_entropy.double()).sum()
    if grad_mean_logp is not None:
        loss = loss + (mean_logp * grad_mean_logp.double()).sum()
    loss.backward()
    return logp.detach(), ent.detach(), mean_logp.detach(), x.grad
