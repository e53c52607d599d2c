"""The checks every emulated kernel family must pass, under every turnstile schedule.

For a family (``logprob``, ``policy_loss``, ``rollout_correction``, ``sampling``) and small inputs that give each
block several rows and several warps (so a warp that runs a row ahead of the others meets shared slots that are still
in use):

* racecheck: the hazards the emulator reports (cuda_emu.h) over the family's launches, in each schedule;
* values: the outputs of each schedule against a reference (the fp64 oracles for the log-probs and the policy
  loss, the contracts' row-by-row oracles for the sampling replay; the fallback for the rollout passes, whose
  per-row partials no public oracle returns -- the whole rollout pipeline on the emulator is held to the
  independent oracle in tests/test_cuda_emulator_rollout_correction.py);
* schedule invariance: the raw outputs (shard records with their headers, loss rows, partial sums) bitwise equal
  across the four schedules -- the kernels reduce in a fixed order, so any difference is a race.

``python -m rollout_corr_testing.cuda_emulator.checks FAMILY [KERNEL_OVERRIDE_DIR]`` builds the family (against a
mutated copy of the kernels when a folder is given) and prints the findings as JSON: the barrier-necessity test
(tests/test_cuda_emulator_races.py) runs it once per removed ``__syncthreads``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEDULES = (0, 1, 2, 3)
SCHEDULE_NAMES = {0: "ascending", 1: "descending", 2: "warp-major, last warp first", 3: "warp-major, first warp first"}
#: The emulated family (emu_*.cpp) that compiles each kernel file.
FAMILY_OF_FILE = {
    "logprob_kernels.cuh": "logprob",
    "policy_loss_kernels.cuh": "policy_loss",
    "rollout_correction_kernels.cuh": "rollout_correction",
    "sampling_kernels.cuh": "sampling",
}


def _mismatch(got, want, **tol) -> str:
    try:
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return ""


# ---- one run of each family: (raw outputs for the invariance check, mismatch vs the reference or "") ---------------

def _logprob_run(schedule: int):
    from rollout_corr_testing.cuda_emulator.logprob_pipeline import emulated_log_probs, oracle_log_probs

    emu = torch.ops.rollout_corr_emu
    g = torch.Generator().manual_seed(0)
    rows, widths, vocab_size = 6, [256, 256], 500  # two shards, padding in the second
    full = torch.randn(rows, sum(widths), generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, vocab_size, (rows,), generator=g)
    t[2] = -100
    shards = [s.float().contiguous() for s in torch.split(full, widths, dim=-1)]
    ones = torch.ones(rows)
    # 128 threads = 4 warps; 2 blocks for 6 rows: three rows per block.
    knobs = dict(threads=128, max_blocks=2, schedule=schedule)
    got = emulated_log_probs(shards, t, vocab_size, 0.9, ones, ones, ones, stats_knobs=knobs,
                             merge_knobs=dict(threads=32, max_blocks=1, schedule=schedule), backward_knobs=knobs)
    want = oracle_log_probs(full.float().double(), t, vocab_size, 0.9, ones, ones, ones)
    why = ""
    for name, a, b in zip(("logp", "entropy", "mean_logp"), got[:3], want[:3]):
        m = _mismatch(a.double(), b, rtol=1e-4, atol=1e-4)
        why = why or (f"{name}: {m}" if m else "")
    m = _mismatch(got[3].double()[:, :vocab_size], want[3][:, :vocab_size], rtol=1e-4, atol=1e-5)
    why = why or (f"gradient: {m}" if m else "")
    records = [emu.vocab_row_stats(s, t, 256 * k, vocab_size, 1 / 0.9, -100, True, **knobs)
               for k, s in enumerate(shards)]
    return [*records, *got], why


def _policy_loss_run(schedule: int):
    from rollout_corr_testing.dense_oracles import PPO_CLIP, policy_loss_rows_dense

    emu = torch.ops.rollout_corr_emu
    g = torch.Generator().manual_seed(0)
    rows, cols = 6, 300
    lp = -torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, cols, generator=g) > 0.2
    inputs = (lp.float(), old.float(), adv.float())
    knobs = dict(threads=128, max_blocks=2, schedule=schedule)
    loss, row = emu.policy_loss_rows(*inputs, mask, None, 0.2, 0.2, 3.0, 0, **knobs)
    ref_loss, ref_row = policy_loss_rows_dense(*(x.double() for x in inputs), mask, None, 0.2, 0.2, 3.0, PPO_CLIP)
    g_mat, g_rows = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
    grad = emu.policy_loss_backward(g_mat, g_rows, *inputs, mask, None, 0.2, 0.2, 3.0, 0, **knobs)
    x = inputs[0].double().requires_grad_(True)
    rl, rr = policy_loss_rows_dense(x, *(v.double() for v in inputs[1:]), mask, None, 0.2, 0.2, 3.0, PPO_CLIP)
    ((rl * g_mat.double()).sum() + (rr[:, 0] * g_rows.double()).sum()).backward()
    why = ""
    for name, a, b, tol in (("loss_mat", loss, ref_loss, 1e-5), ("rows", row, ref_row, 1e-4),
                            ("gradient", grad, x.grad, 1e-5)):
        m = _mismatch(a.double(), b, rtol=tol, atol=tol)
        why = why or (f"{name}: {m}" if m else "")
    return [loss, row, grad], why


def _rollout_run(schedule: int):
    from rollout_corr_ext import RolloutCorrectionConfig, fallback
    from rollout_corr_ext.correction import op_args
    from rollout_corr_testing.rc_testutil import make_inputs

    emu = torch.ops.rollout_corr_emu
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                  rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.7_1.3,0.02",
                                  rollout_token_veto_threshold=0.6)
    lp, rlp, mask = make_inputs(6, 200, seed=1, scale=0.2, pad_rows=(3,))
    mask[1] = True
    lp[1] = rlp[1] + 0.01
    a = op_args(cfg)
    knobs = dict(threads=64, max_blocks=2, schedule=schedule)  # 2 warps, three rows per block
    st = emu.rollout_seq_stats(lp, rlp, mask, None, *a, **knobs)
    st_ref = fallback.rollout_seq_stats(lp, rlp, mask, None, *a)
    out = emu.rollout_token_pass(lp, rlp, mask, None, st_ref, *a, True, **knobs)
    ref = fallback.rollout_token_pass(lp, rlp, mask, None, st_ref, *a, True)
    why = ""
    for name, x, y, tol in (("seq_stats", st, st_ref, dict(rtol=1e-4, atol=1e-4)),
                            ("weights", out[0], ref[0], dict(rtol=1e-5, atol=1e-6)),
                            ("mask", out[1], ref[1], dict(rtol=0, atol=0)),
                            ("sums", out[2], ref[2], dict(rtol=1e-5, atol=1e-5)),
                            ("maxes", out[3], ref[3], dict(rtol=1e-5, atol=1e-6))):
        m = _mismatch(x, y, **tol)
        why = why or (f"{name}: {m}" if m else "")
    return [st, *out], why


def _sampling_run(schedule: int):
    import math

    from rollout_corr_ext.sampling import _ordered_key, _probes
    from rollout_corr_testing.sampling_kernel_oracles import (candidate_decide_oracle, mass_histogram_oracle,
                                                              row_candidates_oracle, rows_with_edges)

    emu = torch.ops.rollout_corr_emu
    knobs = dict(threads=64, max_blocks=2, schedule=schedule)  # 2 warps, several rows per block
    why = []

    # count_at_least (block sums) and mass_histogram (shared buckets)
    z = rows_with_edges(5, 200, torch.float32, seed=4, grid=True)
    floor = torch.tensor([-math.inf, 0.0, -1.0, 2.0, -math.inf])
    counts = emu.count_at_least(z, floor, **knobs)
    want = torch.tensor([int((z[r] >= floor[r]).sum()) for r in range(5)])
    why.append("count_at_least: mismatch" if not torch.equal(counts, want) else "")
    z_max = z.amax(1)
    hi, lo = _ordered_key(z_max), _ordered_key(z_max - 64) - 1
    probes = _probes(lo, hi, 8, torch.float32)  # 255 per row: the shared-memory buckets
    hist = emu.mass_histogram(z, z_max, floor, lo, hi, probes, **knobs)
    diff = int((hist - mass_histogram_oracle(z, z_max, floor, lo, hi, probes)).abs().sum())
    why.append(f"mass_histogram: off by {diff}" if diff > 3 else "")

    # row_topk (radix rounds, the gathered keys' sort)
    x = rows_with_edges(5, 300, torch.float32, seed=5, grid=True)
    top = emu.row_topk(x, 40, **knobs)
    why.append("row_topk: mismatch" if not torch.equal(top, x.topk(40, dim=-1).values) else "")

    # row_candidates: the fast route and the exact one (a row of 4130 ties: the column select)
    v = 4133
    x = rows_with_edges(6, v, torch.bfloat16, seed=6)
    x[2] = 0.25
    x[3, 7] = float("nan")
    k = torch.tensor([5, 3, 4, 6, 50, 0])
    tc = torch.tensor([1, -1, 3, 4, 9, 2])
    cand = emu.row_candidates(x, k, tc, 60, 0.8, v - 3, **knobs)
    want = row_candidates_oracle(x, k, tc, 60, 0.8, v - 3)
    full = want[2] <= 60
    ok = (torch.equal(cand[2], want[2]) and torch.equal(cand[0][full], want[0][full])
          and torch.equal(cand[1][full], want[1][full]) and _mismatch(cand[3], want[3], rtol=2e-6, atol=0) == "")
    why.append("row_candidates: mismatch" if not ok else "")

    # candidate_decide: k-th largest, the top-p cut (the weighted select), the fp64 block sums
    g = torch.Generator().manual_seed(7)
    n, width = 6, 40
    c = (torch.randn(n, width, generator=g, dtype=torch.float64) * 2).round()
    c[1, 25:] = -math.inf
    c = c.float()
    z_max = c.double().amax(1)
    args = (c, z_max, c[:, 3].double(), (c.double() - z_max.unsqueeze(1)).exp().sum(1) + 1.0,
            torch.tensor([5, 30, 12, 0, 40, 8]), torch.full((n,), -math.inf),
            torch.tensor([0.9, 0.5, 1.0, 0.7, 0.3, 0.95], dtype=torch.float64))
    tau, out = emu.candidate_decide(*args, **knobs)
    want_tau, want_out = candidate_decide_oracle(c.sort(dim=1, descending=True).values, *args[1:])  # (reads it sorted)
    ok = torch.equal(tau, want_tau) and _mismatch(out, want_out, rtol=1e-12, atol=1e-12) == ""
    why.append("candidate_decide: mismatch" if not ok else "")
    return [counts, hist, top, *cand, tau, out], "; ".join(w for w in why if w)


RUNS: Dict[str, Callable[[int], tuple]] = {
    "logprob": _logprob_run,
    "policy_loss": _policy_loss_run,
    "rollout_correction": _rollout_run,
    "sampling": _sampling_run,
}


def check_family(family: str) -> dict:
    """{"hazards": {schedule: count}, "hazard_examples": [...], "mismatch": {schedule: why}, "errors": {schedule: msg},
    "schedule_dependent": [names of outputs that differ between schedules], "barriers": {"file:line": releases}}."""
    from rollout_corr_testing.cuda_emulator.records import racecheck, recorded_launches

    run = RUNS[family]
    report = dict(hazards={}, hazard_examples=[], mismatch={}, errors={}, schedule_dependent=[], barriers={})
    outputs = {}
    for s in SCHEDULES:
        # racecheck records hazards without failing the launches, so the values are still compared.
        outs = None
        with racecheck(1), recorded_launches() as rec:
            try:
                outs, why = run(s)
            except Exception as e:  # noqa: BLE001 - an emulator error (synccheck, a crash) is a finding
                report["errors"][s] = f"{type(e).__name__}: {str(e)[:600]}"
        launches = rec.launches()  # the failed launch's record included: its hazards count too
        report["hazards"][s] = sum(x.hazard_count for x in launches)
        for x in launches:
            for h in x.hazards:
                if len(report["hazard_examples"]) < 4 and h not in report["hazard_examples"]:
                    report["hazard_examples"].append(h)
            for site, n in x.barriers.items():
                report["barriers"][site] = report["barriers"].get(site, 0) + n
        if outs is None:
            continue
        if why:
            report["mismatch"][s] = why
        outputs[s] = outs
    done = sorted(outputs)
    for s in done[1:]:
        for i, (a, b) in enumerate(zip(outputs[done[0]], outputs[s])):
            if not torch.equal(torch.nan_to_num(a, nan=12345.0), torch.nan_to_num(b, nan=12345.0)):
                report["schedule_dependent"].append(f"output {i}: schedule {done[0]} vs {s}")
    return report


def detected(report: dict) -> List[str]:
    """What in a report makes an emulator test fail (empty: nothing)."""
    found = []
    if any(report["hazards"].values()):
        found.append("racecheck: " + ", ".join(f"{n} in schedule {s}" for s, n in report["hazards"].items() if n))
    found += [f"schedule {s} ({SCHEDULE_NAMES[int(s)]}): {why}" for s, why in report["mismatch"].items()]
    found += [f"schedule {s}: {msg}" for s, msg in report["errors"].items()]
    found += [f"schedule-dependent {x}" for x in report["schedule_dependent"]]
    return found


def main(argv) -> int:
    """``checks.py FAMILY [KERNEL_DIR] [--skip-barrier FILE.cuh:LINE] [--build-only]``: build (or reuse) the family's
    emulator, on the kernels of KERNEL_DIR when given, and print the REPORT line of :func:`check_family`, with the
    named __syncthreads running as if removed."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("kernel_dir", nargs="?", default=None)
    ap.add_argument("--skip-barrier", default="")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args(argv[1:])
    sys.path.insert(0, str(ROOT))
    from rollout_corr_testing.cuda_emulator.loader import load_emulator

    # On the tree's kernels, the whole emulator: the build every other emulator test loads (cached, so the barrier
    # test compiles nothing of its own); on a mutated copy, only the family (a compile of its own either way).
    load_emulator(kernel_override_dir=args.kernel_dir,
                  sources=[f"emu_{args.family}.cpp"] if args.kernel_dir else None)
    if args.build_only:
        return 0
    torch.ops.rollout_corr_emu.skip_barrier(args.skip_barrier)
    print("REPORT " + json.dumps(check_family(args.family)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
