"""Mismatch diagnostics (compute_rollout_correction(..., diagnostics=MismatchDiagnostics(...))): every metric against
an fp64 loop oracle written from the formulas in docs/rollout_correction.md, the divergence estimators against the
exact divergences of known distributions, the rejection bits against verl 0.9.1's own rejection function one
criterion at a time, packed equal to padded, DP = 2 and CP = 2 (gloo) equal to one process, and the histograms read
back by TensorBoard and accepted by W&B."""

from __future__ import annotations

import math
import os
import re
import time
import warnings

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext.observability import BREAKDOWNS, Histogram, MismatchDiagnostics, log_histograms
from rollout_corr_testing.dist_utils import dist_params, run_workers
from rollout_corr_testing.skips import verl_rollout_correction_fn

CFG = dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1,seq_mean_k3",
           rollout_rs_threshold="0.8_1.25,0.006", rollout_token_veto_threshold=0.82)


def _inputs(b=7, t=30, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rlp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.01
    lp = rlp + 0.12 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.25).long()
    mask[2, 10:] = 0
    mask[4] = 0  # a row without response tokens
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    turns = torch.randint(-1, 11, (b, t), generator=g)
    versions = 20 - torch.randint(0, 12, (b, t), generator=g)
    return lp.to(dtype), rlp.to(dtype), mask, entropy, turns, versions


def _spec(entropy, turns, versions, **kw):
    kw.setdefault("position_buckets", (4, 8, 16))
    kw.setdefault("top_k", 4)
    return MismatchDiagnostics(entropy=entropy, turn_ids=turns, versions=versions, current_version=20, **kw)


# --------------------------------------------------------------------------------------------- the loop oracle


def _oracle(lp, rlp, mask, entropy, turns, versions, spec, out_mask=None, weights=None, pos_mask=None):
    """Token by token in Python floats: the documented formulas and bucket rules (``out_mask`` / ``weights``: the
    correction's outputs, for the per-bucket rejected fraction and mean IS weight of the kept tokens; ``pos_mask``:
    the position_mask positions count among, a superset of ``mask``)."""
    lp, rlp = lp.double().tolist(), rlp.double().tolist()
    b, t = len(lp), len(lp[0])
    pos_mask = mask if pos_mask is None else pos_mask
    tok = []  # (row, position, lr, p, entropy, turn, lag, kept, weight)
    for i in range(b):
        j = 0
        for c in range(t):
            if mask[i][c]:
                kept = out_mask is None or bool(out_mask[i][c])
                w = None if weights is None else float(weights[i][c])
                tok.append((i, j, lp[i][c] - rlp[i][c], math.exp(lp[i][c]), float(entropy[i][c]), int(turns[i][c]),
                            20 - int(versions[i][c]), kept, w))
            j += int(bool(pos_mask[i][c]))
    n_row = [sum(1 for x in tok if x[0] == i) for i in range(b)]
    n_pos = [int(sum(bool(x) for x in pos_mask[i])) for i in range(b)]
    out = {}
    lrs = [x[2] for x in tok]
    n = len(lrs)
    ab = [abs(x) for x in lrs]
    mean = sum(ab) / n
    out["abs_log_ratio_mean"] = mean
    out["abs_log_ratio_max"] = max(ab)
    out["abs_log_ratio_std"] = math.sqrt(sum((a - mean) ** 2 for a in ab) / (n - 1))

    def c20(x):
        return max(-20.0, min(20.0, x))

    # reverse KL(p || q) = E_q[r log r] and JS from its definition with m = (p + q) / 2, per drawn token:
    # E_q[(1/2)(r log(r / m_r) + log(1 / m_r))], m_r = (1 + r) / 2
    out["reverse_kl"] = sum(math.exp(c20(x)) * c20(x) - math.exp(c20(x)) + 1 for x in lrs) / n
    out["js_divergence"] = sum(0.5 * (math.exp(c20(x)) * math.log(math.exp(c20(x)) / ((1 + math.exp(c20(x))) / 2))
                                      + math.log(1 / ((1 + math.exp(c20(x))) / 2))) for x in lrs) / n
    out["staleness_mean"] = sum(x[6] for x in tok) / n
    out["staleness_max"] = max(x[6] for x in tok)
    out["staleness_min"] = min(x[6] for x in tok)

    def bucket(fam, x):
        i, j, _, p, h, turn, lag = x[:7]
        if fam == "position_decile":
            return min(9, (10 * j) // n_pos[i])
        if fam == "position":
            return sum(1 for e in spec.position_buckets if j >= e)
        if fam == "probability":
            return min(spec.probability_bins - 1, int(p * spec.probability_bins))
        if fam == "entropy":
            return sum(1 for e in spec.entropy_edges if h >= e)
        if fam == "turn":
            return None if turn < 0 else min(turn, spec.max_turns)
        return min(lag, spec.max_lag + 1)

    for fam, labels in spec.bucket_labels().items():
        for k, lab in enumerate(labels):
            sel = [x for x in tok if bucket(fam, x) == k]
            key = f"by_{fam}/{lab}/"
            out[key + "tokens"] = float(len(sel))
            if sel:
                out[key + "abs_log_ratio"] = sum(abs(x[2]) for x in sel) / len(sel)
                out[key + "kl"] = sum(-x[2] for x in sel) / len(sel)
                out[key + "k3_kl"] = sum(math.expm1(x[2]) - x[2] for x in sel) / len(sel)  # unclamped, as k3_kl
                out[key + "rejected"] = sum(1 for x in sel if not x[7]) / len(sel)
            else:
                for s in ("abs_log_ratio", "kl", "k3_kl", "rejected"):
                    out[key + s] = math.nan
            if weights is not None:
                kept = [x[8] for x in sel if x[7]]
                out[key + "is_weight"] = sum(kept) / len(kept) if kept else math.nan
    rows = {"tokens": n_row, "log_ratio_sum": [], "abs_log_ratio_mean": [], "kl": [], "k3_kl": []}
    for i in range(b):
        sel = [x[2] for x in tok if x[0] == i]
        rows["log_ratio_sum"].append(sum(sel))
        nb = len(sel)
        rows["abs_log_ratio_mean"].append(sum(abs(x) for x in sel) / nb if nb else math.nan)
        rows["kl"].append(sum(-x for x in sel) / nb if nb else math.nan)
        rows["k3_kl"].append(sum(math.expm1(x) - x for x in sel) / nb if nb else math.nan)
    return out, rows


def _close(got, want, rel, key):
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), (key, got)
    else:
        assert got == pytest.approx(want, rel=rel, abs=rel * 1e-3), (key, got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_metrics_and_rows_equal_loop_oracle(dtype):
    lp, rlp, mask, ent, turns, versions = _inputs(dtype=dtype)
    spec = _spec(ent, turns, versions)
    before = [x.clone() for x in (lp, rlp, mask, ent, turns, versions)]
    res = rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(**CFG), diagnostics=spec)
    assert isinstance(res, rc.RolloutDiagnosticsResult)
    for a, b_ in zip(before, (lp, rlp, mask, ent, turns, versions)):
        assert torch.equal(a, b_)  # inputs untouched
    want, rows = _oracle(lp, rlp, mask, ent, turns, versions, spec, res.response_mask, res.weights)
    got = res.as_floats()
    for k, v in want.items():
        _close(got["rollout_corr/" + k], v, 1e-10, k)
    assert {f for f in BREAKDOWNS} == {k.split("/")[1][3:] for k in got if k.startswith("rollout_corr/by_")}
    d = res.diagnostics
    rel = 1e-10 if dtype == torch.float64 else 2e-5  # row values come from the kernels' fp32 row sums
    assert d.rows["tokens"].tolist() == rows["tokens"]
    for k in ("log_ratio_sum", "abs_log_ratio_mean", "kl", "k3_kl"):
        for i, (g_, w_) in enumerate(zip(d.rows[k].tolist(), rows[k])):
            _close(g_, w_, rel, (k, i))
    assert d.rows["global_row"].tolist() == list(range(lp.shape[0]))
    # the worst rows: the largest mean |lr|, in order
    order = sorted((i for i in range(lp.shape[0]) if rows["tokens"][i]), key=lambda i: -rows["abs_log_ratio_mean"][i])
    assert d.worst["global_row"].tolist() == order[:4]
    for k in ("tokens", "log_ratio_sum", "kl", "k3_kl", "reject_bits"):
        assert torch.equal(d.worst[k], d.rows[k][order[:4]].to(d.worst[k].dtype)), k


def test_position_mask_positions_count_in_the_whole_response():
    """position_mask (megatron's loss_func passes its caller's mask when sampling replay leaves tokens out): the
    position breakdowns read each counted token's place among the position_mask's tokens (given or derived), against
    the loop oracle; a counted token outside it is refused by name."""
    lp, rlp, mask, ent, turns, versions = _inputs(seed=11)
    g = torch.Generator().manual_seed(3)
    part = mask * (torch.rand(mask.shape, generator=g) > 0.4).long()  # the correction's tokens: a part of mask
    cfg = rc.RolloutCorrectionConfig(**CFG)
    for positions in (None, torch.cumsum(mask, 1) - 1):
        spec = _spec(ent, turns, versions, positions=positions, position_mask=mask)
        res = rc.compute_rollout_correction(lp, rlp, part, cfg, diagnostics=spec)
        want, _ = _oracle(lp, rlp, part, ent, turns, versions, spec, res.response_mask, res.weights, pos_mask=mask)
        got = res.as_floats()
        for k, v in want.items():
            _close(got["rollout_corr/" + k], v, 1e-10, k)
    # without it, a position past the part's count is the documented refusal, and the deciles read the part
    with pytest.raises(ValueError, match="diagnostics.positions at response token"):
        rc.compute_rollout_correction(lp, rlp, part, cfg, diagnostics=_spec(ent, turns, versions,
                                                                            positions=torch.cumsum(mask, 1) - 1))
    outside = mask.clone()
    outside[0, mask[0].nonzero()[0]] = 0
    part[0, mask[0].nonzero()[0]] = 1
    with pytest.raises(ValueError, match=r"diagnostics.position_mask at response token \(0, \d+\) is 0"):
        rc.compute_rollout_correction(lp, rlp, part, cfg, diagnostics=_spec(ent, turns, versions,
                                                                            position_mask=outside))


def test_a_token_excluded_as_nonfinite_keeps_the_places_of_the_others():
    """nonfinite="exclude" drops a token from the statistics, not from the response: positions count among the
    response tokens (mask != 0), as documented, derived or given (as under CP). The derived ones counted the finite
    tokens only, and the documented positions were refused as past that count (the review of the day)."""
    lp, rlp, mask, ent, turns, versions = _inputs(seed=12)
    lp = lp.clone()
    lp[0, mask[0].nonzero()[:3, 0]] = float("nan")  # the first three response tokens of row 0
    cfg = rc.RolloutCorrectionConfig(**CFG)
    finite = mask * torch.isfinite(lp).long()
    for positions in (None, torch.cumsum(mask, 1) - 1):
        spec = _spec(ent, turns, versions, positions=positions)
        res = rc.compute_rollout_correction(lp, rlp, mask, cfg, nonfinite="exclude", diagnostics=spec)
        want, _ = _oracle(lp, rlp, finite, ent, turns, versions, spec, res.response_mask, res.weights, pos_mask=mask)
        got = res.as_floats()
        for k, v in want.items():
            if k.startswith("by_position"):
                _close(got["rollout_corr/" + k], v, 1e-10, k)


def test_large_log_ratios_keep_rows_and_buckets_equal_to_the_batch():
    """|lr| > 20: the breakdowns' and the rows' kl / k3_kl are the batch's terms on the unclamped lr, so one
    probability bucket over the whole batch equals the batch metrics, and a row's kl is -log_ratio_mean (before:
    the RS statistics' clamp to +-20 gave k3 2.4e8 against 5.3e12); the loop oracle checks the rest."""
    lp = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -3.0, -1.0]], dtype=torch.float64)
    rlp = torch.tensor([[-31.0, -1.0, -2.5], [-0.2, 22.0, -1.0]], dtype=torch.float64)  # lr = 30 and -25
    mask = torch.ones(2, 3, dtype=torch.long)
    spec = MismatchDiagnostics(probability_bins=1, position_buckets=(), top_k=2)
    res = rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(rollout_is=None, rollout_rs=None),
                                        diagnostics=spec)
    m, rows = res.as_floats(), res.diagnostics.rows
    lr = (lp - rlp).reshape(-1).tolist()
    for key, term in (("kl", lambda x: -x), ("k3_kl", lambda x: math.expm1(x) - x)):
        want = sum(term(x) for x in lr) / len(lr)
        assert m["rollout_corr/" + key] == pytest.approx(want, rel=1e-6)
        assert m[f"rollout_corr/by_probability/0-1/{key}"] == pytest.approx(want, rel=1e-12)
        for i in range(2):
            assert float(rows[key][i]) == pytest.approx(sum(term(x) for x in lr[3 * i:3 * i + 3]) / 3, rel=1e-12)
    assert torch.equal(rows["kl"], -rows["log_ratio_mean"])


def test_abs_log_ratio_std_of_a_small_spread():
    """|lr| = 12 +- 1e-7 and a constant |lr|: the std from sums centred per rank (before: one-pass sums gave 0.0
    against 9.95e-8, and 5.3e-9 for a constant)."""
    g = torch.Generator().manual_seed(2)
    rlp = -torch.rand(8, 64, generator=g, dtype=torch.float64) - 13.0
    mask = torch.ones(8, 64, dtype=torch.long)
    spec = MismatchDiagnostics(top_k=0)
    cfg = rc.RolloutCorrectionConfig(rollout_is=None, rollout_rs=None)
    for lr in (12.0 + 1e-7 * torch.randn(8, 64, generator=g, dtype=torch.float64),
               torch.full((8, 64), 0.3, dtype=torch.float64)):
        res = rc.compute_rollout_correction(rlp + lr, rlp, mask, cfg, diagnostics=spec)
        want = float(((rlp + lr) - rlp).abs().std())
        got = float(res.metrics["rollout_corr/abs_log_ratio_std"])
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15), (got, want)


def test_bucket_labels_are_distinct():
    """Labels name metric keys: fine probability bins or close entropy edges get more digits (before: 1987 keys for
    2000 buckets, their tokens summing to more than the batch); the default labels are unchanged; position edges
    are token positions (ints)."""
    spec = MismatchDiagnostics(probability_bins=2000, entropy=torch.zeros(1), entropy_edges=(0.5, 0.5000001, 0.6))
    labels = spec.bucket_labels()
    for fam in ("probability", "entropy"):
        assert len(set(labels[fam])) == len(labels[fam]), fam
    assert labels["entropy"][:2] == ["0-0.5", "0.5-0.5000001"]
    default = MismatchDiagnostics(entropy=torch.zeros(1)).bucket_labels()
    assert default["probability"][:2] == ["0-0.1", "0.1-0.2"] and default["entropy"][:2] == ["0-0.1", "0.1-0.5"]
    lp, rlp, mask, *_ = _inputs()
    res = rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(rollout_is=None, rollout_rs=None),
                                        diagnostics=MismatchDiagnostics(probability_bins=2000, top_k=0))
    counts = [v for k, v in res.as_floats().items() if k.startswith("rollout_corr/by_probability/") and
              k.endswith("/tokens")]
    assert len(counts) == 2000 and sum(counts) == int(mask.sum())
    with pytest.raises(ValueError, match="position_buckets must be whole numbers"):
        MismatchDiagnostics(position_buckets=(10.5, 20))
    assert MismatchDiagnostics(position_buckets=(64.0, 128)).bucket_labels()["position"] == ["0-63", "64-127", "128+"]


def test_estimators_converge_to_the_exact_divergences():
    """Tokens drawn from q over a 6-token vocabulary: the estimators' means are the exact reverse KL(p || q) and
    Jensen-Shannon divergence of p and q (to sampling error), and kl / k3_kl the forward KL(q || p)."""
    g = torch.Generator().manual_seed(11)
    p = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05], dtype=torch.float64)
    q = torch.tensor([0.22, 0.28, 0.15, 0.17, 0.10, 0.08], dtype=torch.float64)
    y = torch.multinomial(q, 400_000, replacement=True, generator=g).reshape(400, 1000)
    lp, rlp = p.log()[y], q.log()[y]
    res = rc.compute_rollout_correction(lp, rlp, torch.ones_like(y), rc.RolloutCorrectionConfig.disabled(),
                                        diagnostics=MismatchDiagnostics(top_k=0))
    m = res.as_floats()
    mix = (p + q) / 2
    exact = {"reverse_kl": float((p * (p / q).log()).sum()),
             "js_divergence": float(0.5 * (p * (p / mix).log()).sum() + 0.5 * (q * (q / mix).log()).sum()),
             "kl": float((q * (q / p).log()).sum()), "k3_kl": float((q * (q / p).log()).sum())}
    r = (lp - rlp).exp()
    per_token = {"reverse_kl": r * (lp - rlp) - (r - 1), "kl": -(lp - rlp), "k3_kl": r - 1 - (lp - rlp),
                 "js_divergence": 0.5 * (r * (lp - rlp) - (1 + r) * ((1 + r) / 2).log())}
    for k, want in exact.items():
        se = float(per_token[k].std()) / math.sqrt(y.numel())
        assert abs(m["rollout_corr/" + k] - want) < 5 * se + 1e-12, (k, m["rollout_corr/" + k], want, se)
    assert 0 < m["rollout_corr/js_divergence"] < math.log(2)


# ------------------------------------------------------------------------------------------ rejection bits


@pytest.mark.parametrize("rs,spec", [("token_k1,seq_mean_k3", "0.8_1.25,0.006"),
                                     ("seq_sum_k1,token_k3,seq_max_k2", "0.6_1.6,0.02,0.03")])
def test_reject_bits_equal_verl_one_criterion_at_a_time(rs, spec):
    verl_fn = verl_rollout_correction_fn()
    lp, rlp, mask, *_ = _inputs(seed=4)
    cfg = dict(rollout_is=None, rollout_rs=rs, rollout_rs_threshold=spec, rollout_token_veto_threshold=0.75)
    res = rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(**cfg),
                                        diagnostics=MismatchDiagnostics(top_k=0))
    d = res.diagnostics
    names = rs.split(",")
    assert d.reject_bit_names == tuple(names) + ("veto",)
    bits = d.rows["reject_bits"]
    maskf = mask.double()
    for i, (name, s) in enumerate(zip(names, spec.split(","))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, v_mask, _ = verl_fn(lp, rlp, maskf, rollout_is=None, rollout_rs=name, rollout_rs_threshold=s)
        lost = ((maskf - v_mask) > 0).any(1)  # verl dropped a response token of the row under this criterion alone
        assert torch.equal((bits >> i) & 1 == 1, lost), (name, bits, lost)
    veto = ((lp - rlp).exp() < 0.75).logical_and(mask.bool()).any(1)  # a valid token with ratio below V
    assert torch.equal((bits >> len(names)) & 1 == 1, veto)
    # and the rows any criterion names are exactly the rows the correction's mask cut
    assert torch.equal(bits != 0, (res.response_mask != mask).any(1))
    assert bool((bits != 0).any()) and bool((bits == 0).any())  # the case decides something


# ------------------------------------------------------------------------------------- layouts and groups


def _packed(lp, rlp, mask, ent, turns, versions):
    """The rows' first L_b tokens back to back (L_b: each row's last response position + 1, ragged)."""
    keep = [int(mask[i].nonzero().max()) + 1 if mask[i].any() else 3 for i in range(mask.shape[0])]
    cat = [torch.cat([x[i, :k] for i, k in enumerate(keep)]) for x in (lp, rlp, mask, ent, turns, versions)]
    cu = torch.tensor([0] + keep).cumsum(0).to(torch.int32)
    return cat, cu


def test_packed_equals_padded():
    lp, rlp, mask, ent, turns, versions = _inputs(seed=2)
    cfg = rc.RolloutCorrectionConfig(**CFG)
    want = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, versions))
    (plp, prlp, pmask, pent, pturns, pver), cu = _packed(lp, rlp, mask, ent, turns, versions)
    got = rc.compute_rollout_correction(plp, prlp, pmask, cfg, cu_seqlens=cu, diagnostics=_spec(pent, pturns, pver))
    _same(got, want, rel=1e-12)
    # per-row versions [B] are broadcast along each segment
    row_v = versions[:, 0]
    want_r = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, row_v))
    got_r = rc.compute_rollout_correction(plp, prlp, pmask, cfg, cu_seqlens=cu, diagnostics=_spec(pent, pturns, row_v))
    _same(got_r, want_r, rel=1e-12)


def _same(got, want, rel):
    g, w = got.as_floats(), want.as_floats()
    assert set(g) == set(w)
    for k in w:
        _close(g[k], w[k], rel, k)
    for k, v in want.diagnostics.rows.items():
        assert torch.allclose(got.diagnostics.rows[k].double(), v.double(), rtol=rel, atol=0, equal_nan=True), k
    for k, v in want.diagnostics.worst.items():
        assert torch.allclose(got.diagnostics.worst[k].double(), v.double(), rtol=rel, atol=0, equal_nan=True), k
    for k, h in want.diagnostics.histograms.items():
        o = got.diagnostics.histograms[k]
        assert torch.equal(o.counts, h.counts) and torch.equal(o.edges, h.edges), k
        for f in ("num", "min", "max", "sum", "sum_squares"):
            _close(float(getattr(o, f)), float(getattr(h, f)), rel, (k, f))


def _dp_worker(rank, world, lp, rlp, mask, ent, turns, versions):
    import torch.distributed as dist

    cfg = rc.RolloutCorrectionConfig(**CFG)
    want = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, versions))
    rows = slice(0, 2) if rank == 0 else slice(2, None)  # uneven split
    got = rc.compute_rollout_correction(*(x[rows] for x in (lp, rlp, mask)), cfg, dp_group=dist.group.WORLD,
                                        diagnostics=_spec(*(x[rows] for x in (ent, turns, versions))))
    g, w = got.as_floats(), want.as_floats()
    for k in w:
        _close(g[k], w[k], 1e-12, k)
    d, e = got.diagnostics, want.diagnostics
    assert d.rows["global_row"].tolist() == list(range(lp.shape[0]))[rows]
    for k, v in e.rows.items():
        assert torch.allclose(d.rows[k].double(), v[rows].double(), rtol=1e-12, equal_nan=True), k
    for k, v in e.worst.items():  # the same worst rows of the whole batch on every rank
        assert torch.allclose(d.worst[k].double(), v.double(), rtol=1e-12, equal_nan=True), k
    for k, h in e.histograms.items():
        assert torch.equal(d.histograms[k].counts, h.counts), k
    # more worst slots than rows with response tokens (6 of 7): the empty slots read alike (global_row -1, 0 tokens,
    # NaN values; over ranks they held 0 where one process held the empty row's NaN)
    want = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, versions, top_k=9))
    got = rc.compute_rollout_correction(*(x[rows] for x in (lp, rlp, mask)), cfg, dp_group=dist.group.WORLD,
                                        diagnostics=_spec(*(x[rows] for x in (ent, turns, versions)), top_k=9))
    e, d = want.diagnostics.worst, got.diagnostics.worst
    assert e["global_row"].tolist()[6:] == [-1] * 3 and 4 not in e["global_row"].tolist()
    for k, v in e.items():
        assert torch.equal(d[k].isnan(), v.isnan()) if v.is_floating_point() else True, k
        assert torch.allclose(d[k].double(), v.double(), rtol=1e-12, equal_nan=True), k
    assert bool(e["kl"][6:].isnan().all()) and e["tokens"][6:].tolist() == [0] * 3


@pytest.mark.parametrize("device", dist_params(2))
def test_dp2_equals_one_process(device):
    run_workers(_dp_worker, 2, *_inputs(seed=5), device=device)


def _cp_worker(rank, world, lp, rlp, mask, ent, turns, versions):
    import torch.distributed as dist

    cfg = rc.RolloutCorrectionConfig(**CFG)
    want = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, versions))
    positions = torch.cumsum(mask, 1) - 1  # each token's index among its row's response tokens
    t = lp.shape[1]
    cols = slice(0, t // 2) if rank == 0 else slice(t // 2, None)
    sl = [x[:, cols].contiguous() for x in (lp, rlp, mask, ent, turns, versions, positions)]
    got = rc.compute_rollout_correction(sl[0], sl[1], sl[2], cfg, seq_group=dist.group.WORLD,
                                        diagnostics=_spec(sl[3], sl[4], sl[5], positions=sl[6]))
    _same(got, want, rel=1e-12)
    # a part of the mask counted, positions among the whole mask's tokens (megatron's loss_func with sampling replay)
    part = mask * (torch.arange(t) % 3 != 1).long()
    want = rc.compute_rollout_correction(lp, rlp, part, cfg, diagnostics=_spec(ent, turns, versions,
                                                                               position_mask=mask))
    got = rc.compute_rollout_correction(sl[0], sl[1], part[:, cols].contiguous(), cfg, seq_group=dist.group.WORLD,
                                        diagnostics=_spec(sl[3], sl[4], sl[5], positions=sl[6], position_mask=sl[2]))
    _same(got, want, rel=1e-12)
    with pytest.raises(ValueError, match="diagnostics.positions is required under context parallelism"):
        rc.compute_rollout_correction(sl[0], sl[1], sl[2], cfg, seq_group=dist.group.WORLD,
                                      diagnostics=_spec(sl[3], sl[4], sl[5]))


@pytest.mark.parametrize("device", dist_params(2))
def test_cp2_equals_one_process(device):
    run_workers(_cp_worker, 2, *_inputs(seed=6, dtype=torch.float64), device=device)


def test_nonfinite_excluded_tokens_do_not_leak():
    lp, rlp, mask, ent, turns, versions = _inputs(seed=7)
    cfg = rc.RolloutCorrectionConfig(**CFG)
    bad = lp.clone()
    bad[0, 3], bad[1, 5] = math.nan, -math.inf
    mask[0, 3] = mask[1, 5] = 1
    got = rc.compute_rollout_correction(bad, rlp, mask, cfg, nonfinite="exclude",
                                        diagnostics=_spec(ent, turns, versions))
    cut = mask.clone()
    cut[0, 3] = cut[1, 5] = 0
    want = rc.compute_rollout_correction(lp, rlp, cut, cfg, diagnostics=_spec(ent, turns, versions))
    g, w = got.as_floats(), want.as_floats()
    for k in w:
        if "by_position" in k or k.endswith("nonfinite_token_fraction"):
            continue  # positions count the excluded tokens' places differently only by the excluded token itself
        _close(g[k], w[k], 1e-12, k)
    assert all(math.isfinite(v) or "by_" in k for k, v in g.items())


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["log_prob", "rollout_log_prob"])
def test_nonfinite_valid_token_is_the_named_error_with_diagnostics(which, value):
    """nonfinite='error' with diagnostics: the call's own named error, as without them (a NaN log-prob reached the
    probability bucket's int64 cast first: an index out of bounds)."""
    lp, rlp, mask, ent, turns, versions = _inputs(seed=3)
    at = tuple(mask.bool().nonzero()[1].tolist())
    inputs = {"log_prob": lp.clone(), "rollout_log_prob": rlp.clone()}
    inputs[which][at] = value
    with pytest.raises(ValueError, match=r"hold NaN or \+-inf at valid response_mask positions"):
        rc.compute_rollout_correction(inputs["log_prob"], inputs["rollout_log_prob"], mask,
                                      rc.RolloutCorrectionConfig(**CFG), diagnostics=_spec(ent, turns, versions))


# ----------------------------------------------------------------------------------------------- histograms


def _hist_result():
    lp, rlp, mask, ent, turns, versions = _inputs(seed=8)
    return rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(**CFG),
                                         diagnostics=_spec(ent, turns, versions)), lp, rlp, mask


def test_histograms_hold_the_values():
    res, lp, rlp, mask = _hist_result()
    h = res.diagnostics.histograms["log_ratio"]
    lr = (lp - rlp)[mask.bool()]
    assert float(h.num) == lr.numel() == float(h.counts.sum())
    assert float(h.min) == float(lr.min()) and float(h.max) == float(lr.max())
    assert float(h.sum) == pytest.approx(float(lr.sum()), rel=1e-12)
    assert float(h.sum_squares) == pytest.approx(float((lr * lr).sum()), rel=1e-12)
    want = torch.histogram(lr, bins=h.edges).hist  # the same edges, torch's own binning
    assert torch.equal(h.counts, want)
    w = res.weights[res.response_mask.bool()].double()
    hw = res.diagnostics.histograms["is_weight"]
    assert float(hw.num) == w.numel() and float(hw.max) == float(w.max()) and float(hw.min) == float(w.min())
    assert torch.equal(hw.counts, torch.histogram(w, bins=hw.edges).hist)
    t = h.trimmed(7)
    assert t.counts.numel() <= 7 and float(t.counts.sum()) == lr.numel()
    assert float(t.edges[0]) <= float(lr.min()) and float(t.edges[-1]) >= float(lr.max())


def test_weight_statistics_follow_batch_normalisation():
    """With rollout_is_batch_normalize the returned weights are scaled after the reduce: the histogram and the
    per-bucket mean weight describe those returned weights."""
    lp, rlp, mask, ent, turns, versions = _inputs(seed=12)
    cfg = rc.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    res = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, versions))
    want, _ = _oracle(lp, rlp, mask, ent, turns, versions, _spec(ent, turns, versions), res.response_mask, res.weights)
    got = res.as_floats()
    assert got["rollout_corr/rollout_is_batch_norm_factor"] != pytest.approx(1.0, abs=1e-6)
    for k, v in want.items():
        if k.endswith("is_weight"):
            _close(got["rollout_corr/" + k], v, 1e-6, k)  # the returned weights are fp32-rounded after the scale
    h = res.diagnostics.histograms["is_weight"]
    w = res.weights[res.response_mask.bool()].double()
    assert float(h.max) == pytest.approx(float(w.max()), rel=1e-6) and float(h.sum) == pytest.approx(
        float(w.sum()), rel=1e-6)
    assert torch.equal(h.counts, torch.histogram(w, bins=h.edges).hist)  # the edges moved with the weights


def test_histograms_read_back_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="the histogram helpers are tested against TensorBoard (test extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    res, lp, rlp, mask = _hist_result()
    with SummaryWriter(str(tmp_path)) as writer:
        log_histograms(res, step=7, tensorboard=writer)
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    acc.Reload()
    assert set(acc.Tags()["histograms"]) == {"rollout_corr/log_ratio", "rollout_corr/is_weight"}
    ev = acc.Histograms("rollout_corr/log_ratio")[0]
    h = res.diagnostics.histograms["log_ratio"].trimmed()
    assert ev.step == 7
    v = ev.histogram_value
    assert (v.min, v.max, v.num) == (float(h.min), float(h.max), float(h.num))
    assert v.sum == pytest.approx(float(h.sum)) and v.sum_squares == pytest.approx(float(h.sum_squares))
    assert list(v.bucket) == h.counts.tolist()
    assert list(v.bucket_limit) == pytest.approx(h.edges[1:].tolist())


def test_histograms_accepted_by_wandb(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the histogram helpers are tested against W&B (test extra)")
    res, *_ = _hist_result()
    h = res.diagnostics.histograms["log_ratio"]
    big = Histogram(h.edges, h.counts, h.num, h.min, h.max, h.sum, h.sum_squares)
    wh = big.to_wandb()
    t = big.trimmed(512)
    assert isinstance(wh, wandb.Histogram)
    assert wh.histogram == pytest.approx(t.counts.tolist()) and wh.bins == pytest.approx(t.edges.tolist())
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="rollout-corr-test")
    try:
        log_histograms(res, step=3, wandb_run=run)
    finally:
        run.finish()
        wandb.teardown()  # stops W&B's service process, which writes the run file: everything is on disk after it
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".wandb")]
    assert files, "no offline run file written"
    blob = b""
    for _ in range(60):  # and should the service still be writing on a starved machine, give it a minute
        blob = open(files[0], "rb").read()
        if b"rollout_corr/log_ratio" in blob:
            break
        time.sleep(1)
    assert b"rollout_corr/log_ratio" in blob and b"histogram" in blob


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_inputs_raise_named_errors():
    lp, rlp, mask, ent, turns, versions = _inputs()
    cfg = rc.RolloutCorrectionConfig(**CFG)

    def run(**kw):
        return rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=MismatchDiagnostics(**kw))

    with pytest.raises(ValueError, match="diagnostics.entropy must have log_prob's shape"):
        run(entropy=ent[:, :3])
    nan_ent = ent.clone()
    nan_ent[tuple(mask.bool().nonzero()[0].tolist())] = math.nan
    with pytest.raises(ValueError, match=r"diagnostics.entropy at response token .* must be finite"):
        run(entropy=nan_ent)
    with pytest.raises(TypeError, match="diagnostics.turn_ids must be an integer tensor"):
        run(turn_ids=turns.double())
    with pytest.raises(ValueError, match="diagnostics.positions must have log_prob's shape"):
        run(positions=turns[:2])
    # a position outside [0, the row's response tokens) at a response token: no bucket holds it (it was clamped into
    # the first or last decile and the first position bucket, silently)
    derived = (torch.cumsum((mask != 0).long(), dim=1) - 1).clamp(min=0)
    run(positions=derived)  # the positions the mask implies are accepted
    at = tuple(mask.bool().nonzero()[0].tolist())
    for wrong in (-1, int((mask[at[0]] != 0).sum())):
        bad = derived.clone()
        bad[at] = wrong
        with pytest.raises(ValueError, match=rf"diagnostics.positions at response token {re.escape(str(at))} is "
                                             rf"{wrong}, outside \[0, "):
            run(positions=bad)
    with pytest.raises(ValueError, match=r"diagnostics.versions at response token .* newer than current_version 5"):
        run(versions=versions, current_version=5)
    with pytest.raises(ValueError, match="go together"):
        MismatchDiagnostics(versions=versions)
    for wrong in (-1, 2 ** 63):  # 2**63 gave a staleness mean of 9.2e18, silently (the review)
        with pytest.raises(ValueError, match=r"diagnostics.current_version must be in \[0, 2\*\*63\)"):
            MismatchDiagnostics(versions=versions, current_version=wrong)
    with pytest.raises(ValueError, match="diagnostics.position_buckets must be strictly increasing"):
        MismatchDiagnostics(position_buckets=(8, 4))
    with pytest.raises(ValueError, match="diagnostics.top_k must be an int"):
        MismatchDiagnostics(top_k=-1)
    with pytest.raises(TypeError, match="diagnostics must be a MismatchDiagnostics"):
        rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics={"top_k": 3})
    with pytest.raises(ValueError, match="give tensorboard="):
        log_histograms(run().diagnostics)


def _dp_cp_worker(rank, world, lp, rlp, mask, ent, turns, versions):
    """DP = 2 x CP = 2: context-parallel pairs (0, 1) and (2, 3), data-parallel halves of the rows."""
    import torch.distributed as dist

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    seq_group = cp_groups[rank // 2]
    cfg = rc.RolloutCorrectionConfig(**CFG)
    want = rc.compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=_spec(ent, turns, versions))
    positions = torch.cumsum(mask, 1) - 1
    rows = slice(0, 3) if rank < 2 else slice(3, None)
    t = lp.shape[1]
    cols = slice(0, t // 2) if rank % 2 == 0 else slice(t // 2, None)
    sl = [x[rows, cols].contiguous() for x in (lp, rlp, mask, ent, turns, versions, positions)]
    got = rc.compute_rollout_correction(sl[0], sl[1], sl[2], cfg, seq_group=seq_group, dp_group=dist.group.WORLD,
                                        diagnostics=_spec(sl[3], sl[4], sl[5], positions=sl[6]))
    g, w = got.as_floats(), want.as_floats()
    for k in w:
        _close(g[k], w[k], 1e-12, k)
    d, e = got.diagnostics, want.diagnostics
    assert d.rows["global_row"].tolist() == list(range(lp.shape[0]))[rows]  # the same ids on both CP ranks
    for k, v in e.rows.items():
        assert torch.allclose(d.rows[k].double(), v[rows].double(), rtol=1e-12, equal_nan=True), k
    for k, v in e.worst.items():
        assert torch.allclose(d.worst[k].double(), v.double(), rtol=1e-12, equal_nan=True), k


@pytest.mark.parametrize("device", dist_params(4))
def test_dp2_cp2_equals_one_process(device):
    run_workers(_dp_cp_worker, 4, *_inputs(seed=9), device=device)


def _one_rank_bad_worker(rank, world, lp, rlp, mask, ent, turns, versions):
    """DP = 2, a bad value (an entropy, a position, a version) on rank 1's rows only: both ranks raise, rank 1
    naming the token, rank 0 the count on the other rank; then both go on to the same next collective."""
    import torch.distributed as dist

    cfg = rc.RolloutCorrectionConfig(**CFG)
    rows = slice(0, 3) if rank == 0 else slice(3, None)
    sl = [x[rows].clone() for x in (lp, rlp, mask, ent, turns, versions)]
    positions = (torch.cumsum((sl[2] != 0).long(), dim=1) - 1).clamp(min=0)
    at = tuple(sl[2].bool().nonzero()[0].tolist())
    for field, value, named in (("entropy", math.nan, "diagnostics.entropy at response token"),
                                ("positions", -1, "diagnostics.positions at response token"),
                                ("versions", 21, "diagnostics.versions at response token")):
        spec = dict(entropy=sl[3], turn_ids=sl[4], versions=sl[5], positions=positions)
        if rank == 1:
            spec[field] = spec[field].clone()
            spec[field][at] = value
        with pytest.raises(ValueError, match=named if rank == 1 else "response tokens of other ranks"):
            rc.compute_rollout_correction(sl[0], sl[1], sl[2], cfg, dp_group=dist.group.WORLD,
                                          diagnostics=MismatchDiagnostics(current_version=20, **spec))
        check = torch.tensor([float(rank + 1)])
        dist.all_reduce(check)  # the ranks are still in step
        assert float(check) == 3.0, field
    # one rank passes positions, the other not: partials of one size, and both ranks refuse the mismatch (the extra
    # check slot came with positions only: partials of two sizes in one collective)
    spec = dict(entropy=sl[3], turn_ids=sl[4], versions=sl[5], positions=positions if rank == 0 else None)
    with pytest.raises(ValueError, match="different rollout-correction settings"):
        rc.compute_rollout_correction(sl[0], sl[1], sl[2], cfg, dp_group=dist.group.WORLD,
                                      diagnostics=MismatchDiagnostics(current_version=20, **spec))


def test_a_bad_diagnostics_value_on_one_rank_is_refused_on_every_rank():
    run_workers(_one_rank_bad_worker, 2, *_inputs(seed=4))
