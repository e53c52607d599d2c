"""Shared inputs and comparisons of the rollout-correction tests (single-process and distributed)."""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch


from rollout_corr_testing.tolerances import METRIC_TOL, PERCENTILE_RTOL

TOL = METRIC_TOL  # the name the rollout tests import
PREFIX = "rollout_corr/"


def make_inputs(b: int, t: int, seed: int = 0, scale: float = 0.3, pad_rows=(), min_len: int = 1,
                dtype=torch.float32, generator_device: str = "cpu"):
    """log-probs on a 2^-12 grid (so lr, its row sums and k1 are exact in fp32 and fp64 alike: threshold
    decisions cannot differ between the pipeline and the fp64 oracle), right-padded response masks."""
    g = torch.Generator(device=generator_device).manual_seed(seed)
    q = 2.0 ** -12
    rlp = torch.round(-torch.rand(b, t, generator=g) * 4.0 / q) * q
    lr = torch.round(torch.randn(b, t, generator=g) * scale / q) * q
    lp = rlp + lr
    lengths = torch.randint(min(min_len, t), t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    for r in pad_rows:
        mask[r] = False
    # Padding holds junk, as real batches do (the op must ignore it, NaN included).
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    return lp.to(dtype), rlp.to(dtype), mask


def compare_metrics(ours: Dict[str, torch.Tensor], oracle: Dict[str, torch.Tensor], dtype,
                    skip=()) -> list:
    """Mismatches between our ``rollout_corr/*`` metrics and the oracle's ones (keys with or without the prefix);
    [] when equal."""
    tol = METRIC_TOL[dtype]
    errors = []
    ours_f = {k: float(v) for k, v in ours.items()}
    want = {k if k.startswith(PREFIX) else PREFIX + k: float(v) for k, v in oracle.items()}
    if set(ours_f) != set(want):
        errors.append(f"key sets differ: only ours {sorted(set(ours_f) - set(want))}, "
                      f"only oracle {sorted(set(want) - set(ours_f))}")
    for k, w in want.items():
        if k not in ours_f or any(s in k for s in skip):
            continue
        o = ours_f[k]
        if "rollout_is_p" in k and k[len(PREFIX) + len("rollout_is_p"):].isdigit():
            ok = abs(o - w) <= PERCENTILE_RTOL * abs(w) * (1 + 1e-6) + 1e-300
        else:
            ok = math.isclose(o, w, rel_tol=tol["rtol"], abs_tol=tol["atol"]) or (math.isnan(o) and math.isnan(w))
        if not ok:
            errors.append(f"{k}: ours {o!r} oracle {w!r}")
    return errors


def assert_weights_mask(res, weights: Optional[torch.Tensor], mask: torch.Tensor, dtype) -> None:
    tol = METRIC_TOL[dtype]
    if weights is None:
        assert res.weights is None
    else:
        assert res.weights is not None and res.weights.shape == weights.shape
        torch.testing.assert_close(res.weights.to(torch.float64), weights.to(torch.float64), **tol)
    assert res.response_mask.dtype == mask.dtype
    assert torch.equal(res.response_mask, mask)
