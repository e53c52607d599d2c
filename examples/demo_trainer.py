"""A small but real GRPO trainer on megatron-core tensor parallelism, with rollout correction side by side.

    torchrun --nproc_per_node=2 examples/demo_trainer.py            # CPU, gloo, TP=2 (the default)
    torchrun --nproc_per_node=2 examples/demo_trainer.py --device cuda   # GPUs, NCCL

What it does, per step and per correction setting:

* **Rollout** with a mismatched sampler, as a real inference engine would be: a bf16 copy of the policy whose
  weights are those of ``--stale`` GRPO steps ago (asynchronous rollout; each step is ``--minibatches`` optimizer
  steps). It samples responses for a synthetic task
  with a verifiable reward (reverse a string of digits; reward = fraction of positions right), drawing from
  softmax(logits / T) truncated by top-k / top-p as vLLM's sampler does (``--top-p 0.9`` by default), and records
  its own log-probs at sampling time: those of the truncated distribution of its bf16 logits (vLLM's
  ``processed_logprobs``, verl's default).
* **Sampling replay**: the trainer scores tokens under the same truncation of its own logits
  (``make_policy_loss_func(sampling=...)``, docs/sampling_replay.md), so the mismatch metrics see the numerical and
  staleness mismatch alone; a setting named ``NAME:noreplay`` scores them under softmax(logits / T) instead, and its
  ratios then carry each row's kept mass (the default settings include ``none:noreplay`` to show the difference).
* **Advantages**: GRPO (reward normalised within each prompt's group).
* **Update**: the trainer, megatron-core's own ``GPTModel`` (``--model gpt``, the default: the local layer spec,
  RoPE, fp32, sequence parallelism on at TP > 1), recomputes pi_old (decoupled settings) and runs PPO over
  mini-batches through :func:`rollout_corr_ext.megatron.make_policy_loss_func` with ``output_layer=`` the model's
  vocab-parallel output layer: the loss takes the decoder's final hidden states (this rank's ``[s / tp, b, H]``
  under SP) and never builds the logits (fused log-probs -> rollout correction -> policy loss, in megatron-core's
  ``loss_func`` contract). ``--model tiny``: megatron's TP linears around attention written here, and the logits
  path.

Settings (``--settings``): ``none`` (PPO vs pi_old, mismatch ignored; correction metrics still logged),
``token_tis`` (decoupled, token TIS C=2), ``seq_mis`` (decoupled, sequence TIS + sequence RS at 2),
``geo_rs`` (decoupled, geometric-mean RS), ``bypass`` (PPO against pi_rollout, no recompute of pi_old).
All settings start from the same weights and see the same prompts and sampling seeds.

Outputs in ``--out-dir``: ``metrics.jsonl`` (one line per step and setting), ``curves.png`` (reward, exact match,
``rollout_corr/kl``, ``rollout_corr/chi2_token``, percentiles of the token IS ratio pi_train/pi_rollout and the
fraction of sequences / tokens each setting rejects) and ``run.json`` (the command, the commit, the machine, the
backend and the wall time: ``examples/demo_table.py`` prints the docs' results table from these files); unless
``--no-report``, the mismatch report of each setting's last step (rank 0's batch): ``report_SETTING.pt`` (the batch)
and ``report_SETTING.png`` / ``.json`` (``python -m rollout_corr_ext.report`` of it; a ':' in SETTING becomes '_').

On CPU a few pieces of megatron-core need CUDA; ``rollout_corr_testing/megatron_cpu.py`` names each with its shim
(docs/megatron.md). One of them is the schedule (``forward_backward_no_pipelining`` allocates on "cuda"), so
``loss_func`` is called directly, in the same contract ``forward_backward_func`` uses (``loss_sum / num_tokens``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import shlex
import subprocess
import sys
import textwrap
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The demo runs from a checkout: make the package importable without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*compiled extension is not built.*")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")  # megatron's GPU-only advice
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: the table script's moving average
from demo_table import current_machine, smooth  # noqa: E402  (one definition each: the plot and the table agree)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

import rollout_corr_ext as rc  # noqa: E402
from rollout_corr_ext.config import RolloutCorrectionConfig  # noqa: E402
from rollout_corr_ext.losses import PolicyLossConfig  # noqa: E402
from rollout_corr_ext.megatron import make_policy_loss_func, reported_means  # noqa: E402
from rollout_corr_testing.megatron_cpu import (  # noqa: E402
    allreduce_sequence_parallel_grads,
    causal_mask,
    cpu_megatron,
    final_hidden_states,
    gpt_model,
)

# ---------------------------------------------------------------------------------------------------------
# Task: reverse a digit string. Tokens 0-9 are digits, BOS and SEP frame the prompt.
# ---------------------------------------------------------------------------------------------------------

BOS, SEP = 10, 11
VOCAB = 12  # divisible by the TP size 2 (and 4): no padding columns needed
MAX_LEN = 32  # the models' positions
MAX_DIGITS = (MAX_LEN - 2) // 2  # a prompt of BOS, digits, SEP, then as many response tokens


def make_prompts(n: int, digits: int, gen: torch.Generator) -> torch.Tensor:
    body = torch.randint(0, 10, (n, digits), generator=gen)
    return torch.cat([torch.full((n, 1), BOS), body, torch.full((n, 1), SEP)], dim=1)


def reward_fn(prompts: torch.Tensor, responses: torch.Tensor, digits: int) -> torch.Tensor:
    """Verifiable reward: fraction of response positions equal to the reversed digit string."""
    want = prompts[:, 1:1 + digits].flip(1)
    return (responses == want).float().mean(1)


# ---------------------------------------------------------------------------------------------------------
# A tiny causal LM from megatron-core's tensor-parallel layers.
# ---------------------------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelParallelConfig, hidden: int, heads: int, ffn: int, init):
        super().__init__()
        tp = cfg.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(f"heads={heads} must be divisible by the TP size {tp}")
        self.local_heads, self.head_dim = heads // tp, hidden // heads
        self.ln1 = torch.nn.LayerNorm(hidden, dtype=cfg.params_dtype)
        # Column-parallel QKV: this rank's output columns are its heads, laid out [heads_local, 3, head_dim].
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, config=cfg, init_method=init, bias=True,
                                        gather_output=False)
        self.proj = RowParallelLinear(hidden, hidden, config=cfg, init_method=init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False)
        self.ln2 = torch.nn.LayerNorm(hidden, dtype=cfg.params_dtype)
        self.fc1 = ColumnParallelLinear(hidden, ffn, config=cfg, init_method=init, bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(ffn, hidden, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [s, b, hidden]
        s, b, _ = h.shape
        qkv, _ = self.qkv(self.ln1(h))
        qkv = qkv.view(s, b, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)  # [3, b, H, s, d]
        att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # [b, H, s, d]
        att = att.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        out, _ = self.proj(att)
        h = h + out
        mid, _ = self.fc1(self.ln2(h))
        out, _ = self.fc2(F.gelu(mid))
        return h + out


class TinyLM(torch.nn.Module):
    """Embedding -> ``layers`` pre-LN blocks -> LayerNorm -> vocab-parallel output layer ([s, b, V/tp] logits)."""

    def __init__(self, cfg: ModelParallelConfig, hidden=64, heads=4, layers=2, ffn=256, max_len=MAX_LEN, seed=0):
        super().__init__()
        torch.manual_seed(seed)  # identical replicated parameters on every TP rank; TP shards use the CPU init

        def init(w):
            return torch.nn.init.normal_(w, std=0.02)

        self.embed = VocabParallelEmbedding(VOCAB, hidden, init_method=init, config=cfg)
        self.pos = torch.nn.Embedding(max_len, hidden, dtype=cfg.params_dtype)
        torch.nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = torch.nn.ModuleList(Block(cfg, hidden, heads, ffn, init) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden, dtype=cfg.params_dtype)
        self.out = ColumnParallelLinear(hidden, VOCAB, config=cfg, init_method=init, bias=False, gather_output=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [b, s] -> logits [s, b, V_local]
        s = tokens.shape[1]
        h = self.embed(tokens.t()) + self.pos(torch.arange(s, device=tokens.device)).unsqueeze(1)
        for blk in self.blocks:
            h = blk(h)
        logits, _ = self.out(self.ln_f(h))
        return logits


class GPTLM(torch.nn.Module):
    """megatron-core's ``GPTModel`` (rollout_corr_testing/megatron_cpu.py: local spec, RoPE, dropout 0) behind the
    demo's interface: ``forward(tokens [b, s])`` -> logits ``[s, b, V_local]``; ``hidden(tokens)`` -> the output
    layer's input (this rank's ``[s / tp, b, H]`` with sequence parallelism); ``output_layer``."""

    def __init__(self, tp: int, dtype: torch.dtype, seed: int, sequence_parallel: bool, hidden=64, heads=4, layers=2,
                 ffn=256, max_len=MAX_LEN):
        super().__init__()
        self.gpt = gpt_model(VOCAB, tp=tp, sequence_parallel=sequence_parallel, hidden=hidden, heads=heads,
                             layers=layers, ffn=ffn, max_len=max_len, seed=seed, dtype=dtype)
        self.output_layer = self.gpt.output_layer
        self.tp = tp

    def _call(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if self.gpt.config.sequence_parallel and s % self.tp:
            raise ValueError(f"sequence parallelism splits the {s} positions over TP = {self.tp}: use a sequence "
                             f"length divisible by it (--digits)")
        pos = torch.arange(s, device=tokens.device).expand(tokens.shape)
        return self.gpt(tokens, pos, attention_mask=causal_mask(s, tokens.device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._call(tokens).transpose(0, 1)  # GPTModel returns [b, s, V_local]

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        with final_hidden_states(self.gpt):
            return self._call(tokens)


def model_config(tp: int, dtype: torch.dtype) -> ModelParallelConfig:
    return ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, perform_initialization=True,
                               params_dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# Rollout: the mismatched sampler (bf16, stale weights), log-probs recorded at sampling time.
# ---------------------------------------------------------------------------------------------------------


def gather_vocab(shard: torch.Tensor, tp_group) -> torch.Tensor:
    """[b, V_local] shards -> [b, V] on every TP rank (megatron's gather helper allocates on CUDA)."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def truncate(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The engine's truncation, written from vLLM's V1 sampler (``apply_top_k_top_p``): top-k keeps every value
    >= the k-th largest; top-p sorts ascending, takes the cumulative softmax and drops the positions where it is
    <= 1 - top_p, never the last (the top token). Dropped logits become -inf. Dense on purpose: this is the engine's
    side, which holds the whole vocabulary (the trainer replays it with rollout_corr_ext.sampled_log_probs)."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if top_p < 1.0:
        srt, idx = z.sort(dim=-1)
        drop = srt.softmax(-1).cumsum(-1) <= 1.0 - top_p
        drop[:, -1] = False
        z = z.scatter(1, idx, srt.masked_fill(drop, -math.inf))
    return z


@torch.no_grad()
def rollout(sampler: TinyLM, prompts: torch.Tensor, length: int, gen: torch.Generator, tp_group, args):
    """Sample ``length`` tokens per prompt from softmax(logits / T) truncated by top-k / top-p; returns (responses
    [n, length], the sampler's log-probs [n, length]): those of the distribution it drew from (vLLM's
    ``processed_logprobs``, verl's default ``logprobs_mode``)."""
    seq = prompts
    chosen, logps = [], []
    for _ in range(length):
        shard = sampler(seq)[-1].float()  # [b, V_local] of the bf16 logits, last position
        full = gather_vocab(shard, tp_group)  # every TP rank sees the same logits
        if args.temperature != 1.0 or args.top_k > 0 or args.top_p < 1.0:
            full = truncate(full / args.temperature, args.top_k, args.top_p)
        logp_all = torch.log_softmax(full, dim=-1)
        # Sampling on the CPU generator shared by all ranks: identical draws everywhere.
        tok = torch.multinomial(logp_all.exp().cpu(), 1, generator=gen).to(seq.device)
        chosen.append(tok)
        logps.append(logp_all.gather(1, tok))
        seq = torch.cat([seq, tok], dim=1)
    return torch.cat(chosen, 1), torch.cat(logps, 1)


def grpo_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage, as verl's ``compute_grpo_outcome_advantage``: (r - mean_g) / (std_g + eps); a group
    of one response has mean 0 and std 1 there (its std is undefined), so its advantage is r / (1 + eps)."""
    r = rewards.view(-1, group)
    if group == 1:
        return (r / (1.0 + eps)).reshape(-1)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).reshape(-1)


def token_logprobs(model: TinyLM, seq: torch.Tensor, mask: torch.Tensor, tp_group, sampling, temperature: float):
    """Trainer-side log-probs of the next token at the ``mask`` positions, [b, s] (0 elsewhere): under the replayed
    truncated distribution when ``sampling`` is given (-inf where the token is outside its kept set), else under
    softmax(logits / temperature)."""
    from rollout_corr_ext.megatron import vocab_parallel_log_probs

    logits = model(seq)  # [s, b, V_local]
    target = torch.cat([seq[:, 1:], torch.zeros_like(seq[:, :1])], dim=1).masked_fill(~mask, -100).t()
    if sampling is not None:
        return rc.sampled_log_probs(logits, target, sampling, tp_group).log_prob.t()
    return vocab_parallel_log_probs(logits, target, tp_group, temperature=temperature).t()


SETTINGS = {
    "none": lambda a: RolloutCorrectionConfig.disabled(),
    "token_tis": lambda a: RolloutCorrectionConfig.decoupled_token_is(threshold=2.0),
    "seq_mis": lambda a: RolloutCorrectionConfig.seq_mis(threshold=2.0),
    "geo_rs": lambda a: RolloutCorrectionConfig.decoupled_geo_rs(rs_threshold=a.geo_rs_threshold),
    "bypass": lambda a: RolloutCorrectionConfig.bypass_ppo_clip(),
}


#: a setting name with this suffix scores tokens under softmax(logits / T) (the engine's truncation not replayed)
NO_REPLAY = ":noreplay"


def sampling_params(args):
    """What the sampler draws with, for the trainer to replay (None when it draws from softmax(logits) itself)."""
    if args.temperature == 1.0 and args.top_k <= 0 and args.top_p == 1.0:
        return None
    return rc.SamplingParams(temperature=args.temperature, top_k=args.top_k if args.top_k > 0 else None,
                             top_p=args.top_p)


class Run:
    """One correction setting: trainer, stale bf16 sampler, optimizer, weight history."""

    def __init__(self, name: str, args, device):
        self.name, self.args, self.device = name, args, device
        base = name[:-len(NO_REPLAY)] if name.endswith(NO_REPLAY) else name
        self.sampling = None if name.endswith(NO_REPLAY) else sampling_params(args)
        self.rc = SETTINGS[base](args)
        self.bypass = bool(self.rc.bypass_mode)
        self.cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, rollout_correction=self.rc)
        if args.model == "gpt":  # the sampler runs without SP (an inference engine's layout; any length)
            self.model = GPTLM(args.tp, torch.float32, args.seed, sequence_parallel=True).to(device)
            self.sampler = GPTLM(args.tp, torch.bfloat16, args.seed, sequence_parallel=False).to(device)
        else:
            self.model = TinyLM(model_config(args.tp, torch.float32), seed=args.seed).to(device)
            self.sampler = TinyLM(model_config(args.tp, torch.bfloat16), seed=args.seed).to(device)
        # the fused path: the loss takes the output layer's input (not with --packed: a packed stream of the
        # response positions is cut from the logits here)
        self.fused = args.model == "gpt" and not args.packed
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.99))
        self.history = collections.deque(maxlen=args.stale + 1)

    def sync_sampler(self):
        """Push the weights of ``stale`` steps ago to the bf16 sampler (asynchronous rollout)."""
        with torch.no_grad():
            self.history.append({k: p.detach().clone() for k, p in self.model.named_parameters()})
            for name, p in self.sampler.named_parameters():
                p.copy_(self.history[0][name])  # casts fp32 -> bf16

    def step(self, prompts: torch.Tensor, gen: torch.Generator, tp_group, dp_group, keep_batch: bool = False) -> dict:
        """One GRPO step; ``keep_batch``: also keep this step's correction inputs in ``self.batch`` (the report's)."""
        a = self.args
        self.sync_sampler()
        prompts = prompts.repeat_interleave(a.group, 0)
        responses, rollout_lp_resp = rollout(self.sampler, prompts, a.digits, gen, tp_group, a)
        rewards = reward_fn(prompts, responses, a.digits)
        adv = grpo_advantages(rewards, a.group)

        seq = torch.cat([prompts, responses], 1)
        n, s = seq.shape
        p = prompts.shape[1]
        target = torch.cat([seq[:, 1:], torch.zeros_like(seq[:, :1])], 1)  # position t scores token t+1
        mask = torch.zeros(n, s, dtype=torch.bool, device=seq.device)
        mask[:, p - 1:s - 1] = True
        rollout_lp = torch.zeros(n, s, device=seq.device)
        rollout_lp[:, p - 1:s - 1] = rollout_lp_resp
        with torch.no_grad():  # pi_old (decoupled) / pi_theta at step start (bypass: diagnostics only)
            train_lp = token_logprobs(self.model, seq, mask, tp_group, self.sampling, a.temperature)
        # the loss scores tokens as train_lp does: replayed (sampling=) or under softmax(logits / T)
        scoring = dict(sampling=self.sampling) if self.sampling is not None else dict(temperature=a.temperature)
        old_lp = None if self.bypass else train_lp

        reports = []
        perm = torch.randperm(n, generator=gen).to(seq.device)
        for idx in perm.tensor_split(a.minibatches):  # exactly --minibatches (chunk gives fewer when n % m != 0)
            if a.packed:
                # Sequence packing (megatron's THD layout): the loss sees one stream of the response-scoring
                # positions of every sequence, with cu_seqlens; no padding reaches it. (A packed trainer's model
                # would emit [T, 1, V] itself; this tiny model runs padded and its logits are packed here.)
                r = s - p
                cut = slice(p - 1, s - 1)
                cu = torch.arange(0, len(idx) * r + 1, r, device=seq.device)

                def stream(t):
                    return None if t is None else t[idx][:, cut].reshape(-1)

                loss_func = make_policy_loss_func(
                    stream(target), adv[idx], stream(mask), old_log_prob=stream(old_lp),
                    rollout_log_prob=stream(rollout_lp), config=self.cfg, loss_agg_mode="token-mean",
                    tp_group=tp_group, dp_group=dp_group, cu_seqlens=cu, **scoring)
                logits = self.model(seq[idx])  # [s, b, V_local]
                loss_sum, num_tokens, report = loss_func(logits[cut].transpose(0, 1).reshape(-1, 1,
                                                                                              logits.shape[-1]))
            else:
                fused = dict(output_layer=self.model.output_layer) if self.fused else {}
                loss_func = make_policy_loss_func(
                    target[idx], adv[idx], mask[idx],
                    old_log_prob=None if old_lp is None else old_lp[idx], rollout_log_prob=rollout_lp[idx],
                    config=self.cfg, loss_agg_mode="token-mean", tp_group=tp_group, dp_group=dp_group, **scoring,
                    **fused)
                out = self.model.hidden(seq[idx]) if self.fused else self.model(seq[idx])
                loss_sum, num_tokens, report = loss_func(out)
            loss = loss_sum / num_tokens.clamp(min=1)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.args.model == "gpt":  # the norms' gradients, partial per rank under SP (finalize_model_grads)
                allreduce_sequence_parallel_grads(self.model, tp_group)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            reports.append(report)

        # the token ratio over the tokens in the trainer's support (with replay, a token outside its kept set has
        # train_lp = -inf: it left the loss and is counted in rollout_corr/sampling_out_of_support_fraction)
        ratio = (train_lp - rollout_lp)[mask & (train_lp != -math.inf)].exp()
        q = torch.quantile(ratio.float(), torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], device=ratio.device))
        rec = {"setting": self.name, "reward": float(rewards.mean()),
               "exact_match": float((rewards == 1).float().mean())}
        rec.update(reported_means(reports))
        rec.update({f"demo/token_ratio_p{int(k * 100):02d}": float(v)
                    for k, v in zip((0.05, 0.25, 0.5, 0.75, 0.95), q)})
        if keep_batch:
            # the response positions only; a token outside the trainer's kept set (train_lp = -inf) left the loss
            # and is left out of the report's mask as it is of the ratio percentiles above
            cut = slice(p - 1, s - 1)
            lp = train_lp[:, cut]
            self.batch = {"log_prob": lp.float().cpu(), "rollout_log_prob": rollout_lp[:, cut].float().cpu(),
                          "response_mask": (mask[:, cut] & (lp != -math.inf)).cpu(), "config": self.rc.to_dict()}
        return rec


# (metric keys, title, y-axis label, y scale); several keys in one panel: solid, dashed, dotted lines.
PANELS = [
    (("reward",), "reward", "fraction of digits right (batch mean)", "linear"),
    (("exact_match",), "exact match", "fraction of responses fully reversed", "linear"),
    (("rollout_corr/kl",), "rollout_corr/kl: KL(pi_rollout || pi_train), k1 estimate",
     "nats / token (symlog)", "symlog"),
    (("rollout_corr/chi2_token",), "rollout_corr/chi2_token: token chi-squared estimate",
     "mean(ratio^2) - 1 (symlog)", "symlog"),
    (("demo/token_ratio_p95",), "token ratio pi_train/pi_rollout: p95", "ratio (log scale)", "log"),
    (("demo/token_ratio_p05",), "token ratio pi_train/pi_rollout: p5", "ratio (log scale)", "log"),
    (("rollout_corr/seq_masked_fraction", "rollout_corr/masked_fraction"),
     "rejected by RS / veto: sequences (solid), tokens (dashed)", "fraction of the batch rejected", "linear"),
    (("rollout_corr/sampling_kept_mass_mean", "rollout_corr/sampling_out_of_support_fraction"),
     "replay: kept mass S (solid), tokens outside the kept set (dashed)", "fraction (mean over tokens)", "linear"),
]

CAPTION = (
    "Every curve is a trailing moving average over {window} steps. rollout_corr/kl is the k1 estimate "
    "mean(log pi_rollout - log pi_train) and rollout_corr/chi2_token the estimate mean(ratio^2) - 1, both over the "
    "batch's sampled tokens: on a finite batch these sample estimates go below 0 (kl when the sampled tokens are on "
    "average more likely under pi_train than under pi_rollout, chi2 when mean(ratio^2) < 1), although the true KL "
    "and chi-squared are >= 0; their symlog axes are linear within +-1e-3. Rejected: "
    "rollout_corr/seq_masked_fraction (solid) and rollout_corr/masked_fraction (dashed), the sequences and tokens "
    "that RS and the veto remove from the loss; every response has the same length, so the two coincide here. "
    "'none', 'token_tis' and 'bypass' have no RS and reject nothing. The sampler draws with {sampling}; a setting "
    "ending in ':noreplay' scores tokens under softmax(logits / T) instead of replaying the truncation, so its ratios "
    "carry each row's kept mass S (the last panel, which only replaying settings report).")


def plot(path: str, records, settings, window: int = 9, sampling: str = "no truncation"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(3, 3, figsize=(17, 13))
    colors = dict(zip(settings, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = ("-", "--", ":")
    for ax, (keys, title, ylabel, scale) in zip(axes.flat, PANELS):
        for key, ls in zip(keys, styles):
            for name in settings:
                rows = [r for r in records if r["setting"] == name and key in r]
                if rows:
                    ax.plot([r["step"] for r in rows], smooth([r[key] for r in rows], window),
                            label=name if ls == "-" else None, color=colors[name], lw=1.4, ls=ls)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.axhline(0.0, color="k", lw=0.6)
        elif scale == "log":
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(alpha=0.3)
    legend_ax = axes.flat[len(PANELS)]
    legend_ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    legend_ax.legend(handles, labels, loc="center", title="setting", fontsize=11)
    fig.suptitle(f"GRPO with a stale bf16 sampler ({sampling}): rollout-correction settings side by side",
                 fontsize=12)
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(CAPTION.format(window=window, sampling=sampling), 200)), fontsize=9,
             va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report_name(setting: str) -> str:
    """``report_SETTING``, the report files' name (a ':' in the setting's name becomes '_': no colon in file names)."""
    return "report_" + setting.replace(":", "_")


def write_report(prefix: str, batch: dict) -> None:
    """``PREFIX.pt`` (the batch, as ``python -m rollout_corr_ext.report`` reads it) and the one-page report of it,
    ``PREFIX.png`` and ``PREFIX.json`` (docs/rollout_correction.md)."""
    from rollout_corr_ext import report

    torch.save(batch, prefix + ".pt")
    page = report.build_report(batch)
    with open(prefix + ".json", "w") as f:
        json.dump(page, f, indent=1)
    report.plot_report(page, prefix + ".png")


def _cpu_isa() -> str:
    try:
        from rollout_corr_ext import ops

        return ops.cpu_isa()
    except (ImportError, AttributeError, RuntimeError):  # a release without the query
        return "unknown"


def run_info(args, backend: str, seconds: float) -> dict:
    """Where a run came from, for ``run.json``: the command, the commit, the machine (examples/demo_table.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        try:
            return subprocess.run(["git", "--no-optional-locks", *cmd], cwd=root, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("diff", "--name-only", "HEAD", "--", "examples/demo_trainer.py", "rollout_corr_ext", "csrc")
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    return {
        "command": f"torchrun --nproc_per_node={nproc} examples/demo_trainer.py "
                   + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "args": vars(args),
        "commit": git("rev-parse", "--short", "HEAD") or "unknown",
        "uncommitted": changed.split(),  # tracked files the run used that differ from the commit
        "machine": current_machine(),
        "device": (torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
        "dist_backend": backend,
        "rollout_corr_ext_backend": rc.backend(),
        "rollout_corr_ext_cpu_isa": _cpu_isa(),  # which copy of the compiled CPU kernels ran (float rounding)
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
    }


def describe_sampling(args) -> str:
    parts = [f"T = {args.temperature:g}"] if args.temperature != 1.0 else []
    parts += [f"top-k = {args.top_k}"] if args.top_k > 0 else []
    parts += [f"top-p = {args.top_p:g}"] if args.top_p < 1.0 else []
    return ", ".join(parts) or "no truncation"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: gloo process group; cuda: NCCL, one GPU per rank (LOCAL_RANK)")
    ap.add_argument("--model", choices=["gpt", "tiny"], default="gpt",
                    help="gpt: megatron-core's GPTModel (local spec, sequence parallelism at TP > 1), the loss on its "
                         "hidden states through the fused output layer; tiny: megatron's TP linears around attention "
                         "written here, the loss on the logits")
    ap.add_argument("--tp", type=int, default=2,
                    help="tensor-parallel size; the world size must be a multiple, the rest is data parallel")
    ap.add_argument("--steps", type=int, default=200,
                    help="GRPO steps: one rollout batch and one PPO epoch over it per step and setting")
    ap.add_argument("--settings", default="none,token_tis,seq_mis,geo_rs,bypass,none:noreplay",
                    help=f"comma-separated rollout-correction settings run side by side, from {', '.join(SETTINGS)}; "
                         f"NAME{NO_REPLAY}: the same setting without sampling replay (the trainer scores tokens under "
                         f"softmax(logits / T), not the truncated distribution the sampler drew from)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (per data-parallel rank)")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    ap.add_argument("--minibatches", type=int, default=2, help="PPO mini-batches per step (one epoch)")
    ap.add_argument("--digits", type=int, default=3,
                    help="length of the digit string to reverse (the response has as many tokens; at most 15)")
    ap.add_argument("--packed", action="store_true",
                    help="feed the loss packed sequences (a 1-D token stream with cu_seqlens) instead of [b, s]")
    ap.add_argument("--stale", type=int, default=2,
                    help="the sampler draws with the weights of this many GRPO steps ago (each step is --minibatches "
                         "optimizer steps; 0: the current weights, in bf16)")
    ap.add_argument("--top-p", type=float, default=0.9,
                    help="the sampler draws from the smallest top set of mass >= top_p (vLLM's rule; 1: off); the "
                         "trainer replays it (docs/sampling_replay.md) unless a setting ends in ':noreplay'")
    ap.add_argument("--top-k", type=int, default=0, help="the sampler keeps the top_k largest logits (0: off)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the sampler draws from softmax(logits / T)")
    ap.add_argument("--lr", type=float, default=None,
                    help="Adam learning rate (default: 1e-3 for --model gpt, 3e-3 for --model tiny)")
    ap.add_argument("--geo-rs-threshold", default="0.9_1.1",
                    help="geo_rs keep range LOWER_UPPER of exp(mean log-ratio) per sequence")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the prompts and the sampling")
    ap.add_argument("--out-dir", default="demo_out",
                    help="where metrics.jsonl, curves.png, run.json and the report_SETTING files go")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("--no-report", action="store_true",
                    help="no mismatch report of each setting's last step (report_SETTING.pt / .png / .json)")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.lr is None:
        args.lr = 1e-3 if args.model == "gpt" else 3e-3
    # the sizes, named here rather than failing deep in a step (each a count; the sequence, 2 * digits + 2
    # positions, must fit the models' 32 positions)
    for flag, value, low in (("--steps", args.steps, 1), ("--prompts", args.prompts, 1), ("--group", args.group, 1),
                             ("--minibatches", args.minibatches, 1), ("--digits", args.digits, 1),
                             ("--stale", args.stale, 0), ("--tp", args.tp, 1), ("--top-k", args.top_k, 0)):
        if value < low:
            ap.error(f"{flag} must be >= {low}, got {value}")
    if args.digits > MAX_DIGITS:
        ap.error(f"--digits must be <= {MAX_DIGITS} (prompt and response take 2 * digits + 2 of the models' "
                 f"{MAX_LEN} positions), got {args.digits}")
    if args.minibatches > args.prompts * args.group:
        ap.error(f"--minibatches {args.minibatches} is more than the {args.prompts * args.group} responses of a step "
                 f"(--prompts x --group) to split into them")
    if not args.lr >= 0 or math.isinf(args.lr):
        ap.error(f"--lr must be finite and >= 0, got {args.lr}")
    names = args.settings.split(",")
    unknown = [s for s in names if (s[:-len(NO_REPLAY)] if s.endswith(NO_REPLAY) else s) not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}, each optionally with {NO_REPLAY!r}")
    if len(set(names)) != len(names):
        ap.error(f"--settings names a setting twice: {args.settings}")
    try:
        rc.SamplingParams(temperature=args.temperature, top_k=args.top_k if args.top_k > 0 else None,
                          top_p=args.top_p)
    except (TypeError, ValueError) as e:
        ap.error(str(e).replace("SamplingParams.", "--").replace("top_p", "top-p").replace("top_k", "top-k"))
    if any(n.split(NO_REPLAY)[0] == "geo_rs" for n in names):
        try:
            SETTINGS["geo_rs"](args)
        except (TypeError, ValueError) as e:
            ap.error(f"--geo-rs-threshold {args.geo_rs_threshold!r}: {e}")
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = args.settings.split(",")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda asked for, but no CUDA device is visible")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {args.tp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_rank = parallel_state.get_data_parallel_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    shims = cpu_megatron() if args.device == "cpu" else contextlib.nullcontext()  # megatron's CUDA-only pieces
    shims.__enter__()
    runs = [Run(name, args, device) for name in settings]
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "metrics.jsonl")
    records = []
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps * len(runs), desc="GRPO", unit="upd", dynamic_ncols=True)
    t0 = time.time()
    out = open(jsonl, "w") if rank == 0 else None
    keep = rank == 0 and not args.no_report  # the report pages: rank 0's batch of each setting's last step
    for step in range(args.steps):
        # Same prompts and sampling seed for every setting; each DP rank gets its own slice of prompts.
        pgen = torch.Generator().manual_seed(args.seed * 100003 + step * world + dp_rank)
        prompts = make_prompts(args.prompts, args.digits, pgen).to(device)
        for run in runs:
            gen = torch.Generator().manual_seed(args.seed * 7919 + step * world + dp_rank + 1)
            rec = run.step(prompts, gen, tp_group, dp_group, keep_batch=keep and step == args.steps - 1)
            # Reward is local to this DP rank's prompts: average it over DP (TP ranks already agree).
            r = torch.tensor([rec["reward"], rec["exact_match"]], device=device)
            dist.all_reduce(r, group=dp_group)
            rec["reward"], rec["exact_match"] = (r / dist.get_world_size(dp_group)).tolist()
            rec["step"] = step
            records.append(rec)
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"step {step} {run.name} reward {rec['reward']:.2f}")
    if bar is not None:
        bar.close()
    if rank == 0:
        out.close()
        png = os.path.join(args.out_dir, "curves.png")
        plot(png, records, settings, sampling=describe_sampling(args))
        tail = max(1, args.steps // 5)
        print(f"\n{args.steps} steps x {len(runs)} settings in {time.time() - t0:.0f}s  (TP={args.tp}, "
              f"{backend}, rollout_corr_ext backend={rc.backend()}, seed {args.seed}); means over the last {tail} "
              f"steps:")
        print(f"{'setting':<10} {'reward':>7} {'exact':>6} {'kl':>9} {'chi2_tok':>9} {'ratio p5':>9} {'ratio p95':>9}")
        for name in settings:
            rows = [r for r in records if r["setting"] == name][-tail:]

            def mean(key):
                vals = [r[key] for r in rows if key in r]
                return sum(vals) / len(vals) if vals else math.nan

            print(f"{name:<10} {mean('reward'):7.3f} {mean('exact_match'):6.3f} {mean('rollout_corr/kl'):9.2e} "
                  f"{mean('rollout_corr/chi2_token'):9.2e} {mean('demo/token_ratio_p05'):9.3f} "
                  f"{mean('demo/token_ratio_p95'):9.3f}")
        info = os.path.join(args.out_dir, "run.json")
        with open(info, "w") as f:
            json.dump(run_info(args, backend, time.time() - t0), f, indent=1)
            f.write("\n")
        print(f"wrote {jsonl}, {png} and {info}")
        if keep and args.steps > 0:
            for run in runs:
                write_report(os.path.join(args.out_dir, report_name(run.name)), run.batch)
            print(f"wrote {os.path.join(args.out_dir, 'report_<setting>')}.png and .json, the mismatch report of each "
                  f"setting's last step (python -m rollout_corr_ext.report), and its batch .pt; <setting>: "
                  f"{', '.join(report_name(n)[len('report_'):] for n in settings)}")
    dist.barrier()
    shims.__exit__(None, None, None)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
