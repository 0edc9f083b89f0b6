"""The Triton kernels of the paged attention (ops/triton_attention.py launches them).

`_attention_kernel` is the decode attention in one launch, split along the keys
(flash-decoding): each program reduces one span of a row's context for one KV head and its
group of query heads; where a row's context spans several programs, each writes its partial
(max, sum, output) to a float32 scratch and takes a ticket from a per-(row, KV head) int32
counter, and the program that takes the last ticket merges the partials and sets the counter
back to 0, so the next call (or a CUDA graph's replay) finds it zeroed with no memset and no
second launch. With WRITE_KV (a decode step: one row per sequence) the same launch writes each
row's new key and value to the cache and attends to them from its inputs, so no program reads a
slot another is writing; with ROPE it first rotates the query and that key (neox pairs, the
angles from a table row: ops/rope_attention.py). `_write_kv_kernel` stores the step's keys and
values in the paged cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_then_release


@triton.jit
def _store_heads(out_ptr, row, heads, offs_d, g_mask, d_mask, stride_ot, stride_oh, acc, l_i):
    # the normalised output of the group's heads; a row that saw no key (padding) gets zeros
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _own_kv(new_k_ptr, new_v_ptr, slot_ptr, row, kv_head, offs_d, d_mask, own, stride_nkt, stride_nkh, stride_nvt,
            stride_nvh, cos, sin, ROPE: tl.constexpr, HALF: tl.constexpr):
    # the row's new key (rotated with ROPE) and value (the step's inputs) and its cache slot,
    # read where `own` (this program holds the row's own key); slot -1 elsewhere
    k_row = new_k_ptr + row * stride_nkt + kv_head * stride_nkh
    k = tl.load(k_row + offs_d, mask=d_mask & own, other=0.0)
    if ROPE:
        k = _rotate(k, tl.load(k_row + _partner(offs_d, HALF), mask=d_mask & own, other=0.0), cos, sin)
    v = tl.load(new_v_ptr + row * stride_nvt + kv_head * stride_nvh + offs_d, mask=d_mask & own, other=0.0)
    slot = tl.load(slot_ptr + row, mask=own, other=-1)
    return k, v, slot.to(tl.int64)


@triton.jit
def _partner(offs_d, HALF: tl.constexpr):
    # neox RoPE pairs column j with j + HALF within a head
    return tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)


@triton.jit
def _rotate(x, partner, cos, sin):
    # x rotated by the pairs' angles in float32, rounded back to x's dtype (as the models' RoPE);
    # `sin` carries the rotation's sign (-sin on the first half)
    turned = x.to(tl.float32) * cos + partner.to(tl.float32) * sin
    return turned.to(x.dtype)


@triton.jit
def _rope_angles(cos_ptr, sin_ptr, rope_idx_ptr, row, stride_cos, stride_sin, rope_rows, cos_first, sin_first,
                 offs_d, d_mask, HALF: tl.constexpr, ROPE: tl.constexpr):
    # the row's (cos, signed sin) over a head's columns, from the tables' row at rope_idx[row]
    # (ROPE 2: a negative index counts from the end, as torch indexing does) or at the row itself
    # (ROPE 1); an index past the table (a padding row's, say) reads cos 1, sin 0. Without ROPE,
    # placeholders that nothing reads
    cos = offs_d.to(tl.float32)
    sin = cos
    if ROPE != 0:
        if ROPE == 2:
            at = tl.load(rope_idx_ptr + row).to(tl.int64)
            at = tl.where(at < 0, at + rope_rows, at)
        else:
            at = row.to(tl.int64)
        ok = d_mask & (at >= 0) & (at < rope_rows)
        cos = tl.load(cos_ptr + at * stride_cos + cos_first + offs_d % HALF, mask=ok, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + at * stride_sin + sin_first + offs_d % HALF, mask=ok, other=0.0).to(tl.float32)
        sin = tl.where(offs_d < HALF, -sin, sin)
    return cos, sin


@triton.jit
def _store_own_kv(k_ptr, v_ptr, k, v, slot, kv_head, offs_d, d_mask, stride_kb, stride_ks, stride_kh,
                  BLOCK_SIZE: tl.constexpr):
    # the row's new key and value into its cache slot (padding rows, slot -1, write nothing)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kv_head * stride_kh + offs_d
        tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _attend_own_key(q, k, v, m_i, l_i, acc, dtype: tl.constexpr):
    # the online-softmax step for the row's own key, from the step's key and value rounded as
    # the cache will hold them (no program reads that slot of the cache while this one writes it)
    k = k.to(dtype).to(tl.float32)
    v = v.to(dtype).to(tl.float32)
    s = tl.sum(q.to(tl.float32) * k[None, :], axis=1)  # [G_PAD]
    m_new = tl.maximum(m_i, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + p[:, None] * v[None, :]
    l_i = l_i * alpha + p
    return m_new, l_i, acc


@triton.jit
def _scaled_query(q_ptr, offs, partner_offs, mask, scale, cos, sin, dtype: tl.constexpr, ROPE: tl.constexpr):
    q = tl.load(q_ptr + offs, mask=mask, other=0.0)
    if ROPE:
        q = _rotate(q, tl.load(q_ptr + partner_offs, mask=mask, other=0.0), cos[None, :], sin[None, :])
    return (q.to(tl.float32) * scale).to(dtype)


@triton.jit
def _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kv_head, start, end, offs_d, d_mask, stride_kb, stride_ks, stride_kh,
             stride_bt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # the cached keys and values [start, start + BLOCK_N) of one sequence, masked at `end`
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    block = tl.load(tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    base = block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v, n_mask


@triton.jit
def _online_step(q, k, v, n_mask, m_i, l_i, acc, IEEE: tl.constexpr):
    # one tile of the online softmax; the tile holds at least one unmasked key
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_PAD, BLOCK_N]
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _span_partial(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, first, end, offs_d, d_mask,
                  stride_kb, stride_ks, stride_kh, stride_bt, m_i, l_i, acc,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # the online softmax over the cached keys [first, end) of one sequence, from the running
    # (max, sum, output): the same
    for start in range(first, end, BLOCK_N):
        k, v, n_mask = _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kv_head, start, end, offs_d, d_mask,
                                stride_kb, stride_ks, stride_kh, stride_bt, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = _online_step(q, k, v, n_mask, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _publish_partial(acc_ptr, ml_ptr, ticket_ptr, slot, offs_d, g_mask, m_i, l_i, acc, D_PAD: tl.constexpr):
    # the span's partial to the scratch, then a ticket: every thread's stores come before the
    # ticket's release (CTA barrier, then a gpu-scope acq_rel add), and the program that takes
    # the last ticket acquires every span's partial with it
    tl.store(acc_ptr + slot[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(ml_ptr + slot * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + slot * 2 + 1, l_i, mask=g_mask)
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _merge_partials(acc_ptr, ml_ptr, out_ptr, row, num_heads, kv_head, num_splits, active, offs_d, d_mask,
                    stride_ot, stride_oh, GROUP: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    # the spans' partials of each head of the group, merged and stored: one [S_PAD, D_PAD] tile
    # per head (every span at once, a fixed reduction order: the same result whichever program
    # merges); the heads are unrolled, so their loads are all in flight together. .cg loads:
    # from L2, where the other programs' stores went, never a stale L1 line
    offs_s = tl.arange(0, S_PAD)
    s_mask = offs_s < active
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        part = (row * num_heads + head) * num_splits + offs_s
        m_s = tl.load(ml_ptr + part * 2, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ptr + part * 2 + 1, mask=s_mask, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(acc_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None],
                        other=0.0, cache_modifier=".cg")
        m_all = tl.max(m_s, axis=0)  # every active span saw a key: finite
        w = tl.exp(m_s - m_all)  # 0 for the masked spans
        l_all = tl.sum(l_s * w, axis=0)
        out = tl.sum(acc_s * w[:, None], axis=0) / l_all
        tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=d_mask)


# One program: one query row, one KV head with ALL its group's query heads (GQA: keys and values
# read once), one span of the context; heads padded to G_PAD >= 16 rows for tensor-core dots.
# WRITE_KV (decode steps, one row per sequence): the row's own key and value, new this step, are
# read from the inputs by the span holding them, attended and written to the cache by it (no
# program reads that slot: the others read the cache's keys [0, pos) only).
# PREFETCH (PDL and WRITE_KV, in a CUDA graph: ops/pdl.py prefetch): the step's metadata and the
# span's first tile of cached keys and values are read before the wait, while the kernel before
# runs; nothing that kernel writes (the query, the new key and value) is.
@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, acc_ptr, tickets_ptr, tables_ptr, token_seq_ptr, query_pos_ptr,
    new_k_ptr, new_v_ptr, slot_ptr, cos_ptr, sin_ptr, rope_idx_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cos, stride_sin,
    scale, num_heads, num_kv_heads, num_splits, ml_offset, rope_rows, cos_first, sin_first,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, IEEE: tl.constexpr, WRITE_KV: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, ROPE: tl.constexpr,
):
    if PDL and not PREFETCH:  # launched early: read nothing before the kernel before has finished
        wait_then_release()
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    span = tl.program_id(2)
    offs_d = tl.arange(0, D_PAD)
    offs_g = tl.arange(0, G_PAD)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    pos = tl.load(query_pos_ptr + row)
    seq = tl.load(token_seq_ptr + row)  # beside pos: the two loads in flight together
    n_keys = tl.maximum(pos + 1, 0)  # padding rows (position -1) see no key
    # the row's own keys over the launch's spans, in whole steps: a short row in a wide block
    # table still spreads over every span program (a span of the table's width / num_splits
    # would leave it to one program's loop of dependent steps: 1.7-2x slower at 1k keys)
    keys_per_split = tl.maximum(tl.cdiv(n_keys, num_splits * BLOCK_N), 1) * BLOCK_N  # one division
    active = tl.cdiv(tl.maximum(n_keys, 1), keys_per_split)  # spans that hold a key (1 for padding)
    if span < active:
        first = span * keys_per_split
        last = tl.minimum(n_keys, first + keys_per_split)
        # with WRITE_KV the cache holds keys [0, pos) and key pos is new
        cached_end = tl.minimum(last, pos) if WRITE_KV else last
        if PREFETCH:
            k0, v0, n0 = _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kv_head, first, cached_end, offs_d, d_mask,
                                  stride_kb, stride_ks, stride_kh, stride_bt, BLOCK_SIZE, BLOCK_N)
            if PDL:
                wait_then_release()
        # ROPE: the query and the new key are rotated here (neox pairs), not by a kernel before;
        # the angles after the wait (the kernel before may have written the index)
        cos, sin = _rope_angles(cos_ptr, sin_ptr, rope_idx_ptr, row, stride_cos, stride_sin, rope_rows, cos_first,
                                sin_first, offs_d, d_mask, HEAD_DIM // 2, ROPE)
        if WRITE_KV:  # the span holding the row's own key reads it with the query, not after a branch
            own = (pos >= first) & (pos < last)
            new_k, new_v, slot = _own_kv(new_k_ptr, new_v_ptr, slot_ptr, row, kv_head, offs_d, d_mask, own,
                                         stride_nkt, stride_nkh, stride_nvt, stride_nvh, cos, sin, ROPE,
                                         HEAD_DIM // 2)
        heads = kv_head * GROUP + offs_g
        q_rows = row * stride_qt + heads[:, None] * stride_qh
        q = _scaled_query(q_ptr, q_rows + offs_d[None, :], q_rows + _partner(offs_d, HEAD_DIM // 2)[None, :],
                          g_mask[:, None] & d_mask[None, :], scale, cos, sin, k_ptr.dtype.element_ty, ROPE)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        start = first
        if PREFETCH:
            if first < cached_end:  # the span holds a cached key (not only the row's new one)
                m_i, l_i, acc = _online_step(q, k0, v0, n0, m_i, l_i, acc, IEEE)
            start = first + BLOCK_N
        m_i, l_i, acc = _span_partial(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, start, cached_end, offs_d, d_mask,
                                      stride_kb, stride_ks, stride_kh, stride_bt, m_i, l_i, acc,
                                      BLOCK_SIZE, BLOCK_N, IEEE)
        if WRITE_KV:
            if own:
                m_i, l_i, acc = _attend_own_key(q, new_k, new_v, m_i, l_i, acc, k_ptr.dtype.element_ty)
                _store_own_kv(k_ptr, v_ptr, new_k, new_v, slot, kv_head, offs_d, d_mask, stride_kb, stride_ks,
                              stride_kh, BLOCK_SIZE)
        _finish_span(out_ptr, acc_ptr, tickets_ptr, row, heads, kv_head, span, active, num_heads, num_kv_heads,
                     num_splits, ml_offset, offs_d, g_mask, d_mask, stride_ot, stride_oh, m_i, l_i, acc,
                     GROUP, S_PAD, D_PAD)


@triton.jit
def _finish_span(out_ptr, acc_ptr, tickets_ptr, row, heads, kv_head, span, active, num_heads, num_kv_heads,
                 num_splits, ml_offset, offs_d, g_mask, d_mask, stride_ot, stride_oh, m_i, l_i, acc,
                 GROUP: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    if active == 1:  # the whole row in one span: no partials, no ticket
        _store_heads(out_ptr, row, heads, offs_d, g_mask, d_mask, stride_ot, stride_oh, acc, l_i)
    else:
        ml_ptr = acc_ptr + ml_offset  # the partial maxima and sums follow the partial outputs
        ticket_ptr = tickets_ptr + row * num_kv_heads + kv_head
        ticket = _publish_partial(acc_ptr, ml_ptr, ticket_ptr, (row * num_heads + heads) * num_splits + span,
                                  offs_d, g_mask, m_i, l_i, acc, D_PAD)
        if ticket == active - 1:  # the last span of (row, kv head) to finish merges them all
            tl.store(ticket_ptr, 0)  # every span has taken its ticket: ready for the next call
            _merge_partials(acc_ptr, ml_ptr, out_ptr, row, num_heads, kv_head, num_splits, active,
                            offs_d, d_mask, stride_ot, stride_oh, GROUP, S_PAD, D_PAD)


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
