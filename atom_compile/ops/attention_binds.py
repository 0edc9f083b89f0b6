"""Bound launches of the paged attention ops for a token graph's eager regions: the op on its
recorded tensors as Triton launches bound once (ops/triton_launch.py), replayed while the
forward context still holds what they baked in, else the op itself."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..forward_context import get_forward_context
from .attention import PagedAttentionMetadata, _resolve, _rows_view, _triton_kernels


def _meta_reads(meta: Any) -> Optional[tuple]:
    """What a bound attention baked in from the step's metadata: addresses and the layout the
    launches were planned for (None for anything but one PagedAttentionMetadata). The builder
    keeps its buffers, so the steps of a recording agree."""
    if not isinstance(meta, PagedAttentionMetadata):
        return None
    tables = meta.block_tables
    return (meta.slot_mapping.data_ptr(), meta.query_positions.data_ptr(), meta.token_seq.data_ptr(),
            tables.data_ptr(), tables.stride(0), tables.shape[1])


def _bound_launches(query, key, value, output, kv_cache, meta, scale, rope=None) -> Optional[dict]:
    """The op on these exact tensors as bound Triton launches (each run once now; running them
    again writes and computes the same), by step kind: [False] the KV write then the attention,
    for any step (not with `rope`, which rotates in the one launch only); [True], where bound on
    a decode step, one launch doing both, for decode steps (`_launches_for`). None off
    CUDA/Triton or where they cannot be bound."""
    kernels = _triton_kernels() if query.is_cuda else None
    if kernels is None:
        return None
    if meta.query_positions.shape[0] != query.shape[0]:
        meta = _rows_view(meta, query.shape[0])
    bound = {}
    if rope is None:
        write = kernels.bind_write_kv(key, value, kv_cache, meta.slot_mapping)
        attend = kernels.bind_paged_attention(query, kv_cache[0], kv_cache[1], output, meta, scale)
        if write is None or attend is None:
            return None
        bound[False] = (write, *attend)
    if kernels.writes_kv(meta):
        fused = kernels.bind_paged_attention(query, kv_cache[0], kv_cache[1], output, meta, scale, new_kv=(key, value),
                                             rope=rope)
        if fused is not None:
            bound[True] = tuple(fused)
    return bound or None


def _launches_for(bound: dict, meta: Any) -> Optional[tuple]:
    """The bound launches right for this step: the single launch on a decode step (one row per
    sequence), where it was bound; else the KV write and the attention (None where unbound)."""
    return bound.get(meta.max_seqlen_q == 1) or bound.get(False)


def bound_replay(launches: dict, reads: Callable[[], tuple], expected: Any,
                 run_op: Callable[[], None]) -> Callable[[], None]:
    """A bound region's replay: `reads()` gives (what the launches baked in, the step's metadata);
    where that is still `expected` the launches right for the step run, else the op (`run_op`)."""

    def replay() -> None:
        baked, meta = reads()
        chosen = _launches_for(launches, meta) if baked == expected else None
        if chosen is None:
            run_op()
            return
        for launch in chosen:
            launch()

    return replay


def bind_by_name(query, key, value, output, layer_name: str, run_op: Callable[[], None],
                 rope=None) -> Optional[Callable[[], None]]:
    """The by-name attention (rotating first with `rope`) on a token graph's recorded tensors
    as bound launches (`bound_replay`), or None off CUDA/Triton."""
    layer, meta, kv_cache = _resolve(layer_name)
    launches = _bound_launches(query, key, value, output, kv_cache, meta, layer.scale, rope)
    if launches is None:
        return None

    def reads() -> tuple:
        layer, meta, kv_cache = _resolve(layer_name)
        return (kv_cache.data_ptr(), kv_cache.shape, kv_cache.dtype, layer.scale, _meta_reads(meta)), meta

    return bound_replay(launches, reads, reads()[0], run_op)


def bind_with_cache(query, key, value, output, kv_cache, scale: float, run_op: Callable[[], None],
                    rope=None) -> Optional[Callable[[], None]]:
    """As `bind_by_name` for the ops handed their cache and scale: only the step's metadata is
    checked."""
    meta = get_forward_context().attn_metadata
    if not isinstance(meta, PagedAttentionMetadata):
        return None
    launches = _bound_launches(query, key, value, output, kv_cache, meta, scale, rope)
    if launches is None:
        return None

    def reads() -> tuple:
        meta = get_forward_context().attn_metadata
        return _meta_reads(meta), meta

    return bound_replay(launches, reads, _meta_reads(meta), run_op)
