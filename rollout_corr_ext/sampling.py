"""Sampling replay: log-probs under the distribution the sampler really drew from (docs/sampling_replay.md).

An inference engine samples from ``softmax(z)`` truncated by min-p, top-k and top-p and renormalised; a trainer that
scores the same token under the full ``softmax(logits)`` sees every ratio multiplied by the row's kept mass. This
module replays the engine's truncation on the trainer's logits, exactly and under tensor parallelism, without ever
holding more than a rank's vocabulary shard:

1. ``z = logits / temperature`` (fp32; fp64 for fp64 logits), as vLLM's V1 sampler divides its fp32 logits;
2. min-p keeps ``p_u >= min_p * p_max``, i.e. ``exp(z_u - z_max) >= min_p`` (vLLM's ``MinPLogitsProcessor``,
   applied after temperature, before top-k / top-p);
3. top-k keeps every value ``>=`` the k-th largest of what min-p kept (vLLM ``apply_top_k_top_p``: ties with the k-th
   value are kept);
4. top-p, on the distribution renormalised over what 1-3 kept: vLLM sorts ascending, takes the cumulative sum and
   drops the positions where it is ``<= 1 - top_p`` (never the last, the top token). Equal values are one group
   here: a group is kept whole when the cumulative mass through its last member exceeds ``1 - top_p`` (the vLLM rule
   applied to the group's last position; vLLM itself splits a tied group by sort order).

Every step keeps an upper set of ``z``, so a row's kept set is ``{u: z_u >= tau}`` for one threshold ``tau``; the
log-probs are then the plain vocab-parallel log-probs of the logits with everything below ``tau`` masked to -inf
(the existing kernels: the gradient is the renormalised softmax's over the kept set and exactly 0 outside).

The threshold search exchanges per-row summaries only (the max, the top-k candidates, integer partial masses): the
masses ``round(exp(z_u - z_max) * 2^40)`` are int64, whose sums do not depend on the order or the sharding, so every
decision is the same at every tensor-parallel size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import logprobs as _lp

Number = Union[int, float]
#: fixed-point scale of the top-p masses (2^-40 of the top token's probability; sums stay < 2^63 for V < 2^22)
MASS_BITS = 40
#: below this many nats under the row's max, a quantized mass is exactly 0 (e^-64 * 2^40 < 0.5)
_MASS_FLOOR = 64.0


def _field_tensor(name: str, value) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise ValueError(f"SamplingParams.{name}: a per-row tensor must be 1-D (one value per row), got shape "
                             f"{tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"SamplingParams.{name}: expected a real tensor, got {value.dtype}")
        return value.detach()
    return None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What the inference engine sampled with; each field a Python number or a per-row 1-D tensor (engines accept
    per-request parameters). Defaults leave the distribution untouched.

    temperature: > 0 (finite). top_k: ``None`` (or 0 / -1, vLLM's and verl's "disabled") or an int >= 1; in a
    per-row tensor, values <= 0 disable that row. top_p: in (0, 1]; 1 disables. min_p: in [0, 1); 0 disables.
    """

    temperature: Union[Number, torch.Tensor] = 1.0
    top_k: Union[None, int, torch.Tensor] = None
    top_p: Union[Number, torch.Tensor] = 1.0
    min_p: Union[Number, torch.Tensor] = 0.0

    def __post_init__(self):
        checks = {
            "temperature": (lambda v: torch.isfinite(v) & (v > 0), "finite and > 0"),
            "top_p": (lambda v: (v > 0) & (v <= 1), "in (0, 1]"),
            "min_p": (lambda v: (v >= 0) & (v < 1), "in [0, 1)"),
        }
        for name, (ok, what) in checks.items():
            value = getattr(self, name)
            t = _field_tensor(name, value)
            if t is None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"SamplingParams.{name} must be a number or a 1-D tensor, got "
                                    f"{type(value).__name__}")
                t = torch.tensor(float(value), dtype=torch.float64)
            bad = ~ok(t.to(torch.float64))
            if bool(bad.any()):
                v = t.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item() if t.dim() else t.item()
                raise ValueError(f"SamplingParams.{name} must be {what}, got {v!r}")
        k = self.top_k
        t = _field_tensor("top_k", k)
        if t is not None:
            if t.is_floating_point():
                raise TypeError(f"SamplingParams.top_k: a per-row tensor must hold integers, got {t.dtype}")
        elif k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"SamplingParams.top_k must be None, an int or a 1-D integer tensor, got "
                            f"{type(k).__name__}")
        elif k is not None and k < -1:
            raise ValueError(f"SamplingParams.top_k must be >= 1, or None / 0 / -1 (disabled), got {k}")

    @classmethod
    def from_verl(cls, rollout_config) -> "SamplingParams":
        """From verl's rollout config (``actor_rollout_ref.rollout``: ``temperature``, ``top_k`` (-1: disabled),
        ``top_p``); a mapping or an object with those attributes."""
        get = rollout_config.get if hasattr(rollout_config, "get") else lambda k, d: getattr(rollout_config, k, d)
        top_k = get("top_k", -1)
        return cls(temperature=float(get("temperature", 1.0)), top_k=None if top_k in (None, 0, -1) else int(top_k),
                   top_p=float(get("top_p", 1.0)), min_p=float(get("min_p", 0.0) or 0.0))

    def truncates(self) -> bool:
        """Whether any row can lose tokens (top-k, top-p < 1 or min-p > 0 somewhere)."""
        def active(value, off):
            t = _field_tensor("", value) if isinstance(value, torch.Tensor) else None
            return bool(off(t).logical_not().any()) if t is not None else not bool(off(torch.tensor(value)))
        k = self.top_k
        k_on = k is not None and (bool((k > 0).any()) if isinstance(k, torch.Tensor) else k > 0)
        return k_on or active(self.top_p, lambda v: v >= 1) or active(self.min_p, lambda v: v <= 0)


def _per_row(name: str, value, rows: int, lead, dtype, device) -> torch.Tensor:
    """A field as ``[rows]`` (a number broadcast; a tensor of ``rows`` or of the leading shape's size)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() == 0:
            return value.to(device=device, dtype=dtype).expand(rows)
        if value.numel() != rows:
            raise ValueError(f"SamplingParams.{name}: a per-row tensor needs one value per row ({rows} = "
                             f"{tuple(lead)} rows here), got {value.numel()}")
        return value.reshape(rows).to(device=device, dtype=dtype)
    return torch.full((rows,), float(value) if dtype.is_floating_point else int(value), dtype=dtype, device=device)


def _ordered_key(z: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of the float values (``-0.0`` counts as ``0.0``; no NaN here)."""
    z = z + 0.0  # -0.0 + 0.0 = +0.0: equal values get equal keys
    if z.dtype == torch.float64:
        bits = z.view(torch.int64)
        return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    bits = z.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_to_value(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        return torch.where(key < 0, key ^ 0x7FFFFFFFFFFFFFFF, key).view(torch.float64)
    k = torch.where(key < 0, key ^ 0x7FFFFFFF, key).to(torch.int32)
    return k.view(torch.float32)


def _midpoint(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """floor((lo + hi) / 2) without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _probes(lo: torch.Tensor, hi: torch.Tensor, levels: int = 4) -> torch.Tensor:
    """``2^levels - 1`` sorted points of each row's ``[lo, hi]`` by repeated bisection: ``[rows, 2^levels - 1]``."""
    points = [lo, hi]
    for _ in range(levels):
        nxt = [points[0]]
        for a, b in zip(points, points[1:]):
            nxt += [_midpoint(a, b), b]
        points = nxt
    return torch.stack(points[1:-1], dim=1)


def _all_reduce(t: torch.Tensor, op, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _Thresholds(NamedTuple):
    kept: torch.Tensor  # [N, V_local] bool
    log_kept_mass: torch.Tensor  # [N] acc dtype


def kept_set(z: torch.Tensor, params: SamplingParams, rows_active: torch.Tensor, lead, group, world: int):
    """The kept set ``[N, V_local]`` of each row of the scaled logits ``z`` (-inf at excluded columns) and the log of
    its mass under ``softmax(z)``. Collective over ``group`` (every rank calls it with its shard)."""
    n, dev, acc = z.shape[0], z.device, z.dtype
    z_max = _all_reduce(z.amax(-1) if z.shape[-1] else z.new_full((n,), -math.inf), dist.ReduceOp.MAX, group, world)
    z_max = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))  # an all -inf row is refused later
    rel = z.to(torch.float64) - z_max.to(torch.float64).unsqueeze(1)  # log(p_u / p_max), <= 0

    # min-p: p_u >= min_p * p_max
    min_p = _per_row("min_p", params.min_p, n, lead, torch.float64, dev)
    on = (min_p > 0) & rows_active
    z1 = torch.where(on.unsqueeze(1) & (rel < torch.log(min_p.clamp_min(1e-300)).unsqueeze(1)),
                     torch.full_like(z, -math.inf), z)

    # top-k: every value >= the k-th largest of what min-p kept; the k-th largest of the union of the shards is the
    # k-th largest of the union of each shard's k largest.
    if params.top_k is not None:
        k = _per_row("top_k", params.top_k, n, lead, torch.int64, dev)
        on = (k > 0) & rows_active
        k_max = int(k[on].max()) if bool(on.any()) else 0
        if k_max > 0:
            local = z1.topk(min(k_max, z1.shape[-1]), dim=-1).values if z1.shape[-1] else z1.new_empty((n, 0))
            if local.shape[-1] < k_max:
                local = torch.cat([local, local.new_full((n, k_max - local.shape[-1]), -math.inf)], dim=-1)
            if world > 1:
                local = _lp._all_gather(local.reshape(-1).contiguous(), group, world).reshape(world, n, k_max)
                local = local.permute(1, 0, 2).reshape(n, world * k_max)
            top = local.topk(k_max, dim=-1).values  # descending
            kth = top.gather(1, (k.clamp(1, k_max) - 1).unsqueeze(1)).squeeze(1)
            z1 = torch.where(on.unsqueeze(1) & (z1 < kth.unsqueeze(1)), torch.full_like(z1, -math.inf), z1)

    # top-p on the renormalised survivors: keep a value v iff M(<= v) > (1 - p) M, in integer masses.
    top_p = _per_row("top_p", params.top_p, n, lead, torch.float64, dev)
    on = (top_p < 1) & rows_active
    z2 = z1
    if bool(on.any()):
        q = torch.where(z1 == -math.inf, torch.zeros_like(rel),
                        torch.exp(rel) * float(2 ** MASS_BITS)).round().to(torch.int64)
        total = _all_reduce(q.sum(-1), dist.ReduceOp.SUM, group, world)
        c = torch.floor((1.0 - top_p) * total.to(torch.float64)).to(torch.int64)
        c = torch.minimum(c, total - 1)  # p > 0: the top token is always kept
        key = _ordered_key(z1)
        sorted_key, order = key.sort(dim=-1)
        cum = q.gather(1, order).cumsum(-1)
        hi = _ordered_key(z_max.to(acc))
        lo = _ordered_key((z_max.to(torch.float64) - _MASS_FLOOR).to(acc)) - 1  # M(<= lo) = 0 <= c
        lo = torch.where(on, lo, hi - 1)  # inactive rows start converged
        while bool((hi > lo + 1).any()):  # not hi - lo: fp64 keys span more than int64
            probes = _probes(lo, hi)
            idx = torch.searchsorted(sorted_key, probes, right=True)
            mass = torch.where(idx > 0, cum.gather(1, (idx - 1).clamp_min(0)), torch.zeros_like(idx))
            mass = _all_reduce(mass, dist.ReduceOp.SUM, group, world)
            above = mass > c.unsqueeze(1)
            # the new bracket: the last probe at or under c, the first probe over it
            lo = torch.where(above, torch.full_like(probes, torch.iinfo(torch.int64).min), probes).amax(1).maximum(lo)
            hi = torch.where(above, probes, torch.full_like(probes, torch.iinfo(torch.int64).max)).amin(1).minimum(hi)
        z2 = torch.where(on.unsqueeze(1) & (key < hi.unsqueeze(1)), torch.full_like(z1, -math.inf), z1)

    kept = z2 != -math.inf
    sums = torch.stack([torch.where(kept, torch.exp(rel), torch.zeros_like(rel)).sum(-1),
                        torch.where(z == -math.inf, torch.zeros_like(rel), torch.exp(rel)).sum(-1)], dim=1)
    sums = _all_reduce(sums, dist.ReduceOp.SUM, group, world)
    return _Thresholds(kept, (torch.log(sums[:, 0]) - torch.log(sums[:, 1])).to(acc))


class SampledLogProbs(NamedTuple):
    """``log_prob``: the target's log-prob under the truncated, renormalised distribution (-inf where the target is
    outside the kept set); ``entropy``: over the kept set; ``log_kept_mass``: log S, the log of the kept set's mass
    under the untruncated ``softmax(logits / temperature)`` (<= 0); ``in_support``: whether the target is in the kept
    set (True at ignored positions). All ``[...]`` (the logits' leading shape), fp32 (fp64 for fp64 logits)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor
    log_kept_mass: torch.Tensor
    in_support: torch.Tensor


def sampled_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    sampling: SamplingParams,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
) -> SampledLogProbs:
    """Log-probs of ``target`` under the distribution a vLLM-style sampler drew from with ``sampling``.

    ``logits``: this rank's vocab shard ``[..., V_local]`` (as :func:`vocab_parallel_log_probs`); ``target``: global
    ids ``[...]``. Differentiable in ``logits`` (log_prob and entropy; the kept set is piecewise constant, so the
    gradient is the renormalised softmax's over it and exactly 0 outside). A target outside the kept set has
    ``log_prob = -inf`` and ``in_support = False``: mask it out of any loss (the loss entry points that take a
    ``sampling`` do). Under ``tp_group`` every rank calls it with its shard; no rank holds more than its shard.
    """
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _lp._FLOAT_DTYPES:
        raise TypeError(f"logits must be a float16/bfloat16/float32/float64 tensor, got "
                        f"{getattr(logits, 'dtype', type(logits))}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dimension, got shape {tuple(logits.shape)}")
    _lp.check_target(target, logits, "logits")
    ignore_index = _lp.as_int("ignore_index", ignore_index)
    world, rank = _lp._group_size_rank(tp_group)
    local_vocab = logits.shape[-1]
    vocab_start, vocab_size = _lp.vocab_layout(vocab_start, vocab_size, rank, world, local_vocab)
    lead = logits.shape[:-1]
    n = int(torch.Size(lead).numel())
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits2d = logits.reshape(n, local_vocab)
    target1d = target.reshape(n)
    active = target1d != ignore_index  # ignored rows are never inspected (they may hold junk)
    temperature = _per_row("temperature", sampling.temperature, n, lead, acc, logits.device)
    for name in ("top_k", "top_p", "min_p"):  # per-row sizes, before any work
        value = getattr(sampling, name)
        if isinstance(value, torch.Tensor):
            _per_row(name, value, n, lead, value.dtype, value.device)
    with torch.no_grad():
        z = torch.where(active.unsqueeze(1), logits2d.detach().to(acc), torch.zeros((), dtype=acc,
                                                                                     device=logits.device))
        z = z / temperature.unsqueeze(1)  # vLLM divides its fp32 logits by the temperature
        if bool((torch.isnan(z) | (z == math.inf)).any()):  # the kernels would refuse them too, naming the row
            row = int((torch.isnan(z) | (z == math.inf)).any(-1).nonzero()[0, 0])
            raise ValueError(f"sampled_log_probs: NaN or +inf logit in row {row} of the flattened logits")
        valid_cols = max(0, min(local_vocab, vocab_size - vocab_start))
        if valid_cols < local_vocab:  # vocab padding is not part of the distribution
            z[:, valid_cols:] = -math.inf
        th = kept_set(z, sampling, active, lead, tp_group, world)
    keep = th.kept | ~active.unsqueeze(1)
    masked = logits2d.masked_fill(~keep, -math.inf)
    scalar_t = sampling.temperature if not isinstance(sampling.temperature, torch.Tensor) else None
    if scalar_t is None:  # per-row temperatures: scale here, the kernel then runs at temperature 1
        masked = masked.to(acc) / temperature.unsqueeze(1)
        scalar_t = 1.0
    logp, entropy = _lp.vocab_parallel_log_probs(masked, target1d, tp_group, vocab_start=vocab_start,
                                                 vocab_size=vocab_size, temperature=scalar_t,
                                                 ignore_index=ignore_index, return_entropy=True)
    in_support = (logp != -math.inf) | ~active
    log_s = torch.where(active, th.log_kept_mass, torch.zeros_like(th.log_kept_mass))
    return SampledLogProbs(logp.reshape(lead), entropy.reshape(lead), log_s.reshape(lead), in_support.reshape(lead))
