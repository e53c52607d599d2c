"""Policy losses and agg_loss (docs/megatron.md, "Loss modes") against the textbook oracles in
``rollout_corr_testing/dense_oracles.py`` (verl 0.9.1 formulas,
Megatron-LM RL's ``calculate_grpo_loss``): values, gradients, metrics, global normalisers, RS-rejected rows, and
bad input.

Every test runs on each device variant of ``rollout_corr_testing.backends.DEVICES`` (``cpu``; ``emulated``: the
policy-loss and rollout CUDA kernels on the CPU emulator; ``cuda``, skipped with the reason without a GPU), inputs
made on the CPU and moved, the oracle on the same tensors. ``agg_loss`` is torch ops only (no kernel of its own): its
tests run on cpu and cuda.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rollout_corr_testing import dense_oracles as R
from rollout_corr_testing.backends import device_params, ops_on
from rollout_corr_testing.tolerances import LOSS_TOL
from rollout_corr_ext import _layout as LY
from rollout_corr_ext import losses
from rollout_corr_ext.losses import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    agg_loss,
    calculate_grpo_loss,
    compute_policy_loss,
    compute_policy_loss_bypass,
    compute_policy_loss_decoupled,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
)

HAS_CORRECTION = importlib.util.find_spec("rollout_corr_ext.correction") is not None
needs_correction = pytest.mark.skipif(not HAS_CORRECTION, reason="rollout_corr_ext.correction is not in this tree yet")

TOL = LOSS_TOL

DEVICES = device_params()
#: agg_loss is plain torch ops on the loss matrix: no kernel of the emulator's to run, so cpu and cuda only.
AGG_DEVICES = device_params("cpu", "cuda")


def _emulated_subset(device, keep: bool, what: str) -> None:
    """The emulated kernels run a representative subset of a large grid; every case runs on cpu and cuda."""
    if device == "emulated" and not keep:
        pytest.skip(f"emulated: representative subset ({what}); every case runs on cpu and cuda")


def _dev(dev, *tensors):
    """Move tensors (None kept) to ``dev``, keeping leaves that require grad leaves."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif t.requires_grad:
            out.append(t.detach().to(dev).requires_grad_(True))
        else:
            out.append(t.to(dev))
    return out

# Global normalisers as verl's trainer sets them: dp_size with the global token / sequence counts.
NORMALISERS = [
    {},
    dict(dp_size=4, batch_num_tokens=57, global_batch_size=13),
    dict(loss_scale_factor=7.0),
]


def make_batch(dtype=torch.float64, b=6, t=9, seed=0, reject_rows=(2,), mask_dtype=torch.bool, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    # A spread of log-ratios, so every branch is taken: ratios far above 1+eps, below 1-eps, and past c.
    lp = old + torch.randn(b, t, generator=g, dtype=dtype) * 0.6
    adv = torch.randn(b, t, generator=g, dtype=dtype) * 2
    adv[0, :3] = 0.0  # A == 0 ties
    lp[1, :2] = old[1, :2] + 1.5  # r = e^1.5 > c with A < 0: the dual clip is active
    adv[1, :2] = -1.0
    lp = lp.requires_grad_(True)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, :2] = True
    for r in reject_rows:  # rows rejected by RS: all-zero mask
        mask[r] = False
    w = torch.rand(b, t, generator=g, dtype=dtype) * 2.5
    return tuple(_dev(device, old, lp, adv, mask.to(mask_dtype), w))


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)
    return g


# ------------------------------------------------------------------------------------------------------------
# agg_loss
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", AGG_DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("norm", NORMALISERS, ids=["local", "global", "scale"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64, torch.int64])
def test_agg_loss_matches_oracle(mode, norm, mask_dtype, device):
    _, lp, _, mask, _ = make_batch(mask_dtype=mask_dtype, device=device)
    loss_mat = lp * 1.7 - 0.3
    mask_before = mask.clone()
    ours = agg_loss(loss_mat, mask, mode, **norm)
    ref = R.agg_loss_dense(loss_mat, mask, mode, **norm)
    torch.testing.assert_close(ours, ref, **TOL[torch.float64])
    torch.testing.assert_close(_grad(ours, lp), _grad(ref, lp), **TOL[torch.float64])
    assert torch.equal(mask, mask_before)


@pytest.mark.parametrize("device", AGG_DEVICES)
def test_agg_loss_modes_by_hand(device):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], device=device)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], device=device)  # last row rejected
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert agg_loss(loss, mask, "token-sum").item() == pytest.approx(7.0)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2, rel=1e-6)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 4) / 2 / 3)
    assert agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=14).item() == pytest.approx(7 / 14 * 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=4).item() == pytest.approx(7 / 4 * 2)
    assert agg_loss(loss, mask, "token-sum", dp_size=3).item() == pytest.approx(21.0)


@pytest.mark.parametrize("device", AGG_DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_rows_rejected_is_zero_not_nan(mode, device):
    lp = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool, device=device)
    loss = agg_loss(lp * 2, mask, mode)
    assert loss.item() == 0.0
    assert torch.equal(_grad(loss, lp), torch.zeros_like(lp))


@pytest.mark.parametrize("device", AGG_DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_agg_loss_low_precision_with_a_rejected_row_matches_fp64(mode, dtype, device):
    """A fully masked row next to valid ones: its token-mean 0 / (0 + 1e-8) is NaN in fp16 (eps rounds away) and
    must not reach the loss. The oracle is the fp64 formula on the same 16-bit values, rounded to the loss's dtype
    (ours sums in fp32 and rounds once: within one unit of the last place)."""
    g = torch.Generator().manual_seed(3)
    loss = (torch.rand(3, 2048, generator=g, dtype=torch.float64) * 10).to(dtype).to(device).requires_grad_(True)
    mask = torch.rand(3, 2048, generator=g) < 0.9
    mask[1] = False
    mask = mask.to(device)
    ours = agg_loss(loss, mask, mode)
    ref = R.agg_loss_dense(loss.double(), mask, mode)
    assert ours.dtype == dtype and torch.isfinite(ours)
    torch.testing.assert_close(ours.double(), ref.to(dtype).double(), rtol=torch.finfo(dtype).eps, atol=0)
    g_ours, g_ref = _grad(ours, loss), _grad(ref, loss)
    assert torch.isfinite(g_ours).all()
    torch.testing.assert_close(g_ours.double(), g_ref.to(dtype).double(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("device", AGG_DEVICES)
def test_seq_mean_token_sum_norm_of_an_empty_response_is_zero(device):
    """T = 0: every token is masked (there are none) and the divisor T is 0: 0, as for any all-masked batch."""
    lp = torch.zeros(2, 0, device=device, requires_grad=True)
    mask = torch.zeros(2, 0, dtype=torch.bool, device=device)
    assert agg_loss(lp * 1, mask, "seq-mean-token-sum-norm").item() == 0.0
    loss = compute_policy_loss_vanilla(lp.detach(), lp, torch.zeros(2, 0, device=device), mask,
                                       "seq-mean-token-sum-norm")[0]
    assert loss.item() == 0.0


@pytest.mark.parametrize("device", AGG_DEVICES)
def test_agg_loss_bad_input(device):
    x, m = torch.randn(2, 3, device=device), torch.ones(2, 3, device=device)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(x, m, "seq-mean")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(x, m, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(x, m, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(x, torch.ones(2, 4, device=device), "token-mean")
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(x, m, "token-sum", dp_size=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=0)


_NORMALISER_KWARGS = ("batch_num_tokens", "global_batch_size", "loss_scale_factor")
_BAD_NORMALISERS = [-1, -0.5, 0, 0.0, float("nan"), float("inf"), -float("inf"), 10 ** 400, True, "14", [14],
                    torch.tensor(-1.0), torch.tensor(0), torch.tensor(float("nan")), torch.tensor(float("inf")),
                    torch.tensor([3.0, 4.0]), torch.tensor(True)]


def _mode_using(kwarg):
    return {"batch_num_tokens": "token-mean", "global_batch_size": "seq-mean-token-sum",
            "loss_scale_factor": "seq-mean-token-sum-norm"}[kwarg]


@pytest.mark.parametrize("device", AGG_DEVICES)
@pytest.mark.parametrize("bad", _BAD_NORMALISERS, ids=repr)
@pytest.mark.parametrize("kwarg", _NORMALISER_KWARGS)
def test_agg_loss_normalisers_validated_naming_the_kwarg(kwarg, bad, device):
    """A negative normaliser flipped the loss sign, 0 zeroed it (and its gradient), NaN/inf poisoned it."""
    if device == "cuda" and isinstance(bad, torch.Tensor) and bad.numel() == 1 and bad.dtype != torch.bool:
        pytest.skip(reason="cuda: a one-element CUDA tensor normaliser is checked by an asynchronous device assert, which "
                    "poisons the CUDA context (tests/test_cuda.py runs it in a subprocess)")
    if isinstance(bad, torch.Tensor):
        bad = bad.to(device)
    x, m = torch.randn(2, 3, device=device, requires_grad=True), torch.ones(2, 3, device=device)
    for mode in (_mode_using(kwarg), "token-sum"):  # checked even where the mode does not use it
        with pytest.raises(ValueError, match=rf"^{kwarg} must be a finite number > 0"):
            agg_loss(x, m, mode, **{kwarg: bad})
    with pytest.raises(ValueError, match=rf"^{kwarg} must be a finite number > 0"):
        PolicyLossConfig(**{kwarg: bad})


@pytest.mark.parametrize("device", AGG_DEVICES)
@pytest.mark.parametrize("kwarg", _NORMALISER_KWARGS)
@pytest.mark.parametrize("good", [7, 7.0, torch.tensor(7), torch.tensor(7.0, dtype=torch.float64),
                                  torch.tensor([7.0])], ids=repr)
def test_agg_loss_normalisers_accept_numbers_and_0d_tensors(kwarg, good, device):
    if isinstance(good, torch.Tensor):
        good = good.to(device)
    x = torch.randn(2, 3, dtype=torch.float64, device=device, requires_grad=True)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], device=device)
    mode = _mode_using(kwarg)
    got = agg_loss(x, m, mode, **{kwarg: good})
    want = agg_loss(x, m, mode, **{kwarg: 7})
    assert got.shape == () and torch.equal(got.detach(), want.detach())
    assert torch.equal(_grad(got, x), _grad(want, x)) and _grad(got, x).abs().sum() > 0
    assert PolicyLossConfig(**{kwarg: good}).global_batch_info[kwarg] is good


@pytest.mark.parametrize("kwarg", _NORMALISER_KWARGS)
def test_normalisers_below_the_compute_types_range_are_named(kwarg):
    """A normaliser the loss is divided by must be a normal number of the compute type: 1e-300 is 0 in fp32 and a
    subnormal's reciprocal overflows (an inf loss and gradient, silently; the knob fuzz). fp64 holds 1e-300, and the
    loss and gradient are the fp32 inputs' formula in fp64 (finite); a 0-dim fp64 tensor is judged as converted."""
    mode = _mode_using(kwarg)
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    m = torch.ones(1, 3, dtype=torch.bool)
    for bad in (1e-300, 1e-40, 5e-324, torch.tensor(1e-300, dtype=torch.float64)):
        for dtype in (torch.float32, torch.bfloat16):
            x = lp.to(dtype).clone().requires_grad_()
            with pytest.raises(ValueError, match=rf"{kwarg} must be at least 1.175e-38, the smallest normal "
                                                 rf"torch.float32"):
                agg_loss(x, m, mode, **{kwarg: bad})
            with pytest.raises(ValueError, match=rf"{kwarg} must be at least 1.175e-38"):
                losses.compute_policy_loss_vanilla(lp.to(dtype) - 0.1, x, adv.to(dtype), m, mode,
                                                   PolicyLossConfig(**{kwarg: bad}))
    x = lp.double().requires_grad_()
    got = agg_loss(x * adv.double(), m, mode, **{kwarg: 1e-300})
    assert torch.isfinite(got) and torch.isfinite(_grad(got, x)).all()
    x32 = lp.clone().requires_grad_()
    ok = agg_loss(x32, m, mode, **{kwarg: torch.finfo(torch.float32).tiny * 4})  # a normal fp32 normaliser
    assert torch.isfinite(_grad(ok, x32)).all()


def test_agg_loss_takes_a_fraction_normaliser_as_its_float():
    """A Fraction passed the normalisers' check and failed in the division (TypeError; the config fuzz)."""
    import fractions

    x, m = torch.randn(2, 3), torch.ones(2, 3)
    for name in ("batch_num_tokens", "global_batch_size", "loss_scale_factor"):
        for mode in ("token-mean", "seq-mean-token-sum-norm"):
            assert torch.equal(agg_loss(x, m, mode, **{name: fractions.Fraction(9, 2)}),
                               agg_loss(x, m, mode, **{name: 4.5}))
    torch._dynamo.reset()  # traced too: the checks' tensor of the value could not hold a Fraction (the review)
    f = torch.compile(lambda a, b: agg_loss(a, b, "token-mean", batch_num_tokens=fractions.Fraction(9, 2)),
                      backend="eager", fullgraph=True)
    assert torch.equal(f(x, m), agg_loss(x, m, "token-mean", batch_num_tokens=4.5))


@pytest.mark.parametrize("device", AGG_DEVICES)
def test_agg_loss_dp_size_validated(device):
    x, m = torch.randn(2, 3, device=device), torch.ones(2, 3, device=device)
    for bad in (0, -1, 1.5, True, "2", None, 2 ** 63, 10 ** 400):  # 10**400: a bare OverflowError (config fuzz)
        with pytest.raises(ValueError, match=r"^dp_size must be an int in \[1, 2\*\*63\)"):
            agg_loss(x, m, "token-sum", dp_size=bad)
        with pytest.raises(ValueError, match=r"^dp_size must be an int in \[1, 2\*\*63\)"):
            PolicyLossConfig(dp_size=bad)
    for name in ("clip_ratio", "tau_pos", "ppo_kl_coef", "dro_beta"):  # ints past the float range, named
        with pytest.raises(ValueError, match=f"^{name} must be .*, got an integer of 1329 bits"):
            PolicyLossConfig(**{name: 10 ** 400})


# ------------------------------------------------------------------------------------------------------------
# PPO clip (vanilla) and REINFORCE
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("norm", NORMALISERS, ids=["local", "global", "scale"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vanilla_matches_oracle(mode, with_weights, norm, dtype, device):
    _emulated_subset(device, norm == {}, "local normalisers: the global ones only scale the aggregated partials")
    old, lp, adv, mask, w = make_batch(dtype, device="cpu" if device == "emulated" else device)
    w = w if with_weights else None
    cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5, **norm)
    inputs = [x.detach().clone() for x in (old, adv, mask)] + ([w.clone()] if w is not None else [])
    with ops_on(device):
        loss, metrics = compute_policy_loss_vanilla(old, lp, adv, mask, mode, cfg, w)
    pg, clipfrac, clipfrac_lower, ppo_kl = R.ppo_clip_loss_dense(old, lp, adv, mask, 0.15, 0.28, 2.5, w)
    ref = R.agg_loss_dense(pg, mask, mode, **norm)
    tol = TOL[dtype]
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(_grad(loss, lp), _grad(ref, lp), **tol)
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], clipfrac, **tol)
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], clipfrac_lower, **tol)
    torch.testing.assert_close(metrics["actor/ppo_kl"], ppo_kl.detach(), **tol)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    # every branch of the clip was exercised by this batch, so the comparison means something
    assert 0 < clipfrac < 1 and 0 < clipfrac_lower
    for before, after in zip(inputs, [old, adv, mask] + ([w] if w is not None else [])):
        assert torch.equal(before, after)


@pytest.mark.parametrize("device", DEVICES)
def test_vanilla_weights_multiply_after_clipping(device):
    # r = e^1 is clipped to 1.2 for A > 0, so L = -A * 1.2 and then * w (not -A * min(r w, ...)).
    with ops_on(device) as dev:
        old = torch.zeros(1, 2, dtype=torch.float64, device=dev)
        lp = torch.ones(1, 2, dtype=torch.float64, device=dev, requires_grad=True)
        adv = torch.ones(1, 2, dtype=torch.float64, device=dev)
        w = torch.tensor([[0.5, 3.0]], dtype=torch.float64, device=dev)
        loss, m = compute_policy_loss_vanilla(old, lp, adv, torch.ones(1, 2, device=dev), "token-sum", None, w)
        assert loss.item() == pytest.approx(-(1.2 * 0.5 + 1.2 * 3.0))
        assert m["actor/pg_clipfrac"].item() == pytest.approx(1.0, rel=1e-6)
        assert torch.equal(_grad(loss, lp), torch.zeros_like(lp))  # clipped: no gradient


@pytest.mark.parametrize("device", DEVICES)
def test_dual_clip_caps_negative_advantage(device):
    with ops_on(device) as dev:
        old = torch.zeros(1, 1, dtype=torch.float64, device=dev)
        lp = torch.full((1, 1), 3.0, dtype=torch.float64, device=dev, requires_grad=True)  # r = e^3 ~ 20 > c
        adv = torch.full((1, 1), -1.0, dtype=torch.float64, device=dev)
        loss, m = compute_policy_loss_vanilla(old, lp, adv, torch.ones(1, 1, device=dev), "token-mean",
                                              PolicyLossConfig(clip_ratio_c=3.0))
    assert loss.item() == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_reinforce_matches_oracle(mode, with_weights, device):
    rollout, lp, adv, mask, w = make_batch(device="cpu" if device == "emulated" else device)
    w = w if with_weights else None
    with ops_on(device):
        loss, metrics = compute_policy_loss_reinforce(rollout, lp, adv, mask, mode, None, w)
    pg = -adv * lp * (1.0 if w is None else w)
    ref = R.agg_loss_dense(pg, mask, mode)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(_grad(loss, lp), _grad(ref, lp))
    m = mask.double()
    kl = ((rollout - lp.detach()) * m).sum() / (m.sum() + 1e-8)
    torch.testing.assert_close(metrics["actor/ppo_kl"], kl)
    assert set(metrics) == {"actor/ppo_kl"}


ALL_BACKENDS = device_params("cpu", "fallback", "emulated", "cuda")


def _constant_cases(old, lp, adv, mask, w):
    """(entry point, argument name, call taking that argument's tensor) for every input the policy objective treats
    as a constant: pi_old / pi_rollout, the advantages, the IS weights, the inference log-probs."""
    from rollout_corr_ext.config import RolloutCorrectionConfig

    rc_cfg = PolicyLossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_token_is())
    by_cfg = PolicyLossConfig(rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip())
    ref = old - 0.1
    a_seq = adv[:, 0].contiguous()
    return [
        ("vanilla", "old_log_prob", lambda x: compute_policy_loss_vanilla(x, lp, adv, mask)),
        ("vanilla", "advantages", lambda x: compute_policy_loss_vanilla(old, lp, x, mask)),
        ("vanilla", "rollout_is_weights", lambda x: compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean",
                                                                                None, x)),
        ("reinforce", "rollout_log_prob", lambda x: compute_policy_loss_reinforce(x, lp, adv, mask)),
        ("bypass", "old_log_prob", lambda x: compute_policy_loss_bypass(x, lp, adv, mask, "token-mean", by_cfg)),
        ("decoupled", "rollout_log_prob", lambda x: compute_policy_loss_decoupled(old, lp, x, adv, mask,
                                                                                   "token-mean", rc_cfg)),
        ("decoupled", "old_log_prob", lambda x: compute_policy_loss_decoupled(x, lp, old, adv, mask, "token-mean",
                                                                               rc_cfg)),
        ("compute_policy_loss", "rollout_log_prob", lambda x: compute_policy_loss(old, lp, adv, mask, "token-mean",
                                                                                   rc_cfg, rollout_log_prob=x)),
        # GSPO's sequence ratio is a constant built from pi_old: pi_old with a gradient would lose it silently
        ("gspo", "old_log_prob", lambda x: compute_policy_loss_gspo(x, lp, adv, mask)),
        ("compute_policy_loss", "old_log_prob", lambda x: compute_policy_loss(x, lp, adv, mask, "token-mean",
                                                                               PolicyLossConfig(loss_mode="gspo"))),
        ("grpo", "old_logprobs", lambda x: calculate_grpo_loss(lp, x, ref, a_seq, 0.2, 0.2, 0.0, 0.0)),
        ("grpo", "advantages", lambda x: calculate_grpo_loss(lp, old, ref, x, 0.2, 0.2, 0.0, 0.0)),
        ("grpo", "inference_logprobs", lambda x: calculate_grpo_loss(lp, old, ref, a_seq, 0.2, 0.2, 0.0, 0.0,
                                                                     inference_logprobs=x)),
    ]


@pytest.mark.parametrize("device", ALL_BACKENDS)
def test_constants_that_require_grad_are_refused(device):
    """pi_old, pi_rollout, the advantages and the IS weights are constants of the objective: one that requires grad
    is a ValueError naming it (its gradient would otherwise be silently None), on every entry point and backend;
    detached, or with grad mode off, the same call runs."""
    with ops_on(device) as dev:
        old, lp, adv, mask, w = make_batch(device=dev)
        values = {"old_log_prob": old, "old_logprobs": old, "rollout_log_prob": old - 0.05,
                  "inference_logprobs": old - 0.05, "advantages": adv, "rollout_is_weights": w}
        for fn, name, call in _constant_cases(old, lp, adv, mask, w):
            x = values[name]
            if fn == "grpo" and name == "advantages":
                x = adv[:, 0].contiguous()
            with pytest.raises(ValueError, match=f"{name} requires grad"):
                call(x.detach().clone().requires_grad_(True))
            out = call(x)  # the same call with the constant detached
            assert torch.isfinite(out[0]).all(), (fn, name)
            with torch.no_grad():
                call(x.detach().clone().requires_grad_(True))  # no gradient asked for: nothing to refuse


@pytest.mark.parametrize("device", ALL_BACKENDS)
def test_double_backward_is_refused(device):
    """create_graph=True through a policy loss: the first-order gradient is the usual one, and differentiating it
    again raises (never a silent second derivative of 0), on every backend and entry point."""
    with ops_on(device) as dev:
        old, lp, adv, mask, w = make_batch(device=dev)
        calls = {
            "compute_policy_loss_vanilla": lambda: compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean",
                                                                               None, w)[0],
            "compute_policy_loss_reinforce": lambda: compute_policy_loss_reinforce(old, lp, adv, mask)[0],
            "calculate_grpo_loss": lambda: calculate_grpo_loss(lp, old, old - 0.1, adv[:, 0].contiguous(), 0.2,
                                                               0.2, 0.0, 0.0)[0].sum(),
            # the whole-batch losses: kl_cov's penalty has an autograd node of its own
            "compute_policy_loss_kl_cov": lambda: losses.compute_policy_loss_kl_cov(
                old, lp, adv, mask, "token-mean", PolicyLossConfig(kl_cov_ratio=0.2), w)[0],
            "compute_policy_loss_clip_cov": lambda: losses.compute_policy_loss_clip_cov(
                old, lp, adv, mask, "token-mean", PolicyLossConfig(clip_cov_ratio=0.2, clip_cov_lb=-5.0), w)[0],
        }
        for what, call in calls.items():
            g1, = torch.autograd.grad(call(), lp)
            g2, = torch.autograd.grad(call(), lp, create_graph=True)
            torch.testing.assert_close(g2.detach(), g1, rtol=0, atol=0)
            assert g2.requires_grad, what
            with pytest.raises(RuntimeError, match=f"{what}: double backward"):
                torch.autograd.grad(g2.sum(), lp)


def test_double_backward_of_the_raw_op_is_refused():
    """torch.ops.rollout_corr.policy_loss_rows itself (its registered autograd formula): the gradient of a
    create_graph=True backward cannot be differentiated again (it came back None: a silent second derivative)."""
    old, lp, adv, mask, _ = make_batch()
    lp = lp.detach().requires_grad_(True)
    loss_mat, rows = torch.ops.rollout_corr.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.28, 3.0,
                                                             LY.PG_KIND_PPO_UNBOUNDED)
    g1, = torch.autograd.grad(loss_mat.sum() + rows[:, LY.PG_ROW_LOSS_SUM].sum(), lp, create_graph=True)
    assert g1.requires_grad
    with pytest.raises(RuntimeError, match="rollout_corr::policy_loss_rows: double backward"):
        torch.autograd.grad(g1.sum(), lp)


@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_bad_input(device):
    with ops_on(device) as dev:
        _policy_loss_bad_input(*make_batch(device=dev))


def _policy_loss_bad_input(old, lp, adv, mask, w):
    for c in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="clip_ratio_c must be > 0"):
            PolicyLossConfig(clip_ratio_c=c)
    # PPO's dual clip needs c > 1 (verl asserts it), refused where the loss reads it; DPPO caps at any c > 0
    with pytest.raises(ValueError, match=r"clip_ratio_c \(the dual-clip bound c of PPO's loss\) must be > 1.0"):
        compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", PolicyLossConfig(clip_ratio_c=1.0))
    with pytest.raises(ValueError, match="clip_ratio_low"):
        PolicyLossConfig(clip_ratio_low=-0.1)
    with pytest.raises(ValueError, match="dp_size"):
        PolicyLossConfig(dp_size=0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss_vanilla(old, lp, adv, mask, "mean")
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss_vanilla(old, lp, adv[:, :-1], mask)
    with pytest.raises(ValueError, match="response_mask"):
        compute_policy_loss_vanilla(old, lp, adv, mask[:-1])
    with pytest.raises(ValueError, match="rollout_is_weights"):
        compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", None, w[:, :1])
    with pytest.raises(TypeError, match="old_log_prob"):
        compute_policy_loss_vanilla(old.long(), lp, adv, mask)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss_reinforce(old[:1], lp, adv, mask)
    with pytest.raises(TypeError, match="config"):
        compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", 0.2)
    with pytest.raises(ValueError, match="rollout_correction"):
        compute_policy_loss_bypass(old, lp, adv, mask, "token-mean", PolicyLossConfig())


def test_config_global_batch_copy():
    cfg = PolicyLossConfig(clip_ratio=0.1)
    cfg2 = cfg.with_global_batch(dp_size=2, batch_num_tokens=10)
    assert cfg.dp_size == 1 and cfg2.dp_size == 2 and cfg2.clip_ratio == 0.1
    assert cfg2.global_batch_info == dict(dp_size=2, batch_num_tokens=10, global_batch_size=None, loss_scale_factor=None)
    with pytest.raises(TypeError, match="unknown"):
        cfg.with_global_batch(clip_ratio=0.3)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        cfg.with_global_batch(batch_num_tokens=0)


# ------------------------------------------------------------------------------------------------------------
# Bypass and decoupled flows (rollout correction computed inside)
# ------------------------------------------------------------------------------------------------------------


def _rc(**kw):
    from rollout_corr_ext.config import RolloutCorrectionConfig

    return RolloutCorrectionConfig(**kw)


@needs_correction
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_type,is_level,rs", [
    ("ppo_clip", "token", None),
    ("ppo_clip", None, "seq_mean_k1"),
    ("reinforce", "sequence", None),
    ("reinforce", "token", "seq_max_k2"),
])
def test_bypass_matches_oracle(mode, loss_type, is_level, rs, device):
    with ops_on(device) as dev:
        _bypass_matches_oracle(mode, loss_type, is_level, rs, dev)


def _bypass_matches_oracle(mode, loss_type, is_level, rs, dev):
    from rollout_corr_ext.correction import compute_rollout_correction

    rollout, lp, adv, mask, _ = make_batch(reject_rows=(), device=dev)
    rc = _rc(rollout_is=is_level, rollout_rs=rs, rollout_rs_threshold=(0.02 if rs == "seq_max_k2" else "0.8_1.25") if rs else None,
             bypass_mode=True, loss_type=loss_type)
    cfg = PolicyLossConfig(rollout_correction=rc)
    loss, metrics = compute_policy_loss_bypass(rollout, lp, adv, mask, mode, cfg)
    corr = compute_rollout_correction(lp.detach(), rollout, mask, rc)
    if loss_type == "ppo_clip":  # weights only logged
        pg, clipfrac, _, _ = R.ppo_clip_loss_dense(rollout, lp, adv, corr.response_mask, 0.2, 0.2, 3.0)
        torch.testing.assert_close(metrics["actor/pg_clipfrac"], clipfrac)
    else:
        pg = -adv * lp * (1.0 if corr.weights is None else corr.weights)
    ref = R.agg_loss_dense(pg, corr.response_mask, mode)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(_grad(loss, lp), _grad(ref, lp))
    assert any(k.startswith("rollout_corr/") for k in metrics)
    if rs is not None:
        assert (corr.response_mask != mask).any(), "the RS threshold should reject something in this batch"
    # the one-call dispatcher takes the same path
    loss2, _ = compute_policy_loss(None, lp, adv, mask, mode, cfg, rollout_log_prob=rollout)
    torch.testing.assert_close(loss2, loss)


@needs_correction
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_decoupled_matches_oracle(mode, device):
    with ops_on(device) as dev:
        _decoupled_matches_oracle(mode, dev)


def _decoupled_matches_oracle(mode, dev):
    from rollout_corr_ext.correction import compute_rollout_correction

    old, lp, adv, mask, _ = make_batch(reject_rows=(), device=dev)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5), dtype=old.dtype).to(dev)
    rc = _rc(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.85_1.15")
    cfg = PolicyLossConfig(rollout_correction=rc)
    loss, metrics = compute_policy_loss_decoupled(old, lp, rollout, adv, mask, mode, cfg)
    corr = compute_rollout_correction(old, rollout, mask, rc)
    assert corr.weights is not None and (corr.response_mask != mask).any()
    pg, *_ = R.ppo_clip_loss_dense(old, lp, adv, corr.response_mask, 0.2, 0.2, 3.0, corr.weights)
    ref = R.agg_loss_dense(pg, corr.response_mask, mode)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(_grad(loss, lp), _grad(ref, lp))
    for k, v in corr.metrics.items():
        torch.testing.assert_close(metrics[k], v)
    with pytest.raises(ValueError, match="bypass"):
        compute_policy_loss_decoupled(old, lp, rollout, adv, mask, mode,
                                      PolicyLossConfig(rollout_correction=_rc(bypass_mode=True)))


# ------------------------------------------------------------------------------------------------------------
# Megatron-LM RL GRPO form
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tis", [None, 1.5])
@pytest.mark.parametrize("with_inference", [False, True])
def test_grpo_matches_megatron_form(tis, with_inference, device):
    with ops_on(device) as dev:
        _grpo_matches_megatron_form(tis, with_inference, dev)


def _grpo_matches_megatron_form(tis, with_inference, dev):
    old, lp, _, _, _ = make_batch(reject_rows=(), device=dev)
    g = torch.Generator().manual_seed(3)
    ref_lp = old + 0.2 * torch.randn(old.shape, generator=g, dtype=old.dtype).to(dev)
    inf_lp = old + 0.3 * torch.randn(old.shape, generator=g, dtype=old.dtype).to(dev) if with_inference else None
    adv = torch.randn(old.shape[0], generator=g, dtype=old.dtype).to(dev)
    out = calculate_grpo_loss(lp, old, ref_lp, adv, 0.2, 0.28, 0.05, 0.01, inf_lp, tis)
    w = None
    if with_inference:
        w = (old - inf_lp).exp()
        w = w if tis is None else torch.clamp(w, max=tis)
    ref = R.grpo_loss_dense(lp, old, ref_lp, adv, 0.2, 0.28, 0.05, 0.01, w)
    assert len(out) == 6
    for ours, theirs in zip(out, ref):
        torch.testing.assert_close(ours, theirs.detach() if ours.dtype != torch.bool and not ours.requires_grad else theirs)
    torch.testing.assert_close(_grad(out[0].sum(), lp), _grad(ref[0].sum(), lp))
    assert out[4].any() and out[5].any()


@needs_correction
@pytest.mark.parametrize("device", DEVICES)
def test_grpo_with_rollout_correction(device):
    with ops_on(device) as dev:
        _grpo_with_rollout_correction(dev)


def _grpo_with_rollout_correction(dev):
    from rollout_corr_ext.correction import compute_rollout_correction

    old, lp, _, mask, _ = make_batch(reject_rows=(), device=dev)
    g = torch.Generator().manual_seed(4)
    inf_lp = old + 0.3 * torch.randn(old.shape, generator=g, dtype=old.dtype).to(dev)
    adv = torch.randn(old.shape[0], generator=g, dtype=old.dtype).to(dev)
    rc = _rc(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.85_1.15")
    out = calculate_grpo_loss(lp, old, old, adv, 0.2, 0.2, 0.0, 0.0, inf_lp, rollout_correction=rc, response_mask=mask)
    assert len(out) == 7
    corr = compute_rollout_correction(old, inf_lp, mask, rc)
    ref = R.grpo_loss_dense(lp, old, old, adv, 0.2, 0.2, 0.0, 0.0, corr.weights)[0] * (corr.response_mask != 0)
    torch.testing.assert_close(out[0], ref)
    torch.testing.assert_close(out[6].response_mask, corr.response_mask)
    with pytest.raises(ValueError, match="is_truncation_coef"):
        calculate_grpo_loss(lp, old, old, adv, 0.2, 0.2, 0.0, 0.0, inf_lp, 2.0, rollout_correction=rc)


@pytest.mark.parametrize("device", DEVICES)
def test_grpo_bad_input(device):
    with ops_on(device) as dev:
        old, lp, _, _, _ = make_batch(device=dev)
        zeros3, zeros6 = torch.zeros(3, device=dev), torch.zeros(6, device=dev)
        with pytest.raises(ValueError, match="advantages"):
            calculate_grpo_loss(lp, old, old, zeros3, 0.2, 0.2, 0.0, 0.0)
        with pytest.raises(ValueError, match="ref_logprobs"):
            calculate_grpo_loss(lp, old, old[:, :2], zeros6, 0.2, 0.2, 0.0, 0.0)
        with pytest.raises(ValueError, match="is_truncation_coef"):
            calculate_grpo_loss(lp, old, old, zeros6, 0.2, 0.2, 0.0, 0.0, old, 0.0)
        with pytest.raises(ValueError, match="clamp_eps_lower"):
            calculate_grpo_loss(lp, old, old, zeros6, -0.2, 0.2, 0.0, 0.0)
        for bad in (float("nan"), float("inf")):  # would make every token's loss NaN / inf
            with pytest.raises(ValueError, match="kl_beta must be finite"):
                calculate_grpo_loss(lp, old, old, zeros6, 0.2, 0.2, bad, 0.0)
            with pytest.raises(ValueError, match="entropy_weight must be finite"):
                calculate_grpo_loss(lp, old, old, zeros6, 0.2, 0.2, 0.0, bad)
        with pytest.raises(TypeError, match="clamp_eps_upper must be a real number"):
            calculate_grpo_loss(lp, old, old, zeros6, 0.2, True, 0.0, 0.0)
        with pytest.raises(TypeError, match="kl_beta must be a real number"):
            calculate_grpo_loss(lp, old, old, zeros6, 0.2, 0.2, torch.tensor(0.1), 0.0)


# ------------------------------------------------------------------ undefined losses are errors, not NaN


def _pl_inputs():
    g = torch.Generator().manual_seed(4)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    return lp, old, adv, mask


@pytest.mark.parametrize("device", device_params("cpu", "emulated", cuda_reason="an asynchronous device assert on "
                                                 "CUDA (poisons the context): tests/test_cuda.py, in a subprocess"))
@pytest.mark.parametrize("case", ["lp_nan", "old_nan", "lp_posinf", "both_neg_inf", "adv_nan", "weight_inf"])
@pytest.mark.parametrize("fn", ["vanilla", "reinforce"])
def test_undefined_policy_loss_raises_naming_the_token(case, fn, device):
    """CPU tensors (compiled kernels, fallback, emulated CUDA kernels): a ValueError naming the token. On CUDA the
    same condition is an asynchronous device assert: tests/test_cuda.py runs it in a subprocess, and
    test_undefined_values_at_masked_tokens_are_not_inspected below runs the masked half on every device."""
    with ops_on(device):
        _undefined_policy_loss_raises_naming_the_token(case, fn)


def _undefined_policy_loss_raises_naming_the_token(case, fn):
    lp, old, adv, mask = _pl_inputs()
    w = torch.ones(3, 5, dtype=torch.float64)
    nan, inf = float("nan"), float("inf")
    {"lp_nan": lambda: lp.__setitem__((1, 2), nan), "old_nan": lambda: old.__setitem__((1, 2), nan),
     "lp_posinf": lambda: lp.__setitem__((1, 2), inf),
     "both_neg_inf": lambda: (lp.__setitem__((1, 2), -inf), old.__setitem__((1, 2), -inf)),
     "adv_nan": lambda: adv.__setitem__((1, 2), nan), "weight_inf": lambda: w.__setitem__((1, 2), inf)}[case]()
    call = compute_policy_loss_vanilla if fn == "vanilla" else compute_policy_loss_reinforce
    before = [t.clone() for t in (lp, old, adv, w)]
    # the message names the arguments that can hold the bad value (the IS weights by their argument name)
    with pytest.raises(ValueError, match=r"policy loss undefined at response token \(1, 2\).*rollout_is_weights"):
        call(old, lp.requires_grad_(True), adv, mask, rollout_is_weights=w)
    # The same values at a masked-out token are not inspected: a finite loss and gradient.
    lp2, old2, adv2, w2 = (t.detach().clone() for t in (lp, old, adv, w))
    for t, b in zip((lp2, old2, adv2, w2), before):
        t[2, 4] = t[1, 2]
        t[1, 2] = b[1, 2] if torch.isfinite(b[1, 2]) else 0.0
    lp2[1, 2], old2[1, 2], adv2[1, 2], w2[1, 2] = -0.5, -0.4, 0.3, 1.0
    lp2.requires_grad_(True)
    loss, _ = call(old2, lp2, adv2, mask, rollout_is_weights=w2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp2.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["lp_nan", "old_nan", "lp_posinf", "both_neg_inf", "adv_nan", "weight_inf"])
@pytest.mark.parametrize("fn", ["vanilla", "reinforce"])
def test_undefined_values_at_masked_tokens_are_not_inspected(case, fn, device):
    """NaN / inf at a token the mask excludes: a finite loss and gradient on every device (nothing asserts)."""
    lp, old, adv, mask = _pl_inputs()
    w = torch.ones(3, 5, dtype=torch.float64)
    nan, inf = float("nan"), float("inf")
    pos = (2, 4)  # masked out by _pl_inputs
    {"lp_nan": lambda: lp.__setitem__(pos, nan), "old_nan": lambda: old.__setitem__(pos, nan),
     "lp_posinf": lambda: lp.__setitem__(pos, inf),
     "both_neg_inf": lambda: (lp.__setitem__(pos, -inf), old.__setitem__(pos, -inf)),
     "adv_nan": lambda: adv.__setitem__(pos, nan), "weight_inf": lambda: w.__setitem__(pos, inf)}[case]()
    call = compute_policy_loss_vanilla if fn == "vanilla" else compute_policy_loss_reinforce
    with ops_on(device) as dev:
        lp_d = lp.to(dev).requires_grad_(True)
        loss, _ = call(old.to(dev), lp_d, adv.to(dev), mask.to(dev), rollout_is_weights=w.to(dev))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp_d.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_neg_inf_log_prob_under_ppo_is_defined_by_the_clamp(device):
    """PPO clamps the log-ratio to [-20, 20] (verl): log_prob -inf against a finite old_log_prob is a finite loss."""
    lp, old, adv, mask = _pl_inputs()
    lp[0, 1] = float("-inf")
    with ops_on(device) as dev:
        lp, old, adv, mask = lp.to(dev).requires_grad_(True), old.to(dev), adv.to(dev), mask.to(dev)
        loss, metrics = compute_policy_loss_vanilla(old, lp, adv, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and torch.isfinite(metrics["actor/ppo_kl"])
        if dev != "cuda":  # REINFORCE's -inf log_prob at a response token: CUDA asserts (tests/test_cuda.py)
            with pytest.raises(ValueError, match=r"response token \(0, 1\)"):
                compute_policy_loss_reinforce(old, lp, adv, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kl_beta, entropy_weight, kl_is_correction",
                         [(0.0, 0.0, False), (0.0, 0.01, False), (0.05, 0.0, False), (0.05, 0.01, True)])
def test_grpo_at_a_zero_probability_token(kl_beta, entropy_weight, kl_is_correction, device):
    """calculate_grpo_loss at a live token the current policy gives probability 0 (log-prob -inf, finite old and ref):
    the clipped surrogate is defined (ratio e^-20), p log p is 0 (its limit, gradient 0 too) and k3 is +inf (its
    limit, derivative -inf). With kl_beta = 0 the loss there is the surrogate's, not 0 * inf = NaN; elsewhere the
    fp64 Megatron-form oracle. An undefined KL (ref and current both -inf, or a NaN ref) is refused, unless
    kl_beta = 0."""
    with ops_on(device) as dev:
        old, lp, _, _, _ = make_batch(reject_rows=(), device=dev)
        g = torch.Generator().manual_seed(5)
        ref = old + 0.2 * torch.randn(old.shape, generator=g, dtype=old.dtype).to(dev)
        adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, 0.0], dtype=old.dtype, device=dev)
        lp = lp.detach().clone()
        lp[0, 2] = lp[1, 4] = float("-inf")
        lp.requires_grad_(True)
        out = calculate_grpo_loss(lp, old, ref, adv, 0.2, 0.28, kl_beta, entropy_weight,
                                  kl_is_correction=kl_is_correction)
        (grad,) = torch.autograd.grad(out[0].sum(), lp)
        at = torch.zeros(lp.shape, dtype=torch.bool, device=dev)
        at[0, 2] = at[1, 4] = True
        def oracle(x):  # the fp64 Megatron form; kl_is_correction weights k3 by pi / pi_old
            want = R.grpo_loss_dense(x, old, ref, adv, 0.2, 0.28, kl_beta, entropy_weight)
            return want[0] + kl_beta * ((x - old).exp() - 1) * want[1] if kl_is_correction else want[0]

        # the oracle on the finite tokens
        torch.testing.assert_close(out[0].detach()[~at], oracle(lp.detach().masked_fill(at, -1.0))[~at])
        # at the zero-probability tokens, by hand: r = e^-20 (the clamp); A > 0 keeps r A, A < 0 the clip 0.8 A
        r = torch.exp(torch.tensor(-20.0, dtype=old.dtype))
        surrogate = torch.stack([-r * adv[0], -(1 - 0.2) * adv[1]])
        got = out[0].detach()[at]
        if kl_beta == 0:
            torch.testing.assert_close(got, surrogate.to(got.device))
            assert (grad[at] == 0).all()
        else:
            assert (got == float("inf")).all() and (grad[at] == float("-inf")).all()
        assert (out[1].detach()[at] == float("inf")).all() and (out[3].detach()[at] == 0).all()
        assert torch.isfinite(grad[~at]).all()
        (want_grad,) = torch.autograd.grad(oracle(lp.masked_fill(at, -1.0)).sum(), lp)
        torch.testing.assert_close(grad[~at], want_grad[~at])
        if dev != "cuda":  # CUDA asserts asynchronously
            for bad_ref in (float("-inf"), float("nan")):
                ref_bad = ref.clone()
                ref_bad[1, 4] = bad_ref
                if kl_beta != 0:
                    with pytest.raises(ValueError, match=r"KL term is undefined at response token \(1, 4\)"):
                        calculate_grpo_loss(lp, old, ref_bad, adv, 0.2, 0.28, kl_beta, entropy_weight)
                else:
                    assert torch.isfinite(calculate_grpo_loss(lp, old, ref_bad, adv, 0.2, 0.28, 0.0,
                                                              entropy_weight)[0]).all()


@pytest.mark.parametrize("device", device_params("cpu", "fallback", "emulated", cuda_reason="an asynchronous device "
                                                 "assert on CUDA (poisons the context)"))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_float_mask_must_be_finite_and_non_negative(bad, device):
    with ops_on(device):
        _a_float_mask_must_be_finite_and_non_negative(bad)


def _a_float_mask_must_be_finite_and_non_negative(bad):
    """A float response_mask weights each token's loss (verl multiplies it in): a NaN one made the loss and every
    metric NaN, silently (the versions fuzz); inf and negative weights define no loss either. Refused, naming the
    position, in the front door and verl's drop-in alike (by the policy-loss kernel, on the values it reads anyway:
    a separate pass over the mask doubled gpg's time); fractional weights stay accepted."""
    from rollout_corr_ext import verl as rv

    old, lp, adv, mask, _ = make_batch(reject_rows=())
    w = mask.to(lp.dtype) * 0.5
    assert torch.isfinite(compute_policy_loss(old, lp, adv, w, "token-mean", None)[0])
    w[2, 3] = bad
    for fn in (compute_policy_loss, rv.compute_policy_loss_vanilla, compute_policy_loss_reinforce):
        with pytest.raises(ValueError, match=r"undefined at response token \(2, 3\): a response_mask weight NaN, inf "
                                             r"or < 0"):
            fn(old, lp, adv, w, "token-mean", None)
    for mode in ("gpg", "cispo", "kl_cov", "clip_cov", "geo_mean"):
        with pytest.raises(ValueError, match=r"\(2, 3\)"):
            compute_policy_loss(old, lp, adv, w, "token-mean", losses.PolicyLossConfig(loss_mode=mode))
    # agg_loss too: a NaN weight made token-mean NaN and dropped its row from the seq-mean modes (a finite value)
    for mode in LOSS_AGG_MODES:
        with pytest.raises(ValueError, match=r"loss_mask at \(2, 3\) is .*finite and >= 0"):
            agg_loss(lp.detach(), w, mode)
    # the weights as the loss computes with them (the review): an fp64 1e300 is inf in fp32 (the fallback checked
    # the fp64 value and returned NaN), -1e-50 is -0 there (accepted); a negative integer weight flips the sign
    lp32, old32, adv32 = (t.float() for t in (lp.detach(), old, adv))
    w64 = mask.to(torch.float64)
    w64[2, 3] = 1e300
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        compute_policy_loss(old32, lp32, adv32, w64, "token-mean", None)
    with pytest.raises(ValueError, match=r"loss_mask at \(2, 3\) is inf"):
        agg_loss(lp32, w64, "token-mean")
    w64[2, 3] = -1e-50
    assert torch.isfinite(compute_policy_loss(old32, lp32, adv32, w64, "token-mean", None)[0])
    assert torch.isfinite(agg_loss(lp32, w64, "token-mean"))
    wi = mask.to(torch.int64)
    wi[2, 3] = -1
    with pytest.raises(ValueError, match=r"loss_mask at \(2, 3\) is -1"):
        agg_loss(lp.detach(), wi, "token-mean")
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        compute_policy_loss(old, lp, adv, wi, "token-mean", None)


@pytest.mark.parametrize("device", ALL_BACKENDS)
def test_megatron_loss_func_and_verl_adapter_refuse_constants_with_grad(device):
    """The same rules through megatron's loss_func (logits in, old / rollout log-probs and advantages bound at
    build time) and the verl adapter; create_graph=True through loss_func raises too."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from rollout_corr_ext import verl as rc_verl
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    with ops_on(device) as dev:
        old, lp, adv, mask, w = make_batch(device=dev)
        b, s, v = old.shape[0], old.shape[1], 11
        g = torch.Generator().manual_seed(3)
        logits = torch.randn(s, b, v, generator=g, dtype=old.dtype).to(dev).requires_grad_(True)
        target = torch.randint(0, v, (b, s), generator=g).to(dev)
        for mode, kw in (("decoupled", dict(old_log_prob=old, rollout_log_prob=old - 0.05, config=PolicyLossConfig(
                rollout_correction=RolloutCorrectionConfig.decoupled_token_is()))),
                         ("bypass", dict(rollout_log_prob=old - 0.05, config=PolicyLossConfig(
                             rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip())))):
            names = [k for k in ("old_log_prob", "rollout_log_prob") if k in kw] + ["advantages"]
            for name in names:
                args = dict(kw, advantages=adv)
                args[name] = args[name].detach().clone().requires_grad_(True)
                with pytest.raises(ValueError, match=f"{name} requires grad"):
                    make_policy_loss_func(target, args.pop("advantages"), mask, **args)(logits)
            loss_sum = make_policy_loss_func(target, adv, mask, **kw)(logits)[0]
            grad, = torch.autograd.grad(loss_sum, logits, create_graph=True)
            with pytest.raises(RuntimeError, match="double backward"):
                torch.autograd.grad(grad.sum(), logits)
        with pytest.raises(ValueError, match="old_log_prob requires grad"):
            rc_verl.compute_policy_loss_vanilla(old.detach().clone().requires_grad_(True), lp, adv, mask,
                                                "token-mean", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_is_the_same_bits_in_every_layout(mode, dtype):
    """The same values in another layout (a transposed mask or loss, a step-2 slice): the same bits, value and
    gradient. ATen's row sums follow the layout, so a transposed mask moved the loss by up to 99 ulp of a cancelling
    result in fp32 (2.5 in fp64; the layout fuzz): row sums run on row-major values."""
    def tr(x):
        return x.t().contiguous().t()

    def step2(x):
        return torch.stack([x, torch.ones_like(x)], -1)[..., 0]

    for seed in (70, 234, 5):
        g = torch.Generator().manual_seed(seed)
        lm = torch.randn(4, 34, generator=g, dtype=dtype)
        m = (torch.rand(4, 34, generator=g) < 0.8).to(dtype)
        want_x = lm.clone().requires_grad_(True)
        want = losses.agg_loss(want_x, m, mode)
        want.backward()
        for lx, mx in ((lm, tr(m)), (tr(lm), m), (tr(lm), tr(m)), (step2(lm), step2(m))):
            x = lx.detach().clone() if lx.is_contiguous() else lx.detach()
            x.requires_grad_(True)
            got = losses.agg_loss(x, mx, mode)
            got.backward()
            assert torch.equal(got, want), (seed, (got - want).item())
            assert torch.equal(x.grad, want_x.grad)
