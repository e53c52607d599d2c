"""verl's fused-kernel log-probs (``use_fused_kernels=True``, torch backend) against the drop-in that replaces them.

Rows, measured in the same run on the same inputs (verl's remove-padding layout: ``hidden_states`` [1, N, H], the
output weight [V, H], ``input_ids`` [1, N], the actor's temperature 0.7; forward + backward of
``(log_probs * w1 + entropy * w2).sum()`` with respect to both inputs, the log-probs' -inf tokens left out):

* ``verl``: ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (verl 0.9.1; 512-row chunks, each
  materialising its [512, V] fp32 logits, softmax and one-hot, and the backward recomputing them);
* ``ours``: ``rollout_corr_ext.verl.FusedLinearForPPO`` (``linear_log_probs``: no logits tensor);
* ``ours, replay top-k 50 + top-p 0.9`` and ``ours, replay top-p 0.9``: the same under
  ``rollout_corr_ext.verl.configure(sampling=...)`` (``sampled_linear_log_probs``), which verl's class cannot do.

Columns: median wall time of forward + backward (``--repeats``, after a warm-up, the paths interleaved in each
repeat) and its ratio to verl's; peak extra resident memory of one forward + backward in a fresh process each,
with the allocator as the user has it (RSS high-water mark above the RSS once the inputs exist), and its ratio.

Run::

    python benchmarks/bench_verl_fused.py [--n 4096 --hidden 512 --vocab 32000 --dtypes fp32 bf16 --repeats 3]
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
import rollout_corr_ext.verl as rcv  # noqa: E402
from peak_memory import peak_extra_mib  # noqa: E402
from progress import add_progress_flag, progress_bar  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEMPERATURE = 0.7
#: path -> the replay configured for it (None: none)
REPLAYS = {
    "verl": None,
    "ours": None,
    "ours, replay top-k 50 + top-p 0.9": rc.SamplingParams(top_k=50, top_p=0.9),
    "ours, replay top-p 0.9": rc.SamplingParams(top_p=0.9),
}


def verl_class():
    """verl's class, or None when verl is not importable (its rows are then left out)."""
    try:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
    except Exception:  # noqa: BLE001 - any import failure: no verl row
        return None
    return FusedLinearForPPO


def make_inputs(n, h, v, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)).to(dtype)
    ids = torch.randint(0, v, (1, n), generator=g)
    ids[0, ::2] = (hidden[0, ::2].float() @ weight.float().t()).argmax(-1)  # as sampled: half the likeliest token
    w1, w2 = torch.randn(1, n, generator=g), torch.randn(1, n, generator=g)
    return hidden.requires_grad_(True), weight.requires_grad_(True), ids, w1, w2


def step(path, hidden, weight, ids, w1, w2):
    """One forward + backward; the gradients land in hidden.grad / weight.grad."""
    hidden.grad = weight.grad = None
    if path == "verl":
        lp, ent = verl_class()()(hidden, weight, ids, TEMPERATURE)
    else:
        with rcv.configured(sampling=REPLAYS[path]):
            lp, ent = rcv.FusedLinearForPPO()(hidden, weight, ids, TEMPERATURE)
    (torch.where(torch.isfinite(lp), lp * w1, 0.0) + ent.float() * w2).sum().backward()


def measure_memory(path, n, h, v, dtype):
    step(path, *make_inputs(16, h, 256, dtype))  # lazy initialisation on a tiny problem
    inputs = make_inputs(n, h, v, dtype)
    return peak_extra_mib(lambda: step(path, *inputs), "cpu")


def memory_subprocess(path, args, dtype_name, say=print):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_memory", path, "--n", str(args.n),
                          "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtypes", dtype_name],
                         capture_output=True, text=True)
    if out.returncode != 0:
        say(f"(memory of {path} failed: {out.stderr.strip().splitlines()[-1:]})")
        return None
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="N: tokens (rows of the hidden states)")
    ap.add_argument("--hidden", type=int, default=512, help="H: the hidden size")
    ap.add_argument("--vocab", type=int, default=32000, help="V: rows of the output weight")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="input dtypes")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after a warm-up")
    add_progress_flag(ap)
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        print(json.dumps(measure_memory(args._memory, args.n, args.hidden, args.vocab, DTYPES[args.dtypes[0]])))
        return
    paths = [p for p in REPLAYS if p != "verl" or verl_class() is not None]
    if "verl" not in paths:
        print("verl is not importable: its rows are left out")
    print(f"verl's fused-kernel log-probs vs the drop-in: N = {args.n}, H = {args.hidden}, V = {args.vocab}, "
          f"temperature {TEMPERATURE}, forward + backward w.r.t. hidden states and weight; backend={rc.backend()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print()
    print("| dtype | path | time s | time / verl | peak extra MiB | memory / verl |")
    print("|---|---|---:|---:|---:|---:|")
    bar = progress_bar(len(args.dtypes) * len(paths) * (args.repeats + 2), "run", args.no_progress, unit="step")
    for name in args.dtypes:
        inputs = make_inputs(args.n, args.hidden, args.vocab, DTYPES[name])
        for p in paths:  # warm-up
            step(p, *inputs)
            bar.update()
        times = {p: [] for p in paths}
        for _ in range(args.repeats):
            for p in paths:  # interleaved: drift of the machine hits every path alike
                t0 = time.perf_counter()
                step(p, *inputs)
                times[p].append(time.perf_counter() - t0)
                bar.update()
        del inputs
        mem = {}
        for p in paths:
            bar.set_postfix_str(f"{name} memory {p}")
            mem[p] = memory_subprocess(p, args, name, bar.write)
            bar.update()
        med = {p: statistics.median(t) for p, t in times.items()}
        for p in paths:
            ratio_t = f"{med[p] / med['verl']:.2f}x" if "verl" in med else "-"
            ratio_m = (f"{mem[p] / max(mem['verl'], 1e-9):.3f}x" if mem.get("verl") and mem[p] is not None
                       else "-")
            m = "-" if mem[p] is None else f"{mem[p]:.0f}"
            bar.write(f"| {name} | {p} | {med[p]:.3f} | {ratio_t} | {m} | {ratio_m} |")
    bar.close()


if __name__ == "__main__":
    main()
