"""Triton GEMV for a gated MLP's gate and up projections with act(gate) * up as its epilogue
(one row; act is SiLU or GELU's tanh form: SwiGLU, GeGLU), and the dispatch of 2..8 rows to the
split-K dots' gated form (ops/triton_splitk.py).

At one token a gated MLP is GEMV (gate_up), activation-and-mul, GEMV (down): the activation is
a kernel of its own, a launch and a trip of both halves through memory. Here each program reads
BLOCK_N rows of the gate weight and the same rows of the up weight along K, keeps two float32
accumulators and writes act(gate) * up: the row reads the same weight bytes as the plain GEMV,
with the same rows in flight per program, and the activation costs nothing. The prologue form
(ops/prologue_linear.py) recomputes the activation in every program of the down projection.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl, triton_linear, triton_splitk
from .glu_linear import merged_weight
from .pdl import wait_then_release
from .triton_rowwise import ACTIVATIONS, activation
from .triton_launch import FastLaunch, cdiv
from .triton_gemv_forms import check_slot
from .triton_linear import gemv_config, rsqrt_of_lanes, slot_lanes

# Up to this many rows (2..MAX_M; 0: none) take the split-K dots with act(gate) * up as their
# epilogue, where the split-K path takes the projections in one slice; more take the projections,
# then the activation's own kernel. On an H100 the gated form made the FULL decode step 1.1%
# faster at batch 2 and 1.6% slower at batch 8 (benchmarks/decode_ab.py -splitglu / -nosplitglu)
SPLIT_K_GLU_ROWS = 2


@triton.jit
def two_row_blocks(x_ptr, a_ptrs, b_ptrs, mask, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    # the row x against two blocks of BLOCK weight rows (pointers at column 0, unit column
    # stride), along K; float32 sums (the RoPE GEMV's column pairs share it)
    offs_k = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([BLOCK], tl.float32)
    acc_b = tl.zeros([BLOCK], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        both = mask[:, None] & k_mask[None, :]
        acc_a += tl.sum(tl.load(a_ptrs, mask=both, other=0.0).to(tl.float32) * x, axis=1)
        acc_b += tl.sum(tl.load(b_ptrs, mask=both, other=0.0).to(tl.float32) * x, axis=1)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc_a, acc_b


@triton.jit
def _gate_up_glu_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, N, K, stride_gn, stride_un, ss_ptr, eps,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
                        SS_SCALE: tl.constexpr):
    # SS_SCALE: x is a split RMSNorm's g = h * w (ops/split_norm.py); both dots are scaled by
    # 1 / rms from the slot's sum of h squared
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    g_ptrs = wg_ptr + rows * stride_gn + offs_k[None, :]
    u_ptrs = wu_ptr + rows * stride_un + offs_k[None, :]
    if PDL:  # launched early (ops/pdl.py): read nothing before the kernel before has finished
        wait_then_release()
    if SS_SCALE:
        lanes = slot_lanes(ss_ptr)
    acc_g, acc_u = two_row_blocks(x_ptr, g_ptrs, u_ptrs, n_mask, K, BLOCK_N, BLOCK_K)
    if SS_SCALE:
        rstd = rsqrt_of_lanes(lanes, K, eps)
        acc_g *= rstd
        acc_u *= rstd
    # rounded where the model's ops round: each projection's output, act(gate), the product
    dtype = y_ptr.dtype.element_ty
    act = activation(acc_g.to(dtype).to(tl.float32), ACT).to(dtype).to(tl.float32)
    tl.store(y_ptr + offs_n, (act * acc_u.to(dtype).to(tl.float32)).to(dtype), mask=n_mask)


_launch = FastLaunch(_gate_up_glu_kernel)


def glu_config(k: int) -> tuple[int, int, int]:
    """The one-row GEMV's shape (triton_linear.gemv_config) with half its rows from each weight:
    a program has as many weight rows in flight as the plain GEMV's, and the gate_up layer as
    many programs as it had there."""
    block_n, block_k, warps = gemv_config(k)
    return max(1, block_n // 2), block_k, warps


def supported(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> bool:
    """One contiguous half-precision CUDA row; two row-major weights of its dtype and width, alike."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and x.stride(1) == 1 and all(w.dim() == 2 and w.dtype == x.dtype and w.shape[1] == x.shape[1]
                                         and w.stride(1) == 1 and w.device == x.device for w in (gate_weight, up_weight))
            and gate_weight.shape == up_weight.shape)


def gate_up_glu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, act: str,
                config: tuple[int, int, int] | None = None,
                scale: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
    """act(x @ gate_weight.T) * (x @ up_weight.T) for a row `supported` accepts and an
    activation `act` of ACTIVATIONS, in one launch. `scale`: (eps, slot) where x is a split
    RMSNorm's g (triton_gemv_forms.scaled_linear's contract: both dots scaled by 1 / rms)."""
    n, k = gate_weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or glu_config(k)
    eps, slot = scale if scale is not None else (0.0, out)
    if scale is not None:
        check_slot(slot, x, "gate_up_glu")
    _launch((cdiv(n, block_n), 1, 1),
            (x, gate_weight, up_weight, out, n, k, gate_weight.stride(0), up_weight.stride(0), slot, float(eps)),
            {"BLOCK_N": block_n, "BLOCK_K": block_k, "ACT": ACTIVATIONS.index(act), "PDL": pdl.enabled(x.device),
             "SS_SCALE": scale is not None},
            num_warps=warps)
    return out


def rows_config(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> Optional[tuple]:
    """The gated split-K shape for 2..SPLIT_K_GLU_ROWS rows: the shape the split-K path chose
    for these projections (for the merged weight where the two are one block, as the unfused
    path reads them), halved (triton_splitk.glu_config); None where that path does not take
    them or chose the library GEMM or several slices, or x has more rows."""
    if not 2 <= x.shape[0] <= SPLIT_K_GLU_ROWS or gate_weight.shape != up_weight.shape:
        return None
    weight = merged_weight(gate_weight, up_weight)
    weight = gate_weight if weight is None else weight
    # the merged block is a view of the two: what holds for them holds for it
    if not all(triton_linear.supported(x, w, None) for w in (gate_weight, up_weight)) \
            or not triton_linear.takes_split_k(x, weight):
        return None
    config = triton_linear.split_k_choice(x, weight, None)
    return None if config == triton_linear.LIBRARY else triton_splitk.glu_config(config)


def gate_up_glu_rows(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, act: str,
                     config: tuple) -> torch.Tensor:
    """act(x @ gate_weight.T) * (x @ up_weight.T) for 2..MAX_M rows, in one launch of a
    `rows_config` shape."""
    out = torch.empty((x.shape[0], gate_weight.shape[0]), dtype=x.dtype, device=x.device)
    triton_splitk.launch_glu(x, gate_weight, up_weight, out, act, config)
    return out
