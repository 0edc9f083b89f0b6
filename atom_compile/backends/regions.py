"""Inline the bodies of `invoke_subgraph` calls into the top graph, before splitting.

torch's `nested_compile_region` (the decorator applies it to the repeated layers of a
`ModuleList`, see layer_regions.py) makes Dynamo trace a repeated layer once and call the
traced body N times through the `invoke_subgraph` higher-order op. What it saves is Dynamo's
trace; the rest of the pipeline wants one flat graph: the split happens at attention *inside*
each layer, and the pieces of every layer are deduplicated by their content anyway (the
compiler sees each distinct piece once). Copying an FX body N times costs milliseconds.

    before:  out = invoke_subgraph(subgraph_0, "subgraph_0", s0, hidden, w_q, ...); h = out[0]
    after:   the nodes of subgraph_0, their placeholders bound to (s0, hidden, w_q, ...); h = ...
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..errors import AtomCompileError


class RegionInlineError(AtomCompileError, RuntimeError):
    """An `invoke_subgraph` call the backend could not inline (the decorator then traces again
    without regions)."""


def _invoke_subgraph_op() -> Any:
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def is_invoke_subgraph(node: fx.Node) -> bool:
    op = _invoke_subgraph_op()
    return op is not None and node.op == "call_function" and node.target is op


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _copy_attr(gm: fx.GraphModule, value: Any, hint: str) -> str:
    """Install `value` on the top module under a fresh name (a body's own get_attr)."""
    base = "_inlined_" + hint.replace(".", "_")
    name, n = base, 0
    while hasattr(gm, name):
        n += 1
        name = f"{base}_{n}"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name


def _inline_one(gm: fx.GraphModule, node: fx.Node) -> None:
    body = _fetch_attr(gm, node.args[0].target)
    operands = list(node.args[2:])
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise RegionInlineError(f"invoke_subgraph {node.name}: {len(operands)} operands for "
                           f"{len(placeholders)} placeholders of its body")
    env.update(zip(placeholders, operands))
    outputs: Any = None
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                outputs = fx.node.map_arg(inner.args[0], lambda n: env[n])
                continue
            if inner.op == "get_attr":
                name = _copy_attr(gm, _fetch_attr(body, inner.target), inner.target)
                copy = graph.get_attr(name)
                copy.meta.update(inner.meta)
            else:
                copy = graph.node_copy(inner, lambda n: env[n])
            env[inner] = copy
    _replace_uses(node, outputs)


def _replace_uses(node: fx.Node, outputs: Any) -> None:
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(outputs, (tuple, list)):
            user.replace_all_uses_with(outputs[user.args[1]])
            user.graph.erase_node(user)
        else:
            raise RegionInlineError(f"invoke_subgraph {node.name} is read by {user.format_node()}, not by getitem")
    node.graph.erase_node(node)


def inline_invoke_subgraphs(gm: fx.GraphModule) -> int:
    """Replace every `invoke_subgraph` call (nested ones too) by a copy of its body; drop the
    bodies no call reads any more. Returns how many calls were inlined (0: graph untouched)."""
    inlined = 0
    while True:
        calls = [n for n in gm.graph.nodes if is_invoke_subgraph(n)]
        if not calls:
            break
        for node in calls:
            try:
                _inline_one(gm, node)
            except RegionInlineError:
                raise
            except Exception as exc:  # a body this code does not know how to copy
                raise RegionInlineError(f"cannot inline invoke_subgraph {node.name}: "
                                        f"{type(exc).__name__}: {exc}") from exc
            inlined += 1
    if not inlined:
        return 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            target = node.target
            gm.graph.erase_node(node)
            if "." not in target and isinstance(getattr(gm, target, None), fx.GraphModule):
                delattr(gm, target)
    gm.graph.lint()
    gm.recompile()
    return inlined
