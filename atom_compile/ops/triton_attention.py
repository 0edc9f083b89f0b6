"""Triton paged attention (CUDA): one program per (query row, query head).

Each program reads its row's sequence, position and block table from device tensors and walks
the cached keys 0..position in tiles of BLOCK_N, with an online softmax in float32. The launch
grid depends only on the row count, so a CUDA graph can record it: replays read the new
metadata at the same addresses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, token_seq_ptr, query_pos_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    scale,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    pos = tl.load(query_pos_ptr + row)
    out_row = out_ptr + row * stride_ot + head * stride_oh + offs_d
    if pos < 0:
        tl.store(out_row, tl.zeros([D_PAD], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=d_mask)
        return
    seq = tl.load(token_seq_ptr + row)
    kv_head = head // GROUP
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q = q * scale
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    n_keys = pos + 1
    for start in range(0, n_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_keys
        block = tl.load(tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        base = block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out_row, (acc / l_i).to(out_ptr.dtype.element_ty), mask=d_mask)


def triton_paged_attention(query, k_cache, v_cache, output, meta, scale: float) -> None:
    """query/output [rows, heads, dim]; caches [blocks, block_size, kv_heads, dim]."""
    rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("triton_paged_attention: the KV cache must be [blocks, block_size, kv_heads, dim], dim contiguous")
    if query.stride(2) != 1:
        query = query.contiguous()
    target = output if output.stride(2) == 1 else torch.empty_like(output, memory_format=torch.contiguous_format)
    grid = (rows, num_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, target, meta.block_tables, meta.token_seq, meta.query_positions,
        query.stride(0), query.stride(1), target.stride(0), target.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        scale,
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, BLOCK_N=64,
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
    if target is not output:
        output.copy_(target)
