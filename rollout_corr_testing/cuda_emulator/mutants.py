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

#: name -> (file under csrc/cuda, text to find (must occur), replacement, check function name)
MUTANTS = {
    # The barrier between the per-warp partials written to shared memory and warp 0 reading them.
    "missing_syncthreads": (
        "logprob_kernels.cuh",
        "    __syncthreads();\n    if (warp == 0) {",
        "    if (warp == 0) {",
        "check_row_stats_multiwarp",
    ),
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
    # The same barrier in the policy-loss row reduction (warp 0 would read other warps' partials unwritten).
    "policy_loss_missing_syncthreads": (
        "policy_loss_kernels.cuh",
        "    __syncthreads();\n    if (warp == 0) {",
        "    if (warp == 0) {",
        "check_policy_loss_multiwarp",
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


def check_policy_loss_multiwarp() -> str:
    import torch

    from rollout_corr_ext import fallback

    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 300, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(4, 300, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 300, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 300, generator=g) > 0.2
    inputs = (lp.float(), old.float(), adv.float())
    _, ref = fallback.policy_loss_rows(*(x.double() for x in inputs), mask, None, 0.2, 0.2, 3.0, 0)
    for schedule in (0, 1):
        _, rows = torch.ops.rollout_corr_emu.policy_loss_rows(*inputs, mask, None, 0.2, 0.2, 3.0, 0, threads=128,
                                                               schedule=schedule)
        try:
            torch.testing.assert_close(rows.double(), ref, rtol=2e-5, atol=1e-4)
        except AssertionError as e:
            return f"schedule {schedule}: {str(e).splitlines()[0]}"
    return ""


def main(name: str) -> int:
    import torch  # noqa: F401

    from rollout_corr_testing.cuda_emulator.loader import load_emulator

    with tempfile.TemporaryDirectory() as tmp:
        # Build only the emulated family the check exercises: each mutant is a separate (slow) compile.
        family = "emu_policy_loss.cpp" if "policy_loss" in MUTANTS[name][3] else "emu_logprob.cpp"
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
