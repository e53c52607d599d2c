"""How much the geometric-mean rejection (``seq_mean_k1``, the ``decoupled_geo_rs`` presets) drops at a small
mismatch: synthetic sequences whose per-token log-ratio log pi_old - log pi_rollout is Gaussian noise, fixed seed.
README.md quotes the default band's figure from this script's default run::

    python scripts/geo_rs_rejection.py

A sequence of T tokens is kept when exp(mean log-ratio) lies in the band; with i.i.d. noise of scale sigma the mean
has scale sigma / sqrt(T), so shorter sequences are rejected more often (--t)."""

from __future__ import annotations

import argparse

import torch

from rollout_corr_ext import RolloutCorrectionConfig, compute_rollout_correction


def rows(b: int, t: int, noise: float, bands, seed: int):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.05
    old = rollout + noise * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    for band in bands:
        cfg = RolloutCorrectionConfig.decoupled_geo_rs(rs_threshold=band)
        m = compute_rollout_correction(old, rollout, mask, cfg).metrics
        yield (band, float(m["rollout_corr/rollout_rs_masked_fraction"]), float(m["rollout_corr/kl"]),
               float(m["rollout_corr/k3_kl"]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=2000, help="sequences")
    ap.add_argument("--t", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--noise", type=float, default=0.02, help="std of the per-token log-ratio")
    ap.add_argument("--bands", nargs="+", default=["0.999_1.001", "0.99_1.01"], help="rs_threshold values")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"{args.b} sequences x {args.t} tokens, per-token log-ratio ~ N(0, {args.noise}^2), seed {args.seed}\n")
    print("| rs_threshold | rollout_rs_masked_fraction | kl | k3_kl |")
    print("|---|---|---|---|")
    for band, frac, kl, k3 in rows(args.b, args.t, args.noise, args.bands, args.seed):
        print(f"| {band} | {frac:.3f} | {kl:.2e} | {k3:.2e} |")


if __name__ == "__main__":
    main()
