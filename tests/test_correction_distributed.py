"""Rollout correction over real processes (gloo, 127.0.0.1): DP = 2 and 4, CP = 2, DP x CP = 2 x 2.

Every rank builds the same global batch, runs the single-process op on all of it (the reference) and the
distributed op on its own shard (a block of rows for DP; a zig-zag pair of chunks of every row for CP, as
megatron's load-balanced context parallelism splits sequences). Every metric must equal the single-process
value over the concatenated global batch (and the fp64 dense oracle), and each shard's weights and mask
the matching slice of the global ones. Ranks all-reduce a failure flag before raising, so none hangs.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_corr_testing.rc_testutil import PREFIX, TOL, compare_metrics, make_inputs
from rollout_corr_ext import RolloutCorrectionConfig as Cfg
from rollout_corr_ext import compute_offpolicy_metrics, compute_rollout_correction
from rollout_corr_ext import reference as R

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        ref = compute_rollout_correction(lp, rlp, mask, cfg)
        _, _, dense = R.rollout_correction_dense(lp.double(), rlp.double(), mask, cfg)
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


def _worker(rank: int, world: int, port: int, dp: int, cp: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        try:
            failures = _run_cases(rank, dp, cp)
        except Exception:  # a crash is a failure too, but the flag must still be reduced
            failures = [f"rank {rank} raised:\n{traceback.format_exc()}"]
        flag = torch.tensor([1.0 if failures else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            raise AssertionError("\n".join(failures) or f"rank {rank}: another rank failed")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dp,cp", [(2, 1), (4, 1), (1, 2), (2, 2)], ids=["dp2", "dp4", "cp2", "dp2xcp2"])
def test_distributed_equals_single_process(dp, cp):
    world = dp * cp
    mp.spawn(_worker, args=(world, _free_port(), dp, cp), nprocs=world, join=True)
