"""Print the demo's results table (docs/megatron.md) from the files a run of examples/demo_trainer.py wrote.

    python examples/demo_table.py demo_out                     # a run's --out-dir (or its metrics.jsonl)
    python examples/demo_table.py /tmp/seed0 /tmp/seed1 --details

For each run: one header line saying where the numbers come from (the command, the commit, the machine, the
backend and the wall time, read from the run's ``run.json``; without it, the commit and the machine are those of
this checkout and this machine now, and the header says so), then one markdown table, one row per setting:

* ``reward``, ``exact match``, ``rollout_corr/kl``, ``chi2_token``: means over the last ``--tail`` steps (default:
  a fifth of the steps, the window the demo's own summary uses: the last 40 of 200);
* ``steps to 0.5 / 0.8``: the first step at which the trailing moving average of the reward over ``--window``
  steps (9, as in the plot) reaches 0.5 / 0.8; ``–`` if it never does;
* ``rejected``: ``rollout_corr/seq_masked_fraction`` (the fraction of sequences RS and the veto removed) averaged
  over every step of the run.

The best reward and exact match are in bold (when one setting alone has it). ``--details`` adds a second table
with the numbers the docs' narrative quotes: kl and chi2_token at step 0, the largest per-step kl (and its step),
the lowest moving-average p5 and the highest moving-average p95 of the token ratio pi_train/pi_rollout (and their
steps), the mean p5 / p95 over the last ``--tail`` steps, the largest per-step rejected fraction. Standard library
only: no torch needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path: str):
    """(records, run info or None) of a run directory or a metrics.jsonl path."""
    jsonl = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    records = []
    with open(jsonl) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:  # e.g. the last line of a run still being written
                raise SystemExit(f"{jsonl}:{i}: not a JSON record ({e})") from None
            if not isinstance(rec, dict):
                raise SystemExit(f"{jsonl}:{i}: not a JSON object")
            records.append(rec)
    info_path = os.path.join(os.path.dirname(jsonl), "run.json")
    info = None
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
    return records, info


def smooth(y, window):
    """Trailing moving average, as the demo's plot draws it (shorter windows over the first steps)."""
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= window:
            acc -= y[i - window]
        out.append(acc / min(i + 1, window))
    return out


def mean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def first_step(steps, values, threshold):
    return next((s for s, v in zip(steps, values) if v >= threshold), None)


def current_machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def current_commit() -> str:
    try:
        out = subprocess.run(["git", "--no-optional-locks", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def header(info, command=None) -> str:
    if info is None:
        cmd = command or "unknown (no run.json next to metrics.jsonl)"
        return (f"Command: `{cmd}`; commit `{current_commit()}` and machine {current_machine()} are those this table "
                f"was printed on (the run wrote no run.json).")
    commit = f"`{info.get('commit', 'unknown')}`"
    if info.get("uncommitted"):
        commit += " + uncommitted changes to " + ", ".join(f"`{p}`" for p in info["uncommitted"])
    dev = info.get("device", "cpu")
    return (f"Command: `{command or info['command']}`; commit {commit}; machine: {info.get('machine', '?')}"
            f"{'' if dev == 'cpu' else ', ' + dev}; {info.get('dist_backend', '?')}, rollout_corr_ext backend "
            f"`{info.get('rollout_corr_ext_backend', '?')}`"
            f"{' (' + info['rollout_corr_ext_cpu_isa'] + ' kernels)' if 'rollout_corr_ext_cpu_isa' in info else ''}, "
            f"torch {info.get('torch', '?')}"
            f"{' (' + info['torch_cpu_capability'] + ')' if 'torch_cpu_capability' in info else ''}; "
            f"{info.get('seconds', float('nan')):.0f} s wall.")


def per_setting(records):
    settings = list(dict.fromkeys(r["setting"] for r in records))
    return {name: sorted((r for r in records if r["setting"] == name), key=lambda r: r["step"]) for name in settings}


def table(records, tail=None, window=9) -> str:
    runs = per_setting(records)
    n_steps = max(len(rows) for rows in runs.values())
    tail = tail or max(1, n_steps // 5)
    rows_out = []
    for name, rows in runs.items():
        last = rows[-tail:]
        steps = [r["step"] for r in rows]
        sm = smooth([r["reward"] for r in rows], window)
        reach = [first_step(steps, sm, t) for t in (0.5, 0.8)]
        rej = mean([r.get("rollout_corr/seq_masked_fraction", 0.0) for r in rows])
        rows_out.append({
            "setting": name,
            "reward": mean([r["reward"] for r in last]),
            "exact": mean([r["exact_match"] for r in last]),
            "reach": " / ".join("–" if s is None else str(s) for s in reach),
            "kl": mean([r.get("rollout_corr/kl") for r in last]),
            "chi2": mean([r.get("rollout_corr/chi2_token") for r in last]),
            "rejected": rej,
        })
    def num(row, key):  # bold: the best of the column, when one setting alone has it (to the digits shown)
        s = f"{row[key]:.3f}"
        shown = [f"{r[key]:.3f}" for r in rows_out]
        top = max(shown, key=float)
        return f"**{s}**" if s == top and shown.count(top) == 1 and len(rows_out) > 1 else s

    lines = [f"Means over the last {tail} of {n_steps} steps; steps to 0.5 / 0.8: first step at which the "
             f"{window}-step moving average of the reward reaches it; rejected: "
             f"`rollout_corr/seq_masked_fraction` averaged over all {n_steps} steps.", "",
             "| setting | reward | exact match | steps to 0.5 / 0.8 | rollout_corr/kl | chi2_token | rejected |",
             "|---|---|---|---|---|---|---|"]
    for r in rows_out:
        rej = "0" if r["rejected"] == 0 else f"{100 * r['rejected']:.1f} %"
        lines.append(f"| {r['setting']} | {num(r, 'reward')} | {num(r, 'exact')} | {r['reach']} | {r['kl']:.1e} | "
                     f"{r['chi2']:.2g} | {rej} |")
    return "\n".join(lines)


def details(records, tail=None, window=9) -> str:
    runs = per_setting(records)
    tail = tail or max(1, max(len(rows) for rows in runs.values()) // 5)
    lines = [f"| setting | kl at step 0 | chi2_token at step 0 | max kl (step) | min p5, {window}-step avg (step) | "
             f"max p95, {window}-step avg (step) | p5 / p95, last {tail} steps | max rejected in one step (step) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]

        def arg(values, fn):
            i = fn(range(len(values)), key=lambda j: values[j])
            return values[i], steps[i]

        kl = [r["rollout_corr/kl"] for r in rows]
        p5 = smooth([r["demo/token_ratio_p05"] for r in rows], window)
        p95 = smooth([r["demo/token_ratio_p95"] for r in rows], window)
        rej = [r.get("rollout_corr/seq_masked_fraction", 0.0) for r in rows]
        (klm, kls), (p5m, p5s), (p95m, p95s), (rjm, rjs) = arg(kl, max), arg(p5, min), arg(p95, max), arg(rej, max)
        lines.append(f"| {name} | {kl[0]:.1e} | {rows[0]['rollout_corr/chi2_token']:.1e} | {klm:.2f} ({kls}) | "
                     f"{p5m:.2f} ({p5s}) | {p95m:.2f} ({p95s}) | "
                     f"{mean([r['demo/token_ratio_p05'] for r in rows[-tail:]]):.2f} / "
                     f"{mean([r['demo/token_ratio_p95'] for r in rows[-tail:]]):.2f} | "
                     f"{'0' if rjm == 0 else f'{100 * rjm:.0f} % ({rjs})'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (the demo's --out-dir) or metrics.jsonl files")
    ap.add_argument("--tail", type=int, default=None,
                    help="average the last TAIL steps; None: a fifth of the steps, as in the demo's summary")
    ap.add_argument("--window", type=int, default=9, help="moving-average window for the steps-to-threshold column")
    ap.add_argument("--command", default=None, help="the command to name in the header, instead of run.json's")
    ap.add_argument("--details", action="store_true", help="also print the table of the numbers the narrative quotes")
    args = ap.parse_args(argv)
    if args.tail is not None and args.tail < 1:
        ap.error(f"--tail must be >= 1, got {args.tail}")
    if args.window < 1:
        ap.error(f"--window must be >= 1, got {args.window}")
    for i, path in enumerate(args.runs):
        records, info = load(path)
        if not records:
            raise SystemExit(f"{path}: no records")
        if i:
            print()
        print(header(info, args.command))
        print()
        print(table(records, args.tail, args.window))
        if args.details:
            print()
            print(details(records, args.tail, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
