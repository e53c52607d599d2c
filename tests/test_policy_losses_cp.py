"""The whole-batch policy losses (``geo_mean``, ``clip_cov``, ``kl_cov``) under context parallelism (issue #30).

A sequence split over the ranks of ``seq_group`` (padded ``[B, T]`` pieces of the same rows, or packed ``[T]``
streams whose segments are pieces of the same sequences) must give what one process gives on the whole sequences:

* the CP ranks' losses add up to the one-process loss (each returns its share), each rank's gradient is the
  one-process gradient on its own tokens, and the metrics are the one-process values on every rank: through
  ``compute_policy_loss`` / ``policy_step`` (CP = 2, and DP = 2 x CP = 2, where each DP rank keeps its own micro-batch
  loss, as in verl) and through megatron's ``loss_func`` (its ``loss_sum / num_tokens`` contract reduced as megatron
  reduces it, with and without ``calculate_per_token_loss``);
* clip_cov / kl_cov pick their tokens from the whole micro-batch: the inputs put five tokens with one exactly equal
  covariance across the selection boundary (in two rows, on both CP ranks), and the one-process selection itself is
  checked against an fp64 oracle of the documented tie rule (score descending, then the earlier token).

The reference is always one process on the whole batch, computed in the worker before any group is used.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
import types

import pytest
import torch
import torch.distributed as dist

from rollout_corr_ext import losses
from rollout_corr_ext.config import RolloutCorrectionConfig
from rollout_corr_testing.dist_utils import cp_token_index, dist_params, run_workers

NAMES = list(losses.WHOLE_BATCH_LOSSES)
MODES = list(losses.LOSS_AGG_MODES)
B, T, V = 6, 16, 11
#: Tokens with one exactly equal covariance: rows 1 and 4 share their advantage, these tokens their log-prob. Their
#: order by (row, CP rank, position in the piece) is their sequence order both when the ranks hold the two halves
#: and under megatron's load-balanced chunks (rank 0: chunks 0 and 3, rank 1: chunks 1 and 2 of 4 at T = 16).
TIES = [(1, 2), (1, 5), (1, 9), (4, 3), (4, 14)]
#: The selection takes the first two, (1, 2) and (1, 5): on two ranks under megatron's chunks; when the ranks hold
#: halves, the next tie (1, 9) is on the other rank.
TIE_CUT = 2


# ----------------------------------------------------------------------------------------- inputs and oracles


def _batch(seed: int = 0):
    """fp64 ``old, lp, adv, mask, w`` [B, T]: a padding-only row, a row whose response lies in the first chunk only,
    token-level advantages in row 0, and the tie group of :data:`TIES`."""
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5 + 0.05)
    lp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-0.05)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    adv[0, :5] = torch.randn(5, generator=g, dtype=torch.float64)
    adv[1] = adv[4] = 2.5
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).double()
    mask[1] = mask[4] = 1.0
    mask[2] = 0.0  # no response token
    mask[3, 4:] = 0.0  # response in the first chunk only: the other CP rank holds none of it
    for i, (b, t) in enumerate(TIES):  # equal (A, lp): equal covariance; ratio < 1 with A > 0: never clipped
        lp[b, t] = -0.02
        old[b, t] = -0.02 + 0.011 * (i + 1)
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 1.5 + 0.25
    return old, lp, adv, mask, w


def _cov(lp, adv, mask):
    """The covariance clip_cov / kl_cov rank tokens by (0/1 masks: the masked means of both)."""
    n = mask.sum()
    return (adv - (adv * mask).sum() / n) * (lp - (lp * mask).sum() / n)


def _config(name, old, lp, adv, mask, cut=TIE_CUT):
    """A config whose token count puts the selection boundary inside the tie group, after ``cut`` of its tokens."""
    cov = _cov(lp, adv, mask)
    tie = cov[TIES[0]]
    assert all(cov[bt] == tie for bt in TIES)  # exact ties
    if name == "geo_mean":
        return losses.PolicyLossConfig(loss_mode=name, clip_ratio=0.2, clip_ratio_high=0.28)
    valid = mask > 0
    if name == "kl_cov":
        above = int(((cov > tie) & valid).sum())
        n = int(valid.sum())
        return losses.PolicyLossConfig(loss_mode=name, kl_cov_ratio=(above + cut + 0.5) / n, ppo_kl_coef=0.3)
    lb, ub = 0.02, 40.0
    ratio = torch.exp(lp - old)
    clipped = ((ratio > 1.28) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    eligible = (cov > lb) & (cov < ub) & valid & ~clipped
    assert all(bool(eligible[bt]) for bt in TIES)
    above = int(((cov > tie) & eligible).sum())
    return losses.PolicyLossConfig(loss_mode=name, clip_ratio=0.2, clip_ratio_high=0.28, clip_cov_lb=lb,
                                   clip_cov_ub=ub, clip_cov_ratio=(above + cut + 0.5) / float(mask.sum()))


def _oracle_token_mean(name, cfg, old, lp, adv, mask, w, cov=None):
    """fp64 token-mean of clip_cov / kl_cov with the documented selection: the ``count`` tokens first in the order
    (covariance descending, then row-major position). ``cov``: the covariances given (else fp64's)."""
    cov = _cov(lp.detach(), adv, mask) if cov is None else cov
    valid = mask > 0
    ratio = torch.exp(lp - old)
    if name == "kl_cov":
        eligible = valid
        count = max(1, int(int(valid.sum()) * cfg.kl_cov_ratio))
    else:
        r = ratio.detach()
        clipped = adv * r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) < adv * r
        eligible = (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & valid & ~clipped
        count = max(1, int(cfg.clip_cov_ratio * float(mask.sum())))
    order = sorted((i for i in range(cov.numel()) if bool(eligible.reshape(-1)[i])),
                   key=lambda i: (-float(cov.reshape(-1)[i]), i))
    sel = torch.zeros(cov.numel(), dtype=torch.bool)
    sel[order[:count]] = True
    sel = sel.view_as(cov)
    w = torch.ones_like(lp) if w is None else w
    if name == "kl_cov":
        loss_mat = (-adv * ratio + sel.double() * cfg.ppo_kl_coef * (lp - old).abs()) * w
    else:
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
        loss_mat = pg * (~sel) * w
    return (loss_mat * mask).sum() / mask.sum(), sel


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("weights", [False, True], ids=["no_w", "w"])
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_one_process_selection_takes_the_earlier_of_equal_covariances(name, weights, path, monkeypatch):
    """The tie rule the CP selection reproduces, in one process: against the fp64 oracle, loss and gradient; the
    boundary lies inside the tie group (the case checks it). ``device``: the selection as a GPU runs it (no host
    read; forced through ``torch.compiler.is_compiling``)."""
    if path == "device":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    old, lp, adv, mask, w = _batch()
    w = w if weights else None
    cfg = _config(name, old, lp, adv, mask)
    x = lp.clone().requires_grad_(True)
    want, sel = _oracle_token_mean(name, cfg, old, x, adv, mask, w)
    (g_want,) = torch.autograd.grad(want, x)
    picked = [bool(sel[bt]) for bt in TIES]
    assert picked == [True] * TIE_CUT + [False] * (len(TIES) - TIE_CUT), picked
    y = lp.clone().requires_grad_(True)
    got, _ = getattr(losses, "compute_policy_loss_" + name)(old, y, adv, mask, "token-mean", cfg, w)
    got.backward()
    assert torch.allclose(got, want.detach(), rtol=1e-12, atol=1e-14), (got, want)
    assert torch.allclose(y.grad, g_want, rtol=1e-12, atol=1e-14), (y.grad - g_want).abs().max()


@pytest.mark.parametrize("case", ["ties", "few_values", "random", "padded_inf", "descending", "fp64", "small"])
@pytest.mark.parametrize("path", ["cpu", "device"])
def test_top_by_rule_takes_equal_values_by_position(case, path, monkeypatch):
    """The selection's order, (value descending, position ascending), against Python's sort: the CPU path (its
    shortcut when the candidates hold every tie, the cumulative count when not) and the path a GPU (or torch.compile)
    takes, with no host read (forced here by what it tests: ``torch.compiler.is_compiling``)."""
    if path == "device":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(len(case))
    n = 1 << 14
    x = torch.randn(n, generator=g)
    if case == "ties":
        x = torch.randint(0, 40, (n,), generator=g).float()
    elif case == "few_values":
        x = torch.randint(0, 3, (n,), generator=g).float()
    elif case == "padded_inf":  # -inf: padding (not eligible), whose order is not fixed
        x = torch.where(torch.rand(n, generator=g) < 0.9, -math.inf, torch.randint(0, 5, (n,), generator=g).float())
    elif case == "descending":
        x = torch.randint(0, 50, (n,), generator=g).float().sort(descending=True).values
    elif case == "fp64":
        x = torch.randint(0, 9, (n,), generator=g).double()
    elif case == "small":
        x = torch.randint(0, 4, (37,), generator=g).float()
    want = sorted(range(x.numel()), key=lambda i: (-float(x[i]), i))
    for k in (1, 7, 300, 2000, x.numel()):
        k = min(k, x.numel())
        got = losses._top_by_rule(x, k)
        finite = int((x[want[:k]] > -math.inf).sum())
        assert got[:finite].tolist() == want[:finite], (case, k)
        assert bool((x[got[finite:]] == -math.inf).all()) and len(set(got.tolist())) == k, (case, k)


# ----------------------------------------------------------------------------------------- the CP layouts


def _pieces(split: str, cp: int, rank: int):
    """This rank's columns of every row: the r-th contiguous piece ("halves") or megatron's load-balanced chunks."""
    if split == "megatron":
        return cp_token_index(T, cp, rank)
    n = T // cp
    return torch.arange(rank * n, (rank + 1) * n)


def _packed(mask, cp=1, rank=0):
    """The packed layout: sequence b is row b's first ``ell_b`` tokens (up to its last response token, so segments
    differ in length; the padding-only row keeps 3 masked tokens); under CP rank r holds the r-th contiguous piece
    of each segment (uneven pieces, some empty). Returns (flat positions into [B, T], cu_seqlens)."""
    ell = []
    for b in range(B):
        nz = mask[b].nonzero()
        ell.append(int(nz[-1]) + 1 if nz.numel() else 3)
    pos, lens = [], []
    for b in range(B):
        cut = [(ell[b] * i) // cp for i in range(cp + 1)]
        cols = list(range(cut[rank], cut[rank + 1]))
        pos += [b * T + c for c in cols]
        lens.append(len(cols))
    cu = torch.zeros(B + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return torch.tensor(pos, dtype=torch.int64), cu


def _cut(tensors, layout, split, cp, rank, mask):
    """(this rank's pieces of ``tensors``, cu_seqlens or None, the flat [B, T] positions they came from)."""
    if layout == "packed":
        pos, cu = _packed(mask, cp, rank)
        return [None if t is None else t.reshape(-1)[pos].contiguous() for t in tensors], cu, pos
    cols = _pieces(split, cp, rank)
    pos = (torch.arange(B).unsqueeze(1) * T + cols.unsqueeze(0)).reshape(-1)
    return [None if t is None else t[:, cols].contiguous() for t in tensors], None, pos


def _step(name, mode, cfg, old, lp, adv, mask, w, **kw):
    """(loss, metrics, gradient) of ``compute_policy_loss_<name>`` (IS weights ``w`` given as verl gives them)."""
    x = lp.clone().requires_grad_(True)
    fn = getattr(losses, "compute_policy_loss_" + name)
    loss, metrics = fn(old, x, adv, mask, mode, cfg, w, **kw)
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, x.grad


def _front_door(cfg, old, lp, adv, mask, mode, **kw):
    """(loss, the loss's metrics, gradient) of ``policy_step``, the step compute_policy_loss and megatron run."""
    x = lp.clone().requires_grad_(True)
    step = losses.policy_step(cfg, old, x, adv, mask, mode, **kw)
    step.loss.backward()
    return step.loss.detach(), {k: v.detach() for k, v in step.loss_metrics.items()}, x.grad


def _close(a, b, rtol=1e-10, atol=1e-13):
    return torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


def _compare(what, got, want, pos, group, failures, **tol):
    """``got`` = this rank's (loss share, metrics, gradient on its tokens); ``want`` = one process's on [B, T] (or
    packed, then ``pos`` indexes the packed stream). ``tol``: :func:`_close`'s (fp64's by default)."""
    total = got[0].clone().reshape(1)
    dist.all_reduce(total, group=group)
    if not _close(total[0], want[0], **tol):
        failures.append(f"{what}: sum of the CP ranks' losses {float(total):.12g} != one process {float(want[0]):.12g}")
    g_want = want[2].reshape(-1)[pos]
    if not _close(got[2].reshape(-1), g_want, **tol):
        failures.append(f"{what}: gradient on this rank's tokens differs (max "
                        f"{float((got[2].reshape(-1) - g_want).abs().max()):.3g})")
    if set(got[1]) != set(want[1]):
        failures.append(f"{what}: metric keys {sorted(got[1])} != {sorted(want[1])}")
    for k in set(got[1]) & set(want[1]):
        if not _close(got[1][k], want[1][k], **tol):
            failures.append(f"{what}: metric {k} = {float(got[1][k]):.12g}, one process {float(want[1][k]):.12g}")


def _loss_cases():
    for name in NAMES:
        for mode in MODES if name != "geo_mean" else ["token-mean"]:  # geo_mean ignores loss_agg_mode
            for weights in (False, True):
                yield name, mode, weights


def _cp_losses(seq_group, cp, rank, failures, seed=0, dp_group=None):
    """Every whole-batch loss, mode, weights and layout: this rank's share against one process."""
    old, lp, adv, mask, w = _batch(seed)
    rollout = old + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(seed + 100), dtype=old.dtype)
    packed_pos, packed_cu = _packed(mask)
    whole_packed = [t.reshape(-1)[packed_pos] for t in (old, lp, adv, mask, w)]
    for name, mode, weights in _loss_cases():
        cfg = _config(name, old, lp, adv, mask)
        for layout, split in (("padded", "halves"), ("padded", "megatron"), ("packed", "halves")):
            what = f"{name}/{mode}/{'w' if weights else 'no_w'}/{layout}/{split}"
            if layout == "packed":
                o, x, a, m, ww = whole_packed
                want = _step(name, mode, cfg, o, x, a, m, ww if weights else None, cu_seqlens=packed_cu)
            else:
                want = _step(name, mode, cfg, old, lp, adv, mask, w if weights else None)
            (o, x, a, m, ww), cu, pos = _cut((old, lp, adv, mask, w), layout, split, cp, rank, mask)
            if layout == "packed":  # positions into the packed stream of the whole sequences
                pos = torch.searchsorted(packed_pos, pos)
            got = _step(name, mode, cfg, o, x, a, m, ww if weights else None, cu_seqlens=cu, seq_group=seq_group)
            _compare(what, got, want, pos, seq_group, failures)
            if weights or layout == "packed":
                continue
            # the front door (policy_step, as compute_policy_loss and megatron's loss_func run it): plain, and the
            # decoupled flow, whose sequence-level IS weights (exact over seq_group) multiply the loss
            want = _front_door(cfg, old, lp, adv, mask, mode)
            got = _front_door(cfg, o, x, a, m, mode, seq_group=seq_group, dp_group=dp_group)
            _compare(what + " (policy_step)", got, want, pos, seq_group, failures)
            rc = dataclasses.replace(cfg, rollout_correction=RolloutCorrectionConfig(
                rollout_is="sequence", rollout_is_threshold=3.0))
            want = _front_door(rc, old, lp, adv, mask, mode, rollout_log_prob=rollout)
            got = _front_door(rc, o, x, a, m, mode, rollout_log_prob=_cut((rollout,), layout, split, cp, rank,
                                                                          mask)[0][0],
                              seq_group=seq_group, dp_group=dp_group)
            _compare(what + " (policy_step, decoupled)", got, want, pos, seq_group, failures)


#: Per-token losses through the front door under CP (the kernel's rows; GSPO's sequence ratio over seq_group).
TOKEN_LOSSES = ("vanilla", "gspo", "sapo", "dro", "cispo", "gpg")


def _cp_token_losses(seq_group, cp, rank, failures, seed=0):
    """Per-token losses through compute_policy_loss under CP: each rank's loss is its share of the one-process loss
    (the shares add up to it) and its gradient the one-process gradient on its tokens, as for the whole-batch
    losses; the metrics are the rank's own (not compared)."""
    old, lp, adv, mask, w = _batch(seed)
    packed_pos, packed_cu = _packed(mask)
    whole_packed = [t.reshape(-1)[packed_pos] for t in (old, lp, adv, mask)]

    def run(cfg, o, x, a, m, mode, **kw):
        x = x.clone().requires_grad_(True)
        loss, _ = losses.compute_policy_loss(o, x, a, m, mode, cfg, **kw)
        loss.backward()
        return loss.detach(), {}, x.grad

    for name in TOKEN_LOSSES:
        cfg = losses.PolicyLossConfig(loss_mode=name, clip_ratio=0.2, clip_ratio_high=0.28, dro_beta=0.5)
        for mode in MODES:
            for layout, split in (("padded", "halves"), ("padded", "megatron"), ("packed", "halves")):
                what = f"{name}/{mode}/{layout}/{split} (compute_policy_loss)"
                if layout == "packed":
                    want = run(cfg, *whole_packed, mode, cu_seqlens=packed_cu)
                else:
                    want = run(cfg, old, lp, adv, mask, mode)
                (o, x, a, m), cu, pos = _cut((old, lp, adv, mask), layout, split, cp, rank, mask)
                if layout == "packed":
                    pos = torch.searchsorted(packed_pos, pos)
                got = run(cfg, o, x, a, m, mode, cu_seqlens=cu, seq_group=seq_group)
                _compare(what, got, want, pos, seq_group, failures)
                # loss_share=False: the rank's own aggregate, no collective
                own = losses.policy_step(cfg, o, x, a, m, mode, cu_seqlens=cu, seq_group=seq_group,
                                         loss_share=False)
                local = losses.policy_step(cfg, o, x, a, m, mode, cu_seqlens=cu) if name != "gspo" else own
                if not _close(own.loss, local.loss):
                    failures.append(f"{what}: loss_share=False is not the rank's own aggregate")


def _cp_few_tokens_metrics(seq_group, cp, rank, failures):
    """The covariance losses' and geo_mean's metrics on micro-batches of a few tokens, where verl's + 1e-8 in a
    masked mean is 1e-9 relative: under CP clip_cov's actor/ppo_kl divided by the count without it (Σ / n against
    one process's Σ / (n + 1e-8); the distributed fuzz)."""
    for b, t, mask_dtype in ((1, 4, torch.bool), (2, 6, torch.float64)):
        g = torch.Generator().manual_seed(b * 10 + t)
        old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
        lp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
        adv = torch.randn(b, t, generator=g, dtype=torch.float64)
        mask = torch.ones(b, t, dtype=mask_dtype)
        cols = slice(rank * t // cp, (rank + 1) * t // cp)
        # a ratio whose cap overflows selects every token, the same on every rank (the cap's bound is the
        # whole token count, in the all-reduce)
        for name, knobs in (("clip_cov", dict(clip_cov_ratio=0.3, clip_cov_lb=-1.0, clip_cov_ub=5.0)),
                            ("kl_cov", dict(kl_cov_ratio=0.3)), ("geo_mean", {}),
                            ("clip_cov", dict(clip_cov_ratio=1e308, clip_cov_lb=-1e9, clip_cov_ub=1e9)),
                            ("kl_cov", dict(kl_cov_ratio=1e308))):
            cfg = losses.PolicyLossConfig(loss_mode=name, **knobs)
            fn = getattr(losses, f"compute_policy_loss_{name}")
            want = fn(old, lp, adv, mask, "token-mean", cfg)[1]
            got = fn(old[:, cols], lp[:, cols], adv[:, cols], mask[:, cols], "token-mean", cfg, seq_group=seq_group)[1]
            for k in want:
                if not _close(got[k], want[k], rtol=1e-14, atol=0.0):
                    failures.append(f"{name} B={b} T={t}: metric {k} = {float(got[k])!r}, one process "
                                    f"{float(want[k])!r}")


def _cp_worker(rank, world):
    failures = []
    _cp_losses(dist.group.WORLD, world, rank, failures)
    _cp_token_losses(dist.group.WORLD, world, rank, failures)
    _cp_few_tokens_metrics(dist.group.WORLD, world, rank, failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", dist_params(2, cuda_reason="the gloo variant covers the collectives"))
def test_policy_losses_context_parallel_equal_one_process(device):
    run_workers(_cp_worker, 2, device=device)


def _dp_cp_worker(rank, world):
    """DP = 2 x CP = 2: ranks {0, 1} and {2, 3} are two CP pairs, each with its own micro-batch (seed = DP rank);
    the losses stay per micro-batch (nothing is reduced over the data-parallel group, as in verl)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    failures = []
    _cp_losses(pairs[rank // 2], 2, rank % 2, failures, seed=rank // 2, dp_group=dist.group.WORLD)
    assert not failures, "\n".join(failures)


def test_whole_batch_losses_dp_x_cp_stay_per_micro_batch():
    run_workers(_dp_cp_worker, 4)


# ----------------------------------------------------------------------------------------- megatron's loss_func


def _logits_batch(seed: int):
    """[s, b, V] fp64 logits whose log-probs tie exactly at the :data:`TIES` tokens (one logits vector, one
    target), per-row advantages with rows 1 and 4 equal, pi_old distinct at every tie token; and the config of each
    loss whose selection boundary lies inside the tie group."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(T, B, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (B, T), generator=g)
    tie_logits = torch.full((V,), -3.0, dtype=torch.float64)
    tie_logits[0] = 4.0
    for b, t in TIES:
        logits[t, b] = tie_logits
        target[b, t] = 0
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[1] = adv[4] = 2.5
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).double()
    mask[1] = mask[4] = 1.0
    mask[2] = 0.0
    mask[3, 4:] = 0.0
    lp = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    for i, (b, t) in enumerate(TIES):
        old[b, t] = lp[b, t] + 0.011 * (i + 1)
    configs = {name: _config(name, old, lp, adv.unsqueeze(1).expand(B, T), mask) for name in NAMES}
    return (logits, target, adv, mask, old), configs


def _megatron_layouts(batch, cp, rank):
    """(layout, the one-process loss_func inputs, this rank's inputs, the index of this rank's logits rows in the
    one-process logits): padded [s, b, V] under megatron's load-balanced chunks, and packed [T, 1, V] streams whose
    segments the ranks hold in contiguous pieces (``cu_seqlens`` given directly)."""
    logits, target, adv, mask, old = batch
    cols = cp_token_index(T, cp, rank)
    yield ("padded", (logits, target, adv, mask, old, None),
           (logits[cols], target[:, cols], adv, mask[:, cols], old[:, cols], None), cols)
    pos, cu = _packed(mask)
    flat = logits.transpose(0, 1).reshape(B * T, V)[pos].unsqueeze(1)
    whole = (flat, target.reshape(-1)[pos], adv.unsqueeze(1).expand(B, T).reshape(-1)[pos], mask.reshape(-1)[pos],
             old.reshape(-1)[pos], cu)
    local_pos, local_cu = _packed(mask, cp, rank)
    idx = torch.searchsorted(pos, local_pos)
    yield "packed", whole, tuple(t[idx] for t in whole[:-1]) + (local_cu,), idx


def _megatron_cases():
    for name in NAMES:
        modes = ["token-mean"] if name == "geo_mean" else ["token-mean", "seq-mean-token-mean",
                                                           "seq-mean-token-sum-norm"]
        for mode in modes:
            yield name, mode, 0.0 if name == "geo_mean" else 0.01  # geo_mean takes no entropy term


def _loss_func(inputs, cfg, mode, ent, **groups):
    from rollout_corr_ext.megatron import make_policy_loss_func

    logits, target, adv, mask, old, cu = inputs
    x = logits.clone().requires_grad_(True)
    out = make_policy_loss_func(target, adv, mask, old_log_prob=old, config=cfg, loss_agg_mode=mode,
                                entropy_coeff=ent, cu_seqlens=cu, **groups)(x)
    return x, out


def _megatron_checks(groups, cp, cp_rank, dp_cp, dp_rank, dp, failures):
    """Every case on this rank's piece of its DP rank's micro-batch (seed 3 + DP rank) against one process: the
    one-process values of every DP micro-batch reduced as megatron reduces them."""
    from rollout_corr_ext.megatron import reported_means

    batches = [_logits_batch(3 + d) for d in range(dp)]
    for name, mode, ent in _megatron_cases():
        for li in range(2):
            refs = []  # per DP micro-batch: (value, num_tokens, report, gradient) of the one-process loss_func
            for batch, configs in batches:
                layout, whole, _, _ = list(_megatron_layouts(batch, cp, 0))[li]
                x, (loss_sum, n, report) = _loss_func(whole, configs[name], mode, ent)
                (loss_sum / n).backward()
                refs.append((float(loss_sum.detach() / n), int(n), report, x.grad))
            batch, configs = batches[dp_rank]
            layout, _, local, idx = list(_megatron_layouts(batch, cp, cp_rank))[li]
            what = f"megatron {name}/{mode}/{layout} (CP rank {cp_rank}, DP rank {dp_rank})"
            x, (loss_sum, n, report) = _loss_func(local, configs[name], mode, ent, **groups)
            n_all = sum(r[1] for r in refs)
            value = sum(r[0] * r[1] for r in refs) / n_all
            if int(n) != refs[dp_rank][1]:
                failures.append(f"{what}: num_tokens {int(n)} != one process {refs[dp_rank][1]}")
            totals = torch.stack([loss_sum.detach().double(), n.double()])
            dist.all_reduce(totals, group=dp_cp)  # calculate_per_token_loss=True: megatron sums over DP x CP
            if not abs(float(totals[0] / totals[1]) - value) <= 1e-10 * abs(value) + 1e-13:
                failures.append(f"{what}: sum(loss_sum) / sum(num_tokens) {float(totals[0] / totals[1]):.12g} != "
                                f"one process {value:.12g}")
            if dp == 1:  # calculate_per_token_loss=False: megatron averages loss_sum / num_tokens over the CP ranks
                per_rank = (loss_sum.detach().double() / n).reshape(1)
                dist.all_reduce(per_rank, group=dp_cp)
                if not abs(float(per_rank) / cp - value) <= 1e-10 * abs(value) + 1e-13:
                    failures.append(f"{what}: mean of loss_sum / num_tokens {float(per_rank) / cp:.12g} != "
                                    f"{value:.12g}")
            means, want_means = reported_means(report), reported_means([r[2] for r in refs])
            for k, v in want_means.items():  # the report is fp32 (megatron's): its sums round in fp32
                if k not in means or not abs(means[k] - v) <= 2e-6 * abs(v) + 1e-9:
                    failures.append(f"{what}: metric {k} = {means.get(k)}, one process {v:.12g}")
            # megatron's gradient: of loss_sum / (the DP x CP sum of num_tokens); one process: of each micro-batch's
            # value, weighted by its share of the tokens
            (loss_sum / totals[1].to(loss_sum.dtype)).backward()
            want = refs[dp_rank][3][idx] * (refs[dp_rank][1] / n_all)
            if not torch.allclose(x.grad, want, rtol=1e-8, atol=1e-13):
                failures.append(f"{what}: logits gradient differs (max {float((x.grad - want).abs().max()):.3g})")


def _megatron_cp_worker(rank, world):
    """CP = 2, DP = 1: the groups as a ProcessGroupCollection-like namespace (no parallel_state needed)."""
    singles = [dist.new_group([r]) for r in range(world)]
    pgc = types.SimpleNamespace(tp=singles[rank], cp=dist.group.WORLD, dp=singles[rank], dp_cp=dist.group.WORLD)
    failures = []
    _megatron_checks(dict(pg_collection=pgc), world, rank, dist.group.WORLD, 0, 1, failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", dist_params(2, cuda_reason="the gloo variant covers the collectives"))
def test_megatron_loss_func_whole_batch_losses_context_parallel(device):
    run_workers(_megatron_cp_worker, 2, device=device)


def _megatron_dp_cp_worker(rank, world):
    """DP = 2 x CP = 2: ranks {0, 1} and {2, 3} are the CP pairs, dp_cp all four."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    pgc = types.SimpleNamespace(tp=singles[rank], cp=pairs[rank // 2], dp=across[rank % 2], dp_cp=dist.group.WORLD)
    failures = []
    _megatron_checks(dict(pg_collection=pgc), 2, rank % 2, dist.group.WORLD, rank // 2, 2, failures)
    assert not failures, "\n".join(failures)


def test_megatron_loss_func_whole_batch_losses_dp_x_cp():
    run_workers(_megatron_dp_cp_worker, 4)


# ------------------------------------------------------------- exact ties across megatron's load-balanced chunks


def _tie_batch():
    """One response sequence whose tokens all tie exactly (a constant advantage: every covariance is 0), at
    columns 5 (CP rank 1 under megatron's chunks at T = 16, cp = 2) and 14, 15 (rank 0): one process takes column 5
    first, an order by rank then local position would take column 14. fp64 logits [T, B, V] and the loss inputs."""
    g = torch.Generator().manual_seed(11)
    logits = 2.0 * torch.randn(T, 2, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (2, T), generator=g)
    lp = logits.transpose(0, 1).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.2 * torch.randn(2, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.5, 0.0], dtype=torch.float64)
    mask = torch.zeros(2, T, dtype=torch.float64)
    mask[0, [5, 14, 15]] = 1.0
    cfg = {name: losses.PolicyLossConfig(loss_mode=name, kl_cov_ratio=0.05, clip_cov_ratio=0.05, clip_cov_lb=-5.0,
                                         clip_cov_ub=5.0) for name in ("clip_cov", "kl_cov")}
    return logits, target, lp, old, adv, mask, cfg


def _tie_order_worker(rank, world):
    from rollout_corr_ext.megatron import make_policy_loss_func

    logits, target, lp, old, adv, mask, cfgs = _tie_batch()
    adv_bt = adv.unsqueeze(1).expand(2, T).contiguous()
    cols = cp_token_index(T, world, rank)
    singles = [dist.new_group([r]) for r in range(world)]
    pgc = types.SimpleNamespace(tp=singles[rank], cp=dist.group.WORLD, dp=singles[rank], dp_cp=dist.group.WORLD)
    failures = []
    for name, cfg in cfgs.items():
        # policy_step / compute_policy_loss_<name> with each token's position in its whole sequence
        ref = _step(name, "token-mean", cfg, old, lp, adv_bt, mask, None)
        got = _step(name, "token-mean", cfg, *(t[:, cols].contiguous() for t in (old, lp, adv_bt, mask)), None,
                    seq_group=dist.group.WORLD, seq_positions=cols.expand(2, -1))
        x = lp[:, cols].clone().requires_grad_(True)  # and through the front door
        door, _ = losses.compute_policy_loss(old[:, cols], x, adv_bt[:, cols], mask[:, cols], "token-mean", cfg,
                                             seq_group=dist.group.WORLD, seq_positions=cols.expand(2, -1))
        door.backward()
        total = torch.stack([got[0], door.detach()])
        dist.all_reduce(total)
        for what, value, grad in (("step", total[0], got[2]), ("compute_policy_loss", total[1], x.grad)):
            if not (_close(value, ref[0]) and _close(grad, ref[2][:, cols])):
                failures.append(f"{name} {what} with seq_positions: loss {float(value)} vs one process "
                                f"{float(ref[0])}, gradient max error {float((grad - ref[2][:, cols]).abs().max()):.3g}")
        # megatron's loss_func on its load-balanced chunks: the positions are its own
        x_ref = logits.clone().requires_grad_(True)
        loss_sum, n, _ = make_policy_loss_func(target, adv, mask, old_log_prob=old, config=cfg)(x_ref)
        (loss_sum / n).backward()
        x = logits[cols].clone().requires_grad_(True)
        local_sum, local_n, _ = make_policy_loss_func(target[:, cols], adv, mask[:, cols], old_log_prob=old[:, cols],
                                                      config=cfg, pg_collection=pgc)(x)
        totals = torch.stack([local_sum.detach(), local_n.double()])
        dist.all_reduce(totals)  # calculate_per_token_loss=True: megatron sums over DP x CP
        (local_sum / totals[1]).backward()
        if not (_close(totals[0] / totals[1], loss_sum.detach() / n) and _close(x.grad, x_ref.grad[cols])):
            failures.append(f"megatron {name}: loss {float(totals[0] / totals[1])} vs one process "
                            f"{float(loss_sum / n)}, gradient max error {float((x.grad - x_ref.grad[cols]).abs().max()):.3g}")
        # packed (packed_seq_params): the two rows as two sequences, each in megatron's per-document chunks
        cu = torch.tensor([0, T, 2 * T])
        params = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=cu, qkv_format="thd")
        flat = logits.transpose(0, 1).reshape(2 * T, 1, V)
        stream = [t.reshape(-1) for t in (target, mask, old, adv_bt)]
        x_ref = flat.clone().requires_grad_(True)
        loss_sum, n, _ = make_policy_loss_func(stream[0], stream[3], stream[1], old_log_prob=stream[2], config=cfg,
                                               packed_seq_params=params)(x_ref)
        (loss_sum / n).backward()
        pos = torch.cat([cols, cols + T])
        x = flat[pos].clone().requires_grad_(True)
        local_sum, local_n, _ = make_policy_loss_func(*(stream[i][pos] for i in (0, 3, 1)), old_log_prob=stream[2][pos],
                                                      config=cfg, packed_seq_params=params, pg_collection=pgc)(x)
        totals = torch.stack([local_sum.detach(), local_n.double()])
        dist.all_reduce(totals)
        (local_sum / totals[1]).backward()
        if not (_close(totals[0] / totals[1], loss_sum.detach() / n) and _close(x.grad, x_ref.grad[pos])):
            failures.append(f"megatron packed {name}: loss {float(totals[0] / totals[1])} vs one process "
                            f"{float(loss_sum / n)}, gradient max error {float((x.grad - x_ref.grad[pos]).abs().max()):.3g}")
        # packed with use_per_sequence_balancing (megatron-core 0.19): the whole stream in 2 * cp chunks. Row 1
        # first, so the tied tokens sit at stream positions 21 (rank 1) and 30, 31 (rank 0): rank order takes 30
        order = torch.tensor([1, 0])
        stream = [t[order].reshape(-1) for t in (target, mask, old, adv_bt)]
        flat = logits[:, order].transpose(0, 1).reshape(2 * T, 1, V)
        x_ref = flat.clone().requires_grad_(True)
        loss_sum, n, _ = make_policy_loss_func(stream[0], stream[3], stream[1], old_log_prob=stream[2], config=cfg,
                                               packed_seq_params=params)(x_ref)
        (loss_sum / n).backward()
        pos = cp_token_index(2 * T, world, rank)
        x = flat[pos].clone().requires_grad_(True)
        local_sum, local_n, _ = make_policy_loss_func(*(stream[i][pos] for i in (0, 3, 1)), old_log_prob=stream[2][pos],
                                                      config=cfg, packed_seq_params=params, pg_collection=pgc,
                                                      use_per_sequence_balancing=True)(x)
        totals = torch.stack([local_sum.detach(), local_n.double()])
        dist.all_reduce(totals)
        (local_sum / totals[1]).backward()
        if not (_close(totals[0] / totals[1], loss_sum.detach() / n) and _close(x.grad, x_ref.grad[pos])):
            failures.append(f"megatron packed, use_per_sequence_balancing, {name}: loss "
                            f"{float(totals[0] / totals[1])} vs one process {float(loss_sum / n)}, gradient max "
                            f"error {float((x.grad - x_ref.grad[pos]).abs().max()):.3g}")
    assert not failures, "\n".join(failures)


def test_cov_selection_breaks_exact_ties_in_the_one_process_order_across_chunks():
    """clip_cov / kl_cov under CP = 2 with megatron's load-balanced chunks, every covariance tied: the selected token
    is the one-process one (the earliest in its sequence), given each token's position in its whole sequence
    (``seq_positions``; megatron's loss_func computes them itself); before, ties were broken by rank."""
    run_workers(_tie_order_worker, 2)


# ------------------------------------------- a constant side: every covariance is 0, whatever the rounding


def _constant_side_batch(side: str, dtype: torch.dtype, t: int = 700, value: float = 0.7):
    """Two response rows of ``t`` tokens (the second partly padded) in ``dtype`` where one side of the covariance is
    one value on every valid token (``side`` = "adv": an outcome reward on a micro-batch of one group; "lp": equal
    log-probs). n copies of 0.7 do not sum to n times 0.7 in fp32: the mean was an ulp off and every covariance
    rounding noise (+-ulp (x - mean x)), which picked tokens by the other side's order, not by position, and under
    context parallelism by other noise."""
    g = torch.Generator().manual_seed(5)
    old = -(torch.rand(2, t, generator=g, dtype=torch.float64) * 2.0 + 0.05)
    lp = (old + 0.3 * torch.randn(2, t, generator=g, dtype=torch.float64)).clamp(max=-0.05)
    adv = torch.randn(2, t, generator=g, dtype=torch.float64)
    if side == "adv":
        adv = torch.full_like(adv, value)
    else:
        lp = torch.full_like(lp, -value)
    mask = torch.ones(2, t, dtype=torch.float64)
    mask[1, t - t // 3:] = 0.0
    return tuple(x.to(dtype) for x in (old, lp, adv)) + (mask,)


def _constant_side_config(name):
    # every token eligible (no clip; the widest covariance range), 1% of them selected
    return losses.PolicyLossConfig(loss_mode=name, clip_ratio=50.0, clip_ratio_high=50.0, clip_cov_ratio=0.01,
                                   clip_cov_lb=-5.0, clip_cov_ub=5.0, kl_cov_ratio=0.01, ppo_kl_coef=1.0)


def _exact_cov(lp, adv, mask):
    """The covariances of :func:`_cov` in exact rational arithmetic, rounded once (0 / 1 masks): an fp64 mean of n
    copies of an fp64 value need not be that value."""
    keep = (mask.reshape(-1) > 0).tolist()
    a = [Fraction(v) for v in adv.double().reshape(-1).tolist()]
    x = [Fraction(v) for v in lp.detach().double().reshape(-1).tolist()]
    n = sum(keep)
    mean_a = sum(v for v, k in zip(a, keep) if k) / n
    mean_x = sum(v for v, k in zip(x, keep) if k) / n
    return torch.tensor([float((u - mean_a) * (v - mean_x)) for u, v in zip(a, x)],
                        dtype=torch.float64).view(mask.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("side", ["adv", "lp"])
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_constant_side_covariances_are_zero_and_the_earliest_tokens_are_taken(name, side, dtype):
    """One process, against the fp64 oracle of the documented rule on the same numbers (whose means of equal values
    are exact, so every covariance is 0 and the first tokens by position are selected): loss and gradient. fp32
    picked nine tokens far into the rows (the order of the log-probs) before the means were summed in fp64."""
    old, lp, adv, mask = _constant_side_batch(side, dtype)
    cfg = _constant_side_config(name)
    x64 = lp.double().clone().requires_grad_(True)
    want, sel = _oracle_token_mean(name, cfg, old.double(), x64, adv.double(), mask, None, _exact_cov(lp, adv, mask))
    (g_want,) = torch.autograd.grad(want, x64)
    first = torch.nonzero(mask.reshape(-1) > 0).reshape(-1)[:int(sel.sum())]
    assert sorted(torch.nonzero(sel.reshape(-1)).reshape(-1).tolist()) == first.tolist()  # the oracle's own rule
    # a bool mask but for fp32: verl's masked mean divides by the mask's sum in the mask's type, + 1e-8 (an fp64
    # mask: A n / (n + 1e-8); a 16-bit one rounds n), so its mean of equal values is no longer that value
    got, _, grad = _step(name, "token-mean", cfg, old, lp, adv, mask.float() if dtype == torch.float32 else mask > 0,
                         None)
    tol = dict(rtol=1e-10, atol=1e-13) if dtype == torch.float64 else \
        dict(rtol=1e-5, atol=1e-9) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-7)
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    torch.testing.assert_close(grad.double(), g_want, **tol)


def _constant_side_cp_worker(rank, world):
    failures = []
    for side, value in (("adv", 0.3), ("adv", 1.3), ("lp", 0.3), ("lp", 0.55)):
        # values whose fp32 sums over each rank's half (or chunks) rounded to another side of the value than one
        # process's sum
        old, lp, adv, mask = _constant_side_batch(side, torch.float32, value=value)
        mask = mask.float()
        for name in ("clip_cov", "kl_cov"):
            cfg = _constant_side_config(name)
            want = _step(name, "token-mean", cfg, old, lp, adv, mask, None)
            t = old.shape[1]
            # the ranks' halves, and megatron's load-balanced chunks with each token's position in its sequence
            half = torch.arange(rank * t // world, (rank + 1) * t // world)
            for what, cols, kw in (("halves", half, {}),
                                   ("chunks", cp_token_index(t, world, rank), {"seq_positions": None})):
                if "seq_positions" in kw:
                    kw = {"seq_positions": cols.expand(2, -1)}
                got = _step(name, "token-mean", cfg, *(x[:, cols].contiguous() for x in (old, lp, adv, mask)), None,
                            seq_group=dist.group.WORLD, **kw)
                pos = (torch.arange(2).unsqueeze(1) * t + cols.unsqueeze(0)).reshape(-1)
                # fp32: the shares' sums round otherwise; one token more or less moves the loss by ~1e-4
                _compare(f"{name}, constant {side} {value}, {what}", got, want, pos, dist.group.WORLD, failures, rtol=1e-6,
                         atol=1e-9)
    assert not failures, "\n".join(failures)


def test_constant_side_context_parallel_equals_one_process():
    """CP = 2 (the ranks' halves, and megatron's chunks with ``seq_positions``), fp32 with one side constant: the
    same tokens as one process, so the same loss and gradient (each rank's partial sums rounded otherwise)."""
    run_workers(_constant_side_cp_worker, 2)
