"""The fused policy-loss op (docs/megatron.md, "Loss modes") against the independent fp64 oracle
``rollout_corr_testing.dense_oracles.policy_loss_rows_dense`` (verl's formulas): compiled CPU kernels, the CUDA
kernels on a GPU (every compiled-op test has a ``cuda`` variant, skipped with the reason without one), and the CUDA
kernels run thread by thread on the CUDA emulator (their own tests below, over every launch-knob set).

The oracle always runs in fp64 on the very values the op sees (low-precision inputs upcast), so the only
allowed difference is the op's fp32 arithmetic (and, for the gradient, one rounding to log_prob's dtype).
"""

import math

import pytest
import torch

from rollout_corr_ext import _layout as LY
from rollout_corr_ext import fallback, losses, ops
from rollout_corr_ext._layout import PG_KIND_PPO_CLIP, PG_KIND_REINFORCE, PG_ROW_LOSS_SUM, PG_ROW_TOKENS
from rollout_corr_testing.backends import device_params
from rollout_corr_testing.dense_oracles import PPO_CLIP, REINFORCE, policy_loss_rows_dense
from rollout_corr_testing.tolerances import GRAD_TOL, OUTPUT_TOL, POLICY_LOSS_ROW_TOL

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
KINDS = [PG_KIND_PPO_CLIP, PG_KIND_REINFORCE]

#: The suite's tolerances (rollout_corr_testing.tolerances) by log_prob's dtype: loss_mat, row partials, gradient.
TOL = {dtype: {"loss": OUTPUT_TOL[dtype], "rows": POLICY_LOSS_ROW_TOL[dtype], "grad": GRAD_TOL[dtype]}
       for dtype in DTYPES}


def tol(dtype, what):
    rtol, atol = TOL[dtype][what]
    return {"rtol": rtol, "atol": atol}


def _case(b, t, dtype, seed, weights=True, expand_adv=False, mask_kind="bool", extremes=True, other_dtype=None):
    """One input set. Log-ratios ~ N(0, 0.6) so both clip sides and the dual clip (r > c = 3) occur; with
    `extremes`, a few log-ratios beyond +-20 (the clamp) and very negative advantages."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lr = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6
    if extremes and t > 3:
        lr[:, 1] = 25.0  # clamped at +20: zero gradient through the ratio
        lr[:, 2] = -30.0
        lr[0, 3] = 1.5  # ratio 4.5 > c
    old = lp - lr
    if expand_adv:
        adv = torch.randn(b, generator=g, dtype=torch.float64).reshape(-1, 1).expand(b, t)
    else:
        adv = torch.randn(b, t, generator=g, dtype=torch.float64) * 1.5
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    if b > 2:
        mask[1] = False  # a row RS rejected entirely
        mask[2] = True
    if mask_kind == "float":
        mask = mask.double() * (0.5 + torch.rand(b, t, generator=g, dtype=torch.float64))
    elif mask_kind == "int":
        mask = mask.to(torch.int32)
    w = (0.2 + 1.6 * torch.rand(b, t, generator=g, dtype=torch.float64)) if weights else None
    od = other_dtype or dtype
    return dict(lp=lp.to(dtype), old=old.to(od), adv=adv.to(od), mask=mask, w=None if w is None else w.to(od))


def sample_inputs(dtype):
    """(name, inputs, clip kwargs): ragged T across warp counts, B=1, a single token, masks of every kind,
    advantages expanded from [B] (stride 0), mixed dtypes, no dual clip (c = inf, the GRPO form)."""
    clip = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)
    yield "ragged", _case(5, 37, dtype, 0), clip
    yield "no_weights", _case(4, 130, dtype, 1, weights=False), clip
    yield "B1", _case(1, 70, dtype, 2), clip
    yield "single_token", _case(1, 1, dtype, 3, extremes=False), clip
    yield "float_mask_expanded_adv", _case(6, 33, dtype, 4, expand_adv=True, mask_kind="float"), clip
    yield "int_mask_fp32_others", _case(3, 64, dtype, 5, mask_kind="int", other_dtype=torch.float32), clip
    yield "no_dual_clip", _case(4, 20, dtype, 6), dict(clip_low=0.1, clip_high=0.1, clip_c=math.inf)


def _fp64(x):
    return None if x is None else (x.double() if x.is_floating_point() else x)


#: the layout's kind codes -> the oracle's kind names
ORACLE_KIND = {PG_KIND_PPO_CLIP: PPO_CLIP, PG_KIND_REINFORCE: REINFORCE}


def _reference(inp, kind, clip, requires_grad=False):
    lp = inp["lp"].detach().to(torch.float64, copy=True).requires_grad_(requires_grad)
    loss, rows = policy_loss_rows_dense(lp, _fp64(inp["old"]), _fp64(inp["adv"]), inp["mask"], _fp64(inp["w"]),
                                        clip["clip_low"], clip["clip_high"], clip["clip_c"], ORACLE_KIND[kind])
    return lp, loss, rows


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _upstream(inp, seed):
    g = torch.Generator().manual_seed(seed)
    b, t = inp["lp"].shape
    return (torch.randn(b, t, generator=g, dtype=torch.float64), torch.randn(b, generator=g, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------
# The compiled op (CPU kernels; CUDA kernels too when a GPU is present)
# ---------------------------------------------------------------------------------------------------------

#: cpu and cuda (skipped with the reason without a GPU); the emulated kernels have their own tests below.
DEVICES = device_params("cpu", "cuda", emulated_reason="the emulated kernels run in test_emulated_* below, over "
                                                       "every launch-knob set")


def _to(inp, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_gradient_match_fp64_reference(compiled_backend, device, dtype, kind):
    for name, inp, clip in sample_inputs(dtype):
        dinp = _to(inp, device)
        lp = dinp["lp"].clone().requires_grad_(True)
        loss, rows = torch.ops.rollout_corr.policy_loss_rows(lp, dinp["old"], dinp["adv"], dinp["mask"], dinp["w"],
                                                             clip["clip_low"], clip["clip_high"], clip["clip_c"],
                                                             kind)
        ref_lp, ref_loss, ref_rows = _reference(inp, kind, clip, requires_grad=True)
        assert loss.dtype == rows.dtype == _acc(dtype), name
        assert rows.shape == (lp.shape[0], 5), name
        torch.testing.assert_close(loss.cpu().double(), ref_loss.detach(), **tol(dtype, "loss"), msg=name)
        torch.testing.assert_close(rows.cpu().double(), ref_rows.detach(), **tol(dtype, "rows"), msg=name)

        g_mat, g_row = _upstream(inp, seed=len(name))
        ((loss * g_mat.to(device, loss.dtype)).sum() + (rows[:, PG_ROW_LOSS_SUM] * g_row.to(device, loss.dtype))
         .sum()).backward()
        ((ref_loss * g_mat).sum() + (ref_rows[:, PG_ROW_LOSS_SUM] * g_row).sum()).backward()
        assert lp.grad.dtype == dtype, name
        torch.testing.assert_close(lp.grad.cpu().double(), ref_lp.grad, **tol(dtype, "grad"), msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradient_through_rows_only_and_loss_mat_only(compiled_backend, kind, device):
    """Autograd hands the backward one upstream gradient and None/zeros for the other output."""
    inp = _case(5, 40, torch.float64, 11)
    dinp = _to(inp, device)
    clip = dict(clip_low=0.2, clip_high=0.2, clip_c=3.0)
    for use_rows in (True, False):
        lp = dinp["lp"].clone().requires_grad_(True)
        loss, rows = ops.policy_loss_rows(lp, dinp["old"], dinp["adv"], dinp["mask"], dinp["w"], **clip,
                                          loss_kind=kind)
        ref_lp, ref_loss, ref_rows = _reference(inp, kind, clip, requires_grad=True)
        (rows[:, PG_ROW_LOSS_SUM].sum() if use_rows else loss.sum()).backward()
        (ref_rows[:, PG_ROW_LOSS_SUM].sum() if use_rows else ref_loss.sum()).backward()
        grad = lp.grad.cpu()
        torch.testing.assert_close(grad, ref_lp.grad, rtol=1e-12, atol=1e-12)
        if use_rows:  # masked tokens get exactly zero gradient from the row sums
            assert torch.all(grad[inp["mask"] == 0] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_clamped_log_ratio_and_dual_clip_have_zero_gradient(compiled_backend, device):
    inp = _case(3, 10, torch.float64, 12)
    inp["adv"] = -inp["adv"].abs() - 0.1  # A < 0 everywhere: the dual clip applies
    dinp = _to(inp, device)
    lp = dinp["lp"].clone().requires_grad_(True)
    loss, rows = ops.policy_loss_rows(lp, dinp["old"], dinp["adv"], torch.ones_like(dinp["mask"]), None, 0.2, 0.2,
                                      3.0, PG_KIND_PPO_CLIP)
    loss.sum().backward()
    grad, loss, rows = lp.grad.cpu(), loss.detach().cpu(), rows.cpu()
    assert torch.all(grad[:, 1] == 0) and torch.all(grad[:, 2] == 0)  # |lp - old| > 20
    assert grad[0, 3] == 0 and rows[0, LY.PG_ROW_CLIP_LOWER] >= 1  # r = 4.5 > c: dual clip, flat
    torch.testing.assert_close(loss[:, 1], -inp["adv"][:, 1] * 3.0)  # exp(20) capped at -A c


@pytest.mark.parametrize("device", DEVICES)
def test_all_masked_rows_and_empty_shapes(compiled_backend, device):
    inp = _to(_case(4, 9, torch.float32, 13), device)
    mask = torch.zeros(4, 9, dtype=torch.bool, device=device)
    loss, rows = ops.policy_loss_rows(inp["lp"], inp["old"], inp["adv"], mask, inp["w"], 0.2, 0.2, 3.0,
                                      PG_KIND_PPO_CLIP)
    assert torch.all(rows == 0) and torch.isfinite(loss).all()
    for b, t in ((0, 5), (3, 0)):
        z = torch.zeros(b, t, device=device)
        loss, rows = torch.ops.rollout_corr.policy_loss_rows(z, z, z, z.bool(), None, 0.2, 0.2, 3.0, 0)
        assert loss.shape == (b, t) and rows.shape == (b, 5) and torch.all(rows == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_views_read_in_place(compiled_backend, device):
    """Non-contiguous inputs (a column-strided slice, a transposed buffer) are read through their strides."""
    inp = _to(_case(4, 30, torch.float32, 21), device)
    wide = torch.randn(4, 60).to(device)
    wide[:, ::2] = inp["lp"]
    lp_strided = wide[:, ::2]
    old_t = inp["old"].t().contiguous().t()
    assert not lp_strided.is_contiguous() and not old_t.is_contiguous()
    x = lp_strided.clone().requires_grad_(True)  # the gradient path, contiguous
    got = ops.policy_loss_rows(lp_strided, old_t, inp["adv"], inp["mask"].t().contiguous().t(), inp["w"], 0.2, 0.2,
                               3.0, PG_KIND_PPO_CLIP)
    want = ops.policy_loss_rows(x, inp["old"], inp["adv"], inp["mask"], inp["w"], 0.2, 0.2, 3.0, PG_KIND_PPO_CLIP)
    for a, b in zip(got, want):
        assert torch.equal(a, b.detach())
    g = torch.ops.rollout_corr.policy_loss_backward(None, torch.ones(4, device=device), lp_strided, old_t,
                                                    inp["adv"], inp["mask"], inp["w"], 0.2, 0.2, 3.0,
                                                    PG_KIND_PPO_CLIP)
    want[1][:, PG_ROW_LOSS_SUM].sum().backward()
    assert g.is_contiguous() and torch.equal(g, x.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_padding_stays_out_of_the_rows(compiled_backend, device):
    """Padded positions may hold junk (NaN): loss_mat keeps it, as the oracle does, the row partials do not."""
    inp = _case(3, 12, torch.float32, 14)
    lp = inp["lp"].clone()
    lp[inp["mask"] == 0] = float("nan")
    dinp = _to(dict(inp, lp=lp), device)
    loss, rows = ops.policy_loss_rows(dinp["lp"], dinp["old"], dinp["adv"], dinp["mask"], dinp["w"], 0.2, 0.2, 3.0,
                                      0)
    ref_loss, ref_rows = policy_loss_rows_dense(lp, inp["old"], inp["adv"], inp["mask"], inp["w"], 0.2, 0.2, 3.0,
                                                PPO_CLIP)
    loss, rows = loss.cpu().double(), rows.cpu().double()
    assert torch.isfinite(rows).all()
    torch.testing.assert_close(loss, ref_loss, equal_nan=True, **tol(torch.float32, "loss"))
    torch.testing.assert_close(rows, ref_rows, **tol(torch.float32, "rows"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_fp64(compiled_backend, kind, device):
    inp = _to(_case(3, 17, torch.float64, 15, extremes=False, mask_kind="float"), device)
    lp = inp["lp"].clone().requires_grad_(True)

    def fn(x):
        loss, rows = torch.ops.rollout_corr.policy_loss_rows(x, inp["old"], inp["adv"], inp["mask"], inp["w"], 0.2,
                                                             0.28, 3.0, kind)
        return loss, rows[:, PG_ROW_LOSS_SUM]

    assert torch.autograd.gradcheck(fn, (lp,), eps=1e-7, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_both_ops(compiled_backend, device):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for name, inp, clip in list(sample_inputs(dtype))[:3]:
            inp = _to(inp, device)
            for kind in KINDS:
                lp = inp["lp"].clone().requires_grad_(True)
                args = (lp, inp["old"], inp["adv"], inp["mask"], inp["w"], clip["clip_low"], clip["clip_high"],
                        clip["clip_c"], kind)
                torch.library.opcheck(torch.ops.rollout_corr.policy_loss_rows.default, args)
                torch.library.opcheck(torch.ops.rollout_corr.policy_loss_rows.default,
                                      args + (None, 0.0, 0.0, False))  # with_loss_mat=False
                g_mat, g_row = (g.to(device) for g in _upstream(inp, 0))
                bargs = (g_mat.to(_acc(dtype)), g_row.to(_acc(dtype)), inp["lp"], *args[1:])
                torch.library.opcheck(torch.ops.rollout_corr.policy_loss_backward.default, bargs)
                torch.library.opcheck(torch.ops.rollout_corr.policy_loss_backward.default,
                                      (None, g_row.to(_acc(dtype)), inp["lp"], *args[1:]))


@pytest.mark.parametrize("device", DEVICES)
def test_losses_use_the_compiled_op(compiled_backend, monkeypatch, device):
    """losses.py must run the fused op, not the fallback (which would still give the right numbers)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("fallback.policy_loss_rows called although the compiled op is available")

    monkeypatch.setattr(fallback, "policy_loss_rows", forbidden)
    inp = _to(_case(3, 16, torch.float32, 16), device)
    lp = inp["lp"].clone().requires_grad_(True)
    loss, metrics = losses.compute_policy_loss_vanilla(inp["old"], lp, inp["adv"], inp["mask"], "token-mean")
    loss.backward()
    assert torch.isfinite(lp.grad).all() and set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl"}


_BAD = [
    (lambda a: dict(a, old=a["old"][:, :-1]), "old_log_prob must have the shape of log_prob"),
    (lambda a: dict(a, adv=a["adv"].to("meta")), "advantages is on meta but log_prob is on cpu"),
    (lambda a: dict(a, adv=a["adv"].long()), "advantages must be float16, bfloat16, float32 or float64"),
    (lambda a: dict(a, mask=a["mask"].to(torch.complex64)), "response_mask must be bool, integer or floating"),
    (lambda a: dict(a, mask=a["mask"][:1]), "response_mask must have the shape of log_prob"),
    (lambda a: dict(a, w=a["w"].int()), "weights must be float16, bfloat16, float32 or float64"),
    (lambda a: dict(a, lp=a["lp"][0]), "log_prob must be 2-D"),
    (lambda a: dict(a, lp=a["lp"].long()), "log_prob must be float16"),
    (lambda a: dict(a, kind=LY.KIND_COUNT), "loss_kind must be a PG_KIND_"),
    (lambda a: dict(a, kind=-1), "loss_kind must be a PG_KIND_"),
    (lambda a: dict(a, clip_c=1.0), "clip_c .the dual-clip bound c. must be > 1"),
    (lambda a: dict(a, clip_c=0.0, kind=LY.PG_KIND_DPPO_TV), "clip_c .DPPO's ratio cap c; not read by the other kinds. must be > 0"),
    (lambda a: dict(a, clip_c=float("nan"), kind=LY.PG_KIND_DPPO_KL), "clip_c .DPPO's ratio cap c; not read by the other kinds. must be > 0"),
    (lambda a: dict(a, clip_low=-0.1), "clip_low and clip_high must be >= 0"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make, match", _BAD)
def test_bad_input_names_the_argument(compiled_backend, make, match, device):
    inp = _to(dict(_case(3, 8, torch.float32, 17), kind=0, clip_c=3.0, clip_low=0.2), device)
    before = {k: v.clone() for k, v in inp.items() if isinstance(v, torch.Tensor)}
    bad = make(inp)
    match = match.replace("log_prob is on cpu", f"log_prob is on {device}")
    # Straight to the device's kernel: the dispatcher would route a meta tensor to the fake kernel instead.
    kernel = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA if device == "cuda" else torch._C.DispatchKey.CPU)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.rollout_corr.policy_loss_rows.default.redispatch(
            kernel, bad["lp"], bad["old"], bad["adv"], bad["mask"], bad["w"], bad["clip_low"], 0.2,
            bad["clip_c"], bad["kind"])
    for k, v in before.items():
        assert torch.equal(inp[k], v), k  # inputs untouched


@pytest.mark.parametrize("device", DEVICES)
def test_backward_bad_grad_shape_is_named(compiled_backend, device):
    inp = _to(_case(3, 8, torch.float32, 18), device)
    with pytest.raises(RuntimeError, match="grad_rows_loss must have shape \\[3\\]"):
        torch.ops.rollout_corr.policy_loss_backward(None, torch.ones(4, device=device), inp["lp"], inp["old"],
                                                    inp["adv"], inp["mask"], inp["w"], 0.2, 0.2, 3.0, 0)


# ---------------------------------------------------------------------------------------------------------
# The CUDA kernels on the CUDA emulator
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emu():
    from rollout_corr_testing.cuda_emulator.loader import load_emulator

    load_emulator()
    if not hasattr(torch.ops.rollout_corr_emu, "policy_loss_rows"):
        pytest.fail("the emulator module was built without emu_policy_loss.cpp")
    return torch.ops.rollout_corr_emu


# threads x schedule, and grids with fewer blocks than rows (the grid-stride loop over rows).
EMU_KNOBS = [dict()] + [dict(threads=t, schedule=s) for t in (32, 64, 128) for s in (0, 1)] + [
    dict(threads=32, schedule=1, max_blocks=2),
    dict(threads=64, max_blocks=1),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels_match_fp64_reference(emu, dtype, kind):
    for name, inp, clip in sample_inputs(dtype):
        ref_lp, ref_loss, ref_rows = _reference(inp, kind, clip, requires_grad=True)
        g_mat, g_row = _upstream(inp, seed=len(name))
        ((ref_loss * g_mat).sum() + (ref_rows[:, PG_ROW_LOSS_SUM] * g_row).sum()).backward()
        args = (inp["lp"], inp["old"], inp["adv"], inp["mask"], inp["w"], clip["clip_low"], clip["clip_high"],
                clip["clip_c"], kind)
        acc = _acc(dtype)
        for knobs in EMU_KNOBS:
            msg = f"{name} {knobs}"
            loss, rows = emu.policy_loss_rows(*args, **knobs)
            # Outputs start NaN-poisoned: every element written (the inputs are finite).
            assert not loss.isnan().any() and not rows.isnan().any(), msg
            torch.testing.assert_close(loss.double(), ref_loss.detach(), **tol(dtype, "loss"), msg=msg)
            torch.testing.assert_close(rows.double(), ref_rows.detach(), **tol(dtype, "rows"), msg=msg)
            grad = emu.policy_loss_backward(g_mat.to(acc), g_row.to(acc), *args, **knobs)
            assert grad.dtype == dtype and not grad.isnan().any(), msg
            torch.testing.assert_close(grad.double(), ref_lp.grad, **tol(dtype, "grad"), msg=msg)


def test_emulated_rows_gradient_with_strided_upstream(emu):
    """The upstream row gradient arrives as a column view of rows' gradient (stride 5), loss_mat's as None."""
    inp = _case(7, 45, torch.float32, 19)
    ref_lp, _, ref_rows = _reference(inp, PG_KIND_PPO_CLIP, dict(clip_low=0.2, clip_high=0.2, clip_c=3.0), True)
    g_rows_full = torch.randn(7, 5)
    (ref_rows * g_rows_full.double()).sum().backward()
    grad = emu.policy_loss_backward(None, g_rows_full[:, PG_ROW_LOSS_SUM], inp["lp"], inp["old"], inp["adv"],
                                    inp["mask"], inp["w"], 0.2, 0.2, 3.0, PG_KIND_PPO_CLIP, threads=32, max_blocks=3)
    torch.testing.assert_close(grad.double(), ref_lp.grad, **tol(torch.float32, "grad"))


def test_emulated_row_partials_equal_compiled_cpu_counts(emu, compiled_backend):
    """Integer-valued columns (tokens, clip counts) are exact on every path."""
    inp = _case(6, 300, torch.float32, 20)
    args = (inp["lp"], inp["old"], inp["adv"], inp["mask"], inp["w"], 0.2, 0.28, 3.0, PG_KIND_PPO_CLIP)
    _, cpu_rows = torch.ops.rollout_corr.policy_loss_rows(*args)
    _, emu_rows = emu.policy_loss_rows(*args, threads=64, schedule=1, max_blocks=4)
    counts = [PG_ROW_TOKENS, LY.PG_ROW_CLIP, LY.PG_ROW_CLIP_LOWER]
    assert torch.equal(cpu_rows[:, counts], emu_rows[:, counts])
    assert torch.equal(cpu_rows[:, PG_ROW_TOKENS], inp["mask"].sum(-1).float())


def _reuse_inputs(b, t, dtype, seed):
    """(old, log_prob, advantages, mask) of the reused-block tests."""
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(b, t, generator=g) * 3).to(dtype)
    lp = (old.double() + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)).to(dtype)
    adv = torch.randn(b, t, generator=g).to(dtype)
    return old, lp, adv, torch.rand(b, t, generator=g) > 0.3


@pytest.mark.parametrize("kind", [PG_KIND_PPO_CLIP, PG_KIND_REINFORCE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_gradient_block_is_reused_and_fully_overwritten(compiled_backend, kind, dtype):
    """The CPU backward's gradient comes from a one-block cache (csrc/cpu/reused_buffer.h): a freed gradient's block
    serves the next backward of the same size, which writes every element (masked tokens exactly 0, the rest equal
    to a fresh computation) even though the block held large values."""
    import rollout_corr_ext as rc

    b, t = 16, 512
    old, lp0, adv, mask = _reuse_inputs(b, t, dtype, seed=4)

    def grad():
        lp = lp0.clone().requires_grad_(True)
        loss, rows = torch.ops.rollout_corr.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.28, 3.0, kind)
        rows[:, PG_ROW_LOSS_SUM].sum().backward()
        return lp.grad

    rc.empty_cpu_cache()
    first = grad()
    want = first.clone()
    ptr = first.data_ptr()
    first.fill_(1e4)  # what a reused block would show if any element were left unwritten
    del first
    assert ops.cpu_cache_bytes() >= lp0.numel() * lp0.element_size()
    again = grad()
    assert again.data_ptr() == ptr, "the kept block was not reused"
    assert torch.equal(again, want)
    assert bool((again[~mask] == 0).all())
    # what is cached now: the per-token loss's block (csrc/cpu/policy_loss.cpp; freed with `loss` in grad())
    acc_bytes = 8 if dtype == torch.float64 else 4
    assert rc.empty_cpu_cache() == b * t * acc_bytes


@pytest.mark.parametrize("kind", [PG_KIND_PPO_CLIP, PG_KIND_REINFORCE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_loss_mat_block_is_reused_and_fully_overwritten(compiled_backend, kind, dtype):
    """The CPU forward's per-token loss comes from a one-block cache too: a freed one serves the next forward of
    the same size, which writes every element even though the block held other values."""
    import rollout_corr_ext as rc

    old, lp, adv, mask = _reuse_inputs(16, 512, dtype, seed=5)
    rc.empty_cpu_cache()
    first, _ = torch.ops.rollout_corr.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.28, 3.0, kind)
    want, ptr = first.clone(), first.data_ptr()
    first.fill_(1e4)
    del first
    again, _ = torch.ops.rollout_corr.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.28, 3.0, kind)
    assert again.data_ptr() == ptr, "the kept block was not reused"
    assert torch.equal(again, want)
    held = again
    other, _ = torch.ops.rollout_corr.policy_loss_rows(lp, old, adv, mask, None, 0.2, 0.28, 3.0, kind)
    assert other.data_ptr() != held.data_ptr(), "a live loss's block is never handed out again"


# ---------------------------------------------------------------------------------------------------------
# with_loss_mat=False: the row partials only (what every loss of losses.py but calculate_grpo_loss asks for)
# ---------------------------------------------------------------------------------------------------------

#: every kind of the family, with parameters every kind accepts (SAPO's taus, DRO's beta = param_a)
ALL_KINDS = list(range(LY.KIND_COUNT))
KIND_PARAMS = (1.0, 1.05)


def _junk_padding(inp):
    """The case with NaN / +-inf in every input at masked positions: a row-only pass must not read them (nor would
    it matter if it did, as the rows exclude masked tokens: both are checked)."""
    out = dict(inp)
    pad = inp["mask"] == 0
    for key, junk in (("lp", float("nan")), ("old", float("inf")), ("adv", float("-inf")), ("w", float("nan"))):
        if out[key] is not None and out[key].shape == pad.shape:
            out[key] = out[key].masked_fill(pad, junk)
    return out


def _rows_only_matches_full(run, device, dtype, kind):
    """``run(*args, with_loss_mat=...)`` -> (loss_mat, rows): rows without loss_mat equal, bit for bit, the rows of
    the full pass on the same inputs, loss_mat is an empty [0] tensor, and the gradient through the rows is the same
    bits too. Also with junk in the padding (skipped chunks) against the clean inputs' rows."""
    for name, inp, clip in sample_inputs(dtype):
        for variant, case in (("clean", inp), ("junk_padding", _junk_padding(inp))):
            msg = f"{name} {variant} kind={kind}"
            dinp = _to(case, device)
            args = (dinp["old"], dinp["adv"], dinp["mask"], dinp["w"], clip["clip_low"], clip["clip_high"],
                    clip["clip_c"], kind, None, *KIND_PARAMS)
            lp_full = _to(inp, device)["lp"].clone().requires_grad_(True)  # full pass: clean inputs
            full_args = (_to(inp, device)[k] for k in ("old", "adv", "mask", "w"))
            loss_full, rows_full = run(lp_full, *full_args, *args[4:], with_loss_mat=True)
            lp = dinp["lp"].clone().requires_grad_(True)
            loss, rows = run(lp, *args, with_loss_mat=False)
            assert loss.shape == (0,) and loss.dtype == rows_full.dtype, msg
            assert torch.equal(rows, rows_full), msg
            g_row = torch.linspace(-1.0, 2.0, rows.shape[0], dtype=rows.dtype, device=rows.device)
            (rows[:, PG_ROW_LOSS_SUM] * g_row).sum().backward()
            (rows_full[:, PG_ROW_LOSS_SUM] * g_row).sum().backward()
            pad = dinp["mask"] == 0
            assert torch.equal(lp.grad[~pad], lp_full.grad[~pad]), msg
            assert (lp.grad[pad] == 0).all(), msg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_loss_mat_equal_the_full_pass(compiled_backend, device, dtype):
    for kind in ALL_KINDS:
        _rows_only_matches_full(ops.policy_loss_rows, device, dtype, kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_without_loss_mat_fallback(dtype):
    for kind in ALL_KINDS:
        _rows_only_matches_full(fallback.policy_loss_rows, "cpu", dtype, kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_emulated_rows_without_loss_mat_equal_the_full_pass(emu, dtype):
    from rollout_corr_testing.backends import policy_loss_backend

    with policy_loss_backend("emulated", threads=64, schedule=1, max_blocks=2):
        for kind in ALL_KINDS:
            _rows_only_matches_full(ops.policy_loss_rows, "cpu", dtype, kind)



def test_emulated_rows_only_pass_reads_masked_tokens_mask_only(emu):
    """The CUDA kernel without loss_mat moves, per masked token, its mask's byte (its 32-byte sectors) and nothing
    else: the DRAM-level traffic the emulator records falls by the other inputs' bytes of the masked tokens and by
    loss_mat's bytes."""
    from rollout_corr_testing.cuda_emulator.records import recorded_launches

    rows, cols = 4, 1024
    lp = -torch.rand(rows, cols)
    old, adv, w = lp + 0.1 * torch.randn(rows, cols), torch.randn(rows, cols), torch.rand(rows, cols) + 0.5
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    mask[:, : cols // 4] = True  # 3/4 padding, in whole sectors

    def moved(with_loss_mat):
        with recorded_launches() as rec:
            emu.policy_loss_rows(lp, old, adv, mask, w, 0.2, 0.2, 3.0, PG_KIND_PPO_CLIP, None, 0.0, 0.0,
                                 with_loss_mat)
        (x,) = rec.launches("policy_loss_rows_kernel")
        return 32 * x.read.unique_sectors, 32 * x.write.unique_sectors

    full_read, full_write = moved(True)
    rows_read, rows_write = moved(False)
    valid = rows * cols // 4
    assert full_read == rows * cols * (4 * 4 + 1)  # four fp32 inputs and the bool mask, every token
    assert rows_read == rows * cols * 1 + valid * 4 * 4  # the mask everywhere, the rest at valid tokens only
    record_sectors = rows * 5 * 4 // 32 + 2  # the [rows, 5] fp32 records, however they straddle sectors
    assert rows * cols * 4 <= full_write <= rows * cols * 4 + 32 * record_sectors  # loss_mat + the records
    assert rows_write <= 32 * record_sectors  # the records only: no loss_mat


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_undefined_token_rule_matches_the_fallback(compiled_backend, kind):
    """The CPU lane kernel screens each row with one running sum of its response tokens' inputs and losses and checks
    a row exactly only when that sum is not finite: every non-finite input value (and a finite one that overflows the
    screen) at a response token must give the fallback's verdict, the same named token, and nothing at a masked
    one."""
    base = _case(3, 70, torch.float32, 21, extremes=False)
    row, col = 2, 5  # row 2 is all response tokens
    for key in ("lp", "old", "adv", "w"):
        for value in (float("nan"), float("inf"), float("-inf"), -3e38):
            for masked in (False, True):
                inp = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
                inp["mask"][row, col] = not masked
                inp[key][row, col] = value
                if key == "lp" and value == -3e38:
                    inp["old"][row, col] = -3e38  # lp + old overflows the screen; x = 0 is defined
                args = (inp["lp"], inp["old"], inp["adv"], inp["mask"], inp["w"], 0.2, 0.28, 3.0, kind, None,
                        *KIND_PARAMS, False)
                verdicts = []
                for fn in (fallback.policy_loss_rows, ops.policy_loss_rows):
                    try:
                        fn(*args)
                        verdicts.append("ok")
                    except ValueError as e:
                        verdicts.append(str(e).split(":")[0] + (" @ (2, 5)" if "(2, 5)" in str(e) else " @ ?"))
                msg = f"kind={kind} {key}={value} masked={masked}"
                assert verdicts[0] == verdicts[1], (msg, verdicts)
                if masked:
                    assert verdicts[1] == "ok", msg
