"""The Triton paged attention against the plain-torch reference, on CPU through Triton's
interpreter (TRITON_INTERPRET=1): paged KV, GQA groups of 1, 3 and 4, every length class
(1, inside one block, a block boundary, across spans), several batches, padding rows."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_compile.ops import attention as ref  # noqa: E402


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
    want = torch.zeros_like(q)
    cache_ref = cache.clone()
    ref.write_kv(k, v, cache_ref, meta.slot_mapping)
    ref._torch_paged_attention(q, cache_ref[0], cache_ref[1], want, meta, scale)
    got = torch.full_like(q, float("nan"))
    cache_tri = cache.clone()
    tri.triton_write_kv(k, v, cache_tri, meta.slot_mapping)
    tri.triton_paged_attention(q, cache_tri[0], cache_tri[1], got, meta, scale)
    real = meta.slot_mapping >= 0
    assert torch.equal(cache_tri[:, :-1], cache_ref[:, :-1])  # the last block takes padding in the reference
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    assert torch.all(got[~real] == 0)  # padding rows see no key: zeros, never NaN
