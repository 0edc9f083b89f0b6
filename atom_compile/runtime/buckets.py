"""Capture ladders, graph keys, and padding a batch to the bucket that holds it."""

from __future__ import annotations

import bisect
from typing import Any, Optional, Sequence

import torch

from ..config import CompilationConfig, default_capture_ladder
from ..errors import AtomValueError


def capture_ladder(cc: CompilationConfig, max_num_seqs: Optional[int] = None) -> list[int]:
    """The batch sizes to record, ascending: `cudagraph_capture_sizes` if set, else
    `[1..8] + range(16, N+1, 16)` for `cuda_graph_sizes=[N]`, else the given list."""
    if cc.cudagraph_capture_sizes is not None:
        sizes = list(cc.cudagraph_capture_sizes)
    elif len(cc.cuda_graph_sizes) == 1:
        n = cc.cuda_graph_sizes[0]
        sizes = default_capture_ladder(min(n, max_num_seqs) if max_num_seqs else n)
    else:
        sizes = list(cc.cuda_graph_sizes)
    if max_num_seqs is not None:
        too_big = [s for s in sizes if s > max_num_seqs]
        if too_big:
            raise AtomValueError(f"capture sizes {too_big} exceed max_num_seqs ({max_num_seqs})")
    return sorted(set(sizes))


def request_bucket(running_bs: int, max_seqlen_q: int) -> tuple[int, int]:
    """The key of a request graph: (padded batch size, draft tokens each request verifies)."""
    return (running_bs, max_seqlen_q - 1)


def pad_to_bucket(n: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest size in the ascending `sizes` that holds `n`, or None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


NOT_A_BUCKET = 1 << 62  # what a rank whose step no recording holds (a prefill) contributes


def pad_for_data_parallel(n: int, sizes: Sequence[int], group: Any = None) -> Optional[int]:
    """Like pad_to_bucket, but every rank of `group` gets the bucket of the largest batch among
    them (all-reduce max), so that all data-parallel ranks replay the same graph; a rank that
    passes NOT_A_BUCKET makes every rank run eagerly. The tensor lives where the group's
    backend needs it (groups.tensor_device: gloo on the CPU, nccl on the GPU)."""
    if group is not None:
        import torch.distributed as dist

        from ..groups import tensor_device

        value = torch.tensor([n], dtype=torch.int64, device=tensor_device(group))
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        n = int(value.item())
    return pad_to_bucket(n, sizes) if n < NOT_A_BUCKET else None
