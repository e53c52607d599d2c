"""The log-prob op on a real GPU (the same checks as test_logprob.py on CUDA tensors). Skips without one."""

import pytest
import torch

from rollout_corr_testing.logprob_oracle import log_probs_dense

import rollout_corr_ext as rc
from rollout_corr_testing.logprob_samples import DTYPES, sample_inputs
from rollout_corr_testing.tolerances import grad_tol, output_tol

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or rc.backend() != "cuda",
    reason="needs a CUDA device and the extension built with its CUDA kernels",
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_forward_backward_match_fp64_reference(dtype):
    for logits, target, kw in sample_inputs(dtype, device="cuda"):
        x = logits.clone().requires_grad_(True)
        logp, ent = rc.vocab_parallel_log_probs(x, target, return_entropy=True, **kw)
        xr = logits.double().cpu().requires_grad_(True)
        ref_logp, ref_ent, _ = log_probs_dense(
            xr, target.cpu(), vocab_size=kw.get("vocab_size"), temperature=kw.get("temperature", 1.0),
            ignore_index=kw.get("ignore_index", -100))
        torch.testing.assert_close(logp.double().cpu(), ref_logp.detach(), **output_tol(dtype))
        torch.testing.assert_close(ent.double().cpu(), ref_ent.detach(), **output_tol(dtype))
        (logp.sum() + 0.5 * ent.sum()).backward()
        (ref_logp.sum() + 0.5 * ref_ent.sum()).backward()
        torch.testing.assert_close(x.grad.double().cpu(), xr.grad, **grad_tol(dtype))


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

