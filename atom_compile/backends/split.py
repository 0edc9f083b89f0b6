"""Split a traced graph at its splitting ops (attention) into pieces compiled one by one."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from ..config import normalize_op_name
from ..custom_ops import registered_splitting_ops

# Modules whose builtin functions Dynamo records under their aten name
# (torch.nn.functional.scaled_dot_product_attention is recorded as
# torch._C._nn.scaled_dot_product_attention).
_TORCH_FUNCTION_MODULES = ("torch", "torch._C", "torch._C._nn", "torch._C._VariableFunctions",
                           "torch.nn.functional", "torch._C._special", "torch._C._linalg")


# meta key of the `.contiguous()` nodes that `contiguous_boundaries` adds
_BOUNDARY = "atom_split_boundary"


@dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: fx.GraphModule


def target_names(target: Any) -> set[str]:
    """The names a call target answers to: `ns::op`, `ns::op.overload`, or `aten::fn` for a
    torch function such as scaled_dot_product_attention."""
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name  # "ns::op"
        overload = target._overloadname
        return {base, f"{base}.{overload}"}
    if isinstance(target, torch._ops.OpOverloadPacket):
        # Dynamo may record the packet; a call through it resolves to the default overload.
        return {target._qualified_op_name, f"{target._qualified_op_name}.default"}
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if name and (module in _TORCH_FUNCTION_MODULES or module.startswith("torch.")) \
            and callable(target) and hasattr(torch.ops.aten, name):
        return {f"aten::{name}"}
    return set()


def resolve_splitting_ops(splitting_ops: Iterable[str] | None) -> frozenset[str]:
    """Normalised names to split at: the given ones plus ops registered with splitting=True."""
    names = {normalize_op_name(op) for op in (splitting_ops or [])}
    return frozenset(names | registered_splitting_ops())


def is_splitting_node(node: fx.Node, names: frozenset[str]) -> bool:
    return node.op == "call_function" and bool(target_names(node.target) & names)


def _is_boundary_copy(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "contiguous" and node.meta.get(_BOUNDARY, False)


def _tensor_outputs(node: fx.Node) -> list[fx.Node]:
    """The nodes carrying a splitting op's tensor results: the op itself, or its getitems."""
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return [node]
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem
            and isinstance(u.meta.get("example_value"), torch.Tensor)]


def contiguous_boundaries(graph: fx.GraphModule, names: frozenset[str]) -> int:
    """Make every tensor a splitting op returns contiguous before a compiled piece reads it.

    A splitting op runs outside Inductor; its real output need not have the layout its fake
    kernel promised (SDPA's does not), and a piece compiled against the promised strides asserts
    on the first call. A `<value>_contiguous` node, run in the splitting op's own piece, gives
    the next piece exactly the layout it was compiled for (a no-op when already contiguous).
    Returns how many were added; running it twice adds none.
    """
    added = 0
    for node in list(graph.graph.nodes):
        if not is_splitting_node(node, names):
            continue
        for value in _tensor_outputs(node):
            if any(_is_boundary_copy(u) for u in value.users):
                continue
            readers = [u for u in value.users if not is_splitting_node(u, names)]
            if not readers:
                continue
            with graph.graph.inserting_after(value):
                copy = graph.graph.call_method("contiguous", (value,))
            copy.name = f"{value.name}_contiguous"
            copy.meta[_BOUNDARY] = True
            copy.meta["example_value"] = value.meta["example_value"].contiguous()
            for reader in readers:
                reader.replace_input_with(value, copy)
            added += 1
    if added:
        graph.recompile()
    return added


def _assign_pieces(graph: fx.GraphModule, names: frozenset[str]) -> tuple[dict[fx.Node, int], set[int]]:
    """Each node's piece number, and which pieces hold splitting ops (see split_graph)."""
    subgraph_id = 0
    node_to_subgraph: dict[fx.Node, int] = {}
    splitting_ids: set[int] = set()
    previous_was_split = False
    for node in graph.graph.nodes:
        if node.op in ("output", "placeholder"):
            continue
        if node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) and node.args[0] in node_to_subgraph:
            node_to_subgraph[node] = node_to_subgraph[node.args[0]]
            continue
        if is_splitting_node(node, names) or _is_boundary_copy(node):
            if not previous_was_split:
                subgraph_id += 1
            node_to_subgraph[node] = subgraph_id
            splitting_ids.add(subgraph_id)
            previous_was_split = True
        else:
            if previous_was_split:
                subgraph_id += 1
                previous_was_split = False
            node_to_subgraph[node] = subgraph_id
    return node_to_subgraph, splitting_ids


def split_graph(
    graph: fx.GraphModule, splitting_ops: Iterable[str] | None
) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Cut `graph` before and after every splitting op; return the stitching module and pieces.

    Before (splitting_ops=["silly::attention"])::

        def forward(x, out):
            y = x + 1
            torch.ops.silly.attention(y, y, y, out)
            return out * 2

    After, `split_gm` calls three pieces in order::

        def forward(x, out):
            y = self.submod_0(x)            # piece 0: x + 1
            self.submod_1(y, out)           # piece 1: the splitting op alone
            return self.submod_2(out)       # piece 2: out * 2

    Consecutive splitting ops share one piece; a getitem stays with the node it unpacks; the
    order of the original graph is kept. An empty `splitting_ops` (and no op registered with
    splitting=True) gives one piece holding the whole graph.
    """
    names = resolve_splitting_ops(splitting_ops)
    contiguous_boundaries(graph, names)
    node_to_subgraph, splitting_ids = _assign_pieces(graph, names)
    split_gm = split_module(
        graph, None, lambda node: node_to_subgraph[node], keep_original_order=True
    )

    items: list[SplitItem] = []
    names_in_order = [name for name, _ in split_gm.named_children()]
    for name in names_in_order:
        if "." in name or not name.startswith("submod_"):
            continue
        graph_id = int(name.removeprefix("submod_"))
        module = getattr(split_gm, name)
        items.append(SplitItem(name, graph_id, graph_id in splitting_ids, module))
    items.sort(key=lambda item: item.graph_id)
    return split_gm, items
