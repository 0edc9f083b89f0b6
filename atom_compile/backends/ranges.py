"""Compile ranges (vLLM's `compile_ranges`): one compiled piece per [lo, hi) of token counts.

A piece with ranges dispatches a call of `size` tokens like this::

    size in compile_sizes          -> that size's piece (an exact size wins)
    lo <= size < hi for a range    -> that range's piece, compiled once for the whole range
    otherwise                      -> the general-shape piece

A range's piece is compiled from the piece's symbolic graph (every size of the range runs it),
under its own index key: runtime_shape "lo-hi" (see `range_label`). It is compiled when the
split graph is compiled, with the fake inputs the general piece is compiled from.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Optional

import torch.fx as fx

from .manager import CompilerManager


def range_label(lo: int, hi: int) -> str:
    """The runtime_shape a range's piece is stored under in the index."""
    return f"{lo}-{hi}"


def find_range(ranges: list[tuple[int, int]], size: int) -> Optional[tuple[int, int]]:
    """The [lo, hi) of sorted, non-overlapping `ranges` that holds `size`, or None."""
    i = bisect.bisect_right([lo for lo, _ in ranges], size) - 1
    if i >= 0 and ranges[i][0] <= size < ranges[i][1]:
        return ranges[i]
    return None


def compile_ranges(
    manager: CompilerManager,
    graph: fx.GraphModule,
    fake_args: list[Any],
    graph_index: int,
    ranges: list[tuple[int, int]],
    locator: Optional[list[int]],
) -> dict[tuple[int, int], Callable]:
    """Each range's compiled piece (loaded from the cache or compiled); {} for a piece whose
    inputs have no symbolic size (it has one shape, the general piece serves every call)."""
    if locator is None:
        return {}
    return {
        (lo, hi): manager.compile(graph, fake_args, graph_index, range_label(lo, hi), locator)
        for lo, hi in ranges
    }
