"""Before each attention of a split graph, ask L2 for the weights the piece after it reads first.

In a FULL CUDA graph the stitching graph runs once, inside the capture, so an op in it records
work into the graph like any kernel. Before each splitting piece (the attention) this puts an
`atom::l2_prefetch` (ops/l2_prefetch.py) of the weights the next compiled piece multiplies by,
in the order it first reads them, up to a byte budget (the first bytes of the last one taken),
and an `atom::l2_prefetch_join` before the graph's output. A decode layer's o projection and the
start of its gate_up then come from L2, fetched while the attention ran: the memory does not
idle through it (benchmarks/l2_prefetch.py). Weights are the graph's static inputs (no
symbolic size) that reach a matmul's operand through views only.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..ops import l2_prefetch as _ops  # registers the two ops
from .split import SplitItem, target_names

_MATMULS = frozenset({"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
_VIEW_METHODS = frozenset({"t", "transpose", "permute", "view", "reshape", "contiguous", "to", "type_as"})
MIN_BYTES = 1 << 16  # a weight (or what is left of the budget) smaller than one chunk is not asked for


def _is_matmul(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target is operator.matmul or bool(target_names(node.target) & _MATMULS)


def _through_views(node: Any) -> Optional[fx.Node]:
    """The placeholder a matmul operand is a view of, or None."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return node
        is_view = (node.op == "call_method" and node.target in _VIEW_METHODS) or \
            (node.op == "call_function" and bool(target_names(node.target) & {"aten::t", "aten::transpose"}))
        if not is_view or not node.args:
            return None
        node = node.args[0]
    return None


def _static_bytes(value: Any) -> int:
    """A static tensor's bytes (no symbolic size), else 0."""
    if not isinstance(value, torch.Tensor) or any(isinstance(s, torch.SymInt) for s in value.shape):
        return 0
    return value.numel() * value.element_size()


def weights_read_first(piece: fx.GraphModule) -> list[int]:
    """The positions of `piece`'s placeholders that reach a matmul operand through views, in the
    order the piece's matmuls first read them."""
    positions = {n: i for i, n in enumerate(n for n in piece.graph.nodes if n.op == "placeholder")}
    order: list[int] = []
    for node in piece.graph.nodes:
        if not _is_matmul(node):
            continue
        for arg in node.args:
            source = _through_views(arg)
            if source is not None and positions[source] not in order:
                order.append(positions[source])
    return order


def _budgeted(candidates: list[tuple[fx.Node, int]], budget: int) -> list[tuple[fx.Node, int]]:
    """The candidates' first bytes, in order, until `budget` is spent (multiples of 16)."""
    taken = []
    for node, size in candidates:
        if budget < MIN_BYTES:
            break
        nbytes = min(size, budget) // 16 * 16
        if nbytes >= MIN_BYTES:  # a smaller weight is skipped
            taken.append((node, nbytes))
            budget -= nbytes
    return taken


def plan(split_gm: fx.GraphModule, items: list[SplitItem], static: dict[str, int],
         budget: int) -> list[tuple[fx.Node, list[tuple[fx.Node, int]]]]:
    """For each splitting piece's call that a compiled piece follows: (that call, [(the
    stitching graph's input holding a weight of the next piece, bytes to fetch)]). `static`
    maps the stitching graph's static inputs by name to their bytes."""
    by_name = {item.submod_name: item for item in items}
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module" and n.target in by_name]
    out = []
    for call, after in zip(calls, calls[1:]):
        if not by_name[call.target].is_splitting_graph or by_name[after.target].is_splitting_graph:
            continue
        candidates = []
        for position in weights_read_first(by_name[after.target].graph):
            arg = after.args[position] if position < len(after.args) else None
            if isinstance(arg, fx.Node) and arg.op == "placeholder" and static.get(arg.name, 0):
                candidates.append((arg, static[arg.name]))
        taken = _budgeted(candidates, budget)
        if taken:
            out.append((call, taken))
    return out


def insert(split_gm: fx.GraphModule, items: list[SplitItem], budget: int) -> int:
    """Put the prefetches `plan` finds into `split_gm` (and one join); returns how many."""
    static = {n.name: _static_bytes(n.meta.get("example_value")) for n in split_gm.graph.nodes
              if n.op == "placeholder"}
    forks = plan(split_gm, items, static, budget)
    if not forks:
        return 0
    graph = split_gm.graph
    for call, taken in forks:
        with graph.inserting_before(call):
            graph.call_function(torch.ops.atom.l2_prefetch.default,
                                ([node for node, _ in taken], [nbytes for _, nbytes in taken]))
    output = next(n for n in graph.nodes if n.op == "output")
    anchor = forks[0][1][0][0]  # any weight: the join only needs its device
    with graph.inserting_before(output):
        graph.call_function(torch.ops.atom.l2_prefetch_join.default, (anchor,))
    split_gm.recompile()
    return len(forks)


def budget_bytes(megabytes: Optional[int], device: torch.device) -> int:
    """The bytes one prefetch may ask for: `megabytes` MB, or (None) half the device's L2; 0
    where the device cannot take the prefetch."""
    if not _ops.available(device):
        return 0
    return (megabytes << 20) if megabytes is not None else _ops.l2_bytes(device) // 2


def apply(split_gm: fx.GraphModule, items: list[SplitItem], example_inputs: list[Any], megabytes: Optional[int],
          full_graph: bool) -> int:
    """The pass where it pays: a FULL CUDA graph records the stitching graph (`full_graph`; with
    token graphs it would run, a no-op, between their segments every step), on a device that
    takes the prefetch, `megabytes` not 0. Returns the prefetches put in."""
    if not full_graph or megabytes == 0:
        return 0
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda), None)
    budget = budget_bytes(megabytes, device) if device is not None else 0
    return insert(split_gm, items, budget) if budget else 0
