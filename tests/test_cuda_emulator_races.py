"""Shared-memory races and barriers, checked by the emulator (issue §5).

racecheck (cuda_emu.h, like compute-sanitizer's): between two barriers, a shared byte written by one thread and read
or written by another (or touched by a plain access and another thread's atomic) is a hazard, reported with the
kernel, the shared array and element, both threads and both source lines; it is on in every emulated launch and
fails the launch. synccheck: a __syncthreads not reached by the whole block is an error (tests/test_cuda_emulator.py).

Planted races in small kernels prove racecheck fires (and stays quiet on their correct versions, atomics included);
the warp-major schedules let one warp run a row ahead of the others; the kernels are race-free and schedule-invariant
under every schedule; and every __syncthreads of the device code is necessary: removing any single one makes the
emulator's checks fail (slow: one build per barrier).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rollout_corr_testing.cuda_emulator.checks import FAMILY_OF_FILE, check_family, detected
from rollout_corr_testing.cuda_emulator.loader import ROOT, load_emulator
from rollout_corr_testing.cuda_emulator.records import racecheck, racecheck_available, recorded_launches

SELFTEST = ROOT / "rollout_corr_testing" / "cuda_emulator" / "emu_selftest.cpp"
KERNEL_FILES = sorted((ROOT / "csrc" / "cuda").glob("*_kernels.cuh"))


@pytest.fixture(scope="module")
def emu():
    load_emulator()
    if not racecheck_available():
        pytest.skip(reason="racecheck needs the instrumented emulator build (this is the AddressSanitizer build)")
    return torch.ops.rollout_corr_emu


def _line(kernel, pattern: str) -> int:
    """The line of `pattern` in emu_selftest.cpp: its first one after the self-test kernel `kernel` starts."""
    lines = SELFTEST.read_text().splitlines()
    start = [i for i, text in enumerate(lines) if f"void {kernel}_kernel(" in text][0] if kernel else 0
    return next(i + 1 for i in range(start, len(lines)) if pattern in lines[i])


# kernel -> (the correct version's outputs with 128 threads, source lines the hazard report must name)
PLANTED = {
    "warp_slots": ([10], ["slots[warp] = warp + 1", "s += slots[w]"]),
    "histogram": ([16] * 8, ["bins[threadIdx.x] = 0u", "atomicAdd(&bins"]),
    "intra_warp": ([7], ["slot[0] = 7", "out[0] = slot[0]"]),
    "raw_pointer": ([2], ["p[i] = v", "return p[i]"]),
    "rows": ([6, 406, 806, 1206], ["slots[warp] = v", "s += slots[w]"]),
}


@pytest.mark.parametrize("kernel", sorted(PLANTED))
def test_planted_race_is_reported_and_its_fix_is_clean(emu, kernel):
    """Each planted race fails its launch with a racecheck report naming the kernel, the shared array, two
    threads and both source lines, in every schedule; the correct version (a barrier, a __syncwarp) passes with
    the right values. Atomics of different threads on one bin are no race; the zeroing they race with is."""
    want, patterns = PLANTED[kernel]
    # (the raw-pointer kernel's accesses are in its out-of-line helpers, above it)
    lines = [f"emu_selftest.cpp:{_line(None if kernel == 'raw_pointer' else kernel, p)}" for p in patterns]
    for schedule in (0, 1, 2, 3):
        out, error = emu.selftest_race(kernel, 1, schedule)
        assert error == "", error
        assert out[: len(want)].tolist() == want, (schedule, out)
        _, error = emu.selftest_race(kernel, 0, schedule)
        assert "racecheck" in error and f"hazard in selftest::{kernel}_kernel" in error, error
        assert all(line in error for line in lines), (lines, error)
        assert re.search(r"by thread \d+ \(warp \d+\) at .*by thread \d+ \(warp \d+\) at", error), error


def test_racecheck_report_names_the_hazard(emu):
    """The report of the missing barrier between the warps' slots and thread 0's sum, in the ascending schedule:
    thread 0 reads slot 1 before warp 1 writes it."""
    _, error = emu.selftest_race("warp_slots", 0, 0)
    write, read = _line("warp_slots", "slots[warp] = warp + 1"), _line("warp_slots", "s += slots[w]")
    assert (f"write-after-read hazard in selftest::warp_slots_kernel, block (0,0,0), shared slots[1]: read by "
            f"thread 0 (warp 0) at emu_selftest.cpp:{read}, then write by thread 32 (warp 1) at "
            f"emu_selftest.cpp:{write}, with no __syncthreads between them") in error, error


def test_warp_major_schedule_lets_a_warp_run_a_row_ahead(emu):
    """Without the trailing barrier of a row loop, only a schedule in which the last warp runs on to the next row
    before warp 0 reads this row's slots gives wrong values (2: warp-major, last warp first); racecheck reports
    the hazard whatever the schedule."""
    with racecheck(0):
        for schedule in (0, 1, 3):
            out, _ = emu.selftest_race("rows", 0, schedule)
            assert out[:4].tolist() == PLANTED["rows"][0], schedule
        out, _ = emu.selftest_race("rows", 0, 2)
        assert out[:4].tolist() != PLANTED["rows"][0]


@pytest.mark.parametrize("family", sorted(set(FAMILY_OF_FILE.values())))
def test_kernels_are_race_free_and_schedule_invariant(emu, family):
    """Each family with several rows and warps per block, under the four schedules: no hazard, the reference
    values, bitwise the same outputs in every schedule; and every __syncthreads statement of its kernel file
    released the block (racecheck watched every barrier interval)."""
    report = check_family(family)
    assert not detected(report), detected(report)
    file = [f for f, fam in FAMILY_OF_FILE.items() if fam == family][0]
    for line in _barrier_lines(ROOT / "csrc" / "cuda" / file):
        assert report["barriers"].get(f"{file}:{line}", 0) > 0, f"{file}:{line} never ran: {report['barriers']}"


def test_racecheck_off_and_on(emu):
    """set_racecheck: 0 lets the race run (the values say nothing here), 1 records without failing, 2 fails."""
    with racecheck(0):
        assert emu.selftest_race("intra_warp", 0, 0)[1] == ""
    with racecheck(1), recorded_launches() as rec:
        assert emu.selftest_race("intra_warp", 0, 0)[1] == ""
    (launch,) = rec.launches()
    assert launch.hazard_count > 0 and "intra_warp_kernel" in launch.hazards[0]
    assert "racecheck" in emu.selftest_race("intra_warp", 0, 0)[1]


# ---- every barrier is necessary -----------------------------------------------------------------------------------

def _barrier_lines(path: Path):
    """Line numbers of the __syncthreads() statements (comments excluded)."""
    out = []
    for i, text in enumerate(path.read_text().splitlines()):
        if "__syncthreads();" in text.split("//")[0]:
            out.append(i + 1)
    return out


def _barriers():
    return [(f.name, line) for f in KERNEL_FILES for line in _barrier_lines(f)]


# The barriers that guard a slot rewritten for the next row: a warp that runs a row ahead (schedule 2) must give
# wrong values without them, not only a racecheck report.
ROW_TRAILING = {"logprob_kernels.cuh": "the warp_* slots are rewritten for the next row",
                "policy_loss_kernels.cuh": "warp_partials is rewritten for the next row"}


@pytest.mark.slow
def test_every_syncthreads_is_necessary():
    """Each __syncthreads() of csrc/cuda/*_kernels.cuh, disabled alone (the emulator's ``skip_barrier``: the
    statement runs as if removed from the source), makes the emulator's checks fail (checks.py: racecheck, the
    reference values, schedule invariance; each a failure of the regular emulator tests too). racecheck must catch
    every one; the row-trailing barriers of the log-prob and policy-loss kernels must also change the values in the
    warp-major schedule. The emulator build the other tests use, one process per barrier, two in parallel."""
    if os.environ.get("ROLLOUT_CORR_EMU_ASAN") == "1":
        pytest.skip(reason="racecheck is left out of the AddressSanitizer build; the regular test run checks the barriers")
    barriers = _barriers()
    assert len(barriers) >= 8, barriers
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    checks = [sys.executable, "-m", "rollout_corr_testing.cuda_emulator.checks"]

    def build(family):
        return subprocess.run(checks + [family, "--build-only"], cwd=str(ROOT), env=env, capture_output=True,
                              text=True, timeout=1200)

    def run(barrier):
        name, line = barrier
        t0 = time.time()
        proc = subprocess.run(checks + [FAMILY_OF_FILE[name], "--skip-barrier", f"{name}:{line}"], cwd=str(ROOT),
                              env=env, capture_output=True, text=True, timeout=1200)
        return barrier, proc, time.time() - t0

    proc = build("logprob")  # the whole emulator (checks.py loads it for every family): built once, before the runs
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, barriers))
    failures = []
    for (name, line), proc, seconds in results:
        out = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
        if proc.returncode != 0 or not out:
            failures.append(f"{name}:{line}: the check did not run:\n{(proc.stdout + proc.stderr)[-2000:]}")
            continue
        report = json.loads(out[-1][len("REPORT "):])
        if report["barriers"].get(f"{name}:{line}", 0):
            failures.append(f"{name}:{line}: still released the block: the skip did not apply")
            continue
        found = detected(report)
        print(f"{name}:{line} removed ({seconds:.0f} s): " + ("; ".join(found) if found else "NOT DETECTED"))
        if not any(report["hazards"].values()):
            failures.append(f"{name}:{line}: racecheck reported nothing ({found or 'nothing else either'})")
        trailing = ROW_TRAILING.get(name)
        src = (ROOT / "csrc" / "cuda" / name).read_text().splitlines()[line - 1]
        if trailing and trailing in src and "2" not in report["mismatch"] and "2" not in report["errors"]:
            failures.append(f"{name}:{line}: the warp-major schedule did not change the values: {found}")
    assert not failures, "\n".join(failures)
