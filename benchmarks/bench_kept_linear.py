"""Kept-set replay from hidden states: ``kept_linear_log_probs`` vs materialising the logits for ``kept_log_probs``.

Rows, measured in the same run on the same inputs (``hidden`` [N, H], output-layer shard ``weight`` [V, H], targets,
one ``KeptTokens`` list of ``--kept`` ids per row holding its target, as an engine's top-k support would;
forward + backward of ``(where(in_support, logp, 0) * w1 + entropy * w2).sum()`` with respect to hidden and weight):

* materialized: ``logits = hidden @ weight.T`` then ``rollout_corr_ext.kept_log_probs`` (the logits path);
* kept_linear: ``rollout_corr_ext.kept_linear_log_probs`` (no ``[N, V]`` logits; the kept ids' logits gathered,
  log S from one untruncated ``linear_log_probs`` pass without a gradient);
* plain: ``rollout_corr_ext.linear_log_probs`` with no replay (the untruncated fused path, for scale).

Columns: median wall time of forward + backward (``--repeats`` after a warm-up, the paths interleaved repeat by
repeat) and peak extra resident memory of one forward + backward, each path in a fresh subprocess with the allocator
as the user has it (RSS high-water mark above the RSS once the inputs exist)::

    python benchmarks/bench_kept_linear.py [--n 4096 --hidden 512 --vocab 32000 --kept 50 --dtypes fp32]
    python benchmarks/bench_kept_linear.py --device cuda   # on a GPU: CUDA allocator peaks, cuda.synchronize
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rollout_corr_ext as rc  # noqa: E402
from peak_memory import peak_extra_mib  # noqa: E402
from progress import add_progress_flag, progress_bar  # noqa: E402

PATHS = ("materialized", "kept_linear", "plain")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(n, h, v, k, dtype, device):
    """Inputs and a kept list of ``k`` distinct ids per row (its target among them)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).to(device)
    k = min(k, v)
    ids = torch.rand(n, v, generator=g).topk(k, dim=1).indices  # k distinct random ids per row
    target = ids[torch.arange(n), torch.randint(0, k, (n,), generator=g)]
    kept = rc.KeptTokens(ids.reshape(-1).to(device), torch.arange(0, n * k + 1, k).to(device))
    w1, w2 = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    return hidden.requires_grad_(True), weight.requires_grad_(True), target.to(device), kept, w1, w2


def step(path, hidden, weight, target, kept, w1, w2):
    """One forward + backward; the gradients land in hidden.grad / weight.grad."""
    hidden.grad = weight.grad = None
    if path == "plain":
        logp, ent = rc.linear_log_probs(hidden, weight, target, return_entropy=True)
    else:
        r = (rc.kept_log_probs(hidden @ weight.t(), target, kept) if path == "materialized"
             else rc.kept_linear_log_probs(hidden, weight, target, kept))
        logp, ent = torch.where(r.in_support, r.log_prob, 0.0), r.entropy
    (logp * w1 + ent * w2).sum().backward()


def measure_memory(path, n, h, v, k, dtype, device):
    """Peak extra memory (MiB) of one forward + backward in this fresh process."""
    step(path, *make_inputs(64, h, 256, k, dtype, device))  # lazy initialisation on a tiny problem
    inputs = make_inputs(n, h, v, k, dtype, device)
    return peak_extra_mib(lambda: step(path, *inputs), device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="rows N")
    ap.add_argument("--hidden", type=int, default=512, help="H: the hidden size")
    ap.add_argument("--vocab", type=int, default=32000, help="V: rows of the output layer")
    ap.add_argument("--kept", type=int, default=50, help="kept ids per row")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES), help="input dtypes")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after a warm-up")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the inputs live")
    add_progress_flag(ap)
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n, h, v, k, device = args.n, args.hidden, args.vocab, args.kept, args.device
    if args._memory:
        print(json.dumps(measure_memory(args._memory, n, h, v, k, DTYPES[args.dtypes[0]], device)))
        return
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"kept-set log-probs + entropy from hidden states: N = {n}, H = {h}, V = {v}, {k} kept ids per row, forward "
          f"+ backward w.r.t. hidden and weight; device {device}, backend={rc.backend()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print()
    print("| dtype | materialized s | kept_linear s (x materialized) | plain linear_log_probs s | materialized MiB | "
          "kept_linear MiB (x materialized) | plain MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    bar = progress_bar(len(args.dtypes) * len(PATHS) * (args.repeats + 2), "kept", args.no_progress, unit="step")
    for name in args.dtypes:
        inputs = make_inputs(n, h, v, k, DTYPES[name], device)
        times = {p: [] for p in PATHS}
        for p in PATHS:  # warm-up
            step(p, *inputs)
            sync()
            bar.update()
        for _ in range(args.repeats):
            for p in PATHS:
                t0 = time.perf_counter()
                step(p, *inputs)
                sync()
                times[p].append(time.perf_counter() - t0)
                bar.update()
        del inputs
        mem = {}
        for p in PATHS:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_memory", p, "--n", str(n),
                                  "--hidden", str(h), "--vocab", str(v), "--kept", str(k), "--dtypes", name,
                                  "--device", device], capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"memory of {p} failed:\n{out.stderr[-2000:]}")
            mem[p] = float(out.stdout.strip().splitlines()[-1])
            bar.update()
        t = {p: statistics.median(times[p]) for p in PATHS}
        ratio = (f"{mem['kept_linear'] / mem['materialized']:.3f}x" if mem["materialized"] >= 1
                 else "-")  # under 1 MiB: the RSS mark's page granularity
        bar.write(f"| {name} | {t['materialized']:.3f} | {t['kept_linear']:.3f} "
                  f"({t['kept_linear'] / t['materialized']:.2f}x) | {t['plain']:.3f} | {mem['materialized']:.0f} | "
                  f"{mem['kept_linear']:.0f} ({ratio}) | "
                  f"{mem['plain']:.0f} |")
    bar.close()


if __name__ == "__main__":
    main()
