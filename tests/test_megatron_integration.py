"""megatron-core integration (docs/megatron.md) under TP=2 on gloo, with megatron-core's own TP layers.

Two spawned workers build the same tiny model from ``VocabParallelEmbedding``, ``ColumnParallelLinear``,
``RowParallelLinear`` and a vocab-parallel output ``ColumnParallelLinear``; each case runs the ``loss_func`` that
:func:`rollout_corr_ext.megatron.make_policy_loss_func` builds and checks the contract megatron-core's schedule
relies on (a 3-tuple ``(loss_sum, num_tokens, {name: tensor([sum, count])})``), the loss value and every
parameter shard's gradient against a single-process fp64 reference model made of plain torch ops on the
gathered weights. Ranks all-reduce a failure count before anyone asserts, so no rank hangs on a dead peer.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollout_corr_testing.dist_utils import run_workers_preloaded

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

VOCAB, HIDDEN, FFN = 16, 12, 20
B, S = 4, 7


def _build_model(tp: int):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                              perform_initialization=True, params_dtype=torch.float32)
    torch.manual_seed(1234)  # same master weights on every rank; each keeps its shard

    def init(w):
        return torch.nn.init.normal_(w, std=0.5)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=init, config=cfg)
            self.fc1 = ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=init, bias=True, gather_output=False)
            self.fc2 = RowParallelLinear(FFN, HIDDEN, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                         skip_bias_add=False)
            self.out = ColumnParallelLinear(HIDDEN, VOCAB, config=cfg, init_method=init, bias=False,
                                            gather_output=False)

        def forward(self, tokens):  # [b, s] -> [s, b, V_local], megatron's output-layer layout
            h = self.embed(tokens.t())
            mid, _ = self.fc1(h)
            y, _ = self.fc2(F.gelu(mid))
            logits, _ = self.out(h + y)
            return logits

    return Tiny()


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reference_logp(full, tokens, target):
    """The same model in fp64 plain torch on the gathered weights: [b, s] log-probs of ``target``."""
    h = F.embedding(tokens.t(), full["embed"])
    y = F.linear(F.gelu(F.linear(h, full["fc1.w"], full["fc1.b"])), full["fc2.w"], full["fc2.b"])
    logits = F.linear(h + y, full["out"])  # [s, b, V]
    return torch.log_softmax(logits, -1).gather(-1, target.t().unsqueeze(-1)).squeeze(-1).t()


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, 2:] = True
    mask[1, 4:] = False
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return tokens, target, mask, adv


CASES = [
    # name, loss_agg_mode, rollout-correction preset (None: no correction), entropy_coeff
    ("plain_token_mean", "token-mean", None, 0.0),
    ("plain_seq_mean_token_mean_entropy", "seq-mean-token-mean", None, 0.01),
    ("decoupled_token_tis", "token-mean", "decoupled_token_is", 0.0),
    ("decoupled_seq_rs", "seq-mean-token-sum", "decoupled_geo_rs", 0.0),
    ("bypass_ppo_clip", "token-mean", "bypass_ppo_clip", 0.0),
    ("bypass_reinforce_seq_is", "seq-mean-token-sum-norm", "bypass_pg_is", 0.0),
]


def _run_case(name, mode, preset, ent, failures, rank):
    from megatron.core import parallel_state as ps

    from rollout_corr_testing import dense_oracles as R
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.correction import compute_rollout_correction
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    tp = ps.get_tensor_model_parallel_group()
    model = _build_model(2)
    tokens, target, mask, adv = _batch(sum(map(ord, name)))  # not hash(): it differs between processes

    full = {
        "embed": _gather(model.embed.weight.data, 0, tp).double().requires_grad_(True),
        "fc1.w": _gather(model.fc1.weight.data, 0, tp).double().requires_grad_(True),
        "fc1.b": _gather(model.fc1.bias.data, 0, tp).double().requires_grad_(True),
        "fc2.w": _gather(model.fc2.weight.data, 1, tp).double().requires_grad_(True),
        "fc2.b": model.fc2.bias.data.double().clone().requires_grad_(True),
        "out": _gather(model.out.weight.data, 0, tp).double().requires_grad_(True),
    }
    with torch.no_grad():
        lp0 = _reference_logp(full, tokens, target)
    g = torch.Generator().manual_seed(7)
    old = (lp0 + 0.15 * torch.randn(B, S, generator=g, dtype=torch.float64)).float()
    rollout = (lp0 + 0.25 * torch.randn(B, S, generator=g, dtype=torch.float64)).float()
    rc = None
    if preset == "decoupled_geo_rs":
        rc = RolloutCorrectionConfig.decoupled_geo_rs(rs_threshold="0.9_1.1")
    elif preset is not None:
        rc = getattr(RolloutCorrectionConfig, preset)()
    cfg = PolicyLossConfig(clip_ratio=0.2, rollout_correction=rc, loss_scale_factor=5.0)
    bypass = rc is not None and rc.bypass_mode
    loss_func = make_policy_loss_func(target, adv, mask, old_log_prob=None if bypass else old,
                                      rollout_log_prob=rollout, config=cfg, loss_agg_mode=mode, entropy_coeff=ent)
    out = loss_func(model(tokens))

    # -- the contract megatron-core's forward_step relies on
    if not (isinstance(out, tuple) and len(out) == 3):
        failures.append(f"{name}: loss_func returned {type(out).__name__} of len {len(out)}, not a 3-tuple")
        return
    loss_sum, num_tokens, report = out
    if loss_sum.dim() != 0 or not loss_sum.requires_grad or num_tokens.dtype != torch.int32:
        failures.append(f"{name}: loss_sum {loss_sum.shape} grad={loss_sum.requires_grad}, num_tokens {num_tokens.dtype}")
    # -- the reference: the same flow on dense fp64 log-probs
    lp = _reference_logp(full, tokens, target)
    eff_mask, weights, old_ref = mask, None, old.double()
    if rc is not None:
        corr = compute_rollout_correction((lp.detach() if bypass else old).double(), rollout.double(), mask, rc)
        eff_mask = corr.response_mask
        if bypass:
            old_ref = rollout.double()
            weights = corr.weights if rc.loss_type == "reinforce" else None
        else:
            weights = corr.weights
    adv_bt = adv.view(-1, 1).expand(B, S)
    if rc is not None and bypass and rc.loss_type == "reinforce":
        pg = -adv_bt * lp * weights.double()
    else:
        pg, *_ = R.ppo_clip_loss_dense(old_ref, lp, adv_bt, eff_mask, 0.2, 0.2, 3.0,
                                       None if weights is None else weights.double())
    ref = ref_pg = R.agg_loss_dense(pg, eff_mask, mode, loss_scale_factor=5.0)
    if ent:
        h = F.embedding(tokens.t(), full["embed"])
        y = F.linear(F.gelu(F.linear(h, full["fc1.w"], full["fc1.b"])), full["fc2.w"], full["fc2.b"])
        lpa = torch.log_softmax(F.linear(h + y, full["out"]), -1)
        entropy = -(lpa.exp() * lpa).sum(-1).t()
        ref = ref - ent * R.agg_loss_dense(entropy, eff_mask, mode, loss_scale_factor=5.0)
    m = eff_mask.double()
    want_count = int((m != 0).sum()) if mode == "token-mean" else int((m.sum(-1) > 0).sum())
    if int(num_tokens) != want_count:
        failures.append(f"{name}: num_tokens {int(num_tokens)} != {want_count}")
    got = (loss_sum / num_tokens.clamp(min=1)).double()
    if not torch.allclose(got, ref, rtol=1e-5, atol=1e-6):
        failures.append(f"{name}: loss {got.item()} != reference {ref.item()}")
    rep = report["actor/pg_loss"]
    if rep.shape != (2,) or not torch.allclose(rep[0] / rep[1], ref_pg.detach().float(), rtol=1e-4, atol=1e-6):
        failures.append(f"{name}: report actor/pg_loss {rep.tolist()} does not give {ref_pg.item()}")
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"):
        if key not in report or report[key].shape != (2,):
            failures.append(f"{name}: report lacks {key} as tensor([sum, count])")
    if rc is not None and not any(k.startswith("rollout_corr/") for k in report):
        failures.append(f"{name}: no rollout_corr/* metric in the report")
    if name == "decoupled_seq_rs" and (eff_mask == mask).all():
        failures.append(f"{name}: RS rejected nothing; the case does not test the mask path")

    # -- gradients of every shard vs the reference's gradient, sliced the same way
    (loss_sum / num_tokens.clamp(min=1)).backward()
    ref.backward()
    r = dist.get_rank(tp)
    shards = {
        "embed": (model.embed.weight, 0), "fc1.w": (model.fc1.weight, 0), "fc1.b": (model.fc1.bias, 0),
        "fc2.w": (model.fc2.weight, 1), "fc2.b": (model.fc2.bias, None), "out": (model.out.weight, 0),
    }
    for key, (param, dim) in shards.items():
        want = full[key].grad
        if dim is not None:
            want = want.chunk(2, dim=dim)[r]
        if param.grad is None or not torch.allclose(param.grad.double(), want, rtol=1e-4, atol=1e-6):
            err = None if param.grad is None else (param.grad.double() - want).abs().max().item()
            failures.append(f"{name}: rank {rank} gradient of {key} differs from the reference (max err {err})")


def _check_groups_and_dropins(failures):
    """Defaults come from parallel_state; the cross-entropy drop-in equals -logp of the dense reference."""
    from megatron.core import parallel_state as ps

    from rollout_corr_ext.megatron import vocab_parallel_cross_entropy, vocab_parallel_log_probs

    tp = ps.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(11)
    full = torch.randn(S, B, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    shard = full.chunk(2, dim=-1)[dist.get_rank(tp)].clone()
    before = shard.clone()
    want = torch.log_softmax(full.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    got = vocab_parallel_log_probs(shard, target)  # tp_group defaulted from parallel_state
    if not torch.allclose(got.double(), want, atol=1e-5):
        failures.append("vocab_parallel_log_probs with the parallel_state default group is wrong")
    ce = vocab_parallel_cross_entropy(shard, target)
    if not torch.allclose(ce.double(), -want, atol=1e-5):
        failures.append("vocab_parallel_cross_entropy drop-in is wrong")
    if not torch.equal(shard, before):
        failures.append("the drop-ins modified the logits")

    class PG:  # a ProcessGroupCollection-like object, as newer megatron-core releases pass groups
        pass

    pg = PG()
    pg.tp, pg.dp = tp, ps.get_data_parallel_group()
    got2 = vocab_parallel_log_probs(shard, target, pg_collection=pg)
    if not torch.equal(got2, got):
        failures.append("pg_collection.tp is not used as the tensor-parallel group")


def _worker(rank: int, world: int):
    """run_workers joins the gloo group, reduces the failure flag (every rank agrees on the verdict, none hangs on a
    dead peer) and tears it down."""
    from megatron.core import parallel_state as ps

    failures = []
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        _check_groups_and_dropins(failures)
        for case in CASES:
            try:
                _run_case(*case, failures, rank)
            except Exception:
                failures.append(f"{case[0]}: {traceback.format_exc()}")
    finally:
        ps.destroy_model_parallel()
    assert not failures, "\n".join(failures)


def test_loss_func_contract_tp2_gloo():
    run_workers_preloaded(_worker, 2)


def test_make_policy_loss_func_bad_input():
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    tgt, mask, adv = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
    with pytest.raises(ValueError, match="token-sum"):
        make_policy_loss_func(tgt, adv, mask, loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        make_policy_loss_func(tgt, adv, mask, config=PolicyLossConfig(batch_num_tokens=10))
    with pytest.raises(ValueError, match="rollout_log_prob"):
        make_policy_loss_func(tgt, adv, mask, config=PolicyLossConfig(
            rollout_correction=RolloutCorrectionConfig.decoupled_token_is()))
    with pytest.raises(ValueError, match="old_log_prob"):
        make_policy_loss_func(tgt, adv, mask, rollout_log_prob=torch.zeros(2, 3), config=PolicyLossConfig(
            rollout_correction=RolloutCorrectionConfig.decoupled_token_is()))
    with pytest.raises(ValueError, match="advantages"):
        make_policy_loss_func(tgt, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="response_mask"):
        make_policy_loss_func(tgt, adv, mask[:, :2])
    with pytest.raises(ValueError, match="logits_layout"):
        make_policy_loss_func(tgt, adv, mask, logits_layout="vsb")
    loss_func = make_policy_loss_func(tgt, adv, mask)
    with pytest.raises(ValueError, match="logits"):
        loss_func(torch.zeros(3, 2))
    # a -100 target (ignore_index) at a response token would score log-prob 0 (probability 1) in the loss and an
    # MTP head's mean: refused, padded and packed; at a masked token it is megatron's usual padding label
    bad = tgt.clone()
    bad[1, 2] = -100
    for m in (mask, mask.float(), mask.long()):
        with pytest.raises(ValueError, match=r"target at \(1, 2\) is -100 \(ignore_index\) where response_mask"):
            make_policy_loss_func(bad, adv, m)
    with pytest.raises(ValueError, match=r"target at \(5,\) is -100"):
        make_policy_loss_func(bad.reshape(-1), torch.zeros(6), mask.reshape(-1), cu_seqlens=torch.tensor([0, 2, 6]))
    masked = mask.clone()
    masked[1, 2] = False
    make_policy_loss_func(bad, adv, masked)
    # packed boundaries past the stream, short of it, not from 0 or decreasing, with per-sequence advantages or
    # versions (expanded along them): the boundaries' own error (was a raw allocator / repeat error)
    flat, flat_mask = tgt.reshape(-1), mask.reshape(-1)
    for cu in ([0, 2, 9], [0, 2, 5], [1, 2, 6], [0, 4, 3, 6]):
        cu = torch.tensor(cu)
        for kw in (dict(advantages=torch.zeros(len(cu) - 1)),
                   dict(advantages=torch.zeros(6), versions=torch.zeros(len(cu) - 1, dtype=torch.long),
                        current_version=1)):
            with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease and end at the number"):
                make_policy_loss_func(flat, kw.pop("advantages"), flat_mask, cu_seqlens=cu, **kw)


def test_loss_func_single_process_bsv_layout_and_non_loss_data():
    """TP=1 without parallel_state: [b, s, V] logits (GPTModel's output) give the same loss as [s, b, V]."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, VOCAB, generator=g, requires_grad=True)
    tokens, target, mask, adv = _batch(3)
    f_bsv = make_policy_loss_func(target, adv, mask, logits_layout="bsv")
    f_sbv = make_policy_loss_func(target, adv, mask)
    a = f_bsv(logits)
    b = f_sbv(logits.transpose(0, 1))
    torch.testing.assert_close(a[0], b[0])
    assert int(a[1]) == int(mask.sum())
    # on-policy (no old_log_prob): ratio 1, loss = -mean(A) over valid tokens, gradient = REINFORCE's
    want = -(adv.view(-1, 1).expand(B, S).float() * mask).sum() / mask.sum()
    torch.testing.assert_close(a[0] / a[1], want)
    # megatron-core divides the returned loss in place (forward_step_calc_loss): autograd must allow it
    loss_sum, num_tokens, _ = f_sbv(logits.transpose(0, 1))
    loss_sum /= torch.clamp(num_tokens, min=1)
    loss_sum /= 2
    loss_sum.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    data = f_sbv(logits.transpose(0, 1), non_loss_data=True)
    assert set(data) == {"log_prob", "entropy"} and data["log_prob"].shape == (B, S)


def _mb(seed, empty):
    """One micro-batch [s, b, V] of logits and its batch tensors; ``empty``: "mask" (no response token),
    "replay" (every target outside top-1 sampling's kept set), or None."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, B, VOCAB, generator=g, dtype=torch.float64).float().requires_grad_(True)
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) < 0.8).float()
    mask[:, 0] = 1.0
    if empty == "mask":
        mask.zero_()
    elif empty == "replay":  # the least likely token of each row: never top-1
        target = logits.detach().argmin(-1).t().contiguous()
    adv = torch.randn(B, generator=g)
    old = torch.log_softmax(logits.detach().double() + 0.1 * torch.randn(S, B, VOCAB, generator=g, dtype=torch.float64),
                            -1).gather(-1, target.t().unsqueeze(-1)).squeeze(-1).t().float()
    roll = old + 0.05 * torch.randn(B, S, generator=g)
    return logits, target, mask, adv, old, roll


@pytest.mark.parametrize("loss_mode,preset", [
    ("vanilla", None), ("vanilla", "decoupled_token_is"), ("vanilla", "decoupled_seq_is_rs"),
    ("vanilla", "bypass_ppo_clip"), ("gspo", "decoupled_token_is"), ("geo_mean", "decoupled_seq_is_rs"),
    ("clip_cov", "decoupled_token_is"), ("kl_cov", "decoupled_token_is"), ("cispo", "decoupled_token_icepop")])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("empty", ["mask", "replay"])
def test_a_micro_batch_without_response_tokens_adds_nothing(loss_mode, preset, agg, empty):
    """megatron's contract over micro-batches: one without a response token (every mask 0, or every token left
    outside sampling replay's kept set) adds loss 0, num_tokens 0 (geo_mean: its row count, verl's mean over rows)
    and a zero gradient, and leaves every reported mean of the step as the other micro-batch alone gives it, with or
    without a rollout correction (whose own call would refuse a batch without tokens)."""
    from rollout_corr_ext import MismatchDiagnostics, SamplingParams
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    rc = None if preset is None else getattr(RolloutCorrectionConfig, preset)()
    cfg = PolicyLossConfig(loss_mode=loss_mode, rollout_correction=rc)
    # replay: the same metric names in both micro-batches; top-1 leaves none of the other's targets in its kept set
    samplings = {None: SamplingParams(top_k=VOCAB - 1), "replay": SamplingParams(top_k=1)} if empty == "replay" \
        else {None: None, "mask": None}

    def run(seed, what):
        logits, target, mask, adv, old, roll = _mb(seed, what)
        diag = MismatchDiagnostics() if rc is not None else None
        f = make_policy_loss_func(target, adv, mask, old_log_prob=old, rollout_log_prob=roll, config=cfg,
                                  loss_agg_mode=agg, sampling=samplings[what], diagnostics=diag)
        loss_sum, n, report = f(logits)
        loss_sum.backward()
        return loss_sum.detach(), n, report, logits.grad

    full = run(1, None)
    assert int(full[1]) > 0
    loss, n, report, grad = run(2, empty)
    assert torch.isfinite(loss) and float(loss) == 0.0
    assert int(n) == (B if loss_mode == "geo_mean" else 0)
    assert torch.equal(grad, torch.zeros_like(grad))
    for k, v in report.items():
        assert torch.isfinite(v).all(), k
    assert set(report) <= set(full[2])
    alone, both = reported_means(full[2]), reported_means([full[2], report])
    for k, want in alone.items():
        if k in report and not (k.startswith("rollout_corr/sampling") or k.startswith("actor/")):
            assert float(report[k][1]) == 0.0, k  # a statistic of no tokens: (0, 0)
        if k.startswith("rollout_corr/") and not k.startswith("rollout_corr/sampling"):
            assert both[k] == want or (math.isnan(want) and math.isnan(both[k])), k
    if loss_mode != "geo_mean":
        assert float((full[0] + loss) / (full[1] + n)) == float(full[0] / full[1])


def test_diagnostics_buckets_empty_in_one_micro_batch_do_not_poison_the_step():
    """A diagnostics bucket no token of a micro-batch fell in (NaN, a mean of nothing) is reported as (0, 0): the
    step's value is that of the micro-batches that have it (it was NaN for the step)."""
    from rollout_corr_ext import MismatchDiagnostics, compute_rollout_correction
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    rc = RolloutCorrectionConfig.decoupled_token_is()
    cfg = PolicyLossConfig(rollout_correction=rc)
    reports, direct = [], []
    for seed, lag in ((3, 0), (4, 2)):  # all tokens of one lag each: every other lag bucket empty
        logits, target, mask, adv, old, roll = _mb(seed, None)
        versions = torch.full((B,), 10 - lag)
        diag = MismatchDiagnostics(versions=versions, current_version=10)
        f = make_policy_loss_func(target, adv, mask, old_log_prob=old, rollout_log_prob=roll, config=cfg,
                                  diagnostics=diag)
        reports.append(f(logits)[2])
        direct.append(compute_rollout_correction(old.double(), roll.double(), mask, rc, diagnostics=diag).metrics)
    means = reported_means(reports)
    lag_keys = [k for k in means if "/by_lag/" in k]
    assert lag_keys
    for k in lag_keys:
        vals = [float(d[k]) for d in direct]
        defined = [v for v in vals if not math.isnan(v)]
        if not defined:
            assert math.isnan(means[k]), k
            continue
        assert not math.isnan(means[k]), k
        assert math.isclose(means[k], sum(defined) / len(defined), rel_tol=1e-6, abs_tol=1e-9), (k, means[k], vals)


def _empty_micro_batch_worker(rank, world):
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    group = dist.new_group(list(range(world)))
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_seq_is_rs())
    errors = []
    # the one-process reference of "rank 0 empty": both ranks' rows in one micro-batch (the empty rows count as
    # rows in the sequence-level metrics, as in verl's batch)
    e, f = _mb(5, "mask"), _mb(5, None)
    cat = [torch.cat([e[0].detach(), f[0].detach()], 1)] + [torch.cat([a, b]) for a, b in zip(e[1:], f[1:])]
    want = make_policy_loss_func(cat[1], cat[3], cat[2], old_log_prob=cat[4], rollout_log_prob=cat[5],
                                 config=cfg)(cat[0])
    for case in ("dp: rank 0 empty", "dp: every rank empty", "cp: the whole micro-batch empty"):
        try:
            empty = case != "dp: rank 0 empty" or rank == 0
            logits, target, mask, adv, old, roll = _mb(5, "mask" if empty else None)
            groups = dict(dp_group=group) if case.startswith("dp") else dict(dp_group=group, seq_group=group)
            if case.startswith("cp"):  # each rank its half of every sequence (any split along s)
                half = slice(rank * (S // 2), S if rank else S // 2)
                logits = logits.detach()[half].clone().requires_grad_(True)
                target, mask, old, roll = (t[:, half] for t in (target, mask, old, roll))
            loss_sum, n, report = make_policy_loss_func(target, adv, mask, old_log_prob=old, rollout_log_prob=roll,
                                                        config=cfg, **groups)(logits)
            loss_sum.backward()
            if empty and not (float(loss_sum) == 0.0 and int(n) == 0
                              and torch.equal(logits.grad, torch.zeros_like(logits.grad))):
                errors.append(f"rank {rank}: {case}: loss {float(loss_sum)}, n {int(n)}")
            if not empty and not (torch.allclose(loss_sum.detach(), want[0].detach(), rtol=1e-6)
                                  and int(n) == int(want[1])):
                errors.append(f"rank {rank}: {case}: loss {float(loss_sum)} != one process {float(want[0])}")
            for k, v in report.items():  # reduced over dp_group: the one-process batch, or nothing at all
                if not k.startswith("rollout_corr/"):
                    continue
                if case != "dp: rank 0 empty":
                    if not torch.equal(v, torch.zeros(2)):
                        errors.append(f"rank {rank}: {case}: {k} {v.tolist()} != [0, 0]")
                elif not math.isclose(float(v[0] / v[1]), float(want[2][k][0] / want[2][k][1]), rel_tol=1e-6,
                                      abs_tol=1e-7):
                    errors.append(f"rank {rank}: {case}: {k} {v.tolist()} != {want[2][k].tolist()}")
        except Exception:  # noqa: BLE001 - every rank goes on to the next collective
            errors.append(f"rank {rank}: {case}: {traceback.format_exc(limit=3)}")
    assert not errors, "\n".join(errors)


def test_micro_batches_without_tokens_under_data_and_context_parallelism():
    """gloo, 2 ranks: a data-parallel rank whose micro-batch has no response token adds nothing and the reduced
    rollout_corr/* report is the other rank's micro-batch alone; with every rank's (DP) or the whole sequences'
    (CP) micro-batch empty, every rank returns 0 / 0 / (0, 0) (the correction raised on every rank before)."""
    run_workers_preloaded(_empty_micro_batch_worker, 2)


@pytest.mark.parametrize("kept", [False, True])
def test_diagnostics_positions_with_tokens_outside_the_replayed_kept_set(kept):
    """Sampling replay takes tokens out of the correction's mask; the caller's diagnostics positions count among
    its own response tokens. They were refused as past the sequence's (kept) count; now the position breakdowns
    read each token's place in the whole response, with positions given or derived (the versions fuzz)."""
    from rollout_corr_ext import KeptTokens, MismatchDiagnostics, SamplingParams, compute_rollout_correction
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.losses import PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    logits, target, mask, adv, old, roll = _mb(7, None)
    if kept:  # the engine's kept ids: the 4 most likely tokens of each position (targets often outside)
        ids = logits.detach().topk(4, -1).indices.transpose(0, 1).reshape(-1, 4)
        sampling = KeptTokens.from_lists(ids.tolist())
    else:
        sampling = SamplingParams(top_k=4)
    rc_cfg = RolloutCorrectionConfig.decoupled_token_is()
    cfg = PolicyLossConfig(rollout_correction=rc_cfg)
    positions = torch.cumsum(mask.long(), 1) - 1
    reports = []
    for pos in (None, positions):
        f = make_policy_loss_func(target, adv, mask, old_log_prob=old, rollout_log_prob=roll, config=cfg,
                                  sampling=sampling, diagnostics=MismatchDiagnostics(positions=pos))
        reports.append(f(logits)[2])
    inside = f(logits, non_loss_data=True)["in_support"]
    assert 0 < int((inside & (mask != 0)).sum()) < int(mask.sum())  # some tokens left out, some kept
    direct = compute_rollout_correction(old, roll, torch.where(inside, mask, torch.zeros_like(mask)), rc_cfg,
                                        diagnostics=MismatchDiagnostics(position_mask=mask)).metrics
    keys = [k for k in direct if "/by_position" in k]
    assert keys
    for k in keys:
        a, b = reports[0][k], reports[1][k]
        assert torch.equal(a, b), k
        if math.isnan(float(direct[k])):
            assert float(a[1]) == 0.0, k
        else:
            assert math.isclose(float(a[0] / a[1]), float(direct[k]), rel_tol=1e-6, abs_tol=1e-7), k
