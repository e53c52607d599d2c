"""The independent fp64 oracle (``rollout_corr_testing/rollout_oracle.py``) against verl 0.9.1 and the package.

a. The oracle equals verl 0.9.1's real ``compute_rollout_correction_and_rejection_mask`` (the installed verl, not a
   stub) on configurations verl supports: every key verl emits, the weights and the mask. The oracle's extra keys
   are exactly the project's additions (docs/rollout_correction.md).
b. ``rollout_corr_ext.compute_rollout_correction`` equals the oracle: weights, mask (exactly, in the input mask's
   dtype) and every metric (same key set), over every IS level x mode, every RS criterion (verl's 11 and the ratio
   criteria token / sequence / geometric), the veto, batch normalisation, ``nonfinite="exclude"``, input dtypes
   fp32 / bf16 / fp16 / fp64 (and mixed) and mask dtypes bool / int64 / float32.

Inputs sit on a 2^-12 grid (``rc_testutil.make_inputs``), so log-ratios and their row sums are exact in fp32 and
fp64 alike and no threshold decision can flip between the package's fp32 math and the oracle's fp64; padding holds
junk (NaN, +-inf) that must be ignored, and whole padding rows are included.

``run_ours`` is the one place the package is called, so it can be parametrized over kernel backends.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    import rollout_corr_ext

from rollout_corr_testing.backends import rollout_backend, skip_reason
from rollout_corr_testing.rc_testutil import make_inputs
from rollout_corr_testing.rollout_oracle import rollout_correction_oracle
from rollout_corr_testing.skips import verl_rollout_correction_fn
from rollout_corr_testing.tolerances import METRIC_TOL, PERCENTILE_RTOL, WEIGHT_TOL, accumulation_dtype

PREFIX = "rollout_corr/"
PERCENTILE_KEYS = {f"{PREFIX}rollout_is_p{p}" for p in (5, 25, 50, 75, 95)}


#: The implementation the package's ops run on: "cpu" (compiled kernels), "fallback" (the pure-PyTorch fallback),
#: "emulated" (the CUDA kernels thread by thread on the CPU), "cuda" (a GPU, when present).
_BACKEND = {"name": "cpu", "knobs": {}}


def run_ours(lp, rlp, mask, fields, **kw):
    """The package's public API on ``fields`` (RolloutCorrectionConfig keyword arguments) on the current backend;
    returns ``(weights or None, mask, {key: float})`` like the oracle."""
    with rollout_backend(_BACKEND["name"], **_BACKEND["knobs"]) as device:
        moved = [t.to(device) for t in (lp, rlp, mask)]
        res = rollout_corr_ext.compute_rollout_correction(
            *moved, rollout_corr_ext.RolloutCorrectionConfig(**fields), **kw)
    weights = None if res.weights is None else res.weights.cpu()
    return weights, res.response_mask.cpu(), res.as_floats()


@pytest.fixture(params=["cpu", "fallback", "emulated", "cuda"])
def backend(request):
    """Run a test's package calls on each backend (skipped with the reason where one cannot run). The emulated
    kernels run small launches (64 threads, descending schedule, 3 blocks: grid-stride and block reductions)."""
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    knobs = dict(threads=64, schedule=1, max_blocks=3) if request.param == "emulated" else {}
    _BACKEND.update(name=request.param, knobs=knobs)
    yield request.param
    _BACKEND.update(name="cpu", knobs={})


# --------------------------------------------------------------------------------------------------- inputs


def _inputs(b=16, t=48, seed=3, scale=0.2, pad_rows=(2, 9), spikes=False, junk="nan"):
    """fp64 log-probs on the 2^-12 grid with a bool mask; ``junk`` fills the padding ("nan": NaN / +-inf, or
    "finite": large finite values, for verl, whose weights are raw * mask); ``spikes``: a few valid log-ratios
    beyond the +-20 clamp."""
    lp, rlp, mask = make_inputs(b, t, seed=seed, scale=scale, pad_rows=pad_rows, dtype=torch.float64)
    lp = torch.where(mask, lp, torch.zeros_like(lp))
    if spikes:
        rows = [r for r in range(b) if mask[r].sum() >= 3][:3]
        lp[rows[0], 0] = rlp[rows[0], 0] + 25.0  # beyond +20: clamped
        lp[rows[1], 1] = rlp[rows[1], 1] - 24.0  # beyond -20: clamped; also a catastrophic token for any veto
        lp[rows[2], 0] = rlp[rows[2], 0] + 7.5
    pad = ~mask
    idx = torch.arange(b * t).reshape(b, t)
    if junk == "nan":
        lp = torch.where(pad, torch.full_like(lp, math.nan), lp)
        rlp = torch.where(pad & (idx % 3 == 0), torch.full_like(rlp, math.inf), rlp)
        rlp = torch.where(pad & (idx % 3 == 1), torch.full_like(rlp, -math.inf), rlp)
    else:
        lp = torch.where(pad, torch.full_like(lp, 30.0), lp)
        rlp = torch.where(pad, torch.full_like(rlp, -50.0), rlp)
    return lp, rlp, mask


def _cast_mask(mask, dtype):
    return mask if dtype == torch.bool else mask.to(dtype)


def _fields(**kw):
    """All public fields, defaults first (the docs' table), so the oracle and the package see the same ones."""
    f = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
             rollout_rs_threshold=None)
    f.update(kw)
    return f


# --------------------------------------------------------------------------------------------------- a. verl


ALL_VERL_RS = ("token_k1,token_k2,token_k3,seq_sum_k1,seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k2,seq_mean_k3,"
               "seq_max_k2,seq_max_k3")
ALL_VERL_RS_SPECS = "0.75_1.3,0.0311,0.0311,0.45_2.3,0.53,0.53,0.93_1.07,0.0213,0.0213,0.15,0.15"

# (id, verl keyword fields, input scale)
VERL_CASES = [
    ("token_tis", _fields(rollout_is="token", rollout_is_threshold=1.5), 0.3),
    ("token_tis_str", _fields(rollout_is="token", rollout_is_threshold="1.5"), 0.3),
    ("seq_tis", _fields(rollout_is="sequence", rollout_is_threshold=1.5), 0.1),
    ("token_icepop", _fields(rollout_is="token", rollout_is_threshold="0.6_1.6"), 0.3),
    ("seq_icepop", _fields(rollout_is="sequence", rollout_is_threshold="0.6_1.6"), 0.1),
    ("token_tis_norm", _fields(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True), 0.3),
    ("seq_tis_norm", _fields(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True), 0.1),
    ("seq_icepop_norm", _fields(rollout_is="sequence", rollout_is_threshold="0.6_1.6",
                                rollout_is_batch_normalize=True), 0.1),
    ("rs_seq_max_k2_k3", _fields(rollout_is=None, rollout_rs="seq_max_k2,seq_max_k3",
                                 rollout_rs_threshold="0.15,0.11"), 0.2),
    ("rs_token_k123", _fields(rollout_is=None, rollout_rs="token_k1,token_k2,token_k3",
                              rollout_rs_threshold="0.75_1.3,0.0311,0.0251"), 0.2),
    ("token_tis_seq_sum_k1_seq_mean_k3", _fields(rollout_is="token", rollout_is_threshold=1.5,
                                                 rollout_rs="seq_sum_k1,seq_mean_k3",
                                                 rollout_rs_threshold="0.45_2.3,0.0213"), 0.2),
    ("seq_tis_seq_sum_mean", _fields(rollout_is="sequence", rollout_is_threshold=2.0,
                                     rollout_rs="seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k2",
                                     rollout_rs_threshold="0.53,0.53,0.93_1.07,0.0213"), 0.1),
    ("rs_all_eleven", _fields(rollout_is=None, rollout_rs=ALL_VERL_RS, rollout_rs_threshold=ALL_VERL_RS_SPECS), 0.2),
    ("rs_k1_numeric_upper_dupes", _fields(rollout_is=None, rollout_rs="seq_mean_k1, seq_mean_k1,token_k1",
                                          rollout_rs_threshold=1.07), 0.2),
    ("rs_shared_k3_spec", _fields(rollout_is="token", rollout_is_threshold="0.6_1.6",
                                  rollout_rs="token_k3,seq_mean_k3,seq_max_k3", rollout_rs_threshold="0.0311"), 0.3),
    ("disabled", _fields(rollout_is=None, rollout_rs=None), 0.2),
]

#: what the project adds to verl's keys (docs/rollout_correction.md): always the veto / total-masking metrics;
#: the percentiles with an IS level.
ALWAYS_EXTRA = {PREFIX + k for k in ("rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction",
                                     "masked_fraction", "seq_masked_fraction")}


def _run_verl_and_oracle(fields, lp, rlp, mask):
    verl_fn = verl_rollout_correction_fn()
    maskf = mask.to(torch.float64)  # verl multiplies by the mask: pass it as float
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w_proto, v_mask, v_met = verl_fn(lp, rlp, maskf, **fields)
    w, o_mask, o_met = rollout_correction_oracle(lp, rlp, maskf, **fields)
    return w_proto, v_mask, v_met, w, o_mask, o_met


def _compare_verl_metrics(v_met, o_met, fields):
    missing = set(v_met) - set(o_met)
    assert not missing, f"verl keys the oracle lacks: {sorted(missing)}"
    extra = set(o_met) - set(v_met)
    want_extra = ALWAYS_EXTRA | (PERCENTILE_KEYS if fields["rollout_is"] is not None else set())
    assert extra == want_extra, f"oracle's extra keys {sorted(extra)} != the project's additions {sorted(want_extra)}"
    # verl reduces some fractions in fp32 (``.float().mean()``): rel 5e-7 covers that rounding, nothing else.
    bad = [f"{k}: verl {v!r} oracle {o_met[k]!r}" for k, v in sorted(v_met.items())
           if not math.isclose(v, o_met[k], rel_tol=5e-7, abs_tol=1e-12)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", VERL_CASES, ids=[c[0] for c in VERL_CASES])
def test_oracle_equals_verl(case):
    _, fields, scale = case
    # finite junk at padding: verl's token-level weights are raw * mask, so NaN junk would give NaN weights there
    lp, rlp, mask = _inputs(scale=scale, junk="finite", spikes=True)
    w_proto, v_mask, v_met, w, o_mask, o_met = _run_verl_and_oracle(fields, lp, rlp, mask)

    _compare_verl_metrics(v_met, o_met, fields)

    if fields["rollout_is"] is None:
        assert w_proto is None and w is None
    else:
        torch.testing.assert_close(w, w_proto.batch["rollout_is_weights"], rtol=1e-12, atol=1e-300)
    assert o_mask.dtype == v_mask.dtype
    assert torch.equal(o_mask, v_mask)
    # the case is informative: RS configs reject some tokens and keep some
    if fields["rollout_rs"] is not None:
        assert 0.0 < v_met[PREFIX + "rollout_rs_masked_fraction"] < 1.0


@pytest.mark.parametrize("name", ["token_tis_seq_sum_k1_seq_mean_k3", "seq_icepop_norm", "rs_all_eleven"])
def test_oracle_equals_verl_nan_padding(name):
    """NaN / +-inf junk at padding: verl's metrics and mask ignore it (masked_sum selects with torch.where), and so
    does the oracle. verl's token-level weights are NaN there (raw * mask); the docs (and the oracle) say 0."""
    fields, scale = {c[0]: (c[1], c[2]) for c in VERL_CASES}[name]
    lp, rlp, mask = _inputs(scale=scale, junk="nan")
    w_proto, v_mask, v_met, w, o_mask, o_met = _run_verl_and_oracle(fields, lp, rlp, mask)
    _compare_verl_metrics(v_met, o_met, fields)
    if w is not None:
        torch.testing.assert_close(w[mask], w_proto.batch["rollout_is_weights"][mask], rtol=1e-12, atol=1e-300)
        assert bool((w[~mask] == 0).all())
    assert torch.equal(o_mask, v_mask)


def test_oracle_percentiles_are_torch_quantile():
    """The oracle's percentiles are torch.quantile's (linear) of the raw weight over valid tokens; sequence
    levels: each valid token carries its row's weight."""
    lp, rlp, mask = _inputs(b=24, t=40, scale=0.3, seed=8)
    lr = (lp - rlp)
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    _, _, met = rollout_correction_oracle(lp, rlp, mask, rollout_is="token", rollout_is_threshold=1.5)
    want = torch.quantile(torch.exp(lr[mask].clamp(-20, 20)), q)
    got = torch.tensor([met[f"{PREFIX}rollout_is_p{p}"] for p in (5, 25, 50, 75, 95)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    _, _, met = rollout_correction_oracle(lp, rlp, mask, rollout_is="sequence", rollout_is_threshold=1.5)
    seq = torch.where(mask, lr, torch.zeros_like(lr)).sum(1, keepdim=True).clamp(-20, 20).exp().expand_as(lr)
    want = torch.quantile(seq[mask], q)
    got = torch.tensor([met[f"{PREFIX}rollout_is_p{p}"] for p in (5, 25, 50, 75, 95)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


# --------------------------------------------------------------------------------------------------- b. package


def _tolerances(lp_dtype, rlp_dtype):
    acc = accumulation_dtype(lp_dtype, rlp_dtype)
    return METRIC_TOL[acc], WEIGHT_TOL[acc], acc


def _check_against_oracle(lp, rlp, mask, fields, **kw):
    """Our op vs the oracle on the very same (already cast) tensors; returns the oracle's metrics."""
    met_tol, w_tol, w_dtype = _tolerances(lp.dtype, rlp.dtype)
    w_o, m_o, met_o = rollout_correction_oracle(lp, rlp, mask, **fields, **kw)
    w, m, met = run_ours(lp, rlp, mask, fields, **kw)

    assert set(met) == set(met_o), (f"key sets differ: only ours {sorted(set(met) - set(met_o))}, "
                                    f"only oracle {sorted(set(met_o) - set(met))}")
    bad = []
    for k, want in sorted(met_o.items()):
        got = met[k]
        if k in PERCENTILE_KEYS:
            ok = abs(got - want) <= PERCENTILE_RTOL * abs(want)
        else:
            ok = math.isclose(got, want, rel_tol=met_tol["rtol"], abs_tol=met_tol["atol"])
        if not ok:
            bad.append(f"{k}: ours {got!r} oracle {want!r}")
    assert not bad, f"fields={fields} kw={kw}\n" + "\n".join(bad)

    if w_o is None:
        assert w is None
    else:
        assert w is not None and w.dtype == w_dtype and w.shape == w_o.shape
        torch.testing.assert_close(w.to(torch.float64), w_o, **w_tol)
    assert m.dtype == mask.dtype and m_o.dtype == mask.dtype
    assert torch.equal(m, m_o), f"masks differ at {torch.nonzero(m != m_o).tolist()[:10]}"
    return met_o


# IS: level x mode. Thresholds per level so that truncation / masking actually bites on the inputs.
_IS_BOUNDS = {"token": (1.5, 0.6, 1.6, 0.7, 0.55, 0.3), "sequence": (1.5, 0.6, 1.6, 0.7, 0.55, 0.1),
              "geometric": (1.04, 0.96, 1.04, 0.98, 0.95, 0.3)}


def _is_cases():
    cases = []
    for level, (c, lo, up, mlow, mask_low, scale) in _IS_BOUNDS.items():
        modes = {
            "tis": dict(rollout_is_threshold=c),
            "tis_float_str": dict(rollout_is_threshold=str(c)),
            "tis_truncate_mode": dict(rollout_is_threshold=c, rollout_is_mode="truncate"),
            "tis_metric_lower": dict(rollout_is_threshold=c, rollout_is_threshold_lower=mlow),
            "icepop_spec": dict(rollout_is_threshold=f"{lo}_{up}"),
            "icepop_spec_mask_mode": dict(rollout_is_threshold=f"{lo}_{up}", rollout_is_mode="mask"),
            "mask_mode_auto_lower": dict(rollout_is_threshold=up, rollout_is_mode="mask"),
            "mask_mode_lower": dict(rollout_is_threshold=up, rollout_is_mode="mask",
                                    rollout_is_threshold_lower=mask_low),
            "tis_norm": dict(rollout_is_threshold=c, rollout_is_batch_normalize=True),
            "icepop_norm": dict(rollout_is_threshold=f"{lo}_{up}", rollout_is_batch_normalize=True),
        }
        for name, f in modes.items():
            cases.append((f"is_{level}_{name}", dict(rollout_is=level, rollout_rs=None, **f), scale))
    return cases


RS_ALONE = [("token_k1", "0.75_1.3"), ("token_k2", 0.0311), ("token_k3", 0.0311), ("seq_sum_k1", "0.45_2.3"),
            ("seq_sum_k2", 0.53), ("seq_sum_k3", 0.53), ("seq_mean_k1", "0.93_1.07"), ("seq_mean_k2", 0.0213),
            ("seq_mean_k3", 0.0213), ("seq_max_k2", 0.15), ("seq_max_k3", 0.15), ("token", "0.77_1.29"),
            ("sequence", 2.3), ("geometric", "0.93_1.07")]


def _rs_cases():
    cases = [(f"rs_{c}", dict(rollout_is=None, rollout_rs=c, rollout_rs_threshold=t), 0.2) for c, t in RS_ALONE]
    more = {
        "rs_token_k1_numeric_upper": dict(rollout_rs="token_k1", rollout_rs_threshold=1.31),
        "rs_token_k1_upper_and_lower_field": dict(rollout_rs="token_k1", rollout_rs_threshold="1.31",
                                                  rollout_rs_threshold_lower=0.71),
        "rs_token_ratio_no_lower": dict(rollout_rs="token", rollout_rs_threshold=1.29, rollout_rs_threshold_lower=0.0),
        "rs_sequence_ratio_lower_field": dict(rollout_rs="sequence", rollout_rs_threshold=2.3,
                                              rollout_rs_threshold_lower=0.37),
        "rs_geometric_upper_str": dict(rollout_rs="geometric", rollout_rs_threshold="1.07"),
        "rs_combo_per_criterion": dict(rollout_rs="token_k1,seq_mean_k3,seq_max_k2",
                                       rollout_rs_threshold="0.75_1.3, 0.0213, 0.15"),
        "rs_combo_shared_k2k3": dict(rollout_rs="token_k2,seq_max_k3,seq_mean_k2", rollout_rs_threshold=0.0611),
        "rs_dupes_shared_ratio_k1": dict(rollout_rs="seq_mean_k1, seq_mean_k1 ,token,",
                                         rollout_rs_threshold="0.93_1.07"),
        "rs_lower_field_mixed": dict(rollout_rs="seq_sum_k1,geometric,token_k3", rollout_rs_threshold="2.3,1.07,0.0311",
                                     rollout_rs_threshold_lower=0.5),
        "rs_all_fourteen": dict(rollout_rs=ALL_VERL_RS + ",token,sequence,geometric",
                                rollout_rs_threshold=ALL_VERL_RS_SPECS + ",0.77_1.29,2.3,0.93_1.07"),
    }
    cases += [(k, dict(rollout_is=None, **v), 0.2) for k, v in more.items()]
    with_is = {
        "token_tis+rs_combo": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1,seq_mean_k3",
                                   rollout_rs_threshold="0.75_1.3,0.0213"),
        "seq_icepop+rs_seq_sum_k1": dict(rollout_is="sequence", rollout_is_threshold="0.6_1.6",
                                         rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
        "geo_tis_norm+rs_ratio": dict(rollout_is="geometric", rollout_is_threshold=1.04,
                                      rollout_is_batch_normalize=True, rollout_rs="geometric,token",
                                      rollout_rs_threshold="0.97_1.03,0.77_1.29"),
    }
    cases += [(k, v, 0.2) for k, v in with_is.items()]
    return cases


def _veto_cases():
    return [
        ("veto_alone", dict(rollout_is=None, rollout_token_veto_threshold=0.62), 0.2),
        ("veto_token_tis", dict(rollout_is="token", rollout_is_threshold=1.5, rollout_token_veto_threshold=0.5), 0.3),
        ("veto_geo_icepop_rs", dict(rollout_is="geometric", rollout_is_threshold="0.96_1.04",
                                    rollout_rs="seq_mean_k3,token", rollout_rs_threshold="0.0213,0.77_1.29",
                                    rollout_token_veto_threshold=0.62), 0.2),
        ("veto_tiny_seq_tis", dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                   rollout_token_veto_threshold=1e-4), 0.1),
    ]


CONFIG_CASES = ([("defaults", {}, 0.1), ("disabled", dict(rollout_is=None, rollout_rs=None), 0.2)]
                + _is_cases() + _rs_cases() + _veto_cases())
#: Every 4th case on the emulated kernels (the ids spread over IS levels, RS criteria and the veto).
EMULATED_CASES = {c[0] for c in CONFIG_CASES[::4]}


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_package_equals_oracle_configs(case, backend):
    if backend == "emulated" and case[0] not in EMULATED_CASES:
        pytest.skip(reason="the emulated kernels run a representative subset (every IS level and mode, RS kinds, the "
                    "veto) to keep the file under a minute; all cases run on the compiled CPU kernels and the fallback")
    _, fields, scale = case
    lp, rlp, mask = _inputs(scale=scale, spikes=case[0].startswith("veto_tiny"))
    met = _check_against_oracle(lp.float(), rlp.float(), mask, fields)
    # the case is informative: what it configures acts on these inputs, without removing everything
    if fields.get("rollout_rs"):
        assert 0.0 < met[PREFIX + "rollout_rs_masked_fraction"] < 1.0
    if fields.get("rollout_token_veto_threshold"):
        assert 0.0 < met[PREFIX + "rollout_is_veto_fraction"] < 1.0
    if fields.get("rollout_is", "sequence") is not None and "norm" not in case[0]:
        bites = (met[PREFIX + "rollout_is_ratio_fraction_high"] + met.get(PREFIX + "rollout_is_oob_ratio", 0.0))
        assert bites > 0.0, "the IS threshold never acts on these inputs"


# Rich configurations for the dtype matrix: every IS level, IcePop and TIS, RS of each kind, the veto.
RICH = {
    "token_icepop_rs_veto": (dict(rollout_is="token", rollout_is_threshold="0.6_1.6",
                                  rollout_rs="token_k1,seq_mean_k3,seq_max_k2",
                                  rollout_rs_threshold="0.75_1.3,0.0213,0.15", rollout_token_veto_threshold=0.62), 0.2),
    "seq_tis_norm_ratio_rs": (dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                                   rollout_rs="sequence,token_k2,seq_sum_k3", rollout_rs_threshold="2.3,0.0311,0.53"),
                              0.1),
    "geo_mask_mode_rs": (dict(rollout_is="geometric", rollout_is_threshold=1.04, rollout_is_mode="mask",
                              rollout_rs="geometric,seq_sum_k1,token_k3",
                              rollout_rs_threshold="0.97_1.03,0.45_2.3,0.0311",
                              rollout_token_veto_threshold=0.62), 0.2),
}
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
MASK_DTYPES = [torch.bool, torch.int64, torch.float32]


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", sorted(RICH))
def test_package_equals_oracle_dtypes(name, dtype, mask_dtype, backend):
    if backend == "emulated" and mask_dtype != torch.bool:
        pytest.skip(reason="emulated kernels: one mask dtype here (every mask dtype: test_cuda_emulator_rollout_correction)")
    fields, scale = RICH[name]
    lp, rlp, mask = _inputs(scale=scale, seed=11, spikes=True)
    # the oracle sees the very same rounded values (bf16 / fp16 stay on the 2^-12 grid: exact in fp32)
    _check_against_oracle(lp.to(dtype), rlp.to(dtype), _cast_mask(mask, mask_dtype), fields)


@pytest.mark.parametrize("shift", [7.0, 12.0, 30.0], ids=lambda s: f"w~e^-{s:g}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_package_equals_oracle_far_off_policy(level, dtype, shift, backend):
    """IS weights far below 1 (the batches a user diagnoses with ESS and std): the weight sums must not lose
    sum w^2 to rounding by being centred where the weights are not (ESS and std were once wrong by 5-100x from
    w ~ e^-7 in fp32, and ESS = inf for w below ~1e-8 in fp64). shift 30: every weight at the e^-20 clamp."""
    lp, rlp, mask = _inputs(scale=0.3, seed=21)
    rlp = rlp + shift
    fields = dict(rollout_is=level, rollout_is_threshold=2.0, rollout_rs=None)
    met = _check_against_oracle(lp.to(dtype), rlp.to(dtype), mask, fields)
    assert met[PREFIX + "rollout_is_mean"] < 1e-2


@pytest.mark.parametrize("lp_dtype,rlp_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                                (torch.float16, torch.float64), (torch.float64, torch.float32)],
                         ids=["fp32+bf16", "bf16+fp16", "fp16+fp64", "fp64+fp32"])
def test_package_equals_oracle_mixed_dtypes(lp_dtype, rlp_dtype, backend):
    fields, scale = RICH["token_icepop_rs_veto"]
    lp, rlp, mask = _inputs(scale=scale, seed=12, spikes=True)
    _check_against_oracle(lp.to(lp_dtype), rlp.to(rlp_dtype), mask, fields)


NONFINITE_CASES = {
    "token_tis_token_k1": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
                               rollout_rs_threshold="0.75_1.3"),
    "seq_icepop_seq_sum_k1_veto": dict(rollout_is="sequence", rollout_is_threshold="0.6_1.6", rollout_rs="seq_sum_k1",
                                       rollout_rs_threshold="0.45_2.3", rollout_token_veto_threshold=0.62),
    "geo_tis_norm_seq_max_k3_geometric": dict(rollout_is="geometric", rollout_is_threshold=1.04,
                                              rollout_is_batch_normalize=True, rollout_rs="seq_max_k3,geometric",
                                              rollout_rs_threshold="0.15,0.97_1.03"),
    "disabled": dict(rollout_is=None, rollout_rs=None),
}


def _with_nonfinite(lp, rlp, mask):
    """NaN / +inf / -inf at some valid positions, in either input; one row loses all its valid tokens."""
    lp, rlp = lp.clone(), rlp.clone()
    rows = [r for r in range(mask.shape[0]) if mask[r].sum() >= 4]
    lp[rows[0], 0] = math.nan
    rlp[rows[0], 2] = math.inf
    lp[rows[1], 1] = -math.inf
    rlp[rows[2], 3] = math.nan
    lp[rows[2], 0] = math.inf
    short = [r for r in range(mask.shape[0]) if 1 <= mask[r].sum() <= 3 and r not in rows[:3]]
    if short:
        rlp[short[0]] = torch.where(mask[short[0]], torch.full_like(rlp[short[0]], math.nan), rlp[short[0]])
    return lp, rlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", sorted(NONFINITE_CASES))
def test_package_equals_oracle_nonfinite_exclude(name, dtype, backend):
    lp, rlp, mask = _inputs(b=20, scale=0.2, seed=5)
    lp, rlp = _with_nonfinite(lp, rlp, mask)
    met = _check_against_oracle(lp.to(dtype), rlp.to(dtype), mask, NONFINITE_CASES[name], nonfinite="exclude")
    assert met[PREFIX + "nonfinite_token_fraction"] > 0.0


def test_nonfinite_error_both_raise():
    lp, rlp, mask = _inputs(scale=0.2)
    lp, rlp = _with_nonfinite(lp, rlp, mask)
    fields = dict(rollout_is="token", rollout_is_threshold=2.0)
    with pytest.raises(ValueError):
        rollout_correction_oracle(lp.float(), rlp.float(), mask, **fields)
    with pytest.raises(ValueError):
        run_ours(lp.float(), rlp.float(), mask, fields)


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (3, 1), (2, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["token_icepop_rs_veto", "seq_tis_norm_ratio_rs"])
def test_package_equals_oracle_tiny_batches(shape, name, backend):
    """One token, one row, one column: the N <= 1 / B <= 1 branches (std 0) and single-row maxima."""
    b, t = shape
    fields, scale = RICH[name]
    lp, rlp, mask = make_inputs(b, t, seed=b * 7 + t, scale=scale, min_len=1, dtype=torch.float64)
    _check_against_oracle(lp.float(), rlp.float(), mask, fields)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("crit, threshold", [("seq_sum_k3", 100.0), ("token_k3", 50.0), ("seq_mean_k3", 0.01),
                                             ("token_k2", 1e-3)])
def test_std_of_clamped_statistics_is_verls_for_the_mask_dtype(crit, threshold, mask_dtype):
    """Every token's RS statistic above the threshold, so clamped to it: n equal values. verl's masked_mean divides by
    the count + 1e-8 in the mask's dtype, which keeps the 1e-8 only for an fp64 mask (then its std reads
    |x| sqrt(1e-8 / n)); for a bool / int / fp32 mask it rounds away and the std is 0. The package gave the fp64-mask
    value for every mask (9.3e-4 at a threshold of 100 where verl gives 0)."""
    verl_fn = verl_rollout_correction_fn()
    g = torch.Generator().manual_seed(0)
    rlp = -torch.rand(4, 32, generator=g, dtype=torch.float64) * 4
    lp = rlp + 8.0 + torch.rand(4, 32, generator=g, dtype=torch.float64)  # log-ratios in [8, 9]
    mask = torch.ones(4, 32, dtype=torch.bool)
    mask[1, 20:] = False
    mask = mask.to(mask_dtype)
    fields = dict(rollout_is=None, rollout_rs=crit, rollout_rs_threshold=threshold)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, v_met = verl_fn(lp, rlp, mask, **fields)
    key = f"{PREFIX}rollout_rs_{crit}_std"
    got = float(rollout_corr_ext.compute_rollout_correction(lp, rlp, mask, rollout_corr_ext.RolloutCorrectionConfig(
        **fields)).metrics[key])
    assert math.isclose(got, v_met[key], rel_tol=1e-6, abs_tol=1e-12), (got, v_met[key])
    _, _, o_met = rollout_correction_oracle(lp, rlp, mask, **fields)
    assert math.isclose(o_met[key], v_met[key], rel_tol=1e-6, abs_tol=1e-12), (o_met[key], v_met[key])
