"""Vocab-parallel log-probs at TP = 1, 2, 4 (spawned gloo workers) against the single-process fp64 oracle."""

import pytest
import torch
import torch.distributed as dist

import rollout_corr_ext as rc
from rollout_corr_ext import reference
from rollout_corr_testing.dist_utils import CollectiveCounter, run_workers
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
    for case_id, (lead, v_padded, vocab_size, temp, smoothing) in enumerate(CASES):
        full, target = _global_inputs(lead, v_padded, vocab_size, seed=case_id)
        v_local = v_padded // world
        for dtype in dtypes:
            full_d = full.to(dtype)
            shard = full_d[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
            shard_before = shard.detach().clone()
            with CollectiveCounter() as fwd:
                logp, ent = rc.vocab_parallel_log_probs(shard, target, group, vocab_size=vocab_size,
                                                        temperature=temp, return_entropy=True)
                ce = rc.vocab_parallel_cross_entropy(shard, target, smoothing, group, vocab_size=vocab_size,
                                                     temperature=temp)
            expected_collectives = 2 if world > 1 else 0  # one per call
            assert len(fwd.calls) == expected_collectives, fwd.calls
            assert all(c in ("all_gather_single", "all_gather_into_tensor") for c in fwd.calls), fwd.calls

            xr = full_d.double().requires_grad_(True)
            ref_logp, ref_ent, ref_ce = reference.log_probs_dense(xr, target, vocab_size=vocab_size, temperature=temp,
                                                                  label_smoothing=smoothing)
            torch.testing.assert_close(logp.double(), ref_logp.detach(), **output_tol(dtype))
            torch.testing.assert_close(ent.double(), ref_ent.detach(), **output_tol(dtype))
            torch.testing.assert_close(ce.double(), ref_ce.detach(), **output_tol(dtype))

            # Every rank holds identical outputs.
            gathered = [torch.empty_like(logp) for _ in range(world)]
            dist.all_gather(gathered, logp.detach())
            assert all(torch.equal(gathered[0], x) for x in gathered)

            wl, we, wc = (torch.randn(lead, generator=torch.Generator().manual_seed(9 + k), dtype=torch.float64)
                          for k in range(3))
            with CollectiveCounter() as bwd:
                (logp * wl.float() + ent * we.float() + ce * wc.float()).sum().backward()
            assert bwd.calls == [], bwd.calls
            (ref_logp * wl + ref_ent * we + ref_ce * wc).sum().backward()
            ref_grad = xr.grad[..., rank * v_local:(rank + 1) * v_local]
            tol = grad_tol(dtype)
            if dtype != torch.float32:
                # Autograd sums the three outputs' gradients in the logits dtype: three roundings of the sum.
                tol["atol"] += 3 * torch.finfo(dtype).eps * ref_grad.abs().max().item()
            torch.testing.assert_close(shard.grad.double(), ref_grad, **tol)
            assert torch.equal(shard.detach(), shard_before)  # the caller's logits are untouched


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_matches_single_process(world):
    run_workers(_tp_worker, world, (torch.float32, torch.bfloat16))


def _megatron_parity_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        full, target = _global_inputs((7, 3), 64, 64, seed=11)
        target.view(-1)[0] = 3  # megatron-core has no ignore_index
        v_local = 64 // world
        shard = full[..., rank * v_local:(rank + 1) * v_local].float()
        ours_in = shard.clone().requires_grad_(True)
        theirs_in = shard.clone().requires_grad_(True)
        ours = rc.vocab_parallel_cross_entropy(ours_in, target, 0.0, group)
        theirs = mcore_ce(theirs_in * 1.0, target)  # * 1.0: megatron-core writes into its input
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        w = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
        (ours * w).sum().backward()
        (theirs * w).sum().backward()
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-6)
        # With label smoothing megatron-core averages over the *local* shard (Megatron-LM #737), so it only
        # agrees with the global definition at TP=1; ours agrees with the fp64 oracle at any TP (above).
    finally:
        parallel_state.destroy_model_parallel()


def test_parity_with_megatron_core_cross_entropy_tp2():
    run_workers(_megatron_parity_worker, 2)


def _megatron_smoothing_tp1_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        full, target = _global_inputs((4, 2), 50, 50, seed=12)
        target.view(-1)[0] = 1
        x = full.float()
        ours = rc.vocab_parallel_cross_entropy(x, target, 0.1)
        theirs = mcore_ce(x.clone(), target, 0.1)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


def test_parity_with_megatron_core_label_smoothing_tp1():
    run_workers(_megatron_smoothing_tp1_worker, 1)
