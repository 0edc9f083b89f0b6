"""A built-in post-grad pass: the RMSNorm between two of a CUDA piece's projections, split
between them.

After the small-M and GLU passes a decode layer's o and down projections are
`atom::small_m_linear(X, W, None)`, each followed by the residual add `h = y + r`, the norm
`rms_norm(h) * w`, and the next projection reading the norm alone (`atom::small_m_linear` for the
next layer's qkv, `atom::gate_up_glu` for a gated MLP): the norm is a kernel of its own, two a
layer. This pass rewrites such a chain as `atom::linear_add_weigh(X, W, r, w, eps, site, clear)` and
`atom::norm_scaled_linear(g, h, w, eps, W2, up, activation, site)` (ops/split_norm.py: at one
token the first GEMV adds, weighs and sums the squares, the second scales by 1 / rms; no norm
kernel). The sum replaces the add for its other readers. Each producer zeroes the next pair's
slot, so pairs are split only where two or more form a chain (each pair's projection reads the
consumer before it), numbered in that order: a lone pair keeps its norm.

The norm is matched as backends/prologue_pass.py matches it (the models' spellings after
Inductor's decompositions, half precision), on 2-D rows (an engine's flattened tokens) or the
[batch, seq, hidden] rows a transformers model's projection views (flattened for the ops, the
sum viewed back); a norm with another reader, or whose reader is not such a projection, is left
as it is. With prologue_pass on too, this pass runs first: a norm it takes is no longer a norm
for that one.
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


def _rows_read(node: fx.Node) -> Optional[fx.Node]:
    """The single reader of `node`, looking through one reshape to 2-D rows; else None."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if _call(user, *_RESHAPES) and _val(user) is not None and _val(user).dim() == 2 and len(user.users) == 1:
        (user,) = user.users
    return user


def _consumer(normed: fx.Node, linear, glu) -> Optional[tuple[fx.Node, tuple]]:
    """(the projection that alone reads the norm, its (W2, up, activation)); else None."""
    user = _rows_read(normed)
    if (_call(user, linear) and len(user.args) == 3 and user.args[2] is None and _val(user.args[0]) is not None
            and _val(user.args[0]).dim() == 2):
        return user, (user.args[1], None, "")
    if _call(user, glu) and len(user.args) == 4 and isinstance(user.args[3], str):
        return user, tuple(user.args[1:4])
    return None


def _candidate(normed: fx.Node, linear, glu) -> Optional[tuple]:
    """(normed, (h, norm weight, eps), (projection, operand, residual), (reader, (W2, up,
    activation))) where an add of a projection feeds the norm `normed` and one projection reads
    it; else None."""
    found = match_rms_norm(normed)
    parts = _split(found[0], linear) if found is not None else None
    consumer = _consumer(normed, linear, glu) if parts is not None else None
    return (normed, found, parts, consumer) if consumer is not None else None


def _depends(node: fx.Node, on: fx.Node, order: dict) -> bool:
    """Whether `node` reads `on`, through any chain of nodes."""
    todo, seen = list(node.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n is on:
            return True
        if n not in seen and order[n] > order[on]:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _chain_of_pairs(graph: fx.Graph, linear, glu, limit: int) -> list[fx.Node]:
    """The norms of the candidates, in the graph's order, each of whose projection reads the
    consumer before it (the order the slots' zeroing relies on: ops/split_norm.py); at most `limit`."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    chain: list[fx.Node] = []
    reader = None  # the last candidate's consumer
    for node in graph.nodes:
        found = _candidate(node, linear, glu) if node.op == "call_function" and len(chain) < limit else None
        if found is not None and (reader is None or _depends(found[2][0], reader, order)):
            chain.append(node)
            reader = found[3][0]
    return chain


def _rewrite(graph: fx.Graph, candidate: tuple, ops: tuple, site: int, clear: int) -> set[fx.Node]:
    """Split one norm (a `_candidate`) at `site`; the nodes left dead."""
    weigh, scaled = ops
    normed, (h, norm_weight, eps), (projection, operand, residual), (reader, (weight, up, activation)) = candidate
    dead = _chain(normed, {h, norm_weight}) | {h, operand, projection, normed}
    order = {n: i for i, n in enumerate(graph.nodes)}
    rows = _val(projection)
    with graph.inserting_before(normed):  # every operand is defined there (a norm weight computed late too)
        pair = graph.call_function(weigh, (*projection.args[:2], _reshaped(graph, residual, projection),
                                           norm_weight, eps, site, clear))
        pair.meta["val"] = (rows, rows)
        g, flat_h = (graph.call_function(operator.getitem, (pair, i)) for i in range(2))
        g.meta["val"] = flat_h.meta["val"] = rows
        h_out = _reshaped(graph, flat_h, h)
    with graph.inserting_before(reader):  # and the next projection's weights here
        out = graph.call_function(scaled, (g, flat_h, norm_weight, eps, weight, up, activation, site))
        out.meta["val"] = rows.new_empty((rows.shape[0], _val(weight).shape[0]))
        result = _reshaped(graph, out, reader)
    reader.replace_all_uses_with(result)
    dead |= {reader, *normed.users}  # the reader, and a reshape between them
    for user in list(h.users):  # the sum's later readers take the op's; one before keeps the add
        if user not in dead and order.get(user, -1) > order[normed]:
            user.replace_input_with(h, h_out)
    return dead


def fuse_epilogues(graph: fx.Graph) -> int:
    """Split the norms of `graph` between the projections around them, as described above, where
    at least two such pairs form a chain; the number split. The nodes they leave without readers
    are removed."""
    from ..ops.glu_linear import op as glu_op
    from ..ops.linear import op
    from ..ops.split_norm import SITES, ops as split_ops

    chain = _chain_of_pairs(graph, op(), glu_op(), SITES)
    if len(chain) < 2:  # a lone pair has no next producer to empty its slot
        return 0
    dead: set[fx.Node] = set()
    for site, normed in enumerate(chain):
        # matched again: the pair before took this one's residual (its sum) into its producer
        candidate = _candidate(normed, op(), glu_op())
        if candidate is None:  # every site must be there: the slots' zeroing goes round them all
            raise RuntimeError(f"atom-compile epilogue_pass: the norm at {normed.name} no longer matches")
        dead |= _rewrite(graph, candidate, split_ops(), site, (site + 1) % len(chain))
    for node in reversed(list(graph.nodes)):  # readers before what they read
        if node in dead and not node.users:
            graph.erase_node(node)
    return len(chain)


class EpiloguePass(CustomGraphPass):
    """`fuse_epilogues` as an Inductor custom pass, keyed by its source."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_epilogues(graph)

    def uuid(self) -> str:
        source = inspect.getsource(sys.modules[__name__])
        return hashlib.sha256(source.encode()).hexdigest()[:32]

