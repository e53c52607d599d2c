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
must raise.
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
    means = reported_means(report)
    if set(means) != set(ref["metrics"]):
        failures.append(f"{name}: metric names differ: {sorted(set(means) ^ set(ref['metrics']))}")
    for k in sorted(set(means) & set(ref["metrics"])):
        a, b = means[k], ref["metrics"][k]
        if not abs(a - b) <= 1e-4 * abs(b) + 1e-6:
            failures.append(f"{name}: metric {k} = {a:.8g}, single process {b:.8g}")
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
