"""Independent oracles of the sampling-replay ops (contracts: csrc/ops.cpp, "§5 sampling replay"), written row by row
in Python from the contracts, never from a kernel: ``mass_histogram`` with ``math.exp`` and ``bisect``,
``row_candidates`` and ``candidate_decide`` with sorted Python lists and ``math.fsum``. Shared by the CPU kernels'
tests (tests/test_sampling_kernels.py), the emulated CUDA kernels' (tests/test_cuda_emulator_sampling.py) and the
emulator's race checks (cuda_emulator/checks.py).

Test infrastructure: imports nothing from ``rollout_corr_ext``.
"""

from __future__ import annotations

import bisect
import math

import torch


def rows_with_edges(n, v, dtype, seed, grid=False):
    """[n, v] logits (N(0, 9), on a half-integer grid when ``grid``: many ties) with -inf in row 0's first 7
    columns and a row 1 of -inf only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    if grid:
        x = (x * 2).round() / 2  # many ties
    x[0, :7] = -math.inf
    x[1] = -math.inf  # a row of -inf only
    return x.to(dtype)


def acc_dtype(dtype):
    """The dtype the ops compare and accumulate in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mass_histogram_oracle(z, z_max, floor, lo, hi, probes):
    """Per value: its key (the float's bits, order-preserving), inside (lo, hi] and >= floor, mass
    round(e^(z - z_max) 2^40) with math.exp, bucket = #{probes < key} by bisect."""
    import struct

    n, v = z.shape
    out = torch.zeros((n, probes.shape[1] + 1), dtype=torch.int64)
    wide = z.dtype == torch.float64
    for r in range(n):
        pr = probes[r].tolist()
        for c in range(v):
            val = float(z[r, c])
            if math.isnan(val) or val == -math.inf or not val >= float(floor[r]):
                continue
            val = val + 0.0
            if wide:
                bits = struct.unpack("<q", struct.pack("<d", val))[0]
                key = bits ^ 0x7FFFFFFFFFFFFFFF if bits < 0 else bits
            else:
                bits = struct.unpack("<i", struct.pack("<f", val))[0]
                key = bits ^ 0x7FFFFFFF if bits < 0 else bits
            if not (int(lo[r]) < key <= int(hi[r])):
                continue
            rel = val - float(z_max[r])
            mass = 0 if rel < -60 else round(math.exp(rel) * 2.0 ** 40)
            out[r, bisect.bisect_left(pr, key)] += mass
    return out


def row_candidates_oracle(x, k, target_col, width, temperature, valid_cols):
    """``row_candidates`` from its contract, a row at a time in Python: z = x / T in fp32 (fp64 for fp64), the
    values at or above the k-th largest finite one sorted by (value descending, column ascending), the count, and
    max / sum exp / the target's z."""
    acc = acc_dtype(x.dtype)
    z = x[:, :valid_cols].to(acc)
    if temperature != 1.0:
        z = z / torch.tensor(temperature, dtype=acc)
    n = x.shape[0]
    values = torch.full((n, width), -math.inf, dtype=acc)
    index = torch.full((n, width), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    stats = torch.zeros(n, 3, dtype=torch.float64)
    for r in range(n):
        stats[r, 2] = -math.inf
        if int(k[r]) <= 0:
            stats[r, 0] = -math.inf
            continue
        row = [float(v) for v in z[r]]
        if 0 <= int(target_col[r]) < valid_cols:
            stats[r, 2] = row[int(target_col[r])]
        if any(math.isnan(v) or v == math.inf for v in row):
            stats[r, 0] = math.nan
            continue
        finite = sorted(((v, c) for c, v in enumerate(row) if v != -math.inf), key=lambda p: (-p[0], p[1]))
        if not finite:
            stats[r, 0] = -math.inf
            continue
        m = finite[0][0]
        stats[r, 0] = m
        stats[r, 1] = math.fsum(math.exp(v - m) for v, _ in finite)
        kk = int(k[r])
        kth = finite[kk - 1][0] if len(finite) >= kk else -math.inf
        cand = [p for p in finite if p[0] >= kth]
        count[r] = len(cand)
        for i, (v, c) in enumerate(cand[:width]):
            values[r, i] = v
            index[r, i] = c
    return values, index, count, stats


def candidate_decide_oracle(cand, z_max, z_t, sum_all, k, floor, top_p):
    """``candidate_decide`` from its contract, a row at a time with Python numbers: tau from min-p's floor, the k-th
    candidate and vLLM's top-p rule in integer masses; the target's log-prob, the kept set's entropy, log S and
    log_kept = log sum_kept exp(z - z_max), every log-prob relative to z_max."""
    n = cand.shape[0]
    tau = torch.full((n,), -math.inf, dtype=cand.dtype)
    out = torch.zeros(n, 4, dtype=torch.float64)
    for r in range(n):
        if int(k[r]) <= 0:
            continue
        c = [float(v) for v in cand[r]]
        m = float(z_max[r])
        t = max(float(floor[r]), c[int(k[r]) - 1])
        if float(top_p[r]) < 1:
            surv = [v for v in c if v >= t and v != -math.inf]
            mass = {v: 0 for v in surv}
            for v in surv:
                mass[v] += round(math.exp(v - m) * 2 ** 40) if v - m >= -60 else 0
            total = sum(mass.values())
            budget = min(math.floor((1 - float(top_p[r])) * total), total - 1)
            below = 0
            for v in sorted(mass):  # ascending: the smallest v with M(<= v) > budget
                below += mass[v]
                if below > budget:
                    t = max(t, v)
                    break
        kept = [v for v in c if v >= t and v != -math.inf]
        log_kept = math.log(math.fsum(math.exp(v - m) for v in kept))
        h = -math.fsum(math.exp((v - m) - log_kept) * ((v - m) - log_kept) for v in kept)
        tau[r] = t
        zt = float(z_t[r])
        out[r, 0] = (zt - m) - log_kept if zt >= t and zt != -math.inf else -math.inf
        out[r, 1] = h
        out[r, 2] = min(log_kept - math.log(float(sum_all[r])), 0.0)
        out[r, 3] = log_kept
    return tau, out


def scatter_rows_case(dtype):
    """``(values [6, 5], index [6, 5], want [6, 40] fp64)`` for ``scatter_rows(values, index, 40, dtype)``: random
    distinct columns per row, a partly and a wholly ignored row (index -1), the expected rows written one by one."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(6, 5, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    index = torch.stack([torch.randperm(40, generator=g)[:5] for _ in range(6)])
    index[2, 3:] = -1
    index[4] = -1
    want = torch.zeros(6, 40, dtype=torch.float64)
    for r in range(6):
        for w in range(5):
            if index[r, w] >= 0:
                want[r, index[r, w]] = float(values[r, w])
    return values, index, want
