"""What only a real GPU can show. Skips without one.

The op-level tests of every other file run on CUDA too (their ``cuda`` variants, ``rollout_corr_testing.backends
.device_params``); this file holds the CUDA-only checks:

* the misaligned-row (scalar) path of the vectorised log-prob kernels;
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
