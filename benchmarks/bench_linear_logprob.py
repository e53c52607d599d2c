"""Log-probs from hidden states: ``linear_log_probs`` (chunked, [N, V] never materialized) vs the materialized path.

Rows, measured in the same run on the same inputs (``hidden`` [N, H], output-layer shard ``weight`` [V_local, H],
targets, return_entropy=True; forward + backward of ``(logp * w1 + entropy * w2).sum()`` with respect to hidden and
weight):

* materialized: ``logits = hidden @ weight.T`` then ``rollout_corr_ext.vocab_parallel_log_probs`` (what a megatron
  trainer does with its output layer today);
* fused: ``rollout_corr_ext.linear_log_probs(hidden, weight, ...)`` with its default chunk (2048 rows x 2048 vocab
  columns).

Columns: median wall time of forward + backward (``--repeats``, after a warm-up) at ``--n-time`` rows, and the
fused / materialized time ratio; for every N of ``--n``: peak extra resident memory of one forward + backward,
measured in a fresh subprocess with the allocator as the user has it (RSS high-water mark above the RSS once the
inputs exist; no malloc variables), both with and without the gradients both paths must return
(``grad_hidden`` [N, H] and ``grad_weight`` [V_local, H]), and the fused / materialized ratio of the latter.

Run (the issue's size is ``--hidden 2048``; on a 2-core CPU one fp32 forward + backward at N = 8192 then takes
about a minute per path, so the default here is ``--hidden 512``, which leaves the memory ratio of the logits-sized
buffers unchanged)::

    python benchmarks/bench_linear_logprob.py [--hidden 512 --vocab 32000 --n 2048 4096 8192 16384 --n-time 8192
                                               --ignored 0 0.3 0.5]
    python benchmarks/bench_linear_logprob.py --hidden 2048 --n 2048 8192 16384 --memory-only   # memory table only
    python benchmarks/bench_linear_logprob.py --device cuda   # on a GPU: CUDA allocator peaks, cuda.synchronize
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

PATHS = ("materialized", "fused")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(n, h, v, dtype, device, ignored=0.0):
    """``ignored``: the fraction of rows whose target is ignore_index (an RL batch's padding), at random rows."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).to(device)
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.randperm(n, generator=g)[:round(ignored * n)]] = -100
    target = target.to(device)
    w1, w2 = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    return hidden.requires_grad_(True), weight.requires_grad_(True), target, w1, w2


def step(path, hidden, weight, target, w1, w2):
    """One forward + backward; the gradients land in hidden.grad / weight.grad."""
    hidden.grad = weight.grad = None
    if path == "materialized":
        logits = hidden @ weight.t()
        logp, ent = rc.vocab_parallel_log_probs(logits, target, return_entropy=True)
    else:
        logp, ent = rc.linear_log_probs(hidden, weight, target, return_entropy=True)
    (logp * w1 + ent * w2).sum().backward()


def measure_memory(path, n, h, v, dtype, device):
    """Peak extra memory (MiB) of one forward + backward in this fresh process."""
    step(path, *make_inputs(64, h, 256, dtype, device))  # lazy initialisation on a tiny problem
    inputs = make_inputs(n, h, v, dtype, device)
    return peak_extra_mib(lambda: step(path, *inputs), device)


def memory_subprocess(path, n, h, v, dtype_name, device, say=print):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_memory", path, "--n", str(n), "--hidden",
                          str(h), "--vocab", str(v), "--dtypes", dtype_name, "--device", device],
                         capture_output=True, text=True)
    if out.returncode != 0:
        say(f"(memory of {path} at N={n} failed: {out.stderr.strip().splitlines()[-1:]})")
        return None
    return float(out.stdout.strip().splitlines()[-1])


def time_table(args, h, v, device, sync):
    """The time table: every (ignored fraction, path) cell at ``--n-time`` rows, median of ``--repeats``."""
    print(f"time at N = {args.n_time} (median of {args.repeats} after a warm-up); ignored rows: targets set to "
          f"ignore_index, which the fused path leaves out of its GEMMs and the materialized path computes:")
    print()
    print("| dtype | ignored rows | materialized (s) | fused (s) | fused / materialized |")
    print("|---|---:|---:|---:|---:|")
    cells_per_dtype = 2 * len(args.ignored) * (args.repeats + 1)
    bar = progress_bar(len(args.dtypes) * cells_per_dtype, "time", args.no_progress, unit="step")
    for name in args.dtypes:
        bar.set_postfix_str(name)
        # every (ignored fraction, path) cell interleaved within each repeat, so drift of the machine hits all alike
        inputs = {f: make_inputs(args.n_time, h, v, DTYPES[name], device, f) for f in args.ignored}
        cells = [(f, p) for f in args.ignored for p in PATHS]
        for f, path in cells:
            step(path, *inputs[f])
            sync()
            bar.update()
        times = {c: [] for c in cells}
        for _ in range(args.repeats):
            for f, path in cells:
                t0 = time.perf_counter()
                step(path, *inputs[f])
                sync()
                times[(f, path)].append(time.perf_counter() - t0)
                bar.update()
        for f in args.ignored:
            med = {p: statistics.median(times[(f, p)]) for p in PATHS}
            bar.write(f"| {name} | {f:.0%} | {med['materialized']:.2f} | {med['fused']:.2f} | "
                      f"{med['fused'] / med['materialized']:.2f}x |")
        del inputs
    bar.close()
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512, help="H: the hidden size")
    ap.add_argument("--vocab", type=int, default=32000, help="V_local: rows of this rank's output-layer shard")
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                    help="rows N of each memory measurement (a fresh process each)")
    ap.add_argument("--n-time", type=int, default=8192, help="rows N of the time table")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="input dtypes")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after a warm-up")
    ap.add_argument("--ignored", type=float, nargs="+", default=[0.0, 0.3, 0.5],
                    help="fractions of rows whose target is ignore_index, timed each (the fused path skips them)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the inputs live")
    ap.add_argument("--memory-only", action="store_true", help="skip the time table (--n-time, --repeats, --ignored)")
    add_progress_flag(ap)
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    h, v, device = args.hidden, args.vocab, args.device
    if args._memory:
        print(json.dumps(measure_memory(args._memory, args.n[0], h, v, DTYPES[args.dtypes[0]], device)))
        return

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"log-probs + entropy from hidden states: H = {h}, V_local = {v}, forward + backward w.r.t. hidden and "
          f"weight; device {device}, backend={rc.backend()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; fused chunk {rc.linear.DEFAULT_CHUNK_ROWS} x {rc.linear.DEFAULT_CHUNK_COLS}")
    print()
    if not args.memory_only:
        time_table(args, h, v, device, sync)
    print("peak extra memory of one forward + backward (MiB; in brackets: without the returned grad_hidden and "
          "grad_weight):")
    print()
    print("| dtype | N | logits [N, V_local] | materialized | fused | fused / materialized (without grads) |")
    print("|---|---:|---:|---:|---:|---:|")
    bar = progress_bar(len(args.dtypes) * len(args.n) * len(PATHS), "memory", args.no_progress, unit="process")
    for name in args.dtypes:
        elem = torch.empty((), dtype=DTYPES[name]).element_size()
        for n in args.n:
            grads = (n * h + v * h) * elem / 2**20
            mem = {}
            for p in PATHS:
                bar.set_postfix_str(f"{name} N={n} {p}")
                mem[p] = memory_subprocess(p, n, h, v, name, device, bar.write)
                bar.update()
            if None in mem.values():
                continue
            wo = {p: max(m - grads, 0.0) for p, m in mem.items()}
            bar.write(f"| {name} | {n} | {n * v * elem / 2**20:.0f} | {mem['materialized']:.0f} "
                      f"[{wo['materialized']:.0f}] | {mem['fused']:.0f} [{wo['fused']:.0f}] | "
                      f"{wo['fused'] / max(wo['materialized'], 1e-9):.3f} |")
    bar.close()


if __name__ == "__main__":
    main()
