"""The fused linear log-probs' GEMM (``mm_f32_``) in PyTorch: what runs off the CPU kernel (CUDA, the fallback
backend). On CUDA, torch's ``out_dtype`` matmul (cuBLAS writes the fp32 accumulators of 16-bit inputs without
rounding them); elsewhere, the fp32 GEMM of the inputs widened exactly to fp32."""

from __future__ import annotations

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
