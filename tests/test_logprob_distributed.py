"""Vocab-parallel log-probs at TP = 1, 2, 4 against the single-process fp64 oracle: spawned gloo workers on the CPU,
and NCCL workers on GPUs (one per rank; the ``nccl`` variants skip with the reason where fewer are visible)."""

import functools

import pytest
import torch

from rollout_corr_testing.logprob_oracle import log_probs_dense
import torch.distributed as dist

import rollout_corr_ext as rc
from rollout_corr_testing.dist_utils import CollectiveCounter, dist_params, run_workers, worker_device
from rollout_corr_testing.tolerances import grad_tol, output_tol

CASES = [
    # (leading shape, padded vocab, true vocab_size, temperature, label_smoothing)
    ((6, 2), 96, 96, 1.0, 0.0),  # megatron [s, b, V]
    ((2, 6), 96, 90, 0.7, 0.0),  # [b, s, V], padded vocab (last shard partly padding)
    ((5, 3), 128, 125, 1.3, 0.1),  # label smoothing over the global vocab
]


def _global_inputs(lead, v_padded, vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(*lead, v_padded, generator=g, dtype=torch.float64) * 2.5
    target = torch.randint(0, vocab_size, lead, generator=g)
    target.view(-1)[0] = -100
    return full, target


def _tp_worker(rank, world, dtypes):
    group = dist.group.WORLD
    dev = worker_device()
    for case_id, (lead, v_padded, vocab_size, temp, smoothing) in enumerate(CASES):
        full, target_cpu = _global_inputs(lead, v_padded, vocab_size, seed=case_id)
        target = target_cpu.to(dev)
        v_local = v_padded // world
        for dtype in dtypes:
            full_d = full.to(dtype)
            shard = full_d[..., rank * v_local:(rank + 1) * v_local].to(dev).requires_grad_(True)
            shard_before = shard.detach().clone()
            with CollectiveCounter() as fwd:
                logp, ent = rc.vocab_parallel_log_probs(shard, target, group, vocab_size=vocab_size,
                                                        temperature=temp, return_entropy=True)
                ce = rc.vocab_parallel_cross_entropy(shard, target, smoothing, group, vocab_size=vocab_size,
                                                     temperature=temp)
            # Per call: the record all-gather, plus (check_group's CPU default; off on CUDA, where it would cost a
            # host sync) the 64-byte header all-gather.
            expected_collectives = (4 if dev.type == "cpu" else 2) if world > 1 else 0
            assert len(fwd.calls) == expected_collectives, fwd.calls
            assert all(c in ("all_gather_single", "all_gather_into_tensor") for c in fwd.calls), fwd.calls
            with CollectiveCounter() as lean:
                lean_logp = rc.vocab_parallel_log_probs(shard.detach(), target, group, vocab_size=vocab_size,
                                                        temperature=temp, check_group=False)
            assert len(lean.calls) == (1 if world > 1 else 0), lean.calls  # exactly one collective
            torch.testing.assert_close(lean_logp, logp.detach(), rtol=0, atol=0)

            xr = full_d.double().requires_grad_(True)
            ref_logp, ref_ent, ref_ce = log_probs_dense(xr, target_cpu, vocab_size=vocab_size, temperature=temp,
                                                        label_smoothing=smoothing)
            torch.testing.assert_close(logp.double().cpu(), ref_logp.detach(), **output_tol(dtype))
            torch.testing.assert_close(ent.double().cpu(), ref_ent.detach(), **output_tol(dtype))
            torch.testing.assert_close(ce.double().cpu(), ref_ce.detach(), **output_tol(dtype))

            # Every rank holds identical outputs.
            gathered = [torch.empty_like(logp) for _ in range(world)]
            dist.all_gather(gathered, logp.detach())
            assert all(torch.equal(gathered[0], x) for x in gathered)

            wl, we, wc = (torch.randn(lead, generator=torch.Generator().manual_seed(9 + k), dtype=torch.float64)
                          for k in range(3))
            with CollectiveCounter() as bwd:
                (logp * wl.float().to(dev) + ent * we.float().to(dev) + ce * wc.float().to(dev)).sum().backward()
            assert bwd.calls == [], bwd.calls
            (ref_logp * wl + ref_ent * we + ref_ce * wc).sum().backward()
            ref_grad = xr.grad[..., rank * v_local:(rank + 1) * v_local]
            tol = grad_tol(dtype)
            if dtype != torch.float32:
                # Autograd sums the three outputs' gradients in the logits dtype: three roundings of the sum.
                tol["atol"] += 3 * torch.finfo(dtype).eps * ref_grad.abs().max().item()
            torch.testing.assert_close(shard.grad.double().cpu(), ref_grad, **tol)
            assert torch.equal(shard.detach(), shard_before)  # the caller's logits are untouched


#: (world, device) for TP = 1, 2, 4 on gloo and on NCCL (skipped with the reason without that many GPUs).
TP_CASES = [pytest.param(world, p.values[0], marks=p.marks, id=f"{world}-{p.id}")
            for world in (1, 2, 4) for p in dist_params(world)]


@pytest.mark.parametrize("world,device", TP_CASES)
def test_vocab_parallel_matches_single_process(world, device):
    run_workers(_tp_worker, world, (torch.float32, torch.bfloat16), device=device)


def _megatron_parity_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        dev = worker_device()
        full, target = _global_inputs((7, 3), 64, 64, seed=11)
        target.view(-1)[0] = 3  # megatron-core has no ignore_index
        target = target.to(dev)
        v_local = 64 // world
        shard = full[..., rank * v_local:(rank + 1) * v_local].float().to(dev)
        ours_in = shard.clone().requires_grad_(True)
        theirs_in = shard.clone().requires_grad_(True)
        ours = rc.vocab_parallel_cross_entropy(ours_in, target, 0.0, group)
        theirs = mcore_ce(theirs_in * 1.0, target)  # * 1.0: megatron-core writes into its input
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        w = torch.randn(7, 3, generator=torch.Generator().manual_seed(1)).to(dev)
        (ours * w).sum().backward()
        (theirs * w).sum().backward()
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-6)
        # With label smoothing megatron-core averages over the *local* shard (Megatron-LM #737), so it only
        # agrees with the global definition at TP=1; ours agrees with the fp64 oracle at any TP (above).
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("device", dist_params(2))
def test_parity_with_megatron_core_cross_entropy_tp2(device):
    run_workers(_megatron_parity_worker, 2, device=device)


def _megatron_smoothing_tp1_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        full, target = _global_inputs((4, 2), 50, 50, seed=12)
        target.view(-1)[0] = 1
        x, target = full.float().to(worker_device()), target.to(worker_device())
        ours = rc.vocab_parallel_cross_entropy(x, target, 0.1)
        theirs = mcore_ce(x.clone(), target, 0.1)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("device", dist_params(1))
def test_parity_with_megatron_core_label_smoothing_tp1(device):
    run_workers(_megatron_smoothing_tp1_worker, 1, device=device)


def _raises_everywhere(fn, exc, match):
    """``fn()`` must raise ``exc`` matching ``match`` on this rank; then a barrier proves no rank hung or aborted."""
    with pytest.raises(exc, match=match):
        fn()
    dist.barrier()


def _layout_worker(rank, world):
    """Shards that do not fit together give the same named error on every rank (gloo / NCCL: no collective
    mismatch). The named errors come from the header pre-check (``check_group``: on by default for CPU tensors,
    passed explicitly here so the NCCL variant runs it too); without it the merge's check is a RuntimeError on CPU
    and an asynchronous device assert on CUDA (tests/test_cuda.py covers that one in a subprocess)."""
    group = dist.group.WORLD
    dev = worker_device()
    lp = functools.partial(rc.vocab_parallel_log_probs, check_group=True)
    ce = functools.partial(rc.vocab_parallel_cross_entropy, check_group=True)
    full_cpu, target_cpu = _global_inputs((3, 4), 96, 96, seed=21)
    full, target = full_cpu.to(dev), target_cpu.to(dev)
    shard = full[..., rank * 48:(rank + 1) * 48].float()
    fit = "the tensor-parallel shards do not fit together"

    # Two ranks passing the same vocab_start (overlap and a gap).
    _raises_everywhere(lambda: lp(shard, target, group, vocab_start=0, vocab_size=96), ValueError, f"{fit}.*overlap")
    # Uneven shards (50 + 46 columns) with the default vocab_start = rank * V_local: rank 1 starts at 46.
    uneven = full[..., :50] if rank == 0 else full[..., 50:]
    _raises_everywhere(lambda: lp(uneven.float(), target, group, vocab_size=96), ValueError, f"{fit}.*overlap")
    # ... and right with an explicit vocab_start.
    logp = lp(uneven.float(), target, group, vocab_start=0 if rank == 0 else 50, vocab_size=96)
    ref_logp, _, _ = log_probs_dense(full_cpu, target_cpu)
    torch.testing.assert_close(logp.double().cpu(), ref_logp, **output_tol(torch.float32))
    # A vocab_size that the shards do not cover.
    _raises_everywhere(lambda: lp(shard, target, group, vocab_size=100), ValueError, f"{fit}.*do not cover")
    # Different row counts: a named error on every rank, not a collective abort.
    rows = shard[:2] if rank == 0 else shard[:3]
    _raises_everywhere(lambda: lp(rows, target[:rows.shape[0]], group), ValueError,
                       f"{fit}.*rank 0 has 8 rows but rank 1 has 12")  # flattened rows
    # Different targets.
    other = target.clone()
    if rank == 1:
        other.view(-1)[5] = (other.view(-1)[5] + 1) % 96
    _raises_everywhere(lambda: lp(shard, other, group), ValueError, f"{fit}.*different targets")
    # Different record formats (entropy-only vs label smoothing) on the two ranks.
    _raises_everywhere(lambda: ce(shard, target, 0.1 if rank else 0.0, group), ValueError, f"{fit}.*record formats")
    # Different temperatures (records taken at different scales would merge into a wrong answer on both ranks) or
    # ignore_index values (one rank would raise on a target the other ignores, and the other hang): the same error.
    _raises_everywhere(lambda: lp(shard, target, group, temperature=0.7 if rank else 0.8), ValueError,
                       f"{fit}.*settings \\(temperature, ignore_index")
    _raises_everywhere(lambda: lp(shard, target, group, ignore_index=-100 if rank else -1), ValueError,
                       f"{fit}.*settings \\(temperature, ignore_index")
    if dev.type == "cpu":
        # Without the pre-check (check_group=False) the merge still catches the layout after the one all-gather
        # (CUDA: an asynchronous device assert instead, which would poison this worker's context).
        _raises_everywhere(lambda: rc.vocab_parallel_log_probs(shard, target, group, vocab_start=0, vocab_size=96,
                                                               check_group=False), RuntimeError, "overlap")
    # A shard whose every logit is -inf (a sampler mask) is legal: the other shard holds all the mass.
    masked = full_cpu.clone()
    masked[..., 48:] = float("-inf")
    target_low = target_cpu % 48
    shard = masked[..., rank * 48:(rank + 1) * 48].float().to(dev)
    logp, ent = rc.vocab_parallel_log_probs(shard, target_low.to(dev), group, return_entropy=True)
    ref_logp, ref_ent, _ = log_probs_dense(masked, target_low)
    torch.testing.assert_close(logp.double().cpu(), ref_logp, **output_tol(torch.float32))
    torch.testing.assert_close(ent.double().cpu(), ref_ent, **output_tol(torch.float32))


@pytest.mark.parametrize("device", dist_params(2))
def test_mismatched_shards_raise_on_every_rank(device):
    run_workers(_layout_worker, 2, device=device)


def _megatron_group_none_worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        full, target_cpu = _global_inputs((4, 2), 64, 64, seed=13)
        target_cpu.zero_()  # every target in the first shard: the silent off-by-log(tp) case
        target = target_cpu.to(worker_device())
        shard = full[..., rank * 32:(rank + 1) * 32].float().to(worker_device())
        for fn in (rc.vocab_parallel_log_probs, rc.vocab_parallel_cross_entropy):
            with pytest.raises(ValueError, match="tp_group=None, but megatron-core is initialized with "
                                                 "tensor-parallel size 2") as info:
                fn(shard, target)
            assert f"rollout_corr_ext.megatron.{fn.__name__}," in str(info.value), str(info.value)  # the one called
        from rollout_corr_ext import megatron as rc_megatron
        logp = rc_megatron.vocab_parallel_log_probs(shard, target)  # defaults to megatron's group: right
        ref_logp, _, _ = log_probs_dense(full, target_cpu)
        torch.testing.assert_close(logp.double().cpu(), ref_logp, **output_tol(torch.float32))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("device", dist_params(2))
def test_group_none_under_megatron_tp2_is_an_error(device):
    run_workers(_megatron_group_none_worker, 2, device=device)
