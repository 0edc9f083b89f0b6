"""Weights streamed into L2 on a side stream of a CUDA graph, while a decode layer's
latency-bound kernels run (Hopper and later).

At a few tokens a decode layer reads its weights at near the copy bandwidth in its GEMVs, and
between them the memory idles: the attention waits on a chain of small dependent loads, the
norms and the GEMVs' ramps on their own latency. `atom::l2_prefetch`, inside a CUDA-graph
capture, forks a second stream from the capture's and issues bulk L2 prefetches
(`cp.async.bulk.prefetch.L2`: one instruction per 64 KB chunk, no registers or shared memory)
of the weights the next kernels read, so the memory keeps working through the attention and
those GEMVs find their first bytes in L2. `atom::l2_prefetch_join` makes the capture's stream
wait for the forks (a capture must join every stream it forked); nothing else waits on them.
A prefetch is a hint: it changes no value. Outside a capture both ops do nothing but, once,
compile the kernel (nothing may compile inside a capture). backends/l2_prefetch_pass.py puts
them in the stitching graph of a split model.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..counters import compilation_counter
from ..forward_context import get_forward_context
from ..custom_ops import _library, direct_register_custom_op
from .triton_launch import cdiv
from .triton_present import triton_available

CHUNK = 1 << 16  # bytes per prefetch instruction
PER_PROGRAM = 32  # chunks per program: one a lane of one warp

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
        # each lane one chunk; a lane past the end asks again for the last 16 bytes (harmless).
        # The asm's result is a placeholder: is_pure=False keeps the instruction
        idx = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
        first = tl.minimum(idx.to(tl.int64) * CHUNK, nbytes - 16)
        size = (tl.minimum(nbytes - first, CHUNK).to(tl.int32) // 16) * 16
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [base_ptr + first, size], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _device_can(index: int) -> bool:
    return triton_available() and torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def available(device: torch.device) -> bool:
    """Whether `device` can take the bulk L2 prefetch: an NVIDIA GPU of compute capability 9.0
    or later (the instruction is Hopper's) and Triton to compile it."""
    if device.type != "cuda":
        return False
    return _device_can(device.index if device.index is not None else torch.cuda.current_device())


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of `device` in bytes (0 where torch does not say or it is not a GPU)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


_side: dict[int, torch.cuda.Stream] = {}
# (device index, PER_PROGRAM) whose kernel is compiled (a benchmark may change PER_PROGRAM)
_warmed: set[tuple[int, int]] = set()
# the forks not yet joined: device index -> (the capturing stream forked from, the side stream)
_pending: dict[int, tuple[int, torch.cuda.Stream]] = {}


def launch(weight: torch.Tensor, nbytes: int, per_program: Optional[int] = None) -> None:
    """The prefetch of the first `nbytes` of contiguous `weight` (16-byte multiples), on the
    current stream, now, `per_program` chunks a program (a power of two; PER_PROGRAM, read at
    the call, without one; benchmarks/l2_prefetch.py times it; the op forks it)."""
    flat = weight.view(-1).view(torch.uint8)
    per_program = per_program or PER_PROGRAM
    programs = cdiv(cdiv(nbytes, CHUNK), per_program)
    _l2_prefetch_kernel[(programs,)](flat, nbytes, CHUNK=CHUNK, PER_PROGRAM=per_program, num_warps=1)


def _prefetchable(weight: torch.Tensor, nbytes: int) -> bool:
    # the instruction wants 16-byte aligned addresses and sizes; a view past its storage or a
    # strided tensor is left alone
    return (weight.is_cuda and weight.is_contiguous() and weight.data_ptr() % 16 == 0 and nbytes >= 16
            and nbytes % 16 == 0 and nbytes <= weight.numel() * weight.element_size())


def _warm(weight: torch.Tensor, index: int) -> None:
    """Outside a capture: the side stream made (once per device) and the kernel compiled
    (once per device and PER_PROGRAM)."""
    launch(weight, 16)
    _warmed.add((index, PER_PROGRAM))
    if index not in _side:
        _side[index] = torch.cuda.Stream(weight.device)


def recording_token_graph() -> bool:
    """Whether a token graph is being recorded: its segment ends at the attention, before the
    join, so a fork there would fail the recording (runtime/graphs.py hands the recording its
    own forward context with the recorder in it)."""
    ctx = get_forward_context()
    return ctx.region_recorder is not None or ctx.tr_graph == "record"


def l2_prefetch(weights: list[torch.Tensor], nbytes: list[int]) -> None:
    """Inside a CUDA-graph capture (not a token graph's recording): the first `nbytes[i]` of
    each weight asked of L2, on a stream forked from the capture's. Elsewhere: nothing (the
    kernel compiled the first time)."""
    if not weights or not available(weights[0].device) or recording_token_graph():
        return
    device = weights[0].device
    index = device.index if device.index is not None else torch.cuda.current_device()
    capturing = torch.cuda.is_current_stream_capturing()
    warm = (index, PER_PROGRAM) in _warmed
    if not capturing and warm:  # an eager step (a prefill, say): nothing to do
        return
    usable = [(w, n) for w, n in zip(weights, nbytes) if _prefetchable(w, n)]
    if not usable:
        return
    if not capturing:
        _warm(usable[0][0], index)
        return
    if not warm:  # the kernel would compile inside the capture
        return
    side = _side[index]
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for w, n in usable:
            launch(w, n)
    _pending[index] = (main.cuda_stream, side)
    compilation_counter.num_l2_prefetches_recorded += 1


def l2_prefetch_join(anchor: torch.Tensor) -> None:
    """The capturing stream of `anchor`'s device waits for the prefetches forked from it."""
    if anchor.device.type != "cuda":
        return
    index = anchor.device.index if anchor.device.index is not None else torch.cuda.current_device()
    entry: Optional[tuple[int, torch.cuda.Stream]] = _pending.pop(index, None)
    if entry is None or not torch.cuda.is_current_stream_capturing():
        return
    main = torch.cuda.current_stream(anchor.device)
    if entry[0] == main.cuda_stream:  # forked in this capture, not one that failed before
        main.wait_stream(entry[1])


def _register() -> None:
    lib = _library("atom")
    direct_register_custom_op("l2_prefetch", l2_prefetch, mutates_args=[], target_lib=lib)
    direct_register_custom_op("l2_prefetch_join", l2_prefetch_join, mutates_args=[], target_lib=lib)


_register()
