"""Vocab-parallel log-probs, entropy and cross entropy: the autograd function and its one collective.

Forward (DESIGN §2): one read of the local shard -> a 16-20 B record per row -> **one**
``all_gather_into_tensor`` over ``tp_group`` (none at TP=1) -> merge. Backward: no collective, one read and
one write of the shard. Saved: the logits themselves (not a copy) plus 8 B per row.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import ops

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _group_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tp_group was given but torch.distributed is not initialized")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Out-of-range targets are an error. CPU: an exact message; CUDA: an async device assert (no host sync)."""
    bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    if target.device.type == "cuda":
        torch._assert_async(
            ~bad.any(),
            f"target holds ids outside [0, vocab_size={vocab_size}) that are not ignore_index={ignore_index}",
        )
        return
    if bool(bad.any()):
        pos = int(torch.nonzero(bad.reshape(-1))[0])
        raise ValueError(
            f"target holds ids outside [0, vocab_size={vocab_size}) that are not ignore_index={ignore_index}: "
            f"target.flatten()[{pos}] = {int(target.reshape(-1)[pos])}"
        )


def _all_gather_rows(stats: torch.Tensor, group, world: int) -> torch.Tensor:
    """The one collective: every rank's [N, K] record, concatenated along rows, viewed as [world, N, K].

    torch >= 2.12 names it ``all_gather_single`` (``all_gather_into_tensor`` is its deprecated alias).
    """
    out = stats.new_empty((world * stats.shape[0],) + tuple(stats.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, stats.contiguous(), group=group)
    return out.view((world,) + tuple(stats.shape))


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logits [N, V_local], target [N]) -> (logp, entropy, mean_logp), each [N]."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, world, vocab_start, vocab_size, inv_temperature, ignore_index,
                with_sum_z, inplace_backward):
        stats = ops.vocab_row_stats(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index,
                                    with_sum_z)
        if world > 1:
            gathered = _all_gather_rows(stats, tp_group, world)
        else:
            gathered = stats.unsqueeze(0)
        logp, entropy, mean_logp, row_state = ops.merge_row_stats(gathered, target, ignore_index, vocab_size)
        ctx.save_for_backward(logits, target, row_state)
        ctx.args = (vocab_start, vocab_size, inv_temperature, ignore_index, inplace_backward)
        ctx.set_materialize_grads(False)
        if not with_sum_z:
            ctx.mark_non_differentiable(mean_logp)
        return logp, entropy, mean_logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_mean_logp):
        logits, target, row_state = ctx.saved_tensors
        vocab_start, vocab_size, inv_temperature, ignore_index, inplace_backward = ctx.args
        if grad_logp is None and grad_entropy is None and grad_mean_logp is None:
            return (None,) * 10
        if inplace_backward:
            ops.logprob_backward_(logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state,
                                  vocab_start, vocab_size, inv_temperature, ignore_index)
            grad = logits
        else:
            grad = ops.logprob_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
                                        vocab_start, vocab_size, inv_temperature, ignore_index)
        return (grad,) + (None,) * 9


def _vocab_parallel(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group,
    vocab_start: Optional[int],
    vocab_size: Optional[int],
    temperature: float,
    ignore_index: int,
    with_sum_z: bool,
    inplace_backward: bool,
):
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be a float16/bfloat16/float32/float64 tensor, got "
                        f"{getattr(logits, 'dtype', type(logits))}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dimension, got shape {tuple(logits.shape)}")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be an int64 (or int32) tensor of token ids, got "
                        f"{getattr(target, 'dtype', type(target))}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits is on {logits.device}; they must match")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    world, rank = _group_size_rank(tp_group)
    local_vocab = logits.shape[-1]
    if vocab_start is None:
        vocab_start = rank * local_vocab
    if vocab_size is None:
        vocab_size = world * local_vocab
    if vocab_start < 0 or vocab_start + local_vocab > world * local_vocab:
        raise ValueError(
            f"vocab_start={vocab_start} is inconsistent with the shard: a shard of {local_vocab} columns on a "
            f"group of {world} must start in [0, {(world - 1) * local_vocab}]")
    if not 0 < vocab_size <= world * local_vocab:
        raise ValueError(f"vocab_size={vocab_size} is inconsistent with the shards: it must be in "
                         f"[1, {world * local_vocab}] (= tp size {world} x local vocab {local_vocab})")
    if vocab_start >= vocab_size and world == 1:
        raise ValueError(f"vocab_start={vocab_start} must be < vocab_size={vocab_size}")

    target = target.to(torch.int64)
    _check_targets(target, vocab_size, ignore_index)

    lead = logits.shape[:-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    logits2d = logits.reshape(-1, local_vocab)  # a view whenever the leading dims are flattenable
    target1d = target.reshape(-1).contiguous()
    logp, entropy, mean_logp = _VocabParallelLogProbs.apply(
        logits2d, target1d, tp_group, world, int(vocab_start), int(vocab_size), 1.0 / float(temperature),
        int(ignore_index), with_sum_z, inplace_backward)
    return logp.reshape(lead), entropy.reshape(lead), mean_logp.reshape(lead), int(vocab_size)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities of ``target`` under ``softmax(logits / temperature)`` with the vocab split over ``tp_group``.

    Args:
        logits: this rank's shard ``[..., V_local]`` (bf16/fp16/fp32/fp64), e.g. megatron's ``[s, b, V_local]``.
        target: **global** token ids ``[...]`` (int64).
        tp_group: the tensor-parallel process group (None: a single shard, no collective).
        vocab_start: global id of this shard's first column (default ``rank * V_local``).
        vocab_size: true vocab size; columns at or past it are padding and excluded (default ``world * V_local``).
        temperature: z = logits / temperature.
        ignore_index: positions with this target give 0 and zero gradient.
        return_entropy: also return the entropy of ``softmax(z)``.
        inplace_backward: write the gradient into the logits buffer (saves one ``[N, V_local]`` allocation;
            the logits are overwritten during backward).

    Returns:
        fp32 log-probs ``[...]`` (fp64 for fp64 logits), and the entropy when ``return_entropy``.
    """
    logp, entropy, _, _ = _vocab_parallel(logits, target, tp_group, vocab_start, vocab_size, temperature,
                                          ignore_index, False, inplace_backward)
    return (logp, entropy) if return_entropy else logp


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Drop-in for megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``: returns -logp (fp32).

    Label smoothing follows megatron-core's definition (smoothing = eps * V / (V - 1),
    loss = (1 - smoothing) * nll - smoothing * mean_i logp_i) but over the **global** vocab and the globally
    summed logits, so it is also right under TP (megatron-core averages over the local shard only,
    Megatron-LM issue #737). Unlike megatron-core it never modifies ``vocab_parallel_logits``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    with_sum_z = label_smoothing > 0
    logp, _, mean_logp, v = _vocab_parallel(vocab_parallel_logits, target, tp_group, vocab_start, vocab_size,
                                            temperature, ignore_index, with_sum_z, inplace_backward)
    loss = -logp
    if with_sum_z:
        smoothing = label_smoothing * v / (v - 1)
        loss = (1.0 - smoothing) * loss - smoothing * mean_logp
    return loss
