"""The one-launch split-K decode attention on a GPU: inside a captured CUDA graph replayed with
new queries, new cache contents and new lengths; bound (eager-region) launches; and many calls
at batch 1 and 8 over long contexts, where the spans of a row finish in any order, so a missing
release/acquire on the ticket or a counter not reset would show as a wrong row."""

from __future__ import annotations

import pytest
import torch

from atom_compile.ops import attention as ref

pytestmark = pytest.mark.cuda
tri = pytest.importorskip("atom_compile.ops.triton_attention")

BLOCK = 16


def _setup(rows: int, capacity: int, heads=32, kv_heads=8, dim=64, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = capacity // BLOCK
    num_blocks = rows * max_blocks + 1
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype).cuda()
    builder = ref.PagedAttentionMetadataBuilder(rows, rows, max_blocks, BLOCK, device="cuda")
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = [perm[s * max_blocks:(s + 1) * max_blocks] for s in range(rows)]
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype).cuda()
    return cache, builder, tables, q


def _step(builder, tables, lengths):
    """This step's metadata in the builder's persistent buffers (same addresses every step)."""
    steps = [ref.SequenceStep([1], n - 1, tables[s][: -(-n // BLOCK)]) for s, n in enumerate(lengths)]
    return builder.build(steps)[2]


def _want(q, cache, meta, scale):
    want = torch.zeros_like(q)
    ref._torch_paged_attention(q, cache[0], cache[1], want, meta, scale)
    return want


def _counters_zero(device) -> bool:
    return int(tri._tickets[device].abs().sum()) == 0


def test_one_launch_in_a_cuda_graph_replays_new_queries_keys_and_lengths():
    lengths = [[1, 1000, 64], [1024, 65, 3], [500, 1, 1023], [17, 999, 1024]]
    cache, builder, tables, q = _setup(3, 1024)
    meta = _step(builder, tables, lengths[0])
    scale = 64 ** -0.5
    out = torch.zeros_like(q)
    assert tri._plan_for(q, cache[0], meta).num_splits > 1  # the merge path is in the graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)
    gen = torch.Generator().manual_seed(1)
    for step in lengths[1:]:  # 3 replays: new queries, new cache contents, new lengths
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
        meta = _step(builder, tables, step)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _want(q, cache, meta, scale), rtol=2e-2, atol=2e-2)
        assert _counters_zero(q.device)


def test_bound_attention_is_one_launch_and_replays_new_data():
    cache, builder, tables, q = _setup(4, 2048, seed=2)
    meta = _step(builder, tables, [2048, 1, 700, 129])
    out = torch.zeros_like(q)
    bound = tri.bind_paged_attention(q, cache[0], cache[1], out, meta, 0.125)
    assert bound is not None and len(bound) == 1
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        bound[0]()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _want(q, cache, meta, 0.125), rtol=2e-2, atol=2e-2)
        assert _counters_zero(q.device)


@pytest.mark.parametrize("rows", [1, 8])
def test_many_calls_agree_with_the_reference(rows):
    # hundreds of launches with up to ~66 spans a row finishing in any order; every call's
    # output is compared, so one lost partial (ordering) or stale ticket shows
    cache, builder, tables, q = _setup(rows, 8192, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(1, 8193, (rows,), generator=gen).tolist()
    meta = _step(builder, tables, lengths)
    want = _want(q, cache, meta, 0.125)
    outs = [torch.empty_like(q) for _ in range(200)]
    for out in outs:
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, 0.125)
    torch.cuda.synchronize()
    for out in outs:
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert torch.equal(torch.stack(outs).amax(0), torch.stack(outs).amin(0))  # deterministic merge order
    assert _counters_zero(q.device)


def test_the_kv_writing_launch_in_a_cuda_graph_follows_decode_steps():
    # FULL-graph decode: each replay writes the step's keys and values and attends to them
    cache, builder, tables, q = _setup(3, 1024, seed=4)
    rows, kv_heads, dim = 3, cache.shape[3], cache.shape[4]
    k = torch.randn(rows, kv_heads, dim, device="cuda", dtype=cache.dtype)
    v = torch.randn_like(k)
    lengths = [63, 1, 1000]
    meta = _step(builder, tables, lengths)
    assert tri.writes_kv(meta)
    out, scale = torch.zeros_like(q), 0.125
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale, new_kv=(k, v))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale, new_kv=(k, v))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # each sequence one token longer (64, 65, ...: across a span boundary)
        lengths = [n + 1 for n in lengths]
        meta = _step(builder, tables, lengths)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        cache_want = cache.clone()
        ref.write_kv(k, v, cache_want, meta.slot_mapping)
        want = _want(q, cache_want, meta, scale)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(cache, cache_want, rtol=0, atol=0)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
        assert _counters_zero(q.device)


def test_a_region_bound_on_a_decode_step_replays_decode_as_one_launch_and_longer_queries_as_two(monkeypatch):
    import atom_compile as ac

    cache, builder, tables, q = _setup(3, 256, seed=6)
    k = torch.randn(3, cache.shape[3], cache.shape[4], device="cuda", dtype=cache.dtype)
    v = torch.randn_like(k)
    out = torch.zeros_like(q)
    calls = []
    op = ref.paged_attention_with_output
    monkeypatch.setattr(ref, "paged_attention_with_output", lambda *a: (calls.append(1), op(*a))[1])
    decode = _step(builder, tables, [100, 7, 200])
    from atom_compile.ops import attention_binds

    bound = attention_binds._bound_launches(q, k, v, out, cache, decode, 0.125)
    assert len(attention_binds._launches_for(bound, decode)) == 1 and len(bound[False]) == 2
    with ac.set_forward_context(decode):
        replay = ref.bind_paged_attention_with_output(q, k, v, out, cache, 0.125)
        assert replay is not None
    gen = torch.Generator().manual_seed(8)
    chunk = [ref.SequenceStep([1, 1], 101, tables[0][:7]), ref.SequenceStep([1], 201, tables[2][:13])]
    # the next decode step (the single launch), then the same three rows as one 2-token chunk and
    # one decode row (the same buffers, longer queries: the write launch, then the attention)
    kinds = []
    for build in (lambda: _step(builder, tables, [101, 8, 201]), lambda: builder.build(chunk)[2]):
        meta = build()
        kinds.append(meta.max_seqlen_q)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        cache_want = cache.clone()
        ref.write_kv(k, v, cache_want, meta.slot_mapping)
        want = _want(q, cache_want, meta, 0.125)
        with ac.set_forward_context(meta):
            replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(cache, cache_want, rtol=0, atol=0)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert kinds == [1, 2] and calls == []  # both replayed bound launches, not the op


def test_counters_first_made_inside_a_capture_are_zeroed_for_the_graph_and_after_it():
    cache, builder, tables, q = _setup(2, 1024, seed=9)
    meta = _step(builder, tables, [900, 300])
    out, scale = torch.zeros_like(q), 0.125
    tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)  # compiled before the capture
    torch.cuda.synchronize()
    saved = tri._tickets.pop(q.device)  # as if the first call of the process were captured
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)
        fresh = tri._tickets[q.device]
        assert fresh is not saved and q.device in tri._dirty_tickets
        fresh.fill_(7)  # garbage where the capture's zeroing has not run yet
        graph.replay()  # the graph zeroes its counters itself
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _want(q, cache, meta, scale), rtol=2e-2, atol=2e-2)
        fresh.fill_(7)
        out2 = torch.zeros_like(q)
        tri.triton_paged_attention(q, cache[0], cache[1], out2, meta, scale)  # outside: zeroed first
        torch.cuda.synchronize()
        torch.testing.assert_close(out2, out, rtol=0, atol=0)
        assert q.device not in tri._dirty_tickets and _counters_zero(q.device)
    finally:
        tri._tickets[q.device] = saved
        tri._dirty_tickets.discard(q.device)
