"""Rollout correction (docs/rollout_correction.md) on one process: the two-pass pipeline against the fp64 dense oracle.

Every test runs on each device variant of ``rollout_corr_testing.backends.DEVICES``: ``cpu`` (the compiled ops when
the extension is active, the pure-PyTorch fallback under ``ROLLOUT_CORR_FORCE_FALLBACK=1``; both must pass),
``emulated`` (the CUDA kernels on the CPU thread-model emulator; a representative subset of the larger grids, since
each emulated call costs ~0.1-0.3 s) and ``cuda`` (skipped with the reason without a GPU), with the same oracle (on
the CPU) and tolerance table. The independent oracle has its own file (test_rollout_oracle.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout_corr_testing.rc_testutil import PERCENTILE_RTOL, PREFIX, TOL, assert_weights_mask, compare_metrics, make_inputs
from rollout_corr_ext import RolloutCorrectionConfig as Cfg
from rollout_corr_ext import compute_offpolicy_metrics, compute_rollout_correction
from rollout_corr_ext import _layout as LY
from rollout_corr_testing.rollout_oracle import oracle_for_config
from rollout_corr_testing.backends import device_params, ops_on
from rollout_corr_testing.skips import skip_unless_ci

DEVICES = device_params()
#: For the tests that exercise the compiled ops' registration (opcheck) or sizes beyond the emulator's reach.
NOT_EMULATED = "the emulator does not register torch.ops.rollout_corr kernels (opcheck checks those)"


def _emulated_subset(device, keep: bool, what: str) -> None:
    """The emulated kernels run a representative subset of a large parameter grid (each call costs ~0.1-0.3 s of
    thread-by-thread emulation); every case runs on cpu and cuda."""
    if device == "emulated" and not keep:
        pytest.skip(f"emulated: representative subset ({what}); every case runs on cpu and cuda")


def _on_cpu(res):
    """A RolloutCorrectionResult with every tensor moved to the CPU (where the oracle runs)."""
    return type(res)(None if res.weights is None else res.weights.cpu(), res.response_mask.cpu(),
                     {k: v.cpu() for k, v in res.metrics.items()})


def _run(device, lp, rlp, mask, cfg, **kw):
    """compute_rollout_correction on the device variant ``device``, inputs moved there, the result back on the CPU."""
    with ops_on(device) as dev:
        res = compute_rollout_correction(lp.to(dev), rlp.to(dev), mask.to(dev), cfg, **kw)
        assert res.response_mask.device.type == torch.device(dev).type
    return _on_cpu(res)


def _check(cfg, lp, rlp, mask, dtype=torch.float32, skip=(), device="cpu", **kw):
    res = _run(device, lp, rlp, mask, cfg, **kw)
    w, m, met = oracle_for_config(lp.double(), rlp.double(), mask, cfg, nonfinite=kw.get("nonfinite", "error"))
    errors = compare_metrics(res.metrics, met, dtype, skip=skip)
    assert not errors, "\n".join(errors)
    assert_weights_mask(res, w, m, dtype)
    return res


IS_SPECS = {
    "tis": dict(rollout_is_threshold=2.0),
    "icepop": dict(rollout_is_threshold="0.5_5.0"),
    "mask_auto_lower": dict(rollout_is_threshold=1.5, rollout_is_mode="mask"),
    "tis_asym_metric_lower": dict(rollout_is_threshold=3.0, rollout_is_threshold_lower=0.6),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_dropping_every_weight_reports_no_effective_sample(level, device):
    """IcePop with every weight outside its band: all weights 0, and the effective sample size 0 (no sample counts;
    verl divides by zero there, the formula alone gives eps^2 / 0 = inf), every metric as the oracle."""
    lp, rlp, mask = make_inputs(6, 20, seed=31)
    rlp = lp.clone()  # on-policy: every weight 1, outside [1.5, 5]
    res = _check(Cfg(rollout_is=level, rollout_is_threshold="1.5_5.0"), lp, rlp, mask, device=device)
    assert float(res.metrics[PREFIX + "rollout_is_eff_sample_size"]) == 0.0
    assert bool((res.weights == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("spec", sorted(IS_SPECS))
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_is_levels_and_modes(level, spec, normalize, dtype, device):
    _emulated_subset(device, not normalize, "without batch normalisation, a Python-side scale of the weights")
    scale = 0.3 if level == "token" else 0.05  # sequence weights = prod of ratios: keep them O(1)
    lp, rlp, mask = make_inputs(12, 48, seed=1, scale=scale, pad_rows=(3,), dtype=dtype)
    cfg = Cfg(rollout_is=level, rollout_rs=None, rollout_is_batch_normalize=normalize, **IS_SPECS[spec])
    res = _check(cfg, lp, rlp, mask, dtype, device=device)
    valid = mask
    if normalize:  # the mean weight becomes 1
        w = res.weights.double()
        if level == "token":
            mean = w[valid].mean()
        else:
            n = valid.sum(1)
            seq_means = (w * valid).sum(1)[n > 0] / n[n > 0]
            mean = seq_means.mean()
        assert abs(float(mean) - 1.0) < 1e-5


RS_ALONE = [
    ("token_k1", "0.7_1.3"), ("token_k2", 0.02), ("token_k3", 0.02),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.5), ("seq_sum_k3", 0.5),
    ("seq_mean_k1", "0.98_1.02"), ("seq_mean_k2", 0.02), ("seq_mean_k3", 0.02),
    ("seq_max_k2", 0.05), ("seq_max_k3", 0.05),
    ("token", "0.8_1.25"), ("sequence", 2.0), ("geometric", "0.97_1.03"),  # 0.99_1.01 rejected every row
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("criterion,threshold", RS_ALONE)
def test_rs_criterion_alone(criterion, threshold, dtype, device):
    _emulated_subset(device, dtype == torch.float32, "fp32 inputs; fp64 in test_is_levels_and_modes")
    lp, rlp, mask = make_inputs(16, 40, seed=2, scale=0.2, pad_rows=(5,), dtype=dtype)
    res = _check(Cfg(rollout_is=None, rollout_rs=criterion, rollout_rs_threshold=threshold), lp, rlp, mask, dtype,
                 device=device)
    dropped = float(res.metrics[PREFIX + "rollout_rs_masked_fraction"])
    assert 0.0 < dropped < 1.0, "the thresholds are meant to reject some tokens but not all"


RS_COMBOS = [
    ("token_k1,seq_mean_k3", "0.7_1.3,0.05", "token", 2.0),
    ("seq_sum_k1,seq_max_k2,token_k2", "0.5_2.0,0.2,0.02", "sequence", "0.5_5.0"),
    ("token_k3,geometric,seq_mean_k1", "0.02,0.99_1.01,0.98_1.02", None, 2.0),
    ("token,sequence,token_k1,seq_sum_k2", "0.8_1.25,0.4_2.5,1.3,0.5", "geometric", 2.0),
    ("seq_mean_k1,seq_mean_k1,token_k2", "0.98_1.02,0.02", "token", 2.0),  # duplicates removed
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("veto", [None, 0.6])
@pytest.mark.parametrize("rs,thr,level,is_thr", RS_COMBOS)
def test_rs_combinations_and_veto(rs, thr, level, is_thr, veto, device):
    lp, rlp, mask = make_inputs(16, 40, seed=3, scale=0.2, pad_rows=(0, 9))
    cfg = Cfg(rollout_is=level, rollout_is_threshold=is_thr, rollout_rs=rs, rollout_rs_threshold=thr,
              rollout_token_veto_threshold=veto)
    res = _check(cfg, lp, rlp, mask, device=device)
    if veto is not None:
        assert float(res.metrics[PREFIX + "rollout_is_veto_fraction"]) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_veto_alone_rejects_whole_sequences(device):
    lp, rlp, mask = make_inputs(10, 30, seed=4, scale=0.2)
    lp[4, 3] = rlp[4, 3] + math.log(1e-5)  # one catastrophic token
    mask[4, 3] = True
    res = _check(Cfg(rollout_is="token", rollout_token_veto_threshold=1e-4), lp, rlp, mask, device=device)
    assert not res.response_mask[4].any() and torch.equal(res.response_mask[:4], mask[:4])
    assert float(res.metrics[PREFIX + "rollout_is_veto_fraction"]) == pytest.approx(0.1)
    assert res.weights[4, 3] > 0, "the veto edits the mask only, as in verl 0.6.1"


@pytest.mark.parametrize("device", DEVICES)
def test_auto_reciprocal_and_asymmetric_bounds(device):
    c = Cfg(rollout_is="token", rollout_is_threshold=4.0, rollout_is_mode="mask",
            rollout_rs="token_k1,token,seq_sum_k1", rollout_rs_threshold="2.0,1.25,0.8_1.5")
    assert c.is_spec.lower == pytest.approx(0.25) and c.is_spec.upper == 4.0
    k1, ratio, asym = c.rs_criteria
    assert (k1.lower, k1.upper) == (pytest.approx(math.log(0.5)), pytest.approx(math.log(2.0)))
    assert (ratio.lower, ratio.upper) == (pytest.approx(0.8), 1.25)
    assert (asym.lower, asym.upper) == (pytest.approx(math.log(0.8)), pytest.approx(math.log(1.5)))
    lp, rlp, mask = make_inputs(12, 32, seed=5, scale=0.3)
    _check(c, lp, rlp, mask, device=device)
    legacy_lower = Cfg(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.01,
                       rollout_rs_threshold_lower=0.995)
    assert legacy_lower.rs_criteria[0].lower == 0.995
    _check(legacy_lower, *make_inputs(12, 32, seed=6, scale=0.02), device=device)


@pytest.mark.parametrize("preset", ["decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop",
                                    "bypass_pg_token_icepop", "decoupled_seq_is_rs", "decoupled_geo_rs",
                                    "bypass_ppo_clip", "bypass_ppo_clip_k3_rs", "decoupled_geo_rs_token_tis",
                                    "decoupled_k3_rs_seq_tis", "seq_mis", "geo_mis", "pure_is", "disabled"])
@pytest.mark.parametrize("device", DEVICES)
def test_presets(preset, device):
    lp, rlp, mask = make_inputs(16, 40, seed=7, scale=0.01)
    _check(getattr(Cfg, preset)(), lp, rlp, mask, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_edge_shapes_padding_rows_b1(device):
    cfg = Cfg(rollout_is="token", rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.05,0.7_1.3",
              rollout_token_veto_threshold=0.5)
    lp, rlp, mask = make_inputs(8, 24, seed=8, pad_rows=(0, 1, 7))
    _check(cfg, lp, rlp, mask, device=device)
    lp, rlp, mask = make_inputs(1, 24, seed=9)
    _check(cfg, lp, rlp, mask, device=device)
    _check(Cfg(rollout_is="sequence", rollout_rs="seq_sum_k2", rollout_rs_threshold=3.0),
           *make_inputs(1, 32768, seed=10, scale=0.01), device=device)


def _zero_run_mask(t: int) -> torch.Tensor:
    """Masks with long runs of 0 around the CPU kernels' 64-token chunks (which skip chunks without a valid token):
    whole zero chunks between valid ones (across the 256-token fold points of the fp32 lane sums), leading zeros,
    a lone valid token, valid tokens only in the last, partial chunk, scattered short runs, a full row."""
    runs = [[(0, 64), (320, t)], [(500, 530)], [(129, 130)], [(t - t % 64, t)], [(0, 10), (200, 260), (t - 10, t)],
            [(0, t)]]
    mask = torch.zeros(len(runs), t, dtype=torch.bool)
    for r, spans in enumerate(runs):
        for a, b in spans:
            mask[r, a:b] = True
    return mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_long_masked_out_runs(dtype, mask_dtype, device):
    _emulated_subset(device, dtype == torch.float32, "fp32 inputs")
    t = 700  # not a multiple of the chunk: the last chunk is partial
    mask = _zero_run_mask(t)
    lp, rlp, _ = make_inputs(mask.shape[0], t, seed=21, scale=0.2, min_len=t, dtype=dtype)
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))  # junk wherever the mask is 0
    rlp = torch.where(mask, rlp, torch.full_like(rlp, float("-inf")))
    for cfg in (Cfg(rollout_is="token", rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.8_1.25,0.05",
                    rollout_token_veto_threshold=0.3),
                Cfg(rollout_is="sequence", rollout_is_threshold="0.5_4.0", rollout_is_mode="mask",
                    rollout_rs="token_k3,seq_mean_k2", rollout_rs_threshold="0.02,0.01")):
        res = _check(cfg, lp, rlp, mask.to(mask_dtype), dtype=dtype, device=device)
        assert torch.all(res.weights[~mask] == 0) and torch.all(res.response_mask[~mask] == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [0.5, 2.0, float("nan")])
def test_lone_bad_mask_value_among_zeros_raises(value, device):
    """A value other than 0 / 1 alone in a run of zeros (a chunk the CPU kernels would otherwise skip) is found."""
    if device == "cuda":
        pytest.skip(reason="CUDA raises through an asynchronous device assert (tests/test_cuda.py, in a subprocess)")
    mask = _zero_run_mask(300).float()
    lp, rlp, _ = make_inputs(mask.shape[0], 300, seed=22, min_len=300)
    mask[1, 200] = value
    with ops_on(device):
        with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1.*response_mask\[1, 200\]"):
            compute_rollout_correction(lp, rlp, mask, Cfg.decoupled_token_is())
    mask[1, 200] = -0.0  # a zero: the token is padding, as with +0.0
    res = _check(Cfg.decoupled_token_is(), lp, rlp, mask, device=device)
    assert res.weights[1, 200] == 0 and res.response_mask[1, 200] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_inputs(device):
    lp, rlp, mask = make_inputs(12, 40, seed=11, dtype=torch.bfloat16)
    cfg = Cfg(rollout_is="token", rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="0.05,0.98_1.02")
    _check(cfg, lp, rlp, mask, dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_mask_dtype_preserved_and_weights_detached(mask_dtype, device):
    lp, rlp, mask = make_inputs(8, 32, seed=12)
    lp = torch.where(mask, lp, torch.zeros_like(lp))
    cfg = Cfg(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    with ops_on(device) as dev:
        lp_d = lp.to(dev).requires_grad_(True)
        res = compute_rollout_correction(lp_d, rlp.to(dev), mask.to(dev, mask_dtype), cfg)
        ref = compute_rollout_correction(lp_d.detach(), rlp.to(dev), mask.to(dev), cfg)
    assert res.response_mask.dtype == mask_dtype
    assert torch.equal(res.response_mask.bool(), ref.response_mask)
    assert not res.weights.requires_grad and res.weights.dtype == torch.float32
    assert all(not v.requires_grad and v.dim() == 0 for v in res.metrics.values())


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_never_modified(device):
    lp, rlp, mask = make_inputs(8, 32, seed=13)
    with ops_on(device) as dev:
        lp, rlp, mask = lp.to(dev), rlp.to(dev), mask.to(dev)
        copies = [t.clone() for t in (lp, rlp, mask)]
        compute_rollout_correction(lp, rlp, mask, Cfg(rollout_is="sequence", rollout_is_batch_normalize=True,
                                                      rollout_rs="token_k1", rollout_rs_threshold=1.2,
                                                      rollout_token_veto_threshold=0.5))
    for a, b in zip((lp, rlp, mask), copies):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_offpolicy_metrics_alone(device):
    lp, rlp, mask = make_inputs(8, 32, seed=14)
    with ops_on(device) as dev:
        got = {k: v.cpu() for k, v in compute_offpolicy_metrics(lp.to(dev), rlp.to(dev), mask.to(dev)).items()}
        only = compute_offpolicy_metrics(lp.to(dev), None, mask.to(dev))
    _, _, met = oracle_for_config(lp.double(), rlp.double(), mask, Cfg.disabled())
    want = {k: met[PREFIX + k] for k in ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl",
                                "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
                                "ppl_ratio", "chi2_token", "chi2_seq")}
    assert not compare_metrics(got, want, torch.float32)
    assert set(only) == {PREFIX + "training_ppl", PREFIX + "training_log_ppl"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_perplexities_past_fp32_range_of_a_row_stay_finite(device, dtype):
    """A row whose mean log-prob is below -88 (e^88 past fp32) in fp32 / bf16 inputs: the perplexities are fp64
    sums of fp64 exps, so they equal the fp64 oracle (an fp32 exp per row made them inf)."""
    lp, rlp, mask = make_inputs(8, 16, seed=21)
    lp[0], rlp[0], rlp[1] = -90.0, -90.5, -100.0
    lp, rlp = lp.to(dtype), rlp.to(dtype)
    with ops_on(device) as dev:
        got = {k: v.cpu() for k, v in compute_offpolicy_metrics(lp.to(dev), rlp.to(dev), mask.to(dev)).items()}
    _, _, met = oracle_for_config(lp.double(), rlp.double(), mask, Cfg.disabled())
    for k in ("training_ppl", "rollout_ppl", "ppl_ratio"):
        assert math.isfinite(float(got[PREFIX + k])), k
        assert math.isclose(float(got[PREFIX + k]), float(met[PREFIX + k]), rel_tol=1e-5), k


class _CountSyncs(TorchDispatchMode):
    """Counts device->host scalar reads (what .item(), bool(), float(), .tolist() lower to)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.skipif(__import__("rollout_corr_ext").backend() == "fallback",
                    reason="the one-read budget is the compiled kernels' (the fallback's checks read more than once)")
def test_host_syncs_one_read_for_all_metrics(device):
    lp, rlp, mask = make_inputs(8, 32, seed=15)
    cfg = Cfg(rollout_is="token", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="1.3,0.05")
    with ops_on(device) as dev:
        lp, rlp, mask = lp.to(dev), rlp.to(dev), mask.to(dev)
        with _CountSyncs() as c:
            res = compute_rollout_correction(lp, rlp, mask, cfg)
    # CPU tensors: one scalar read for the input-value check; CUDA: none (asynchronous device asserts instead).
    # (Blocking copies are not scalar reads: test_cuda_graphs_determinism.py pins those per entry point.)
    assert c.count <= (0 if dev == "cuda" else 1)
    reads = []
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item
    try:
        torch.Tensor.tolist = lambda self: reads.append("tolist") or real_tolist(self)
        torch.Tensor.item = lambda self: reads.append("item") or real_item(self)
        floats = res.as_floats()
    finally:
        torch.Tensor.tolist, torch.Tensor.item = real_tolist, real_item
    assert reads == ["tolist"] and len(floats) == len(res.metrics)


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_clear_errors(device):
    lp, rlp, mask = make_inputs(4, 16, seed=16)
    cfg = Cfg.decoupled_token_is()
    with ops_on(device) as dev:
        _bad_inputs_clear_errors(lp.to(dev), rlp.to(dev), mask.to(dev), cfg, dev)


def _bad_inputs_clear_errors(lp, rlp, mask, cfg, dev):
    with pytest.raises(ValueError, match="rollout_log_prob shape"):
        compute_rollout_correction(lp, rlp[:, :8], mask, cfg)
    with pytest.raises(ValueError, match="response_mask shape"):
        compute_rollout_correction(lp, rlp, mask[:2], cfg)
    with pytest.raises(ValueError, match="2-D"):
        compute_rollout_correction(lp[0], rlp[0], mask[0], cfg)
    if dev != "cuda":  # CUDA: an asynchronous device assert (tests/test_cuda.py, in a subprocess)
        with pytest.raises(ValueError, match="no valid token"):
            compute_rollout_correction(lp, rlp, torch.zeros_like(mask), cfg)
    with pytest.raises(TypeError, match="log_prob must be"):
        compute_rollout_correction(lp.long(), rlp, mask, cfg)
    with pytest.raises(ValueError, match="response_mask is on meta"):
        compute_rollout_correction(lp, rlp, mask.to("meta"), cfg)
    with pytest.raises(TypeError, match="config must be"):
        compute_rollout_correction(lp, rlp, mask, 3)
    with pytest.raises(ValueError, match="nonfinite must be"):
        compute_rollout_correction(lp, rlp, mask, cfg, nonfinite="ignore")
    with pytest.raises(ValueError, match="empty must be"):
        compute_rollout_correction(lp, rlp, mask, cfg, empty="zero")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [Cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                     rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
                                 Cfg.decoupled_seq_is_rs(), Cfg.decoupled_geo_rs(), Cfg.disabled()],
                         ids=["token_is_norm_rs", "seq_is_rs", "geo_rs", "disabled"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_empty_nan_a_batch_without_tokens(device, cfg, mask_dtype):
    """empty="nan": a batch without a valid token (every mask 0, or every token excluded as non-finite) is not an
    error: weights and mask 0, every metric NaN (a statistic of no tokens; the batch-normalised weights too stay 0,
    not 0 / NaN); on a batch with tokens the result is the default's, bit for bit."""
    from rollout_corr_ext import MismatchDiagnostics

    lp, rlp, mask = make_inputs(4, 16, seed=17)
    mask = mask.to(mask_dtype)
    excluded = lp.clone()
    excluded[:] = float("nan")
    with ops_on(device) as dev:
        lp, rlp, mask, excluded = (t.to(dev) for t in (lp, rlp, mask, excluded))
        for diag in (None, MismatchDiagnostics()):
            for inputs, nonfinite in (((lp, rlp, torch.zeros_like(mask)), "error"), ((excluded, rlp, mask), "exclude")):
                res = compute_rollout_correction(*inputs, cfg, nonfinite=nonfinite, diagnostics=diag, empty="nan")
                assert res.response_mask.dtype == mask_dtype and not bool(res.response_mask.any())
                if cfg.rollout_is is None:
                    assert res.weights is None
                else:
                    assert torch.equal(res.weights, torch.zeros_like(res.weights))
                assert res.metrics and all(math.isnan(v) for v in res.as_floats().values())
            want = compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=diag)
            got = compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=diag, empty="nan")
            assert torch.equal(got.response_mask, want.response_mask)
            assert (got.weights is None) == (want.weights is None)
            if got.weights is not None:
                assert torch.equal(got.weights, want.weights)
            assert got.metrics.keys() == want.metrics.keys()
            for k, v in want.metrics.items():
                assert torch.equal(got.metrics[k], v) or (torch.isnan(v) and torch.isnan(got.metrics[k])), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_error_or_exclude(bad, device):
    lp, rlp, mask = make_inputs(6, 20, seed=17)
    mask[2, 5] = True
    lp[2, 5] = bad
    cfg = Cfg(rollout_is="sequence", rollout_rs="token_k2", rollout_rs_threshold=0.05)
    if device != "cuda":  # CUDA: an asynchronous device assert (tests/test_cuda.py, in a subprocess)
        with ops_on(device):
            with pytest.raises(ValueError, match=r"NaN or \+-inf.*log_prob\[2, 5\]"):
                compute_rollout_correction(lp, rlp, mask, cfg)
    res = _check(cfg, lp, rlp, mask, nonfinite="exclude", device=device)
    assert res.response_mask[2, 5] == 0 and res.weights[2, 5] == 0
    n_valid = int(mask.sum())
    assert float(res.metrics[PREFIX + "nonfinite_token_fraction"]) == pytest.approx(1.0 / n_valid)


# ------------------------------------------------------------------------------- mixed input dtypes (issue 8 §8)

#: (log_prob dtype, rollout_log_prob dtype): the engine often returns fp32 while the trainer works in bf16.
MIXED_DTYPES = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float64),
                (torch.float64, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.float16, torch.float32),
                (torch.bfloat16, torch.float64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lp_dtype,rlp_dtype", MIXED_DTYPES, ids=str)
def test_mixed_input_dtypes_promote_to_the_wider(lp_dtype, rlp_dtype, device):
    _emulated_subset(device, lp_dtype in (torch.bfloat16, torch.float16),
                     "16-bit log_prob dtypes; every pair in test_rollout_oracle.py's mixed-dtype test")
    lp, rlp, mask = make_inputs(12, 40, seed=31, scale=0.2, pad_rows=(3,))
    lp, rlp = lp.to(lp_dtype), rlp.to(rlp_dtype)
    copies = (lp.clone(), rlp.clone())
    cfg = Cfg(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token_k1,seq_mean_k3",
              rollout_rs_threshold="0.7_1.3,0.05", rollout_token_veto_threshold=0.3)
    weights_dtype = torch.float64 if torch.float64 in (lp_dtype, rlp_dtype) else torch.float32
    # the oracle sees the exact values of both inputs (widening is exact)
    res = _check(cfg, lp, rlp, mask, weights_dtype, device=device)
    assert res.weights.dtype == weights_dtype
    wide = torch.promote_types(lp_dtype, rlp_dtype)
    same = _run(device, lp.to(wide), rlp.to(wide), mask, cfg)
    assert torch.equal(res.weights, same.weights) and torch.equal(res.response_mask, same.response_mask)
    assert all(torch.equal(res.metrics[k], same.metrics[k]) for k in same.metrics)
    assert lp.dtype == lp_dtype and rlp.dtype == rlp_dtype
    assert torch.equal(lp.nan_to_num(), copies[0].nan_to_num()) and torch.equal(rlp, copies[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["token", "sequence", None])
def test_passes_on_a_rank_without_rows(level, device):
    """A DP rank may hold no rows: its partials are the neutral elements (0 sums, -inf maxima), on every backend."""
    from rollout_corr_ext import ops
    from rollout_corr_ext.correction import op_args

    args = op_args(Cfg(rollout_is=level, rollout_rs="token_k1,seq_mean_k3,geometric,seq_max_k2",
                       rollout_rs_threshold="0.7_1.3,0.02,0.99_1.01,0.1"))
    with ops_on(device) as dev:
        lp, rlp, mask = (x[:0].to(dev) for x in make_inputs(3, 16, seed=33))
        st = ops.rollout_seq_stats(lp, rlp, mask, args)
        w, m, sums, maxes = ops.rollout_token_pass(lp, rlp, mask, st, args, True)
        sums, maxes = sums.cpu(), maxes.cpu()
    assert st.shape == (0, LY.SEQ_COLS) and m.shape == (0, 16)
    assert (sums == 0).all() and (maxes == -math.inf).all()
    assert (sums.numel(), maxes.numel()) == LY.partial_sizes(4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_weights_dtype_is_fp32_or_fp64(dtype, weights_dtype, device):
    lp, rlp, mask = make_inputs(4, 16, seed=32, dtype=dtype)
    assert _run(device, lp, rlp, mask, Cfg.decoupled_seq_is()).weights.dtype == weights_dtype


# --------------------------------------------------------------------------------------------- large batches


@pytest.mark.slow
@pytest.mark.parametrize("device", device_params("cpu", "cuda", emulated_reason="16.8 M tokens: beyond what the "
                                                                                "thread-by-thread emulator runs"))
def test_more_than_2_pow_24_tokens_percentiles(device):
    """Percentiles over more than 2^24 tokens (where older torch.quantile raises): histogram vs exact order stats."""
    b, t = 4104, 4096  # 16,809,984 tokens > 2^24
    g = torch.Generator().manual_seed(18)
    rlp = -torch.rand(b, t, generator=g) * 4.0
    lp = rlp + torch.randn(b, t, generator=g) * 0.3
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, -7:] = False
    res = _run(device, lp, rlp, mask, Cfg(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=2.0))
    raw = torch.exp((lp - rlp)[mask].clamp(-20, 20))
    assert raw.numel() > 2 ** 24  # torch.quantile raised past 2^24 elements before torch 2.x; the oracle sorts
    s = raw.sort().values
    for q in (5, 25, 50, 75, 95):
        pos = q / 100 * (s.numel() - 1)
        k0 = int(pos)
        exact = float(s[k0] * (1 - (pos - k0)) + s[min(k0 + 1, s.numel() - 1)] * (pos - k0))
        got = float(res.metrics[PREFIX + f"rollout_is_p{q}"])
        assert abs(got / exact - 1) <= PERCENTILE_RTOL * 1.001, (q, got, exact)
    n = int(mask.sum())
    assert float(res.metrics[PREFIX + "rollout_is_mean"]) == pytest.approx(
        float(torch.exp((lp - rlp)[mask].double()).clamp(max=2.0).sum()) / n, rel=1e-5)


# verl parity (verl 0.9.1's real helper, installed in CI) and the independent oracle: tests/test_rollout_oracle.py.


# --------------------------------------------------------------------------------------------- compiled ops

from rollout_corr_ext import fallback as _fallback  # noqa: E402
from rollout_corr_ext import ops as _ops  # noqa: E402
from rollout_corr_ext.correction import op_args  # noqa: E402

_HAS_OPS = _ops._has_kernel(torch.device("cpu"))


@pytest.mark.skipif(not _HAS_OPS, reason="the compiled rollout_corr CPU kernels are not loaded (build the extension, "
                                         "or ROLLOUT_CORR_JIT=1); the pure-PyTorch fallback is what runs")
@pytest.mark.parametrize("dtype,rlp_dtype,mask_dtype", [
    (torch.float32, torch.float32, torch.bool), (torch.bfloat16, torch.bfloat16, torch.int64),
    (torch.float64, torch.float64, torch.float32), (torch.float16, torch.float16, torch.int32),
    (torch.bfloat16, torch.float32, torch.uint8), (torch.float16, torch.float64, torch.float16)])
@pytest.mark.parametrize("cfg_kw", [
    dict(rollout_is="token", rollout_rs="token_k1,seq_mean_k3,token", rollout_rs_threshold="1.3,0.02,0.8_1.25",
         rollout_token_veto_threshold=0.5),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_rs="seq_max_k2,geometric",
         rollout_rs_threshold="0.05,0.99_1.01"),
])
@pytest.mark.parametrize("device", device_params("cpu", "cuda", emulated_reason=NOT_EMULATED))
def test_compiled_passes_match_fallback_and_opcheck(cfg_kw, dtype, rlp_dtype, mask_dtype, device):
    """The compiled kernels (CPU: SIMD lanes, chunked loads of every dtype, padded tails; CUDA: the launchers) against
    the fallback on the CPU, pass by pass, on ragged rows whose lengths are not multiples of the chunk; and
    torch.library.opcheck of the schemas on the device."""
    lp_c, rlp_c, mask_c = make_inputs(6, 150, seed=20, pad_rows=(2,), dtype=dtype)
    rlp_c, mask_c = rlp_c.to(rlp_dtype), mask_c.to(mask_dtype)
    lp, rlp, mask = lp_c.to(device), rlp_c.to(device), mask_c.to(device)
    args = op_args(Cfg(**cfg_kw))
    st = torch.ops.rollout_corr.rollout_seq_stats.default(lp, rlp, mask, None, *args)
    st_ref = _fallback.rollout_seq_stats(lp_c, rlp_c, mask_c, None, *args)
    tol = TOL[torch.float64 if torch.float64 in (dtype, rlp_dtype) else torch.float32]
    torch.testing.assert_close(st.cpu(), st_ref, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)
    out = torch.ops.rollout_corr.rollout_token_pass.default(lp, rlp, mask, None, st_ref.to(device), *args, True)
    ref = _fallback.rollout_token_pass(lp_c, rlp_c, mask_c, None, st_ref, *args, True)
    out = [o.cpu() for o in out]
    torch.testing.assert_close(out[0], ref[0], **tol)
    assert out[1].dtype == mask_dtype and torch.equal(out[1], ref[1])
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[3], ref[3], rtol=1e-6, atol=1e-7)
    torch.library.opcheck(torch.ops.rollout_corr.rollout_seq_stats.default, (lp, rlp, mask, None, *args))
    torch.library.opcheck(torch.ops.rollout_corr.rollout_token_pass.default, (lp, rlp, mask, None, st, *args, True))
    torch.library.opcheck(torch.ops.rollout_corr.rollout_check.default,
                          (out[2].to(device), None, lp, rlp, mask, False))
    torch.library.opcheck(torch.ops.rollout_corr.rollout_check.default,
                          (out[2].to(device), None, lp, rlp, mask, False, True))


@pytest.mark.skipif(not _HAS_OPS, reason="the compiled rollout_corr ops are not loaded (the fallback has no op schemas)")
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_rollout_check_reads_the_sums_view_not_its_storage(layout):
    """rollout_check as a raw op on a strided or expanded (stride 0) ``sums``: the status slots are the view's
    elements, as with a contiguous copy (its CPU kernel read them by offset from the storage: the wrong elements of
    a strided view, past the storage of an expanded one)."""
    lp = torch.zeros(2, 3)
    n = LY.SUM_CRIT_BASE
    slots = (LY.SUM["tokens"], LY.SUM["nonfinite"], LY.SUM["bad_mask"])
    cases = [(t, f, b) for t in (0.0, 5.0) for f in (0.0, 1.0) for b in (0.0, 1.0)]
    for values in cases:
        if layout == "strided":  # the gaps between the view's elements hold the opposite status
            base = torch.empty(2 * n, dtype=torch.float64)
            view = base[::2]
            view.zero_()
            base[1::2] = 7.0
            for slot, v in zip(slots, values):
                view[slot] = v
                base[2 * slot + 1] = 0.0 if v else 7.0
        else:
            if values[1] != values[2] or values[0] != values[1] * 5.0:
                continue  # an expanded view holds one value in every slot
            base = torch.full((n + 8,), 7.0, dtype=torch.float64)
            base[0] = values[1]
            view = base[:1].expand(n)
        want = got = None
        try:
            want = torch.ops.rollout_corr.rollout_check(view.contiguous(), None, lp, lp, torch.ones(2, 3), False)
        except (RuntimeError, ValueError) as e:
            want = str(e).splitlines()[0]
        try:
            got = torch.ops.rollout_corr.rollout_check(view, None, lp, lp, torch.ones(2, 3), False)
        except (RuntimeError, ValueError) as e:
            got = str(e).splitlines()[0]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and torch.equal(got, want), (values, got)
        else:
            assert got == want, (values, got, want)


@pytest.mark.skipif(not _HAS_OPS, reason="the compiled rollout_corr ops are not loaded (the fallback has no op schemas)")
def test_fakes_work_on_meta_tensors_before_any_wrapper_ran():
    """register_fake at import: the ops trace on meta tensors (shapes and dtypes only)."""
    lp = torch.empty(3, 5, device="meta", dtype=torch.bfloat16)
    rlp = torch.empty(3, 5, device="meta", dtype=torch.float64)
    mask = torch.empty(3, 5, device="meta", dtype=torch.bool)
    args = op_args(Cfg(rollout_is="token", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="1.3,0.02"))
    st = torch.ops.rollout_corr.rollout_seq_stats.default(lp, rlp, mask, None, *args)
    assert st.shape == (3, LY.SEQ_COLS) and st.dtype == torch.float64
    w, m, s, x = torch.ops.rollout_corr.rollout_token_pass.default(lp, rlp, mask, None, st, *args, True)
    assert w.shape == (3, 5) and w.dtype == torch.float64 and m.dtype == torch.bool
    assert (s.numel(), x.numel()) == LY.partial_sizes(2)


#: Configs for the two finalize paths: every IS level and mode, token- and sequence-level criteria, veto, batch norm.
FINALIZE_CONFIGS = [
    dict(rollout_is="token", rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,0.05",
         rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_4.0", rollout_is_mode="mask", rollout_rs="seq_mean_k2",
         rollout_rs_threshold=0.01, rollout_token_veto_threshold=0.3),
    dict(rollout_is="geometric", rollout_is_batch_normalize=True, rollout_rs="token,seq_sum_k1",
         rollout_rs_threshold="0.9_1.1,0.1_0.5"),
    dict(rollout_is="token", rollout_is_threshold="5.0_6.0", rollout_is_mode="mask"),  # every weight 0: ESS x / 0
]


@pytest.mark.parametrize("cfg_kw", FINALIZE_CONFIGS)
@pytest.mark.parametrize("batch", ["regular", "one_token", "one_row"])
def test_finalize_same_on_tensors_and_on_host(batch, cfg_kw):
    """finalize_metrics runs the metric formulas on numpy fp64 scalars for plain CPU partials and on tensor ops
    otherwise (CUDA, torch.compile): both give the same metrics, NaN / inf of degenerate batches included."""
    from rollout_corr_ext import correction as C

    cfg = Cfg(**cfg_kw)
    lp, rlp, mask = make_inputs(*{"regular": (6, 40), "one_token": (2, 8), "one_row": (1, 30)}[batch], seed=23)
    if batch == "one_token":
        mask.zero_()
        mask[1, 3] = True
        lp[1, 3] = rlp[1, 3] + 0.25
    args = op_args(cfg)
    st = _ops.rollout_seq_stats(lp, rlp, mask, args, None)
    _, _, sums, maxes = _ops.rollout_token_pass(lp, rlp, mask, st, args, True, None)
    host = C.finalize_metrics(sums, maxes, cfg)
    tensor = C._metric_formulas(sums, maxes, cfg, False, C._TensorMath)
    assert list(host) == list(tensor)
    for k, v in tensor.items():
        assert v.dim() == 0 and v.dtype == torch.float64 and host[k].dim() == 0 and host[k].dtype == torch.float64
        torch.testing.assert_close(host[k], v, rtol=1e-13, atol=0, equal_nan=True, msg=k)
    if "5.0_6.0" in str(cfg_kw.get("rollout_is_threshold")):  # sum w^2 = 0: no sample counts
        assert float(host[PREFIX + "rollout_is_eff_sample_size"]) == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("rs", [None, "token"])
def test_std_metrics_do_not_cancel_near_on_policy(level, rs, device):
    """Nearly on-policy batches (weights 1 +- 0.002): E[w^2] - E[w]^2 cancels in fp32 unless the sums are centred;
    the std metrics must still match the fp64 oracle to the fp32 tolerance."""
    g = torch.Generator().manual_seed(41)
    b, t = 32, 1500
    rlp = -torch.rand(b, t, generator=g) * 3
    lp = rlp + torch.randn(b, t, generator=g) * 2e-3
    mask = torch.ones(b, t, dtype=torch.bool)
    cfg = Cfg(rollout_is=level, rollout_is_threshold=2.0, rollout_rs=rs,
              rollout_rs_threshold="0.5_2.0" if rs else None)
    res = _run(device, lp, rlp, mask, cfg)
    _, _, met = oracle_for_config(lp.double(), rlp.double(), mask, cfg)
    for key in ["rollout_is_std", "rollout_is_eff_sample_size"] + (["rollout_rs_token_std"] if rs else []):
        assert float(res.metrics[PREFIX + key]) == pytest.approx(float(met[PREFIX + key]), rel=2e-5), key


def test_packed_ops_opcheck_and_fakes():
    """The packed layout through the op schemas (cu_seqlens), opcheck and meta tensors."""
    if not _HAS_OPS:
        skip_unless_ci("the compiled rollout_corr CPU kernels are not loaded (build the extension)")
    lp, rlp, mask = make_inputs(1, 40, seed=4)
    lp, rlp, mask = lp.reshape(-1), rlp.reshape(-1), mask.reshape(-1)
    cu = torch.tensor([0, 7, 7, 30, 40])
    args = op_args(Cfg(rollout_is="sequence", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="1.3,0.02"))
    st = torch.ops.rollout_corr.rollout_seq_stats.default(lp, rlp, mask, cu, *args)
    assert st.shape == (4, LY.SEQ_COLS)
    torch.library.opcheck(torch.ops.rollout_corr.rollout_seq_stats.default, (lp, rlp, mask, cu, *args))
    torch.library.opcheck(torch.ops.rollout_corr.rollout_token_pass.default, (lp, rlp, mask, cu, st, *args, True))
    meta = [t.to("meta") for t in (lp, rlp, mask, cu)]
    assert torch.ops.rollout_corr.rollout_seq_stats.default(*meta, *args).shape == (4, LY.SEQ_COLS)


@pytest.mark.skipif(__import__("rollout_corr_ext").backend() == "fallback",
                    reason="the reused output blocks belong to the compiled CPU kernels")
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_reused_output_blocks_are_rewritten_everywhere(mask_dtype, packed):
    """The CPU weights and mask come from blocks kept from the previous call (csrc/cpu/reused_buffer.h). A call whose
    outputs land in blocks filled with sentinels gives the same bits as a call on other memory: every element is
    written, the skipped all-padding chunks and the rejected tokens included."""
    import rollout_corr_ext as rc
    from rollout_corr_ext import ops

    b, t = 12, 700
    g = torch.Generator().manual_seed(21)
    rlp = -torch.rand(b, t, generator=g) * 3
    lp = rlp + torch.randn(b, t, generator=g) * 0.3
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(mask_dtype)
    cfg = Cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_max_k3",
              rollout_rs_threshold="0.7_1.5,0.05")
    kw = {}
    if packed:
        lp, rlp, mask = lp.reshape(-1), rlp.reshape(-1), mask.reshape(-1)
        kw["cu_seqlens"] = torch.arange(0, b * t + 1, t)

    rc.empty_cpu_cache()
    first = compute_rollout_correction(lp, rlp, mask, cfg, **kw)
    weights_ptr = first.weights.data_ptr()
    first.weights.fill_(7.0)
    first.response_mask.fill_(1)
    del first
    assert ops.cpu_cache_bytes() == lp.numel() * (4 + torch.empty((), dtype=mask_dtype).element_size())
    reused = compute_rollout_correction(lp, rlp, mask, cfg, **kw)
    assert reused.weights.data_ptr() == weights_ptr, "the kept block was not reused"
    assert rc.empty_cpu_cache() == 0, "both blocks are the live outputs' now"
    other = compute_rollout_correction(lp, rlp, mask, cfg, **kw)
    assert other.weights.data_ptr() != weights_ptr
    assert torch.equal(reused.weights, other.weights) and torch.equal(reused.response_mask, other.response_mask)
    assert torch.all(reused.weights[mask == 0] == 0) and torch.all(reused.response_mask[mask == 0] == 0)
    assert reused.response_mask.dtype == mask_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_results_do_not_depend_on_the_thread_count(dtype, packed):
    """The CPU kernel's fp64 metric sums merged per-thread partials in thread order, so every std / mean metric (and
    fp64 batch-normalised weights) moved with the thread count (the `*_std` ones by up to 3.3e-10 relative; the
    thread-count fuzz). Rows are summed in fixed blocks, merged in block order: the same bits at 1, 2 and 3 threads,
    padded and packed, every metric of token IS + a token and a sequence RS criterion, and batch normalisation."""
    if not _HAS_OPS:
        skip_unless_ci("the compiled rollout_corr CPU kernels are not loaded (build the extension)")
    g = torch.Generator().manual_seed(23)
    b, t = 96, 1536  # 21 rows per block: five blocks, split differently by each thread count
    rlp = (-torch.rand(b, t, generator=g) * 3).to(dtype)
    lp = rlp + (torch.randn(b, t, generator=g) * 0.3).to(dtype)
    mask = torch.rand(b, t, generator=g) < 0.9
    cfgs = [Cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k3,seq_mean_k1",
                rollout_rs_threshold="0.5,0.8_1.25", rollout_is_batch_normalize=True),
            Cfg(rollout_is="sequence", rollout_is_threshold=1e4, rollout_rs="seq_max_k2",
                rollout_rs_threshold=0.8)]
    kw = {}
    if packed:
        lens = torch.randint(1, 2 * t, (b,), generator=g)
        lens = lens * (b * t) // int(lens.sum()) + 1
        cu = torch.zeros(b + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0).clamp(max=b * t)
        lp, rlp, mask = lp.reshape(-1)[: int(cu[-1])], rlp.reshape(-1)[: int(cu[-1])], mask.reshape(-1)[: int(cu[-1])]
        kw = dict(cu_seqlens=cu)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append([compute_rollout_correction(lp, rlp, mask, cfg, **kw) for cfg in cfgs]
                        + [compute_offpolicy_metrics(lp, rlp, mask, **kw)])
    finally:
        torch.set_num_threads(threads)
    first = runs[0]
    for other in runs[1:]:
        for a, o in zip(first[:-1], other[:-1]):
            assert torch.equal(a.weights, o.weights) and torch.equal(a.response_mask, o.response_mask)
            bad = [k for k in a.metrics if not torch.equal(a.metrics[k], o.metrics[k])]
            assert not bad, bad
        assert all(torch.equal(first[-1][k], other[-1][k]) for k in first[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["cpu", "fallback"])
def test_results_are_the_same_bits_in_every_layout(backend, dtype):
    """The same values in another layout (transposed inputs or mask, step-2 slices): the same weights, mask and
    metrics, bit for bit. The fallback summed its rows in the layout's order (31 fp32 metrics moved, by up to 6.6e-6
    relative; the review), which a row mean at a bound could decide by."""
    from rollout_corr_testing.backends import rollout_backend

    if backend == "cpu" and not _HAS_OPS:
        skip_unless_ci("the compiled rollout_corr CPU kernels are not loaded (build the extension)")
    lp, rlp, mask = make_inputs(6, 300, seed=8, scale=0.3, pad_rows=(2,), dtype=dtype)

    def tr(x):
        return x.t().contiguous().t()

    def step2(x):
        return torch.stack([x, torch.zeros_like(x)], -1)[..., 0]

    cfg = Cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,token_k3",
              rollout_rs_threshold="0.9_1.1,0.05", rollout_is_batch_normalize=True)
    with rollout_backend(backend):
        want = compute_rollout_correction(lp, rlp, mask, cfg)
        for args in ((lp, rlp, tr(mask)), (tr(lp), tr(rlp), mask), tuple(map(step2, (lp, rlp, mask)))):
            got = compute_rollout_correction(*args, cfg)
            assert torch.equal(got.weights, want.weights) and torch.equal(got.response_mask, want.response_mask)
            bad = [k for k in want.metrics if not torch.equal(got.metrics[k], want.metrics[k])]
            assert not bad, bad


@pytest.mark.parametrize("device", DEVICES)
def test_rs_std_of_values_far_from_any_fixed_centre_does_not_cancel(device):
    """Every valid token's k2 clamped at the upper bound U (the exact std 0, far from the statistic's typical value
    0): the std read about U * 2^-12 = 1e-5 in fp32 when the sums were centred at a fixed 0 (a fuzz finding); each
    row's sums are centred on its own clamped mean statistic now, as the IS sums are."""
    lr = torch.tensor([[0.599, 0.489, 1.318, 0.0], [0.0, 0.0, 0.0, 0.873]], dtype=torch.float64)  # k2 > 0.05
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    wide = (torch.rand(64, 300, generator=g, dtype=torch.float64) + 0.4) * (torch.rand(64, 300, generator=g) < 0.5)
    for lr_, mask_ in ((lr, mask), (wide, (wide != 0).float())):
        for dtype in (torch.float32, torch.float64):
            lp = -torch.ones_like(lr_)
            cfg = Cfg(rollout_is=None, rollout_rs="token_k2", rollout_rs_threshold=0.05)
            res = _run(device, lp.to(dtype), (lp - lr_).to(dtype), mask_, cfg)
            std = float(res.metrics[PREFIX + "rollout_rs_token_k2_std"])
            assert 0.0 <= std <= 0.05 * 2.0 ** -24, (dtype, std)


@pytest.mark.parametrize("device", DEVICES)
def test_std_of_equal_values_is_zero_in_any_summation_order(device):
    """A std metric of values that are all equal (every token rejected, its statistic clamped at the bound; every IS
    weight at the cap) is exactly 0, whatever order the partials are summed in. It was the one-pass formula's
    rounding, E[x^2] - E[x]^2 of fp64 sums: 0 on the CPU kernels and 1.2e-10 on the emulated GPU grid for the same
    fp64 batch (the emulator fuzz; 2^-28 under CP for the IS std). A variance below VAR_ROUNDING E[x^2] is 0, and a
    real spread is kept (oracle: torch.std in fp64). Rows in another order: the same metrics."""
    from rollout_corr_ext import correction

    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 200, generator=g, dtype=torch.float64) * 3
    rlp = lp + torch.randn(4, 200, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(4, 200, generator=g) > 0.3
    mask[1] = False
    mask[2] = False
    mask[2, -1] = True
    cases = [(Cfg.decoupled_k3_rs(), "rollout_rs_seq_mean_k3_std"),
             (Cfg(rollout_is="token", rollout_is_threshold=1e-3), "rollout_is_std"),      # every weight at the cap
             (Cfg(rollout_is="sequence", rollout_is_threshold=1e-3), "rollout_is_std")]
    perm = torch.tensor([3, 0, 2, 1])
    with ops_on(device) as dev:
        for cfg, key in cases:
            for x, y, m in ((lp, rlp, mask), (lp[perm], rlp[perm], mask[perm])):
                out = compute_rollout_correction(x.to(dev), y.to(dev), m.to(dev), cfg)
                assert float(out.metrics[PREFIX + key]) == 0.0, (key, float(out.metrics[PREFIX + key]))
    # the floor's semantics: NaN and inf kept, negative and rounding-level variances 0, a resolvable spread kept
    F = correction._TensorMath
    t = torch.tensor
    e2 = t(4.0, dtype=torch.float64)
    assert torch.isnan(correction._resolved(t(math.nan, dtype=torch.float64), e2, F))
    assert correction._resolved(t(math.inf, dtype=torch.float64), t(math.inf, dtype=torch.float64), F) == math.inf
    assert correction._resolved(t(-1e-30, dtype=torch.float64), e2, F) == 0
    assert correction._resolved(t(4.0 * 2 ** -50, dtype=torch.float64), e2, F) == 0
    x = 2.0 + 1e-6 * torch.randn(1000, generator=g, dtype=torch.float64)  # relative spread 5e-7: resolvable
    w = compute_rollout_correction(torch.log(x)[None], torch.zeros(1, 1000, dtype=torch.float64),
                                   torch.ones(1, 1000, dtype=torch.bool),
                                   Cfg(rollout_is="token", rollout_is_threshold=10.0))
    std = float(w.metrics[PREFIX + "rollout_is_std"])
    assert std == pytest.approx(float(x.std(unbiased=False)), rel=1e-3) and std > 0
