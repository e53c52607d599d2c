"""The pure-PyTorch sampling-replay ops (docs/sampling_replay.md): ``row_topk``, the per-shard candidates of the
threshold search, with ``torch.topk``, ``floor_fill``, a row's kept set as -inf elsewhere, ``mass_histogram``, one round of the top-p search, and
``count_at_least`` (the CPU
kernels: csrc/cpu/sampling.cpp)."""

from __future__ import annotations

import math

import torch


def row_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row of ``values`` ``[N, C]``, descending, fp32 (fp64 for fp64), -inf after a
    row's values when ``C < k``; NaN is never a candidate (as in the kernel)."""
    if values.dim() != 2:
        raise RuntimeError(f"row_topk: values must be 2-D [rows, cols], got {values.dim()}-D")
    if k < 1:
        raise RuntimeError(f"row_topk: k must be >= 1, got {k}")
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    v = values.to(acc)
    if bool(torch.isnan(v).any()):  # torch.topk ranks NaN first; the kernel skips it
        v = v.masked_fill(torch.isnan(v), -math.inf)
    top = v.topk(min(k, v.shape[1]), dim=-1).values
    if top.shape[1] < k:
        top = torch.cat([top, top.new_full((top.shape[0], k - top.shape[1]), -math.inf)], 1)
    return top


def _below(x: torch.Tensor, floor: torch.Tensor, temperature: float) -> torch.Tensor:
    """Where ``z = x / temperature`` (fp32; fp64 for fp64 ``x``; ``x`` itself at temperature 1) is under the floor."""
    if temperature == 1.0:
        return x < floor.unsqueeze(1)  # bf16 / fp16 widen exactly in the comparison
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) / torch.tensor(temperature, dtype=acc, device=x.device)) < floor.unsqueeze(1)


def floor_fill(x: torch.Tensor, floor: torch.Tensor, temperature: float, out: torch.Tensor) -> None:
    """``out`` = ``x`` with -inf where ``x / temperature`` is under the row's ``floor``."""
    torch.where(_below(x, floor, temperature), torch.full((), -math.inf, dtype=x.dtype, device=x.device), x, out=out)


def floor_zero_(grad: torch.Tensor, x: torch.Tensor, floor: torch.Tensor, temperature: float) -> None:
    """``grad`` = 0 where ``x / temperature`` is under the row's ``floor``."""
    grad.masked_fill_(_below(x, floor, temperature), 0.0)


def _ordered_key(z: torch.Tensor) -> torch.Tensor:
    z = z + 0.0  # -0.0 + 0.0 = +0.0
    if z.dtype == torch.float64:
        bits = z.view(torch.int64)
        return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    bits = z.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def mass_histogram(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   probes: torch.Tensor) -> torch.Tensor:
    """``[N, P + 1]`` int64: per row the masses ``round(exp(z - z_max) * 2^40)`` of the values ``z >= floor`` (not
    -inf) with ``lo < key(z) <= hi``, in bucket ``#{j: probes[j] < key(z)}``."""
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)  # bf16 / fp16 widen exactly
    key = _ordered_key(z)
    use = (z >= floor.unsqueeze(1)) & (z != -math.inf) & (key > lo.unsqueeze(1)) & (key <= hi.unsqueeze(1))
    rel = z.to(torch.float64) - z_max.to(torch.float64).unsqueeze(1)
    mass = torch.where(use & (rel >= -60.0), torch.exp(rel) * float(2 ** 40), torch.zeros_like(rel))
    mass = mass.round().to(torch.int64)
    bucket = torch.searchsorted(probes.contiguous(), key.contiguous())  # the first probe >= key: #{probes < key}
    hist = torch.zeros((z.shape[0], probes.shape[1] + 1), dtype=torch.int64, device=z.device)
    return hist.scatter_add_(1, bucket, mass)


def count_at_least(z: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: per row the number of values ``z >= floor``."""
    return torch.count_nonzero(z >= floor.unsqueeze(1), dim=-1)


def row_candidates(x: torch.Tensor, k: torch.Tensor, target_col: torch.Tensor, width: int, temperature: float,
                   valid_cols: int):
    """The replay of top-k sampling from one look at the logits (the op's contract, csrc/ops.cpp): per row with
    ``k >= 1``, every ``z = x / temperature`` at or above the row's k-th largest (ties whole, never -inf), sorted by
    value descending then column ascending (``values``, ``index``, padded with -inf / -1 to ``width``), how many
    there are (``count``), and ``stats`` ``[N, 3]`` fp64: max z (NaN for a row with NaN / +inf, -inf when every
    value is -inf), sum exp(z - max z), z at ``target_col`` (-inf where it is -1)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, dev = x.shape[0], x.device
    active = k >= 1
    z = x[:, :valid_cols].to(acc)
    if temperature != 1.0:
        z = z / torch.tensor(temperature, dtype=acc, device=dev)
    z = torch.where(active.unsqueeze(1), z, torch.full((), -math.inf, dtype=acc, device=dev))
    bad = (torch.isnan(z) | (z == math.inf)).any(-1)
    zc = z.masked_fill(bad.unsqueeze(1), -math.inf)
    z_max = zc.amax(-1) if valid_cols else torch.full((n,), -math.inf, dtype=acc, device=dev)
    ref = torch.where(z_max > -math.inf, z_max, torch.zeros_like(z_max)).unsqueeze(1)
    sum_exp = torch.exp(zc.to(torch.float64) - ref.to(torch.float64)).sum(-1)
    t_ok = (target_col >= 0) & (target_col < valid_cols) & active
    z_t = z.gather(1, target_col.clamp(0, max(valid_cols - 1, 0)).unsqueeze(1)).squeeze(1) if valid_cols else \
        torch.full((n,), -math.inf, dtype=acc, device=dev)
    stats = torch.stack([torch.where(bad, torch.full_like(z_max, math.nan), z_max).to(torch.float64),
                         torch.where(bad | ~active, torch.zeros_like(sum_exp), sum_exp),
                         torch.where(t_ok, z_t, torch.full_like(z_t, -math.inf)).to(torch.float64)], 1)
    values = torch.full((n, width), -math.inf, dtype=torch.float32 if acc == torch.float32 else acc, device=dev)
    index = torch.full((n, width), -1, dtype=torch.int64, device=dev)
    count = torch.zeros(n, dtype=torch.int64, device=dev)
    w = min(width, valid_cols)
    if w == 0:
        return values, index, count, stats
    # the k-th largest finite value (-inf when a row has fewer than k); then every value at or above it
    k_max = int(k.max()) if n else 0
    top = zc.topk(min(max(k_max, 1), valid_cols), dim=-1).values
    kth = top.gather(1, (k.clamp(1, top.shape[1]) - 1).unsqueeze(1)).squeeze(1)
    kth = torch.where(k > top.shape[1], torch.full_like(kth, -math.inf), kth)
    keep = (zc >= kth.unsqueeze(1)) & (zc > -math.inf) & (active & ~bad).unsqueeze(1)
    count = keep.sum(-1)
    # the w largest kept, then value descending, column ascending: a stable sort by value of them in column order
    key = torch.where(keep, zc, torch.full((), -math.inf, dtype=acc, device=dev))
    v_sorted, i_sorted = key.topk(w, dim=-1)
    i_sorted, order = i_sorted.sort(dim=-1)
    v_sorted, order = v_sorted.gather(1, order).sort(dim=-1, descending=True, stable=True)
    i_sorted = i_sorted.gather(1, order)
    slot = torch.arange(w, device=dev).unsqueeze(0) < count.unsqueeze(1)
    values[:, :w] = torch.where(slot, v_sorted, torch.full((), -math.inf, dtype=acc, device=dev)).to(values.dtype)
    index[:, :w] = torch.where(slot, i_sorted, torch.full((), -1, dtype=torch.int64, device=dev))
    return values, index, count, stats


def scatter_rows(values: torch.Tensor, index: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, cols]`` of ``dtype``: 0, with ``values[r, w]`` at column ``index[r, w]`` where that is >= 0."""
    out = torch.zeros((values.shape[0], cols), dtype=values.dtype, device=values.device)
    use = index >= 0
    out.scatter_add_(1, index.clamp_min(0), torch.where(use, values, torch.zeros_like(values)))
    return out.to(dtype)


def candidate_decide(cand: torch.Tensor, z_max: torch.Tensor, z_t: torch.Tensor, sum_all: torch.Tensor,
                     k: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor):
    """The replay's decision on each row's candidates (the op's contract, csrc/ops.cpp): ``tau`` (the kept set
    is ``{z >= tau, z > -inf}``) and ``[N, 4]`` fp64 (log-prob of the target, entropy, log S, log_kept): every
    log-prob relative to z_max (z - z_max - log_kept), since z_max + log_kept rounds log_kept away for huge z."""
    n, width = cand.shape
    dev = cand.device
    ninf = -math.inf
    active = k >= 1
    cand = cand.sort(dim=1, descending=True).values  # the shards' lists, gathered, come in any order
    kth = cand.gather(1, (k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
    tau = torch.where(active, torch.maximum(floor, kth), torch.full_like(floor, ninf))
    p_on = (top_p < 1) & active
    if bool(p_on.any()):
        surv = (cand >= tau.unsqueeze(1)) & (cand != ninf)
        rel = cand.to(torch.float64) - z_max.unsqueeze(1)
        q = torch.where(surv & (rel >= -60.0), torch.exp(rel) * float(2 ** 40), torch.zeros_like(rel))
        q = q.round().to(torch.int64)
        total = q.sum(1)
        budget = torch.minimum(torch.floor((1.0 - top_p) * total.to(torch.float64)).to(torch.int64), total - 1)
        # M(<= v) = total - M(> v); M(> v) is the running mass before v's group of equal values (descending order)
        first = torch.searchsorted(-cand.contiguous(), -cand.contiguous(), side="left")
        before = torch.cat([torch.zeros((n, 1), dtype=torch.int64, device=dev), q.cumsum(1)], 1).gather(1, first)
        over = surv & ((total.unsqueeze(1) - before) > budget.unsqueeze(1))
        thr = torch.where(over, cand, torch.full((), math.inf, dtype=cand.dtype, device=dev)).amin(1)
        tau = torch.where(p_on, torch.maximum(tau, thr), tau)
    kept = (cand >= tau.unsqueeze(1)) & (cand != ninf)
    rel = torch.where(kept, cand.to(torch.float64) - z_max.unsqueeze(1), torch.full((), ninf, dtype=torch.float64,
                                                                                      device=dev))
    log_kept = torch.logsumexp(rel, 1)
    lp = torch.where(kept, rel - log_kept.unsqueeze(1), torch.zeros_like(rel))
    entropy = -(lp.exp() * lp).masked_fill(~kept, 0.0).sum(1)
    inside = (z_t >= tau.to(torch.float64)) & (z_t != ninf)
    logp = torch.where(inside, (z_t - z_max) - log_kept, torch.full_like(z_t, ninf))
    log_s = (log_kept - torch.log(sum_all)).clamp_max(0.0)
    out = torch.stack([logp, entropy, log_s, log_kept], 1)
    out = torch.where(active.unsqueeze(1), out, torch.zeros_like(out))
    return tau, out
