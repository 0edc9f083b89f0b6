"""Graph pass: in a piece compiled for a concrete size of at most MAX_M tokens on CUDA, every
`F.linear` becomes `atom::small_m_linear` (the Triton GEMV of ops/triton_linear.py).

Decode runs its projections at 1-8 tokens, where cuBLAS's GEMM tiles read the weight at a
fraction of the memory bandwidth. The rewrite is deterministic, so the piece's content key (taken
over the rewritten graph) is the same in every process, and an entry made with the rewrite is
never loaded for a graph without it. The op itself falls back to `F.linear` for any call the
kernel does not take (fp32, a transposed weight, more rows than MAX_M after flattening).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx

from ..ops import linear as linear_op

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


def applies(size: int, args: list[Any]) -> bool:
    """Whether a piece compiled for `size` tokens with these inputs gets the rewrite."""
    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    return on_cuda and 0 < size <= linear_op.MAX_M


def rewrite(graph: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph` with each linear call replaced by the small-M op, and how many were."""
    nodes = [n for n in graph.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
    if not nodes:
        return graph, 0
    out = copy.copy(graph)
    out.graph = copy.deepcopy(graph.graph)
    count = 0
    for node in out.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        x, weight, bias = _linear_args(node)
        with out.graph.inserting_before(node):
            new = out.graph.call_function(linear_op.op(), (x, weight, bias))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        out.graph.erase_node(node)
        count += 1
    out.recompile()
    return out, count


def _linear_args(node: fx.Node) -> tuple[Any, Any, Any]:
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    weight = node.kwargs.get("weight", args[1])
    bias = node.kwargs.get("bias", args[2])
    return x, weight, bias
