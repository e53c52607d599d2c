"""Packed sequences (megatron's THD layout): compute_rollout_correction on a 1-D token stream with cu_seqlens must
give, token for token and metric for metric, what the same sequences give padded to [B, T].

Random packings: empty segments, length-1 segments, a single segment, thousands of segments; an inner token mask
(prompt tokens inside the stream); every backend (compiled CPU kernels, the emulated CUDA kernels, the fallback).
The kernels reduce segment by segment from the same chunk and thread boundaries as the padded rows, so the results
are expected to be identical, not just close.
"""

from __future__ import annotations

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_testing.backends import rollout_backend, skip_reason

CONFIGS = {
    "token_tis_rs_veto": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_max_k3,token",
                              rollout_rs_threshold="0.6_1.6,0.05,0.7_1.4", rollout_token_veto_threshold=0.3),
    "seq_icepop_norm": dict(rollout_is="sequence", rollout_is_threshold="0.3_3.0", rollout_is_batch_normalize=True,
                            rollout_rs="seq_sum_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,0.01"),
    "geometric_rs": dict(rollout_is="geometric", rollout_is_threshold=1.2, rollout_rs="geometric,token_k2",
                         rollout_rs_threshold="0.98_1.02,0.02"),
}


def _packing(lengths, seed=0, dtype=torch.float32, inner_mask=True):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    q = 2.0 ** -12  # a grid on which every sum is exact in fp32 and fp64
    rlp = torch.round(-torch.rand(total, generator=g) * 4 / q) * q
    lp = rlp + torch.round(torch.randn(total, generator=g) * 0.1 / q) * q
    mask = torch.rand(total, generator=g) > 0.1 if inner_mask else torch.ones(total, dtype=torch.bool)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return lp.to(dtype), rlp.to(dtype), mask, cu


def _padded(x, cu, fill):
    lens = (cu[1:] - cu[:-1]).tolist()
    width = max(lens, default=0)
    out = torch.full((len(lens), width), fill, dtype=x.dtype)
    for b, n in enumerate(lens):
        out[b, :n] = x[cu[b]:cu[b] + n]
    return out


def _unpad(x, cu):
    return torch.cat([x[b, :int(cu[b + 1] - cu[b])] for b in range(len(cu) - 1)]) if len(cu) > 1 else x.reshape(-1)


PACKINGS = {
    "ragged": [5, 1, 0, 70, 33, 0, 129, 64, 2],
    "one_segment": [300],
    "length_one": [1] * 40,
    "many": None,  # thousands of short segments
}


def _lengths(name):
    if name == "many":
        g = torch.Generator().manual_seed(5)
        return torch.randint(0, 9, (2500,), generator=g).tolist()
    return PACKINGS[name]


@pytest.mark.parametrize("backend", ["cpu", "fallback", "emulated", "cuda"])
@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_packed_equals_padded(backend, packing, cfg_name):
    reason = skip_reason(backend)
    if reason:
        pytest.skip(reason)
    if backend == "emulated" and packing == "many":
        pytest.skip(reason="emulated: thousands of segments thread by thread are too slow; the other packings "
                           "cover the emulated kernels, and cpu / fallback run this one")
    cfg = rc.RolloutCorrectionConfig(**CONFIGS[cfg_name])
    lp, rlp, mask, cu = _packing(_lengths(packing), seed=len(packing))
    knobs = dict(threads=32, schedule=1, max_blocks=3) if backend == "emulated" else {}
    with rollout_backend(backend, **knobs) as device:
        packed = rc.compute_rollout_correction(lp.to(device), rlp.to(device), mask.to(device), cfg,
                                               cu_seqlens=cu.to(device))
        padded = rc.compute_rollout_correction(_padded(lp, cu, float("nan")).to(device),
                                               _padded(rlp, cu, 0.0).to(device),
                                               _padded(mask, cu, False).to(device), cfg)
    assert packed.response_mask.shape == mask.shape and packed.response_mask.dtype == mask.dtype
    assert torch.equal(packed.response_mask.cpu(), _unpad(padded.response_mask.cpu(), cu))
    assert torch.equal(packed.weights.cpu(), _unpad(padded.weights.cpu(), cu))
    a, b = packed.as_floats(), padded.as_floats()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-15, nan_ok=True), k


@pytest.mark.parametrize("shape", ["1d", "1xT", "Tx1"])
def test_megatron_shapes_and_int32_cu_seqlens(shape):
    """megatron hands packed tensors as [1, T] or [T, 1] and cu_seqlens as int32; the outputs keep the shape."""
    cfg = rc.RolloutCorrectionConfig(**CONFIGS["token_tis_rs_veto"])
    lp, rlp, mask, cu = _packing([7, 0, 12, 3], seed=3)
    view = {"1d": lambda t: t, "1xT": lambda t: t.unsqueeze(0), "Tx1": lambda t: t.unsqueeze(1)}[shape]
    res = rc.compute_rollout_correction(view(lp), view(rlp), view(mask), cfg, cu_seqlens=cu.to(torch.int32))
    ref = rc.compute_rollout_correction(lp, rlp, mask, cfg, cu_seqlens=cu)
    assert res.weights.shape == view(lp).shape and res.response_mask.shape == view(mask).shape
    assert torch.equal(res.weights.reshape(-1), ref.weights) and torch.equal(res.response_mask.reshape(-1),
                                                                             ref.response_mask)


@pytest.mark.parametrize("cu, match", [
    ([1, 5, 22], "start at 0"),
    ([0, 5, 21], "end at"),
    ([0, 9, 5, 22], "never decrease"),
])
def test_bad_cu_seqlens_are_named_errors(cu, match):
    lp, rlp, mask, _ = _packing([5, 17], seed=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(), cu_seqlens=torch.tensor(cu))


def test_packed_needs_a_1d_stream_and_padded_needs_2d():
    lp, rlp, mask, cu = _packing([5, 17], seed=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig())
    with pytest.raises(ValueError, match="packed token stream"):
        rc.compute_rollout_correction(lp.reshape(2, 11), rlp.reshape(2, 11), mask.reshape(2, 11),
                                      rc.RolloutCorrectionConfig(), cu_seqlens=cu)


@pytest.mark.parametrize("backend", ["cpu", "fallback"])
@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
def test_ops_on_a_packed_stream_without_tokens(backend, is_level):
    """The two passes on a packed stream of empty sequences (T = 0): empty weights (or the no-IS placeholder) and
    mask, as on every backend (the fallback indexed its no-IS placeholder with the padded layout's mask)."""
    from rollout_corr_ext import fallback
    from rollout_corr_ext.correction import op_args

    args = op_args(rc.RolloutCorrectionConfig(rollout_is=is_level, rollout_rs="token_k1",
                                              rollout_rs_threshold="0.5_2.0"))
    lp, mask, cu = torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.tensor([0, 0, 0, 0])
    ops = torch.ops.rollout_corr if backend == "cpu" else fallback
    stats = ops.rollout_seq_stats(lp, lp, mask, cu, *args)
    w, m_out, _, _ = ops.rollout_token_pass(lp, lp, mask, cu, stats, *args, True)
    assert w.shape == (0,) and m_out.shape == (0,)
