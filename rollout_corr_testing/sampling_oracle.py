"""Dense fp64 oracle of sampling replay, written from vLLM's V1 sampler rules (``vllm/v1/sample/sampler.py``,
``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p``, the min-p logits processor): the whole vocabulary of
one row at a time, sorted, cumulated, masked and renormalised, exactly as those functions do it, with one documented
difference: a group of equal values at the top-p boundary is kept or dropped whole (vLLM splits it by sort order).

Test infrastructure: imports nothing from ``rollout_corr_ext``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

F64 = torch.float64


def _row_value(v, i):
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return v.reshape(-1)[i].item()
    if isinstance(v, (list, tuple)):
        return v[i]
    return v


def _kept_entropy(kept: torch.Tensor, zk: torch.Tensor, lse_k: torch.Tensor) -> torch.Tensor:
    """The entropy over the kept set, -sum q log q, differentiable: log q is 0 outside the set before its product
    (-inf there would make the gradient NaN through 0 * -inf)."""
    lq = torch.where(kept, zk - lse_k, torch.zeros_like(zk))
    return -torch.where(kept, lq.exp() * lq, torch.zeros_like(zk)).sum()


def kept_mask_dense(z: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float) -> torch.Tensor:
    """The kept set of one row of temperature-scaled logits ``z`` ``[V]`` (fp64), vLLM's order: min-p, top-k, top-p."""
    z = z.to(F64).clone()
    v = z.numel()
    if min_p > 0:  # vLLM: probs < min_p * max(probs) -> -inf
        probs = torch.softmax(z, dim=0)
        z[probs < min_p * probs.max()] = -math.inf
    if top_k is not None and 0 < top_k < v:  # vLLM: logits_sort < the k-th largest -> -inf (ties kept)
        asc = z.sort().values
        kth = asc[v - top_k]
        z[z < kth] = -math.inf
    if top_p < 1:  # vLLM: ascending sort, cumsum of the renormalised probs, drop where cumsum <= 1 - p
        asc, idx = z.sort(stable=True)
        cum = torch.softmax(asc, dim=0).cumsum(0)
        drop_sorted = torch.zeros(v, dtype=torch.bool)
        i = 0
        while i < v:  # one group of equal values at a time: the decision of its last member
            j = i
            while j + 1 < v and asc[j + 1] == asc[i]:
                j += 1
            drop_sorted[i:j + 1] = bool(cum[j] <= 1 - top_p) and j != v - 1
            i = j + 1
        drop = torch.zeros(v, dtype=torch.bool)
        drop[idx] = drop_sorted
        z[drop] = -math.inf
    return z != -math.inf


def sampled_log_probs_dense(logits: torch.Tensor, target: torch.Tensor, temperature=1.0,
                            top_k: Union[None, int, Sequence, torch.Tensor] = None, top_p=1.0, min_p=0.0,
                            ignore_index: int = -100):
    """Per row of ``logits`` ``[N, V]`` (the whole vocabulary): (log_prob, entropy, log_kept_mass, in_support,
    kept ``[N, V]``), fp64; ``log_prob`` and ``entropy`` differentiable in ``logits``. Parameters: a
    number for every row or one value per row; top_k None / <= 0 disables."""
    n, v = logits.shape
    out_lp, out_ent, out_ls, out_in, kept_rows = [], [], [], [], []
    for i in range(n):
        t = int(target[i])
        if t == ignore_index:
            zero = logits[i, :1].to(F64).nan_to_num().sum() * 0  # ignored rows may hold NaN
            out_lp.append(zero); out_ent.append(zero.detach()); out_ls.append(zero.detach())  # noqa: E702
            out_in.append(True); kept_rows.append(torch.ones(v, dtype=torch.bool))  # noqa: E702
            continue
        temp = float(_row_value(temperature, i))
        k = _row_value(top_k, i)
        k = None if k is None or int(k) <= 0 else int(k)
        z = logits[i].to(F64) / temp
        kept = kept_mask_dense(z.detach(), k, float(_row_value(top_p, i)), float(_row_value(min_p, i)))
        zk = torch.where(kept, z, torch.full_like(z, -math.inf))
        lse_k = torch.logsumexp(zk, 0)
        out_lp.append(zk[t] - lse_k if bool(kept[t]) else z.nan_to_num(0.0, 0.0, 0.0)[t] * 0 - math.inf)
        out_ent.append(_kept_entropy(kept, zk, lse_k))
        out_ls.append((lse_k - torch.logsumexp(z, 0)).detach())
        out_in.append(bool(kept[t]))
        kept_rows.append(kept)
    return (torch.stack(out_lp), torch.stack(out_ent), torch.stack(out_ls), torch.tensor(out_in),
            torch.stack(kept_rows))


def kept_log_probs_dense(logits: torch.Tensor, target: torch.Tensor, kept_rows, temperature=1.0,
                         ignore_index: int = -100):
    """The same outputs over explicit kept sets: ``kept_rows[i]`` lists row ``i``'s kept ids. Per row: z = logits /
    T in fp64, every column outside the list at -inf, ``log_softmax``; log S = logsumexp(z over the list) -
    logsumexp(z). (log_prob and entropy differentiable, log S, in_support)."""
    n, v = logits.shape
    out_lp, out_ent, out_ls, out_in = [], [], [], []
    for i in range(n):
        t = int(target[i])
        if t == ignore_index:
            zero = logits[i, :1].to(F64).nan_to_num().sum() * 0
            out_lp.append(zero); out_ent.append(zero.detach()); out_ls.append(zero.detach())  # noqa: E702
            out_in.append(True)  # noqa: E702
            continue
        z = logits[i].to(F64) / float(_row_value(temperature, i))
        kept = torch.zeros(v, dtype=torch.bool)
        kept[torch.tensor(list(kept_rows[i]), dtype=torch.int64)] = True
        kept &= z.detach() != -math.inf  # a kept id the trainer gives probability 0 stays at 0
        zk = torch.where(kept, z, torch.full_like(z, -math.inf))
        lse_k = torch.logsumexp(zk, 0)
        out_lp.append(zk[t] - lse_k if bool(kept[t]) else z.nan_to_num(0.0, 0.0, 0.0).sum() * 0 - math.inf)
        out_ent.append(_kept_entropy(kept, zk, lse_k))
        out_ls.append((lse_k - torch.logsumexp(z, 0)).detach())
        out_in.append(bool(kept[t]))
    return torch.stack(out_lp), torch.stack(out_ent), torch.stack(out_ls), torch.tensor(out_in)
