"""Rollout correction: our two-pass op vs verl 0.9.1's real implementation, with bandwidth baselines.

Problem (default): B x T = 256 x 8192 (2.1 M tokens), fp32 log-probs, bool mask (random lengths in [T/4, T]),
token-level TIS (C = 2) + ``rollout_rs="token_k1,seq_max_k3"`` with thresholds ``"0.5_2.0,0.05"``, every metric
read back as Python floats. The log-ratio noise varies per row (sigma in [0.01, 0.09]) with rare large spikes, so
some tokens are clipped / rejected and about a quarter of the sequences are rejected (the run prints the fractions).

Rows, all measured in the same run, on the same inputs, interleaved repeat by repeat:

* ours: ``rollout_corr_ext.compute_rollout_correction(lp, rlp, mask, cfg).as_floats()``;
* verl 0.9.1: ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` (the real
  function, imported from the installed package) on ``mask.float()`` (converted once, outside the timing), then
  every metric read as a Python float, as a trainer does to log them. If verl cannot be imported the row is
  skipped and the output says so;
* plain read: the input bytes read once (``lp.sum(); rlp.sum()`` and the mask summed through an int64 view of its
  bytes, since ``bool.sum()`` is compute-bound): the bandwidth ceiling;
* plain read + write: ``lp`` and the mask copied into preallocated buffers.

Before every timed call a 96 MiB buffer is read, so each call starts with its inputs out of the CPU caches (the
inputs, 18 MiB, would otherwise fit in a large L3 and the plain read would measure cache bandwidth);
``--warm-cache`` skips that.

Columns: median wall time of ``--repeats`` runs (after one warm-up); speed-up vs verl; host syncs
(``aten::_local_scalar_dense`` dispatches, i.e. ``.item()`` / ``float()`` / ``bool()`` of a tensor, plus
``Tensor.tolist()`` calls, which do not dispatch it; in parentheses, ops whose output shape depends on the data --
boolean indexing, ``nonzero``, ``masked_select`` -- which also synchronise on a GPU); peak extra resident memory of
one call (measured in a fresh subprocess, inputs already allocated); effective GB/s over the bytes a fused
implementation must move (inputs read twice: 2 x (4 + 4 + 1) B/token, weights written 4 B/token, mask written
1 B/token; the baseline rows count the bytes they move themselves: 9 and 10 B/token); that bandwidth as a
fraction of the plain read's; number of metrics. The peak memory counts every page the call touches that was not
resident before it (buffers it allocates, and the baselines' preallocated outputs, first touched by the call).
Run::

    python benchmarks/bench_rollout_corr.py [--b 256 --t 8192 --repeats 5 --threads N --warm-cache]

On a machine shared with other jobs every multi-threaded op can wait a scheduler time slice for its worker
thread, which inflates implementations made of many small ops (verl: ~500) far more than ours (3 op calls): the
run prints how much CPU other processes used while it was timing; ``--threads 1`` is less sensitive to that.

``--device cuda`` runs every row on the GPU (inputs made on the CPU and copied once): each timed call is followed by
``torch.cuda.synchronize()``, the caches are flushed by reading a 256 MiB buffer (several times the 50 MiB L2 of an
H100), peak extra memory is the CUDA allocator's peak above what was allocated before the call, and
``--peak-gbps`` (the GPU's HBM bandwidth) adds a "% of HBM peak" column::

    python benchmarks/bench_rollout_corr.py --device cuda --peak-gbps 3350 [--b 256 --t 8192 --repeats 20]

``--packed`` compares the two layouts of the same sequences (issue: packed sequences), in one run: B sequences
(``--b``, default 64) with lengths uniform in [``--min-len`` 64, ``--t`` 8192], as a padded ``[B, T]`` batch + mask
and as megatron's packed token stream + ``cu_seqlens``; rows: ours padded, ours packed, and what a packed trainer
paid before packed input existed (unpack the stream into a zero-padded ``[B, T]`` batch, then ours padded). Columns:
tokens stored (real + padding), input MiB, median time, peak extra memory, effective GB/s over the real tokens, and
whether the per-token weights / masks and every metric equal the padded row's::

    python benchmarks/bench_rollout_corr.py --packed [--b 64 --t 8192 --min-len 64 --repeats 5]

``--dist`` instead measures what the cross-rank checks cost on 2 gloo ranks (one thread each), per call of
``compute_rollout_correction`` on a ``--b`` x ``--t`` shard per rank: DP (``dp_group``: the partials travel at the
fixed wire size with the config fingerprint, no extra collective) and CP (``seq_group``: one extra 16-byte
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
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
warnings.filterwarnings("ignore")

import rollout_corr_ext as rc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import add_progress_flag, progress_bar  # noqa: E402

RS = "token_k1,seq_max_k3"
RS_THRESHOLD = "0.5_2.0,0.05"
CFG = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=RS, rollout_rs_threshold=RS_THRESHOLD)
CFG_TEXT = f"token TIS (C=2) + rollout_rs={RS!r} (thresholds {RS_THRESHOLD!r})"

OURS = "ours: compute_rollout_correction(...).as_floats()"
VERL = "verl 0.9.1: compute_rollout_correction_and_rejection_mask + float(metric) each"
DIAG = ("ours + diagnostics=MismatchDiagnostics(entropy, turn_ids, versions): compute_rollout_correction(...)"
        ".as_floats()")
READ = "plain read of the inputs (lp, rlp, mask)"
COPY = "plain read + write (copy lp and mask)"
#: bytes per token each row moves: the fused minimum for the two implementations, their own for the baselines
BYTES_PER_TOKEN = {OURS: 2 * (4 + 4 + 1) + 4 + 1, VERL: 2 * (4 + 4 + 1) + 4 + 1, READ: 4 + 4 + 1, COPY: 2 * (4 + 1),
                   DIAG: 2 * (4 + 4 + 1) + 4 + 1 + 4 + 8 + 8}  # + the diagnostics' own inputs, read once


def make_inputs(b: int, t: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    rlp = -torch.rand(b, t, generator=g) * 4.0
    sigma = 0.01 + 0.08 * torch.rand(b, 1, generator=g)  # per-row mismatch level
    noise = torch.randn(b, t, generator=g) * sigma
    spikes = torch.rand(b, t, generator=g) < 5e-5  # rare large disagreements (TIS clips, token_k1 rejects)
    noise = torch.where(spikes, noise + torch.randn(b, t, generator=g), noise)
    lp = rlp + noise
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return lp.to(device), rlp.to(device), mask.to(device)


def _import_verl():
    """verl's real helper, or (None, why)."""
    try:
        import verl
        import verl.trainer.ppo.rollout_corr_helper as H
    except Exception as exc:  # noqa: BLE001 - any failure to import means: no verl row, said loudly
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return H, getattr(verl, "__version__", "?")


# Each setup gets (lp, rlp, mask, cfg) and returns the zero-argument call to time; what it prepares (verl's float
# mask, the copy buffers) is neither timed nor counted in the peak memory.


def setup_ours(lp, rlp, mask, cfg):
    return lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg).as_floats()


def setup_verl(lp, rlp, mask, cfg):
    H, _ = _import_verl()
    mask_f = mask.float()

    def run():
        _, _, metrics = H.compute_rollout_correction_and_rejection_mask(
            lp, rlp, mask_f, rollout_is="token", rollout_is_threshold=2.0, rollout_rs=RS,
            rollout_rs_threshold=RS_THRESHOLD)
        return {k: float(v) for k, v in metrics.items()}  # what a trainer's logger does

    return run


def _bytes_view(mask):
    flat = mask.reshape(-1)
    return flat.view(torch.int64) if flat.numel() % 8 == 0 else flat.view(torch.uint8)


def setup_read(lp, rlp, mask, cfg):
    mview = _bytes_view(mask)
    return lambda: (lp.sum(), rlp.sum(), mview.sum())


def setup_copy(lp, rlp, mask, cfg):
    buf, mbuf = torch.empty_like(lp), torch.empty_like(mask)
    return lambda: (buf.copy_(lp), mbuf.copy_(mask))


def setup_diag(lp, rlp, mask, cfg):
    """The correction with the mismatch diagnostics (every breakdown, 8 worst rows): entropy, turn ids and per-token
    versions of the inputs' shape."""
    g = torch.Generator().manual_seed(2)
    b, t = lp.shape
    entropy = (torch.rand(b, t, generator=g) * 4).to(lp.device)
    turns = (torch.arange(t) // max(1, t // 4)).expand(b, t).contiguous().to(lp.device)
    versions = (100 - torch.randint(0, 4, (b, 1), generator=g)).expand(b, t).contiguous().to(lp.device)
    spec = rc.MismatchDiagnostics(entropy=entropy, turn_ids=turns, versions=versions, current_version=100)
    return lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=spec).as_floats()


SETUPS = {OURS: setup_ours, VERL: setup_verl, READ: setup_read, COPY: setup_copy, DIAG: setup_diag}


# ------------------------------------------------------------------------------------------- host syncs

_SHAPE_OPS = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default}
_INDEX_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}


class CountSyncs(TorchDispatchMode):
    """``_local_scalar_dense`` dispatches (host reads) and data-dependent-shape ops (device syncs on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.shape_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        elif func in _SHAPE_OPS:
            self.shape_ops += 1
        elif func in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                        for i in (args[1] if len(args) > 1 else ()) or ()):
            self.shape_ops += 1
        return func(*args, **(kwargs or {}))


def count_syncs(fn):
    """(host reads, data-dependent-shape ops) of one call. ``Tensor.tolist()`` reads the data directly without
    dispatching ``_local_scalar_dense``, so it is counted by wrapping it."""
    reads = [0]
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        reads[0] += 1
        return real_tolist(self)

    torch.Tensor.tolist = tolist
    try:
        with CountSyncs() as c:
            fn()
    finally:
        torch.Tensor.tolist = real_tolist
    return c.count + reads[0], c.shape_ops


class OtherLoad:
    """The share of all CPUs used by other processes since construction: busy time in /proc/stat less this
    process's own CPU time (so a noisy timing can be told from a quiet one)."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return float("nan")
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def share(self) -> float:
        wall = time.perf_counter() - self.t0
        other = (self._busy() - self.busy0) - (self._own() - self.own0)
        return max(other, 0.0) / (wall * (os.cpu_count() or 1))


# ------------------------------------------------------------------------------------------- memory


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cuda_peak_memory(fn) -> float:
    """Peak extra CUDA memory (MiB) of one call: the allocator's peak above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure_peak_memory(name: str, b: int, t: int) -> float:
    """Peak extra RSS (MiB) of one call, measured in this (fresh) process after the inputs exist."""
    cfg = rc.RolloutCorrectionConfig(**CFG)
    SETUPS[name](*make_inputs(4, 64), cfg)()  # lazy imports and one-off allocations, on a tiny batch
    fn = SETUPS[name](*make_inputs(b, t), cfg)
    base = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    fn()
    return (_rss_kib("VmHWM") - base) / 1024.0


def peak_memory_subprocess(name: str, b: int, t: int, extra_args=()):
    """``measure_peak_memory`` (or, with ``extra_args=("--packed", "--min-len", ...)``, its packed twin) of ``name`` in
    a fresh subprocess of this script; None (and a note) when it fails."""
    # The allocator as the user has it (no malloc variables): what the call adds to the resident memory of a
    # process that has just built its inputs.
    env = dict(os.environ, ROLLOUT_CORR_FORCE_FALLBACK=os.environ.get("ROLLOUT_CORR_FORCE_FALLBACK", "0"))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *extra_args, "--b", str(b), "--t", str(t),
                          "--threads", str(torch.get_num_threads()), "--_memory", name],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"(peak memory of {name!r} could not be measured: {out.stderr.strip().splitlines()[-1:]})")
        return None
    return float(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- main


def _fmt(x: float) -> str:
    """Three or four significant digits, never in exponent form."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--b", type=int, default=256, help="sequences B")
    ap.add_argument("--t", type=int, default=8192, help="response length T")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats (median) after a warm-up")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--warm-cache", action="store_true", help="do not evict the inputs from the caches between calls")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the inputs and every row run")
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="the device's peak memory bandwidth (GB/s), for a %% of peak column (e.g. 3350 on an H100 SXM)")
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--packed", action="store_true",
                    help="instead: the packed and padded layouts of the same sequences (own options: --b (default 64), "
                         "--t, --min-len 64, --repeats, --threads, --warm-cache, --device)")
    ap.add_argument("--dist", action="store_true",
                    help="instead: the cost of the cross-rank checks on 2 gloo ranks (own options: --b (default 64), "
                         "--t (default 2048), --repeats (default 20))")
    add_progress_flag(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._memory:
        print(json.dumps(measure_peak_memory(args._memory, args.b, args.t)))
        return

    H, verl_info = _import_verl()
    names = [OURS, DIAG, VERL, READ, COPY] if H is not None else [OURS, DIAG, READ, COPY]
    if H is None:
        banner = "!" * 100
        print(f"{banner}\n!!! verl could not be imported ({verl_info}):\n!!! the verl row is SKIPPED and there is "
              f"no speed-up column. Install verl==0.9.1 to compare.\n{banner}\n", flush=True)

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if device == "cuda" and rc.backend() != "cuda":
        print(f"!!! --device cuda but the extension's backend is {rc.backend()!r}: ours runs the pure-PyTorch fallback "
              f"(build with FORCE_CUDA=1, or run scripts/gpu_check.sh)", flush=True)
    lp, rlp, mask = make_inputs(args.b, args.t, device)
    cfg = rc.RolloutCorrectionConfig(**CFG)
    n = lp.numel()
    fns = {name: SETUPS[name](lp, rlp, mask, cfg) for name in names}
    if args.warm_cache:
        flush = None
    elif device == "cuda":
        flush = torch.ones(64 * 1024 * 1024, device="cuda")  # 256 MiB, several times an H100's 50 MiB L2
    else:
        flush = torch.ones(24 * 1024 * 1024)  # 96 MiB, several times any L3

    # one step per timed repeat (the warm-up counted as one) and per row's syncs + peak memory
    bar = progress_bar(args.repeats + 1 + len(names), "rollout correction", args.no_progress, unit="step")
    probe = OtherLoad()
    bar.set_postfix_str("warm-up")
    results = {name: fn() for name, fn in fns.items()}  # warm-up (and the values compared below)
    _sync(device)
    bar.update()
    bar.set_postfix_str("timed repeats")
    times = {name: [] for name in names}
    for _ in range(args.repeats):  # interleaved, so load from other processes hits every row alike
        for name, fn in fns.items():
            if flush is not None:
                flush.sum()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
        bar.update()

    others = probe.share()
    rows = {}
    for name in names:
        bar.set_postfix_str(f"syncs and peak memory: {name.split(':')[0]}")
        med = statistics.median(times[name])
        syncs, shape_ops = count_syncs(fns[name])
        peak = cuda_peak_memory(fns[name]) if device == "cuda" else peak_memory_subprocess(name, args.b, args.t)
        gbs = BYTES_PER_TOKEN[name] * n / med / 1e9
        nmet = len(results[name]) if name in (OURS, VERL, DIAG) else None
        rows[name] = (med, syncs, shape_ops, peak, gbs, nmet)
        bar.update()
    bar.close()

    read_gbs = rows[READ][4]
    verl_med = rows[VERL][0] if VERL in rows else None
    ours = results[OURS]
    cache = "warm caches" if args.warm_cache else "inputs evicted from the caches before each call"
    where = (f"device cuda ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda})" if device == "cuda"
             else f"device cpu, {torch.get_num_threads()} threads")
    print(f"rollout correction, B x T = {args.b} x {args.t} ({n / 1e6:.2f} M tokens), fp32 log-probs, bool mask, "
          f"{CFG_TEXT}, all metrics read as floats")
    print(f"{where}, backend={rc.backend()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, verl {verl_info if H is not None else 'NOT AVAILABLE'}; median of {args.repeats} "
          f"after a warm-up, {cache};\n"
          f"other processes used {others:.0%} of the {os.cpu_count()} CPUs while this run was timing (1-min load "
          f"average now {os.getloadavg()[0]:.1f}, this run included)")
    print(f"workload: {ours['rollout_corr/rollout_is_ratio_fraction_high']:.1e} of tokens clipped by TIS, "
          f"{ours['rollout_corr/rollout_rs_token_k1_masked_fraction']:.1e} rejected by token_k1, "
          f"{ours['rollout_corr/seq_masked_fraction']:.1%} of sequences ("
          f"{ours['rollout_corr/masked_fraction']:.1%} of tokens) rejected in all")
    print()
    peak_col = args.peak_gbps is not None
    print("| implementation | median time (ms) | speed-up vs verl | host syncs | peak extra memory (MiB) "
          "| effective GB/s | of plain-read GB/s |" + (" % of HBM peak |" if peak_col else "") + " metrics |")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if peak_col else "") + "---:|")
    for name in names:
        med, syncs, shape_ops, peak, gbs, nmet = rows[name]
        speed = _fmt(verl_med / med) + "x" if verl_med else "n/a (no verl)"
        sync = f"{syncs}" + (f" (+{shape_ops})" if shape_ops else "")
        mem = f"{peak:.0f}" if peak is not None else "?"
        label = name if name in (OURS, VERL, DIAG) else f"{name}, {BYTES_PER_TOKEN[name]} B/token"
        pct = f" {gbs / args.peak_gbps:.1%} |" if peak_col else ""
        print(f"| {label} | {_fmt(med * 1e3)} | {speed} | {sync} | {mem} | {gbs:.2f} | {gbs / read_gbs:.1%} |{pct} "
              f"{nmet if nmet is not None else '-'} |")
    print()
    print("spread of the timed runs (min - max, ms): " + "; ".join(
        f"{name.split(':')[0].split(' (')[0]} {_fmt(min(times[name]) * 1e3)} - {_fmt(max(times[name]) * 1e3)}"
        for name in names))
    print(f"effective GB/s of ours and verl: {BYTES_PER_TOKEN[OURS]} B/token (inputs read twice, weights + mask "
          f"written once); host syncs in parentheses: data-dependent-shape ops (boolean indexing, nonzero), which "
          f"also sync on a GPU")
    if H is None:
        print("\n!!! verl row SKIPPED (could not import verl): no metric comparison either.")
        return
    theirs = results[VERL]
    shared = sorted(set(ours) & set(theirs))
    rel = {k: abs(ours[k] - theirs[k]) / max(abs(theirs[k]), 1e-6) for k in shared}
    worst = max(rel, key=rel.get)
    print(f"metrics: ours {len(ours)}, verl {len(theirs)}, shared {len(shared)}; only ours: "
          f"{', '.join(k.split('/', 1)[1] for k in sorted(set(ours) - set(theirs))) or '-'}; only verl: "
          f"{', '.join(k.split('/', 1)[1] for k in sorted(set(theirs) - set(ours))) or '-'}")
    print(f"max relative difference over the {len(shared)} shared metrics (|a - b| / max(|verl|, 1e-6)): "
          f"{rel[worst]:.1e} at {worst} (ours {ours[worst]!r}, verl {theirs[worst]!r}); "
          f"{sum(v > 1e-4 for v in rel.values())} above 1e-4")


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


def _dist_worker(rank: int, world: int, store: str, b: int, t: int, repeats: int, out_path: str,
                 no_progress: bool = False) -> None:
    import torch.distributed as dist

    from rollout_corr_ext import correction as C
    from rollout_corr_testing.dist_utils import CollectiveCounter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if rc.backend() == "fallback" and os.environ.get("ROLLOUT_CORR_FORCE_FALLBACK", "0") != "1":
        rc.load_extension()
    lp, rlp, mask = make_inputs(b, t)
    cfg = rc.RolloutCorrectionConfig(**CFG)
    group = dist.group.WORLD
    args = C.op_args(cfg, exclude_nonfinite=False)
    st = rc.ops.rollout_seq_stats(lp, rlp, mask, args)
    _, _, sums, maxes = rc.ops.rollout_token_pass(lp, rlp, mask, st, args, True)

    def bare_reduce():  # the layout before the check: this config's sizes, no fingerprint
        dist.all_reduce(sums.clone(), op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes.clone(), op=dist.ReduceOp.MAX, group=group)

    fingerprint = C.config_fingerprint(cfg)

    def checked_reduce():  # what the op does after pass 2: padded reduce, then the agreement + batch checks
        s, _, agree = C._reduce_partials(sums, maxes, fingerprint, group)[:3]
        rc.ops.rollout_check(s, agree, lp, rlp, mask, False)

    rows = []
    cases = [
        ("DP op (dp_group)", lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg, dp_group=group)),
        ("  its partials reduce: fixed wire size + fingerprint and batch checks", checked_reduce),
        ("  baseline: bare SUM + MAX of the unpadded partials", bare_reduce),
        ("CP op (seq_group)", lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg, seq_group=group)),
        ("  its row-count check alone (16-byte MAX all-reduce)",
         lambda: C._check_seq_rows(lp.shape[0], lp.device, group)),
        ("single-process op (no collectives)", lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg)),
    ]
    bar = progress_bar(len(cases), "--dist", no_progress or rank != 0, unit="row")
    for name, fn in cases:
        bar.set_postfix_str(name.strip())
        ms = _median_ms(fn, repeats)
        with CollectiveCounter() as cc:
            fn()
        rows.append((name, ms, len(cc.calls)))
        bar.update()
    bar.close()
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
        mp.spawn(_dist_worker, args=(2, os.path.join(tmp, "store"), b, t, repeats, out, args.no_progress), nprocs=2,
                 join=True)
        with open(out) as f:
            res = json.load(f)
    n = b * t
    print(f"rollout correction across 2 gloo ranks (1 thread each), {b} x {t} per rank ({n / 1e6:.2f} M tokens), "
          f"{CFG_TEXT}; backend={rc.backend()}, torch {torch.__version__}, median of {repeats}")
    print(f"partials per rank: this config {res['own'][0]} + {res['own'][1]} fp64 values; on the wire (any config) "
          f"{res['wire'][0]} + {res['wire'][1]} ({(sum(res['wire']) - sum(res['own'])) * 8} bytes more)")
    print()
    wire_kib = sum(res["wire"]) * 8 / 1024
    own_kib = sum(res["own"]) * 8 / 1024
    extra = {"  its partials reduce": f"{wire_kib:.1f} KiB wire buffers (counted, not sampled)",
             "  baseline": f"{own_kib:.1f} KiB copies (counted)", "  its row-count": "16 B (counted)"}
    print("| what | median time (ms) | collectives | effective GB/s | extra memory |")
    print("|---|---:|---:|---:|---:|")
    fused_bytes = n * BYTES_PER_TOKEN[OURS]
    for name, ms, calls in res["rows"]:
        gbs = f"{fused_bytes / (ms * 1e-3) / 1e9:.2f}" if "op" in name.split("(")[0] else "-"
        mem = next((v for k, v in extra.items() if name.startswith(k)), "see the single-process table")
        print(f"| {name} | {ms:.3f} | {calls} | {gbs} | {mem} |")


# ------------------------------------------------------------------------------------------- --packed


def make_packed_inputs(b: int, t: int, min_len: int, device: str = "cpu"):
    """The same B sequences (lengths uniform in [min_len, t]) padded and packed:
    ((lp, rlp, mask) [B, t], (lp, rlp, mask of ones) [sum of lengths], cu_seqlens int32 [B + 1]). The packed
    stream's mask is all ones here (every token a response token); in a trainer it also masks prompt / tool tokens."""
    lp, rlp, _ = make_inputs(b, t)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(min_len, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    lp, rlp = lp.masked_fill(~mask, 0.0), rlp.masked_fill(~mask, 0.0)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    packed = (lp[mask].contiguous(), rlp[mask].contiguous(), torch.ones(int(lengths.sum()), dtype=torch.bool))
    to = lambda x: x.to(device)  # noqa: E731
    return tuple(map(to, (lp, rlp, mask))), tuple(map(to, packed)), to(cu)


def _unpack(x: torch.Tensor, cu: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """The packed stream scattered into a zero-padded [B, t] batch (what a trainer did without packed input)."""
    lengths = cu[1:] - cu[:-1]
    mask = torch.arange(t, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)
    out = x.new_zeros(b, t)
    out[mask] = x
    return out, mask


PADDED, PACKED, UNPACK = ("ours, padded [B, T] + mask", "ours, packed [sum L] + cu_seqlens",
                          "packed stream unpacked to [B, T], then ours padded")


def packed_setups(b, t, min_len, device="cpu"):
    """name -> zero-argument call (returning the result object), on inputs made here."""
    (lp, rlp, mask), (plp, prlp, pmask), cu = make_packed_inputs(b, t, min_len, device)
    cfg = rc.RolloutCorrectionConfig(**CFG)

    def unpack_then_padded():
        ulp, umask = _unpack(plp, cu, b, t)
        urlp, _ = _unpack(prlp, cu, b, t)
        return rc.compute_rollout_correction(ulp, urlp, umask, cfg)

    fns = {PADDED: lambda: rc.compute_rollout_correction(lp, rlp, mask, cfg),
           PACKED: lambda: rc.compute_rollout_correction(plp, prlp, pmask, cfg, cu_seqlens=cu),
           UNPACK: unpack_then_padded}
    inputs = {PADDED: (lp, rlp, mask), PACKED: (plp, prlp, pmask, cu), UNPACK: (plp, prlp, cu)}
    return fns, inputs, mask


def measure_packed_peak_memory(name: str, b: int, t: int, min_len: int) -> float:
    packed_setups(4, 128, 16)[0][name]().as_floats()  # lazy imports and one-off allocations, on a tiny batch
    fn = packed_setups(b, t, min_len)[0][name]
    base = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn().as_floats()
    return (_rss_kib("VmHWM") - base) / 1024.0


def packed_main(args) -> None:
    b, t, min_len, device = args.b or 64, args.t, args.min_len, args.device
    fns, inputs, mask = packed_setups(b, t, min_len, device)
    real = int(mask.sum())
    flush = None if args.warm_cache else (torch.ones(64 * 1024 * 1024, device="cuda") if device == "cuda"
                                          else torch.ones(24 * 1024 * 1024))
    bar = progress_bar(args.repeats + 1 + len(fns), "packed vs padded", args.no_progress, unit="step")
    bar.set_postfix_str("warm-up")
    results = {name: fn() for name, fn in fns.items()}
    _sync(device)
    bar.update()
    bar.set_postfix_str("timed repeats")
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            if flush is not None:
                flush.sum()
            _sync(device)
            t0 = time.perf_counter()
            fn().as_floats()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
        bar.update()
    peaks = {}
    for name in fns:  # peak memory before any row prints (a fresh subprocess each on CPU)
        bar.set_postfix_str(f"peak memory: {name}")
        if device == "cuda":
            peaks[name] = cuda_peak_memory(lambda: fns[name]().as_floats())
        else:
            peaks[name] = peak_memory_subprocess(name, b, t, ("--packed", "--min-len", str(min_len)))
        bar.update()
    bar.close()
    ref = results[PADDED]
    ref_w, ref_m = ref.weights[mask], ref.response_mask[mask]
    ref_metrics = ref.as_floats()
    print(f"packed vs padded rollout correction: B = {b} sequences, lengths uniform in [{min_len}, {t}] "
          f"({real / 1e6:.3f} M real tokens, {b * t / 1e6:.3f} M padded slots: {1 - real / (b * t):.0%} padding), "
          f"fp32 log-probs, {CFG_TEXT}, metrics read as floats")
    print(f"device {device}, backend={rc.backend()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {args.repeats} after a warm-up; {'warm caches' if flush is None else 'caches flushed'}")
    print()
    print("| layout | tokens stored | input MiB | median time (ms) | peak extra memory (MiB) | GB/s (real tokens) "
          "| same weights, mask, metrics as padded |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in fns:
        res = results[name]
        med = statistics.median(times[name])
        stored = sum(x.numel() for x in inputs[name][:2]) // 2
        in_mib = sum(x.numel() * x.element_size() for x in inputs[name]) / 2**20
        peak = peaks[name]
        w = res.weights if name == PACKED else res.weights[mask]
        m = res.response_mask if name == PACKED else res.response_mask[mask]
        same = (torch.equal(w, ref_w) and torch.equal(m, ref_m) and res.as_floats() == ref_metrics)
        gbs = BYTES_PER_TOKEN[OURS] * real / med / 1e9
        print(f"| {name} | {stored / 1e6:.3f} M | {in_mib:.1f} | {_fmt(med * 1e3)} | "
              f"{'?' if peak is None else f'{peak:.0f}'} | {gbs:.2f} | {'yes' if same else 'NO'} |")
    print()
    print(f"GB/s: {BYTES_PER_TOKEN[OURS]} B per real token (inputs read twice, weights + mask written once); input MiB: "
          f"log-probs + mask (padded), + cu_seqlens (packed; the unpack row takes no mask); peak extra memory: resident pages the call "
          f"touches beyond its inputs (CPU: a fresh subprocess; CUDA: the allocator's peak)")


if __name__ == "__main__":
    if "--dist" in sys.argv:
        ap = argparse.ArgumentParser(description="rollout correction: the cross-rank checks' cost on 2 gloo ranks")
        ap.add_argument("--dist", action="store_true")
        ap.add_argument("--b", type=int, default=None, help="rows per rank (default 64)")
        ap.add_argument("--t", type=int, default=None, help="response length (default 2048)")
        ap.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 20)")
        add_progress_flag(ap)
        dist_main(ap.parse_args())
    elif "--packed" in sys.argv:
        ap = argparse.ArgumentParser(description="rollout correction: packed vs padded layouts of the same sequences")
        ap.add_argument("--packed", action="store_true")
        ap.add_argument("--b", type=int, default=None, help="sequences (default 64)")
        ap.add_argument("--t", type=int, default=8192, help="padded length (default 8192)")
        ap.add_argument("--min-len", type=int, default=64, help="shortest sequence (default 64)")
        ap.add_argument("--repeats", type=int, default=5, help="timed calls per row (default 5)")
        ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
        ap.add_argument("--warm-cache", action="store_true", help="do not evict the inputs between calls")
        ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
        add_progress_flag(ap)
        ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
        pargs = ap.parse_args()
        if pargs.threads:
            torch.set_num_threads(pargs.threads)
        if pargs._memory:
            print(json.dumps(measure_packed_peak_memory(pargs._memory, pargs.b or 64, pargs.t, pargs.min_len)))
        else:
            packed_main(pargs)
    else:
        main()
