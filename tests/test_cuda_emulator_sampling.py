"""The sampling-replay CUDA kernels (csrc/cuda/sampling_kernels.cuh), run thread by thread on the CUDA emulator
(through the launchers' own host driver, sampling_launch.cuh), against the independent oracles the CPU kernels are
held to (rollout_corr_testing/sampling_kernel_oracles.py: row-by-row Python from the contracts in csrc/ops.cpp),
and against the CPU kernels themselves where the contract makes the result exact (candidate lists, thresholds,
integer masses).

Every dtype, -inf, NaN / +inf rows, ignored rows, ties (a half-integer grid, a row of one repeated value), partial
tiles, candidate lists that overflow their width, rows with more tied values than the kernel's shared-memory buffer
(its exact route), strided rows, and the launch knobs: block sizes, the four turnstile schedules (racecheck on in
every launch), grids smaller than the row count. Races and barriers: test_cuda_emulator_races.py (the "sampling"
family); memory traffic: test_cuda_emulator_traffic.py; planted bugs: mutants.py (test_cuda_emulator.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext import ops
from rollout_corr_ext.sampling import _ordered_key, _probes
from rollout_corr_testing.cuda_emulator.loader import load_emulator
from rollout_corr_testing.sampling_kernel_oracles import (acc_dtype, candidate_decide_oracle, mass_histogram_oracle,
                                                          row_candidates_oracle, rows_with_edges, scatter_rows_case)

pytestmark = pytest.mark.skipif(rc.backend() == "fallback", reason="the emulator and the CPU kernels it is compared "
                                "with need the compiled extension (ROLLOUT_CORR_FORCE_FALLBACK=1 is set)")


@pytest.fixture(scope="module")
def emu():
    load_emulator()
    return torch.ops.rollout_corr_emu


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
KNOBS = [
    dict(),  # the launcher's own choices
    dict(threads=64, schedule=1, max_blocks=2),  # several rows per block, descending turnstile
    dict(threads=128, schedule=2, max_blocks=3),  # warp-major: the last warp runs ahead
    dict(threads=32, schedule=3),  # one warp
]


def _ids(knobs):
    return ",".join(f"{k}={v}" for k, v in knobs.items()) or "launcher"


# ---- floor_fill, floor_zero_, count_at_least, scatter_rows ---------------------------------------------------------

def _under(x, floor, temperature, r, c):
    """The contract's rule, one element: z = x / T in the accumulation dtype (x itself at T = 1) below the floor."""
    acc = acc_dtype(x.dtype)
    z = x[r, c].to(acc) if temperature == 1.0 else x[r, c].to(acc) / torch.tensor(temperature, dtype=acc)
    return bool(z < floor[r])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_floor_fill_and_floor_zero(emu, dtype, temperature):
    """floor_fill: -inf exactly where z is under the row's floor, x elsewhere (out of place, in place, strided rows);
    floor_zero_: the gradient zeroed there and untouched elsewhere."""
    x = rows_with_edges(6, 130, dtype, seed=3)  # 130: a partial warp step at the end of each row
    x[2, 4] = float("nan")  # NaN is never under a floor: kept
    acc = acc_dtype(dtype)
    floor = torch.tensor([0.5, -math.inf, 1.0, 2.0, -1.0, 10.0], dtype=acc)
    under = torch.tensor([[_under(x, floor, temperature, r, c) for c in range(130)] for r in range(6)])
    want = torch.where(under, torch.full((), -math.inf, dtype=dtype), x)
    grad0 = torch.randn(6, 130, generator=torch.Generator().manual_seed(1)).to(dtype)
    for knobs in KNOBS:
        before = x.clone()
        out = torch.full_like(x, float("nan"))
        emu.floor_fill(x, floor, temperature, out, **knobs)
        assert torch.equal(x.nan_to_num(7.0), before.nan_to_num(7.0))  # the input is read only
        assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0)), _ids(knobs)
        grad = grad0.clone()
        emu.floor_zero_(grad, x, floor, temperature, **knobs)
        assert torch.equal(grad, torch.where(under, torch.zeros((), dtype=dtype), grad0)), _ids(knobs)
    inplace = x.clone()
    emu.floor_fill(inplace, floor, temperature, inplace, threads=64)
    assert torch.equal(inplace.nan_to_num(7.0), want.nan_to_num(7.0))
    wide = torch.cat([x, x], 1)[:, 10:140]  # strided rows (a column slice), written into a strided output
    dest = torch.zeros(6, 300, dtype=dtype)[:, 5:135]
    emu.floor_fill(wide, floor, temperature, dest, threads=32, max_blocks=2)
    assert torch.equal(dest.nan_to_num(7.0), fallback_floor_fill(wide, floor, temperature).nan_to_num(7.0))


def fallback_floor_fill(x, floor, temperature):
    from rollout_corr_ext import fallback

    out = torch.empty_like(x)
    fallback.floor_fill(x, floor, temperature, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_count_at_least(emu, dtype):
    z = rows_with_edges(6, 150, dtype, seed=9, grid=True)
    z[3, 7] = float("nan")
    floor = torch.tensor([0.0, -math.inf, 0.5, 1.0, -10.0, math.inf], dtype=acc_dtype(dtype))
    want = torch.tensor([sum(float(v) >= float(floor[r]) for v in z[r]) for r in range(6)], dtype=torch.int64)
    for knobs in KNOBS:
        assert torch.equal(emu.count_at_least(z, floor, **knobs), want), _ids(knobs)
    assert torch.equal(emu.count_at_least(z[:, 20:100], floor, threads=64), torch.tensor(
        [sum(float(v) >= float(floor[r]) for v in z[r, 20:100]) for r in range(6)], dtype=torch.int64))
    assert emu.count_at_least(z[:0], floor[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_rows(emu, dtype):
    values, index, want = scatter_rows_case(dtype)
    for knobs in KNOBS:
        got = emu.scatter_rows(values, index, 40, dtype, **knobs)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), _ids(knobs)
    with pytest.raises(RuntimeError, match="an index is >= cols = 5"):
        emu.scatter_rows(torch.ones(2, 2), torch.tensor([[0, 9], [1, -1]]), 5, torch.float32)
    assert emu.scatter_rows(values[:0], index[:0], 9, dtype).shape == (0, 9)


@pytest.mark.parametrize("impl", ["emulated", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_column_views_keep_their_row_stride(emu, impl, dtype):
    """A one-column view of wider rows (x[:, :1], stride (2, 1): a one-column vocab shard as a view) is read and
    written at its row stride by every op (before: the stride was taken as 1 for one column, so row r read element r
    of the storage, and floor_fill / floor_zero_ wrote into the hidden column)."""
    lib = emu if impl == "emulated" else torch.ops.rollout_corr
    acc = acc_dtype(dtype)
    base = torch.tensor([[1.0, 100.0], [2.0, 100.0], [3.0, 100.0]], dtype=dtype)
    x = base[:, :1]
    col = x.contiguous()
    assert torch.equal(lib.row_topk(x, 1), col.to(acc))
    k, tcol = torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    if dtype != torch.float64:  # (fp64 takes the torch path, not this op)
        got, want = lib.row_candidates(x, k, tcol, 1, 1.0, 1), lib.row_candidates(col, k, tcol, 1, 1.0, 1)
        assert torch.equal(got[0].reshape(-1), col.reshape(-1).to(got[0].dtype))
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert lib.count_at_least(x, torch.full((3,), 50.0, dtype=acc)).tolist() == [0, 0, 0]
    floor = torch.full((3,), 1.5, dtype=acc)
    out_base = torch.full((3, 2), 7.0, dtype=dtype)
    lib.floor_fill(x, floor, 1.0, out_base[:, :1])
    assert out_base[:, 0].tolist() == [-math.inf, 2.0, 3.0] and out_base[:, 1].tolist() == [7.0] * 3
    grad_base = torch.full((3, 2), 5.0, dtype=dtype)
    lib.floor_zero_(grad_base[:, :1], x, floor, 1.0)
    assert grad_base[:, 0].tolist() == [0.0, 5.0, 5.0] and grad_base[:, 1].tolist() == [5.0] * 3
    z_max = col.reshape(-1).to(acc)
    lo = _ordered_key(torch.full((3,), 0.5, dtype=acc))
    hi = _ordered_key(torch.full((3,), 4.0, dtype=acc))
    probes = _probes(lo, hi, 2, acc)
    hist = lib.mass_histogram(x, z_max, torch.full((3,), -math.inf, dtype=acc), lo, hi, probes)
    assert int(hist.sum()) > 0 and torch.equal(
        hist, lib.mass_histogram(col, z_max, torch.full((3,), -math.inf, dtype=acc), lo, hi, probes))


# ---- the general search: row_topk, mass_histogram ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 5, 51, 300])
def test_row_topk(emu, dtype, k):
    """The k largest of each row (NaN never one of them), descending, -inf after a row's values: torch.topk of the
    row with NaN as -inf; ties, -inf, strided rows, fewer columns than k."""
    acc = acc_dtype(dtype)
    for grid in (False, True):
        x = rows_with_edges(9, 257, dtype, seed=k, grid=grid)
        x[3, 100] = float("nan")
        xa = x.to(acc)
        ref = xa.masked_fill(torch.isnan(xa), -math.inf).topk(min(k, 257), dim=-1).values
        if k > 257:
            ref = torch.cat([ref, ref.new_full((9, k - 257), -math.inf)], 1)
        for knobs in KNOBS[1:] if grid else KNOBS[:2]:
            out = emu.row_topk(x, k, **knobs)
            assert out.dtype == acc and out.shape == (9, k)
            assert torch.equal(out, ref), (dtype, k, grid, _ids(knobs))
    wide = rows_with_edges(4, 300, dtype, seed=1)
    assert torch.equal(emu.row_topk(wide[:, 50:90], 8, threads=64), wide[:, 50:90].to(acc).topk(8, dim=-1).values)
    short = emu.row_topk(wide[:, :3], 5, threads=32)
    assert torch.equal(short[:, :3], wide[:, :3].to(acc).topk(3, dim=-1).values)
    assert torch.equal(short[:, 3:], torch.full((4, 2), -math.inf, dtype=acc))
    assert emu.row_topk(torch.empty(0, 10, dtype=dtype), 3).shape == (0, 3)


def test_row_topk_beyond_the_shared_buffer(emu):
    """k above the kernel's shared-memory sort (kTopkCap = 4096) takes torch.topk on the same device: same result."""
    x = rows_with_edges(2, 5000, torch.float32, seed=2)
    got = emu.row_topk(x, 4500)
    assert torch.equal(got, x.topk(4500, dim=-1).values)


def _mass_inputs(dtype, levels, seed):
    acc = acc_dtype(dtype)
    z = rows_with_edges(5, 200, dtype, seed=seed, grid=True)
    z[1] = 1.5  # one repeated value (a tie of the whole row)
    z[2, 11] = float("nan")
    za = z.to(acc)
    z_max = za.nan_to_num(-math.inf).amax(1)
    floor = torch.tensor([-math.inf, -math.inf, 0.0, -2.0, -math.inf], dtype=acc)
    hi = _ordered_key(z_max)
    lo = _ordered_key(z_max - 64) - 1
    lo[3], hi[3] = _ordered_key(torch.tensor(-1.0, dtype=acc)), _ordered_key(torch.tensor(2.5, dtype=acc))
    return z, za, z_max, floor, lo, hi, _probes(lo, hi, levels, acc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("levels", [4, 8, 12])
def test_mass_histogram(emu, dtype, levels):
    """Against the math.exp / bisect oracle (a mass may round the other way where the kernels' exp, within 2 ulp,
    and math.exp straddle a half: at most 1 per value, rarely); 2^12 buckets take the global-memory path."""
    z, za, z_max, floor, lo, hi, probes = _mass_inputs(dtype, levels, seed=levels)
    want = mass_histogram_oracle(za, z_max, floor, lo, hi, probes)
    for knobs in KNOBS[:3]:
        got = emu.mass_histogram(z, z_max, floor, lo, hi, probes, **knobs)
        assert got.dtype == torch.int64 and got.shape == (5, 2 ** levels)
        diff = (got - want).abs()
        assert int(diff.sum()) <= 3 and int(got.sum()) > 0, (_ids(knobs), diff)


@pytest.mark.skipif(torch.ops.rollout_corr.cpu_isa() == "baseline", reason="the CPU kernels run their baseline copy "
                    "(no FMA): its exp rounds each product of the polynomial once more than the device's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_masses_are_the_cpu_kernels_bit_for_bit(emu, dtype):
    """The integer masses come from one exp polynomial (sampling_math.h) whose products are fused as the CPU kernels'
    FMA copies fuse them: 2^17 values of N(0, 16) give the CPU kernel's histogram exactly (at the 2^40 scale a mass
    differing by one ulp of its exp would round differently about once in 8000 values)."""
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(32, 4096, generator=g, dtype=torch.float64) * 4).to(dtype)
    z_max = z.amax(1)
    floor = torch.full((32,), -math.inf, dtype=dtype)
    hi = _ordered_key(z_max)
    lo = _ordered_key(z_max - 64) - 1
    probes = _probes(lo, hi, 8, dtype)
    assert torch.equal(emu.mass_histogram(z, z_max, floor, lo, hi, probes), ops.mass_histogram(z, z_max, floor, lo, hi,
                                                                                                probes))


# ---- the candidate path: row_candidates, candidate_decide ------------------------------------------------------------

def _candidate_rows(v, dtype, grid):
    x = rows_with_edges(12, v, dtype, seed=v, grid=grid)
    x[2, 5] = float("nan")
    x[3, 9] = math.inf
    x[4] = -math.inf
    x[4, 10:13] = 1.5  # fewer finite values than k
    x[5] = 0.25  # every value tied
    x[6, :] = -math.inf
    x[6, v - 2] = float("nan")  # NaN among -inf only
    k = torch.tensor([3, 7, 5, 5, 9, 4, 2, 0, 1, 40, 12, 64])
    target_col = torch.tensor([0, 5, 9, -1, 11, 3, 2, 7, v - 4, 100, -1, 20])
    return x, k, target_col


def _check_candidates(got, want, width):
    full = want[2] <= width  # rows whose lists fit: exact; the others only need their count
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert torch.equal(got[2], want[2]), (got[2], want[2])
    assert torch.equal(got[0][full], want[0][full]) and torch.equal(got[1][full], want[1][full])
    assert torch.equal(got[3][:, 0].isnan(), want[3][:, 0].isnan())
    assert torch.equal(got[3][:, [0, 2]].nan_to_num(), want[3][:, [0, 2]].nan_to_num())
    ok = ~want[3][:, 0].isnan()
    torch.testing.assert_close(got[3][ok, 1], want[3][ok, 1], rtol=2e-6, atol=0)
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_candidates(emu, dtype, temperature):
    """Every value the top-k can keep, ties whole, -inf never, NaN / +inf rows flagged, ignored rows (k = 0) never
    read, partial tiles, lists too short for a row's ties (count > width), rows with fewer finite values than k; and
    a row of 4130 equal values, more than the kernel's 4096-entry buffer: its exact route. The lists and counts are
    the CPU kernel's exactly."""
    for (grid, v), knobs in zip(((False, 1000), (True, 301), (False, 4096 + 37)), KNOBS[1:]):
        x, k, target_col = _candidate_rows(v, dtype, grid)
        width, valid = 72, v - 3
        got = emu.row_candidates(x, k, target_col, width, temperature, valid, **knobs)
        want = row_candidates_oracle(x, k, target_col, width, temperature, valid)
        full = _check_candidates(got, want, width)
        assert bool((~full).any()) and bool(full.any())
        cpu = ops.row_candidates(x, k, target_col, width, temperature, valid)
        for a, b in zip(got[:3], cpu[:3]):
            assert torch.equal(a, b), (dtype, v, _ids(knobs))
    wide = rows_with_edges(4, 300, dtype, seed=2)
    k4, tc = torch.full((4,), 6), torch.full((4,), -1)
    got = emu.row_candidates(wide[:, 40:240], k4, tc, 8, temperature, 200, threads=64)
    want = row_candidates_oracle(wide[:, 40:240].contiguous(), k4, tc, 8, temperature, 200)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = emu.row_candidates(torch.empty(0, 10, dtype=dtype), torch.zeros(0, dtype=torch.int64),
                               torch.zeros(0, dtype=torch.int64), 4, 1.0, 10)
    assert empty[0].shape == (0, 4)


def test_row_candidates_long_rows_and_wide_lists(emu):
    """Rows wider than 8192 tiles of 32 (tiles of several warp steps), k near the buffer (1024, width 1280: the
    sampling path's largest), i.i.d. and bf16-tied rows; and a list wider than the kernel's buffer is refused."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 270_000, generator=g)
    x[1] = x[1].bfloat16().float()  # bf16 values: many ties
    k = torch.tensor([1024, 700, 50])
    tc = torch.tensor([5, -1, 269_999])
    got = emu.row_candidates(x, k, tc, 1280, 0.9, 269_990, threads=256, schedule=1)
    want = row_candidates_oracle(x, k, tc, 1280, 0.9, 269_990)
    _check_candidates(got, want, 1280)
    with pytest.raises(RuntimeError, match="keeps at most 4096 candidates"):
        emu.row_candidates(x[:1, :100], k[:1], tc[:1], 5000, 1.0, 100)


def _decide_inputs(dtype, n=40, width=24, seed=5):
    g = torch.Generator().manual_seed(seed)
    cand = (torch.randn(n, width, generator=g, dtype=torch.float64) * 2).round()
    cand = cand.sort(dim=1, descending=True).values.to(dtype)
    cand[3, 10:] = -math.inf
    z_max = cand[:, 0].double() + torch.where(torch.arange(n) % 3 == 0, 0.5, 0.0).double()  # a shard's max above
    z_t = torch.where(torch.arange(n) % 2 == 0, cand[:, 2].double(), cand[:, -1].double() - 1.0)
    z_t[7] = -math.inf
    sum_all = (cand.double() - z_max.unsqueeze(1)).exp().sum(1) * 1.7 + 1.0
    k = torch.randint(1, width + 1, (n,), generator=g)
    k[5] = 0
    floor = torch.where(torch.arange(n) % 4 == 1, z_max - 1.5, torch.full((n,), -math.inf, dtype=torch.float64))
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.99] * (n // 5), dtype=torch.float64)
    return cand, z_max, z_t, sum_all, k, floor.to(dtype), top_p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_candidate_decide(emu, dtype):
    """min-p floors, top-k with ties at the k-th, top-p with ties at its boundary (a grid), a target inside / outside
    the kept set, rows skipped (k = 0), -inf padding; tau is the CPU kernel's exactly; the lists in any order."""
    args = _decide_inputs(dtype)
    want_tau, want_out = candidate_decide_oracle(*args)
    cpu_tau, _ = ops.candidate_decide(*args)
    fin = want_out[:, 0] != -math.inf
    assert bool(fin.any()) and not bool(fin.all())
    for knobs in KNOBS:
        tau, out = emu.candidate_decide(*args, **knobs)
        assert torch.equal(tau, want_tau) and torch.equal(tau, cpu_tau), _ids(knobs)
        assert torch.equal(out[:, 0] == -math.inf, want_out[:, 0] == -math.inf)
        torch.testing.assert_close(out[fin], want_out[fin], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[~fin][:, 1:], want_out[~fin][:, 1:], rtol=1e-12, atol=1e-12)
    # the shards' lists arrive gathered, not merged: any order per row gives the same tau (the fp64 sums may round
    # differently: they are block sums over the row in its order)
    g = torch.Generator().manual_seed(1)
    cand = args[0]
    shuffled = cand.gather(1, torch.stack([torch.randperm(cand.shape[1], generator=g) for _ in range(cand.shape[0])]))
    tau_s, out_s = emu.candidate_decide(shuffled, *args[1:], threads=64)
    assert torch.equal(tau_s, want_tau)
    torch.testing.assert_close(out_s, out, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_candidate_decide_top_p_is_the_cpu_kernels(emu, dtype):
    """Wide gathered lists (4 shards of 320, -inf padded, bf16-like ties), top-p from 0.05 to 0.999: the cut, a
    comparison of integer mass sums, equals the CPU kernel's on every row, and the outputs agree to fp64 rounding."""
    g = torch.Generator().manual_seed(11)
    n, width = 30, 1280
    cand = (torch.randn(n, width, generator=g, dtype=torch.float64) * 2.5).to(torch.bfloat16).to(dtype)
    cand[::4, 1000:] = -math.inf
    z_max = cand.double().amax(1)
    z_t = cand[:, 17].double()
    sum_all = (cand.double() - z_max.unsqueeze(1)).exp().sum(1) + 3.0
    k = torch.randint(200, width + 1, (n,), generator=g)
    floor = torch.full((n,), -math.inf, dtype=dtype)
    floor[1::5] = (z_max[1::5] - 6).to(dtype)
    top_p = torch.rand(n, generator=g, dtype=torch.float64) * 0.95 + 0.05
    top_p[-1] = 0.999
    args = (cand, z_max, z_t, sum_all, k, floor, top_p)
    tau, out = emu.candidate_decide(*args, threads=128, max_blocks=4, schedule=2)
    cpu_tau, cpu_out = ops.candidate_decide(*args)
    assert torch.equal(tau, cpu_tau)
    torch.testing.assert_close(out, cpu_out, rtol=1e-12, atol=1e-12)
    want_tau, _ = candidate_decide_oracle(cand.sort(dim=1, descending=True).values, *args[1:])  # (reads it sorted)
    assert torch.equal(tau, want_tau)


def test_bad_arguments_name_the_problem(emu):
    """The emulated ops go through the CPU kernels' boundary checks (csrc/sampling_host.h): the same messages."""
    x = torch.randn(3, 10)
    with pytest.raises(RuntimeError, match="k must be >= 1"):
        emu.row_topk(x, 0)
    with pytest.raises(RuntimeError, match="floor must be"):
        emu.floor_fill(x, torch.zeros(2), 1.0, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="temperature must be finite"):
        emu.floor_zero_(torch.empty_like(x), x, torch.zeros(3), 0.0)
    with pytest.raises(RuntimeError, match="power of 2"):
        emu.mass_histogram(x, x.amax(1), torch.zeros(3), torch.zeros(3, dtype=torch.int64),
                           torch.ones(3, dtype=torch.int64), torch.zeros(3, 6, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="floor must be"):
        emu.count_at_least(x, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="every k must be <= width"):
        emu.row_candidates(x, torch.full((3,), 5), torch.zeros(3, dtype=torch.int64), 4, 1.0, 10)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        emu.row_candidates(x.double(), torch.full((3,), 2), torch.zeros(3, dtype=torch.int64), 4, 1.0, 10)
    with pytest.raises(RuntimeError, match="floor must be"):
        emu.candidate_decide(torch.zeros(3, 4), *(torch.zeros(3, dtype=torch.float64),) * 3,
                             torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.float64),
                             torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="threads must be 0 or a multiple of 32"):
        emu.count_at_least(x, torch.zeros(3), threads=48)


# ---- the whole replay on the emulated kernels ---------------------------------------------------------------------

REPLAY_PARAMS = {
    "candidate_path": dict(top_k=9, top_p=0.8, temperature=0.7),  # row_candidates, candidate_decide, scatter_rows
    "candidate_min_p": dict(top_k=40, min_p=0.05),
    "general_top_p": dict(top_p=0.85, temperature=1.3),  # mass_histogram rounds, floor_fill, floor_zero_
    "general_large_k": dict(top_k=1100, top_p=0.97),  # k beyond the candidate path: row_topk, count_at_least
}


@pytest.mark.parametrize("name", sorted(REPLAY_PARAMS))
def test_replay_on_the_emulated_kernels_matches_the_dense_oracle(name):
    """sampled_log_probs with every op of the replay on the emulated CUDA kernels (the log-prob family's included:
    rollout_corr_testing.backends.ops_on("emulated")), against the dense fp64 oracle of vLLM's sampler rules:
    log-probs, entropy, log S, the support, and the gradient. Values on a grid put ties at the boundaries."""
    from rollout_corr_ext import SamplingParams, sampled_log_probs
    from rollout_corr_testing.backends import ops_on
    from rollout_corr_testing.cuda_emulator.records import recorded_launches
    from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense
    from rollout_corr_testing.tolerances import grad_tol, output_tol

    kw = REPLAY_PARAMS[name]
    g = torch.Generator().manual_seed(len(name))
    steps = 64 if name.startswith("candidate") else 2  # coarse: ties everywhere, more than a candidate list holds
    x = (torch.randn(6, 2000, generator=g, dtype=torch.float64) * 2 * steps).round() / steps
    x[2, :30] = -math.inf
    x = x.float()
    target = torch.randint(0, 2000, (6,), generator=g)
    target[1] = -100
    kept = sampled_log_probs_dense(x.double(), target, **kw)[4]
    for i in (0, 2, 4):  # half of the targets inside the kept set
        ids = kept[i].nonzero().flatten()
        target[i] = ids[len(ids) // 2]
    with ops_on("emulated", threads=128, schedule=1, max_blocks=4), recorded_launches() as rec:
        xs = x.clone().requires_grad_(True)
        res = sampled_log_probs(xs, target, SamplingParams(**kw))
        use = res.in_support & (target != -100)
        torch.where(use, res.log_prob, torch.zeros_like(res.log_prob)).sum().backward()
    kernels = {launch.kernel.split("<")[0] for launch in rec.launches()}
    expected = {"candidate_path": {"row_candidates_kernel", "candidate_decide_kernel", "scatter_rows_kernel"},
                "candidate_min_p": {"row_candidates_kernel", "candidate_decide_kernel", "scatter_rows_kernel"},
                "general_top_p": {"mass_histogram_kernel", "floor_fill_kernel", "floor_zero_kernel"},
                "general_large_k": {"row_topk_kernel"}}[name]
    assert expected <= kernels, kernels
    lp, ent, log_s, in_support, _ = sampled_log_probs_dense(x.double(), target, **kw)
    assert torch.equal(res.in_support, in_support)
    assert torch.equal(res.log_prob == -math.inf, lp == -math.inf)
    fin = lp != -math.inf
    tol = output_tol(torch.float32)
    torch.testing.assert_close(res.log_prob.double()[fin], lp.detach()[fin], **tol)
    torch.testing.assert_close(res.entropy.double(), ent, **tol)
    torch.testing.assert_close(res.log_kept_mass.double(), log_s, **tol)
    xr = x.double().requires_grad_(True)
    lp_r = sampled_log_probs_dense(xr, target, **kw)[0]
    ref, = torch.autograd.grad(torch.where(use, lp_r, torch.zeros_like(lp_r)).sum(), xr)
    torch.testing.assert_close(xs.grad.double()[use], ref[use], **grad_tol(torch.float32))
