"""Split-K tensor-core projection for 2..8 rows of a narrow layer (decode at batch 2-8).

At 2-8 rows a projection is still a read of the weight, but the rows make the CUDA-core GEMV
arithmetic-bound (BENCHMARKS.md: 2.3-4x slower than cuBLAS at 8 rows) and the padded dots of
triton_linear leave SMs idle on narrow layers (3072 / 16 columns = 192 programs, each streaming a
whole row of K). Here each program takes BLOCK_N columns and one of SPLIT slices of K, the rows
padded to 16 for tensor-core dots; the slices' float32 partials go to a scratch, and the program
that takes a column block's last ticket (an acq_rel counter, as the attention's merge) sums them
in slice order (the same result whichever program is last), adds the bias and stores. One
launch; the counters are left at 0 for the next call, so CUDA-graph replays need no memset.

On by default (`ATOM_COMPILE_SPLIT_K=0`, or `triton_linear.SPLIT_K_ROWS = False`, turns it off):
each shape is timed against the library GEMM as well, with the weight read past L2 as a decode
step reads it (ops/tuning.py), and the library keeps the shapes it reads faster by more than
its price outside our kernels' PDL chain (triton_linear.LIBRARY_CHAIN_US).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_then_release
from .triton_rowwise import ACTIVATIONS, activation
from .triton_launch import FastLaunch, cdiv

ROWS = 16  # tl.dot takes at least 16 rows: 2..8 real rows, padded
# (BLOCK_N, BLOCK_K, SPLIT, num_warps); SPLIT is at most this many slices of K
CONFIGS = [(16, 256, 4, 4), (16, 256, 1, 4), (16, 256, 2, 4), (16, 128, 4, 4), (16, 256, 8, 4), (16, 128, 8, 4),
           (32, 256, 2, 4), (32, 256, 4, 4), (32, 128, 8, 4), (16, 512, 4, 4),
           # wide column blocks for wide layers (an MLP's gate/up: thousands of columns already)
           (64, 128, 1, 4), (64, 256, 1, 8), (128, 128, 1, 8), (64, 128, 2, 4)]
_tickets: dict = {}
_retired: list = []  # counters a larger request replaced: a recorded graph may still use them


@triton.jit
def _split_k_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, tickets_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
    u_ptr, stride_un,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, ACT: tl.constexpr,
):
    # ACT >= 0 (one slice, no bias): a gated MLP's y = act(x @ w.T) * (x @ u.T), act the
    # activation of that index (ops/triton_rowwise.py), w the gate weight and u the up weight:
    # each program reads the same BLOCK_N rows of both, so the SiLU-and-mul needs no kernel
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_first = pid_k * k_per_split
    k_end = tl.minimum(k_first + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_first + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_first + offs_k)[None, :]
    if PREFETCH:  # the weight only (ops/pdl.py prefetch): read while the kernel before runs
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & ((k_first + offs_k) < k_end)[None, :], other=0.0)
    if PDL:
        wait_then_release()
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    if ACT >= 0:
        u_ptrs = u_ptr + offs_n.to(tl.int64)[:, None] * stride_un + (k_first + offs_k)[None, :]
        acc_u = tl.zeros([16, BLOCK_N], tl.float32)
    for k in range(k_first, k_end, BLOCK_K):
        k_mask = (k + offs_k) < k_end
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if PREFETCH:
            w = w_next
            w_next = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & ((k + BLOCK_K + offs_k) < k_end)[None, :],
                             other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        if ACT >= 0:
            u = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_u += tl.dot(x, tl.trans(u))
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if ACT >= 0:  # rounded where the model's ops round: each projection, act(gate), the product
        dtype = y_ptr.dtype.element_ty
        act = activation(acc.to(dtype).to(tl.float32), ACT).to(dtype).to(tl.float32)
        tl.store(y_ptrs, (act * acc_u.to(dtype).to(tl.float32)).to(dtype), mask=y_mask)
    elif SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        # this slice's partial, then a ticket: every thread's stores come before the release
        tile = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + (pid_n * SPLIT + pid_k) * 16 * BLOCK_N + tile, acc, mask=m_mask[:, None])
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last slice of this column block sums them all, in slice order
            tl.store(tickets_ptr + pid_n, 0)
            total = tl.zeros([16, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT):  # .cg: from L2, where the other programs' stores went
                total += tl.load(part_ptr + (pid_n * SPLIT + s) * 16 * BLOCK_N + tile, mask=m_mask[:, None],
                                 other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


_launch_fn = FastLaunch(_split_k_kernel, twins=pdl.prefetch_twins("linear"))


def slices(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(K per slice, a multiple of BLOCK_K; the number of slices) for at most `split` slices."""
    per = cdiv(cdiv(k, split), block_k) * block_k
    return per, cdiv(k, per)


def counters(blocks: int, device: torch.device) -> Optional[torch.Tensor]:
    """The int32 ticket counters on `device` (at least `blocks`), zeroed when made; None inside
    a capture when there are none large enough (a zeroing would be recorded, not run: the
    caller then takes one slice, which needs none). Each call leaves them at 0; calls share
    them in stream order (with PDL, a launch touches them only after its wait)."""
    current = _tickets.get(device)
    if current is None or current.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if current is not None:
            _retired.append(current)
        current = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _tickets[device] = current
    return current


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
           config: tuple[int, int, int, int]) -> None:
    """out = x @ weight.T + bias for 2..16 rows, in one launch of `config`."""
    block_n, block_k, split, warps = config
    m, k = x.shape
    n = weight.shape[0]
    per, split = slices(k, block_k, split)
    blocks = cdiv(n, block_n)
    tickets = counters(blocks, x.device) if split > 1 else None
    if split > 1 and tickets is None:
        per, split = slices(k, block_k, 1)
    part = torch.empty(blocks * split * ROWS * block_n if split > 1 else 1, dtype=torch.float32, device=x.device)
    early = pdl.enabled(x.device)
    _launch_fn(
        (blocks, split, 1),
        (x, weight, bias if bias is not None else weight, out, part, tickets if tickets is not None else part,
         m, n, k, x.stride(0), weight.stride(0), out.stride(0), per, weight, weight.stride(0)),
        {"HAS_BIAS": bias is not None, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": split, "PDL": early,
         "PREFETCH": pdl.prefetch(early, "linear"), "ACT": -1},
        num_warps=warps,
    )


def glu_config(config: tuple[int, int, int, int]) -> Optional[tuple[int, int, int, int]]:
    """The gated form of a one-slice shape `config` chose for the gate and up projections'
    outputs: half its columns from each weight, so a program has as many weight rows in flight
    and the layer as many programs; None where there is no such form (several slices, or a
    half narrower than a dot's 16 columns)."""
    block_n, block_k, split, warps = config
    if split != 1 or block_n // 2 < 16:
        return None
    return block_n // 2, block_k, 1, warps


def launch_glu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, out: torch.Tensor, act: str,
               config: tuple[int, int, int, int]) -> None:
    """out = act(x @ gate_weight.T) * (x @ up_weight.T) for 2..16 rows, in one launch of a
    one-slice `config` (glu_config); act one of ACTIVATIONS."""
    block_n, block_k, split, warps = config
    if split != 1:
        raise ValueError(f"the gated split-K form takes one slice, not config {config}")
    m, k = x.shape
    n = gate_weight.shape[0]
    early = pdl.enabled(x.device)
    _launch_fn(
        (cdiv(n, block_n), 1, 1),
        (x, gate_weight, gate_weight, out, out, out, m, n, k, x.stride(0), gate_weight.stride(0), out.stride(0), k,
         up_weight, up_weight.stride(0)),
        {"HAS_BIAS": False, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": 1, "PDL": early,
         "PREFETCH": pdl.prefetch(early, "linear"), "ACT": ACTIVATIONS.index(act)},
        num_warps=warps,
    )
