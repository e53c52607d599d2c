"""Sampling replay (docs/sampling_replay.md): ``sampled_log_probs`` against the dense fp64 oracle written from vLLM's
V1 sampler rules (``rollout_corr_testing/sampling_oracle.py``), and at TP = 2 / 4 against one process.

Inputs: logits on a coarse grid where stated (ties at the top-k and top-p boundaries), targets drawn from inside and
outside each row's kept set, ignored rows holding NaN, -inf logits, per-row parameters with some rows disabled.
"""

import dataclasses
import math
import re
import types

import pytest
import torch
import torch.distributed as dist

import rollout_corr_ext as rc
from rollout_corr_ext.sampling import KeptTokens, SamplingParams, kept_log_probs, kept_set, sampled_log_probs
from rollout_corr_testing.backends import device_params, ops_on
from rollout_corr_testing.dist_utils import CollectiveCounter, run_workers
from rollout_corr_testing.sampling_oracle import sampled_log_probs_dense
from rollout_corr_testing.tolerances import grad_tol, linear_tol, output_tol

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
#: temperatures that scale exactly (so fp32 and fp64 see the same order and ties) and one that does not
PARAMS = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.08),
    "all_three_t0.5": dict(top_k=20, top_p=0.8, min_p=0.02, temperature=0.5),
    "top_p_t0.7": dict(top_p=0.7, temperature=0.7),
    "top_k_ge_vocab": dict(top_k=10_000, top_p=0.95),
}


def _inputs(n, v, dtype, seed, grid=None, ignored=(1,), neg_inf=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 2.0
    if grid:  # a coarse grid: many equal values, at every boundary
        x = (x / grid).round() * grid
    if neg_inf:
        x[0, 3] = -math.inf
        x[2, :5] = -math.inf
    x = x.to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    for r in ignored:
        target[r] = -100
        x[r] = float("nan")  # ignored rows are never inspected
    return x, target


def _targets_in_and_out(x, target, kw, seed):
    """Half of the rows get a target inside their kept set (drawn from it), the rest keep a random one (mostly
    outside once truncation is on)."""
    _, _, _, _, kept = sampled_log_probs_dense(x.double(), target, **kw)
    g = torch.Generator().manual_seed(seed)
    t = target.clone()
    for i in range(0, x.shape[0], 2):
        if t[i] == -100:
            continue
        ids = kept[i].nonzero().flatten()
        t[i] = ids[torch.randint(0, ids.numel(), (1,), generator=g)]
    return t


def _check(res, oracle, dtype, x_grad=None, ref_grad=None):
    lp, ent, ls, ins, _ = oracle
    assert torch.equal(res.in_support, ins)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    tol = output_tol(dtype)
    assert res.log_prob.dtype == acc
    # -inf exactly where the oracle says the target is outside the kept set
    assert torch.equal(res.log_prob == -math.inf, lp == -math.inf)
    fin = lp != -math.inf
    torch.testing.assert_close(res.log_prob.double()[fin], lp.detach()[fin], **tol)
    torch.testing.assert_close(res.entropy.double(), ent, **tol)
    torch.testing.assert_close(res.log_kept_mass.double(), ls, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_matches_the_dense_vllm_oracle(name, dtype):
    kw = PARAMS[name]
    x, target = _inputs(9, 300, dtype, seed=sum(map(ord, name)), grid=0.25 if dtype != torch.float16 else None)
    target = _targets_in_and_out(x, target, kw, seed=1)
    res = sampled_log_probs(x, target, SamplingParams(**kw))
    oracle = sampled_log_probs_dense(x.double(), target, **kw)
    _check(res, oracle, dtype)
    assert bool((res.log_kept_mass <= 1e-6).all())
    assert bool(res.in_support.any()) and not bool(res.in_support.all())  # both kinds of targets occur


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gradient_is_the_renormalised_softmax_over_the_kept_set(dtype):
    kw = dict(top_k=30, top_p=0.85, temperature=0.5)
    x, target = _inputs(7, 200, dtype, seed=3, neg_inf=True)
    target = _targets_in_and_out(x, target, kw, seed=2)
    xs = x.clone().requires_grad_(True)
    res = sampled_log_probs(xs, target, SamplingParams(**kw))
    g = torch.randn(7, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    use = res.in_support & (target != -100)
    (torch.where(use, res.log_prob.double(), torch.zeros_like(g)) * g).sum().backward()
    xr = x.double().requires_grad_(True)
    lp, _, _, ins, kept = sampled_log_probs_dense(xr, target, **kw)
    (torch.where(use, lp, torch.zeros_like(lp)) * g).sum().backward()
    rows = use.nonzero().flatten()
    torch.testing.assert_close(xs.grad.double()[rows], xr.grad[rows], **grad_tol(dtype))
    assert bool((xs.grad[rows][~kept[rows]] == 0).all())  # exactly 0 outside the kept set
    assert bool((xs.grad[~use] == 0).all())


@pytest.mark.parametrize("path", ["scalar_t", "per_row_t", "kept", "kept_per_row_t"])
def test_a_target_outside_the_kept_set_passes_no_gradient(path):
    """Its log-prob is -inf and its gradient exactly 0 on every path, even when the caller's upstream gradient there
    is not 0 (the per-row-temperature and kept-id paths passed the kernel's -p / T on the kept columns)."""
    from rollout_corr_ext import KeptTokens, kept_log_probs

    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.25, 0.0, 3.0]])
    target = torch.tensor([3, 3])  # row 0: outside {0}; row 1: inside
    t = torch.tensor([1.0, 0.5]) if path.endswith("per_row_t") else 0.5
    xg = x.clone().requires_grad_(True)
    if path.startswith("kept"):
        res = kept_log_probs(xg, target, KeptTokens.from_lists([[0], [3, 0]], temperature=t))
    else:
        res = sampled_log_probs(xg, target, SamplingParams(temperature=t, top_k=2))  # row 0 keeps {0, 1}
    assert res.in_support.tolist() == [False, True] and float(res.log_prob[0].detach()) == -math.inf
    (grad,) = torch.autograd.grad(res.log_prob, xg, torch.ones(2))
    assert bool((grad[0] == 0).all()), grad[0]
    assert bool((grad[1] != 0).any())


def test_no_truncation_is_the_plain_log_prob_bit_for_bit():
    x, target = _inputs(6, 128, torch.float32, seed=5)
    for kw in (dict(), dict(top_k=128, top_p=1.0, min_p=0.0), dict(top_k=None, temperature=0.7)):
        res = sampled_log_probs(x, target, SamplingParams(**kw))
        plain, ent = rc.vocab_parallel_log_probs(x, target, temperature=kw.get("temperature", 1.0),
                                                 return_entropy=True)
        assert torch.equal(res.log_prob, plain) and torch.equal(res.entropy, ent)
        assert bool((res.log_kept_mass.abs() < 1e-6).all()) and bool(res.in_support.all())


def test_per_row_parameters_with_disabled_rows():
    x, target = _inputs(8, 160, torch.float32, seed=6, ignored=(3,))
    kw = dict(top_k=torch.tensor([5, 0, -1, 9, 160, 3, 0, 40]),
              top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 0.99, 1.0, 1.0, 0.6], dtype=torch.float64),
              min_p=torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0]),
              temperature=torch.tensor([1.0, 0.5, 2.0, 1.0, 0.25, 1.0, 1.0, 1.0]))
    target = _targets_in_and_out(x, target, kw, seed=7)
    res = sampled_log_probs(x, target, SamplingParams(**kw))
    _check(res, sampled_log_probs_dense(x.double(), target, **kw), torch.float32)


def test_ties_at_the_boundaries_are_kept_whole():
    # top-k: values 5, 4, 4, 4, 1: k = 2 keeps the three 4s. top-p: 4 equal tokens and p = 0.5 keep all four.
    x = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, -3.0], [2.0, 2.0, 2.0, 2.0, -9.0, -9.0]])
    res = sampled_log_probs(x, torch.tensor([3, 1]), SamplingParams(top_k=torch.tensor([2, 0]),
                                                                    top_p=torch.tensor([1.0, 0.5])))
    assert bool(res.in_support.all())
    assert res.log_prob[1].item() == pytest.approx(math.log(0.25), abs=1e-6)
    z = x[0, :4]
    assert res.log_prob[0].item() == pytest.approx((z[3] - torch.logsumexp(z, 0)).item(), abs=1e-6)


#: cases where every scored row has a top-k: the one-read candidate path (sampling._candidate_log_probs) runs them
CANDIDATE_CASES = {
    "k20_p0.8": dict(top_k=20, top_p=0.8),
    "k5_minp_t0.7": dict(top_k=5, min_p=0.05, temperature=0.7),
    "k3_t0.5": dict(top_k=3, temperature=0.5),
    "per_row": dict(top_k=torch.tensor([4, 30, 1, 12, 7, 50, 2, 9, 64]),
                    top_p=torch.tensor([0.9, 1.0, 0.5, 0.7, 1.0, 0.95, 0.6, 0.99, 0.8], dtype=torch.float64),
                    min_p=torch.tensor([0.0, 0.01, 0.0, 0.0, 0.1, 0.0, 0.0, 0.02, 0.0])),
}


def _spy_candidates(monkeypatch):
    """Records whether each call took the candidate path (True) or left it for the general search (False)."""
    import rollout_corr_ext.sampling as sampling_mod

    taken = []
    real = sampling_mod._candidate_log_probs

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(sampling_mod, "_candidate_log_probs", spy)
    return taken


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CANDIDATE_CASES))
def test_candidate_path_matches_the_oracle_and_the_general_search(name, dtype, monkeypatch):
    """With a top-k on every row the replay reads the logits once (a few candidates per row); its kept sets are the
    general search's and the dense oracle's, its values and gradients the oracle's."""
    import rollout_corr_ext.sampling as sampling_mod

    kw = CANDIDATE_CASES[name]
    x, target = _inputs(9, 700, dtype, seed=sum(map(ord, name)), grid=0.25 if dtype != torch.float16 else None)
    target = _targets_in_and_out(x, target, kw, seed=3)
    taken = _spy_candidates(monkeypatch)
    xs = x.clone().requires_grad_(True)
    res = sampled_log_probs(xs, target, SamplingParams(**kw))
    assert taken == [True]
    oracle = sampled_log_probs_dense(x.double(), target, **kw)
    _check(res, oracle, dtype)
    use = res.in_support & (target != -100)
    g = torch.randn(9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (torch.where(use, res.log_prob.double(), torch.zeros_like(g)) * g + res.entropy.double() * g.flip(0)).sum().backward()
    xr = torch.where(torch.isnan(x), torch.zeros_like(x), x).double().requires_grad_(True)
    lp, _, _, _, kept = sampled_log_probs_dense(xr, target, **kw)
    active = target != -100
    # the entropy over the oracle's kept set, differentiable: -sum q log q of log_softmax over it, in fp64
    log_q = torch.log_softmax(torch.where(kept, xr / kw.get("temperature", 1.0), torch.tensor(-math.inf).double()), 1)
    log_q = torch.where(kept, log_q, torch.zeros_like(log_q))  # no 0 * -inf in the backward
    ent = -torch.where(kept, log_q.exp() * log_q, torch.zeros_like(log_q)).sum(1)
    (torch.where(use, lp, torch.zeros_like(lp)) * g + torch.where(active, ent, torch.zeros_like(ent)) * g.flip(0)
     ).sum().backward()
    rows = active.nonzero().flatten()
    torch.testing.assert_close(xs.grad.double()[rows], xr.grad[rows], **grad_tol(dtype))
    assert bool((xs.grad[rows][~kept[rows]] == 0).all()) and bool((xs.grad[~active] == 0).all())
    # the general search (the candidate path turned off) keeps the same sets
    monkeypatch.setattr(sampling_mod, "CANDIDATE_MAX_K", 0)
    general = sampled_log_probs(x, target, SamplingParams(**kw))
    assert taken == [True, False]
    assert torch.equal(general.in_support, res.in_support)
    torch.testing.assert_close(general.log_kept_mass, res.log_kept_mass.detach(), **output_tol(dtype))


def test_candidate_path_leaves_rows_with_ties_past_its_lists_to_the_general_search(monkeypatch):
    """A row whose k-th value is tied more times than the candidate lists hold (bf16 logits tie often): the
    candidate path declines (every rank sees it in the gathered flags) and the general search decides."""
    from rollout_corr_ext.sampling import _candidate_width

    x, target = _inputs(4, 400, torch.bfloat16, seed=12, ignored=(), neg_inf=False)
    x[1, :] = -5.0
    x[1, :_candidate_width(6) + 40] = 2.0  # far more ties at the 6th largest than the lists hold
    target[1] = 3
    kw = dict(top_k=6, top_p=0.9)
    taken = _spy_candidates(monkeypatch)
    res = sampled_log_probs(x, target, SamplingParams(**kw))
    assert taken == [False]
    _check(res, sampled_log_probs_dense(x.double(), target, **kw), torch.bfloat16)


def test_bf16_tie_rule_kept_mass_difference_is_measured():
    """On bf16 logits (many ties) the whole-group rule keeps at least vLLM's set; the extra mass it keeps is what
    vLLM's sort order would drop. The docs state the measured bound; this checks it holds here."""
    x, target = _inputs(64, 2048, torch.bfloat16, seed=8, ignored=(), neg_inf=False)
    extra = []
    for i in range(x.shape[0]):
        z = x[i].double()
        asc, _ = z.sort(stable=True)
        cum = torch.softmax(asc, 0).cumsum(0)
        vllm_kept_mass = torch.softmax(asc, 0)[~((cum <= 0.1) & (torch.arange(z.numel()) != z.numel() - 1))].sum()
        res = sampled_log_probs(x[i:i + 1], target[i:i + 1], SamplingParams(top_p=0.9))
        ours = res.log_kept_mass.double().exp().item()
        extra.append(ours - vllm_kept_mass.item())
    extra = torch.tensor(extra)
    assert bool((extra >= -1e-6).all())  # never less than vLLM's set
    assert extra.max().item() < 0.02


@pytest.mark.parametrize("field,value,match", [
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"), ("top_p", 1.5, "top_p"), ("min_p", 1.0, r"min_p must be in \[0, 1\)"),
    ("temperature", 0.0, "temperature must be finite and > 0"), ("temperature", math.inf, "temperature"),
    ("top_k", -2, "top_k must be >= 1"), ("top_k", 2.5, "top_k must be None, an int"),
    ("top_p", torch.tensor([0.5, 0.0]), "top_p must be in"), ("top_k", torch.tensor([1.0]), "integers"),
])
def test_bad_parameters_name_the_field(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**{field: value})


def test_bad_inputs_are_named_and_inputs_untouched():
    x, target = _inputs(4, 50, torch.float32, seed=9, ignored=())
    x[2, 7] = float("nan")
    before = x.clone()
    with pytest.raises(ValueError, match="row 2"):
        sampled_log_probs(x, target, SamplingParams(top_p=0.9))
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())
    with pytest.raises(ValueError, match="one value per row"):
        sampled_log_probs(x, target, SamplingParams(top_p=torch.tensor([0.9, 0.8])))
    with pytest.raises(TypeError, match="SamplingParams"):
        sampled_log_probs(x, target, dict(top_p=0.9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_strided_along_the_vocab_equal_the_contiguous_ones(dtype):
    """Logits whose vocab dimension is not unit-stride (a transposed buffer) give the contiguous logits' outputs and
    gradient, bit for bit, on every path (temperature alone, top-p, min-p, top-k at or below the vocab, per-row
    tensors, kept sets); before, several paths stopped in a kernel's unnamed layout check."""
    n, v = 7, 9
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(v, n, generator=g).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    settings = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9),
                SamplingParams(temperature=0.8, min_p=0.1), SamplingParams(temperature=0.8, top_k=3),
                SamplingParams(temperature=0.8, top_k=v), SamplingParams(top_k=3, top_p=0.9),
                SamplingParams(temperature=torch.linspace(0.5, 1.5, n), top_p=torch.linspace(0.5, 1.0, n))]
    for sp in settings:
        outs = []
        for x in (buf.t(), buf.t().contiguous()):
            x = x.detach().requires_grad_(True)
            out = sampled_log_probs(x, target, sp)
            out.log_prob.masked_fill(~out.in_support, 0).sum().backward()
            outs.append((out.log_prob, out.entropy, out.log_kept_mass, out.in_support, x.grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b), sp
    kept = KeptTokens.from_lists([[0, 1, 2], [1, 2], [2, 3, 4], [3], [4, 0], [5, 6], [7, 8, 0]])
    a, b = (kept_log_probs(x, target, kept) for x in (buf.t(), buf.t().contiguous()))
    assert torch.equal(a.log_prob, b.log_prob) and torch.equal(a.log_kept_mass, b.log_kept_mass)


def test_from_verl_rollout_config():
    sp = SamplingParams.from_verl({"temperature": 0.8, "top_k": -1, "top_p": 0.95})
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.8, None, 0.95, 0.0)
    assert SamplingParams.from_verl({"top_k": 50}).top_k == 50
    for key, bad in (("top_p", None), ("temperature", None), ("top_p", "high"), ("temperature", True)):
        with pytest.raises(ValueError, match=rf"rollout config: {key} must be a number, got {bad!r}"):
            SamplingParams.from_verl({key: bad})
    assert SamplingParams.from_verl({"top_p": "0.9"}).top_p == 0.9  # a YAML string number reads as its value
    assert SamplingParams.from_verl({"top_k": "50", "min_p": "0"}).top_k == 50
    assert SamplingParams.from_verl({"top_k": 50.0, "min_p": None}).min_p == 0.0
    # verl (0.9.1) passes temperature, top_k and top_p to its engine (experimental/agent_loop/agent_loop.py), never
    # a min_p: one in the config was not sampled with, and replaying it truncated what the engine did not (was
    # replayed, silently)
    verl_fields = {f.name for f in dataclasses.fields(pytest.importorskip("verl.workers.config.rollout").RolloutConfig)}
    assert {"temperature", "top_k", "top_p"} <= verl_fields and "min_p" not in verl_fields
    for name in ("vllm", None):
        with pytest.raises(ValueError, match=r"rollout config: min_p=0.05: verl passes temperature, top_k and top_p"):
            SamplingParams.from_verl({"top_k": "50", "min_p": "0.05", "name": name})
    # an offset that is not an integer is another sampler, silently (int() read 4.7 as 4): named
    for bad in (4.7, "4.7", True, "many", [4], "+-5", "\u00b2"):
        with pytest.raises(ValueError, match=rf"rollout config: top_k must be an integer .*got {re.escape(repr(bad))}"):
            SamplingParams.from_verl({"top_k": bad})
    with pytest.raises(ValueError, match="rollout config: min_p must be a number, got 'low'"):
        SamplingParams.from_verl({"min_p": "low"})


def test_from_megatron_maps_megatron_cores_sampling_params():
    """megatron-core's inference SamplingParams (0 / 0.0: top_k / top_p disabled) and its logprobs_mode: raw
    log-probs (the default, and all that megatron-core 0.16 reports) are of the untruncated distribution at
    temperature 1, so nothing is replayed (None); processed ones are replayed with the engine's parameters."""
    msp = pytest.importorskip("megatron.core.inference.sampling_params").SamplingParams
    processed = "processed_logprobs"
    assert SamplingParams.from_megatron(msp(temperature=0.7, top_p=0.9), logprobs_mode="raw_logprobs") is None
    assert SamplingParams.from_megatron(msp(), logprobs_mode=processed) == SamplingParams()
    assert SamplingParams.from_megatron(msp(temperature=0.7, top_p=0.9), logprobs_mode=processed) == \
        SamplingParams(temperature=0.7, top_p=0.9)
    assert SamplingParams.from_megatron(msp(top_k=50), logprobs_mode=processed) == SamplingParams(top_k=50)
    # FlashInfer's sampler takes both (top-k, then top-p on the renormalised top-k: vLLM's order)
    both = SamplingParams.from_megatron({"temperature": 2, "top_k": 5, "top_p": 0.5}, logprobs_mode=processed)
    assert both == SamplingParams(temperature=2.0, top_k=5, top_p=0.5)
    # any mapping is read by key, not by attribute (which would find no field and fall back to the defaults)
    view = types.MappingProxyType({"temperature": 2, "top_k": 5, "top_p": 0.5})
    assert SamplingParams.from_megatron(view, logprobs_mode=processed) == both
    # the mode read off megatron-core's InferenceConfig (or anything holding it)
    config = type("InferenceConfig", (), {"logprobs_mode": processed})()
    assert SamplingParams.from_megatron(msp(top_k=3), logprobs_mode=config) == SamplingParams(top_k=3)
    bad = [({}, {"logprobs_mode": "processed"}, ValueError, "logprobs_mode must be 'raw_logprobs' or"),
           ({"top_k": -1}, {}, ValueError, r"sampling_params.top_k must be >= 0 \(0: disabled\), got -1"),
           ({"top_k": 2.0}, {}, TypeError, "sampling_params.top_k must be an int, got 2.0"),
           ({"top_k": True}, {}, TypeError, "sampling_params.top_k must be an int"),
           ({"top_p": 1.5}, {}, ValueError, r"sampling_params.top_p must be in \[0, 1\]"),
           ({"top_p": None}, {}, TypeError, "sampling_params.top_p must be a number, got None"),
           ({"temperature": 0.0}, {}, ValueError, "temperature=0.0: below 1e-6 megatron-core's torch sampler"),
           ({"temperature": math.nan}, {}, ValueError, "temperature=nan")]
    for fields, kw, err, match in bad:  # named whatever the mode: a raw config with them is still wrong
        for mode in ("raw_logprobs", processed):
            with pytest.raises(err, match=match):
                SamplingParams.from_megatron(fields, **{"logprobs_mode": mode, **kw})


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (1.3, 20, 0.0), (1.0, 1, 0.0), (0.5, 0, 0.0),
                                                     (1.0, 0, 0.3)])
def test_from_megatron_replays_megatron_cores_processed_log_probs(temperature, top_k, top_p):
    """Against megatron-core's own filter (0.19 on: ``TorchSampling.filter_logits``, which its processed
    ``log_probs_kernel`` applies before ``log_softmax``): the replay of ``from_megatron``'s parameters gives its
    log-probs, its kept set and its -inf outside it."""
    torch_sampling = pytest.importorskip(
        "megatron.core.inference.sampling.torch_sampling",
        reason="megatron-core before 0.19 reports raw log-probs only (no processed log-probs to replay)")
    msp = pytest.importorskip("megatron.core.inference.sampling_params").SamplingParams
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(24, 257, generator=g) * 3
    target = torch.randint(0, 257, (24,), generator=g)
    ref = torch.log_softmax(torch_sampling.TorchSampling.filter_logits(logits, float(temperature), top_k, top_p),
                            dim=-1)
    target[::2] = ref[::2].argmax(-1)  # half the rows: a token surely kept; the others mostly outside
    ref_lp = ref.gather(-1, target[:, None])[:, 0]
    sp = SamplingParams.from_megatron(msp(temperature=temperature, top_k=top_k, top_p=top_p),
                                      logprobs_mode="processed_logprobs")
    out = sampled_log_probs(logits, target, sp)
    assert torch.equal(out.in_support, torch.isfinite(ref_lp))
    assert bool((~out.in_support).any()) == (top_k > 0 or top_p > 0.0)  # the truncation did drop some targets
    torch.testing.assert_close(out.log_prob, ref_lp, rtol=1e-5, atol=1e-5)
    kept = torch.isfinite(ref)
    torch.testing.assert_close(out.log_kept_mass, torch.logsumexp(
        torch.where(kept, logits / temperature, -math.inf), -1) - torch.logsumexp(logits / temperature, -1),
        rtol=1e-5, atol=1e-5)


def test_from_verl_reads_the_vllm_engine_kwargs():
    """verl spreads ``rollout.engine_kwargs.vllm`` into vLLM's arguments (verl 0.9.1, vllm_async_server.py): a lossy
    speculative decoding (vLLM 0.33.0's rejection_sample_method "synthetic" accepts drafts at a set rate, "fly" is
    lossy by vLLM's account) draws tokens from another distribution than the one whose log-probs vLLM reports, and
    custom logits processors change both before the temperature: refused, where they were replayed silently."""
    base = {"name": "vllm", "top_p": 0.9, "temperature": 0.7}
    for spec in ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0},
                 '{"method": "mtp", "rejection_sample_method": "fly"}', {"rejection_sample_method": "FLY"}):
        for extra in ({}, {"top_p": 1.0, "temperature": 1.0}):  # also where nothing is replayed
            cfg = {**base, **extra, "engine_kwargs": {"vllm": {"speculative_config": spec}}}
            with pytest.raises(ValueError, match=r"speculative_config.rejection_sample_method='(synthetic|fly|FLY)'"):
                SamplingParams.from_verl(cfg)
    for spec in ({"rejection_sample_method": "standard"}, {"rejection_sample_method": "block"},
                 '{"method": "mtp", "num_speculative_tokens": 2}', {"rejection_sample_method": None}):
        sp = SamplingParams.from_verl({**base, "engine_kwargs": {"vllm": {"speculative_config": spec}}})
        assert (sp.top_p, sp.temperature) == (0.9, 0.7)
    with pytest.raises(ValueError, match="speculative_config is neither a mapping nor JSON"):
        SamplingParams.from_verl({**base, "engine_kwargs": {"vllm": {"speculative_config": "{bad"}}})
    for procs in (["my_pkg.Biaser"], "my_pkg.Biaser", ("a", "b")):
        with pytest.raises(ValueError, match=r"engine_kwargs.vllm.logits_processors=.*before the temperature"):
            SamplingParams.from_verl({**base, "engine_kwargs": {"vllm": {"logits-processors": procs}}})
    for procs in ([], None):
        SamplingParams.from_verl({**base, "engine_kwargs": {"vllm": {"logits_processors": procs}}})
    # another engine's kwargs, and vllm's kwargs under another engine, are not vLLM's options
    lossy = {"vllm": {"speculative_config": {"rejection_sample_method": "synthetic"}}}
    assert SamplingParams.from_verl({"name": "sglang", "temperature": 0.7, "engine_kwargs": lossy}).temperature == 0.7
    SamplingParams.from_verl({**base, "engine_kwargs": {"sglang": {"logits_processors": ["x"]}, "vllm": None}})
    with pytest.raises(TypeError, match="engine_kwargs.vllm must be a mapping"):
        SamplingParams.from_verl({**base, "engine_kwargs": {"vllm": ["speculative_config"]}})


# --------------------------------------------------------------------------------------------- tensor parallel

TP_CASES = [dict(top_k=12, top_p=0.85), dict(top_p=0.7, min_p=0.01, temperature=0.5), dict(top_k=3),
            dict(top_k=9, top_p=0.9, min_p=0.02, temperature=0.7)]


def _scaled(x, active, kw, vocab_size=None):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = torch.where(active.unsqueeze(1), x.to(acc), torch.zeros((), dtype=acc)) / \
        torch.as_tensor(kw.get("temperature", 1.0), dtype=acc)
    if vocab_size is not None:
        z[:, vocab_size:] = -math.inf
    return z


def _kept(z, kw, active, group, world, fast=True):
    ks = kept_set(lambda r0, r1: z[r0:r1], z.shape[0], z.shape[1], z.dtype, z.device, SamplingParams(**kw), active,
                  (z.shape[0],), group, world, allow_fast_top_p=fast)
    return ks.mask(z) & active.unsqueeze(1)


def test_top_k_candidates_and_general_search_agree_with_ties_past_k():
    """A row whose k-th value is tied many times over (more than k on one shard): the candidates are incomplete,
    the general search decides; both paths give the oracle's kept set."""
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.5, -1.0]] * 2, dtype=torch.float32)
    x[1] = torch.linspace(2, -2, 10)
    active = torch.ones(2, dtype=torch.bool)
    kw = dict(top_k=2, top_p=0.9)
    want = sampled_log_probs_dense(x.double(), torch.zeros(2, dtype=torch.long), **kw)[4]
    for fast in (True, False):
        assert torch.equal(_kept(_scaled(x, active, kw), kw, active, None, 1, fast), want), fast


def _tp_worker(rank, world):
    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for i, kw in enumerate(TP_CASES):
            vocab_size = 90  # the last shard ends in padding
            x, target = _inputs(10, vocab_size, dtype, seed=20 + i, grid=0.5 if i == 0 else None)
            target = _targets_in_and_out(x, target, kw, seed=i)
            x = torch.cat([x, torch.full((10, 96 - vocab_size), 7.0, dtype=dtype)], dim=1)  # padding: must not count
            single = sampled_log_probs(x, target, SamplingParams(**kw), vocab_size=vocab_size)
            v_local = 96 // world
            shard = x[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
            with CollectiveCounter() as c:
                res = sampled_log_probs(shard, target, SamplingParams(**kw), group, vocab_size=vocab_size)
            assert len(c.calls) < 30, c.calls  # a fixed handful of small collectives, independent of V
            assert torch.equal(res.in_support, single.in_support), (dtype, kw)
            assert torch.equal(res.log_prob == -math.inf, single.log_prob == -math.inf)
            fin = single.log_prob != -math.inf
            torch.testing.assert_close(res.log_prob[fin], single.log_prob[fin], **output_tol(dtype))
            torch.testing.assert_close(res.entropy, single.entropy, **output_tol(dtype))
            torch.testing.assert_close(res.log_kept_mass, single.log_kept_mass, **output_tol(dtype))
            # The kept sets are the same to the bit: gather this rank's kept shard and compare with one process's.
            active = target != -100
            z_full = _scaled(x, active, kw, vocab_size)
            kept_single = _kept(z_full, kw, active, None, 1)
            z_shard = z_full[:, rank * v_local:(rank + 1) * v_local].contiguous()
            for fast in (True, False):  # the top-k candidates' search and the general one agree
                kept_shard = _kept(z_shard, kw, active, group, world, fast)
                gathered = [torch.empty_like(kept_shard, dtype=torch.uint8) for _ in range(world)]
                dist.all_gather(gathered, kept_shard.to(torch.uint8), group=group)
                assert torch.equal(torch.cat(gathered, dim=1).bool(), kept_single), (dtype, kw, fast)
            # backward: no collective, zero outside the kept set
            use = res.in_support & active
            with CollectiveCounter() as cb:
                torch.where(use, res.log_prob, torch.zeros_like(res.log_prob)).sum().backward()
            assert cb.calls == []
            kept_local = kept_single[:, rank * v_local:(rank + 1) * v_local]
            assert bool((shard.grad[use][~kept_local[use]] == 0).all())


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_one_process(world):
    run_workers(_tp_worker, world)


def _refusal_tp_worker(rank, world):
    """Every rank raises alike (none is left waiting in a collective another skipped), naming the fault."""
    from rollout_corr_ext.sampling import KeptTokens, kept_log_probs

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 40, generator=g)
    target = torch.tensor([1, 12, 25, 39])
    v_local = 40 // world
    shard = x[:, rank * v_local:(rank + 1) * v_local].clone()
    cand = SamplingParams(top_k=4, top_p=0.9)

    def refused(match, fn):
        with pytest.raises(ValueError, match=match):
            fn()

    # the candidate path checks the shards as the plain log-probs' headers do
    refused("do not fit together.*overlap", lambda: sampled_log_probs(shard, target, cand, group, vocab_start=0,
                                                                          vocab_size=40))
    refused("do not fit together.*different targets",
            lambda: sampled_log_probs(shard, target.roll(rank), cand, group, vocab_size=40))
    refused("do not fit together.*vocab_size", lambda: sampled_log_probs(shard, target, cand, group,
                                                                          vocab_size=40 + rank))
    # NaN / +inf on one rank's shard only: every path, and the kept ids, raise on every rank
    bad = shard.clone()
    if rank == world - 1:
        bad[2, 3] = float("nan")
        bad[3, 0] = math.inf
    for sp in (cand, SamplingParams(top_p=0.9), SamplingParams(min_p=0.1)):
        refused("NaN or \\+inf logit in row 2", lambda: sampled_log_probs(bad, target, sp, group, vocab_size=40))
    kept = KeptTokens.from_lists([[1], [12], [25], [39]])
    refused("NaN or \\+inf logit in row 2", lambda: kept_log_probs(bad, target, kept, group, vocab_size=40))
    # different settings on one rank (before: silent wrong values, e.g. -inf at a target top-k always keeps): every
    # path and the kept ids raise on every rank
    other = rank == world - 1
    for sp, odd in ((cand, SamplingParams(temperature=0.5, top_k=4, top_p=0.9)),  # the candidate path
                    (cand, SamplingParams(top_k=4, top_p=0.8)),
                    (SamplingParams(top_p=0.9), SamplingParams(top_p=0.5)),  # the general search
                    (SamplingParams(min_p=0.1), SamplingParams(min_p=0.2)),
                    (SamplingParams(top_k=4, min_p=0.1), SamplingParams(top_k=4, min_p=0.1, top_p=0.9)),
                    # (a different largest top-k changes the exchange's size: the collective's own error then)
                    (SamplingParams(top_k=torch.full((4,), 4)), SamplingParams(top_k=torch.tensor([4, 4, 3, 4]))),
                    (SamplingParams(top_p=torch.full((4,), 0.9)),
                     SamplingParams(top_p=torch.tensor([0.9, 0.9, 0.9, 0.8])))):
        refused("different settings", lambda: sampled_log_probs(shard, target, odd if other else sp, group,
                                                                 vocab_size=40))
    for sp in (cand, SamplingParams(top_p=0.9), SamplingParams(temperature=torch.full((4,), 0.7), top_k=4)):
        refused("different settings", lambda: sampled_log_probs(shard, target, sp, group, vocab_size=40,
                                                                 ignore_index=12 if other else -100))
    # (bf16 against fp32: the same fp32 exchange; fp64 against fp32 would change its size)
    refused("different settings", lambda: sampled_log_probs(shard.bfloat16() if other else shard, target,
                                                             SamplingParams(top_p=0.9), group, vocab_size=40))
    # shards that overlap or leave a gap: named as such (before: "every kept id ... has a -inf logit")
    refused("hold .* kept ids .* overlap or leave gaps", lambda: kept_log_probs(shard, target, kept, group,
                                                                                vocab_start=0, vocab_size=40))
    odd_kept = KeptTokens.from_lists([[1], [12], [25, 3 if other else 4], [39]])
    refused("different settings", lambda: kept_log_probs(shard, target, odd_kept, group, vocab_size=40))
    # and the same inputs, fixed, still run
    sampled_log_probs(shard, target, cand, group, vocab_size=40)


def test_tensor_parallel_refusals_are_raised_on_every_rank():
    run_workers(_refusal_tp_worker, 2)


def test_sampling_metrics_over_valid_tokens():
    from rollout_corr_ext.sampling import sampling_metrics

    x, target = _inputs(3, 40, torch.float32, seed=11, ignored=())
    res = sampled_log_probs(x.reshape(3, 1, 40).expand(3, 2, 40), target.reshape(3, 1).expand(3, 2),
                            SamplingParams(top_k=3))
    mask = torch.tensor([[1, 0], [1, 1], [0, 0]])
    met = sampling_metrics(res, mask)
    valid = mask.bool()
    s = res.log_kept_mass.double()[valid]
    assert met["rollout_corr/sampling_kept_mass_mean"].item() == pytest.approx(s.exp().mean().item(), rel=1e-12)
    assert met["rollout_corr/sampling_kept_mass_min"].item() == pytest.approx(s.exp().min().item(), rel=1e-12)
    assert met["rollout_corr/sampling_log_kept_mass_mean"].item() == pytest.approx(s.mean().item(), rel=1e-12)
    want = (~res.in_support[valid]).double().mean().item()
    assert met["rollout_corr/sampling_out_of_support_fraction"].item() == pytest.approx(want, abs=1e-12)
    # no valid token: every statistic NaN (was 0 for the means and +inf for the min)
    empty = sampling_metrics(res, torch.zeros_like(mask))
    assert len(empty) == 4 and all(math.isnan(v.item()) for v in empty.values()), empty
    with pytest.raises(ValueError, match="response_mask"):
        sampling_metrics(res, mask[:, :1])
    # not a mask, not a replay's result: named, where a list or a tuple failed with an AttributeError and a complex
    # mask was taken
    with pytest.raises(TypeError, match="response_mask must be a torch.Tensor"):
        sampling_metrics(res, mask.tolist())
    with pytest.raises(TypeError, match="response_mask must be a bool, integer or float tensor"):
        sampling_metrics(res, mask.to(torch.complex64))
    with pytest.raises(TypeError, match="result must be the SampledLogProbs"):
        sampling_metrics(tuple(res), mask)


# --------------------------------------------------------------------------------------------- the policy loss


def test_make_policy_loss_func_replays_and_masks_tokens_outside_the_kept_set():
    """make_policy_loss_func(sampling=...) equals the dense composition: the oracle's truncated log-probs, the
    tokens outside the kept set out of the loss (token-mean PPO against old_log_prob, bypass rollout correction
    with token TIS), and the sampling metrics over the response tokens."""
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means
    from rollout_corr_testing.dense_oracles import agg_loss_dense, ppo_clip_loss_dense

    b, s, v = 3, 6, 80
    kw = dict(top_k=10, top_p=0.8, temperature=0.7)
    g = torch.Generator().manual_seed(12)
    logits_bsv = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, v, (b, s), generator=g)
    flat_t = _targets_in_and_out(logits_bsv.reshape(-1, v), target.reshape(-1), kw, seed=3).reshape(b, s)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[2, 4:] = False
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lp_ref, _, ls_ref, ins_ref, _ = sampled_log_probs_dense(logits_bsv.reshape(-1, v), flat_t.reshape(-1), **kw)
    lp_ref, ls_ref, ins_ref = lp_ref.reshape(b, s), ls_ref.reshape(b, s), ins_ref.reshape(b, s)
    old = torch.where(ins_ref, lp_ref, torch.zeros_like(lp_ref)).detach() + 0.05 * torch.randn(b, s, generator=g,
                                                                                           dtype=torch.float64)
    assert bool((mask & ~ins_ref).any()) and bool((mask & ins_ref).any())

    x = logits_bsv.clone().requires_grad_(True)
    fn = make_policy_loss_func(flat_t, adv, mask, old_log_prob=old, logits_layout="bsv", vocab_size=v,
                               sampling=SamplingParams(**kw))
    loss_sum, count, report = fn(x)
    (loss_sum / count).backward()

    xr = logits_bsv.clone().requires_grad_(True)
    lp, _, _, _, _ = sampled_log_probs_dense(xr.reshape(-1, v), flat_t.reshape(-1), **kw)
    eff = mask & ins_ref
    lp = torch.where(eff, lp.reshape(b, s), torch.zeros((), dtype=torch.float64))
    adv_bt = adv.reshape(-1, 1).expand(b, s)
    pg, *_ = ppo_clip_loss_dense(torch.where(eff, old, torch.zeros_like(old)), lp, adv_bt, eff, 0.2, 0.2, 3.0)
    ref = agg_loss_dense(pg, eff, "token-mean")
    ref.backward()
    assert (loss_sum / count).item() == pytest.approx(ref.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-9, atol=1e-12)
    means = reported_means(report)
    assert means["rollout_corr/sampling_out_of_support_fraction"] == pytest.approx(
        (mask & ~ins_ref).sum().item() / mask.sum().item())
    assert means["rollout_corr/sampling_log_kept_mass_mean"] == pytest.approx(ls_ref[mask].mean().item(), rel=1e-6)  # fp32 report
    with pytest.raises(ValueError, match="temperature"):
        make_policy_loss_func(flat_t, adv, mask, temperature=0.7, sampling=SamplingParams(**kw))
    with pytest.raises(TypeError, match="SamplingParams"):
        make_policy_loss_func(flat_t, adv, mask, sampling=dict(top_k=3))


def test_replayed_old_log_prob_outside_its_kept_set_leaves_the_loss():
    """Decoupled flow with replay: pi_old (replayed by the caller) is -inf where the token is outside pi_old's own
    kept set although pi_theta keeps it. The token leaves the loss and the rollout correction (the PPO ratio is
    undefined there) and is counted as out of support; the rest equals the same call with those tokens masked by
    hand. Bypass mode does not read old_log_prob and is unaffected."""
    from rollout_corr_ext.config import RolloutCorrectionConfig
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    b, s, v = 2, 5, 40
    kw = dict(top_k=12, top_p=0.9)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(b, s, v, generator=g, dtype=torch.float64)
    target = _targets_in_and_out(logits.reshape(-1, v), torch.randint(0, v, (b * s,), generator=g), kw,
                                 seed=2).reshape(b, s)
    target[:, 1::2] = logits[:, 1::2].argmax(-1)  # surely kept by pi_theta
    lp, _, _, ins, _ = sampled_log_probs_dense(logits.reshape(-1, v), target.reshape(-1), **kw)
    lp, ins = lp.reshape(b, s).detach(), ins.reshape(b, s)
    old = torch.where(ins, lp, torch.zeros_like(lp)) - 0.02
    old_out = ins.clone()
    old_out[:, :] = False
    old_out[0, 1] = old_out[1, 3] = True  # kept by pi_theta, outside pi_old's kept set
    assert bool(ins[old_out].all())
    old_inf = old.masked_fill(old_out, -math.inf)
    mask = torch.ones(b, s, dtype=torch.bool)
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    rollout = old + 0.03 * torch.randn(b, s, generator=g, dtype=torch.float64)
    cfg = dict(config=dict(clip_ratio=0.2, rollout_correction=RolloutCorrectionConfig.decoupled_token_is(threshold=2.0)))
    common = dict(logits_layout="bsv", vocab_size=v, sampling=SamplingParams(**kw), rollout_log_prob=rollout, **cfg)

    x1 = logits.clone().requires_grad_(True)
    l1, n1, r1 = make_policy_loss_func(target, adv, mask, old_log_prob=old_inf, **common)(x1)
    (l1 / n1).backward()
    x2 = logits.clone().requires_grad_(True)
    l2, n2, r2 = make_policy_loss_func(target, adv, mask & ~old_out, old_log_prob=old, **common)(x2)
    (l2 / n2).backward()
    assert torch.isfinite(l1) and int(n1) == int(n2)
    assert (l1 / n1).item() == pytest.approx((l2 / n2).item(), rel=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    m1, m2 = reported_means(r1), reported_means(r2)
    assert m1["rollout_corr/sampling_out_of_support_fraction"] == pytest.approx(
        ((~ins) | old_out).sum().item() / mask.sum().item())
    assert m1["rollout_corr/rollout_is_mean"] == pytest.approx(m2["rollout_corr/rollout_is_mean"], rel=1e-6)
    # bypass: old_log_prob unused, its -inf changes nothing
    bcfg = dict(config=dict(clip_ratio=0.2, rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip()))
    common.update(bcfg)
    lb1, nb1, _ = make_policy_loss_func(target, adv, mask, old_log_prob=old_inf, **common)(logits)
    lb2, nb2, _ = make_policy_loss_func(target, adv, mask, old_log_prob=old, **common)(logits)
    assert torch.equal(lb1, lb2) and int(nb1) == int(nb2)


def test_the_candidate_search_counts_ties_that_run_past_the_list():
    """With a top-k, the gathered candidates decide top-p, a run of ties at the threshold longer than a shard's list
    included (counted and weighted): the oracle's kept set and log S."""
    active = torch.ones(1, dtype=torch.bool)
    distinct = torch.linspace(2, -2, 10).reshape(1, 10)
    tied = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.5, -1.0]])
    for kw in (dict(top_k=2, top_p=0.9), dict(top_k=2, top_p=0.5), dict(top_k=1, top_p=0.3)):
        for z in (distinct, tied):
            ks = kept_set(lambda r0, r1: z[r0:r1], 1, 10, z.dtype, z.device, SamplingParams(**kw), active, (1,),
                          None, 1)
            assert ks.fast_top_p
            _, _, ls, _, want = sampled_log_probs_dense(z.double(), torch.zeros(1, dtype=torch.long), **kw)
            assert torch.equal(ks.mask(z), want), (kw, z)
            assert ks.log_kept_mass.item() == pytest.approx(ls.item(), abs=1e-6)


# --------------------------------------------------------------------------------------------- from hidden states


def _linear_case(n, h, v, dtype, seed, vocab_size=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.6).to(dtype)
    bias = (torch.randn(v, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    vs = v if vocab_size is None else vocab_size
    if vs < v:
        weight[vs:] = float("nan")  # padded vocabulary rows are never read
        bias[vs:] = float("nan")
    target = torch.randint(0, vs, (n,), generator=g)
    target[1] = -100
    hidden[1] = float("nan")  # an ignored row's hidden state is never read
    return hidden, weight, bias, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kw", [dict(top_k=6, top_p=0.8, temperature=0.5), dict(top_p=0.7), dict(min_p=0.05, top_k=9)],
                         ids=["k_p_t", "p_only", "min_p_k"])
def test_linear_log_probs_with_replay_match_the_oracle(kw, dtype):
    from rollout_corr_ext.sampling import sampled_linear_log_probs

    n, h, v, vs = 11, 16, 40, 37
    hidden, weight, bias, target = _linear_case(n, h, v, dtype, seed=31, vocab_size=vs)
    # the logits as the fused path's chunks compute them (4 rows x 16 vocab columns, in the input dtype), so that the
    # oracle decides on the very values the kernels see
    from rollout_corr_ext.linear import chunk_logits
    logits = torch.cat([torch.cat([chunk_logits(hidden[r0:r0 + 4], weight[c0:min(c0 + 16, vs)],
                                                 bias[c0:min(c0 + 16, vs)]) for c0 in range(0, vs, 16)], 1)
                        for r0 in range(0, n, 4)])
    logits = torch.where(torch.isnan(logits), torch.zeros_like(logits), logits)
    target = _targets_in_and_out(logits, target, kw, seed=5)
    hs, ws, bs = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    res = sampled_linear_log_probs(hs, ws, target, SamplingParams(**kw), bias=bs, vocab_size=vs, chunk_rows=4,
                                   chunk_cols=16)
    # the oracle, on the very logits the chunks compute (rounded to the input dtype, as the GEMM returns them)
    oracle = sampled_log_probs_dense(logits.double(), target, **kw)
    _check(res, oracle, dtype)
    use = res.in_support & (target != -100)
    g = torch.randn(n, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    (torch.where(use, res.log_prob.double(), torch.zeros_like(g)) * g).sum().backward()
    hr = torch.where(target.unsqueeze(1) == -100, torch.zeros_like(hidden), hidden).double().requires_grad_(True)
    wr, br = weight[:vs].double().requires_grad_(True), bias[:vs].double().requires_grad_(True)
    lp, _, _, _, _ = sampled_log_probs_dense(hr @ wr.t() + br, target, **kw)
    (torch.where(use, lp, torch.zeros_like(lp)) * g).sum().backward()
    tol = dict(rtol=5e-2, atol=5e-2) if dtype == torch.bfloat16 else grad_tol(dtype)
    torch.testing.assert_close(hs.grad.double()[target != -100], hr.grad[target != -100], **tol)
    assert bool((hs.grad[1] == 0).all())  # the ignored row
    torch.testing.assert_close(ws.grad.double()[:vs], wr.grad, **tol)
    assert bool((ws.grad[vs:] == 0).all()) and bool((bs.grad[vs:] == 0).all())
    torch.testing.assert_close(bs.grad.double()[:vs], br.grad, **tol)


def _linear_tp_worker(rank, world):
    from rollout_corr_ext.sampling import sampled_linear_log_probs

    group = dist.group.WORLD
    for i, kw in enumerate([dict(top_k=5, top_p=0.85), dict(top_p=0.6, temperature=0.7)]):
        hidden, weight, bias, target = _linear_case(9, 8, 48, torch.float32, seed=40 + i, vocab_size=45)
        single = sampled_linear_log_probs(hidden, weight, target, SamplingParams(**kw), bias=bias, vocab_size=45,
                                          chunk_rows=4, chunk_cols=8)
        vl = 48 // world
        res = sampled_linear_log_probs(hidden, weight[rank * vl:(rank + 1) * vl], target, SamplingParams(**kw), group,
                                       bias=bias[rank * vl:(rank + 1) * vl], vocab_size=45, chunk_rows=4, chunk_cols=8)
        assert torch.equal(res.in_support, single.in_support), kw
        fin = single.log_prob != -math.inf
        torch.testing.assert_close(res.log_prob[fin], single.log_prob[fin], **output_tol(torch.float32))
        torch.testing.assert_close(res.log_kept_mass, single.log_kept_mass, **output_tol(torch.float32))


@pytest.mark.parametrize("world", [2])
def test_linear_log_probs_with_replay_under_tensor_parallelism(world):
    run_workers(_linear_tp_worker, world)


def test_make_policy_loss_func_replay_from_hidden_states_equals_the_logits_path():
    from rollout_corr_ext.megatron import make_policy_loss_func

    b, s, h, v = 2, 5, 12, 30
    g = torch.Generator().manual_seed(50)
    hidden = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    kw = dict(top_k=6, top_p=0.8)

    class Layer:
        pass
    layer = Layer()
    layer.weight, layer.bias = weight, None
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    layer.weight = w1
    out1 = make_policy_loss_func(target, adv, mask, output_layer=layer, vocab_size=v,
                                 sampling=SamplingParams(**kw))(h1)
    (out1[0] / out1[1]).backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out2 = make_policy_loss_func(target, adv, mask, vocab_size=v, sampling=SamplingParams(**kw))(h2 @ w2.t())
    (out2[0] / out2[1]).backward()
    assert out1[0].item() == pytest.approx(out2[0].item(), rel=1e-10, abs=1e-12) and int(out1[1]) == int(out2[1])
    for k in out2[2]:
        torch.testing.assert_close(out1[2][k], out2[2][k], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True])
def test_make_policy_loss_func_per_position_params_follow_target_order(fused):
    """Per-position SamplingParams tensors are in target's row-major [b, s] order, as every batch tensor, in either
    logits layout and on the fused path: the log-probs equal the dense oracle's with each position's own settings
    (before: at "sbv" they were read in the logits' [s, b] order, silently mixing the positions' settings)."""
    from rollout_corr_ext.megatron import make_policy_loss_func

    b, s, h, v = 2, 3, 8, 16
    g = torch.Generator().manual_seed(61)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    logits = hidden @ weight.t()
    target = logits.argmax(-1)
    target[1, 2] = logits[1, 2].argmin()  # outside its kept set
    temp = 0.7 if fused else torch.tensor([0.3, 0.5, 0.7, 3.0, 2.0, 1.0], dtype=torch.float64)  # fused: one number
    sp = SamplingParams(temperature=temp, top_k=torch.tensor([1, 2, 3, 8, 6, 4]),
                        top_p=torch.tensor([1.0, 0.9, 0.8, 0.95, 0.7, 0.6]))
    want = sampled_log_probs_dense(logits.reshape(-1, v), target.reshape(-1), sp.temperature, sp.top_k,
                                   sp.top_p)[0].detach().reshape(b, s)

    class Layer:
        pass
    layer = Layer()
    layer.weight, layer.bias = weight, None
    for layout in ("bsv", "sbv"):
        x = hidden if fused else logits
        x = x if layout == "bsv" else x.transpose(0, 1).contiguous()
        fn = make_policy_loss_func(target, torch.ones(b, s, dtype=torch.float64), torch.ones(b, s, dtype=torch.bool),
                                   logits_layout=layout, vocab_size=v, sampling=sp,
                                   output_layer=layer if fused else None)
        got = fn(x, non_loss_data=True)["log_prob"]
        assert torch.allclose(got, want, rtol=1e-12, atol=0) and bool(torch.isneginf(got[1, 2])), layout


# --------------------------------------------------------------------------------------------- edges, backends


def test_edge_batches_and_refusals():
    from rollout_corr_ext.sampling import sampled_linear_log_probs

    sp = SamplingParams(top_k=3, top_p=0.8)
    empty = sampled_log_probs(torch.randn(0, 10), torch.zeros(0, dtype=torch.long), sp, vocab_size=10)
    assert all(t.shape == (0,) for t in empty)
    ignored = sampled_log_probs(torch.full((3, 10), float("nan")), torch.full((3,), -100), sp, vocab_size=10)
    assert bool((ignored.log_prob == 0).all()) and bool(ignored.in_support.all())
    assert bool((ignored.log_kept_mass == 0).all())
    lin = sampled_linear_log_probs(torch.full((3, 4), float("nan")), torch.randn(6, 4), torch.full((3,), -100), sp,
                                   vocab_size=6)
    assert bool((lin.log_prob == 0).all()) and bool(lin.in_support.all())
    x = torch.randn(3, 10)
    x[1] = -math.inf
    with pytest.raises(RuntimeError, match="every logit of row 1"):
        sampled_log_probs(x, torch.zeros(3, dtype=torch.long), sp, vocab_size=10)
    with pytest.raises(ValueError, match="temperature=1e-40 is out of range"):
        sampled_log_probs(torch.randn(2, 5), torch.tensor([0, 1]), SamplingParams(temperature=1e-40), vocab_size=5)
    with pytest.raises(ValueError, match="temperature"):
        sampled_log_probs(torch.randn(2, 5), torch.tensor([0, 1]),
                          SamplingParams(temperature=torch.tensor([1.0, 1e-40])), vocab_size=5)
    with pytest.raises(ValueError, match="SamplingParams.temperature requires grad"):
        SamplingParams(temperature=torch.ones(2, requires_grad=True))
    h = torch.randn(3, 4)
    h[2, 0] = float("nan")
    with pytest.raises(ValueError, match="^sampled_linear_log_probs: .*row 2 of the flattened hidden states"):
        sampled_linear_log_probs(h, torch.randn(6, 4), torch.tensor([1, -100, 3]), sp, vocab_size=6)


PATH_CASES = {"candidates": dict(top_k=5, top_p=0.9), "general": dict(top_p=0.9),
              "per-row temperature": dict(top_k=5, temperature=torch.tensor([1.0, 0.5, 2.0])), "none": dict()}


@pytest.mark.parametrize("path", sorted(PATH_CASES))
def test_bad_targets_and_layouts_are_refused_on_every_path(path):
    """What the plain log-probs refuse, every path of the replay refuses (the candidate path never reaches their
    kernels): a target outside [0, vocab_size) (past the end, in the vocab padding, a -1 pad with the default
    ignore_index) and a single shard short of vocab_size. Before, the candidate path returned such a target as an
    out-of-support token (-inf, in_support False), which the losses then leave out silently."""
    from rollout_corr_ext.sampling import KeptTokens, kept_log_probs

    sp = SamplingParams(**PATH_CASES[path])
    x = torch.randn(3, 50)
    for bad, vocab_size in ((50, 50), (10 ** 6, 50), (48, 45), (-1, 50)):
        with pytest.raises(ValueError, match=f"outside \\[0, vocab_size={vocab_size}\\).*{bad} at flattened position 2"):
            sampled_log_probs(x, torch.tensor([1, 2, bad]), sp, vocab_size=vocab_size)
    with pytest.raises(ValueError, match="must hold the whole vocab"):
        sampled_log_probs(x, torch.tensor([1, 2, 3]), sp, vocab_size=60)
    kept = KeptTokens.from_lists([[1, 4], [2], [3, 0]])
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=50\\)"):
        kept_log_probs(x, torch.tensor([1, 2, -1]), kept, vocab_size=50)
    # int32 ids are taken as the plain path takes them, with the int64 results
    t = torch.tensor([1, 2, 3])
    want = sampled_log_probs(x, t, sp, vocab_size=50)
    got = sampled_log_probs(x, t.to(torch.int32), sp, vocab_size=50)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_kept_tokens_refuse_nan_or_inf_outside_the_kept_ids():
    """A NaN or +inf logit at an id the engine did not keep still enters log S's total: refused, naming the row
    (before: log S NaN, or -inf, with in_support True)."""
    from rollout_corr_ext.sampling import KeptTokens, kept_log_probs

    for bad in (float("nan"), math.inf):
        x = torch.tensor([[0.0, 1.0, 2.0], [0.0, bad, 1.0]])
        with pytest.raises(ValueError, match="NaN or \\+inf logit in row 1"):
            kept_log_probs(x, torch.tensor([0, 0]), KeptTokens.from_lists([[0, 1], [0, 2]]), vocab_size=3)
        ignored = kept_log_probs(x, torch.tensor([0, -100]), KeptTokens.from_lists([[0, 1], [0, 2]]), vocab_size=3)
        assert bool(torch.isfinite(ignored.log_kept_mass).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_candidate_log_kept_mass_is_exact_at_large_logits(dtype):
    """log S on the candidate path against fp64 at large logit maxima (the row max's product with log2(e) / T once
    put its rounding error, up to 1e-4 relative, into every term of the sum): a row whose other logits are far below
    its max has log S = 0 exactly, and peaked rows at T = 0.1 match the oracle to fp32 precision."""
    for a in (50.0, 2558.0, 60000.0):
        x = torch.zeros(2, 64, dtype=dtype)
        x[:, 5] = a
        out = sampled_log_probs(x, torch.tensor([5, 5]), SamplingParams(top_k=1), vocab_size=64)
        assert bool((out.log_kept_mass == 0).all()), (a, out.log_kept_mass)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 3000, generator=g) * 3)
    x[:, 7] += 12
    x = (x * 10).to(dtype)  # maxima near 1800 in z at T = 0.1
    T = 0.1
    out = sampled_log_probs(x, x.float().argmax(-1), SamplingParams(temperature=T, top_k=50), vocab_size=3000)
    z = x.double() / T
    kth = z.sort(-1, descending=True).values[:, 49:50]
    want = torch.logsumexp(z.masked_fill(z < kth, -math.inf), -1) - torch.logsumexp(z, -1)
    torch.testing.assert_close(out.log_kept_mass.double(), want, rtol=0, atol=2e-6)


def test_cuda_graph_capture_is_refused_by_name(monkeypatch):
    """The replay reads per-row values on the host, which a CUDA-graph capture cannot do: every entry point refuses
    it up front with an error naming the call (not an opaque CUDA error half-way through the capture). The capture
    state is faked here (tests/test_cuda_graphs_determinism.py runs a real capture on a GPU); the check runs before
    anything is read, so nothing else runs."""
    from rollout_corr_ext import sampling
    from rollout_corr_ext.sampling import KeptTokens, kept_linear_log_probs, kept_log_probs, sampled_linear_log_probs

    assert not sampling._capturing(torch.randn(2, 3))  # a CPU tensor is never captured
    monkeypatch.setattr(sampling, "_capturing", lambda t: True)
    sp = SamplingParams(top_k=3, top_p=0.8)
    logits, target = torch.randn(2, 6), torch.tensor([0, 1])
    kept = KeptTokens(ids=torch.tensor([0, 1, 2, 0, 1, 3]), offsets=torch.tensor([0, 3, 6]))
    calls = {
        "sampled_log_probs": lambda: sampled_log_probs(logits, target, sp, vocab_size=6),
        "kept_log_probs": lambda: kept_log_probs(logits, target, kept, vocab_size=6),
        "sampled_linear_log_probs": lambda: sampled_linear_log_probs(torch.randn(2, 4), torch.randn(6, 4), target,
                                                                     sp, vocab_size=6),
        "kept_linear_log_probs": lambda: kept_linear_log_probs(torch.randn(2, 4), torch.randn(6, 4), target, kept),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: the sampling replay cannot be captured in a CUDA graph"):
            call()


@pytest.mark.parametrize("top_k", [None, 4, "kept"], ids=["general", "candidates", "kept"])
@pytest.mark.parametrize("linear", [False, True], ids=["logits", "hidden"])
def test_double_backward_is_refused(linear, top_k):
    from rollout_corr_ext.sampling import KeptTokens, kept_linear_log_probs, kept_log_probs, sampled_linear_log_probs

    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 6, dtype=torch.float64)
    target = torch.tensor([1, 2, 3])
    if top_k == "kept":
        kept = KeptTokens.from_lists([[1, 0], [2, 5], [0, 4]])
        r = kept_linear_log_probs(x, w, target, kept, vocab_size=8) if linear else \
            kept_log_probs(x, target, kept, vocab_size=6)
    else:
        sp = SamplingParams(top_p=0.9, top_k=top_k)
        r = sampled_linear_log_probs(x, w, target, sp, vocab_size=8) if linear else \
            sampled_log_probs(x, target, sp, vocab_size=6)
    g, = torch.autograd.grad(torch.where(r.in_support, r.log_prob, torch.zeros_like(r.log_prob)).sum(), x,
                             create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), x)


@pytest.mark.parametrize("device", device_params("cpu", "fallback", "emulated", "cuda"))
def test_every_backend_matches_the_oracle(device):
    """The replay runs the log-prob ops of whatever backend is active: the compiled CPU kernels, the pure-PyTorch
    fallback, the CUDA kernels on the emulator (and on a GPU)."""
    kw = dict(top_k=9, top_p=0.8, temperature=0.5)
    x, target = _inputs(6, 64, torch.float32, seed=60)
    target = _targets_in_and_out(x, target, kw, seed=61)
    with ops_on(device) as dev:
        xs = x.to(dev).requires_grad_(True)
        res = sampled_log_probs(xs, target.to(dev), SamplingParams(**kw))
        use = (res.in_support & (target.to(dev) != -100))
        torch.where(use, res.log_prob, torch.zeros_like(res.log_prob)).sum().backward()
        res = type(res)(*(t.cpu() for t in res))
        grad = xs.grad.cpu()
    oracle = sampled_log_probs_dense(x.double(), target, **kw)
    _check(res, oracle, torch.float32)
    xr = torch.where(torch.isnan(x), torch.zeros_like(x), x).double().requires_grad_(True)
    lp = sampled_log_probs_dense(xr, target, **kw)[0]
    use = use.cpu()
    ref_grad, = torch.autograd.grad(torch.where(use, lp, torch.zeros_like(lp)).sum(), xr)
    torch.testing.assert_close(grad.double()[use], ref_grad[use], **grad_tol(torch.float32))


# ------------------------------------------------------------------------------------------- kept-set input mode


def _kept_case(n, v, dtype, seed, ragged=True):
    """Inputs, and for each row a random kept list (unsorted, 1-12 ids), its target inside it on even rows."""
    from rollout_corr_ext import KeptTokens

    x, target = _inputs(n, v, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    lists = []
    for i in range(n):
        size = int(torch.randint(1, 13, (1,), generator=g)) if ragged else 6
        ids = torch.randperm(v, generator=g)[:size].tolist()
        if i in (0, 2):  # rows with -inf logits: a kept id at -inf, and a finite one (else the row is refused)
            ids = [3, 7] + [j for j in ids if j not in (3, 7)] if i == 0 else [1, 9] + [j for j in ids if j not in (1, 9)]
        if i % 2 == 0 and target[i] != -100:
            target[i] = ids[0]
        lists.append(ids)
    temps = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5)
    return x, target, lists, KeptTokens.from_lists(lists), temps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row_t", [False, True])
def test_kept_tokens_match_the_dense_oracle(dtype, per_row_t):
    """kept_log_probs: values, in_support and the gradient against the fp64 oracle over the same lists, with
    ignored rows holding NaN, -inf logits (a kept id at -inf keeps probability 0), a target outside its list."""
    from rollout_corr_ext import KeptTokens, kept_log_probs
    from rollout_corr_testing.sampling_oracle import kept_log_probs_dense

    x, target, lists, kept, temps = _kept_case(9, 50, dtype, seed=31)
    t = temps if per_row_t else 0.7
    kept = KeptTokens(kept.ids, kept.offsets, t)
    xg = x.clone().requires_grad_(True)
    res = kept_log_probs(xg, target, kept)
    xr = x.double().clone().requires_grad_(True)
    lp, ent, ls, ins = kept_log_probs_dense(xr, target, lists, temperature=t)
    assert torch.equal(res.in_support, ins) and bool((~ins).any()) and bool(ins[target != -100].any())
    assert torch.equal(res.log_prob == -math.inf, lp == -math.inf)
    fin = lp != -math.inf
    tol = output_tol(dtype)
    torch.testing.assert_close(res.log_prob.double()[fin], lp.detach()[fin], **tol)
    torch.testing.assert_close(res.entropy.double(), ent, **tol)
    torch.testing.assert_close(res.log_kept_mass.double(), ls, **tol)
    use = ins & (target != -100)
    torch.where(use, res.log_prob, torch.zeros_like(res.log_prob)).sum().backward()
    torch.where(use, lp, torch.zeros_like(lp)).sum().backward()
    active = (target != -100).unsqueeze(1)
    torch.testing.assert_close(xg.grad.double().where(active, 0.0), xr.grad.where(active, 0.0), **grad_tol(dtype))
    assert bool((xg.grad[~active.squeeze(1)] == 0).all())
    for i in range(9):  # exactly 0 outside the kept list
        if use[i]:
            outside = torch.ones(50, dtype=torch.bool)
            outside[lists[i]] = False
            assert bool((xg.grad[i][outside] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_log_kept_mass_of_ids_far_below_the_row_max(dtype):
    """Kept ids all ~800 nats (in z) below the row max: their mass relative to the row max underflows even in fp64;
    log S is taken relative to their own max, finite and equal to the fp64 value (it was -inf)."""
    from rollout_corr_ext import KeptTokens, kept_log_probs

    x = torch.tensor([[0.0, -80.0, -81.0], [0.0, -1.0, -2.0]], dtype=dtype)
    res = kept_log_probs(x, torch.tensor([1, 0]), KeptTokens.from_lists([[1, 2], [0, 1]], temperature=0.1))
    z = x.double() / torch.tensor(0.1, dtype=dtype).double()
    want = torch.stack([torch.logsumexp(z[0, 1:], 0), torch.logsumexp(z[1, :2], 0)]) - torch.logsumexp(z, 1)
    torch.testing.assert_close(res.log_kept_mass.double(), want, rtol=1e-6, atol=1e-6)
    # fp32: z = -80 / 0.1 rounds in the 5th digit of the tiny log-prob
    assert float(res.log_prob[0]) == pytest.approx(-math.log1p(math.exp(-10.0)),
                                                   rel=1e-3 if dtype == torch.float32 else 1e-9)


def test_kept_tokens_equal_the_replayed_set_and_refusals():
    """The kept sets a replay finds, passed back as KeptTokens, give the same outputs (two independent ways to the
    same distribution); bad kept lists are refused with the argument named; inputs are untouched."""
    from rollout_corr_ext import KeptTokens, kept_log_probs
    from rollout_corr_ext.sampling import SamplingParams as SP

    x, target = _inputs(8, 60, torch.float32, seed=3, ignored=())
    kw = dict(top_k=9, top_p=0.85, temperature=0.8)
    rep = sampled_log_probs(x, target, SP(**kw))
    _, _, _, _, kept = sampled_log_probs_dense(x.double(), target, **kw)
    lists = [k.nonzero().flatten().tolist() for k in kept]
    before = x.clone()
    res = kept_log_probs(x, target, KeptTokens.from_lists(lists, temperature=0.8))
    assert torch.equal(x, before)
    assert torch.equal(res.in_support, rep.in_support)
    fin = rep.log_prob != -math.inf
    torch.testing.assert_close(res.log_prob[fin], rep.log_prob[fin])
    torch.testing.assert_close(res.entropy, rep.entropy)
    torch.testing.assert_close(res.log_kept_mass, rep.log_kept_mass)

    with pytest.raises(TypeError, match="KeptTokens.ids"):
        KeptTokens(torch.tensor([1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="KeptTokens.offsets"):
        KeptTokens(torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="KeptTokens.temperature"):
        KeptTokens(torch.tensor([1]), torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError, match="kept has 2 rows"):
        kept_log_probs(x, target, KeptTokens.from_lists([[1], [2]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kept_log_probs(x, target, KeptTokens.from_lists([[1]] * 7 + [[60]]))
    with pytest.raises(ValueError, match="row 2 lists id 5 twice"):
        kept_log_probs(x, target, KeptTokens.from_lists([[1]] * 2 + [[5, 3, 5]] + [[1]] * 5))
    with pytest.raises(ValueError, match="row 1 is scored .* no kept ids"):
        kept_log_probs(x, target, KeptTokens.from_lists([[1], []] + [[1]] * 6))
    t2 = target.clone()
    t2[1] = -100  # an ignored row may have an empty list
    kept_log_probs(x, t2, KeptTokens.from_lists([[1], [], [7]] + [[1]] * 5))
    with pytest.raises(TypeError, match="kept must be a KeptTokens"):
        kept_log_probs(x, target, lists)
    x3 = x.clone()
    x3[4, [2, 6]] = -math.inf
    with pytest.raises(ValueError, match="every kept id of row 4 has a -inf logit"):
        kept_log_probs(x3, target, KeptTokens.from_lists([[7]] * 4 + [[2, 6]] + [[7]] * 3))


def _kept_tp_worker(rank, world):
    from rollout_corr_ext import KeptTokens, kept_log_probs

    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        vocab_size = 90
        x, target, lists, kept, temps = _kept_case(10, vocab_size, dtype, seed=40)
        x = torch.cat([x, torch.full((10, 96 - vocab_size), 7.0, dtype=dtype)], dim=1)  # padding: never counted
        kept = KeptTokens(kept.ids, kept.offsets, temps)
        single = kept_log_probs(x, target, kept, vocab_size=vocab_size)
        v_local = 96 // world
        shard = x[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        with CollectiveCounter() as c:
            res = kept_log_probs(shard, target, kept, group, vocab_size=vocab_size)
        assert len(c.calls) <= 4, c.calls  # MAX and SUM for log S, and the log-probs' own
        assert torch.equal(res.in_support, single.in_support)
        fin = single.log_prob != -math.inf
        torch.testing.assert_close(res.log_prob[fin], single.log_prob[fin], **output_tol(dtype))
        torch.testing.assert_close(res.entropy, single.entropy, **output_tol(dtype))
        torch.testing.assert_close(res.log_kept_mass, single.log_kept_mass, **output_tol(dtype))
        xs = x.clone().requires_grad_(True)
        s1 = kept_log_probs(xs, target, kept, vocab_size=vocab_size)
        use = single.in_support & (target != -100)
        torch.where(use, s1.log_prob, torch.zeros_like(s1.log_prob)).sum().backward()
        with CollectiveCounter() as cb:
            torch.where(use, res.log_prob, torch.zeros_like(res.log_prob)).sum().backward()
        assert cb.calls == []
        torch.testing.assert_close(shard.grad, xs.grad[:, rank * v_local:(rank + 1) * v_local], **grad_tol(dtype))


@pytest.mark.parametrize("world", [2, 4])
def test_kept_tokens_under_tensor_parallelism(world):
    run_workers(_kept_tp_worker, world)


def test_kept_tokens_permute_rows():
    from rollout_corr_ext import KeptTokens

    k = KeptTokens.from_lists([[1, 2], [], [3], [4, 5, 6]], temperature=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    p = k.permute_rows(torch.tensor([3, 0, 2, 1]))
    assert p.offsets.tolist() == [0, 3, 5, 6, 6] and p.ids.tolist() == [4, 5, 6, 1, 2, 3]
    assert p.temperature.tolist() == [4.0, 1.0, 3.0, 2.0]


@pytest.mark.parametrize("layout", ["sbv", "bsv", "packed"])
def test_make_policy_loss_func_takes_kept_tokens(layout):
    """make_policy_loss_func(sampling=KeptTokens(...)) with the kept sets a replay finds equals
    make_policy_loss_func(sampling=SamplingParams(...)): loss, gradient and metrics, in every logits layout (the
    kept rows follow target's row-major order; sbv logits are transposed inside)."""
    from rollout_corr_ext import KeptTokens
    from rollout_corr_ext.megatron import make_policy_loss_func, reported_means

    b, s, v = 3, 4, 50
    kw = dict(top_k=8, top_p=0.8, temperature=0.9)
    g = torch.Generator().manual_seed(21)
    logits_bsv = torch.randn(b, s, v, generator=g, dtype=torch.float64)
    target = _targets_in_and_out(logits_bsv.reshape(-1, v), torch.randint(0, v, (b * s,), generator=g), kw,
                                 seed=4).reshape(b, s)
    _, _, _, _, kept = sampled_log_probs_dense(logits_bsv.reshape(-1, v), target.reshape(-1), **kw)
    kt = KeptTokens.from_lists([k.nonzero().flatten().tolist() for k in kept], temperature=0.9)
    mask = torch.ones(b, s, dtype=torch.bool)
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    if layout == "packed":
        x = logits_bsv.reshape(b * s, 1, v)
        args = (target.reshape(-1), adv.reshape(-1), mask.reshape(-1))
        extra = dict(cu_seqlens=torch.tensor([0, 4, 8, 12]))
    else:
        x = logits_bsv.transpose(0, 1).contiguous() if layout == "sbv" else logits_bsv
        args, extra = (target, adv, mask), dict(logits_layout=layout)
    out = []
    for spec in (kt, SamplingParams(**kw)):
        xg = x.clone().requires_grad_(True)
        loss, n, rep = make_policy_loss_func(*args, vocab_size=v, sampling=spec, **extra)(xg)
        (loss / n).backward()
        out.append((loss.item(), int(n), xg.grad, reported_means(rep)))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-12) and out[0][1] == out[1][1]
    torch.testing.assert_close(out[0][2], out[1][2], rtol=1e-12, atol=1e-14)
    for k in ("rollout_corr/sampling_out_of_support_fraction", "rollout_corr/sampling_log_kept_mass_mean"):
        assert out[0][3][k] == pytest.approx(out[1][3][k], rel=1e-6)
    with pytest.raises(ValueError, match="KeptTokens has 2 rows"):
        make_policy_loss_func(*args, vocab_size=v, sampling=KeptTokens.from_lists([[1], [2]]), **extra)


@pytest.mark.parametrize("device", device_params("cpu", "fallback", "emulated", "cuda"))
def test_kept_tokens_on_every_backend(device):
    """kept_log_probs on the compiled CPU kernels, the fallback, the CUDA kernels on the emulator (and a GPU)."""
    from rollout_corr_ext import kept_log_probs
    from rollout_corr_testing.sampling_oracle import kept_log_probs_dense

    x, target, lists, kept, _ = _kept_case(6, 64, torch.float32, seed=62)
    with ops_on(device) as dev:
        xs = x.to(dev).requires_grad_(True)
        res = kept_log_probs(xs, target.to(dev), kept)
        use = res.in_support & (target.to(dev) != -100)
        torch.where(use, res.log_prob, torch.zeros_like(res.log_prob)).sum().backward()
        res = type(res)(*(t.cpu() for t in res))
        grad, use = xs.grad.cpu(), use.cpu()
    xr = torch.where(torch.isnan(x), torch.zeros_like(x), x).double().requires_grad_(True)
    lp, ent, ls, ins = kept_log_probs_dense(xr, target, lists)
    assert torch.equal(res.in_support, ins)
    fin = lp != -math.inf
    torch.testing.assert_close(res.log_prob.double()[fin], lp.detach()[fin], **output_tol(torch.float32))
    torch.testing.assert_close(res.entropy.double(), ent, **output_tol(torch.float32))
    torch.testing.assert_close(res.log_kept_mass.double(), ls, **output_tol(torch.float32))
    ref_grad, = torch.autograd.grad(torch.where(use, lp, torch.zeros_like(lp)).sum(), xr)
    torch.testing.assert_close(grad.double()[use], ref_grad[use], **grad_tol(torch.float32))


@pytest.mark.parametrize("layout", ["sbv", "bsv"])
def test_kept_tokens_errors_name_the_callers_rows_in_every_layout(layout):
    """megatron's loss_func reorders KeptTokens' rows into the logits' [s, b] order; an error about them still names
    the row (and id index) the caller built, in target's row-major [b, s] order (it named the reordered row)."""
    from rollout_corr_ext import KeptTokens, PolicyLossConfig
    from rollout_corr_ext.megatron import make_policy_loss_func

    b, s, v = 2, 3, 8
    target, adv, mask = torch.zeros(b, s, dtype=torch.long), torch.ones(b, s, dtype=torch.float64), \
        torch.ones(b, s, dtype=torch.bool)
    logits = torch.randn((s, b, v) if layout == "sbv" else (b, s, v), dtype=torch.float64)
    for rows, words in (({1: []}, "kept: row 1 is scored"), ({1: [3, 3]}, "kept: row 1 lists id 3 twice"),
                        ({1: [0, 9]}, r"kept.ids\[3\] = 9 \(row 1\) is outside the vocabulary")):
        lists = [[0, 1]] * (b * s)
        lists = [rows.get(i, r) for i, r in enumerate(lists)]
        with pytest.raises(ValueError, match=words):
            make_policy_loss_func(target, adv, mask, config=PolicyLossConfig(), vocab_size=v, logits_layout=layout,
                                  sampling=KeptTokens.from_lists(lists))(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logits_whose_quotient_by_the_temperature_overflows_are_refused(dtype):
    """Finite logits near the dtype's maximum at a small temperature: z = x / T overflows fp32 (vLLM's sampler
    divides its fp32 logits the same way, so it cannot sample such a row). The top-k candidate path returned a NaN
    log-prob with in_support True and NaN gradients; top-p / min-p refused it as a "NaN or +inf logit" (the
    extremes fuzz). Every path refuses it naming the overflow; at temperature 1 the same row is exact."""
    big = 0.9 * torch.finfo(dtype).max
    x = torch.tensor([[0.5, big, -big, 1.0, 0.0, -1.0, 2.0, 0.25]], dtype=dtype)
    t = torch.tensor([1])
    for sp in (rc.SamplingParams(temperature=1e-3, top_k=5), rc.SamplingParams(temperature=1e-3, top_k=1),
               rc.SamplingParams(temperature=1e-3, top_p=0.9), rc.SamplingParams(temperature=1e-3, min_p=0.1),
               rc.SamplingParams(temperature=torch.tensor([1e-3]), top_k=5)):
        with pytest.raises(ValueError, match="quotient by the temperature is past the float range"):
            rc.sampled_log_probs(x.clone().requires_grad_(True), t, sp)
    lg = x.clone().requires_grad_(True)
    out = rc.sampled_log_probs(lg, t, rc.SamplingParams(temperature=1.0, top_k=5))
    out.log_prob.sum().backward()
    assert float(out.log_prob) == 0.0 and bool(out.in_support) and torch.equal(lg.grad, torch.zeros_like(lg))


def test_top_k_past_int64_is_refused_naming_it():
    """top_k = 10**400 was accepted and failed later inside torch (the config fuzz); any k from the vocabulary's size
    up keeps every token, so a k past int64 is refused naming the field."""
    with pytest.raises(ValueError, match=r"SamplingParams.top_k must be >= 1 \(below 2\*\*63\)"):
        SamplingParams(top_k=10 ** 400)
    x = torch.randn(2, 7)
    t = torch.tensor([1, 4])
    assert torch.equal(sampled_log_probs(x, t, SamplingParams(top_k=2 ** 62)).log_prob,
                       sampled_log_probs(x, t, SamplingParams()).log_prob)


# ------------------------------------------------------------------------------ kept sets from hidden states


def _kept_linear_case(dtype, seed, n=11, h=16, v=40, vs=37):
    """_linear_case (padded vocabulary rows and an ignored row's hidden state NaN) with a random kept list per row
    (unsorted, 1-12 ids, one row keeping every id), its target inside it on even rows."""
    from rollout_corr_ext import KeptTokens

    hidden, weight, bias, target = _linear_case(n, h, v, dtype, seed, vocab_size=vs)
    g = torch.Generator().manual_seed(seed + 1)
    lists = []
    for i in range(n):
        ids = torch.randperm(vs, generator=g)[:int(torch.randint(1, 13, (1,), generator=g))].tolist()
        ids = list(range(vs))[::-1] if i == 4 else ids  # the whole vocabulary: log S = 0
        if i % 2 == 0 and target[i] != -100:
            target[i] = ids[-1]
        lists.append(ids)
    return hidden, weight, bias, target, lists, KeptTokens.from_lists(lists, temperature=0.7)


def _kept_linear_oracle(hidden, weight, bias, target, lists, temperature, vs):
    """The fp64 oracle (rollout_corr_testing.sampling_oracle.kept_log_probs_dense) of the exact product of the
    (rounded) inputs: log-prob and entropy differentiable in them, log S, in_support; ignored rows 0 (their hidden
    state may be NaN)."""
    from rollout_corr_testing.sampling_oracle import kept_log_probs_dense

    z = hidden.double().nan_to_num(0.0) @ weight[:vs].double().t() + bias[:vs].double()
    return kept_log_probs_dense(z, target, lists, temperature=temperature)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_kept_linear_log_probs_match_the_dense_oracle(dtype, with_bias):
    """kept_linear_log_probs: log-prob, entropy, log S and in_support against the fp64 oracle of the exact product
    over the same lists (a padded vocabulary, an ignored row whose hidden state is NaN, targets outside their list,
    a row keeping every id), and the gradients in hidden, weight and bias through both outputs: exactly 0 on the
    weight rows no kept list names and in the ignored row. Inputs untouched."""
    from rollout_corr_ext import kept_linear_log_probs

    vs = 37
    hidden, weight, bias, target, lists, kept = _kept_linear_case(dtype, seed=71, vs=vs)
    if not with_bias:
        bias = torch.zeros_like(bias)
    before = [x.clone() for x in (hidden, weight, bias, target)]
    hs, ws, bs = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    res = kept_linear_log_probs(hs, ws, target, kept, bias=bs if with_bias else None, vocab_size=vs, chunk_rows=4,
                                chunk_cols=16)
    assert all(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and
                                     torch.equal(a.nan_to_num(), b.nan_to_num()))
               for a, b in zip(before, (hidden, weight, bias, target)))
    hr, wr, br = (x.detach().double().requires_grad_(True) for x in (hidden, weight, bias))
    lp, ent, ls, ins = _kept_linear_oracle(hr, wr, br, target, lists, 0.7, vs)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert res.log_prob.dtype == res.entropy.dtype == res.log_kept_mass.dtype == acc
    assert torch.equal(res.in_support, ins) and not bool(ins.all()) and bool(ins[target != -100].any())
    assert torch.equal(res.log_prob == -math.inf, lp == -math.inf)
    fin = lp != -math.inf
    tol = linear_tol(dtype)
    torch.testing.assert_close(res.log_prob.double()[fin], lp.detach()[fin], **tol)
    torch.testing.assert_close(res.entropy.double(), ent.detach(), **tol)
    torch.testing.assert_close(res.log_kept_mass.double(), ls, **tol)
    assert float(res.log_kept_mass[4]) == pytest.approx(0.0, abs=1e-6)
    g = torch.Generator().manual_seed(8)
    gl, ge = torch.randn(11, generator=g, dtype=torch.float64), torch.randn(11, generator=g, dtype=torch.float64)
    (torch.where(fin, res.log_prob.double(), 0.0) * gl + res.entropy.double() * ge).sum().backward()
    (torch.where(fin, lp, 0.0) * gl + ent * ge).sum().backward()
    active = target != -100
    gt = grad_tol(dtype)
    torch.testing.assert_close(hs.grad.double()[active], hr.grad[active], **gt)
    assert bool((hs.grad[~active] == 0).all())
    named = torch.zeros(weight.shape[0], dtype=torch.bool)
    for i in range(11):
        if bool(active[i]):
            named[lists[i]] = True
    torch.testing.assert_close(ws.grad.double()[:vs], wr.grad[:vs], **gt)
    assert bool((ws.grad[~named] == 0).all()) and bool((~named[vs:]).all())
    if with_bias:
        torch.testing.assert_close(bs.grad.double()[:vs], br.grad[:vs], **gt)
        assert bool((bs.grad[~named] == 0).all())
    else:
        assert bs.grad is None


def test_kept_linear_log_probs_equal_the_logits_path_and_refusals():
    """The same outputs as kept_log_probs on the materialized logits (fp64), [s, b] leading shapes kept; bad input
    refused with the argument named."""
    from rollout_corr_ext import KeptTokens, kept_linear_log_probs, kept_log_probs

    hidden, weight, bias, target, lists, kept = _kept_linear_case(torch.float64, seed=72, v=37)
    hidden = hidden.nan_to_num(0.0)
    res = kept_linear_log_probs(hidden, weight, target, kept, bias=bias)
    ref = kept_log_probs(hidden @ weight.t() + bias, target, kept)
    assert torch.equal(res.in_support, ref.in_support)
    for a, b in zip(res[:3], ref[:3]):
        torch.testing.assert_close(a, b, **linear_tol(torch.float64))
    sb = kept_linear_log_probs(hidden.reshape(11, 1, 16), weight, target.reshape(11, 1), kept, bias=bias)
    assert sb.log_prob.shape == (11, 1) and torch.equal(sb.log_prob.reshape(-1), res.log_prob)
    with pytest.raises(TypeError, match="kept must be a KeptTokens"):
        kept_linear_log_probs(hidden, weight, target, lists)
    with pytest.raises(ValueError, match="KeptTokens.temperature must be one number"):
        kept_linear_log_probs(hidden, weight, target, KeptTokens(kept.ids, kept.offsets, torch.ones(11)))
    with pytest.raises(ValueError, match="kept has 2 rows .* but hidden has 11"):
        kept_linear_log_probs(hidden, weight, target, KeptTokens.from_lists([[1], [2]]))
    with pytest.raises(ValueError, match="outside the vocabulary of 37"):
        kept_linear_log_probs(hidden, weight, target, KeptTokens.from_lists([[1]] * 10 + [[37]]))
    with pytest.raises(ValueError, match="row 2 lists id 5 twice"):
        kept_linear_log_probs(hidden, weight, target, KeptTokens.from_lists([[1]] * 2 + [[5, 3, 5]] + [[1]] * 8))
    with pytest.raises(TypeError, match="target must be an int64"):
        kept_linear_log_probs(hidden, weight, target.float(), kept)
    dead = bias.clone()
    dead[[2, 6]] = -math.inf
    with pytest.raises(ValueError, match="every kept id of row 0 has a -inf logit"):
        kept_linear_log_probs(hidden, weight, target.clamp(min=0), KeptTokens.from_lists([[2, 6]] + [[7]] * 10),
                              bias=dead)
    nan = hidden.clone()
    nan[3, 2] = math.nan
    with pytest.raises(ValueError, match="row 3"):
        kept_linear_log_probs(nan, weight, target, kept)
    # a scored target outside the vocabulary is refused, as kept_log_probs refuses it (it came back as an
    # out-of-support token, silently left out of the loss with its entropy still in it)
    for bad in (-1, 37, 10 ** 6):
        t = target.clone()
        t[5] = bad
        for fn, x in ((kept_linear_log_probs, hidden), (kept_log_probs, hidden @ weight.t() + bias)):
            with pytest.raises(ValueError, match=rf"target holds an id outside \[0, vocab_size=37\).*{bad} at "
                                                 r"flattened position 5"):
                fn(x, weight, t, kept, bias=bias) if fn is kept_linear_log_probs else fn(x, t, kept)
    # a finite logit whose quotient by the temperature overflows (fp32: T = 1e-38) is refused, as kept_log_probs
    # refuses it (its log-prob came back -inf: an out-of-support token, silently)
    h32, w32 = hidden.float(), weight.float()
    tiny = KeptTokens(kept.ids, kept.offsets, 1e-38)
    for fn, x in ((kept_linear_log_probs, h32), (kept_log_probs, h32 @ w32.t())):
        with pytest.raises(ValueError, match="quotient by the temperature is past the float range"):
            fn(x, w32, target, tiny) if fn is kept_linear_log_probs else fn(x, target, tiny)


def _kept_linear_tp_worker(rank, world):
    from rollout_corr_ext import kept_linear_log_probs

    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        vs, v = 45, 48
        hidden, weight, bias, target, lists, kept = _kept_linear_case(dtype, seed=80, n=9, h=8, v=v, vs=vs)
        hs1, ws1, bs1 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
        single = kept_linear_log_probs(hs1, ws1, target, kept, bias=bs1, vocab_size=vs, chunk_rows=4, chunk_cols=8)
        vl = v // world
        hs = hidden.clone().requires_grad_(True)
        ws, bs = (x[rank * vl:(rank + 1) * vl].clone().requires_grad_(True) for x in (weight, bias))
        with CollectiveCounter() as c:
            res = kept_linear_log_probs(hs, ws, target, kept, group, bias=bs, vocab_size=vs, chunk_rows=4,
                                        chunk_cols=8)
        # the log-S pass's own (linear_log_probs: its all-gather and header check), MAX, SUM, the target's z
        assert len(c.calls) <= 5, c.calls
        assert torch.equal(res.in_support, single.in_support)
        fin = single.log_prob != -math.inf
        for a, b in zip(res[:3], single[:3]):
            torch.testing.assert_close(a[fin], b[fin], **output_tol(torch.float32))
        g = torch.Generator().manual_seed(3)
        gl, ge = torch.randn(9, generator=g), torch.randn(9, generator=g)
        (torch.where(fin, single.log_prob, 0.0) * gl + single.entropy * ge).sum().backward()
        with CollectiveCounter() as cb:
            (torch.where(fin, res.log_prob, 0.0) * gl + res.entropy * ge).sum().backward()
        assert cb.calls == []
        gt = grad_tol(dtype)
        torch.testing.assert_close(ws.grad, ws1.grad[rank * vl:(rank + 1) * vl], **gt)
        torch.testing.assert_close(bs.grad, bs1.grad[rank * vl:(rank + 1) * vl], **gt)
        # grad_hidden is this shard's part: summed over the ranks (megatron's column-parallel region) it is the whole
        # (in bf16 each rank's part is rounded once: up to half an ulp of the largest part, per rank)
        total = hs.grad.float()
        dist.all_reduce(total, group=group)
        most = hs.grad.abs().max().float()
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        tol = gt if dtype == torch.float32 else dict(rtol=gt["rtol"], atol=world * 2 ** -9 * float(most))
        torch.testing.assert_close(total[target != -100], hs1.grad.float()[target != -100], **tol)
    # refusals every rank makes alike (no rank left waiting in a collective): a target outside the vocabulary, and a
    # logit overflowing at a tiny temperature on one rank's shard only
    hidden, weight, bias, target, lists, kept = _kept_linear_case(torch.float32, seed=80, n=9, h=8, v=48, vs=45)
    vl = 48 // world
    ws, bs = weight[rank * vl:(rank + 1) * vl], bias[rank * vl:(rank + 1) * vl]
    bad = target.clone()
    bad[4] = 45
    with pytest.raises(ValueError, match="target holds an id outside"):
        kept_linear_log_probs(hidden, ws, bad, kept, group, bias=bs, vocab_size=45)
    from rollout_corr_ext import KeptTokens

    row0 = [0, vl + 1]  # one kept id on rank 0's shard, one on rank 1's
    big = torch.zeros_like(bs) if rank else torch.full_like(bs, 1e3)
    tiny = KeptTokens.from_lists([row0] * 9, temperature=1e-36)
    with pytest.raises(ValueError, match="quotient by the temperature is past the float range"):
        kept_linear_log_probs(torch.zeros_like(hidden), ws, torch.zeros_like(target), tiny, group, bias=big,
                              vocab_size=45)


@pytest.mark.parametrize("world", [2, 4])
def test_kept_linear_log_probs_under_tensor_parallelism(world):
    run_workers(_kept_linear_tp_worker, world)


@pytest.mark.parametrize("layout", ["sbv", "bsv"])
def test_make_policy_loss_func_takes_kept_tokens_with_output_layer(layout):
    """sampling=KeptTokens with output_layer (kept_linear_log_probs) gives the loss, metrics and gradients of the
    logits path on the materialized logits hidden @ W.T + b, in both layouts (the kept sets' rows follow target's
    row-major order); batch_invariant is refused by name (a sequence-parallel layer: below, under TP)."""
    from rollout_corr_ext import KeptTokens
    from rollout_corr_ext.megatron import make_policy_loss_func

    b, s, h, v = 2, 5, 12, 30
    g = torch.Generator().manual_seed(51)
    hidden = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    if layout == "bsv":
        hidden = hidden.transpose(0, 1).contiguous()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.2
    target = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 3:] = False
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lists = [torch.randperm(v, generator=g)[:int(torch.randint(1, 9, (1,), generator=g))].tolist()
             for _ in range(b * s)]
    for i in range(0, b * s, 2):
        lists[i][0] = int(target.reshape(-1)[i])  # half the targets inside their kept set
        lists[i] = list(dict.fromkeys(lists[i]))
    kept = KeptTokens.from_lists(lists)

    class Layer:
        pass
    layer = Layer()
    h1, w1, b1 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    layer.weight, layer.bias = w1, b1
    out1 = make_policy_loss_func(target, adv, mask, output_layer=layer, vocab_size=v, sampling=kept,
                                 logits_layout=layout)(h1)
    (out1[0] / out1[1]).backward()
    h2, w2, b2 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    out2 = make_policy_loss_func(target, adv, mask, vocab_size=v, sampling=kept, logits_layout=layout)(
        h2 @ w2.t() + b2)
    (out2[0] / out2[1]).backward()
    assert out1[0].item() == pytest.approx(out2[0].item(), rel=1e-10, abs=1e-12) and int(out1[1]) == int(out2[1])
    out_of_support, tokens = out2[2]["rollout_corr/sampling_out_of_support_fraction"].tolist()  # [sum, count]
    assert 0 < out_of_support < tokens
    for k in out2[2]:
        torch.testing.assert_close(out1[2][k], out2[2][k], rtol=1e-6, atol=1e-7)
    for a, c in ((h1, h2), (w1, w2), (b1, b2)):
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="sampling=KeptTokens.* with output_layer and batch_invariant=True"):
        make_policy_loss_func(target, adv, mask, output_layer=layer, vocab_size=v, sampling=kept,
                              batch_invariant=True)


@pytest.mark.parametrize("device", device_params("cpu", "fallback", "emulated", "cuda"))
def test_kept_linear_log_probs_on_every_backend(device):
    """kept_linear_log_probs (whose log-S pass is linear_log_probs' kernels) on the compiled CPU kernels, the
    fallback, the CUDA kernels on the emulator (and a GPU): the fp64 oracle's values and gradients."""
    from rollout_corr_ext import kept_linear_log_probs

    vs = 37
    hidden, weight, bias, target, lists, kept = _kept_linear_case(torch.float32, seed=73, n=6, h=8, v=40, vs=vs)
    with ops_on(device) as dev:
        hs, ws, bs = (x.to(dev).requires_grad_(True) for x in (hidden, weight, bias))
        res = kept_linear_log_probs(hs, ws, target.to(dev), kept, bias=bs, vocab_size=vs)
        fin = res.log_prob != -math.inf
        (torch.where(fin, res.log_prob, 0.0) + 0.5 * res.entropy).sum().backward()
        res = type(res)(*(t.cpu() for t in res))
        grads = [x.grad.cpu() for x in (hs, ws, bs)]
    hr, wr, br = (x.detach().double().requires_grad_(True) for x in (hidden, weight, bias))
    lp, ent, ls, ins = _kept_linear_oracle(hr, wr, br, target, lists, 0.7, vs)
    assert torch.equal(res.in_support, ins)
    fin = lp != -math.inf
    for a, b in ((res.log_prob[fin], lp[fin]), (res.entropy, ent), (res.log_kept_mass, ls)):
        torch.testing.assert_close(a.double(), b.detach(), **linear_tol(torch.float32))
    (torch.where(fin, lp, 0.0) + 0.5 * ent).sum().backward()
    active = target != -100
    torch.testing.assert_close(grads[0].double()[active], hr.grad[active], **grad_tol(torch.float32))
    torch.testing.assert_close(grads[1].double()[:vs], wr.grad[:vs], **grad_tol(torch.float32))
    torch.testing.assert_close(grads[2].double()[:vs], br.grad[:vs], **grad_tol(torch.float32))


# ------------------------------------------------------------------------------------- huge logits, every entry point

def _huge_tie_case(entry, m, temperature, dtype):
    """(log-prob, entropy, log S, d log-prob / d logits) of target 0 over the logits [m, m, m / 2, 0] with the kept
    set {0, 1} (top-k 2), through ``entry``."""
    logits = torch.tensor([[m, m, 0.5 * m, 0.0]], dtype=dtype, requires_grad=True)
    target = torch.tensor([0])
    if entry in ("candidate", "general"):  # a Python temperature takes the candidate path, a tensor the general one
        t = temperature if entry == "candidate" else torch.tensor(temperature)
        out = sampled_log_probs(logits, target, SamplingParams(top_k=2, temperature=t))
        leaf = logits
    elif entry == "kept":
        out = kept_log_probs(logits, target, KeptTokens.from_lists([[0, 1]], temperature=temperature))
        leaf = logits
    else:  # the logits as the bias of a zero projection: hidden @ weight.T + bias
        bias = logits.detach().reshape(-1).clone().requires_grad_(True)
        hidden, weight = torch.zeros(1, 3, dtype=dtype), torch.zeros(4, 3, dtype=dtype)
        if entry == "kept_linear":
            out = rc.kept_linear_log_probs(hidden, weight, target, KeptTokens.from_lists([[0, 1]],
                                                                                      temperature=temperature),
                                           bias=bias)
        else:
            out = rc.sampled_linear_log_probs(hidden, weight, target, SamplingParams(top_k=2, temperature=temperature),
                                              bias=bias)
        leaf = bias
    out.log_prob.sum().backward()
    return out, leaf.grad.reshape(-1)


@pytest.mark.parametrize("entry", ["candidate", "general", "kept", "kept_linear", "sampled_linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_huge_logits_keep_their_log_probs_and_gradients(entry, dtype, temperature):
    """Two tied maxima kept by top-k 2: log-prob and entropy log 2 (exactly the kept pair's), log S 0 (the third
    logit's mass is exp(-m / 2T), nothing) and the gradient [1/2, -1/2, 0, 0] / T, whatever the size of the logits.
    The candidate path and the kept-ids linear path formed z_t - (z_max + log_kept), which rounds log_kept away past
    ~1e15: log-prob 0 and the gradient [0, -1, 0, 0] at 1e16 (an error growing from 1e12 up)."""
    sizes = (3e4,) if dtype == torch.float16 else (1e6, 1e12, 1e16, 1e30)
    for m in sizes:
        out, grad = _huge_tie_case(entry, m, temperature, dtype)
        tol = dict(rtol=0, atol=2e-6)
        torch.testing.assert_close(out.log_prob.double(), torch.tensor([-math.log(2)], dtype=torch.float64), **tol,
                                   msg=lambda s: f"log-prob at {m:g}: {s}")
        torch.testing.assert_close(out.entropy.double(), torch.tensor([math.log(2)], dtype=torch.float64), **tol,
                                   msg=lambda s: f"entropy at {m:g}: {s}")
        torch.testing.assert_close(out.log_kept_mass.double(), torch.zeros(1, dtype=torch.float64), **tol,
                                   msg=lambda s: f"log S at {m:g}: {s}")
        want = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / temperature
        torch.testing.assert_close(grad.double(), want, rtol=0, atol=4e-3 if dtype.itemsize == 2 else 2e-6,
                                   msg=lambda s: f"gradient at {m:g}: {s}")
