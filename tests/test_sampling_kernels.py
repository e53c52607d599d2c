"""The sampling-replay search ops (csrc/cpu/sampling.cpp, and the fallback's torch versions) against independent
oracles written from their contracts in csrc/ops.cpp: ``row_topk`` against ``torch.topk`` (NaN left out), ``floor_fill``
against an elementwise Python rule, ``mass_histogram`` against a per-value loop with ``math.exp`` and ``bisect``,
``count_at_least`` against a comparison count, ``row_candidates`` / ``candidate_decide`` / ``scatter_rows`` (the top-k
replay's one-read path) against row-by-row Python from their contracts; every dtype, -inf, ties, strided rows, empty
inputs, bad arguments, and the fake (meta) kernels."""

import math

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext import fallback, ops
from rollout_corr_testing.sampling_kernel_oracles import acc_dtype as _acc
from rollout_corr_testing.sampling_kernel_oracles import candidate_decide_oracle as _decide_oracle
from rollout_corr_testing.sampling_kernel_oracles import mass_histogram_oracle as _mass_oracle
from rollout_corr_testing.sampling_kernel_oracles import row_candidates_oracle as _candidates_oracle
from rollout_corr_testing.sampling_kernel_oracles import rows_with_edges as _rows
from rollout_corr_testing.sampling_kernel_oracles import scatter_rows_case

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
#: the compiled CPU kernels exist only when the extension is loaded (not under ROLLOUT_CORR_FORCE_FALLBACK=1); the
#: fallback variant runs everywhere
needs_kernels = pytest.mark.skipif(rc.backend() == "fallback", reason="the compiled CPU kernels are not loaded "
                                   "(ROLLOUT_CORR_FORCE_FALLBACK=1 or no build); the fallback variant runs")
IMPLS = [pytest.param("kernel", marks=needs_kernels), "fallback"]


def _impl(name, op):
    return getattr(ops if name == "kernel" else fallback, op)


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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels", [4, 8])
@pytest.mark.parametrize("probe_kind", ["search", "bisection"])
def test_mass_histogram(impl, dtype, levels, probe_kind):
    """Against the oracle, with the search's own probes (for 32-bit keys the grid whose buckets the CPU kernel
    computes by a formula) and with bisection points (any ascending probes: the kernel's stepping search)."""
    from rollout_corr_ext.sampling import _bisection_probes, _ordered_key, _probes

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
    probes = _probes(lo, hi, levels, acc) if probe_kind == "search" else _bisection_probes(lo, hi, levels)
    got = fn(z, z_max, floor, lo, hi, probes)
    want = _mass_oracle(za, z_max, floor, lo, hi, probes)
    assert got.dtype == torch.int64 and got.shape == (5, 2 ** levels)
    # a value's mass may round the other way when the kernel's exp (within 2 ulp) and math.exp straddle a half:
    # at most 1 per value, rarely
    diff = (got - want).abs()
    assert int(diff.sum()) <= 3 and int(got.sum()) > 0, diff


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mass_histogram_over_the_search_brackets(impl, dtype):
    """Long rows (several of the CPU kernel's 256-value blocks) in the brackets a search meets: the whole first one
    (every value inside: the dense path), one holding about a tenth of each row (a few per block: the compacted
    path), one of a few dozen keys (probes repeat: buckets of 0 or 1 key) and one where blocks are mostly empty;
    with the search's probes and with bisection points."""
    from rollout_corr_ext.sampling import _bisection_probes, _ordered_key, _probes

    fn = _impl(impl, "mass_histogram")
    acc = _acc(dtype)
    g = torch.Generator().manual_seed(7)
    z = (torch.randn(6, 1500, generator=g, dtype=torch.float64) * 3).to(dtype)
    z[0, 700:] = -math.inf
    za = z.to(acc)
    z_max = za.amax(1)
    floor = torch.full((6,), -math.inf, dtype=acc)
    floor[5] = z_max[5] - 4
    keys = _ordered_key(za).sort(1).values
    first = (_ordered_key(z_max - 64) - 1, _ordered_key(z_max))
    tenth = (keys[:, 1200] - 1, keys[:, 1350])
    narrow = (keys[:, 1400] - 1, keys[:, 1400] + 40)
    sparse = (keys[:, 1490] - 1, keys[:, 1499])
    for lo, hi in (first, tenth, narrow, sparse):
        for levels in (4, 8):
            for probes in (_probes(lo, hi, levels, acc), _bisection_probes(lo, hi, levels)):
                got = fn(z, z_max, floor, lo, hi, probes)
                want = _mass_oracle(za, z_max, floor, lo, hi, probes)
                diff = (got - want).abs()
                assert int(diff.sum()) <= 3 and int(got.sum()) > 0, (levels, diff)


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
    with pytest.raises(RuntimeError, match="every k must be <= width"):
        ops.row_candidates(x, torch.full((3,), 5), torch.zeros(3, dtype=torch.int64), 4, 1.0, 10)
    with pytest.raises(RuntimeError, match="temperature must be finite"):
        ops.row_candidates(x, torch.full((3,), 2), torch.zeros(3, dtype=torch.int64), 4, 0.0, 10)
    with pytest.raises(RuntimeError, match="valid_cols"):
        ops.row_candidates(x, torch.full((3,), 2), torch.zeros(3, dtype=torch.int64), 4, 1.0, 11)
    with pytest.raises(RuntimeError, match="an index is >= cols"):
        ops.scatter_rows(torch.ones(2, 2), torch.tensor([[0, 9], [1, -1]]), 5, torch.float32)
    with pytest.raises(RuntimeError, match="floor must be"):
        ops.candidate_decide(torch.zeros(3, 4), *(torch.zeros(3, dtype=torch.float64),) * 3,
                             torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.float64),
                             torch.ones(3, dtype=torch.float64))
    vals, idx, cnt, st = torch.ops.rollout_corr.row_candidates(m, i64, i64, 7, 1.0, 9)
    assert vals.shape == idx.shape == (4, 7) and cnt.shape == (4,) and st.shape == (4, 3)
    assert torch.ops.rollout_corr.scatter_rows(f.reshape(4, 1), i64.reshape(4, 1), 9, torch.bfloat16).dtype == \
        torch.bfloat16
    f64 = torch.empty(4, dtype=torch.float64, device="meta")
    tau, out = torch.ops.rollout_corr.candidate_decide(m, f64, f64, f64, i64, f, f64)
    assert tau.shape == (4,) and out.shape == (4, 4)


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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_candidates(impl, dtype, temperature):
    """Every value the top-k can keep, ties whole (grid rows), -inf never, NaN / +inf rows flagged, ignored rows
    (k = 0) untouched, partial blocks (valid_cols not a multiple of 64), a list too short for a row's ties (count >
    width), rows with fewer finite values than k, strided rows."""
    fn = _impl(impl, "row_candidates")
    for grid, v in ((False, 1000), (True, 301), (False, 4096 + 37)):
        x = _rows(12, v, dtype, seed=v, grid=grid)
        x[2, 5] = float("nan")
        x[3, 9] = math.inf
        x[4] = -math.inf
        x[4, 10:13] = 1.5  # fewer finite values than k
        x[5] = 0.25  # every value tied
        x[6, :] = -math.inf
        x[6, v - 2] = float("nan")  # NaN among -inf only
        k = torch.tensor([3, 7, 5, 5, 9, 4, 2, 0, 1, 40, 12, 64])
        target_col = torch.tensor([0, 5, 9, -1, 11, 3, 2, 7, v - 4, 100, -1, 20])
        width, valid = 72, v - 3
        got = fn(x, k, target_col, width, temperature, valid)
        want = _candidates_oracle(x, k, target_col, width, temperature, valid)
        full = want[2] <= width  # rows whose lists fit: exact; the others only need their count
        assert got[0].dtype == _acc(dtype) and got[1].dtype == torch.int64, (got[0].dtype, got[1].dtype)
        assert torch.equal(got[2], want[2]), (impl, dtype, grid, got[2], want[2])
        assert torch.equal(got[0][full], want[0][full]) and torch.equal(got[1][full], want[1][full]), (impl, dtype, grid)
        assert bool((~full).any()) and bool(full.any())
        assert torch.equal(got[3][:, 0].isnan(), want[3][:, 0].isnan())
        assert torch.equal(got[3][:, [0, 2]].nan_to_num(), want[3][:, [0, 2]].nan_to_num())
        ok = ~want[3][:, 0].isnan()
        torch.testing.assert_close(got[3][ok, 1], want[3][ok, 1], rtol=2e-6, atol=0)
    wide = _rows(4, 300, dtype, seed=2)
    k4 = torch.full((4,), 6)
    tc = torch.full((4,), -1)
    got = fn(wide[:, 40:240], k4, tc, 8, temperature, 200)
    want = _candidates_oracle(wide[:, 40:240].contiguous(), k4, tc, 8, temperature, 200)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert fn(torch.empty(0, 10, dtype=dtype), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
              4, 1.0, 10)[0].shape == (0, 4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [0.3, 0.7])
def test_row_candidates_total_mass_is_of_the_quotients_at_large_logits(impl, dtype, temperature):
    """The total mass sums exp(z - max z) over the candidates' own values z = fp32(x / T), so a kept set of every
    value has the total's mass (log S = 0). The CPU kernel summed exp((x - max x) / T): at |z| ~ 1e4, where fp32
    rounds each quotient by ~1e-3, the total was off by 1e-3 relative (log S of a top-k set off by as much)."""
    fn = _impl(impl, "row_candidates")
    g = torch.Generator().manual_seed(5)
    for offset in (3e2, 3e3, 1e4, 1e5):
        if offset * 2 > torch.finfo(dtype).max:  # fp16: 1e5 is +inf
            continue
        x = (torch.randn(6, 1000 + 37, generator=g) * 3 + offset).to(dtype)
        k, tc = torch.full((6,), 40), torch.full((6,), -1)
        got = fn(x, k, tc, 64, temperature, x.shape[1])
        want = _candidates_oracle(x, k, tc, 64, temperature, x.shape[1])
        torch.testing.assert_close(got[3][:, 0], want[3][:, 0], rtol=0, atol=0)
        torch.testing.assert_close(got[3][:, 1], want[3][:, 1], rtol=2e-6, atol=0, msg=lambda m: f"{offset}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_candidate_decide(impl, dtype):
    """min-p floors, top-k with ties at the k-th, top-p with ties at its boundary (a grid), a target inside / outside
    the kept set, rows skipped (k = 0), -inf padding."""
    fn = _impl(impl, "candidate_decide")
    g = torch.Generator().manual_seed(5)
    n, width = 40, 24
    cand = (torch.randn(n, width, generator=g, dtype=torch.float64) * 2).round(decimals=0 if dtype else 0)
    cand = cand.sort(dim=1, descending=True).values.to(dtype)
    cand[3, 10:] = -math.inf
    z_max = cand[:, 0].double() + torch.where(torch.arange(n) % 3 == 0, 0.5, 0.0).double()  # a shard's max above
    z_t = torch.where(torch.arange(n) % 2 == 0, cand[:, 2].double(), cand[:, -1].double() - 1.0)
    z_t[7] = -math.inf
    sum_all = (cand.double() - z_max.unsqueeze(1)).exp().sum(1) * 1.7 + 1.0
    k = torch.randint(1, width + 1, (n,), generator=g)
    k[5] = 0
    floor = torch.where(torch.arange(n) % 4 == 1, z_max - 1.5, torch.full((n,), -math.inf, dtype=torch.float64))
    floor = floor.to(dtype)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.99] * 8, dtype=torch.float64)
    tau, out = fn(cand, z_max, z_t, sum_all, k, floor, top_p)
    want_tau, want_out = _decide_oracle(cand, z_max, z_t, sum_all, k, floor, top_p)
    assert torch.equal(tau, want_tau)
    assert torch.equal(out[:, 0] == -math.inf, want_out[:, 0] == -math.inf)
    fin = want_out[:, 0] != -math.inf
    assert bool(fin.any()) and not bool(fin.all())
    torch.testing.assert_close(out[fin], want_out[fin], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[~fin][:, 1:], want_out[~fin][:, 1:], rtol=1e-12, atol=1e-12)
    # the shards' lists arrive gathered, not merged: any order per row decides the same
    shuffled = cand.gather(1, torch.stack([torch.randperm(width, generator=g) for _ in range(n)]))
    tau_s, out_s = fn(shuffled, z_max, z_t, sum_all, k, floor, top_p)
    assert torch.equal(tau_s, tau) and torch.equal(out_s, out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows(impl, dtype):
    fn = _impl(impl, "scatter_rows")
    values, index, want = scatter_rows_case(dtype)
    for _ in range(2):  # the CPU kernel reuses its block: a second call must not show the first one's values
        got = fn(values, index, 40, dtype)
        assert got.dtype == dtype and got.shape == (6, 40)
        assert torch.equal(got, want.to(dtype))
        del got
        values = values.flip(0)
        index = index.flip(0)
        want = want.flip(0)


@needs_kernels
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_candidate_ops_compile_fullgraph(backend):
    """The one-read replay's ops under torch.compile(fullgraph=True) (their fake kernels and schemas): candidates,
    decision and the scattered gradient, equal to eager."""
    def step(x, k, tc, floor, top_p):
        vals, idx, count, stats = torch.ops.rollout_corr.row_candidates(x, k, tc, 12, 0.7, x.shape[1])
        tau, out = torch.ops.rollout_corr.candidate_decide(vals, stats[:, 0], stats[:, 2], stats[:, 1], k, floor,
                                                           top_p)
        grad = torch.ops.rollout_corr.scatter_rows(out[:, 3:4].float().expand(-1, 12) * (vals > -math.inf), idx,
                                                   x.shape[1], x.dtype)
        return vals, idx, count, tau, out, grad

    torch._dynamo.reset()
    x = _rows(6, 200, torch.float32, seed=4)
    x[1, :5] = 0.0  # a row with some finite values
    args = (x, torch.full((6,), 8), torch.tensor([0, 3, -1, 7, 8, 9]), torch.full((6,), -math.inf),
            torch.full((6,), 0.9, dtype=torch.float64))
    eager = step(*args)
    compiled = torch.compile(step, backend=backend, fullgraph=True)(*args)
    for a, b in zip(compiled, eager):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_op_of_a_replay_passes_opcheck(dtype):
    """torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch static and dynamic) on every
    rollout_corr op a replay calls, with the arguments the entry points really pass (recorded below dispatch): the
    top-k candidate path, the general top-p / min-p path, per-row temperatures and kept sets. merge_row_stats without
    entropy returns a NaN entropy by contract, which opcheck's comparison reads as a difference (NaN != NaN): it is
    checked with entropy (tests/test_logprob.py too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "rollout_corr":
                keep = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
                calls.append((func, torch.utils._pytree.tree_map(keep, args), torch.utils._pytree.tree_map(keep, kwargs)))
            return func(*args, **kwargs)

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 17, generator=g) * 2).to(dtype)
    target = torch.randint(0, 17, (6,), generator=g)
    target[2] = -100
    kept = rc.KeptTokens.from_lists([sorted({0, 3, 5, 8, int(t) % 17}) for t in target.tolist()], temperature=0.9)
    with Record():
        for sp in (rc.SamplingParams(temperature=0.8, top_k=4), rc.SamplingParams(temperature=0.7, top_p=0.8, min_p=0.02),
                   rc.SamplingParams(temperature=torch.linspace(0.5, 1.5, 6), top_k=5, top_p=0.9)):
            x = logits.clone().requires_grad_(True)
            out = rc.sampled_log_probs(x, target, sp)
            out.log_prob.masked_fill(~out.in_support, 0).sum().backward()
        x = logits.clone().requires_grad_(True)
        rc.kept_log_probs(x, target, kept).log_prob.sum().backward()
    seen, checked = set(), set()
    for func, args, kwargs in calls:
        name = func._schema.name
        if name.endswith(("cpu_scratch", "cpu_cache_bytes", "cpu_isa", "built_with_cuda", "mm_f32_uses_mkl")):
            continue
        if name.endswith("merge_row_stats") and not args[-1]:
            continue
        key = (name, tuple((a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else repr(a) for a in args))
        if key in seen:
            continue
        seen.add(key)
        torch.library.opcheck(func, args, kwargs)
        checked.add(name.split("::")[1])
    assert {"row_candidates", "candidate_decide", "scatter_rows", "mass_histogram", "floor_fill", "floor_zero_",
            "row_topk", "vocab_row_stats", "logprob_backward"} <= checked, checked
