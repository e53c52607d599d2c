"""The fused linear log-probs' GEMM (``mm_f32_``) and 16-bit gradient accumulator (``hilo_add_``) in PyTorch: what
runs off the CPU kernels (CUDA, the fallback backend). On CUDA, torch's ``out_dtype`` matmul (cuBLAS writes the fp32
accumulators of 16-bit inputs without rounding them); elsewhere, the fp32 GEMM of the inputs widened exactly to
fp32."""

from __future__ import annotations

from typing import Optional

import torch

#: torch's matmul with an fp32 output for 16-bit inputs (``aten::mm.dtype``: CUDA kernels since torch 2.8)
_HAS_OUT_DTYPE_MM = hasattr(torch.ops.aten.mm, "dtype")


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cuda" and _HAS_OUT_DTYPE_MM:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.to(torch.float32), b.to(torch.float32))  # the exact products, accumulated in fp32


def mm_f32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    """``out`` (fp32) = ``a @ b + beta * out`` for bf16 / fp16 ``a`` and ``b``, never rounded to 16 bits."""
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 2:
        raise RuntimeError(f"mm_f32_: a, b and out must be 2-D, got {tuple(a.shape)}, {tuple(b.shape)}, "
                           f"{tuple(out.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16) or out.dtype != torch.float32:
        raise RuntimeError(f"mm_f32_: a and b must both be bfloat16 or both float16 and out float32, got {a.dtype}, "
                           f"{b.dtype}, {out.dtype}")
    prod = _product(a, b)
    if beta == 0.0:
        out.copy_(prod)
    else:
        out.mul_(beta).add_(prod)


def hilo_add_(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor, index: Optional[torch.Tensor]) -> None:
    """``(hi, lo) += x`` (rows ``index`` of hi and lo, or all): ``s = (hi + lo) + x`` in fp32, ``hi`` = s rounded to
    its 16-bit dtype, ``lo = bf16(s - hi)`` (0 where hi overflows). The CPU kernel's values, bit for bit (one fp32
    temporary of x's shape here)."""
    if hi.dim() != 2 or lo.shape != hi.shape or x.dim() != 2 or x.shape[1] != hi.shape[1]:
        raise RuntimeError(f"hilo_add_: hi, lo [N, C] and x [R, C] must be 2-D with the same columns, got "
                           f"{tuple(hi.shape)}, {tuple(lo.shape)}, {tuple(x.shape)}")
    if hi.dtype not in (torch.bfloat16, torch.float16) or lo.dtype != torch.bfloat16 or \
            x.dtype not in (hi.dtype, torch.float32):
        raise RuntimeError(f"hilo_add_: hi must be bfloat16 or float16, lo bfloat16 and x hi's dtype or float32, got "
                           f"{hi.dtype}, {lo.dtype}, {x.dtype}")
    if index is None and x.shape[0] != hi.shape[0]:
        raise RuntimeError(f"hilo_add_: x must have hi's {hi.shape[0]} rows, got {x.shape[0]}")
    h = hi if index is None else hi.index_select(0, index)
    s = h.to(torch.float32)
    s += lo if index is None else lo.index_select(0, index)  # exact: at most 20 significant bits
    s += x
    h.copy_(s)
    s -= h  # exact (Sterbenz); +-inf - +-inf is NaN where hi overflowed: lo is 0 there
    s.masked_fill_(~torch.isfinite(h), 0.0)
    if index is None:
        lo.copy_(s)
    else:
        hi.index_copy_(0, index, h)
        lo.index_copy_(0, index, s.to(torch.bfloat16))
