"""linear_log_probs: log-probs and entropy from hidden states with the output layer fused in (issue: [N, V] never
materialized).

Oracle: ``log_probs_dense`` (``torch.log_softmax`` in fp64) of the full product ``hidden @ weight.T + bias``, with
its gradient for hidden, weight and bias from autograd. 16-bit inputs: the kernels see the product rounded to the
input dtype (as the materialized path does), so values are compared with the oracle of those rounded logits, and
gradients (accumulated chunk by chunk) are held to be no less accurate than the materialized path's
(``hidden @ weight.T`` in that dtype + ``vocab_parallel_log_probs``) against the fp64 oracle. Every case runs on the
compiled CPU kernels and on the emulated CUDA kernels (the fold is the log-prob op's ``vocab_row_stats`` and
``merge_row_stats``, the backward its ``logprob_backward_``); TP = 2 and 4 run on spawned gloo workers against the
single-process result, counting the collectives.
"""

import math

import pytest
import torch
import torch.distributed as dist

import rollout_corr_ext as rc
from rollout_corr_testing.backends import device_params, ops_on
from rollout_corr_testing.dist_utils import CollectiveCounter, run_workers
from rollout_corr_testing.logprob_oracle import log_probs_dense
from rollout_corr_testing.tolerances import linear_tol

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DEVICES = device_params("cpu", "emulated", "cuda")

#: (N, H, V_local, vocab_size, chunk_rows, chunk_cols, temperature, bias): uneven chunks, padded vocab, one chunk.
CASES = [
    (37, 16, 50, 50, 8, 16, 1.0, False),
    (29, 24, 64, 61, 7, 9, 0.7, True),  # padded vocab: weight rows 61..63 are excluded
    (12, 8, 40, 40, 64, 64, 1.3, True),  # the whole product in one chunk
]


def _inputs(n, h, v, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64)).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h) * 3).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64)).to(dtype) if bias else None
    return hidden, weight, b


def _oracle(hidden, weight, bias, target, vocab_size, temperature, rounded):
    """fp64 log_softmax of the product (rounded to the inputs' dtype first when ``rounded``), with autograd leaves."""
    hd, wd = (x.detach().double().clone().requires_grad_(True) for x in (hidden, weight))
    bd = None if bias is None else bias.detach().double().clone().requires_grad_(True)
    def rounded_to_input(x):  # what the 16-bit GEMM (then the bias add) hands on; the gradient flows straight through
        return x + (x.detach().to(hidden.dtype).double() - x.detach()) if rounded else x

    z = rounded_to_input(hd @ wd.t())
    if bd is not None:
        z = rounded_to_input(z + bd)
    logp, ent, _ = log_probs_dense(z, target, vocab_size=vocab_size, temperature=temperature)
    return logp, ent, (hd, wd, bd)


def _rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_and_gradients_match_the_full_product(dtype, device):
    with ops_on(device) as dev:
        for i, (n, h, v, vocab_size, cr, cc, temp, with_bias) in enumerate(CASES):
            hidden, weight, bias = _inputs(n, h, v, dtype, i, with_bias)
            target = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(10 + i))
            target[::5] = -100
            ws = torch.randn(n, dtype=torch.float64)
            hx, wx = hidden.to(dev, copy=True).requires_grad_(True), weight.to(dev, copy=True).requires_grad_(True)
            bx = None if bias is None else bias.to(dev, copy=True).requires_grad_(True)
            h_before, w_before = hidden.clone(), weight.clone()
            logp, ent = rc.linear_log_probs(hx, wx, target.to(dev), bias=bx, vocab_size=vocab_size,
                                            temperature=temp, return_entropy=True, chunk_rows=cr, chunk_cols=cc)
            assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            (logp.double().cpu() * ws).sum().add((ent.double().cpu() * ws.flip(0)).sum()).backward()
            assert torch.equal(hx.detach().cpu(), h_before) and torch.equal(wx.detach().cpu(), w_before)

            sixteen = dtype in (torch.bfloat16, torch.float16)
            # the exact product of the inputs: 16-bit inputs' chunk logits are never rounded to 16 bits
            ref_logp, ref_ent, leaves = _oracle(hidden, weight, bias, target, vocab_size, temp, rounded=False)
            tol = linear_tol(dtype)
            torch.testing.assert_close(logp.cpu().double(), ref_logp.detach(), **tol)
            torch.testing.assert_close(ent.cpu().double(), ref_ent.detach(), **tol)
            ignored = target == -100
            assert torch.all(logp.cpu()[ignored] == 0) and torch.all(ent.cpu()[ignored] == 0)

            (ref_logp * ws).sum().add((ref_ent * ws.flip(0)).sum()).backward()
            ours = [hx.grad, wx.grad] + ([bx.grad] if bx is not None else [])
            refs = [x.grad for x in leaves if x is not None]
            if not sixteen:
                for a, r in zip(ours, refs):
                    assert a.dtype == dtype
                    torch.testing.assert_close(a.cpu().double(), r, rtol=1e-4 if dtype == torch.float32 else 1e-10,
                                               atol=1e-5 if dtype == torch.float32 else 1e-12)
                continue
            # 16-bit: the materialized path (product in the dtype, then the log-prob op) against the same oracle.
            hm, wm = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            bm = None if bias is None else bias.clone().requires_grad_(True)
            z = hm @ wm.t() + (0 if bm is None else bm)
            lm, em = rc.vocab_parallel_log_probs(z, target, vocab_size=vocab_size, temperature=temp,
                                                 return_entropy=True)
            (lm.double() * ws).sum().add((em.double() * ws.flip(0)).sum()).backward()
            mats = [hm.grad, wm.grad] + ([bm.grad] if bm is not None else [])
            for name, a, m, r in zip(("hidden", "weight", "bias"), ours, mats, refs):
                assert a.dtype == dtype
                err, err_m = _rel_err(a.cpu(), r), _rel_err(m, r)
                assert err <= 1.5 * err_m + 2e-3, (name, err, err_m)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_input_layout_gives_the_contiguous_inputs_results(dtype):
    """A column-major weight (a transposed or tied-embedding view), a transposed hidden, a row-strided slice: the
    values and gradients of the contiguous copies, to the GEMMs' own rounding (their summation order may follow the
    layout), and gradients in the inputs' dtype and shape (the 16-bit backward once raised from an internal op on a
    column-major weight: its grad_weight took the weight's strides)."""
    hidden, weight, bias = _inputs(10, 24, 70, dtype, 3, True)
    target = torch.randint(0, 70, (10,), generator=torch.Generator().manual_seed(4))
    target[2] = -100

    def run(h, w, b):
        h, w, b = (x.detach().requires_grad_(True) for x in (h, w, b))
        logp, ent = rc.linear_log_probs(h, w, target, bias=b, return_entropy=True, chunk_rows=4, chunk_cols=32)
        (logp.sum() + 0.5 * ent.sum()).backward()
        return logp, ent, h.grad, w.grad, b.grad

    want = run(hidden, weight, bias)
    layouts = [(hidden, weight.t().contiguous().t(), bias), (hidden.t().contiguous().t(), weight, bias),
               (torch.stack([hidden, hidden], 2)[:, :, 0], torch.stack([weight, weight], 2)[:, :, 1],
                torch.stack([bias, bias], 1)[:, 0])]
    for h, w, b in layouts:
        assert torch.equal(h, hidden) and torch.equal(w, weight)
        for got, ref in zip(run(h, w, b), want):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            torch.testing.assert_close(got, ref, **linear_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_inputs_at_scale_match_the_exact_product(dtype):
    """bf16 / fp16 hidden states and weights at a production H (2048) and logits of std ~4: the fused log-probs and
    entropy are those of the exact product h W^T within the fp32 tolerance (the chunk logits are fp32 accumulators),
    while the materialized 16-bit product (the logits a 16-bit output layer returns) is off by orders of magnitude
    more. The oracle: fp64 log_softmax of the fp64 product of the same inputs."""
    g = torch.Generator().manual_seed(21)
    n, hsize, v = 96, 2048, 6144
    hidden = torch.randn(n, hsize, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, hsize, generator=g, dtype=torch.float64) / math.sqrt(hsize) * 4).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    ref_logp, ref_ent, _ = log_probs_dense(hidden.double() @ weight.double().t(), target)
    logp, ent = rc.linear_log_probs(hidden, weight, target, return_entropy=True, chunk_rows=40, chunk_cols=2500)
    torch.testing.assert_close(logp.double(), ref_logp, **linear_tol(dtype))
    torch.testing.assert_close(ent.double(), ref_ent, **linear_tol(dtype))
    mat_logp = rc.vocab_parallel_log_probs(hidden @ weight.t(), target)
    assert (mat_logp.double() - ref_logp).abs().max() > 100 * (logp.double() - ref_logp).abs().max()


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=pytest.mark.skipif(
    rc.backend() != "cpu", reason="the compiled CPU kernels are not loaded (ROLLOUT_CORR_FORCE_FALLBACK or no build)")),
    "fallback"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mm_f32_is_the_exact_product_accumulated_in_fp32(impl, dtype):
    """ops.mm_f32_ (the fused path's GEMM) against the fp64 product of its 16-bit inputs, for every operand layout
    it meets (row-major, transposed views, a strided slice that must be copied), beta 0 and 1, empty dimensions;
    the inputs are left unchanged and a result is never rounded to 16 bits."""
    from rollout_corr_ext import fallback, ops

    mm = ops.mm_f32_ if impl == "cpu" else fallback.mm_f32_
    g = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    a, b = rand(37, 48), rand(29, 48)
    deep_a, deep_b = rand(19, 600), rand(23, 600)  # K past the CPU kernel's depth slice (256): three MKL calls
    cases = [(a, b.t()), (a.t().contiguous().t(), b.t()), (b, a.t().contiguous()), (a[:, ::2], b[:, ::2].t()),
             (a[3:20], b[5:9].t()), (rand(1, 48), b.t()), (a, rand(48, 1)), (deep_a, deep_b.t()),
             (deep_a.t().contiguous().t(), deep_b.t().contiguous()), (deep_a[:, 1::2], deep_b[:, 1::2].t()),
             (rand(1, 600), deep_b.t()), (deep_a, rand(600, 1))]
    for x, y in cases:
        x0, y0 = x.clone(), y.clone()
        exact = x.double() @ y.double()
        out = torch.full(exact.shape, math.nan)
        mm(out, x, y, 0.0)
        # deep cases: the fp32 summation bound K 2^-24 sum_k |x_ik y_kj| (still 30x under one bf16 rounding)
        tol = {"rtol": 1e-6, "atol": 1e-5} if x.shape[1] <= 48 else {
            "rtol": 0, "atol": (x.shape[1] * 2.0 ** -24 * (x.double().abs() @ y.double().abs())).max().item()}
        torch.testing.assert_close(out.double(), exact, **tol)
        assert not torch.equal(out, out.to(dtype).float())  # kept at fp32, not a 16-bit value
        base = torch.randn(exact.shape, generator=g)
        acc = base.clone()
        mm(acc, x, y, 1.0)
        torch.testing.assert_close(acc.double(), base.double() + exact, **tol)
        assert torch.equal(x, x0) and torch.equal(y, y0)
    out = torch.full((4, 3), math.nan)
    mm(out, rand(4, 0), rand(0, 3), 0.0)
    assert torch.equal(out, torch.zeros(4, 3))
    mm(torch.empty(0, 3), rand(0, 5), rand(5, 3), 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 or both float16"):
        mm(torch.empty(2, 2), a[:2].float(), b[:2].t(), 0.0)


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=pytest.mark.skipif(
    rc.backend() != "cpu", reason="the compiled CPU kernels are not loaded (ROLLOUT_CORR_FORCE_FALLBACK or no build)")),
    "fallback"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", ["input", torch.float32])
def test_hilo_add_holds_the_sum_to_its_stated_bound(impl, dtype, x_dtype):
    """ops.hilo_add_ (the 16-bit gradients' accumulator) against the fp64 sum of what it was given: after T calls
    the pair hi + lo is within sum_t (2^-17 + 2^-24) |s_t| of the exact sum (s_t: the running sums; fp16: plus
    2^-34 per addition where hi is subnormal; docs/logprobs.md), and hi, the returned gradient, within half an ulp
    of its dtype more: it is the exact sum rounded to its dtype except where that sum lies within the bound of a
    rounding boundary (under 1 % of the elements here). Terms of mixed sign and magnitude (cancellation), rows
    through ``index`` (distinct, any order), and the CPU kernel bit for bit equal to the fallback's torch ops."""
    from rollout_corr_ext import fallback, ops

    add = ops.hilo_add_ if impl == "cpu" else fallback.hilo_add_
    x_dtype = dtype if x_dtype == "input" else x_dtype
    g = torch.Generator().manual_seed(9)
    n, cols, steps = 40, 96, 64
    hi, lo = torch.zeros(n, cols, dtype=dtype), torch.zeros(n, cols, dtype=torch.bfloat16)
    twin = (torch.zeros_like(hi), torch.zeros_like(lo))
    exact = torch.zeros(n, cols, dtype=torch.float64)
    bound = torch.zeros(n, cols, dtype=torch.float64)
    for t in range(steps):
        scale = torch.exp(torch.randn(n, 1, generator=g, dtype=torch.float64) * 2)  # rows of different magnitude
        x = (torch.randn(n, cols, generator=g, dtype=torch.float64) * scale).to(x_dtype)
        index = torch.randperm(n, generator=g)[:n // 2] if t % 3 == 2 else None
        add(hi, lo, x[:n // 2] if index is not None else x, index)
        if impl == "cpu":
            fallback.hilo_add_(*twin, x[:n // 2] if index is not None else x, index)
        rows = index if index is not None else torch.arange(n)
        exact[rows] += x[:rows.numel()].double()
        bound[rows] += exact[rows].abs() * (2.0 ** -17 + 2.0 ** -24) + (2.0 ** -34 if dtype == torch.float16 else 0)
    if impl == "cpu":
        assert torch.equal(hi, twin[0]) and torch.equal(lo, twin[1])
    held = hi.double() + lo.double()
    assert torch.all((held - exact).abs() <= bound)
    assert torch.all((hi.double() - exact).abs() <= _half_ulp(exact, dtype) + bound)
    assert (hi.double() != exact.to(dtype).double()).double().mean() < 0.01  # only next to a rounding boundary
    # overflow (fp16 past 65504): the pair stays inf, never NaN
    big_hi, big_lo = torch.full((1, 3), 6e4, dtype=dtype), torch.zeros(1, 3, dtype=torch.bfloat16)
    add(big_hi, big_lo, torch.full((1, 3), 3e38 if dtype == torch.bfloat16 else 6e4, dtype=torch.float32), None)
    add(big_hi, big_lo, torch.full((1, 3), 3e38 if dtype == torch.bfloat16 else 6e4, dtype=torch.float32), None)
    assert torch.all(torch.isinf(big_hi)) and torch.all(big_lo == 0)
    with pytest.raises(RuntimeError, match="hilo_add_"):
        add(hi, lo.to(dtype) if dtype != torch.bfloat16 else lo.float(), x.to(x_dtype), None)


@pytest.mark.skipif(rc.backend() != "cpu", reason="the compiled CPU kernels are not loaded")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_ops_opcheck(dtype):
    """torch.library.opcheck on the linear family's ops: schemas (declared mutation), fake kernels, dispatch."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 300, generator=g).to(dtype), torch.randn(300, 5, generator=g).to(dtype)
    torch.library.opcheck(torch.ops.rollout_corr.mm_f32_.default, (torch.zeros(6, 5), a, b, 1.0))
    hi, lo = torch.randn(7, 5, generator=g).to(dtype), torch.zeros(7, 5, dtype=torch.bfloat16)
    for x, index in ((torch.randn(7, 5, generator=g), None), (torch.randn(3, 5, generator=g).to(dtype),
                                                            torch.tensor([4, 0, 6]))):
        torch.library.opcheck(torch.ops.rollout_corr.hilo_add_.default, (hi, lo, x, index))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_gradients_summed_over_many_chunks_match_the_fp64_oracle(dtype, monkeypatch):
    """The 16-bit gradients are hi/lo pairs summed over every vocab tile (grad_hidden) and row chunk (grad_weight).
    With 100 tiles and 12 row chunks, some rows ignored (the indexed rows of the accumulator): (1) they are within
    the tolerance the 16-bit gradients are held to (no less accurate than the materialized path's, against the fp64
    oracle of the exact product); (2) each returned gradient is the fp64 sum of the very chunk products its
    accumulator was handed (watched at ``ops.hilo_add_``) to within half an ulp plus the accumulator's stated bound,
    and equal to that sum rounded once to 16 bits on more than 99 % of the elements."""
    from rollout_corr_ext import ops

    n, hsize, v, cr, cc = 96, 192, 1600, 8, 16
    g = torch.Generator().manual_seed(31)
    hidden = torch.randn(n, hsize, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, hsize, generator=g, dtype=torch.float64) / math.sqrt(hsize) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[::7] = -100
    ws = torch.randn(n, generator=g, dtype=torch.float64)

    # storage of each accumulator's hi -> the fp64 sum of everything added to it, and the bound of the pair's error
    exact_sums, bounds = {}, {}
    real_add = ops.hilo_add_

    def watched_add(hi, lo, x, index=None):
        store = hi.untyped_storage()
        views = []
        for table in (exact_sums, bounds):
            flat = table.setdefault(store.data_ptr(), torch.zeros(store.nbytes() // hi.element_size(),
                                                                  dtype=torch.float64))
            views.append(flat.as_strided(hi.shape, hi.stride(), hi.storage_offset()))
        total, bound = views
        rows = slice(None) if index is None else index
        total[rows] += x.double()
        bound[rows] += total[rows].abs() * (2.0 ** -17 + 2.0 ** -24) + (2.0 ** -34 if dtype == torch.float16 else 0)
        real_add(hi, lo, x, index)

    monkeypatch.setattr(ops, "hilo_add_", watched_add)
    hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = rc.linear_log_probs(hx, wx, target, return_entropy=True, chunk_rows=cr, chunk_cols=cc)
    (logp.double() * ws).sum().add((ent.double() * ws.flip(0)).sum()).backward()
    monkeypatch.undo()
    ref_logp, ref_ent, (hd, wd, _) = _oracle(hidden, weight, None, target, v, 1.0, rounded=False)
    (ref_logp * ws).sum().add((ref_ent * ws.flip(0)).sum()).backward()
    hm, wm = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lm, em = rc.vocab_parallel_log_probs(hm @ wm.t(), target, return_entropy=True)
    (lm.double() * ws).sum().add((em.double() * ws.flip(0)).sum()).backward()
    for name, a, m, r in (("hidden", hx.grad, hm.grad, hd.grad), ("weight", wx.grad, wm.grad, wd.grad)):
        assert a.dtype == dtype
        err, err_m = _rel_err(a, r), _rel_err(m, r)
        assert err <= 1.5 * err_m + 2e-3, (name, err, err_m)
        summed, bound = (table[a.untyped_storage().data_ptr()][:a.numel()].view(a.shape)
                         for table in (exact_sums, bounds))
        assert torch.all((a.double() - summed).abs() <= _half_ulp(summed, dtype) + bound), name
        off = (a.double() != summed.to(dtype).double()).double().mean().item()
        assert off < 0.01, (name, off)
    assert torch.all(hx.grad[target == -100] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_both_cpu_routes_of_the_sixteen_bit_gradient_gemms(dtype, monkeypatch):
    """The 16-bit backward's gradient GEMMs take oneDNN's 16-bit GEMM on a CPU that runs it natively and the fp32
    one (``ops.mm_f32_``) on one that does not (there torch's 16-bit mm is a reference loop, 40-85x slower: the
    backward of 512 rows x 32000 took 21 s instead of 0.5 s on an AVX2-only VM). A machine takes one route; both
    run here, each against the fp64 oracle and with the materialized path's accuracy, the log-probs unchanged."""
    from rollout_corr_ext import linear

    n, hsize, v = 40, 48, 300
    hidden, weight, _ = _inputs(n, hsize, v, dtype, 3, False)
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    target[::6] = -100
    ws = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref_logp, ref_ent, (hd, wd, _) = _oracle(hidden, weight, None, target, v, 1.0, rounded=False)
    (ref_logp * ws).sum().add((ref_ent * ws.flip(0)).sum()).backward()
    hm, wm = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lm, em = rc.vocab_parallel_log_probs(hm @ wm.t(), target, return_entropy=True)
    (lm.double() * ws).sum().add((em.double() * ws.flip(0)).sum()).backward()
    outs = []
    for native in (True, False):
        monkeypatch.setattr(linear, "_native_16bit_gemm", lambda dt, native=native: native)
        hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, ent = rc.linear_log_probs(hx, wx, target, return_entropy=True, chunk_rows=16, chunk_cols=64)
        (logp.double() * ws).sum().add((ent.double() * ws.flip(0)).sum()).backward()
        for a, m, r in ((hx.grad, hm.grad, hd.grad), (wx.grad, wm.grad, wd.grad)):
            assert a.dtype == dtype and _rel_err(a, r) <= 1.5 * _rel_err(m, r) + 2e-3, (native, _rel_err(a, r))
        outs.append((logp, ent))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An upper bound of half an ulp of ``dtype`` at the fp64 values ``x`` (the error of rounding them to it)."""
    return (x.abs() * 2.0 ** (-8 if dtype == torch.bfloat16 else -11)).clamp(min=2.0 ** -25)


@pytest.mark.parametrize("device", DEVICES)
def test_chunking_does_not_change_values(device):
    """fp64: every chunk shape (1 x 1 up to one chunk) gives the same log-probs and gradients to fp64 rounding."""
    with ops_on(device) as dev:
        hidden, weight, bias = _inputs(11, 6, 23, torch.float64, 5, True)
        target = torch.randint(0, 23, (11,), generator=torch.Generator().manual_seed(3))
        results = []
        for cr, cc in [(1, 1), (3, 5), (11, 23), (100, 100)]:
            hx, wx, bx = (x.to(dev, copy=True).requires_grad_(True) for x in (hidden, weight, bias))
            lp, ent = rc.linear_log_probs(hx, wx, target.to(dev), bias=bx, return_entropy=True, chunk_rows=cr,
                                          chunk_cols=cc)
            (lp.sum() + ent.sum()).backward()
            results.append([t.detach().cpu() for t in (lp, ent, hx.grad, wx.grad, bx.grad)])
        for other in results[1:]:
            for a, b in zip(results[0], other):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_empty_rows_and_ignored_rows(device):
    with ops_on(device) as dev:
        hidden, weight, _ = _inputs(12, 8, 30, torch.float32, 1, False)
        h3 = hidden.reshape(4, 3, 8).to(dev, copy=True).requires_grad_(True)  # megatron's [s, b, H]
        target = torch.randint(0, 30, (4, 3)).to(dev)
        target[1] = -100
        lp = rc.linear_log_probs(h3, weight.to(dev), target, chunk_rows=5, chunk_cols=7)
        assert lp.shape == (4, 3) and torch.all(lp[1] == 0)
        lp.sum().backward()
        assert torch.all(h3.grad[1] == 0)  # ignored rows: no gradient
        ref, _, _ = log_probs_dense((hidden.double() @ weight.double().t()).reshape(4, 3, 30), target.cpu())
        torch.testing.assert_close(lp.detach().cpu().double(), ref, rtol=1e-5, atol=1e-5)
        empty = torch.zeros(0, 8, device=dev, requires_grad=True)
        out = rc.linear_log_probs(empty, weight.to(dev), torch.zeros(0, dtype=torch.int64, device=dev))
        assert out.shape == (0,)
        out.sum().backward()
        assert empty.grad.shape == (0, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_minus_inf_bias_columns_and_extreme_values(device):
    """A -inf bias masks vocab columns (top-k style): probability 0, zero gradient there, a target there gives -inf;
    a bias of 1e30 keeps the max-shifted math exact; a row whose every column is -inf raises."""
    with ops_on(device) as dev:
        hidden, weight, bias = _inputs(9, 5, 20, torch.float32, 2, True)
        bias[3:11] = -math.inf
        bias[15] = 1e30
        target = torch.randint(0, 20, (9,), generator=torch.Generator().manual_seed(1))
        target = torch.where((target >= 3) & (target < 11), target + 8, target)
        target[0] = 5  # a masked column: logp = -inf
        target[1] = 15
        hx, wx, bx = (x.to(dev, copy=True).requires_grad_(True) for x in (hidden, weight, bias))
        lp, ent = rc.linear_log_probs(hx, wx, target.to(dev), bias=bx, return_entropy=True, chunk_rows=4,
                                      chunk_cols=6)
        z = hidden.double() @ weight.double().t() + bias.double()
        ref_lp, ref_ent, _ = log_probs_dense(z, target)
        assert lp[0].item() == -math.inf
        torch.testing.assert_close(lp.detach().cpu()[1:].double(), ref_lp[1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.detach().cpu().double(), ref_ent, rtol=1e-5, atol=1e-5)
        lp[1:].sum().backward()
        assert torch.all(bx.grad[3:11] == 0) and torch.all(torch.isfinite(hx.grad)) and torch.all(
            torch.isfinite(wx.grad))
        if dev == "cpu":
            with pytest.raises((ValueError, RuntimeError), match="-inf"):
                rc.linear_log_probs(hidden, weight, target, bias=torch.full((20,), -math.inf))


def test_double_backward_raises_instead_of_dropping_the_second_order_term():
    hidden, weight, _ = _inputs(5, 4, 9, torch.float64, 6, False)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = rc.linear_log_probs(h, w, torch.randint(0, 9, (5,)))
    (gh,) = torch.autograd.grad(logp.sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gh.sum().backward()


def test_bad_arguments_are_named():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    cases = [
        (dict(hidden=h.int()), TypeError, "hidden"),
        (dict(weight=torch.randn(10, 7)), ValueError, "weight"),
        (dict(weight=w.double()), ValueError, "weight"),
        (dict(target=t.float()), TypeError, "target"),
        (dict(target=t[:3]), ValueError, "target"),
        (dict(bias=torch.randn(9)), ValueError, "bias"),
        (dict(chunk_rows=0), ValueError, "chunk_rows"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(vocab_size=11), ValueError, "vocab_size"),
        (dict(target=torch.full((4,), 10)), (ValueError, RuntimeError), "target"),
    ]
    for kw, exc, word in cases:
        args = dict(hidden=h, weight=w, target=t)
        args.update(kw)
        extra = {k: args.pop(k) for k in list(args) if k not in ("hidden", "weight", "target")}
        with pytest.raises(exc, match=word):
            rc.linear_log_probs(args["hidden"], args["weight"], args["target"], **extra)


def test_errors_name_the_row_of_the_whole_batch_when_chunked():
    """The merge runs per row chunk; its errors must still name the row of the flattened hidden / target, not the
    row within the chunk, and say what the logits are here (the product, which the caller never saw)."""
    n = 10
    for chunk_rows in (None, 4, 3, 1):
        h, w, t = torch.randn(n, 4), torch.randn(6, 4), torch.randint(0, 6, (n,))
        h[6, 0] = math.nan
        with pytest.raises(ValueError, match=r"hidden @ weight.T .* NaN or \+inf in row 6 \(hidden.reshape\(-1, H\)\[6\]"):
            rc.linear_log_probs(h, w, t, chunk_rows=chunk_rows)
        h[6, 0] = 0.0
        t[9] = 6
        with pytest.raises(ValueError, match=r"target.flatten\(\)\[9\] = 6"):
            rc.linear_log_probs(h, w, t, chunk_rows=chunk_rows)
        t[9] = 0
        bias = torch.zeros(6)
        h[7] = 0.0
        bias[:] = -math.inf
        t[:] = -100
        t[7] = 1  # every logit of row 7 is -inf; the other rows are ignored
        with pytest.raises(ValueError, match=r"every logit of row 7 \(hidden.reshape\(-1, H\)\[7\]"):
            rc.linear_log_probs(h, w, t, bias=bias, chunk_rows=chunk_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_temperature_outside_the_compute_type_is_named(dtype):
    acc = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    h, w, t = torch.randn(3, 4, dtype=dtype), torch.randn(6, 4, dtype=dtype), torch.tensor([0, 5, 2])
    for temperature in (1.0 / acc.max / 4, 1.0 / acc.tiny * 2):
        with pytest.raises(ValueError, match=r"temperature=.* is out of range"):
            rc.linear_log_probs(h, w, t, temperature=temperature)


# ------------------------------------------------------------------------------------------ tensor parallel


def _tp_worker(rank, world, dtype):
    group = dist.group.WORLD
    n, hsize, v_padded, vocab_size = 21, 12, 48, 45
    hidden, weight, bias = _inputs(n, hsize, v_padded, dtype, 7, True)
    target = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(8))
    target[2] = -100
    ws = torch.randn(n, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    v_local = v_padded // world
    sl = slice(rank * v_local, (rank + 1) * v_local)

    def run(h, w, b, grp, **kw):
        lp, ent = rc.linear_log_probs(h, w, target, grp, bias=b, vocab_size=vocab_size, temperature=0.8,
                                      return_entropy=True, chunk_rows=6, chunk_cols=5, **kw)
        (lp.double() * ws).sum().add((ent.double() * ws).sum()).backward()
        return lp.detach(), ent.detach()

    hx, wx, bx = hidden.clone().requires_grad_(True), weight[sl].clone().requires_grad_(True), \
        bias[sl].clone().requires_grad_(True)
    with CollectiveCounter() as fwd:
        lp, ent = rc.linear_log_probs(hx, wx, target, group, bias=bx, vocab_size=vocab_size, temperature=0.8,
                                      return_entropy=True, chunk_rows=6, chunk_cols=5, check_group=False)
    with CollectiveCounter() as bwd:
        (lp.double() * ws).sum().add((ent.double() * ws).sum()).backward()
    assert fwd.calls == ["all_gather_single"] or fwd.calls == ["all_gather_into_tensor"], fwd.calls
    assert bwd.calls == [], bwd.calls
    # the single-process result on the whole weight
    h1, w1, b1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True), \
        bias.clone().requires_grad_(True)
    lp1, ent1 = run(h1, w1, b1, None)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(lp, lp1, **tol)
    torch.testing.assert_close(ent, ent1, **tol)
    # grad_hidden: each rank holds its shard's part (ColumnParallelLinear all-reduces it); the weight/bias shards
    gh = hx.grad.clone()
    dist.all_reduce(gh, group=group)
    torch.testing.assert_close(gh, h1.grad, **tol)
    torch.testing.assert_close(wx.grad, w1.grad[sl], **tol)
    torch.testing.assert_close(bx.grad, b1.grad[sl], **tol)
    # check_group=True: a rank with a different row count gets a named error instead of a failed collective
    h_bad = hidden[: n - rank]
    with pytest.raises(ValueError, match="rows"):
        rc.linear_log_probs(h_bad, weight[sl], target[: n - rank], group, vocab_size=vocab_size, check_group=True,
                            chunk_rows=100)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tensor_parallel_matches_single_process(world, dtype):
    run_workers(_tp_worker, world, dtype)


# ------------------------------------------------------------------------------------------ megatron loss_func


class _OutputLayer:
    """What make_policy_loss_func reads from megatron's ColumnParallelLinear output layer."""

    def __init__(self, weight, bias=None):
        self.weight, self.bias = weight, bias
        self.sequence_parallel = False
        self.skip_bias_add = False


def _policy_batch(s, b, v, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.rand(b, s, generator=g) > 0.2
    adv = torch.randn(b, generator=g)
    old = -torch.rand(b, s, generator=g) * 3
    return target, mask, adv, old


def _loss_and_grads(loss_func, x, params):
    loss, num_tokens, metrics = loss_func(x)
    (loss / num_tokens).backward()
    return loss.detach(), num_tokens, {k: v.detach() for k, v in metrics.items()}, [p.grad.clone() for p in params]


def test_make_policy_loss_func_from_hidden_states_equals_logits_path():
    """output_layer: loss, num_tokens, every metric and the gradients of hidden and weight equal the logits path."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    s, b, hsize, v = 7, 3, 10, 40
    target, mask, adv, old = _policy_batch(s, b, v, 0)
    hidden, weight, bias = _inputs(s * b, hsize, v, torch.float64, 4, True)
    hidden = hidden.reshape(s, b, hsize)
    kw = dict(old_log_prob=old.double(), entropy_coeff=0.01, temperature=0.9)
    h1, w1, b1 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    fused = _loss_and_grads(make_policy_loss_func(target, adv, mask, output_layer=_OutputLayer(w1, b1), **kw), h1,
                            [h1, w1, b1])
    h2, w2, b2 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    logits = h2 @ w2.t() + b2
    ref = _loss_and_grads(make_policy_loss_func(target, adv, mask, **kw), logits, [h2, w2, b2])
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.as_tensor(fused[1]), torch.as_tensor(ref[1]))
    assert fused[2].keys() == ref[2].keys()
    for k in ref[2]:
        torch.testing.assert_close(fused[2][k], ref[2][k], rtol=1e-12, atol=1e-12)
    for a, r in zip(fused[3], ref[3]):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    # sequence_parallel without TP is the plain path (megatron only shards the sequence over TP ranks)
    layer = _OutputLayer(w1.detach(), b1.detach())
    layer.sequence_parallel = True
    loss_sp = make_policy_loss_func(target, adv, mask, output_layer=layer, **kw)(hidden)[0]
    torch.testing.assert_close(loss_sp, ref[0], rtol=1e-12, atol=1e-12)


def _megatron_tp_worker(rank, world):
    from rollout_corr_ext.megatron import make_policy_loss_func

    group = dist.group.WORLD
    s, b, hsize, v = 6, 2, 8, 36
    target, mask, adv, old = _policy_batch(s, b, v, 1)
    hidden, weight, _ = _inputs(s * b, hsize, v, torch.float64, 5, False)
    hidden = hidden.reshape(s, b, hsize)
    sl = slice(rank * (v // world), (rank + 1) * (v // world))
    kw = dict(old_log_prob=old.double(), entropy_coeff=0.01, tp_group=group)
    h, w = hidden.clone().requires_grad_(True), weight[sl].clone().requires_grad_(True)
    loss_func = make_policy_loss_func(target, adv, mask, output_layer=_OutputLayer(w), **kw)
    with CollectiveCounter() as fwd:
        loss, num_tokens, metrics = loss_func(h)
    with CollectiveCounter() as bwd:
        (loss / num_tokens).backward()
    assert fwd.calls.count("all_gather_single") + fwd.calls.count("all_gather_into_tensor") >= 1
    assert bwd.calls == ["all_reduce"], bwd.calls  # the copy-to-TP-region gradient sum, as megatron's output layer
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = _loss_and_grads(make_policy_loss_func(target, adv, mask, old_log_prob=old.double(), entropy_coeff=0.01),
                          h1 @ w1.t(), [h1, w1])
    torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, ref[3][0], rtol=1e-10, atol=1e-12)  # the full gradient on every rank
    torch.testing.assert_close(w.grad, ref[3][1][sl], rtol=1e-10, atol=1e-12)


def test_make_policy_loss_func_from_hidden_states_tp2():
    run_workers(_megatron_tp_worker, 2)


# ------------------------------------------------------------------------------------------ sequence parallel

_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def _sp_worker(rank, world, dtype, packed_ignored):
    """sequence_parallel=True on this rank's [s / tp, b, H] rows: the log-probs and entropy of the whole sequence
    and every gradient (grad_hidden now whole for its rows: reduce-scattered) equal the single-process call on the
    whole sequence and weight; the collectives are exactly the documented ones."""
    group = dist.group.WORLD
    s, b, hsize, v_padded, vocab_size = 4 * world, 3, 10, 8 * world, 8 * world - 3
    hidden, weight, bias = _inputs(s * b, hsize, v_padded, dtype, 11, True)
    hidden = hidden.reshape(s, b, hsize)
    target = torch.randint(0, vocab_size, (s, b), generator=torch.Generator().manual_seed(12))
    if packed_ignored:  # ignored rows on some ranks only, and a whole rank's piece ignored
        target[0, 1] = -100
        target[s // world: 2 * s // world] = -100
    ws = torch.randn(s, b, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    v_local = v_padded // world
    sl = slice(rank * v_local, (rank + 1) * v_local)
    rows = slice(rank * (s // world), (rank + 1) * (s // world))
    kw = dict(vocab_size=vocab_size, temperature=0.7, return_entropy=True, chunk_rows=5, chunk_cols=3)

    hx = hidden[rows].clone().requires_grad_(True)
    wx, bx = weight[sl].clone().requires_grad_(True), bias[sl].clone().requires_grad_(True)
    with CollectiveCounter() as fwd:
        lp, ent = rc.linear_log_probs(hx, wx, target, group, bias=bx, sequence_parallel=True, check_group=False,
                                      **kw)
    with CollectiveCounter() as bwd:
        (lp.double() * ws).sum().add((ent.double() * ws).sum()).backward()
    # forward: the hidden rows' gather and the records' gather; backward: the rows gathered again, one
    # reduce-scatter of grad_hidden
    assert len(fwd.calls) == 2 and all(c in _GATHERS for c in fwd.calls), fwd.calls
    assert len(bwd.calls) == 2 and bwd.calls[0] in _GATHERS and bwd.calls[1] in _SCATTERS, bwd.calls
    h1, w1, b1 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    lp1, ent1 = rc.linear_log_probs(h1, w1, target, bias=b1, **kw)
    (lp1.double() * ws).sum().add((ent1.double() * ws).sum()).backward()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    assert lp.shape == (s, b)
    torch.testing.assert_close(lp, lp1.detach(), **tol)
    torch.testing.assert_close(ent, ent1.detach(), **tol)
    torch.testing.assert_close(hx.grad, h1.grad[rows], **tol)
    torch.testing.assert_close(wx.grad, w1.grad[sl], **tol)
    torch.testing.assert_close(bx.grad, b1.grad[sl], **tol)
    # the same through sampling replay's fused path
    from rollout_corr_ext.sampling import SamplingParams, sampled_linear_log_probs

    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.8)
    hx.grad = None
    r = sampled_linear_log_probs(hx, wx.detach(), target, sp, group, bias=bx.detach(), vocab_size=vocab_size,
                                 sequence_parallel=True, chunk_rows=5, chunk_cols=3)
    r1 = sampled_linear_log_probs(hidden, weight, target, sp, bias=bias, vocab_size=vocab_size, chunk_rows=5,
                                  chunk_cols=3)
    for a, e in zip(r, r1):
        torch.testing.assert_close(a, e, **tol)
    r.log_prob.masked_fill(~r.in_support, 0).double().mul(ws).sum().backward()
    h2 = hidden.clone().requires_grad_(True)
    r2 = sampled_linear_log_probs(h2, weight, target, sp, bias=bias, vocab_size=vocab_size)
    r2.log_prob.masked_fill(~r2.in_support, 0).double().mul(ws).sum().backward()
    torch.testing.assert_close(hx.grad, h2.grad[rows], **tol)
    # and through the kept-ids path (the whole sequence's kept sets, in target's row-major order), both outputs'
    # gradients in hidden, weight and bias
    from rollout_corr_ext.sampling import KeptTokens, kept_linear_log_probs

    g = torch.Generator().manual_seed(14)
    lists = [torch.randperm(vocab_size, generator=g)[:int(torch.randint(1, 7, (1,), generator=g))].tolist()
             for _ in range(s * b)]
    for i in range(0, s * b, 2):  # half the targets inside their kept set
        if int(target.reshape(-1)[i]) != -100:
            lists[i] = list(dict.fromkeys([int(target.reshape(-1)[i])] + lists[i]))
    kept = KeptTokens.from_lists(lists, temperature=0.7)
    results, grads = [], []
    for h, w, bb, kw_sp in ((hidden[rows], weight[sl], bias[sl], dict(tp_group=group, sequence_parallel=True)),
                            (hidden, weight, bias, {})):
        h, w, bb = (x.clone().requires_grad_(True) for x in (h, w, bb))
        with CollectiveCounter() as fwd:
            r = kept_linear_log_probs(h, w, target, kept, bias=bb, vocab_size=vocab_size, chunk_rows=5, chunk_cols=3,
                                      check_group=False, **kw_sp)
        with CollectiveCounter() as bwd:
            r.log_prob.masked_fill(~r.in_support, 0).double().mul(ws).sum().add(
                (r.entropy.double() * ws).sum()).backward()
        if kw_sp:  # forward: the rows' gather, the log-S pass's records, MAX, SUM, MAX; backward: gather, scatter
            assert len(fwd.calls) == 5 and fwd.calls[0] in _GATHERS, fwd.calls
            assert len(bwd.calls) == 2 and bwd.calls[0] in _GATHERS and bwd.calls[1] in _SCATTERS, bwd.calls
        results.append(r)
        grads.append((h.grad, w.grad, bb.grad))
    assert torch.equal(results[0].in_support, results[1].in_support) and not bool(results[1].in_support.all())
    for a, e in zip(results[0][:3], results[1][:3]):
        fin = e != -math.inf
        assert torch.equal(a == -math.inf, ~fin)
        torch.testing.assert_close(a[fin], e[fin], **tol)
    for a, e in zip(grads[0], (grads[1][0][rows], grads[1][1][sl], grads[1][2][sl])):
        torch.testing.assert_close(a, e, **tol)
    # kept sets for the whole sequence, named as such when they do not match it
    with pytest.raises(ValueError, match=r"kept has \d+ rows .* but the gathered hidden has"):
        kept_linear_log_probs(hidden[rows], weight[sl], target, KeptTokens.from_lists(lists[:-1], temperature=0.7),
                              group, bias=bias[sl], vocab_size=vocab_size, sequence_parallel=True)
    # target must be the whole sequence
    with pytest.raises(ValueError, match="sequence_parallel: target must be the whole sequence"):
        rc.linear_log_probs(hx, wx, target[rows], group, sequence_parallel=True, vocab_size=vocab_size)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_parallel_equals_the_whole_sequence(world, dtype):
    run_workers(_sp_worker, world, dtype, world == 2)


def _megatron_sp_worker(rank, world, packed):
    from rollout_corr_ext import KeptTokens, SamplingParams
    from rollout_corr_ext.megatron import make_policy_loss_func

    group = dist.group.WORLD
    s, b, hsize, v = 8, 2, 8, 36
    target, mask, adv, old = _policy_batch(s, b, v, 3)
    hidden, weight, _ = _inputs(s * b, hsize, v, torch.float64, 6, False)
    hidden = hidden.reshape(s, b, hsize)
    if packed:  # one stream [T] of two sequences; hidden [T, 1, H]
        target, mask, old = (x.t().reshape(-1) for x in (target, mask, old))
        adv = torch.randn(2, generator=torch.Generator().manual_seed(4))
        hidden = hidden.reshape(s * b, 1, hsize)
        extra = dict(cu_seqlens=torch.tensor([0, 5, s * b]))
    else:
        extra = {}
    rows = slice(rank * (hidden.shape[0] // world), (rank + 1) * (hidden.shape[0] // world))
    sl = slice(rank * (v // world), (rank + 1) * (v // world))
    g = torch.Generator().manual_seed(5)  # the engine's kept ids: one set per target position, half with the target
    lists = [torch.randperm(v, generator=g)[:int(torch.randint(1, 9, (1,), generator=g))].tolist()
             for _ in range(target.numel())]
    for i in range(0, target.numel(), 2):
        lists[i] = list(dict.fromkeys([int(target.reshape(-1)[i])] + lists[i]))
    for sampling in (None, SamplingParams(top_k=6, top_p=0.9), KeptTokens.from_lists(lists)):
        kw = dict(old_log_prob=old.double(), entropy_coeff=0.01, sampling=sampling, **extra)
        h, w = hidden[rows].clone().requires_grad_(True), weight[sl].clone().requires_grad_(True)
        layer = _OutputLayer(w)
        layer.sequence_parallel = True
        loss_func = make_policy_loss_func(target, adv, mask, output_layer=layer, tp_group=group, **kw)
        loss, num_tokens, metrics = loss_func(h)
        with CollectiveCounter() as bwd:
            (loss / num_tokens).backward()
        # no all-reduce of grad_hidden: the reduce-scatter sums it
        assert sorted(bwd.calls) == sorted([_GATHERS[0], _SCATTERS[0]]) or \
            sorted(bwd.calls) == sorted([_GATHERS[1], _SCATTERS[1]]), bwd.calls
        h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        ref = _loss_and_grads(make_policy_loss_func(target, adv, mask, **kw), h1 @ w1.t(), [h1, w1])
        torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-12, atol=1e-12)
        assert int(num_tokens) == int(ref[1])
        for k in ref[2]:
            torch.testing.assert_close(metrics[k].detach(), ref[2][k], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h.grad, ref[3][0][rows], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w.grad, ref[3][1][sl], rtol=1e-10, atol=1e-12)
    layer.sequence_parallel = True
    with pytest.raises(ValueError, match="logits_layout must be 'sbv'"):
        make_policy_loss_func(target, adv, mask, output_layer=layer, tp_group=group, logits_layout="bsv", **extra)


@pytest.mark.parametrize("packed", [False, True])
def test_make_policy_loss_func_with_sequence_parallel_equals_one_process(packed):
    run_workers(_megatron_sp_worker, 2, packed)


@pytest.mark.parametrize("device", device_params("cpu", "fallback", "emulated", "cuda"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunks", [(4, 4), (64, 64)])
@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "zeroed"])
def test_what_the_loss_excludes_never_reaches_an_output_or_gradient(device, dtype, chunks, compact, monkeypatch):
    """NaN / inf in the hidden state of an ignore_index row, and in the weight (and bias) rows of the padded
    vocabulary (at or past vocab_size, here a partial tile and a whole tile of padding), reach neither the outputs
    nor any gradient: those rows are never multiplied (ignored rows left out of the GEMMs, or, where finding them
    would need a host read (a CUDA graph being captured), zeroed in each chunk). Every value and gradient equals the
    oracle on the clean inputs, whose excluded rows hold zeros; the gradients of the excluded rows are exactly 0."""
    n, h, v, vocab_size = 13, 8, 12, 7
    cr, cc = chunks
    if not compact:
        monkeypatch.setattr(rc.linear, "_can_compact", lambda hidden: False)
    with ops_on(device) as dev:
        hidden, weight, bias = _inputs(n, h, v, dtype, 5, True)
        target = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(4))
        target[[0, 5, 6, 12]] = -100
        ignored = target == -100
        hidden[ignored], weight[vocab_size:], bias[vocab_size:] = 0, 0, 0
        ref_logp, ref_ent, leaves = _oracle(hidden, weight, bias, target, vocab_size, 1.0, rounded=False)
        ws = torch.randn(n, dtype=torch.float64)
        (ref_logp * ws).sum().add((ref_ent * ws.flip(0)).sum()).backward()
        poisoned_h, poisoned_w, poisoned_b = hidden.clone(), weight.clone(), bias.clone()
        poisoned_h[0], poisoned_h[5] = math.nan, math.inf
        poisoned_h[12, 3] = -math.inf
        poisoned_w[vocab_size:] = math.nan
        poisoned_w[vocab_size + 2, 1] = math.inf
        poisoned_b[vocab_size:] = math.nan
        hx, wx, bx = (x.to(dev, copy=True).requires_grad_(True) for x in (poisoned_h, poisoned_w, poisoned_b))
        logp, ent = rc.linear_log_probs(hx, wx, target.to(dev), bias=bx, vocab_size=vocab_size,
                                        return_entropy=True, chunk_rows=cr, chunk_cols=cc)
        (logp.double().cpu() * ws).sum().add((ent.double().cpu() * ws.flip(0)).sum()).backward()
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else (
            {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2})
        torch.testing.assert_close(logp.cpu().double(), ref_logp.detach(), **linear_tol(dtype))
        torch.testing.assert_close(ent.cpu().double(), ref_ent.detach(), **linear_tol(dtype))
        assert torch.all(logp.cpu()[ignored] == 0) and torch.all(ent.cpu()[ignored] == 0)
        for name, ours, ref in zip(("hidden", "weight", "bias"), (hx.grad, wx.grad, bx.grad), leaves):
            assert torch.isfinite(ours).all(), f"{name}.grad holds non-finite values from an excluded row"
            torch.testing.assert_close(ours.cpu().double(), ref.grad, **tol)
        assert torch.all(hx.grad.cpu()[ignored] == 0)
        assert torch.all(wx.grad.cpu()[vocab_size:] == 0) and torch.all(bx.grad.cpu()[vocab_size:] == 0)


@pytest.mark.parametrize("device", device_params("cpu", "fallback", "emulated", "cuda"))
def test_every_row_ignored_and_the_error_names_the_callers_row(device):
    """All rows ignored: log-probs 0 and zero gradients without a GEMM; with ignored rows left out of the GEMMs, the
    NaN error still names the row of the caller's hidden states (not the row within the computed rows)."""
    with ops_on(device) as dev:
        hidden, weight, _ = _inputs(9, 8, 10, torch.float32, 6, False)
        hx, wx = hidden.to(dev).requires_grad_(True), weight.to(dev).requires_grad_(True)
        target = torch.full((9,), -100, device=dev)
        logp = rc.linear_log_probs(hx, wx, target, chunk_rows=4, chunk_cols=4)
        logp.sum().backward()
        assert torch.all(logp == 0) and torch.all(hx.grad == 0) and torch.all(wx.grad == 0)
        if device == "emulated":
            return  # the emulated merge reports through status slots; the message is tested on cpu / fallback
        bad = hidden.clone()
        bad[7] = math.nan
        target = torch.tensor([-100, 1, -100, -100, 2, 3, -100, 4, 5], device=dev)
        with pytest.raises(ValueError, match=r"hidden.reshape\(-1, H\)\[7\]"):
            rc.linear_log_probs(bad.to(dev), weight.to(dev), target, chunk_rows=2, chunk_cols=4)


# ------------------------------------------------------------------------------------------ batch invariance


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant_rows_are_bitwise_independent_of_their_batch(dtype):
    """batch_invariant=True: every row's log-prob and entropy are bitwise equal whether it is computed alone, in a
    sub-batch at another offset, in a shuffled batch, or among ignored rows (which are left out of the GEMMs and so
    move every later row within its chunk); with sampling replay the kept set and log S too. The values are the
    default path's to its tolerance, and the gradients are correct (against the default path)."""
    from rollout_corr_ext.sampling import SamplingParams, sampled_linear_log_probs

    g = torch.Generator().manual_seed(31)
    n, hsize, v = 300, 64, 200
    hidden = torch.randn(n, hsize, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, hsize, generator=g, dtype=torch.float64) / math.sqrt(hsize) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    kw = dict(batch_invariant=True, chunk_rows=64, chunk_cols=48, return_entropy=True)
    full_lp, full_ent = rc.linear_log_probs(hidden, weight, target, **kw)
    sp = SamplingParams(top_k=20, top_p=0.8)
    skw = dict(batch_invariant=True, chunk_rows=64, chunk_cols=48)
    full_s = sampled_linear_log_probs(hidden, weight, target, sp, **skw)

    def same(rows, lp, ent, s=None):
        assert torch.equal(lp, full_lp[rows]) and torch.equal(ent, full_ent[rows])
        if s is not None:
            for a, b in zip(s, full_s):
                assert torch.equal(a, b[rows])

    for r0, r1 in [(0, 1), (7, 8), (5, 70), (63, 200), (1, 300)]:
        rows = torch.arange(r0, r1)
        same(rows, *rc.linear_log_probs(hidden[r0:r1], weight, target[r0:r1], **kw),
             sampled_linear_log_probs(hidden[r0:r1], weight, target[r0:r1], sp, **skw))
    perm = torch.randperm(n, generator=g)
    same(perm, *rc.linear_log_probs(hidden[perm], weight, target[perm], **kw),
         sampled_linear_log_probs(hidden[perm], weight, target[perm], sp, **skw))
    ignored = target.clone()
    ignored[torch.randperm(n, generator=g)[:90]] = -100
    keep = ignored != -100
    lp, ent = rc.linear_log_probs(hidden, weight, ignored, **kw)
    assert torch.equal(lp[keep], full_lp[keep]) and torch.equal(ent[keep], full_ent[keep])
    # against the default path (not bitwise: other GEMM shapes), and the gradient
    tol = linear_tol(dtype)
    hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_lp, ref_ent = rc.linear_log_probs(hx, wx, target, return_entropy=True)
    (ref_lp.double().sum() + ref_ent.double().sum()).backward()
    torch.testing.assert_close(full_lp, ref_lp.detach(), **tol)
    torch.testing.assert_close(full_ent, ref_ent.detach(), **tol)
    hb, wb = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = rc.linear_log_probs(hb, wb, target, **kw)
    (lp.double().sum() + ent.double().sum()).backward()
    if dtype in (torch.float16, torch.bfloat16):  # other chunk products rounded to 16 bits: compare the whole
        for a, b in ((hb.grad, hx.grad), (wb.grad, wx.grad)):
            assert _rel_err(a, b.double()) < 1e-2, _rel_err(a, b.double())
        return
    gtol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(hb.grad, hx.grad, **gtol)
    torch.testing.assert_close(wb.grad, wx.grad, **gtol)


def test_batch_invariant_default_chunk_and_errors():
    from rollout_corr_ext.linear import BATCH_INVARIANT_CHUNK_ROWS
    from rollout_corr_ext.megatron import make_policy_loss_func

    hidden, weight, _ = _inputs(BATCH_INVARIANT_CHUNK_ROWS + 3, 8, 20, torch.float32, 3, False)
    target = torch.randint(0, 20, (hidden.shape[0],), generator=torch.Generator().manual_seed(1))
    a = rc.linear_log_probs(hidden, weight, target, batch_invariant=True)
    b = rc.linear_log_probs(hidden[-3:], weight, target[-3:], batch_invariant=True)
    assert torch.equal(a[-3:], b)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        rc.linear_log_probs(hidden, weight, target, batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant=True applies to the fused path"):
        make_policy_loss_func(target.reshape(1, -1), torch.zeros(1), torch.ones(1, hidden.shape[0]),
                              batch_invariant=True)


# ------------------------------------------------------------------------------------------ multi-token prediction


def _mtp_oracle(hidden_all, weight, target, mask, adv, old, n_layers, scale, packed_cu):
    """megatron-core's MTP rules in fp64: the main head's policy loss from its materialized logits (the logits path
    of make_policy_loss_func), and for MTP head k the cross-entropy of log_softmax(h_k W^T) at the labels and loss
    mask rolled k times by megatron's own roll_tensor (per packed sequence with packed_seq_params), masked, summed,
    over the rolled mask's sum, times scaling_factor / L, added to the micro-batch's value."""
    from types import SimpleNamespace

    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from rollout_corr_ext.megatron import make_policy_loss_func

    chunks = torch.chunk(hidden_all, 1 + n_layers, dim=0)
    kw = dict(old_log_prob=old, entropy_coeff=0.01)
    if packed_cu is not None:
        kw["cu_seqlens"] = packed_cu
    main = make_policy_loss_func(target, adv, mask, **kw)
    loss, num_tokens, metrics = main(chunks[0] @ weight.t())
    value = loss / num_tokens
    psp = None if packed_cu is None else SimpleNamespace(cu_seqlens_q=packed_cu)
    labels = (target if packed_cu is None else target.reshape(1, -1)).clone()
    lmask = (mask if packed_cu is None else mask.reshape(1, -1)).double()
    heads = []
    for k in range(1, n_layers + 1):
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, packed_seq_params=psp)
        lmask, n_k = roll_tensor(lmask, shifts=-1, dims=-1, packed_seq_params=psp)
        logp = torch.log_softmax(chunks[k] @ weight.t(), -1)  # [s, b, V] (packed: [T, 1, V])
        lab = labels.t() if packed_cu is None else labels.reshape(-1, 1)
        ce = -logp.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        ce = ce.t() if packed_cu is None else ce.reshape(1, -1)
        ce_sum = (ce * lmask).sum()
        value = value + scale / n_layers * ce_sum / n_k
        heads.append((ce_sum, n_k))
    return value, int(num_tokens), heads


@pytest.mark.parametrize("packed", [False, True])
def test_make_policy_loss_func_with_mtp_heads_equals_megatrons_rules(packed):
    """mtp_num_layers = 2 through the fused path: the value loss_sum / num_tokens, every head's reported loss and
    the gradients of the heads' hidden states and the output weight equal the fp64 oracle of megatron's MTP rules;
    the heads' logits are never materialized (the fused path), and an MTP head's ignored positions (the rolled-off
    tail, prompt tokens) are left out of its GEMMs."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    s, b, hsize, v, n_layers, scale = 9, 2, 8, 30, 2, 0.3
    target, mask, adv, old = _policy_batch(s, b, v, 7)
    hidden, weight, _ = _inputs((1 + n_layers) * s * b, hsize, v, torch.float64, 8, False)
    cu = None
    if packed:
        target, mask, old = (x.t().reshape(-1) for x in (target, mask, old))  # any stream of s * b tokens
        cu = torch.tensor([0, 4, 11, s * b])
        adv = torch.randn(3, generator=torch.Generator().manual_seed(2))
        hidden = hidden.reshape((1 + n_layers) * s * b, 1, hsize)
    else:
        hidden = hidden.reshape((1 + n_layers) * s, b, hsize)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    kw = dict(old_log_prob=old.double(), entropy_coeff=0.01, mtp_num_layers=n_layers, mtp_loss_scaling_factor=scale)
    if packed:
        kw["cu_seqlens"] = cu
    loss, num_tokens, metrics = make_policy_loss_func(target, adv, mask, output_layer=_OutputLayer(w), **kw)(h)
    (loss / num_tokens).backward()
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    value, ref_tokens, heads = _mtp_oracle(h1, w1, target, mask, adv, old.double(), n_layers, scale, cu)
    value.backward()
    assert int(num_tokens) == ref_tokens
    torch.testing.assert_close(loss.detach() / num_tokens, value.detach(), rtol=1e-12, atol=1e-12)
    for k, (ce_sum, n_k) in enumerate(heads, 1):
        torch.testing.assert_close(metrics[f"actor/mtp_{k}_loss"].double(), torch.stack([ce_sum, n_k]).detach().double(),
                                   rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, h1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w1.grad, rtol=1e-10, atol=1e-12)
    # the argument checks
    with pytest.raises(ValueError, match="needs output_layer"):
        make_policy_loss_func(target, adv, mask, mtp_num_layers=1, **({"cu_seqlens": cu} if packed else {}))
    with pytest.raises(ValueError, match="mtp_num_layers must be an int"):
        make_policy_loss_func(target, adv, mask, output_layer=_OutputLayer(w), mtp_num_layers=-1)
    with pytest.raises(ValueError, match=r"\[\(1 \+ 2\) \* s, b, H\]"):
        make_policy_loss_func(target, adv, mask, output_layer=_OutputLayer(w), **kw)(h[:-1])


def _mtp_sp_worker(rank, world):
    """MTP heads under TP = 2 with sequence parallelism: each rank returns its [(1 + L) * s / tp, b, H] piece (each
    head's s / tp rows, concatenated, as megatron's SP MTP block hands them on); the loss, every metric and the
    gradients equal the single-process call on the whole hidden states."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    group = dist.group.WORLD
    s, b, hsize, v, n_layers = 8, 2, 8, 36, 2
    target, mask, adv, old = _policy_batch(s, b, v, 9)
    hidden, weight, _ = _inputs((1 + n_layers) * s * b, hsize, v, torch.float64, 10, False)
    heads = hidden.reshape(1 + n_layers, s, b, hsize)
    rows = slice(rank * (s // world), (rank + 1) * (s // world))
    local = heads[:, rows].reshape(-1, b, hsize)
    sl = slice(rank * (v // world), (rank + 1) * (v // world))
    kw = dict(old_log_prob=old.double(), entropy_coeff=0.01, mtp_num_layers=n_layers)
    for sp in (True, False):
        x = (local if sp else heads.reshape(-1, b, hsize)).clone().requires_grad_(True)
        w = weight[sl].clone().requires_grad_(True)
        layer = _OutputLayer(w)
        layer.sequence_parallel = sp
        loss, num_tokens, metrics = make_policy_loss_func(target, adv, mask, output_layer=layer, tp_group=group,
                                                          **kw)(x)
        (loss / num_tokens).backward()
        h1, w1 = hidden.reshape(-1, b, hsize).clone().requires_grad_(True), weight.clone().requires_grad_(True)
        ref = _loss_and_grads(make_policy_loss_func(target, adv, mask, output_layer=_OutputLayer(w1), **kw), h1,
                              [h1, w1])
        torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-12, atol=1e-12)
        for k in ref[2]:
            torch.testing.assert_close(metrics[k], ref[2][k], rtol=1e-10, atol=1e-12)
        want_h = ref[3][0].reshape(1 + n_layers, s, b, hsize)[:, rows].reshape(-1, b, hsize) if sp else ref[3][0]
        torch.testing.assert_close(x.grad, want_h, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w.grad, ref[3][1][sl], rtol=1e-10, atol=1e-12)


def test_mtp_heads_under_tensor_and_sequence_parallelism():
    run_workers(_mtp_sp_worker, 2)
