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
