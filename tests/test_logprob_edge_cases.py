"""The log-prob op on the inputs that break naive implementations (issue "No silent wrong answer"), on every
implementation of the ops: compiled CPU kernels, emulated CUDA kernels, the pure-PyTorch fallback (and CUDA when a
GPU is present). The oracle is fp64 ``torch.log_softmax`` on the whole vocab (rollout_corr_testing.logprob_oracle).

Classes: -inf logits (a column, a block, a whole shard, the target, a whole row); extreme magnitudes (1e30, the
fp16 / bf16 maximum, temperatures that overflow fp32 in unshifted coordinates); NaN / +inf logits; out-of-range
targets; shard layouts that do not tile the vocab; in-place backward hazards; double backward; argument types.
"""

from __future__ import annotations

import math

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext import _layout as LY
from rollout_corr_ext import fallback, ops
from rollout_corr_testing.backends import device_params, logprob_backend, ops_on
from rollout_corr_testing.logprob_oracle import log_probs_dense
from rollout_corr_testing.tolerances import grad_tol, output_tol

BACKENDS = ["cpu", "emulated", "fallback", "cuda"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
NEG_INF = -math.inf
#: cpu / emulated / cuda (skipped with the reason without a GPU) for the tests that run the public API only.
DEVICES = device_params()


def _status(x, target, vocab_size=None, starts=None, shards=None, temperature=1.0):
    """The merge's status slots (``LY.STATUS_*``) of ``x`` split into ``shards`` at ``starts``, computed by the
    ops directly. On CUDA the public API turns a non-zero slot into an asynchronous device assert, which would poison
    this process's CUDA context; the slots show what the kernels detected without asserting (the assert itself:
    tests/test_cuda.py::test_device_asserts_end_the_process, in a subprocess)."""
    shards = [x] if shards is None else shards
    starts = [0] if starts is None else starts
    vocab_size = x.shape[-1] if vocab_size is None else vocab_size
    recs = torch.stack([ops.vocab_row_stats(s.reshape(-1, s.shape[-1]), target.reshape(-1), st, vocab_size,
                                            1.0 / temperature, -100, False) for s, st in zip(shards, starts)])
    return ops.merge_row_stats(recs, target.reshape(-1), -100, vocab_size, 1.0 / temperature, False)[4].cpu()


def _oracle(x, target, weights, **kw):
    """fp64 (logp, entropy, ce), the gradient of sum(w_lp logp + w_h H + w_ce ce) w.r.t. x, and the elementwise sum
    of the three terms' gradient magnitudes (the scale the rounding of a low-precision gradient is relative to:
    autograd adds the per-output gradients in the logits' dtype, so cancelling terms keep their own rounding)."""
    smoothing = kw.pop("label_smoothing", 0.0)
    xr = x.detach().double().cpu().clone().requires_grad_(True)
    logp, ent, ce = log_probs_dense(xr, target.cpu(), label_smoothing=smoothing, **kw)
    w_lp, w_h, w_ce = weights
    terms = [(torch.where(w_lp != 0, logp, torch.zeros_like(logp)) * w_lp).sum(), (ent * w_h).sum()]
    if w_ce is not None:
        terms.append((torch.where(w_ce != 0, ce, torch.zeros_like(ce)) * w_ce).sum())
    grads = [torch.autograd.grad(term, xr, retain_graph=True)[0] for term in terms]
    scale = sum(g.abs() for g in grads)
    return logp.detach(), ent.detach(), ce.detach(), sum(grads), scale


def _ours(x, target, weights, device, **kw):
    smoothing = kw.pop("label_smoothing", 0.0)
    xx = x.to(device).clone().requires_grad_(True)
    t = target.to(device)
    logp, ent = rc.vocab_parallel_log_probs(xx, t, return_entropy=True, **kw)
    ce = rc.vocab_parallel_cross_entropy(xx, t, smoothing, **kw)
    w_lp, w_h, w_ce = (None if w is None else w.to(device) for w in weights)
    loss = (torch.where(w_lp != 0, logp, torch.zeros_like(logp)) * w_lp.to(logp.dtype)).sum()
    loss = loss + (ent * w_h.to(ent.dtype)).sum()
    if w_ce is not None:
        loss = loss + (torch.where(w_ce != 0, ce, torch.zeros_like(ce)) * w_ce.to(ce.dtype)).sum()
    loss.backward()
    return logp.detach().double().cpu(), ent.detach().double().cpu(), ce.detach().double().cpu(), \
        xx.grad.double().cpu()


def _assert_matches(x, target, weights, backend, dtype, check_ce=True, **kw):
    with logprob_backend(backend) as device:
        ours = _ours(x, target, weights, device, **dict(kw))
    *want, grad_scale = _oracle(x, target, weights, **dict(kw))
    names = ("logp", "entropy", "cross entropy")
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name, a, b in zip(names, ours, want):
        b = b.to(out_dtype).double()  # the exact value rounded to the output dtype (-6.6e38 is -inf in fp32)
        if name == "cross entropy" and not check_ce:
            continue
        torch.testing.assert_close(a, b, **output_tol(dtype), msg=lambda m, n=name: f"{backend} {dtype} {n}: {m}")
    tol = grad_tol(dtype)
    err = (ours[3] - want[3]).abs()
    bound = tol["atol"] + tol["rtol"] * grad_scale
    worst = int((err - bound).flatten().argmax())
    assert bool((err <= bound).all()), (
        f"{backend} {dtype} gradient: |error| {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} at "
        f"flat index {worst} (ours {ours[3].flatten()[worst]:.6g}, oracle {want[3].flatten()[worst]:.6g})")
    return ours


def _neg_inf_case(dtype, cols=700, seed=0):
    """Rows: one -inf column; a 600-column -inf block (longer than a CPU block and a warp's share); the target at a
    -inf column; all but one column -inf; a plain row; an ignored all -inf row."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, cols, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, cols, (6,), generator=g)
    x[0, (t[0] + 1) % cols] = NEG_INF
    x[1, :600] = NEG_INF
    t[1] = 650
    x[2, 10:30] = NEG_INF
    t[2] = 15
    x[3, :] = NEG_INF
    x[3, 123] = 1.5
    x[5, :] = NEG_INF
    t[5] = -100
    return x, t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_logits_match_log_softmax(backend, dtype):
    x, t = _neg_inf_case(dtype)
    w = (torch.linspace(0.5, 1.5, 6, dtype=torch.float64), torch.linspace(-1, 1, 6, dtype=torch.float64), None)
    logp, ent, _, grad = _assert_matches(x, t, w, backend, dtype, check_ce=False)
    assert logp[2] == NEG_INF, "a target at a -inf column has log-probability -inf"
    assert torch.isfinite(ent).all() and torch.isfinite(grad).all()
    masked = torch.isinf(x) & (torch.arange(700) != t.unsqueeze(1))
    assert torch.all(grad[masked] == 0), "-inf columns (other than a target) get exactly zero gradient"
    assert ent[3] == 0 and logp[5] == 0 and ent[5] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_with_label_smoothing_and_temperature(backend):
    """mean_i log p_i is -inf when a column is -inf (the smoothed loss is +inf, as torch gives); its gradient is
    finite: (1/V - p_i)/T."""
    x, t = _neg_inf_case(torch.float32, seed=1)
    w = (torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64),
         torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 1.0], dtype=torch.float64))
    _, _, ce, grad = _assert_matches(x, t, w, backend, torch.float32, label_smoothing=0.1, temperature=0.7)
    assert ce[0] == math.inf and math.isfinite(ce[4])
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", ["cpu", "emulated", "fallback", "cuda"])
def test_whole_shard_of_neg_inf_merges_as_identity(backend):
    """A tensor-parallel shard whose rows are all -inf (a sampler mask, or padding filled with -inf) is the identity of
    the merge; the rows of the other shard give the whole answer."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 64, generator=g, dtype=torch.float64) * 2
    full[:, 32:] = NEG_INF
    full[4, 40] = 0.5  # one row with mass in the second shard too
    t = torch.randint(0, 32, (5,), generator=g)
    with logprob_backend(backend) as dev:
        td = t.to(dev)
        recs = torch.stack([ops.vocab_row_stats(full[:, :32].float().to(dev), td, 0, 64, 1.0, -100, True),
                            ops.vocab_row_stats(full[:, 32:].float().to(dev), td, 32, 64, 1.0, -100, True)])
        logp, ent, mean_logp, _, status = ops.merge_row_stats(recs, td, -100, 64, 1.0, True)
    assert not status.cpu().any(), status
    ref_logp, ref_ent, _ = log_probs_dense(full, t)
    torch.testing.assert_close(logp.double().cpu(), ref_logp, **output_tol(torch.float32))
    torch.testing.assert_close(ent.double().cpu(), ref_ent, **output_tol(torch.float32))
    assert torch.all(mean_logp.cpu() == NEG_INF)


def _extreme_case(dtype, seed=0):
    """Rows around 1e30 (fp32/fp64/bf16) or at the fp16 maximum, with spreads that matter after the shift."""
    g = torch.Generator().manual_seed(seed)
    cols = 600
    noise = torch.randn(5, cols, generator=g, dtype=torch.float64)
    if dtype == torch.float16:
        big = 65504.0
        x = torch.cat([
            torch.full((1, cols), big),                      # every logit at the fp16 maximum: uniform
            (big - 32.0 * noise.abs().round()).clamp(min=-big)[1:2],  # the top of the fp16 range, spacing 32
            -big + 32.0 * noise[2:3].abs().round(),           # the bottom of the range
            noise[3:4] * 3,
            torch.where(noise[4:5] > 0, torch.full((1, cols), big), torch.full((1, cols), -big)),
        ])
    else:
        big = 1e30
        x = torch.cat([
            torch.full((1, cols), big),
            big * (1 + 1e-6 * noise[1:2]),
            -big * (1 + 1e-6 * noise[2:3].abs()),
            noise[3:4] * 3,
            torch.where(noise[4:5] > 0, torch.full((1, cols), big), torch.full((1, cols), -big)),
        ])
    x = x.to(dtype)
    t = torch.randint(0, cols, (5,), generator=g)
    return x, t


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_magnitudes_match_log_softmax(backend, dtype, temperature):
    x, t = _extreme_case(dtype)
    w = (torch.linspace(0.5, 1.5, 5, dtype=torch.float64), torch.linspace(-1, 1, 5, dtype=torch.float64),
         torch.linspace(1, 2, 5, dtype=torch.float64))
    logp, ent, _, grad = _assert_matches(x, t, w, backend, dtype, temperature=temperature, label_smoothing=0.05)
    torch.testing.assert_close(logp[0], torch.tensor(-math.log(600), dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent[0], torch.tensor(math.log(600), dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_near_the_fp32_maximum(backend, dtype):
    """Columns at 3.3e38 next to +-1e30: x / 0.5 overflows fp32 unless shifted by the row max first."""
    x, t = _extreme_case(torch.float32)
    x[4, :5] = 3.3e38
    x = x.to(dtype)
    w = (torch.linspace(0.5, 1.5, 5, dtype=torch.float64), torch.linspace(-1, 1, 5, dtype=torch.float64),
         torch.linspace(1, 2, 5, dtype=torch.float64))
    _assert_matches(x, t, w, backend, dtype, temperature=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_label_smoothing_with_one_neg_inf_column_anywhere(backend, dtype):
    """One -inf column per row, at a block's first, middle or last column, at the CPU kernel's 512-column scan
    boundaries and in a block's scalar tail: the smoothed loss is +inf (mean_i logp_i = -inf), everything else exact."""
    cols = 9000
    positions = [0, 1, 511, 512, 1000, 2047, 2048, 4321, 8191, 8192, 8990, 8999]
    g = torch.Generator().manual_seed(13)
    x = torch.randn(len(positions), cols, generator=g, dtype=torch.float64) * 3
    for r, c in enumerate(positions):
        x[r, c] = NEG_INF
    x = x.to(dtype)
    t = torch.tensor([(c + 17) % cols for c in positions])
    rows = len(positions)
    w = (torch.linspace(0.5, 1.5, rows, dtype=torch.float64), torch.linspace(-1, 1, rows, dtype=torch.float64),
         torch.linspace(1, 2, rows, dtype=torch.float64))
    _, _, ce, _ = _assert_matches(x, t, w, backend, dtype, label_smoothing=0.1)
    assert (ce == math.inf).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_log_prob_whose_logit_gap_overflows_but_its_quotient_does_not(backend, dtype):
    """y - max = -6.6e38 is past fp32's range, (y - max) / 100 = -6.6e36 is not: logp and the cross entropy (plain
    and smoothed) are that finite value, not -inf / +inf."""
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(4, 3000, generator=g, dtype=torch.float64) * 2 - 1) * 1e30
    x[:, 7] = 3.3e38
    x[:, 100] = -3.3e38
    x[3, 2999] = -3.3e38
    t = torch.tensor([100, 100, 5, 2999])
    x = x.to(dtype)
    w = (torch.linspace(0.5, 1.5, 4, dtype=torch.float64), torch.linspace(-1, 1, 4, dtype=torch.float64),
         torch.linspace(1, 2, 4, dtype=torch.float64))
    for smoothing in (0.0, 0.1):
        logp, _, ce, _ = _assert_matches(x, t, w, backend, dtype, temperature=100.0, label_smoothing=smoothing)
        assert torch.isfinite(logp).all() and torch.isfinite(ce).all() and logp[0] < -6e36


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_label_smoothing_mean_at_spreads_near_the_fp32_maximum(backend, dtype, temperature):
    """The smoothed loss's mean_i logp_i where one term (x_i - max)/T, or the sum over the vocab, leaves the fp32
    range but the mean does not: the loss is the finite value, not +inf (and +inf only where the exact mean is past
    fp32's range). 9000 columns: several CPU blocks of either dtype."""
    g = torch.Generator().manual_seed(5)
    cols = 9000
    u = torch.rand(7, cols, generator=g, dtype=torch.float64)
    x = torch.stack([
        (2 * u[0] - 1) * 3.0e38,               # terms of -6e38: past fp32 one by one
        -3.0e38 * u[1],                        # max near 0, the rest down to -3e38 (x log2(e) overflows)
        -1e35 * (1 + u[2]),                    # no term overflows, the sum over 9000 does
        torch.where(u[3] < 0.5, torch.full_like(u[3], -1.5e38), 0.1 * u[3]),  # t overflows in log2 units
        (2 * u[4] - 1) * 3.0e38,               # the same as row 0 with a -inf column: the mean is -inf
        u[5] * 4,                              # an ordinary row
        u[6] * 4,                              # and with -inf in the last column (a block's scalar tail)
    ])
    x[4, 4321] = NEG_INF
    x[6, cols - 1] = NEG_INF
    x = x.to(dtype)
    t = torch.randint(0, cols - 1, (7,), generator=g)
    w = (torch.zeros(7, dtype=torch.float64), torch.zeros(7, dtype=torch.float64),
         torch.linspace(1, 2, 7, dtype=torch.float64))
    _, _, ce, _ = _assert_matches(x, t, w, backend, dtype, temperature=temperature, label_smoothing=0.1)
    assert ce[4] == math.inf and ce[6] == math.inf
    assert torch.isfinite(ce[[2, 3, 5]]).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("backend", ["cpu", "emulated", "fallback", "cuda"])
def test_nan_or_posinf_logits_raise_naming_the_row(backend, bad):
    x = torch.randn(2, 4, 50)
    t = torch.randint(0, 50, (2, 4))
    x[1, 2, 17] = bad
    t_ignored = t.clone()
    t_ignored[1, 2] = -100  # the same NaN in an ignored row is not inspected
    with logprob_backend(backend) as dev:
        if dev == "cuda":  # detected (the status slot the public API asserts on), not raised here
            assert _status(x.to(dev), t.to(dev))[LY.STATUS_NON_FINITE] != 0
            assert not _status(x.to(dev), t_ignored.to(dev)).any()
        else:
            with pytest.raises(RuntimeError, match="NaN or \\+inf"):
                rc.vocab_parallel_log_probs(x, t)
        out = rc.vocab_parallel_log_probs(x.to(dev), t_ignored.to(dev)).cpu()
    assert out[1, 2] == 0 and torch.isfinite(out).all()
    if backend not in ("emulated", "cuda"):  # the CPU messages name the (flattened) row
        with logprob_backend(backend):
            with pytest.raises(RuntimeError, match="row 6 "):
                rc.vocab_parallel_log_probs(x, t)


@pytest.mark.parametrize("backend", ["cpu", "emulated", "fallback", "cuda"])
def test_row_of_only_neg_inf_raises(backend):
    x = torch.randn(3, 40)
    x[1] = NEG_INF
    t = torch.randint(0, 40, (3,))
    with logprob_backend(backend) as dev:
        if dev == "cuda":
            assert _status(x.to(dev), t.to(dev))[LY.STATUS_NO_FINITE_LOGIT] != 0
            return
        with pytest.raises(RuntimeError, match="-inf"):
            rc.vocab_parallel_log_probs(x, t)


@pytest.mark.parametrize("backend", ["cpu", "emulated", "fallback", "cuda"])
def test_out_of_range_targets_raise_and_ignore_index_is_exempt(backend):
    x = torch.randn(4, 30)
    with logprob_backend(backend) as dev:
        for bad in (30, -3, 10**12):
            t = torch.tensor([0, bad, 5, 7])
            if dev == "cuda":
                assert _status(x.to(dev), t.to(dev))[LY.STATUS_TARGET] != 0, bad
                continue
            with pytest.raises(RuntimeError, match="target holds ids outside"):
                rc.vocab_parallel_log_probs(x, t)
        t = torch.tensor([0, 99, 5, 7])
        out = rc.vocab_parallel_log_probs(x.to(dev), t.to(dev), ignore_index=99).cpu()
    assert out[1] == 0


# --------------------------------------------------------------------------------------------- shard layouts


def _records(shards, target, starts, vocab_size, with_sum_z=False):
    return torch.stack([ops.vocab_row_stats(s, target, st, vocab_size, 1.0, -100, with_sum_z)
                        for s, st in zip(shards, starts)])


@pytest.mark.parametrize("backend", ["cpu", "emulated", "fallback", "cuda"])
def test_merge_rejects_shards_that_do_not_tile_the_vocab(backend):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(4, 60, generator=g)
    t_cpu = torch.randint(0, 60, (4,), generator=g)
    with logprob_backend(backend) as dev:
        t = t_cpu.to(dev)
        a, b = full[:, :30].to(dev), full[:, 30:].to(dev)
        good = _records([a, b], t, [0, 30], 60)
        logp, *_ = ops.merge_row_stats(good, t, -100, 60, 1.0, False)
        torch.testing.assert_close(logp.double().cpu(), log_probs_dense(full.double(), t_cpu)[0],
                                   **output_tol(torch.float32))
        cases = [
            (_records([a, b], t, [0, 0], 60), "overlap|do not fit"),  # two ranks with the same vocab_start
            (_records([a, b], t, [0, 31], 61), "do not cover|do not fit"),  # a gap at column 30
            (torch.stack([_records([a], t, [0], 60)[0], _records([b], t, [30], 61)[0]]), "vocab_size|do not fit"),
            (torch.stack([_records([a], t, [0], 60)[0], _records([b], t.flip(0), [30], 60)[0]]),
             "different targets|do not fit"),
        ]
        for records, match in cases:
            if dev == "cuda":  # the CUDA merge sets the layout status slot (asserted asynchronously by the API)
                status = ops.merge_row_stats(records, t, -100, 60, 1.0, False)[4].cpu()
                assert status[LY.STATUS_LAYOUT] != 0, match
                continue
            with pytest.raises(RuntimeError, match=match):
                ops.merge_row_stats(records, t, -100, 60, 1.0, False)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_rejects_records_of_another_length(device):
    with ops_on(device) as dev:
        t = torch.randint(0, 10, (3,)).to(dev)
        rec = ops.vocab_row_stats(torch.randn(3, 10).to(dev), t, 0, 10, 1.0, -100, False)
        with pytest.raises(RuntimeError, match="number of rows or on the record format"):
            ops.merge_row_stats(rec.unsqueeze(0), t, -100, 10, 1.0, True)


# --------------------------------------------------------------------------------------------- in-place backward


def _grad_out_of_place(x, t):
    y = x.detach().clone().requires_grad_(True)
    rc.vocab_parallel_log_probs(y * 1.0, t).sum().backward()
    return y.grad


@pytest.mark.parametrize("backend", ["cpu", "emulated", "fallback", "cuda"])
def test_inplace_backward_bumps_the_version_counter(backend):
    torch.manual_seed(0)
    with logprob_backend(backend) as dev:
        base = torch.randn(4, 50).to(dev).requires_grad_(True)
        t = torch.randint(0, 50, (4,)).to(dev)
        logits = base * 1.0
        v0 = logits._version
        rc.vocab_parallel_log_probs(logits, t, inplace_backward=True).sum().backward()
        assert logits._version > v0
        torch.testing.assert_close(base.grad, _grad_out_of_place(base, t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["ours_first", "other_first"])
def test_inplace_backward_with_another_saver_is_right_or_refused(order, device):
    """Another autograd node saved the same logits: whatever runs first, the result is the right gradient or
    autograd's "modified by an inplace operation" error, never a gradient computed from overwritten logits."""
    torch.manual_seed(1)
    with ops_on(device) as dev:
        base = torch.randn(4, 30).to(dev).requires_grad_(True)
        t = torch.randint(0, 30, (4,)).to(dev)
        logits = base * 1.0
        if order == "ours_first":
            other = logits.sin().sum()  # created first: its backward runs after ours
            lp = rc.vocab_parallel_log_probs(logits, t, inplace_backward=True).sum()
        else:
            lp = rc.vocab_parallel_log_probs(logits, t, inplace_backward=True).sum()
            other = logits.sin().sum()
        try:
            (lp + other).backward()
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            return
        want = _grad_out_of_place(base, t) + base.detach().cos()
    torch.testing.assert_close(base.grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_two_calls_on_the_same_logits_are_refused_or_right(device):
    torch.manual_seed(2)
    with ops_on(device) as dev:
        base = torch.randn(3, 20).to(dev).requires_grad_(True)
        t1, t2 = torch.randint(0, 20, (3,)).to(dev), torch.randint(0, 20, (3,)).to(dev)
        logits = base * 1.0
        a = rc.vocab_parallel_log_probs(logits, t1, inplace_backward=True).sum()
        b = rc.vocab_parallel_log_probs(logits, t2, inplace_backward=True).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (a + b).backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_second_backward_is_refused(device):
    with ops_on(device) as dev:
        base = torch.randn(3, 20).to(dev).requires_grad_(True)
        t = torch.randint(0, 20, (3,)).to(dev)
        lp = rc.vocab_parallel_log_probs(base * 1.0, t, inplace_backward=True).sum()
        lp.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            lp.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_refuses_overlapping_and_leaf_logits(device):
    with ops_on(device) as dev:
        t = torch.randint(0, 20, (4,)).to(dev)
        row = torch.randn(1, 20).to(dev)
        with pytest.raises(ValueError, match="rows do not share memory"):
            rc.vocab_parallel_log_probs(row.expand(4, 20), t, inplace_backward=True)
        leaf = torch.randn(4, 20).to(dev).requires_grad_(True)
        with pytest.raises(ValueError, match="leaf"):
            rc.vocab_parallel_log_probs(leaf, t, inplace_backward=True)
        # The op itself refuses overlapping memory too (a direct caller of torch.ops).
        state = torch.zeros(4, 3).to(dev)
        with pytest.raises(RuntimeError, match="overlapping"):
            ops.logprob_backward_(row.expand(4, 20), torch.ones(4).to(dev), None, None, t, state, 0, 20, 1.0, -100)


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_logits_out_of_place_are_right(device):
    with ops_on(device) as dev:
        row = torch.randn(1, 20).to(dev)
        t = torch.randint(0, 20, (4,)).to(dev)
        x = row.expand(4, 20)
        torch.testing.assert_close(rc.vocab_parallel_log_probs(x, t),
                                   rc.vocab_parallel_log_probs(x.contiguous(), t))


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_raises_instead_of_dropping_the_second_order_term(device):
    with ops_on(device) as dev:
        x = torch.randn(3, 10, dtype=torch.float64).to(dev).requires_grad_(True)
        t = torch.randint(0, 10, (3,)).to(dev)
        logp = rc.vocab_parallel_log_probs(x, t)
        (g,) = torch.autograd.grad(logp.sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            g.pow(2).sum().backward()
        # The silent case: another term makes the gradient differentiable, ours would contribute a dropped zero.
        x2 = torch.randn(3, 10, dtype=torch.float64).to(dev).requires_grad_(True)
        loss = rc.vocab_parallel_log_probs(x2, t).sum() + x2.pow(3).sum()
        (g2,) = torch.autograd.grad(loss, x2, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(g2.sum(), x2)
        # A first-order gradient taken with create_graph=True is still the right one.
        torch.testing.assert_close(g2.detach(), torch.autograd.grad(
            rc.vocab_parallel_log_probs(x2, t).sum() + x2.pow(3).sum(), x2)[0])


# --------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(vocab_size=7.5), TypeError, "vocab_size must be an integer"),
        (dict(vocab_size=True), TypeError, "vocab_size must be an integer"),
        (dict(vocab_start="0"), TypeError, "vocab_start must be an integer"),
        (dict(vocab_start=1.0), TypeError, "vocab_start must be an integer"),
        (dict(ignore_index=-100.5), TypeError, "ignore_index must be an integer"),
        (dict(temperature="1.0"), TypeError, "temperature must be a real number"),
        (dict(temperature=math.inf), ValueError, "temperature must be finite and > 0"),
        (dict(temperature=math.nan), ValueError, "temperature must be finite and > 0"),
        (dict(temperature=0.0), ValueError, "temperature must be finite and > 0"),
        (dict(temperature=-1.0), ValueError, "temperature must be finite and > 0"),
        (dict(return_entropy="yes"), TypeError, "return_entropy must be a bool"),
        (dict(inplace_backward=1), TypeError, "inplace_backward must be a bool"),
        (dict(vocab_size=0), ValueError, "vocab_size must be >= 1"),
        (dict(vocab_size=41), ValueError, "vocab_size <= 40"),
        (dict(vocab_start=-1), ValueError, "vocab_start must be >= 0"),
        (dict(vocab_start=3), ValueError, "vocab_start must be 0"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_arguments_are_type_and_range_checked(kw, exc, match, device):
    with ops_on(device) as dev:
        x = torch.randn(5, 40).to(dev)
        t = torch.randint(0, 40, (5,)).to(dev)
        x0 = x.clone()
        with pytest.raises(exc, match=match):
            rc.vocab_parallel_log_probs(x, t, **kw)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_and_tensor_integers_are_accepted(device):
    np = pytest.importorskip("numpy")
    with ops_on(device) as dev:
        x = torch.randn(5, 40).to(dev)
        t = torch.randint(0, 30, (5,)).to(dev)
        want = rc.vocab_parallel_log_probs(x, t, vocab_size=30)
        torch.testing.assert_close(rc.vocab_parallel_log_probs(x, t, vocab_size=np.int64(30)), want)
        torch.testing.assert_close(rc.vocab_parallel_log_probs(x, t, vocab_size=torch.tensor(30)), want)
        torch.testing.assert_close(rc.vocab_parallel_log_probs(x, t, temperature=np.float32(1.0), vocab_size=30),
                                   want)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_arguments(device):
    with ops_on(device) as dev:
        x = torch.randn(2, 5).to(dev)
        t = torch.tensor([0, 1]).to(dev)
        zeros = torch.tensor([0, 0]).to(dev)
        with pytest.raises(ValueError, match="vocab_size >= 2"):
            rc.vocab_parallel_cross_entropy(x[:, :1], zeros, label_smoothing=0.1)
        with pytest.raises(TypeError, match="label_smoothing must be a real number"):
            rc.vocab_parallel_cross_entropy(x, t, label_smoothing="0.1")
        with pytest.raises(ValueError, match="label_smoothing must be in"):
            rc.vocab_parallel_cross_entropy(x, t, label_smoothing=math.nan)
        # Without smoothing a one-token vocab is fine: log p = 0.
        assert torch.equal(rc.vocab_parallel_cross_entropy(x[:, :1], zeros).cpu(), torch.zeros(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_temperature_outside_the_compute_type_is_named(dtype, device):
    """1 / temperature beyond [tiny, max] of the type the kernels compute in (fp32, fp64 for fp64 logits) would
    overflow or flush there and fail every row for a reason that is not in the logits: refused up front, naming
    temperature; at the edge of the range the values are still right."""
    acc = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    with ops_on(device) as dev:
        x = torch.randn(3, 50).to(dtype).to(dev)
        t = torch.tensor([0, 49, 7]).to(dev)
        for temperature in (1.0 / acc.max / 4, 1.0 / acc.tiny * 2, 5e-324):
            with pytest.raises(ValueError, match=r"temperature=.* is out of range"):
                rc.vocab_parallel_log_probs(x, t, temperature=temperature)
            with pytest.raises(ValueError, match=r"temperature=.* is out of range"):
                rc.vocab_parallel_cross_entropy(x, t, temperature=temperature)
        temperature = 2.0 / acc.max  # in range: a near-zero temperature, the distribution is argmax-sharp
        logp = rc.vocab_parallel_log_probs(x, t, temperature=temperature)
        xd = x.double().cpu()
        z = (xd - xd.max(dim=-1, keepdim=True).values) / temperature  # shifted first: x / T overflows even fp64
        want = torch.log_softmax(z, dim=-1).gather(1, t.cpu()[:, None])[:, 0]
        want = want.to(logp.dtype).double()  # beyond the output type's range: -inf (documented)
        logp = logp.double().cpu()
        assert torch.equal(torch.isinf(logp), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(logp[finite], want[finite], **output_tol(dtype))


def test_record_headers_are_the_same_bits_on_every_implementation():
    """Ranks may run different implementations (a CPU rank beside the fallback): the header, with its target and
    settings fingerprints (1/T, ignore_index), must be bit-identical, and must change with either setting."""
    x = torch.randn(5, 40)
    t = torch.tensor([0, 39, 7, -100, 3])
    n = LY.header_len(torch.float32)

    def header(fn, inv_t, ignore):
        return fn(x, t, 0, 40, inv_t, ignore, False)[:n].view(torch.int64).tolist()

    for inv_t, ignore in ((1.0, -100), (1.0 / 0.7, -100), (1.0, -1)):
        assert header(ops.vocab_row_stats, inv_t, ignore) == header(fallback.vocab_row_stats, inv_t, ignore)
    base = header(ops.vocab_row_stats, 1.0, -100)
    assert header(ops.vocab_row_stats, 1.0 / 0.7, -100) != base and header(ops.vocab_row_stats, 1.0, -1) != base


@pytest.mark.parametrize("device", DEVICES)
def test_label_smoothing_of_one_at_a_neg_inf_target_is_inf(device):
    """eps = (V-1)/V makes megatron's smoothing s = eps V/(V-1) exactly 1 (and larger eps s > 1): (1 - s) nll is
    then 0 * inf or -inf + inf. Every log-prob enters the smoothed loss with a coefficient <= 0, so a -inf logit
    makes it +inf; the gradient is the formula's (its coefficients), not 0."""
    with ops_on(device) as dev:
        for v, eps, target in ((2, 0.5, 1), (3, 2 / 3, 2), (3, 0.9, 2), (3, 0.9, 0)):
            x = torch.zeros(1, v, dtype=torch.float64)
            x[0, -1] = NEG_INF
            x[0, 0] = 1.0 if v > 2 else 0.0
            xd = x.to(dev).requires_grad_(True)
            ce = rc.vocab_parallel_cross_entropy(xd * 1, torch.tensor([target]).to(dev), label_smoothing=eps)
            assert ce.item() == math.inf, (v, eps, target)
            (grad,) = torch.autograd.grad(ce.sum(), xd)
            s = eps * v / (v - 1)
            p = torch.softmax(x, -1)
            want = (1 - s) * (p - torch.nn.functional.one_hot(torch.tensor([target]), v)) + s * (p - 1.0 / v)
            torch.testing.assert_close(grad.cpu(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_of_a_strided_view(device):
    """An empty view whose vocab stride is not 1 (torch calls any empty tensor contiguous) gives empty outputs."""
    with ops_on(device) as dev:
        x = torch.zeros(0, 30).to(dev)[:, ::2].requires_grad_(True)
        logp, ent = rc.vocab_parallel_log_probs(x, torch.zeros(0, dtype=torch.long).to(dev), return_entropy=True)
        assert logp.shape == (0,) and ent.shape == (0,)
        assert rc.vocab_parallel_cross_entropy(x, torch.zeros(0, dtype=torch.long).to(dev)).shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    with ops_on(device) as dev:
        x = torch.randn(0, 7, 11).to(dev).requires_grad_(True)
        t = torch.zeros(0, 7, dtype=torch.long).to(dev)
        logp, ent = rc.vocab_parallel_log_probs(x, t, return_entropy=True)
        assert logp.shape == (0, 7) and ent.shape == (0, 7)
        (logp.sum() + ent.sum()).backward()
    assert x.grad.shape == x.shape


# --------------------------------------------------------------------------------------------- property-based

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _logit_batches(draw):
    """Shapes, dtypes, -inf masks (sampler top-k / top-p), extreme magnitudes and ignored rows."""
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    top = torch.finfo(dtype).max
    scale = draw(st.sampled_from([1.0, 30.0, 1e4] + ([] if dtype == torch.float16 else [1e30])))
    offset = draw(st.sampled_from([0.0, 0.9 * top, -0.9 * top] + ([] if dtype == torch.float16 else [1e30])))
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale + offset).clamp(-top, top)
    mask_p = draw(st.sampled_from([0.0, 0.1, 0.9]))
    masked = torch.rand(rows, cols, generator=g) < mask_p
    keep = torch.randint(0, cols, (rows,), generator=g)
    masked[torch.arange(rows), keep] = False  # every row keeps a finite logit
    x = x.masked_fill(masked, NEG_INF).to(dtype)
    target = torch.randint(0, cols, (rows,), generator=g)
    ignored = torch.rand(rows, generator=g) < 0.25
    target[ignored] = -100
    temperature = draw(st.sampled_from([0.5, 1.0, 2.0]))
    return x, target, dtype, temperature


def _property(backend, batch):
    x, target, dtype, temperature = batch
    rows = x.shape[0]
    w = (torch.linspace(0.5, 1.5, rows, dtype=torch.float64), torch.linspace(-1, 1, rows, dtype=torch.float64), None)
    _, ent, _, grad = _assert_matches(x, target, w, backend, dtype, check_ce=False, temperature=temperature)
    assert torch.isfinite(ent).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", ["cpu", "fallback", "cuda"])
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batch=_logit_batches())
def test_property_log_probs_entropy_gradient_match_log_softmax(backend, batch):
    _property(backend, batch)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batch=_logit_batches())
def test_property_on_the_emulated_cuda_kernels(batch):
    _property("emulated", batch)


# ---------------------------------------------------------------------------------------------------------
# The CPU out-of-place backward's one-block gradient cache (csrc/cpu/reused_buffer.h)
# ---------------------------------------------------------------------------------------------------------

needs_compiled_cpu = pytest.mark.skipif(rc.backend() == "fallback", reason="the cache belongs to the compiled CPU "
                                                                            "kernels")


def _cpu_grad(logits, target, **kw):
    x = logits.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(rc.vocab_parallel_log_probs(x, target, **kw).sum(), x)
    return grad


def _dense_grad(logits, target, **kw):
    x = logits.detach().double().requires_grad_(True)
    (grad,) = torch.autograd.grad(log_probs_dense(x, target, **kw)[0].sum(), x)
    return grad


@needs_compiled_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_grad_cache_reuses_one_block_and_never_shows_old_values(dtype):
    """A freed gradient's block serves the next backward of about the same size, which overwrites all of it: rows
    with target = ignore_index and padding columns come out exactly 0 even though the block held large values."""
    rc.empty_cpu_cache()
    g = torch.Generator().manual_seed(11)
    rows, v, vocab_size = 48, 3000, 2900
    first = _cpu_grad((torch.randn(rows, v, generator=g) * 30).to(dtype), torch.randint(0, v, (rows,), generator=g))
    ptr, nbytes = first.data_ptr(), first.nbytes
    first.fill_(1e4)  # what a reused block would show if any element were left unwritten
    del first
    assert ops.cpu_cache_bytes() == nbytes

    logits = torch.randn(rows, v, generator=g).to(dtype)
    target = torch.randint(0, vocab_size, (rows,), generator=g)
    target[::3] = -100
    grad = _cpu_grad(logits, target, vocab_size=vocab_size)
    assert grad.data_ptr() == ptr, "the cached block was not reused"
    assert ops.cpu_cache_bytes() == 0, "the block is the live gradient's now"
    assert torch.all(grad[::3] == 0) and torch.all(grad[:, vocab_size:] == 0)
    ref = _dense_grad(logits, target, vocab_size=vocab_size)
    torch.testing.assert_close(grad.double(), ref, **grad_tol(dtype))


@needs_compiled_cpu
def test_cpu_grad_cache_keeps_at_most_one_block():
    """A request the cached block cannot serve (more than 5/4 of its size, or smaller than it) frees that block
    before allocating, so the cache never holds more than one block beside the live gradients; empty_cpu_cache()
    frees it and returns its size."""
    rc.empty_cpu_cache()
    g = torch.Generator().manual_seed(12)
    target = torch.randint(0, 1000, (64,), generator=g)
    big = _cpu_grad(torch.randn(64, 1000, generator=g), target)
    big_ptr, big_bytes = big.data_ptr(), big.nbytes
    del big
    assert ops.cpu_cache_bytes() == big_bytes

    near = _cpu_grad(torch.randn(56, 1000, generator=g), target[:56])  # 7/8 of the block: reused
    assert near.data_ptr() == big_ptr and ops.cpu_cache_bytes() == 0
    del near
    small = _cpu_grad(torch.randn(8, 1000, generator=g), target[:8])  # 1/8: a fresh block, the cached one freed
    assert ops.cpu_cache_bytes() == 0
    small_bytes = small.nbytes
    small.resize_(16, 1000)  # the storage came from an allocator, so it can grow like any CPU tensor's
    del small
    assert ops.cpu_cache_bytes() == 16 * 1000 * 4
    assert rc.empty_cpu_cache() == 16 * 1000 * 4 and small_bytes == 8 * 1000 * 4
    assert ops.cpu_cache_bytes() == 0 and rc.empty_cpu_cache() == 0


@needs_compiled_cpu
def test_cpu_grad_cache_can_be_turned_off():
    import subprocess
    import sys

    code = ("import torch, rollout_corr_ext as rc\n"
            "from rollout_corr_ext import ops\n"
            "x = torch.randn(32, 500, requires_grad=True)\n"
            "rc.vocab_parallel_log_probs(x, torch.randint(0, 500, (32,))).sum().backward()\n"
            "x.grad = None\n"
            "print(ops.cpu_cache_bytes())\n")
    env = dict(__import__("os").environ, ROLLOUT_CORR_CPU_CACHE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0"
