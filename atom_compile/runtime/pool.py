"""The one memory pool every CUDA-graph recording shares, and what keeps it near the largest's.

Recordings never overlap in use (a step consumes its graph's output before the next replay),
so the memory of one may serve the others. Three things keep the pool close to the largest
recording's alone rather than growing with the ladder:
- what a recording keeps of pool memory after it is recorded (its output, a token graph's
  eager-region tensors) it keeps as non-owning views (`pool_alias`), so the next recording may
  reuse it;
- the largest recording's need, measured on its warm-up, is reserved as one free segment
  (`reserve`) that every recording carves its blocks from, instead of the allocator's size
  classes (20 MiB segments for 1-10 MiB blocks) spread over segments that smaller recordings
  fragment;
- recordings run on one capture stream whose library workspaces (cuBLAS's, 32 MiB on Hopper)
  were made before any capture, so none is made inside the pool and kept there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger("atom_compile")

_pool: Optional[Any] = None
# The recordings made in the pool. A pool lives only while some graph uses it: once every one
# is gone (a runner dropped), the handle is dead and capturing into it trips an allocator assert.
_pool_users: "weakref.WeakSet[torch.cuda.CUDAGraph]" = weakref.WeakSet()
_reserved = 0  # bytes the next capture into the pool claims as one free segment
_streams: dict[int, torch.cuda.Stream] = {}
# Below the allocator's exact-size threshold (10 MiB) a reservation would be a 20 MiB segment of
# its 1-10 MiB class, and a small recording's blocks (< 1 MiB) never use it: no reservation.
_MIN_RESERVE = 10 << 20


def graph_pool() -> Any:
    """The memory pool every recording shares: about the largest recording's size, not the sum.

    A recording keeps its intermediates referenced, so they are never handed to another; its
    output it does not keep (`pool_alias`): a replay's output is valid until the next replay of
    any recording in the pool.
    """
    global _pool
    if _pool is None or not _pool_users:
        _pool = torch.cuda.graph_pool_handle()
    return _pool


def uses_pool(graph: torch.cuda.CUDAGraph) -> None:
    """Count `graph` among the pool's users (the pool stays while one lives)."""
    _pool_users.add(graph)


def reset_graph_pool() -> None:
    """Forget the shared pool (tests and benchmarks that measure one recording at a time)."""
    global _pool, _reserved
    _pool = None
    _reserved = 0
    _pool_users.clear()


@functools.lru_cache(maxsize=None)
def _snapshot_options() -> tuple[str, ...]:
    # torch >= 2.10 or so: a snapshot of one pool, without the allocation history's traces
    params = inspect.signature(torch.cuda.memory_snapshot).parameters
    return tuple(name for name in ("mempool_id", "include_traces") if name in params)


def _segments() -> list[dict]:
    if _pool is None or not torch.cuda.is_available():
        return []
    pool = tuple(_pool)
    # A whole-process snapshot with its traces took 45 ms on an H100 with the allocator's history
    # on, and a token-graph ladder asked for 766 (38 s of a 65 s capture): ask for the pool's
    # segments alone, without traces, where this torch can
    options = {"mempool_id": pool, "include_traces": False}
    names = _snapshot_options()
    snapshot = torch.cuda.memory_snapshot(**{name: options[name] for name in names})
    unnamed = pool if "mempool_id" in names else ()  # a snapshot of the pool alone: its segments
    return [seg for seg in snapshot if tuple(seg.get("segment_pool_id", unnamed)) == pool]


def graph_pool_bytes() -> int:
    """Bytes the caching allocator holds in the shared pool's segments (0 if there is none)."""
    return sum(seg["total_size"] for seg in _segments())


def pool_ranges() -> list[tuple[int, int]]:
    """[start, end) of each of the pool's segments."""
    return [(seg["address"], seg["address"] + seg["total_size"]) for seg in _segments()]


class PoolMembership:
    """Whether an address lies in the pool: its segments as last read, read again (a snapshot
    costs about a millisecond) only for an address outside them not asked about before. Sound
    for the life of a tensor at that address: a segment made later cannot hold it."""

    def __init__(self) -> None:
        self._ranges = pool_ranges()
        self._outside: set[int] = set()

    def _in_ranges(self, ptr: int) -> bool:
        return any(lo <= ptr < hi for lo, hi in self._ranges)

    def __call__(self, ptr: int) -> bool:
        if self._in_ranges(ptr):
            return True
        if ptr in self._outside:
            return False
        self._ranges = pool_ranges()
        if self._in_ranges(ptr):
            return True
        self._outside.add(ptr)
        return False


def pool_alias(tree: Any, inside: Optional[Callable[[int], bool]] = None) -> Any:
    """`tree` with each CUDA tensor in the pool's memory replaced by a view that does not own it.

    Kept strongly, every recording's output (and a token graph's region tensors) stays allocated
    in the pool, one per size, where smaller recordings cannot reuse it. Freed once recorded,
    that memory goes back to the pool for the next recording; the recording still writes there
    on replay. Tensors outside the pool (module buffers, a KV cache, an eager region's result)
    stay as they are: their owners keep them. `inside(data_ptr)` says what is in the pool (a
    `PoolMembership` by default). Torch without the non-owning storage constructor (the one
    its CUDA-graph trees use) keeps everything.
    """
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        return tree
    if inside is None:
        inside = PoolMembership()

    def alias(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not inside(ptr):
            return t
        weak = make(ptr, t.device, storage.nbytes())
        return torch.empty((0,), dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())

    return pytree.tree_map(alias, tree)


def reservable() -> bool:
    """Whether a reservation would help: only where the allocator splits any free block for any
    request (not with max_split_size_mb: oversize blocks are not split; not with expandable
    segments or cudaMallocAsync, which have no such pools). Ask before measuring a need."""
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()
    if "max_split_size_mb" in conf or "expandable_segments:true" in conf:
        return False
    backend = getattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    return backend() == "native"


def reserve(nbytes: int) -> bool:
    """Have the next capture into the pool start with one free segment of `nbytes` (the largest
    recording's need, measured on its warm-up), which it and later recordings carve their
    blocks from. False (nothing reserved) where the allocator would not split it, or for a need
    of 10 MiB or less."""
    global _reserved
    if nbytes <= _MIN_RESERVE or not reservable():
        return False
    _reserved = int(nbytes)
    return True


def claim_reservation() -> None:
    """Inside a capture into the pool, first thing: make the reservation a free segment."""
    global _reserved
    nbytes, _reserved = _reserved, 0
    if nbytes:
        # allocated from the pool and freed at once: no kernel is recorded, the segment stays
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def capture_stream(device: Optional[int] = None) -> torch.cuda.Stream:
    """The stream every recording on `device` is captured on, its library workspaces made
    before any capture (a GEMM's first use on a stream allocates cuBLAS's workspace, which
    inside a capture would come from the pool and stay there)."""
    index = torch.cuda.current_device() if device is None else device
    stream = _streams.get(index)
    if stream is None:
        stream = torch.cuda.Stream(index)
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream), torch.inference_mode():
            for dtype in (torch.float32, torch.bfloat16):
                a = torch.zeros(16, 16, device=f"cuda:{index}", dtype=dtype)
                try:
                    torch.mm(a, a)
                    torch.nn.functional.linear(a, a, a[0])  # the cuBLASLt path (a bias epilogue)
                except RuntimeError as exc:  # a GPU without that dtype's GEMMs: nothing to warm
                    logger.debug("atom-compile: no %s GEMM to warm the capture stream (%s)", dtype, exc)
        torch.cuda.current_stream(index).wait_stream(stream)
        _streams[index] = stream
    return stream
