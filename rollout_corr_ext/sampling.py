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


#: rows per chunk of the local passes (their fp64 temporaries are [chunk, V_local])
CHUNK_ROWS = 256


class KeptSet(NamedTuple):
    kept: torch.Tensor  # [N, V_local] bool
    log_kept_mass: torch.Tensor  # [N] acc dtype
    fast_top_p: bool  # whether top-p was decided on the gathered top-k candidates alone


def _masses(values: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
    """round(exp(z - z_max) * 2^MASS_BITS) as int64 (0 at -inf): order-free exact sums."""
    rel = values.to(torch.float64) - z_max.to(torch.float64).unsqueeze(1)
    return torch.where(values == -math.inf, torch.zeros_like(rel),
                       torch.exp(rel) * float(2 ** MASS_BITS)).round().to(torch.int64)


def _mass_at_or_below(sorted_key: torch.Tensor, cum: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """M(<= probe) per row from ascending keys and their cumulative masses."""
    idx = torch.searchsorted(sorted_key, probes, right=True)
    return torch.where(idx > 0, cum.gather(1, (idx - 1).clamp_min(0)), torch.zeros_like(idx))


def _top_p_budget(total: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """c = floor((1 - p) M): a value v is kept iff M(<= v) > c; never the top token (c < M)."""
    c = torch.floor((1.0 - top_p) * total.to(torch.float64)).to(torch.int64)
    return torch.minimum(c, total - 1)


def kept_set(z_of, n: int, v_local: int, acc, device, params: SamplingParams, rows_active: torch.Tensor, lead,
             group, world: int, allow_fast_top_p: bool = True) -> KeptSet:
    """The kept set ``[N, V_local]`` of each row and the log of its mass under ``softmax(z)``; ``z_of(r0, r1)``
    gives rows ``r0:r1`` of the scaled logits (-inf at excluded columns). Collective over ``group`` (every rank calls
    it with its shard). The local passes run ``CHUNK_ROWS`` rows at a time; the per-row decisions (max, k-th value,
    top-p threshold) are exchanged as small summaries. ``allow_fast_top_p=False`` forces the general top-p search
    (the tests hold the two to the same kept sets)."""
    chunks = [(r0, min(r0 + CHUNK_ROWS, n)) for r0 in range(0, n, CHUNK_ROWS)]
    ninf = -math.inf
    z_max = torch.full((n,), ninf, dtype=acc, device=device)
    for r0, r1 in chunks:
        z_max[r0:r1] = z_of(r0, r1).amax(-1)
    z_max = _all_reduce(z_max, dist.ReduceOp.MAX, group, world)
    z_max = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))  # an all -inf row is refused later

    # min-p: p_u >= min_p * p_max, i.e. z_u - z_max >= log(min_p) (fp64)
    min_p = _per_row("min_p", params.min_p, n, lead, torch.float64, device)
    log_min_p = torch.where((min_p > 0) & rows_active, torch.log(min_p.clamp_min(1e-300)),
                            torch.full_like(min_p, ninf))

    def survivors(r0, r1, kth=None):
        z = z_of(r0, r1)
        rel = z.to(torch.float64) - z_max[r0:r1].to(torch.float64).unsqueeze(1)
        keep = (z != ninf) & (rel >= log_min_p[r0:r1].unsqueeze(1))
        if kth is not None:
            keep &= z >= kth[r0:r1].unsqueeze(1)
        return z, rel, keep

    # top-k: every value >= the k-th largest of what min-p kept; the k-th largest of the union of the shards is the
    # k-th largest of the union of each shard's k largest.
    kth = torch.full((n,), ninf, dtype=acc, device=device)
    cand = None
    k_on = torch.zeros(n, dtype=torch.bool, device=device)
    if params.top_k is not None:
        k = _per_row("top_k", params.top_k, n, lead, torch.int64, device)
        k_on = (k > 0) & rows_active
        k_max = int(k[k_on].max()) if bool(k_on.any()) else 0
        if k_max > 0:
            local = torch.full((n, k_max), ninf, dtype=acc, device=device)
            for r0, r1 in chunks:
                z, _, keep = survivors(r0, r1)
                top = torch.where(keep, z, torch.full_like(z, ninf)).topk(min(k_max, v_local), dim=-1).values
                local[r0:r1, :top.shape[1]] = top
            if world > 1:
                local = _lp._all_gather(local.reshape(-1).contiguous(), group, world).reshape(world, n, k_max)
                local = local.permute(1, 0, 2).reshape(n, world * k_max)
            cand = local
            top = local.topk(k_max, dim=-1).values  # descending
            kth_k = top.gather(1, (k.clamp(1, k_max) - 1).unsqueeze(1)).squeeze(1)
            kth = torch.where(k_on, kth_k, kth)
        else:
            k_on = torch.zeros_like(k_on)

    # top-p on the renormalised survivors: keep a value v iff M(<= v) > (1 - p) M, in integer masses.
    top_p = _per_row("top_p", params.top_p, n, lead, torch.float64, device)
    p_on = (top_p < 1) & rows_active
    tau_p = torch.full((n,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
    fast = False
    if bool(p_on.any()):
        if allow_fast_top_p and cand is not None and bool((k_on | ~p_on).all()):
            # Every top-p row has a top-k: its survivors are the gathered candidates >= kth, if none is missing
            # (a shard with more than k_max values tied at kth would be): count them to be sure.
            count = torch.zeros(n, dtype=torch.int64, device=device)
            for r0, r1 in chunks:
                count[r0:r1] = survivors(r0, r1, kth)[2].sum(-1)
            count = _all_reduce(count, dist.ReduceOp.SUM, group, world)
            cand = torch.where(cand >= kth.unsqueeze(1), cand, torch.full_like(cand, ninf))
            fast = bool(((cand != ninf).sum(-1) == count)[p_on].all())
        if fast:  # every rank holds the same candidates: the search needs no collective
            q = _masses(cand, z_max)
            c = _top_p_budget(q.sum(-1), top_p)
            key = _ordered_key(cand)
            sorted_key, order = key.sort(dim=-1)
            cum = q.gather(1, order).cumsum(-1)
            over = _mass_at_or_below(sorted_key, cum, sorted_key) > c.unsqueeze(1)
            first = torch.where(over & (sorted_key > torch.iinfo(torch.int64).min), sorted_key,
                                torch.full_like(sorted_key, torch.iinfo(torch.int64).max)).amin(1)
            tau_p = torch.where(p_on, first, tau_p)
        else:  # the general search: 16-way bisection of the key space over every shard's survivors
            zs = torch.cat([torch.where(s[2], s[0], torch.full_like(s[0], ninf))
                            for s in (survivors(r0, r1, kth) for r0, r1 in chunks)]) if chunks else \
                torch.empty((0, v_local), dtype=acc, device=device)
            q = _masses(zs, z_max)
            total = _all_reduce(q.sum(-1), dist.ReduceOp.SUM, group, world)
            c = _top_p_budget(total, top_p)
            key = _ordered_key(zs)
            sorted_key, order = key.sort(dim=-1)
            cum = q.gather(1, order).cumsum(-1)
            del zs, q, key, order
            hi = _ordered_key(z_max)
            lo = _ordered_key((z_max.to(torch.float64) - _MASS_FLOOR).to(acc)) - 1  # M(<= lo) = 0 <= c
            lo = torch.where(p_on, lo, hi - 1)  # inactive rows start converged
            while bool((hi > lo + 1).any()):  # not hi - lo: fp64 keys span more than int64
                probes = _probes(lo, hi)
                mass = _all_reduce(_mass_at_or_below(sorted_key, cum, probes), dist.ReduceOp.SUM, group, world)
                above = mass > c.unsqueeze(1)
                # the new bracket: the last probe at or under c, the first probe over it
                lo = torch.where(above, torch.full_like(probes, torch.iinfo(torch.int64).min), probes).amax(1)\
                    .maximum(lo)
                hi = torch.where(above, probes, torch.full_like(probes, torch.iinfo(torch.int64).max)).amin(1)\
                    .minimum(hi)
            tau_p = torch.where(p_on, hi, tau_p)

    kept = torch.empty((n, v_local), dtype=torch.bool, device=device)
    sums = torch.zeros((n, 2), dtype=torch.float64, device=device)
    for r0, r1 in chunks:
        z, rel, keep = survivors(r0, r1, kth)
        keep &= _ordered_key(z) >= tau_p[r0:r1].unsqueeze(1)
        kept[r0:r1] = keep
        e = torch.exp(rel)
        sums[r0:r1, 0] = torch.where(keep, e, torch.zeros_like(e)).sum(-1)
        sums[r0:r1, 1] = torch.where(z == ninf, torch.zeros_like(e), e).sum(-1)
    sums = _all_reduce(sums, dist.ReduceOp.SUM, group, world)
    return KeptSet(kept, (torch.log(sums[:, 0]) - torch.log(sums[:, 1])).to(acc), fast)


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
    temperature = torch.where(active, temperature, torch.ones_like(temperature))
    for name in ("top_k", "top_p", "min_p"):  # per-row sizes, before any work
        value = getattr(sampling, name)
        if isinstance(value, torch.Tensor):
            _per_row(name, value, n, lead, value.dtype, value.device)
    valid_cols = max(0, min(local_vocab, vocab_size - vocab_start))
    data = logits2d.detach()
    temp_col = temperature.unsqueeze(1)

    def z_of(r0, r1):
        """Rows r0:r1 of z = logits / temperature (vLLM divides its fp32 logits); -inf at vocab padding; ignored
        rows read as 0 (never inspected)."""
        z = data[r0:r1].to(acc) / temp_col[r0:r1]
        z = torch.where(active[r0:r1].unsqueeze(1), z, torch.zeros((), dtype=acc, device=z.device))
        if valid_cols < local_vocab:  # vocab padding is not part of the distribution
            z[:, valid_cols:] = -math.inf
        return z

    with torch.no_grad():
        for r0 in range(0, n, CHUNK_ROWS):  # the kernels would refuse them too, naming the row
            z = z_of(r0, min(r0 + CHUNK_ROWS, n))
            bad = (torch.isnan(z) | (z == math.inf)).any(-1)
            if bool(bad.any()):
                raise ValueError(f"sampled_log_probs: NaN or +inf logit in row {r0 + int(bad.nonzero()[0, 0])} of "
                                 f"the flattened logits")
        th = kept_set(z_of, n, local_vocab, acc, logits.device, sampling, active, lead, tp_group, world)
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
