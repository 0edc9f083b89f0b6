"""Triton row-wise kernels (RMSNorm after a residual add; SiLU- or GELU-and-mul) for the rows
the fused GEMVs do not take.

The ops of ops/prologue_linear.py put these into the GEMV's prologue at one row; at more rows
they run these kernels (one launch each, as Inductor's fused kernels would be) and then the
projection. They round where the model's own code does: the sum to x's dtype, the normalised
row to x's dtype before the weight, the product to x's dtype; silu(gate) to its dtype, then
the product with up.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .glu_linear import ACTIVATIONS  # a kernel's ACT: an index into these
from .pdl import wait_then_release
from .triton_launch import FastLaunch, cdiv, next_power_of_2

MAX_K = 16384  # a whole row per program: wider rows take the PyTorch path


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, y_ptr, K, stride_xm, stride_rm, eps,
                         ADD: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early (ops/pdl.py): read nothing before the kernel before has finished
        wait_then_release()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * stride_rm + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * K + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * K + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


_norm_launch = FastLaunch(_add_rms_norm_kernel)


def supported(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor) -> bool:
    """2-D CUDA rows of at most MAX_K, unit inner strides, norm weight (and residual) alike."""
    ok = (x.dim() == 2 and x.is_cuda and 0 < x.shape[1] <= MAX_K and x.stride(1) == 1
          and norm_weight.shape == (x.shape[1],) and norm_weight.stride(0) == 1 and norm_weight.dtype == x.dtype)
    return ok and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1
                                        and residual.dtype == x.dtype))


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(rms_norm(x [+ residual]) * norm_weight, the sum or None) for rows `supported` accepts."""
    m, k = x.shape
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    h = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0:
        return y, h
    r = residual if residual is not None else x
    _norm_launch((m, 1, 1), (x, r, h if h is not None else y, norm_weight, y, k, x.stride(0), r.stride(0), float(eps)),
                 {"ADD": residual is not None, "BLOCK_K": next_power_of_2(k), "PDL": pdl.enabled(x.device)},
                 num_warps=4 if k <= 4096 else 8)
    return y, h




@triton.jit
def activation(g, ACT: tl.constexpr):
    """SiLU (ACT 0) or GELU's tanh form (ACT 1) of float32 `g`."""
    if ACT == 0:
        out = g / (1.0 + tl.exp(-g))
    else:  # tanh(y) as 1 - 2 / (1 + e^2y): exact at both ends, where e^2y is 0 or inf
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        out = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
    return out


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, y_ptr, K, stride_gm, stride_um, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:
        wait_then_release()
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = col < K
    g = tl.load(g_ptr + row * stride_gm + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_um + col, mask=mask, other=0.0).to(tl.float32)
    act = activation(g, ACT).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * K + col, (act * u).to(y_ptr.dtype.element_ty), mask=mask)


_act_launch = FastLaunch(_act_mul_kernel)


def silu_mul_supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """2-D CUDA rows of one shape and dtype, unit inner strides."""
    return (gate.dim() == 2 and gate.is_cuda and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.stride(1) == 1 and up.stride(1) == 1)


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up (an activation of ACTIVATIONS) for rows `silu_mul_supported` accepts,
    contiguous; act(gate) rounded to gate's dtype before the product, as the models round."""
    m, k = gate.shape
    y = torch.empty((m, k), dtype=gate.dtype, device=gate.device)
    if m and k:
        block = min(1024, next_power_of_2(k))
        _act_launch((m, cdiv(k, block), 1), (gate, up, y, k, gate.stride(0), up.stride(0)),
                    {"BLOCK_K": block, "ACT": ACTIVATIONS.index(act), "PDL": pdl.enabled(gate.device)}, num_warps=4)
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows `silu_mul_supported` accepts, contiguous."""
    return act_mul(gate, up, "silu")
