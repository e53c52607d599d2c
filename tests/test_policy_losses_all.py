"""Every policy loss of verl 0.9.1's registry on the fused policy-loss family (docs/policy_losses.md).

* Each loss against verl's own function on the same inputs and config, every aggregation mode, with and without IS
  weights: loss, gradient and metrics (the 2^-12 input grid of the adapter tests, so no mask decision flips), on
  the compiled CPU kernels, the emulated CUDA kernels and the fallback.
* Each loss against an fp64 oracle written here from the paper's formula (per sequence, in the paper's own form:
  GSPO's and GMPO's ratios as products of per-token ratios to the power 1/|y|), gradient included.
* Packed rows equal padded ones; GSPO's sequence ratio is exact when a sequence is split across two
  context-parallel ranks (gloo); GMPO with ``global_batch_size`` is the same mean when the rows are split over two
  data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
import zlib

import pytest
import torch

from rollout_corr_ext import _layout as LY
from rollout_corr_ext import losses, ops
from rollout_corr_ext import verl as rv
from rollout_corr_testing.backends import policy_loss_backend
from rollout_corr_testing.dist_utils import dist_params, run_workers
from rollout_corr_testing.skips import skip_unless_ci

MODES = losses.LOSS_AGG_MODES
#: verl's registry without bypass_mode (which needs a rollout-correction config; tests/test_verl_adapter.py has it).
NAMES = [n for n in losses.POLICY_LOSS_MODES if n != "bypass_mode"]
#: The knobs every loss reads; clip_cov's range and ratio admit fewer tokens than its cap, where verl is deterministic.
KNOBS = dict(dro_beta=0.5, clip_cov_ratio=0.5, clip_cov_lb=0.02, clip_cov_ub=40.0, kl_cov_ratio=0.1)


def _verl():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import verl.trainer.ppo.core_algos as core
            from verl.workers.config.actor import ActorConfig, PolicyLossConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means verl is not usable here
        skip_unless_ci(f"verl cannot be imported: {exc!r}")
    return core, ActorConfig, PolicyLossConfig


def _actor(name, knobs=None, **kw):
    _, ActorConfig, PLConfig = _verl()
    fields = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                  clip_ratio=0.2, clip_ratio_high=0.28, tau_pos=1.0, tau_neg=1.05)
    fields.update(kw)
    return ActorConfig(policy_loss=PLConfig(loss_mode=name, **dict(KNOBS, **(knobs or {}))), **fields)


def _inputs(b=8, t=24, seed=0, dtype=torch.float32):
    """On a 2^-12 grid: exact log-ratios, so threshold decisions agree with verl's eager fp32 math."""
    g = torch.Generator().manual_seed(seed)
    q = 2.0 ** -12
    old = torch.round(-(torch.rand(b, t, generator=g) * 2.5 + 0.05) / q) * q
    lp = (old + torch.round(torch.randn(b, t, generator=g) * 0.3 / q) * q).clamp(max=-q)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    adv[0, :5] = torch.randn(5, generator=g)  # token-level advantages too
    adv[3] = 0.0
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    mask[2] = 0.0  # a padding-only row
    w = torch.round((torch.rand(b, t, generator=g) * 1.5 + 0.25) / q) * q
    return [x.to(dtype) for x in (old, lp, adv)] + [mask, w]


def _run(fn, old, lp, adv, mask, mode, cfg, w, **kw):
    x = lp.detach().clone().requires_grad_(True)
    loss, metrics = fn(old, x, adv, mask, mode, cfg, w, **kw)
    loss.backward()
    return loss.detach(), metrics, x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_16_bit_gradient_is_the_fp32_gradient_rounded_once(name, dtype):
    """16-bit log-probs are computed in fp32 and rounded once: the gradient equals, bit for bit, the gradient of the
    same values given in fp32, rounded to the 16-bit type. kl_cov's penalty once added its own rounded gradient to
    the kernel's rounded one (1-5 steps of the 16-bit type off where the two nearly cancel)."""
    _verl()
    for seed in range(3):
        for mode in ("token-mean", "seq-mean-token-sum"):
            old, lp, adv, mask, w = (t.to(dtype) if i < 3 else t for i, t in enumerate(_inputs(seed=seed)))
            actor = _actor(name, knobs=dict(kl_cov_ratio=0.5, ppo_kl_coef=0.3 + 0.1 * seed))
            g16 = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, mode, actor, w)[2]
            g32 = _run(rv.POLICY_LOSSES[name], old.float(), lp.float(), adv.float(), mask, mode, actor, w)[2]
            assert g16.dtype == dtype and torch.equal(g16, g32.to(dtype)), (seed, mode,
                                                                             (g16.float() - g32).abs().max())


@pytest.fixture(params=["cpu", "emulated", "fallback"])
def backend(request):
    with policy_loss_backend(request.param, threads=32, schedule=1, max_blocks=3):
        yield request.param


#: (backend, mode): every mode on the compiled CPU kernels and the fallback; the emulated CUDA kernels (slow, thread
#: by thread) in two modes, since the per-token kernel is the same for all and only the aggregation above it differs.
BACKEND_MODES = [(b, m) for b in ("cpu", "fallback") for m in MODES] + [
    ("emulated", m) for m in ("token-mean", "seq-mean-token-mean")]


@pytest.mark.parametrize("weights", [False, True], ids=["no_w", "w"])
@pytest.mark.parametrize("backend_name, mode", BACKEND_MODES)
@pytest.mark.parametrize("name", NAMES)
def test_equals_verl(backend_name, name, mode, weights):
    core, _, _ = _verl()
    with policy_loss_backend(backend_name, threads=32, schedule=1, max_blocks=3):
        _equals_verl(core, name, mode, weights)


def _equals_verl(core, name, mode, weights):
    old, lp, adv, mask, w = _inputs(seed=len(name) + len(mode))
    actor = _actor(name)
    w = w if weights else None
    want = _run(core.get_policy_loss_fn(name), old, lp, adv, mask, mode, actor, w)
    got = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, mode, actor, w)
    assert torch.allclose(got[0].double(), want[0].double(), rtol=2e-5, atol=2e-6), (got[0], want[0])
    assert torch.allclose(got[2], want[2], rtol=2e-5, atol=1e-7), (got[2] - want[2]).abs().max()
    assert list(got[1]) == list(want[1]), (list(got[1]), list(want[1]))
    for k, v in want[1].items():
        assert type(got[1][k]) is float and math.isclose(got[1][k], v, rel_tol=2e-5, abs_tol=2e-6), (k, got[1][k], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend_name", ["cpu", "emulated", "fallback"])
@pytest.mark.parametrize("name", NAMES)
def test_gradient_at_the_exact_bounds_is_verls(backend_name, name, dtype):
    """Log-ratios exactly on a bound: verl's +-20 clamp, GSPO's sequence cap of 10, a clip bound (clip_ratio_low=0 on
    policy: r = 1; GMPO's log-space bound 0.25). torch 2.14's clamp passes no gradient on its bound and
    torch.maximum / torch.min split a tie evenly, so verl's loss gives half the slope on a clip bound and none on the
    clamp's; the kernels passed the whole gradient at each (GSPO: e^10 A against 0), for fp32's lanes too."""
    core, _, _ = _verl()
    old = torch.tensor([[-1.0, -21.0, -1.0, -1.5, -1.0, -1.0], [-1.0, -1.0, -2.0, -2.0, -2.0, -2.0],
                        [-21.0, -1.0, -0.5, -3.0, -1.0, -0.5], [-1.0, -2.0, -1.0, -3.0, -1.0, -2.0]], dtype=dtype)
    lp = torch.tensor([[-21.0, -1.0, -0.9, -1.75, -1.0, -0.75], [9.0, 9.0, -1.5, -2.25, -2.0, -1.75],
                       [-1.0, -21.0, -0.25, -2.5, -1.0, -0.25], [-1.0, -2.0, -0.75, -3.0, -1.25, -2.25]], dtype=dtype)
    adv = torch.tensor([[1.5], [-1.0], [-2.0], [0.75]], dtype=dtype).expand(4, 6).contiguous()
    adv[0, 1] = -0.5
    mask = torch.ones(4, 6, dtype=dtype)
    mask[1, 2:] = 0.0  # row 1: two tokens, each log-ratio 10, GSPO's s exactly 10
    for knobs in (dict(), dict(clip_ratio_low=0.0, clip_ratio_high=0.25)):  # bounds at r = 1 and at x = 0, 0.25
        actor = _actor(name, **knobs)
        with policy_loss_backend(backend_name, threads=32, schedule=1, max_blocks=3):
            for mode in ("token-mean", "seq-mean-token-mean"):
                want = _run(core.get_policy_loss_fn(name), old, lp, adv, mask, mode, actor, None)
                got = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, mode, actor, None)
                tol = dict(rtol=1e-9, atol=1e-15) if dtype == torch.float64 else dict(rtol=2e-6, atol=1e-9)
                assert torch.allclose(got[0], want[0], **tol), (knobs, mode, got[0], want[0])
                assert torch.allclose(got[2], want[2], **tol), (knobs, mode, got[2], want[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend_name", ["cpu", "emulated", "fallback"])
@pytest.mark.parametrize("name", ["clip_cov"])
def test_an_overflowing_ratio_on_the_clipped_branch_passes_no_gradient(backend_name, name, dtype):
    """clip_cov's PPO has no bound on the log-ratio: at x = 96 with A > 0, exp(x) overflows fp32 but the clipped
    branch wins, so the loss is finite and the token's gradient is 0 (the fp64 value). It was NaN, silently
    (0 * inf; verl's fp32 loss gives the same NaN), on every backend. (kl_cov's loss is the unclipped -A r there:
    undefined, the named error.)"""
    old = torch.tensor([[-97.0, -1.0, -1.25, -0.5], [-1.0, -2.0, -0.75, -1.5]])
    lp = torch.tensor([[-1.0, -1.0, -1.0, -0.5], [-1.25, -1.75, -1.0, -1.5]])
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4])
    mask = torch.ones(2, 4, dtype=torch.bool)
    cfg = losses.PolicyLossConfig(loss_mode=name, clip_cov_ratio=0.25, kl_cov_ratio=0.25, clip_cov_lb=-1e30,
                                  clip_cov_ub=1e30)
    fn = getattr(losses, "compute_policy_loss_" + name)
    x64 = lp.double().requires_grad_(True)
    want, _ = fn(old.double(), x64, adv.double(), mask, "token-mean", cfg)
    want.backward()
    with policy_loss_backend(backend_name, threads=32, schedule=1, max_blocks=3):
        x = lp.to(dtype).requires_grad_(True)
        got, _ = fn(old.to(dtype), x, adv.to(dtype), mask, "token-mean", cfg)
        got.backward()
    assert bool(torch.isfinite(x.grad).all()), x.grad
    assert float(x.grad[0, 0]) == 0.0 and float(x64.grad[0, 0]) == 0.0
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool], ids=["float_mask", "bool_mask"])
@pytest.mark.parametrize("junk", ["nan", "inf", "-inf", "ratio_inf", "ratio_huge"])
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_values_at_masked_tokens_never_reach_a_loss(name, junk, mask_dtype, backend):
    """NaN / +-inf (or a log-ratio past exp's range: log_prob +inf or 1e30 against old_log_prob -inf or -1e30) in
    every input at tokens the mask excludes: the loss, the gradient and the metrics are those of the same batch with
    finite values there, bit for bit (the whole-batch losses' CPU sums take products of the mask first and fall back
    to selects exactly when a dropped value is not finite; the per-token kernel's lanes never depend on each other:
    a masked lane past exp's range switched its whole vector to std::exp, an ulp off in its neighbours' gradients,
    kl_cov's; the verl-adapter fuzz)."""
    old, lp, adv, mask, w = _inputs(seed=11)
    mask = mask.to(mask_dtype)
    drop = mask == 0
    value = {"nan": [math.nan] * 4, "inf": [math.inf] * 4, "-inf": [-math.inf] * 4,
             "ratio_inf": [-math.inf, math.inf, math.inf, math.inf],
             "ratio_huge": [-1e30, 1e30, 1e30, 1e30]}[junk]  # old, lp, adv, w
    dirty = [t.clone().masked_fill_(drop, v) for t, v in zip((old, lp, adv, w), value)]
    cfg = losses.PolicyLossConfig.from_dict(_actor(name))
    for mode in ("token-mean", "seq-mean-token-mean"):
        want = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, mode, cfg, w)
        got = _run(rv.POLICY_LOSSES[name], dirty[0], dirty[1], dirty[2], mask, mode, cfg, dirty[3])
        assert torch.equal(got[0], want[0]), (mode, got[0], want[0])
        assert torch.equal(got[2], want[2]), (mode, (got[2] - want[2]).abs().max())
        assert got[1] == want[1], (mode, got[1], want[1])


@pytest.mark.parametrize("which", ["log_prob", "old_log_prob", "advantages"])
@pytest.mark.parametrize("name", NAMES)
def test_nan_at_a_response_token_is_an_error_naming_it(name, which, backend):
    """A NaN the mask keeps: every loss raises naming the token, before any value it would poison is returned (the
    whole-batch losses' masked sums skip a NaN, which is safe because of this). gpg never reads old_log_prob."""
    old, lp, adv, mask, w = _inputs(seed=12)
    inputs = {"old_log_prob": old, "log_prob": lp, "advantages": adv}
    r, c = 1, 0  # a response token of every seed's first rows
    assert mask[r, c] != 0
    inputs[which][r, c] = math.nan
    cfg = losses.PolicyLossConfig.from_dict(_actor(name))
    if name == "gpg" and which == "old_log_prob":
        assert torch.isfinite(_run(rv.POLICY_LOSSES[name], old, lp, adv, mask, "token-mean", cfg, w)[0])
        return
    with pytest.raises(ValueError, match=rf"response token \({r}, {c}\)"):
        _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, "token-mean", cfg, w)


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_all_masked_batches_give_zero(name, backend):
    """[0, T], [B, 0] and an all-masked batch: every loss is 0 (not verl's 0 / 0 NaN), every gradient exactly 0 and
    every metric finite, in every aggregation mode."""
    cfg = losses.PolicyLossConfig.from_dict(_actor(name))
    for b, t, keep in ((0, 8, 1.0), (3, 0, 1.0), (3, 8, 0.0)):
        g = torch.Generator().manual_seed(b + t)
        old = -torch.rand(b, t, generator=g) - 0.1
        lp = old + 0.1 * torch.randn(b, t, generator=g)
        adv = torch.randn(b, t, generator=g)
        mask, w = torch.full((b, t), keep), torch.ones(b, t)
        for mode in MODES:
            loss, metrics, grad = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, mode, cfg, w)
            assert float(loss) == 0.0, (b, t, keep, mode, loss)
            assert grad.shape == lp.shape and bool((grad == 0).all()), (b, t, keep, mode)
            assert all(math.isfinite(v) for v in metrics.values()), (b, t, keep, mode, metrics)


def test_the_valid_count_is_exact_past_fp32_integers():
    """kl_cov counts its valid tokens from float 0 / 1 flags: above 2^24 an fp32 sum of ones is not exact (2^24 + 3
    sums to 2^24 + 4), so the count comes from the bools there, as count_nonzero gives it."""
    n = 2 ** 24 + 4
    flags = torch.ones(n)
    flags[5] = 0.0  # n - 1 = 2^24 + 3 ones
    assert int(flags.sum()) != n - 1  # what the float sum alone would give
    got = losses._count(flags, flags.bool())
    assert got.dtype == torch.int64 and int(got) == n - 1
    small = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    assert int(losses._count(small, small.bool())) == 2


def test_clip_cov_cuts_tokens_and_matches_verl_exactly_there():
    """The comparison above is only meaningful if clip_cov removed some tokens: it did (metric > 0)."""
    old, lp, adv, mask, _ = _inputs(seed=5)
    loss, metrics, _ = _run(losses.compute_policy_loss_clip_cov, old, lp, adv, mask, "token-mean",
                            losses.PolicyLossConfig.from_dict(_actor("clip_cov")), None)
    assert metrics["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_clip_cov_means_divide_by_verls_count_as_verl_types_it(mask_dtype, dtype):
    """verl's masked means divide by mask.sum() + 1e-8 in the type torch gives that sum: fp32 for a bool / int / fp32
    mask, where the eps rounds away, so the mean of one advantage over the micro-batch is that advantage exactly and
    every covariance is 0: nothing passes clip_cov's strict cov > clip_cov_lb = 0, and nothing is cut. fp64 inputs
    once added the eps in fp64 whatever the mask (mean A = A n / (n + 1e-8)): covariances of +-1e-9, and the tokens
    with positive ones were cut (loss -0.32 against verl's -0.70; the verl fuzz). Every token is under the cap.

    fp32 inputs (but for an fp64 mask, which promotes verl's sums) are compared with verl on the same numbers in
    fp64: verl's fp32 sum of the seven 0.7s is an ulp short, its covariances rounding noise, and it cuts the three
    tokens above the mean log-prob (-0.30); the means here are summed in fp64 (exact for equal values;
    docs/policy_losses.md, "Equal covariances")."""
    ref = torch.float64 if mask_dtype != torch.float64 else dtype  # verl's exact means
    core, _, _ = _verl()
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.25, -1.0, -3.0, -0.5]], dtype=dtype)
    lp = torch.tensor([[-0.9, -2.05, -0.45, -1.6], [-0.3, -1.1, -2.9, -0.5]], dtype=dtype)
    adv = torch.full((2, 4), 0.7, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).to(mask_dtype)
    actor = _actor("clip_cov", knobs=dict(clip_cov_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=5.0))
    for mode in ("token-mean", "seq-mean-token-mean"):
        got = _run(rv.compute_policy_loss_clip_cov, old, lp, adv, mask, mode, actor, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _run(core.compute_policy_loss_clip_cov, *(x.to(ref) for x in (old, lp, adv)), mask, mode, actor,
                        None)
        # fp64: the aggregation's own + 1e-8 is added in fp64 (docs/from_verl.md: 1e-8 / n relative)
        tol = dict(rtol=1e-8, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
        # (an fp64 mask promotes verl's fp32 loss to fp64; ours stays in the log-probs' dtype)
        torch.testing.assert_close(got[0], want[0], check_dtype=False, **tol)
        torch.testing.assert_close(got[2], want[2], check_dtype=False, **tol)
        torch.testing.assert_close(float(got[1]["actor/pg_clipfrac"]), float(want[1]["actor/pg_clipfrac"]))


def test_clip_cov_cap_of_fp32_inputs_counts_an_fp64_mask_in_fp64():
    """verl's cap int(clip_cov_ratio * mask.sum()) sums an fp64 mask in fp64 whatever the log-probs' dtype. 100 weights
    of 0.1 sum to 10.0 in fp64 but 9.999999 once cast to fp32: at ratio 0.5 verl cuts 5 tokens, and an fp32 count
    cut 4 (a different loss, silently). Every token is eligible here (ratio 1, no clip, the widest cov range), so
    verl picks its 5 at random: the count is compared (the cut fraction, and the tokens whose gradient is 0), not
    which tokens."""
    core, _, _ = _verl()
    g = torch.Generator().manual_seed(7)
    b, t = 4, 25
    lp = -torch.rand(b, t, generator=g) - 0.1
    old = lp.clone()
    adv = torch.randn(b, t, generator=g)
    mask = torch.full((b, t), 0.1, dtype=torch.float64)
    assert int(0.5 * float(mask.sum())) == 5 and int(0.5 * float(mask.float().sum())) == 4
    actor = _actor("clip_cov", knobs=dict(clip_cov_ratio=0.5, clip_cov_lb=-1e9, clip_cov_ub=1e9))
    got = _run(rv.compute_policy_loss_clip_cov, old, lp, adv, mask, "token-mean", actor, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _run(core.compute_policy_loss_clip_cov, old, lp, adv, mask, "token-mean", actor, None)
    torch.testing.assert_close(float(got[1]["actor/pg_clipfrac"]), float(want[1]["actor/pg_clipfrac"]))
    assert int((got[2] == 0).sum()) == int((want[2] == 0).sum()) == 5


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_clip_cov_cap_counts_mask_weights_as_verl_does(mask_dtype):
    """verl cuts up to int(ratio * sum(mask)) tokens: with mask weights of 2 that is twice the token count, and no
    static bound from the number of positions may cap it below that (a silent difference). Every token is eligible
    here, so exactly that many are cut."""
    g = torch.Generator().manual_seed(3)
    b, t = 4, 16
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) - 0.1
    old = lp.clone()  # ratio 1: nothing clipped, every token with cov in the range is eligible
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    scale = 1 if mask_dtype == torch.bool else 2
    mask = torch.ones(b, t, dtype=mask_dtype) * (True if mask_dtype == torch.bool else scale)
    cfg = losses.PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.3, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    _, metrics = losses.compute_policy_loss_clip_cov(old, lp, adv, mask, "token-mean", cfg)
    want = min(b * t, int(0.3 * scale * b * t))  # verl: int(clip_cov_ratio * sum(mask)) of the eligible tokens
    cut = float(metrics["actor/pg_clipfrac"]) * b * t  # masked mean of the cut indicator, uniform weights
    assert round(cut) == want, (cut, want)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_covariance_cap_is_verls_python_product(name, mask_dtype):
    """verl's caps, int(clip_cov_ratio * mask.sum().item()) and int(len(valid) * kl_cov_ratio), multiply Python
    floats (fp64). An fp32 product rounds 100 * 0.29 = 28.999999999999996 up to 29: one more token cut or penalised
    than verl, silently (kl_cov's loss 0.048 against verl's 0.044; found by reading the cap's dtype). Every token is
    eligible here, so the count of tokens cut (clip_cov, whose choice among them verl draws at random) or verl's
    loss and gradient (kl_cov, deterministic) tell the cap."""
    core, _, _ = _verl()
    g = torch.Generator().manual_seed(11)
    b, t = 4, 25
    ratios = [0.29, 0.53, 0.57, 0.58, 0.59]
    assert all(int(b * t * r) != int((torch.tensor(b * t) * r).floor()) for r in ratios)  # the fp32 product differs
    for r in ratios:
        lp = -torch.rand(b, t, generator=g) - 0.1
        old = lp.clone() if name == "clip_cov" else lp - 0.2 * torch.randn(b, t, generator=g)
        adv = torch.randn(b, t, generator=g)
        mask = torch.ones(b, t, dtype=mask_dtype)
        knob = "clip_cov_ratio" if name == "clip_cov" else "kl_cov_ratio"
        actor = _actor(name, knobs={knob: r, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9})
        fn = getattr(rv, f"compute_policy_loss_{name}")
        got = _run(fn, old, lp, adv, mask, "token-mean", actor, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _run(getattr(core, f"compute_policy_loss_{name}"), old, lp, adv, mask, "token-mean", actor, None)
        if name == "clip_cov":
            assert int((got[2] == 0).sum()) == int((want[2] == 0).sum()) == int(r * b * t), r
        else:
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ratio", [1.0, 3.0, 1e300, 1e308])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_covariance_cap_past_the_token_count_takes_every_token(name, mask_dtype, ratio):
    """A cap of at least every token (a ratio >= 1, or one whose product overflows: 1e308 * 100 is inf, where verl's
    int() raised OverflowError and ours too, and clip_cov blamed the mask) selects every eligible token: the loss
    of ratio 1."""
    g = torch.Generator().manual_seed(12)
    b, t = 4, 25
    lp = -torch.rand(b, t, generator=g) - 0.1
    old = lp - 0.05 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = torch.ones(b, t, dtype=mask_dtype)
    mask[1, 20:] = 0
    knob = "clip_cov_ratio" if name == "clip_cov" else "kl_cov_ratio"
    fn = getattr(losses, f"compute_policy_loss_{name}")

    def run(r):
        cfg = losses.PolicyLossConfig(loss_mode=name, clip_cov_lb=-1e9, clip_cov_ub=1e9, **{knob: r})
        return _run(fn, old, lp, adv, mask, "token-mean", cfg, None)

    got, want = run(ratio), run(1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert torch.isfinite(got[2]).all()


# ----------------------------------------------------------------------------------------- fp64 paper oracles


def _cap(cfg, verl_default):
    """clip_ratio_c, or verl 0.9.1's default of that loss for a missing key (config.get("clip_ratio_c", ...))."""
    return verl_default if cfg.clip_ratio_c is None else cfg.clip_ratio_c


def _ratio(lp, old):
    return torch.exp(lp - old)


def _oracle(name, old, lp, adv, mask, cfg):
    """Token-mean (or the loss's own aggregation) of the paper's objective, in fp64, one sequence at a time."""
    lo, hi = cfg.clip_low, cfg.clip_high
    per_seq, tok_sum, n_tok = [], 0.0, 0.0
    for b in range(lp.shape[0]):
        m = mask[b] > 0
        if not m.any():
            per_seq.append(None)
            continue
        x, o, a = lp[b][m], old[b][m], adv[b][m]
        if name == "gspo":  # s = (prod_t pi / pi_old)^(1/|y|), the gradient through each token's pi only
            s_val = torch.prod(_ratio(x.detach(), o)) ** (1.0 / x.numel())
            s = s_val * torch.exp(x - x.detach())
            tok = -torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a)
        elif name == "geo_mean":  # -A (prod_t clip_sgn(r_t))^(1/|y|)
            r = _ratio(x, o)
            sg = torch.sign(a)
            r_clip = torch.where(sg > 0, torch.minimum(r, torch.full_like(r, math.exp(hi))),
                                 torch.where(sg < 0, torch.maximum(r, torch.full_like(r, math.exp(-lo))), r))
            r_clip = torch.where(sg == 0, torch.ones_like(r), r_clip)
            per_seq.append(-a.mean() * torch.prod(r_clip) ** (1.0 / x.numel()))
            continue
        elif name == "sapo":  # soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, the sequence mean of f A
            tau = torch.where(a > 0, torch.full_like(a, cfg.tau_pos), torch.full_like(a, cfg.tau_neg))
            tok = -torch.sigmoid(tau * (_ratio(x, o) - 1)) * 4 / tau * a
            per_seq.append(tok.mean())
            continue
        elif name == "cispo":  # REINFORCE with the clipped, stopped IS weight
            tok = -torch.clamp(_ratio(x.detach(), o), 1 - lo, 1 + hi) * a * x
        elif name == "dppo_tv":  # binary TV trust region |p - p_old| on the advantage's side
            d = torch.exp(x.detach()) - torch.exp(o)
            keep = torch.where(a > 0, d <= hi, d >= -lo).double()
            tok = -a * torch.clamp(_ratio(x.detach(), o), max=_cap(cfg, 20.0)) * x * keep
        elif name == "dppo_kl":  # the same with the Bernoulli KL(p_old || p) <= eps as the trust region; a token
            # moving against the advantage's push is always kept (arXiv:2602.04879)
            # (verl adds 1e-8 to both 1 - p's in the log, as the kernel does; the paper does not: no token of these
            # inputs lies that close to eps.)
            p, q = torch.exp(x.detach()), torch.exp(o)
            kl = q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))
            keep = torch.where(a > 0, (kl <= hi) | (p <= q), (kl <= lo) | (p >= q)).double()
            tok = -a * torch.clamp(_ratio(x.detach(), o), max=_cap(cfg, 20.0)) * x * keep
        elif name == "vanilla":  # PPO's clipped surrogate (arXiv:1707.06347), the dual clip for A < 0 (1912.09729)
            r = _ratio(x, o)
            tok = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
            tok = torch.where(a < 0, torch.minimum(tok, -a * _cap(cfg, 3.0)), tok)
        elif name == "dro":
            tok = -(x * a) + cfg.dro_beta / 2 * (x - o) ** 2
        elif name in ("gpg",):
            tok = -a * x
        else:
            raise AssertionError(name)
        tok_sum = tok_sum + tok.sum()
        n_tok += x.numel()
    if name in ("geo_mean",):
        return torch.stack([p if p is not None else torch.zeros((), dtype=lp.dtype) for p in per_seq]).mean()
    if name == "sapo":
        vals = [p for p in per_seq if p is not None]
        return torch.stack(vals).mean()
    return tok_sum / n_tok


@pytest.mark.parametrize("name", ["vanilla", "gspo", "geo_mean", "sapo", "cispo", "dppo_tv", "dppo_kl", "dro", "gpg"])
def test_equals_paper_oracle_fp64(backend, name):
    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=11))
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, loss_mode=name, **KNOBS)
    x = lp.clone().requires_grad_(True)
    want = _oracle(name, old, x, adv, mask, cfg)
    (g_want,) = torch.autograd.grad(want, x)
    fn = getattr(losses, "compute_policy_loss_" + name)
    got, _, g_got = _run(fn, old, lp, adv, mask, "token-mean", cfg, None)
    # GMPO's and SAPO's per-sequence means divide by |y| + 1e-8 (verl's, and ours, to stay equal to it); the
    # paper's by |y|.
    tol = 1e-7 if name in ("geo_mean", "sapo") else 1e-10
    assert torch.allclose(got, want.detach(), rtol=tol, atol=1e-12), (got, want)
    assert torch.allclose(g_got, g_want, rtol=tol, atol=1e-12), (g_got - g_want).abs().max()


# ----------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_padded(name):
    old, lp, adv, mask, w = (x.double() for x in _inputs(seed=3))
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, loss_mode=name, **KNOBS)
    fn = getattr(losses, "compute_policy_loss_" + name)
    mode = "seq-mean-token-mean"
    want = _run(fn, old, lp, adv, mask, mode, cfg, w)
    lengths = mask.sum(-1).long()
    lengths[2] = 3  # a row with tokens, all masked out
    keep = torch.arange(lp.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    cu = torch.zeros(lp.shape[0] + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    got = _run(fn, old[keep], lp[keep], adv[keep], mask[keep], mode, cfg, w[keep], cu_seqlens=cu)
    assert torch.allclose(got[0], want[0], rtol=1e-12, atol=1e-14), (got[0], want[0])
    assert torch.allclose(got[2], want[2][keep], rtol=1e-12, atol=1e-14)
    assert list(got[1]) == list(want[1])
    for k in want[1]:
        assert torch.allclose(got[1][k], want[1][k], rtol=1e-12, atol=1e-14), k


def test_geo_mean_global_batch_size_is_exact_over_dp():
    """Two data-parallel halves with the global sequence count: their mean loss and summed gradients are one
    process's (verl's torch.mean over the micro-batch is not, when the halves differ in length)."""
    old, lp, adv, mask, _ = (x.double() for x in _inputs(b=7, seed=4))
    one = _run(losses.compute_policy_loss_geo_mean, old, lp, adv, mask, "token-mean",
               losses.PolicyLossConfig(loss_mode="geo_mean"), None)
    cfg = losses.PolicyLossConfig(loss_mode="geo_mean", dp_size=2, global_batch_size=7)
    halves = [_run(losses.compute_policy_loss_geo_mean, old[s], lp[s], adv[s], mask[s], "token-mean", cfg, None)
              for s in (slice(0, 3), slice(3, 7))]
    assert torch.allclose((halves[0][0] + halves[1][0]) / 2, one[0], rtol=1e-12)
    # the gradient data-parallel training applies: the mean over ranks of each rank's gradient
    assert torch.allclose(torch.cat([h[2] for h in halves]) / 2, one[2], rtol=1e-12, atol=1e-15)


def _gspo_cp_worker(rank, world, old, lp, adv, mask):
    """Each sequence split over two ranks (first half / second half of its tokens), every mode: the ranks' losses
    add up to one process's, and each rank's token gradients are one process's on its tokens (the direct call once
    returned its own aggregate, right only for token-sum, where local and shared aggregation agree)."""
    import torch.distributed as dist

    t = lp.shape[1]
    cols = slice(0, t // 2) if rank == 0 else slice(t // 2, t)
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, loss_mode="gspo")
    for mode in MODES:
        want = _run(losses.compute_policy_loss_gspo, old, lp, adv, mask, mode, cfg, None)
        got = _run(losses.compute_policy_loss_gspo, old[:, cols].contiguous(), lp[:, cols].contiguous(),
                   adv[:, cols].contiguous(), mask[:, cols].contiguous(), mode, cfg, None,
                   seq_group=dist.group.WORLD)
        total = got[0].clone()
        dist.all_reduce(total)
        assert torch.allclose(total, want[0], rtol=1e-12), (mode, total, want[0])
        assert torch.allclose(got[2], want[2][:, cols], rtol=1e-12, atol=1e-15), mode


@pytest.mark.parametrize("device", dist_params(2))
def test_gspo_context_parallel_equals_one_process(device):
    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=8))
    run_workers(_gspo_cp_worker, 2, old, lp, adv, mask, device=device)


# ----------------------------------------------------------------------------------------- front door and checks


def test_config_reads_verl_actor_config():
    cfg = losses.PolicyLossConfig.from_dict(_actor("sapo", tau_pos=1.5, tau_neg=2.5))
    assert (cfg.loss_mode, cfg.tau_pos, cfg.tau_neg, cfg.dro_beta) == ("sapo", 1.5, 2.5, 0.5)
    assert (cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub, cfg.kl_cov_ratio) == (0.5, 0.02, 40.0, 0.1)


def test_none_knobs_read_as_verls_losses_read_them():
    """A policy_loss knob set to None: verl's loss functions substitute their own value (kl_cov: ppo_kl_coef 1.0, not
    the config's default 0.1; clip_cov / kl_cov ratios and bounds: the defaults), and so does the adapter: the same
    loss as verl's own function."""
    core, _, _ = _verl()
    old, lp, adv, mask, _ = _inputs(seed=4)
    for name, knobs in (("kl_cov", dict(ppo_kl_coef=None, kl_cov_ratio=0.2)), ("kl_cov", dict(kl_cov_ratio=None)),
                        ("clip_cov", dict(clip_cov_ratio=None, clip_cov_lb=None, clip_cov_ub=None))):
        actor = _actor(name, knobs=knobs)
        want = _run(core.get_policy_loss_fn(name), old, lp, adv, mask, "token-mean", actor, None)
        got = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, "token-mean", actor, None)
        assert torch.allclose(got[0], want[0], rtol=2e-5, atol=2e-6), (name, knobs, got[0], want[0])


@pytest.mark.parametrize("bad, match", [
    (dict(loss_mode="ppo"), "loss_mode must be one of"),
    (dict(loss_mode="dro"), "dro_beta"),
    (dict(tau_pos=0.0), "tau_pos"),
    (dict(dro_beta=-1.0), "dro_beta"),
    (dict(kl_cov_ratio=float("nan")), "kl_cov_ratio"),
])
def test_config_refuses_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        losses.PolicyLossConfig(**bad)


@pytest.mark.parametrize("name", ["dppo_tv", "cispo", "dro", "gspo", "geo_mean", "sapo"])
def test_undefined_token_is_a_named_error(name):
    old, lp, adv, mask, _ = _inputs(seed=2)
    lp = lp.clone()
    lp[1, 0] = float("-inf")
    mask[1, 0] = 1.0
    cfg = losses.PolicyLossConfig(loss_mode=name, **KNOBS)
    with pytest.raises(ValueError, match="undefined at response token"):
        getattr(losses, "compute_policy_loss_" + name)(old, lp, adv, mask, "token-mean", cfg)
    mask[1, 0] = 0.0  # masked out: never inspected, and no NaN reaches the gradient
    got = _run(getattr(losses, "compute_policy_loss_" + name), old, lp, adv, mask, "token-mean", cfg, None)
    assert torch.isfinite(got[0]) and torch.isfinite(got[2]).all() and got[2][1, 0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_transposed_inputs_give_the_contiguous_bits(name, dtype):
    """Inputs that are transposed views ([T, B] buffers) give the loss, metrics and gradient of contiguous copies,
    bit for bit (GSPO's sequence ratio was summed in the layout's order: an ulp off)."""
    old, lp, adv, mask, w = (t.to(dtype) for t in _inputs(b=6, t=40, seed=12))
    adv = adv + 0.01 * torch.arange(40, dtype=dtype)  # token-level, so a transpose reorders every input's reads
    cfg = losses.PolicyLossConfig(loss_mode=name, **KNOBS)
    fn = getattr(losses, "compute_policy_loss_" + name)
    tr = lambda t: t.t().contiguous().t()  # noqa: E731 - the same values, column-major
    for mode in ("token-mean", "seq-mean-token-mean"):
        want = _run(fn, old, lp, adv, mask, mode, cfg, w)
        got = _run(fn, tr(old), tr(lp), tr(adv), tr(mask), mode, cfg, tr(w))
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), (mode, got[0] - want[0])
        for k, v in want[1].items():
            assert torch.equal(torch.as_tensor(got[1][k]), torch.as_tensor(v)), (mode, k)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", ["kl_cov", "clip_cov"])
def test_cov_losses_with_every_advantage_undefined_name_the_token(name, bad):
    """Every response token's advantage non-finite (so every covariance NaN): the named undefined-token error, not
    an internal size mismatch from the covariance selection (kl_cov's top-k came back short on NaN scores)."""
    old = torch.tensor([[-1.0, -1.25, -0.75], [-0.25, -2.0, -1.0]])
    lp = torch.tensor([[-1.125, -1.0, -0.875], [-0.25, -2.125, -1.5]])
    cfg = losses.PolicyLossConfig(loss_mode=name, kl_cov_ratio=0.5, clip_cov_ratio=0.5, clip_cov_lb=-1e30,
                                  clip_cov_ub=1e30)
    with pytest.raises(ValueError, match=r"undefined at response token \(0, 0\)"):
        getattr(losses, "compute_policy_loss_" + name)(old, lp, torch.full((2, 3), bad), torch.ones(2, 3),
                                                       "token-mean", cfg)


@pytest.mark.parametrize("bad", ["list", "float", "bool", "shape", "meta"])
@pytest.mark.parametrize("entry", ["clip_cov", "kl_cov", "compute_policy_loss"])
def test_seq_positions_of_the_wrong_kind_are_a_named_error(entry, bad):
    """``seq_positions`` (the covariance losses' tie order under CP) is checked at every entry, with or without
    CP: an integer tensor of log_prob's shape on its device, else a ValueError naming it."""
    old = torch.tensor([[-1.0, -1.25, -0.75], [-0.25, -2.0, -1.0]])
    lp, adv, mask = old + 0.125, torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5]]), torch.ones(2, 3)
    positions = torch.arange(3).expand(2, 3)
    wrong = {"list": positions.tolist(), "float": positions.double(), "bool": positions > 0,
             "shape": positions[:, :2], "meta": positions.to("meta")}[bad]
    cfg = losses.PolicyLossConfig(loss_mode="kl_cov" if entry == "compute_policy_loss" else entry, kl_cov_ratio=0.5,
                                  clip_cov_ratio=0.5)
    fn = losses.compute_policy_loss if entry == "compute_policy_loss" else \
        getattr(losses, "compute_policy_loss_" + entry)
    with pytest.raises(ValueError, match="seq_positions must be an integer tensor"):
        fn(old, lp, adv, mask, "token-mean", cfg, seq_positions=wrong)
    fn(old, lp, adv, mask, "token-mean", cfg, seq_positions=positions)  # the right kind is taken


@pytest.mark.parametrize("backend_name", ["cpu", "fallback"])
@pytest.mark.parametrize("dtype, big", [(torch.float32, 200.0), (torch.float64, 1500.0)], ids=["fp32", "fp64"])
def test_geo_mean_sequence_value_overflow_is_a_named_error(backend_name, dtype, big):
    """Finite inputs whose GMPO sequence value exp(mean of the clipped log-ratios) overflows: a named error, as any
    undefined token loss of the kinds after Reinforce (before: an inf loss and NaN gradients)."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -2.0]], dtype=dtype)
    lp = torch.tensor([[-1.0 + big, -1.5], [-1.25, -2.0]], dtype=dtype)  # row 0: x = [big, -0.5], A < 0: unclipped
    adv = torch.tensor([[-1.0], [0.5]], dtype=dtype).expand(2, 2).contiguous()
    mask = torch.ones(2, 2, dtype=dtype)
    cfg = losses.PolicyLossConfig(loss_mode="geo_mean")
    with policy_loss_backend(backend_name):
        with pytest.raises(ValueError, match=r"geo_mean: sequence 0's value .*not finite"):
            losses.compute_policy_loss_geo_mean(old, lp, adv, mask, "token-mean", cfg)
        mask[0] = 0.0  # the row out of the loss: never read, a finite loss and gradient
        got = _run(losses.compute_policy_loss_geo_mean, old, lp, adv, mask, "token-mean", cfg, None)
        assert torch.isfinite(got[0]) and torch.isfinite(got[2]).all()


@pytest.mark.parametrize("backend_name", ["cpu", "fallback"])
def test_geo_mean_negative_is_weight_is_named(backend_name):
    """GMPO takes the geometric mean of the IS weights, exp(mean log(w + 1e-10)) (verl's): a weight below 0 (or NaN)
    under the mask has no log (verl's loss is NaN). Named as the weights' fault (was blamed on an exp overflow of the
    clipped log-ratios, with a torch warning from the message itself); a masked one is never read."""
    old = torch.full((2, 3), -1.0)
    lp = (old + torch.tensor([[0.1, -0.1, 0.05], [0.0, 0.2, -0.3]])).requires_grad_(True)
    adv = torch.tensor([[1.0], [-0.5]]).expand(2, 3).contiguous()
    mask = torch.ones(2, 3)
    cfg = losses.PolicyLossConfig(loss_mode="geo_mean")
    with policy_loss_backend(backend_name):
        for bad in (-0.5, math.nan):
            w = torch.ones(2, 3)
            w[1, 2] = bad
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(ValueError, match=r"geo_mean: sequence 1 has a rollout_is_weights value below 0"):
                    losses.compute_policy_loss_geo_mean(old, lp, adv, mask, "token-mean", cfg, w)
            m = mask.clone()
            m[1, 2] = 0.0
            loss, _ = losses.compute_policy_loss_geo_mean(old, lp, adv, m, "token-mean", cfg, w)
            assert torch.isfinite(loss)
        w = torch.ones(2, 3)
        w[0, 0] = 0.0  # a zero weight is a weight: log(1e-10), the sequence's loss all but 0
        loss, _ = losses.compute_policy_loss_geo_mean(old, lp, adv, mask, "token-mean", cfg, w)
        assert torch.isfinite(loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_matches_fp64(name, dtype):
    old, lp, adv, mask, w = (x.to(dtype) for x in _inputs(seed=6))
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, loss_mode=name, **KNOBS)
    fn = getattr(losses, "compute_policy_loss_" + name)
    want = _run(fn, old.double(), lp.double(), adv.double(), mask, "token-mean", cfg, w.double())
    got = _run(fn, old, lp, adv, mask, "token-mean", cfg, w)
    assert got[2].dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    assert torch.allclose(got[0].double(), want[0], rtol=tol, atol=tol), (got[0], want[0])
    assert torch.allclose(got[2].double(), want[2], rtol=tol, atol=tol * 0.1)


@pytest.mark.parametrize("kind, params, match", [
    ("SAPO", (0.0, 1.0), "SAPO's temperatures"),
    ("SAPO", (1.0, float("inf")), "SAPO's temperatures"),
    ("DRO", (0.0, 0.0), "DRO's beta"),
    # finite in fp64 but not in the fp32 the kernels compute in (or 4 / tau is not): tau_pos = 1e308 returned a
    # finite loss with NaN gradients (0 * inf), DRO's beta = 1e308 and tau = 1e-320 blamed a token (the config fuzz)
    ("SAPO", (1e308, 1.0), "SAPO's temperatures"),
    ("SAPO", (1.0, 1e-320), "SAPO's temperatures"),
    ("SAPO", (1e-38, 1.0), "SAPO's temperatures"),
    ("DRO", (1e308, 0.0), "DRO's beta"),
])
def test_op_refuses_bad_kind_parameters(backend, kind, params, match):
    from rollout_corr_ext import _layout as LY, ops

    old, lp, adv, mask, _ = _inputs(seed=1)
    with pytest.raises((RuntimeError, ValueError), match=match):
        ops.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.2, 3.0, getattr(LY, "PG_KIND_" + kind), None, *params)


@pytest.mark.parametrize("packed", [False, True])
def test_kl_cov_penalty_past_the_float_range_is_a_named_error(packed):
    """kl_cov's penalty ppo_kl_coef |x| on its selected tokens is a token loss: past the float range it is refused as
    the kernel refuses any other kind's (ppo_kl_coef = 1e308, inf in fp32, returned an inf loss and NaN gradients,
    silently; the config fuzz). A coefficient the compute type holds, whose product with |x| overflows, names the
    token."""
    g = torch.Generator().manual_seed(0)
    b, t = 3, 8
    lp = -torch.rand(b, t, generator=g) - 0.1
    old = lp - 2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = torch.ones(b, t)
    kw = {}
    if packed:
        lp, old, adv, mask = (x.reshape(-1) for x in (lp, old, adv, mask))
        kw = dict(cu_seqlens=torch.tensor([0, 8, 16, 24], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"ppo_kl_coef must be finite in the compute type \(torch.float32\)"):
        cfg = losses.PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.5, ppo_kl_coef=1e308)
        losses.compute_policy_loss_kl_cov(old, lp, adv, mask, "token-mean", cfg, **kw)
    cfg = losses.PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.5, ppo_kl_coef=3e38)
    at = r"\(\d+,\)" if packed else r"\(\d+, \d+\)"
    with pytest.raises(ValueError, match=r"penalty ppo_kl_coef \* \|log_prob - old_log_prob\| \* weight at "
                                         r"response token " + at + " is past the float range"):
        losses.compute_policy_loss_kl_cov(old, lp, adv, mask, "token-mean", cfg, **kw)
    # fp64 holds both: a finite loss and gradient
    loss, _, grad = _run(losses.compute_policy_loss_kl_cov, old.double(), lp.double(), adv.double(), mask,
                         "token-mean", cfg, None, **kw)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_dual_clip_bound_that_rounds_to_1_is_refused_in_the_compute_type(backend):
    """PPO's dual clip needs c > 1; 1 + 1e-8 passes that in Python but is exactly 1 in fp32, where an on-policy
    token with A < 0 ties the two branches and loses half its gradient (the knob fuzz). Refused as compared, in the
    compute type; fp64 inputs hold it (the full gradient)."""
    from rollout_corr_ext import _layout as LY, ops

    old, lp, adv, mask, _ = _inputs(seed=1)
    with pytest.raises((RuntimeError, ValueError), match=r"must be > 1 in the compute type .* got 1\.00000001"):
        ops.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.2, 1 + 1e-8, LY.PG_KIND_PPO_CLIP, None)
    cfg = losses.PolicyLossConfig(clip_ratio_c=1 + 1e-8)
    got = _run(losses.compute_policy_loss_vanilla, lp.double(), lp.double(), adv.double(), mask, "token-mean", cfg,
               None)
    want = _run(losses.compute_policy_loss_vanilla, lp.double(), lp.double(), adv.double(), mask, "token-mean",
                losses.PolicyLossConfig(clip_ratio_c=3.0), None)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)  # on-policy: no clip reached, the full gradient


@pytest.mark.parametrize("dtype, tau", [(torch.float64, 1e308), (torch.float64, 1e-300), (torch.float32, 1e38),
                                        (torch.float32, 2e-38), (torch.bfloat16, 1e38)], ids=str)
def test_sapo_temperatures_at_the_compute_types_ends_give_finite_values(backend, dtype, tau):
    """A temperature the compute type holds, with its 4 / tau: a finite loss and gradient (fp64 at tau = 1e308, which
    fp32 refuses above), and the 32- / 16-bit ones those of the fp64 inputs."""
    old, lp, adv, mask, _ = _inputs(seed=2, b=4, t=6)
    adv = adv * 1e-30 if tau < 1 else adv  # a gate of 2 / tau times A stays in range
    cfg = losses.PolicyLossConfig(loss_mode="sapo", tau_pos=tau, tau_neg=tau)
    mode = "seq-mean-token-mean"
    loss, _, grad = _run(losses.compute_policy_loss_sapo, *(x.to(dtype) for x in (old, lp, adv)), mask, mode, cfg,
                         None)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    if dtype != torch.float64:
        want = _run(losses.compute_policy_loss_sapo, old.double(), lp.double(), adv.double(), mask, mode, cfg, None)
        rtol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(loss.double(), want[0], rtol=rtol, atol=rtol * float(want[0].abs()))
        torch.testing.assert_close(grad.double(), want[2], rtol=rtol, atol=rtol * float(want[2].abs().max()))


@pytest.mark.parametrize("name", NAMES)
def test_front_door_picks_loss_mode(name):
    """compute_policy_loss with config.loss_mode is that loss; in the decoupled flow, with the correction's weights
    and mask."""
    import rollout_corr_ext as rc

    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=9))
    rlp = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0), dtype=old.dtype)
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, loss_mode=name, **KNOBS)
    fn = getattr(losses, "compute_policy_loss_" + name)
    got = _run(lambda o, x, a, m, mode, c, w: losses.compute_policy_loss(o, x, a, m, mode, c), old, lp, adv, mask,
               "token-mean", cfg, None)
    want = _run(fn, old, lp, adv, mask, "token-mean", cfg, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    corr = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.02, rollout_rs="token_k2",
                                      rollout_rs_threshold=0.0012)
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, loss_mode=name, rollout_correction=corr, **KNOBS)
    got = _run(lambda o, x, a, m, mode, c, w: losses.compute_policy_loss(o, x, a, m, mode, c, rollout_log_prob=rlp),
               old, lp, adv, mask, "token-mean", cfg, None)
    result = rc.compute_rollout_correction(old, rlp, mask, corr)
    kept = result.response_mask.sum() / mask.sum()
    assert 0.2 < kept < 0.95 and (result.weights[mask > 0] != 1).any()  # the correction is in play
    want = _run(fn, old, lp, adv, result.response_mask, "token-mean", cfg, result.weights)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert got[1]["rollout_corr/rollout_is_mean"] == result.metrics["rollout_corr/rollout_is_mean"]


def test_is_corrected_kl_is_unbiased_off_policy():
    """calculate_grpo_loss(kl_is_correction=True): on tokens drawn from pi_old, the mean of (pi / pi_old) k3 is
    KL(pi || pi_ref) (computed exactly over a small vocabulary), and its gradient is that of the exact KL; plain k3
    is biased there."""
    g = torch.Generator().manual_seed(0)
    v = 6
    logits, old_logits, ref_logits = (torch.randn(v, generator=g, dtype=torch.float64) for _ in range(3))
    n = 400000
    old_p = old_logits.softmax(-1)
    tokens = torch.multinomial(old_p, n, replacement=True, generator=g)
    z = logits.clone().requires_grad_(True)
    lp = z.log_softmax(-1)[tokens].reshape(1, n)
    old = old_logits.log_softmax(-1)[tokens].reshape(1, n)
    ref = ref_logits.log_softmax(-1)[tokens].reshape(1, n)
    adv = torch.zeros(1, dtype=torch.float64)
    out = losses.calculate_grpo_loss(lp, old, ref, adv, 0.2, 0.2, 1.0, 0.0, kl_is_correction=True)
    est = out[1].mean()
    (g_est,) = torch.autograd.grad(est, z)
    zz = logits.clone().requires_grad_(True)
    p, q = zz.softmax(-1), ref_logits.softmax(-1)
    exact = (p * (p.log() - q.log())).sum()
    (g_exact,) = torch.autograd.grad(exact, zz)
    assert abs(est.item() - exact.item()) < 0.01 * exact.item() + 1e-3
    assert torch.allclose(g_est, g_exact, atol=0.02 * g_exact.abs().max().item())
    plain = losses.calculate_grpo_loss(lp.detach(), old, ref, adv, 0.2, 0.2, 1.0, 0.0)[1].mean()
    assert abs(plain.item() - exact.item()) > 5 * abs(est.item() - exact.item())


@pytest.mark.parametrize("name", [n for n in losses.POLICY_LOSS_MODES if n not in ("vanilla", "bypass_mode")])
def test_front_door_refuses_a_loss_the_bypass_flow_would_ignore(name):
    """compute_policy_loss picks the bypass flow from config.rollout_correction, whose loss is its loss_type: a
    loss_mode naming another loss (gspo, cispo, ...) was run as PPO clip, silently (the same value for every name;
    the docs audit). It is a ValueError naming the caller, as make_policy_loss_func's at build time; the functions
    named for the bypass loss read the correction's fields only, as verl's does."""
    from rollout_corr_ext import RolloutCorrectionConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) - 0.1
    lp = old + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    ro = old + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    cfg = losses.PolicyLossConfig(loss_mode=name, rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip(),
                                  **(dict(dro_beta=0.5) if name == "dro" else {}))
    with pytest.raises(ValueError, match=rf"compute_policy_loss: the bypass flow's loss .* not loss_mode='{name}'"):
        losses.compute_policy_loss(old, lp, adv, mask, "seq-mean-token-mean", cfg, rollout_log_prob=ro)
    with pytest.raises(ValueError, match=rf"make_policy_loss_func: the bypass flow's loss .* not loss_mode='{name}'"):
        make_policy_loss_func(torch.zeros(3, 6, dtype=torch.long), adv, mask, rollout_log_prob=ro, config=cfg,
                              loss_agg_mode="seq-mean-token-mean")
    vanilla = dataclasses.replace(cfg, loss_mode="bypass_mode")
    want = losses.compute_policy_loss(old, lp, adv, mask, "seq-mean-token-mean", vanilla, rollout_log_prob=ro)
    got = losses.compute_policy_loss_bypass(ro, lp, adv, mask, "seq-mean-token-mean", cfg)
    assert torch.equal(got[0], want[0])


def test_covariance_losses_do_not_depend_on_the_thread_count():
    """clip_cov / kl_cov pick tokens by the sign and size of their covariances against the micro-batch means. Those
    means were full fp32 sums, which ATen splits over threads past 32768 elements: with one advantage over the batch
    its mean moved by an ulp between 1 and 2 threads, every covariance changed sign and other tokens were cut (loss
    1.3377 against 1.3059, 3,276 gradients different; the thread-count fuzz). The sums run in fixed blocks now
    (_checks.ordered_sum): loss, metrics and gradient are the same bits at every thread count."""
    from rollout_corr_ext import _checks

    g = torch.Generator().manual_seed(11)
    b, t = 40, 4096
    old = -torch.rand(b, t, generator=g) * 2 - 0.05
    lp = old + 0.05 * torch.randn(b, t, generator=g)
    adv = torch.full((b, t), -1.3)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[3, 1000:] = False
    threads = torch.get_num_threads()
    runs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for name, knobs in (("clip_cov", dict(clip_cov_ratio=0.02, clip_cov_lb=0.0)),
                                ("kl_cov", dict(kl_cov_ratio=0.02))):
                cfg = losses.PolicyLossConfig(loss_mode=name, **knobs)
                fn = getattr(losses, f"compute_policy_loss_{name}")
                runs.setdefault(name, []).append(_run(fn, old, lp, adv, mask, "token-mean", cfg, None))
            # one long row (micro-batch 1 at a long context): its row sums were split over the threads too
            one = losses.PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.02)
            w = torch.rand(1, 40_000, generator=torch.Generator().manual_seed(5)) + 0.25
            runs.setdefault("one_row", []).append(_run(losses.compute_policy_loss_kl_cov, old[:10].reshape(1, -1)[:, :40_000],
                                                       lp[:10].reshape(1, -1)[:, :40_000], adv[:10].reshape(1, -1)[:, :40_000],
                                                       w, "token-mean", one, None))
            # more sequences than one block: geo_mean's mean over them (the follow-up fuzz)
            gl = lp[:, :3000].reshape(40_000, 3)
            runs.setdefault("geo_mean", []).append(_run(
                losses.compute_policy_loss_geo_mean, old[:, :3000].reshape(40_000, 3), gl,
                torch.randn(40_000, 1, generator=torch.Generator().manual_seed(6)).expand(40_000, 3),
                torch.ones(40_000, 3, dtype=torch.bool), "token-mean", losses.PolicyLossConfig(loss_mode="geo_mean"),
                None))
            x = torch.randn(200_003, generator=torch.Generator().manual_seed(n)) if n == 1 else x
            runs.setdefault("sum", []).append(_checks.ordered_sum(x))
    finally:
        torch.set_num_threads(threads)
    for name in ("clip_cov", "kl_cov", "one_row", "geo_mean"):
        first = runs[name][0]
        for other in runs[name][1:]:
            assert torch.equal(first[0], other[0]) and torch.equal(first[2], other[2]), name
            assert all(torch.equal(first[1][k], other[1][k]) for k in first[1]), name
    assert all(torch.equal(runs["sum"][0], v) for v in runs["sum"][1:])


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_covariance_losses_give_a_bool_mask_the_bits_of_its_float_copy(name):
    """A bool response_mask is read as its bytes and taken as the valid set itself (no comparison); the masked
    sums convert to fp64 through one reused block (_checks.ordered_sum's ``buf``). Past one sum block (40,000
    tokens), a bool mask, contiguous or transposed, gives the loss, metrics and gradient of the same mask as fp32
    0 / 1 (which takes the comparison path); and ``buf`` gives ordered_sum's bits, within 1e-12 of an fp64 sum."""
    from rollout_corr_ext import _checks

    old, lp, adv, _, w = _inputs(b=8, t=5000, seed=21)
    lengths = torch.tensor([5000, 17, 4000, 1, 2500, 4999, 3000, 0])
    mask = torch.arange(5000).unsqueeze(0) < lengths.unsqueeze(1)
    cfg = losses.PolicyLossConfig(loss_mode=name, clip_cov_ratio=0.01, clip_cov_lb=0.0, kl_cov_ratio=0.01)
    fn = getattr(losses, "compute_policy_loss_" + name)
    tr = lambda t: t.t().contiguous().t()  # noqa: E731 - the same values, column-major
    want = _run(fn, old, lp, adv, mask.float(), "token-mean", cfg, w)
    for m in (mask, tr(mask)):
        got = _run(fn, old, lp, adv, m, "token-mean", cfg, w)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        for k, v in want[1].items():
            assert torch.equal(torch.as_tensor(got[1][k]), torch.as_tensor(v)), k
    assert mask.dtype == torch.bool and mask.sum() == lengths.sum()  # the input is not modified
    # the bytes are clamped: a bool viewed from uint8 data of 2 (undefined in torch, read as True by its ops) gives 1,
    # not 2 (clip_cov's cap doubled when the bytes were copied as they are)
    odd = (mask.to(torch.uint8) * 2).view(torch.bool)
    assert torch.equal(losses._in_dtype(odd, torch.float32, 0), mask.float())
    block = _checks.ORDERED_SUM_BLOCK
    buf = torch.empty(8 * block, dtype=torch.float64)
    for n in (block + 1, 8 * block, 9 * block + 7, 17 * block):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        x[n // 3] = math.nan
        for nan in (False, True):
            ref = _checks.ordered_sum(x, nan=nan, dtype=torch.float64)
            got = _checks.ordered_sum(x, nan=nan, dtype=torch.float64, buf=buf)
            assert torch.equal(got, ref) or (ref.isnan() and got.isnan()), (n, nan)
        exact = x.double().nansum()
        assert abs(float(got) - float(exact)) <= 1e-12 * float(x.double().abs().nansum())


KL_TYPES = list(losses.KL_PENALTY_TYPES) + ["k1+", "k3+", "low_var_kl+", "k2+", "abs+"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_penalty_matches_verl(kind, dtype):
    """rollout_corr_ext.verl.kl_penalty is verl's kl_penalty, value and gradient (logprob and ref_logprob), every
    estimator and its straight-through '+' form; log-ratios up to +-30 reach verl's clamps (20, and 10 on k3)."""
    core, _, _ = _verl()
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    lp = -torch.rand(5, 37, generator=g, dtype=torch.float64) * 3
    ref = lp + torch.randn(5, 37, generator=g, dtype=torch.float64) * 2
    ref[0, :4] = torch.tensor([lp[0, 0] + 30, lp[0, 1] - 30, lp[0, 2] + 3, lp[0, 3] - 25])
    lp, ref = lp.to(dtype), ref.to(dtype)
    x0, r0 = lp.clone(), ref.clone()
    got_in = [t.clone().requires_grad_(True) for t in (lp, ref)]
    want_in = [t.clone().requires_grad_(True) for t in (lp, ref)]
    got = rv.kl_penalty(got_in[0], got_in[1], kind)
    want = core.kl_penalty(want_in[0], want_in[1], kind)
    assert got.dtype == want.dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    up = torch.randn(got.shape, generator=g, dtype=torch.float64).to(dtype)
    for a, b in zip(torch.autograd.grad((got * up).sum(), got_in), torch.autograd.grad((want * up).sum(), want_in)):
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(lp, x0) and torch.equal(ref, r0)


@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
def test_kl_penalty_is_corrected_expectation_is_the_exact_kl(kind):
    """kl_penalty(..., old_log_prob=): E_{pi_old}[(pi / pi_old) k] = E_pi[k] = KL(pi || pi_ref) for k1 and k3,
    taken exactly over a small vocabulary (each token weighted by pi_old: no sampling), and its gradient is the
    exact KL's (the ratio is differentiated); the uncorrected estimate's expectation under pi_old is not the KL."""
    g = torch.Generator().manual_seed(1)
    v = 7  # logits of scale 0.4: k3 below verl's clamp at 10, where the estimate is not the formula
    logits, old_logits, ref_logits = (0.4 * torch.randn(v, generator=g, dtype=torch.float64) for _ in range(3))
    old = old_logits.log_softmax(-1)
    ref = ref_logits.log_softmax(-1)
    z = logits.clone().requires_grad_(True)
    lp = z.log_softmax(-1)
    est = (old.exp() * rv.kl_penalty(lp, ref, kind, old_log_prob=old)).sum()
    (g_est,) = torch.autograd.grad(est, z)
    zz = logits.clone().requires_grad_(True)
    p, q = zz.softmax(-1), ref_logits.softmax(-1)
    exact = (p * (p.log() - q.log())).sum()
    (g_exact,) = torch.autograd.grad(exact, zz)
    torch.testing.assert_close(est, exact.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_est, g_exact, rtol=1e-10, atol=1e-12)
    plain = (old.exp() * rv.kl_penalty(lp.detach(), ref, kind)).sum()
    assert abs(plain.item() - exact.item()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kl_penalty_is_corrected_matches_the_formula(dtype):
    """The IS-corrected value exp(clamp(lp - old, -20, 20)) * k against an fp64 oracle written from the formula
    (Schulman's k3 with verl's clamps), the gradient too; 16-bit inputs are computed in fp32 and rounded once."""
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(4, 33, generator=g, dtype=torch.float64) * 4
    old = lp + torch.randn(4, 33, generator=g, dtype=torch.float64)
    ref = lp + torch.randn(4, 33, generator=g, dtype=torch.float64)
    old[0, 0], ref[0, 1] = lp[0, 0] - 25, lp[0, 1] + 22  # the ratio's clamp, k3's clamps
    lp, old, ref = (t.to(dtype).double() for t in (lp, old, ref))  # representable in dtype
    x = lp.to(dtype).requires_grad_(True)
    got = rv.kl_penalty(x, ref.to(dtype), "k3", old_log_prob=old.to(dtype))
    xx = lp.clone().requires_grad_(True)
    d = (ref - xx).clamp(-20, 20)
    want = torch.exp((xx - old).clamp(-20, 20)) * (d.exp() - d - 1).clamp(-10, 10)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-6)
    else:  # fp32 math rounded once
        torch.testing.assert_close(got, want.detach().float().to(dtype), rtol=0, atol=0)
    (g_got,) = torch.autograd.grad(got.float().sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), xx)
    torch.testing.assert_close(g_got.double(), g_want.to(dtype).double(), rtol=1e-6 if dtype == torch.float32 else 0,
                               atol=1e-6 if dtype == torch.float32 else 0)


def test_kl_penalty_bad_input():
    lp = -torch.rand(2, 3)
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        rv.kl_penalty(lp, lp, "full")
    with pytest.raises(TypeError, match="kl_penalty must be a str"):
        rv.kl_penalty(lp, lp, 3)
    with pytest.raises(ValueError, match="ref_logprob must have the shape"):
        rv.kl_penalty(lp, lp[:, :2], "k3")
    with pytest.raises(ValueError, match="old_log_prob must have the shape"):
        rv.kl_penalty(lp, lp, "k3", old_log_prob=lp[:1])
    with pytest.raises(TypeError, match="old_log_prob must be a floating-point"):
        rv.kl_penalty(lp, lp, "k3", old_log_prob=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="already makes the gradient unbiased; pass 'k3'"):
        rv.kl_penalty(lp, lp, "k3+", old_log_prob=lp)
    # pi_old is a constant: old_log_prob=log_prob (on-policy) with its graph gave plain k3's gradient, silently
    x = lp.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="kl_penalty: old_log_prob requires grad"):
        rv.kl_penalty(x, lp, "k3", old_log_prob=x)
    (g,) = torch.autograd.grad(rv.kl_penalty(x, lp - 0.3, "k3", old_log_prob=x.detach()).sum(), x)
    torch.testing.assert_close(g, 1 - torch.exp(torch.tensor(-0.3)) + (torch.exp(torch.tensor(-0.3)) + 0.3 - 1)
                               * torch.ones_like(g))


# ----------------------------------------------------------------------------------------- Megatron-LM packed GRPO


@pytest.mark.parametrize("correction", [None, "seq"])
def test_grpo_packed_signature_equals_unpacked(correction):
    """calculate_grpo_loss(..., seq_starts, seq_lengths) on a Megatron-LM bin ([1, bin], one advantage per sequence,
    log-probs one shorter than each sequence, gaps between sequences) equals the unpacked [B, T] call token by token:
    loss, kl, ratios, gradient; with a sequence-level rollout correction each sequence is its own segment."""
    import rollout_corr_ext as rc

    g = torch.Generator().manual_seed(3)
    # sequence lengths; each has length - 1 log-probs (none for 0 and 1: a 0 once cut the sequence before it)
    lengths = [6, 0, 2, 9, 1, 4]
    starts, pos = [], 1
    for ln in lengths:
        starts.append(pos)
        pos += ln + 1  # one padding position after each sequence's last token
    size = pos + 2
    n, t = len(lengths), max(lengths) - 1
    cur, old, ref, inf = (torch.randn(1, size, generator=g, dtype=torch.float64) * 0.2 - 1.5 for _ in range(4))
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    pad = {k: torch.zeros(n, t, dtype=torch.float64) for k in ("cur", "old", "ref", "inf")}
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i, (s, ln) in enumerate(zip(starts, lengths)):
        m = max(ln - 1, 0)
        for k, v in (("cur", cur), ("old", old), ("ref", ref), ("inf", inf)):
            pad[k][i, :m] = v[0, s:s + m]
        mask[i, :m] = True
    kw = {}
    if correction:
        kw = dict(rollout_correction=rc.RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=3.0,
                                                                rollout_rs="seq_mean_k3", rollout_rs_threshold=0.02))
    x = cur.clone().requires_grad_(True)
    got = losses.calculate_grpo_loss(x, old, ref, adv, 0.2, 0.28, 0.05, 0.01, inf if correction else None, None,
                                     starts, lengths, **kw)
    got[0].sum().backward()
    y = pad["cur"].clone().requires_grad_(True)
    want = losses.calculate_grpo_loss(y, pad["old"], pad["ref"], adv, 0.2, 0.28, 0.05, 0.01,
                                      pad["inf"] if correction else None, None, response_mask=mask, **kw)
    (want[0] * mask).sum().backward()
    for i, (s, ln) in enumerate(zip(starts, lengths)):
        m = max(ln - 1, 0)
        sl = slice(s, s + m)
        for k in (0, 1, 2, 3):
            assert torch.allclose(got[k][0, sl], want[k][i, :m], rtol=1e-12, atol=1e-14), (k, i)
        assert torch.allclose(x.grad[0, sl], y.grad[i, :m], rtol=1e-12, atol=1e-14)
        if correction:
            assert torch.equal(got[6].response_mask[sl] != 0, want[6].response_mask[i, :m] != 0)
            assert torch.allclose(got[6].weights[sl], want[6].weights[i, :m].to(got[6].weights.dtype))
    outside = torch.ones(size, dtype=torch.bool)
    for s, ln in zip(starts, lengths):
        outside[s:s + max(ln - 1, 0)] = False
    assert (got[0][0, outside] == 0).all() and (x.grad[0, outside] == 0).all()  # outside every sequence
    if correction:  # the sequence-level RS decided per sequence, some kept and some not
        kept = [bool(want[6].response_mask[i, 0]) for i in range(n) if lengths[i] > 1]
        assert any(kept) and not all(kept), kept
    # Megatron-LM's trainer passes seq_starts as its packer builds them, with the bin's padded end as a last entry
    # (megatron/rl/sequence_packing_utils.py: pack_sequences appends it, get_packed_seq_params asserts n + 1 entries;
    # its calculate_grpo_loss zips it away): the same call (was refused: the Megatron-LM check)
    for sentinel in (pos, size + 1, starts[-1] + lengths[-1]):
        x2 = cur.clone().requires_grad_(True)
        again = losses.calculate_grpo_loss(x2, old, ref, adv, 0.2, 0.28, 0.05, 0.01, inf if correction else None,
                                           None, starts + [sentinel], lengths, **kw)
        again[0].sum().backward()
        for k in range(6):
            assert torch.equal(again[k], got[k]), k
        assert torch.equal(x2.grad, x.grad)


@pytest.mark.parametrize("kl_is_correction", [False, True])
@pytest.mark.parametrize("correction", [None, "token"])
def test_grpo_masked_tokens_are_never_read(correction, kl_is_correction):
    """-inf / NaN in current_logprobs or ref_logprobs at a masked token (response_mask 0, outside every packed
    sequence) reaches neither the loss nor the gradient: 0 there, and every other token as in the clean call
    (before: NaN in both, through the KL and entropy terms)."""
    import rollout_corr_ext as rc

    g = torch.Generator().manual_seed(9)
    lp, old, ref, inf = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 0.2 - 1.2 for _ in range(4))
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) > 0.3
    kw = dict(response_mask=mask, kl_is_correction=kl_is_correction)
    if correction:
        kw["rollout_correction"] = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)

    def run(cur, ref_):
        x = cur.clone().requires_grad_(True)
        out = losses.calculate_grpo_loss(x, old, ref_, adv, 0.2, 0.28, 0.05, 0.01, inf, None, **kw)
        out[0].sum().backward()
        return out, x.grad

    clean, clean_grad = run(lp, ref)
    for bad in (-math.inf, math.nan):
        for which in ("cur", "ref"):
            cur, ref_ = lp.clone(), ref.clone()
            (cur if which == "cur" else ref_)[~mask] = bad
            out, grad = run(cur, ref_)
            assert torch.equal(out[0], clean[0]) and torch.equal(grad, clean_grad), (bad, which)
            assert bool((out[0][~mask] == 0).all()) and bool((grad[~mask] == 0).all())
            assert torch.equal(out[1], clean[1]) and torch.equal(out[3], clean[3])  # kl, entropy terms: 0 there


def test_grpo_packed_refuses_overlap_and_mismatch():
    lp = torch.zeros(1, 10, dtype=torch.float64)
    adv = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="overlaps"):
        losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, [0, 2], [5, 3])
    with pytest.raises(ValueError, match="both seq_starts and seq_lengths"):
        losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, [0, 5])
    with pytest.raises(ValueError, match="one value per packed sequence"):
        losses.calculate_grpo_loss(lp, lp, lp, adv[:1], 0.2, 0.2, 0.0, 0.0, None, None, [0, 5], [4, 4])
    # offsets that are not integers were truncated by int() (4.7 -> 4, "4" -> 4): another layout, silently
    bad = {"seq_starts": ([0.5, 4.7], [3, 3]), "seq_lengths": (torch.tensor([0, 4]), torch.tensor([3.0, 3.9]))}
    bad["seq_starts[1]"] = ([0, "4"], [3, 3])
    bad["seq_starts must be a list or a 1-D"] = (torch.tensor([[0, 4]]), [3, 3])
    for what, (starts, lengths) in bad.items():
        with pytest.raises(ValueError, match=re.escape(what)):
            losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, starts, lengths)
    out = losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, torch.tensor([0, 5],
                                     dtype=torch.int32), (5, 5))  # int32 tensors and tuples are integers
    assert out[0].shape == (1, 10)
    # a sequence whose log-probs run past the bin was cut short, one that starts past it dropped, silently (the
    # config fuzz); one ending exactly at the bin's end is whole
    for starts, lengths in (([0, 5], [5, 7]), ([0, 12], [5, 3]), ([0, 5], [5, 2 ** 62]), ([0, 11], [5, 1])):
        with pytest.raises(ValueError, match=r"packed sequence 1 .* runs past the bin"):
            losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, starts, lengths)
    # Megatron's log-probs are [1, bin_size - 1]: a sequence may end at token 11 of these 10 log-probs, and one of
    # length 0 may start there (the review: a full bin followed by empty sequences)
    losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, [0, 5], [5, 6])
    adv3 = torch.zeros(3, dtype=torch.float64)
    losses.calculate_grpo_loss(lp, lp, lp, adv3, 0.2, 0.2, 0.0, 0.0, None, None, [0, 5, 11], [5, 6, 0])
    # Megatron-LM's padded-end sentinel: one entry more, at or past the last sequence's end and within the bin;
    # an empty bin is [] and [] (Megatron's empty-bin entry), or [end] and []
    losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, [0, 5, 11], [5, 6])
    for starts in ([0, 5, 9], [0, 5, 12], [0, 5, -1]):
        with pytest.raises(ValueError, match=r"seq_starts has one entry more than seq_lengths \(2\): its last, "
                                             r"-?[0-9]+, must be the bin's padded end"):
            losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, starts, [5, 6])
    with pytest.raises(ValueError, match=r"seq_starts has 4 entries but seq_lengths has 2 \(one start per sequence, "
                                         r"or with Megatron-LM's padded-end sentinel one more\)"):
        losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.0, None, None, [0, 5, 8, 11], [5, 3])
    empty = torch.zeros(0, dtype=torch.float64)
    for starts in ([], [0], [11]):
        out = losses.calculate_grpo_loss(lp, lp, lp, empty, 0.2, 0.2, 0.0, 0.0, None, None, starts, [])
        assert (out[0] == 0).all()


def test_grpo_entropy_term_is_the_entropy():
    """entropy_term is H = -p log p >= 0, the loss subtracting entropy_weight H, as Megatron-LM's
    calculate_grpo_loss returns it since "Fix the entropy sign" (core 0.16; megatron/rl/rl_utils.py): it returned
    p log p here, the sign of 0.15, so a trainer logging rl/entropy_term read a negative entropy (the loss was the
    same; the Megatron-LM check). Oracle: the formula in fp64."""
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    out = losses.calculate_grpo_loss(lp, lp, lp, adv, 0.2, 0.2, 0.0, 0.5)
    p = lp.exp()
    torch.testing.assert_close(out[3], -p * lp, rtol=1e-14, atol=0)
    assert (out[3] > 0).all()
    # ratio 1, KL 0: the loss is -A - 0.5 H
    torch.testing.assert_close(out[0], -adv[:, None].expand_as(lp) - 0.5 * (-p * lp), rtol=1e-14, atol=1e-15)


def test_grpo_numbers_are_real_numbers_named():
    """calculate_grpo_loss's numbers take what a real number is (int, float, numpy scalars, Fraction) and refuse the
    rest naming the argument: is_truncation_coef read np.bool_(True) as 1, raised raw torch errors for 1e308 (a
    cap past fp32), Decimal and str; an int past the float range was a bare OverflowError everywhere (the config
    fuzz)."""
    import fractions

    import numpy as np

    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(3, 5, generator=g)
    inf_lp = lp - 0.3 * torch.rand(3, 5, generator=g)
    adv = torch.randn(3, generator=g)

    def run(**kw):
        args = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.2, kl_beta=0.0, entropy_weight=0.0,
                    inference_logprobs=inf_lp)
        args.update(kw)
        return losses.calculate_grpo_loss(lp, lp + 0.01, lp, adv, **args)[0]

    for bad in (True, np.bool_(True), "0.5", 0.0, -1.0, float("nan")):
        with pytest.raises((TypeError, ValueError), match="is_truncation_coef"):
            run(is_truncation_coef=bad)
    for name in ("is_truncation_coef", "kl_beta", "clamp_eps_lower"):
        with pytest.raises(ValueError, match=f"{name} must be a finite real number, got an integer of 1329 bits"):
            run(**{name: 10 ** 400})
    assert torch.equal(run(is_truncation_coef=np.float32(0.5)), run(is_truncation_coef=0.5))
    assert torch.equal(run(is_truncation_coef=fractions.Fraction(1, 2)), run(is_truncation_coef=0.5))
    assert torch.equal(run(is_truncation_coef=1e308), run(is_truncation_coef=math.inf))  # truncates nothing
    # an IS weight that overflows (inference log-prob -100 under an old one near 0) is refused with any cap past
    # the dtype's range, as without a cap (a clamp to fp32's max had made it finite: the review)
    far = inf_lp.clone()
    far[0, 2] = -100.0
    for coef in (None, math.inf, 1e308):
        with pytest.raises(ValueError, match=r"policy loss undefined at response token \(0, 2\)"):
            losses.calculate_grpo_loss(lp, lp + 0.01, lp, adv, 0.2, 0.2, 0.0, 0.0, far, coef)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grpo_terms_past_the_compute_types_range_are_named(dtype):
    """calculate_grpo_loss forms its KL and entropy terms in fp32 below fp64 inputs: kl_beta = 1e308 (inf there)
    returned an inf loss, silently, and a finite kl_beta whose product with a finite KL overflows did too; both are
    refused, naming the argument or the token. fp64 holds 1e308 itself; an infinite KL (pi = 0 under pi_ref > 0) is
    its limit and stays inf (tests/test_losses.py)."""
    g = torch.Generator().manual_seed(4)
    lp = (-torch.rand(2, 6, generator=g) - 0.1).to(dtype)
    old = lp + 0.05
    ref = (lp.float() + 0.1 * torch.randn(2, 6, generator=g)).to(dtype)
    adv = torch.randn(2, generator=g)
    for name in ("kl_beta", "entropy_weight"):
        args = dict(dict(kl_beta=0.0, entropy_weight=0.0), **{name: -1e308})
        with pytest.raises(ValueError, match=rf"{name} must be finite in the compute type \(torch.float32\)"):
            losses.calculate_grpo_loss(lp, old, ref, adv, 0.2, 0.2, **args)
        out = losses.calculate_grpo_loss(lp.double(), old.double(), ref.double(), adv, 0.2, 0.2,
                                         **dict(args, **{name: 1e300}))
        assert torch.isfinite(out[0]).all()
    far = ref.clone()
    far[1, 3] = 30.0  # k3 = e^(30 - lp) - ...: about 1e13, finite; times 1e30 past fp32
    with pytest.raises(ValueError, match=r"kl_beta \* the KL term is past the float range at response token \(1, 3\)"):
        losses.calculate_grpo_loss(lp, old, far, adv, 0.2, 0.2, 1e30, 0.0)


def test_grpo_entropy_gradient_at_a_huge_weight_is_the_fp64_one():
    """The entropy term's gradient w p (log p + 1) is formed from w p: autograd's chain through p formed w log p
    first, -5e38 at w = 1e38 and log p = -5, so the fp32 gradient was -inf where fp64's is -2.7e36 (the knob
    fuzz). Oracle: the formula in fp64; a masked-out -inf log-prob stays without gradient."""
    lp = torch.tensor([[-5.0, -0.3, -1.7, -math.inf]])
    mask = torch.tensor([[1, 1, 1, 0]])
    for w in (1e38, -3e37, 0.01):
        x = lp.clone().requires_grad_()
        out = losses.calculate_grpo_loss(x, lp.clamp(min=-50), lp.clamp(min=-50), torch.tensor([0.0]), 0.2, 0.2, 0.0,
                                         w, response_mask=mask)
        out[0].sum().backward()
        d = lp[0, :3].double()
        want = w * d.exp() * (d + 1)  # d/dlp of w e^lp lp (the advantage is 0: no policy-gradient term)
        torch.testing.assert_close(x.grad[0, :3].double(), want, rtol=1e-6, atol=0)
        assert x.grad[0, 3] == 0
        torch.testing.assert_close(out[0][0, :3].double(), w * d.exp() * d, rtol=1e-6, atol=0)
        # the value is -entropy_weight * entropy_term bit for bit (Megatron's form, entropy_term = -p log p; A = 0:
        # the PPO term is -0)
        assert torch.equal(out[0][0, :3], (-w * out[3])[0, :3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_clip_cov_clip_bounds_past_the_compute_types_range(dtype):
    """clip_cov clamps its ratios in the compute type: a clip_ratio_high of 1e39 (no upper bound) raised torch's raw
    "cannot be converted to type float without overflow" (the other losses run); it is the loss with a bound no
    ratio reaches (the knob fuzz)."""
    old, lp, adv, mask, _ = (x.to(dtype) if i < 3 else x for i, x in enumerate(_inputs(seed=3)))
    knobs = dict(loss_mode="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    for name in ("clip_ratio_high", "clip_ratio_low", "clip_ratio"):
        big = losses.PolicyLossConfig(**knobs, **{name: 1e39})
        far = losses.PolicyLossConfig(**knobs, **{name: 1e30})
        got = _run(losses.compute_policy_loss_clip_cov, old, lp, adv, mask, "token-mean", big, None)
        want = _run(losses.compute_policy_loss_clip_cov, old, lp, adv, mask, "token-mean", far, None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), name


# ----------------------------------------------------------------------------------------- off-policy sequence masking


def _opsm_oracle(lp, beh, adv, mask, delta):
    """DeepSeek-V3.2: M_i = 0 iff A_i < 0 and (1/|o_i|) sum_t log(pi_old / pi_theta) > delta; one sequence at a time."""
    keep = []
    for b in range(lp.shape[0]):
        m = mask[b] > 0
        if not m.any():
            keep.append(True)
            continue
        kl = float((beh[b][m] - lp[b][m]).mean())
        keep.append(not (float(adv[b][m].mean()) < 0 and kl > delta))
    return torch.tensor(keep)


@pytest.mark.parametrize("packed", [False, True])
def test_opsm_decides_per_sequence(packed):
    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=12))
    beh = lp + torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype) * 0.3
    delta = 0.15
    keep = _opsm_oracle(lp, beh, adv, mask, delta)
    if not packed:
        got, frac = losses.off_policy_sequence_mask(lp, beh, adv, mask, delta)
        assert torch.equal(got, mask * keep.unsqueeze(-1).double())
    else:
        lengths = torch.full((lp.shape[0],), lp.shape[1])
        cu = torch.zeros(lp.shape[0] + 1, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        got, frac = losses.off_policy_sequence_mask(lp.reshape(-1), beh.reshape(-1), adv.reshape(-1), mask.reshape(-1),
                                                    delta, cu_seqlens=cu)
        assert torch.equal(got.reshape(mask.shape), mask * keep.unsqueeze(-1).double())
    rows = mask.sum(-1) > 0
    assert 0 < (~keep[rows]).sum() < rows.sum()  # some sequences dropped, not all
    assert float(frac) == pytest.approx(float((~keep[rows]).sum()) / float(rows.sum()))


def test_opsm_through_the_front_door():
    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=12))
    rlp = lp + torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype) * 0.3
    cfg = losses.PolicyLossConfig(loss_mode="cispo", opsm_delta=0.15)
    got = _run(lambda o, x, a, m, mode, c, w: losses.compute_policy_loss(o, x, a, m, mode, c, rollout_log_prob=rlp),
               old, lp, adv, mask, "token-mean", cfg, None)
    masked, frac = losses.off_policy_sequence_mask(lp, rlp, adv, mask, 0.15)
    want = _run(losses.compute_policy_loss_cispo, old, lp, adv, masked, "token-mean",
                dataclasses.replace(cfg, opsm_delta=None), None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert got[1]["actor/opsm_masked_frac"] == frac


OPSM_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
               "cispo")


@pytest.mark.parametrize("name", OPSM_LOSSES)
def test_opsm_delta_is_honoured_by_every_loss_on_its_own(name):
    """A config with opsm_delta given to compute_policy_loss_<name> directly (as verl's registry and our verl
    adapter call it) masks the drifted negative-advantage sequences with old_log_prob as the behaviour policy:
    equal to the loss on the oracle's mask without opsm_delta; never silently ignored."""
    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=12))
    old = lp + torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype) * 0.3
    keep = _opsm_oracle(lp, old, adv, mask, 0.15)
    assert bool((~keep).any())
    cfg = dataclasses.replace(losses.PolicyLossConfig.from_dict(_actor(name)), opsm_delta=0.15)
    fn = getattr(losses, "compute_policy_loss_" + name)
    mode = "seq-mean-token-mean" if name in ("gspo", "sapo") else "token-mean"
    got = _run(fn, old, lp, adv, mask, mode, cfg, None)
    want = _run(fn, old, lp, adv, mask * keep.unsqueeze(-1).double(), mode, dataclasses.replace(cfg, opsm_delta=None),
                None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    rows = mask.sum(-1) > 0
    assert float(got[1]["actor/opsm_masked_frac"]) == pytest.approx(float((~keep[rows]).sum()) / float(rows.sum()))
    verl_got = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, mode, cfg, None)  # the verl adapter too
    assert torch.equal(verl_got[0], want[0]) and "actor/opsm_masked_frac" in verl_got[1]


def _opsm_cp_worker(rank, world, lp, beh, adv, mask):
    import torch.distributed as dist

    t = lp.shape[1]
    cols = slice(0, t // 2) if rank == 0 else slice(t // 2, t)
    want, _ = losses.off_policy_sequence_mask(lp, beh, adv, mask, 0.15)
    got, _ = losses.off_policy_sequence_mask(*(x[:, cols].contiguous() for x in (lp, beh, adv, mask)), 0.15,
                                             seq_group=dist.group.WORLD)
    assert torch.equal(got, want[:, cols])


@pytest.mark.parametrize("device", dist_params(2))
def test_opsm_context_parallel_equals_one_process(device):
    old, lp, adv, mask, _ = (x.double() for x in _inputs(seed=12))
    beh = lp + torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype) * 0.3
    run_workers(_opsm_cp_worker, 2, lp, beh, adv, mask, device=device)


def test_megatron_micro_batches_pool_opsm_and_refuse_weighted_token_mean():
    """Over micro-batches (megatron sums each [sum, count] pair), actor/opsm_masked_frac is the pooled fraction of
    dropped sequences (before: [frac, 1], the mean of the micro-batches' fractions); token-mean with a fractional
    mask is refused by name (num_tokens is a count: the sum over micro-batches would weight each by its token count,
    not its mask's sum), seq-mean modes take it."""
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    g = torch.Generator().manual_seed(4)
    b, s, v = 4, 6, 9
    logits = torch.randn(s, b, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    with torch.no_grad():
        lp = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    beh = lp + torch.tensor([0.5, 0.0, 0.0, 0.0], dtype=torch.float64).unsqueeze(1)  # row 0 drifted
    adv = torch.tensor([-1.0, 0.5, -0.3, 0.2], dtype=torch.float64)
    mask = torch.ones(b, s, dtype=torch.bool)
    cfg = losses.PolicyLossConfig(opsm_delta=0.1)

    def report(rows):  # pi_old = beh: the behaviour policy of OPSM
        f = make_policy_loss_func(target[rows], adv[rows], mask[rows], old_log_prob=beh[rows], config=cfg)
        return f(logits[:, rows])[2]

    key = "actor/opsm_masked_frac"
    assert reported_means(report(slice(None)))[key] == pytest.approx(0.25)  # 1 of 4 sequences
    assert reported_means([report(slice(0, 1)), report(slice(1, None))])[key] == pytest.approx(0.25)  # not 0.5
    weighted = torch.ones(b, s, dtype=torch.float64)
    weighted[1] = 0.25
    with pytest.raises(ValueError, match=r"response_mask at \(1, 0\) is 0.25.*token-mean"):
        make_policy_loss_func(target, adv, weighted, old_log_prob=lp)
    make_policy_loss_func(target, adv, weighted, old_log_prob=lp, loss_agg_mode="seq-mean-token-mean")(logits)


# ----------------------------------------------------------------------------------------- megatron's loss_func


@pytest.mark.parametrize("mode,opsm", [("token-mean", None), ("seq-mean-token-mean", None),
                                       ("seq-mean-token-sum", None), ("token-mean", 0.1),
                                       ("seq-mean-token-mean", 0.1)])
@pytest.mark.parametrize("name", NAMES)
def test_megatron_loss_func_runs_every_loss(name, mode, opsm):
    """make_policy_loss_func(config.loss_mode=name) on [s, b, V] logits: loss_sum / num_tokens and the gradient in
    the logits equal compute_policy_loss_<name> on the log-probs (plain torch log_softmax of the same logits);
    with opsm_delta, both mask the same sequences (behaviour: old_log_prob)."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    if opsm is not None and name == "sapo" and mode != "seq-mean-token-mean":
        return
    if name == "sapo" and mode != "seq-mean-token-mean":
        cfg = losses.PolicyLossConfig(loss_mode="sapo")
        with pytest.raises(ValueError, match="seq-mean-token-mean"):
            make_policy_loss_func(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2), torch.ones(2, 3),
                                  config=cfg, loss_agg_mode=mode)
        return
    g = torch.Generator().manual_seed(len(name))
    b, s, v = 4, 9, 11
    logits = torch.randn(s, b, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.2).double()
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    with torch.no_grad():
        old = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        old = old + 0.2 * torch.randn(b, s, generator=g, dtype=torch.float64)
        if opsm is not None:
            old[::2] += 0.3  # rows 0, 2 drifted: OPSM drops those of them with a negative advantage
            adv[0], adv[2] = -abs(adv[0]), abs(adv[2])
    cfg = losses.PolicyLossConfig(clip_ratio=0.2, loss_mode=name, opsm_delta=opsm, **KNOBS)
    x = logits.clone().requires_grad_(True)
    loss_sum, count, report = make_policy_loss_func(target, adv, mask, old_log_prob=old, config=cfg,
                                                    loss_agg_mode=mode)(x)
    if opsm is not None:
        frac = report["actor/opsm_masked_frac"]
        assert 0 < float(frac[0] / frac[1]) < 1  # the case masks some sequences, not all
    (loss_sum / count).backward()
    y = logits.clone().requires_grad_(True)
    lp = y.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    want, metrics = getattr(losses, "compute_policy_loss_" + name)(old, lp, adv.view(-1, 1).expand(b, s), mask, mode,
                                                                   cfg)
    want.backward()
    assert torch.allclose(loss_sum / count, want, rtol=1e-10, atol=1e-12), (loss_sum / count, want)
    assert torch.allclose(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    if name != "gpg":  # verl's gpg logs no metrics
        kl = report["actor/ppo_kl"]
        assert float(kl[0] / kl[1]) == pytest.approx(float(metrics["actor/ppo_kl"]), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("flow", ["bypass", "decoupled"])
def test_one_policy_step_behind_the_front_door_and_megatron(flow, loss_type):
    """compute_policy_loss and make_policy_loss_func run the one policy_step: with a correction whose RS and batch
    normalisation see every sequence and OPSM dropping a drifted sequence after it (in every flow), the loss, the
    gradient and every metric agree (bypass used to mask before correcting behind the front door only)."""
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    if flow == "decoupled" and loss_type == "reinforce":
        return
    g = torch.Generator().manual_seed(5)
    b, s, v = 6, 10, 13
    logits = torch.randn(s, b, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.float64)
    adv = torch.ones(b, dtype=torch.float64)
    adv[0] = -1.0
    with torch.no_grad():
        lp = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        old = lp + 0.05 * torch.randn(b, s, generator=g, dtype=torch.float64)
        rlp = old + 0.05 * torch.randn(b, s, generator=g, dtype=torch.float64)
        rlp[0] += 0.18  # sequence 0 drifted (within RS bounds) with a negative advantage: OPSM drops it
        rlp[5] -= 0.4  # sequence 5 is rejected by the geometric RS
    rc = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True,
                                 rollout_rs="geometric", rollout_rs_threshold="0.8_1.25",
                                 bypass_mode=flow == "bypass", loss_type=loss_type)
    cfg = losses.PolicyLossConfig(rollout_correction=rc, opsm_delta=0.1)
    x = logits.clone().requires_grad_(True)
    loss_sum, count, report = make_policy_loss_func(target, adv, mask, old_log_prob=old, rollout_log_prob=rlp,
                                                    config=cfg)(x)
    (loss_sum / count).backward()
    y = logits.clone().requires_grad_(True)
    lp_y = y.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    step = losses.policy_step(cfg, old, lp_y, adv.view(-1, 1).expand(b, s), mask, rollout_log_prob=rlp)
    want, metrics = losses.compute_policy_loss(old, lp_y, adv.view(-1, 1).expand(b, s), mask, "token-mean", cfg,
                                               rollout_log_prob=rlp)
    want.backward()
    assert step.flow == flow and torch.equal(step.loss, want) and step.metrics.keys() == metrics.keys()
    assert float(metrics["actor/opsm_masked_frac"]) == pytest.approx(1 / 5)  # of the 5 sequences RS kept
    assert float(step.mask[5].sum()) == 0 and float(step.mask[0].sum()) == 0
    assert torch.allclose(loss_sum / count, want, rtol=1e-12, atol=1e-14)
    assert torch.allclose(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    means = reported_means(report)
    for k, val in metrics.items():
        assert means[k] == pytest.approx(float(val), rel=1e-6, abs=1e-9), k


def test_megatron_loss_func_geo_mean_refuses_entropy():
    from rollout_corr_ext.megatron import make_policy_loss_func

    cfg = losses.PolicyLossConfig(loss_mode="geo_mean")
    with pytest.raises(ValueError, match="entropy_coeff=0"):
        make_policy_loss_func(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2), torch.ones(2, 3), config=cfg,
                              entropy_coeff=0.01)


# ----------------------------------------------------------------------------------------- two-sided truncated IS


@pytest.mark.parametrize("device", ["cpu", "emulated", "fallback"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_two_sided_tis_clamps_both_ways(device, level):
    """rollout_is_mode="two_sided": w = clamp(rho, L, U) at every level (rho per token, or per sequence: the product
    / geometric mean of the token ratios), fp64 oracle; the one-sided TIS of the same config is min(rho, U)."""
    import rollout_corr_ext as rc
    from rollout_corr_testing.backends import ops_on

    g = torch.Generator().manual_seed(2)
    b, t = 6, 14
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    rlp = lp + (0.6 if level == "token" else 0.05) * torch.randn(b, t, generator=g, dtype=torch.float64)
    if level != "token":  # per-row drifts that put some sequences below L and some above U
        rlp = rlp + torch.linspace(-0.8, 0.8, b, dtype=torch.float64).unsqueeze(-1) / (t if level == "sequence" else 1)
    mask = torch.rand(b, t, generator=g) > 0.2
    lower, upper = 0.7, 1.6
    cfg = rc.RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=upper, rollout_is_mode="two_sided",
                                     rollout_is_threshold_lower=lower, rollout_rs=None)
    log_rho = torch.where(mask, lp - rlp, torch.zeros_like(lp))
    if level == "token":
        rho = log_rho.exp()
    else:
        s = log_rho.sum(-1, keepdim=True)
        rho = (s if level == "sequence" else s / mask.sum(-1, keepdim=True).clamp(min=1)).exp().expand(b, t)
    with ops_on(device) as dev:
        got = rc.compute_rollout_correction(lp.to(dev), rlp.to(dev), mask.to(dev), cfg)
        one_sided = rc.compute_rollout_correction(lp.to(dev), rlp.to(dev), mask.to(dev), dataclasses_replace(
            cfg, rollout_is_mode="truncate", rollout_is_threshold_lower=None))
    want = torch.where(mask, rho.clamp(lower, upper), torch.zeros_like(rho))
    assert torch.allclose(got.weights.double().cpu(), want, rtol=1e-6, atol=1e-12)
    assert ((rho < lower) & mask).any() and ((rho > upper) & mask).any()  # both clamps in play
    want1 = torch.where(mask, rho.clamp(max=upper), torch.zeros_like(rho))
    assert torch.allclose(one_sided.weights.double().cpu(), want1, rtol=1e-6, atol=1e-12)
    low = float(got.metrics["rollout_corr/rollout_is_ratio_fraction_low"])
    assert low > 0  # the fraction clamped from below is what *_fraction_low reports


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_two_sided_tis_config():
    import rollout_corr_ext as rc

    cfg = rc.RolloutCorrectionConfig.two_sided_tis()
    assert (cfg.is_spec.mode, cfg.is_spec.lower, cfg.is_spec.upper) == ("two_sided", 0.5, 2.0)
    spec = rc.RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.8_1.5",
                                      rollout_is_mode="two_sided").is_spec
    assert (spec.mode, spec.lower, spec.upper) == ("two_sided", 0.8, 1.5)
    assert rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=4.0,
                                      rollout_is_mode="two_sided").is_spec.lower == 0.25
    with pytest.raises(ValueError, match="lower bound 3.0 > upper bound 2.0"):
        rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="two_sided",
                                   rollout_is_threshold_lower=3.0)


def _whole_batch_cp_worker(rank, world):
    """The whole-batch losses run under context parallelism (they used to be refused): megatron's loss_func and the
    front door on two halves of every sequence give one process's value (tests/test_policy_losses_cp.py checks
    every loss, mode, layout and gradient)."""
    import torch.distributed as dist

    from rollout_corr_ext.megatron import make_policy_loss_func

    from rollout_corr_testing.dist_utils import worker_device

    dev = worker_device()
    old, lp, adv, mask, _ = (x.double().to(dev) for x in _inputs(b=4, t=8, seed=6))
    cols = slice(0, 4) if rank == 0 else slice(4, 8)
    for name in losses.WHOLE_BATCH_LOSSES:
        cfg = losses.PolicyLossConfig(loss_mode=name, **KNOBS)
        want = losses.compute_policy_loss(old, lp, adv, mask, "token-mean", cfg)[0]
        got = losses.compute_policy_loss(old[:, cols], lp[:, cols], adv[:, cols], mask[:, cols], "token-mean", cfg,
                                         seq_group=dist.group.WORLD)[0].reshape(1)
        dist.all_reduce(got)  # each rank's loss is its share
        assert torch.allclose(got[0], want, rtol=1e-12), (name, got, want)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 2, 7, generator=g, dtype=torch.float64).to(dev)
    target = torch.randint(0, 7, (2, 8), generator=g).to(dev)
    adv, mask = torch.ones(2, device=dev), torch.ones(2, 8, device=dev)
    cfg = losses.PolicyLossConfig(loss_mode="clip_cov")
    whole = make_policy_loss_func(target, adv, mask, config=cfg)(logits)
    part = make_policy_loss_func(target[:, cols], adv, mask[:, cols], config=cfg, tp_group=None,
                                 dp_group=dist.group.WORLD, seq_group=dist.group.WORLD)(logits[cols])
    totals = torch.stack([part[0].detach(), part[1].double()])
    dist.all_reduce(totals)
    assert torch.allclose(totals[0] / totals[1], whole[0] / whole[1], rtol=1e-12)


@pytest.mark.parametrize("device", dist_params(2))
def test_whole_batch_losses_run_under_context_parallelism(device):
    run_workers(_whole_batch_cp_worker, 2, device=device)


@pytest.mark.parametrize("case", ["random", "ties", "nan_inf", "sorted", "descending", "odd", "fp64", "small"])
def test_candidate_top_set_holds_the_k_largest_values(case):
    """clip_cov / kl_cov select tokens from losses._top_set, which on the CPU runs torch.topk over candidate blocks
    only (those whose maximum reaches the k-th largest block maximum): k distinct positions whose values are the k
    largest, against a full sort, ties, NaN (ranked largest) and -inf included."""
    g = torch.Generator().manual_seed(hash(case) % 1000)
    n, k = 1 << 17, 300
    x = torch.randn(n, generator=g)
    if case == "ties":
        x = torch.randint(0, 7, (n,), generator=g).float()
    elif case == "nan_inf":
        x[torch.randint(0, n, (50,), generator=g)] = -math.inf
        x[torch.randint(0, n, (3,), generator=g)] = math.nan
        x[torch.randint(0, n, (20,), generator=g)] = math.inf
    elif case == "sorted":
        x = x.sort().values
    elif case == "descending":
        x = x.sort(descending=True).values
    elif case == "odd":
        x = x[: n - 77]
    elif case == "fp64":
        x = x.double()
    elif case == "small":
        x, k = x[:1000], 10
    desc = torch.sort(torch.where(x.isnan(), math.inf, x), descending=True, stable=True)
    nan_first = torch.cat([x.isnan().nonzero().squeeze(1), desc.indices[~x[desc.indices].isnan()]])
    for kk in (1, k, 2 * k + 1):
        want = x[nan_first[:kk]]  # the kk largest values, NaN first, from a full sort
        got = losses._top_set(x, kk)
        assert got.numel() == kk and got.unique().numel() == kk, (case, kk)
        vals = x[got]
        vals = torch.cat([vals[vals.isnan()], vals[~vals.isnan()].sort(descending=True).values])
        torch.testing.assert_close(vals, want, rtol=0, atol=0, equal_nan=True, msg=f"{case} {kk}")


@pytest.mark.parametrize("case", ["random", "ties", "ties_tail", "few_ties", "neg_inf", "fp64"])
def test_top_by_rule_equals_stable_sort(case):
    """The selection rule of clip_cov / kl_cov (value descending, then position ascending), against a stable sort:
    the CPU path finds the positions tied at the k-th value in the blocks whose maximum reaches it only."""
    g = torch.Generator().manual_seed(len(case))
    n = (1 << 16) + (45 if case == "ties_tail" else 0)
    x = torch.randn(n, generator=g)
    if case in ("ties", "ties_tail"):  # many values at the boundary, in the tail too
        x = torch.randint(0, 5, (n,), generator=g).float()
    elif case == "few_ties":  # a handful of copies of one large value, far apart
        x[torch.randint(0, n, (9,), generator=g)] = 3.5
    elif case == "neg_inf":  # ineligible entries, as the losses mask them
        x[torch.rand(n, generator=g) < 0.9] = -math.inf
    elif case == "fp64":
        x = torch.randint(0, 3, (n,), generator=g).double()
    for k in (1, 7, 300, 1000):
        want = torch.sort(x, descending=True, stable=True).indices[:k]
        got = losses._top_by_rule(x, k)
        assert torch.equal(got, want), (case, k)


def test_scratch_blocks_are_reused_never_shared():
    """ops.scratch_empty: a slot's block goes to the next request only once the tensor holding it is freed, so two
    live temporaries never alias; the blocks count in cpu_cache_bytes and empty_cpu_cache() frees them."""
    if not ops._compiled:
        pytest.skip(reason="the compiled extension is not built")
    import rollout_corr_ext as rc

    rc.empty_cpu_cache()
    cpu = torch.device("cpu")
    a = ops.scratch_empty((64, 1000), torch.float32, cpu, 0)
    b = ops.scratch_empty((64, 1000), torch.float32, cpu, 0)  # the same slot while `a` lives: a block of its own
    assert a.data_ptr() != b.data_ptr() and a.is_contiguous() and a.shape == (64, 1000)
    ptr = a.data_ptr()
    del a
    c = ops.scratch_empty((64, 1000), torch.float32, cpu, 0)
    assert c.data_ptr() == ptr, "the freed block serves the next request of its size"
    d = ops.scratch_empty((64, 1000), torch.bool, cpu, 1)
    assert d.dtype == torch.bool and d.data_ptr() not in (b.data_ptr(), c.data_ptr())
    del b, c, d
    assert ops.cpu_cache_bytes() >= 64 * 1000 * 5
    assert rc.empty_cpu_cache() >= 64 * 1000 * 5 and ops.cpu_cache_bytes() == 0
    with pytest.raises(RuntimeError, match="slot must be in"):
        ops.scratch_empty((4,), torch.float32, cpu, LY.SCRATCH_SLOTS)  # the count policy_loss_layout.def declares
    ops.scratch_empty((4,), torch.float32, cpu, LY.SCRATCH_SLOTS - 1)
    # the slots losses.py hands out exist
    slots = [v for k, v in vars(losses).items() if k.startswith("_SLOT_")]
    assert slots and max(slots) < LY.SCRATCH_SLOTS and min(slots) >= 2  # 0 and 1: the accumulation-dtype pair


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_whole_batch_losses_repeat_exactly(name):
    """clip_cov / kl_cov write their temporaries into reused blocks: a second call (blocks holding the first call's
    values) and a call on other inputs in between give bitwise the same loss, metrics and gradient; the inputs are
    untouched."""
    core, _, _ = _verl()
    actor = _actor(name)
    cfg = losses.PolicyLossConfig.from_dict(actor)
    fn = getattr(losses, "compute_policy_loss_" + name)
    old, lp, adv, mask, w = _inputs(seed=21)
    saved = [t.clone() for t in (old, lp, adv, mask, w)]
    first = _run(fn, old, lp, adv, mask, "token-mean", cfg, w)
    other = _inputs(seed=22)
    _run(fn, *other[:4], "seq-mean-token-sum", cfg, other[4])
    again = _run(fn, old, lp, adv, mask, "token-mean", cfg, w)
    assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    assert {k: float(v) for k, v in first[1].items()} == {k: float(v) for k, v in again[1].items()}
    for t, s in zip((old, lp, adv, mask, w), saved):
        assert torch.equal(t, s)


# ------------------------------------------------------------------------------------------------------------------
# The loss as one autograd node: ops.policy_loss (the kernel and its aggregation), losses.RowAggregation.grad
# ------------------------------------------------------------------------------------------------------------------

#: Normalisers of RowAggregation: the local counts; Python numbers; one-element tensors (verl passes 0-dim ones);
#: data-parallel (dp_size 2, global numbers); a padded length of 0 (an empty response dimension).
_NORMS = {
    "local": dict(),
    "numbers": dict(batch_num_tokens=37.0, global_batch_size=5, loss_scale_factor=3.0),
    "tensors": dict(batch_num_tokens=torch.tensor([37.0]), global_batch_size=torch.tensor(5.0),
                    loss_scale_factor=torch.tensor(3.0)),
    "dp2": dict(dp_size=2, batch_num_tokens=37, global_batch_size=9),
}


@pytest.mark.parametrize("tokens", ["some_empty", "all_empty"])
@pytest.mark.parametrize("horizon", [24, 0, "tensor"])
@pytest.mark.parametrize("norms", sorted(_NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
def test_row_aggregation_grad_is_autograd_bit_for_bit(mode, dtype, norms, horizon, tokens):
    """RowAggregation.grad, the one-node loss's backward, is the gradient autograd takes through RowAggregation.value
    (the composed path's, the registered op's under torch.compile), to the bit: every mode, local / number / tensor /
    data-parallel normalisers, rows without tokens, a batch without any, a padded length of 0."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{mode} {norms} {horizon} {tokens} {dtype}".encode()))
    row_tokens = (torch.rand(7, generator=g) * 9).round().to(dtype) / 2  # fractional mask sums too
    row_tokens[[1, 4]] = 0.0
    if tokens == "all_empty":
        row_tokens.zero_()
    row_loss = torch.randn(7, generator=g, dtype=dtype) * (row_tokens != 0)
    h = torch.tensor(24) if horizon == "tensor" else horizon
    agg = losses.RowAggregation(mode, h, **_NORMS[norms])
    x = row_loss.clone().requires_grad_(True)
    loss = agg.value(x, row_tokens)
    upstream = torch.randn((), generator=g, dtype=dtype)
    want, = torch.autograd.grad(loss, x, upstream)
    got = agg.grad(upstream, row_tokens)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (got, want)
    assert torch.equal(loss.detach(), losses.aggregate_rows(row_loss, row_tokens, mode, h, **_NORMS[norms]))


#: The losses whose kernel and aggregation are one node (rows read for metrics only).
ONE_NODE = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "dro", "cispo", "clip_cov"]


#: Global normalisers through the whole loss: none; data-parallel with one-element tensors (as verl passes them).
_LOSS_NORMS = {"local": {}, "dp2_tensors": dict(dp_size=2, batch_num_tokens=torch.tensor(301.0),
                                               global_batch_size=torch.tensor([13.0]), loss_scale_factor=5.0)}


@pytest.mark.parametrize("norms", sorted(_LOSS_NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ONE_NODE)
def test_one_node_loss_equals_the_composed_one_bit_for_bit(backend, name, mode, dtype, norms, monkeypatch):
    """On the kernels (compiled CPU, emulated CUDA) the loss is one autograd node (ops.policy_loss); its loss,
    metrics and gradient are those of the op and the aggregation under autograd (ops.policy_loss_composed, what
    torch.compile and the fallback run), to the bit, with local and with data-parallel tensor normalisers; a second
    backward through a retained graph gives the same gradient; create_graph=True still raises by name."""
    core, _, _ = _verl()
    cfg = dataclasses.replace(losses.PolicyLossConfig.from_dict(_actor(name)), **_LOSS_NORMS[norms])
    fn = getattr(losses, "compute_policy_loss_" + name)
    old, lp, adv, mask, w = _inputs(seed=len(name) + len(mode), dtype=dtype)
    x = lp.detach().clone().requires_grad_(True)
    loss, metrics = fn(old, x, adv, mask, mode, cfg, w)
    if backend != "fallback":
        assert type(loss.grad_fn).__name__ == "_PolicyLossEagerBackward"
    grad, = torch.autograd.grad(loss, x, retain_graph=True)
    again, = torch.autograd.grad(loss, x)
    assert torch.equal(grad, again)
    g3, = torch.autograd.grad(fn(old, x, adv, mask, mode, cfg, w)[0], x, create_graph=True)
    with pytest.raises(RuntimeError, match="compute_policy_loss_" + name):
        g3.sum().backward()
    monkeypatch.setattr(ops, "policy_loss", ops.policy_loss_composed)
    x2 = lp.detach().clone().requires_grad_(True)
    loss2, metrics2 = fn(old, x2, adv, mask, mode, cfg, w)
    assert type(loss2.grad_fn).__name__ != "_PolicyLossEagerBackward"
    grad2, = torch.autograd.grad(loss2, x2)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2), ((loss, loss2), (grad - grad2).abs().max())
    assert {k: float(v) for k, v in metrics.items()} == {k: float(v) for k, v in metrics2.items()}


def test_one_node_loss_without_grad_and_under_no_grad(backend):
    """No gradient wanted (log_prob without requires_grad, or no_grad): the same loss and metrics, no node."""
    core, _, _ = _verl()
    cfg = losses.PolicyLossConfig.from_dict(_actor("vanilla"))
    old, lp, adv, mask, w = _inputs(seed=5)
    x = lp.detach().clone().requires_grad_(True)
    want = losses.compute_policy_loss_vanilla(old, x, adv, mask, "seq-mean-token-mean", cfg, w)
    for got in (losses.compute_policy_loss_vanilla(old, lp, adv, mask, "seq-mean-token-mean", cfg, w),):
        assert got[0].grad_fn is None and torch.equal(got[0], want[0].detach())
    with torch.no_grad():
        got = losses.compute_policy_loss_vanilla(old, x, adv, mask, "seq-mean-token-mean", cfg, w)
    assert got[0].grad_fn is None and torch.equal(got[0], want[0].detach())
    assert {k: float(v) for k, v in got[1].items()} == {k: float(v) for k, v in want[1].items()}


@pytest.mark.parametrize("flow, loss_type", [("plain", None), ("decoupled", "ppo_clip"), ("bypass", "ppo_clip"),
                                             ("bypass", "reinforce")])
def test_policy_step_flows_take_the_one_node_loss(backend, flow, loss_type, monkeypatch):
    """compute_policy_loss's flows (plain, decoupled, bypass; IS weights and RS from the correction) run the
    one-node loss on the kernels, with the composed path's loss, metrics and gradient to the bit."""
    from rollout_corr_ext.config import RolloutCorrectionConfig

    old, lp, adv, mask, _ = _inputs(seed=9)
    g = torch.Generator().manual_seed(19)
    rlp = old + torch.round(torch.randn(old.shape, generator=g) * 0.05 * 4096) / 4096
    rc = None if flow == "plain" else RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_threshold="0.7_1.4",
        bypass_mode=flow == "bypass", loss_type=loss_type)
    cfg = losses.PolicyLossConfig(rollout_correction=rc)

    def run():
        x = lp.detach().clone().requires_grad_(True)
        loss, metrics = losses.compute_policy_loss(old, x, adv, mask, "seq-mean-token-mean", cfg,
                                                   rollout_log_prob=rlp)
        grad, = torch.autograd.grad(loss, x)
        return loss.detach(), {k: float(v) for k, v in metrics.items()}, grad, type(loss.grad_fn).__name__

    got = run()
    if backend != "fallback":
        assert got[3] == "_PolicyLossEagerBackward"
    monkeypatch.setattr(ops, "policy_loss", ops.policy_loss_composed)
    want = run()
    assert want[3] != "_PolicyLossEagerBackward"
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and got[1] == want[1]


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The values of ``x`` in a transposed layout (strides (1, B)): what ``x.t().contiguous().t()`` returns."""
    return x.t().contiguous().t()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
@pytest.mark.parametrize("backend_name", ["cpu", "fallback"])
@pytest.mark.parametrize("name", NAMES)
def test_every_loss_takes_every_input_in_any_layout(backend_name, name, mask_dtype):
    """Each input (log-probs, advantages, mask, IS weights) in a transposed layout, and a step-2 slice: the same loss,
    metrics and gradient as the contiguous call. The fallback's kl_cov added its penalty's gradient through
    ``grad.view(-1)``, which the fallback's gradient, laid out like a transposed mask, refused (a raw view error in
    backward; the layout fuzz), and summed its rows in the layout's order (the loss moved by up to 60 ulp): the same
    bits in every layout, kernels and fallback."""
    actor = _actor(name)
    old, lp, adv, mask, w = _inputs(seed=3)
    mask = mask.to(mask_dtype)
    with policy_loss_backend(backend_name):
        want = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, "seq-mean-token-mean", actor, w)
        cases = {"mask": (old, lp, adv, _strided(mask), w), "advantages": (old, lp, _strided(adv), mask, w),
                 "old": (_strided(old), lp, adv, mask, w), "log_prob": (old, _strided(lp), adv, mask, w),
                 "weights": (old, lp, adv, mask, _strided(w)),
                 "all": tuple(_strided(x) for x in (old, lp, adv, mask, w)),
                 "step2": tuple(torch.stack([x, torch.ones_like(x)], -1)[..., 0] for x in (old, lp, adv, mask, w))}
        for what, (o, l, a, m, ww) in cases.items():
            got = _run(rv.POLICY_LOSSES[name], o, l, a, m, "seq-mean-token-mean", actor, ww)
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), what
            assert got[1] == want[1], what


@pytest.mark.parametrize("backend_name", ["cpu", "fallback"])
@pytest.mark.parametrize("c", [1.0, 0.5, 1.1])
@pytest.mark.parametrize("name", NAMES)
def test_clip_ratio_c_at_or_below_one_equals_verl(name, c, backend_name):
    """clip_ratio_c is PPO's dual-clip bound, which verl's vanilla asserts > 1; DPPO truncates the ratio at it
    with no bound, and the other losses do not read it. Every loss but vanilla takes c <= 1 as verl does (value,
    gradient, metrics; DPPO's cap binds), where our config refused anything <= 1 as a dual-clip bound (the verl
    config fuzz, then the review for the losses that do not read c); vanilla refuses it, as verl does."""
    core, _, _ = _verl()
    old, lp, adv, mask, w = _inputs(seed=17)
    actor = _actor(name, clip_ratio_c=c)
    with policy_loss_backend(backend_name):
        if name == "vanilla" and c <= 1:
            with pytest.raises(AssertionError):
                _run(core.get_policy_loss_fn(name), old, lp, adv, mask, "token-mean", actor, w)
            with pytest.raises(ValueError, match=r"clip_ratio_c \(the dual-clip bound c of PPO's loss\) must be > 1"):
                _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, "token-mean", actor, w)
            return
        want = _run(core.get_policy_loss_fn(name), old, lp, adv, mask, "token-mean", actor, w)
        got = _run(rv.POLICY_LOSSES[name], old, lp, adv, mask, "token-mean", actor, w)
    assert torch.allclose(got[0].double(), want[0].double(), rtol=2e-5, atol=2e-6), (got[0], want[0])
    assert torch.allclose(got[2], want[2], rtol=2e-5, atol=1e-7)
    for k, v in want[1].items():
        assert math.isclose(got[1][k], v, rel_tol=2e-5, abs_tol=2e-6), (k, got[1][k], v)
    if name.startswith("dppo"):
        assert want[1]["actor/pg_clipfrac_lower"] > 0  # the cap binds


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_refuses_a_constant_that_requires_grad(name):
    """old_log_prob, advantages and the IS weights are constants of every policy loss: one that requires grad is a
    ValueError naming it, never a gradient silently dropped. clip_cov multiplied its IS weights into the kernel's
    weights detached and returned no gradient for them (w.grad None; the backend fuzz)."""
    old, lp, adv, mask, w = _inputs(seed=4)
    cfg = losses.PolicyLossConfig(loss_mode=name, **KNOBS)
    fn = getattr(losses, f"compute_policy_loss_{name}")
    for i, arg in ((0, "old_log_prob"), (2, "advantages"), (6, "rollout_is_weights")):
        args = [old, lp, adv, mask, "token-mean", cfg, w]
        args[i] = args[i].clone().requires_grad_(True)
        if name == "gpg" and arg == "old_log_prob":
            continue  # gpg does not read it (verl's gpg neither); checked by name all the same below
        with pytest.raises(ValueError, match=f"{arg} requires grad"):
            fn(*args)
    with torch.no_grad():  # no gradient asked for: nothing to refuse
        fn(old, lp, adv, mask, "token-mean", cfg, w.clone().requires_grad_(True))


@pytest.mark.parametrize("backend_name", ["cpu", "fallback"])
@pytest.mark.parametrize("name", ["gpg", "vanilla"])
def test_a_token_loss_past_the_float_range_is_refused(name, backend_name):
    """Finite inputs whose token loss overflows the type (-A log pi w = 6e38 in fp32): gpg returned an inf loss (the
    mean, 1.5e38, is finite, but not computable in fp32), where every kind after REINFORCE refused it (the extremes
    fuzz). Every kind refuses it now, naming the token; a large loss that fits is computed."""
    lp = torch.tensor([[-1.0, -3e38, -1.0, -1.0]])
    adv = torch.full((1, 4), 2.0) if name == "gpg" else torch.tensor([[1.0, -3e38, 1.0, 1.0]])
    old = lp.clone() if name == "gpg" else torch.tensor([[-1.0, -3e38 - 2e32, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = losses.PolicyLossConfig(loss_mode=name, clip_ratio_c=10.0)
    fn = getattr(losses, f"compute_policy_loss_{name}")
    with policy_loss_backend(backend_name):
        with pytest.raises(ValueError, match=r"policy loss undefined at response token \(0, 1\)"):
            fn(old, lp.clone().requires_grad_(True), adv, mask, "token-mean", cfg)
        ok = lp.clone()
        ok[0, 1] = -1e38
        loss, _ = fn(old if name == "gpg" else lp, ok.requires_grad_(True), adv if name == "gpg" else adv.clamp(-1e37),
                     mask, "token-mean", cfg)
        assert torch.isfinite(loss)
