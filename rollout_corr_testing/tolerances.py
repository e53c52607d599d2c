"""The one tolerance table of the test suite: every comparison of ours against an oracle or a peer takes its
tolerance from here, keyed by the dtype the comparison runs in."""

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


#: linear_log_probs (log-probs, entropy) against the fp64 log_softmax of the *exact* product h W^T (+ b), by the
#: inputs' dtype. 16-bit inputs: the chunk logits are the GEMM's fp32 accumulators (never rounded to 16 bits), so
#: the error is the fp32 accumulation over H of exact products plus the fp32 kernel's: the fp32 bound. (A 16-bit
#: materialized output layer is off by up to half a bf16 ulp of each logit: 0.02 in log-prob at |z| ~ 8.)
LINEAR_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-5, 1e-5),
    torch.float16: (1e-5, 1e-5),
}


def linear_tol(dtype):
    rtol, atol = LINEAR_TOL[dtype]
    return {"rtol": rtol, "atol": atol}


def output_tol(dtype):
    rtol, atol = OUTPUT_TOL[dtype]
    return {"rtol": rtol, "atol": atol}


def grad_tol(dtype):
    rtol, atol = GRAD_TOL[dtype]
    return {"rtol": rtol, "atol": atol}


#: Rollout-correction metrics, weights and masks against the fp64 oracle, by the dtype the pipeline accumulates in
#: (bf16/fp16 inputs are rounded first and the math is fp32).
METRIC_TOL = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.float32: dict(rtol=2e-5, atol=2e-6),
    torch.bfloat16: dict(rtol=2e-5, atol=2e-6),
    torch.float16: dict(rtol=2e-5, atol=2e-6),
}
#: IS weights are O(1) and never summed before the comparison: a tighter atol than the batch metrics.
WEIGHT_TOL = {
    torch.float64: dict(rtol=1e-9, atol=1e-12),
    torch.float32: dict(rtol=2e-5, atol=1e-7),
}
#: The documented accuracy of the IS-weight percentiles (docs/rollout_correction.md: within 0.5 % of the exact
#: order statistics at any batch size).
PERCENTILE_RTOL = 0.005

#: Policy-loss kernel by log_prob's dtype: the row partials are sums over up to ~130 tokens of fp32 terms of size
#: ~5, so a few fp32 ulps of the running sum.
POLICY_LOSS_ROW_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (2e-5, 1e-4),
    torch.float16: (2e-5, 1e-4),
}
#: Whole losses (package vs the dense fp64 / verl formulas) in the dtype the loss runs in.
LOSS_TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
#: Rollout metrics against verl's own helper (``math.isclose`` form). fp64 inputs: verl still reduces its fractions
#: in fp32 (``.float().mean()``), rel 5e-7 covers that rounding.
VERL_TOL = {torch.float32: dict(rel_tol=2e-5, abs_tol=2e-6), torch.float64: dict(rel_tol=5e-7, abs_tol=1e-12)}


def accumulation_dtype(*dtypes):
    """The dtype the package accumulates in for these input dtypes: fp64 when any is fp64, else fp32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
