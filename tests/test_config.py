"""RolloutCorrectionConfig: presets with their sources' defaults, validation at build time, (de)serialisation,
legacy conversion."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from rollout_corr_ext import RolloutCorrectionConfig as Cfg
from rollout_corr_ext.config import PRESETS

DEFAULTS = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_mode=None, rollout_is_threshold_lower=None,
                rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None,
                rollout_rs_threshold_lower=None, rollout_token_veto_threshold=None, bypass_mode=False,
                loss_type="ppo_clip")

#: preset -> the fields that differ from the defaults (verl 0.9.1 algorithm.py; the original API's names).
EXPECTED = {
    "decoupled_token_is": dict(rollout_is="token"),
    "decoupled_seq_is": dict(),
    "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "bypass_pg_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True,
                                   loss_type="reinforce"),
    "decoupled_seq_is_rs": dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "bypass_ppo_clip": dict(rollout_is=None, bypass_mode=True),
    "bypass_ppo_clip_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001",
                                   bypass_mode=True),
    "bypass_ppo_clip_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01,
                                  bypass_mode=True),
    "bypass_pg_is": dict(bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001",
                             bypass_mode=True, loss_type="reinforce"),
    "decoupled_geo_rs_seq_tis": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001"),
    "bypass_pg_geo_rs_seq_tis": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True,
                                     loss_type="reinforce"),
    "bypass_pg_geo_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001", bypass_mode=True, loss_type="reinforce"),
    "decoupled_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "disabled": dict(rollout_is=None),
    "token_is": dict(rollout_is="token"),
    "token_tis": dict(rollout_is="token"),
    "seq_is": dict(),
    "seq_is_rs": dict(rollout_rs="sequence", rollout_rs_threshold=2.0),
    "seq_mis": dict(rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0),
    "geo_rs": dict(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.001,
                   rollout_token_veto_threshold=1e-4),
    "geo_mis": dict(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.001,
                    rollout_rs_threshold_lower=0.999, rollout_token_veto_threshold=1e-4),
    "ppo_is_bypass": dict(rollout_is="token", bypass_mode=True),
    "pure_is": dict(bypass_mode=True, loss_type="reinforce"),
    # ours: two-sided truncated IS
    "two_sided_tis": dict(rollout_is="token", rollout_is_mode="two_sided", rollout_is_threshold_lower=0.5),
}


def test_preset_list_is_complete():
    assert len(PRESETS) == 29 and set(PRESETS) == set(EXPECTED)
    assert len([p for p in PRESETS[:19]]) == 19 and "disabled" in PRESETS[:19]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_have_their_sources_defaults(name):
    cfg = getattr(Cfg, name)()
    assert cfg.to_dict() == {**DEFAULTS, **EXPECTED[name]}
    assert Cfg.from_dict(cfg.to_dict()) == cfg
    assert Cfg.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # YAML/JSON scalars only


def test_threshold_forms():
    tis = Cfg(rollout_is="token", rollout_is_threshold=3.0).is_spec
    assert (tis.mode, tis.lower, tis.upper, tis.metric_lower) == ("truncate", None, 3.0, pytest.approx(1 / 3))
    assert Cfg(rollout_is="token", rollout_is_threshold="3.0").is_spec.mode == "truncate"
    ice = Cfg(rollout_is="token", rollout_is_threshold="0.5_5").is_spec
    assert (ice.mode, ice.lower, ice.upper) == ("mask", 0.5, 5.0)
    legacy = Cfg(rollout_is="geometric", rollout_is_threshold=2.0, rollout_is_mode="mask").is_spec
    assert (legacy.mode, legacy.lower) == ("mask", 0.5)
    legacy_lo = Cfg(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_mode="mask",
                    rollout_is_threshold_lower=0.8).is_spec
    assert legacy_lo.lower == 0.8
    k = Cfg(rollout_rs="seq_mean_k1,seq_max_k3", rollout_rs_threshold=1.5).rs_criteria
    assert k[0].lower == pytest.approx(math.log(1 / 1.5)) and k[1].upper == 1.5 and not k[1].apply_lower
    assert [c.name for c in Cfg(rollout_rs="token_k2, token_k2 ,seq_sum_k3", rollout_rs_threshold="0.1,0.2")
            .rs_criteria] == ["token_k2", "seq_sum_k3"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(rollout_is="tokens"), r"rollout_is must be None or one of \['token', 'sequence', 'geometric'\]"),
    (dict(rollout_rs="seq_k1", rollout_rs_threshold=2.0), r"rollout_rs: unknown criterion 'seq_k1'; allowed"),
    (dict(rollout_is_threshold=0.0), r"rollout_is_threshold: the upper bound must be > 0"),
    (dict(rollout_is_threshold=-1.0), r"rollout_is_threshold: the upper bound must be > 0"),
    (dict(rollout_is_threshold="2_1"), r"rollout_is_threshold: lower bound 2.0 > upper bound 1.0"),
    (dict(rollout_is_threshold="0_1"), r"rollout_is_threshold: the lower bound must be > 0"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2_1"), r"criterion 'token_k1'.*lower bound 2.0 > upper"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=0), r"criterion 'token_k1'.*upper bound must be > 0"),
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold="0.1_0.2"), r"k2/k3 criteria take an upper bound only"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=0.1, rollout_rs_threshold_lower=0.05),
     r"rollout_rs_threshold_lower: k2/k3 criteria take an upper bound only"),
    (dict(rollout_rs="token_k1"), r"rollout_rs_threshold is required when rollout_rs='token_k1'"),
    (dict(rollout_rs="token_k1,token_k2,seq_sum_k3", rollout_rs_threshold="1.5,0.1"),
     r"rollout_rs_threshold has 2 specs but rollout_rs has 3 criteria"),
    (dict(loss_type="ppo"), r"loss_type must be one of \['ppo_clip', 'reinforce'\]"),
    (dict(rollout_is_mode="clip"), r"rollout_is_mode must be None or one of \['truncate', 'mask', 'two_sided'\]"),
    (dict(rollout_is_threshold="0.5_2", rollout_is_mode="truncate"), r"rollout_is_threshold: a 'L_U' spec"),
    (dict(rollout_token_veto_threshold=0), r"rollout_token_veto_threshold must be None or a finite number > 0"),
    (dict(rollout_is_threshold=None), r"rollout_is_threshold is required when rollout_is='sequence'"),
    (dict(rollout_is_threshold="abc"), r"rollout_is_threshold: cannot parse 'abc'"),
    (dict(rollout_is_threshold=True), r"rollout_is_threshold must be a number"),
    (dict(bypass_mode="yes"), r"bypass_mode must be a bool"),
    (dict(rollout_rs=" , "), r"rollout_rs must name at least one criterion"),
])
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cfg(**kwargs)


@pytest.mark.parametrize("fields", [dict(rollout_is_threshold=0), dict(rollout_is_threshold="1.5_1.0"),
                                    dict(rollout_is_mode="mask", rollout_is_threshold=0.8),
                                    dict(rollout_is_threshold=None)])
def test_is_threshold_is_judged_only_when_is_is_on(fields):
    """verl's helper never reads the IS threshold fields with rollout_is=None, so a config that switches IS off
    but keeps (say) a threshold of 0 runs there; it must here too. With IS on the same fields are errors."""
    assert Cfg(rollout_is=None, **fields).is_spec is None
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        Cfg(rollout_is="token", **fields)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown RolloutCorrectionConfig field\(s\) \['rollout_is_level'\]"):
        Cfg.from_dict({"rollout_is_level": "token"})
    assert Cfg.from_dict(None) == Cfg.disabled()


def test_from_legacy_flat_keys():
    with pytest.warns(UserWarning) as rec:
        c = Cfg.from_legacy(dict(rollout_is=False, rollout_is_threshold=2.0, rollout_is_threshold_lower=None,
                                 rollout_is_level="geometric", rollout_is_mode="mask",
                                 rollout_is_veto_threshold=1e-4))
    messages = " | ".join(str(w.message) for w in rec)
    assert "rollout_is=False" in messages and "has no config equivalent" in messages and "veto" in messages
    assert (c.rollout_is, c.rollout_is_mode, c.rollout_token_veto_threshold) == ("geometric", "mask", 1e-4)
    assert c.is_spec.lower == 0.5
    with pytest.warns(UserWarning, match="removes the sequence from response_mask"):
        c = Cfg.from_legacy(dict(rollout_is=True, rollout_is_threshold=3.0, rollout_is_level="token"))
    assert (c.rollout_is, c.rollout_is_threshold, c.is_spec.mode) == ("token", 3.0, "truncate")
    with pytest.warns(UserWarning, match="switched the whole legacy feature off"):
        c = Cfg.from_legacy(dict(rollout_is=True, rollout_is_threshold=None, rollout_is_level="token"))
    assert c.rollout_is is None and c.rollout_token_veto_threshold is None
    with pytest.warns(UserWarning, match="fell back to rollout_is_threshold"):
        c = Cfg.from_legacy(dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence",
                                 rollout_rs_threshold=None, rollout_rs_threshold_lower=None,
                                 rollout_token_veto_threshold=None, bypass_old_logprob_for_rollout=True,
                                 use_pure_rollout_correction=True))
    assert (c.rollout_rs_threshold, c.bypass_mode, c.loss_type) == (2.0, True, "reinforce")
    assert Cfg.from_legacy(Cfg.decoupled_geo_rs().to_dict()) == Cfg.decoupled_geo_rs()
    with pytest.raises(ValueError, match="from_legacy: unknown key 'tis_cap'"):
        Cfg.from_legacy(dict(tis_cap=2.0))


# ----------------------------------------------------------------------------------------- immutability (issue 8 §6)

_FIELD_VALUES = dict(rollout_is="token", rollout_is_threshold=1.05, rollout_is_mode="mask",
                     rollout_is_threshold_lower=0.5, rollout_is_batch_normalize=True, rollout_rs="token_k1",
                     rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.5, rollout_token_veto_threshold=0.1,
                     bypass_mode=True, loss_type="reinforce")


@pytest.mark.parametrize("field", sorted(_FIELD_VALUES))
def test_config_is_frozen(field):
    cfg = Cfg.decoupled_seq_is_rs()
    before = (cfg.to_dict(), cfg.is_spec, cfg.rs_criteria)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, _FIELD_VALUES[field])
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, "bogus")
    assert (cfg.to_dict(), cfg.is_spec, cfg.rs_criteria) == before


def test_policy_loss_config_is_frozen():
    from rollout_corr_ext.losses import PolicyLossConfig

    cfg = PolicyLossConfig(rollout_correction=Cfg.decoupled_token_is())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_ratio = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout_correction.rollout_is_threshold = 1.05


def test_replace_revalidates_and_changes_what_the_op_applies():
    from rollout_corr_ext import compute_rollout_correction
    from rollout_corr_testing.rc_testutil import make_inputs

    cfg = Cfg.decoupled_token_is(threshold=2.0)
    tight = dataclasses.replace(cfg, rollout_is_threshold=1.05)
    assert cfg.is_spec.upper == 2.0 and tight.is_spec.upper == 1.05 and tight.to_dict()["rollout_is_threshold"] == 1.05
    lp, rlp, mask = make_inputs(6, 32, seed=7, scale=0.3)
    w = compute_rollout_correction(lp, rlp, mask, tight).weights
    assert float(w[mask].max()) == pytest.approx(1.05) and float(w[mask].max()) <= 1.05 + 1e-6
    assert float(compute_rollout_correction(lp, rlp, mask, cfg).weights[mask].max()) > 1.05
    with_rs = dataclasses.replace(cfg, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    assert [c.name for c in with_rs.rs_criteria] == ["token_k1"] and cfg.rs_criteria == []
    with pytest.raises(ValueError, match=r"rollout_is must be None or one of"):
        dataclasses.replace(cfg, rollout_is="bogus")
    with pytest.raises(ValueError, match=r"rollout_is_threshold must be a finite number"):
        dataclasses.replace(cfg, rollout_is_threshold=math.nan)


def test_configs_are_hashable_values():
    a, b = Cfg.decoupled_geo_rs(), Cfg.decoupled_geo_rs()
    assert a == b and hash(a) == hash(b) and len({a, b, Cfg.decoupled_k3_rs()}) == 2


# ------------------------------------------------------------------------------- non-finite thresholds (§6)

_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs,field", [
    (dict(rollout_is_threshold=_NAN), "rollout_is_threshold"),
    (dict(rollout_is_threshold=_INF), "rollout_is_threshold"),
    (dict(rollout_is_threshold=-_INF), "rollout_is_threshold"),
    (dict(rollout_is_threshold=10 ** 400), "rollout_is_threshold"),
    (dict(rollout_is_threshold="nan"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="inf"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="Infinity"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="1e400"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="nan_2"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="0.5_inf"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="-inf_2"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="0.5_1e400"), "rollout_is_threshold"),
    (dict(rollout_is_threshold=2.0, rollout_is_mode="mask", rollout_is_threshold_lower=_NAN),
     "rollout_is_threshold_lower"),
    (dict(rollout_is_threshold=2.0, rollout_is_threshold_lower=_INF), "rollout_is_threshold_lower"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=_NAN),
     "rollout_rs_threshold_lower"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=_INF),
     "rollout_rs_threshold_lower"),
    (dict(rollout_rs="token", rollout_rs_threshold=_NAN), "rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=_INF), "rollout_rs_threshold"),
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold="inf"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="nan_2"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="0.5_2,1e400"), "rollout_rs_threshold"),
    (dict(rollout_rs="geometric", rollout_rs_threshold="0.9_NaN"), "rollout_rs_threshold"),
    (dict(rollout_token_veto_threshold=_NAN), "rollout_token_veto_threshold"),
    (dict(rollout_token_veto_threshold=_INF), "rollout_token_veto_threshold"),
])
def test_nonfinite_thresholds_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        Cfg(**kwargs)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        Cfg.from_dict({**DEFAULTS, **kwargs})


@pytest.mark.parametrize("spec", ["0.5_2_3", "0.5_1_0", "1_0", "_2", "0.5_"])
def test_malformed_spec_strings_rejected(spec):
    with pytest.raises(ValueError, match=r"rollout_is_threshold"):
        Cfg(rollout_is="token", rollout_is_threshold=spec)


# ------------------------------------------------------------------------------------ round trip (§6)

_ROUND_TRIP = [getattr(Cfg, name)() for name in PRESETS] + [
    Cfg(rollout_is="token", rollout_is_threshold="0.25_4", rollout_rs="token_k1,seq_max_k3,geometric",
        rollout_rs_threshold="0.8_1.25,0.05,0.999_1.001", rollout_token_veto_threshold=1e-3,
        rollout_is_batch_normalize=True),
    Cfg(rollout_is="geometric", rollout_is_threshold=1.5, rollout_is_mode="mask", rollout_is_threshold_lower=0.7,
        rollout_rs="sequence", rollout_rs_threshold=3, rollout_rs_threshold_lower=0),
    dataclasses.replace(Cfg.decoupled_token_is(), rollout_is_threshold=1.05),
]


@pytest.mark.parametrize("i", range(len(_ROUND_TRIP)))
def test_dict_round_trip_is_exactly_what_the_op_applies(i):
    import torch

    from rollout_corr_ext import compute_rollout_correction
    from rollout_corr_ext.correction import config_fingerprint, op_args
    from rollout_corr_testing.rc_testutil import make_inputs

    cfg = _ROUND_TRIP[i]
    for back in (Cfg.from_dict(cfg.to_dict()), Cfg.from_dict(json.loads(json.dumps(cfg.to_dict())))):
        assert back == cfg and back.to_dict() == cfg.to_dict()
        assert (back.is_spec, back.rs_criteria) == (cfg.is_spec, cfg.rs_criteria)
        assert op_args(back) == op_args(cfg) and config_fingerprint(back) == config_fingerprint(cfg)
        lp, rlp, mask = make_inputs(8, 24, seed=i, scale=0.1)
        a, b = compute_rollout_correction(lp, rlp, mask, cfg), compute_rollout_correction(lp, rlp, mask, back)
        assert (a.weights is None) == (b.weights is None)
        if a.weights is not None:
            assert torch.equal(a.weights, b.weights)
        assert torch.equal(a.response_mask, b.response_mask)
        assert a.metrics.keys() == b.metrics.keys()
        assert all(torch.equal(a.metrics[k], b.metrics[k]) or (a.metrics[k].isnan() and b.metrics[k].isnan())
                   for k in a.metrics)


def test_an_is_threshold_whose_reciprocal_overflows_is_refused_naming_it():
    """rollout_is_threshold=1e-320 was accepted, its default lower bound 1 / U = inf, and the kernel refused the call
    with "is_metric_lower must be finite" (the config fuzz): refused when built, naming the field."""
    import pytest as _pytest

    from rollout_corr_ext import RolloutCorrectionConfig

    with _pytest.raises(ValueError, match=r"rollout_is_threshold: 1e-320 is too small, its reciprocal"):
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e-320)
    with _pytest.raises(ValueError, match=r"rollout_is_threshold: 1e-320 is too small"):
        RolloutCorrectionConfig.decoupled_seq_is(1e-320)


def test_ratio_bounds_outside_fp32s_range_are_refused_naming_them():
    """The kernels compare, clamp and square ratio-space bounds in fp32 below fp64 inputs: rollout_is_threshold
    1e-300 (0 in fp32) made every IS weight 0, an RS bound of 3.5e38 (inf) gave a NaN rollout_rs_token_std and the
    fallback a raw overflow error, 1e38 an inf one (its square) (the knob fuzz). Each is named; k1's log-space
    bounds and a ratio lower bound of 0 stay accepted, and so do bounds at the range's ends."""
    import pytest as _pytest
    import torch

    from rollout_corr_ext import RolloutCorrectionConfig, compute_rollout_correction
    from rollout_corr_ext.config import RATIO_BOUND_RANGE

    lo, hi = RATIO_BOUND_RANGE
    bad = [(dict(rollout_is="token", rollout_is_threshold=1e-300), r"rollout_is_threshold: 1e-300 is outside"),
           (dict(rollout_is="token", rollout_is_threshold=3.5e38), r"rollout_is_threshold: 3.5e\+38 is outside"),
           (dict(rollout_is="token", rollout_is_threshold="1e-40_2"), r"rollout_is_threshold: 1e-40 is outside"),
           (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="two_sided",
                 rollout_is_threshold_lower=1e-300), r"rollout_is_threshold_lower: 1e-300 is outside"),
           (dict(rollout_is=None, rollout_rs="token", rollout_rs_threshold="3.5e38_3.5e38"),
            r"rollout_rs_threshold \(criterion 'token'\): 3.5e\+38 is outside"),
           (dict(rollout_is=None, rollout_rs="token", rollout_rs_threshold="1e38_1e38"), r"1e\+38 is outside"),
           (dict(rollout_is=None, rollout_rs="seq_max_k2", rollout_rs_threshold=1e20), r"1e\+20 is outside"),
           (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=1e-300),
            r"rollout_token_veto_threshold: 1e-300 is outside")]
    for kw, match in bad:
        with _pytest.raises(ValueError, match=match):
            RolloutCorrectionConfig(**kw)
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for kw in (dict(rollout_is="token", rollout_is_threshold=hi), dict(rollout_is="token", rollout_is_threshold=lo),
               dict(rollout_is=None, rollout_rs="token", rollout_rs_threshold=f"{lo!r}_{hi!r}"),
               dict(rollout_is=None, rollout_rs="token", rollout_rs_threshold=f"{hi!r}_{hi!r}"),
               dict(rollout_is=None, rollout_rs="token", rollout_rs_threshold="0_2"),
               dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="1e-300_1e300")):
        res = compute_rollout_correction(lp, lp - 0.1, mask, RolloutCorrectionConfig(**kw))
        assert all(bool(torch.isfinite(v).all()) for v in res.metrics.values()), kw
