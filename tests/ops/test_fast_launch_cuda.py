"""The direct Triton launch (ops/triton_launch.py) on a GPU: after the first call of a
specialisation, later calls skip Triton's JIT path and still compute what the reference does,
with new data, new addresses, and an address whose alignment differs (a new specialisation)."""

from __future__ import annotations

import pytest
import torch

from atom_compile.ops import attention as ref

from .attention_reference import reference as _reference

pytestmark = pytest.mark.cuda
tri = pytest.importorskip("atom_compile.ops.triton_attention")


def _case(seed: int, lengths=(5, 130, 1025), heads=32, kv_heads=8, dim=64, block_size=16):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1
    num_blocks = len(lengths) * max_blocks + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(torch.bfloat16).cuda()
    builder = ref.PagedAttentionMetadataBuilder(len(lengths), len(lengths), max_blocks, block_size, device="cuda")
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    steps = [ref.SequenceStep([1], n - 1, perm[s * max_blocks:(s + 1) * max_blocks][: -(-n // block_size)])
             for s, n in enumerate(lengths)]
    _, _, meta, _ = builder.build(steps)
    rows = len(lengths)
    q = torch.randn(rows, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(torch.bfloat16).cuda()
    return q, k, v, cache, meta


def _both(q, k, v, cache, meta):
    scale = q.shape[-1] ** -0.5
    want, cache_ref = _reference(q, k, v, cache, meta, scale)
    got = torch.full_like(q, float("nan"))
    cache_tri = cache.clone()
    tri.triton_write_kv(k, v, cache_tri, meta.slot_mapping)
    tri.triton_paged_attention(q, cache_tri[0], cache_tri[1], got, meta, scale)
    torch.testing.assert_close(cache_tri, cache_ref, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_direct_launch_after_the_first_call_matches_the_reference():
    for seed in range(4):  # seed 0 compiles (JIT path), the others launch directly
        _both(*_case(seed))
    assert tri._attention_launch.direct and tri._write_launch.direct
    assert len(tri._attention_launch.compiled) >= 1


def test_a_misaligned_view_is_a_new_specialisation_and_still_right():
    q, k, v, cache, meta = _case(7)
    _both(q, k, v, cache, meta)
    before = len(tri._attention_launch.compiled)
    wide = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = wide[1:].view(q.shape)  # 2 bytes off a 16-byte boundary
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 != 0
    _both(shifted, k, v, cache, meta)
    assert len(tri._attention_launch.compiled) == before + 1


def test_direct_launch_records_in_a_cuda_graph():
    q, k, v, cache, meta = _case(3)
    _both(q, k, v, cache, meta)  # compiled and cached before the capture
    scale = q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)  # warm on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        tri.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)
    q.copy_(torch.randn_like(q))
    graph.replay()
    want = torch.zeros_like(q)
    ref._torch_paged_attention(q, cache[0], cache[1], want, meta, scale)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_a_bound_region_replays_new_data_and_falls_back_when_the_cache_moves(monkeypatch):
    import types

    import atom_compile as ac

    q, k, v, cache, meta = _case(11)
    scale = q.shape[-1] ** -0.5
    layer = types.SimpleNamespace(kv_cache=cache.clone(), scale=scale)
    out = torch.zeros_like(q)
    calls = []
    op = ref.unified_attention_with_output
    monkeypatch.setattr(ref, "unified_attention_with_output", lambda *a: (calls.append(1), op(*a))[1])
    with ac.set_forward_context(meta, no_compile_layers={"layer.0": layer}):
        replay = ref.bind_unified_attention(q, k, v, out, "layer.0")
        assert replay is not None
        for seed in (1, 2):  # new data in the bound tensors: the bound launches see it
            gen = torch.Generator().manual_seed(seed)
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            want, cache_want = _reference(q, k, v, layer.kv_cache, meta, scale)
            replay()
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(layer.kv_cache, cache_want, rtol=0, atol=0)
        assert calls == []  # bound: the op's Python did not run
        layer.kv_cache = cache.clone() * 0.5  # the engine reallocated its cache: new address
        want, cache_want = _reference(q, k, v, layer.kv_cache, meta, scale)
        replay()
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(layer.kv_cache, cache_want, rtol=0, atol=0)
        assert calls == [1]  # what it bound no longer holds: the op ran instead


def test_a_specialisation_first_seen_after_warmup_is_counted_and_warned(caplog):
    import logging

    import atom_compile as ac
    from atom_compile import compilation_counter
    from atom_compile.ops import jit_watch

    caplog.set_level(logging.WARNING, logger="atom_compile")
    _both(*_case(0))  # the warm-up's specialisation
    ac.mark_warmed_up()
    try:
        with compilation_counter.expect(num_triton_compiles_after_warmup=0):
            _both(*_case(1))  # the same specialisation, new data: nothing compiles
        before = compilation_counter.num_triton_compiles_after_warmup
        _both(*_case(2, heads=12, kv_heads=4, dim=48))  # a head size the warm-up never saw
        assert compilation_counter.num_triton_compiles_after_warmup - before >= 2  # KV write + attention
        warned = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
        assert any("_attention_kernel" in w and "(3, 12, 48) bfloat16" in w for w in warned), warned
    finally:
        jit_watch.stop_watching()
