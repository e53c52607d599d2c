"""Context parallelism in :func:`rollout_corr_ext.megatron.make_policy_loss_func` (issue 8 §7), gloo on CPU and
NCCL on 4 GPUs.

Four spawned workers (one fork server preloads megatron-core) run three layouts: TP=2 CP=2 DP=1 and TP=1 CP=2
DP=2 with megatron-core's ``parallel_state`` and **default groups**, and TP=1 CP=2 DP=1 (two independent pairs)
without parallel_state, groups given as a megatron ``ProcessGroupCollection`` or as an explicit ``seq_group``.
Each rank takes megatron's load-balanced share of every sequence (``2 * cp`` chunks, rank r holds chunks r and
2cp-1-r: ``rollout_corr_testing.dist_utils.cp_token_index``), its DP rows and its TP vocab shard of one global
batch of logits. Against the single-process ``loss_func`` on the whole batch (computed in the same worker before
any group exists): sum over DP x CP of ``loss_sum`` / sum of ``num_tokens`` (megatron with
``calculate_per_token_loss=True``) and, at DP=1, the mean of the ranks' ``loss_sum / num_tokens`` (without it);
every reported metric; the gradient w.r.t. each rank's logits shard. The rollout-correction configs have
sequence-level IS and sequence-level RS, so a sequence's statistics need all its CP pieces; each case checks
that RS rejected some sequences and kept others. Group combinations that would be silently wrong under CP
must raise. Multi-token prediction heads (``output_layer=`` megatron's ``ColumnParallelLinear``, ``mtp_num_layers``
1 and 2) run at CP = 2, padded and packed, against one process and megatron's own CP ``roll_tensor``.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist

from rollout_corr_testing.dist_utils import cp_token_index, dist_params, run_workers_preloaded, worker_device

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

VOCAB, ROWS, T = 24, 4, 16  # ROWS sequences per DP rank; T divisible by 2 * cp


def _config(preset: str):
    from rollout_corr_ext.config import RolloutCorrectionConfig

    if preset == "seq_is_rs":  # decoupled: sequence TIS + seq_sum_k1 rejection
        return RolloutCorrectionConfig.decoupled_seq_is_rs(is_threshold=1.5, rs_threshold="0.4_2.5")
    if preset == "bypass_geo_rs":  # bypass PPO-clip against pi_rollout + seq_mean_k1 rejection
        return RolloutCorrectionConfig.bypass_ppo_clip_geo_rs(rs_threshold="0.9_1.1")
    if preset == "bypass_pg_seq_is":  # REINFORCE with sequence IS, plus seq_max_k2 rejection
        return RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_max_k2",
                                       rollout_rs_threshold=0.5, bypass_mode=True, loss_type="reinforce")
    raise AssertionError(preset)


CASES = [
    # loss_agg_mode, rollout-correction preset, entropy_coeff, loss_scale_factor
    ("token-mean", "seq_is_rs", 0.0, None),
    ("seq-mean-token-mean", "seq_is_rs", 0.01, None),
    ("seq-mean-token-sum-norm", "bypass_geo_rs", 0.0, None),  # None: divides by the padded length T (all of it)
    ("seq-mean-token-sum", "bypass_pg_seq_is", 0.0, None),
]


def _global_batch(n_rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(T, n_rows, VOCAB, generator=g)  # [s, b, V], the output layer's layout
    target = torch.randint(0, VOCAB, (n_rows, T), generator=g)
    mask = torch.zeros(n_rows, T, dtype=torch.bool)
    for b in range(n_rows):
        start = 2 + (3 * b) % 5
        end = T - (2 * b) % 4
        mask[b, start:end] = True
    mask[1, :] = False  # a sequence without response tokens: counts for no mode
    mask[2, 4:] = False  # response only in the first chunk: CP rank 1 holds none of it
    adv = torch.randn(n_rows, generator=g, dtype=torch.float64).float()
    lp = torch.log_softmax(logits.double(), -1).gather(-1, target.t().unsqueeze(-1)).squeeze(-1).t()
    scale = torch.linspace(0.05, 0.7, n_rows, dtype=torch.float64)[torch.randperm(n_rows, generator=g)]
    old = (lp + 0.1 * torch.randn(n_rows, T, generator=g, dtype=torch.float64)).float()
    rollout = (lp + scale.view(-1, 1) * torch.randn(n_rows, T, generator=g, dtype=torch.float64)).float()
    return logits, target, mask, adv, old, rollout


def _loss_func(batch, mode, preset, ent, lsf, **groups):
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    _, target, mask, adv, old, rollout = batch
    rc = _config(preset)
    cfg = PolicyLossConfig(clip_ratio=0.2, rollout_correction=rc, loss_scale_factor=lsf)
    return make_policy_loss_func(target, adv, mask, old_log_prob=None if rc.bypass_mode else old,
                                 rollout_log_prob=rollout, config=cfg, loss_agg_mode=mode, entropy_coeff=ent,
                                 **groups)


def _single_process(batch, case):
    """The whole batch on this process alone (parallel_state not initialised: no group anywhere)."""
    from rollout_corr_ext.megatron import reported_means

    logits = batch[0].clone().requires_grad_(True)
    loss_sum, num_tokens, report = _loss_func(batch, *case)(logits)
    value = loss_sum / num_tokens.clamp(min=1)
    value.backward()
    return {"value": value.detach().double(), "count": int(num_tokens), "metrics": reported_means(report),
            "grad": logits.grad.double()}


def _shard(batch, rows, seq_idx, vocab_slice):
    logits, target, mask, adv, old, rollout = batch
    local = logits[seq_idx][:, rows][..., vocab_slice].clone().requires_grad_(True)
    cut = [t[rows][:, seq_idx] for t in (target, mask)]
    return local, (None, cut[0], cut[1], adv[rows], old[rows][:, seq_idx], rollout[rows][:, seq_idx])


def _check_metrics(name, means, want, failures):
    """Every reported metric mean (megatron's reduction of the pairs) against the single process's."""
    if set(means) != set(want):
        failures.append(f"{name}: metric names differ: {sorted(set(means) ^ set(want))}")
    for k in sorted(set(means) & set(want)):
        a, b = means[k], want[k]
        if not abs(a - b) <= 1e-4 * abs(b) + 1e-6:
            failures.append(f"{name}: metric {k} = {a:.8g}, single process {b:.8g}")


def _check_case(case, batch, ref, coords, dp_cp, cp_group, failures, **groups):
    """Run ``case`` on this rank's shard with ``groups`` (none: megatron defaults); compare with ``ref``."""
    from rollout_corr_ext.megatron import reported_means

    rows, seq_idx, vocab_slice = coords
    dp_size = dist.get_world_size(dp_cp) // dist.get_world_size(cp_group)
    name = f"{case[0]}/{case[1]}" + (f" ({', '.join(groups)})" if groups else "")
    local, local_batch = _shard(batch, rows, seq_idx, vocab_slice)
    loss_sum, num_tokens, report = _loss_func(local_batch, *case, **groups)(local)
    cp = dist.get_world_size(cp_group)
    totals = torch.stack([loss_sum.detach().double(), num_tokens.double()])
    dist.all_reduce(totals, group=dp_cp)  # calculate_per_token_loss=True: schedule + finalize_model_grads sums
    if int(totals[1]) != cp * ref["count"] or (dp_size == 1 and int(num_tokens) != ref["count"]):
        failures.append(f"{name}: num_tokens {int(num_tokens)}, summed over DP x CP {int(totals[1])}; single "
                        f"process {ref['count']} (every CP rank reports its DP rank's count)")
    got = totals[0] / totals[1].clamp(min=1)
    if not torch.allclose(got, ref["value"], rtol=1e-5, atol=1e-6):
        failures.append(f"{name}: loss {got.item():.8g} != single process {ref['value'].item():.8g}")
    if dp_size == 1:  # calculate_per_token_loss=False: megatron averages loss_sum / num_tokens over the ranks
        per_rank = (loss_sum.detach().double() / num_tokens.clamp(min=1)).reshape(1)
        dist.all_reduce(per_rank, group=dp_cp)
        if not torch.allclose(per_rank[0] / cp, ref["value"], rtol=1e-5, atol=1e-6):
            failures.append(f"{name}: mean of per-rank loss_sum / num_tokens {per_rank.item() / cp:.8g} != "
                            f"single process {ref['value'].item():.8g}")
    _check_metrics(name, reported_means(report), ref["metrics"], failures)
    (loss_sum / totals[1].clamp(min=1).to(loss_sum.dtype)).backward()
    want = ref["grad"][seq_idx][:, rows][..., vocab_slice]
    if local.grad is None or not torch.allclose(local.grad.double(), want, rtol=1e-4, atol=1e-7):
        err = None if local.grad is None else (local.grad.double() - want).abs().max().item()
        failures.append(f"{name}: gradient of the logits shard differs from the single-process slice (max {err})")


def _references(n_rows: int, seed: int, failures):
    batch = tuple(t.to(worker_device()) for t in _global_batch(n_rows, seed))  # gloo: CPU; NCCL: this rank's GPU
    refs = [_single_process(batch, case) for case in CASES]
    for case, ref in zip(CASES, refs):  # the cases test what they claim: RS rejects some sequences, not all
        rejected = ref["metrics"].get("rollout_corr/rollout_rs_seq_masked_fraction")
        if case[0] != "token-mean" and not 0 < ref["count"] < n_rows - 1:
            failures.append(f"{case}: RS kept {ref['count']} of {n_rows - 1} sequences; retune the batch")
        if rejected is not None and not 0 < rejected < 1:
            failures.append(f"{case}: rollout_rs_seq_masked_fraction {rejected}; retune the batch")
    return batch, refs


def _parallel_state_layout(tp: int, cp: int, seed: int, failures):
    """megatron-core parallel_state with CP: default groups only."""
    from megatron.core import parallel_state as ps

    dp = dist.get_world_size() // (tp * cp)
    batch, refs = _references(ROWS * dp, seed, failures)  # before parallel_state exists: single-process values
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        assert ps.get_context_parallel_world_size() == cp and ps.get_data_parallel_world_size() == dp
        tp_rank, cp_rank, dp_rank = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                                     ps.get_data_parallel_rank())
        v = VOCAB // tp
        coords = (torch.arange(dp_rank * ROWS, (dp_rank + 1) * ROWS), cp_token_index(T, cp, cp_rank),
                  slice(tp_rank * v, (tp_rank + 1) * v))
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        for case, ref in zip(CASES, refs):
            _check_case(case, batch, ref, coords, dp_cp, ps.get_context_parallel_group(), failures)
        _expect_group_error("explicit dp_group without CP (parallel_state defaults for the rest)", batch,
                            dict(dp_group=ps.get_data_parallel_group()), failures)
        # a pg_collection that leaves out .cp while parallel_state has CP (the 0.19.2 fuzz: accepted, and every
        # sequence-level value computed on half-sequences): refused, whatever data-parallel group it carries
        from megatron.core.process_groups_config import ProcessGroupCollection

        tp_g = ps.get_tensor_model_parallel_group()
        for what, dp_g in (("dp", ps.get_data_parallel_group()),
                           ("dp_cp", ps.get_data_parallel_group(with_context_parallel=True))):
            _expect_group_error(f"pg_collection(tp, {what}) without .cp while parallel_state has CP", batch,
                                dict(pg_collection=ProcessGroupCollection(tp=tp_g, **{what: dp_g})), failures)
    finally:
        ps.destroy_model_parallel()


def _pg_collection_layout(seed: int, failures):
    """TP=1 CP=2 DP=1 without parallel_state: ranks {0, 1} and {2, 3} are two independent CP pairs, groups
    passed as a megatron ProcessGroupCollection."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    batch, refs = _references(ROWS, seed, failures)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    pair, single = pairs[rank // 2], singles[rank]
    pgc = ProcessGroupCollection(tp=single, cp=pair, dp=single, dp_cp=pair)
    coords = (torch.arange(ROWS), cp_token_index(T, 2, rank % 2), slice(0, VOCAB))
    for case, ref in zip(CASES, refs):
        _check_case(case, batch, ref, coords, pair, pair, failures, pg_collection=pgc)
    # megatron-core >= 0.19 answers None for every group a ProcessGroupCollection was not given: None is absent
    ns = types.SimpleNamespace
    _check_case(CASES[1], batch, refs[1], coords, pair, pair, failures,
                pg_collection=ns(tp=single, cp=pair, dp=single, dp_cp=pair, dp_cp_gtp_remat=None, gtp_remat=None))
    # DP=1: the CP group alone, passed explicitly, is also the group the metrics are reduced over
    _check_case(CASES[1], batch, refs[1], coords, pair, pair, failures, seq_group=pair)
    bad = {
        "explicit dp_group without CP next to pg_collection.cp": dict(dp_group=single, pg_collection=pgc),
        "pg_collection without .dp_cp under CP": dict(pg_collection=ProcessGroupCollection(tp=single, cp=pair,
                                                                                           dp=single)),
        "pg_collection without .cp under CP": dict(pg_collection=ProcessGroupCollection(tp=single, dp=single,
                                                                                        dp_cp=pair)),
        "pg_collection.dp_cp without the CP ranks": dict(pg_collection=ProcessGroupCollection(
            tp=single, cp=pair, dp=single, dp_cp=single)),
        # the 0.19 form of "without .dp_cp", on every megatron-core release
        "pg_collection.dp_cp = None under CP": dict(pg_collection=ns(tp=single, cp=pair, dp=single, dp_cp=None)),
        "pg_collection.cp = None under CP": dict(pg_collection=ns(tp=single, cp=None, dp=single, dp_cp=pair)),
    }
    for what, groups in bad.items():
        _expect_group_error(what, batch, groups, failures)


def _expect_group_error(what, batch, groups, failures):
    """Group combinations that would silently give per-rank values of half-sequences are clear errors."""
    try:
        _loss_func(batch, *CASES[1], **groups)
    except ValueError as e:
        if not any(word in str(e) for word in ("dp_cp", "with context parallelism", "seq_group")):
            failures.append(f"{what}: the error does not say which group is wrong: {e}")
    else:
        failures.append(f"{what}: accepted (the loss would be silently wrong under CP)")


def _worker(rank, world):
    warnings.filterwarnings("ignore")
    failures = []
    _parallel_state_layout(2, 2, 12, failures)  # TP=2 CP=2 DP=1
    _parallel_state_layout(1, 2, 13, failures)  # TP=1 CP=2 DP=2
    _pg_collection_layout(11, failures)  # TP=1 CP=2 DP=1, ProcessGroupCollection, no parallel_state
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", dist_params(4))
def test_loss_func_context_parallel(device):
    """gloo on the CPU; NCCL with one GPU per rank (skipped with the reason where fewer than 4 are visible)."""
    run_workers_preloaded(_worker, 4, device=device)


# ------------------------------------------------------------------------------ multi-token prediction under CP

HIDDEN = 8
MTP_LENGTHS = [16, 8, 12, 4]  # packed: padded lengths, multiples of 2 * cp = 4; chunk 1 < L = 2 in the last one


def _mtp_batch(n_rows: int, n_layers: int, packed: bool, seed: int):
    """One global micro-batch for make_policy_loss_func(output_layer=..., mtp_num_layers=n_layers): the main and MTP
    heads' hidden states ``[1 + L, s, b, H]`` (packed: ``[1 + L, T, 1, H]``), the output layer's weight and bias,
    and target / mask / advantages / pi_old / pi_rollout ``[b, s]`` (packed: the stream ``[T]``, advantages per
    sequence). Responses run across the CP chunk boundaries, so every head's shifted targets need the other rank's
    tokens, and the two CP ranks hold different numbers of them."""
    g = torch.Generator().manual_seed(seed)
    lengths = [MTP_LENGTHS[i % len(MTP_LENGTHS)] for i in range(n_rows)] if packed else [T] * n_rows
    n_tok = sum(lengths)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    bias = 0.5 * torch.randn(VOCAB, generator=g)
    hidden = torch.randn(1 + n_layers, n_tok, HIDDEN, generator=g)  # the tokens in row-major [b, s] / stream order
    target = torch.randint(0, VOCAB, (n_tok,), generator=g)
    mask = torch.zeros(n_tok, dtype=torch.bool)
    at = 0
    for b, n in enumerate(lengths):
        # some sequences are response from their first position: a shift past a sequence's end must not read it
        mask[at + b % 3: at + n - (b % 2)] = torch.rand(n - b % 3 - b % 2, generator=g) > 0.15
        at += n
    adv = torch.randn(n_rows, generator=g, dtype=torch.float64).float()
    logp = torch.log_softmax(hidden[0].double() @ weight.double().t() + bias.double(), -1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    noise = torch.linspace(0.05, 0.7, n_rows, dtype=torch.float64)[torch.randperm(n_rows, generator=g)]
    old = (lp + 0.1 * torch.randn(n_tok, generator=g, dtype=torch.float64)).float()
    rollout = (lp + torch.repeat_interleave(noise, torch.tensor(lengths)) *
               torch.randn(n_tok, generator=g, dtype=torch.float64)).float()
    cu = torch.tensor([0] + lengths).cumsum(0)
    if not packed:  # [b, s] batch tensors, hidden states [1 + L, s, b, H]
        target, mask, old, rollout = (t.reshape(n_rows, T) for t in (target, mask, old, rollout))
        hidden = hidden.reshape(1 + n_layers, n_rows, T, HIDDEN).transpose(1, 2)
    else:
        hidden = hidden.unsqueeze(2)
    return dict(hidden=hidden, weight=weight, bias=bias, batch=(None, target, mask, adv, old, rollout), cu=cu,
                lengths=lengths)


class _Layer:
    """What make_policy_loss_func reads from the output layer, for the single-process reference."""

    def __init__(self, weight, bias):
        self.weight, self.bias, self.sequence_parallel, self.skip_bias_add = weight, bias, False, False


def _mtp_kwargs(data, n_layers, packed):
    kw = dict(mtp_num_layers=n_layers, mtp_loss_scaling_factor=0.3)
    if packed:  # megatron's cu_seqlens_q(_padded): the whole sequences (the loss divides by the CP size)
        cu = data["cu"]
        kw["packed_seq_params"] = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=cu, qkv_format="thd")
    return kw


def _mtp_single_process(data, case, n_layers, packed):
    from rollout_corr_ext.megatron import reported_means

    h = data["hidden"].reshape(-1, *data["hidden"].shape[2:]).clone().requires_grad_(True)
    w, b = data["weight"].clone().requires_grad_(True), data["bias"].clone().requires_grad_(True)
    loss_sum, num_tokens, report = _loss_func(data["batch"], *case, output_layer=_Layer(w, b),
                                              **_mtp_kwargs(data, n_layers, packed))(h)
    value = loss_sum / num_tokens.clamp(min=1)
    value.backward()
    return {"value": value.detach().double(), "count": int(num_tokens), "metrics": reported_means(report),
            "grad_h": h.grad.double().reshape(data["hidden"].shape), "grad_w": w.grad.double(),
            "grad_b": b.grad.double()}


def _mtp_shard(data, n_layers, packed, cp_rank, cp, tp_rank, tp, sp):
    """This rank's part: its CP share of every sequence (megatron's load-balanced chunks; packed: of each sequence,
    with megatron's cu_seqlens_q_padded of the whole sequences), its TP vocabulary shard; with sequence parallelism
    its 1 / tp of every head's rows. Returns the local hidden states, batch, megatron kwargs, and the index of its
    hidden rows (positions, batch rows) in the global ``[1 + L, s, b, H]``."""
    _, target, mask, adv, old, rollout = data["batch"]
    heads = data["hidden"]
    kw = _mtp_kwargs(data, n_layers, packed)
    if packed:
        cu, lengths = data["cu"], data["lengths"]
        tok = torch.cat([cu[i] + cp_token_index(n, cp, cp_rank) for i, n in enumerate(lengths)])
        local_batch = (None, target[tok], mask[tok], adv, old[tok], rollout[tok])
        pick = (tok, torch.zeros(1, dtype=torch.long))
    else:
        seq_idx = cp_token_index(T, cp, cp_rank)
        local_batch = (None, target[:, seq_idx], mask[:, seq_idx], adv, old[:, seq_idx], rollout[:, seq_idx])
        pick = (seq_idx, torch.arange(adv.shape[0]))
    pos = pick[0]
    if sp:  # each head's rows split over TP (megatron's SP MTP block hands on [(1 + L) * s / tp, b, H])
        piece = pos.shape[0] // tp
        pos = pos[tp_rank * piece: (tp_rank + 1) * piece]
    local = heads[:, pos][:, :, pick[1]]
    return local.reshape(-1, *local.shape[2:]), local_batch, kw, (pos, pick[1])


def _check_megatron_roll(local_batch, n_layers, packed, kw, cp_group, failures, name):
    """Our shifted targets and weights (what the loss scores) equal megatron-core's own ``roll_tensor`` with the CP
    group, applied k times to the labels and loss mask, at this rank's positions (its rolled-in positions: weight
    0)."""
    from unittest import mock

    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from rollout_corr_ext.megatron import _mtp_shifted_cp

    _, target, mask, *_ = local_batch
    cu = kw["packed_seq_params"].cu_seqlens_q // dist.get_world_size(cp_group) if packed else None
    ours = _mtp_shifted_cp(target, mask, n_layers, cu, cp_group)
    labels = target.reshape(1, -1) if packed else target
    lmask = (mask.reshape(1, -1) if packed else mask).float()
    psp = kw.get("packed_seq_params")
    device = labels.device
    # megatron's padded CP roll allocates its receive buffers on torch.cuda.current_device(): the CPU here
    with mock.patch.object(torch.cuda, "current_device", lambda: device):
        for k, (tgt_k, m_k) in enumerate(ours, 1):
            labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=psp)
            lmask, _ = roll_tensor(lmask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=psp)
            m_k, tgt_k = m_k.reshape(lmask.shape), tgt_k.reshape(labels.shape)
            if not torch.equal(m_k.float(), lmask) or not torch.equal(tgt_k[m_k], labels[m_k]):
                failures.append(f"{name}: head {k}'s shifted targets / weights differ from megatron's roll_tensor "
                                f"with the CP group")


def _mtp_case(data, case, n_layers, packed, ref, tp_group, cp_group, sp, failures, **groups):
    """One MTP case on this rank with megatron's ColumnParallelLinear output layer; ``groups`` go to
    make_policy_loss_func (none: parallel_state's). DP = 1: the CP group is the group the batch is split over."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from rollout_corr_ext.megatron import reported_means
    from rollout_corr_testing.dist_utils import CollectiveCounter

    tp, cp = dist.get_world_size(tp_group), dist.get_world_size(cp_group)
    tp_rank, cp_rank = dist.get_rank(tp_group), dist.get_rank(cp_group)
    name = (f"mtp L={n_layers} {'packed' if packed else 'padded'} tp={tp} cp={cp}{' sp' if sp else ''}"
            f"{' (' + ', '.join(groups) + ')' if groups else ''}")
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                 gather_output=False, tp_group=tp_group).to(worker_device())
    v = VOCAB // tp
    vocab = slice(tp_rank * v, (tp_rank + 1) * v)
    with torch.no_grad():
        layer.weight.copy_(data["weight"][vocab])
        layer.bias.copy_(data["bias"][vocab])
    local, local_batch, kw, (pos, rows) = _mtp_shard(data, n_layers, packed, cp_rank, cp, tp_rank, tp, sp)
    _check_megatron_roll(local_batch, n_layers, packed, kw, cp_group, failures, name)
    local = local.clone().requires_grad_(True)
    loss_func = _loss_func(local_batch, *case, output_layer=layer, **kw, **groups)
    with CollectiveCounter() as first:
        loss_sum, num_tokens, report = loss_func(local)
    with CollectiveCounter() as again:
        loss_func(local.detach())
    extra = list(first.calls)
    for call in again.calls:
        extra.remove(call)
    if sorted(c.split("_")[1] for c in extra) != ["gather", "reduce"]:
        failures.append(f"{name}: the first call's collectives beyond a later call's are {extra}, not the check of "
                        f"the pieces' lengths (all-reduce) and the all-gather of the chunks' first tokens")
    if int(num_tokens) != ref["count"]:
        failures.append(f"{name}: num_tokens {int(num_tokens)}, single process {ref['count']}")
    totals = torch.stack([loss_sum.detach().double(), num_tokens.double()])
    dist.all_reduce(totals, group=cp_group)  # calculate_per_token_loss=True: megatron sums over DP x CP
    got = totals[0] / totals[1].clamp(min=1)
    if not torch.allclose(got, ref["value"], rtol=1e-5, atol=1e-6):
        failures.append(f"{name}: loss {got.item():.8g} != single process {ref['value'].item():.8g}")
    per_rank = (loss_sum.detach().double() / num_tokens.clamp(min=1)).reshape(1)
    dist.all_reduce(per_rank, group=cp_group)  # otherwise megatron averages loss_sum / num_tokens over the ranks
    if not torch.allclose(per_rank[0] / cp, ref["value"], rtol=1e-5, atol=1e-6):
        failures.append(f"{name}: mean of per-rank loss_sum / num_tokens {per_rank.item() / cp:.8g} != "
                        f"single process {ref['value'].item():.8g}")
    means = reported_means(report)
    if f"actor/mtp_{n_layers}_loss" not in means:
        failures.append(f"{name}: no actor/mtp_{n_layers}_loss among {sorted(means)}")
    _check_metrics(name, means, ref["metrics"], failures)
    (loss_sum / totals[1].clamp(min=1).to(loss_sum.dtype)).backward()
    want_h = ref["grad_h"][:, pos][:, :, rows].reshape(local.shape)
    if local.grad is None or not torch.allclose(local.grad.double(), want_h, rtol=1e-4, atol=1e-6):
        err = None if local.grad is None else (local.grad.double() - want_h).abs().max().item()
        failures.append(f"{name}: gradient of this rank's hidden states differs from one process (max {err})")
    for what, param, want in (("weight", layer.weight, ref["grad_w"]), ("bias", layer.bias, ref["grad_b"])):
        grad = param.grad.double().clone()  # megatron's finalize_model_grads sums it over DP x CP
        dist.all_reduce(grad, group=cp_group)
        if not torch.allclose(grad, want[vocab], rtol=1e-4, atol=1e-6):
            failures.append(f"{name}: gradient of the output layer's {what} shard differs from one process (max "
                            f"{(grad - want[vocab]).abs().max().item()})")


MTP_CASES = [(1, CASES[0]), (2, CASES[1])]  # (mtp_num_layers, the main loss's case)


def _mtp_references(seed: int):
    """Every (data, case, L, packed, single-process reference), computed before any group exists."""
    work = []
    for packed in (False, True):
        for n_layers, case in MTP_CASES:
            data = _mtp_batch(ROWS, n_layers, packed, seed + n_layers + 10 * packed)
            data = {k: (v.to(worker_device()) if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
            data["batch"] = tuple(None if t is None else t.to(worker_device()) for t in data["batch"])
            work.append((data, case, n_layers, packed, _mtp_single_process(data, case, n_layers, packed)))
    return work


def _mtp_worker(rank, world):
    """TP=2 CP=2 with parallel_state's default groups (with and without sequence parallelism), then TP=1 CP=2 as two
    independent pairs with a ProcessGroupCollection. DP = 1 in both: a micro-batch's MTP mean is per micro-batch (as
    megatron's), so a DP split changes the value; the reference is the whole micro-batch on one process."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    warnings.filterwarnings("ignore")
    failures = []
    work = _mtp_references(21)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    try:
        for data, case, n_layers, packed, ref in work:
            for sp in (False, True):
                _mtp_case(data, case, n_layers, packed, ref, ps.get_tensor_model_parallel_group(),
                          ps.get_context_parallel_group(), sp, failures)
    finally:
        ps.destroy_model_parallel()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    singles = [dist.new_group([r]) for r in range(world)]
    pair, single = pairs[rank // 2], singles[rank]
    pgc = ProcessGroupCollection(tp=single, cp=pair, dp=single, dp_cp=pair)
    for data, case, n_layers, packed, ref in _mtp_references(23):
        _mtp_case(data, case, n_layers, packed, ref, single, pair, False, failures, pg_collection=pgc)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", dist_params(4))
def test_mtp_heads_under_context_parallelism(device):
    """mtp_num_layers = 1 and 2 with megatron's ColumnParallelLinear output layer at CP = 2 (padded with megatron's
    load-balanced chunks, and packed THD), TP = 2 (with and without SP) and DP = 2: the shifted targets equal
    megatron's own roll_tensor with the CP group; the loss after megatron's reductions, every metric (each head's
    actor/mtp_{k}_loss included), the gradients of each rank's hidden states and of the output layer's weight and
    bias equal one process's; the first call adds exactly two collectives, the check of the pieces' lengths (an
    all-reduce of 8 numbers) and the all-gather of the chunks' first tokens."""
    run_workers_preloaded(_mtp_worker, 4, device=device)


def _mtp_lengths_worker(rank, world):
    from rollout_corr_ext.megatron import make_policy_loss_func

    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    b, hidden, n_layers = 2, 8, 2
    weight = torch.randn(VOCAB, hidden, generator=g)
    errors = []
    for lengths, what in (((4, 6), "different lengths"), ((4, 5), "two equal chunks"), ((6, 6), None)):
        n = lengths[rank]
        target = torch.randint(0, VOCAB, (b, n), generator=g)
        try:
            loss_func = make_policy_loss_func(target, torch.randn(b, generator=g), torch.ones(b, n, dtype=torch.bool),
                                              output_layer=_Layer(weight, None), mtp_num_layers=n_layers, dp_group=group,
                                              seq_group=group)
            loss_func(torch.randn((1 + n_layers) * n, b, hidden, generator=g))
            if what is not None:
                errors.append(f"rank {rank}: local lengths {lengths}: no error")
        except ValueError as e:
            if what is None or what not in str(e):
                errors.append(f"rank {rank}: local lengths {lengths}: {e}")
    assert not errors, "\n".join(errors)


def test_mtp_pieces_of_other_lengths_are_refused_on_every_rank():
    """CP = 2 with MTP heads: pieces of different lengths on the two ranks (no load-balanced split gives them) were
    rolled as if equal, without an error (the megatron fuzz), and a piece of odd length was refused by its own rank
    alone while the other waited in the gather; both raise on every rank now (the loss's first call checks them)."""
    run_workers_preloaded(_mtp_lengths_worker, 2)
