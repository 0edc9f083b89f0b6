"""Triton paged attention (CUDA): one launch per layer, split along the keys (flash-decoding).

Each program takes one query row, one KV head with every query head of its group (GQA: each
cached key and value is read once per group, and both products are tensor-core dots) and one
span of the cached keys (as many spans as fill the GPU at that batch, _spans; each row's own
keys are divided over them, so a short row in a wide block table is split as finely as a long
one): it reads the row's sequence, position and block table from device tensors and keeps an
online softmax in float32. The spans of a row are merged in the same launch by the last of
them to finish (a ticket counter per row and KV head, triton_attention_kernels.py). Every
launch grid depends only on the row count and the block table's width, never on host data, so
a CUDA graph records it and replays read the new metadata at the same addresses. Splitting the
keys keeps the GPU busy at batch 1, where one program per head would leave most
multiprocessors idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import AtomValueError
from . import pdl
from .triton_attention_kernels import _attention_kernel, _write_kv_kernel
from .triton_launch import FastLaunch, cdiv, next_power_of_2


@dataclass(frozen=True)
class Tuning:
    """Span programs to aim for per multiprocessor, keys per loop step, warps per program."""

    programs_per_sm: int
    block_n: int
    num_warps: int


# Measured in the decode step on an H100 (benchmarks/decode_ab.py: paired, every arm on the same
# weights; BENCHMARKS.md), by how many (row, KV head) pairs a launch has per multiprocessor:
# - under a tenth (batch 1 of an 8-KV-head model): the spans' programs number fewer than the
#   multiprocessors, and long steps of four warps win;
# - up to about a third (batches 2 and 4): the same spans on two warps, 3-4% off the step;
# - more: short steps of two warps, more spans (2.7% off at batch 8; at 16 within 0.2% of the
#   long steps; past the multiprocessor count, where the spans stop, the H200 sweep of
#   attention_kernel.py chose it).
# An isolated sweep of the kernel alone (attention after attention) ranked them otherwise.
FEW_PAIRS = ((0.1, Tuning(programs_per_sm=2, block_n=128, num_warps=4)),
             (0.35, Tuning(programs_per_sm=2, block_n=128, num_warps=2)))  # (pairs per SM below, tuning)
MANY_PAIRS = Tuning(programs_per_sm=4, block_n=64, num_warps=2)
FORCED: Optional[Tuning] = None  # set by the sweep to time one tuning at every shape
MAX_SPLITS = 64  # bounds the merge's [spans, head_dim] tile (registers) at very long contexts
_SMS: dict = {}


def _sms(device: torch.device) -> int:
    if device not in _SMS:
        cuda = device.type == "cuda"
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    return _SMS[device]


def tuning_for(pairs: int, device: torch.device) -> Tuning:
    """The kernel's tuning for a launch of `pairs` (rows x KV heads) on `device`."""
    if FORCED is not None:
        return FORCED
    per_sm = pairs / _sms(device)
    return next((tuning for below, tuning in FEW_PAIRS if per_sm < below), MANY_PAIRS)


@dataclass(frozen=True)
class _Plan:
    """The host side of one attention launch, a function of shapes only (cached per shape, so a
    step's layers compute it once)."""

    num_splits: int
    keys_per_split: int  # the longest span, a row as long as the table; shorter rows split their own keys
    block_n: int
    num_warps: int
    group: int
    g_pad: int
    d_pad: int
    s_pad: int  # spans padded to a power of two: the merge's tile
    scratch: int  # float32 elements: partial outputs, then (max, sum) pairs
    ml_offset: int
    tickets: int  # int32 counters, one per (row, KV head); 0 where every row fits one span


_plans: dict[tuple, _Plan] = {}
# the prefetching twin of a decode launch with PDL, where prefetching is on, is compiled beside it
# (nothing compiles in a capture)
_attention_twins = pdl.prefetch_twins("attention")
_attention_launch = FastLaunch(_attention_kernel, twins=lambda c: _attention_twins(c) if c["WRITE_KV"] else [])


def _spans(capacity: int, groups: int, device: torch.device, tuning: Tuning) -> tuple[int, int]:
    """How many span programs each row gets, and the keys of the longest span (a row as long
    as the table; a multiple of the tuning's block_n): enough programs to fill the GPU at batch
    1, fewer as the batch grows. The count follows shapes only (the block table's width, rows,
    KV heads), never the step's lengths, so a CUDA graph recorded for a batch size stays right
    for every step of that size; the kernel divides each row's own keys over them."""
    block_n = tuning.block_n
    wanted = min(cdiv(tuning.programs_per_sm * _sms(device), max(1, groups)), MAX_SPLITS)
    splits = max(1, min(cdiv(capacity, block_n), wanted))
    keys = cdiv(cdiv(capacity, splits), block_n) * block_n
    return cdiv(capacity, keys), keys


def _plan(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, capacity: int, device: torch.device) -> _Plan:
    key = (rows, num_heads, num_kv_heads, head_dim, capacity, device, FORCED)
    plan = _plans.get(key)
    if plan is None:
        tuning = tuning_for(rows * num_kv_heads, device)
        num_splits, keys_per_split = _spans(capacity, rows * num_kv_heads, device, tuning)
        d_pad = max(16, next_power_of_2(head_dim))  # tl.dot takes at least 16
        group = num_heads // num_kv_heads
        partials = rows * num_heads * num_splits if num_splits > 1 else 0
        plan = _Plan(num_splits, keys_per_split, tuning.block_n, tuning.num_warps, group,
                     max(16, next_power_of_2(group)), d_pad, next_power_of_2(num_splits), max(1, partials * (d_pad + 2)),
                     partials * d_pad, rows * num_kv_heads if num_splits > 1 else 0)
        _plans[key] = plan
    return plan


def _check_cache(k_cache, v_cache) -> None:
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise AtomValueError("triton_paged_attention: the KV cache must be [blocks, block_size, kv_heads, dim], dim contiguous")


def writes_kv(meta) -> bool:
    """True when the attention launch can also write the step's keys and values: a decode step
    (one row per sequence, `max_seqlen_q` 1), where each row's only new key is its own. Rows
    of a longer query read keys that other rows write, so those steps launch the write first."""
    return getattr(meta, "max_seqlen_q", None) == 1


def _check_new_kv(new_kv, query, k_cache, meta) -> None:
    if not writes_kv(meta):
        raise AtomValueError("triton_paged_attention: new_kv needs a decode step's metadata (max_seqlen_q 1); "
                             "write the cache first (triton_write_kv) for longer queries")
    key, value = new_kv
    want = (query.shape[0], k_cache.shape[2], k_cache.shape[3])
    if tuple(key.shape) != want or tuple(value.shape) != want:
        raise AtomValueError(f"triton_paged_attention: new_kv must be [rows, kv_heads, dim] = {list(want)}, "
                             f"got {list(key.shape)} and {list(value.shape)}")


def _rope_args(rope, query) -> tuple:
    """(cos table, sin table, index, their row strides, rows, cos column, sin column, ROPE) for
    the kernel: ROPE 0 without `rope` (a RopeTable, ops/rope_attention.py), 1 where each row
    reads its own table row, 2 where an index gives it."""
    if rope is None:
        return query, query, query, 0, 0, 0, 0, 0, 0  # unread
    cos, sin, index, cos_first, sin_first = rope
    return (cos, sin, cos if index is None else index, cos.stride(0), sin.stride(0),
            min(cos.shape[0], sin.shape[0]), cos_first, sin_first, 1 if index is None else 2)


def _attention_launch_args(query, k_cache, v_cache, output, meta, scale: float, plan: _Plan, scratch, tickets,
                           new_kv=None, rope=None) -> tuple:
    """The one attention launch as (launcher, grid, args, constexprs, num_warps); `query`,
    `output` and `new_kv` (the step's key and value to write, or None) have a contiguous last
    dimension; with `rope` (a RopeTable, decode steps only) the query and new key are rotated."""
    rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = meta.block_tables
    kv_strides = k_cache.stride()
    key, value = new_kv if new_kv is not None else (query, query)  # unread without WRITE_KV
    cos, sin, index, stride_cos, stride_sin, rope_rows, cos_first, sin_first, rope_kind = _rope_args(rope, query)
    early = pdl.enabled(query.device)
    return (
        _attention_launch, (rows, num_kv_heads, plan.num_splits),
        (query, k_cache, v_cache, output, scratch, tickets, tables, meta.token_seq, meta.query_positions,
         key, value, meta.slot_mapping, cos, sin, index,
         query.stride(0), query.stride(1), output.stride(0), output.stride(1),
         kv_strides[0], kv_strides[1], kv_strides[2], tables.stride(0),
         key.stride(0), key.stride(1), value.stride(0), value.stride(1), stride_cos, stride_sin,
         scale, num_heads, num_kv_heads, plan.num_splits, plan.ml_offset, rope_rows, cos_first, sin_first),
        {"GROUP": plan.group, "G_PAD": plan.g_pad, "BLOCK_SIZE": block_size, "BLOCK_N": plan.block_n,
         "HEAD_DIM": head_dim, "D_PAD": plan.d_pad, "S_PAD": plan.s_pad, "IEEE": k_cache.dtype == torch.float32,
         "WRITE_KV": new_kv is not None, "PDL": early,
         "PREFETCH": new_kv is not None and pdl.prefetch(early, "attention"), "ROPE": rope_kind},
        plan.num_warps,
    )


def _plan_for(query, k_cache, meta) -> _Plan:
    rows, num_heads, head_dim = query.shape
    return _plan(rows, num_heads, k_cache.shape[2], head_dim, meta.block_tables.shape[1] * k_cache.shape[1], query.device)


def _check_rope(rope, new_kv, query) -> None:
    if rope is None:
        return
    if new_kv is None:
        raise AtomValueError("triton_paged_attention: rope rotates the step's new keys: it needs new_kv (a decode "
                             "step); rotate the query and keys first for longer queries")
    if any(t.dim() != 2 or t.stride(1) != 1 for t in rope[:2]):
        raise AtomValueError("triton_paged_attention: rope's cos and sin tables must be 2-D with contiguous columns")


def triton_paged_attention(query, k_cache, v_cache, output, meta, scale: float, new_kv=None, rope=None) -> None:
    """query/output [rows, heads, dim]; caches [blocks, block_size, kv_heads, dim]. One launch;
    with `new_kv` (key, value [rows, kv_heads, dim]) of a decode step (`writes_kv`) it also
    writes them to the cache at `meta.slot_mapping`; with `rope` (a RopeTable) it rotates the
    query and the new keys first (neox pairs)."""
    _check_cache(k_cache, v_cache)
    _check_rope(rope, new_kv, query)
    if new_kv is not None:
        _check_new_kv(new_kv, query, k_cache, meta)
        new_kv = tuple(t if t.stride(2) == 1 else t.contiguous() for t in new_kv)
    if query.stride(2) != 1:
        query = query.contiguous()
    target = output if output.stride(2) == 1 else torch.empty_like(output, memory_format=torch.contiguous_format)
    plan = _plan_for(query, k_cache, meta)
    scratch = torch.empty(plan.scratch, dtype=torch.float32, device=query.device)
    tickets = ticket_counters(plan.tickets, query.device)
    launch, grid, args, constexprs, warps = _attention_launch_args(query, k_cache, v_cache, target, meta, scale,
                                                                   plan, scratch, tickets, new_kv, rope)
    launch(grid, args, constexprs, num_warps=warps)
    if target is not output:
        output.copy_(target)


_bound_scratch: dict = {}
_tickets: dict = {}
_dirty_tickets: set = set()  # devices whose counters were made inside a capture (not yet zeroed)


def _shared_scratch(elements: int, device: torch.device) -> torch.Tensor:
    """A float32 scratch of at least `elements`, shared by every bound attention on `device`.
    Bound launches replay in stream order, one region after another, so they never overlap;
    a larger request makes a new buffer (bindings made earlier keep theirs alive)."""
    current = _bound_scratch.get(device)
    if current is None or current.numel() < elements:
        current = torch.empty(elements, dtype=torch.float32, device=device)
        _bound_scratch[device] = current
    return current


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def ticket_counters(elements: int, device: torch.device) -> torch.Tensor:
    """The int32 ticket counters of the attention on `device` (at least `elements`), zeroed
    once when made: each call leaves them at 0 (the merging program resets its counter), so
    every launch, bound or in a CUDA graph, finds them zeroed. Calls in stream order share them."""
    current = _tickets.get(device)
    if current is None or current.numel() < elements:
        # at least one counter per program a batch-1 launch aims for: a row count that splits its
        # keys has rows * kv_heads below that, so the buffer hardly ever grows
        size = max(elements, max(t.programs_per_sm for _, t in FEW_PAIRS) * _sms(device), 1024)
        current = torch.zeros(size, dtype=torch.int32, device=device)
        _tickets[device] = current
        if _capturing(device):  # the zeroing was recorded into the graph, not run
            _dirty_tickets.add(device)
    elif device in _dirty_tickets:  # made inside a capture: zero it (again, in a graph's own replay)
        current.zero_()
        if not _capturing(device):
            _dirty_tickets.discard(device)
    return current


def bind_paged_attention(query, k_cache, v_cache, output, meta, scale: float, new_kv=None,
                         rope=None) -> Optional[list]:
    """The attention (and with `new_kv` the KV write, with `rope` the rotation, as
    `triton_paged_attention`) on these exact tensors as bound launches (one, run once now), or
    None where it cannot be bound (a strided query, output, key or value, a Triton without
    direct launches)."""
    _check_cache(k_cache, v_cache)
    _check_rope(rope, new_kv, query)
    if new_kv is not None:
        _check_new_kv(new_kv, query, k_cache, meta)
    if query.stride(2) != 1 or output.stride(2) != 1 or any(t.stride(2) != 1 for t in new_kv or ()):
        return None
    plan = _plan_for(query, k_cache, meta)
    scratch = _shared_scratch(plan.scratch, query.device)
    tickets = ticket_counters(plan.tickets, query.device)
    launch, grid, args, constexprs, warps = _attention_launch_args(query, k_cache, v_cache, output, meta, scale,
                                                                   plan, scratch, tickets, new_kv, rope)
    bound = launch.bind(grid, args, constexprs, num_warps=warps)
    return None if bound is None else [bound]


_write_launch = FastLaunch(_write_kv_kernel)


def _write_kv_launch(key, value, kv_cache, slot_mapping) -> tuple:
    rows, heads, head_dim = key.shape
    k_cache = kv_cache[0].view(-1, heads, head_dim)
    v_cache = kv_cache[1].view(-1, heads, head_dim)
    return (
        (rows, 1, 1),
        (key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
         k_cache.stride(0), k_cache.stride(1)),
        {"HEADS": heads, "HEAD_DIM": head_dim, "H_PAD": next_power_of_2(heads), "D_PAD": next_power_of_2(head_dim)},
    )


def triton_write_kv(key, value, kv_cache, slot_mapping) -> None:
    """One launch for this step's keys and values ([rows, kv_heads, dim]) into the paged cache."""
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    grid, args, constexprs = _write_kv_launch(key, value, kv_cache, slot_mapping)
    _write_launch(grid, args, constexprs, num_warps=1)


def bind_write_kv(key, value, kv_cache, slot_mapping) -> Optional[Any]:
    """The KV write on these exact tensors as a bound launch (run once now), or None."""
    if key.stride(2) != 1 or value.stride(2) != 1:
        return None
    grid, args, constexprs = _write_kv_launch(key, value, kv_cache, slot_mapping)
    return _write_launch.bind(grid, args, constexprs, num_warps=1)
