"""A built-in post-grad pass: the row-wise step before a CUDA piece's projection goes into it.

After the small-M pass (backends/small_m_pass.py) a decode layer is GEMV, norm, GEMV, SiLU-and-
mul, GEMV...: each norm (with the residual add before it, which Inductor fuses into it) and the
activation is a kernel of its own, three per layer, each a launch and a trip of the row through
memory. This pass finds `atom::small_m_linear(X, W, None)` where X is
- `rms_norm(h) * w`: calls `atom::rms_norm_linear(h, w, eps, W)`, or, where `h` is a residual
  add `a + b`, `atom::add_rms_norm_linear(a, b, w, eps, W)`, whose second output is the sum
  that the rest of the graph reads;
- `silu(gate) * up`: calls `atom::silu_mul_linear(gate, up, W)`
(ops/prologue_linear.py: one launch at one token, the row-wise kernel and the projection above).

Matched as the models spell them and Inductor's decompositions leave them, in half precision:
the norm `w * (float(h) * rsqrt(mean(float(h) ** 2, -1, keepdim) + eps)).to(h.dtype)`
(factors in either order, `x * x` for the square, any 1-D tensor for w: Gemma's 1 + w too); silu
as `silu`, `x * sigmoid(x)` or `x / (1 + exp(-x))`, in float32 and cast back or in the half
dtype; the rows 2-D (an engine's flattened tokens) or 3-D [batch, seq, hidden] flattened by the
projection (transformers' Linear), whose operands are then reshaped to the op's 2-D rows and the
sum back. Anything else (a float32 model, another activation) is left as it is.
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

from .small_m_pass import _HALF

aten, prims = torch.ops.aten, torch.ops.prims


def _call(node: object, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node: object) -> Optional[torch.Tensor]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _cast(node: object, dtype: torch.dtype) -> Optional[fx.Node]:
    """The input of `node` where it is a cast to `dtype`, else None."""
    if _call(node, prims.convert_element_type.default) and node.args[1] == dtype:
        return node.args[0]
    return None


def _other(node: fx.Node, pred) -> Optional[tuple[object, object]]:
    """(the factor that satisfies `pred`, the other) of a two-factor mul, either order."""
    if not _call(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    a, b = node.args
    return (a, b) if pred(a) else (b, a) if pred(b) else None


def _squared_mean(node: object, x: object, dims: int) -> bool:
    if not (_call(node, aten.mean.dim) and len(node.args) >= 2 and list(node.args[1]) in ([-1], [dims - 1])
            and (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))):
        return False
    sq = node.args[0]
    return (_call(sq, aten.pow.Tensor_Scalar) and sq.args[0] is x and sq.args[1] == 2) \
        or (_call(sq, aten.mul.Tensor) and sq.args[0] is x and sq.args[1] is x)


def _rstd_eps(node: object, x: object) -> Optional[float]:
    """eps where `node` is rsqrt(mean(x ** 2, -1, keepdim) + eps), else None."""
    if not _call(node, aten.rsqrt.default) or not _call(node.args[0], aten.add.Tensor, aten.add.Scalar):
        return None
    a, b = node.args[0].args[:2]
    mean, eps = (a, b) if isinstance(b, (int, float)) else (b, a)
    dims = _val(x).dim() if _val(x) is not None else 0
    return float(eps) if isinstance(eps, (int, float)) and _squared_mean(mean, x, dims) else None


def match_rms_norm(normed: object) -> Optional[tuple[fx.Node, fx.Node, float]]:
    """(h, norm weight, eps) where `normed` is the RMSNorm of the half-precision rows `h` (2-D,
    or 3-D [batch, seq, hidden]), else None."""
    out = _val(normed)
    if out is None or out.dim() not in (2, 3) or out.dtype not in _HALF:
        return None
    weight_first = _other(normed, lambda n: _val(n) is not None and _val(n).dim() == 1)
    if weight_first is None:
        return None
    weight, rounded = weight_first
    scaled = _cast(rounded, out.dtype)
    parts = _other(scaled, lambda n: _call(n, aten.rsqrt.default)) if isinstance(scaled, fx.Node) else None
    if parts is None or _val(weight).dtype != out.dtype or tuple(_val(weight).shape) != (out.shape[-1],):
        return None
    rsqrt, x32 = parts
    h = _cast(x32, torch.float32)
    eps = _rstd_eps(rsqrt, x32)
    if h is None or eps is None or _val(h) is None or _val(h).dtype != out.dtype or _val(h).shape != out.shape:
        return None
    return h, weight, eps


def _residual_add(h: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(a, b) where `h` is `a + b` of two tensors of h's own shape and dtype, else None."""
    if not _call(h, aten.add.Tensor) or len(h.args) != 2 or h.kwargs.get("alpha", 1) != 1:
        return None
    want = _val(h)
    same = all(_val(t) is not None and tuple(_val(t).shape) == tuple(want.shape) and _val(t).dtype == want.dtype
               for t in h.args)
    return (h.args[0], h.args[1]) if same else None


def _silu_arg(node: object) -> Optional[fx.Node]:
    """x where `node` is silu(x) as decompositions spell it: silu(x), x * sigmoid(x) or
    x / (1 + exp(-x)), factors and terms in either order; else None."""
    if _call(node, aten.silu.default):
        return node.args[0]
    if _call(node, aten.mul.Tensor) and len(node.args) == 2:
        for x, other in (node.args, node.args[::-1]):
            if _call(other, aten.sigmoid.default) and other.args[0] is x:
                return x
        return None
    if not (_call(node, aten.div.Tensor) and _call(node.args[1], aten.add.Tensor)):
        return None
    x, (a, b) = node.args[0], node.args[1].args[:2]
    exp = a if b == 1 else b if a == 1 else None
    negated = _call(exp, aten.exp.default) and _call(exp.args[0], aten.neg.default) and exp.args[0].args[0] is x
    return x if negated else None


def _silu_input(act: object, dtype: torch.dtype) -> Optional[fx.Node]:
    """g where `act` is silu(g) in g's half dtype: computed in it, or in float32 and cast back."""
    if _call(act, aten.silu.default) and _val(act.args[0]) is not None and _val(act.args[0]).dtype == dtype:
        return act.args[0]
    x32 = _silu_arg(_cast(act, dtype))
    return _cast(x32, torch.float32) if x32 is not None else None


def match_silu_mul(node: object) -> Optional[tuple[fx.Node, fx.Node]]:
    """(gate, up) where `node` is silu(gate) * up of two half-precision row blocks alike (2-D or
    3-D), else None."""
    out = _val(node)
    if out is None or out.dim() not in (2, 3) or out.dtype not in _HALF or not _call(node, aten.mul.Tensor):
        return None
    for act, up in (node.args[:2], node.args[1::-1]):
        gate = _silu_input(act, out.dtype)
        alike = gate is not None and all(_val(t) is not None and tuple(_val(t).shape) == tuple(out.shape)
                                         and _val(t).dtype == out.dtype for t in (gate, up))
        if alike:
            return gate, up
    return None


_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _rows_of(x: fx.Node) -> fx.Node:
    """The [batch, seq, hidden] block that the projection's 2-D input `x` flattens (transformers'
    Linear on 3-D activations), or `x` itself."""
    inner = x.args[0] if _call(x, *_RESHAPES) else None
    val, flat = _val(inner), _val(x)
    if val is None or flat is None or val.dim() != 3 or flat.dim() != 2 or val.shape[-1] != flat.shape[-1]:
        return x
    return inner


def _reshaped(graph: fx.Graph, node: fx.Node, like: fx.Node) -> fx.Node:
    """`node` reshaped as `like` (shape and meta), where their shapes differ; else `node`."""
    if tuple(_val(node).shape) == tuple(_val(like).shape):
        return node
    out = graph.call_function(aten.reshape.default, (node, list(_val(like).shape)))
    out.meta.update({k: v for k, v in like.meta.items() if k in ("val", "tensor_meta")})
    return out


def _chain(normed: fx.Node, stop: set) -> set[fx.Node]:
    """The norm's own nodes: from `normed` back to (not into) the nodes of `stop`."""
    seen: set[fx.Node] = set()
    todo = [normed]
    while todo:
        node = todo.pop()
        if node in stop or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen


def _fuse_one(graph: fx.Graph, node: fx.Node, sums: dict) -> Optional[set[fx.Node]]:
    """Rewrite the projection `node` if it reads a norm; the norm's nodes (now maybe dead) or None.
    `sums` maps a residual add already fused to the fused op's sum."""
    from ..ops.prologue_linear import ops

    plain, with_add, silu_mul = ops()
    x = node.args[0]
    normed = _rows_of(x)  # the ops take 2-D rows: 3-D operands are reshaped as x, sums back as h
    found = match_rms_norm(normed)
    if found is None:
        return _fuse_silu_mul(graph, node, silu_mul)
    h, norm_weight, eps = found
    operands = _residual_add(h) if h not in sums else None
    # where the sum's readers stand, taken before the rewrite (only an add's fusion needs it)
    order = {n: i for i, n in enumerate(graph.nodes)} if operands is not None else {}
    with graph.inserting_before(node):
        if operands is None:
            call = graph.call_function(plain, (_reshaped(graph, sums.get(h, h), x), norm_weight, eps, node.args[1]))
            call.meta.update(node.meta)
        else:
            flat = [_reshaped(graph, t, x) for t in operands]
            fused = graph.call_function(with_add, (*flat, norm_weight, eps, node.args[1]))
            fused.meta["val"] = (node.meta["val"], x.meta["val"])
            call = graph.call_function(operator.getitem, (fused, 0))
            call.meta.update(node.meta)
            total = graph.call_function(operator.getitem, (fused, 1))
            total.meta["val"] = x.meta["val"]
            sums[h] = _reshaped(graph, total, h)
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    if operands is not None:  # the sum's later readers take the fused op's; earlier ones keep h
        for user in list(h.users):
            if user in order and order[user] > order[node]:
                user.replace_input_with(h, sums[h])
    return _chain(x, {h, norm_weight}) | {h}


def _fuse_silu_mul(graph: fx.Graph, node: fx.Node, target) -> Optional[set[fx.Node]]:
    x = node.args[0]
    product = _rows_of(x)
    found = match_silu_mul(product)
    if found is None:
        return None
    with graph.inserting_before(node):
        call = graph.call_function(target, (*[_reshaped(graph, t, x) for t in found], node.args[1]))
    call.meta.update(node.meta)
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    return _chain(x, set(found))


def fuse_prologues(graph: fx.Graph) -> int:
    """Rewrite each `atom::small_m_linear(X, W, None)` of `graph` whose X is a norm or a
    SiLU-and-mul, as described above; the number rewritten. Their nodes left without readers
    are removed."""
    from ..ops.linear import op

    target = op()
    sums: dict = {}
    dead: set[fx.Node] = set()
    rewritten = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is target]:
        if len(node.args) != 3 or node.args[2] is not None:
            continue
        chain = _fuse_one(graph, node, sums)
        if chain is not None:
            dead.update(chain)
            rewritten += 1
    for node in reversed(list(graph.nodes)):  # the chains' nodes, readers before what they read
        if node in dead and not node.users:
            graph.erase_node(node)
    return rewritten


class ProloguePass(CustomGraphPass):
    """`fuse_prologues` as an Inductor custom pass, keyed by its source."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_prologues(graph)

    def uuid(self) -> str:
        source = inspect.getsource(sys.modules[__name__])
        return hashlib.sha256(source.encode()).hexdigest()[:32]
