"""Tensor helpers shared by the fallback (``fallback/``) and the layers above the op surface (``losses.py``): a leaf
module, so that nothing but ``ops.py`` imports the fallback."""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

_CU_MSG = "cu_seqlens must start at 0, never decrease and end at the number of packed tokens"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (for gradcheck); every other dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_sum`` integrand: ``where(mask, v, 0) * mask`` (NaN outside the mask never leaks)."""
    return torch.where(mask != 0, values, torch.zeros_like(values)) * mask


def check_cu_seqlens(log_prob: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The packed layout's checks (the kernels' rollout_layout), returning cu_seqlens as int64: a named ValueError
    on CPU, an asynchronous device assert on CUDA (no host sync)."""
    if log_prob.dim() != 1:
        raise ValueError(f"with cu_seqlens, log_prob must be the 1-D packed token stream [total_tokens], got shape "
                         f"{tuple(log_prob.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [num_sequences + 1], got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    ok = (cu[0] == 0) & (cu[-1] == log_prob.shape[0]) & (cu[1:] >= cu[:-1]).all()
    if cu.device.type == "cuda":
        torch._assert_async(ok, _CU_MSG)
    elif not bool(ok):
        raise ValueError(f"{_CU_MSG} ({log_prob.shape[0]}): got {cu.tolist()}")
    return cu


def check_mask_kind(name: str, mask) -> None:
    """A mask's kind alone (where nothing fixes its shape): a bool, integer or float tensor, else an error naming
    ``name``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype.is_complex:
        raise TypeError(f"{name} must be a bool, integer or float tensor, got {mask.dtype}")


def check_mask(name: str, mask, ref: torch.Tensor, ref_name: str = "log_prob") -> None:
    """A mask (or any per-token tensor) at the boundary: a bool, integer or float tensor of ``ref``'s shape and
    device, else an error naming ``name``."""
    check_mask_kind(name, mask)
    if tuple(mask.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(mask.shape)}")
    if mask.device != ref.device:
        raise ValueError(f"{name} is on {mask.device} but {ref_name} is on {ref.device}")


#: The block of :func:`ordered_sum`: ATen's CPU reductions split the reduced dimension over threads from its grain
#: size (32768 elements) on, so a full sum above it depends on the thread count; a block below it never is split.
ORDERED_SUM_BLOCK = 32768


def ordered_sum(x: torch.Tensor, nan: bool = False, dtype: Optional[torch.dtype] = None,
                buf: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sum (``nansum`` with ``nan``) of every element of ``x``, in an order that does not depend on the number of
    threads: fixed blocks of :data:`ORDERED_SUM_BLOCK` elements, each reduced by one thread (a reduction along the
    last dimension is split over its rows, never within one), then the block sums. ``x.sum()`` of a tensor past the
    block size is split across threads by the thread count, and its last bits move with it: a mean that should
    equal each of n equal values then differs from them by an ulp, and every covariance against it changes sign
    (clip_cov / kl_cov cut other tokens at another thread count; the thread-count fuzz). At most one block: exactly
    ``x.sum()`` (what verl's reductions give there). ``dtype``: accumulated (and returned) in that type; past one
    block the elements are converted 8 blocks at a time (2 MiB of fp64), then reduced natively: on the CPU about
    half the time of a reduction that converts as it reads. ``buf``: a contiguous 1-D tensor of ``dtype`` with at
    least ``8 * ORDERED_SUM_BLOCK`` elements that holds those conversions (the same values and order), so that no
    block is allocated per call: 2 MiB ones came from freshly mapped pages in the covariance losses' flow, at about
    twice the cost of the copy itself."""
    red = torch.nansum if nan else torch.sum
    flat = x.reshape(-1)
    n = flat.numel()
    if n <= ORDERED_SUM_BLOCK:
        return red(flat, dtype=dtype)
    r = n // ORDERED_SUM_BLOCK
    if dtype is None or dtype == flat.dtype:
        blocks = red(flat[:r * ORDERED_SUM_BLOCK].reshape(r, ORDERED_SUM_BLOCK), -1)
    else:
        step = 8 * ORDERED_SUM_BLOCK
        def converted(i, j):
            return flat[i:j].to(dtype) if buf is None else buf[:j - i].copy_(flat[i:j])

        blocks = torch.cat([red(converted(i, min(i + step, r * ORDERED_SUM_BLOCK)).view(-1, ORDERED_SUM_BLOCK), -1)
                            for i in range(0, r * ORDERED_SUM_BLOCK, step)])
    if n % ORDERED_SUM_BLOCK:
        blocks = torch.cat([blocks, red(flat[r * ORDERED_SUM_BLOCK:], dtype=dtype).reshape(1)])
    return red(blocks)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)``, each row summed by one thread in one order whatever the thread count. ATen splits a reduction
    over its rows when it has several, but a single row past one block (:data:`ORDERED_SUM_BLOCK`) over the threads
    (its last bits then move with their number); such a row is summed as one of two identical rows (an expanded
    view, no copy), which gives the bits it has in any batch of several rows. Rows not laid out row-major
    (a transposed or strided mask makes the masked values so) are summed in another order: they are made row-major
    first, so the same values give the same bits in any layout."""
    if x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2 and x.shape[0] == 1 and x.shape[1] > ORDERED_SUM_BLOCK:
        return x.expand(2, x.shape[1]).sum(-1)[:1]
    return x.sum(-1)


def assert_traced_number(value, ok: Callable[[torch.Tensor], torch.Tensor], msg: str) -> None:
    """A check of a Python-number argument while torch.compile traces: the number may be a symbol (``dynamic=True``,
    or a value that changed between calls: torch does not specialize floats), for which ``math.isfinite`` is a graph
    break and a comparison a guard sympy decides on its own terms (it takes symbols as finite). So the check is
    ``ok`` of a tensor of the value, an assert made at run time (a RuntimeError with ``msg``)."""
    torch._assert_async(ok(torch.scalar_tensor(value, dtype=torch.float64)), msg)


def check_finite_in(value, dtype: torch.dtype, msg: str) -> None:
    """A Python-number parameter the kernels use in ``dtype`` (the compute type) must be finite there (1e308 is inf
    in fp32): a ValueError ``msg`` with the value; traced by torch.compile, an assert made at run time
    (:func:`assert_traced_number`), since a host read of the traced number would break the graph."""
    if torch.compiler.is_compiling():
        assert_traced_number(value, lambda t: torch.isfinite(t.to(dtype)), msg)
    elif not math.isfinite(float(torch.tensor(float(value), dtype=torch.float64).to(dtype))):
        raise ValueError(f"{msg}, got {value!r}")


def check_weight_mask(name: str, mask: torch.Tensor) -> None:
    """A mask that weights each token's loss (verl multiplies it in), as the loss reads it (``mask`` already in the
    dtype the loss computes in: an fp64 1e300 is inf in fp32): NaN, inf or a negative weight defines no loss, so
    each is refused naming the position (:func:`refuse_where`; a bool mask has nothing to check, an integer one its
    sign). A NaN weight made the loss NaN in token-mean and dropped its row in the seq-mean modes, silently. One
    read of the mask (its min and max, NaN propagating); the position is looked for only when one is bad. (The
    policy-loss kernels make the same check on the values they read anyway, at no cost.)"""
    if mask.dtype == torch.bool or mask.numel() == 0 or mask.is_complex():
        return
    lo, hi = torch.aminmax(mask)
    refuse_unless((lo >= 0) & (hi < math.inf) if mask.is_floating_point() else lo >= 0,  # NaN fails both
                  lambda: ~(mask >= 0) | (mask == math.inf),
                  lambda at: f"{name} at {at} is {float(mask.detach()[at])}: a mask weights its token's loss and "
                             f"must be finite and >= 0",
                  f"{name}: a mask weight must be finite and >= 0")


def refuse_where(bad: torch.Tensor, describe: Callable[[Tuple[int, ...]], str], device_msg: str) -> None:
    """A value check at the boundary: on CPU a ValueError ``describe(index)`` naming the first index where ``bad``
    holds; on CUDA an asynchronous device assert with ``device_msg`` (no host sync). Traced by torch.compile, the
    assert on every device (a RuntimeError with ``device_msg`` on CPU): the host read would break the graph."""
    if bad.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            raise ValueError(describe(tuple(int(i) for i in bad.nonzero()[0])))
    else:
        torch._assert_async(~bad.any(), device_msg)


def refuse_unless(ok: torch.Tensor, bad: Callable[[], torch.Tensor], describe: Callable[[Tuple[int, ...]], str],
                  device_msg: str) -> None:
    """:func:`refuse_where` behind a cheap verdict: ``ok``, a 0-dim bool from a few reductions (no [B, T]
    temporaries), is read on CPU, and only when it fails is ``bad()`` built to name the first offending index; on
    CUDA, or traced, an asynchronous assert on ``ok`` (no host sync)."""
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            refuse_where(bad(), describe, device_msg)
    else:
        torch._assert_async(ok, device_msg)


def refuse_ambiguous_per_sequence(name: str, n_values: int, cu: torch.Tensor, num_tokens: int, fix: str) -> None:
    """A packed [N] value with as many sequences as tokens reads as one per sequence or one per token; the two agree
    only when every sequence is one token long and they cover the stream. Otherwise raise, naming ``name`` (a host
    read, only in this case)."""
    if n_values != cu.shape[0] - 1 or n_values != num_tokens:
        return
    if bool(((cu[1:] - cu[:-1]) == 1).all()) and int(cu[-1]) == num_tokens:
        return
    raise ValueError(f"{name} of shape [{n_values}] is ambiguous: {n_values} packed sequences (some empty) and as "
                     f"many tokens, so one per sequence and one per token are both possible and differ here; {fix}")


def _nonzero_divisor(den: torch.Tensor, like: torch.Tensor):
    """``(den != 0, den with 1 where it is 0)``, ``den`` in ``like``'s dtype and device: both selects of
    :func:`safe_div`, the divisor's too, so that the gradient at den == 0 is 0 / 1, not 0 / 0."""
    if den.dtype != like.dtype or den.device != like.device:
        den = den.to(dtype=like.dtype, device=like.device)
    nonzero = den != 0
    return nonzero, torch.where(nonzero, den, 1)


def safe_div(num: torch.Tensor, den) -> torch.Tensor:
    """num / den, and 0 where den == 0 (verl gives NaN there; see :func:`agg_loss`). Gradient-safe."""
    if not isinstance(den, torch.Tensor):
        # A Python number stays a scalar operand: no host-to-device copy (CUDA-graph capturable, no sync).
        return num / den if den != 0 else num * 0.0
    nonzero, den = _nonzero_divisor(den, num)
    return torch.where(nonzero, num / den, 0)


def safe_div_grad(grad: torch.Tensor, den) -> torch.Tensor:
    """The gradient in ``num`` of :func:`safe_div` ``(num, den)``, ``grad`` the output's, as autograd computes it."""
    if not isinstance(den, torch.Tensor):
        return grad / den if den != 0 else grad * 0.0
    nonzero, den = _nonzero_divisor(den, grad)
    return torch.where(nonzero, grad, 0) / den
