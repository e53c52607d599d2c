"""The one tolerance table of the test suite, keyed by dtype (rtol, atol)."""

import torch

#: Comparisons of a kernel's fp32 outputs against the fp64 oracle, by the dtype of the *input* logits.
#: fp32 inputs are tight. bf16/fp16 inputs are exact inputs to an fp32-accumulating kernel, so outputs are
#: held to the same fp32 tolerance (the oracle sees the same rounded values).
OUTPUT_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-5, 2e-5),
    torch.float16: (2e-5, 2e-5),
}

#: Log-prob / entropy of the CPU kernels against fp64 on rows built to stress the block merge (a max that keeps
#: rising block after block, a late jump, a one-hot row): |ours - oracle| <= this * (1 + |oracle|). A few fp32 ulp:
#: what fp32 accumulation over a row reaches when no merge cancels (a merge that rebases sums taken against a
#: smaller max cancels terms of the size of the jump; at a jump of 40 that measured 1.9e-6).
ROW_ROUNDING_TOL = 3e-7
#: The same for the CPU kernels' x86-64 baseline copy (no FMA: every product of the polynomial and of the entropy's
#: sum rounds once more; on a row of thousands of equal logits those roundings do not average out, 3.9e-7 measured).
ROW_ROUNDING_TOL_NO_FMA = 2 * ROW_ROUNDING_TOL

#: Gradients are returned in the logits dtype, so one rounding to that dtype is allowed.
GRAD_TOL = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (2e-3, 1e-6),
}


def output_tol(dtype):
    rtol, atol = OUTPUT_TOL[dtype]
    return {"rtol": rtol, "atol": atol}


def grad_tol(dtype):
    rtol, atol = GRAD_TOL[dtype]
    return {"rtol": rtol, "atol": atol}
