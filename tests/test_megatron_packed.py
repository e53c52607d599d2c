"""Packed sequences (megatron's THD layout) in :func:`rollout_corr_ext.megatron.make_policy_loss_func`.

One global batch of B sequences with padded lengths L_b (multiples of 2 * cp) is run three ways and compared with
the single-process **padded** ``loss_func`` on ``[s, b, V]`` logits: (1) packed on one process (logits
``[T, 1, V]``, megatron's ``PackedSeqParams``); (2) packed over DP = 2 (each rank packs its sequences);
(3) packed over CP = 2 (each rank holds megatron's load-balanced share of every sequence, 2 * cp chunks, rank r
chunks r and 2cp-1-r, with the local boundaries ``cu_seqlens_q_padded // cp``). Loss (megatron's
``calculate_per_token_loss=True`` reduction), ``num_tokens``, every reported metric and the gradient of the logits
must match. Rollout correction with sequence-level IS / RS, so each sequence's statistics need all its pieces.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

from rollout_corr_testing.dist_utils import cp_token_index, run_workers_preloaded

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

VOCAB, T = 24, 16
LENGTHS = [16, 8, 12, 4]  # padded sequence lengths: multiples of 2 * cp = 4; one is the full width T
CASES = [
    ("token-mean", "seq_is_rs", 0.0),
    ("seq-mean-token-mean", "seq_is_rs", 0.01),
    ("seq-mean-token-sum-norm", "bypass_geo_rs", 0.0),
    ("seq-mean-token-sum", "bypass_pg_seq_is", 0.0),
]


def _config(preset):
    from rollout_corr_ext.config import RolloutCorrectionConfig

    if preset == "seq_is_rs":
        return RolloutCorrectionConfig.decoupled_seq_is_rs(is_threshold=1.5, rs_threshold="0.4_2.5")
    if preset == "bypass_geo_rs":
        return RolloutCorrectionConfig.bypass_ppo_clip_geo_rs(rs_threshold="0.9_1.1")
    return RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_max_k2",
                                   rollout_rs_threshold=0.5, bypass_mode=True, loss_type="reinforce")


def _batch(seed=7):
    """Padded [b, s] tensors (positions past L_b are padding: mask 0) and [s, b, V] logits."""
    g = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    logits = 2.0 * torch.randn(T, b, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (b, T), generator=g)
    mask = torch.zeros(b, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, 1 + i % 2:n - (i % 3 == 0)] = True
    adv = torch.randn(b, generator=g)
    lp = torch.log_softmax(logits.double(), -1).gather(-1, target.t().unsqueeze(-1)).squeeze(-1).t()
    scale = torch.tensor([0.05, 0.6, 0.2, 0.4], dtype=torch.float64)
    old = (lp + 0.1 * torch.randn(b, T, generator=g, dtype=torch.float64)).float()
    rollout = (lp + scale.view(-1, 1) * torch.randn(b, T, generator=g, dtype=torch.float64)).float()
    return logits, target, mask, adv, old, rollout


def _local_cu(cu, n, cp, rank):
    """This rank's local boundaries of a stream split with use_per_sequence_balancing (each sequence's overlap with
    chunks r and 2cp-1-r of the whole stream's 2cp), from the positions the rank holds."""
    held = cp_token_index(n, cp, rank)
    counts = [int(((held >= a) & (held < b)).sum()) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.tensor([0] + counts).cumsum(0)


def _make(case, target, mask, adv, old, rollout, **kw):
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    mode, preset, ent = case
    rc = _config(preset)
    cfg = PolicyLossConfig(clip_ratio=0.2, rollout_correction=rc)
    return make_policy_loss_func(target, adv, mask, old_log_prob=None if rc.bypass_mode else old,
                                 rollout_log_prob=rollout, config=cfg, loss_agg_mode=mode, entropy_coeff=ent, **kw)


def _padded_reference(batch, case):
    from rollout_corr_ext.megatron import reported_means

    logits = batch[0].clone().requires_grad_(True)
    loss_sum, num_tokens, report = _make(case, *batch[1:])(logits)
    value = loss_sum / num_tokens.clamp(min=1)
    value.backward()
    return value.detach().double(), int(num_tokens), reported_means(report), logits.grad


def _pack(batch, seqs, positions):
    """Pack sequences ``seqs`` (each at ``positions(b)``) into one stream: logits [T', 1, V], the rest [T'],
    advantages per sequence, cu_seqlens, and the (position, sequence) index of every packed token."""
    logits, target, mask, adv, old, rollout = batch
    index = [(int(p), b) for b in seqs for p in positions(b)]
    pos = torch.tensor([p for p, _ in index])
    row = torch.tensor([b for _, b in index])
    lens = [len(positions(b)) for b in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    packed_logits = logits[pos, row].unsqueeze(1).clone().requires_grad_(True)
    return (packed_logits, target[row, pos], mask[row, pos], adv[list(seqs)], old[row, pos], rollout[row, pos], cu,
            pos, row)


def _compare(name, got, ref, failures):
    value, count, metrics, grad_ok = got
    ref_value, ref_count, ref_metrics = ref
    if count != ref_count:
        failures.append(f"{name}: num_tokens {count} != {ref_count}")
    if not torch.allclose(value, ref_value, rtol=1e-5, atol=1e-6):
        failures.append(f"{name}: loss {value.item():.8g} != padded {ref_value.item():.8g}")
    if set(metrics) != set(ref_metrics):
        failures.append(f"{name}: metric names differ: {sorted(set(metrics) ^ set(ref_metrics))}")
    for k in sorted(set(metrics) & set(ref_metrics)):
        if math.isnan(metrics[k]) and math.isnan(ref_metrics[k]):  # a diagnostics bucket no token fell in
            continue
        if not abs(metrics[k] - ref_metrics[k]) <= 1e-4 * abs(ref_metrics[k]) + 1e-6:
            failures.append(f"{name}: metric {k} = {metrics[k]:.8g}, padded {ref_metrics[k]:.8g}")
    if not grad_ok:
        failures.append(f"{name}: gradient of the packed logits differs from the padded one")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_packed_single_process_equals_padded(case):
    from rollout_corr_ext.megatron import reported_means

    batch = _batch()
    ref_value, ref_count, ref_metrics, ref_grad = _padded_reference(batch, case)
    plog, tgt, mask, adv, old, rollout, cu, pos, row = _pack(batch, range(len(LENGTHS)),
                                                             lambda b: torch.arange(LENGTHS[b]))
    params = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=cu, qkv_format="thd")
    loss_sum, num_tokens, report = _make(case, tgt, mask, adv, old, rollout, packed_seq_params=params)(plog)
    value = loss_sum / num_tokens.clamp(min=1)
    value.backward()
    grad_ok = torch.allclose(plog.grad[:, 0], ref_grad[pos, row], rtol=1e-4, atol=1e-7)
    failures = []
    _compare(case[0], (value.detach().double(), int(num_tokens), reported_means(report), grad_ok),
             (ref_value, ref_count, ref_metrics), failures)
    assert not failures, "\n".join(failures)


def _megatron_per_sequence_split(total, cu, group):
    """The stream positions megatron-core's own ``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)``
    (0.19+) gives this rank, or None where megatron-core has no such split."""
    import inspect

    try:
        from megatron.core.utils import get_batch_on_this_cp_rank
    except ImportError:
        return None
    if "use_per_sequence_balancing" not in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return None
    batch = {"tokens": torch.arange(total).reshape(1, -1), "cu_seqlens": cu}
    out = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group, use_per_sequence_balancing=True)
    return out["tokens"].reshape(-1)


def _worker(rank, world, layout):
    from rollout_corr_ext.megatron import reported_means

    failures = []
    group = dist.new_group([0, 1])
    for case in CASES:
        batch = _batch()
        ref_value, ref_count, ref_metrics, ref_grad = _padded_reference(batch, case)
        if layout == "dp":  # each rank packs its own sequences
            seqs = [rank, rank + 2]
            packed = _pack(batch, seqs, lambda b: torch.arange(LENGTHS[b]))
            groups = dict(dp_group=group, seq_group=None)
        elif layout == "cp":  # CP: every sequence, this rank's load-balanced half of each
            seqs = list(range(len(LENGTHS)))
            packed = _pack(batch, seqs, lambda b: cp_token_index(LENGTHS[b], world, rank))
            groups = dict(dp_group=group, seq_group=group)
        else:  # CP, megatron 0.19's use_per_sequence_balancing: the whole stream cut into 2 * cp chunks (zigzag)
            seqs = list(range(len(LENGTHS)))
            plog, tgt, mask, adv, old, rollout, cu, pos, row = _pack(batch, seqs, lambda b: torch.arange(LENGTHS[b]))
            mine = cp_token_index(int(cu[-1]), world, rank)  # a sequence may span both of this rank's chunks
            theirs = _megatron_per_sequence_split(int(cu[-1]), cu, group)
            if theirs is not None and not torch.equal(theirs, mine):
                failures.append(f"megatron's per-sequence split gives positions {theirs.tolist()}, not {mine.tolist()}")
            plog = plog.detach()[mine].clone().requires_grad_(True)
            packed = (plog, tgt[mine], mask[mine], adv, old[mine], rollout[mine], cu, pos[mine], row[mine])
            groups = dict(dp_group=group, seq_group=group, use_per_sequence_balancing=True)
        plog, tgt, mask, adv, old, rollout, cu, pos, row = packed
        global_cu = cu * (world if layout == "cp" else 1)  # megatron's cu_seqlens_q_padded: the whole sequences
        params = types.SimpleNamespace(cu_seqlens_q=global_cu, cu_seqlens_q_padded=global_cu, qkv_format="thd")
        loss_sum, num_tokens, report = _make(case, tgt, mask, adv, old, rollout, packed_seq_params=params,
                                             tp_group=None, **groups)(plog)
        if layout == "cp_per_sequence":
            # MTP heads' shift follows the per-document split: refused with the flag whichever way the boundaries come
            # (packed_seq_params, or this rank's local cu_seqlens; before, the latter gave wrong MTP targets silently)
            out_layer = types.SimpleNamespace(weight=torch.zeros(5, 3), bias=None, sequence_parallel=False,
                                              skip_bias_add=False)
            for route in (dict(packed_seq_params=params), dict(cu_seqlens=_local_cu(cu, int(cu[-1]), world, rank))):
                try:
                    _make(case, tgt, mask, adv, old, rollout, tp_group=None, output_layer=out_layer,
                          mtp_num_layers=1, **route, **groups)
                    failures.append(f"MTP with use_per_sequence_balancing under CP ({sorted(route)}): no error")
                except ValueError as e:
                    if "use_per_sequence_balancing" not in str(e):
                        failures.append(f"the MTP error does not name use_per_sequence_balancing: {e}")
            # the same batch without the flag: its lengths cannot be per-document
            uneven = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 6, 20, 40]),
                                           cu_seqlens_q_padded=torch.tensor([0, 6, 20, 40]), qkv_format="thd")
            try:
                _make(case, tgt, mask, adv[:3], old, rollout, packed_seq_params=uneven, tp_group=None,
                      dp_group=group, seq_group=group)
                failures.append("lengths not divisible by 2 * cp without use_per_sequence_balancing: no error")
            except ValueError as e:
                if "use_per_sequence_balancing" not in str(e):
                    failures.append(f"the error does not name use_per_sequence_balancing: {e}")
        totals = torch.stack([loss_sum.detach().double(), num_tokens.double()])
        dist.all_reduce(totals, group=group)  # calculate_per_token_loss=True: megatron sums over DP x CP
        value = totals[0] / totals[1].clamp(min=1)
        count = int(totals[1]) // (1 if layout == "dp" else world)  # every CP rank reports the whole count
        (loss_sum / totals[1].clamp(min=1).to(loss_sum.dtype)).backward()
        grad_ok = torch.allclose(plog.grad[:, 0], ref_grad[pos, row], rtol=1e-4, atol=1e-7)
        _compare(f"{layout}/{case[0]}", (value, count, reported_means(report), grad_ok),
                 (ref_value, ref_count, ref_metrics), failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("layout", ["dp", "cp", "cp_per_sequence"])
def test_packed_distributed_equals_single_process_padded(layout):
    run_workers_preloaded(_worker, 2, layout)


def test_packed_advantages_of_ambiguous_length_are_refused():
    """As many packed sequences as tokens, some empty: advantages [N] could be per sequence or per token, and the
    two differ, so it is an error naming the way out; [1, T] is per token; all segments of length 1 coincide."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    logits = torch.tensor([[[0.0, 1.0, 2.0]], [[1.0, 0.0, -1.0]]])
    target, mask = torch.tensor([0, 2]), torch.tensor([True, True])
    psp = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32), cu_seqlens_q_padded=None)
    with pytest.raises(ValueError, match=r"advantages of shape \[2\] is ambiguous"):
        make_policy_loss_func(target, torch.tensor([1.0, -5.0]), mask, packed_seq_params=psp)(logits)
    per_token, n, _ = make_policy_loss_func(target, torch.tensor([[1.0, 1.0]]), mask, packed_seq_params=psp)(logits)
    assert per_token.item() / n.item() == pytest.approx(-1.0)  # on-policy: loss = -A per token
    ones = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), cu_seqlens_q_padded=None)
    loss, n, _ = make_policy_loss_func(target, torch.tensor([1.0, -5.0]), mask, packed_seq_params=ones)(logits)
    assert loss.item() / n.item() == pytest.approx(2.0)


def test_packed_seq_params_of_megatron_0_19():
    """megatron-core 0.19's PackedSeqParams fields: None (as it leaves unset fields) counts as absent, and a
    local_cp_size that is not the sequence group's size (hybrid CP without its group) is a named error, never
    per-rank values of half-sequences."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    logits = torch.tensor([[[0.0, 1.0, 2.0]], [[1.0, 0.0, -1.0]], [[0.5, 0.5, 0.0]]])
    target, mask, adv = torch.tensor([0, 2, 1]), torch.tensor([True, True, True]), torch.tensor([[1.0, 1.0, 1.0]])
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    plain = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=None)
    new = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=None, local_cp_size=None, cp_group=None)
    ref = make_policy_loss_func(target, adv, mask, packed_seq_params=plain)(logits)
    got = make_policy_loss_func(target, adv, mask, packed_seq_params=new)(logits)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    hybrid = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=None, local_cp_size=2, cp_group=None)
    with pytest.raises(ValueError, match="local_cp_size = 2"):
        make_policy_loss_func(target, adv, mask, packed_seq_params=hybrid)


def _ambiguous_per_sequence_balancing_worker(rank, world):
    from rollout_corr_ext.megatron import make_policy_loss_func

    group = dist.new_group(list(range(world)))
    cu = torch.tensor([0, 1, 4])  # two sequences, 1 and 3 tokens: 2 tokens per rank
    params = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=cu, qkv_format="thd")
    mine = cp_token_index(4, world, rank)  # rank 0: positions 0, 3 (one token of each); rank 1: 1, 2 (sequence 1)
    target = torch.tensor([0, 2, 1, 0])[mine]
    errors = []
    for name, kw in (("advantages", dict(advantages=torch.tensor([1.0, -5.0]))),
                     ("versions", dict(advantages=torch.tensor([[1.0, 1.0]]), versions=torch.tensor([3, 4]),
                                       current_version=5))):
        try:  # construction only: a rank that did not raise would wait in the loss's all-reduce
            make_policy_loss_func(target, kw.pop("advantages"), torch.ones(2, dtype=torch.bool),
                                  packed_seq_params=params, dp_group=group, seq_group=group,
                                  use_per_sequence_balancing=True, **kw)
            errors.append(f"rank {rank}: {name} [2] not refused")
        except ValueError as e:
            if "ambiguous" not in str(e):
                errors.append(f"rank {rank}: {name}: {e}")
    assert not errors, "\n".join(errors)


def test_ambiguous_per_sequence_values_are_refused_on_every_rank_under_per_sequence_balancing():
    """use_per_sequence_balancing gives the CP ranks different pieces: here rank 0 holds one token of each of the
    two sequences (per sequence and per token coincide) and rank 1 two tokens of the second (they differ). Rank 1
    alone refused advantages / versions [2] and rank 0 went on into the loss's all-reduce (a hang until gloo's
    timeout; the megatron fuzz): every rank reads every rank's boundaries and refuses alike."""
    run_workers_preloaded(_ambiguous_per_sequence_balancing_worker, 2)


#: Sampling replay under CP: (loss_mode, preset, loss_agg_mode, sampling, diagnostics). "kept": the engine's kept ids
#: (the 3 most likely tokens of each position, from each rank's own logits).
REPLAY_CASES = [
    ("vanilla", "decoupled_seq_is_rs", "seq-mean-token-mean", dict(top_k=6, top_p=0.9), True),
    ("geo_mean", "decoupled_token_is", "token-mean", dict(top_p=0.7, min_p=0.05, temperature=0.8), False),
    ("gspo", None, "seq-mean-token-mean", "kept", False),
    ("clip_cov", "decoupled_token_icepop", "token-mean", dict(top_k=12, temperature=1.3), True),
    ("vanilla", "bypass_ppo_clip", "seq-mean-token-sum-norm", "kept", True),
]


def _replay_loss_func(case, logits, target, mask, adv, old, rollout, positions, **kw):
    from rollout_corr_ext import KeptTokens, MismatchDiagnostics, SamplingParams
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    mode, preset, agg, spec, diag = case
    rc = None if preset is None else getattr(RolloutCorrectionConfig, preset)()
    cfg = PolicyLossConfig(loss_mode=mode, clip_ratio=0.2, rollout_correction=rc, clip_cov_ratio=0.5,
                           clip_cov_lb=0.02, clip_cov_ub=40.0)
    if spec == "kept":  # one list per target, in the targets' order ([b, s] padded, the stream packed)
        ids = logits.detach().topk(3, -1).indices
        sampling = KeptTokens.from_lists((ids.transpose(0, 1) if ids.shape[1] > 1 else ids).reshape(-1, 3).tolist())
    else:
        sampling = SamplingParams(**spec)
    return make_policy_loss_func(target, adv, mask, old_log_prob=None if rc is not None and rc.bypass_mode else old,
                                 rollout_log_prob=rollout, config=cfg, loss_agg_mode=agg, sampling=sampling,
                                 diagnostics=MismatchDiagnostics(positions=positions) if diag else None, **kw)(logits)


def _replay_batch(seed):
    """:func:`_batch` with most targets among each position's two most likely tokens (as a sampler draws them), so
    the replay keeps some and leaves others out."""
    logits, target, mask, adv, _, _ = _batch(seed)
    g = torch.Generator().manual_seed(seed)
    likely = logits.topk(2, -1).indices.gather(-1, torch.randint(0, 2, logits.shape[:2] + (1,), generator=g))
    target = torch.where(torch.rand(target.shape, generator=g) < 0.7, likely.squeeze(-1).t(), target)
    lp = torch.log_softmax(logits.double(), -1).gather(-1, target.t().unsqueeze(-1)).squeeze(-1).t()
    old = (lp + 0.1 * torch.randn(lp.shape, generator=g, dtype=torch.float64)).float()
    rollout = (lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)).float()
    return logits, target, mask, adv, old, rollout


def _cp_replay_worker(rank, world):
    from rollout_corr_ext.megatron import reported_means

    failures = []
    group = dist.new_group([0, 1])
    for i, case in enumerate(REPLAY_CASES):
        logits, target, mask, adv, old, rollout = batch = _replay_batch(11 + i)
        positions = torch.cumsum(mask.long(), 1) - 1  # each token's index among its sequence's response tokens
        ref_logits = logits.clone().requires_grad_(True)
        loss_sum, num_tokens, report = _replay_loss_func(case, ref_logits, target, mask, adv, old, rollout, positions)
        (loss_sum / num_tokens.clamp(min=1)).backward()
        ref = ((loss_sum / num_tokens.clamp(min=1)).detach().double(), int(num_tokens), reported_means(report))
        seqs = list(range(len(LENGTHS)))
        plog, tgt, pmask, padv, pold, proll, cu, pos, row = _pack(batch, seqs,
                                                                  lambda b: cp_token_index(LENGTHS[b], world, rank))
        global_cu = cu * world
        params = types.SimpleNamespace(cu_seqlens_q=global_cu, cu_seqlens_q_padded=global_cu, qkv_format="thd")
        loss_sum, num_tokens, report = _replay_loss_func(case, plog, tgt, pmask, padv, pold, proll, positions[row, pos],
                                                         packed_seq_params=params, dp_group=group, seq_group=group)
        totals = torch.stack([loss_sum.detach().double(), num_tokens.double()])
        dist.all_reduce(totals, group=group)  # calculate_per_token_loss=True: megatron sums over DP x CP
        (loss_sum / totals[1].clamp(min=1).to(loss_sum.dtype)).backward()
        grad_ok = torch.allclose(plog.grad[:, 0], ref_logits.grad[pos, row], rtol=1e-4, atol=1e-7)
        name = f"{case[0]}/{case[1]}/{case[3]}"
        if not 0 < ref[2]["rollout_corr/sampling_out_of_support_fraction"] < 1:
            failures.append(f"{name}: the replay should leave some targets out and keep others")
        _compare(name, (totals[0] / totals[1].clamp(min=1), int(totals[1]) // world, reported_means(report), grad_ok),
                 ref, failures)
    assert not failures, "\n".join(failures)


def test_sampling_replay_under_context_parallelism_equals_one_process():
    """Sampling replay (vLLM's rules and an engine's kept ids) with sequence-level IS / RS, diagnostics and the loss
    family under CP = 2 (packed, megatron's load-balanced halves): the loss, num_tokens, every reported metric (the
    sampling ones included) and the gradient of the logits equal the padded one-process call. Each rank replays its
    own positions; the tokens left outside the kept set leave every sequence statistic on every rank alike."""
    run_workers_preloaded(_cp_replay_worker, 2)
