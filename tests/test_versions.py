"""Per-token policy versions (rollout_corr_ext.versions): AReaL's proximal approximation against formulas written
out token by token, staleness metrics against a loop oracle and exact over DP = 2 (gloo), and the front door's
decoupled flow without a pi_old forward pass."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_corr_ext import RolloutCorrectionConfig, losses
from rollout_corr_ext.versions import (compute_rollout_correction_by_lag, proximal_error_metrics, proximal_log_prob,
                                       staleness_metrics)
from rollout_corr_testing.dist_utils import dist_params, run_workers


def _inputs(b=5, t=12, seed=0, current=10):
    g = torch.Generator().manual_seed(seed)
    lb = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lt = lb + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    versions = torch.randint(current - 5, current + 1, (b, t), generator=g)
    versions[0, :3] = -1  # not generated (prompt) tokens: not response tokens either
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[0, :3] = False
    return lb, lt, versions, mask


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_proximal_matches_formula_token_by_token(method):
    lb, lt, versions, _ = _inputs()
    cur = 10
    got = proximal_log_prob(lb, lt, versions, cur, method)
    for (i, j), v in zip(torch.cartesian_prod(torch.arange(5), torch.arange(12)).tolist(), versions.reshape(-1).tolist()):
        a = (cur - 1 - v) / (cur - v) if (cur - v > 0 and v >= 0) else 0.0
        a = min(max(a, 0.0), 1.0)
        b_, t_ = float(lb[i, j]), float(lt[i, j])
        want = b_ + a * (t_ - b_) if method == "loglinear" else math.log((1 - a) * math.exp(b_) + a * math.exp(t_))
        assert float(got[i, j]) == pytest.approx(want, rel=1e-12, abs=1e-12), (i, j, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_proximal_lags_of_large_versions_are_exact(method, dtype):
    """The lag v_theta - v_b is taken in integers: versions past 2^24 (fp32's integers) keep their alpha in every
    dtype (they were rounded to fp32 first: lag 2 became 0 or 4)."""
    base = 2 ** 40
    lb, lt = torch.tensor([-1.0, -1.0, -1.0], dtype=dtype), torch.tensor([-2.0, -2.0, -2.0], dtype=dtype)
    got = proximal_log_prob(lb, lt, torch.tensor([base - 1, base - 2, base - 4]), base, method)
    for i, lag in enumerate((1, 2, 4)):
        a = (lag - 1) / lag
        want = -1.0 - a if method == "loglinear" else math.log((1 - a) * math.exp(-1.0) + a * math.exp(-2.0))
        assert float(got[i]) == pytest.approx(want, rel=1e-6), (lag, float(got[i]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_proximal_at_large_lags_keeps_its_digits(method, dtype):
    """At lag L, alpha = (L - 1) / L and 1 - alpha = 1 / L. The linear mix took log1p(-alpha) of an fp32 alpha,
    which keeps no digits of 1 / L: lag 1e6 was 0.013 off, and from 2^25 alpha rounded to 1 and pi_theta came back
    (-100 for -17.3; the versions fuzz). Oracle: AReaL's formula in Python floats."""
    lags = [2, 10, 1000, 10 ** 4, 10 ** 6, 10 ** 7, 2 ** 25, 2 ** 40]
    lb = torch.full((len(lags),), -0.5, dtype=dtype)
    lt = torch.full((len(lags),), -40.0, dtype=dtype)
    v_theta = 2 ** 41
    got = proximal_log_prob(lb, lt, torch.tensor([v_theta - lag for lag in lags]), v_theta, method)
    b, t = float(lb[0]), float(lt[0])
    for i, lag in enumerate(lags):
        a = (lag - 1) / lag
        want = b + a * (t - b) if method == "loglinear" else math.log(math.exp(b) / lag + a * math.exp(t))
        # one rounding of the result in the accumulation dtype (fp32 below fp64), a few ulps of the operands
        rel = 1e-13 if dtype == torch.float64 else 1e-6
        assert float(got[i]) == pytest.approx(want, rel=rel), (lag, float(got[i]), want)
    # pi_b = 0 (log -inf) at 0 < alpha < 1 is -inf at every lag: the fp32 alpha of a lag past 2^25 is 1, and the
    # log-linear mix's (1 - alpha) * -inf read 0 * -inf = NaN (the review)
    # (the linear mix is then log(alpha) + log pi_theta, finite)
    got = proximal_log_prob(torch.full_like(lb, -math.inf), lt, torch.tensor([v_theta - lag for lag in lags]),
                            v_theta, method)
    for i, lag in enumerate(lags):
        want = -math.inf if method == "loglinear" else t + math.log1p(-1 / lag)
        assert float(got[i]) == pytest.approx(want, rel=1e-6), (lag, float(got[i]), want)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_proximal_at_alpha_0_and_1_is_the_endpoint_whatever_the_other_holds(method):
    """alpha 0 (lag 1, a prompt token) is pi_b exactly, even where log pi_theta is NaN or +-inf (0 * NaN was NaN);
    pi_b = 0 (log -inf) at 0 < alpha < 1 gives -inf in the log-linear mix (it was -inf + inf = NaN)."""
    lb = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    lt = torch.tensor([math.nan, -math.inf, math.inf, math.nan], dtype=torch.float64)
    got = proximal_log_prob(lb, lt, torch.tensor([9, 9, 9, -1]), 10, method)
    assert got.tolist() == [-1.0] * 4
    got = proximal_log_prob(torch.tensor([-math.inf]), torch.tensor([-1.0]), torch.tensor([8]), 10, method)
    want = -math.inf if method == "loglinear" else math.log(0.5) - 1.0
    assert float(got[0]) == pytest.approx(want)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_proximal_is_fp64_when_either_input_is(method):
    """fp64 when either log-prob is fp64, as the correction promotes: an fp64 pi_b with fp32 log pi_theta was
    rounded to fp32 (alpha 0 returned pi_b 4.8e-8 off; the dtype fuzz), an fp64 log pi_theta with fp32 pi_b was
    not. Oracle: the mix of the module docstring in fp64 at lag 2 (alpha 1/2)."""
    b64 = torch.tensor([-1.0000000001, -2.3, -0.7], dtype=torch.float64)
    t64 = torch.tensor([-1.1, -2.0, -0.2], dtype=torch.float64)
    versions = torch.tensor([10, 8, 9])  # lags 0 (a newest token: alpha 0), 2, 1 (alpha 0)
    half = 0.5 * (b64 + t64) if method == "loglinear" else torch.logaddexp(b64, t64) + math.log(0.5)
    want = torch.where(versions == 8, half, b64)
    for b, t in ((b64, t64.float()), (b64.float(), t64), (b64, t64)):
        got = proximal_log_prob(b, t, versions, 10, method)
        assert got.dtype == torch.float64
        want_here = torch.where(versions == 8, (0.5 * (b.double() + t.double()) if method == "loglinear" else
                                                torch.logaddexp(b.double(), t.double()) + math.log(0.5)), b.double())
        torch.testing.assert_close(got, want_here, rtol=1e-15, atol=0)
    assert proximal_log_prob(b64, t64.float(), versions, 10, method)[0].item() == b64[0].item()  # alpha 0: pi_b
    assert proximal_log_prob(b64.float(), t64.float(), versions, 10, method).dtype == torch.float32
    torch.testing.assert_close(proximal_log_prob(b64, t64, versions, 10, method), want, rtol=1e-15, atol=0)


def test_policy_lag_reads_any_mask_dtype():
    """A non-bool mask counts where it is not 0 (an int mask of 2 skipped the newer-than-trainer check; a float mask
    raised an unnamed bitwise error)."""
    from rollout_corr_ext.versions import policy_lag

    for mask in (torch.tensor([2, 2]), torch.tensor([1.0, 0.5]), torch.tensor([True, True])):
        with pytest.raises(ValueError, match=r"versions at response token \(1,\) is 9, newer than current_version 5"):
            policy_lag(torch.tensor([3, 9]), 5, mask)
    assert policy_lag(torch.tensor([3, 9]), 5, torch.tensor([2, 0])).tolist() == [2, -4]


def test_proximal_is_exact_when_log_probs_move_linearly_in_versions():
    """If log pi_v moves linearly in v between the behaviour version and the current one, the log-linear
    approximation of pi_{current - 1} is exact, and its error metrics are 0; per-row versions broadcast."""
    g = torch.Generator().manual_seed(1)
    b, t, cur = 4, 9, 7
    lb = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    lt = lb + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    vrow = torch.tensor([3, 5, 6, 7])
    v = vrow.unsqueeze(-1).double()
    true_prox = torch.where(v < cur, lb + (cur - 1 - v) / (cur - v).clamp(min=1) * (lt - lb), lb)
    approx = proximal_log_prob(lb, lt, vrow, cur)
    assert torch.allclose(approx, true_prox, rtol=1e-13, atol=1e-14)
    err = proximal_error_metrics(approx, true_prox, torch.ones(b, t))
    assert float(err["rollout_corr/prox_approx_abs_error"]) < 1e-13
    err = proximal_error_metrics(approx, lt, torch.ones(b, t))  # against pi_theta itself: not 0
    assert float(err["rollout_corr/prox_approx_abs_error"]) > 1e-3


def test_staleness_metrics_equal_loop_oracle():
    lb, lt, versions, mask = _inputs(seed=2)
    versions = versions.clamp(min=0)
    got = staleness_metrics(versions, 10, mask, max_lag=3)
    lags = [10 - int(v) for v, m in zip(versions.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m]
    assert float(got["rollout_corr/staleness_mean"]) == pytest.approx(sum(lags) / len(lags))
    assert float(got["rollout_corr/staleness_max"]) == max(lags)
    assert float(got["rollout_corr/staleness_min"]) == min(lags)
    want_hist = [sum(1 for x in lags if x == k) for k in range(4)] + [sum(1 for x in lags if x > 3)]
    assert got["rollout_corr/staleness_hist"].tolist() == want_hist


def test_staleness_refuses_a_token_newer_than_the_trainer():
    lb, lt, versions, mask = _inputs(seed=2)
    versions = versions.clone()
    versions[1, 1] = 11
    mask[1, 1] = True
    with pytest.raises(ValueError, match=r"response token \(1, 1\) is 11, newer than current_version 10"):
        staleness_metrics(versions, 10, mask)


def test_staleness_refuses_a_negative_version_at_a_response_token():
    """A negative version marks a token the engine did not generate (proximal_log_prob's alpha 0); at a response
    token it was counted as a lag of current_version + 1 (max 11 here, the mean pulled up), silently. It is refused,
    naming the token, in staleness_metrics and compute_rollout_correction_by_lag; elsewhere it is not read."""
    lb, lt, versions, mask = _inputs(seed=2)
    want = staleness_metrics(versions, 10, mask)
    assert float(want["rollout_corr/staleness_max"]) <= 5
    mask = mask.clone()
    mask[0, 1] = True
    with pytest.raises(ValueError, match=r"response token \(0, 1\) is -1, negative"):
        staleness_metrics(versions, 10, mask)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    with pytest.raises(ValueError, match=r"response token \(0, 1\) is -1, negative"):
        compute_rollout_correction_by_lag(lt, lb, mask, [(0, cfg)], versions, 10)
    for bad in (-1, 2 ** 63):
        with pytest.raises(ValueError, match=r"current_version must be in \[0, 2\*\*63\)"):
            staleness_metrics(versions, bad, mask)


def test_proximal_method_is_checked_without_versions_too():
    lb, lt, _, mask = _inputs()
    adv = torch.ones_like(lb)
    with pytest.raises(ValueError, match=r"proximal must be one of \('loglinear', 'linear'\), got 'foo'"):
        losses.compute_policy_loss(lb, lt, adv, mask, "token-mean", None, proximal="foo")


def _dp_worker(rank, world, versions, mask):
    import torch.distributed as dist

    rows = slice(0, 1) if rank == 0 else slice(1, None)
    want = staleness_metrics(versions, 10, mask)
    got = staleness_metrics(versions[rows], 10, mask[rows], dp_group=dist.group.WORLD)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("device", dist_params(2))
def test_staleness_exact_over_dp(device):
    _, _, versions, mask = _inputs(seed=3)
    run_workers(_dp_worker, 2, versions.clamp(min=0), mask, device=device)


def _dp_refusal_worker(rank, world):
    import torch.distributed as dist

    versions = torch.tensor([[3, 4]]) if rank == 0 else torch.tensor([[3, 9]])
    mask = torch.ones(1, 2)
    want = (r"newer than current_version \(at 1 response tokens of other ranks\)" if rank == 0 else
            r"versions at response token \(0, 1\) is 9, newer than current_version 5")
    with pytest.raises(ValueError, match=want):
        staleness_metrics(versions, 5, mask, dp_group=dist.group.WORLD)
    # the ranks stay in step: the next collective is the same one on both
    got = staleness_metrics(versions.clamp(max=5), 5, mask, dp_group=dist.group.WORLD)
    assert float(got["rollout_corr/staleness_max"]) == 2.0


@pytest.mark.parametrize("device", dist_params(2))
def test_staleness_refusal_is_raised_on_every_rank(device):
    """A version newer than the trainer on one rank: every rank raises, naming the token where it holds it (one
    rank raised alone and the other waited in the all-reduce until gloo's timeout; the versions fuzz)."""
    run_workers(_dp_refusal_worker, 2, device=device)


def test_staleness_max_lag_is_bounded_by_name():
    """max_lag sizes the histogram tensor: 2**40 was a raw allocator error."""
    _, _, versions, mask = _inputs(seed=3)
    with pytest.raises(ValueError, match=r"max_lag must be an int in \[0, 16777216\]"):
        staleness_metrics(versions.clamp(min=0), 10, mask, max_lag=2 ** 40)


def test_front_door_decoupled_without_an_old_forward():
    import rollout_corr_ext as rc

    lb, lt, versions, mask = _inputs(seed=4)
    versions = versions.clamp(min=0)
    adv = torch.randn(lb.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    corr = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    cfg = losses.PolicyLossConfig(rollout_correction=corr)
    x = lt.clone().requires_grad_(True)
    loss, metrics = losses.compute_policy_loss(None, x, adv, mask, "token-mean", cfg, rollout_log_prob=lb,
                                               versions=versions, current_version=10)
    prox = proximal_log_prob(lb, lt, versions, 10)
    y = lt.clone().requires_grad_(True)
    want, want_metrics = losses.compute_policy_loss(prox, y, adv, mask, "token-mean", cfg, rollout_log_prob=lb)
    assert torch.equal(loss, want)
    loss.backward()
    want.backward()
    assert torch.equal(x.grad, y.grad)
    assert float(metrics["rollout_corr/staleness_max"]) == float((10 - versions[mask]).max())
    assert "rollout_corr/prox_approx_abs_error" not in metrics
    # with the real pi_old as well: the approximation's error is logged, the loss uses the real one
    old = lt + 0.01
    got = losses.compute_policy_loss(old, lt, adv, mask, "token-mean", cfg, rollout_log_prob=lb, versions=versions,
                                     current_version=10)[1]
    assert float(got["rollout_corr/prox_approx_abs_error"]) > 0


def test_megatron_loss_func_with_versions():
    """make_policy_loss_func(versions=, current_version=) in the decoupled flow without old_log_prob: the loss and
    the gradient in the logits equal compute_policy_loss with the same versions on the log-probs; the staleness mean
    is reported; with old_log_prob as well, the approximation's error is."""
    import rollout_corr_ext as rc
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    g = torch.Generator().manual_seed(5)
    b, s, v = 3, 7, 11
    logits = torch.randn(s, b, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.rand(b, s, generator=g) > 0.2
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp0 = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    rlp = lp0 + 0.1 * torch.randn(b, s, generator=g, dtype=torch.float64)
    versions = torch.tensor([9, 8, 10])
    cfg = losses.PolicyLossConfig(rollout_correction=rc.RolloutCorrectionConfig(rollout_is="token",
                                                                                 rollout_is_threshold=2.0))
    x = logits.clone().requires_grad_(True)
    loss_sum, count, report = make_policy_loss_func(target, adv, mask, rollout_log_prob=rlp, config=cfg,
                                                    versions=versions, current_version=10)(x)
    (loss_sum / count).backward()
    y = logits.clone().requires_grad_(True)
    lp = y.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    want, _ = losses.compute_policy_loss(None, lp, adv.view(-1, 1).expand(b, s), mask, "token-mean", cfg,
                                         rollout_log_prob=rlp, versions=versions, current_version=10)
    want.backward()
    assert torch.allclose(loss_sum / count, want, rtol=1e-10, atol=1e-12)
    assert torch.allclose(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    lags = (10 - versions).view(-1, 1).expand(b, s)[mask].double()
    assert reported_means(report)["rollout_corr/staleness_mean"] == pytest.approx(float(lags.mean()))
    _, _, report = make_policy_loss_func(target, adv, mask, old_log_prob=lp0, rollout_log_prob=rlp, config=cfg,
                                         versions=versions, current_version=10)(logits)
    assert reported_means(report)["rollout_corr/prox_approx_abs_error"] > 0
    with pytest.raises(ValueError, match="current_version"):
        make_policy_loss_func(target, adv, mask, rollout_log_prob=rlp, config=cfg, versions=versions)


@pytest.mark.parametrize("flow", ["plain", "decoupled"])
def test_megatron_loss_func_refuses_the_versions_compute_policy_loss_refuses(flow):
    """make_policy_loss_func refuses what compute_policy_loss refuses, by name: a response token newer than the
    trainer or with a negative version (it read them as a negative lag, or as lag current_version + 1, in the
    staleness mean, and the decoupled flow's pi_prox was pi_rollout there, silently), float / bool versions (it
    truncated them), a negative current_version. A negative version outside the response (a prompt token) is fine."""
    import rollout_corr_ext as rc
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    g = torch.Generator().manual_seed(6)
    b, s, v = 2, 4, 9
    logits = torch.randn(s, b, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 0] = False
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    rlp = -torch.rand(b, s, generator=g, dtype=torch.float64)
    kw = dict(rollout_log_prob=rlp)
    if flow == "decoupled":
        kw["config"] = losses.PolicyLossConfig(rollout_correction=rc.RolloutCorrectionConfig(rollout_is="token"))

    def run(versions, current_version=10):
        return make_policy_loss_func(target, adv, mask, versions=versions, current_version=current_version,
                                     **kw)(logits)

    for versions, token, why in ((torch.tensor([[9, 12, 9, 9], [8, 8, 8, 8]]), r"\(0, 1\) is 12", "newer than"),
                                 (torch.tensor([[9, 9, 9, 9], [8, 8, -1, 8]]), r"\(1, 2\) is -1", "negative")):
        for vs in (versions, versions.to(torch.int32)):
            with pytest.raises(ValueError, match=rf"versions at response token {token}, {why}"):
                run(vs)
    for bad in (torch.tensor([9.0, 8.0]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match="versions must be an integer tensor"):
            run(bad)
    with pytest.raises(ValueError, match=r"current_version must be in \[0, 2\*\*63\)"):
        run(torch.tensor([0, 0]), current_version=-3)
    fine = torch.tensor([[9, 9, 9, 9], [-1, 8, 8, 8]])  # the -1 where the mask is 0
    assert reported_means(run(fine)[2])["rollout_corr/staleness_mean"] == pytest.approx((4 * 1 + 3 * 2) / 7)


# ----------------------------------------------------------------------------------- lag-dependent thresholds

from rollout_corr_ext import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from rollout_corr_ext.versions import compute_rollout_correction_by_lag  # noqa: E402

LAG_CFGS = [(0, dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                     rollout_rs_threshold="0.7_1.4")),
            (2, dict(rollout_is="token", rollout_is_threshold=1.2, rollout_rs="token_k1",
                     rollout_rs_threshold="0.85_1.15")),
            (4, dict(rollout_is=None, rollout_rs=None))]


def _lag_inputs(seed=0, b=6, t=16):
    g = torch.Generator().manual_seed(seed)
    rlp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lp = rlp + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    versions = 10 - torch.randint(0, 6, (b, t), generator=g)
    return lp, rlp, mask, versions


def test_token_thresholds_follow_each_tokens_lag():
    """Token TIS and token_k1 rejection with the bucket's own bounds, token by token (fp64 formulas)."""
    lp, rlp, mask, versions = _lag_inputs()
    res = compute_rollout_correction_by_lag(lp, rlp, mask, LAG_CFGS, versions, 10)
    bounds = {0: (2.0, 0.7, 1.4), 1: (2.0, 0.7, 1.4), 2: (1.2, 0.85, 1.15), 3: (1.2, 0.85, 1.15)}
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            lag = 10 - int(versions[i, j])
            lr = float(lp[i, j] - rlp[i, j])
            if not mask[i, j]:
                assert res.response_mask[i, j] == 0 and float(res.weights[i, j]) == 0.0
                continue
            if lag >= 4:  # no correction: kept, weight 1
                assert res.response_mask[i, j] == 1 and float(res.weights[i, j]) == 1.0
                continue
            u, lo, hi = bounds[lag]
            assert float(res.weights[i, j]) == pytest.approx(min(math.exp(lr), u), rel=1e-12), (i, j)
            keep = math.log(lo) <= -lr <= math.log(hi)  # verl's token_k1: -log-ratio inside [log L, log U]
            assert int(res.response_mask[i, j]) == int(keep), (i, j, lag, lr)
    assert float(res.metrics["rollout_corr/staleness_max"]) == float((10 - versions)[mask.bool()].max())
    assert "rollout_corr/lag_0-1/rollout_is_mean" in res.metrics and "rollout_corr/lag_4+/kl" in res.metrics


def test_sequence_configs_need_row_versions_and_match_the_row_subset():
    lp, rlp, mask, versions = _lag_inputs(seed=1)
    cfgs = [(0, RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0)),
            (2, RolloutCorrectionConfig(rollout_is="geometric", rollout_is_threshold=1.05, rollout_rs="seq_mean_k3",
                                        rollout_rs_threshold=0.01))]
    with pytest.raises(ValueError, match="one version per sequence"):
        compute_rollout_correction_by_lag(lp, rlp, mask, cfgs, versions, 10)
    rows_v = torch.tensor([10, 9, 7, 10, 6, 8])
    res = compute_rollout_correction_by_lag(lp, rlp, mask, cfgs, rows_v, 10)
    for (lo, cfg), hi in zip(cfgs, (2, None)):
        sel = ((10 - rows_v) >= lo) & ((10 - rows_v) < hi if hi is not None else True)
        sub = compute_rollout_correction(lp[sel], rlp[sel], mask[sel], cfg)  # those rows alone
        assert torch.allclose(res.weights[sel], sub.weights, rtol=1e-12, atol=0)
        assert torch.equal(res.response_mask[sel], sub.response_mask)
        tag = f"rollout_corr/lag_{lo}-{hi - 1}/" if hi else f"rollout_corr/lag_{lo}+/"
        for k, v in sub.metrics.items():
            got = float(res.metrics[tag + k[len("rollout_corr/"):]])
            assert (math.isnan(got) and math.isnan(float(v))) or got == pytest.approx(float(v), rel=1e-9, abs=1e-12), k


def test_lag_configs_bad_input():
    lp, rlp, mask, versions = _lag_inputs()
    with pytest.raises(ValueError, match="start at 0 and increase strictly"):
        compute_rollout_correction_by_lag(lp, rlp, mask, [(1, {"rollout_is": None})], versions, 10)
    with pytest.raises(ValueError, match="newer than current_version 8"):
        compute_rollout_correction_by_lag(lp, rlp, mask, LAG_CFGS, versions, 8)
    with pytest.raises(ValueError, match="non-empty list"):
        compute_rollout_correction_by_lag(lp, rlp, mask, [], versions, 10)
    # the log-probs are checked against each other and the mask before any bucket slices them (more rows than the
    # mask were cut down silently, fewer columns named the sliced shape)
    with pytest.raises(ValueError, match=r"rollout_log_prob shape \(8, 16\) does not match log_prob shape"):
        compute_rollout_correction_by_lag(lp, torch.cat([rlp, rlp[:2]]), mask, LAG_CFGS, versions, 10)
    with pytest.raises(ValueError, match=r"response_mask shape .* does not match log_prob shape \(8, 16\)"):
        compute_rollout_correction_by_lag(torch.cat([lp, lp[:2]]), torch.cat([rlp, rlp[:2]]), mask, LAG_CFGS,
                                          versions, 10)
    with pytest.raises(TypeError, match="log_prob must be a float16/bfloat16/float32/float64 tensor"):
        compute_rollout_correction_by_lag(lp.tolist(), rlp, mask, LAG_CFGS, versions, 10)
    # no response token at all: compute_rollout_correction's error (it returned NaN metrics)
    with pytest.raises(ValueError, match="response_mask has no valid token"):
        compute_rollout_correction_by_lag(lp, rlp, torch.zeros_like(mask), LAG_CFGS, versions, 10)


def _lag_dp_worker(rank, world, lp, rlp, mask, versions):
    import torch.distributed as dist

    want = compute_rollout_correction_by_lag(lp, rlp, mask, LAG_CFGS, versions, 10)
    rows = slice(0, 2) if rank == 0 else slice(2, None)
    got = compute_rollout_correction_by_lag(lp[rows], rlp[rows], mask[rows], LAG_CFGS, versions[rows], 10,
                                            dp_group=dist.group.WORLD)
    assert torch.allclose(got.weights, want.weights[rows], rtol=1e-12, atol=0)
    assert torch.equal(got.response_mask, want.response_mask[rows])
    for k, v in want.metrics.items():
        g = float(got.metrics[k])
        assert (math.isnan(g) and math.isnan(float(v))) or g == pytest.approx(float(v), rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("device", dist_params(2))
def test_lag_thresholds_exact_over_dp(device):
    run_workers(_lag_dp_worker, 2, *_lag_inputs(seed=2), device=device)


def _pack(x, lengths):
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])


def test_lag_buckets_packed_equal_padded_and_empty_bucket():
    lp, rlp, mask, versions = _lag_inputs(seed=3)
    lengths = [16, 9, 12, 16, 5, 14]
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
    cu = torch.tensor([0] + lengths).cumsum(0)
    cfgs = LAG_CFGS + [(50, dict(rollout_is="token", rollout_is_threshold=3.0))]  # no token is 50 steps old
    want = compute_rollout_correction_by_lag(lp, rlp, mask, cfgs, versions, 10)
    got = compute_rollout_correction_by_lag(_pack(lp, lengths), _pack(rlp, lengths), _pack(mask, lengths), cfgs,
                                            _pack(versions, lengths), 10, cu_seqlens=cu)
    assert torch.equal(got.weights, _pack(want.weights, lengths))
    assert torch.equal(got.response_mask, _pack(want.response_mask, lengths))
    assert set(got.metrics) == set(want.metrics)
    for k, v in want.metrics.items():
        g = float(got.metrics[k])
        assert (math.isnan(g) and math.isnan(float(v))) or g == pytest.approx(float(v), rel=1e-12, abs=1e-15), k
    assert float(want.metrics["rollout_corr/lag_50+/tokens"]) == 0
    assert not any(k.startswith("rollout_corr/lag_50+/") and not k.endswith("/tokens") for k in want.metrics)
    # per-sequence versions, sequence-level configs: packed equals padded too
    rows_v = torch.tensor([10, 9, 7, 10, 6, 8])
    seq_cfgs = [(0, dict(rollout_is="sequence", rollout_is_threshold=2.0)), (3, dict(rollout_is="geometric",
                                                                                     rollout_is_threshold=1.1))]
    want = compute_rollout_correction_by_lag(lp, rlp, mask, seq_cfgs, rows_v, 10)
    got = compute_rollout_correction_by_lag(_pack(lp, lengths), _pack(rlp, lengths), _pack(mask, lengths), seq_cfgs,
                                            rows_v, 10, cu_seqlens=cu)
    assert torch.allclose(got.weights, _pack(want.weights, lengths), rtol=1e-12, atol=0)
    for k, v in want.metrics.items():
        g = float(got.metrics[k])
        assert (math.isnan(g) and math.isnan(float(v))) or g == pytest.approx(float(v), rel=1e-12, abs=1e-15), k


def _lag_cp_worker(rank, world, lp, rlp, mask, rows_v):
    import torch.distributed as dist

    cfgs = [(0, dict(rollout_is="sequence", rollout_is_threshold=2.0)),
            (2, dict(rollout_is="token", rollout_is_threshold=1.3, rollout_rs="seq_mean_k3",
                     rollout_rs_threshold=0.02))]
    want = compute_rollout_correction_by_lag(lp, rlp, mask, cfgs, rows_v, 10)
    t = lp.shape[1]
    cols = slice(0, t // 2) if rank == 0 else slice(t // 2, None)
    got = compute_rollout_correction_by_lag(lp[:, cols].contiguous(), rlp[:, cols].contiguous(),
                                            mask[:, cols].contiguous(), cfgs, rows_v, 10, seq_group=dist.group.WORLD)
    assert torch.allclose(got.weights, want.weights[:, cols], rtol=1e-12, atol=0)
    assert torch.equal(got.response_mask, want.response_mask[:, cols])
    for k, v in want.metrics.items():
        g = float(got.metrics[k])
        assert (math.isnan(g) and math.isnan(float(v))) or g == pytest.approx(float(v), rel=1e-9, abs=1e-12), k
    with pytest.raises(ValueError, match="under context parallelism"):
        compute_rollout_correction_by_lag(lp[:, cols], rlp[:, cols], mask[:, cols], LAG_CFGS[:1],
                                          10 - torch.zeros_like(mask[:, cols]), 10, seq_group=dist.group.WORLD)


def _lag_layout_refusal_worker(rank, world):
    import torch.distributed as dist

    from rollout_corr_testing.dist_utils import worker_device

    dev = worker_device()
    group = dist.group.WORLD
    token_cfgs = [(0, dict(rollout_is="token", rollout_is_threshold=2.0)),
                  (2, dict(rollout_is="token", rollout_is_threshold=1.5))]
    seq_cfgs = [(0, dict(rollout_is="sequence", rollout_is_threshold=2.0))]
    other = "refused on another rank of the group"
    cases = [
        # CP, each rank its pieces of three sequences (1, 3, 2 tokens): rank 0 one token of each (one per sequence
        # and per token agree), rank 1 pieces of 0, 2, 1 tokens (ambiguous)
        ("cp", dict(seq_group=group), [0, 1, 2, 3] if rank == 0 else [0, 0, 2, 3], 3, token_cfgs, [10, 9, 7],
         "ambiguous" if rank == 1 else other),
        # DP: rank 0's three tokens in three sequences of 0, 2, 1 (ambiguous), rank 1's five in two sequences
        ("dp", dict(dp_group=group), [0, 0, 2, 3] if rank == 0 else [0, 2, 5], 3 if rank == 0 else 5, token_cfgs,
         [10, 9, 7] if rank == 0 else [10, 8], "ambiguous" if rank == 0 else other),
        # DP, a sequence-level config: rank 1's versions are per token (five for two sequences), rank 0's per sequence
        ("dp per token", dict(dp_group=group), [0, 1, 3] if rank == 0 else [0, 2, 5], 3 if rank == 0 else 5,
         seq_cfgs, [10, 9] if rank == 0 else [10, 10, 9, 9, 9], "one version per sequence" if rank == 1 else other),
    ]
    for name, groups, cu, n, cfgs, versions, want in cases:
        lp = torch.full((n,), -1.0, dtype=torch.float64, device=dev)
        with pytest.raises(ValueError, match=want):
            compute_rollout_correction_by_lag(lp, lp - 0.1, torch.ones(n, device=dev), cfgs,
                                              torch.tensor(versions, device=dev), 10,
                                              cu_seqlens=torch.tensor(cu, device=dev), **groups)
    # the ranks stay in step: the next collective is the same one on both
    got = staleness_metrics(torch.tensor([[9, 10]], device=dev), 10, torch.ones(1, 2, device=dev), dp_group=group)
    assert float(got["rollout_corr/staleness_max"]) == 1.0


@pytest.mark.parametrize("device", dist_params(2))
def test_lag_layout_refusals_are_raised_on_every_rank(device):
    """compute_rollout_correction_by_lag's refusals of a rank's layout (per-sequence versions of an ambiguous
    packed length; per-token versions with a sequence-level config) are counted into its all-reduce and raised on
    every rank: the refusing rank raised alone and the others waited in the all-reduce until gloo's timeout (CP with
    rank-own boundaries, and DP; the versions fuzz)."""
    run_workers(_lag_layout_refusal_worker, 2, device=device)


@pytest.mark.parametrize("device", dist_params(2))
def test_lag_thresholds_exact_over_cp(device):
    lp, rlp, mask, _ = _lag_inputs(seed=4)
    run_workers(_lag_cp_worker, 2, lp, rlp, mask, torch.tensor([10, 9, 7, 10, 6, 8]), device=device)


def _lag_dp_cp_inputs():
    """Sequence-level configs, one version per row; row 1 has no response token, row 3 has its response tokens in
    the second half of its columns only (the first context-parallel rank holds none of them)."""
    lp, rlp, mask, _ = _lag_inputs(seed=5, b=8)
    mask[1] = 0
    mask[3, :8] = 0
    return lp, rlp, mask, torch.tensor([10, 9, 7, 10, 6, 8, 10, 9])


_SEQ_LAG_CFGS = [(0, dict(rollout_is="sequence", rollout_is_threshold=2.0)),
                 (2, dict(rollout_is="token", rollout_is_threshold=1.3, rollout_rs="seq_mean_k3",
                          rollout_rs_threshold=0.02, rollout_token_veto_threshold=0.3))]


def _lag_dp_cp_worker(rank, world, lp, rlp, mask, rows_v):
    """DP = 2 x CP = 2 (and CP = 2 alone): each rank its rows (DP) and half of their columns (CP), against one
    process over the whole batch. The bucket token counts must be the whole batch's on every rank, and a sequence
    with no response token (here, or on one CP rank only) must stay out of every bucket's statistics."""
    import torch.distributed as dist

    want = compute_rollout_correction_by_lag(lp, rlp, mask, _SEQ_LAG_CFGS, rows_v, 10)
    t = lp.shape[1]
    if world == 4:
        cp_pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        # dp_group: the data-parallel group with the context-parallel ranks (megatron's with_context_parallel=True)
        seq_group, dp_group, cp_rank, dp_rank = cp_pairs[rank // 2], dist.group.WORLD, rank % 2, rank // 2
        rows = slice(0, 4) if dp_rank == 0 else slice(4, None)
    else:
        seq_group, dp_group, cp_rank, rows = dist.group.WORLD, None, rank, slice(None)
    cols = slice(0, t // 2) if cp_rank == 0 else slice(t // 2, None)

    def part(x):
        return x[rows, cols].contiguous()

    got = compute_rollout_correction_by_lag(part(lp), part(rlp), part(mask), _SEQ_LAG_CFGS, rows_v[rows], 10,
                                            seq_group=seq_group, dp_group=dp_group)
    assert torch.allclose(got.weights, want.weights[rows, cols], rtol=1e-12, atol=0)
    assert torch.equal(got.response_mask, want.response_mask[rows, cols])
    assert set(got.metrics) == set(want.metrics)
    for k, v in want.metrics.items():
        g = float(got.metrics[k])
        assert (math.isnan(g) and math.isnan(float(v))) or g == pytest.approx(float(v), rel=1e-9, abs=1e-12), k
    # a response token newer than the trainer on one rank only: every rank raises (none waits in a collective)
    newer = rows_v[rows].clone()
    if rank == world - 1:
        newer[-1] = 11
    with pytest.raises(ValueError, match="newer than current_version 10"):
        compute_rollout_correction_by_lag(part(lp), part(rlp), part(mask), _SEQ_LAG_CFGS, newer, 10,
                                          seq_group=seq_group, dp_group=dp_group)


@pytest.mark.parametrize("world", [2, 4])
def test_lag_buckets_exact_over_dp_x_cp_with_empty_rows(world):
    run_workers(_lag_dp_cp_worker, world, *_lag_dp_cp_inputs())


def test_lag_buckets_packed_layouts_and_the_token_veto():
    """Per-sequence versions of a packed stream: the [1, T] stream equals the padded batch; as many sequences as
    tokens with one-token sequences is unambiguous, otherwise refused; padding after the last sequence is refused as
    compute_rollout_correction refuses it; the token veto (a whole-sequence rejection) needs per-sequence versions."""
    lp, rlp, mask, rows_v = _lag_dp_cp_inputs()
    lengths = [16, 9, 12, 16, 5, 14, 3, 1]
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
    cu = torch.tensor([0] + lengths).cumsum(0)
    want = compute_rollout_correction_by_lag(lp, rlp, mask, _SEQ_LAG_CFGS, rows_v, 10)
    got = compute_rollout_correction_by_lag(_pack(lp, lengths)[None], _pack(rlp, lengths)[None],
                                            _pack(mask, lengths)[None], _SEQ_LAG_CFGS, rows_v, 10, cu_seqlens=cu)
    assert torch.allclose(got.weights[0], _pack(want.weights, lengths), rtol=1e-12, atol=0)
    assert torch.equal(got.response_mask[0], _pack(want.response_mask, lengths))
    for k, v in want.metrics.items():
        g = float(got.metrics[k])
        assert (math.isnan(g) and math.isnan(float(v))) or g == pytest.approx(float(v), rel=1e-12, abs=1e-15), k

    cfg = [(0, dict(rollout_is=None, rollout_rs=None)), (1, dict(rollout_is=None, rollout_rs=None))]
    one = torch.full((4,), -1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="one per sequence and one per token are both possible"):
        compute_rollout_correction_by_lag(one, one, torch.ones(4), cfg, torch.tensor([10, 8, 8, 9]), 10,
                                          cu_seqlens=torch.tensor([0, 2, 2, 2, 4]))
    single = compute_rollout_correction_by_lag(one, one, torch.ones(4), cfg, torch.tensor([10, 8, 8, 9]), 10,
                                               cu_seqlens=torch.tensor([0, 1, 2, 3, 4]))
    assert float(single.metrics["rollout_corr/staleness_mean"]) == pytest.approx(5 / 4)
    with pytest.raises(ValueError, match="end at the number of packed tokens"):
        compute_rollout_correction_by_lag(one, one, torch.ones(4), cfg, torch.tensor([10, 9]), 10,
                                          cu_seqlens=torch.tensor([0, 2, 3]))

    veto = [(0, dict(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=0.5))] * 1 + \
        [(1, dict(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=0.5))]
    x = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    y = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)  # the last token's ratio e^-1 < 0.5: vetoed
    with pytest.raises(ValueError, match="token veto"):
        compute_rollout_correction_by_lag(x, y, torch.ones(1, 4), veto, torch.tensor([[10, 10, 9, 9]]), 10)
    res = compute_rollout_correction_by_lag(x, y, torch.ones(1, 4), veto, torch.tensor([9]), 10)
    assert res.response_mask.sum() == 0  # the whole sequence, as compute_rollout_correction rejects it


def test_megatron_packed_versions_that_could_be_per_sequence_or_per_token():
    """make_policy_loss_func with packed versions of one value per sequence when there are as many sequences as
    tokens: refused where the two readings differ (before: silently read as per-sequence), accepted for one-token
    sequences, where they agree; [1, T] versions are per token."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    t, v = 4, 7
    target = torch.randint(0, v, (t,), generator=torch.Generator().manual_seed(0))
    lp = torch.full((t,), -1.0, dtype=torch.float64)
    kw = dict(old_log_prob=lp, current_version=10)
    versions = torch.tensor([10, 8, 8, 9])
    with pytest.raises(ValueError, match="one per sequence and one per token are both possible"):
        make_policy_loss_func(target, torch.ones(1, t), torch.ones(t, dtype=torch.bool), versions=versions,
                              cu_seqlens=torch.tensor([0, 2, 2, 2, 4]), **kw)
    logits = torch.randn(t, 1, v, dtype=torch.float64)
    for cu, vs in ((torch.tensor([0, 1, 2, 3, 4]), versions), (torch.tensor([0, 2, 2, 2, 4]), versions[None])):
        out = make_policy_loss_func(target, torch.ones(1, t), torch.ones(t, dtype=torch.bool), versions=vs,
                                    cu_seqlens=cu, **kw)(logits)
        pair = out[2]["rollout_corr/staleness_mean"]
        assert float(pair[0] / pair[1]) == pytest.approx((0 + 2 + 2 + 1) / 4)


def test_proximal_error_metrics_of_no_tokens_is_nan():
    """A mean over no response tokens is NaN, as staleness_metrics and debug_metrics give (it read 0.0: a perfect
    approximation); non-float inputs are refused by name."""
    lb, lt, _, mask = _inputs()
    out = proximal_error_metrics(lb, lt, torch.zeros_like(mask))
    assert all(math.isnan(float(v)) for v in out.values())
    with pytest.raises(TypeError, match="old_log_prob"):
        proximal_error_metrics(lb, lt.long(), mask)
    with pytest.raises(TypeError, match="approx_log_prob"):
        proximal_error_metrics(lb.tolist(), lt, mask)


def test_megatron_loss_func_reports_diagnostics():
    """make_policy_loss_func(diagnostics=...): the diagnostics' metrics (by lag with the loss's versions) equal
    compute_rollout_correction's on the same tensors, padded and packed."""
    import rollout_corr_ext as rc
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means
    from rollout_corr_ext.observability import MismatchDiagnostics, is_diagnostics_key

    g = torch.Generator().manual_seed(6)
    b, s, v = 3, 8, 11
    logits = torch.randn(s, b, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp0 = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    rlp = lp0 + 0.1 * torch.randn(b, s, generator=g, dtype=torch.float64)
    versions = torch.tensor([9, 8, 10])
    rc_cfg = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    cfg = losses.PolicyLossConfig(rollout_correction=rc_cfg)
    spec = MismatchDiagnostics(top_k=0, max_lag=3, position_buckets=(2, 4))
    _, _, report = make_policy_loss_func(target, adv, mask, old_log_prob=lp0, rollout_log_prob=rlp, config=cfg,
                                         versions=versions, current_version=10, diagnostics=spec)(logits)
    got = reported_means(report)
    want = rc.compute_rollout_correction(lp0, rlp, mask, rc_cfg, diagnostics=MismatchDiagnostics(
        top_k=0, max_lag=3, position_buckets=(2, 4), versions=versions, current_version=10)).as_floats()
    keys = [k for k in want if is_diagnostics_key(k)]
    assert "rollout_corr/by_lag/2/abs_log_ratio" in keys
    for k in keys:
        assert (math.isnan(got[k]) and math.isnan(want[k])) or got[k] == pytest.approx(want[k], rel=1e-6), k
    # packed: [T] tensors with cu_seqlens, logits [T, 1, V], versions one per sequence
    cu = torch.tensor([0, s, 2 * s, 3 * s])
    packed_logits = logits.transpose(0, 1).reshape(b * s, 1, v)
    _, _, report = make_policy_loss_func(target.reshape(-1), adv, mask.reshape(-1), old_log_prob=lp0.reshape(-1),
                                         rollout_log_prob=rlp.reshape(-1), config=cfg, versions=versions,
                                         current_version=10, diagnostics=spec, cu_seqlens=cu)(packed_logits)
    got = reported_means(report)
    for k in keys:
        assert (math.isnan(got[k]) and math.isnan(want[k])) or got[k] == pytest.approx(want[k], rel=1e-6), k
    with pytest.raises(ValueError, match="diagnostics need config.rollout_correction"):
        make_policy_loss_func(target, adv, mask, old_log_prob=lp0, diagnostics=spec)
