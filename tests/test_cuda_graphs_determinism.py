"""CUDA graph capture and determinism of every op and public entry point (issue §2).

What is stated in docs/benchmarks.md ("CUDA graphs and determinism") is pinned here, case by case (``CASES``):

* **CUDA graph capture** (GPU only): each case is captured in one ``torch.cuda.CUDAGraph`` (after a warm-up on a side
  stream, as ``torch.cuda.graph`` requires), its static inputs are overwritten with new values, the graph is replayed,
  and the outputs must equal an eager run on the new values. Every case must also run without a host sync
  (``torch.cuda.set_sync_debug_mode("error")``).
* **Determinism** (CPU and GPU): under ``torch.use_deterministic_algorithms(True)`` (which also fills fresh
  ``torch.empty`` outputs with NaN, so an element a kernel forgets to write shows up) three runs of each case give
  **bitwise** equal outputs. The rollout kernels fold per-block partials in a fixed order (no atomics), the log-prob
  and policy-loss kernels write each output element from one thread; the CPU kernels merge per-thread partials in
  thread order. The CUDA sizes are large enough for several blocks per row family and for grids that stride over
  more rows than blocks (B = 2048 > 1024 rollout blocks).

Without a GPU the CUDA variants are skipped with the reason; the CPU determinism variants run everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, Tuple

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_ext import ops
from rollout_corr_ext.correction import op_args
from rollout_corr_ext.losses import PolicyLossConfig
from rollout_corr_testing.backends import device_params, device_skip_reason
from rollout_corr_testing.rc_testutil import make_inputs

Cfg = rc.RolloutCorrectionConfig

@dataclasses.dataclass(frozen=True)
class Case:
    """``make(device, seed)`` -> the case's input tensors (static buffers for capture); ``run(inputs)`` -> the
    output tensors. Every case is documented CUDA-graph-safe and free of host syncs."""

    name: str
    make: Callable[[str, int], Dict[str, torch.Tensor]]
    run: Callable[[Dict[str, torch.Tensor]], Tuple[torch.Tensor, ...]]


# --------------------------------------------------------------------------------------------------- inputs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(device: str, seed: int, grad: bool = False, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """Logits [N, V] (CPU: 37 x 300; CUDA: 2048 x 8192, many blocks) with ignored rows, targets, upstream weights."""
    n, v = (37, 300) if device == "cpu" else (2048, 8192)
    g = _gen(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype).to(device)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return {"x": x.requires_grad_(grad), "t": t.to(device), "w1": torch.randn(n, generator=g).to(device),
            "w2": torch.randn(n, generator=g).to(device)}


def _rollout(device: str, seed: int) -> Dict[str, torch.Tensor]:
    """Log-probs [B, T] on the 2^-12 grid with NaN padding (CPU: 24 x 96; CUDA: 2048 x 512, B > the 1024 blocks)."""
    b, t = (24, 96) if device == "cpu" else (2048, 512)
    lp, rlp, mask = make_inputs(b, t, seed=seed, scale=0.2, pad_rows=(3,))
    return {"lp": lp.to(device), "rlp": rlp.to(device), "mask": mask.to(device)}


def _policy(device: str, seed: int, grad: bool = True) -> Dict[str, torch.Tensor]:
    """Policy-loss inputs [B, T] (CPU: 12 x 40; CUDA: 2048 x 512) with rejected rows, IS weights, advantages."""
    b, t = (12, 40) if device == "cpu" else (2048, 512)
    g = _gen(seed)
    old = -torch.rand(b, t, generator=g) * 3
    lp = old + torch.randn(b, t, generator=g) * 0.4
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    mask[1] = False
    out = {"lp": lp.to(device).requires_grad_(grad), "old": old.to(device),
           "rollout": (old + torch.randn(b, t, generator=g) * 0.1).to(device),
           "adv": torch.randn(b, t, generator=g).to(device), "mask": mask.to(device),
           "w": (0.5 + torch.rand(b, t, generator=g)).to(device), "adv_rows": torch.randn(b, generator=g).to(device),
           # a global normaliser as a tensor on the device, made outside the step (a copy inside would sync)
           "num_tokens": torch.tensor(float(mask.sum()) * 4).to(device)}
    return out


def _grad(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(out, x)
    return g


def _metrics(d: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    return tuple(d[k] for k in sorted(d))


# --------------------------------------------------------------------------------------------------- cases

RS_ONLY = Cfg(rollout_is=None, rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.7_1.3,0.02,0.1",
              rollout_token_veto_threshold=1e-3)
TOKEN_IS_RS = Cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
                  rollout_rs_threshold="0.7_1.3,0.02")
SEQ_IS_NORM = Cfg(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
                  rollout_rs="geometric", rollout_rs_threshold="0.99_1.01")


def _lp_fwd(i):
    return rc.vocab_parallel_log_probs(i["x"], i["t"], return_entropy=True, temperature=0.9)


def _lp_fwd_bwd(i):
    logp, ent = rc.vocab_parallel_log_probs(i["x"], i["t"], return_entropy=True, temperature=0.9)
    return logp, ent, _grad((logp * i["w1"] + ent * i["w2"]).sum(), i["x"])


def _lp_inplace(i):
    z = i["x"] * 1.0  # the output layer's (non-leaf) logits, overwritten by the gradient
    logp = rc.vocab_parallel_log_probs(z, i["t"], inplace_backward=True)
    return logp, _grad((logp * i["w1"]).sum(), i["x"])


def _ce_bwd(i):
    loss = rc.vocab_parallel_cross_entropy(i["x"], i["t"], label_smoothing=0.1)
    return loss, _grad((loss * i["w1"]).sum(), i["x"])


def _correction(cfg):
    def run(i):
        res = rc.compute_rollout_correction(i["lp"], i["rlp"], i["mask"], cfg)
        return ((res.response_mask,) + (() if res.weights is None else (res.weights,)) + _metrics(res.metrics))
    return run


def _offpolicy(i):
    return _metrics(rc.compute_offpolicy_metrics(i["lp"], i["rlp"], i["mask"]))


def _vanilla(cfg=None, mode="token-mean"):
    def run(i):
        c = cfg(i) if callable(cfg) else cfg
        loss, met = rc.compute_policy_loss_vanilla(i["old"], i["lp"], i["adv"], i["mask"], mode, c, i["w"])
        return (loss, _grad(loss, i["lp"])) + _metrics(met)
    return run


def _reinforce(i):
    loss, met = rc.compute_policy_loss_reinforce(i["rollout"], i["lp"], i["adv"], i["mask"], "seq-mean-token-sum",
                                                 None, i["w"])
    return (loss, _grad(loss, i["lp"])) + _metrics(met)


def _bypass_rs(i):
    cfg = PolicyLossConfig(rollout_correction=Cfg(rollout_is=None, rollout_rs="seq_mean_k1",
                                                  rollout_rs_threshold="0.9_1.1", bypass_mode=True,
                                                  loss_type="ppo_clip"))
    loss, met = rc.compute_policy_loss_bypass(i["rollout"], i["lp"], i["adv"], i["mask"], "token-mean", cfg)
    return (loss, _grad(loss, i["lp"])) + _metrics(met)


def _decoupled_tis(i):
    cfg = PolicyLossConfig(rollout_correction=TOKEN_IS_RS)
    loss, met = rc.compute_policy_loss_decoupled(i["old"], i["lp"], i["rollout"], i["adv"], i["mask"], "token-mean",
                                                 cfg)
    return (loss, _grad(loss, i["lp"])) + _metrics(met)


def _agg(**norm):
    def run(i):
        loss_mat = i["lp"] * i["adv"]
        n = {k: (v(i) if callable(v) else v) for k, v in norm.items()}
        return tuple(rc.agg_loss(loss_mat, i["mask"], mode, **n) for mode in
                     ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    return run


def _grpo(i):
    out = rc.calculate_grpo_loss(i["lp"], i["old"], i["rollout"], i["adv_rows"], 0.2, 0.28, 0.05, 0.01,
                                 i["rollout"] - 0.05, 2.0)
    return tuple(out) + (_grad(out[0].sum(), i["lp"]),)


def _megatron_inputs(device, seed):
    i = _logits(device, seed, grad=True)
    n, v = i["x"].shape
    s = 8 if device == "cpu" else 64
    b = n // s
    g = _gen(seed + 100)
    mask = torch.rand(b, s, generator=g) > 0.2
    return {"x": i["x"][: b * s].detach().reshape(s, b, v).clone().requires_grad_(True),
            "target": torch.randint(0, v, (b, s), generator=g).to(device), "mask": mask.to(device),
            "adv": torch.randn(b, generator=g).to(device), "old": (-torch.rand(b, s, generator=g) * 5).to(device),
            "rollout": (-torch.rand(b, s, generator=g) * 5).to(device)}


def _megatron(rcfg=None):
    def run(i):
        from rollout_corr_ext.megatron import make_policy_loss_func

        cfg = PolicyLossConfig(rollout_correction=rcfg)
        fn = make_policy_loss_func(i["target"], i["adv"], i["mask"], old_log_prob=i["old"],
                                   rollout_log_prob=i["rollout"] if rcfg is not None else None, config=cfg,
                                   entropy_coeff=0.01)
        loss_sum, num_tokens, report = fn(i["x"])
        return (loss_sum, num_tokens, _grad(loss_sum, i["x"])) + _metrics(report)
    return run


# The ops themselves (torch.ops.rollout_corr.*, through the rollout_corr_ext.ops wrappers).


def _op_vocab_row_stats(i):
    return (ops.vocab_row_stats(i["x"], i["t"], 0, i["x"].shape[1], 1.1, -100, True),)


def _op_merge_and_backward(i):
    x, t, v = i["x"], i["t"], i["x"].shape[1]
    half = v // 2
    recs = torch.stack([ops.vocab_row_stats(x[:, :half].contiguous(), t, 0, v, 1.1, -100, True),
                        ops.vocab_row_stats(x[:, half:].contiguous(), t, half, v, 1.1, -100, True)])
    logp, ent, mean_logp, state, status = ops.merge_row_stats(recs, t, -100, v, 1.1, True)
    grad = ops.logprob_backward(i["w1"], i["w2"], i["w1"], x, t, state, 0, v, 1.1, -100)
    inplace = x.detach().clone()
    ops.logprob_backward_(inplace, i["w1"], i["w2"], None, t, state, 0, v, 1.1, -100)
    return logp, ent, mean_logp, state, status, grad, inplace


def _op_rollout_passes(cfg):
    args = op_args(cfg)

    def run(i):
        st = ops.rollout_seq_stats(i["lp"], i["rlp"], i["mask"], args)
        w, m, sums, maxes = ops.rollout_token_pass(i["lp"], i["rlp"], i["mask"], st, args, True)
        checked = ops.rollout_check(sums, None, i["lp"], i["rlp"], i["mask"], False)
        return (st, m, sums, maxes, checked) + (() if cfg.is_spec is None else (w,))
    return run


def _op_policy_loss(i):
    loss_mat, rows = ops.policy_loss_rows(i["lp"], i["old"], i["adv"], i["mask"], i["w"], 0.2, 0.28, 3.0, 0)
    # backward: policy_loss_backward through the op's registered autograd formula
    return loss_mat, rows, _grad((loss_mat * i["adv"]).sum() + rows[:, 0].sum(), i["lp"])


CASES = {c.name: c for c in [
    # public entry points
    Case("vocab_parallel_log_probs", lambda d, s: _logits(d, s), _lp_fwd),
    Case("vocab_parallel_log_probs+backward", lambda d, s: _logits(d, s, grad=True), _lp_fwd_bwd),
    Case("vocab_parallel_log_probs+backward(bf16)", lambda d, s: _logits(d, s, grad=True, dtype=torch.bfloat16),
         _lp_fwd_bwd),
    Case("vocab_parallel_log_probs(inplace_backward)", lambda d, s: _logits(d, s, grad=True), _lp_inplace),
    Case("vocab_parallel_cross_entropy(label_smoothing)+backward", lambda d, s: _logits(d, s, grad=True), _ce_bwd),
    Case("compute_rollout_correction(RS+veto, no IS)", _rollout, _correction(RS_ONLY)),
    Case("compute_rollout_correction(token IS+RS)", _rollout, _correction(TOKEN_IS_RS)),
    Case("compute_rollout_correction(sequence IS, batch-normalised)", _rollout, _correction(SEQ_IS_NORM)),
    Case("compute_offpolicy_metrics", _rollout, _offpolicy),
    Case("compute_policy_loss_vanilla+backward", _policy, _vanilla()),
    Case("compute_policy_loss_vanilla(tensor normalisers)+backward", _policy,
         _vanilla(lambda i: PolicyLossConfig(dp_size=4, batch_num_tokens=i["num_tokens"]))),
    Case("compute_policy_loss_vanilla(Python-number normalisers)+backward", _policy,
         _vanilla(PolicyLossConfig(dp_size=4, batch_num_tokens=57))),
    Case("compute_policy_loss_reinforce+backward", _policy, _reinforce),
    Case("compute_policy_loss_bypass(ppo_clip, RS only)+backward", _policy, _bypass_rs),
    Case("compute_policy_loss_decoupled(token IS)+backward", _policy, _decoupled_tis),
    Case("agg_loss(every mode)", _policy, _agg()),
    Case("agg_loss(Python-number normalisers)", _policy, _agg(global_batch_size=13, batch_num_tokens=57)),
    Case("calculate_grpo_loss(TIS)+backward", _policy, _grpo),
    Case("make_policy_loss_func(TP=1, no correction)+backward", _megatron_inputs, _megatron()),
    Case("make_policy_loss_func(TP=1, RS only)+backward", _megatron_inputs,
         _megatron(Cfg(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"))),
    Case("make_policy_loss_func(TP=1, decoupled token IS)+backward", _megatron_inputs,
         _megatron(Cfg.decoupled_token_is())),
    # the ops
    Case("op:vocab_row_stats", lambda d, s: _logits(d, s), _op_vocab_row_stats),
    Case("op:merge_row_stats+logprob_backward+logprob_backward_", lambda d, s: _logits(d, s), _op_merge_and_backward),
    Case("op:rollout_seq_stats+rollout_token_pass+rollout_check(IS+RS)", _rollout, _op_rollout_passes(TOKEN_IS_RS)),
    Case("op:rollout_seq_stats+rollout_token_pass+rollout_check(RS only)", _rollout, _op_rollout_passes(RS_ONLY)),
    Case("op:policy_loss_rows+policy_loss_backward", _policy, _op_policy_loss),
]}
SAFE = list(CASES)

CUDA_REASON = device_skip_reason("cuda")
needs_cuda = pytest.mark.skipif(CUDA_REASON is not None, reason=f"cuda: {CUDA_REASON}")


# --------------------------------------------------------------------------------------------------- helpers


def _flat(outputs) -> Tuple[torch.Tensor, ...]:
    return tuple(o for o in outputs if isinstance(o, torch.Tensor))


def _clone(inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inputs.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def capture_and_replay(case: Case) -> None:
    """Capture ``case`` in a CUDA graph on static inputs, replay it on new values, compare with eager."""
    static = case.make("cuda", 0)
    fresh = case.make("cuda", 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture: lazy initialisation, autograd, the allocator
            case.run(_clone(static))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _flat(case.run(static))
    with torch.no_grad():
        for k, v in fresh.items():
            static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    eager = _flat(case.run(_clone(fresh)))
    assert len(captured) == len(eager)
    for i, (a, b) in enumerate(zip(captured, eager)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True,
                                   msg=lambda m, i=i: f"{case.name}: replayed output {i} differs from eager: {m}")
    del graph


# --------------------------------------------------------------------------------------------------- tests


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", SAFE)
def test_capture_safe_cases_replay_like_eager(name):
    capture_and_replay(CASES[name])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", SAFE)
def test_capture_safe_cases_do_not_sync_the_host(name):
    case = CASES[name]
    inputs = case.make("cuda", 0)
    case.run(_clone(inputs))  # warm-up: first-call initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.run(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.cuda
def test_sampling_replay_refuses_capture_by_name():
    """The sampling replay is not capturable (it reads per-row values on the host): inside a real capture it raises
    its own error before any work, and the graph can be ended and the stream used again."""
    logits = torch.randn(4, 32, device="cuda")
    target = torch.randint(0, 32, (4,), device="cuda")
    sp = rc.SamplingParams(top_k=8, top_p=0.9)
    rc.sampled_log_probs(logits, target, sp, vocab_size=32)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="sampled_log_probs: the sampling replay cannot be captured"):
        with torch.cuda.graph(graph):
            rc.sampled_log_probs(logits, target, sp, vocab_size=32)
    torch.cuda.synchronize()
    assert torch.isfinite(rc.sampled_log_probs(logits, target, sp, vocab_size=32).log_prob).all()


@pytest.mark.parametrize("device", device_params("cpu", "cuda"))
@pytest.mark.parametrize("name", list(CASES))
def test_bitwise_deterministic_under_deterministic_algorithms(name, device):
    case = CASES[name]
    inputs = case.make(device, 0)
    with _deterministic():
        runs = [_flat(case.run(_clone(inputs))) for _ in range(3)]
    for r, run in enumerate(runs[1:], 1):
        assert len(run) == len(runs[0])
        for i, (a, b) in enumerate(zip(runs[0], run)):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, i)
            assert torch.equal(_bits(a), _bits(b)), f"{name} on {device}: output {i} of run {r} differs bitwise"
