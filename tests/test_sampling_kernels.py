"""The sampling-replay search ops (csrc/cpu/sampling.cpp, and the fallback's torch versions) against independent
oracles written from their contracts in csrc/ops.cpp: ``row_topk`` against ``torch.topk`` (NaN left out), ``floor_fill``
against an elementwise Python rule, ``mass_histogram`` against a per-value loop with ``math.exp`` and ``bisect``,
``count_at_least`` against a comparison count; every dtype, -inf, ties, strided rows, empty inputs, bad arguments,
and the fake (meta) kernels."""

import bisect
import math

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext import fallback, ops

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
#: the compiled CPU kernels exist only when the extension is loaded (not under ROLLOUT_CORR_FORCE_FALLBACK=1); the
#: fallback variant runs everywhere
needs_kernels = pytest.mark.skipif(rc.backend() == "fallback", reason="the compiled CPU kernels are not loaded "
                                   "(ROLLOUT_CORR_FORCE_FALLBACK=1 or no build); the fallback variant runs")
IMPLS = [pytest.param("kernel", marks=needs_kernels), "fallback"]


def _impl(name, op):
    return getattr(ops if name == "kernel" else fallback, op)


def _rows(n, v, dtype, seed, grid=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    if grid:
        x = (x * 2).round() / 2  # many ties
    x[0, :7] = -math.inf
    x[1] = -math.inf  # a row of -inf only
    return x.to(dtype)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 5, 51, 300])
def test_row_topk(impl, dtype, k):
    fn = _impl(impl, "row_topk")
    for grid in (False, True):
        x = _rows(9, 257, dtype, seed=k, grid=grid)  # 257: a partial block at the end
        x[3, 100] = float("nan")  # never a candidate
        out = fn(x, k)
        xa = x.to(_acc(dtype))
        ref = xa.masked_fill(torch.isnan(xa), -math.inf).topk(min(k, 257), dim=-1).values
        if k > 257:
            ref = torch.cat([ref, ref.new_full((9, k - 257), -math.inf)], 1)
        assert out.dtype == _acc(dtype) and out.shape == (9, k)
        assert torch.equal(out, ref), (impl, dtype, k, grid)
    # strided rows (a column slice of a wider tensor) and fewer columns than k
    wide = _rows(4, 300, dtype, seed=1)
    assert torch.equal(fn(wide[:, 50:90], 8), wide[:, 50:90].to(_acc(dtype)).topk(8, dim=-1).values)
    short = fn(wide[:, :3], 5)
    assert torch.equal(short[:, 3:], torch.full((4, 2), -math.inf, dtype=_acc(dtype)))
    assert fn(torch.empty(0, 10, dtype=dtype), 3).shape == (0, 3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_floor_fill(impl, dtype, temperature):
    fn = _impl(impl, "floor_fill")
    x = _rows(6, 130, dtype, seed=3)
    acc = _acc(dtype)
    floor = torch.tensor([0.5, -math.inf, 1.0, 2.0, -1.0, 10.0], dtype=acc)
    out = torch.empty_like(x)
    before = x.clone()
    fn(x, floor, temperature, out)
    assert torch.equal(x, before)  # the input is read only
    t = torch.tensor(temperature, dtype=acc)
    for r in range(6):
        for c in range(130):
            z = x[r, c].to(acc) if temperature == 1.0 else x[r, c].to(acc) / t
            want = -math.inf if z < floor[r] else x[r, c].item()
            assert out[r, c].item() == want or (math.isnan(want) and math.isnan(out[r, c].item()))
    fn(x, floor, temperature, x)  # in place (out may be x)
    assert torch.equal(x, out)


def _mass_oracle(z, z_max, floor, lo, hi, probes):
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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels", [4, 8])
def test_mass_histogram(impl, dtype, levels):
    from rollout_corr_ext.sampling import _ordered_key, _probes

    fn = _impl(impl, "mass_histogram")
    acc = _acc(dtype)
    z = _rows(5, 200, dtype, seed=levels, grid=True)
    z[1] = 1.5  # one repeated value (a tie of the whole row)
    za = z.to(acc)
    z_max = za.amax(1)
    floor = torch.tensor([-math.inf, -math.inf, 0.0, -2.0, -math.inf], dtype=acc)
    hi = _ordered_key(z_max)
    lo = _ordered_key(z_max - 64) - 1
    lo[3], hi[3] = _ordered_key(torch.tensor(-1.0, dtype=acc)), _ordered_key(torch.tensor(2.5, dtype=acc))  # a narrow bracket
    probes = _probes(lo, hi, levels)
    got = fn(z, z_max, floor, lo, hi, probes)
    want = _mass_oracle(za, z_max, floor, lo, hi, probes)
    assert got.dtype == torch.int64 and got.shape == (5, 2 ** levels)
    # a value's mass may round the other way when the kernel's exp (within 2 ulp) and math.exp straddle a half:
    # at most 1 per value, rarely
    diff = (got - want).abs()
    assert int(diff.sum()) <= 3 and int(got.sum()) > 0, diff


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_count_at_least(impl, dtype):
    fn = _impl(impl, "count_at_least")
    z = _rows(6, 150, dtype, seed=9, grid=True)
    floor = torch.tensor([0.0, -math.inf, 0.5, 1.0, -10.0, math.inf], dtype=_acc(dtype))
    got = fn(z, floor)
    want = torch.tensor([sum(float(v) >= float(floor[r]) for v in z[r]) for r in range(6)], dtype=torch.int64)
    assert torch.equal(got, want)


@needs_kernels
def test_bad_arguments_and_fakes():
    x = torch.randn(3, 10)
    with pytest.raises(RuntimeError, match="k must be >= 1"):
        ops.row_topk(x, 0)
    with pytest.raises(RuntimeError, match="2-D"):
        ops.row_topk(x[0], 2)
    with pytest.raises(RuntimeError, match="floor must be"):
        ops.floor_fill(x, torch.zeros(2), 1.0, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="temperature must be finite"):
        ops.floor_fill(x, torch.zeros(3), 0.0, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="power of 2"):
        ops.mass_histogram(x, x.amax(1), torch.zeros(3), torch.zeros(3, dtype=torch.int64),
                           torch.ones(3, dtype=torch.int64), torch.zeros(3, 6, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="floor must be"):
        ops.count_at_least(x, torch.zeros(3, dtype=torch.float64))
    m = torch.empty(4, 9, device="meta")
    assert torch.ops.rollout_corr.row_topk(m, 3).shape == (4, 3)
    assert torch.ops.rollout_corr.count_at_least(m, torch.empty(4, device="meta")).shape == (4,)
    probes = torch.empty(4, 15, dtype=torch.int64, device="meta")
    i64 = torch.empty(4, dtype=torch.int64, device="meta")
    f = torch.empty(4, device="meta")
    assert torch.ops.rollout_corr.mass_histogram(m, f, f, i64, i64, probes).shape == (4, 16)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_floor_zero_(impl, dtype, temperature):
    fn = _impl(impl, "floor_zero_")
    x = _rows(5, 90, dtype, seed=4)
    acc = _acc(dtype)
    floor = torch.tensor([0.5, -math.inf, 1.0, -1.0, 10.0], dtype=acc)
    grad = torch.randn(5, 90, dtype=torch.float64).to(dtype)
    want = grad.clone()
    t = torch.tensor(temperature, dtype=acc)
    for r in range(5):
        for c in range(90):
            z = x[r, c].to(acc) if temperature == 1.0 else x[r, c].to(acc) / t
            if z < floor[r]:
                want[r, c] = 0
    before = x.clone()
    fn(grad, x, floor, temperature)
    assert torch.equal(grad, want) and torch.equal(x, before)
