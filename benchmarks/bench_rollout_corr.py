"""Rollout correction: our two-pass op vs an op-by-op eager implementation in the style of verl.

Problem (default): B x T = 256 x 8192 (2.1 M tokens), fp32 log-probs, bool mask, token-level TIS (C = 2),
two RS criteria (token_k1 + seq_mean_k3), every metric read back as Python floats.

Baseline: ``reference.rollout_correction_dense`` run in fp32 without percentiles (verl 0.9.1 has none): one
torch expression per metric, and one ``.item()`` per metric as verl's ``rollout_corr_helper`` does.

Reported per implementation: median wall time of ``--repeats`` runs (after one warm-up), host syncs
(``aten::_local_scalar_dense`` dispatches + ``.tolist()`` / ``.item()`` calls; on a GPU each is a device
sync) before and including the metric read, peak extra resident memory (measured in a fresh subprocess),
and the effective bandwidth over the bytes a fused implementation must move (inputs read twice, weights and
mask written once). Run::

    python benchmarks/bench_rollout_corr.py [--b 256 --t 8192 --repeats 5]

``--dist`` instead measures what the cross-rank checks cost (issue 8 §7) on 2 gloo ranks (one thread each), per
call of ``compute_rollout_correction`` on a ``--b`` x ``--t`` shard per rank: DP (``dp_group``: the partials travel at
the fixed wire size with the config fingerprint, no extra collective) and CP (``seq_group``: one extra 16-byte
all-reduce of the row counts before the per-row reduce). Baselines in the same run: the bare collectives of the
previous layout (SUM + MAX of this config's unpadded partials), and the row-count check alone::

    python benchmarks/bench_rollout_corr.py --dist [--b 64 --t 2048 --repeats 20]
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
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rollout_corr_ext as rc  # noqa: E402
from rollout_corr_ext import reference as R  # noqa: E402

CFG = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
           rollout_rs_threshold="0.5_2.0,0.05")


def make_inputs(b: int, t: int):
    g = torch.Generator().manual_seed(0)
    rlp = -torch.rand(b, t, generator=g) * 4.0
    lp = rlp + torch.randn(b, t, generator=g) * 0.2
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, rlp, mask


def run_ours(lp, rlp, mask, cfg):
    res = rc.compute_rollout_correction(lp, rlp, mask, cfg)
    return res.as_floats()


def run_eager(lp, rlp, mask, cfg):
    _, _, met = R.rollout_correction_dense(lp, rlp, mask, cfg, dtype=torch.float32, percentiles=False)
    return {"rollout_corr/" + k: v.item() for k, v in met.items()}  # verl: one .item() per metric


IMPLS = {"ours (two-pass op)": run_ours, "eager, verl style": run_eager}


class CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_syncs(fn, *args):
    reads = [0]
    real_tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: reads.__setitem__(0, reads[0] + 1) or real_tolist(self)
    try:
        with CountSyncs() as c:
            fn(*args)
    finally:
        torch.Tensor.tolist = real_tolist
    return c.count + reads[0]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def measure_peak_memory(name: str, b: int, t: int) -> float:
    """Peak extra RSS (MiB) of one call, measured in this (fresh) process after the inputs exist."""
    cfg = rc.RolloutCorrectionConfig(**CFG)
    IMPLS[name](*make_inputs(4, 64), cfg)  # lazy imports and one-off allocations, on a tiny batch
    lp, rlp, mask = make_inputs(b, t)
    base = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    IMPLS[name](lp, rlp, mask, cfg)
    return (_rss_kib("VmHWM") - base) / 1024.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=256)
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        print(json.dumps(measure_peak_memory(args._memory, args.b, args.t)))
        return

    lp, rlp, mask = make_inputs(args.b, args.t)
    cfg = rc.RolloutCorrectionConfig(**CFG)
    n = lp.numel()
    fused_bytes = 2 * n * (4 + 4 + 1) + n * (4 + 1)
    rows = []
    check = {}
    times = {name: [] for name in IMPLS}
    for fn in IMPLS.values():
        fn(lp, rlp, mask, cfg)  # warm-up
    for _ in range(args.repeats):  # interleaved, so load from other processes hits both alike
        for name, fn in IMPLS.items():
            t0 = time.perf_counter()
            check[name] = fn(lp, rlp, mask, cfg)
            times[name].append(time.perf_counter() - t0)
    for name, fn in IMPLS.items():
        med = statistics.median(times[name])
        syncs = count_syncs(fn, lp, rlp, mask, cfg)
        env = dict(os.environ, ROLLOUT_CORR_FORCE_REFERENCE=os.environ.get("ROLLOUT_CORR_FORCE_REFERENCE", "0"))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--b", str(args.b), "--t", str(args.t),
                              "--_memory", name], capture_output=True, text=True, env=env, check=True)
        peak = float(out.stdout.strip().splitlines()[-1])
        rows.append((name, med, syncs, peak, fused_bytes / med / 1e9, len(check[name])))

    base = rows[1][1]
    print(f"rollout correction, B x T = {args.b} x {args.t} ({n / 1e6:.2f} M tokens), token TIS + token_k1 + "
          f"seq_mean_k3, all metrics; backend={rc.backend()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print()
    print("| implementation | median time (ms) | speed-up | host syncs | peak extra memory (MiB) | effective GB/s "
          "| metrics |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, med, syncs, peak, gbs, nmet in rows:
        print(f"| {name} | {med * 1e3:.1f} | {base / med:.1f}x | {syncs} | {peak:.0f} | {gbs:.2f} | {nmet} |")
    shared = set(check[rows[0][0]]) & set(check[rows[1][0]])
    worst = max(abs(check[rows[0][0]][k] - check[rows[1][0]][k]) / max(abs(check[rows[1][0]][k]), 1e-6)
                for k in shared)
    print()
    print(f"max relative difference over the {len(shared)} shared metrics: {worst:.1e}")


# ------------------------------------------------------------------------------------------- --dist


def _median_ms(fn, repeats: int) -> float:
    import torch.distributed as dist

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _dist_worker(rank: int, world: int, store: str, b: int, t: int, repeats: int, out_path: str) -> None:
    import torch.distributed as dist

    from rollout_corr_ext import correction as C
    from rollout_corr_testing.dist_utils import CollectiveCounter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if rc.backend() == "reference" and os.environ.get("ROLLOUT_CORR_FORCE_REFERENCE", "0") != "1":
        rc.load_extension()
    lp, rlp, mask = make_inputs(b, t)
    cfg = rc.RolloutCorrectionConfig(**CFG)
    group = dist.group.WORLD
    params = C.pack_params(cfg)
    st = rc.ops.rollout_seq_stats(lp, rlp, mask, params)
    _, _, sums, maxes = rc.ops.rollout_token_pass(lp, rlp, mask, st, params, True)

    def bare_reduce():  # the layout before the check: this config's sizes, no fingerprint
        dist.all_reduce(sums.clone(), op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes.clone(), op=dist.ReduceOp.MAX, group=group)

    fingerprint = C.config_fingerprint(cfg)
    rows = []
    for name, fn in [
        ("DP op (dp_group)", lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg, dp_group=group)),
        ("  its partials reduce: fixed wire size + fingerprint check",
         lambda: C._raise_config_mismatch(C._reduce_partials(sums, maxes, fingerprint, group)[2], fingerprint)),
        ("  baseline: bare SUM + MAX of the unpadded partials", bare_reduce),
        ("CP op (seq_group)", lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg, seq_group=group)),
        ("  its row-count check alone (16-byte MAX all-reduce)", lambda: C._check_seq_rows(lp, group)),
        ("single-process op (no collectives)", lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg)),
    ]:
        ms = _median_ms(fn, repeats)
        with CollectiveCounter() as cc:
            fn()
        rows.append((name, ms, len(cc.calls)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(rows=rows, wire=[C._WIRE_SUM, C._WIRE_MAX], own=[sums.numel(), maxes.numel()]), f)
    dist.destroy_process_group()


def dist_main(args) -> None:
    import tempfile

    import torch.multiprocessing as mp

    b, t, repeats = args.b or 64, args.t or 2048, args.repeats or 20
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_dist_worker, args=(2, os.path.join(tmp, "store"), b, t, repeats, out), nprocs=2, join=True)
        with open(out) as f:
            res = json.load(f)
    n = b * t
    print(f"rollout correction across 2 gloo ranks (1 thread each), {b} x {t} per rank ({n / 1e6:.2f} M tokens), "
          f"token TIS + token_k1 + seq_mean_k3; backend={rc.backend()}, torch {torch.__version__}")
    print(f"partials per rank: this config {res['own'][0]} + {res['own'][1]} fp64 values; on the wire (any config) "
          f"{res['wire'][0]} + {res['wire'][1]} ({(sum(res['wire']) - sum(res['own'])) * 8} bytes more)")
    print()
    wire_kib = sum(res["wire"]) * 8 / 1024
    own_kib = sum(res["own"]) * 8 / 1024
    extra = {"  its partials reduce": f"{wire_kib:.1f} KiB wire buffers (counted, not sampled)",
             "  baseline": f"{own_kib:.1f} KiB copies (counted)", "  its row-count": "16 B (counted)"}
    print("| what | median time (ms) | collectives | effective GB/s | extra memory |")
    print("|---|---:|---:|---:|---:|")
    fused_bytes = 2 * n * (4 + 4 + 1) + n * (4 + 1)
    for name, ms, calls in res["rows"]:
        gbs = f"{fused_bytes / (ms * 1e-3) / 1e9:.2f}" if "op" in name.split("(")[0] else "-"
        mem = next((v for k, v in extra.items() if name.startswith(k)), "see the single-process table")
        print(f"| {name} | {ms:.3f} | {calls} | {gbs} | {mem} |")


if __name__ == "__main__":
    if "--dist" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--dist", action="store_true")
        ap.add_argument("--b", type=int, default=None)
        ap.add_argument("--t", type=int, default=None)
        ap.add_argument("--repeats", type=int, default=None)
        dist_main(ap.parse_args())
    else:
        main()
