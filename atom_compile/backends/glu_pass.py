"""A built-in post-grad pass: a gated MLP's activation-and-mul goes into its gate and up projections.

After the small-M pass (backends/small_m_pass.py) a gated MLP is `atom::small_m_linear` for
gate and up, an activation-and-mul kernel, `atom::small_m_linear` for down. This pass finds
`act(gate) * up` where act is SiLU (SwiGLU: Llama, Qwen, Mistral, Phi-3) or GELU's tanh form
(GeGLU: Gemma), recognised by what it computes rather than by how the decompositions spell it:
the pointwise nodes between the gate and the product are run on a float64 probe row and
compared with each activation. Gate and up are
- two halves of one projection `atom::small_m_linear(x, W, None)` along its last dimension
  (`chunk`, `split`, `split_with_sizes` or slices: vLLM's and the built-in Llama's merged
  gate_up weight, in either order), or
- two projections of the same rows `x` (transformers' gate_proj and up_proj),
through reshapes to and from [batch, seq, hidden], and calls `atom::gate_up_glu(x, Wg, Wu, act)`
(ops/glu_linear.py: one launch at one token, with the weights' row blocks as slices of W).
It rewrites only where nothing else reads the projections, so no weight is read twice; any
other activation or layout is left as it is.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import sys
from typing import Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from torch._subclasses.fake_tensor import unset_fake_temporarily

from .prologue_pass import _RESHAPES, _call, _chain, _reshaped, _rows_of, _val
from .small_m_pass import _HALF

aten, prims = torch.ops.aten, torch.ops.prims
MAX_ACTIVATION_NODES = 32  # an activation's decomposition is a handful of pointwise nodes


def _pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and torch.Tag.pointwise in node.target.tags


def _activation_input(act: fx.Node) -> Optional[fx.Node]:
    """g where `act` is a pointwise function (at most MAX_ACTIVATION_NODES nodes) of the one
    tensor g and constants; else None."""
    inner: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [act]
    while todo:
        node = todo.pop()
        if node in inner or node in leaves:
            continue
        if _pointwise(node) and len(inner) < MAX_ACTIVATION_NODES:
            inner.add(node)
            todo.extend(node.all_input_nodes)
        else:
            leaves.add(node)
    return leaves.pop() if len(leaves) == 1 and inner else None


def run_in_float64(out: fx.Node, values: dict, region: Optional[set] = None) -> object:
    """`out` computed from `values` (its inputs' probe values, keyed by node), every cast made a
    cast to float64; with `region`, only the nodes in it are computed (KeyError past it)."""
    def run(node: object) -> object:
        if not isinstance(node, fx.Node):
            return node
        if node not in values:
            if region is not None and node not in region:
                raise KeyError(node)
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), run)
            cast = node.target is prims.convert_element_type.default
            values[node] = args[0].to(torch.float64) if cast else node.target(*args, **kwargs)
        return values[node]

    return run(out)


def identify_activation(act: fx.Node, g: fx.Node) -> Optional[str]:
    """The name (ops/glu_linear.ACTIVATIONS) of the function the pointwise nodes from `g` to
    `act` compute; None where it is none of them (or cannot run here). They run on a float64
    probe row with every cast made a cast to float64: GELU's erf and tanh forms differ by 2e-4,
    below bf16's rounding and well above float64's."""
    from ..ops.glu_linear import ACTIVATIONS, activate

    # real tensors, even where the pass runs under a fake mode (the graph's values are fake)
    with unset_fake_temporarily(), torch.no_grad():
        # both tails and the curved middle, where SiLU and the GELUs differ most
        probe = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
        try:
            got = run_in_float64(act, {g: probe})
        except Exception:  # an op with no CPU kernel, or arguments it cannot take on a probe row
            return None
        for name in ACTIVATIONS:
            want = activate(probe, name)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype \
                    and torch.allclose(got, want, rtol=1e-6, atol=1e-9):
                return name
    return None


def match_glu(product: fx.Node) -> Optional[tuple[fx.Node, fx.Node, str]]:
    """(gate, up, activation) where `product` is act(gate) * up of two half-precision row blocks
    alike (2-D or 3-D) and act one of the op's activations; else None."""
    out = _val(product)
    if out is None or out.dim() not in (2, 3) or out.dtype not in _HALF or not _call(product, aten.mul.Tensor) \
            or len(product.args) != 2 or not all(isinstance(a, fx.Node) for a in product.args):
        return None
    for act, up in (product.args, product.args[::-1]):
        gate = _activation_input(act)
        alike = gate is not None and all(
            _val(t) is not None and tuple(_val(t).shape) == tuple(out.shape) and _val(t).dtype == out.dtype
            for t in (gate, up))
        name = identify_activation(act, gate) if alike else None
        if name is not None:
            return gate, up, name
    return None


def _unreshaped(node: fx.Node) -> fx.Node:
    """`node` without the reshapes that keep its last dimension (to and from 3-D rows)."""
    while _call(node, *_RESHAPES) and _val(node.args[0]) is not None \
            and _val(node.args[0]).shape[-1] == _val(node).shape[-1]:
        node = node.args[0]
    return node


def _last_dim(dim: object, node: fx.Node) -> bool:
    return isinstance(dim, int) and dim in (-1, _val(node).dim() - 1)


def _piece(node: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    """(the split tensor, first column, columns) where `node` is one piece of a split or a slice
    along the last dimension; None for anything else."""
    if _call(node, operator.getitem) and _call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split, index = node.args[0], node.args[1]
        whole, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if not _last_dim(dim, whole):
            return None
        total = _val(whole).shape[-1]
        starts = list(range(0, total, sizes)) if isinstance(sizes, int) else \
            [sum(sizes[:i]) for i in range(len(sizes))]
        return whole, starts[index], _val(node).shape[-1]
    if _call(node, aten.slice.Tensor) and len(node.args) >= 3 and _last_dim(node.args[1], node.args[0]):
        step = node.args[4] if len(node.args) > 4 else 1
        start = node.args[2] if node.args[2] is not None else 0
        if step == 1 and isinstance(start, int) and start >= 0:
            return node.args[0], start, _val(node).shape[-1]
    return None


def _projection(node: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    """(the `small_m_linear(x, W, None)` node, first output column, columns) that `node` is,
    whole or one piece of, through reshapes; else None."""
    from ..ops.linear import op

    node = _unreshaped(node)
    start, width = 0, _val(node).shape[-1]
    piece = _piece(node)
    if piece is not None:
        node, start, width = _unreshaped(piece[0]), piece[1], piece[2]
    ok = _call(node, op()) and len(node.args) == 3 and node.args[2] is None and _val(node.args[0]).dim() == 2
    return (node, start, width) if ok else None


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    """Whether two projections' inputs are one tensor: one node, or one reshape of one node."""
    if a is b:
        return True
    return (_call(a, *_RESHAPES) and _call(b, *_RESHAPES) and a.args[0] is b.args[0]
            and tuple(_val(a).shape) == tuple(_val(b).shape))


def _weight_rows(graph: fx.Graph, proj: fx.Node, start: int, width: int) -> fx.Node:
    """The projection's weight, or the node of its rows [start, start + width)."""
    weight = proj.args[1]
    if start == 0 and width == _val(weight).shape[0]:
        return weight
    rows = graph.call_function(aten.slice.Tensor, (weight, 0, start, start + width))
    rows.meta["val"] = _val(weight)[start:start + width]  # a view of the fake weight (it dispatches itself)
    return rows


def _exclusive(product: fx.Node, stop: set) -> Optional[set[fx.Node]]:
    """The nodes from the projections to `product`, where nothing outside them reads any of them."""
    chain = _chain(product, stop)
    inner = chain - {product}
    return chain if all(set(n.users) <= chain for n in inner) else None


def _fuse_one(graph: fx.Graph, product: fx.Node) -> Optional[set[fx.Node]]:
    """Rewrite `product` if it is a gated MLP's activation-and-mul of its projections; its chain
    or None."""
    from ..ops.glu_linear import op

    found = match_glu(product)
    halves = [_projection(t) for t in found[:2]] if found is not None else [None]
    if any(h is None for h in halves):
        return None
    (gate, g_start, width), (up, u_start, u_width) = halves
    x = gate.args[0]
    if width != u_width or not _same_rows(x, up.args[0]) or (gate is up and g_start == u_start):
        return None
    chain = _exclusive(product, {x, up.args[0], gate.args[1], up.args[1]})
    if chain is None or gate not in chain or up not in chain:
        return None
    # the op takes rows of any rank: given the [batch, seq, hidden] block that x flattens, its
    # result has the product's shape, and no reshape (of symbolic sizes, in a dynamic piece) is made
    rows = _rows_of(x)
    if tuple(_val(rows).shape[:-1]) != tuple(_val(product).shape[:-1]):
        rows = x
    with graph.inserting_before(product):
        weights = [_weight_rows(graph, p, s, width) for p, s in ((gate, g_start), (up, u_start))]
        call = graph.call_function(op(), (rows, *weights, found[2]))
        call.meta["val"] = _val(gate).new_empty((*_val(rows).shape[:-1], width))
        out = _reshaped(graph, call, product)
    product.replace_all_uses_with(out)
    return chain | {x, up.args[0]}  # the Linear's reshapes of the rows are dead now too


def fuse_glu(graph: fx.Graph) -> int:
    """Rewrite each activation-and-mul of `graph` over a gated MLP's projections, as described
    above; the number rewritten. The nodes they leave without readers are removed."""
    dead: set[fx.Node] = set()
    rewritten = 0
    for node in [n for n in graph.nodes if _call(n, aten.mul.Tensor)]:
        chain = _fuse_one(graph, node)
        if chain is not None:
            dead.update(chain)
            rewritten += 1
    for node in reversed(list(graph.nodes)):  # readers before what they read; never an input
        if node in dead and not node.users and node.op == "call_function":
            graph.erase_node(node)
    return rewritten


class GluPass(CustomGraphPass):
    """`fuse_glu` as an Inductor custom pass, keyed by its source, the helpers it takes from the
    prologue pass and the op's module (its activations)."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_glu(graph)

    def uuid(self) -> str:
        from ..ops import glu_linear  # what it recognises: the op's activations

        source = "".join(inspect.getsource(m) for m in (sys.modules[__name__], sys.modules[_rows_of.__module__],
                                                         glu_linear))
        return hashlib.sha256(source.encode()).hexdigest()[:32]
