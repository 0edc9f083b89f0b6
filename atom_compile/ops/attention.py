"""Reference paged attention: `aiter::unified_attention_with_output` and its metadata.

The op takes tensors and the layer's name; it finds the layer (and its KV cache) through the
forward context's `no_compile_layers` and the step's metadata in `attn_metadata`, so one op
schema serves every layer and no module crosses into the graph. It writes this step's keys
and values into the paged cache, then attends each query row over its sequence's cached keys
up to its own position (causal), for prefill, decode and mixed batches alike.

Everything it reads is a device tensor at an address the metadata builder keeps fixed, so the
op needs no host data: it is safe inside a FULL CUDA graph. On CUDA with Triton it runs
`triton_paged_attention`; elsewhere a plain-torch path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..custom_ops import _library, direct_register_custom_op, existing_schema
from ..errors import AtomRuntimeError, AtomValueError
from ..forward_context import Context, get_forward_context
from .triton_present import triton_available

logger = logging.getLogger("atom_compile")

OP_NAME = "unified_attention_with_output"
# The same attention, handed the layer's KV cache and scale instead of its name: no per-layer
# constant in the graph, so repeated layers trace to one body (layer_regions.py).
KV_NAMESPACE = "atom"
KV_OP_NAME = "paged_attention_with_output"


@dataclass
class PagedAttentionMetadata:
    """One step's attention metadata. Row tensors have the step's (padded) row count."""

    slot_mapping: torch.Tensor  # [rows] int64, cache slot of each new key/value; -1: padding
    query_positions: torch.Tensor  # [rows] int32, absolute position; -1: padding row
    token_seq: torch.Tensor  # [rows] int32, the row's sequence index
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [seqs] int32, context length after this step
    num_actual_tokens: int = 0
    num_seqs: int = 0
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    is_prefill: bool = False


@dataclass
class SequenceStep:
    """What one sequence feeds in a step: its tokens, the position of the first, its blocks."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


def _torch_paged_attention(q, k_cache, v_cache, out, meta: PagedAttentionMetadata, scale: float) -> None:
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    tables = meta.block_tables[meta.token_seq.long()].long()  # [rows, max_blocks]
    length = tables.shape[1] * block_size
    keys = k_cache[tables].reshape(rows, length, num_kv_heads, head_dim)
    values = v_cache[tables].reshape(rows, length, num_kv_heads, head_dim)
    qg = q.reshape(rows, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("thgd,tlhd->thgl", qg, keys.float()) * scale
    pos = meta.query_positions.long()
    visible = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [rows, length]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows see no key at all
    result = torch.einsum("thgl,tlhd->thgd", probs, values.float())
    out.copy_(result.reshape(rows, num_heads, head_dim).to(out.dtype))


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values; padding rows (slot -1) go to the cache's last slot,
    a block reserved for them, so the write has a fixed shape and needs no host data."""
    k_flat = kv_cache[0].view(-1, *kv_cache.shape[3:])
    v_flat = kv_cache[1].view(-1, *kv_cache.shape[3:])
    rows = key.shape[0]
    slots = slot_mapping[:rows]
    slots = torch.where(slots >= 0, slots, torch.full_like(slots, k_flat.shape[0] - 1))
    k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, value.to(v_flat.dtype))


def paged_attention(query, key, value, output, kv_cache, meta: PagedAttentionMetadata, scale: float) -> None:
    rows = query.shape[0]
    if meta.query_positions.shape[0] != rows:
        meta = _rows_view(meta, rows)
    kernels = _triton_kernels() if query.is_cuda else None
    if kernels is not None and kernels.writes_kv(meta):  # decode: one launch writes and attends
        kernels.triton_paged_attention(query, kv_cache[0], kv_cache[1], output, meta, scale, new_kv=(key, value))
    elif kernels is not None:
        kernels.triton_write_kv(key, value, kv_cache, meta.slot_mapping)
        kernels.triton_paged_attention(query, kv_cache[0], kv_cache[1], output, meta, scale)
    else:
        write_kv(key, value, kv_cache, meta.slot_mapping)
        _torch_paged_attention(query, kv_cache[0], kv_cache[1], output, meta, scale)


def _rows_view(meta: PagedAttentionMetadata, rows: int) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(
        slot_mapping=meta.slot_mapping[:rows], query_positions=meta.query_positions[:rows],
        token_seq=meta.token_seq[:rows], block_tables=meta.block_tables, seq_lens=meta.seq_lens,
        num_actual_tokens=meta.num_actual_tokens, num_seqs=meta.num_seqs,
        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, is_prefill=meta.is_prefill,
    )


_KERNELS: Any = None


def _triton_kernels() -> Any:
    """The Triton kernels module (imported once: an eager region calls this every layer), or
    None without Triton."""
    global _KERNELS
    if _KERNELS is None and triton_available():
        from . import triton_attention

        _KERNELS = triton_attention
    return _KERNELS


def _resolve(layer_name: str) -> tuple[Any, PagedAttentionMetadata, torch.Tensor]:
    """The layer named `layer_name`, this step's metadata for it and its KV cache, from the
    forward context."""
    ctx = get_forward_context()
    layer = ctx.no_compile_layers.get(layer_name)
    if layer is None:
        raise AtomRuntimeError(
            f"attention layer {layer_name!r} is not in the forward context's no_compile_layers; "
            "run the model inside set_forward_context(attn_metadata, config) with the config it was built with"
        )
    meta = ctx.attn_metadata
    if isinstance(meta, dict):
        meta = meta[layer_name]
    kv_cache = getattr(layer, "kv_cache", None)
    if meta is None or kv_cache is None:
        raise AtomRuntimeError(
            f"attention layer {layer_name!r} has no attention metadata or KV cache in this step; "
            "allocate the cache (model.allocate_kv_cache) and set the step's metadata"
        )
    return layer, meta, kv_cache


def unified_attention_with_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    """Attention for the layer named `layer_name`; writes into `output` ([rows, heads, dim])."""
    layer, meta, kv_cache = _resolve(layer_name)
    paged_attention(query, key, value, output, kv_cache, meta, layer.scale)


def bind_unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                           layer_name: str) -> Optional[Callable[[], None]]:
    """The op on a token graph's recorded tensors as bound Triton launches, one for a decode step
    (KV write and attention, two otherwise; a replay then costs a check and the launches),
    or None off CUDA/Triton. A replay whose forward context no longer matches runs the op."""
    from .attention_binds import bind_by_name

    return bind_by_name(query, key, value, output, layer_name,
                        lambda: unified_attention_with_output(query, key, value, output, layer_name))


def bind_paged_attention_with_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     output: torch.Tensor, kv_cache: torch.Tensor,
                                     scale: float) -> Optional[Callable[[], None]]:
    """`atom::paged_attention_with_output` bound as `bind_unified_attention` binds the by-name
    op; the cache and scale are its own arguments, so only the step's metadata is checked."""
    from .attention_binds import bind_with_cache

    return bind_with_cache(query, key, value, output, kv_cache, scale,
                           lambda: paged_attention_with_output(query, key, value, output, kv_cache, scale))


def paged_attention_with_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
    kv_cache: torch.Tensor, scale: float,
) -> None:
    """Attention over `kv_cache` (the layer's own cache, an input of the graph) with the step's
    metadata from the forward context; writes into `output`. The cache is written in place
    outside the graph's view, as the by-name op writes the cache it looks up."""
    paged_attention(query, key, value, output, kv_cache, step_metadata(f"atom::{KV_OP_NAME}"), scale)


def step_metadata(op: str) -> PagedAttentionMetadata:
    """The step's one metadata for every layer, from the forward context, for the ops handed
    their cache (`op` names the caller in the error)."""
    meta = get_forward_context().attn_metadata
    if meta is None or isinstance(meta, dict):
        raise AtomRuntimeError(
            f"{op} needs the step's attention metadata (one PagedAttentionMetadata for every "
            f"layer) in the forward context; got {type(meta).__name__}. Per-layer metadata (a dict by layer "
            f"name) needs aiter::{OP_NAME}, which finds its layer by name"
        )
    return meta


def kv_cache_op_available() -> bool:
    """True where `atom::paged_attention_with_output` runs the same kernel as the by-name op
    (ours, not a real aiter's): a model may then hand attention its cache instead of its name."""
    return _is_ours()


def _register() -> None:
    direct_register_custom_op(KV_OP_NAME, paged_attention_with_output, mutates_args=["output"],
                              splitting=True, eager_region=True, target_lib=_library(KV_NAMESPACE),
                              bind_region=bind_paged_attention_with_output)
    # A real aiter wins: register ours only when no op of that name exists.
    if existing_schema(f"aiter::{OP_NAME}") is not None and not _is_ours():
        logger.info("atom-compile: aiter::%s exists already; the reference op is not registered", OP_NAME)
        return
    direct_register_custom_op(OP_NAME, unified_attention_with_output, mutates_args=["output"],
                              splitting=True, eager_region=True, bind_region=bind_unified_attention)


def _is_ours() -> bool:
    from ..custom_ops import registered_op

    return registered_op(f"aiter::{OP_NAME}") is not None


_register()


class PagedAttentionMetadataBuilder:
    """Builds PagedAttentionMetadata into persistent device buffers.

    The buffers are allocated once for the largest step, so every step's metadata lives at the
    same addresses: what a FULL CUDA graph recorded reading is what the next step writes.
    """

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: Any = "cpu"):
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        d = self.device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=d)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=d)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.long, device=d)
        self.query_positions = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=d)
        self.token_seq = torch.zeros(max_num_tokens, dtype=torch.int32, device=d)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=d)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=d)

    def _metadata(self, rows: int, seqs: int, actual_rows: int, actual_seqs: int,
                  max_q: int, max_k: int, is_prefill: bool) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:rows], query_positions=self.query_positions[:rows],
            token_seq=self.token_seq[:rows], block_tables=self.block_tables[:seqs],
            seq_lens=self.seq_lens[:seqs], num_actual_tokens=actual_rows, num_seqs=actual_seqs,
            max_seqlen_q=max_q, max_seqlen_k=max_k, is_prefill=is_prefill,
        )

    def build_for_capture(self, num_seqs: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, Context]:
        """A dummy decode batch of `num_seqs` sequences with `q_len` rows each (capture and
        warm-up): padding rows everywhere, so nothing is written to a real cache block."""
        rows = num_seqs * q_len
        self.input_ids[:rows].zero_()
        self.positions[:rows].zero_()
        self.slot_mapping[:rows].fill_(-1)
        self.query_positions[:rows].fill_(0)
        self.token_seq[:rows].copy_(torch.arange(rows, device=self.device, dtype=torch.int32) // q_len)
        self.block_tables[:num_seqs].zero_()
        self.seq_lens[:num_seqs].fill_(1)
        meta = self._metadata(rows, num_seqs, rows, num_seqs, q_len, 1, False)
        ctx = Context(positions=self.positions[:rows], is_prefill=False, batch_size=num_seqs,
                      running_bs=num_seqs, running_tokens=rows)
        return self.input_ids[:rows], self.positions[:rows], meta, ctx

    def build_for_cudagraph_capture(self, num_seqs: int, q_len: int = 1
                                    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, Context]:
        """The seed's name for `build_for_capture`, for a host that records its own CUDA graphs
        around our model: the dummy batch its capture runs, in the buffers every replay reads."""
        return self.build_for_capture(num_seqs, q_len)

    def build(self, steps: Sequence[SequenceStep], padded_num_seqs: Optional[int] = None,
              padded_rows: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, Context]:
        """Fill the buffers for a real step, padded to `padded_num_seqs` sequences (decode graph
        buckets) or `padded_rows` rows (token buckets). Returns (input_ids, positions, metadata,
        context) as views of the persistent buffers."""
        num_seqs = len(steps)
        if num_seqs == 0:
            raise AtomValueError("build: a step needs at least one sequence")
        if num_seqs > self.max_num_seqs:
            raise AtomValueError(f"build: {num_seqs} sequences; this builder holds at most {self.max_num_seqs}")
        ids, pos, slots, seq_idx = [], [], [], []
        max_q = max_k = 0
        tables = torch.zeros(num_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        lens = []
        is_prefill = False
        for s, step in enumerate(steps):
            n = len(step.token_ids)
            end = step.start_pos + n
            if end > len(step.block_table) * self.block_size:
                raise AtomValueError(f"sequence {s}: {end} positions need more than its {len(step.block_table)} blocks")
            if len(step.block_table) > self.max_blocks_per_seq:
                raise AtomValueError(f"sequence {s}: {len(step.block_table)} blocks; at most {self.max_blocks_per_seq}")
            ids.extend(step.token_ids)
            pos.extend(range(step.start_pos, end))
            slots.extend(step.block_table[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(step.start_pos, end))
            seq_idx.extend([s] * n)
            tables[s, : len(step.block_table)] = torch.tensor(list(step.block_table), dtype=torch.int32)
            lens.append(end)
            max_q, max_k = max(max_q, n), max(max_k, end)
            is_prefill |= n > 1 and step.start_pos == 0
        rows = len(ids)
        seqs = max(num_seqs, padded_num_seqs or 0)
        total_rows = max(rows, padded_rows or 0, seqs * max_q if padded_num_seqs else 0)
        if total_rows > self.max_num_tokens or seqs > self.max_num_seqs:
            raise AtomValueError(f"build: {total_rows} rows / {seqs} sequences exceed the builder's "
                             f"{self.max_num_tokens} / {self.max_num_seqs}")
        pad = total_rows - rows
        self.input_ids[:total_rows].copy_(torch.tensor(ids + [0] * pad, dtype=torch.long), non_blocking=True)
        self.positions[:total_rows].copy_(torch.tensor(pos + [0] * pad, dtype=torch.long), non_blocking=True)
        self.slot_mapping[:total_rows].copy_(torch.tensor(slots + [-1] * pad, dtype=torch.long), non_blocking=True)
        self.query_positions[:total_rows].copy_(torch.tensor(pos + [-1] * pad, dtype=torch.int32), non_blocking=True)
        self.token_seq[:total_rows].copy_(torch.tensor(seq_idx + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.block_tables[:num_seqs].copy_(tables, non_blocking=True)
        self.block_tables[num_seqs:seqs].zero_()
        self.seq_lens[:seqs].copy_(torch.tensor(lens + [0] * (seqs - num_seqs), dtype=torch.int32), non_blocking=True)
        meta = self._metadata(total_rows, seqs, rows, num_seqs, max_q, max_k, is_prefill)
        ctx = Context(positions=self.positions[:total_rows], is_prefill=is_prefill, batch_size=num_seqs,
                      running_bs=seqs, running_tokens=total_rows)
        return self.input_ids[:total_rows], self.positions[:total_rows], meta, ctx


# The rotating twins of the ops above are splitting ops too, and the set of splitting ops enters
# a graph-partition compile's key: register them whenever these are, in every process alike.
from . import rope_attention  # noqa: E402,F401
