"""``rollout_corr_ext.verl`` against verl 0.9.1's real functions (the installed wheel, not a stub).

Every adapter function is called next to its verl namesake on the same inputs and every output is compared:
signatures (names, order, kinds, defaults), IS weights (dtype and values), masks (dtype and values, exactly), metric
dicts (the same keys in the same order, Python floats, values within rel 2e-5 / abs 2e-6 in fp32, 1e-9 in fp64),
losses and the gradients of both through ``backward``. Configs: verl's own objects (``RolloutCorrectionConfig``
with all 19 presets, ``ActorConfig`` with ``_target_``, ``ppo_mini_batch_size``, ``global_batch_info``, ...), their
OmegaConf form and plain dicts.

Inputs sit on a 2^-12 grid (``rc_testutil.make_inputs``), so log-ratios and row sums are exact and no threshold
decision can flip between verl's eager fp32 math and the kernels. Padding holds finite junk where verl's weights
are compared (verl's token weights are raw * mask: NaN junk gives NaN there, a documented difference with its own
test).

verl not importable (or another version): the tests FAIL when CI=true, and are skipped with the reason otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    import rollout_corr_ext
    import rollout_corr_ext.verl as rv

from rollout_corr_ext import PolicyLossConfig, RolloutCorrectionConfig, compute_rollout_correction
from rollout_corr_ext.config import PRESETS
from rollout_corr_testing.dist_utils import dist_params, run_workers
from rollout_corr_testing.rc_testutil import make_inputs
from rollout_corr_testing.skips import skip_unless_ci
from rollout_corr_testing.tolerances import VERL_TOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERL_PRESETS = PRESETS[:19]
TOL = VERL_TOL


# --------------------------------------------------------------------------------------------------- verl


class _Verl:
    def __init__(self):
        import verl
        import verl.trainer.ppo.core_algos as core_algos
        import verl.trainer.ppo.rollout_corr_helper as helper
        from verl.protocol import DataProto
        from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlRCConfig
        from verl.workers.config.actor import ActorConfig
        from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig

        self.version = getattr(verl, "__version__", None)
        self.helper, self.core = helper, core_algos
        self.DataProto, self.RCConfig, self.ActorConfig, self.PLConfig = (DataProto, VerlRCConfig, ActorConfig,
                                                                           VerlPolicyLossConfig)

    def actor(self, rc=None, loss_mode="vanilla", **kw):
        """verl's ActorConfig, as its trainer builds one (strategy, rollout_n, micro batch size are required)."""
        fields = dict(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4)
        fields.update(kw)
        policy_loss = self.PLConfig(loss_mode=loss_mode, **({} if rc is None else {"rollout_correction": rc}))
        return self.ActorConfig(policy_loss=policy_loss, **fields)


@pytest.fixture(scope="module")
def V():
    """verl 0.9.1's modules. Missing or another version: FAIL under CI=true, skip otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = _Verl()
    except Exception as exc:  # noqa: BLE001 - any import failure means "verl is not usable here"
        v, msg = None, f"verl {rv.VERL_VERSION} cannot be imported: {exc!r}"
    else:
        msg = None if v.version == rv.VERL_VERSION else f"the adapter follows verl {rv.VERL_VERSION}; installed " \
                                                         f"verl is {v.version}"
    if msg:
        skip_unless_ci(msg)
    return v


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------------------------------- compare


def up(x):
    """A floating tensor in fp64 (the same values: the inputs are exact in fp32); anything else as is."""
    return x.to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def assert_metrics(ours, theirs, ref=None, dtype=torch.float32):
    """Same keys in the same order, Python floats, equal values.

    ``ref``: verl's metrics on the fp64 copies of the same inputs. verl's fp32 evaluation carries its own rounding,
    most visibly the cancellation of E[x^2] - E[x]^2 in ``*_std`` when the spread is small (a relative error of
    1e-3 at std ~ 2e-3). Values are then held to ``ref`` at the fp32 tolerance, and to verl's fp32 result within
    verl's own fp32 error (|ours - verl32| <= |verl64 - verl32| + tolerance)."""
    assert list(ours) == list(theirs), (f"keys differ: only ours {sorted(set(ours) - set(theirs))}, only verl "
                                        f"{sorted(set(theirs) - set(ours))}, or order {list(ours)} vs {list(theirs)}")
    assert all(type(v) is float for v in ours.values()), {k: type(v) for k, v in ours.items()}
    tol = TOL[dtype]
    if ref is None:
        bad = [f"{k}: ours {ours[k]!r} verl {v!r}" for k, v in theirs.items() if not math.isclose(ours[k], v, **tol)]
    else:
        assert list(ref) == list(theirs)
        bad = [f"{k}: ours {ours[k]!r} verl fp64 {ref[k]!r} verl {v!r}" for k, v in theirs.items()
               if not math.isclose(ours[k], ref[k], **tol)
               or abs(ours[k] - v) > abs(ref[k] - v) + max(tol["rel_tol"] * abs(ref[k]), tol["abs_tol"])]
    assert not bad, "\n".join(bad)


def assert_weights(ours, theirs):
    if theirs is None:
        assert ours is None
        return
    assert ours is not None and ours.dtype == theirs.dtype and ours.shape == theirs.shape
    tol = TOL[theirs.dtype] if theirs.dtype in TOL else TOL[torch.float32]
    torch.testing.assert_close(ours, theirs, rtol=tol["rel_tol"], atol=tol["abs_tol"])


def assert_mask(ours, theirs):
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), f"masks differ at {torch.nonzero(ours != theirs).tolist()[:10]}"


def inputs(b=12, t=40, seed=0, scale=0.2, dtype=torch.float32, mask_dtype=torch.float32, pad_rows=(5,)):
    """(log_prob, rollout_log_prob, mask): grid log-probs, finite junk (0) at padding."""
    lp, rlp, mask = make_inputs(b, t, seed=seed, scale=scale, pad_rows=pad_rows, dtype=torch.float64)
    lp = torch.where(mask, lp, torch.zeros_like(lp))
    return lp.to(dtype), rlp.to(dtype), mask.to(mask_dtype)


def mix_rows(lp, rlp):
    """Even rows' log-ratios scaled by 2^-8 (still exact: a 2^-20 grid): near-on-policy rows next to off-policy
    ones, so tight RS bounds (verl's geometric 0.999_1.001, k3 0.01) keep some rows and reject others, and the IS
    weights keep a spread for which the fp32 std is well conditioned."""
    lr = lp - rlp
    lr[::2] = lr[::2] * 2.0 ** -8
    return rlp + lr


def loss_inputs(b=10, t=24, seed=0, dtype=torch.float32, mask_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = 2.0 ** -12
    old = torch.round(-torch.rand(b, t, generator=g) * 3 / q) * q
    lp = old + torch.round(torch.randn(b, t, generator=g) * 0.3 / q) * q
    adv = torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    mask[2] = False  # a padding-only row
    return old.to(dtype), lp.to(dtype), adv.to(dtype), mask.to(mask_dtype)


def run_loss(fn, args, kwargs=None):
    """``fn(*args)`` with args[1] (log_prob) a fresh leaf; returns (loss, metrics, d loss / d log_prob)."""
    args = list(args)
    lp = args[1].detach().clone().requires_grad_(True)
    args[1] = lp
    loss, metrics = fn(*args, **(kwargs or {}))
    loss.backward()
    return loss.detach(), metrics, lp.grad


def assert_loss(ours, theirs, ref, dtype=torch.float32):
    """``ours`` / ``theirs`` / ``ref``: (loss, metrics, grad) of ours, of verl on the same inputs and of verl on their
    fp64 copies: loss and gradient against verl's, metrics as :func:`assert_metrics`."""
    (l1, m1, g1), (l2, m2, g2) = ours, theirs
    assert l1.shape == l2.shape == torch.Size([]) and l1.dtype == l2.dtype and g1.dtype == g2.dtype
    tol = TOL[dtype]
    assert math.isclose(l1.item(), ref[0].item(), **tol), (l1.item(), l2.item(), ref[0].item())
    assert math.isclose(l1.item(), l2.item(), **tol), (l1.item(), l2.item())
    assert_metrics(m1, m2, ref[1], dtype)
    torch.testing.assert_close(g1, g2, rtol=tol["rel_tol"], atol=1e-7 if dtype == torch.float32 else 1e-12)


def verl_loss(fn, args):
    """verl's loss on ``args`` and on their fp64 copies (actor configs are shared)."""
    return run_loss(fn, args), run_loss(fn, [up(a) for a in args])


# --------------------------------------------------------------------------------------------------- signatures

HELPER_FNS = ("compute_rollout_correction_and_rejection_mask", "compute_rollout_correction_and_add_to_batch",
              "compute_rollout_correction_weights", "compute_rollout_rejection_mask", "compute_offpolicy_metrics",
              "compute_rollout_corr_metrics_from_logprobs", "apply_bypass_mode")
CORE_FNS = ("agg_loss", "compute_policy_loss", "compute_policy_loss_vanilla", "compute_policy_loss_reinforce",
            "compute_policy_loss_bypass_mode") + tuple(
    "compute_policy_loss_" + n for n in ("dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
                                         "dro", "cispo"))


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", HELPER_FNS + CORE_FNS)
def test_signature_equals_verl(V, name):
    module = V.helper if name in HELPER_FNS else V.core
    assert _params(getattr(rv, name)) == _params(getattr(module, name))


def test_signature_of_the_extended_functions_extends_verls(V):
    """kl_penalty: verl's parameters, then old_log_prob=None (the IS correction); calculate_debug_metrics: verl's."""
    import verl.utils.debug.metrics as debug

    assert _params(rv.kl_penalty)[:3] == _params(V.core.kl_penalty)
    assert _params(rv.kl_penalty)[3:] == [("old_log_prob", inspect.Parameter.POSITIONAL_OR_KEYWORD, None)]
    assert _params(rv.calculate_debug_metrics) == _params(debug.calculate_debug_metrics)


def test_constants_equal_verl(V):
    assert rv.SAFETY_BOUND == V.helper.SAFETY_BOUND
    assert set(rv.SUPPORTED_ROLLOUT_RS_OPTIONS) == set(V.helper.SUPPORTED_ROLLOUT_RS_OPTIONS)


def test_agg_loss_of_the_package_takes_verl_positional_order():
    assert _params(rollout_corr_ext.agg_loss)[:7] == _params(rv.agg_loss)[:7]
    x, m = torch.arange(15.0).reshape(3, 5), torch.ones(3, 5)
    assert rollout_corr_ext.agg_loss(x, m, "token-mean", 2, 30.0).item() == pytest.approx(105.0 / 30 * 2)
    assert rollout_corr_ext.agg_loss(x, m, "seq-mean-token-sum-norm", 1, None, None, 7.0).item() == pytest.approx(
        105.0 / 3 / 7)


# --------------------------------------------------------------------------------------------------- the helper

HELPER_CASES = [
    ("disabled", dict(), 0.2),
    ("token_tis", dict(rollout_is="token", rollout_is_threshold=1.5), 0.3),
    ("token_tis_str", dict(rollout_is="token", rollout_is_threshold="1.5"), 0.3),
    ("seq_tis", dict(rollout_is="sequence", rollout_is_threshold=1.5), 0.1),
    ("token_icepop_norm", dict(rollout_is="token", rollout_is_threshold="0.6_1.6", rollout_is_batch_normalize=True),
     0.3),
    ("seq_icepop_norm", dict(rollout_is="sequence", rollout_is_threshold="0.6_1.6", rollout_is_batch_normalize=True),
     0.1),
    ("is_without_threshold_is_off", dict(rollout_is="token", rollout_is_threshold=None), 0.2),
    ("rs_token_k123", dict(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="0.75_1.3,0.0311,0.0251"),
     0.2),
    ("rs_all_eleven", dict(rollout_rs="token_k1,token_k2,token_k3,seq_sum_k1,seq_sum_k2,seq_sum_k3,seq_mean_k1,"
                                      "seq_mean_k2,seq_mean_k3,seq_max_k2,seq_max_k3",
                           rollout_rs_threshold="0.75_1.3,0.0311,0.0311,0.45_2.3,0.53,0.53,0.93_1.07,0.0213,0.0213,"
                                                "0.15,0.15"), 0.2),
    ("rs_k1_numeric_dupes", dict(rollout_rs="seq_mean_k1, seq_mean_k1,token_k1", rollout_rs_threshold=1.07), 0.2),
    ("token_tis_rs", dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_sum_k1,seq_mean_k3",
                          rollout_rs_threshold="0.45_2.3,0.0213"), 0.2),
    ("seq_icepop_rs_norm", dict(rollout_is="sequence", rollout_is_threshold="0.6_1.6", rollout_is_batch_normalize=True,
                                rollout_rs="seq_max_k2,seq_max_k3", rollout_rs_threshold="0.02,0.021"), 0.1),
]


@pytest.mark.parametrize("case", HELPER_CASES, ids=[c[0] for c in HELPER_CASES])
def test_correction_and_rejection_mask(V, case):
    _, kw, scale = case
    lp, rlp, mask = inputs(scale=scale, seed=len(kw))
    theirs = V.helper.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
    ref = V.helper.compute_rollout_correction_and_rejection_mask(up(lp), up(rlp), mask, **kw)[2]
    ours = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
    if theirs[0] is None:
        assert ours[0] is None
    else:
        assert isinstance(ours[0], V.DataProto) and list(ours[0].batch.keys()) == ["rollout_is_weights"]
        assert_weights(ours[0].batch["rollout_is_weights"], theirs[0].batch["rollout_is_weights"])
    assert_mask(ours[1], theirs[1])
    assert_metrics(ours[2], theirs[2], ref)
    if "rollout_rs" in kw:  # the case is informative
        assert 0.0 < theirs[2]["rollout_corr/rollout_rs_masked_fraction"] < 1.0


@pytest.mark.parametrize("dtype,mask_dtype", [(torch.float64, torch.float64), (torch.float32, torch.bool),
                                              (torch.float64, torch.int64), (torch.float32, torch.float64)])
def test_correction_dtypes(V, dtype, mask_dtype):
    """Weights in verl's dtype (log-prob dtype promoted with the mask's), the mask in its own dtype."""
    kw = dict(rollout_is="token", rollout_is_threshold="0.6_1.6", rollout_rs="seq_mean_k1,token_k2",
              rollout_rs_threshold="0.93_1.07,0.0311")
    lp, rlp, mask = inputs(scale=0.2, dtype=dtype, mask_dtype=mask_dtype)
    theirs = V.helper.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
    ref = V.helper.compute_rollout_correction_and_rejection_mask(up(lp), up(rlp), mask, **kw)[2]
    ours = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
    assert_weights(ours[0].batch["rollout_is_weights"], theirs[0].batch["rollout_is_weights"])
    assert_mask(ours[1], theirs[1])
    assert_metrics(ours[2], theirs[2], ref, dtype=dtype)


def test_bf16_inputs_are_computed_in_fp32(V):
    """Documented difference: verl does its arithmetic in the input dtype (bf16 log-ratios, exp, means); the kernels
    read bf16 and compute in fp32. So ours equals verl on fp32 copies of the same bf16 values; the weights come
    back in verl's dtype (bf16)."""
    kw = dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_rs="token_k1", rollout_rs_threshold="0.75_1.3")
    lp, rlp, mask = inputs(scale=0.1, mask_dtype=torch.bool)  # (a float32 mask would promote verl's weights)
    lp16, rlp16 = lp.to(torch.bfloat16), rlp.to(torch.bfloat16)
    ours = rv.compute_rollout_correction_and_rejection_mask(lp16, rlp16, mask, **kw)
    want = V.helper.compute_rollout_correction_and_rejection_mask(lp16.float(), rlp16.float(), mask, **kw)
    w = ours[0].batch["rollout_is_weights"]
    assert w.dtype == V.helper.compute_rollout_correction_and_rejection_mask(
        lp16, rlp16, mask, **kw)[0].batch["rollout_is_weights"].dtype == torch.bfloat16
    torch.testing.assert_close(w, want[0].batch["rollout_is_weights"].to(torch.bfloat16), rtol=0, atol=0)
    assert_mask(ours[1], want[1])
    assert_metrics(ours[2], want[2],
                   V.helper.compute_rollout_correction_and_rejection_mask(up(lp16), up(rlp16), mask, **kw)[2])


@pytest.mark.parametrize("preset", VERL_PRESETS)
def test_add_to_batch_on_verl_presets(V, preset):
    """verl's own config objects (every preset) through ``compute_rollout_correction_and_add_to_batch``."""
    lp, rlp, mask = inputs(scale=0.3, seed=VERL_PRESETS.index(preset))
    lp = mix_rows(lp, rlp)
    cfg = getattr(V.RCConfig, preset)()

    def batch():
        return V.DataProto.from_dict(tensors={"old_log_probs": lp.clone(), "rollout_log_probs": rlp.clone(),
                                              "response_mask": mask.clone()})

    b_theirs, m_theirs = V.helper.compute_rollout_correction_and_add_to_batch(batch(), cfg)
    fields = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")
    ref = V.helper.compute_rollout_correction_and_rejection_mask(up(lp), up(rlp), mask,
                                                                 **{k: cfg[k] for k in fields})[2]
    b_ours, m_ours = rv.compute_rollout_correction_and_add_to_batch(batch(), cfg)
    assert sorted(b_ours.batch.keys()) == sorted(b_theirs.batch.keys())
    assert_mask(b_ours.batch["response_mask"], b_theirs.batch["response_mask"])
    if "rollout_is_weights" in b_theirs.batch.keys():
        assert_weights(b_ours.batch["rollout_is_weights"], b_theirs.batch["rollout_is_weights"])
    assert_metrics(m_ours, m_theirs, ref)
    if cfg.rollout_rs is not None:  # the case is informative
        assert 0.0 < m_theirs["rollout_corr/rollout_rs_seq_masked_fraction"] < 1.0
    # the same config as OmegaConf / a plain dict (verl's .get defaults for absent keys) and as our own preset
    from omegaconf import OmegaConf

    plain = {k: cfg[k] for k in cfg}
    for alt in (OmegaConf.create(plain), plain, getattr(RolloutCorrectionConfig, preset)()):
        _, m_alt = rv.compute_rollout_correction_and_add_to_batch(batch(), alt)
        assert_metrics(m_alt, m_theirs, ref)
    partial = {k: v for k, v in plain.items() if k != "rollout_is"}  # verl: .get("rollout_is", None) -> no IS
    b1, m1 = V.helper.compute_rollout_correction_and_add_to_batch(batch(), partial)
    b2, m2 = rv.compute_rollout_correction_and_add_to_batch(batch(), partial)
    assert "rollout_is_weights" not in b1.batch.keys() and "rollout_is_weights" not in b2.batch.keys()
    assert_mask(b2.batch["response_mask"], b1.batch["response_mask"])
    assert list(m2) == list(m1)


@pytest.mark.parametrize("kw", [dict(rollout_is="token", rollout_is_threshold=1.5),
                                dict(rollout_is="sequence", rollout_is_threshold="0.6_1.6",
                                     rollout_is_batch_normalize=True),
                                dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)],
                         ids=["token_tis", "seq_icepop_norm", "token_tis_norm"])
def test_correction_weights(V, kw):
    lp, rlp, mask = inputs(scale=0.1 if kw["rollout_is"] == "sequence" else 0.3)
    log_ratio = lp - rlp
    w_theirs, m_theirs = V.helper.compute_rollout_correction_weights(log_ratio, mask, **kw)
    ref = V.helper.compute_rollout_correction_weights(up(log_ratio), mask, **kw)[1]
    w_ours, m_ours = rv.compute_rollout_correction_weights(log_ratio, mask, **kw)
    assert_weights(w_ours, w_theirs)
    assert_metrics(m_ours, m_theirs, ref)


@pytest.mark.parametrize("kw", [dict(rollout_rs="token_k1", rollout_rs_threshold="0.75_1.3"),
                                dict(rollout_rs="seq_sum_k2,seq_max_k3,seq_mean_k1",
                                     rollout_rs_threshold="0.53,0.15,0.93_1.07")], ids=["token_k1", "three"])
def test_rejection_mask(V, kw):
    lp, rlp, mask = inputs(scale=0.2)
    log_ratio = lp - rlp
    mask_theirs, m_theirs = V.helper.compute_rollout_rejection_mask(log_ratio, mask, **kw)
    ref = V.helper.compute_rollout_rejection_mask(up(log_ratio), mask, **kw)[1]
    mask_ours, m_ours = rv.compute_rollout_rejection_mask(log_ratio, mask, **kw)
    assert_mask(mask_ours, mask_theirs)
    assert_metrics(m_ours, m_theirs, ref)
    empty = torch.zeros(0, 5)
    assert rv.compute_rollout_rejection_mask(empty, empty, **kw)[1] == {}  # verl's shortcut for an empty batch
    # ... which returned any mask as it came: one of another shape is refused by name
    with pytest.raises(ValueError, match="response_mask must have the shape of log_ratio"):
        rv.compute_rollout_rejection_mask(empty, mask, **kw)


def test_offpolicy_metrics(V):
    lp, rlp, mask = inputs(scale=0.2, seed=4)
    for ours, fn, second in ((rv.compute_offpolicy_metrics, V.helper.compute_offpolicy_metrics, rlp),
                             (rv.compute_offpolicy_metrics, V.helper.compute_offpolicy_metrics, None),
                             (rv.compute_rollout_corr_metrics_from_logprobs,
                              V.helper.compute_rollout_corr_metrics_from_logprobs, rlp)):
        assert_metrics(ours(lp, second, mask), fn(lp, second, mask), fn(up(lp), up(second), mask))


def test_apply_bypass_mode(V):
    from omegaconf import OmegaConf

    lp, rlp, mask = inputs()
    rc = V.RCConfig.bypass_pg_is()
    outs = []
    for fn in (V.helper.apply_bypass_mode, rv.apply_bypass_mode):
        batch = V.DataProto.from_dict(tensors={"old_log_probs": lp.clone(), "rollout_log_probs": rlp.clone(),
                                               "response_mask": mask.clone()})
        pl = OmegaConf.create({"loss_mode": "vanilla", "ppo_kl_coef": 0.1})
        OmegaConf.set_struct(pl, True)
        assert fn(batch, rc, pl) is None
        outs.append((batch.batch["old_log_probs"], pl.loss_mode, pl.rollout_correction))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1:] == outs[1][1:]
    with pytest.raises(ValueError, match="rollout_log_probs"):
        rv.apply_bypass_mode(V.DataProto.from_dict(tensors={"response_mask": mask}), rc, {})


def test_nan_padding_is_zero_weight_not_nan(V):
    """Documented difference: junk at padding. verl's token weights are raw * mask (NaN there); ours are 0. The
    mask and every metric agree."""
    lp, rlp, mask = inputs(scale=0.3)
    lp = torch.where(mask.bool(), lp, torch.full_like(lp, float("nan")))
    kw = dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1", rollout_rs_threshold="0.75_1.3")
    theirs = V.helper.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
    ours = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
    w_t, w_o = theirs[0].batch["rollout_is_weights"], ours[0].batch["rollout_is_weights"]
    valid = mask.bool()
    assert bool(torch.isnan(w_t[~valid]).all()) and bool((w_o[~valid] == 0).all())
    assert_weights(w_o[valid], w_t[valid])
    assert_mask(ours[1], theirs[1])
    assert_metrics(ours[2], theirs[2], V.helper.compute_rollout_correction_and_rejection_mask(up(lp), up(rlp), mask,
                                                                                             **kw)[2])


def test_no_valid_token_is_an_error(V):
    lp, rlp, mask = inputs()
    empty = torch.zeros_like(mask)
    for fn in (V.helper.compute_rollout_correction_and_rejection_mask,
               rv.compute_rollout_correction_and_rejection_mask):
        with pytest.raises(ValueError, match="valid token"):
            fn(lp, rlp, empty, rollout_is="token")
    with pytest.raises(ValueError, match="valid token"):  # verl: an AssertionError here (documented)
        rv.compute_offpolicy_metrics(lp, rlp, empty)


def test_batch_norm_under_torch_distributed(V, monkeypatch):
    """verl normalises the weights over the default process group when torch.distributed is initialised; so does
    the adapter (dp_group=WORLD) unless configure() names the groups. One gloo rank: the values must agree."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip(reason="a process group is already initialised in this process (this test installs its own)")
    seen = []
    real = rv.compute_rollout_correction
    monkeypatch.setattr(rv, "compute_rollout_correction",
                        lambda *a, **k: seen.append(k["dp_group"]) or real(*a, **k))
    lp, rlp, mask = inputs(scale=0.2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for kw in (dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
                   dict(rollout_is="sequence", rollout_is_threshold="0.6_1.6", rollout_is_batch_normalize=True),
                   dict(rollout_is="token", rollout_is_threshold=1.5)):
            theirs = V.helper.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
            ours = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)
            assert_weights(ours[0].batch["rollout_is_weights"], theirs[0].batch["rollout_is_weights"])
            assert_metrics(ours[2], theirs[2])
        assert seen == [dist.group.WORLD, dist.group.WORLD, None]
    finally:
        dist.destroy_process_group()


def test_helpers_errors_name_their_own_arguments(V):
    """Each helper's errors name its own arguments: log_ratio in the log-ratio helpers, old_log_prob where verl's
    function takes it, log_prob in compute_rollout_corr_metrics_from_logprobs, the batch's keys in
    compute_rollout_correction_and_add_to_batch (they said log_prob, an argument none of them takes)."""
    lp, rlp, mask = inputs()
    lr1 = (lp - rlp)[0]
    nan = lp.clone()
    nan[0, 1] = math.nan
    cases = [
        (lambda: rv.compute_rollout_correction_weights(lr1, mask[0]), r"^log_ratio must be 2-D"),
        (lambda: rv.compute_rollout_rejection_mask((lp - rlp).long(), mask, "token_k1", 2.0),
         r"^log_ratio must be a float16"),
        (lambda: rv.compute_rollout_correction_weights(nan - rlp, mask), r"^log_ratio hold NaN"),
        (lambda: rv.compute_rollout_rejection_mask(lp - rlp, mask[:, :-1], "token_k1", 2.0),
         r"does not match log_ratio shape"),
        (lambda: rv.compute_rollout_correction_and_rejection_mask(lp[0], rlp[0], mask[0], rollout_is="token"),
         r"^old_log_prob must be 2-D"),
        (lambda: rv.compute_rollout_correction_and_rejection_mask(nan, rlp, mask, rollout_is="token"),
         r"^old_log_prob / rollout_log_prob hold NaN"),
        (lambda: rv.compute_offpolicy_metrics(nan, None, mask), r"^old_log_prob hold NaN"),
        (lambda: rv.compute_offpolicy_metrics(lp, rlp, mask[:, :-1]), r"does not match old_log_prob shape"),
        (lambda: rv.compute_rollout_corr_metrics_from_logprobs(lp[0], rlp[0], mask[0]), r"^log_prob must be 2-D"),
    ]
    for call, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            call()
    batch = V.DataProto.from_dict(tensors={"old_log_probs": nan, "rollout_log_probs": rlp, "response_mask": mask})
    with pytest.raises(ValueError, match=r"^batch\['old_log_probs'\] / batch\['rollout_log_probs'\] hold NaN"):
        rv.compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(rollout_is="token"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_float16_weights_past_its_range_are_refused(V, level):
    """float16 log-probs (and a bool mask): the weights are float16, as verl's. A TIS threshold past 65504 whose
    clamp a ratio reaches gave an inf weight, silently (verl raises there); it is refused, naming the weights and
    the threshold. Below the range the weights are verl's."""
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float16)
    roll = torch.tensor([[-16.0, -2.0]], dtype=torch.float16)  # log-ratio 15: a ratio of 3.3e6
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"rollout_is_weights: a weight of 1e\+06 is past float16's range.*"
                                         r"rollout_is_threshold"):
        rv.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is=level, rollout_is_threshold=1e6)
    with pytest.raises(ValueError, match="past float16's range"):
        rv.compute_rollout_correction_weights(old - roll, mask, level, 1e6)
    ours = rv.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is=level,
                                                            rollout_is_threshold=6e4)[0].batch["rollout_is_weights"]
    assert ours.dtype == torch.float16
    assert ours.tolist() == ([[60000.0, 1.0]] if level == "token" else [[60000.0, 60000.0]])  # the clamp, exactly
    if level == "token":  # (verl's sequence-level metrics divide by an fp16 square that overflows)
        theirs = V.helper.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is=level,
                                                                        rollout_is_threshold=6e4)[0]
        assert_weights(ours, theirs.batch["rollout_is_weights"])


def test_fractional_mask_is_an_error():
    """Documented difference: verl multiplies by a fractional mask; the package requires 0/1 and says where not."""
    lp, rlp, mask = inputs()
    mask[0, 0] = 0.5
    with pytest.raises(ValueError, match="response_mask"):
        rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, rollout_is="token")


# --------------------------------------------------------------------------------------------------- settings


def test_extra_metrics_opt_in(V):
    lp, rlp, mask = inputs(scale=0.3)
    kw = dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1", rollout_rs_threshold="0.75_1.3")
    base = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)[2]
    with rv.configured(extra_metrics=True):
        extra = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, **kw)[2]
        w_extra = rv.compute_rollout_correction_weights(lp - rlp, mask, "token", 1.5)[1]
    assert rv._SETTINGS["extra_metrics"] is False
    added = [k for k in extra if k not in base]
    assert list(extra)[:len(base)] == list(base)
    assert {f"rollout_corr/rollout_is_p{p}" for p in (5, 25, 50, 75, 95)} <= set(added)
    assert {"rollout_corr/masked_fraction", "rollout_corr/seq_masked_fraction",
            "rollout_corr/rollout_is_veto_fraction"} <= set(added)
    assert [k for k in w_extra if k.startswith("rollout_is_p")] == [f"rollout_is_p{p}" for p in (5, 25, 50, 75, 95)]
    with pytest.raises(TypeError, match="unknown setting"):
        rv.configure(dp_groups=None)


def test_groups_and_nonfinite_reach_the_op(monkeypatch):
    seen = {}
    real = rv.compute_rollout_correction

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **{**kwargs, "dp_group": None, "seq_group": None})

    monkeypatch.setattr(rv, "compute_rollout_correction", spy)
    lp, rlp, mask = inputs()
    lp[0, 0] = float("nan")
    with pytest.raises(ValueError):
        rv.compute_offpolicy_metrics(lp, rlp, mask)
    dp, seq = object(), object()
    with rv.configured(dp_group=dp, seq_group=seq, nonfinite="exclude"):
        rv.compute_offpolicy_metrics(lp, rlp, mask)
    assert seen["dp_group"] is dp and seen["seq_group"] is seq and seen["nonfinite"] == "exclude"


# --------------------------------------------------------------------------------------------------- losses

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss(V, mode):
    old, lp, adv, mask = loss_inputs()
    for extra in ((), (1,), (2, 300.0, 9.0), (1, None, None, 7.0)):
        outs = []
        for fn in (V.core.agg_loss, rv.agg_loss):
            x = (lp * adv).detach().requires_grad_(True)
            loss = fn(x, mask, mode, *extra)  # verl's positional order
            loss.backward()
            outs.append((loss.detach(), x.grad))
        assert math.isclose(outs[0][0].item(), outs[1][0].item(), rel_tol=2e-6), (extra, outs)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=2e-6, atol=1e-9)


def _actor_variants(V, **kw):
    """One actor config in verl's three forms (dataclass, DictConfig with _target_) and as a dict of our fields."""
    from omegaconf import OmegaConf

    actor = V.actor(**kw)
    info = dict(actor.global_batch_info)
    as_yaml = OmegaConf.create({"_target_": "verl.workers.config.McoreActorConfig", "strategy": "megatron",
                                "ppo_mini_batch_size": 4, "clip_ratio": actor.clip_ratio,
                                "clip_ratio_low": actor.clip_ratio_low, "clip_ratio_high": actor.clip_ratio_high,
                                "clip_ratio_c": actor.clip_ratio_c, "global_batch_info": info,
                                "loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "vanilla"}})
    ours = dict(clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low,
                clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c, **info)
    return actor, [actor, as_yaml, ours, PolicyLossConfig(**ours)]


ACTOR_CASES = [
    ("defaults", dict()),
    ("asymmetric_dual_clip", dict(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.5)),
    ("global_tokens", dict(global_batch_info={"dp_size": 4, "batch_num_tokens": 517, "global_batch_size": 37,
                                              "loss_scale_factor": None})),
    ("global_seqs_scale", dict(global_batch_info={"dp_size": 2, "batch_num_tokens": 300, "global_batch_size": 21,
                                                  "loss_scale_factor": 11})),
]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("case", ACTOR_CASES, ids=[c[0] for c in ACTOR_CASES])
def test_policy_loss_vanilla(V, case, mode):
    old, lp, adv, mask = loss_inputs(seed=len(mode))
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(1)) * 2
    actor, variants = _actor_variants(V, **case[1])
    for weights in (None, w):
        theirs, ref = verl_loss(V.core.compute_policy_loss_vanilla, (old, lp, adv, mask, mode, actor, weights))
        for cfg in variants:
            ours = run_loss(rv.compute_policy_loss_vanilla, (old, lp, adv, mask, mode, cfg, weights))
            assert_loss(ours, theirs, ref)
    # the package's own loss takes verl's actor config too (metrics stay tensors there)
    loss, met = rollout_corr_ext.compute_policy_loss_vanilla(old, lp, adv, mask, mode, actor, w)
    assert math.isclose(loss.item(), theirs[0].item(), rel_tol=2e-5) and isinstance(met["actor/ppo_kl"], torch.Tensor)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "token-mean", "seq-mean-token-mean"])
def test_policy_loss_reinforce(V, mode):
    old, lp, adv, mask = loss_inputs(seed=3, mask_dtype=torch.bool)
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(2)) * 2
    actor, variants = _actor_variants(V, global_batch_info={"dp_size": 2, "batch_num_tokens": 250,
                                                            "global_batch_size": 19})
    for weights in (None, w):
        theirs, ref = verl_loss(V.core.compute_policy_loss_reinforce, (old, lp, adv, mask, mode, actor, weights))
        for cfg in variants:
            ours = run_loss(rv.compute_policy_loss_reinforce, (old, lp, adv, mask, mode, cfg, weights))
            assert_loss(ours, theirs, ref)


BYPASS_PRESETS = [p for p in VERL_PRESETS if p.startswith("bypass_")]


@pytest.mark.parametrize("preset", BYPASS_PRESETS)
def test_policy_loss_bypass_mode(V, preset):
    """verl's bypass loss on its bypass presets, config as verl's apply_bypass_mode leaves it."""
    old, lp, adv, mask = loss_inputs(seed=BYPASS_PRESETS.index(preset))
    lp = mix_rows(lp, old)
    rc = getattr(V.RCConfig, preset)()
    actor = V.actor(rc=rc, loss_mode="bypass_mode", clip_ratio_low=0.15, clip_ratio_high=0.25,
                    global_batch_info={"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None})
    mode = "seq-mean-token-mean" if "pg" in preset else "token-mean"
    theirs, ref = verl_loss(V.core.compute_policy_loss_bypass_mode, (old, lp, adv, mask, mode, actor))
    if rc.rollout_rs is not None:  # the case is informative
        assert 0.0 < theirs[1]["rollout_corr/rollout_rs_seq_masked_fraction"] < 1.0
    assert_loss(run_loss(rv.compute_policy_loss_bypass_mode, (old, lp, adv, mask, mode, actor)), theirs, ref)
    ours_cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.25,
                                rollout_correction=getattr(RolloutCorrectionConfig, preset)())
    assert_loss(run_loss(rv.compute_policy_loss_bypass_mode, (old, lp, adv, mask, mode, ours_cfg)), theirs, ref)


def test_policy_loss_bypass_with_rs_and_batch_norm(V):
    old, lp, adv, mask = loss_inputs(seed=11)
    for loss_type in ("reinforce", "ppo_clip"):
        rc = V.RCConfig(rollout_is="token", rollout_is_threshold="0.7_1.4", rollout_is_batch_normalize=True,
                        rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.75_1.3,0.2", bypass_mode=True,
                        loss_type=loss_type)
        actor = V.actor(rc=rc, loss_mode="bypass_mode")
        theirs, ref = verl_loss(V.core.compute_policy_loss_bypass_mode, (old, lp, adv, mask, "token-mean", actor))
        assert 0 < theirs[1]["rollout_corr/rollout_rs_masked_fraction"] < 1
        ours = run_loss(rv.compute_policy_loss_bypass_mode, (old, lp, adv, mask, "token-mean", actor))
        assert_loss(ours, theirs, ref)
    with pytest.raises(ValueError, match="rollout_correction"):
        rv.compute_policy_loss_bypass_mode(old, lp, adv, mask, "token-mean", {"policy_loss": {}})


def test_everything_rejected_is_zero_loss_not_nan(V):
    """Documented difference: when RS rejects every token of a micro-batch, verl's token-mean is 0/0 = NaN (and
    NaN gradients); ours is 0 with zero gradients, so one such micro-batch cannot poison the step."""
    old, lp, adv, mask = loss_inputs(seed=4)
    rc = V.RCConfig.bypass_ppo_clip_k3_rs(rs_threshold=1e-6)
    actor = V.actor(rc=rc, loss_mode="bypass_mode")
    l_t, m_t, g_t = run_loss(V.core.compute_policy_loss_bypass_mode, (old, lp, adv, mask, "token-mean", actor))
    l_o, m_o, g_o = run_loss(rv.compute_policy_loss_bypass_mode, (old, lp, adv, mask, "token-mean", actor))
    assert m_t["rollout_corr/rollout_rs_masked_fraction"] == 1.0 and math.isnan(l_t.item())
    assert l_o.item() == 0.0 and bool((g_o == 0).all())
    assert list(m_o) == list(m_t)


def test_deprecated_compute_policy_loss(V):
    old, lp, adv, mask = loss_inputs(seed=5)
    for kw in (dict(cliprange=0.2), dict(cliprange=0.2, cliprange_low=0.1, cliprange_high=0.3, clip_ratio_c=2.0)):
        outs = []
        for fn in (V.core.compute_policy_loss, rv.compute_policy_loss):
            x = lp.detach().clone().requires_grad_(True)
            loss, clipfrac, kl, clipfrac_lower = fn(old, x, adv, mask, loss_agg_mode="seq-mean-token-mean", **kw)
            loss.backward()
            outs.append(([t.item() for t in (loss, clipfrac, kl, clipfrac_lower)], x.grad))
        for a, b in zip(outs[1][0], outs[0][0]):
            assert math.isclose(a, b, rel_tol=2e-5, abs_tol=2e-7)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=2e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------------- registry


def test_register_policy_losses(V):
    registry = V.core.POLICY_LOSS_REGISTRY
    before = dict(registry)
    previous = rv.register_policy_losses()
    try:
        assert V.core.get_policy_loss_fn("vanilla") is rv.compute_policy_loss_vanilla
        assert V.core.get_policy_loss_fn("bypass_mode") is rv.compute_policy_loss_bypass_mode
        assert set(previous) == set(before) == set(rv.POLICY_LOSSES)  # all twelve of verl's names
        assert previous == {name: before[name] for name in rv.POLICY_LOSSES}
        # called the way verl's ppo_loss calls it: keywords, bool mask, the actor config
        old, lp, adv, mask = loss_inputs(mask_dtype=torch.bool)
        actor = V.actor()
        kwargs = dict(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
                      config=actor, rollout_is_weights=None)
        got = V.core.get_policy_loss_fn("vanilla")(**kwargs)
        want = before["vanilla"](**kwargs)
        assert math.isclose(got[0].item(), want[0].item(), rel_tol=2e-5)
        assert_metrics(got[1], want[1])
    finally:
        rv.restore_policy_losses(previous)
    assert registry == before
    previous = rv.register_policy_losses(replace=False)
    try:
        assert previous == {"rollout_corr_" + name: None for name in rv.POLICY_LOSSES}
        assert registry["vanilla"] is before["vanilla"]
        # selected the way verl selects it: the actor config names the prefixed loss
        old, lp, adv, mask = loss_inputs()
        for name in ("gspo", "cispo"):
            actor = V.actor(loss_mode="rollout_corr_" + name)
            got = V.core.get_policy_loss_fn("rollout_corr_" + name)(old, lp, adv, mask, "token-mean", actor)
            want = before[name](old, lp, adv, mask, "token-mean", actor)
            assert math.isclose(got[0].item(), want[0].item(), rel_tol=2e-5)
            assert_metrics(got[1], want[1])
        assert V.core.get_policy_loss_fn("rollout_corr_bypass_mode") is rv.compute_policy_loss_bypass_mode
    finally:
        rv.restore_policy_losses(previous)
    assert registry == before


@pytest.mark.parametrize("name", ["vanilla", "dppo_tv", "dppo_kl"])
def test_missing_clip_ratio_c_takes_each_losss_verl_default(V, name):
    """A config without clip_ratio_c (a DictConfig or dict): each loss falls back to verl's own default for it
    (config.get("clip_ratio_c", ...): 3.0 in vanilla, 20.0 in dppo_tv / dppo_kl; before: 3.0 everywhere, a
    different loss and pg_clipfrac_lower for ratios in (3, 20])."""
    from omegaconf import OmegaConf

    old = torch.tensor([[-2.0, -2.0, -1.0, -1.0]], dtype=torch.float64)
    lp = torch.tensor([[-0.5, -3.0, -1.0, -1.0]], dtype=torch.float64)  # ratios e^1.5 = 4.48, e^-1, 1, 1
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    # wide trust-region bounds: the first token stays in, its ratio between 3 and 20
    keys = {"clip_ratio": 0.99, "clip_ratio_low": None, "clip_ratio_high": None, "global_batch_info": {}}
    for cfg in (OmegaConf.create(keys), keys):
        got = getattr(rv, "compute_policy_loss_" + name)(old, lp, adv, mask, "token-mean", cfg)
        want = getattr(V.core, "compute_policy_loss_" + name)(old, lp, adv, mask, "token-mean",
                                                             OmegaConf.create(keys))
        assert math.isclose(got[0].item(), want[0].item(), rel_tol=1e-12), (name, got[0].item(), want[0].item())
        assert_metrics(got[1], want[1])


# --------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("preset", VERL_PRESETS)
def test_our_config_accepts_verl_config(V, preset):
    from omegaconf import OmegaConf

    verl_cfg = getattr(V.RCConfig, preset)()
    want = getattr(RolloutCorrectionConfig, preset)()
    assert "_target_" in dict(verl_cfg)
    assert RolloutCorrectionConfig.from_dict(verl_cfg) == want
    assert RolloutCorrectionConfig.from_dict(OmegaConf.create(dict(verl_cfg))) == want
    assert RolloutCorrectionConfig.from_dict(dict(verl_cfg)) == want
    assert PolicyLossConfig(rollout_correction=verl_cfg).rollout_correction == want


def test_package_api_takes_verl_configs(V):
    lp, rlp, mask = inputs(scale=0.3)
    verl_cfg = V.RCConfig.decoupled_geo_rs_token_tis(rs_threshold="0.8_1.25")
    res = rollout_corr_ext.compute_rollout_correction(lp, rlp, mask, verl_cfg)
    want = rollout_corr_ext.compute_rollout_correction(lp, rlp, mask, RolloutCorrectionConfig.from_dict(verl_cfg))
    assert torch.equal(res.weights, want.weights) and torch.equal(res.response_mask, want.response_mask)
    # verl's actor config with loss_mode="bypass_mode": the package's bypass flow reads its rollout correction
    actor = V.actor(rc=V.RCConfig.bypass_pg_is(), loss_mode="bypass_mode", ppo_mini_batch_size=8,
                    global_batch_info={"dp_size": 2, "batch_num_tokens": 400, "global_batch_size": 20,
                                       "loss_scale_factor": None})
    cfg = PolicyLossConfig.from_dict(actor)
    assert (cfg.dp_size, cfg.batch_num_tokens, cfg.global_batch_size) == (2, 400, 20)
    assert cfg.rollout_correction == RolloutCorrectionConfig.bypass_pg_is()
    old, lp2, adv, mask2 = loss_inputs()
    loss, metrics = rollout_corr_ext.compute_policy_loss(None, lp2, adv, mask2, "token-mean", actor,
                                                         rollout_log_prob=old)
    theirs, _ = V.core.compute_policy_loss_bypass_mode(old, lp2, adv, mask2, "token-mean", actor)
    assert math.isclose(loss.item(), theirs.item(), rel_tol=2e-5)
    # vanilla loss mode: verl's default policy_loss.rollout_correction is not read (verl reads it only in bypass)
    assert PolicyLossConfig.from_dict(V.actor()).rollout_correction is None


def test_plain_dicts_validate_known_fields_and_ignore_verl_ones():
    cfg = PolicyLossConfig.from_dict({"clip_ratio": 0.3, "ppo_mini_batch_size": 4, "strategy": "megatron",
                                      "_target_": "verl.workers.config.ActorConfig", "global_batch_info": {}})
    assert cfg == PolicyLossConfig(clip_ratio=0.3)
    assert PolicyLossConfig.from_dict({"clip_ratio": 0.3, "loss_agg_mode": "token-mean"}) == cfg
    with pytest.raises(ValueError, match=r"unknown PolicyLossConfig field\(s\) \['clip_ration'\]"):
        PolicyLossConfig.from_dict({"clip_ration": 0.3})
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig.from_dict({"_target_": "x", "clip_ratio_c": -0.5})
    with pytest.raises(ValueError, match="global_batch_info"):
        PolicyLossConfig.from_dict({"global_batch_info": {"dp": 2}})
    rc = RolloutCorrectionConfig.from_dict({"_target_": "verl.trainer.config.RolloutCorrectionConfig",
                                            "rollout_is": "token", "rollout_is_threshold": 1.5})
    assert rc == RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5)
    with pytest.raises(ValueError, match=r"unknown RolloutCorrectionConfig field\(s\) \['rollout_is_levle'\]"):
        RolloutCorrectionConfig.from_dict({"_target_": "x", "rollout_is_levle": "token"})
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        RolloutCorrectionConfig.from_dict({"_target_": "x", "rollout_is": "token", "rollout_is_threshold": -1.0})


# --------------------------------------------------------------------------------------------------- without verl

_NO_VERL = r"""
import sys, warnings
sys.modules["verl"] = None  # `import verl` raises ImportError
warnings.simplefilter("ignore")
import torch
import rollout_corr_ext.verl as rv
lp = -torch.rand(4, 6); rlp = lp + 0.01 * torch.randn(4, 6); mask = torch.ones(4, 6)
assert set(rv.compute_offpolicy_metrics(lp, rlp, mask)) >= {"kl", "chi2_seq"}
proto, m, met = rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask)  # no weights: no DataProto needed
assert proto is None and "rollout_corr/kl" in met
loss, met = rv.compute_policy_loss_vanilla(rlp, lp, torch.randn(4, 6), mask, "token-mean", {"clip_ratio": 0.2})
assert isinstance(met["actor/ppo_kl"], float)
for call, name in ((lambda: rv.compute_rollout_correction_and_rejection_mask(lp, rlp, mask, rollout_is="token"),
                    "compute_rollout_correction_and_rejection_mask"),
                   (rv.register_policy_losses, "register_policy_losses")):
    try:
        call()
    except ImportError as exc:
        assert name in str(exc), str(exc)
    else:
        raise AssertionError(name + " did not raise ImportError")
print("OK")
"""


def test_imports_and_runs_without_verl():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _NO_VERL], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


def test_configure_returns_the_previous_settings():
    prev = rv.configure(extra_metrics=True)
    snapshot = copy.copy(rv._SETTINGS)
    rv.configure(**prev)
    assert snapshot["extra_metrics"] is True and rv._SETTINGS == prev


# --------------------------------------------------------------------------------------------------- sampling replay


def test_sampling_params_from_verl_configs(V):
    """rv.sampling_params reads verl's own RolloutConfig (and the trainer / actor_rollout_ref nesting, as dicts):
    temperature, top_k (-1: off), top_p; None when nothing truncates; logprobs_mode other than processed_logprobs
    (the engine's log-probs would not be the sampling probabilities) is refused."""
    from verl.workers.config.rollout import RolloutConfig

    from rollout_corr_ext import SamplingParams

    cfg = RolloutConfig(name="vllm", top_p=0.9, top_k=20, temperature=0.7)
    assert cfg.logprobs_mode == "processed_logprobs"  # verl's default: the log-probs of the distribution drawn from
    assert rv.sampling_params(cfg) == SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    assert rv.sampling_params(cfg, temperature_applied=False) == SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    nested = {"actor_rollout_ref": {"rollout": {"top_p": 0.8, "top_k": -1, "temperature": 1.0}}}
    assert rv.sampling_params(nested) == SamplingParams(top_p=0.8)
    assert rv.sampling_params(nested["actor_rollout_ref"]) == SamplingParams(top_p=0.8)
    assert rv.sampling_params(RolloutConfig(name="vllm", temperature=0.7)) is None  # top_k=-1, top_p=1: no truncation
    # nothing to replay at T = 0.7 (the actor divides by it), but the engine drew from softmax(z / 0.7) and
    # raw_logprobs are of softmax(z): refused all the same (was None: IS ratios of two distributions, silently)
    for mode in ("raw_logprobs", None):
        with pytest.raises(ValueError, match=r"logprobs_mode=.*draws from softmax\(logits / 0.7\)"):
            rv.sampling_params(RolloutConfig(name="vllm", temperature=0.7, logprobs_mode=mode))
    assert rv.sampling_params(RolloutConfig(name="vllm", logprobs_mode="raw_logprobs")) is None  # T = 1: raw is drawn
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs'.*processed_logprobs"):
        rv.sampling_params(RolloutConfig(name="vllm", top_p=0.9, logprobs_mode="raw_logprobs"))
    for mode in ("raw_logits", "processed_logits"):  # vLLM's logits modes: no log-probs at all, and said so
        with pytest.raises(ValueError, match=f"logprobs_mode='{mode}': the engine reports logits, not log-probs"):
            rv.sampling_params({"top_k": 5, "logprobs_mode": mode})
    # None: verl passes no flag and vLLM keeps its default, raw_logprobs (before: accepted, a replay against
    # untruncated rollout log-probs); an absent key is verl's default, processed_logprobs
    for cfg in (RolloutConfig(name="vllm", top_p=0.9, logprobs_mode=None), {"top_p": 0.9, "logprobs_mode": None}):
        with pytest.raises(ValueError, match="logprobs_mode=.*raw_logprobs"):
            rv.sampling_params(cfg)
    assert rv.sampling_params({"top_p": 0.9}) == SamplingParams(top_p=0.9)
    # verl's server spreads engine_kwargs.vllm after its own logprobs_mode, so that one reaches vLLM (was: the
    # rollout's processed_logprobs read, a replay against raw rollout log-probs, silently)
    for key in ("logprobs_mode", "logprobs-mode"):
        cfg = RolloutConfig(name="vllm", top_p=0.9, top_k=50, engine_kwargs={"vllm": {key: "raw_logprobs"}})
        assert cfg.logprobs_mode == "processed_logprobs"
        with pytest.raises(ValueError, match=r"rollout.engine_kwargs.vllm.logprobs_mode='raw_logprobs'"):
            rv.sampling_params(cfg)
        with pytest.raises(ValueError, match=r"engine_kwargs.vllm.logprobs_mode='raw_logprobs'.*softmax\(logits / 0.7"):
            rv.sampling_params({"temperature": 0.7, "engine_kwargs": {"vllm": {key: "raw_logprobs"}}})
    cfg = RolloutConfig(name="vllm", top_p=0.9, logprobs_mode="raw_logprobs",
                        engine_kwargs={"vllm": {"logprobs_mode": "processed_logprobs"}})
    assert rv.sampling_params(cfg) == SamplingParams(top_p=0.9)  # what vLLM runs with is processed
    cfg = RolloutConfig(name="vllm", top_p=0.9, engine_kwargs={"vllm": {"logprobs_mode": None}})
    assert rv.sampling_params(cfg) == SamplingParams(top_p=0.9)  # verl drops None values: the rollout's applies
    with pytest.raises(ValueError, match="rejection_sample_method='synthetic'"):  # verl's own config object
        rv.sampling_params(RolloutConfig(name="vllm", top_p=0.9, engine_kwargs={
            "vllm": {"speculative_config": {"rejection_sample_method": "synthetic"}}}))
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        rv.sampling_params({"top_p": 1.5})
    with pytest.raises(TypeError, match="SamplingParams"):
        rv.configure(sampling={"top_p": 0.9})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits_equals_verl_and_replays_when_configured(V, dtype):
    """Without sampling: verl's logprobs_from_logits on the same logits (its torch path here), value and gradient;
    for bf16 logits verl returns bf16 log-probs (rounded), ours are fp32: held to the exact fp64 value and at least
    as close to it as verl's. With configure(sampling=...): the dense fp64 oracle of vLLM's rules (-inf outside the
    kept set)."""
    import verl.utils.torch_functional as vtf

    from rollout_corr_ext import SamplingParams
    from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense
    from rollout_corr_testing.tolerances import grad_tol, output_tol

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 5, 64, generator=g) * 2).to(dtype)
    labels = torch.randint(0, 64, (3, 5), generator=g)
    assert _params(rv.logprobs_from_logits) == _params(vtf.logprobs_from_logits)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours = rv.logprobs_from_logits(a, labels)
    theirs = vtf.logprobs_from_logits(b, labels)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert ours.dtype == torch.float32 and theirs.dtype == dtype
    torch.testing.assert_close(ours.double(), exact, **output_tol(dtype))
    assert bool(((ours.double() - exact).abs() <= (theirs.double() - exact).abs() + 1e-6).all())
    ours.sum().backward()
    theirs.sum().backward()
    x = logits.double().requires_grad_(True)
    torch.log_softmax(x, -1).gather(-1, labels.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(a.grad.double(), x.grad, **grad_tol(dtype))
    if dtype == torch.float32:  # bf16: verl's gradient comes from its bf16 log_softmax and is coarser than ours
        torch.testing.assert_close(a.grad, b.grad, **grad_tol(dtype))

    sp = SamplingParams(top_k=16, top_p=0.8)
    with rv.configured(sampling=sp):
        got = rv.logprobs_from_logits(logits, labels)
    lp, *_ = sampled_log_probs_dense(logits.double().reshape(-1, 64), labels.reshape(-1), top_k=16, top_p=0.8)
    lp = lp.reshape(3, 5)
    assert torch.equal(got == -math.inf, lp == -math.inf) and bool((lp == -math.inf).any())
    fin = lp != -math.inf
    torch.testing.assert_close(got.double()[fin], lp[fin], **output_tol(dtype))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_temperature_vllm_raises_is_replayed_at_vllms(V, top_p):
    """vLLM raises a request temperature in (0, 0.01) to 0.01 before sampling (vllm/sampling_params.py,
    ``_MAX_TEMP``): a rollout configured at T = 0.005 is drawn from softmax(z / 0.01), while verl's actor divides
    its logits by the configured 0.005. sampling_params replays at 0.01 / 0.005 = 2 on those logits (was 1, or no
    replay at all without truncation: the log-probs of another distribution than the one drawn from; the vLLM
    check), from_verl at 0.01 on raw logits; another engine (sglang) keeps its configured temperature. Oracle: the
    dense fp64 vLLM-rule replay at 0.01 of the raw logits."""
    from rollout_corr_ext import SamplingParams
    from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense

    g = torch.Generator().manual_seed(6)
    z = torch.randn(4, 32, generator=g, dtype=torch.float64) * 0.02  # gaps of a few 0.01: T matters
    labels = torch.randint(0, 32, (4,), generator=g)
    cfg = {"temperature": 0.005, "top_k": -1, "top_p": top_p, "name": "vllm"}
    sp = rv.sampling_params(cfg)
    assert sp is not None and sp.temperature == pytest.approx(2.0)
    assert SamplingParams.from_verl(cfg).temperature == 0.01
    assert rv.sampling_params(cfg, temperature_applied=False).temperature == 0.01
    want, *_ = sampled_log_probs_dense(z, labels, temperature=0.01, top_p=top_p)
    with rv.configured(sampling=sp):
        got = rv.logprobs_from_logits((z / 0.005).float(), labels)  # verl's actor: logits / the configured T
    fin = want != -math.inf
    assert torch.equal(got == -math.inf, ~fin)
    torch.testing.assert_close(got.double()[fin], want[fin], rtol=1e-5, atol=1e-5)
    # the configured temperature (what the old mapping replayed) is a different distribution here
    other, *_ = sampled_log_probs_dense(z, labels, temperature=0.005, top_p=top_p)
    assert (other[fin] - want[fin]).abs().max() > 1e-2
    # sglang samples at the configured temperature (its truncation is not replayed: the next test); at or above
    # 0.01 vLLM does too
    if top_p == 1.0:
        assert SamplingParams.from_verl(dict(cfg, name="sglang")).temperature == 0.005
        assert rv.sampling_params(dict(cfg, name="sglang")) is None
    assert rv.sampling_params(dict(cfg, temperature=0.01)) == (None if top_p == 1.0 else SamplingParams(top_p=top_p))
    assert rv.sampling_params(dict(cfg, temperature=0.7), temperature_applied=False) == SamplingParams(
        temperature=0.7, top_p=top_p)
    # a replay at the engine's temperature needs the engine's processed log-probs as much as a truncation does
    # (raw_logprobs are of the raw logits: the review)
    for mode in ("raw_logprobs", None):
        with pytest.raises(ValueError, match="logprobs_mode=.*draws from"):
            rv.sampling_params(dict(cfg, logprobs_mode=mode))


@pytest.mark.parametrize("estimator", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_kl_penalty_leaves_replayed_out_of_support_tokens_out(V, estimator):
    """Under sampling replay verl's engines replay the reference's log-probs too, so a sampled token outside the
    reference's own kept set has ref_log_prob -inf (and a tool token's actor log-prob may be -inf): verl's
    kl_penalty gives inf / NaN there (-inf - -inf), which `kld * response_mask` carries into the rewards or the KL
    loss, masked tokens included. With configure(sampling=...) rcv.kl_penalty gives such a token 0 with gradient
    0; every other token equals verl's kl_penalty (value and gradient, also with old_log_prob); without replay it
    is verl's everywhere, -inf included."""
    from rollout_corr_ext import SamplingParams

    g = torch.Generator().manual_seed(8)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3 - 0.05
    ref = lp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    lp[0, 1] = -math.inf  # the actor's own kept set (a tool token)
    ref[1, 2] = ref[2, 3] = -math.inf  # the reference's
    lp[2, 3] = -math.inf  # both: -inf - -inf
    out = (lp == -math.inf) | (ref == -math.inf)
    for with_old in (False, True):
        if with_old and estimator.endswith("+"):
            continue
        kw = {"old_log_prob": old} if with_old else {}
        a = lp.clone().requires_grad_(True)
        with rv.configured(sampling=SamplingParams(top_p=0.9)):
            got = rv.kl_penalty(a, ref, estimator, **kw)
        assert bool(torch.isfinite(got).all()) and bool((got[out] == 0).all())
        b = torch.where(out, -1.0, lp).requires_grad_(True)  # verl on the kept tokens (finite stand-ins elsewhere)
        want = V.core.kl_penalty(b, torch.where(out, -1.0, ref), estimator)
        if with_old:
            want = want * torch.exp(torch.clamp(b - old, -20.0, 20.0))
        torch.testing.assert_close(got[~out], want[~out], rtol=1e-12, atol=1e-12)
        w = torch.randn(4, 6, generator=g, dtype=torch.float64)
        (got * w).sum().backward()
        (torch.where(out, 0.0, want) * w).sum().backward()
        assert bool((a.grad[out] == 0).all())
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    # without replay: verl's own values at -inf too (inf / NaN)
    torch.testing.assert_close(rv.kl_penalty(lp, ref, estimator), V.core.kl_penalty(lp, ref, estimator),
                               equal_nan=True, rtol=0, atol=0)
    with rv.configured(sampling=SamplingParams(top_p=0.9)):
        # a NaN is an error's value, not the replay's marker: NaN stays NaN beside a -inf (was 0, the fuzz)
        nan_ref = ref.clone()
        nan_ref[0, 1] = math.nan
        assert bool(rv.kl_penalty(lp, nan_ref, estimator)[0, 1].isnan())
        # shapes are checked as without replay (the where() below the check broadcast them: the fuzz)
        for args in ((lp, ref[0]), (lp, ref[:, :1])):
            with pytest.raises(ValueError, match="ref_logprob must have the shape"):
                rv.kl_penalty(*args, estimator)
    with pytest.raises(ValueError, match="ref_logprob must have the shape"):
        rv.kl_penalty(lp, ref[0], estimator)


def _megatron_engine_worker(rank, world):
    """verl's megatron engine scores with verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits
    over this rank's vocab shard; rcv.logprobs_from_logits there read the shard as the whole vocabulary. The
    drop-in: without replay equal to verl's own function (value, gradient); with configure(sampling=...) the dense
    fp64 oracle of vLLM's rules on the whole vocabulary (kept set exact), the gradient equal to the one-process
    replay's on this shard's columns."""
    from megatron.core import parallel_state as ps
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits as verl_vp

    from rollout_corr_ext import SamplingParams
    from rollout_corr_testing.dist_utils import worker_device
    from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        dev = worker_device()
        g = torch.Generator().manual_seed(21)
        full = torch.randn(6, 5, 64, generator=g) * 2
        labels = torch.randint(0, 64, (6, 5), generator=g)
        v = 64 // world
        shard = full[..., rank * v:(rank + 1) * v].contiguous()
        w = torch.randn(6, 5, generator=g)
        a = shard.clone().to(dev).requires_grad_(True)
        b = shard.clone().to(dev).requires_grad_(True)
        ours = rv.vocab_parallel_log_probs_from_logits(a, labels.to(dev))
        theirs = verl_vp(b * 1.0, labels.to(dev))  # * 1.0: megatron-core writes into its input
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        (ours * w.to(dev)).sum().backward()
        (theirs * w.to(dev)).sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)

        sp = SamplingParams(top_k=12, top_p=0.8)
        want, *_ = sampled_log_probs_dense(full.double().reshape(-1, 64), labels.reshape(-1), top_k=12, top_p=0.8)
        want = want.reshape(6, 5)
        c = shard.clone().to(dev).requires_grad_(True)
        one = full.clone().requires_grad_(True)
        with rv.configured(sampling=sp):
            got = rv.vocab_parallel_log_probs_from_logits(c, labels.to(dev))
            single = rv.logprobs_from_logits(one, labels)
        fin = want != -math.inf
        assert bool((~fin).any()) and bool(fin.any())
        assert torch.equal(got.cpu() == -math.inf, ~fin)
        torch.testing.assert_close(got.cpu().double()[fin], want[fin], rtol=1e-5, atol=1e-5)
        (torch.where(fin, got.cpu(), 0.0) * w).sum().backward()
        (torch.where(fin, single, 0.0) * w).sum().backward()
        torch.testing.assert_close(c.grad.cpu(), one.grad[..., rank * v:(rank + 1) * v], rtol=1e-5, atol=1e-6)
    finally:
        ps.destroy_model_parallel()


def _fused_oracle(h, w, labels, temperature, sampling=None):
    """fp64 log-prob and entropy of ``labels`` under softmax(h W^T / temperature) (with ``sampling``: the dense
    oracle of vLLM's rules on those logits), differentiable in ``h`` and ``w``."""
    from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense

    z = (h.double() @ w.double().t()) / temperature
    z2, t1 = z.reshape(-1, z.shape[-1]), labels.reshape(-1)
    if sampling is None:
        lsm = torch.log_softmax(z2, -1)
        lp, ent = lsm.gather(-1, t1[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    else:
        lp, ent, *_ = sampled_log_probs_dense(z2, t1, temperature=sampling.temperature, top_k=sampling.top_k,
                                              top_p=sampling.top_p, min_p=sampling.min_p)
    return lp.reshape(labels.shape), ent.reshape(labels.shape)


def _fused_grads_close(ours, oracle, verls, dtype):
    """fp32 / fp64: the tolerance table's. 16-bit: the gradient GEMMs take 16-bit operands (dlogits rounded, as in
    verl's class), so a hidden state's gradient, a sum over the vocabulary that cancels, is off by more than its
    own rounding: held, in norm against the fp64 oracle, to verl's own class's error (``verls``) or 2^-7."""
    from rollout_corr_testing.tolerances import grad_tol

    for i, (a, r) in enumerate(zip(ours, oracle)):
        assert a.dtype == dtype
        if dtype in (torch.float32, torch.float64):
            torch.testing.assert_close(a.double(), r, **grad_tol(dtype))
            continue
        err = float((a.double() - r).norm() / r.norm())
        bound = 2.0 ** -7 if verls is None else 1.5 * float((verls[i].double() - r).norm() / r.norm()) + 2e-3
        assert err <= bound, (i, err, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_linear_for_ppo_is_verls_and_replays(V, dtype):
    """verl's use_fused_kernels=True (torch backend) scores with FusedLinearForPPO, out of reach of a replay
    through logprobs_from_logits. The drop-in: verl's class's shapes and dtypes (log-probs fp32, the entropy in the
    hidden states' dtype), equal to verl's own class in fp32 (values and both inputs' gradients through both
    outputs) and, in every dtype, to the fp64 oracle of the exact product; with configure(sampling=...) the dense
    fp64 oracle of vLLM's rules on the logits verl divides by its temperature (the replay's own temperature
    applied on top), -inf outside the kept set."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlFused

    from rollout_corr_ext import SamplingParams
    from rollout_corr_testing.tolerances import grad_tol, linear_tol

    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 7, 16, generator=g).to(dtype)
    w = (torch.randn(48, 16, generator=g) * 0.6).to(dtype)
    labels = torch.randint(0, 48, (3, 7), generator=g)
    labels[:, ::2] = (h.double() @ w.double().t()).argmax(-1)[:, ::2]  # some surely kept by the replay below
    gl, ge = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    mods = [rv.FusedLinearForPPO()] + ([VerlFused()] if dtype != torch.float64 else [])
    outs = []
    for mod in mods:
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = mod(hh, ww, labels, 0.7)
        assert (lp.dtype, ent.dtype, lp.shape, ent.shape) == (torch.float32, dtype, labels.shape, labels.shape)
        ((lp.double() * gl).sum() + (ent.double() * ge).sum()).backward()
        outs.append((lp, ent, hh.grad, ww.grad))
    if dtype == torch.float32:  # verl's own class (its 16-bit path rounds the logits to 16 bits first)
        for a, b in zip(outs[0][:2], outs[1][:2]):
            torch.testing.assert_close(a, b, **linear_tol(torch.float32))
        for a, b in zip(outs[0][2:], outs[1][2:]):
            torch.testing.assert_close(a, b, **grad_tol(torch.float32))
    # the log-probs come back in fp32 and the entropy in the hidden states' dtype (as verl's): its gradient
    # arrives rounded to that dtype, and an fp64 log-prob is rounded to fp32 once
    ge16 = ge.to(dtype).double()
    lp_tol = linear_tol(torch.float32 if dtype == torch.float64 else dtype)
    hh, ww = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    lp, ent = _fused_oracle(hh, ww, labels, 0.7)
    ((lp * gl).sum() + (ent * ge16).sum()).backward()
    ours = outs[0]
    torch.testing.assert_close(ours[0].double(), lp.detach(), **lp_tol)
    # the entropy comes back in the hidden states' dtype, as verl's: one rounding to it
    torch.testing.assert_close(ours[1].double(), ent.detach(), **(linear_tol(dtype) if dtype != torch.bfloat16
                                                                  else dict(rtol=2 ** -8, atol=1e-5)))
    _fused_grads_close(ours[2:], (hh.grad, ww.grad), outs[1][2:] if dtype == torch.bfloat16 else None, dtype)

    sp = SamplingParams(temperature=1.25, top_k=9, top_p=0.8)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with rv.configured(sampling=sp):
        lp, ent = rv.FusedLinearForPPO()(hh, ww, labels, 0.7)
    ho, wo = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want, want_ent = _fused_oracle(ho, wo, labels, 0.7, sp)
    fin = torch.isfinite(want)
    assert bool((~fin).any()) and bool(fin.any())
    assert torch.equal(torch.isfinite(lp), fin)
    torch.testing.assert_close(lp.double()[fin], want.detach()[fin], **lp_tol)
    torch.testing.assert_close(ent.double(), want_ent, **(linear_tol(dtype) if dtype != torch.bfloat16
                                                          else dict(rtol=2 ** -8, atol=1e-5)))
    torch.where(fin, lp.double() * gl, 0.0).sum().backward()
    torch.where(fin, want * gl, 0.0).sum().backward()
    _fused_grads_close((hh.grad, ww.grad), (ho.grad, wo.grad), None, dtype)
    # verl's constructor checks, and input shapes named
    with pytest.raises(ValueError, match="impl_backend must be 'torch' or 'liger'"):
        rv.FusedLinearForPPO(impl_backend="triton")
    with pytest.raises(ValueError, match="input_ids must have hidden_states' shape"):
        rv.FusedLinearForPPO()(h, w, labels[:, :3])
    with pytest.raises(ValueError, match="temperature must be a number > 0, got 0"):
        rv.FusedLinearForPPO()(h, w, labels, 0)


def _fused_tp_worker(rank, world):
    """verl's Triton linear_cross_entropy, as its megatron engine calls it: this rank's vocab shard of the weight
    and the tensor-parallel group. The drop-in at TP = world equals the one-process call (values; the weight
    shard's gradient; the hidden states' gradient summed over the ranks, as megatron's layer all-reduces it), with
    and without a replay, and, flattened, verl's FusedLinearForPPO."""
    import torch.distributed as dist

    from rollout_corr_ext import SamplingParams

    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(13)
    h = torch.randn(4, 6, 32, generator=g)
    w = torch.randn(64, 32, generator=g) * 0.5
    labels = torch.randint(0, 64, (4, 6), generator=g)
    labels[:, ::2] = (h @ w.t()).argmax(-1)[:, ::2]  # some surely kept by the replays below
    gl, ge = torch.randn(24, generator=g), torch.randn(24, generator=g)
    v = 64 // world
    for sp in (None, SamplingParams(top_k=10, top_p=0.85), SamplingParams(top_p=0.7, temperature=0.9)):
        with rv.configured(sampling=sp):
            grads = []
            for tp, weight in ((group, w[rank * v:(rank + 1) * v]), (None, w)):
                hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
                lp, ent = rv.linear_cross_entropy(hh, ww, labels, 0.8, "none", tp)
                assert lp.shape == ent.shape == (24,) and lp.dtype == ent.dtype == torch.float32
                fin = torch.isfinite(lp)
                (torch.where(fin, lp * gl, 0.0).sum() + (ent * ge).sum()).backward()
                grads.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
        (lp_tp, ent_tp, gh_tp, gw_tp), (lp_1, ent_1, gh_1, gw_1) = grads
        assert torch.equal(torch.isfinite(lp_tp), torch.isfinite(lp_1)) and bool(fin.any())
        assert sp is None or bool((~fin).any())
        torch.testing.assert_close(lp_tp, lp_1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_tp, ent_1, rtol=1e-5, atol=1e-5)
        dist.all_reduce(gh_tp, group=group)
        torch.testing.assert_close(gh_tp, gh_1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw_tp, gw_1[rank * v:(rank + 1) * v], rtol=1e-5, atol=1e-5)
        if sp is None:
            from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlFused

            theirs = VerlFused()(h, w, labels, 0.8)
            torch.testing.assert_close(lp_1, theirs[0].reshape(-1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent_1, theirs[1].reshape(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_linear_cross_entropy_is_verls_and_replays_under_tp(V, world):
    from rollout_corr_testing.dist_utils import run_workers_preloaded

    run_workers_preloaded(_fused_tp_worker, world)


def test_fused_kernel_patches_reach_verls_model_forward(V, monkeypatch):
    """Where docs/from_verl.md says to patch, verl's own fused model forwards (use_fused_kernels=True; the torch and
    the triton backends of verl/models/transformers/dense_common.py) call the drop-ins: with a replay configured,
    their log-probs are the replay's (-inf outside the kept set), which verl's own functions never give."""
    import types

    import verl.utils.experimental.torch_functional as verl_tf
    import verl.utils.kernel.linear_cross_entropy as verl_lce
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from verl.models.transformers import dense_common

    from rollout_corr_ext import SamplingParams

    g = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(2, 9, 16, generator=g), torch.randn(40, 16, generator=g) * 0.7
    ids = torch.randint(0, 40, (2, 9), generator=g)
    rolled = torch.roll(ids, shifts=-1, dims=-1)
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(output_attentions=False, output_hidden_states=False),
        model=lambda **kw: BaseModelOutputWithPast(last_hidden_state=hidden),
        lm_head=types.SimpleNamespace(weight=weight))
    monkeypatch.setattr(verl_tf, "FusedLinearForPPO", rv.FusedLinearForPPO)
    monkeypatch.setattr(verl_lce, "linear_cross_entropy", rv.linear_cross_entropy)
    sp = SamplingParams(top_p=0.6)
    with rv.configured(sampling=sp):
        want = rv.FusedLinearForPPO()(hidden, weight, rolled, 0.7)
        torch_out = dense_common.forward_with_torch_backend(model, input_ids=ids, return_dict=True, temperature=0.7)
        triton_out = dense_common.forward_with_triton_backend(model, input_ids=ids, return_dict=True,
                                                              temperature=0.7)
    assert bool(torch.isinf(want[0]).any()) and bool(torch.isfinite(want[0]).any())
    assert torch.equal(torch_out.log_probs, want[0]) and torch.equal(torch_out.entropy, want[1])
    assert torch.equal(triton_out.log_probs, want[0].reshape(-1))
    assert torch.equal(triton_out.entropy, want[1].reshape(-1))


def test_linear_cross_entropy_signature_and_refusals(V):
    """Same parameters as verl's (its autograd Function's forward, less ctx); reduction "none" only, named."""
    from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy

    theirs = list(inspect.signature(LinearCrossEntropy.forward).parameters)[1:]
    assert list(inspect.signature(rv.linear_cross_entropy).parameters) == theirs
    for name in ("__init__", "forward"):
        from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlFused

        assert list(inspect.signature(getattr(rv.FusedLinearForPPO, name)).parameters) == \
            list(inspect.signature(getattr(VerlFused, name)).parameters)
    h, w, labels = torch.randn(3, 8), torch.randn(10, 8), torch.randint(0, 10, (3,))
    with pytest.raises(ValueError, match="reduction must be 'none'"):
        rv.linear_cross_entropy(h, w, labels, 1.0, "mean")
    with pytest.raises(ValueError, match="labels must hold one id per row of hidden .*got 2 ids for 3 rows"):
        rv.linear_cross_entropy(h, w, labels[:2])
    # verl's megatron engine passes hidden [s, b, H] with labels [b, s] (b = 1): flattened alike, as verl's kernel
    hs = h.unsqueeze(1).requires_grad_(True)
    lp, ent = rv.linear_cross_entropy(hs, w, labels.unsqueeze(0), 0.9)
    want = rv.FusedLinearForPPO()(h, w, labels, 0.9)
    assert lp.shape == ent.shape == (3,)
    assert torch.equal(lp, want[0]) and torch.equal(ent, want[1])
    lp.sum().backward()
    assert hs.grad.shape == hs.shape


@pytest.mark.parametrize("replay", [False, True])
def test_drop_ins_refuse_bad_ids_in_their_callers_names(V, replay):
    """Ids that are not integers (float, bool) are refused, not truncated to integers, as verl's own gather refuses
    them; int32 ids score as int64 ones. Every error names the drop-in's own arguments (input_ids / hidden_states /
    vocab_weights for FusedLinearForPPO, labels for the others), with and without a replay."""
    from rollout_corr_ext import SamplingParams

    with rv.configured(sampling=SamplingParams(top_k=5, top_p=0.9) if replay else None):  # restored after
        g = torch.Generator().manual_seed(5)
        h, w = torch.randn(2, 3, 8, generator=g), torch.randn(50, 8, generator=g)
        ids = torch.randint(0, 50, (2, 3), generator=g)
        fused = lambda hs, ws, i: rv.FusedLinearForPPO()(hs, ws, i, 0.9)  # noqa: E731
        lce = lambda hs, ws, i: rv.linear_cross_entropy(hs, ws, i, 0.9)  # noqa: E731
        for fn, label in ((fused, "input_ids"), (lce, "labels")):
            want = fn(h, w, ids)
            got = fn(h, w, ids.to(torch.int32))
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            for bad in (ids.float() + 0.5, ids > 20):
                with pytest.raises(TypeError, match=f"^{label} must be an int64 \\(or int32\\) tensor of token ids, "
                                                    f"got {bad.dtype}"):
                    fn(h, w, bad)
            far = ids.clone()
            far[1, 2] = 50
            with pytest.raises(ValueError, match=f"^{label} holds an id outside \\[0, vocab_size\\) that is not "
                                                 f"ignore_index: {label}.flatten\\(\\)\\[5\\] = 50"):
                fn(h, w, far)
        with pytest.raises(ValueError, match="^vocab_weights must have shape \\[V_local > 0, H = hidden_states.shape"):
            fused(h, w[:, :7], ids)
        with pytest.raises(ValueError, match="^vocab_weights \\(torch.float64, cpu\\) must have hidden_states's dtype"):
            fused(h, w.double(), ids)
        for fn, hname in ((fused, "hidden_states"), (lce, "hidden")):
            with pytest.raises(ValueError, match=f"^{hname} must have a non-empty last \\(hidden-size\\) dimension"):
                fn(h[..., :0], w[:, :0], ids)
        nan = h.clone()
        nan[0, 1, 2] = math.nan
        with pytest.raises(ValueError, match="row 1 .*hidden_states, vocab_weights or bias holds NaN / inf"):
            fused(nan, w, ids)
        logits = h @ w.T
        for fn in (rv.logprobs_from_logits, rv.vocab_parallel_log_probs_from_logits):
            assert torch.equal(fn(logits, ids), fn(logits, ids.to(torch.int32)))
            with pytest.raises(TypeError, match="^labels must be an int64 \\(or int32\\) tensor of token ids"):
                fn(logits, ids.float())
            with pytest.raises(ValueError, match="^labels must have shape logits.shape\\[:-1\\]"):
                fn(logits, ids[:, :2])
            with pytest.raises((ValueError, RuntimeError),
                               match=f"^({fn.__name__}: )?labels holds (an id|ids) outside"):
                fn(logits, far)


@pytest.mark.parametrize("world", [1, 2])
def test_vocab_parallel_log_probs_from_logits_is_verls_and_replays_under_tp(V, world):
    # (no "megatron" in the name: the newest-stack job runs -m megatron without verl)
    from rollout_corr_testing.dist_utils import run_workers_preloaded

    run_workers_preloaded(_megatron_engine_worker, world)


def _sglang_torch_kept(probs, top_k, top_p, min_p):
    """The kept set of SGLang's torch sampler: its ``top_k_top_p_min_p_sampling_from_probs_torch`` rules
    (sglang/srt/layers/sampler.py, 0.5.23; flashinfer's "joint" order the same), written from them in fp64: sort
    descending; drop ranks >= top_k; drop where the mass before a token exceeds top_p, on the **full** distribution;
    drop p < min_p p_max."""
    p, idx = probs.sort(descending=True)
    before = p.cumsum(0) - p
    keep = (torch.arange(p.numel()) < top_k) & ~(before > top_p) & ~(p < min_p * p[0])
    return set(idx[keep].tolist())


def test_sglang_truncation_is_refused_and_its_temperature_replayed(V):
    """SGLang (0.5.23, sglang/srt/layers/sampler.py) draws from its truncated distribution but returns the log-probs
    of softmax(logits / T) before the truncation (its filters never write into the probabilities it logs), and
    takes top-p on the full distribution where vLLM renormalises after top-k and min-p. A vLLM-rule replay (what
    from_verl returned for name="sglang") then scored renormalised log-probs against unrenormalised ones: every IS
    ratio off by the kept mass, silently, and with top-k + top-p another kept set besides. Refused now for any
    truncation, by from_verl and sampling_params, naming the engine; a temperature alone is replayed (SGLang's
    reported log-probs are those of softmax(logits / T): the oracle below), whatever logprobs_mode says (verl
    forwards it to vLLM only). Below 1e-6 SGLang samples greedily: refused. Another engine's truncation: refused."""
    from rollout_corr_ext import SamplingParams
    from rollout_corr_ext.sampling import engine_temperature
    from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense

    # the kept sets differ on the example probabilities [0.5, 0.3, 0.2] (top_k=2, top_p=0.6): vLLM keeps {0}
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    lp, *_ = sampled_log_probs_dense(probs.log().unsqueeze(0), torch.tensor([1]), top_k=2, top_p=0.6)
    assert lp.item() == -math.inf and _sglang_torch_kept(probs, 2, 0.6, 0.0) == {0, 1}
    for trunc in ({"top_k": 2}, {"top_p": 0.6}, {"top_k": 2, "top_p": 0.6}):
        cfg = dict({"name": "sglang", "temperature": 0.7}, **trunc)
        with pytest.raises(ValueError, match=r"name='sglang' with a truncation .*before the truncation"):
            SamplingParams.from_verl(cfg)
        for applied in (True, False):
            with pytest.raises(ValueError, match=r"name='sglang'"):
                rv.sampling_params(cfg, temperature_applied=applied)
        with pytest.raises(ValueError, match=r"name='trtllm' with a truncation .*not known"):
            rv.sampling_params(dict(cfg, name="trtllm"))
        assert rv.sampling_params(dict(cfg, name="vllm")) is not None  # vLLM's own rules: replayed

    # a temperature alone: SGLang returns log softmax(logits / T), which the replay at T computes (raw logits) or
    # the actor's own division leaves nothing to replay for; raw_logprobs is a vLLM flag (not refused for sglang)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 40, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 40, (4,), generator=g)
    for mode in ("processed_logprobs", "raw_logprobs", None):
        cfg = {"name": "sglang", "temperature": 0.7, "top_k": -1, "top_p": 1.0, "logprobs_mode": mode}
        assert rv.sampling_params(cfg) is None
        sp = rv.sampling_params(cfg, temperature_applied=False)
        assert sp == SamplingParams.from_verl(cfg) == SamplingParams(temperature=0.7)
        with rv.configured(sampling=sp):
            got = rv.logprobs_from_logits(z, labels)
        sglang = torch.log_softmax(z / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1)  # what SGLang reports
        torch.testing.assert_close(got.double(), sglang, rtol=1e-6, atol=1e-6)
        if mode != "processed_logprobs":  # vLLM's flag is still checked for vLLM
            with pytest.raises(ValueError, match="logprobs_mode"):
                rv.sampling_params(dict(cfg, name="vllm"))
    # greedy below 1e-6: no distribution to replay or correct
    for t in (0.0, 5e-7):
        with pytest.raises(ValueError, match="SGLang samples greedily"):
            SamplingParams.from_verl({"name": "sglang", "temperature": t})
        with pytest.raises(ValueError, match="SGLang samples greedily"):
            engine_temperature(t, "sglang")
    assert engine_temperature(1e-6, "sglang") == 1e-6 and engine_temperature(5e-7, "vllm") == 0.01


def test_losses_and_correction_leave_out_of_support_tokens_out_when_replaying(V):
    """With configure(sampling=...), a response token whose log-prob is -inf (outside a replayed kept set) leaves
    the loss and the rollout correction: every result equals the call with that token masked by hand, and
    rollout_corr/sampling_out_of_support_fraction counts it. Without replay, -inf in both log-probs stays an
    error (an undefined ratio)."""
    from rollout_corr_ext import SamplingParams

    g = torch.Generator().manual_seed(9)
    b, s = 3, 6
    old = -torch.rand(b, s, generator=g) * 2
    lp = old + 0.05 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, s, generator=g)
    mask = torch.ones(b, s)
    mask[2, 4:] = 0
    out = torch.zeros(b, s, dtype=torch.bool)
    out[0, 2] = out[1, 5] = True
    old_inf, lp_inf = old.masked_fill(out, -math.inf), lp.masked_fill(out, -math.inf)
    hand = mask.masked_fill(out, 0)
    frac = out.sum().item() / mask.sum().item()
    actor = V.actor()
    with rv.configured(sampling=SamplingParams(top_p=0.9)):
        x1 = lp_inf.clone().requires_grad_(True)
        l1, m1 = rv.compute_policy_loss_vanilla(old_inf, x1, adv, mask, "token-mean", actor)
        l1.backward()
        assert m1["rollout_corr/sampling_out_of_support_fraction"] == pytest.approx(frac)
        r1, _ = rv.compute_policy_loss_reinforce(old_inf, lp_inf, adv, mask, "token-mean", actor)
        _, cmask, cm = rv.compute_rollout_correction_and_rejection_mask(old_inf, old + 0.01, mask, "token", 2.0)
        assert cm["rollout_corr/sampling_out_of_support_fraction"] == pytest.approx(frac)
    x2 = lp.clone().requires_grad_(True)
    l2, m2 = rv.compute_policy_loss_vanilla(old, x2, adv, hand, "token-mean", actor)
    l2.backward()
    assert l1.item() == pytest.approx(l2.item(), rel=1e-6) and torch.isfinite(l1)
    torch.testing.assert_close(x1.grad, x2.grad)
    assert "rollout_corr/sampling_out_of_support_fraction" not in m2
    r2, _ = rv.compute_policy_loss_reinforce(old, lp, adv, hand, "token-mean", actor)
    assert r1.item() == pytest.approx(r2.item(), rel=1e-6)
    _, cmask2, _ = rv.compute_rollout_correction_and_rejection_mask(old, old + 0.01, hand, "token", 2.0)
    assert torch.equal(cmask, cmask2)
    with pytest.raises(ValueError, match="-inf"):
        rv.compute_policy_loss_vanilla(old_inf, lp_inf, adv, mask, "token-mean", actor)


def test_log_ratio_helpers_leave_either_side_out_of_support_when_replaying(V):
    """The helpers that take log_ratio = log pi_old - log pi_rollout: with configure(sampling=...), -inf on either
    side (log_ratio -inf: pi_old's; +inf: the rollout's, the engine's own kept set) leaves the mask, as the helpers
    given both log-probs take it; the weights and the RS mask equal those with the token masked by hand. A +inf
    log-ratio was a ValueError naming rollout_log_prob. NaN (both sides -inf, or a NaN) stays an error."""
    from rollout_corr_ext import SamplingParams

    g = torch.Generator().manual_seed(4)
    b, s = 3, 7
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 2
    rollout = old - 0.2 * torch.randn(b, s, generator=g, dtype=torch.float64)
    mask = torch.ones(b, s, dtype=torch.float64)
    mask[2, 5:] = 0
    out_old = torch.zeros(b, s, dtype=torch.bool)
    out_old[0, 1] = True
    out_roll = torch.zeros(b, s, dtype=torch.bool)
    out_roll[1, 3] = out_roll[0, 6] = True
    old_inf, rollout_inf = old.masked_fill(out_old, -math.inf), rollout.masked_fill(out_roll, -math.inf)
    hand = mask.masked_fill(out_old | out_roll, 0)
    frac = (out_old | out_roll).sum().item() / mask.sum().item()
    with rv.configured(sampling=SamplingParams(top_p=0.9)):
        w1, m1 = rv.compute_rollout_correction_weights(old_inf - rollout_inf, mask, "token", 1.15)
        r1, n1 = rv.compute_rollout_rejection_mask(old_inf - rollout_inf, mask, "token_k1", "0.9_1.1")
        _, c1, _ = rv.compute_rollout_correction_and_rejection_mask(old_inf, rollout_inf, mask, None, None, False,
                                                                    "token_k1", "0.9_1.1")
        with pytest.raises(ValueError, match="NaN"):
            rv.compute_rollout_correction_weights((old_inf - rollout_inf).masked_fill(out_old, math.nan), mask)
    assert m1["sampling_out_of_support_fraction"] == pytest.approx(frac)
    assert n1["sampling_out_of_support_fraction"] == pytest.approx(frac)
    w2, _ = rv.compute_rollout_correction_weights(old - rollout, hand, "token", 1.15)
    r2, _ = rv.compute_rollout_rejection_mask(old - rollout, hand, "token_k1", "0.9_1.1")
    torch.testing.assert_close(w1 * hand, w2 * hand)
    assert torch.equal(r1, r2) and torch.equal(c1, r2)


@pytest.mark.parametrize("source", ["rollout_versions", "min_global_steps", "none"])
def test_add_to_batch_with_diagnostics_and_versions(V, source):
    """configure(diagnostics=...): the returned metrics are verl's plus the diagnostics' (equal to
    compute_rollout_correction with the same spec), the lags from the batch's per-row versions: our tensor key, or
    verl's fully-async ``min_global_steps`` with the trainer's version from ``meta_info["global_steps"]``."""
    import numpy as np

    from rollout_corr_ext import MismatchDiagnostics

    lp, rlp, mask = inputs(scale=0.3, seed=4)
    cfg = V.RCConfig.decoupled_token_is()
    rows = torch.arange(lp.shape[0]) % 3 + 5  # versions 5, 6, 7
    tensors = {"old_log_probs": lp.clone(), "rollout_log_probs": rlp.clone(), "response_mask": mask.clone()}
    non_tensors, meta = {}, {}
    if source == "rollout_versions":
        tensors["rollout_versions"] = rows.clone()
    elif source == "min_global_steps":
        non_tensors["min_global_steps"] = np.array(rows.tolist(), dtype=object)
        meta["global_steps"] = 7
    batch = V.DataProto.from_dict(tensors=tensors, non_tensors=non_tensors or None, meta_info=meta or None)
    spec = MismatchDiagnostics(top_k=0, max_lag=3)
    with rv.configured(diagnostics=spec, current_version=None if source == "min_global_steps" else 7):
        _, metrics = rv.compute_rollout_correction_and_add_to_batch(batch, cfg)
    want = compute_rollout_correction(lp, rlp, mask, rv.rollout_correction_config(cfg), diagnostics=dataclasses.replace(
        spec, versions=None if source == "none" else rows, current_version=None if source == "none" else 7))
    diag = {k: float(v) for k, v in want.metrics.items() if k.startswith("rollout_corr/by_") or k.endswith(
        ("reverse_kl", "js_divergence", "abs_log_ratio_mean", "staleness_mean"))}
    assert ("rollout_corr/staleness_mean" in diag) == (source != "none")
    for k, v in diag.items():
        assert math.isnan(v) and math.isnan(metrics[k]) or metrics[k] == pytest.approx(v, rel=1e-12), k
    if source != "none":
        assert metrics["rollout_corr/by_lag/2/tokens"] == float(mask[rows == 5].sum())
    with pytest.raises(TypeError, match="diagnostics must be a rollout_corr_ext.MismatchDiagnostics"):
        rv.configure(diagnostics=True)
    with pytest.raises(ValueError, match="leave its tensors None"):
        rv.configure(diagnostics=MismatchDiagnostics(entropy=lp))


def test_add_to_batch_versions_must_be_integers(V):
    """verl's ``min_global_steps`` and ``meta_info["global_steps"]`` are integer steps: None, NaN or 4.7 is refused
    by name (before: a raw numpy TypeError, an error about diagnostics.versions holding INT64_MIN, or 4.7 silently
    truncated to step 4; the verl-adapter fuzz); whole floats and integer arrays are taken."""
    import numpy as np

    from rollout_corr_ext import MismatchDiagnostics

    lp, rlp, mask = inputs(scale=0.3, seed=4)
    cfg = V.RCConfig.decoupled_token_is()
    b = lp.shape[0]

    def run(steps, current=7):
        batch = V.DataProto.from_dict(
            tensors={"old_log_probs": lp.clone(), "rollout_log_probs": rlp.clone(), "response_mask": mask.clone()},
            non_tensors={"min_global_steps": steps}, meta_info={"global_steps": current})
        with rv.configured(diagnostics=MismatchDiagnostics(top_k=0, max_lag=3)):
            return rv.compute_rollout_correction_and_add_to_batch(batch, cfg)[1]

    rows = [5 + i % 3 for i in range(b)]
    want = run(np.array(rows, dtype=np.int64))
    for same in (np.array(rows, dtype=object), np.array(rows, dtype=np.float64), np.array(rows, dtype=np.int32)):
        got = run(same)
        assert got["rollout_corr/by_lag/2/tokens"] == want["rollout_corr/by_lag/2/tokens"] == float(
            mask[torch.tensor(rows) == 5].sum())
    for bad, shown in ((None, "None"), (math.nan, "nan"), (4.7, "4.7"), (True, "True"), (1e300, "1e[+]300"),
                       (2 ** 64, str(2 ** 64))):
        steps = np.array(rows, dtype=object)
        steps[1] = bad
        with pytest.raises(ValueError, match=rf"min_global_steps'\] must hold one integer .* got {shown} at row 1"):
            run(steps)
    with pytest.raises(ValueError, match=r"min_global_steps.*got nan at row 1"):
        run(np.array([5.0, math.nan] + [5.0] * (b - 2)))
    # a layout that is not one value per row is refused by its shape, NaN in it or not (not as a row it lacks:
    # the review)
    for steps in (np.full((b, 2), 5.0), np.array([[5.0, math.nan]] * b)):
        with pytest.raises(ValueError, match=r"diagnostics.versions must have batch\['old_log_probs'\]'s shape"):
            run(steps)
    for current in (5.7, "7", 7.0):
        with pytest.raises(TypeError, match=r"batch.meta_info\['global_steps'\] must be an integer"):
            run(np.array(rows), current=current)
    for current in (np.int64(7), torch.tensor(7)):
        got = run(np.array(rows), current=current)
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] or math.isnan(got[k]) and math.isnan(want[k]) for k in want)


def _bad_steps_worker(rank, world, masked):
    """Rank 1's min_global_steps holds NaN at row 2 (with response tokens, or ``masked``: without any)."""
    import numpy as np
    import torch.distributed as dist
    from verl.protocol import DataProto

    from rollout_corr_ext import MismatchDiagnostics

    g = torch.Generator().manual_seed(rank)
    lp = -torch.rand(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    if masked:
        mask[2] = False
    steps = np.array([5.0, 6.0, math.nan if rank == 1 else 6.0, 7.0])

    def run(steps):
        batch = DataProto.from_dict(
            tensors={"old_log_probs": lp.clone(), "rollout_log_probs": lp - 0.05, "response_mask": mask.clone()},
            non_tensors={"min_global_steps": steps}, meta_info={"global_steps": 7})
        with rv.configured(dp_group=dist.group.WORLD, diagnostics=MismatchDiagnostics(top_k=0, max_lag=3)):
            return rv.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": "token",
                                                                          "rollout_is_threshold": 2.0})[1]

    if masked:  # a row without response tokens is never read: its version neither raises nor counts
        got = run(steps)
        want = run(np.where(np.isnan(steps), 5.0, steps))
        assert all(got[k] == want[k] or math.isnan(got[k]) and math.isnan(want[k]) for k in want)
        return
    with pytest.raises(ValueError) as exc:
        run(steps)
    if rank == 1:
        assert "min_global_steps'] must hold one integer policy version per row, got nan at row 2" in str(exc.value)
    else:
        assert "diagnostics.versions" in str(exc.value) and "other ranks" in str(exc.value)


@pytest.mark.parametrize("masked", [False, True], ids=["read", "masked"])
@pytest.mark.parametrize("device", dist_params(2, cuda_reason="the refusal is an asynchronous device assert"))
def test_bad_min_global_steps_on_one_rank_raises_on_every_rank(V, device, masked):
    """DP = 2, rank 1's min_global_steps with a NaN row: every rank raises (rank 1 naming the row; before, rank 1
    raised alone and rank 0 waited in the correction's all-reduce: a hang; the review), and a NaN at a row without
    response tokens is never read."""
    run_workers(_bad_steps_worker, 2, masked, device=device)


def test_replay_positions_count_in_the_whole_response(V):
    """configure(sampling=..., diagnostics=...): tokens outside the replayed kept set leave the correction, but the
    position breakdowns place the others by their place in the whole response, as megatron's loss_func does
    (``position_mask``; before: counted among the kept tokens only, so the last 5 of 10 tokens fell in deciles 0, 2,
    4, 6 and 8; the verl-adapter fuzz). Oracle: the deciles by hand."""
    from rollout_corr_ext import MismatchDiagnostics, SamplingParams

    T = 10
    old = torch.full((2, T), -1.0)
    ro = torch.full((2, T), -1.1)
    ro[0, :5] = -math.inf  # row 0: the first 5 tokens outside the kept set
    ro[1, 3] = -math.inf   # row 1: one token in the middle
    mask = torch.ones(2, T, dtype=torch.bool)
    batch = V.DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": ro, "response_mask": mask})
    with rv.configured(sampling=SamplingParams(top_p=0.9), diagnostics=MismatchDiagnostics(top_k=0)):
        _, met = rv.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": "token",
                                                                        "rollout_is_threshold": 2.0})
    # decile of position t in a response of 10 tokens: t (the kept tokens' positions in the whole row)
    want = [0.0] * 10
    for t in range(5, 10):
        want[t] += 1
    for t in range(10):
        want[t] += t != 3
    got = [met[f"rollout_corr/by_position_decile/d{i}/tokens"] for i in range(10)]
    assert got == want
    assert met["rollout_corr/sampling_out_of_support_fraction"] == pytest.approx(6 / 20)


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.float64], ids=str)
def test_fp64_row_means_divide_by_the_count_as_verl_does_for_the_mask_dtype(V, mask_dtype, default_dtype):
    """verl's masked_mean is sum / (count + 1e-8) with the count in the mask's dtype: a bool / int mask's count
    (int64 + 1e-8 -> torch's default dtype) and an fp32 mask's lose the 1e-8 to fp32 rounding, an fp64 count keeps
    it. With fp64 log-probs our row means added it in fp64 for every mask: a row of weights all exactly 1 had mean
    n / (n + 1e-8), counted below a lower bound of 1.0 (rollout_is_seq_fraction_low 1.0 against verl's 0.0), and a
    row whose mean k2 is exactly 0.125 was kept under a bound of 0.1249999999 that verl rejects it at (the verl
    config fuzz); under an fp64 default dtype verl keeps the 1e-8 for a bool / int mask too (the review)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        _row_means_as_verl(V, mask_dtype)
    finally:
        torch.set_default_dtype(before)


def _row_means_as_verl(V, mask_dtype):
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-1.0, -2.0, -0.5, -1.5], [-0.3, -0.7, -1.1, -0.2]],
                       dtype=torch.float64)
    roll = old.clone()
    roll[1] -= 0.5  # log-ratio 0.5 at every token: k2 = 0.125 exactly, its row mean too (verl's)
    roll[2] += torch.tensor([0.01, -0.02, 0.03, 0.0], dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=mask_dtype)
    mask[2, 3] = 0
    for kw in (dict(rollout_is="token", rollout_is_threshold=1.0),
               dict(rollout_is="token", rollout_is_threshold="1.0_2.0"),
               dict(rollout_rs="seq_mean_k2", rollout_rs_threshold=0.1249999999),
               dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,token_k2",
                    rollout_rs_threshold="0.9_1.7,0.2")):
        theirs = V.helper.compute_rollout_correction_and_rejection_mask(old, roll, mask.clone(), **kw)
        ours = rv.compute_rollout_correction_and_rejection_mask(old, roll, mask.clone(), **kw)
        assert_mask(ours[1], theirs[1])
        if theirs[0] is not None:
            torch.testing.assert_close(ours[0].batch["rollout_is_weights"], theirs[0].batch["rollout_is_weights"],
                                       rtol=1e-15, atol=0)
        assert list(ours[2]) == list(theirs[2])
        for k, v in theirs[2].items():  # the IS means exactly; verl takes its fractions' means in fp32
            tol = 0.0 if k in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_seq_mean") else \
                1e-7 if "fraction" in k or "ratio" in k else 1e-12
            assert math.isclose(ours[2][k], v, rel_tol=tol, abs_tol=tol), (kw, k, ours[2][k], v)
