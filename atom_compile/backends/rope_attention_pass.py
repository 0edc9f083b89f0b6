"""A pass on the traced graph, before it is split: the rotary embedding (RoPE, neox pairs) of an
attention's query and key goes into the attention op (ops/rope_attention.py).

A model rotates q and k with a few pointwise nodes right before its attention; after the split
they are a kernel of their own between the qkv projection and the attention, in the piece
before it, where no post-grad pass can reach the attention. Here, for each of our paged
attention ops, the nodes its query and key come through (pure torch ops: arithmetic, casts,
views, chunks, cats) are found back to a tensor of the same shape, and RoPE is recognised by
what they compute, as backends/rope_pass.py does: run in float64 on unit pairs they yield the
cos and sin they apply, and on random values they must rotate each head's pairs (j, j + half)
by them. The cos and sin must be columns of one of the graph's tensors: a table gathered at an
index (`cos_sin_cache[positions]`, vLLM's and the built-in Llama's) is read by the op at that
index; any other tensor is read a row per token. The op then takes the unrotated q and k, and
the rotation's nodes are dropped. Where q and k differ in their angles or head_dim, where the
rotated q or k is read elsewhere, or anything else does not fit, the graph stays as it is.
"""

from __future__ import annotations

import logging
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from .rope_match import _gather, _pure, _tensor, _token_expr, _val, match_rope

logger = logging.getLogger("atom_compile")


def _gathered(source: tuple[fx.Node, int]) -> tuple[fx.Node, Optional[fx.Node], int]:
    """(table, index or None, first column): a `table[index]` or `index_select(table, 0, index)`
    source is read by the op at the index; any other is read a row per token."""
    node, first = source
    if node.op == "call_function" and node.target is operator.getitem and _gather(node):
        table, index = node.args
    elif node.target in (torch.index_select, "index_select") and len(node.args) == 3 and node.args[1] == 0:
        table, _, index = node.args
    else:
        return node, None, first
    index_val = _val(index)
    if _tensor(table) and _val(table).dim() == 2 and index_val.dim() == 1 and not index_val.is_floating_point() \
            and not index_val.is_complex() and index_val.dtype != torch.bool:
        return table, index, first
    return node, None, first


def _reshaped(graph: fx.Graph, node: fx.Node, *trailing: int) -> fx.Node:
    """`node` as [rows, *trailing]: itself where it has that shape, else a reshape node at the
    graph's insertion point."""
    val = _val(node)
    if val.dim() == len(trailing) + 1 and tuple(val.shape[1:]) == trailing:
        return node
    out = graph.call_method("reshape", (node, -1, *trailing))
    out.meta["example_value"] = val.reshape(-1, *trailing)
    return out


def _attention_kind(node: fx.Node) -> Optional[tuple[Callable, int]]:
    """(the rope op, argument count) for one of our paged attention ops, else None."""
    from ..ops import rope_attention
    from .split import target_names

    if node.op != "call_function" or node.kwargs:
        return None
    names = target_names(node.target)
    if "atom::paged_attention_with_output" in names and len(node.args) == 6:
        return rope_attention.paged_op(), 6
    if "aiter::unified_attention_with_output" in names and len(node.args) == 5 and rope_attention.by_name_available():
        return rope_attention.by_name_op(), 5
    return None


_SHAPE_ONLY = (torch.empty_like, torch.zeros_like)


def _plan(attention: fx.Node) -> Optional[tuple[dict, dict, tuple, tuple]]:
    """The matches of q and k where both are RoPE of one angle source and nothing but the
    attention (and shape-only readers of q: `empty_like`) reads them rotated, with where the op
    reads the cos and the sin (`_gathered`)."""
    q, k = attention.args[0], attention.args[1]
    if not isinstance(q, fx.Node) or not isinstance(k, fx.Node) or q is k:
        return None
    if any(u is not attention and u.target not in _SHAPE_ONLY for u in q.users) \
            or any(u is not attention for u in k.users):
        return None
    mq, mk = match_rope(q), match_rope(k)
    if mq is None or mk is None or mq["cos"] != mk["cos"] or mq["sin"] != mk["sin"] \
            or _val(q).shape[2] != _val(k).shape[2] or set(mq["sub"]) & set(mk["sub"]):
        return None
    cos, sin = _gathered(mq["cos"]), _gathered(mk["sin"])
    rows = _token_expr(_val(q))
    if cos[1] is None and any(_token_expr(_val(t[0])) != rows for t in (cos, sin)):
        return None  # read a row per token: the tensors must have the query's rows
    if cos[1] is not sin[1] or any(u.target in _SHAPE_ONLY and _val(u).dtype != _val(mq["raw"]).dtype for u in q.users):
        return None
    return mq, mk, cos, sin


def _rewrite(graph: fx.Graph, attention: fx.Node, op: Callable, count: int, mq: dict, mk: dict,
             cos_at: tuple, sin_at: tuple) -> list[fx.Node]:
    q, k = attention.args[0], attention.args[1]
    heads_q, heads_k, head_dim = _val(q).shape[1], _val(k).shape[1], _val(q).shape[2]
    (cos, index, cos_first), (sin, _, sin_first) = cos_at, sin_at
    with graph.inserting_after(mq["raw"]):  # before q's shape-only readers
        raw_q = _reshaped(graph, mq["raw"], heads_q, head_dim)
    with graph.inserting_after(mk["raw"]):
        raw_k = _reshaped(graph, mk["raw"], heads_k, head_dim)
    with graph.inserting_before(attention):
        if index is None:
            cos, sin = _reshaped(graph, cos, _val(cos).shape[-1]), _reshaped(graph, sin, _val(sin).shape[-1])
        new = graph.call_function(op, (raw_q, raw_k, *attention.args[2:count], cos, sin, index, cos_first, sin_first))
    new.meta.update(attention.meta)
    attention.replace_all_uses_with(new)
    graph.erase_node(attention)
    for user in list(q.users):  # shape-only readers: the unrotated query has its shape and dtype
        user.replace_input_with(q, raw_q)
    return mq["nodes"] + mk["nodes"]  # the rotations and the angles' moves; the sweep keeps what is read


def fuse_rope_into_attention(gm: fx.GraphModule) -> int:
    """Rewrite each of our paged attention ops whose query and key are RoPE'd right before it, as
    described above; the number rewritten. The rotation's nodes left unread are removed."""
    graph, rewritten, dropped = gm.graph, 0, []
    ours = [(n, kind) for n in graph.nodes if (kind := _attention_kind(n)) is not None]
    for attention, (op, count) in ours:
        plan = _plan(attention)
        if plan is not None:
            dropped += _rewrite(graph, attention, op, count, *plan)
            rewritten += 1
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(dropped) & set(order), key=order.__getitem__, reverse=True):
        if not node.users and node.op in ("call_function", "call_method") and (_pure(node) or _gather(node)):
            graph.erase_node(node)
    if rewritten:
        gm.recompile()
        logger.debug("atom-compile: RoPE of %d attention ops moved into the op", rewritten)
    return rewritten
