"""The log-prob and policy-loss CUDA kernels, run thread by thread on the CUDA emulator (rollout_corr_testing/
cuda_emulator), against independent fp64 oracles (log_softmax on the gathered vocab for the log-prob family).

The emulator compiles csrc/cuda/*_kernels.cuh unchanged with g++; these tests sweep ragged sizes, every dtype,
block sizes, vector widths, the turnstile schedules (ascending, descending, warp-major: one warp a row ahead) and
grids smaller than the row count (grid-stride loops), with racecheck on in every launch. The self-test at the end
plants bugs in copies of the kernels and asserts that each one is caught. (Traffic and coalescing:
test_cuda_emulator_traffic.py; races and barriers: test_cuda_emulator_races.py.)
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout_corr_testing.cuda_emulator.loader import ROOT, load_emulator
from rollout_corr_testing.cuda_emulator.logprob_pipeline import emulated_log_probs, oracle_log_probs
from rollout_corr_testing.cuda_emulator.mutants import MUTANTS
from rollout_corr_testing.tolerances import grad_tol, output_tol


@pytest.fixture(scope="module")
def emu():
    load_emulator()
    return torch.ops.rollout_corr_emu


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# (rows, shard widths, vocab_size): ragged vocab (not a multiple of the vector width), a padded single shard, two
# shards, single-token rows, a second shard that is all padding.
CASES = [
    (5, [203], 203),
    (3, [96], 90),
    (4, [64, 64], 128),
    (1, [1], 1),
    (2, [40, 40], 40),
    (6, [130, 67], 190),
]
KNOBS = [
    dict(),  # the launcher's own choices
    dict(threads=32, vec=1, schedule=1, max_blocks=2),
    dict(threads=64, schedule=1),
    dict(threads=128, vec=1, max_blocks=1),
    dict(threads=64, schedule=2, max_blocks=2),  # warp-major: the last warp runs a row ahead
]
MERGE_KNOBS = [dict(), dict(threads=32, schedule=1, max_blocks=1)]


def _inputs(rows, widths, vocab_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, sum(widths), generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, vocab_size, (rows,), generator=g)
    if rows > 1:
        t[rows // 2] = -100  # an ignored row
    shards = list(torch.split(full, widths, dim=-1))
    return full, [s.contiguous() for s in shards], t


@pytest.mark.parametrize("dtype", DTYPES)
def test_pipeline_matches_log_softmax_for_every_launch_shape(emu, dtype):
    """Row stats, merge and backward (out of place and in place) under every launch knob, against the fp64 oracle."""
    temperature = 0.8
    for i, (rows, widths, vsize) in enumerate(CASES):
        full, shards, t = _inputs(rows, widths, vsize, dtype, seed=i)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        g_lp, g_h, g_mz = (torch.randn(rows, dtype=acc) for _ in range(3))
        want = oracle_log_probs(full, t, vsize, temperature, g_lp, g_h, g_mz)
        for k, knobs in enumerate(KNOBS):
            got = emulated_log_probs(shards, t, vsize, temperature, g_lp, g_h, g_mz, stats_knobs=knobs,
                                     merge_knobs=MERGE_KNOBS[k % 2], backward_knobs=knobs, inplace=k == 3)
            for name, a, b in zip(("logp", "entropy", "mean_logp"), got, want):
                torch.testing.assert_close(a.double(), b, **output_tol(dtype),
                                           msg=lambda m, n=name: f"case {i} knobs {knobs} {n}: {m}")
            grad = got[3].double()
            torch.testing.assert_close(grad[:, :vsize], want[3][:, :vsize], **grad_tol(dtype),
                                       msg=lambda m: f"case {i} knobs {knobs} gradient: {m}")
            assert torch.all(grad[:, vsize:] == 0), "padding columns get exactly zero gradient"


def test_full_pipeline_on_the_emulator_with_logprob_only(emu):
    """The forward without the mean term (the plain log-prob call) and a gradient of the log-probs only."""
    torch.manual_seed(0)
    full = torch.randn(9, 300, dtype=torch.float64) * 2
    t = torch.randint(0, 290, (9,))
    shards = [full[:, :150].float().contiguous(), full[:, 150:].float().contiguous()]
    got = emulated_log_probs(shards, t, 290, 1.0, torch.ones(9), None, None)
    want = oracle_log_probs(full, t, 290, 1.0, torch.ones(9), None, None)
    torch.testing.assert_close(got[0].double(), want[0], **output_tol(torch.float32))
    torch.testing.assert_close(got[1].double(), want[1], **output_tol(torch.float32))
    torch.testing.assert_close(got[3].double()[:, :290], want[3][:, :290], **grad_tol(torch.float32))


def test_misaligned_rows_take_the_scalar_path(emu):
    """A row stride that breaks 16-byte alignment must not use vector loads (the launcher picks vec=1)."""
    base = torch.randn(4, 131)
    x = base[:, 1:130]  # row stride 131 floats, base offset 1 float: misaligned
    t = torch.randint(0, 129, (4,))
    with pytest.raises(RuntimeError, match="needs 16-byte aligned rows"):
        emu.vocab_row_stats(x, t, 0, 129, 1.0, -100, False, vec=4)
    got = emulated_log_probs([x], t, 129, 1.0, torch.ones(4), None, None)
    want = oracle_log_probs(x, t, 129, 1.0, torch.ones(4), None, None)
    torch.testing.assert_close(got[0].double(), want[0], **output_tol(torch.float32))
    torch.testing.assert_close(got[3].double(), want[3], **grad_tol(torch.float32))


def test_emulator_reports_barrier_divergence(emu):
    """synccheck: a __syncthreads reached by half the block, a full-mask shuffle reached by 8 lanes of 32, and the two
    halves of a block waiting at different __syncthreads statements are errors naming the kernel, the barrier's
    line and the threads, not silent passes (rollout_corr_testing/cuda_emulator/emu_selftest.cpp)."""
    half = emu.selftest_divergence(0)
    assert "deadlock or divergent synchronisation in selftest::half_block_barrier_kernel block (0,0,0)" in half
    assert "synccheck: __syncthreads at emu_selftest.cpp:" in half
    assert "reached by threads 0-15 only; threads 16-63 exited" in half
    assert "deadlock or divergent synchronisation" in emu.selftest_divergence(1)
    split = emu.selftest_divergence(2)
    assert "divergent __syncthreads" in split and "threads 0-31 at emu_selftest.cpp:" in split, split
    assert "threads 32-63 at emu_selftest.cpp:" in split, split


def test_emulator_device_api_semantics(emu):
    """The emulated device API itself: dynamic shared memory, __shfl_down/up/sync, __syncwarp, atomics, 2-D blocks."""
    r = emu.selftest_device_api()
    assert abs(r[0] - r[1]) < 1e-3 and r[2] == 3
    lanes = [int(v) for v in r[3:]]
    for t, v in enumerate(lanes):
        lane = t % 32
        assert v // 1000 == 30 and v % 1000 == (lane - 1 if lane > 0 else 0), (t, v)


@pytest.mark.slow
def test_planted_bugs_are_caught():
    """Each mutant of MUTANTS (wrong shuffle offsets, off-by-one bounds and ranks, a wrong comparison) is detected
    (removed barriers: test_cuda_emulator_races.py::test_every_syncthreads_is_necessary)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(name):
        proc = subprocess.run([sys.executable, "-m", "rollout_corr_testing.cuda_emulator.mutants", name], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=900)
        return name, proc

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, sorted(MUTANTS)))
    for name, proc in results:
        tail = (proc.stdout + proc.stderr)[-3000:]
        assert proc.returncode == 0 and f"DETECTED {name}" in proc.stdout, f"mutant {name} was not caught:\n{tail}"
        print(proc.stdout.strip().splitlines()[-1])  # why it was caught (shown with -s or -rP)
