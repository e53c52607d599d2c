"""Single-process tests of the vocab-parallel log-prob / entropy / cross-entropy op (docs/logprobs.md, §7).

Every op-level test runs on each device variant of ``rollout_corr_testing.backends.DEVICES``: ``cpu``, ``emulated``
(the CUDA kernels on the CPU thread-model emulator) and ``cuda`` (skipped with the reason without a GPU), with the
same fp64 oracles (on the CPU) and the tolerance table of ``rollout_corr_testing.tolerances``.
"""

import math

import pytest
import torch

from rollout_corr_testing.logprob_oracle import log_probs_dense

import rollout_corr_ext as rc
from rollout_corr_ext import _layout as LY
from rollout_corr_ext import ops
from rollout_corr_testing.backends import device_params, ops_on
from rollout_corr_testing.logprob_samples import DTYPES, merge_stress_rows, sample_inputs
from rollout_corr_testing.tolerances import ROW_ROUNDING_TOL, grad_tol, output_tol

DEVICES = device_params()
#: opcheck and torch.compile check the registered torch.ops.rollout_corr kernels, which the emulator is not.
COMPILED_DEVICES = device_params("cpu", "cuda", emulated_reason="checks the registered torch.ops.rollout_corr "
                                                                "kernels; the emulator registers its own test library")


def dense_reference(logits, target, kw, label_smoothing=0.0):
    return log_probs_dense(
        logits.double(), target, vocab_size=kw.get("vocab_size"), temperature=kw.get("temperature", 1.0),
        ignore_index=kw.get("ignore_index", -100), label_smoothing=label_smoothing)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_fp64_reference(dtype, device):
    with ops_on(device) as dev:
        for logits, target, kw in sample_inputs(dtype, device=dev):
            logp, ent = rc.vocab_parallel_log_probs(logits, target, return_entropy=True, **kw)
            assert logp.device == logits.device and ent.device == logits.device
            logp, ent, logits, target = logp.cpu(), ent.cpu(), logits.cpu(), target.cpu()
            ref_logp, ref_ent, _ = dense_reference(logits, target, kw)
            assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            assert logp.shape == target.shape and ent.shape == target.shape
            torch.testing.assert_close(logp.double(), ref_logp, **output_tol(dtype))
            torch.testing.assert_close(ent.double(), ref_ent, **output_tol(dtype))
            ignored = target == kw.get("ignore_index", -100)
            assert torch.all(logp[ignored] == 0) and torch.all(ent[ignored] == 0)


@pytest.mark.parametrize("temperature", [1.0, 0.3, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_merge_keeps_fp32_accuracy(dtype, temperature):
    """CPU kernels (the copy this CPU runs; test_logprob_cpu_isa.py runs the others), on merge_stress_rows: logp and
    entropy within a few fp32 ulp of fp64 (tighter than the output table, which these kernels meet with room; a merge
    that cancels shows up here first)."""
    rows, target = merge_stress_rows()
    logits = rows.to(dtype)
    logp, ent = rc.vocab_parallel_log_probs(logits, target, return_entropy=True, temperature=temperature)
    ref_logp, ref_ent, _ = log_probs_dense(logits.double(), target, temperature=temperature)
    for got, ref in ((logp, ref_logp), (ent, ref_ent)):
        err = (got.double() - ref).abs() / (1 + ref.abs())
        assert err.max() <= ROW_ROUNDING_TOL, (err.max().item(), err.argmax().item())
    assert ent[4] == 0 and logp[4] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_with_one_finite_logit_is_exact(dtype, device):
    """A row with one finite logit (the rest -inf, or so far below it that their exp is 0 in the accumulation type)
    has log p = 0 at that logit and entropy 0 exactly, wherever the logit sits (in a vector loop or a block's scalar
    tail) and whatever its value and the temperature: maxima whose product with log2(e)/T is not exact in fp32
    included (the AVX-512 CPU copy sums x log2(e)/T - fl(m log2(e)/T) in one FMA and takes the offset out after)."""
    vocab = 2100  # one 2048-column block and a tail, or part of one 8192-column bf16 block
    values = [3.7, -12.3, 0.1, 1000.1, 6.02e6, 3.1e38 if dtype != torch.float16 else 6.0e4]
    positions = [0, 100, 2047, 2090]
    no_mass = 750.0 if dtype == torch.float64 else 150.0  # e^-no_mass is 0 in the accumulation type
    with ops_on(device) as dev:
        for temperature in (1.0, 0.7, 1.3):
            rows, targets = [], []
            for v in values:
                for pos in positions:
                    for rest in (-math.inf, v - (no_mass + 50.0) * temperature):
                        row = torch.full((vocab,), rest, dtype=torch.float64)
                        row[pos] = v
                        rows.append(row)
                        targets.append(pos)
            logits = torch.stack(rows).to(dtype)
            top = logits.double().max(1).values
            rest = logits.double().min(1).values
            ok = torch.isfinite(top) & ((top - rest) / temperature > no_mass)  # not where rounding brought them close
            logits, target = logits[ok].to(dev), torch.tensor(targets)[ok].to(dev)
            logp, ent = rc.vocab_parallel_log_probs(logits, target, return_entropy=True, temperature=temperature)
            assert torch.all(logp.cpu() == 0), (temperature, logp)
            assert torch.all(ent.cpu() == 0), (temperature, ent)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_and_grad_match_reference(dtype, label_smoothing, device):
    with ops_on(device) as dev:
        for logits, target, kw in sample_inputs(dtype, seed=1):
            x = logits.to(dev, copy=True).requires_grad_(True)
            loss = rc.vocab_parallel_cross_entropy(x, target.to(dev), label_smoothing=label_smoothing, **kw)
            xr = logits.double().requires_grad_(True)
            _, _, ref_loss = log_probs_dense(
                xr, target, vocab_size=kw.get("vocab_size"), temperature=kw.get("temperature", 1.0),
                ignore_index=kw.get("ignore_index", -100), label_smoothing=label_smoothing)
            torch.testing.assert_close(loss.double().cpu(), ref_loss.detach(), **output_tol(dtype))
            w = torch.randn(target.shape, dtype=torch.float64)
            (loss * w.to(dev, loss.dtype)).sum().backward()
            (ref_loss * w).sum().backward()
            assert x.grad.dtype == dtype and x.grad.device == x.device
            torch.testing.assert_close(x.grad.double().cpu(), xr.grad, **grad_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_joint_logp_entropy_gradient(dtype, device):
    with ops_on(device) as dev:
        for logits, target, kw in sample_inputs(dtype, seed=2):
            x = logits.to(dev, copy=True).requires_grad_(True)
            logp, ent = rc.vocab_parallel_log_probs(x, target.to(dev), return_entropy=True, **kw)
            xr = logits.double().requires_grad_(True)
            ref_logp, ref_ent, _ = log_probs_dense(
                xr, target, vocab_size=kw.get("vocab_size"), temperature=kw.get("temperature", 1.0),
                ignore_index=kw.get("ignore_index", -100))
            a, b = torch.randn(target.shape, dtype=torch.float64), torch.randn(target.shape, dtype=torch.float64)
            (logp * a.to(dev, logp.dtype) + ent * b.to(dev, ent.dtype)).sum().backward()
            (ref_logp * a + ref_ent * b).sum().backward()
            grad = x.grad.cpu()
            torch.testing.assert_close(grad.double(), xr.grad, **grad_tol(dtype))
            if "vocab_size" in kw:  # padding columns get exactly zero gradient
                assert torch.all(grad[..., kw["vocab_size"]:] == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_without_entropy_gives_the_same_logp_and_gradient(dtype, device):
    """return_entropy=False and the cross-entropy take the records with with_entropy=False (the CPU kernels skip the
    entropy sums): the log-probs and their gradient are bit for bit those of a call that returns the entropy."""
    with ops_on(device) as dev:
        for logits, target, kw in sample_inputs(dtype, seed=4):
            logits, target = logits.to(dev), target.to(dev)
            g = torch.randn(target.shape, dtype=torch.float64).to(dev)
            grads = []
            for return_entropy in (True, False):
                x = logits.detach().clone().requires_grad_(True)
                out = rc.vocab_parallel_log_probs(x, target, return_entropy=return_entropy, **kw)
                logp = out[0] if return_entropy else out
                (logp * g.to(logp.dtype)).sum().backward()
                grads.append((logp.detach(), x.grad))
            assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
            nll = rc.vocab_parallel_cross_entropy(logits, target, **kw)
            assert torch.equal(nll, -grads[0][0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_records_without_entropy_merge_to_nan_entropy(dtype, device):
    """Op level: records taken with with_entropy=False say so in their header; the merge returns a NaN entropy
    (0 on ignored rows) and a 0 mean in the row state, never a value nobody computed, on every backend; shards
    that disagree on the flag are a format mismatch."""
    with ops_on(device) as dev:
        x = (torch.randn(6, 40, dtype=torch.float64) * 3).to(dtype).to(dev)
        target = torch.tensor([3, -100, 39, 0, 17, 25]).to(dev)
        merged = []
        for with_entropy in (True, False):
            rec = ops.vocab_row_stats(x, target, 0, 40, 1.25, -100, False, with_entropy)
            merged.append(ops.merge_row_stats(rec.unsqueeze(0), target, -100, 40, 1.25, False))
        (logp, ent, _, state, _), (logp2, ent2, _, state2, _) = merged
        ignored = (target == -100).cpu()
        assert torch.equal(logp, logp2) and torch.equal(state[:, :2], state2[:, :2])
        assert torch.all(ent.cpu()[~ignored].isfinite()) and torch.all(ent2.cpu()[~ignored].isnan())
        assert torch.all(ent2.cpu()[ignored] == 0) and torch.all(state2[:, 2].cpu() == 0)
        halves = [ops.vocab_row_stats(x[:, 20 * k:20 * (k + 1)].contiguous(), target, 20 * k, 40, 1.25, -100, False,
                                      k == 0) for k in range(2)]
        with pytest.raises((RuntimeError, ValueError), match="format"):
            ops.merge_row_stats(torch.stack(halves), target, -100, 40, 1.25, False)
    if device == "cpu":  # the pure-PyTorch fallback writes the same header and merges the same way
        from rollout_corr_ext import fallback

        rec = fallback.vocab_row_stats(x, target, 0, 40, 1.25, -100, False, False)
        hl = LY.header_len(torch.float32 if dtype != torch.float64 else dtype)
        assert torch.equal(rec[:hl], ops.vocab_row_stats(x, target, 0, 40, 1.25, -100, False, False)[:hl])
        _, ent3, _, state3, _ = fallback.merge_row_stats(rec.unsqueeze(0), target, -100, 40, 1.25, False)
        assert torch.equal(ent3.isnan(), ent2.isnan()) and torch.all(state3[:, 2] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_fp64(device):
    with ops_on(device) as dev:
        torch.manual_seed(0)
        x = torch.randn(3, 4, 11, dtype=torch.float64).to(dev).requires_grad_(True)
        t = torch.randint(0, 10, (3, 4))
        t[0, 1] = -100
        t = t.to(dev)

        def fn(inp):
            logp, ent = rc.vocab_parallel_log_probs(inp, t, vocab_size=10, temperature=0.8, return_entropy=True)
            ce = rc.vocab_parallel_cross_entropy(inp, t, label_smoothing=0.2, vocab_size=10, temperature=0.8)
            return logp, ent, ce

        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_twice_eager(dtype, device):
    """Our bf16/fp16 error vs fp64 is at most 2x that of an eager low-precision log_softmax vs fp64 (on the CPU)."""
    torch.manual_seed(3)
    logits = (torch.randn(64, 4096, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, 4096, (64,))
    exact = torch.log_softmax(logits.double(), -1).gather(1, target[:, None]).squeeze(1)
    with ops_on(device) as dev:
        ours = rc.vocab_parallel_log_probs(logits.to(dev), target.to(dev)).double().cpu()
        x = logits.to(dev, copy=True).requires_grad_(True)
        rc.vocab_parallel_log_probs(x, target.to(dev)).sum().backward()
        our_grad = x.grad.double().cpu()
    eager = torch.log_softmax(logits, -1).gather(1, target[:, None]).squeeze(1).double()
    our_err = (ours - exact).abs().max().item()
    eager_err = (eager - exact).abs().max().item()
    assert our_err <= 2 * eager_err + 1e-6, (our_err, eager_err)

    xe = logits.clone().requires_grad_(True)
    torch.log_softmax(xe, -1).gather(1, target[:, None]).sum().backward()
    xd = logits.double().requires_grad_(True)
    torch.log_softmax(xd, -1).gather(1, target[:, None]).sum().backward()
    assert (our_grad - xd.grad).abs().max() <= 2 * (xe.grad.double() - xd.grad).abs().max() + 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_caller_logits_untouched_unless_inplace(inplace_backward, device):
    torch.manual_seed(4)
    with ops_on(device) as dev:
        base = torch.randn(6, 50).to(dev).requires_grad_(True)
        logits = base * 1.0  # a non-leaf, as an output layer produces
        target = torch.randint(0, 50, (6,)).to(dev)
        before = logits.detach().clone()
        logp, ent = rc.vocab_parallel_log_probs(logits, target, return_entropy=True,
                                                inplace_backward=inplace_backward)
        assert torch.equal(logits.detach(), before)
        (logp.sum() + 0.5 * ent.sum()).backward()
    xr = before.cpu().double().requires_grad_(True)
    rl, re, _ = log_probs_dense(xr, target.cpu())
    (rl.sum() + 0.5 * re.sum()).backward()
    torch.testing.assert_close(base.grad.double().cpu(), xr.grad, rtol=1e-5, atol=1e-6)
    if inplace_backward:
        # The gradient was written into the logits buffer: no [N, V] allocation for it.
        torch.testing.assert_close(logits.detach().double().cpu(), xr.grad, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_without_grad_saves_nothing_and_allocates_small(device):
    with ops_on(device) as dev:
        x = torch.randn(16, 300).to(dev)
        t = torch.randint(0, 300, (16,)).to(dev)
        with torch.no_grad():
            out = rc.vocab_parallel_log_probs(x, t)
    assert out.grad_fn is None and out.shape == (16,) and out.device == x.device


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, t: ((x, t[:-1]), {}), "target must have shape"),
        (lambda x, t: ((x, t.float()), {}), "target must be an int64"),
        (lambda x, t: ((x.long(), t), {}), "logits must be a float"),
        (lambda x, t: ((x, t.clone().fill_(40)), {}), "target holds ids outside"),
        (lambda x, t: ((x, t.clone().fill_(-3)), {}), "target holds ids outside"),
        (lambda x, t: ((x, t.clone().fill_(35)), {"vocab_size": 30}), "target holds ids outside"),
        (lambda x, t: ((x, t), {"vocab_size": 41}), r"vocab_size <= 40 = logits.shape\[-1\] \(got 41\)"),
        (lambda x, t: ((x, t), {"vocab_size": 0}), "vocab_size must be >= 1, got 0"),
        (lambda x, t: ((x, t), {"vocab_start": 3}), r"vocab_start must be 0 \(got 3\)"),
        (lambda x, t: ((x, t), {"vocab_start": -1}), "vocab_start must be >= 0, got -1"),
        (lambda x, t: ((x, t), {"temperature": 0.0}), "temperature must be finite and > 0, got 0.0"),
        (lambda x, t: ((x, t.to("meta")), {}), "target is on meta but logits is on (cpu|cuda)"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_argument(make, match, device):
    if device == "cuda" and "target holds ids" in match:
        pytest.skip(reason="cuda: out-of-range targets are an asynchronous device assert, which poisons the CUDA context; "
                    "tests/test_cuda.py::test_device_asserts_end_the_process runs it in a subprocess")
    with ops_on(device) as dev:
        x = torch.randn(5, 40).to(dev)
        t = torch.randint(0, 40, (5,)).to(dev)
        x0, t0 = x.clone(), t.clone()
        args, kw = make(x, t)
        with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
            rc.vocab_parallel_log_probs(*args, **kw)
    assert torch.equal(x, x0) and torch.equal(t, t0)


def test_label_smoothing_out_of_range():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        rc.vocab_parallel_cross_entropy(torch.randn(2, 5), torch.tensor([0, 1]), label_smoothing=1.0)


@pytest.mark.parametrize("device", COMPILED_DEVICES)
def test_ops_opcheck(compiled_backend, device):
    torch.manual_seed(5)
    for dtype in [torch.float32, torch.bfloat16, torch.float64]:
        full = torch.randn(6, 74).to(device, dtype)
        x = full[:, :37].contiguous()
        t = torch.randint(0, 70, (6,))
        t[1] = -100
        t = t.to(device)
        args = (x, t, 0, 70, 1.25, -100, True)
        torch.library.opcheck(torch.ops.rollout_corr.vocab_row_stats.default, args)
        stats = torch.stack([ops.vocab_row_stats(*args),
                             ops.vocab_row_stats(full[:, 37:].contiguous(), t, 37, 70, 1.25, -100, True)])
        torch.library.opcheck(torch.ops.rollout_corr.merge_row_stats.default, (stats, t, -100, 70, 1.25, True))
        _, _, _, state, _ = ops.merge_row_stats(stats, t, -100, 70, 1.25, True)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        g = torch.randn(6, dtype=acc).to(device)
        torch.library.opcheck(torch.ops.rollout_corr.logprob_backward.default,
                              (g, None, g, x, t, state, 0, 70, 1.25, -100))
        torch.library.opcheck(torch.ops.rollout_corr.logprob_backward_.default,
                              (x.clone(), g, g, None, t, state, 0, 70, 1.25, -100))


@pytest.mark.parametrize("device", COMPILED_DEVICES)
def test_torch_compile_fullgraph_forward(compiled_backend, device):
    x = torch.randn(4, 64).to(device)
    t = torch.randint(0, 64, (4,)).to(device)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(a, b):
        return ops.vocab_row_stats(a, b, 0, 64, 1.0, -100, False)

    torch.testing.assert_close(f(x, t), ops.vocab_row_stats(x, t, 0, 64, 1.0, -100, False))


@pytest.mark.parametrize("device", DEVICES)
def test_shard_with_only_padding_merges_cleanly(device):
    """A shard whose columns are all padding contributes nothing (and no NaN) to the merge."""
    torch.manual_seed(6)
    full = torch.randn(5, 16, dtype=torch.float64)
    target = torch.randint(0, 10, (5,))
    # Columns 10..15 are padding: shard 1 has 2 real columns, shard 2 none at all.
    shards = [full[:, :8], full[:, 8:], torch.randn(5, 8, dtype=torch.float64)]
    with ops_on(device) as dev:
        t = target.to(dev)
        recs = torch.stack([ops.vocab_row_stats(s.to(dev), t, 8 * i, 10, 1.0, -100, True)
                            for i, s in enumerate(shards)])
        logp, ent, mean_logp, _, status = ops.merge_row_stats(recs, t, -100, 10, 1.0, True)
    assert not status.cpu().any(), status
    ref_logp, ref_ent, _ = log_probs_dense(full[:, :10], target)
    torch.testing.assert_close(logp.cpu(), ref_logp)
    torch.testing.assert_close(ent.cpu(), ref_ent)
    torch.testing.assert_close(mean_logp.cpu(), torch.log_softmax(full[:, :10], -1).mean(-1))


@pytest.mark.slow
@pytest.mark.parametrize("device", device_params("cpu", "cuda", emulated_reason="2.24e9 elements: far beyond what "
                                                                                "the thread-by-thread emulator runs"))
def test_shard_over_2_pow_31_elements(device):
    """bf16 [70000, 32000] on one rank (2.24e9 elements): int64 indexing end to end, checked analytically."""
    rows, vocab = 70000, 32000
    assert rows * vocab > 2**31
    x = torch.zeros(rows, vocab, dtype=torch.bfloat16, device=device)
    target = (torch.arange(rows) * 7919 % vocab).to(device)
    probe = torch.tensor([0, 1, 67109, 67110, rows - 2, rows - 1], device=device)  # rows around/past element 2^31
    a = torch.tensor([2.0, -1.5, 3.0, 0.5, 4.0, -2.0], dtype=torch.float64)
    x[probe, target[probe]] = a.to(device, torch.bfloat16)
    x[rows - 1, vocab - 1] = 1.0  # the very last element, far past 2^31
    logp = rc.vocab_parallel_log_probs(x, target).cpu()
    target_cpu = target.cpu()

    def expected(row, a_val):
        total = (vocab - 1) + math.exp(a_val)
        if row == rows - 1 and target_cpu[row] != vocab - 1:
            total += math.e - 1.0  # the column set to 1.0 was a 0
        return a_val - math.log(total)

    for i, r in enumerate(probe.tolist()):
        torch.testing.assert_close(logp[r].double(), torch.tensor(expected(r, a[i].item()), dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
    untouched = torch.tensor([2, 5000, 69997])
    torch.testing.assert_close(logp[untouched].double(), torch.full((3,), -math.log(vocab), dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    # Backward, in place to keep memory at one copy: the gradient of the last row at its last column.
    x.requires_grad_(False)
    _, _, _, state, _ = ops.merge_row_stats(
        ops.vocab_row_stats(x, target, 0, vocab, 1.0, -100, False).unsqueeze(0), target, -100, vocab, 1.0, False)
    g = torch.zeros(rows, device=device)
    g[rows - 1] = 1.0
    ops.logprob_backward_(x, g, None, None, target, state, 0, vocab, 1.0, -100)
    p_last = math.e / ((vocab - 2) + math.e + math.exp(a[-1].item()))
    torch.testing.assert_close(x[rows - 1, vocab - 1].double().cpu(), torch.tensor(-p_last, dtype=torch.float64),
                               rtol=1e-2, atol=1e-6)
    assert x[0].abs().sum() == 0  # rows with zero upstream gradient get zero


@pytest.mark.parametrize("device", DEVICES)
def test_int32_target_accepted_and_equal(device):
    with ops_on(device) as dev:
        x = torch.randn(3, 20).to(dev)
        t = torch.randint(0, 20, (3,)).to(dev)
        torch.testing.assert_close(rc.vocab_parallel_log_probs(x, t.int()), rc.vocab_parallel_log_probs(x, t))


@pytest.mark.parametrize("device", DEVICES)
def test_non_flattenable_layout_matches_contiguous(device):
    """A transposed [b, s, V] -> [s, b, V] input (leading dims not flattenable to a view) gives equal results."""
    with ops_on(device) as dev:
        x = torch.randn(3, 5, 40).to(dev)
        t = torch.randint(0, 40, (3, 5)).to(dev)
        torch.testing.assert_close(rc.vocab_parallel_log_probs(x.transpose(0, 1), t.transpose(0, 1)),
                                   rc.vocab_parallel_log_probs(x, t).transpose(0, 1))
