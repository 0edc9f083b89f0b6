"""Capture within a memory budget (Config.cudagraph_memory_budget).

Sizes are recorded largest first into one pool. After each recording the pool is measured; the
next size is recorded only if the pool plus its predicted growth (the last recording's growth,
scaled by the ratio of the sizes) stays within the budget. The first (largest) size is always recorded: nothing predicts its cost before it.
Skipped sizes are the smallest ones, so a skipped batch pads up to the next larger recorded
graph (ModelRunner.padding_for), or runs eagerly when none is recorded.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union


def budget_bytes(budget: Union[int, float], free_bytes: int) -> int:
    """An int budget is bytes; a float in (0, 1] is that fraction of the free device memory."""
    if isinstance(budget, float):
        return int(budget * free_bytes)
    return int(budget)


def capture_within_budget(
    sizes: Sequence[int],
    capture: Callable[[int], None],
    pool_bytes: Callable[[], int],
    budget: int,
) -> tuple[list[int], list[int]]:
    """Record `sizes` largest first while the predicted pool stays within `budget` bytes.
    Returns (recorded, skipped), each descending."""
    recorded: list[int] = []
    ordered = sorted(sizes, reverse=True)
    growth = 0
    for i, size in enumerate(ordered):
        before = pool_bytes()
        if recorded and before + growth * size // recorded[-1] > budget:
            return recorded, ordered[i:]
        capture(size)
        growth = max(pool_bytes() - before, 0)
        recorded.append(size)
    return recorded, []
