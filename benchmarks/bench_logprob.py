"""Benchmark: vocab-parallel log-probs (forward and forward+backward) vs megatron-core and eager PyTorch.

Compares, in one run and on the same inputs:
  * ours          rollout_corr_ext.vocab_parallel_cross_entropy (returns -logp, the same quantity as megatron's)
  * ours-inplace  the same with inplace_backward=True (the gradient overwrites the logits buffer)
  * megatron      megatron.core.tensor_parallel.vocab_parallel_cross_entropy (fed a copy: it writes its input)
  * eager         -log_softmax(logits.float()).gather(target) (TP=1 only: it needs the whole vocab)
  * plain read    logits.sum(): what this machine can read of the shard (forward rows only: the bandwidth baseline)
  * ours, cached logits  the same forward on a [N, V_local] view whose rows all alias the first row (row stride 0):
                the same work per element with the shard read from cache, not memory (forward only: the compute
                bound). A forward is at its roofline where its time is that of the slower of this and the plain read
  * plain copy    a preallocated [N, V_local] buffer .copy_(logits): read + write (the backward's baseline)
  * plain fresh write  torch.empty_like(logits).fill_(0): allocating and first touching a fresh [N, V_local] buffer,
                what an out-of-place backward pays on top of the in-place one without a cached buffer (ours keeps its
                last gradient block for the next step on CPU, and its extra memory counts that block)

For each: median time over --reps, throughput (bytes of logits read, and on fwd+bwd also the gradient written,
per second; on CUDA also % of the peak HBM bandwidth given by --peak-gbps), peak extra memory during the step,
and the number of torch.distributed collectives per step. TP=2 runs two gloo processes, each with one thread
(TP=1 runs one process with all threads); with ``--device cuda`` one process per GPU on NCCL (a TP size larger than
the number of visible GPUs is skipped, and said so). Prints a markdown table.

    python benchmarks/bench_logprob.py                       # the full CPU table of docs/benchmarks.md
    python benchmarks/bench_logprob.py --tokens 2048 --vocab 32000 --dtypes bf16 --tp 1   # a quick look
    python benchmarks/bench_logprob.py --device cuda --peak-gbps 4800                     # on a GPU (H200)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

from rollout_corr_ext import ops  # noqa: E402  (after the path; the package picks its backend at import)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import add_progress_flag, progress_bar  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "broadcast")


class CountCollectives:
    def __init__(self):
        self.n = 0
        self.saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                orig = getattr(dist, name)
                self.saved[name] = orig

                def wrapped(*a, __o=orig, **k):
                    self.n += 1
                    return __o(*a, **k)

                setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(dist, name, orig)


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak extra memory of a step: CUDA allocator peak on GPU; on CPU the process's resident-set high-water mark
    (reset through /proc/self/clear_refs) above the resident set before the step, plus the gradient block that our
    CPU backward kept from the previous step (csrc/cpu/reused_buffer.h): it is resident before the step, but it is
    the step's memory all the same."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _rss_kib("VmRSS") * 1024 - ops.cpu_cache_bytes()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _rss_kib("VmHWM") * 1024 - self.base


def _impls(tp, group):
    import rollout_corr_ext as rc
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    impls = {
        "ours": lambda x, t: rc.vocab_parallel_cross_entropy(x, t, 0.0, group if tp > 1 else None),
        # The output layer's logits are a non-leaf: a view stands in for them (no copy), since in-place backward
        # refuses to overwrite a leaf.
        "ours-inplace": lambda x, t: rc.vocab_parallel_cross_entropy(x.view_as(x) if x.requires_grad else x, t, 0.0,
                                                                     group if tp > 1 else None,
                                                                     inplace_backward=True),
        "megatron": lambda x, t: mcore_ce(x.clone() if not x.requires_grad else x * 1.0, t),
    }
    if tp == 1:
        impls["eager"] = lambda x, t: -torch.log_softmax(x.float(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    return impls


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(fn, make_input, target, backward, reps, device, group):
    times, peaks, colls = [], [], []
    ops.cpu_cache_bytes(release=True)  # each implementation starts without our cached block; ours refills it
    for i in range(reps + 1):  # the first run warms up
        x = make_input()
        if backward:
            x.requires_grad_(True)
        dist.barrier(group)
        _sync(device)
        with PeakMemory(device) as mem, CountCollectives() as cc:
            t0 = time.perf_counter()
            loss = fn(x, target)
            if backward:
                loss.sum().backward()
            _sync(device)
            elapsed = time.perf_counter() - t0
        if i > 0:
            times.append(elapsed)
            peaks.append(mem.peak)
            colls.append(cc.n)
        del x, loss
    return statistics.median(times), max(peaks), max(colls)


def _worker(rank, world, store, args, out_path):
    threads = max(1, (os.cpu_count() or 1) // world) if args.device == "cpu" else 1
    torch.set_num_threads(threads)
    if args.device == "cuda":  # one GPU per rank, NCCL
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.group.WORLD
    import rollout_corr_ext as rc

    if rc.backend() == "fallback":
        rc.load_extension()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    device = args.device
    rows = []
    # one step per (size, dtype, implementation, pass): 2 passes of each implementation, 1 of the 4 baselines
    steps = len(args.tokens) * len(args.vocab) * len(args.dtypes) * (2 * len(_impls(world, group)) + 4)
    bar = progress_bar(steps, f"TP={world}", args.no_progress or rank != 0, unit="step")
    for n in args.tokens:
        for v_local in args.vocab:
            for dname in args.dtypes:
                dtype = DTYPES[dname]
                g = torch.Generator().manual_seed(1234 + rank)
                base = (torch.randn(n, v_local, generator=g) * 2).to(dtype).to(device)
                target = torch.randint(0, v_local * world, (n,), generator=torch.Generator().manual_seed(7)).to(device)
                elem = base.element_size()
                copy_out = torch.empty_like(base)
                impls = dict(_impls(world, group))
                impls["plain read"] = lambda x, t: x.sum()
                # The compute bound: every row aliases row 0 (stride 0), so the N x V_local elements come from cache.
                impls["ours, cached logits"] = lambda x, t, ours=impls["ours"]: ours(x[:1].expand(x.shape), t)
                impls["plain copy"] = lambda x, t: copy_out.copy_(x)
                # What an out-of-place backward would pay before any math: a fresh [N, V_local] buffer, written once
                # (allocation + first-touch page faults; no huge-page hint).
                impls["plain fresh write"] = lambda x, t: torch.empty_like(x).fill_(0)
                for name, fn in impls.items():
                    for backward in (False, True):
                        if backward and (name.startswith("plain") or name.endswith("cached logits")):
                            continue
                        bar.set_postfix_str(f"N={n} V={v_local} {dname} {name} {'fwd+bwd' if backward else 'fwd'}")
                        make = lambda src=base: src.clone()  # noqa: E731  (bound now: pyflakes sees the del below)
                        t, peak, coll = _measure(fn, make, target, backward, args.reps, device, group)
                        # bytes moved: read once, plus the gradient written (fwd+bwd) or the copy's write; a fresh write 1x
                        moved = n * v_local * elem * (2 if backward or name == "plain copy" else 1)
                        rows.append((world, n, v_local, dname, name, "fwd+bwd" if backward else "fwd", t,
                                     moved / t / 1e9, peak, coll))
                        bar.update()
                del base
    bar.close()
    if rank == 0:
        torch.save(rows, out_path)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Formatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="rows N (tokens) per shard")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 64000], help="V_local (per rank)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES), help="logits dtypes")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (gloo processes)")
    p.add_argument("--reps", type=int, default=3, help="timed repeats (median) after a warm-up")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the logits live")
    p.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth for the %% column (GPU)")
    add_progress_flag(p)
    args = p.parse_args()

    all_rows = []
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    for tp in args.tp:
        if args.device == "cuda" and tp > torch.cuda.device_count():
            print(f"(TP={tp} skipped: needs {tp} GPUs, {torch.cuda.device_count()} visible)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            mp.spawn(_worker, args=(tp, os.path.join(tmp, "store"), args, out), nprocs=tp, join=True)
            all_rows += torch.load(out)

    import rollout_corr_ext as rc

    if rc.backend() == "fallback":
        rc.load_extension()  # what the workers ran (the header reports it)
    where = (f"cuda ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, NCCL for TP > 1)"
             if args.device == "cuda" else f"cpu ({os.cpu_count()} cores, {ops.cpu_isa()} copy of the CPU kernels)")
    print(f"device: {where}, torch {torch.__version__}, backend {rc.backend()}, median of {args.reps} runs")
    header = "| TP | tokens | V_local | dtype | impl | pass | time (ms) | GB/s |"
    header += " % peak |" if args.peak_gbps else ""
    header += " peak extra mem (MiB) | collectives |"
    print(header)
    print("|" + "|".join(["---"] * (header.count("|") - 1)) + "|")
    for world, n, v, dname, name, pas, t, gbps, peak, coll in all_rows:
        line = f"| {world} | {n} | {v} | {dname} | {name} | {pas} | {t * 1e3:.1f} | {gbps:.2f} |"
        if args.peak_gbps:
            line += f" {100 * gbps / args.peak_gbps:.0f}% |"
        line += f" {peak / 2**20:.0f} | {coll} |"
        print(line)

    # Speed-up summary against megatron-core for the fwd+bwd pass.
    print()
    print("| TP | tokens | V_local | dtype | fwd GB/s: ours / plain read | fwd GB/s: cached logits "
          "| fwd % of roofline | fwd+bwd speed-up vs megatron "
          "| same, inplace_backward | fwd+bwd GB/s: ours / plain copy | extra mem ours / megatron "
          "| fwd+bwd ms: out-of-place - in-place / plain fresh write |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    index = {(r[0], r[1], r[2], r[3], r[4], r[5]): r for r in all_rows}
    for (world, n, v, dname, name, pas), r in index.items():
        if name != "ours" or pas != "fwd+bwd":
            continue
        m = index[(world, n, v, dname, "megatron", pas)]
        inp = index[(world, n, v, dname, "ours-inplace", pas)]
        fwd = index[(world, n, v, dname, "ours", "fwd")]
        read = index[(world, n, v, dname, "plain read", "fwd")]
        copy = index[(world, n, v, dname, "plain copy", "fwd")]
        fresh = index[(world, n, v, dname, "plain fresh write", "fwd")]
        cached = index[(world, n, v, dname, "ours, cached logits", "fwd")]
        roofline = min(read[7], cached[7])  # GB/s of the slower of memory and the kernel's own arithmetic
        mem_ratio = r[8] / m[8] if m[8] > 0 else float("nan")
        print(f"| {world} | {n} | {v} | {dname} | {fwd[7]:.2f} / {read[7]:.2f} = {fwd[7] / read[7]:.0%} "
              f"| {cached[7]:.2f} | {fwd[7] / roofline:.0%} | {m[6] / r[6]:.2f}x | {m[6] / inp[6]:.2f}x "
              f"| {r[7]:.2f} / {copy[7]:.2f} = {r[7] / copy[7]:.0%} "
              f"| {mem_ratio:.2f} | {(r[6] - inp[6]) * 1e3:.0f} / {fresh[6] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
