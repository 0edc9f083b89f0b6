"""Triton kernels for the qkv projection with rotary embeddings (RoPE, neox style) applied to its
query and key columns.

At one token, attention's input is GEMV (qkv), then RoPE on q and k (Inductor's kernels, two a
layer in our profiles). Here the GEMV's programs each compute BLOCK_P pairs of output columns
(d, d + head_dim / 2) of one head, so that the rotation of a pair is the GEMV's epilogue: the
same weight bytes and rows in flight as the plain GEMV, and no RoPE kernel. More rows take the
projection as it was and one row-wise rotation kernel in place (`rope_rows`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_then_release
from .triton_glu import two_row_blocks
from .triton_launch import FastLaunch, cdiv, next_power_of_2
from .triton_linear import gemv_config


@triton.jit
def _pair_rows(pairs, HALF: tl.constexpr):
    # pair i of a [*, heads * 2 * HALF] row: columns (h * 2 HALF + j, h * 2 HALF + j + HALF)
    first = (pairs // HALF) * (2 * HALF) + pairs % HALF
    return first, first + HALF


@triton.jit
def _rotated(a, b, cos_ptr, sin_ptr, first, pairs, mask, rotated, HALF: tl.constexpr):
    # (a, b) rounded to the output's dtype, rotated where the pair's column is below `rotated`,
    # in float32 (the models' RoPE computes on the float of the rounded projection)
    rot = mask & (first < rotated)
    c = tl.load(cos_ptr + pairs % HALF, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pairs % HALF, mask=rot, other=0.0).to(tl.float32)
    return a * c - b * s, b * c + a * s


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, y_ptr, PAIRS, K, stride_wn, rotated,
                     HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = pairs < PAIRS
    first, second = _pair_rows(pairs, HALF)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = w_ptr + first.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    b_ptrs = w_ptr + second.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if PDL:  # launched early (ops/pdl.py): read nothing before the kernel before has finished
        wait_then_release()
    acc_a, acc_b = two_row_blocks(x_ptr, a_ptrs, b_ptrs, mask, K, BLOCK_P, BLOCK_K)
    if HAS_BIAS:  # added before the projection's rounding, as F.linear adds it (Qwen2's qkv)
        acc_a += tl.load(b_ptr + first, mask=mask, other=0.0).to(tl.float32)
        acc_b += tl.load(b_ptr + second, mask=mask, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    a, b = _rotated(acc_a.to(dtype).to(tl.float32), acc_b.to(dtype).to(tl.float32), cos_ptr, sin_ptr,
                    first, pairs, mask, rotated, HALF)
    tl.store(y_ptr + first, a.to(dtype), mask=mask)
    tl.store(y_ptr + second, b.to(dtype), mask=mask)


@triton.jit
def _rope_rows_kernel(y_ptr, cos_ptr, sin_ptr, stride_ym, stride_cm, stride_sm, PAIRS,
                      HALF: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = pairs < PAIRS
    first, second = _pair_rows(pairs, HALF)
    y = y_ptr + row * stride_ym
    if PDL:
        wait_then_release()
    a = tl.load(y + first, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y + second, mask=mask, other=0.0).to(tl.float32)
    a, b = _rotated(a, b, cos_ptr + row * stride_cm, sin_ptr + row * stride_sm, first, pairs, mask,
                    PAIRS * 2, HALF)
    tl.store(y + first, a.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y + second, b.to(y_ptr.dtype.element_ty), mask=mask)


_gemv = FastLaunch(_qkv_rope_kernel)
_rows = FastLaunch(_rope_rows_kernel)


def rope_config(k: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_K, num_warps): the one-row GEMV's shape (triton_linear.gemv_config) with
    its BLOCK_N rows as BLOCK_N / 2 pairs, so a program has as many weight rows in flight."""
    block_n, block_k, warps = gemv_config(k)
    return max(1, block_n // 2), block_k, warps


def supported(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor,
              sin: torch.Tensor, head_dim: int) -> bool:
    """One contiguous half-precision CUDA row, a row-major weight of its dtype whose rows are
    whole heads (and a contiguous bias of them), one row of cos and of sin with head_dim / 2
    contiguous values."""
    half = head_dim // 2
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1 or bias.dtype != x.dtype
                             or bias.device != x.device):
        return False
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and x.stride(1) == 1 and weight.dim() == 2 and weight.dtype == x.dtype and weight.shape[1] == x.shape[1]
            and weight.stride(1) == 1 and weight.device == x.device and head_dim % 2 == 0
            and weight.shape[0] % head_dim == 0
            and all(t.dim() == 2 and t.shape == (1, half) and t.stride(1) == 1 and t.device == x.device
                    and t.dtype.is_floating_point for t in (cos, sin)))


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor,
             sin: torch.Tensor, rotated: int, head_dim: int, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with the pairs of its first `rotated` columns rotated (neox RoPE per head of
    head_dim) by cos and sin, for a row `supported` accepts, in one launch."""
    n, k = weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_p, block_k, warps = config or rope_config(k)
    pairs = n // 2
    _gemv((cdiv(pairs, block_p), 1, 1),
          (x, weight, weight if bias is None else bias, cos, sin, out, pairs, k, weight.stride(0), rotated),
          {"HAS_BIAS": bias is not None, "HALF": head_dim // 2, "BLOCK_P": block_p, "BLOCK_K": block_k, "PDL": pdl.enabled(x.device)},
          num_warps=warps)
    return out


def rows_supported(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, head_dim: int) -> bool:
    """CUDA rows of whole heads with contiguous columns, and a [rows, head_dim / 2] cos and sin."""
    half = head_dim // 2
    return (y.dim() == 2 and y.is_cuda and y.stride(1) == 1 and head_dim % 2 == 0 and rotated % head_dim == 0
            and 0 < rotated <= y.shape[1]
            and all(t.dim() == 2 and t.shape == (y.shape[0], half) and t.stride(1) == 1 and t.device == y.device
                    and t.dtype.is_floating_point for t in (cos, sin)))


def rope_rows(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, head_dim: int) -> torch.Tensor:
    """Rotate, in place, the pairs of `y`'s first `rotated` columns of each row by that row's cos
    and sin (one launch); returns y."""
    if y.shape[0] == 0:
        return y
    pairs = rotated // 2
    block_p = min(256, next_power_of_2(pairs))
    _rows((cdiv(pairs, block_p), y.shape[0], 1),
          (y, cos, sin, y.stride(0), cos.stride(0), sin.stride(0), pairs),
          {"HALF": head_dim // 2, "BLOCK_P": block_p, "PDL": pdl.enabled(y.device)}, num_warps=4)
    return y
