"""Rollout correction over real processes: DP = 2 and 4, CP = 2, DP x CP = 2 x 2; gloo on the CPU (127.0.0.1) and
NCCL on GPUs (one per rank; the ``nccl`` variants skip with the reason where fewer are visible).

Every rank builds the same global batch, runs the single-process op on all of it (the reference) and the
distributed op on its own shard (a block of rows for DP; a zig-zag pair of chunks of every row for CP, as
megatron's load-balanced context parallelism splits sequences). Every metric must equal the single-process
value over the concatenated global batch (and the fp64 dense oracle), and each shard's weights and mask
the matching slice of the global ones. Ranks all-reduce a failure flag before raising, so none hangs.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from rollout_corr_testing.dist_utils import dist_params, run_workers, worker_device
from rollout_corr_testing.rc_testutil import PREFIX, TOL, compare_metrics, make_inputs
from rollout_corr_ext import RolloutCorrectionConfig as Cfg
from rollout_corr_ext import compute_offpolicy_metrics, compute_rollout_correction
from rollout_corr_testing.rollout_oracle import oracle_for_config

B, T = 24, 48
CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
         rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.7_1.3,0.02,0.05",
         rollout_token_veto_threshold=0.6),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
         rollout_rs="seq_sum_k1,token_k2,sequence", rollout_rs_threshold="0.3_3.0,0.02,0.2_5.0"),
    dict(rollout_is="geometric", rollout_is_threshold=1.05, rollout_is_mode="mask",
         rollout_rs="geometric,seq_sum_k3,token", rollout_rs_threshold="0.99_1.01,0.5,0.8_1.25"),
    dict(rollout_is=None, rollout_rs=None),
]


def _row_block(dp_rank: int, dp: int):
    """Uneven row blocks (DP ranks need not hold the same number of sequences)."""
    cuts = [0] + [round(B * (i + 1) / dp) + (1 if 0 < i + 1 < dp and i % 2 == 0 else 0) for i in range(dp)]
    cuts[-1] = B
    return slice(cuts[dp_rank], cuts[dp_rank + 1])


def _zigzag_cols(cp_rank: int, cp: int) -> torch.Tensor:
    chunk = T // (2 * cp)
    idx = torch.arange(T).view(2 * cp, chunk)
    return torch.cat([idx[cp_rank], idx[2 * cp - 1 - cp_rank]])


def _run_cases(rank: int, dp: int, cp: int) -> list:
    dev = worker_device()
    seq_group = None
    if cp > 1:
        groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(dp)]
        seq_group = groups[rank // cp]
    dp_group = dist.group.WORLD if dp > 1 else None  # dp=1, cp=2 exercises the default (seq_group)
    rows = _row_block(rank // cp, dp)
    cols = _zigzag_cols(rank % cp, cp) if cp > 1 else torch.arange(T)
    failures = []
    for i, case in enumerate(CASES):
        cfg = Cfg(**case)
        scale = 0.2 if case["rollout_is"] in ("token", None) else 0.05
        lp, rlp, mask = make_inputs(B, T, seed=100 + i, scale=scale, pad_rows=(2, 3, 4, 5, 6))
        _, _, dense = oracle_for_config(lp.double(), rlp.double(), mask, cfg)
        lp, rlp, mask = lp.to(dev), rlp.to(dev), mask.to(dev)
        ref = compute_rollout_correction(lp, rlp, mask, cfg)
        shard = lambda x: x[rows][:, cols].contiguous()  # noqa: E731
        res = compute_rollout_correction(shard(lp), shard(rlp), shard(mask), cfg, dp_group=dp_group,
                                         seq_group=seq_group)
        tag = f"rank {rank} dp={dp} cp={cp} case {i}"
        single = {k[len(PREFIX):]: v for k, v in ref.metrics.items()}
        failures += [f"{tag} vs single-process: {e}" for e in compare_metrics(res.metrics, single, torch.float32)]
        failures += [f"{tag} vs dense oracle: {e}" for e in compare_metrics(res.metrics, dense, torch.float32)]
        if not torch.equal(res.response_mask, shard(ref.response_mask)):
            failures.append(f"{tag}: mask differs from the global mask's slice")
        if (res.weights is None) != (ref.weights is None):
            failures.append(f"{tag}: weights presence differs")
        elif res.weights is not None and not torch.allclose(res.weights, shard(ref.weights), **TOL[torch.float32]):
            failures.append(f"{tag}: weights differ from the global weights' slice")
        off = compute_offpolicy_metrics(shard(lp), shard(rlp), shard(mask), dp_group=dp_group, seq_group=seq_group)
        want = {k[len(PREFIX):]: ref.metrics[k] for k in off}
        failures += [f"{tag} offpolicy: {e}" for e in compare_metrics(off, want, torch.float32)]
    return failures


def _worker(rank: int, world: int, dp: int, cp: int) -> None:
    """run_workers joins the group, reduces the failure flag (no rank hangs on a dead peer) and tears it down."""
    failures = _run_cases(rank, dp, cp)
    assert not failures, "\n".join(failures)


#: (dp, cp, device) for each layout on gloo and on NCCL (skipped with the reason without dp * cp GPUs).
LAYOUTS = [pytest.param(dp, cp, p.values[0], marks=p.marks, id=f"{name}-{p.id}")
           for (dp, cp), name in zip([(2, 1), (4, 1), (1, 2), (2, 2)], ["dp2", "dp4", "cp2", "dp2xcp2"])
           for p in dist_params(dp * cp)]


@pytest.mark.parametrize("dp,cp,device", LAYOUTS)
def test_distributed_equals_single_process(dp, cp, device):
    run_workers(_worker, dp * cp, dp, cp, device=device)


# ------------------------------------------------------------------ settings that differ between ranks (issue 8 §7)


_CFG_A = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.3")
#: rank r of a mismatch case uses MISMATCH[case][r % 2]: (config kwargs, nonfinite).
MISMATCH = {
    # a different number of RS criteria changed the size of the partial vectors: a gloo abort before the fix
    "criteria_count": [(_CFG_A, "error"),
                       (dict(_CFG_A, rollout_rs="token_k1,seq_mean_k3,geometric",
                             rollout_rs_threshold="0.7_1.3,0.02,0.99_1.01"), "error")],
    "rs_vs_none": [(_CFG_A, "error"), (dict(_CFG_A, rollout_rs=None, rollout_rs_threshold=None), "error")],
    # same sizes, different semantics: silently mixed partials before the fix
    "threshold": [(_CFG_A, "error"), (dict(_CFG_A, rollout_rs_threshold="0.7_1.31"), "error")],
    "is_level": [(_CFG_A, "error"), (dict(_CFG_A, rollout_is="sequence"), "error")],
    "batch_normalize": [(_CFG_A, "error"), (dict(_CFG_A, rollout_is_batch_normalize=True), "error")],
    "nonfinite": [(_CFG_A, "error"), (_CFG_A, "exclude")],
}


def _mismatch_worker(rank, world, case, odd_rank):
    lp, rlp, mask = make_inputs(B, T, seed=7, scale=0.2, pad_rows=(2,))  # gloo only: see MISMATCH_DEVICES
    rows = _row_block(rank, world)
    kwargs, nonfinite = MISMATCH[case][1 if rank == odd_rank else 0]
    shard = [x[rows] for x in (lp, rlp, mask)]
    with pytest.raises(ValueError, match=r"the ranks of dp_group pass different rollout-correction settings"):
        compute_rollout_correction(*shard, Cfg(**kwargs), dp_group=dist.group.WORLD, nonfinite=nonfinite)
    # The group is still usable, and agreeing ranks get the single-process result.
    cfg = Cfg(**MISMATCH[case][0][0])
    res = compute_rollout_correction(*shard, cfg, dp_group=dist.group.WORLD)
    ref = compute_rollout_correction(lp, rlp, mask, cfg)
    errors = compare_metrics(res.metrics, {k[len(PREFIX):]: v for k, v in ref.metrics.items()}, torch.float32)
    assert not errors, errors
    assert torch.equal(res.response_mask, ref.response_mask[rows])
    torch.testing.assert_close(res.weights, ref.weights[rows], **TOL[torch.float32])


#: The config check over dp_group is a ValueError on every rank for CPU tensors; on CUDA it is an asynchronous device
#: assert (no host sync), which would poison the NCCL workers' contexts: tests/test_cuda.py asserts it in a subprocess
#: (rollout_check with agree=False, what the reduce hands it).
MISMATCH_CUDA = "a config mismatch over dp_group is an asynchronous device assert on CUDA (tests/test_cuda.py)"


@pytest.mark.parametrize("device", dist_params(2, cuda_reason=MISMATCH_CUDA))
@pytest.mark.parametrize("case", sorted(MISMATCH))
def test_dp_ranks_with_different_configs_raise_on_every_rank(case, device):
    run_workers(_mismatch_worker, 2, case, 1, device=device)


@pytest.mark.parametrize("device", dist_params(3, cuda_reason=MISMATCH_CUDA))
def test_dp_one_rank_of_three_differs_every_rank_raises(device):
    run_workers(_mismatch_worker, 3, "criteria_count", 2, device=device)


def _uneven_rows_worker(rank, world):
    """Different (and empty) row counts on DP ranks are legal: every metric is the single-process value."""
    lp, rlp, mask = (x.to(worker_device()) for x in make_inputs(B, T, seed=8, scale=0.2, pad_rows=(4,)))
    cuts = [0, 0, 5, B][: world + 1] if world == 3 else [0, 17, B]
    rows = slice(cuts[rank], cuts[rank + 1])
    cfg = Cfg(**MISMATCH["criteria_count"][1][0])
    res = compute_rollout_correction(lp[rows], rlp[rows], mask[rows], cfg, dp_group=dist.group.WORLD)
    ref = compute_rollout_correction(lp, rlp, mask, cfg)
    errors = compare_metrics(res.metrics, {k[len(PREFIX):]: v for k, v in ref.metrics.items()}, torch.float32)
    assert not errors, errors
    assert torch.equal(res.response_mask, ref.response_mask[rows])
    torch.testing.assert_close(res.weights, ref.weights[rows], **TOL[torch.float32])


@pytest.mark.parametrize("world,device", [pytest.param(w, p.values[0], marks=p.marks, id=f"{w}-{p.id}")
                                          for w in (2, 3) for p in dist_params(w)])
def test_dp_uneven_row_counts_still_equal_single_process(world, device):
    run_workers(_uneven_rows_worker, world, device=device)


def _cp_rows_worker(rank, world):
    """The row-count check of seq_group is read on the host (one 16-byte all-reduce): a ValueError on every rank on
    gloo and NCCL alike."""
    lp, rlp, mask = (x.to(worker_device()) for x in make_inputs(B, T, seed=9, scale=0.2))
    cols = _zigzag_cols(rank, world)
    cfg = Cfg(**_CFG_A)
    rows = slice(0, B - 1) if rank == 1 else slice(0, B)  # rank 1 lost a sequence
    with pytest.raises(ValueError, match=r"seq_group \(context parallelism\): the ranks hold different numbers of "
                                         rf"rows \(between {B - 1} and {B}; this rank {B - rank}\)"):
        compute_rollout_correction(lp[rows][:, cols], rlp[rows][:, cols], mask[rows][:, cols], cfg,
                                   seq_group=dist.group.WORLD)
    res = compute_rollout_correction(lp[:, cols], rlp[:, cols], mask[:, cols], cfg, seq_group=dist.group.WORLD)
    ref = compute_rollout_correction(lp, rlp, mask, cfg)
    errors = compare_metrics(res.metrics, {k[len(PREFIX):]: v for k, v in ref.metrics.items()}, torch.float32)
    assert not errors, errors


@pytest.mark.parametrize("device", dist_params(2))
def test_cp_ranks_with_different_row_counts_raise_on_every_rank(device):
    run_workers(_cp_rows_worker, 2, device=device)
