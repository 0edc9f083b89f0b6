"""The Triton paged attention against the plain-torch reference, on CPU through Triton's
interpreter (TRITON_INTERPRET=1): paged KV, GQA groups of 1, 3 and 4, every length class
(1, inside one block, a block boundary, across spans), several batches, padding rows."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_compile.ops import attention as ref  # noqa: E402

from ..attention_reference import reference as _reference  # noqa: E402


@pytest.fixture(scope="module")
def tri():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/ops/test_interpreted.py"
    from atom_compile.ops import triton_attention

    return triton_attention


def _case(lengths, q_len, heads, kv_heads, dim, dtype, block_size=16, pad_seqs=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1
    num_blocks = len(lengths) * max_blocks + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    builder = ref.PagedAttentionMetadataBuilder(len(lengths) + pad_seqs, (len(lengths) + pad_seqs) * q_len,
                                                max_blocks, block_size)
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()  # scattered blocks
    steps = []
    for s, n in enumerate(lengths):
        table = perm[s * max_blocks:(s + 1) * max_blocks][: -(-n // block_size)]
        steps.append(ref.SequenceStep(token_ids=[1] * q_len, start_pos=n - q_len, block_table=table))
    _, _, meta, _ = builder.build(steps, padded_num_seqs=len(lengths) + pad_seqs)
    rows = meta.query_positions.shape[0]
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("lengths,q_len,pad", [([1], 1, 0), ([17, 16, 5], 1, 1), ([300], 1, 0),
                                               ([40, 9], 4, 0), ([2, 513], 1, 2)])
def test_matches_reference(tri, dtype, heads, kv_heads, lengths, q_len, pad):
    dim = 32 if heads != 6 else 24  # 24: a head size that is not a power of two
    q, k, v, cache, meta = _case(lengths, q_len, heads, kv_heads, dim, dtype, pad_seqs=pad)
    scale = dim ** -0.5
    want, cache_ref = _reference(q, k, v, cache, meta, scale)
    got = torch.full_like(q, float("nan"))
    cache_tri = cache.clone()
    tri.triton_write_kv(k, v, cache_tri, meta.slot_mapping)
    tri.triton_paged_attention(q, cache_tri[0], cache_tri[1], got, meta, scale)
    real = meta.slot_mapping >= 0
    assert torch.equal(cache_tri[:, :-1], cache_ref[:, :-1])  # the last block takes padding in the reference
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    assert torch.all(got[~real] == 0)  # padding rows see no key: zeros, never NaN


def _attend(tri, q, k, v, cache, meta, scale):
    """The reference and the Triton op on copies of `cache`: (want, got) for the real rows."""
    want, _ = _reference(q, k, v, cache, meta, scale)
    got = torch.full_like(q, float("nan"))
    tri.triton_write_kv(k, v, cache, meta.slot_mapping)
    tri.triton_paged_attention(q, cache[0], cache[1], got, meta, scale)
    return want, got


# 1 key; a span boundary (64 keys: one span of BLOCK_N at these sizes) and one past it; lengths
# that are no multiple of the block size; many spans; a batch mixing them with a padding row
LENGTHS = [[1], [64], [65], [37], [1000], [1, 64, 129, 1000, 37]]


# float16, not bfloat16: the interpreter's tl.dot reads bfloat16 operands as raw bits (Triton 3.9)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (8, 1, 128), (4, 4, 64)])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_one_launch_split_k_matches_reference(tri, monkeypatch, dtype, heads, kv_heads, dim, lengths):
    q, k, v, cache, meta = _case(lengths, 1, heads, kv_heads, dim, dtype, pad_seqs=1, seed=len(lengths) + dim)
    plan = tri._plan_for(q, cache[0], meta)
    assert plan.num_splits == -(-meta.block_tables.shape[1] * 16 // plan.keys_per_split)
    if max(lengths) > plan.keys_per_split:
        assert plan.num_splits > 1 and plan.tickets == q.shape[0] * kv_heads  # the merge path runs
    launches = []
    call = type(tri._attention_launch).__call__

    def counted(self, *args, **kwargs):
        launches.append(self)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(type(tri._attention_launch), "__call__", counted)
    want, got = _attend(tri, q, k, v, cache, meta, dim ** -0.5)
    assert launches[1:] == [tri._attention_launch]  # the KV write, then ONE attention launch
    real = meta.slot_mapping >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    assert torch.all(got[~real] == 0)
    assert int(tri._tickets[q.device].abs().sum()) == 0  # every ticket counter back at 0


def _row_span(n: int, plan) -> int:
    """Keys per span of a row of `n` keys: its keys over the launch's spans, in whole steps."""
    return max(1, -(-n // (plan.num_splits * plan.block_n))) * plan.block_n


@pytest.mark.parametrize("write_kv", [False, True])
def test_a_short_row_in_a_wide_table_spreads_its_keys_over_every_span(tri, write_kv):
    # an engine's block table is as wide as its longest sequence may be; the span count follows
    # that width, but each row divides its own keys over the spans (in whole steps of block_n)
    lengths = [1000, 16000, 1]
    q, k, v, cache, meta = _case(lengths, 1, 8, 2, 64, torch.float32, pad_seqs=1, seed=5)
    plan = tri._plan_for(q, cache[0], meta)
    scale = 0.125
    want, cache_ref = _reference(q, k, v, cache, meta, scale)
    if not write_kv:
        tri.triton_write_kv(k, v, cache, meta.slot_mapping)
    scratch = torch.full((plan.scratch,), float("nan"))  # what a span stores becomes finite
    got = torch.full_like(q, float("nan"))
    launch, grid, args, constexprs, warps = tri._attention_launch_args(
        q, cache[0], cache[1], got, meta, scale, plan, scratch, tri.ticket_counters(plan.tickets, q.device),
        (k, v) if write_kv else None)
    launch(grid, args, constexprs, num_warps=warps)
    stored = scratch[plan.ml_offset:].view(q.shape[0], q.shape[1], plan.num_splits, 2)[..., 0].isfinite()
    for row, n in enumerate(lengths):
        active = -(-n // _row_span(n, plan))
        assert int(stored[row, 0].sum()) == (active if active > 1 else 0), (row, n)  # one span: no partial
    # the 1000-key row takes more spans than the table's width alone would give it
    assert -(-1000 // _row_span(1000, plan)) > -(-1000 // plan.keys_per_split) > 1
    real = meta.slot_mapping >= 0
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.all(got[~real] == 0)
    assert torch.equal(cache[:, :-1], cache_ref[:, :-1])
    assert int(tri._tickets[q.device].abs().sum()) == 0


@pytest.mark.parametrize("tuning", [0, 1, "MANY_PAIRS"])
def test_every_tuning_matches_the_reference(tri, monkeypatch, tuning):
    # the rule picks by (rows x KV heads) per multiprocessor; force each one
    monkeypatch.setattr(tri, "FORCED", tri.MANY_PAIRS if tuning == "MANY_PAIRS" else tri.FEW_PAIRS[tuning][1])
    q, k, v, cache, meta = _case([1, 64, 129, 1000, 37], 1, 8, 2, 64, torch.float16, pad_seqs=1, seed=11)
    plan = tri._plan_for(q, cache[0], meta)
    assert (plan.block_n, plan.num_warps) == (tri.FORCED.block_n, tri.FORCED.num_warps) and plan.num_splits > 1
    want, got = _attend(tri, q, k, v, cache, meta, 0.125)
    real = meta.slot_mapping >= 0
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=2e-3, rtol=2e-3)
    assert int(tri._tickets[q.device].abs().sum()) == 0


def test_a_long_context_is_split_at_most_max_splits_ways_and_merged_in_one_tile(tri):
    # one row, one KV head: the GPU-filling split count is far above MAX_SPLITS, so the cap
    # sets the spans and the merge reads more than 32 partials per head at once
    q, k, v, cache, meta = _case([9000], 1, 4, 1, 32, torch.float32, seed=3)
    plan = tri._plan_for(q, cache[0], meta)
    assert 32 < plan.num_splits <= tri.MAX_SPLITS and plan.s_pad == 64
    want, got = _attend(tri, q, k, v, cache, meta, 32 ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert int(tri._tickets[q.device].abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_repeated_calls_restart_the_tickets_from_zero(tri, dtype):
    q, k, v, cache, meta = _case([700, 3, 200], 1, 8, 2, 64, dtype, seed=5)
    assert tri._plan_for(q, cache[0], meta).num_splits > 1
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):  # new queries and new keys each call: a stale counter would skip or repeat a merge
        q = torch.randn(q.shape, generator=gen).to(dtype)
        k = torch.randn(k.shape, generator=gen).to(dtype)
        want, got = _attend(tri, q, k, v, cache, meta, 0.125)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert int(tri._tickets[q.device].abs().sum()) == 0


def test_a_counter_left_nonzero_is_what_the_reset_prevents(tri):
    # the counters matter: a ticket counter that did not start at 0 makes the wrong program
    # merge (too early or never), so the output is wrong; this is what the reset keeps away
    q, k, v, cache, meta = _case([900], 1, 8, 2, 64, torch.float32, seed=3)
    want, got = _attend(tri, q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tri._tickets[q.device][:2] = 1
    try:
        q = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))  # new queries: stale partials differ
        want, got = _attend(tri, q, k, v, cache, meta, 0.125)
        assert not torch.allclose(got, want, atol=1e-3, rtol=1e-3)
    finally:
        tri._tickets[q.device].zero_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (8, 1, 128), (4, 4, 64)])
@pytest.mark.parametrize("lengths", LENGTHS + [[16, 17, 2]])
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_launch_that_also_writes_the_kv_matches_write_then_attend(tri, monkeypatch, dtype, heads, kv_heads, dim,
                                                                      lengths, prefetch):
    # decode: the row's own (new) key at position len-1 sits at a span's start, end or middle;
    # `prefetch`: the variant a CUDA graph records with PDL (each span's first tile read ahead)
    monkeypatch.setattr(tri.pdl, "prefetch", lambda early, kind: {"attention": prefetch}[kind])
    q, k, v, cache, meta = _case(lengths, 1, heads, kv_heads, dim, dtype, pad_seqs=1, seed=len(lengths) + 7)
    assert tri.writes_kv(meta)
    scale = dim ** -0.5
    want, cache_ref = _reference(q, k, v, cache, meta, scale)
    got = torch.full_like(q, float("nan"))
    cache_tri = cache.clone()
    tri.triton_paged_attention(q, cache_tri[0], cache_tri[1], got, meta, scale, new_kv=(k, v))
    assert torch.equal(cache_tri[:, :-1], cache_ref[:, :-1])  # the new keys and values, nothing else
    assert torch.equal(cache_tri[:, -1], cache[:, -1])  # padding rows write nothing
    real = meta.slot_mapping >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    assert torch.all(got[~real] == 0)
    assert int(tri._tickets[q.device].abs().sum()) == 0


def test_the_kv_writing_launch_refuses_a_step_with_longer_queries(tri):
    from atom_compile.errors import AtomValueError

    q, k, v, cache, meta = _case([40, 9], 4, 4, 4, 32, torch.float32)
    assert not tri.writes_kv(meta)
    with pytest.raises(AtomValueError, match="max_seqlen_q"):
        tri.triton_paged_attention(q, cache[0], cache[1], torch.empty_like(q), meta, 0.1, new_kv=(k, v))
    q, k, v, cache, meta = _case([40, 9], 1, 4, 4, 32, torch.float32)
    with pytest.raises(AtomValueError, match=r"\[rows, kv_heads, dim\]"):
        tri.triton_paged_attention(q, cache[0], cache[1], torch.empty_like(q), meta, 0.1, new_kv=(k[:, :2], v))
