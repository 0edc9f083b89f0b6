"""Triton paged attention (CUDA), split along the keys (flash-decoding).

Each program takes one query row, one KV head with every query head of its group (GQA: each
cached key and value is read once per group, and both products are tensor-core dots) and one
span of the cached keys (as many spans as fill the GPU at that batch, _spans): it reads the row's sequence, position and block table from
device tensors and keeps an online softmax in float32. A second kernel merges the spans. Every launch grid depends only on the
row count and the block table's width, never on host data, so a CUDA graph records it and
replays read the new metadata at the same addresses. Splitting the keys keeps the GPU busy at
batch 1, where one program per head would leave most multiprocessors idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from ..errors import AtomValueError
from .triton_launch import FastLaunch, cdiv, next_power_of_2

PROGRAMS_PER_SM = 4  # span programs to aim for, per multiprocessor
_SMS: dict = {}
BLOCK_N = 64


@triton.jit
def _attention_span_kernel(
    q_ptr, k_ptr, v_ptr, acc_ptr, tables_ptr, token_seq_ptr, query_pos_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    scale, num_heads, num_splits, keys_per_split, ml_offset,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    # One program: one query row, one KV head with ALL the query heads of its group (GQA: the
    # keys and values are read once for the group), one span of the context. The group's
    # heads are padded to G_PAD >= 16 rows so both products run as tensor-core dots.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    span = tl.program_id(2)
    ml_ptr = acc_ptr + ml_offset  # the partial maxima and sums follow the partial outputs
    offs_d = tl.arange(0, D_PAD)
    offs_g = tl.arange(0, G_PAD)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    pos = tl.load(query_pos_ptr + row)
    n_keys = tl.maximum(pos + 1, 0)  # padding rows (position -1) see no key
    first = span * keys_per_split
    last = tl.minimum(n_keys, first + keys_per_split)
    seq = tl.load(token_seq_ptr + row)
    heads = kv_head * GROUP + offs_g
    q_off = row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = (q * scale).to(k_ptr.dtype.element_ty)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < last
        block = tl.load(tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        base = block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    slot = (row * num_heads + heads) * num_splits + span  # [G_PAD]
    tl.store(acc_ptr + slot[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(ml_ptr + slot * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + slot * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _merge_spans_kernel(
    acc_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits, ml_offset,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    ml_ptr = acc_ptr + ml_offset
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    slot = (row * num_heads + head) * num_splits + offs_s
    m = tl.load(ml_ptr + slot * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(ml_ptr + slot * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(l * w, axis=0)
    acc = tl.load(acc_ptr + slot[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    merged = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class _Plan:
    """The host side of one attention launch, a function of shapes only (cached per shape, so a
    step's layers compute it once)."""

    num_splits: int
    keys_per_split: int
    group: int
    g_pad: int
    d_pad: int
    splits_pad: int
    scratch: int  # float32 elements: partial outputs, then (max, sum) pairs
    ml_offset: int


_plans: dict[tuple, _Plan] = {}
_span_launch = FastLaunch(_attention_span_kernel)
_merge_launch = FastLaunch(_merge_spans_kernel)


def _spans(capacity: int, groups: int, device: torch.device) -> tuple[int, int]:
    """How many spans to split each row's keys into, and keys per span (a multiple of BLOCK_N):
    enough programs to fill the GPU at batch 1, fewer and longer spans as the batch grows. It
    follows shapes only (the block table's width, rows, KV heads), never the step's lengths,
    so a CUDA graph recorded for a batch size stays right for every step of that size."""
    if device not in _SMS:
        cuda = device.type == "cuda"
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    wanted = cdiv(PROGRAMS_PER_SM * _SMS[device], max(1, groups))
    splits = max(1, min(cdiv(capacity, BLOCK_N), wanted))
    keys = cdiv(cdiv(capacity, splits), BLOCK_N) * BLOCK_N
    return cdiv(capacity, keys), keys


def _plan(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, capacity: int, device: torch.device) -> _Plan:
    key = (rows, num_heads, num_kv_heads, head_dim, capacity, device)
    plan = _plans.get(key)
    if plan is None:
        num_splits, keys_per_split = _spans(capacity, rows * num_kv_heads, device)
        d_pad = max(16, next_power_of_2(head_dim))  # tl.dot takes at least 16
        group = num_heads // num_kv_heads
        partials = rows * num_heads * num_splits
        plan = _Plan(num_splits, keys_per_split, group, max(16, next_power_of_2(group)), d_pad,
                     next_power_of_2(num_splits), partials * (d_pad + 2), partials * d_pad)
        _plans[key] = plan
    return plan


def _check_cache(k_cache, v_cache) -> None:
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise AtomValueError("triton_paged_attention: the KV cache must be [blocks, block_size, kv_heads, dim], dim contiguous")


def _attention_launches(query, k_cache, v_cache, output, meta, scale: float, plan: _Plan, scratch) -> list:
    """The span and merge launches as (launcher, grid, args, constexprs, num_warps); `query`
    and `output` have a contiguous last dimension."""
    rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = meta.block_tables
    kv_strides = k_cache.stride()
    span = (
        _span_launch, (rows, num_kv_heads, plan.num_splits),
        (query, k_cache, v_cache, scratch, tables, meta.token_seq, meta.query_positions,
         query.stride(0), query.stride(1), kv_strides[0], kv_strides[1], kv_strides[2], tables.stride(0),
         scale, num_heads, plan.num_splits, plan.keys_per_split, plan.ml_offset),
        {"GROUP": plan.group, "G_PAD": plan.g_pad, "BLOCK_SIZE": block_size, "BLOCK_N": BLOCK_N,
         "HEAD_DIM": head_dim, "D_PAD": plan.d_pad, "IEEE": k_cache.dtype == torch.float32},
        4,
    )
    merge = (
        _merge_launch, (rows, num_heads, 1),
        (scratch, output, output.stride(0), output.stride(1), num_heads, plan.num_splits, plan.ml_offset),
        {"HEAD_DIM": head_dim, "D_PAD": plan.d_pad, "SPLITS_PAD": plan.splits_pad},
        1 if plan.num_splits <= 16 else 4,
    )
    return [span, merge]


def _plan_for(query, k_cache, meta) -> _Plan:
    rows, num_heads, head_dim = query.shape
    return _plan(rows, num_heads, k_cache.shape[2], head_dim, meta.block_tables.shape[1] * k_cache.shape[1], query.device)


def triton_paged_attention(query, k_cache, v_cache, output, meta, scale: float) -> None:
    """query/output [rows, heads, dim]; caches [blocks, block_size, kv_heads, dim]."""
    _check_cache(k_cache, v_cache)
    if query.stride(2) != 1:
        query = query.contiguous()
    target = output if output.stride(2) == 1 else torch.empty_like(output, memory_format=torch.contiguous_format)
    plan = _plan_for(query, k_cache, meta)
    scratch = torch.empty(plan.scratch, dtype=torch.float32, device=query.device)
    for launch, grid, args, constexprs, warps in _attention_launches(query, k_cache, v_cache, target, meta, scale, plan, scratch):
        launch(grid, args, constexprs, num_warps=warps)
    if target is not output:
        output.copy_(target)


_bound_scratch: dict = {}


def _shared_scratch(elements: int, device: torch.device) -> torch.Tensor:
    """A float32 scratch of at least `elements`, shared by every bound attention on `device`.
    Bound launches replay in stream order, one region after another, so they never overlap;
    a larger request makes a new buffer (bindings made earlier keep theirs alive)."""
    current = _bound_scratch.get(device)
    if current is None or current.numel() < elements:
        current = torch.empty(elements, dtype=torch.float32, device=device)
        _bound_scratch[device] = current
    return current


def bind_paged_attention(query, k_cache, v_cache, output, meta, scale: float) -> Optional[list]:
    """The attention on these exact tensors as bound launches (run once now), or None where it
    cannot be bound (a strided query or output, a Triton without direct launches)."""
    _check_cache(k_cache, v_cache)
    if query.stride(2) != 1 or output.stride(2) != 1:
        return None
    plan = _plan_for(query, k_cache, meta)
    scratch = _shared_scratch(plan.scratch, query.device)
    bound = [launch.bind(grid, args, constexprs, num_warps=warps)
             for launch, grid, args, constexprs, warps in _attention_launches(query, k_cache, v_cache, output, meta, scale, plan, scratch)]
    return None if any(b is None for b in bound) else bound


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:  # padding rows (slot -1) write nothing
        offs_h = tl.arange(0, H_PAD)[:, None]
        offs_d = tl.arange(0, D_PAD)[None, :]
        mask = (offs_h < HEADS) & (offs_d < HEAD_DIM)
        k = tl.load(k_ptr + row * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
        v = tl.load(v_ptr + row * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        dst = slot.to(tl.int64) * stride_cs + offs_h * stride_ch + offs_d
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


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
