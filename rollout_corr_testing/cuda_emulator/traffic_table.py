"""The traffic table of docs/cuda_kernels.md, measured by the emulator.

``python -m rollout_corr_testing.cuda_emulator.traffic_table`` runs every kernel at small shapes (the launchers' own
launch choices), fits the measured DRAM-level bytes of each launch to ``a * elements + b * rows + c`` (elements:
logits or tokens), checks the fit on a larger shape, and prints per kernel: bytes moved / minimum bytes, sectors per
request against the ideal, and the bandwidth-bound time at a realistic shape on an H100 and an H200.

Bytes moved = distinct 32-byte sectors read + distinct sectors written, times 32: the DRAM traffic with a cache
that keeps what a launch re-reads (the row constants every thread reads, the partial rows thread 0 updates) -- on
an H100 / H200 those few sectors per row stay in L1 / L2. Minimum bytes = each input byte the op needs read once
and each output byte written once (scratch excluded). Sectors per request: over all the launch's requests, with
Nsight Compute's ideal ceil(distinct bytes / 32) in brackets.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent.parent

#: Peak HBM bandwidth, bytes/s: H100 SXM5 (80 GB HBM3) and H200 (141 GB HBM3e), NVIDIA's datasheets.
GPUS = {"H100 SXM": 3.35e12, "H200": 4.8e12}


@dataclass
class Measured:
    moved: int  # (unique read sectors + unique write sectors) * 32
    minimum: int
    sectors: int
    ideal: int
    requests: int


def _stats(rec, kernel: str, minimum: int) -> Measured:
    (x,) = rec.launches(kernel)
    return Measured(moved=32 * (x.read.unique_sectors + x.write.unique_sectors), minimum=minimum,
                    sectors=x.read.sectors + x.write.sectors, ideal=x.read.ideal_sectors + x.write.ideal_sectors,
                    requests=x.read.requests + x.write.requests)


# ---- one measurement per kernel: (rows, columns) -> Measured ----------------------------------------------------------

def logprob_forward(rows: int, cols: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    x = torch.randn(rows, cols).bfloat16()
    t = torch.randint(0, cols, (rows,))
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.vocab_row_stats(x, t, 0, cols, 1.0, -100, False)
    return _stats(rec, "vocab_row_stats_kernel", rows * cols * 2 + rows * 8 + rows * 16)


def logprob_merge(rows: int, shards: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    emu = torch.ops.rollout_corr_emu
    x = torch.randn(rows, 64 * shards)
    t = torch.randint(0, 64 * shards, (rows,))
    recs = torch.stack([emu.vocab_row_stats(x[:, 64 * k: 64 * (k + 1)].contiguous(), t, 64 * k, 64 * shards, 1.0,
                                            -100, False) for k in range(shards)])
    with recorded_launches() as rec:
        emu.merge_row_stats(recs, t, -100, 64 * shards, 1.0, False)
    return _stats(rec, "merge_row_stats_kernel", shards * (64 + rows * 16) + rows * 8 + rows * 6 * 4)


def logprob_backward(rows: int, cols: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    emu = torch.ops.rollout_corr_emu
    x = torch.randn(rows, cols).bfloat16()
    t = torch.randint(0, cols, (rows,))
    _, _, _, state, _ = emu.merge_row_stats(emu.vocab_row_stats(x, t, 0, cols, 1.0, -100, False).unsqueeze(0), t,
                                            -100, cols, 1.0, False)
    g = torch.randn(rows)
    with recorded_launches() as rec:
        emu.logprob_backward(g, g, None, x, t, state, 0, cols, 1.0, -100)
    return _stats(rec, "logprob_backward_kernel", 2 * rows * cols * 2 + rows * (8 + 12 + 8))


def _policy_inputs(rows, cols):
    lp = -torch.rand(rows, cols)
    return lp, lp + 0.1 * torch.randn(rows, cols), torch.randn(rows, cols), torch.rand(rows, cols) > 0.2, \
        torch.rand(rows, cols) + 0.5


def policy_loss_rows(rows: int, cols: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    lp, old, adv, mask, w = _policy_inputs(rows, cols)
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.policy_loss_rows(lp, old, adv, mask, w, 0.2, 0.2, 3.0, 0)
    return _stats(rec, "policy_loss_rows_kernel", rows * cols * (17 + 4) + rows * 20)


def policy_loss_backward(rows: int, cols: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    lp, old, adv, mask, w = _policy_inputs(rows, cols)
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.policy_loss_backward(torch.randn(rows, cols), torch.randn(rows), lp, old, adv, mask,
                                                        w, 0.2, 0.2, 3.0, 0)
    return _stats(rec, "policy_loss_backward_kernel", rows * cols * (21 + 4) + rows * 4)


def _rollout(rows: int, cols: int):
    from rollout_corr_ext import RolloutCorrectionConfig
    from rollout_corr_ext.correction import op_args
    from rollout_corr_testing.cuda_emulator.records import recorded_launches
    from rollout_corr_testing.rc_testutil import make_inputs

    emu = torch.ops.rollout_corr_emu
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
                                  rollout_rs_threshold="0.7_1.3,0.02")
    lp, rlp, mask = make_inputs(rows, cols, seed=0, scale=0.2)
    a = op_args(cfg)
    with recorded_launches() as rec:
        st = emu.rollout_seq_stats(lp, rlp, mask, None, *a)
        w, m, sums, maxes = emu.rollout_token_pass(lp, rlp, mask, None, st, *a, True)
    return rec, st, sums, maxes


def rollout_seq_stats(rows: int, cols: int) -> Measured:
    rec, st, _, _ = _rollout(rows, cols)
    return _stats(rec, "rollout_seq_stats_kernel", rows * cols * 9 + st.numel() * 4)


def rollout_token_pass(rows: int, cols: int) -> Measured:
    rec, st, _, _ = _rollout(rows, cols)
    return _stats(rec, "rollout_token_pass_kernel", rows * cols * (9 + 4 + 1) + st.numel() * 4)


def rollout_reduce(rows: int, cols: int) -> Measured:
    rec, _, sums, maxes = _rollout(rows, cols)
    return _stats(rec, "rollout_reduce_partials_kernel", (sums.numel() + maxes.numel()) * 8)


def floor_fill(rows: int, cols: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    x = torch.randn(rows, cols).bfloat16()
    out = torch.empty_like(x)
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.floor_fill(x, torch.full((rows,), 0.5), 0.7, out)
    return _stats(rec, "floor_fill_kernel", 2 * rows * cols * 2 + rows * 4)


def mass_histogram(rows: int, cols: int) -> Measured:
    from rollout_corr_ext.sampling import _ordered_key, _probes
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    z = torch.randn(rows, cols) * 3
    z_max = z.amax(1)
    hi, lo = _ordered_key(z_max), _ordered_key(z_max - 64) - 1
    probes = _probes(lo, hi, 8, torch.float32)
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.mass_histogram(z, z_max, torch.full((rows,), -1.0), lo, hi, probes)
    return _stats(rec, "mass_histogram_kernel", rows * cols * 4 + rows * (255 * 8 + 256 * 8 + 4 + 4 + 8 + 8))


def row_candidates(rows: int, cols: int) -> Measured:
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).bfloat16()
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.row_candidates(x, torch.full((rows,), 50), torch.full((rows,), 7), 66, 0.7, cols)
    # the logits, k and target in; 66 candidates (value, column), the count and 3 stats out per row
    return _stats(rec, "row_candidates_kernel", rows * cols * 2 + rows * (16 + 66 * 12 + 8 + 24))


def candidate_decide(rows: int, width: int) -> Measured:
    import math

    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    g = torch.Generator().manual_seed(rows * width)
    cand = torch.randn(rows, width, generator=g)
    z_max = cand.double().amax(1)
    f64 = torch.float64
    with recorded_launches() as rec:
        torch.ops.rollout_corr_emu.candidate_decide(cand, z_max, cand[:, 0].double(), torch.full((rows,), 9.0, dtype=f64),
                                                    torch.full((rows,), 50), torch.full((rows,), -math.inf),
                                                    torch.full((rows,), 0.9, dtype=f64))
    # the lists and 5 per-row inputs (z_max, z_t, sum_all, k, top_p: 8 B; floor: 4 B) in; tau and 4 fp64 out
    return _stats(rec, "candidate_decide_kernel", rows * width * 4 + rows * (5 * 8 + 4) + rows * (4 + 32))


# kernel -> (measure, description of the inputs, small shapes (rows, cols) to fit on, check shape, realistic shape,
#            realistic shape's description, how elements count)
KERNELS: Dict[str, Tuple[Callable[[int, int], Measured], str, List[Tuple[int, int]], Tuple[int, int], Tuple[int, int],
                         str]] = {
    "vocab_row_stats_kernel": (logprob_forward, "bf16 logits", [(2, 4096), (4, 4096), (2, 8192)], (3, 12288),
                               (16384, 32768), "N = 16384 tokens, V = 32768 columns per shard"),
    "merge_row_stats_kernel": (logprob_merge, "fp32 records, R shards", [(64, 2), (128, 2), (64, 4)], (96, 3),
                               (16384, 8), "N = 16384, R = 8"),
    "logprob_backward_kernel": (logprob_backward, "bf16 logits and gradient", [(2, 4096), (4, 4096), (2, 8192)],
                                (3, 12288), (16384, 32768), "N = 16384, V = 32768"),
    "policy_loss_rows_kernel": (policy_loss_rows, "fp32 inputs + weights, bool mask", [(2, 512), (4, 512), (2, 1024)],
                                (3, 1536), (64, 8192), "B = 64, T = 8192"),
    "policy_loss_backward_kernel": (policy_loss_backward, "fp32, upstream [B, T] and [B]",
                                    [(2, 512), (4, 512), (2, 1024)], (3, 1536), (64, 8192), "B = 64, T = 8192"),
    "rollout_seq_stats_kernel": (rollout_seq_stats, "fp32 log-probs, bool mask", [(2, 512), (4, 512), (2, 1024)],
                                 (3, 1536), (64, 8192), "B = 64, T = 8192"),
    "rollout_token_pass_kernel": (rollout_token_pass, "fp32 log-probs, bool mask, token IS + 2 RS criteria",
                                  [(2, 512), (4, 512), (2, 1024)], (3, 1536), (64, 8192), "B = 64, T = 8192"),
    "rollout_reduce_partials_kernel": (rollout_reduce, "fp64 partial rows", [(2, 512), (4, 512), (2, 1024)],
                                       (3, 1536), (64, 8192), "B = 64 (64 partial rows)"),
    "floor_fill_kernel": (floor_fill, "bf16 logits", [(2, 4096), (4, 4096), (2, 8192)], (3, 12288), (16384, 32768),
                          "N = 16384, V = 32768"),
    "mass_histogram_kernel": (mass_histogram, "fp32 logits, 255 probes", [(2, 4096), (4, 4096), (2, 8192)],
                              (3, 12288), (16384, 32768), "N = 16384, V = 32768"),
    "row_candidates_kernel": (row_candidates, "bf16 logits, top-k 50, width 66", [(2, 4096), (4, 4096), (2, 8192)],
                              (3, 12288), (16384, 32768), "N = 16384, V = 32768"),
    "candidate_decide_kernel": (candidate_decide, "fp32 gathered lists, top-k 50, top-p 0.9",
                                [(32, 132), (64, 132), (32, 264)], (48, 396), (16384, 528),
                                "N = 16384, 8 shards of 66"),
}


def _fit(measure, shapes, check):
    """bytes = a * rows * cols + b * rows + c for both moved and minimum bytes; checked on `check`."""
    pts = [(r, c, measure(r, c)) for r, c in shapes]
    (r1, c1, m1), (r2, _, m2), (_, c3, m3) = pts

    def solve(f):
        b_plus_ac = (f(m2) - f(m1)) / (r2 - r1)  # a * c1 + b
        a = (f(m3) - f(m1)) / (r1 * (c3 - c1))
        b = b_plus_ac - a * c1
        c = f(m1) - a * r1 * c1 - b * r1
        return a, b, c

    moved, minimum = solve(lambda m: m.moved), solve(lambda m: m.minimum)
    m4 = measure(*check)
    predict = lambda co, r, c: co[0] * r * c + co[1] * r + co[2]  # noqa: E731
    err = abs(predict(moved, *check) - m4.moved) / m4.moved
    return moved, minimum, pts, m4, err


def table() -> str:
    rows = ["| kernel | inputs (realistic shape) | bytes moved / minimum | sectors per request [ideal] "
            "| model: bytes moved | " + " | ".join(f"{g} time" for g in GPUS) + " |",
            "|---|---|---|---|---|" + "---|" * len(GPUS)]
    for kernel, (measure, what, shapes, check, real, real_desc) in KERNELS.items():
        moved, minimum, pts, m4, err = _fit(measure, shapes, check)
        assert err < 0.01, f"{kernel}: the linear traffic model is off by {err:.2%} on {check}"
        r, c = real
        b_moved = moved[0] * r * c + moved[1] * r + moved[2]
        b_min = minimum[0] * r * c + minimum[1] * r + minimum[2]
        spr = m4.sectors / m4.requests
        ideal = m4.ideal / m4.requests
        unit = "elem" if "logit" in what or "records" in what or "lists" in what else "token"
        model = f"{moved[0]:.3g} B/{unit} + {moved[1]:.4g} B/row"
        if abs(moved[2]) >= 1:
            model += f" + {moved[2]:.0f} B"
        times = []
        for bw in GPUS.values():
            t = b_moved / bw
            times.append(f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms")
        rows.append(f"| `{kernel}` | {what} ({real_desc}) | {b_moved / b_min:.3f} "
                    f"({b_moved / 2**20:.1f} / {b_min / 2**20:.1f} MiB) | {spr:.2f} [{ideal:.2f}] | {model} | "
                    + " | ".join(times) + " |")
    return "\n".join(rows)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from rollout_corr_testing.cuda_emulator.loader import load_emulator

    load_emulator()
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
