"""Recognising RoPE on a traced (Dynamo) graph, for backends/rope_attention_pass.py: the nodes
an attention's query or key comes through, back to the tensor they rotate, and the tensors their
cos and sin are columns of.

The nodes are pure torch ops (arithmetic, casts, views, chunks, cats: `_pure`). RoPE is
recognised by what they compute, as backends/rope_pass.py does on Inductor's graphs: run in
float64 on unit pairs they yield the cos and sin they apply, and on random values they must
rotate each head's pairs (j, j + head_dim / 2) by them, the same for every head.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .rope_pass import _unit_pairs

MAX_NODES = 64  # a RoPE of q or k is a dozen or two nodes
PROBE_ROWS = 3  # a symbolic token count's value on the probe
_CASTS = {"float", "half", "bfloat16", "double", "type_as", "to"}
_METHODS = _CASTS | {"view", "reshape", "chunk", "split", "unsqueeze", "squeeze", "contiguous", "flatten", "unflatten",
                     "transpose", "permute", "expand", "narrow", "mul", "add", "sub", "neg", "__getitem__", "clone",
                     "size"}
_FUNCTIONS = {operator.mul, operator.add, operator.sub, operator.neg, operator.getitem, operator.truediv,
              torch.cat, torch.stack, torch.mul, torch.add, torch.sub, torch.neg, torch.chunk, torch.split,
              torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten, torch.transpose, torch.narrow}
_ROWS = {"view", "reshape", "unsqueeze", "squeeze", "contiguous"}  # moves that keep [rows, .., columns]


def _val(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _tensor(node: Any) -> bool:
    return isinstance(_val(node), torch.Tensor)


def _gather(node: fx.Node) -> bool:
    """`table[index]` with a tensor index: data movement, but not through the rotation."""
    return node.target is operator.getitem and isinstance(node.args[1], fx.Node) and _tensor(node.args[1])


def _floating(a: Any) -> bool:
    return a.is_floating_point if isinstance(a, torch.dtype) else _tensor(a) and _val(a).is_floating_point()


def _cast_only(node: fx.Node) -> bool:
    """`.to(...)` or `.type_as(...)` to a floating dtype only (the probe runs casts as identity:
    an integer cast or a device move is not one)."""
    rest = [a for a in node.args[1:]] + [v for k, v in node.kwargs.items() if k not in ("copy", "non_blocking")]
    return all(_floating(a) for a in rest)


def _pure(node: fx.Node) -> bool:
    """A pure torch op the rotation may be made of (no in-place op, no `out=`)."""
    if "out" in node.kwargs:
        return False
    if node.op == "call_method":
        return node.target in _METHODS and (node.target not in ("to", "type_as") or _cast_only(node))
    return node.op == "call_function" and node.target in _FUNCTIONS and not _gather(node)


def _backward(target: fx.Node) -> list[fx.Node]:
    """The pure nodes `target` is computed from (itself included), nearest first, at most MAX_NODES."""
    seen, order, todo = set(), [], [target]
    while todo and len(order) < MAX_NODES:
        node = todo.pop(0)
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        if node is target or _pure(node):
            todo.extend(node.all_input_nodes)
    return order


def _between(start: fx.Node, target: fx.Node, nodes: list[fx.Node]) -> Optional[list[fx.Node]]:
    """The nodes on paths from `start` to `target` (target included, start not), in graph order,
    where nothing outside them reads any but `target`; else None."""
    depends: dict[fx.Node, bool] = {start: True}

    def reaches(node: fx.Node) -> bool:
        if node not in depends:
            depends[node] = node in nodes and node is not start and _pure(node) and any(
                reaches(a) for a in node.all_input_nodes)
        return depends[node]

    if not reaches(target):
        return None
    sub = [n for n in nodes if n is not start and reaches(n)]
    order = {n: i for i, n in enumerate(target.graph.nodes)}
    sub = sorted(set(sub) | {target}, key=order.__getitem__)
    inside = set(sub) | {start}
    if any(set(n.users) - inside for n in sub if n is not target) or set(start.users) - inside:
        return None
    return sub


def _probe_value(node: Any, rows: int, expr: Any, gen: torch.Generator) -> Any:
    """A float64 probe value for a leaf: random for a tensor (its token count at `rows`), `rows`
    for the token count itself; None where neither fits."""
    val = _val(node)
    if isinstance(val, torch.SymInt):
        return rows if val.node.expr == expr else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return None
    dims = [d if isinstance(d, int) else (rows if d.node.expr == expr else None) for d in val.shape]
    return None if None in dims else torch.rand(dims, generator=gen, dtype=torch.float64) + 0.5


def _run(sub: list[fx.Node], env: dict) -> torch.Tensor:
    """The nodes of `sub` run on `env`'s values, casts left out (everything stays float64)."""
    for node in sub:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_method" and node.target in _CASTS:
            env[node] = args[0]
        elif node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env[sub[-1]]


def _token_expr(val: torch.Tensor) -> Any:
    rows = val.shape[0]
    return rows.node.expr if isinstance(rows, torch.SymInt) else rows


def _per_token(node: fx.Node, rows: Any, width: int) -> bool:
    """Whether `node` is [tokens, ...] floating with `width` elements a token (static)."""
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 2 \
        and _token_expr(val) == rows and all(isinstance(d, int) for d in val.shape[1:]) \
        and math.prod(val.shape[1:]) == width


def _angles(raw: fx.Node, sub: list[fx.Node], leaves: list, inputs: dict, heads: int, head_dim: int,
            rows: int, gen: torch.Generator) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) [rows, half] where `sub` rotates `raw` by them on these leaf values, else None."""
    half, shape = head_dim // 2, (rows, *_val(raw).shape[1:])
    unit = _run(sub, {**inputs, raw: _unit_pairs(rows, heads * head_dim, head_dim).reshape(shape)})
    if unit.numel() != rows * heads * head_dim:
        return None
    unit = unit.reshape(rows, heads, head_dim)
    cos, sin = unit[:, :1, :half], unit[:, :1, half:]
    if not torch.allclose(unit, torch.cat([cos, sin], -1).expand_as(unit), rtol=1e-9, atol=1e-12) \
            or torch.allclose(sin, torch.zeros_like(sin)):
        return None
    x = torch.randn(rows, heads, head_dim, generator=gen, dtype=torch.float64)
    got = _run(sub, {**inputs, raw: x.reshape(shape)}).reshape(rows, heads, head_dim)
    a, b = x.split(half, -1)
    if not torch.allclose(got, torch.cat([a * cos - b * sin, b * cos + a * sin], -1), rtol=1e-9, atol=1e-12):
        return None
    return cos[:, 0], sin[:, 0]


def _source(leaves: list, inputs: dict, want: torch.Tensor) -> Optional[tuple[fx.Node, int]]:
    """(leaf, first column) where the leaf, as [rows, columns], holds `want` at those columns."""
    rows, half = want.shape
    for leaf in leaves:
        value = inputs[leaf]
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            continue
        flat = value.reshape(rows, -1)
        for first in range(flat.shape[1] - half + 1):
            if torch.equal(flat[:, first:first + half], want):
                return leaf, first
    return None


_MOVES = _CASTS | _ROWS | {"expand", "transpose", "permute", "flatten", "unflatten", "chunk", "split"}


def _move(node: fx.Node) -> bool:
    """Data movement and casts only (no arithmetic): a cat of cos with itself, an unsqueeze."""
    if not _pure(node):
        return False
    if node.op == "call_method":
        return node.target in _MOVES or node.target == "__getitem__"
    return node.target in (operator.getitem, torch.cat, torch.stack, torch.chunk, torch.split, torch.reshape,
                           torch.unsqueeze, torch.squeeze, torch.flatten, torch.transpose)


def _widened(sub: list[fx.Node], raw: fx.Node) -> list[fx.Node]:
    """`sub` with the data movement its other inputs come through (a cat of cos with itself, an
    unsqueeze, a table's chunk), in graph order: the probe then sets the tensors moved, so that
    values a model duplicates stay duplicates."""
    wide = set(sub)
    todo = [a for n in sub for a in n.all_input_nodes if a not in wide and a is not raw]
    while todo:
        node = todo.pop()
        if node in wide or node is raw or not _move(node) or len(wide) >= 2 * MAX_NODES:
            continue
        wide.add(node)
        todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(raw.graph.nodes)}
    return sorted(wide, key=order.__getitem__)


def _probe(raw: fx.Node, sub: list[fx.Node], heads: int, head_dim: int) -> Optional[dict]:
    """The angles' sources where `sub` is RoPE of `raw` (neox pairs), else None."""
    rotation, sub = sub, _widened(sub, raw)
    leaves = sorted({a for n in sub for a in n.all_input_nodes if a not in sub and a is not raw}, key=lambda n: n.name)
    expr = _token_expr(_val(sub[-1]))
    rows = expr if isinstance(expr, int) else PROBE_ROWS
    gen = torch.Generator().manual_seed(0)
    inputs = {leaf: _probe_value(leaf, rows, expr, gen) for leaf in leaves}
    if any(v is None for v in inputs.values()):
        return None
    with unset_fake_temporarily(), torch.no_grad():
        try:
            found = _angles(raw, sub, leaves, inputs, heads, head_dim, rows, gen)
        except Exception:  # an op that cannot take the probe's values
            found = None
        if found is None:
            return None
        cos, sin = _source(leaves, inputs, found[0]), _source(leaves, inputs, found[1])
    if cos is None or sin is None:
        return None
    return {"raw": raw, "sub": rotation, "cos": canonical(*cos), "sin": canonical(*sin)}


def match_rope(target: fx.Node) -> Optional[dict]:
    """How `target` ([tokens, heads, head_dim], an attention's q or k) is RoPE of an earlier node:
    that node (the farthest back that fits), the nodes between, the (tensor, first column)
    sources of cos and sin, and every pure node it was looked for among; else None."""
    val = _val(target)
    if not isinstance(val, torch.Tensor) or val.dim() != 3 or not all(isinstance(d, int) for d in val.shape[1:]) \
            or val.shape[2] % 2:
        return None
    heads, head_dim = val.shape[1], val.shape[2]
    nodes = _backward(target)
    rows = _token_expr(val)
    order = {n: i for i, n in enumerate(target.graph.nodes)}
    candidates = sorted((n for n in nodes if n is not target and _per_token(n, rows, heads * head_dim)),
                        key=order.__getitem__)
    for raw in candidates:
        sub = _between(raw, target, nodes)
        found = _probe(raw, sub, heads, head_dim) if sub else None
        if found is not None:
            return {**found, "nodes": nodes}
    return None


def _row_like(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and all(d == 1 for d in val.shape[1:-1])


def _column_piece(node: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """(tensor, first column) where `node` is a piece of a tensor's last dimension: an item of
    its chunk or split, or a slice of its columns."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    inner, index = node.args
    if isinstance(index, int) and (inner.target in ("chunk", "split", torch.chunk, torch.split)):
        pieces, source = _val(inner), inner.args[0]
        dim = inner.kwargs.get("dim", inner.args[2] if len(inner.args) > 2 else 0)
        if isinstance(pieces, (list, tuple)) and isinstance(dim, int) and dim in (-1, _val(source).dim() - 1):
            return source, sum(p.shape[-1] for p in pieces[:index])
        return None
    index = index if isinstance(index, tuple) else (index,)
    if index and all(i is None or i is Ellipsis or i == slice(None) for i in index[:-1]) \
            and isinstance(index[-1], slice) and index[-1].step in (None, 1) and (Ellipsis in index or
                                                                                  len(index) == _val(inner).dim()):
        return inner, index[-1].start or 0
    return None


def _same_rows(node: fx.Node, inner: Any) -> bool:
    a, b = _val(node), _val(inner)
    return _row_like(a) and _row_like(b) and _token_expr(a) == _token_expr(b)


def canonical(leaf: fx.Node, first: int) -> tuple[fx.Node, int]:
    """The source of cos or sin traced back through casts, row-keeping moves and column pieces to
    the tensor it comes from (so that q's and k's copies of one table are one source)."""
    while True:
        inner = leaf.args[0] if leaf.args and isinstance(leaf.args[0], fx.Node) else None
        piece = _column_piece(leaf) if leaf.op == "call_function" else None
        if piece is not None and _same_rows(leaf, piece[0]):
            leaf, first = piece[0], first + piece[1]
        elif inner is not None and leaf.op == "call_method" and (leaf.target in _ROWS or (
                leaf.target in _CASTS and _cast_only(leaf))) and _same_rows(leaf, inner) \
                and _val(inner).shape[-1] == _val(leaf).shape[-1]:
            leaf = inner
        elif inner is not None and leaf.op == "call_function" and leaf.target is operator.getitem \
                and not _gather(leaf) and _same_rows(leaf, inner) and _val(inner).shape[-1] == _val(leaf).shape[-1]:
            leaf = inner  # x[:, None, :] and the like
        else:
            return leaf, first
