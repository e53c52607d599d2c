"""Every policy loss: forward + backward of ours vs verl 0.9.1's own function, in one run (docs/policy_losses.md).

Problem (default): B x T = 256 x 8192 (2.1 M tokens), fp32 log-probs, a float mask (random lengths in [T/4, T]),
sequence-level advantages, rollout IS weights, ``loss_agg_mode="token-mean"``; verl's ``ActorConfig`` with
``clip_ratio=0.2``, ``clip_ratio_high=0.28``, ``dro_beta=0.5`` and verl's defaults otherwise. Each timed call is
``loss, metrics = fn(...)``, ``loss.backward()``, then every metric read back as a Python float (verl returns floats;
ours through the same verl-signature adapter, ``rollout_corr_ext.verl.POLICY_LOSSES``).

Rows: one per loss of verl's registry except ``bypass_mode`` (which needs a rollout-correction config and is the
vanilla / reinforce kernel plus the rollout-correction op, measured in bench_rollout_corr.py). Columns: median wall
time of ``--repeats`` runs after one warm-up, ours and verl's interleaved repeat by repeat on the same inputs;
speed-up. Before each of those calls a 256 MiB buffer is zeroed, untimed, as ``triton.testing.do_bench`` does:
every call starts from the same cold cache full of dirty lines, instead of from what the other function left behind
(both read the same inputs, so each could find them cached by the other). ``--flush-probe 64 128 192 256`` times
our gpg forward alone after zeroing each size and after a call of verl's gpg; on this VM, whose cache is not the
32 MiB it reports, a scratch timing once found 64 and 128 MiB leaving the inputs cached, so the default is 256 MiB
(docs/benchmarks.md). Then the same in each function's own steady state ("alone": ``--repeats`` calls of one function back to
back after its warm-up, no flush: the best case for both, inputs partly cached, no page faults for temporaries the allocator kept); the median
of the minor page faults of one interleaved call (``getrusage``: what the process pays for fresh memory from the
kernel, most of the run-to-run swing of a time); host reads of one call, metrics included (``.item()`` / ``float()`` of a tensor and ``tolist()``; ours:
the adapter's one ``tolist`` of all metrics at the end; verl: one ``.item()`` per metric, and clip_cov / kl_cov read
sizes mid-call), with, in parentheses, ops whose output shape depends on the data (each a sync on a GPU). Run::

    python benchmarks/bench_policy_losses.py [--b 256 --t 8192 --repeats 3 --losses gspo cispo ...]
    python benchmarks/bench_policy_losses.py --flush-probe 64 128 192 256 [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rollout_corr_ext import losses  # noqa: E402
from rollout_corr_ext import verl as rv  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import add_progress_flag, progress_bar  # noqa: E402

NAMES = [n for n in losses.POLICY_LOSS_MODES if n != "bypass_mode"]


def _inputs(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.01
    lp = (old + 0.1 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    lengths = torch.randint(max(1, t // 4), t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    w = (torch.rand(b, t, generator=g) * 1.5 + 0.25)
    return old, lp, adv, mask, w


def _call(fn, old, lp, adv, mask, cfg, w):
    x = lp.detach().requires_grad_(True)
    loss, metrics = fn(old, x, adv, mask, "token-mean", cfg, w)
    loss.backward()
    return {k: float(v) for k, v in metrics.items()}


#: Zeroed before each interleaved call (``--flush-mib``; 0: no flush).
_FLUSH = {"buf": None}


def _timed(fn, *args, flush=False):
    """(wall seconds, minor page faults) of one :func:`_call`, after the cache flush when ``flush``."""
    if flush and _FLUSH["buf"] is not None:
        _FLUSH["buf"].zero_()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    _call(fn, *args)
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"  # small problems: the per-call overhead, in microseconds' digits


def _syncs(fn, *args):
    """Host reads of one call (bench_rollout_corr.count_syncs: ``_local_scalar_dense`` dispatches plus ``tolist``),
    and data-dependent-shape ops (syncs on a GPU)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_rollout_corr import count_syncs

    return count_syncs(lambda: _call(fn, *args))


def _flush_probe(sizes_mib, repeats, inputs, verl_call):
    """Which flush evicts the inputs: our gpg forward (the op alone, no autograd) timed with nothing before it, after
    zeroing each size, and after a call of verl's gpg (which reads the same inputs and writes its temporaries), the
    conditions interleaved repeat by repeat. A flush that evicts the inputs gives about the time after verl's call."""
    from rollout_corr_ext import _layout as LY
    from rollout_corr_ext import ops

    old, lp, adv, mask, w = inputs

    def forward():
        with torch.no_grad():
            ops.policy_loss_rows(lp, lp, adv, mask, w, 0.2, 0.28, 3.0, LY.PG_KIND_REINFORCE, with_loss_mat=False)

    bufs = {m: torch.zeros(m << 18) for m in sizes_mib}
    before = {"nothing": lambda: None}
    before.update({f"zeroing {m} MiB": (lambda b=bufs[m]: b.zero_()) for m in sizes_mib})
    before["a call of verl's gpg"] = verl_call
    times = {k: [] for k in before}
    forward()
    verl_call()
    for _ in range(repeats):
        for k, fn in before.items():
            fn()
            t0 = time.perf_counter()
            forward()
            times[k].append(time.perf_counter() - t0)
    print("| before the timed gpg forward | ours ms (median) |")
    print("|---|---:|")
    for k, v in times.items():
        print(f"| {k} | {_ms(statistics.median(v) * 1e3)} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=256, help="sequences (default: %(default)s)")
    ap.add_argument("--t", type=int, default=8192, help="response length (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (default: %(default)s)")
    ap.add_argument("--losses", nargs="+", default=NAMES, choices=NAMES, help="losses to run (default: all)")
    ap.add_argument("--flush-mib", type=int, default=256,
                    help="MiB zeroed before each interleaved call, untimed (0: none) (default: %(default)s)")
    ap.add_argument("--flush-probe", type=int, nargs="+", metavar="MIB",
                    help="only time our gpg forward after zeroing each of these sizes (and after verl's gpg)")
    add_progress_flag(ap)
    args = ap.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import verl.trainer.ppo.core_algos as core
        from verl.workers.config.actor import ActorConfig, PolicyLossConfig
    old, lp, adv, mask, w = _inputs(args.b, args.t)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    machine = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
               f"{platform.processor() or platform.machine()}, commit {commit}")

    def actor_config(name):
        return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                           clip_ratio=0.2, clip_ratio_high=0.28,
                           policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.5))

    if args.flush_probe:
        print(f"# which flush evicts the inputs, B x T = {args.b} x {args.t}, fp32; {machine}")
        verl_gpg, gpg_actor = core.get_policy_loss_fn("gpg"), actor_config("gpg")
        _flush_probe(args.flush_probe, args.repeats, (old, lp, adv, mask, w),
                     lambda: _call(verl_gpg, old, lp, adv, mask, gpg_actor, w))
        return
    _FLUSH["buf"] = torch.empty(args.flush_mib << 18) if args.flush_mib > 0 else None
    print(f"# policy losses fwd+bwd, B x T = {args.b} x {args.t}, fp32, token-mean, IS weights, "
          f"{args.flush_mib} MiB flushed before each interleaved call; {machine}")
    print("| loss | ours ms | verl 0.9.1 ms | speed-up | alone: ours ms | alone: verl ms | alone: speed-up "
          "| page faults / call ours / verl | host reads (shape ops) ours / verl |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    bar = progress_bar(len(args.losses) * (2 * args.repeats + 1), "policy losses", args.no_progress)
    for name in args.losses:
        bar.set_postfix_str(name)
        actor = actor_config(name)
        fns = {"ours": rv.POLICY_LOSSES[name], "verl": core.get_policy_loss_fn(name)}
        cfgs = {"ours": losses.PolicyLossConfig.from_dict(actor), "verl": actor}
        times = {k: [] for k in fns}
        faults = {k: [] for k in fns}
        alone = {k: [] for k in fns}
        for k in fns:
            _call(fns[k], old, lp, adv, mask, cfgs[k], w)  # warm-up
        bar.update()
        for _ in range(args.repeats):
            for k in fns:
                dt, nf = _timed(fns[k], old, lp, adv, mask, cfgs[k], w, flush=True)
                times[k].append(dt)
                faults[k].append(nf)
            bar.update()
        for k in fns:  # each alone: a warm-up, then back to back
            _call(fns[k], old, lp, adv, mask, cfgs[k], w)
            for _ in range(args.repeats):
                alone[k].append(_timed(fns[k], old, lp, adv, mask, cfgs[k], w)[0])
                bar.update()
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        med_alone = {k: statistics.median(v) * 1e3 for k, v in alone.items()}
        nf = {k: int(statistics.median(v)) for k, v in faults.items()}
        syncs = {k: _syncs(fns[k], old, lp, adv, mask, cfgs[k], w) for k in fns}
        bar.write(f"| {name} | {_ms(med['ours'])} | {_ms(med['verl'])} | {med['verl'] / med['ours']:.2f}x | "
                  f"{_ms(med_alone['ours'])} | {_ms(med_alone['verl'])} | "
                  f"{med_alone['verl'] / med_alone['ours']:.2f}x | {nf['ours']} / {nf['verl']} | "
                  f"{syncs['ours'][0]} ({syncs['ours'][1]}) / {syncs['verl'][0]} ({syncs['verl'][1]}) |")
    bar.close()


if __name__ == "__main__":
    main()
