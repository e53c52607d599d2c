"""Sampling replay against the plain log-probs and the peers' way, in the same run.

Forward (log-prob + entropy, and log S for the replay) and backward of: ``plain`` = ``vocab_parallel_log_probs``
(no truncation); ``replay`` = ``sampled_log_probs`` with top-k / top-p / min-p; ``peer`` = what NeMo-RL-style code does
(gather the whole vocabulary at TP > 1, ``torch.sort``, ``cumsum``, mask, ``log_softmax``). Peak extra memory of one
forward + backward in a fresh process (RSS high-water mark above the RSS once the inputs exist; CUDA: the allocator's
peak), in the default environment. ``--tp N`` also runs the replay on N gloo workers (CPU) and counts its collectives
and their bytes per row. ``--ties`` measures, on bf16 logits, how much more mass the whole-tie-group top-p rule keeps
than vLLM's position-by-position rule (``torch.sort`` order).

    python benchmarks/bench_sampling.py --n 4096 --vocab 32000 --dtypes fp32 bf16
    python benchmarks/bench_sampling.py --ties
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout_corr_ext as rc  # noqa: E402
from peak_memory import peak_extra_mib  # noqa: E402
from progress import add_progress_flag, progress_bar  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("plain", "replay", "peer")


def make_inputs(n, v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype).to(device)
    target = torch.randint(0, v, (n,), generator=g).to(device)
    return logits, target


def peer_way(logits, target, sp, group=None, world=1):
    """Gather the vocabulary, sort, cumsum, mask, log_softmax (the materialising way; vLLM's rules)."""
    if world > 1:
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.detach(), group=group)
        rank = dist.get_rank(group)
        parts[rank] = logits
        logits = torch.cat(parts, dim=-1)
    z = logits.float() / sp.temperature
    srt, idx = z.sort(dim=-1)
    if sp.top_k is not None:
        kth = srt[:, z.shape[-1] - sp.top_k].unsqueeze(1)
        srt = srt.masked_fill(srt < kth, -math.inf)
    if sp.top_p < 1:
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - sp.top_p
        drop[:, -1] = False
        srt = srt.masked_fill(drop, -math.inf)
    masked = torch.empty_like(srt).scatter(-1, idx, srt)
    logp_all = masked.log_softmax(-1)
    logp = logp_all.gather(1, target.unsqueeze(1)).squeeze(1)
    p = logp_all.exp()
    ent = -(torch.where(p > 0, p * logp_all, torch.zeros_like(p))).sum(-1)
    return logp, ent


def forward(method, logits, target, sp, group=None, world=1):
    if method == "plain":
        return rc.vocab_parallel_log_probs(logits, target, group, temperature=sp.temperature, return_entropy=True)
    if method == "replay":
        r = rc.sampled_log_probs(logits, target, sp, group)
        return r.log_prob, r.entropy
    return peer_way(logits, target, sp, group, world)


def step(method, logits, target, sp, group=None, world=1, backward=True):
    x = logits.detach().requires_grad_(backward)
    logp, ent = forward(method, x, target, sp, group, world)
    if backward:
        torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)).sum().add(ent.sum()).backward()
    return x


def timed_backward(method, logits, target, sp, repeats, sync):
    """Median time of the backward call alone (the forward runs untimed before each)."""
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        x = logits.detach().requires_grad_(True)
        logp, ent = forward(method, x, target, sp)
        loss = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)).sum().add(ent.sum())
        sync()
        t0 = time.perf_counter()
        loss.backward()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
        del x, logp, ent, loss
    return statistics.median(times)


def timed(fn, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_memory(method, n, v, dtype, device, sp):
    step(method, *make_inputs(32, 256, dtype, device), sp)  # lazy initialisation on a tiny problem
    logits, target = make_inputs(n, v, dtype, device)
    return peak_extra_mib(lambda: step(method, logits, target, sp), device)


def _tp_worker(rank, world, store, n, v, dtype_name, sp_kw, repeats, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.group.WORLD
    sp = rc.SamplingParams(**sp_kw)
    logits, target = make_inputs(n, v, DTYPES[dtype_name], "cpu")
    shard = logits[:, rank * (v // world):(rank + 1) * (v // world)].contiguous()
    calls = []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single")
    saved = {k: getattr(dist, k) for k in names if hasattr(dist, k)}

    def wrap(name, fn):
        def inner(*a, **k):
            t = a[0] if name == "all_reduce" else (a[1] if len(a) > 1 else k.get("input_tensor"))
            if isinstance(t, (list, tuple)):
                t = t[0]
            calls.append((name, t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0))
            return fn(*a, **k)
        return inner
    res = {}
    for method in METHODS:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        calls.clear()
        step(method, shard, target, sp, group, world, backward=False)
        counted = list(calls)
        for name, fn in saved.items():
            setattr(dist, name, fn)
        fwd = timed(lambda: step(method, shard, target, sp, group, world, backward=False), repeats, lambda: None)
        res[method] = dict(fwd=fwd, collectives=len(counted), bytes_per_row=sum(b for _, b in counted) / n)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def run_tp(world, n, v, dtype_name, sp_kw, repeats):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_tp_worker, args=(world, os.path.join(tmp, "store"), n, v, dtype_name, sp_kw, repeats, out),
                 nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def tie_rule_difference(n, v, top_p, scale, seed=0):
    """Per bf16 row: kept mass of the whole-group rule minus vLLM's (sort, cumsum, drop where <= 1 - p)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(torch.bfloat16)
    z = logits.float()
    asc, _ = z.sort(dim=-1)  # vLLM: logits.sort(descending=False), not stable
    probs = asc.softmax(-1)
    cum = probs.cumsum(-1)
    drop = cum <= 1 - top_p
    drop[:, -1] = False
    vllm_mass = torch.where(drop, torch.zeros_like(probs), probs).sum(-1)
    ours = rc.sampled_log_probs(logits, torch.zeros(n, dtype=torch.long), rc.SamplingParams(top_p=top_p),
                                vocab_size=v).log_kept_mass.exp()
    return ours.double() - vllm_mass.double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="rows (tokens)")
    ap.add_argument("--vocab", type=int, default=32000, help="V: the whole vocabulary")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="logit dtypes")
    ap.add_argument("--top-k", type=int, default=50, help="top_k of the replay and the peer way (0: no top-k)")
    ap.add_argument("--top-p", type=float, default=0.9, help="top_p of the replay and the peer way")
    ap.add_argument("--temperature", type=float, default=1.0, help="temperature")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after a warm-up")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (> 1: gloo workers)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the inputs live (TP = 1)")
    ap.add_argument("--no-memory", action="store_true", default=False, help="skip the memory table")
    ap.add_argument("--ties", action="store_true", default=False,
                    help="measure the top-p tie rule's extra kept mass on bf16 logits instead of timing")
    add_progress_flag(ap)
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ties:
        print(f"top-p tie rule on bf16 logits (N(0, s^2)), V = {args.vocab}, {args.n} rows per case: kept mass of the "
              f"whole-group rule minus vLLM's sort-order rule")
        print()
        print("| top_p | logit scale s | mean | max | rows that differ |")
        print("|---|---|---|---|---|")
        cases = [(top_p, scale) for top_p in (0.5, 0.9, 0.95) for scale in (1.0, 3.0, 8.0)]
        with progress_bar(len(cases), "ties", args.no_progress, unit="case") as bar:
            for top_p, scale in cases:
                d = tie_rule_difference(args.n, args.vocab, top_p, scale)
                bar.write(f"| {top_p} | {scale} | {d.mean().item():.2e} | {d.max().item():.2e} | "
                          f"{(d.abs() > 1e-6).double().mean().item() * 100:.1f} % |")
                bar.update()
        return
    sp_kw = dict(top_k=args.top_k if args.top_k > 0 else None, top_p=args.top_p, temperature=args.temperature)
    sp = rc.SamplingParams(**sp_kw)
    if args._memory:
        print(json.dumps(measure_memory(args._memory, args.n, args.vocab, DTYPES[args.dtypes[0]], args.device, sp)))
        return
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"sampling replay: N = {args.n}, V = {args.vocab}, top_k = {args.top_k}, top_p = {args.top_p}, "
          f"temperature = {args.temperature}; device {args.device}, backend={rc.backend()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print()
    print("| dtype | TP | plain fwd s | replay fwd s (x plain) | peer fwd s (x replay) | plain bwd s | replay bwd s "
          "| replay collectives / bytes per row |")
    print("|---|---|---|---|---|---|---|---|")
    bar = progress_bar(len(args.dtypes) * len(args.tp), "time", args.no_progress, unit="case")
    for name in args.dtypes:
        dtype = DTYPES[name]
        for tp in args.tp:
            bar.set_postfix_str(f"{name} TP={tp}")
            if tp == 1:
                logits, target = make_inputs(args.n, args.vocab, dtype, args.device)
                fwd = {m: timed(lambda m=m: step(m, logits, target, sp, backward=False), args.repeats, sync)
                       for m in METHODS}
                bwd = {m: timed_backward(m, logits, target, sp, args.repeats, sync) for m in METHODS}
                coll = "0 / 0"
                bar.write(f"| {name} | 1 | {fwd['plain']:.4f} | {fwd['replay']:.4f} "
                          f"({fwd['replay'] / fwd['plain']:.2f}x) | {fwd['peer']:.4f} "
                          f"({fwd['peer'] / fwd['replay']:.2f}x) | {bwd['plain']:.4f} | {bwd['replay']:.4f} | {coll} |")
            else:
                r = run_tp(tp, args.n, args.vocab, name, sp_kw, args.repeats)
                p, s, q = r["plain"], r["replay"], r["peer"]
                bar.write(f"| {name} | {tp} | {p['fwd']:.4f} | {s['fwd']:.4f} ({s['fwd'] / p['fwd']:.2f}x) | "
                          f"{q['fwd']:.4f} ({q['fwd'] / s['fwd']:.2f}x) | - | - | {s['collectives']} / "
                          f"{s['bytes_per_row']:.0f} (plain: {p['collectives']} / {p['bytes_per_row']:.0f}; peer: "
                          f"{q['collectives']} / {q['bytes_per_row']:.0f}) |")
            bar.update()
    bar.close()
    if args.no_memory:
        return
    print()
    print("Peak extra memory of one forward + backward (MiB), a fresh process each, TP = 1:")
    print()
    print("| dtype | plain | replay | peer (x replay) |")
    print("|---|---|---|---|")
    bar = progress_bar(len(args.dtypes) * len(METHODS), "memory", args.no_progress, unit="process")
    for name in args.dtypes:
        mem = {}
        for m in METHODS:
            bar.set_postfix_str(f"{name} {m}")
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_memory", m, "--n", str(args.n),
                                  "--vocab", str(args.vocab), "--dtypes", name, "--device", args.device,
                                  "--top-k", str(args.top_k), "--top-p", str(args.top_p), "--temperature",
                                  str(args.temperature)], capture_output=True, text=True)
            mem[m] = float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else float("nan")
            bar.update()
        bar.write(f"| {name} | {mem['plain']:.1f} | {mem['replay']:.1f} | {mem['peer']:.1f} "
                  f"({mem['peer'] / max(mem['replay'], 1e-9):.2f}x) |")
    bar.close()


if __name__ == "__main__":
    main()
