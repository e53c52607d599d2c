"""The torch CPU primitives the whole-batch policy losses (clip_cov, kl_cov) choose between, in one run
(docs/benchmarks.md, "Policy losses"; rollout_corr_ext/losses.py, ``_flag``, ``_count``, ``_masked_total``,
``_in_dtype``).

Problem (default): B x T = 256 x 8192 fp32 (the policy-loss benchmark's size), a float 0 / 1 mask with random lengths
in [T/4, T], standard-normal values. Each row: median wall time of ``--repeats`` calls after one warm-up, the inputs
in cache (they fit in this VM's L3 two at a time), into preallocated outputs where the op takes one. Run::

    python benchmarks/bench_torch_masks.py [--b 256 --t 8192 --repeats 21]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=256, help="rows (default: %(default)s)")
    ap.add_argument("--t", type=int, default=8192, help="columns (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=21, help="timed calls per row (default: %(default)s)")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    b, t = args.b, args.t
    lengths = torch.randint(max(1, t // 4), t + 1, (b,), generator=g)
    m = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    x = torch.randn(b, t, generator=g)
    valid = m > 0
    flags = valid.float()
    zero = torch.zeros(())
    out_f, out_b = torch.empty(b, t), torch.empty(b, t, dtype=torch.bool)
    rows = [
        ("comparison into bool: `torch.gt(m, 0, out=bool)`", lambda: torch.gt(m, 0, out=out_b)),
        ("comparison into float: `torch.gt(m, 0, out=float)`", lambda: torch.gt(m, 0, out=out_f)),
        ("float 0 / 1 to bool: `out_bool.copy_(flags)`", lambda: out_b.copy_(flags)),
        ("count the bools: `torch.count_nonzero(valid)`", lambda: torch.count_nonzero(valid)),
        ("count the float flags: `flags.sum()`", lambda: flags.sum()),
        ("masked sum by select: `torch.where(valid, x, 0).sum()`",
         lambda: torch.where(valid, x, zero, out=out_f).sum()),
        ("masked sum by product: `torch.mul(x, m).nansum()`", lambda: torch.mul(x, m, out=out_f).nansum()),
        ("bool to float: `out_float.copy_(valid)`", lambda: out_f.copy_(valid)),
        ("bool bytes to float, clamped: `out_float.copy_(valid.view(torch.uint8)).clamp_(max=1)`",
         lambda: out_f.copy_(valid.view(torch.uint8)).clamp_(max=1)),
    ]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"# torch CPU mask primitives, B x T = {b} x {t} fp32; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, commit {commit}")
    print("| op | ms |")
    print("|---|---:|")
    for name, fn in rows:
        print(f"| {name} | {_median_ms(fn, args.repeats):.3f} |", flush=True)


if __name__ == "__main__":
    main()
