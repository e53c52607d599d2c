"""torch.compile of a whole RL loss step with fullgraph=True (issue: every op family typed and traceable).

The step: vocab-parallel log-probs and entropy (with backward), rollout correction (weights, RS mask, every
metric), the PPO policy loss with the IS weights, and agg_loss. Under ``aot_eager`` and ``inductor`` on CPU it must
compile into one graph (``fullgraph=True`` raises on any graph break; ``torch._dynamo.explain`` counts them) and
give the eager results and gradients. Value checks live behind the op boundary (the ops raise, or assert
asynchronously on CUDA), so nothing in the step reads a tensor on the host. Each test runs on CPU tensors and on CUDA
tensors (skipped with the reason without a GPU); the emulator registers no torch.ops.rollout_corr kernels to trace.
"""

from __future__ import annotations

import re

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_testing.backends import device_params

DEVICES = device_params("cpu", "cuda")

pytestmark = pytest.mark.skipif(rc.backend() == "fallback",
                                reason="the pure-PyTorch fallback checks values on the host (graph breaks by design); "
                                       "the compiled ops are what torch.compile traces")

CFG = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
                                 rollout_rs_threshold="0.5_2.0,0.05", rollout_token_veto_threshold=1e-4)


def _step(logits, target, old_lp, rollout_lp, mask, adv):
    lp, entropy = rc.vocab_parallel_log_probs(logits, target, return_entropy=True, temperature=0.9)
    res = rc.compute_rollout_correction(old_lp, rollout_lp, mask, CFG)
    pg_loss, pg_metrics = rc.compute_policy_loss_vanilla(old_lp, lp, adv, res.response_mask,
                                                         loss_agg_mode="seq-mean-token-mean",
                                                         rollout_is_weights=res.weights)
    ent = rc.agg_loss(entropy, res.response_mask, "token-mean")
    return pg_loss - 0.01 * ent, res.metrics, pg_metrics


def _inputs(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    b, t, v = 3, 12, 40
    logits = torch.randn(b, t, v, generator=g).to(dtype)
    target = torch.randint(0, v, (b, t), generator=g)
    with torch.no_grad():
        old = torch.log_softmax(logits.float() / 0.9, -1).gather(-1, target[..., None])[..., 0]
    rollout = old + 0.05 * torch.randn(b, t, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 8:] = False
    adv = torch.randn(b, t, generator=g)
    return tuple(x.to(device) for x in (logits, target, old, rollout, mask, adv))


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_has_no_graph_break(device):
    torch._dynamo.reset()
    args = _inputs(device=device)
    explained = torch._dynamo.explain(_step)(args[0].clone().requires_grad_(True), *args[1:])
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_equals_eager(backend, device):
    torch._dynamo.reset()
    args = _inputs(device=device)
    x_eager = args[0].clone().requires_grad_(True)
    loss_e, met_e, pg_e = _step(x_eager, *args[1:])
    loss_e.backward()
    x_comp = args[0].clone().requires_grad_(True)
    compiled = torch.compile(_step, backend=backend, fullgraph=True)
    loss_c, met_c, pg_c = compiled(x_comp, *args[1:])
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x_comp.grad, x_eager.grad, rtol=1e-5, atol=1e-7)
    assert met_c.keys() == met_e.keys() and pg_c.keys() == pg_e.keys()
    for k in met_e:
        torch.testing.assert_close(met_c[k], met_e[k], rtol=1e-6, atol=1e-9, equal_nan=True, msg=k)
    for k in pg_e:
        torch.testing.assert_close(pg_c[k], pg_e[k], rtol=1e-6, atol=1e-9, msg=k)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_nan_compiles_whole_and_equals_eager(device):
    """compute_rollout_correction(empty="nan") (megatron's loss_func path) traces without a host read: a batch
    with tokens and one without give the eager weights, mask and metrics (NaN for the empty one)."""
    torch._dynamo.reset()
    _, _, old, rollout, mask, _ = _inputs(device=device)

    def corr(o, r, m):
        res = rc.compute_rollout_correction(o, r, m, CFG, empty="nan")
        return res.weights, res.response_mask, res.metrics

    compiled = torch.compile(corr, backend="aot_eager", fullgraph=True)
    for m in (mask, torch.zeros_like(mask)):
        w_e, m_e, met_e = corr(old, rollout, m)
        w_c, m_c, met_c = compiled(old, rollout, m)
        assert torch.equal(w_c, w_e) and torch.equal(m_c, m_e) and met_c.keys() == met_e.keys()
        for k in met_e:
            torch.testing.assert_close(met_c[k], met_e[k], rtol=1e-6, atol=1e-9, equal_nan=True, msg=k)
        assert all(bool(torch.isnan(v)) for v in met_e.values()) == (not bool(m.any()))


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_temperature_that_changes_between_calls_compiles_whole(dynamic):
    """torch 2.14 traces a float argument as a symbol once it changes between calls (or from the start with
    dynamic=True): the log-prob entry points compile whole (fullgraph) with a symbolic temperature, equal to eager
    in value and gradient, and a bad one is still refused, by the kernels' boundary at run time (their host check
    called math.isfinite on the symbol: a graph break, so fullgraph failed on the second temperature)."""
    logits, target = _inputs()[:2]

    def step(x, t, temp):
        lp, ent = rc.vocab_parallel_log_probs(x, t, temperature=temp, return_entropy=True)
        nll = rc.vocab_parallel_cross_entropy(x, t, temperature=temp, label_smoothing=0.1)
        return lp.sum() + 0.5 * ent.sum() - nll.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for temp in (0.9, 0.6, 1.7):
        xc, xe = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        got, want = compiled(xc, target, temp), step(xe, target, temp)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-7)
    # 0.0 gets a symbol of its own, with which 1 / temperature failed in tracing (a TorchRuntimeError on a
    # ZeroDivisionError, the compile fuzz) before the assert could name the argument
    for bad in (float("inf"), -1.0, float("nan"), 1e-39, 0.0, -0.0):
        with pytest.raises(RuntimeError, match=re.escape("temperature must be finite and > 0, and 1 / temperature")):
            compiled(logits, target, bad)


@pytest.mark.parametrize("dynamic", [None, True])
def test_number_arguments_that_change_between_calls_compile_whole(dynamic):
    """As the temperature above: agg_loss's global normalisers (verl changes them every step; a 0-d CPU tensor too),
    calculate_grpo_loss's clamps and coefficients, off_policy_sequence_mask's delta and a PolicyLossConfig built
    inside the compiled function were checked with math.isfinite / .item() on the host: a graph break once the
    number was a symbol, so fullgraph failed on the second value (the compile fuzz). Traced, each check is a
    run-time assert: values equal eager's, and a bad number is still refused."""
    logits, target, old, rollout, mask, adv = _inputs()
    lp0 = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    adv_rows = adv[:, 0].contiguous()

    def step(lp, n, clip, kl_beta, delta):
        a = rc.agg_loss(lp, mask, "token-mean", 1, n) + rc.agg_loss(lp, mask, "seq-mean-token-mean", 1, None, n)
        cfg = rc.losses.PolicyLossConfig(clip_ratio=clip, global_batch_size=n)
        b = rc.compute_policy_loss(old, lp, adv, mask, "seq-mean-token-mean", cfg)[0]
        c = rc.calculate_grpo_loss(lp, old, rollout, adv_rows, clip, clip + 0.05, kl_beta, 0.01)[0].sum()
        keep, frac = rc.off_policy_sequence_mask(lp.detach(), rollout, adv, mask, delta)
        return a + b + c + keep.sum() + frac

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for n, clip, kl_beta, delta in ((24.0, 0.2, 0.05, 0.1), (20.0, 0.25, 0.1, 0.3), (7, 0.15, 0.0, 0.0)):
        xc, xe = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
        got, want = compiled(xc, n, clip, kl_beta, delta), step(xe, n, clip, kl_beta, delta)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-7)
    tensor_n = torch.compile(lambda lp, n: rc.agg_loss(lp, mask, "token-mean", 1, n), backend="aot_eager",
                             fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(tensor_n(lp0, torch.tensor(24.0)), rc.agg_loss(lp0, mask, "token-mean", 1, 24.0))
    for args, what in (((-1.0, 0.2, 0.05, 0.1), "batch_num_tokens must be a finite number > 0"),
                       ((24.0, float("nan"), 0.05, 0.1), "clip_ratio must be a finite float >= 0"),
                       ((24.0, 0.2, float("inf"), 0.1), "kl_beta must be finite"),
                       ((24.0, 0.2, 0.05, -0.5), "delta must be finite and >= 0.0")):
        with pytest.raises(RuntimeError, match=re.escape(what)):
            compiled(lp0, *args)
    with pytest.raises(RuntimeError, match=re.escape("batch_num_tokens must be a finite number > 0")):
        tensor_n(lp0, torch.tensor(0.0))


@pytest.mark.parametrize("dynamic", [None, True])
def test_kl_cov_coefficient_that_changes_between_calls_compiles_whole(dynamic):
    """kl_cov's check that ppo_kl_coef is finite in the compute type read a tensor of the traced number on the host:
    "Could not guard on data-dependent expression" on the second value (the compile fuzz). Traced, it is a run-time
    assert: values equal eager's, and 1e308 (inf in fp32) is still refused."""
    logits, target, old, rollout, mask, adv = _inputs()
    lp0 = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]

    def loss(lp, coef):
        cfg = rc.losses.PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=coef)
        return rc.compute_policy_loss(old, lp, adv, mask, "token-mean", cfg)[0]

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for coef in (0.1, 1.0, 0.35):
        xc, xe = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
        got, want = compiled(xc, coef), loss(xe, coef)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-8)
    with pytest.raises(RuntimeError, match=re.escape("ppo_kl_coef must be finite in the compute type")):
        compiled(lp0, 1e308)


def test_grpo_coefficients_past_the_compute_type_are_refused_when_traced():
    """calculate_grpo_loss refuses kl_beta / entropy_weight past fp32's range eagerly; traced, the check was skipped:
    entropy_weight = -1e308 returned an inf loss, and kl_beta = 1e308 was blamed on a token (the review). Traced,
    each is a run-time assert naming the argument."""
    logits, target, old, rollout, mask, adv = _inputs()
    lp0 = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    adv_rows = adv[:, 0].contiguous()

    def grpo(lp, kb, ew):
        return rc.calculate_grpo_loss(lp, old, rollout, adv_rows, 0.2, 0.2, kb, ew)[0].sum()

    torch._dynamo.reset()
    compiled = torch.compile(grpo, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(lp0, 0.1, 0.01), grpo(lp0, 0.1, 0.01), rtol=1e-6, atol=1e-6)
    for kb, ew, name in ((1e308, 0.01, "kl_beta"), (0.1, -1e308, "entropy_weight")):
        with pytest.raises(RuntimeError, match=re.escape(f"{name} must be finite in the compute type")):
            compiled(lp0, kb, ew)


def test_per_row_temperatures_are_checked_under_compile():
    """The replay's per-row temperatures run the kernels at temperature 1, so the kernels' boundary never sees them:
    traced, their range check is the entry's own assert (a flat row at 1e300 came back silently)."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.25, 0.0, 3.0]])
    target = torch.tensor([0, 3])
    sp = rc.SamplingParams(temperature=torch.tensor([1e300, 1.0], dtype=torch.float64), top_k=2)
    with pytest.raises(ValueError, match="out of range"):
        rc.sampled_log_probs(x, target, sp)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: rc.sampled_log_probs(a, b, sp).log_prob, backend="eager")
    with pytest.raises(RuntimeError, match=re.escape("temperature must be finite and > 0, and 1 / temperature")):
        compiled(x, target)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
@pytest.mark.parametrize("mode", [m for m in rc.losses.POLICY_LOSS_MODES if m != "bypass_mode"])
def test_every_policy_loss_compiles_whole(mode, mask_dtype):
    """compute_policy_loss of every loss under torch.compile(fullgraph=True): value and gradient equal to eager.
    geo_mean's check of its sequence values (an overflowing exp) read the host on CPU, a graph break; traced, it is
    an assert, which still refuses the overflow (a RuntimeError naming it). clip_cov read its cap from a non-bool
    mask's sum on the host (the compile fuzz); traced, every token bounds it."""
    logits, target, old, rollout, mask, adv = _inputs()
    mask = mask.to(mask_dtype)
    lp0 = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    cfg = rc.losses.PolicyLossConfig(loss_mode=mode, clip_cov_ratio=0.2, kl_cov_ratio=0.2,
                                     dro_beta=0.5 if mode == "dro" else None)

    def loss(o, lp, a, m):
        return rc.compute_policy_loss(o, lp, a, m, loss_agg_mode="token-mean", config=cfg)[0]

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    xc, xe = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    got, want = compiled(old, xc, adv, mask), loss(old, xe, adv, mask)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-8)
    if mode == "geo_mean":  # a mean clipped log-ratio of 100 overflows exp in fp32
        big = rc.losses.PolicyLossConfig(loss_mode=mode, clip_ratio_low=1e30, clip_ratio_high=1e30)
        torch._dynamo.reset()
        compiled = torch.compile(lambda o, lp, a, m: rc.compute_policy_loss(o, lp, a, m, config=big)[0],
                                 backend="aot_eager", fullgraph=True)
        with pytest.raises(RuntimeError, match="exp\\(mean clipped log-ratio\\) is not finite"):
            compiled(old - 100.0, lp0, adv, mask)


@pytest.mark.parametrize("device", device_params("cpu", cuda_reason="on CUDA the check is an asynchronous device "
                                                                    "assert (tests/test_cuda.py, in a subprocess)"))
def test_compiled_step_still_raises_clear_errors(device):
    """The checks survive compilation: a NaN log-prob at a response token is still a named ValueError."""
    torch._dynamo.reset()
    logits, target, old, rollout, mask, adv = _inputs()
    rollout = rollout.clone()
    rollout[0, 3] = float("nan")
    compiled = torch.compile(_step, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="NaN or \\+-inf at valid response_mask positions"):
        compiled(logits.clone().requires_grad_(True), target, old, rollout, mask, adv)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_error_types_under_compile(fullgraph):
    """What a compiled caller sees (docs/logprobs.md, "Under torch.compile"): a check of tensor *values* runs inside
    the op at run time and keeps its type (ValueError) under compile, fullgraph or not. A check of the arguments
    themselves (shapes, dtypes, modes, requires_grad) runs while dynamo traces: without fullgraph dynamo falls back
    to eager there and the caller gets the documented ValueError / TypeError unchanged; with fullgraph=True dynamo
    wraps it in torch._dynamo.exc.Unsupported (a RuntimeError) whose message carries the original one."""
    torch._dynamo.reset()
    logits, target, old, rollout, mask, adv = _inputs()

    def run(fn, *args):
        return torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)(*args)

    def eager_error(fn, *args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return type(e), str(e).split("\n")[0][:60]
        raise AssertionError("no error in eager mode")

    bad_rollout = rollout.clone()
    bad_rollout[0, 3] = float("nan")
    bad_target = target.clone()
    bad_target[1, 2] = 10_000
    bad_logits = logits.clone()
    bad_logits[2, 5, 7] = float("nan")
    value_cases = [(_step, (logits.clone().requires_grad_(True), target, old, bad_rollout, mask, adv)),
                   (lambda x, t: rc.vocab_parallel_log_probs(x, t), (logits, bad_target)),
                   (lambda x, t: rc.vocab_parallel_log_probs(x, t), (bad_logits, target))]
    for fn, args in value_cases:
        exc, words = eager_error(fn, *args)
        torch._dynamo.reset()
        with pytest.raises(exc, match=re.escape(words)):
            run(fn, *args)

    def bad_mode(old_lp, lp, a, m):
        return rc.compute_policy_loss_vanilla(old_lp, lp, a, m, loss_agg_mode="mean")[0]

    def old_with_grad(old_lp, lp, a, m):
        return rc.compute_policy_loss_vanilla(old_lp, lp, a, m)[0]

    lp = old.clone().requires_grad_(True)
    cases = [(bad_mode, (old, lp, adv, mask), ValueError, "loss_agg_mode"),
             (old_with_grad, (old.clone().requires_grad_(True), lp, adv, mask), ValueError,
              "old_log_prob requires grad")]
    for fn, args, exc, words in cases:
        torch._dynamo.reset()
        if fullgraph:
            with pytest.raises(torch._dynamo.exc.Unsupported) as info:
                run(fn, *args)
            assert exc.__name__ in str(info.value) and words in str(info.value), str(info.value)[:500]
        else:
            with pytest.raises(exc, match=words):
                run(fn, *args)
