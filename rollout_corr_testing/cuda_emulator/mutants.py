"""Planted bugs: the emulator must catch each one (docs/cuda_kernels.md, issue: "it proves it can fail").

``python -m rollout_corr_testing.cuda_emulator.mutants NAME`` copies the kernel headers into a temp folder, applies one
mutation, builds the emulator against the mutated copy, runs the check that the mutation should break, and
exits 0 when the bug was detected (wrong values or an emulator error), 1 when it slipped through.
Each mutant runs in its own process: a broken kernel may crash, and each build registers the same op names.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CUDA_DIR = ROOT / "csrc" / "cuda"

#: name -> (file under csrc/cuda, text to find (must occur), replacement, check function name). A removed
#: ``__syncthreads()`` is not planted here: tests/test_cuda_emulator_races.py disables every barrier of every kernel
#: file in turn (the emulator's skip_barrier, on the one shared build) and requires the emulator to catch each.
MUTANTS = {
    # Butterfly that starts at offset 8 instead of 16: the two half-warps are never merged.
    "wrong_shuffle_offset": (
        "logprob_kernels.cuh",
        "for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {\n    RowSummary<acc_t> other;",
        "for (int offset = kWarpSize / 4; offset > 0; offset /= 2) {\n    RowSummary<acc_t> other;",
        "check_row_stats_multiwarp",
    ),
    # Off-by-one column bound: the row sweep also reads the first padding column.
    "off_by_one_bound": (
        "logprob_kernels.cuh",
        "for (int64_t c = num_vec * kVec + threadIdx.x; c < p.valid_cols; c += blockDim.x) {",
        "for (int64_t c = num_vec * kVec + threadIdx.x; c <= p.valid_cols; c += blockDim.x) {",
        "check_row_stats_padded",
    ),
    # The warp prefix sum's shuffle ladder starting at offset 2 (odd lanes never add their left neighbour): wrong
    # slots for the gathered candidates, wrong bins in the radix scans.
    "sampling_wrong_shuffle_offset": (
        "sampling_kernels.cuh",
        "for (int offset = 1; offset < kWarpSize; offset *= 2) {",
        "for (int offset = 2; offset < kWarpSize; offset *= 2) {",
        "check_sampling_candidates",
    ),
    # Off-by-one column bound of row_candidates' read: the first padding column enters the max, sum and candidates.
    "sampling_off_by_one_bound": (
        "sampling_kernels.cuh",
        "        if (c >= p.cols) break;",
        "        if (c > p.cols) break;",
        "check_sampling_padded",
    ),
    # The top-p cut's weighted select leaving out the values tied with the k-th largest (> for >=): it then
    # weighs fewer survivors than the budget was taken from.
    "sampling_top_p_survivors": (
        "sampling_kernels.cuh",
        "const bool surv = v >= tau_k && v != ninf;",
        "const bool surv = v > tau_k && v != ninf;",
        "check_sampling_decide",
    ),
    # Off-by-one rank: the (k + 1)-th candidate taken as the k-th largest (the tied run at the list's end is cut
    # at the wrong value).
    "sampling_off_by_one_rank": (
        "sampling_kernels.cuh",
        "const uint64_t kth_hi = buf[k - 1] >> 32;",
        "const uint64_t kth_hi = buf[k] >> 32;",
        "check_sampling_candidates",
    ),
}


def make_mutant_dir(name: str, dest: Path) -> Path:
    file, old, new, _ = MUTANTS[name]
    for src in CUDA_DIR.glob("*.cuh"):
        shutil.copy(src, dest / src.name)
    text = (dest / file).read_text()
    if text.count(old) < 1:
        raise RuntimeError(f"mutant {name}: the text to mutate is no longer in {file}; update MUTANTS")
    (dest / file).write_text(text.replace(old, new, 1))
    return dest


def _inputs(rows, cols, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, cols, (rows,), generator=g)
    return x.float(), t


def _row_stats_mismatch(x, t, vocab_size, **knobs) -> str:
    """The forward values a user gets (row stats under the given launch knobs, then merge) vs the fp64 oracle."""
    import torch

    from rollout_corr_testing.cuda_emulator.logprob_pipeline import emulated_log_probs, oracle_log_probs

    ones = torch.ones(x.shape[0])
    got = emulated_log_probs([x], t, vocab_size, 1.0, ones, ones, ones, stats_knobs=knobs)
    want = oracle_log_probs(x, t, vocab_size, 1.0, ones, ones, ones)
    for name, a, b in zip(("logp", "entropy", "mean_logp"), got, want):
        try:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4)
        except AssertionError as e:
            return f"{name}: {str(e).splitlines()[0]}"
    return ""


def check_row_stats_multiwarp() -> str:
    x, t = _inputs(6, 4096)
    for schedule in (0, 1):
        why = _row_stats_mismatch(x, t, 4096, threads=256, schedule=schedule)
        if why:
            return f"schedule {schedule}: {why}"
    return ""


def check_row_stats_padded() -> str:
    x, t = _inputs(5, 100)
    t = t.clamp(max=96)
    return _row_stats_mismatch(x, t, 97, threads=32, vec=1)


def _sampling_mismatch(x, k, tc, width, temperature, valid, **knobs) -> str:
    """row_candidates under the given launch knobs vs the contract's row-by-row oracle."""
    import torch

    from rollout_corr_testing.sampling_kernel_oracles import row_candidates_oracle

    got = torch.ops.rollout_corr_emu.row_candidates(x, k, tc, width, temperature, valid, **knobs)
    want = row_candidates_oracle(x, k, tc, width, temperature, valid)
    full = want[2] <= width
    for name, a, b in (("count", got[2], want[2]), ("values", got[0][full], want[0][full]),
                       ("index", got[1][full], want[1][full])):
        if not torch.equal(a, b):
            return f"row_candidates {name}: {a.tolist()[:4]} != {b.tolist()[:4]}"
    try:
        torch.testing.assert_close(got[3], want[3], rtol=2e-6, atol=0, equal_nan=True)
    except AssertionError as e:
        return f"row_candidates stats: {str(e).splitlines()[0]}"
    return ""


def check_sampling_candidates() -> str:
    import torch

    from rollout_corr_testing.sampling_kernel_oracles import rows_with_edges

    k = torch.tensor([5, 1, 40, 17, 3, 64])
    tc = torch.tensor([0, -1, 7, 100, 3, 9])
    for grid in (False, True):  # distinct values, and ties on a half-integer grid
        x = rows_with_edges(6, 1500, torch.float32, seed=3, grid=grid)
        for schedule in (0, 1):
            why = _sampling_mismatch(x, k, tc, 80, 1.0, 1500, threads=128, schedule=schedule)
            if why:
                return f"grid {grid}, schedule {schedule}: {why}"
    return ""


def check_sampling_decide() -> str:
    """candidate_decide on gathered lists with ties (a grid), top-k and top-p, vs the contract's oracle."""
    import math

    import torch

    from rollout_corr_testing.sampling_kernel_oracles import candidate_decide_oracle

    g = torch.Generator().manual_seed(5)
    n, width = 20, 32
    cand = (torch.randn(n, width, generator=g, dtype=torch.float64) * 2).round().sort(dim=1, descending=True).values
    z_max = cand[:, 0].clone()
    args = (cand.float(), z_max, cand[:, 1].clone(), (cand - z_max.unsqueeze(1)).exp().sum(1) + 1.0,
            torch.randint(2, width, (n,), generator=g), torch.full((n,), -math.inf),
            torch.tensor([0.9, 0.5, 0.3, 0.7] * 5, dtype=torch.float64))
    want_tau, want_out = candidate_decide_oracle(*args)
    for schedule in (0, 1):
        tau, out = torch.ops.rollout_corr_emu.candidate_decide(*args, threads=64, schedule=schedule)
        if not torch.equal(tau, want_tau):
            bad = (tau != want_tau).nonzero().flatten().tolist()
            return f"schedule {schedule}: tau differs in rows {bad}"
    return ""


def check_sampling_padded() -> str:
    import torch

    from rollout_corr_testing.sampling_kernel_oracles import rows_with_edges

    x = rows_with_edges(4, 200, torch.float32, seed=4)
    x[:, 197:] = 1000.0  # padding columns: never read
    k = torch.tensor([3, 5, 7, 2])
    return _sampling_mismatch(x, k, torch.tensor([1, 2, 3, 4]), 16, 1.0, 197, threads=64)


def main(name: str) -> int:
    import torch  # noqa: F401

    from rollout_corr_testing.cuda_emulator.loader import load_emulator

    with tempfile.TemporaryDirectory() as tmp:
        # Build only the emulated family the check exercises: each mutant is a separate (slow) compile.
        family = "emu_" + MUTANTS[name][0].replace("_kernels.cuh", ".cpp")
        load_emulator(kernel_override_dir=str(make_mutant_dir(name, Path(tmp))), sources=[family])
        try:
            why = globals()[MUTANTS[name][3]]()
        except Exception as e:  # noqa: BLE001 - an emulator error is a detection
            why = f"{type(e).__name__}: {e}"
    if why:
        print(f"DETECTED {name}: {why}")
        return 0
    print(f"MISSED {name}")
    return 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1]))
