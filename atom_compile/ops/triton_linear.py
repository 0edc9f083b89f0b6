"""Triton linear layer for the few-token calls of decode (y = x @ w.T + b with M <= 8 rows).

At M <= 8 a linear layer is a matrix-vector product: the time is reading the weight once, and
cuBLAS's GEMM tiles (M padded to 64 or 128, few column tiles) leave most of the bandwidth unused.
Each program here computes a narrow strip of BLOCK_N output columns for every row, streaming its
BLOCK_N weight rows along K once; the strips are narrow so that even N = 2048 gives hundreds of
programs. The block shape is tuned once per (M, N, K, dtype) outside CUDA-graph capture; a
shape first seen during capture runs the default shape (a capture cannot time anything).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # an older layout: no config is skipped for its size
    OutOfResources = ()  # type: ignore[assignment,misc]

from .. import envs
from . import pdl, triton_splitk, tuning
from .pdl import wait_then_release
from .triton_launch import FastLaunch, cdiv, next_power_of_2

logger = logging.getLogger("atom_compile")

MAX_M = 8
# (BLOCK_N, BLOCK_K, num_warps); the first is the default for shapes never tuned
CONFIGS = [(16, 256, 4), (4, 512, 4), (8, 512, 4), (8, 256, 4), (16, 128, 4), (4, 256, 2), (32, 128, 4),
           (32, 256, 8), (64, 128, 4),
           # one-shot strips: a whole row of K (or half) per loop step, every load in flight at once
           (4, 2048, 4), (2, 2048, 2), (8, 1024, 4), (2, 4096, 4), (1, 8192, 4), (8, 2048, 8), (2, 8192, 8),
           (16, 1024, 4), (16, 2048, 8)]
_tuned: dict[tuple, tuple[int, int, int]] = {}


@triton.jit
def _with_second_operand(x, r_ptr, h_ptr, r_offs, h_offs, mask, writes_h, ADD: tl.constexpr, SILU_MUL: tl.constexpr):
    # SILU_MUL: silu(x) * r; ADD: x + r, written to h by the program that `writes_h`; each
    # rounded to x's dtype where the model's separate ops round
    r = tl.load(r_ptr + r_offs, mask=mask, other=0.0)
    if SILU_MUL:
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype)
        x = (act.to(tl.float32) * r.to(tl.float32)).to(x.dtype)
    if ADD:  # h is contiguous: row stride K
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if writes_h:
            tl.store(h_ptr + h_offs, x, mask=mask)
    return x


@triton.jit
def _accumulate(acc, x, w, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    # one return at the end: Triton 3.6 compiles the statements after a return inside a
    # constexpr branch too (a dot-path call then fails on the GEMV line's shapes)
    if USE_DOT:
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    else:
        acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
    return acc


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    r_ptr, h_ptr, nw_ptr, stride_rm, eps, ss_ptr, clr_ptr, er_ptr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
    SILU_MUL: tl.constexpr, PREFETCH: tl.constexpr, EPI_SS: tl.constexpr, SS_SCALE: tl.constexpr,
):
    # One token (BLOCK_M 1): a plain GEMV, weight row by x, reduced along K in float32.
    # More tokens: tensor-core dots with the rows padded to BLOCK_M = 16 (reading the weight
    # once is the cost either way; the padding is free arithmetic).
    # NORM (GEMV only): x is RMS-normalised on the way in, y = rms_norm(x) * nw @ w.T. The
    # program streams all of x along K anyway, so the sum of squares comes with it and the row's
    # 1 / rms scales the dot at the end: no norm kernel before, no normalised row in memory.
    # ADD: x + r first (rounded to x's dtype, as the separate add would be), program 0 writing
    # the sum to h (the residual stream the model reads next).
    # SILU_MUL (GEMV only): x is silu(x) * r, rounded as the model's two ops round (x the gate,
    # r the up projection: an MLP's activation in the down projection's prologue).
    # EPI_SS (GEMV only, not with NORM): an RMSNorm after the projection, split with the next
    # projection (ops/split_norm.py): this one writes h = y + er, g = h * nw (y_ptr), adds the
    # sum of h squared into the slot at ss_ptr and zeroes the one at clr_ptr. SS_SCALE (GEMV
    # only): x is such a g, the dot scaled by 1 / rms from the slot's sum over K.
    # PREFETCH (with PDL): the weight's first tile is read before the wait, while the kernel
    # before still runs, and each step reads the next; only for a weight that kernel does not
    # write (a model's parameter inside a CUDA graph: ops decide it in launch_gemv).
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if PREFETCH:
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL:  # launched early (ops/pdl.py): read nothing else before the kernel before has finished
        wait_then_release()
    if SS_SCALE:
        lanes = slot_lanes(ss_ptr)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if PREFETCH:  # the last step's read is masked off entirely: no memory traffic
            w = w_next
            w_next = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & ((k + BLOCK_K + offs_k) < K)[None, :],
                             other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if ADD or SILU_MUL:
            x = _with_second_operand(x, r_ptr, h_ptr, offs_m[:, None] * stride_rm + k + offs_k[None, :],
                                     offs_m[:, None] * K + k + offs_k[None, :], m_mask[:, None] & k_mask[None, :],
                                     pid == 0, ADD, SILU_MUL)
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = xf * tl.load(nw_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc = _accumulate(acc, x, w, USE_DOT, IEEE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if NORM:
        acc *= tl.rsqrt(squares / K + eps)[:, None]
    if SS_SCALE:
        acc *= rsqrt_of_lanes(lanes, K, eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if EPI_SS:
        _add_weigh_and_square(acc, pid, offs_n, n_mask, er_ptr, h_ptr, nw_ptr, y_ptr, ss_ptr, clr_ptr)
    else:
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# a split norm's slot (ops/split_norm.py): SS_LANES float32 sums, SS_STRIDE apart (one 128-byte
# line each), so that a GEMV's programs add into eight addresses, not one
SS_LANES = tl.constexpr(8)
SS_STRIDE = tl.constexpr(32)
SLOT_FLOATS = SS_LANES.value * SS_STRIDE.value


@triton.jit
def slot_lanes(ss_ptr):
    # read right after the wait (the producer's atomics landed when it finished; L1 may hold an
    # older line), summed at the end (rsqrt_of_lanes): a sum here would hold every thread at a
    # barrier until the load returned, before the program's first weight load
    return tl.load(ss_ptr + tl.arange(0, SS_LANES) * SS_STRIDE, cache_modifier=".cg")


@triton.jit
def rsqrt_of_lanes(lanes, K, eps):
    return tl.rsqrt(tl.sum(lanes, axis=0) / K + eps)


@triton.jit
def _add_weigh_and_square(acc, pid, offs_n, n_mask, r_ptr, h_ptr, nw_ptr, g_ptr, ss_ptr, clr_ptr):
    # the producer's half of a split RMSNorm (one row): h = y + r and g = h * nw, each rounded
    # to the row's dtype, and the strip's sum of h squared added into one of the slot's lanes
    # (nothing waits on the add: the consumer reads the sum once this kernel has finished).
    # Program 0 zeroes the next pair's slot, whose last consumer has finished and whose producer
    # comes after this kernel: no consumer needs to count its programs to empty its own.
    dtype = g_ptr.dtype.element_ty
    y = tl.sum(acc, axis=0).to(dtype)
    r = tl.load(r_ptr + offs_n, mask=n_mask, other=0.0)
    h = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(h_ptr + offs_n, h, mask=n_mask)
    hf = h.to(tl.float32)
    nw = tl.load(nw_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(g_ptr + offs_n, (hf * nw).to(dtype), mask=n_mask)
    tl.atomic_add(ss_ptr + (pid % SS_LANES) * SS_STRIDE, tl.sum(hf * hf, axis=0), sem="relaxed", scope="gpu")
    if pid == 0:
        tl.store(clr_ptr + tl.arange(0, SS_LANES) * SS_STRIDE, tl.zeros([SS_LANES], tl.float32))


# with PDL and ATOM_COMPILE_PREFETCH=1, the prefetching twin of each specialisation is compiled
# beside it (outside the capture that will launch it: nothing compiles while a graph records)
_linear_launch = FastLaunch(_small_m_linear_kernel, twins=pdl.prefetch_twins("linear"))


def _block_m(m: int) -> int:
    return 1 if m == 1 else 16  # tl.dot takes at least 16 rows


def _fits(config: tuple[int, int, int], block_m: int) -> bool:
    # the GEMV holds a BLOCK_N x BLOCK_K float32 tile; the dot path needs BLOCK_N >= 16, and its
    # one-shot strips (BLOCK_K > 256) are not timed: at 8 rows of the LM head the five fastest
    # shapes all had BLOCK_K <= 256 (H100, small_m_linear.py --m 8 --sweep), and each candidate
    # costs a capture's warm-up a compile (and its prefetching twin's, where that is on)
    block_n, block_k, warps = config
    if block_m > 1:
        return block_n >= 16 and block_k <= 256
    return block_n * block_k <= 64 * 32 * warps


def launch_gemv(x, weight, bias, out, config, norm=None, up=None, epilogue=None, scale=None) -> None:
    """`norm`: None, or (norm weight, eps, residual or None, h or None) for the NORM prologue;
    `up`: None, or the up projection for the SILU_MUL prologue (x the gate); `epilogue`: None,
    or (norm weight, residual, h, slot, slot to clear) for the EPI_SS epilogue (out receives g);
    `scale`: None, or (eps, slot) for SS_SCALE. A slot is SLOT_FLOATS float32
    (triton_gemv_forms.check_slot).

    Inside a CUDA-graph capture with PDL the weight is prefetched (pdl.prefetch)."""
    block_n, block_k, warps = config
    m, k = x.shape
    n = weight.shape[0]
    dummy = bias if bias is not None else weight
    nw, eps, residual, h = norm if norm is not None else (weight, 0.0, up, None)
    ss, clear, added = out, out, out
    if epilogue is not None:
        nw, added, h, ss, clear = epilogue
    if scale is not None:
        eps, ss = scale
    early = pdl.enabled(x.device)
    constexprs = {"HAS_BIAS": bias is not None, "BLOCK_M": _block_m(m), "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "USE_DOT": _block_m(m) > 1, "IEEE": x.dtype == torch.float32, "PDL": early,
                  "NORM": norm is not None, "ADD": norm is not None and residual is not None,
                  "SILU_MUL": up is not None, "PREFETCH": pdl.prefetch(early, "linear"),
                  # every constexpr, in order (FastLaunch's direct launch)
                  "EPI_SS": epilogue is not None, "SS_SCALE": scale is not None}
    _linear_launch(
        (cdiv(n, block_n), 1, 1),
        (x, weight, dummy, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
         residual if residual is not None else x, h if h is not None else out, nw,
         residual.stride(0) if residual is not None else x.stride(0), float(eps), ss, clear, added),
        constexprs, num_warps=warps,
    )


def gemv_config(k: int) -> tuple[int, int, int]:
    """The one-row block shape, untuned: two weight rows per program and a whole K of up to
    2048 (half of it above) per step, so every program's loads are in flight at once. On an
    H200 (benchmarks/small_m_linear.py --sweep, weights past L2) it was the fastest or within
    3% of it for every Llama-3.2-1B projection and the LM head, 1.2-1.35x cuBLAS where the
    weight is 8-34 MB. A short K takes a step no longer than itself."""
    block_n, block_k, warps = (2, 2048, 2) if k <= 2048 else (2, 4096, 4)
    return block_n, min(block_k, max(16, next_power_of_2(k))), warps


def _tune(x, weight, bias, out, key: tuple) -> tuple[int, int, int]:
    block_m = _block_m(x.shape[0])
    if block_m == 1:
        return gemv_config(x.shape[1])
    candidates = [c for c in CONFIGS if _fits(c, block_m)] or [CONFIGS[0]]
    return _timed_choice("small_m_linear", key, x, weight, candidates,
                         lambda config, w: launch_gemv(x, w, bias, out, config))


def _timed_choice(kernel: str, key: tuple, x: torch.Tensor, weight: torch.Tensor, candidates: list, run,
                  handicap: Optional[dict] = None) -> tuple:
    """The fastest of `candidates` for `run(config, weight)`, timed once per shape and device
    with the weight read from memory, not from L2 (tuning.past_l2), each time plus its
    `handicap` (ms), and kept in the kernel directory (ops/tuning.py); the first candidate off
    CUDA."""
    if len(candidates) == 1 or x.device.type != "cuda":
        return candidates[0]
    saved = tuning.lookup(kernel, key, x.device, candidates)
    if saved is not None:  # chosen by an earlier process: no candidate is compiled or timed
        return saved
    weights = tuning.past_l2(weight)
    timings = {}
    for config in candidates:
        # timed inside a CUDA graph: launched from Python, a few-microsecond kernel measures
        # Triton's launch overhead, not itself
        try:
            timings[config] = _bench(lambda: [run(config, w) for w in weights]) / len(weights)
        except OutOfResources:  # a tile this GPU's shared memory cannot hold
            continue
    best = tuning.fastest(timings, handicap)
    logger.debug("atom-compile: %s %s tuned to %s (%.2f us)", kernel, key, best, timings[best] * 1e3)
    tuning.remember(kernel, key, x.device, best)
    return best


def _bench(fn) -> float:
    bench = getattr(triton.testing, "do_bench_cudagraph", None)
    if bench is None:
        return triton.testing.do_bench(fn, warmup=5, rep=20)
    return bench(fn, rep=20)


# Above one row the kernel pads the rows to 16 for tensor-core dots; measured on an H200 it beat
# cuBLAS only on a large-vocabulary LM head, so 2..MAX_M rows take it only from this many outputs
DOT_MIN_N = 32768


# 2..MAX_M rows of a narrower layer on the split-K dots (ops/triton_splitk.py), each shape
# timed against the library GEMM: None reads ATOM_COMPILE_SPLIT_K (on unless 0: 5-7% off the
# decode step at batch 8 on an H100, benchmarks/decode.py -nosplitk arms); True / False override it
SPLIT_K_ROWS: Optional[bool] = None


def _split_k_rows() -> bool:
    return SPLIT_K_ROWS if SPLIT_K_ROWS is not None else envs.split_k_rows()


def supported(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether the kernel takes this call: 2-D half-precision input of one row (or of at most
    MAX_M rows for at least DOT_MIN_N outputs, or any with SPLIT_K_ROWS), a row-major weight of
    the same dtype, unit inner strides."""
    rows = x.shape[0] if x.dim() == 2 else 0
    wide = weight.dim() == 2 and (weight.shape[0] >= DOT_MIN_N or (rows > 1 and _split_k_rows()))
    return (x.dim() == 2 and (rows == 1 or (0 < rows <= MAX_M and wide)) and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dim() == 2 and weight.dtype == x.dtype and weight.shape[1] == x.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.stride(0) == 1)))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight.T + bias for a call `supported` accepts; tuned on first sight of its shape."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if takes_split_k(x, weight):
        return _split_k_or_library(x, weight, bias, out, split_k_choice(x, weight, bias, out))
    key = (_block_m(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    config = _tuned.get(key)
    if config is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            config = gemv_config(x.shape[1]) if _block_m(x.shape[0]) == 1 else CONFIGS[0]
        else:
            config = _tuned[key] = _tune(x, weight, bias, out, key)
    launch_gemv(x, weight, bias, out, config)
    return out


def takes_split_k(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call `supported` accepts goes to the split-K path: 2..MAX_M rows of a layer
    narrower than DOT_MIN_N."""
    return x.shape[0] > 1 and weight.shape[0] < DOT_MIN_N


def split_k_choice(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   out: Optional[torch.Tensor] = None) -> tuple:
    """The split-K path's shape for x @ weight.T (+ bias), or LIBRARY: timed on first sight of
    the shape outside a capture (`out` a scratch for the timing), LIBRARY untimed inside one."""
    key = ("split_k", weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    config = _tuned.get(key)
    if config is not None:
        return config
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return LIBRARY
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    config = _tuned[key] = _timed_choice(
        "small_m_split_k", key, x, weight, _split_k_candidates(),
        lambda c, w: _split_k_or_library(x, w, bias, out, c),
        {LIBRARY: LIBRARY_CHAIN_US * 1e-3} if pdl.enabled(x.device) else None)
    return config


# the split-K path's candidate for "the library GEMM": a shape where cuBLAS/hipBLASLt reads the
# weight faster keeps it (timed with the split-K shapes; the choice a capture makes untimed)
LIBRARY = (0, 0, 0, 0)
# With PDL our kernels launch while the kernel before them ends, and the one after launches while
# they end; the library GEMM takes no part, so in a decode step it pays two whole boundaries. Timed
# back to back, each candidate after itself, the split-K shapes gain only one: the library's time
# counts this much more (us). On an H100 the library read the 4- and 8-row qkv 0.1-0.2 us faster
# alone, and the split-K shapes made the decode step 0.5% faster (BENCHMARKS.md, `-nolib`)
LIBRARY_CHAIN_US = 0.5


def _split_k_candidates() -> list:
    return [*triton_splitk.CONFIGS, LIBRARY]


def _split_k_or_library(x, weight, bias, out, config) -> torch.Tensor:
    if config == LIBRARY:
        return torch.addmm(bias, x, weight.t(), out=out) if bias is not None else torch.mm(x, weight.t(), out=out)
    triton_splitk.launch(x, weight, bias, out, config)
    return out
