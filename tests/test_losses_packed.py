"""Packed sequences (megatron's THD layout) through the policy losses and agg_loss: the same sequences packed
into a 1-D stream with cu_seqlens give the padded results: loss, every metric and the gradient per token, on every
backend of the fused policy-loss op (compiled CPU kernels, emulated CUDA kernels, the fallback), every agg mode."""

from __future__ import annotations

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext import losses
from rollout_corr_testing.backends import policy_loss_backend

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LENGTHS = [5, 0, 1, 40, 17, 0, 33, 2]


def _packed_inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    rlp = -torch.rand(total, generator=g, dtype=torch.float64) * 3
    old = rlp + 0.05 * torch.randn(total, generator=g, dtype=torch.float64)
    lp = old + 0.2 * torch.randn(total, generator=g, dtype=torch.float64)
    adv = torch.randn(total, generator=g, dtype=torch.float64)
    mask = torch.rand(total, generator=g) > 0.15
    cu = torch.zeros(len(LENGTHS) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(LENGTHS).cumsum(0)
    return [t.to(dtype) for t in (lp, old, rlp, adv)] + [mask, cu]


def _pad(x, cu, fill=0.0):
    out = torch.full((len(cu) - 1, max(LENGTHS)), fill, dtype=x.dtype)
    for b in range(len(cu) - 1):
        out[b, :int(cu[b + 1] - cu[b])] = x[cu[b]:cu[b + 1]]
    return out


def _unpad(x, cu):
    return torch.cat([x[b, :int(cu[b + 1] - cu[b])] for b in range(len(cu) - 1)])


@pytest.fixture(params=["cpu", "emulated", "fallback"])
def policy_backend(request):
    """The policy-loss op on each backend (rollout_corr_testing.backends: the emulated kernels with the compiled op's
    autograd formula, the fallback's differentiable torch ops)."""
    with policy_loss_backend(request.param, threads=32, schedule=1, max_blocks=3):
        yield request.param


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flow", ["vanilla", "reinforce", "decoupled", "bypass"])
def test_packed_policy_loss_equals_padded(policy_backend, mode, flow):
    lp, old, rlp, adv, mask, cu = _packed_inputs(seed=len(mode) + len(flow))
    corr = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_mean_k3",
                                      rollout_rs_threshold=0.02, bypass_mode=flow == "bypass")
    cfg = rc.PolicyLossConfig(rollout_correction=corr if flow in ("decoupled", "bypass") else None)

    def run(lp_, old_, rlp_, adv_, mask_, cu_):
        if flow == "vanilla":
            return rc.compute_policy_loss_vanilla(old_, lp_, adv_, mask_, mode, cfg, cu_seqlens=cu_)
        if flow == "reinforce":
            return rc.compute_policy_loss_reinforce(rlp_, lp_, adv_, mask_, mode, cfg, cu_seqlens=cu_)
        if flow == "decoupled":
            return rc.compute_policy_loss_decoupled(old_, lp_, rlp_, adv_, mask_, mode, cfg, cu_seqlens=cu_)
        return rc.compute_policy_loss_bypass(rlp_, lp_, adv_, mask_, mode, cfg, cu_seqlens=cu_)

    x_packed = lp.clone().requires_grad_(True)
    loss_p, met_p = run(x_packed, old, rlp, adv, mask, cu)
    loss_p.backward()
    x_padded = _pad(lp, cu).requires_grad_(True)
    loss_d, met_d = run(x_padded, _pad(old, cu), _pad(rlp, cu), _pad(adv, cu), _pad(mask, cu, False), None)
    loss_d.backward()
    torch.testing.assert_close(loss_p, loss_d, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x_packed.grad, _unpad(x_padded.grad, cu), rtol=1e-12, atol=1e-14)
    assert met_p.keys() == met_d.keys()
    for k in met_p:
        torch.testing.assert_close(met_p[k], met_d[k], rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_packed_agg_loss_equals_padded(mode):
    lp, old, rlp, adv, mask, cu = _packed_inputs(seed=3)
    x = lp.clone().requires_grad_(True)
    a = rc.agg_loss(x, mask, mode, cu_seqlens=cu)
    a.backward()
    y = _pad(lp, cu).requires_grad_(True)
    b = rc.agg_loss(y, _pad(mask, cu, False), mode)
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, _unpad(y.grad, cu), rtol=1e-12, atol=1e-14)


def test_packed_agg_loss_checks_the_cu_seqlens_values():
    """agg_loss runs no op that would check the packed boundaries: a shifted, decreasing or short cu_seqlens must be
    a named error, not the loss of another segmentation or a raw torch error."""
    lp, _, _, _, mask, cu = _packed_inputs(seed=3)
    n = len(lp)
    for bad in ([1, 5, n], [0, 7, 5, n], [0, 5, n - 1], [0, 5, n + 3], [-2, 5, n]):
        with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease and end at"):
            rc.agg_loss(lp, mask, "seq-mean-token-mean", cu_seqlens=torch.tensor(bad))


def test_packed_policy_loss_errors_name_the_argument():
    lp, old, rlp, adv, mask, cu = _packed_inputs()
    with pytest.raises(ValueError, match="cu_seqlens"):
        rc.compute_policy_loss_vanilla(old, lp, adv, mask)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rc.compute_policy_loss_vanilla(old, lp, adv, mask, cu_seqlens=torch.tensor([0, 3, 2, len(lp)]))
    with pytest.raises(TypeError, match="cu_seqlens"):
        rc.compute_policy_loss_vanilla(old, lp, adv, mask, cu_seqlens=cu.float())
    bad = lp.clone()
    bad[int(cu[3]) + 2] = float("nan")
    mask[int(cu[3]) + 2] = True
    with pytest.raises(ValueError, match="policy loss undefined at response token"):
        rc.compute_policy_loss_vanilla(old, bad, adv, mask, cu_seqlens=cu)
    assert losses.agg_loss  # the module stays importable with the new keyword
