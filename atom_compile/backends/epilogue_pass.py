"""A built-in post-grad pass: the residual add + RMSNorm after a CUDA piece's projection goes into it.

After the small-M pass (backends/small_m_pass.py) a decode layer's o and down projections are
`atom::small_m_linear(X, W, None)`, each followed by the residual add `h = y + r` and the norm
`rms_norm(h) * w` that the next projection reads: a kernel of its own, two a layer. This pass
finds such a norm whose add reads a projection that nothing else reads, and calls
`atom::linear_add_rms_norm(X, W, r, w, eps)` (ops/epilogue_linear.py: at one token the GEMV's
last program adds and normalises, one launch), whose two outputs replace the norm and the sum.

The norm is matched as backends/prologue_pass.py matches it (the models' spellings after
Inductor's decompositions, half precision), on 2-D rows (an engine's flattened tokens) or the
[batch, seq, hidden] rows a transformers model's projection views (flattened for the op, its
outputs viewed back); anything else is left as it is. With prologue_pass on too, this pass runs
first: a norm it takes is no longer a norm for that one.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import sys
from typing import Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .prologue_pass import _RESHAPES, _call, _chain, _reshaped, _residual_add, _val, match_rms_norm


def _projection(node: object, target) -> bool:
    """Whether `node` is `small_m_linear(X, W, None)` on 2-D rows, read only by the add."""
    return (_call(node, target) and len(node.args) == 3 and node.args[2] is None and len(node.users) == 1
            and _val(node) is not None and _val(node).dim() == 2)


def _rows(node: object, target) -> Optional[fx.Node]:
    """The projection that `node` is, or that `node` views as [batch, seq, N] (transformers'
    Linear on 3-D activations), read by nothing else; else None."""
    if _projection(node, target):
        return node
    if _call(node, *_RESHAPES) and len(node.users) == 1 and _projection(node.args[0], target):
        val, flat = _val(node), _val(node.args[0])
        if val is not None and val.dim() == 3 and val.shape[-1] == flat.shape[-1]:
            return node.args[0]
    return None


def _split(h: fx.Node, target) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """(projection, the operand that is it or views it, residual) where `h` is their sum; else None."""
    operands = _residual_add(h)
    if operands is None:
        return None
    for operand, residual in (operands, operands[::-1]):
        projection = _rows(operand, target)
        if projection is not None:
            return projection, operand, residual
    return None


def _fuse_one(graph: fx.Graph, normed: fx.Node, target, fused_op) -> Optional[set[fx.Node]]:
    """Rewrite the norm `normed` if its add reads a projection; the nodes left dead, or None."""
    found = match_rms_norm(normed)
    if found is None:
        return None
    h, norm_weight, eps = found
    parts = _split(h, target)
    if parts is None:
        return None
    projection, operand, residual = parts
    dead = _chain(normed, {h, norm_weight}) | {h, operand, projection}  # taken before h's readers change
    order = {n: i for i, n in enumerate(graph.nodes)}
    rows = _val(projection)
    # at the norm, where every operand is defined (a norm weight computed after the add too)
    with graph.inserting_before(normed):
        fused = graph.call_function(fused_op, (*projection.args[:2], _reshaped(graph, residual, projection),
                                               norm_weight, eps))
        fused.meta["val"] = (rows, rows)
        outs = []
        for i, like in enumerate((normed, h)):  # each back to the rows' shape the graph had
            out = graph.call_function(operator.getitem, (fused, i))
            out.meta["val"] = rows
            outs.append(_reshaped(graph, out, like))
    normed.replace_all_uses_with(outs[0])
    for user in list(h.users):  # the sum's later readers take the op's; one before the norm keeps the add
        if order.get(user, -1) > order[normed]:
            user.replace_input_with(h, outs[1])
    return dead


def fuse_epilogues(graph: fx.Graph) -> int:
    """Rewrite each norm of `graph` that follows a projection's residual add, as described
    above; the number rewritten. The nodes they leave without readers are removed."""
    from ..ops.epilogue_linear import op as fused_op
    from ..ops.linear import op

    target = op()
    dead: set[fx.Node] = set()
    rewritten = 0
    for node in [n for n in graph.nodes if n.op == "call_function"]:
        if node in dead:
            continue
        gone = _fuse_one(graph, node, target, fused_op())
        if gone is not None:
            dead |= gone
            rewritten += 1
    for node in reversed(list(graph.nodes)):  # readers before what they read
        if node in dead and not node.users:
            graph.erase_node(node)
    return rewritten


class EpiloguePass(CustomGraphPass):
    """`fuse_epilogues` as an Inductor custom pass, keyed by its source."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_epilogues(graph)

    def uuid(self) -> str:
        source = inspect.getsource(sys.modules[__name__])
        return hashlib.sha256(source.encode()).hexdigest()[:32]

