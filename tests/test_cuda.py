"""What only a real GPU can show. Skips without one.

The op-level tests of every other file run on CUDA too (their ``cuda`` variants, ``rollout_corr_testing.backends
.device_params``); this file holds the CUDA-only checks:

* the misaligned-row (scalar) path of the vectorised log-prob kernels;
* the sampling-replay ops' CUDA kernels against the CPU kernels on the same values (the candidate lists, counts,
  thresholds and integer masses exactly);
* the checks that are **asynchronous device asserts** on CUDA (``torch._assert_async``; on the CPU they raise at
  once): each bad input runs in a fresh subprocess, because a device-side assert poisons the CUDA context of the
  process that triggers it. The CUDA message is CUDA's ("device-side assert triggered"): the text passed to
  ``torch._assert_async`` is only kept on the CPU, where the same inputs raise the named errors the CPU tests check.
"""

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_testing.backends import assert_device_assert, device_skip_reason
from rollout_corr_testing.tolerances import output_tol

pytestmark = [
    pytest.mark.skipif(device_skip_reason("cuda") is not None, reason=f"cuda: {device_skip_reason('cuda')}"),
    pytest.mark.cuda,
]


def test_cuda_inplace_backward_and_misaligned_rows():
    base = torch.randn(8, 1001, device="cuda")
    x = base[:, 1:1000].clone()[:, :999]  # odd width: rows not 16-byte aligned -> scalar path
    t = torch.randint(0, 999, (8,), device="cuda")
    xi = x.clone().requires_grad_(False)
    y = x.clone().requires_grad_(True)
    rc.vocab_parallel_log_probs(y, t).sum().backward()
    z = xi.clone().requires_grad_(True)
    logp = rc.vocab_parallel_log_probs(z * 1.0, t, inplace_backward=True)
    logp.sum().backward()
    torch.testing.assert_close(z.grad, y.grad, rtol=1e-5, atol=1e-6)


def test_misaligned_rows_match_aligned_rows():
    """A shard that starts one element into its buffer (unaligned rows: the scalar path) gives the results of the
    same values in an aligned buffer (the vector path) to the fp32 tolerance, in every dtype."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buf = (torch.randn(6, 2049, device="cuda") * 3).to(dtype)
        shifted = buf[:, 1:]  # data pointer one element past an aligned address
        aligned = shifted.contiguous()
        t = torch.randint(0, 2048, (6,), device="cuda")
        a = rc.vocab_parallel_log_probs(shifted, t, return_entropy=True)
        b = rc.vocab_parallel_log_probs(aligned, t, return_entropy=True)
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, **output_tol(dtype))


# (id, code run after the prelude of backends.run_python: torch, rc, ops imported, the CUDA backend active)
DEVICE_ASSERTS = [
    ("logprob_target_out_of_range", """
        rc.vocab_parallel_log_probs(torch.randn(4, 30, device="cuda"), torch.tensor([0, 30, 5, 7], device="cuda"))
    """),
    ("logprob_nan_logit", """
        x = torch.randn(4, 30, device="cuda"); x[2, 7] = float("nan")
        rc.vocab_parallel_log_probs(x, torch.zeros(4, dtype=torch.long, device="cuda"))
    """),
    ("logprob_row_of_only_neg_inf", """
        x = torch.randn(4, 30, device="cuda"); x[1] = float("-inf")
        rc.vocab_parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long, device="cuda"))
    """),
    ("logprob_shards_that_do_not_tile", """
        from rollout_corr_ext import logprobs
        x, t = torch.randn(4, 60, device="cuda"), torch.randint(0, 60, (4,), device="cuda")
        recs = torch.stack([ops.vocab_row_stats(x[:, :30], t, 0, 60, 1.0, -100, False),
                            ops.vocab_row_stats(x[:, 30:], t, 0, 60, 1.0, -100, False)])  # same vocab_start
        logprobs.assert_status(ops.merge_row_stats(recs, t, -100, 60, 1.0, False)[4])  # what the forward does
    """),
    ("rollout_no_valid_token", """
        lp = torch.randn(3, 8, device="cuda")
        rc.compute_rollout_correction(lp, lp, torch.zeros(3, 8, dtype=torch.bool, device="cuda"),
                                      rc.RolloutCorrectionConfig.decoupled_token_is())
    """),
    ("rollout_nonfinite_log_prob", """
        lp = -torch.rand(3, 8, device="cuda"); rlp = lp.clone(); lp[1, 2] = float("nan")
        rc.compute_rollout_correction(lp, rlp, torch.ones(3, 8, dtype=torch.bool, device="cuda"),
                                      rc.RolloutCorrectionConfig.decoupled_token_is())
    """),
    ("rollout_mask_not_0_or_1", """
        lp = -torch.rand(3, 8, device="cuda"); mask = torch.ones(3, 8, device="cuda"); mask[0, 3] = 0.5
        rc.compute_rollout_correction(lp, lp.clone(), mask, rc.RolloutCorrectionConfig.decoupled_token_is())
    """),
    ("rollout_ranks_disagree_on_the_config", """
        from rollout_corr_ext.correction import op_args
        lp = -torch.rand(3, 8, device="cuda"); mask = torch.ones(3, 8, dtype=torch.bool, device="cuda")
        args = op_args(rc.RolloutCorrectionConfig.decoupled_token_is())
        st = ops.rollout_seq_stats(lp, lp, mask, args)
        _, _, sums, _ = ops.rollout_token_pass(lp, lp, mask, st, args, True)
        ops.rollout_check(sums, torch.tensor(False, device="cuda"), lp, lp, mask, False)  # what dp_group's check sees
    """),
    ("policy_loss_undefined_at_a_response_token", """
        lp = -torch.rand(3, 8, device="cuda"); lp[1, 2] = float("nan")
        rc.compute_policy_loss_vanilla(lp.clone(), lp, torch.randn(3, 8, device="cuda"),
                                       torch.ones(3, 8, dtype=torch.bool, device="cuda"))
    """),
    ("sampling_scatter_index_out_of_range", """
        ops.scatter_rows(torch.ones(2, 2, device="cuda"), torch.tensor([[0, 9], [1, -1]], device="cuda"), 5,
                         torch.float32)
    """),
    ("agg_loss_normaliser_tensor_not_positive", """
        rc.agg_loss(torch.randn(2, 3, device="cuda"), torch.ones(2, 3, device="cuda"), "token-mean",
                    batch_num_tokens=torch.tensor(0.0, device="cuda"))
    """),
]


@pytest.mark.parametrize("code", [c[1] for c in DEVICE_ASSERTS], ids=[c[0] for c in DEVICE_ASSERTS])
def test_device_asserts_end_the_process(code, request):
    """Each bad input is a device-side assert on CUDA (no host sync in the op; the error surfaces at the next
    synchronisation): the subprocess must fail with one, never finish with a wrong result."""
    assert_device_assert(code, request.node.callspec.id)


def test_good_inputs_do_not_assert():
    """The subprocess harness itself: the same calls on valid inputs finish (so a failure above is the assert)."""
    from rollout_corr_testing.backends import run_python

    proc = run_python("""
        x, t = torch.randn(4, 30, device="cuda"), torch.randint(0, 30, (4,), device="cuda")
        rc.vocab_parallel_log_probs(x, t)
        lp = -torch.rand(3, 8, device="cuda")
        res = rc.compute_rollout_correction(lp, lp + 0.01, torch.ones(3, 8, dtype=torch.bool, device="cuda"),
                                            rc.RolloutCorrectionConfig.decoupled_token_is())
        rc.compute_policy_loss_vanilla(lp.clone(), lp, torch.randn(3, 8, device="cuda"),
                                       torch.ones(3, 8, dtype=torch.bool, device="cuda"))
        torch.cuda.synchronize()
        print("OK", len(res.as_floats()))
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ---- sampling replay: the CUDA kernels against the CPU kernels ---------------------------------------------------

SAMPLING_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _sampling_rows(n, v, dtype, seed, grid=False):
    from rollout_corr_testing.sampling_kernel_oracles import rows_with_edges

    return rows_with_edges(n, v, dtype, seed, grid=grid)


@pytest.mark.parametrize("dtype", SAMPLING_DTYPES, ids=str)
def test_sampling_elementwise_ops_match_the_cpu_kernels(dtype):
    """floor_fill, floor_zero_, count_at_least, scatter_rows and row_topk (k inside and beyond the kernel's
    shared-memory sort) on CUDA tensors equal the CPU kernels' results exactly."""
    import math

    from rollout_corr_ext import ops

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = _sampling_rows(64, 3001, dtype, seed=1, grid=True)
    x[5, 17] = float("nan")
    floor = (torch.randn(64, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3).to(acc)
    floor[3] = -math.inf
    xc, fc = x.cuda(), floor.cuda()
    for t in (1.0, 0.7):
        want = torch.empty_like(x)
        ops.floor_fill(x, floor, t, want)
        got = torch.empty_like(xc)
        ops.floor_fill(xc, fc, t, got)
        assert torch.equal(got.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
        g = torch.randn(64, 3001).to(dtype)
        gc = g.cuda()
        ops.floor_zero_(g, x, floor, t)
        ops.floor_zero_(gc, xc, fc, t)
        assert torch.equal(gc.cpu(), g)
    assert torch.equal(ops.count_at_least(xc, fc).cpu(), ops.count_at_least(x, floor))
    for k in (1, 50, 1025, 5000):
        assert torch.equal(ops.row_topk(xc, k).cpu(), ops.row_topk(x, k)), k
    values = torch.randn(64, 40, dtype=acc)
    index = torch.stack([torch.randperm(3001)[:40] for _ in range(64)])
    index[7, 20:] = -1
    assert torch.equal(ops.scatter_rows(values.cuda(), index.cuda(), 3001, dtype).cpu(),
                       ops.scatter_rows(values, index, 3001, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sampling_mass_histogram_matches_the_cpu_kernel(dtype):
    """The integer masses of the general top-p search: one exp polynomial (sampling_math.h) with the products fused
    as the CPU kernels' FMA copies fuse them, so the histograms are equal (the baseline copy, without FMA, may round
    a mass the other way: at most 1 per value, rarely)."""
    import math

    from rollout_corr_ext import ops
    from rollout_corr_ext.sampling import _ordered_key, _probes

    z = (torch.randn(256, 8192, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4).to(dtype)
    z_max = z.amax(1)
    floor = torch.full((256,), -math.inf, dtype=dtype)
    hi, lo = _ordered_key(z_max), _ordered_key(z_max - 64) - 1
    for levels in (4, 8, 12):
        probes = _probes(lo, hi, levels, torch.float64 if dtype == torch.float64 else torch.float32)
        want = ops.mass_histogram(z, z_max, floor, lo, hi, probes)
        got = ops.mass_histogram(*(t.cuda() for t in (z, z_max, floor, lo, hi, probes))).cpu()
        if torch.ops.rollout_corr.cpu_isa() == "baseline":
            assert int((got - want).abs().sum()) <= 256 * 8192 // 1000
        else:
            assert torch.equal(got, want), levels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sampling_row_candidates_match_the_cpu_kernel(dtype):
    """The candidate lists and counts of a realistic shard (32000 columns, k up to 1024, width 1280), i.i.d. and
    tied rows, a row of one repeated value (the kernel's exact route), NaN / +inf / all -inf rows, ignored rows:
    equal to the CPU kernel's; max and target exactly, the sum of exps to 2e-6."""
    import math

    from rollout_corr_ext import ops

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(48, 32768, generator=g) * 3).to(dtype)
    x[1] = 0.5
    x[2, 100] = float("nan")
    x[3, 7] = math.inf
    x[4] = -math.inf
    k = torch.randint(1, 1025, (48,), generator=g)
    k[5] = 0
    tc = torch.randint(-1, 32000, (48,), generator=g)
    for t in (1.0, 0.6):
        want = ops.row_candidates(x, k, tc, 1280, t, 32000)
        got = [v.cpu() for v in ops.row_candidates(x.cuda(), k.cuda(), tc.cuda(), 1280, t, 32000)]
        for a, b in zip(got[:3], want[:3]):
            assert torch.equal(a, b)
        assert torch.equal(got[3][:, [0, 2]].nan_to_num(), want[3][:, [0, 2]].nan_to_num())
        torch.testing.assert_close(got[3][:, 1], want[3][:, 1], rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sampling_candidate_decide_matches_the_cpu_kernel(dtype):
    """The decision on gathered lists (8 shards of 160, unsorted, -inf padded, ties): tau exactly the CPU kernel's
    (top-k, min-p floor, top-p in integer masses), the fp64 outputs to rounding."""
    import math

    from rollout_corr_ext import ops

    g = torch.Generator().manual_seed(5)
    n, width = 512, 1280
    cand = (torch.randn(n, width, generator=g, dtype=torch.float64) * 3).to(torch.bfloat16).to(dtype)
    cand[::3, 1100:] = -math.inf
    z_max = cand.double().amax(1)
    z_t = cand[:, 9].double()
    sum_all = (cand.double() - z_max.unsqueeze(1)).exp().sum(1) + 2.0
    k = torch.randint(0, width + 1, (n,), generator=g)
    floor = torch.where(torch.arange(n) % 4 == 1, z_max - 5, torch.full((n,), -math.inf, dtype=torch.float64))
    top_p = torch.rand(n, generator=g, dtype=torch.float64)
    top_p[::7] = 1.0
    args = (cand, z_max, z_t, sum_all, k, floor.to(dtype), top_p)
    tau, out = ops.candidate_decide(*args)
    tau_c, out_c = ops.candidate_decide(*(a.cuda() for a in args))
    assert torch.equal(tau_c.cpu(), tau)
    torch.testing.assert_close(out_c.cpu(), out, rtol=1e-12, atol=1e-12, equal_nan=True)
