"""megatron-core integration (docs/megatron.md): drop-ins for its vocab-parallel log-prob / cross-entropy path and a
``loss_func`` factory for its ``forward_backward_func``.

Process groups default to megatron-core's ``parallel_state`` (when it is initialized) and can always be given
explicitly, either as groups or as a ``ProcessGroupCollection`` (``pg_collection.tp`` / ``.dp_cp`` / ``.cp``), the
way newer megatron-core releases pass them. Under context parallelism the loss follows megatron-core: the batch is
split over the data-parallel group *with* CP, and sequence-level values are reduced over the CP group (see
:func:`make_policy_loss_func`). Nothing here needs CUDA.
"""

from __future__ import annotations

import dataclasses

import math
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from . import _layout as LY
from . import logprobs as _lp
from ._checks import (check_cu_seqlens, check_mask, ordered_sum, refuse_ambiguous_per_sequence, refuse_where, row_sums,
                      safe_div)
from .losses import (
    PolicyLossConfig,
    as_policy_config,
    check_bypass_loss_mode,
    check_loss_agg_mode,
    padded_horizon,
    policy_step,
    refuse_grad,
    segment_sum,
)

#: megatron's padding label, the log-prob kernels' default ignore_index (scored as log-prob 0)
_IGNORE_INDEX = -100


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except ImportError:  # megatron-core is optional: without it, groups must be passed explicitly
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def _attr(obj, name: str):
    """``obj.name``, or None when it is absent *or* None: megatron-core >= 0.19's ``ProcessGroupCollection`` answers
    None for every declared group it was not given (0.16 raises AttributeError), and its configs and layers set
    optional attributes to None. Every read of a megatron object goes through here, so the two mean the same."""
    return getattr(obj, name, None) if obj is not None else None


def _tp_group(group, pg_collection, layer=None):
    """``group`` if given; else ``pg_collection.tp``; else the output layer's own ``tp_group``; else megatron's
    parallel_state TP group; else None."""
    if group is not None:
        return group
    if pg_collection is not None:
        tp = _attr(pg_collection, "tp")
        if tp is None:
            raise TypeError("pg_collection has no tensor-parallel group (.tp is absent or None); expected a megatron "
                            "ProcessGroupCollection with .tp set, or pass tp_group")
        return tp
    if _attr(layer, "tp_group") is not None:
        return layer.tp_group
    ps = _parallel_state()
    return None if ps is None else ps.get_tensor_model_parallel_group()


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _ranks(group):
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def _loss_groups(dp_group, seq_group, pg_collection):
    """The (data-parallel, sequence) groups of the loss, following megatron-core under context parallelism.

    CP splits every sequence's tokens over the CP ranks, so the batch a loss is global over is split over
    DP x CP ranks (megatron's ``get_data_parallel_group(with_context_parallel=True)`` / ``pg_collection.dp_cp``,
    the group its ``finalize_model_grads`` reduces ``num_tokens`` and the gradients over), and per-sequence sums
    need the CP group (``get_context_parallel_group()`` / ``pg_collection.cp``). Explicit groups win; the other
    one is defaulted the same way and the pair is checked, so a DP group without CP next to a CP group is an
    error rather than per-rank metrics of half-sequences.
    """
    ps = _parallel_state() if pg_collection is None else None
    if seq_group is None:
        if pg_collection is not None:
            seq_group = _attr(pg_collection, "cp")
            state = _parallel_state() if seq_group is None else None
            if state is not None and state.get_context_parallel_world_size() > 1:
                # a collection that left its CP group out would make every rank's half-sequences whole ones
                raise ValueError(f"pg_collection has no .cp (absent or None), but megatron's parallel_state has "
                                 f"context parallelism of size {state.get_context_parallel_world_size()}: set "
                                 f"pg_collection.cp or pass seq_group (the context-parallel group)")
        elif ps is not None and ps.get_context_parallel_world_size() > 1:
            seq_group = ps.get_context_parallel_group()
    cp = _size(seq_group)
    # megatron-core >= 0.19: dp_cp_gtp_remat is the full data-distribution group (dp_cp x the GTP weight-remat
    # group, which holds distinct micro-batches too), the one its loss reductions use; it equals dp_cp when GTP is off.
    pg_dp_cp, gtp = _attr(pg_collection, "dp_cp_gtp_remat"), _size(_attr(pg_collection, "gtp_remat"))
    if pg_dp_cp is None:
        pg_dp_cp, gtp = _attr(pg_collection, "dp_cp"), 1
    pg_dp = _attr(pg_collection, "dp")
    if dp_group is None:
        if pg_collection is not None:
            if pg_dp_cp is not None:
                dp_group = pg_dp_cp
            elif cp > 1:
                raise ValueError(f"the context-parallel group has {cp} ranks but pg_collection has no .dp_cp (the "
                                 "data-parallel group with context parallelism; absent or None); set it or pass "
                                 "dp_group")
            elif pg_dp is not None:
                dp_group = pg_dp
            else:
                raise TypeError("pg_collection has neither .dp_cp nor .dp (absent or None; expected a megatron "
                                "ProcessGroupCollection); pass dp_group")
        elif ps is not None:
            dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    if cp == 1 and pg_dp is not None and pg_dp_cp is not None and _size(pg_dp_cp) != gtp * _size(pg_dp):
        raise ValueError(f"pg_collection.dp_cp has {_size(pg_dp_cp)} ranks and .dp {_size(pg_dp)}"
                         ": context parallelism is on, but there is no sequence group; add pg_collection.cp or "
                         "pass seq_group (the context-parallel group)")
    if cp > 1 and dp_group is not None:
        missing = set(dist.get_process_group_ranks(seq_group)) - set(dist.get_process_group_ranks(dp_group))
        if missing:
            raise ValueError(f"dp_group must be the data-parallel group *with* context parallelism (megatron's "
                             f"get_data_parallel_group(with_context_parallel=True) / pg_collection.dp_cp): it lacks "
                             f"the ranks {sorted(missing)} of the context-parallel seq_group")
    return dp_group, seq_group


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, tp_group=None, *, pg_collection=None,
                             **kwargs):
    """:func:`rollout_corr_ext.vocab_parallel_log_probs` with the tensor-parallel group defaulting to
    megatron-core's (``parallel_state.get_tensor_model_parallel_group()``, or ``pg_collection.tp``).

    ``logits`` is the ``[s, b, V_local]`` output of a megatron output layer (any leading shape works; ``target``
    must have the same leading shape, e.g. ``labels.transpose(0, 1)`` for megatron's ``[b, s]`` labels).
    Keyword arguments (``vocab_size``, ``temperature``, ``ignore_index``, ``return_entropy``, ...) pass through.
    """
    return _lp.vocab_parallel_log_probs(logits, target, _tp_group(tp_group, pg_collection), **kwargs)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, tp_group=None, *, pg_collection=None, **kwargs):
    """Drop-in for ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing)``:
    same call, returns -logp ``[s, b]`` in fp32, never modifies the logits, and smooths over the **global** vocab
    (Megatron-LM issue #737). The group defaults to megatron-core's tensor-parallel group.
    """
    return _lp.vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing,
                                            _tp_group(tp_group, pg_collection), **kwargs)


def _seq_numerator(row_sum, row_tokens, valid, mode, horizon, loss_scale_factor) -> torch.Tensor:
    """This rank's share of a seq-mean-* numerator, sum_b value_b (verl 0.9.1 ``agg_loss``): ``row_sum`` holds
    this rank's part of each row's sum(m * L), ``row_tokens`` / ``horizon`` the whole sequences' token counts and
    padded length (reduced over CP), so the shares of the CP ranks add up to the single-process numerator."""
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / (row_tokens.to(row_sum.dtype) + LY.MASKED_MEAN_EPS)
    total = ordered_sum(torch.where(valid, row_sum, torch.zeros_like(row_sum)))
    if mode == "seq-mean-token-sum-norm":
        total = safe_div(total, horizon if loss_scale_factor is None else loss_scale_factor)  # horizon 0: T = 0
    return total


def _packed_boundaries(packed_seq_params, cu_seqlens, cp_size: int, per_sequence: bool = False):
    """This rank's packed-sequence boundaries: ``cu_seqlens`` as given, or megatron's ``PackedSeqParams``
    (``cu_seqlens_q_padded`` else ``cu_seqlens_q``; divided by the CP size, as each CP rank holds that share of every
    padded sequence: each padded length must be divisible by 2 * cp). ``per_sequence`` (megatron's
    ``use_per_sequence_balancing``) under CP: the whole stream's boundaries, which :func:`_zigzag_boundaries` turns
    into this rank's once the stream's length is known. None: padded [b, s] batches."""
    if packed_seq_params is not None and cu_seqlens is not None:
        raise ValueError("pass either packed_seq_params or cu_seqlens, not both")
    if cu_seqlens is not None:
        return cu_seqlens
    if packed_seq_params is None:
        return None
    local_cp = _attr(packed_seq_params, "local_cp_size")  # megatron-core >= 0.19: a per-batch (hybrid) CP size
    if local_cp is not None and int(local_cp) != cp_size:
        raise ValueError(f"packed_seq_params.local_cp_size = {local_cp} but the sequence (context-parallel) group "
                         f"has {cp_size} ranks: pass that batch's CP group as seq_group")
    cu = _attr(packed_seq_params, "cu_seqlens_q_padded")
    if cu is None:
        cu = _attr(packed_seq_params, "cu_seqlens_q")
    if cu is None:
        raise ValueError("packed_seq_params carries no cu_seqlens_q / cu_seqlens_q_padded")
    if cp_size == 1 or per_sequence:
        return cu
    # megatron's per-document split (TE's thd_get_partitioned_indices): 2 * cp equal chunks of every padded sequence
    lengths = cu[1:] - cu[:-1]
    uneven = (lengths % (2 * cp_size)).ne(0).any()
    msg = (f"packed sequences under context parallelism ({cp_size} ranks): every padded sequence length "
           f"(cu_seqlens_q_padded) must be divisible by 2 * cp = {2 * cp_size} (megatron's per-document split); "
           f"a batch split with use_per_sequence_balancing needs make_policy_loss_func(use_per_sequence_balancing=True)")
    refuse_where(uneven, lambda at: msg, msg)
    return cu // cp_size


def _zigzag_position(offset: torch.Tensor, chunk, cp: int, rank: int) -> torch.Tensor:
    """The position in its whole sequence of a token at ``offset`` in CP rank ``rank``'s local piece of it, under
    megatron's load-balanced split: the piece is chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` (each ``chunk``
    long)."""
    second = offset >= chunk
    return torch.where(second, 2 * cp - 1 - rank, rank) * chunk + torch.where(second, offset - chunk, offset)


def _cp_positions(target: torch.Tensor, cu: Optional[torch.Tensor], cp: int, rank: int,
                  whole_stream: bool) -> torch.Tensor:
    """Each local token's position in its whole sequence under megatron's load-balanced split (rank ``rank`` of
    ``cp`` holds chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``): of each padded row, of each packed sequence
    (local boundaries ``cu``), or of the whole packed stream (``whole_stream``: use_per_sequence_balancing), in
    ``target``'s shape. Another split gives other positions, still distinct: a valid order, not the one-process one."""
    dev = target.device
    n = target.shape[-1]
    t = torch.arange(n, device=dev)
    if cu is None or whole_stream or cu.shape[0] < 2:
        pos = _zigzag_position(t, n // 2, cp, rank)
        return pos.expand(target.shape) if target.dim() == 2 else pos
    cu = cu.to(device=dev, dtype=torch.int64)
    seg = torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.shape[0] - 2)
    start = cu[seg]
    return _zigzag_position(t - start, (cu[seg + 1] - start) // 2, cp, rank)


def _zigzag_boundaries(cu: torch.Tensor, n: int, cp: int, rank: int) -> torch.Tensor:
    """This CP rank's packed-sequence boundaries when the whole packed stream (boundaries ``cu``) was split as one
    sequence (megatron-core 0.19's ``use_per_sequence_balancing``: ``2 * cp`` equal chunks of the stream, rank r
    holding chunks r and 2cp-1-r; ``n`` = 2 chunks, this rank's stream length). A sequence's local piece is its
    overlap with the two chunks; in the local stream the pieces come in sequence order and each is contiguous (a
    sequence in both chunks ends the first and starts the second), so the local boundaries are the cumulative sums
    of the overlaps: [B + 1], no host read."""
    if n % 2:
        raise ValueError(f"use_per_sequence_balancing under context parallelism: this rank's packed stream has {n} "
                         f"tokens, not two equal chunks (the stream length must be divisible by 2 * cp = {2 * cp})")
    c = n // 2
    cu = cu.to(torch.int64)
    lo = torch.tensor([rank * c, (2 * cp - 1 - rank) * c], device=cu.device)
    start, end = cu[:-1].unsqueeze(1), cu[1:].unsqueeze(1)
    overlap = (torch.minimum(end, lo + c) - torch.maximum(start, lo)).clamp(min=0).sum(1)
    return torch.cat([overlap.new_zeros(1), overlap.cumsum(0)])


def _bs(name: str, t, shape) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape [b, s] = {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _mtp_shifted(target: torch.Tensor, response_mask: torch.Tensor, k: int, cu: Optional[torch.Tensor]):
    """MTP head ``k``'s (targets, weights): position ``t`` scores the token ``k`` positions further in its sequence,
    ``target[.., t + k]`` with weight ``response_mask[.., t + k]`` (megatron-core's ``roll_tensor`` applied ``k`` times,
    within each packed sequence); the last ``k`` positions of each sequence get weight 0 and ``ignore_index`` -100
    (they are never multiplied)."""
    if cu is None:  # [b, s]
        s = target.shape[-1]
        pos = torch.arange(s, device=target.device) + k
        inside = (pos < s).expand(target.shape)
        idx = pos.clamp(max=max(s - 1, 0)).expand(target.shape)
    else:  # [T] in segments cu
        n = target.shape[0]
        cu = cu.to(target.device)
        seg = torch.searchsorted(cu[1:], torch.arange(n, device=target.device), right=True)
        pos = torch.arange(n, device=target.device) + k
        inside = pos < cu[1:][seg.clamp(max=cu.shape[0] - 2)]
        idx = pos.clamp(max=max(n - 1, 0))
    mask = torch.where(inside, response_mask.gather(-1, idx) if cu is None else response_mask[idx],
                       torch.zeros((), dtype=response_mask.dtype, device=response_mask.device))
    shifted = target.gather(-1, idx) if cu is None else target[idx]
    return torch.where(mask != 0, shifted, torch.full_like(shifted, _IGNORE_INDEX)), mask


def _mtp_shifted_cp(target: torch.Tensor, response_mask: torch.Tensor, num_layers: int, cu: Optional[torch.Tensor],
                    group):
    """Every MTP head's (targets, weights) under context parallelism: :func:`_mtp_shifted` of the whole sequences,
    read at this CP rank's positions (heads ``k = 1 .. num_layers``).

    The positions follow megatron-core's load-balanced layout (``get_batch_on_this_cp_rank``; packed THD: each
    sequence on its own, TE's ``thd_get_partitioned_indices`` over ``cu_seqlens_q_padded``): a sequence is cut into
    ``2 * cp`` equal chunks and CP rank r holds chunks r and ``2 * cp - 1 - r``, so its local piece of the sequence
    is ``[chunk r | chunk 2cp-1-r]``. megatron's ``roll_tensor(..., cp_group=...)`` (0.16 - 0.19,
    ``transformer/multi_token_prediction.py``) rolls each local chunk left by one and splices in the first token of
    the next chunk from the CP neighbour (isend / irecv; rank cp-1 takes it from its own second chunk, rank 0 inserts
    0 at the end of the sequence): the roll of the whole sequence, applied once per head. The same values come from
    **one all-gather** over ``group`` (after one MAX all-reduce of 8 numbers that checks every rank's pieces) of the
    first ``min(L, chunk)`` tokens of every local chunk, target and weight as fp64 (16 bytes a token; exact for ids
    and mask values): a position ``k <= L`` further lies in the same chunk
    (local) or within the first ``k`` tokens of a later chunk of its sequence (gathered). Positions past their
    sequence's end get weight 0 and -100, as in :func:`_mtp_shifted`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = target.device
    # [rows, positions]: the padded batch's rows, or the packed stream as one row
    rows_t, rows_m = (target, response_mask) if cu is None else (target.reshape(1, -1), response_mask.reshape(1, -1))
    n = rows_t.shape[-1]
    bounds = [0, n] if cu is None else [int(x) for x in cu.tolist()]  # one host read of the B + 1 local boundaries
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    # This rank's piece must be two equal chunks of each sequence, and every rank's of the same lengths (the gather
    # below assumes them). The verdict is every rank's (one MAX all-reduce of 8 numbers, on this first call only):
    # a rank that refused alone left the others waiting in the gather, and a piece of another length was rolled
    # wrongly without an error
    odd = any(length % 2 for length in lengths) or (cu is not None and bounds[-1] > n)
    key = 0
    for x in [rows_t.shape[0], len(lengths)] + lengths:
        key = (key * 1000003 + x) % (1 << 50)  # exact in fp64
    mine_v = torch.tensor([n, len(lengths), key, float(odd)], dtype=torch.float64, device=dev)
    both = torch.cat([mine_v, -mine_v])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if float(both[3]) > 0:
        raise ValueError(f"mtp_num_layers > 0 with context parallelism: every sequence's local piece must be the two "
                         f"equal chunks of megatron's load-balanced split (sequence lengths, packed: "
                         f"cu_seqlens_q_padded, divisible by 2 * cp = {2 * cp}) within the stream; this rank: {n} "
                         f"positions, local lengths {lengths}" + ("" if odd else " (another rank's are not)"))
    if not torch.equal(both[:3], -both[4:7]):
        raise ValueError(f"mtp_num_layers > 0 with context parallelism: the ranks of seq_group hold sequence pieces "
                         f"of different lengths (this rank: {n} positions, {rows_t.shape[0]} rows, local sequence "
                         f"lengths {lengths}); megatron's load-balanced split gives every rank two chunks of "
                         f"s / (2 * cp) positions of each sequence")
    n_heads_per_rank = sum(2 * min(num_layers, (b - a) // 2) for a, b in zip(bounds[:-1], bounds[1:]))
    if len(bounds) < 2 or n == 0:  # no sequence: every head weight is 0
        zero = torch.zeros_like(response_mask)
        return [(torch.full_like(target, _IGNORE_INDEX), zero) for _ in range(num_layers)]
    cu_l = torch.tensor(bounds, device=dev) if cu is None else cu.to(device=dev, dtype=torch.int64)
    t = torch.arange(n, device=dev)
    seg = torch.searchsorted(cu_l[1:], t, right=True).clamp(max=cu_l.shape[0] - 2)
    start, end = cu_l[seg], cu_l[seg + 1]
    in_seq = t < cu_l[-1]
    half = (end - start) // 2  # the chunk length of the position's sequence
    off = (t - start) % half.clamp(min=1)  # offset within its chunk: the same on every rank
    size = cp * n  # global positions of the whole sequences, plus one slot that takes the positions outside them

    def global_pos(r):  # where CP rank r's local positions sit in the whole sequences (sequence i starts at cp * cu[i])
        pos = cp * start + _zigzag_position(t - start, half, cp, r)
        return torch.where(in_seq, pos, torch.full_like(pos, size))

    vals = torch.stack([rows_t.double(), rows_m.double()], -1)  # [rows, n, 2]
    heads = torch.nonzero_static(in_seq & (off < num_layers), size=n_heads_per_rank).squeeze(1)
    from .logprobs import all_gather

    got = all_gather(vals.index_select(1, heads).reshape(-1), group, cp)  # the one collective: [cp, rows * nh * 2]
    got = got.view(cp, vals.shape[0], -1, 2).permute(1, 0, 2, 3).reshape(vals.shape[0], -1, 2)
    whole = vals.new_zeros(vals.shape[0], size + 1, 2)
    whole[:, torch.cat([global_pos(r).index_select(0, heads) for r in range(cp)])] = got
    mine = global_pos(rank)
    whole[:, mine] = vals
    whole[:, size] = 0  # the slot outside every sequence (this rank's stream past the last boundary) reads as masked
    out = []
    for k in range(1, num_layers + 1):
        read = whole[:, torch.where(in_seq & (mine + k < cp * end), mine + k, torch.full_like(mine, size))]
        mask = read[..., 1].to(response_mask.dtype)
        shifted = torch.where(mask != 0, read[..., 0].to(target.dtype), torch.full_like(rows_t, _IGNORE_INDEX))
        out.append((shifted.reshape(target.shape), mask.reshape(response_mask.shape)))
    return out


def make_policy_loss_func(
    target: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    old_log_prob: Optional[torch.Tensor] = None,
    rollout_log_prob: Optional[torch.Tensor] = None,
    config: Optional[PolicyLossConfig] = None,
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    logits_layout: str = "sbv",
    tp_group=None,
    dp_group=None,
    seq_group=None,
    pg_collection=None,
    reduce_metrics: bool = True,
    packed_seq_params=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_layer=None,
    sampling=None,
    batch_invariant: bool = False,
    mtp_num_layers: int = 0,
    mtp_loss_scaling_factor: float = 0.1,
    use_per_sequence_balancing: bool = False,
    versions: Optional[torch.Tensor] = None,
    current_version: Optional[int] = None,
    proximal: str = "loglinear",
    diagnostics=None,
) -> Callable:
    """Build the ``loss_func`` that megatron-core's ``forward_backward_func`` expects, for one micro-batch.

    ``forward_step_func`` returns ``(output_tensor, make_policy_loss_func(...))``; megatron then calls
    ``loss_func(output_tensor)`` with the output layer's vocab-parallel logits and gets
    ``(loss_sum, num_tokens, {name: tensor([sum, count])})``. Inside: log-probs (and entropy) from the logits
    with one collective over the TP group -> :func:`rollout_corr_ext.losses.policy_step` (the flow, rollout
    correction and policy loss, as :func:`rollout_corr_ext.losses.compute_policy_loss` runs them) -> this contract.

    Batch tensors are ``[b, s]`` and aligned with the logits' positions: ``target[b, s]`` is the token whose
    log-prob position s scores (megatron's ``labels``), ``response_mask`` marks the response tokens,
    ``advantages`` is ``[b, s]`` or ``[b]``. The flow follows ``config.rollout_correction``:

    * None: PPO (or the loss ``config.loss_mode`` names: every per-token loss of docs/policy_losses.md and GSPO,
      whose sequence ratio sums over ``seq_group``) against ``old_log_prob`` (None: pi_theta detached, i.e.
      on-policy, ratio 1);
    * ``bypass_mode``: correction of pi_theta vs ``rollout_log_prob``, PPO-clip or REINFORCE against pi_rollout;
    * otherwise (decoupled): correction of ``old_log_prob`` vs ``rollout_log_prob``, PPO (or ``loss_mode``'s loss)
      against pi_old times the IS weights. ``geo_mean``, ``clip_cov`` and ``kl_cov`` run their own functions on
      the micro-batch's log-probs (their covariances and GMPO's mean over rows are per micro-batch, as in verl;
      under context parallelism over the whole sequences of ``seq_group``, each rank's value its share of the
      micro-batch's), and ``geo_mean`` needs ``entropy_coeff=0``.

    Reduction contract: ``loss_sum / num_tokens`` is this micro-batch's ``loss_agg_mode`` value, and summed over
    micro-batches and data-parallel ranks, ``sum(loss_sum) / sum(num_tokens)`` is the exact global value of the
    mode — which is what megatron computes with ``calculate_per_token_loss=True`` (without it, megatron averages
    the per-micro-batch values). ``num_tokens`` counts valid tokens (``token-mean``) or valid sequences
    (``seq-mean-*``). ``token-sum`` has no normaliser to report and is rejected, and the config's global
    normalisers must be left unset (megatron's schedule does the global normalisation).

    Metrics, as megatron's training loop reports them (``sum / count`` after summing over micro-batches):
    ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy``
    and every ``rollout_corr/*`` value (count 1 per micro-batch; count 0 and sum 0 where the value is NaN, a
    statistic of no tokens: a diagnostics bucket no token fell in, or every correction metric of a micro-batch
    without response tokens over ``dp_group``, which adds loss 0 and ``num_tokens`` 0, ``geo_mean`` its row count,
    instead of raising), summed
    over ``dp_group`` in one all-reduce when ``reduce_metrics`` (the ratio is unchanged if the training loop reduces
    again).

    Groups (explicit arguments win; megatron-core 0.16 - 0.19 names; an attribute that is None counts as absent):

    * ``tp_group``: ``pg_collection.tp``, else ``output_layer.tp_group``, else
      ``parallel_state.get_tensor_model_parallel_group()``; with ``output_layer`` it must be the layer's group.
    * ``dp_group``: the ranks one global batch is split over, i.e. data parallel *with* context parallelism:
      ``pg_collection.dp_cp_gtp_remat`` (0.19+), else ``.dp_cp`` (``.dp`` only when there is no CP), else
      ``parallel_state.get_data_parallel_group(with_context_parallel=True)``.
    * ``seq_group``: the context-parallel group, whose ranks hold pieces of the same sequences (any split along
      s, e.g. megatron's load-balanced 2*cp chunks): ``packed_seq_params.cp_group`` (0.19+, a batch's own CP
      group), else ``pg_collection.cp``, else ``parallel_state.get_context_parallel_group()`` when CP > 1.
      Sequence-level IS / RS statistics and the ``seq-mean-*`` per-sequence token counts are summed over it (one all-reduce each), so the result equals
      the single-process one. Every CP rank returns the micro-batch's ``num_tokens`` (whole sequences) and
      ``cp_size`` times its share of the numerator (as megatron-core scales CP losses), so megatron's sum over
      DP x CP ranks (``calculate_per_token_loss=True``) and its mean of per-rank ``loss_sum / num_tokens``
      (otherwise) both give the value of the whole sequences. A ``dp_group`` that does not contain the
      ``seq_group`` ranks (the DP group without CP) is a ValueError. Without parallel_state or a pg_collection,
      pass both groups yourself under CP: nothing else can tell that the logits hold only part of each sequence.

    **Packed sequences** (sequence packing, megatron's THD layout): pass megatron's ``packed_seq_params`` (its
    ``cu_seqlens_q_padded``, else ``cu_seqlens_q``; with CP > 1 each rank holds ``1 / cp_size`` of every padded
    sequence, so the local boundaries ``cu_seqlens_q_padded // cp_size`` are used) or ``cu_seqlens`` itself (this
    rank's local boundaries). ``use_per_sequence_balancing=True``: the batch was split as megatron-core 0.19's
    ``get_batch_on_this_cp_rank(use_per_sequence_balancing=True)`` splits it (the whole packed stream cut into
    ``2 * cp_size`` chunks, rank r holding chunks r and ``2 * cp_size - 1 - r``; ``cu_seqlens_q_padded`` of the
    whole stream): the local boundaries are each sequence's overlap with this rank's chunks. Without it, a padded
    length not divisible by ``2 * cp_size`` is a ValueError (a device assert on a GPU): the per-document split
    cannot have produced it. Then ``target``, ``response_mask``, ``old_log_prob``, ``rollout_log_prob`` are the
    packed token stream ``[T]`` (or ``[1, T]`` / ``[T, 1]``), ``advantages`` is ``[T]`` or one value per sequence
    ``[B]``, and the logits are ``[T, 1, V_local]`` (``sbv``) or ``[1, T, V_local]`` (``bsv``). Padding tokens
    between segments must be 0 in ``response_mask``. No reshaping to ``[b, s]`` anywhere: every sequence-level
    quantity reduces over its segment in the kernels.

    **Hidden states instead of logits** (``output_layer``): pass the output layer (megatron's ``ColumnParallelLinear``
    ``model.output_layer``, or anything with a ``[V_local, H]`` ``weight`` and optional ``bias``) and return the
    final hidden states ``[s, b, H]`` (``bsv``: ``[b, s, H]``; packed: ``[T, 1, H]`` / ``[1, T, H]``) from
    ``forward_step_func`` instead of the logits (megatron: ``GPTModel.forward(..., runtime_gather_output=...)`` is
    not called for the output layer; e.g. ``model.decoder(...)`` then the final norm). The log-probs then come from
    :func:`rollout_corr_ext.linear_log_probs`: the ``[N, V_local]`` logits are never materialized. The hidden states
    enter it through megatron's "copy to tensor-parallel region" (identity forward, all-reduce of the gradient over
    the TP group in backward), as the output layer's own input does, so the transformer below gets the full
    gradient. With sequence parallelism (``output_layer.sequence_parallel``, as megatron's output layer has it
    whenever the model runs with ``sequence_parallel=True`` and TP > 1), return the hidden states as that layer
    receives them, this rank's ``[s / tp, b, H]`` piece (packed: ``[T / tp, 1, H]``): they are all-gathered over the
    TP group (again in backward, only this rank's piece is kept) and the gradient is reduce-scattered back, as the
    layer does (``linear_log_probs(..., sequence_parallel=True)``); ``logits_layout`` must then be ``sbv``.
    ``batch_invariant=True`` (with ``output_layer`` only) makes each token's log-prob independent of the rest of the
    micro-batch (``linear_log_probs(..., batch_invariant=True)``: fixed GEMM shapes).

    **Multi-token prediction** (``mtp_num_layers`` = megatron's ``config.mtp_num_layers``, with ``output_layer``):
    return the hidden states as megatron's ``MultiTokenPredictionBlock`` hands them to the output layer, the main
    head's and each MTP head's concatenated along the first (sequence) dimension, ``[(1 + L) * s, b, H]`` (sequence
    parallel: ``[(1 + L) * s / tp, b, H]``; packed: ``[(1 + L) * T, 1, H]``). The main head's part gets the policy
    loss; MTP head ``k`` (1..L) gets megatron's MTP loss, the cross-entropy of the tokens ``k`` positions further
    (``target`` and ``response_mask`` rolled left by ``k`` within each sequence, the last ``k`` positions of a
    sequence left out), through the fused path, so no MTP head materializes its logits either. As megatron
    scales it: ``loss_sum / num_tokens`` gains ``mtp_loss_scaling_factor / L * sum_k mean_k`` (``mean_k``: head
    ``k``'s cross-entropy over its rolled response mask, this micro-batch: megatron's per-micro-batch rule, so over
    micro-batches and DP ranks the MTP part is the ``num_tokens``-weighted mean of their MTP means, and a micro-batch
    with ``num_tokens`` 0 adds none; docs/megatron.md), and each head's value is reported as
    ``actor/mtp_{k}_loss``. Under context parallelism the positions must follow megatron's load-balanced split
    (each sequence, or each packed sequence, in ``2 * cp`` chunks, rank r holding chunks r and ``2 * cp - 1 - r``),
    as megatron's ``roll_tensor`` assumes (checked on the first call, one all-reduce of 8 numbers: pieces of odd or
    different lengths raise the same ValueError on every rank): the first call all-gathers over ``seq_group`` the
    first ``min(L, chunk)`` target ids and mask values of every local chunk (16 bytes a token, nothing per
    vocabulary entry), each head's
    weight sum joins the existing all-reduce of the counts, and the loss, the metrics and the gradients equal the
    single-process ones.

    **Sampling replay** (``sampling``, a :class:`rollout_corr_ext.SamplingParams`; docs/sampling_replay.md): pi_theta's
    log-probs are those of the truncated, renormalised distribution the engine sampled from (its temperature
    replaces ``temperature``, which must then stay 1.0; a per-position tensor field is in ``target``'s row-major
    order, whatever ``logits_layout``). Tokens outside the replayed kept set leave the loss (and the
    rollout correction) and are counted in ``rollout_corr/sampling_out_of_support_fraction``; so do tokens where a
    (replayed) ``old_log_prob`` is -inf (outside pi_old's kept set), except in bypass mode, which does not read it;
    ``rollout_corr/sampling_kept_mass_mean`` and ``rollout_corr/sampling_log_kept_mass_mean`` report S and log S
    over the response tokens. With ``output_layer`` the kept set is found from the same logits chunks the fused
    path computes (:func:`rollout_corr_ext.sampling.sampled_linear_log_probs`); the logits are never materialized.
    ``sampling`` may instead be a :class:`rollout_corr_ext.KeptTokens`: the ids the engine reported it kept for each
    target position (rows in ``target``'s row-major order, or the packed stream's), renormalised over exactly those
    (:func:`rollout_corr_ext.kept_log_probs`; with ``output_layer``, from the hidden states,
    :func:`rollout_corr_ext.kept_linear_log_probs`, with sequence parallelism too, not with ``batch_invariant``).

    **Asynchronous rollouts**: ``versions`` (the policy version that sampled each token: ``[b, s]``, ``[b]``, packed
    ``[T]`` or one per sequence) and ``current_version`` (the trainer's) report ``rollout_corr/staleness_mean``
    (the token-weighted lag). In the decoupled flow with ``old_log_prob=None``, pi_old is approximated from them
    (:func:`rollout_corr_ext.versions.proximal_log_prob`, ``proximal``: ``"loglinear"`` / ``"linear"``), with no
    forward pass; with ``old_log_prob`` given too, the approximation's error is reported
    (``rollout_corr/prox_approx_abs_error``, ``_imp_weight_error``).

    **Diagnostics** (``diagnostics``, a :class:`rollout_corr_ext.MismatchDiagnostics`, with a rollout correction):
    its metrics (docs/rollout_correction.md, "Diagnostics") join the ``rollout_corr/*`` ones (exact over
    ``dp_group`` per micro-batch, count 1), broken down by policy lag with ``versions``. Its per-token tensors
    (entropy, turn ids, positions) are in the batch tensors' layout; under context parallelism it needs
    ``positions``. For per-row values, the worst rows and histograms call
    :func:`rollout_corr_ext.compute_rollout_correction` with it directly.
    """
    cfg = as_policy_config(config)
    check_loss_agg_mode(loss_agg_mode)
    kept_tokens = None
    if sampling is not None:
        from .sampling import KeptTokens, SamplingParams

        if not isinstance(sampling, (SamplingParams, KeptTokens)):
            raise TypeError(f"sampling must be a rollout_corr_ext.SamplingParams or KeptTokens, got "
                            f"{type(sampling).__name__}")
        if temperature != 1.0:
            raise ValueError("with sampling, the temperature is sampling.temperature; leave temperature at 1.0")
        if isinstance(sampling, KeptTokens):
            if output_layer is not None and batch_invariant:
                raise ValueError("sampling=KeptTokens(...) with output_layer and batch_invariant=True is not supported "
                                 "(kept_linear_log_probs has no batch-invariant mode); pass SamplingParams, or the "
                                 "logits")
            kept_tokens = sampling

    rc_cfg = cfg.rollout_correction
    # the flow and the loss are policy_step's; refused here, at build time: a loss_mode the bypass flow would
    # ignore, and what the loss_sum / num_tokens contract cannot take
    if rc_cfg is not None and getattr(rc_cfg, "bypass_mode", False):
        check_bypass_loss_mode(cfg, "make_policy_loss_func")
    else:
        if cfg.loss_mode == "bypass_mode":
            raise ValueError("loss_mode='bypass_mode' needs config.rollout_correction with bypass_mode=True")
        if cfg.loss_mode == "geo_mean" and entropy_coeff != 0:
            raise ValueError("loss_mode='geo_mean' averages over sequences whatever loss_agg_mode says: an "
                             "entropy term has no common normaliser with it here; pass entropy_coeff=0")
        if cfg.loss_mode == "sapo" and loss_agg_mode != "seq-mean-token-mean":
            raise ValueError("loss_mode='sapo' is aggregated seq-mean-token-mean (as verl forces it); pass "
                             "loss_agg_mode='seq-mean-token-mean'")
    if loss_agg_mode == "token-sum":
        raise ValueError("loss_agg_mode='token-sum' has no normaliser to return as num_tokens in megatron's "
                         "loss_func contract; use token-mean or a seq-mean-* mode (or agg_loss directly)")
    if cfg.dp_size != 1 or cfg.batch_num_tokens is not None or cfg.global_batch_size is not None:
        raise ValueError("config.dp_size / batch_num_tokens / global_batch_size must be left unset for "
                         "make_policy_loss_func: megatron's schedule normalises by the returned num_tokens")
    if batch_invariant and output_layer is None:
        raise ValueError("batch_invariant=True applies to the fused path (output_layer=...): with logits, the "
                         "log-probs are per row already and the logits come from your own GEMM")
    if logits_layout not in ("sbv", "bsv"):
        raise ValueError(f"logits_layout must be 'sbv' (output layer) or 'bsv' (GPTModel output), got {logits_layout!r}")
    if not isinstance(use_per_sequence_balancing, bool):
        raise TypeError(f"use_per_sequence_balancing must be a bool, got {type(use_per_sequence_balancing).__name__}")
    if isinstance(mtp_num_layers, bool) or not isinstance(mtp_num_layers, int) or mtp_num_layers < 0:
        raise ValueError(f"mtp_num_layers must be an int >= 0 (megatron's config.mtp_num_layers), got "
                         f"{mtp_num_layers!r}")
    if mtp_num_layers:
        if output_layer is None:
            raise ValueError("mtp_num_layers > 0 needs output_layer=...: the MTP heads' losses come from their hidden "
                             "states through the fused path")
        if logits_layout != "sbv":
            raise ValueError("mtp_num_layers > 0: the heads' hidden states are concatenated along the sequence "
                             "dimension of [s, b, H], so logits_layout must be 'sbv'")
        if not (isinstance(mtp_loss_scaling_factor, (int, float)) and math.isfinite(mtp_loss_scaling_factor)
                and mtp_loss_scaling_factor >= 0):
            raise ValueError(f"mtp_loss_scaling_factor must be a finite number >= 0, got {mtp_loss_scaling_factor!r}")
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a tensor of token ids, got {type(target).__name__}")
    tp = _tp_group(tp_group, pg_collection, output_layer)
    if output_layer is not None and _attr(output_layer, "tp_group") is not None and _ranks(tp) != _ranks(
            output_layer.tp_group):
        raise ValueError(f"the tensor-parallel group (ranks {_ranks(tp)}) is not output_layer.tp_group (ranks "
                         f"{_ranks(output_layer.tp_group)}), the group the layer's vocabulary is split over")
    if seq_group is None and _attr(packed_seq_params, "cp_group") is not None:
        seq_group = packed_seq_params.cp_group  # megatron-core >= 0.19: this batch's own CP group (hybrid CP)
    dp, seq = _loss_groups(dp_group, seq_group, pg_collection)
    seq_world = _size(seq)
    zigzag = use_per_sequence_balancing and seq_world > 1 and packed_seq_params is not None
    if use_per_sequence_balancing and seq_world > 1 and mtp_num_layers:  # however the boundaries come
        raise ValueError("mtp_num_layers > 0 with use_per_sequence_balancing under context parallelism is not "
                         "supported (the MTP heads' shift follows megatron's per-document split)")
    cu = _packed_boundaries(packed_seq_params, cu_seqlens, seq_world, per_sequence=use_per_sequence_balancing)
    if cu is not None:  # packed: 1-D token streams
        if target.dim() == 2 and 1 in tuple(target.shape):
            target, response_mask, old_log_prob, rollout_log_prob = (
                None if t is None else t.reshape(-1) for t in (target, response_mask, old_log_prob, rollout_log_prob))
        if target.dim() != 1:
            raise ValueError(f"with packed sequences target must be the packed token stream [T] (or [1, T] / "
                             f"[T, 1]), got shape {tuple(target.shape)}")
        whole_cu = cu
        if zigzag:
            cu = _zigzag_boundaries(cu, target.shape[0], seq_world, dist.get_rank(seq))
        # the boundaries' own checks first: per-sequence values are expanded along them below (a raw allocator or
        # repeat error on boundaries past the stream or decreasing)
        cu = check_cu_seqlens(target, cu.to(target.device))
        num_seqs = cu.shape[0] - 1

        def refuse_ambiguous(name, n_values, fix):
            # decided alike on every rank: with use_per_sequence_balancing each rank's pieces differ (one rank's
            # refusal alone left the others waiting in the loss's all-reduce), so every rank's boundaries are read
            for r in range(seq_world) if zigzag else (None,):
                local = cu if r is None else _zigzag_boundaries(whole_cu, target.shape[0], seq_world, r)
                refuse_ambiguous_per_sequence(name, n_values, local.to(target.device), target.shape[0], fix)

        if isinstance(advantages, torch.Tensor) and advantages.dim() == 1:
            refuse_ambiguous("advantages", advantages.shape[0],
                             f"pass per-token advantages as [1, {num_seqs}], or expand per-sequence ones to the tokens "
                             f"yourself (torch.repeat_interleave(advantages, cu_seqlens.diff()))")
        if isinstance(advantages, torch.Tensor) and advantages.dim() == 1 and advantages.shape[0] == num_seqs \
                and num_seqs != target.shape[0]:
            advantages = torch.repeat_interleave(advantages, cu[1:] - cu[:-1], output_size=target.shape[0])
        elif isinstance(advantages, torch.Tensor) and advantages.dim() == 2 and 1 in tuple(advantages.shape):
            advantages = advantages.reshape(-1)
    elif target.dim() != 2:
        raise ValueError(f"target must be a [b, s] tensor of token ids, got {tuple(target.shape)}")
    shape = tuple(target.shape)
    check_mask("response_mask", response_mask, target, "target")
    # the log-prob kernels score a target at ignore_index (-100) as log-prob 0: at a response token it would enter
    # the loss (and an MTP head's mean) as a certain token, silently
    ignored = (target == _IGNORE_INDEX) & (response_mask != 0)
    refuse_where(ignored, lambda at: f"target at {at} is -100 (ignore_index) where response_mask is "
                                     f"{response_mask[at].item()}: a response token needs its token id (mask it out "
                                     f"to leave it out of the loss)",
                 "target holds -100 (ignore_index) at a response token (response_mask != 0)")
    if loss_agg_mode == "token-mean" and response_mask.dtype != torch.bool:
        # num_tokens is an integer count: sum(loss_sum) / sum(num_tokens) over micro-batches and ranks is the global
        # token mean sum(m L) / sum(m) only for 0 / 1 weights (a fractional mask would weight each micro-batch by its
        # token count, not by its mask's sum): refused, as megatron's own integer count cannot carry it either
        frac = (response_mask != 0) & (response_mask != 1)
        refuse_where(frac, lambda at: f"response_mask at {at} is {float(response_mask.detach()[at])}: loss_agg_mode="
                                      f"'token-mean' in megatron's loss_func contract needs 0 / 1 weights (num_tokens "
                                      f"is a count); use a seq-mean-* mode for weighted tokens",
                     "response_mask: token-mean in the loss_func contract needs 0 / 1 weights")
    if cu is None and isinstance(advantages, torch.Tensor) and advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages of shape [b] must have b = {shape[0]}, got {tuple(advantages.shape)}")
        advantages = advantages.reshape(-1, 1).expand(shape)
    _bs("advantages", advantages, shape)
    rc = cfg.rollout_correction
    bypass = rc is not None and bool(getattr(rc, "bypass_mode", False))
    if versions is not None:  # per-token policy versions (asynchronous rollouts): per token, per row, per sequence
        from .versions import PROXIMAL_METHODS, check_current_version, check_versions_dtype

        if isinstance(current_version, bool) or not isinstance(current_version, int):
            raise ValueError(f"versions need current_version (an int, the trainer's policy version), got "
                             f"{current_version!r}")
        check_current_version(current_version)  # in [0, 2**63): the lags are int64
        if proximal not in PROXIMAL_METHODS:
            raise ValueError(f"proximal must be one of {PROXIMAL_METHODS}, got {proximal!r}")
        check_versions_dtype(versions)
        per_seq = cu is not None and versions.dim() == 1 and versions.shape[0] == cu.shape[0] - 1
        if per_seq and versions.shape[0] == target.shape[0]:
            refuse_ambiguous("versions", versions.shape[0], "pass per-token versions as [1, T] (or [T, 1])")
            per_seq = False
        if per_seq:
            versions = torch.repeat_interleave(versions, cu[1:] - cu[:-1], output_size=target.shape[0])
        elif cu is not None and versions.dim() == 2 and 1 in tuple(versions.shape):
            versions = versions.reshape(-1)
        elif cu is None and versions.dim() == 1 and versions.shape[0] == shape[0]:
            versions = versions.reshape(-1, 1).expand(shape)
        _bs("versions", versions, shape)
    elif current_version is not None:
        raise ValueError("current_version is given without versions")
    diag_spec = None
    if diagnostics is not None:
        from .observability import MismatchDiagnostics

        if not isinstance(diagnostics, MismatchDiagnostics):
            raise TypeError(f"diagnostics must be a rollout_corr_ext.MismatchDiagnostics, got "
                            f"{type(diagnostics).__name__}")
        if rc is None:
            raise ValueError("diagnostics need config.rollout_correction (they ride on the correction's reduce)")
        diag_spec = diagnostics
        if versions is not None and diagnostics.versions is None:  # the loss's versions, per token
            diag_spec = dataclasses.replace(diagnostics, versions=versions, current_version=current_version)
    if old_log_prob is not None:
        _bs("old_log_prob", old_log_prob, shape)
    if rollout_log_prob is not None:
        _bs("rollout_log_prob", rollout_log_prob, shape)
    if rc is not None and rollout_log_prob is None:
        raise ValueError("config.rollout_correction is set, so rollout_log_prob (the sampler's log-probs) is required")
    if rc is not None and not bypass and old_log_prob is None and versions is None:
        raise ValueError("decoupled rollout correction needs old_log_prob (pi_old recomputed by the trainer), or "
                         "versions + current_version to approximate it; set bypass_mode=True to use pi_rollout as "
                         "pi_old instead")
    metric_group = dp if dp is not None else seq  # the ranks the global batch is split over
    seq_parallel = False
    if output_layer is not None:
        out_weight = _attr(output_layer, "weight")
        if not isinstance(out_weight, torch.Tensor) or out_weight.dim() != 2:
            raise ValueError("output_layer must have a [V_local, H] weight tensor (megatron's ColumnParallelLinear "
                             "output layer)")
        # megatron's layer all-gathers its sequence-sharded input; the fused path does the same, keeps only this
        # rank's piece for backward and reduce-scatters the gradient (which then needs no all-reduce)
        seq_parallel = bool(_attr(output_layer, "sequence_parallel")) and _size(tp) > 1
        if seq_parallel and logits_layout != "sbv":
            raise ValueError("output_layer with sequence_parallel=True: the hidden states are split along their "
                             "first (sequence) dimension, so logits_layout must be 'sbv' ([s / tp, b, H]; packed: "
                             "[T / tp, 1, H])")
        out_bias = None if _attr(output_layer, "skip_bias_add") else _attr(output_layer, "bias")

    if kept_tokens is not None:  # its rows follow target's flattened order; the logits' rows may be transposed
        if kept_tokens.rows != target.numel():
            raise ValueError(f"sampling=KeptTokens has {kept_tokens.rows} rows, target {target.numel()} tokens "
                             f"(one kept set per target position, in target's row-major order)")
        if cu is None and logits_layout == "sbv":
            b_, s_ = target.shape
            kept_tokens = kept_tokens.permute_rows(
                torch.arange(b_ * s_, device=kept_tokens.offsets.device).reshape(b_, s_).t().reshape(-1))

    if sampling is not None and kept_tokens is None and cu is None and logits_layout == "sbv":
        # per-position fields follow target's row-major [b, s] order, as every batch tensor; the logits' rows are
        # [s, b] here, so they are transposed with them (as KeptTokens' rows above)
        b_, s_ = target.shape

        def _sb(v):  # SamplingParams takes 1-D tensors only: [b * s] in target's row-major order
            if isinstance(v, torch.Tensor) and v.dim() and v.numel() == b_ * s_:
                return v.reshape(b_, s_).t().reshape(-1)
            return v

        sampling = dataclasses.replace(sampling, **{f: _sb(getattr(sampling, f))
                                                    for f in ("temperature", "top_k", "top_p", "min_p")})

    # clip_cov / kl_cov under CP: each token's position in its whole sequence, so that their covariance selections
    # break exact ties in the one-process order (losses.policy_step's seq_positions), where the split is megatron's
    # (padded rows, packed_seq_params, use_per_sequence_balancing); this rank's own cu_seqlens may come from any
    # split: ties by rank then (exact for contiguous pieces)
    seq_positions = None
    if seq_world > 1 and cfg.loss_mode in ("clip_cov", "kl_cov") and (
            cu is None or packed_seq_params is not None or use_per_sequence_balancing):
        seq_positions = _cp_positions(target, cu, seq_world, dist.get_rank(seq), use_per_sequence_balancing)

    # MTP head k's targets and weights: target / response_mask k positions further within each sequence. Under CP
    # the next positions may sit on other CP ranks: found on the first loss_func call (one all-gather over seq_group
    # of the chunks' first L tokens, _mtp_shifted_cp) and kept for later calls
    mtp_heads = [] if seq_world > 1 else [_mtp_shifted(target, response_mask, k, cu)
                                          for k in range(1, mtp_num_layers + 1)]

    def hidden_in(x):  # the output layer's input: all-reduce of its gradient over TP (with SP: inside the path)
        from .linear import copy_to_tensor_parallel_region

        return x if seq_parallel or mtp_num_layers else copy_to_tensor_parallel_region(x, tp)

    def log_probs(x, tgt):
        """(log-probs, entropy, in_support or None, log S or None) in ``tgt``'s shape."""
        if kept_tokens is not None:
            from .sampling import kept_linear_log_probs, kept_log_probs

            if output_layer is None:
                r = kept_log_probs(x, tgt, kept_tokens, tp, vocab_size=vocab_size)
            else:
                r = kept_linear_log_probs(hidden_in(x), out_weight, tgt, kept_tokens, tp, bias=out_bias,
                                          vocab_size=vocab_size, sequence_parallel=seq_parallel)
            return r.log_prob, r.entropy, r.in_support, r.log_kept_mass
        if sampling is not None:
            from .sampling import sampled_linear_log_probs, sampled_log_probs

            if output_layer is None:
                r = sampled_log_probs(x, tgt, sampling, tp, vocab_size=vocab_size)
            else:
                r = sampled_linear_log_probs(hidden_in(x), out_weight, tgt, sampling, tp, bias=out_bias,
                                             vocab_size=vocab_size, sequence_parallel=seq_parallel,
                                             batch_invariant=batch_invariant)
            return r.log_prob, r.entropy, r.in_support, r.log_kept_mass
        if output_layer is None:
            return _lp.vocab_parallel_log_probs(x, tgt, tp, vocab_size=vocab_size, temperature=temperature,
                                                return_entropy=True) + (None, None)
        from .linear import linear_log_probs

        return linear_log_probs(hidden_in(x), out_weight, tgt, tp, bias=out_bias, vocab_size=vocab_size,
                                temperature=temperature, return_entropy=True,
                                sequence_parallel=seq_parallel, batch_invariant=batch_invariant) + (None, None)

    def _map(fn, *xs):
        return tuple(None if x is None else fn(x) for x in xs)
    if not entropy_coeff >= 0:
        raise ValueError(f"entropy_coeff must be >= 0, got {entropy_coeff}")

    def loss_func(output_tensor: torch.Tensor, non_loss_data: bool = False):
        logits = output_tensor[0] if isinstance(output_tensor, (tuple, list)) else output_tensor
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"loss_func expects vocab-parallel logits [s, b, V_local] (or [b, s, V_local]; with "
                             f"output_layer: hidden states [s, b, H] / [b, s, H]), got "
                             f"{getattr(logits, 'shape', type(logits))}")
        mtp_parts = []
        if mtp_num_layers:  # [(1 + L) * s, b, H]: the main head's rows, then each MTP head's
            if logits.shape[0] % (1 + mtp_num_layers):
                raise ValueError(f"mtp_num_layers = {mtp_num_layers}: the hidden states must be the main and MTP "
                                 f"heads' concatenated along dim 0, [(1 + {mtp_num_layers}) * s, b, H]; got "
                                 f"{tuple(logits.shape)}")
            if not seq_parallel:  # one all-reduce of d(loss)/d(hidden) over TP for every head
                from .linear import copy_to_tensor_parallel_region

                logits = copy_to_tensor_parallel_region(logits, tp)
            logits, *mtp_parts = torch.chunk(logits, 1 + mtp_num_layers, dim=0)
        tgt = target.to(logits.device)
        # with sequence parallelism the hidden states are this rank's 1 / tp of the positions (first dimension)
        lead = (logits.shape[0] * (_size(tp) if seq_parallel else 1),) + tuple(logits.shape[1:-1])
        if cu is not None:  # [T, 1, V] or [1, T, V]: the log-probs of the stream, [T]
            if math.prod(lead) != tgt.shape[0] or 1 not in lead:
                raise ValueError(f"packed sequences: logits must be [T, 1, V_local] or [1, T, V_local] with T = "
                                 f"{tgt.shape[0]}" + (f" (sequence parallel: hidden states [T / tp, 1, H], tp = "
                                                      f"{_size(tp)})" if seq_parallel else "") +
                                 f", got {tuple(logits.shape)}")
            logp, entropy, in_support, log_s = _map(lambda t: t.reshape(-1),
                                                    *log_probs(logits, tgt.reshape(lead)))
        elif logits_layout == "sbv":
            logp, entropy, in_support, log_s = _map(lambda t: t.transpose(0, 1),
                                                    *log_probs(logits, tgt.transpose(0, 1)))
        else:
            logp, entropy, in_support, log_s = log_probs(logits, tgt)
        if non_loss_data:
            out = {"log_prob": logp.detach(), "entropy": entropy.detach()}
            if in_support is not None:
                out.update(in_support=in_support, log_kept_mass=log_s)
            return out
        refuse_grad("make_policy_loss_func", old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob,
                    advantages=advantages)
        if mtp_num_layers and not mtp_heads:  # context parallelism: every CP rank calls loss_func, so all gather
            mtp_heads.extend(_mtp_shifted_cp(tgt, response_mask.to(tgt.device), mtp_num_layers, cu, seq))

        old_in, rollout_in, versions_in = _map(lambda t: t.to(logp.device), old_log_prob, rollout_log_prob, versions)
        lag = None
        if versions_in is not None:
            from .versions import policy_lag

            # a response token newer than the trainer, or with a negative version (not generated), is refused, as
            # compute_policy_loss refuses it, before it could be read as a lag or give pi_prox = pi_rollout
            # silently: a ValueError naming it on the rank that holds it (an asynchronous assert on CUDA), no
            # collective
            lag = policy_lag(versions_in, current_version, response_mask.to(versions_in.device))
        given, diag_call = response_mask, diag_spec
        if in_support is not None:  # a token outside the replayed kept set has probability 0: it leaves the loss
            if old_in is not None and not bypass:
                # pi_old, replayed by the caller, is -inf where the token is outside pi_old's own kept set: the PPO
                # ratio pi_theta / pi_old is undefined there, so the token leaves the loss as well
                in_support = in_support & (old_in != -math.inf)
            given = torch.where(in_support, response_mask, torch.zeros_like(response_mask))
            if diag_spec is not None:  # the correction sees the kept tokens only
                diag_call = diag_spec.with_positions_in(response_mask.to(given.device))
        if old_in is None and rc is None:  # no pi_old (and none to approximate): on-policy, ratio 1
            old_in = logp.detach()
        step = policy_step(cfg, old_in, logp, advantages, given, loss_agg_mode, rollout_log_prob=rollout_in,
                           dp_group=dp, seq_group=seq, cu_seqlens=cu, versions=versions_in,
                           current_version=current_version, proximal=proximal, diagnostics=diag_call,
                           empty="nan", loss_share=False, seq_positions=seq_positions, fn="make_policy_loss_func")
        rows, mask = step.rows, step.mask
        m = mask.to(logp.dtype)
        ent_masked = torch.where(mask != 0, entropy, torch.zeros_like(entropy)).mul(m)
        ent_rows = row_sums(ent_masked) if cu is None else segment_sum(ent_masked, cu)
        # Whole sequences: under CP the ranks of seq_group hold pieces of the same sequences, so the per-row token
        # counts, the padded length (packed: the B sequence lengths) and the valid-token count are summed over it
        # (one all-reduce of B + 2 numbers, 2B + 1 packed, fp64 so counts stay exact) and every CP rank reports the
        # micro-batch's num_tokens. Its share
        # of the numerator is scaled by the CP size, as megatron-core scales CP losses: then both of megatron's
        # reductions give the single-process value (the sum over DP x CP ranks of loss_sum over that of
        # num_tokens with calculate_per_token_loss=True; otherwise the mean over the ranks of loss_sum / num_tokens).
        row_tokens = rows[:, LY.PG_ROW_TOKENS].detach()
        n_rows = row_tokens.shape[0]
        if cu is None:  # the padded width (under CP each rank's share of it: the shares add up to it)
            local_horizon = row_tokens.new_full((1,), float(logp.shape[-1]), dtype=torch.float64)  # no H2D copy
        elif seq_world > 1:  # packed under CP: each sequence's local length, summed to its whole length, then max
            local_horizon = (cu[1:] - cu[:-1]).to(device=row_tokens.device, dtype=torch.float64)
        else:
            local_horizon = padded_horizon(logp, cu).double().reshape(1)
        # under CP the MTP heads' weight sums ride on the same all-reduce: each head's mean is over the micro-batch
        mtp_local = [ordered_sum(m_k.double()).reshape(1) for _, m_k in mtp_heads] if seq_world > 1 else []
        counts = torch.cat([row_tokens.double(), local_horizon, (mask != 0).sum().double().reshape(1)] + mtp_local)
        if seq_world > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=seq)
        counts, mtp_totals = counts[:counts.shape[0] - len(mtp_local)], counts[counts.shape[0] - len(mtp_local):]
        row_tokens, horizon, valid_tokens = counts[:n_rows].to(rows.dtype), counts[n_rows:-1], counts[-1]
        if cu is None or seq_world == 1:
            horizon = horizon[0]
        else:  # the longest whole sequence, as padded_horizon takes it
            horizon = horizon.max().clamp(min=1) if horizon.numel() else horizon.new_ones(())
        if loss_agg_mode == "token-mean":
            # value * count is sum(m * L) for 0/1 masks; for fractional masks it keeps the micro-batch value exact
            count = valid_tokens.round().to(torch.int64)
            n = count.to(rows.dtype)
            pg_sum = safe_div(ordered_sum(rows[:, LY.PG_ROW_LOSS_SUM]), ordered_sum(row_tokens)) * n
            ent_sum = safe_div(ordered_sum(ent_rows), ordered_sum(row_tokens).to(ent_rows.dtype)) * n.to(ent_rows.dtype)
        else:
            valid = row_tokens > 0  # rows RS rejected entirely (or without response tokens) do not count
            count = valid.sum()
            pg_sum = _seq_numerator(rows[:, LY.PG_ROW_LOSS_SUM], row_tokens, valid, loss_agg_mode, horizon,
                                    cfg.loss_scale_factor)
            ent_sum = _seq_numerator(ent_rows, row_tokens, valid, loss_agg_mode, horizon, cfg.loss_scale_factor)
        if step.whole_batch:  # the loss's own micro-batch value times this contract's count (under CP the
            # step's loss is this rank's share of it, scaled by the CP size below like every share)
            if cfg.loss_mode == "geo_mean":  # the mean over every row, as verl's torch.mean
                count = torch.tensor(rows.shape[0], device=rows.device)
            pg_sum = step.loss * count.to(step.loss.dtype)
        if seq_world > 1:
            pg_sum, ent_sum = pg_sum * seq_world, ent_sum * seq_world
        n = count.to(pg_sum.dtype)
        loss_sum = pg_sum - entropy_coeff * ent_sum if entropy_coeff > 0 else pg_sum
        mtp_pairs = []
        if mtp_num_layers:
            from .linear import linear_log_probs

            # megatron's MTP loss: each head's cross-entropy mean over its rolled mask, scaled by factor / L,
            # added to this micro-batch's value (so loss_sum gains it times num_tokens). Under CP this rank's share:
            # its cross-entropy sum over the micro-batch's weight sum, times the CP size like every share above
            # (megatron's own MTP divides by the rank's weight sum; this is the single-process value)
            scale = mtp_loss_scaling_factor / mtp_num_layers * seq_world
            for k, (x_k, (tgt_k, m_k)) in enumerate(zip(mtp_parts, mtp_heads)):
                tgt_k = tgt_k.to(x_k.device)
                lp_k = linear_log_probs(x_k, out_weight, tgt_k.reshape(lead) if cu is not None else tgt_k.t(), tp,
                                        bias=out_bias,
                                        vocab_size=vocab_size, sequence_parallel=seq_parallel,
                                        batch_invariant=batch_invariant)
                lp_k = lp_k.reshape(-1) if cu is not None else lp_k.transpose(0, 1)
                m_k = m_k.to(device=lp_k.device, dtype=lp_k.dtype)
                # this rank's: the metric's, summed over dp_group
                ce_sum, n_k = -ordered_sum(lp_k * m_k), ordered_sum(m_k)
                n_all = mtp_totals[k].to(n_k.dtype) if seq_world > 1 else n_k
                loss_sum = loss_sum + scale * safe_div(ce_sum, n_all) * n
                mtp_pairs.append((ce_sum.detach(), n_k))

        rows = rows.detach()
        tokens = ordered_sum(rows[:, LY.PG_ROW_TOKENS])
        names = ["actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy"]
        pairs = [
            (pg_sum.detach(), n),
            (ordered_sum(rows[:, LY.PG_ROW_CLIP]), tokens),
            (ordered_sum(rows[:, LY.PG_ROW_CLIP_LOWER]), tokens),
            (ordered_sum(rows[:, LY.PG_ROW_KL_SUM]) if step.gspo_x_sum is None else -step.gspo_x_sum.to(rows.dtype),
             tokens),
            (ordered_sum(entropy.detach() * m), tokens),
        ]
        if step.whole_batch:  # the loss's own metrics (verl's masked means), as sums over the same tokens
            zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
            for i, key in ((1, "actor/pg_clipfrac"), (2, "actor/pg_clipfrac_lower"), (3, "actor/ppo_kl")):
                v = step.loss_metrics.get(key)
                pairs[i] = ((v.to(rows.dtype) * (tokens + LY.MASKED_MEAN_EPS)) if v is not None else zero, tokens)
        if step.opsm_counts is not None:  # dropped sequences over sequences with tokens (whole sequences, exact
            # over CP): as a [sum, count] pair, so summing micro-batches and ranks gives the pooled fraction
            names.append("actor/opsm_masked_frac")
            pairs.append(tuple(c.detach().to(torch.float32) for c in step.opsm_counts))
        if step.correction_metrics:  # NaN: nothing to average in this micro-batch (no token over dp_group, or a
            # diagnostics bucket no token fell in); it adds (0, 0), not a NaN that would poison the sum. One stack
            # for all of them (a diagnostics spec brings about 200)
            vals = torch.stack([v.detach().reshape(()).to(torch.float32) for v in step.correction_metrics.values()])
            defined = vals == vals
            names.extend(step.correction_metrics)
            pairs.extend(zip(torch.where(defined, vals, torch.zeros_like(vals)).unbind(),
                             defined.to(torch.float32).unbind()))
        if versions is not None:  # token-weighted lag over this rank's response tokens, summed like actor/*
            valid_t = given != 0
            names.append("rollout_corr/staleness_mean")
            pairs.append((torch.where(valid_t, lag, torch.zeros_like(lag)).sum().float(), valid_t.sum().float()))
        if step.prox_error:  # exact over dp_group already: weighted by this rank's tokens, its mean is unchanged
            n_given = (given != 0).sum().float()
            for k, v in step.prox_error.items():  # a micro-batch without tokens adds (0, 0), not its NaN mean
                names.append(k)
                pairs.append((torch.where(n_given > 0, v.float() * n_given, torch.zeros_like(n_given)), n_given))
        for k, pair in enumerate(mtp_pairs, 1):
            names.append(f"actor/mtp_{k}_loss")
            pairs.append(pair)
        if in_support is not None:  # over this rank's response tokens, summed like the actor/ metrics
            valid = response_mask != 0
            n_valid = valid.sum().float()
            ls = log_s.detach().double()
            names += ["rollout_corr/sampling_out_of_support_fraction", "rollout_corr/sampling_kept_mass_mean",
                      "rollout_corr/sampling_log_kept_mass_mean"]
            pairs += [((valid & ~in_support).sum().float(), n_valid),
                      (ordered_sum(torch.where(valid, ls.exp(), torch.zeros_like(ls))), n_valid),
                      (ordered_sum(torch.where(valid, ls, torch.zeros_like(ls))), n_valid)]
        report = torch.stack([torch.stack([a.float(), b.float()]) for a, b in pairs])
        if reduce_metrics and _size(metric_group) > 1:
            dist.all_reduce(report, group=metric_group)
        return loss_sum, count.to(torch.int), {k: report[i] for i, k in enumerate(names)}

    return loss_func


def reported_means(reports) -> Dict[str, float]:
    """What megatron's training loop logs from the ``loss_func`` reports of one step's micro-batches:
    for each name, (sum of sums) / (sum of counts). Accepts one dict or a list of them."""
    if isinstance(reports, dict):
        reports = [reports]
    out: Dict[str, float] = {}
    for k in reports[0]:
        total = torch.stack([r[k].float() for r in reports]).sum(0)
        out[k] = float(total[0] / total[1]) if float(total[1]) != 0 else float("nan")
    return out
