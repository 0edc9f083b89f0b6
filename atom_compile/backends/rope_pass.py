"""A built-in post-grad pass: the rotary embedding (RoPE, neox style) of the query and key goes
into their qkv projection.

After the small-M pass (backends/small_m_pass.py) attention's input is `atom::small_m_linear`
for qkv, split into q, k and v, then RoPE on q and k: a few pointwise nodes that Inductor makes
into one or two kernels a layer. This pass finds, for each piece of one projection, the nodes
that read it (pointwise ops, casts, splits, slices, cats and reshapes) up to the one node that
the rest of the graph reads, and recognises RoPE by what those nodes compute, not by how a
model spells it: they run in float64 on probe values, once on unit pairs (which yields the
cos and sin they apply) and once on a random piece, which must come out as each head's pairs
(j, j + head_dim / 2) rotated by those cos and sin, the same for every head. The cos and sin
must be one of the graph's own tensors (a table gathered at the positions: the built-in
Llama's and vLLM's `cos_sin_cache[positions]`, or a model's cos and sin inputs), taken as it is.
Where the roped pieces are the projection's first columns (q, then k) with one head_dim and one
cos and sin, the projection and its RoPE become `atom::qkv_rope_linear` (ops/rope_linear.py:
one launch at one token) and every piece a view of its result. GPT-J's interleaved pairs,
partial rotary dims, token-major layouts other than [tokens, heads, head_dim], and anything else
are left as they are.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import operator
import sys
from typing import Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import stable_topological_sort
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .glu_pass import _piece, _pointwise, run_in_float64
from .prologue_pass import _RESHAPES, _call, _val
from .small_m_pass import _HALF

aten, prims = torch.ops.aten, torch.ops.prims
MAX_ROPE_NODES = 64  # a RoPE of q or k is a dozen or two nodes
PROBE_ROWS = 3  # a symbolic token count's value on the probe
_MOVES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.expand.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
          aten.cat.default, aten.clone.default, operator.getitem, prims.convert_element_type.default)


def _inside(node: fx.Node) -> bool:
    return node.op == "call_function" and (_pointwise(node) or node.target in _MOVES)


def _region(piece: fx.Node) -> Optional[set[fx.Node]]:
    """The nodes that read `piece`, through the ops a RoPE is made of; None past MAX_ROPE_NODES."""
    region: set[fx.Node] = set()
    todo = list(piece.users)
    while todo:
        node = todo.pop()
        if node in region or not _inside(node):
            continue
        if len(region) == MAX_ROPE_NODES:
            return None
        region.add(node)
        todo.extend(node.users)
    return region


def _upto(region: set[fx.Node], out: fx.Node) -> Optional[set[fx.Node]]:
    """The region's nodes that `out` is computed from, where nothing else reads any but `out`."""
    sub: set[fx.Node] = set()
    todo = [out]
    while todo:
        node = todo.pop()
        if node in region and node not in sub:
            sub.add(node)
            todo.extend(node.all_input_nodes)
    return sub if all(set(n.users) <= sub for n in sub - {out}) else None


def _widened(sub: set[fx.Node], piece: fx.Node) -> set[fx.Node]:
    """`sub` with the data movement its other inputs come through (unsqueeze, expand, a cat of
    cos with itself, a table's split): the probe then sets the tensors moved, so that values the
    model duplicates stay duplicates."""
    wide = set(sub)
    todo = [a for n in sub for a in n.all_input_nodes if a not in sub and a is not piece]
    while todo:
        node = todo.pop()
        if node in wide or node is piece or node.op != "call_function" or node.target not in _MOVES \
                or len(wide) >= 2 * MAX_ROPE_NODES:
            continue
        wide.add(node)
        todo.extend(node.all_input_nodes)
    return wide


def _outputs(piece: fx.Node, region: set[fx.Node]) -> list[fx.Node]:
    """The region's nodes that could be the piece rotated ([tokens, piece columns] or
    [tokens, heads, head_dim] with static heads), the last computed first."""
    width = _val(piece).shape[-1]

    def fits(node: fx.Node) -> bool:
        shape = _val(node).shape if _val(node) is not None else ()
        return len(shape) in (2, 3) and all(isinstance(d, int) for d in shape[1:]) and math.prod(shape[1:]) == width

    order = {n: i for i, n in enumerate(piece.graph.nodes)}
    return sorted((n for n in region if fits(n)), key=order.__getitem__, reverse=True)


def _probe_shape(val: torch.Tensor, rows: int) -> Optional[tuple[int, ...]]:
    dims = [d if isinstance(d, int) else rows for d in val.shape]
    symbolic = [i for i, d in enumerate(val.shape) if not isinstance(d, int)]
    return tuple(dims) if len(symbolic) <= 1 else None


def _token_count(node: fx.Node, piece: fx.Node) -> bool:
    """Whether `node` is the piece's symbolic row count (a reshape's size read as a node)."""
    val, rows = node.meta.get("val"), _val(piece).shape[0]
    return isinstance(val, torch.SymInt) and isinstance(rows, torch.SymInt) and val.node.expr == rows.node.expr


def _leaves(region: set[fx.Node], piece: fx.Node) -> Optional[list[fx.Node]]:
    """The region's inputs other than the piece: tensors, and the piece's row count (the probe
    gives it its rows); None where another input cannot take a probe value."""
    leaves = {a for n in region for a in n.all_input_nodes if a not in region and a is not piece}
    ok = all(_val(a) is not None or _token_count(a, piece) for a in leaves)
    return sorted(leaves, key=lambda n: n.name) if ok else None


def _unit_pairs(rows: int, width: int, head_dim: int) -> torch.Tensor:
    """A piece whose every pair is (1, 0): RoPE turns it into (cos, sin)."""
    head = torch.cat([torch.ones(head_dim // 2), torch.zeros(head_dim // 2)]).double()
    return head.repeat(width // head_dim).expand(rows, width).contiguous()


def _angles(region, out, piece, leaves, head_dim: int, rows: int, gen) -> Optional[tuple]:
    """(cos, sin) [rows, head_dim / 2] where the region is RoPE of `piece` with that head_dim
    for random leaf values (returned too), else None."""
    width, half = _val(piece).shape[-1], head_dim // 2
    tensors = [leaf for leaf in leaves if _val(leaf) is not None]
    shapes = [_probe_shape(_val(leaf), rows) for leaf in tensors]
    if any(s is None for s in shapes) or head_dim % 2 or width % head_dim:
        return None
    inputs = {leaf: torch.rand(s, generator=gen, dtype=torch.float64) + 0.5 for leaf, s in zip(tensors, shapes)}
    inputs.update({leaf: rows for leaf in leaves if leaf not in inputs})
    unit = run_in_float64(out, {**inputs, piece: _unit_pairs(rows, width, head_dim)}, region)
    if unit.numel() != rows * width:
        return None
    unit = unit.reshape(rows, width // head_dim, head_dim)
    cos, sin = unit[:, :1, :half], unit[:, :1, half:]
    if not torch.allclose(unit, torch.cat([cos, sin], -1).expand_as(unit), rtol=1e-9, atol=1e-12):
        return None
    x = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    got = run_in_float64(out, {**inputs, piece: x}, region).reshape(rows, width // head_dim, head_dim)
    a, b = x.reshape(rows, width // head_dim, head_dim).split(half, -1)
    want = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
        return None
    return cos[:, 0], sin[:, 0], inputs


def _source(leaves: list[fx.Node], inputs: dict, want: torch.Tensor) -> Optional[tuple[fx.Node, int]]:
    """(leaf, first column) where the leaf, as [rows, columns], has `want` at those columns."""
    rows, half = want.shape
    for leaf in leaves:
        value = inputs[leaf]
        if not isinstance(value, torch.Tensor) or value.numel() % rows or value.dim() == 0 or value.shape[0] != rows:
            continue
        flat = value.reshape(rows, -1)
        for first in range(0, flat.shape[1] - half + 1, half):
            if torch.allclose(flat[:, first:first + half], want, rtol=1e-12, atol=0):
                return leaf, first
    return None


def _match_out(piece: fx.Node, sub: set[fx.Node], out: fx.Node, rows: int) -> Optional[dict]:
    leaves = _leaves(sub, piece)
    if not leaves:
        return None
    dims = sorted({_val(n).shape[-1] for n in sub if _val(n) is not None and _val(n).dim() >= 3
                   and isinstance(_val(n).shape[-1], int)})
    gen = torch.Generator().manual_seed(0)
    for head_dim in dims:
        try:
            angles = _angles(sub, out, piece, leaves, head_dim, rows, gen)
        except Exception:  # an op with no CPU kernel, or arguments it cannot take on a probe
            angles = None
        if angles is None or torch.allclose(angles[1], torch.zeros_like(angles[1])):
            continue
        cos, sin = _source(leaves, angles[2], angles[0]), _source(leaves, angles[2], angles[1])
        if cos is not None and sin is not None:
            return {"region": sub, "out": out, "head_dim": head_dim, "cos": canonical(cos), "sin": canonical(sin)}
    return None


def _row_like(val: torch.Tensor) -> bool:
    """Whether `val` is [rows, columns] up to dims of one between them."""
    return val.dim() >= 2 and all(d == 1 for d in val.shape[1:-1])


def canonical(source: tuple[fx.Node, int]) -> tuple[fx.Node, int]:
    """The source of cos or sin traced back through reshapes and column pieces to the tensor they
    come from (so that q's and k's copies of one table are one source, and the op reads it)."""
    leaf, first = source
    while _val(leaf) is not None and _row_like(_val(leaf)):
        inner = leaf.args[0] if _call(leaf, *_RESHAPES, aten.unsqueeze.default, aten.squeeze.dim) else None
        piece = _piece(leaf) if inner is None else None
        if inner is not None and _val(inner) is not None and _row_like(_val(inner)) \
                and _val(inner).shape[0] == _val(leaf).shape[0] and _val(inner).shape[-1] == _val(leaf).shape[-1]:
            leaf = inner
        elif piece is not None and _row_like(_val(piece[0])):
            leaf, first = piece[0], first + piece[1]
        else:
            break
    return leaf, first


def match_rope(piece: fx.Node) -> Optional[dict]:
    """How the nodes that read `piece` rotate it, where they are RoPE: the nodes, the one read
    from outside them, head_dim and the (leaf, first column) sources of cos and sin; else None.
    The last node that is RoPE of the piece wins (a scale or cast after it stays out)."""
    region = _region(piece)
    rows = _probe_shape(_val(piece), PROBE_ROWS)
    if not region or rows is None:
        return None
    with unset_fake_temporarily(), torch.no_grad():
        for out in _outputs(piece, region):
            sub = _upto(region, out)
            if sub is not None and not set(piece.users) <= sub:  # the unrotated piece is read too
                continue
            found = _match_out(piece, _widened(sub, piece), out, rows[0]) if sub is not None else None
            if found is not None:
                return found
    return None


def _pieces(linear: fx.Node) -> Optional[list[tuple[fx.Node, int, int]]]:
    """(piece, first column, columns) for every reader of the projection, each a piece of it
    along the last dimension (a split's items or a slice); None where anything else reads it."""
    pieces = []
    for user in linear.users:
        items = list(user.users) if _call(user, aten.split.Tensor, aten.split_with_sizes.default) else [user]
        for item in items:
            piece = _piece(item)
            if piece is None or piece[0] is not linear:
                return None
            pieces.append((item, piece[1], piece[2]))
    return sorted(pieces, key=lambda p: p[1])


def _depends_on(node: fx.Node, target: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is target:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _plan(linear: fx.Node) -> Optional[tuple[list, list, int]]:
    """(the roped pieces with their matches, the other pieces, rotated columns) where the
    projection's first pieces are RoPE'd alike and nothing read depends on it; else None."""
    pieces = _pieces(linear)
    if not pieces:
        return None
    matches = [match_rope(p[0]) for p in pieces]
    roped = [(p, m) for p, m in zip(pieces, matches) if m is not None]
    rotated = sum(p[2] for p, _ in roped)
    if not roped or any(m is None for m in matches[:len(roped)]) or roped[0][0][1] != 0:
        return None
    first = roped[0][1]
    alike = all(m["head_dim"] == first["head_dim"] and m["cos"] == first["cos"] and m["sin"] == first["sin"]
                for _, m in roped)
    joined = all(a[0][1] + a[0][2] == b[0][1] for a, b in zip(roped, roped[1:]))
    leaves = {leaf for _, m in roped for n in m["region"] for leaf in n.all_input_nodes if leaf not in m["region"]}
    if not alike or not joined or any(_depends_on(leaf, linear) for leaf in leaves - {p[0] for p, _ in roped}):
        return None
    return roped, pieces[len(roped):], rotated


def _node(graph: fx.Graph, target, args: tuple, val: torch.Tensor) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _angle_rows(graph: fx.Graph, source: tuple[fx.Node, int], half: int) -> fx.Node:
    """The [tokens, half] cos or sin: a source leaf as rows, then its columns."""
    leaf, first = source
    val = _val(leaf)
    columns = math.prod(val.shape[1:])
    rows = _node(graph, aten.reshape.default, (leaf, [-1, columns]), val.reshape(-1, columns)) if val.dim() != 2 \
        else leaf
    if columns == half:
        return rows
    return _node(graph, aten.slice.Tensor, (rows, 1, first, first + half), _val(rows)[:, first:first + half])


def _rewrite(graph: fx.Graph, linear: fx.Node, roped: list, others: list, rotated: int) -> None:
    from ..ops.rope_linear import op

    match = roped[0][1]
    head_dim = match["head_dim"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min((m["out"] for _, m in roped), key=order.__getitem__)):
        cos, sin = (_angle_rows(graph, match[k], head_dim // 2) for k in ("cos", "sin"))
        x, weight, bias = linear.args
        call = _node(graph, op(), (x, weight, bias, cos, sin, rotated, head_dim), _val(linear).new_empty(_val(linear).shape))
        for (piece, first, width), m in roped + [(p, None) for p in others]:
            view = _node(graph, aten.slice.Tensor, (call, 1, first, first + width), _val(piece))
            if m is None:
                piece.replace_all_uses_with(view)
                continue
            out = m["out"]
            if _val(out).dim() == 3:
                view = _node(graph, aten.reshape.default, (view, [-1, *_val(out).shape[1:]]), _val(out))
            out.replace_all_uses_with(view)


def fuse_rope(graph: fx.Graph) -> int:
    """Rewrite each qkv projection of `graph` whose query and key pieces are RoPE'd, as described
    above; the number rewritten. The nodes they leave without readers are removed."""
    from ..ops.linear import op

    rewritten = 0
    for linear in [n for n in graph.nodes if _call(n, op())]:
        val = _val(linear)
        if len(linear.args) != 3 or val is None or val.dim() != 2 \
                or val.dtype not in _HALF:
            continue
        plan = _plan(linear)
        if plan is not None:
            _rewrite(graph, linear, *plan)
            rewritten += 1
    if rewritten:
        stable_topological_sort(graph)  # a value piece's readers may sit before the new op
        for node in reversed(list(graph.nodes)):  # readers before what they read; never an input
            if not node.users and node.op == "call_function" and _removable(node):
                graph.erase_node(node)
    return rewritten


def _removable(node: fx.Node) -> bool:
    """Whether a reader-less node is one this pass may leave dead (pure: no side effects)."""
    from ..ops.linear import op

    return _inside(node) or _call(node, op())


class RopePass(CustomGraphPass):
    """`fuse_rope` as an Inductor custom pass, keyed by its source and the helpers it takes from
    the GLU and prologue passes."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_rope(graph)

    def uuid(self) -> str:
        from ..ops import rope_linear

        source = "".join(inspect.getsource(m) for m in (sys.modules[__name__], sys.modules[_piece.__module__],
                                                         sys.modules[_call.__module__], rope_linear))
        return hashlib.sha256(source.encode()).hexdigest()[:32]
