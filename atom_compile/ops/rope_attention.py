"""RoPE inside the attention: `atom::rope_paged_attention_with_output` and
`atom::rope_unified_attention_with_output`, the paged attention ops handed the query and key
before their rotary embedding (neox pairs: column j with j + head_dim / 2) and the table of
angles.

The RoPE-attention pass (backends/rope_attention_pass.py) puts them where a model rotates q and
k right before its attention. At a decode step on CUDA the one attention launch rotates the
query and the new key in registers (ops/triton_attention_kernels.py): no RoPE kernel runs between
the qkv projection and the attention, and the projection is the attention's PDL predecessor.
Other steps and devices rotate with PyTorch, then attend as the plain ops do.

The angles: row `index[i]` of `cos_table` (row i where `index` is None) holds query row i's cos
at columns [cos_first, cos_first + head_dim / 2), and the same row of `sin_table` its sin from
sin_first; a model's `cos_sin_cache[positions]` is one table and its positions. The rotation is
computed in float32 on the inputs and rounded to their dtype, as the models' RoPE computes.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..custom_ops import _library, direct_register_custom_op
from .attention import KV_NAMESPACE, _is_ours, _resolve, _rows_view, _triton_kernels, paged_attention, step_metadata

PAGED_OP = "rope_paged_attention_with_output"
BY_NAME_OP = "rope_unified_attention_with_output"


class RopeTable(NamedTuple):
    """Where a step's rotary angles are: the tables of cos and sin (often one), the row of each
    query row (None: its own), the first columns of cos and of sin."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    index: Optional[torch.Tensor]
    cos_first: int
    sin_first: int


def angles(rope: RopeTable, rows: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [rows, half] in float32 for the first `rows` query rows."""
    at = rope.index[:rows].long() if rope.index is not None else torch.arange(rows, device=rope.cos_table.device)
    return (rope.cos_table[at, rope.cos_first:rope.cos_first + half].float(),
            rope.sin_table[at, rope.sin_first:rope.sin_first + half].float())


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] with each head's pairs rotated (out of place, x's dtype)."""
    a, b = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(x.dtype)


def _table_ok(table: torch.Tensor, first: int, half: int, rows: int, indexed: bool) -> bool:
    return table.dim() == 2 and 0 <= first <= table.shape[1] - half and (indexed or table.shape[0] >= rows)


def _check(query: torch.Tensor, rope: RopeTable) -> None:
    half, rows, index = query.shape[-1] // 2, query.shape[0], rope.index
    indexed = index is not None
    if query.dim() != 3 or query.shape[-1] % 2 or not _table_ok(rope.cos_table, rope.cos_first, half, rows, indexed) \
            or not _table_ok(rope.sin_table, rope.sin_first, half, rows, indexed) \
            or (indexed and (index.dim() != 1 or index.shape[0] < rows or index.is_floating_point())):
        raise ValueError(f"atom::{PAGED_OP}: the query [rows, heads, even head_dim] is {list(query.shape)}; the "
                         f"tables {list(rope.cos_table.shape)} and {list(rope.sin_table.shape)} must hold cos from "
                         f"column {rope.cos_first} and sin from {rope.sin_first}, {half} columns each, a row per "
                         "query row or an integer index of rows")


def rope_paged_attention(query, key, value, output, kv_cache, meta, scale: float, rope: RopeTable) -> None:
    """The paged attention of the rotated query and key (`attention.paged_attention`)."""
    _check(query, rope)
    rows = query.shape[0]
    if meta.query_positions.shape[0] != rows:
        meta = _rows_view(meta, rows)
    kernels = _triton_kernels() if query.is_cuda else None
    if kernels is not None and kernels.writes_kv(meta) \
            and rope.cos_table.stride(1) == 1 and rope.sin_table.stride(1) == 1:
        kernels.triton_paged_attention(query, kv_cache[0], kv_cache[1], output, meta, scale, new_kv=(key, value),
                                       rope=rope)
        return
    cos, sin = angles(rope, rows, query.shape[-1] // 2)
    paged_attention(rotate_heads(query, cos, sin), rotate_heads(key, cos, sin), value, output, kv_cache, meta, scale)


def rope_paged_attention_with_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
    scale: float, cos_table: torch.Tensor, sin_table: torch.Tensor, rope_index: Optional[torch.Tensor],
    cos_first: int, sin_first: int,
) -> None:
    """`atom::paged_attention_with_output` of the query and key rotated by the table's angles."""
    meta = step_metadata(f"atom::{PAGED_OP}")
    rope_paged_attention(query, key, value, output, kv_cache, meta, scale,
                         RopeTable(cos_table, sin_table, rope_index, cos_first, sin_first))


def rope_unified_attention_with_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str,
    cos_table: torch.Tensor, sin_table: torch.Tensor, rope_index: Optional[torch.Tensor], cos_first: int,
    sin_first: int,
) -> None:
    """`aiter::unified_attention_with_output` (ours) of the query and key rotated by the table's angles."""
    layer, meta, kv_cache = _resolve(layer_name)
    rope_paged_attention(query, key, value, output, kv_cache, meta, layer.scale,
                         RopeTable(cos_table, sin_table, rope_index, cos_first, sin_first))


def _bind_paged(query, key, value, output, kv_cache, scale, cos_table, sin_table, rope_index, cos_first,
                sin_first) -> Optional[Callable[[], None]]:
    from .attention_binds import bind_with_cache

    args = (query, key, value, output, kv_cache, scale, cos_table, sin_table, rope_index, cos_first, sin_first)
    return bind_with_cache(query, key, value, output, kv_cache, scale,
                           lambda: rope_paged_attention_with_output(*args),
                           RopeTable(cos_table, sin_table, rope_index, cos_first, sin_first))


def _bind_by_name(query, key, value, output, layer_name, cos_table, sin_table, rope_index, cos_first,
                  sin_first) -> Optional[Callable[[], None]]:
    from .attention_binds import bind_by_name

    args = (query, key, value, output, layer_name, cos_table, sin_table, rope_index, cos_first, sin_first)
    return bind_by_name(query, key, value, output, layer_name, lambda: rope_unified_attention_with_output(*args),
                        RopeTable(cos_table, sin_table, rope_index, cos_first, sin_first))


def by_name_available() -> bool:
    """Whether the by-name op stands for ours (a real aiter's attention is not replaced)."""
    return _is_ours()


def _register() -> None:
    lib = _library(KV_NAMESPACE)
    direct_register_custom_op(PAGED_OP, rope_paged_attention_with_output, mutates_args=["output"], splitting=True,
                              eager_region=True, target_lib=lib, bind_region=_bind_paged)
    direct_register_custom_op(BY_NAME_OP, rope_unified_attention_with_output, mutates_args=["output"],
                              splitting=True, eager_region=True, target_lib=lib, bind_region=_bind_by_name)


_register()


def paged_op() -> torch._ops.OpOverload:
    return torch.ops.atom.rope_paged_attention_with_output.default


def by_name_op() -> torch._ops.OpOverload:
    return torch.ops.atom.rope_unified_attention_with_output.default
