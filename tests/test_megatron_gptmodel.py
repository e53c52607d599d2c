"""megatron-core's own ``GPTModel`` (local layer spec) under TP = 2 with sequence parallelism, on gloo.

What megatron-core needs CUDA for here, and the shims that let the rest run unmodified on CPU, are listed in
``rollout_corr_testing/megatron_cpu.py`` (docs/megatron.md repeats them). Each case runs the same model, the same
weights and the same batch two ways and compares the loss, ``num_tokens``, every metric and the gradient of every
parameter shard (sequence-parallel parameters summed over TP, as ``finalize_model_grads`` does):

* the **logits path**: ``GPTModel.forward`` -> vocab-parallel logits ``[b, s, V / tp]`` ->
  ``make_policy_loss_func(logits_layout="bsv")``;
* the **fused path**: the decoder's final hidden states, this rank's ``[s / tp, b, H]`` -> ``make_policy_loss_func(
  output_layer=model.output_layer)`` (gathered along the sequence, reduce-scattered back, logits never built).

And the loss of both equals a one-process TP = 1 run of the same model (same seed: megatron initializes each master
weight on CPU and splits it), with sampling replay too.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from rollout_corr_testing.dist_utils import run_workers_preloaded

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

VOCAB, B, S = 24, 2, 8


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) > 0.25
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, S, generator=g) * 3
    rollout = old - 0.1 * torch.rand(B, S, generator=g)
    return tokens, target, mask, adv, old, rollout


def _run(model, fused, sampling, tp_group):
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.megatron import make_policy_loss_func
    from rollout_corr_testing.megatron_cpu import allreduce_sequence_parallel_grads, causal_mask, final_hidden_states

    tokens, target, mask, adv, old, rollout = _batch()
    pos = torch.arange(S).expand(B, S)
    model.zero_grad(set_to_none=True)
    kw = dict(old_log_prob=old, rollout_log_prob=rollout, entropy_coeff=0.01, sampling=sampling,
              config=dict(rollout_correction=RolloutCorrectionConfig.decoupled_token_is(threshold=2.0)))
    if fused:
        with final_hidden_states(model):
            out = model(tokens, pos, attention_mask=causal_mask(S))
        loss_func = make_policy_loss_func(target, adv, mask, output_layer=model.output_layer, **kw)
    else:
        out = model(tokens, pos, attention_mask=causal_mask(S))
        loss_func = make_policy_loss_func(target, adv, mask, logits_layout="bsv", **kw)
    loss, num_tokens, metrics = loss_func(out)
    (loss / num_tokens).backward()
    if tp_group is not None:
        allreduce_sequence_parallel_grads(model, tp_group)
    return out.shape, loss.detach(), int(num_tokens), {k: v.detach() for k, v in metrics.items()}, \
        {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, world, path):
    from megatron.core import parallel_state as ps

    from rollout_corr_ext import SamplingParams
    from rollout_corr_testing.megatron_cpu import cpu_megatron, gpt_model

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        tp_group = ps.get_tensor_model_parallel_group() if world > 1 else None
        with cpu_megatron():
            model = gpt_model(VOCAB, tp=world, sequence_parallel=True)
            for sampling in (None, SamplingParams(top_k=8, top_p=0.9)):
                tag = "plain" if sampling is None else "replay"
                shape_l, loss_l, n_l, met_l, grads_l = _run(model, False, sampling, tp_group)
                shape_f, loss_f, n_f, met_f, grads_f = _run(model, True, sampling, tp_group)
                assert tuple(shape_l) == (B, S, VOCAB // world)
                assert tuple(shape_f) == (S // world, B, model.config.hidden_size)  # SP: this rank's positions
                torch.testing.assert_close(loss_f, loss_l, rtol=1e-5, atol=1e-6)
                assert n_f == n_l
                assert met_f.keys() == met_l.keys()
                for k in met_l:
                    torch.testing.assert_close(met_f[k], met_l[k], rtol=1e-5, atol=1e-6)
                for name in grads_l:
                    torch.testing.assert_close(grads_f[name], grads_l[name], rtol=1e-4, atol=1e-6,
                                               msg=lambda m, name=name: f"{tag} {name}: {m}")
                if world == 1:
                    with open(path + tag, "w") as f:
                        json.dump({"loss": float(loss_l), "n": n_l}, f)
                else:  # TP = 2 with SP equals the one-process model
                    with open(path + tag) as f:
                        ref = json.load(f)
                    assert n_l == ref["n"]
                    assert abs(float(loss_l) - ref["loss"]) <= 1e-5 * (1 + abs(ref["loss"])), (loss_l, ref)
    finally:
        ps.destroy_model_parallel()


def test_gptmodel_fused_and_logits_paths_agree_under_tp2_with_sequence_parallelism():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tp1_")
        run_workers_preloaded(_worker, 1, path)
        run_workers_preloaded(_worker, 2, path)


def _pipeline_worker(rank, world):
    """PP = 2: megatron calls loss_func on the last stage only. With the default groups (parallel_state's, which
    are per pipeline stage) the loss_func, its metrics' all-reduce included, involves no rank of another stage:
    the last stage's call completes while the first stage takes part in nothing, and returns the single-process
    values. (The first stage then gets no loss and no metrics, as in megatron's schedule.)"""
    from megatron.core import parallel_state as ps

    from rollout_corr_ext.megatron import make_policy_loss_func

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        tokens, target, mask, adv, old, rollout = _batch()
        logits = torch.randn(S, B, VOCAB, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        if ps.is_pipeline_last_stage():
            loss_func = make_policy_loss_func(target, adv, mask, old_log_prob=old.double())
            loss, n, metrics = loss_func(logits)
            ref_loss, ref_n, ref_metrics = make_policy_loss_func(target, adv, mask, old_log_prob=old.double(),
                                                                 tp_group=None, dp_group=None,
                                                                 reduce_metrics=False)(logits)
            torch.testing.assert_close(loss, ref_loss)
            assert int(n) == int(ref_n) and metrics.keys() == ref_metrics.keys()
        dist.barrier()  # the first stage waits here the whole time
    finally:
        ps.destroy_model_parallel()


def test_loss_func_on_the_last_pipeline_stage_alone():
    run_workers_preloaded(_pipeline_worker, 2)
