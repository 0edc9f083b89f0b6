"""The decode attention that rotates its query and new key (RoPE, neox pairs) itself, against
rotating with PyTorch and then the reference attention, on CPU through Triton's interpreter:
angles read at an index (a `cos_sin_cache[positions]` table, negative indices counting from the
end) or a row per token (separate cos and sin tensors), GQA, lengths across spans, padding
rows, with and without the prefetching variant."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_compile.ops.rope_attention import RopeTable, angles, rotate_heads  # noqa: E402

from ..attention_reference import reference as _reference  # noqa: E402
from .check_triton_attention import _case  # noqa: E402


@pytest.fixture(scope="module")
def tri():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/ops/test_interpreted.py"
    from atom_compile.ops import triton_attention

    return triton_attention


def _table(rows: int, dim: int, dtype, gen) -> torch.Tensor:
    """[rows, dim] cos then sin of random angles, as a model's cos_sin_cache."""
    theta = torch.rand(rows, dim // 2, generator=gen) * 6.3
    return torch.cat([theta.cos(), theta.sin()], dim=-1).to(dtype)


def _rope(kind: str, meta, dim: int, gen) -> RopeTable:
    rows = meta.query_positions.shape[0]
    if kind == "index":
        table = _table(64, dim, torch.float32, gen)
        index = torch.randint(-64, 64, (rows,), generator=gen)  # negative: from the end, as torch indexes
        return RopeTable(table, table, index, 0, dim // 2)
    cos = torch.randn(rows, dim + 6, generator=gen).to(torch.float16)  # a wider tensor: cos at columns 3..
    sin = torch.randn(rows, dim // 2, generator=gen).to(torch.float16)
    return RopeTable(cos, sin, None, 3, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 32), (6, 2, 24)])
@pytest.mark.parametrize("lengths", [[1], [65], [1, 64, 129, 1000, 37]])
@pytest.mark.parametrize("kind", ["index", "rows"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_rotating_in_the_launch_matches_rotating_first(tri, monkeypatch, dtype, heads, kv_heads, dim, lengths, kind,
                                                       prefetch):
    monkeypatch.setattr(tri.pdl, "prefetch", lambda early, k: {"attention": prefetch}[k])
    gen = torch.Generator().manual_seed(len(lengths) + dim)
    q, k, v, cache, meta = _case(lengths, 1, heads, kv_heads, dim, dtype, pad_seqs=1, seed=len(lengths) + 3)
    rope = _rope(kind, meta, dim, gen)
    cos, sin = angles(rope, q.shape[0], dim // 2)
    scale = dim ** -0.5
    want, cache_ref = _reference(rotate_heads(q, cos, sin), rotate_heads(k, cos, sin), v, cache, meta, scale)
    got = torch.full_like(q, float("nan"))
    cache_tri = cache.clone()
    tri.triton_paged_attention(q, cache_tri[0], cache_tri[1], got, meta, scale, new_kv=(k, v), rope=rope)
    real = meta.slot_mapping >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    # the rotated keys as the cache holds them (one rounding of float32 math: a last-bit difference at most)
    torch.testing.assert_close(cache_tri[:, :-1].float(), cache_ref[:, :-1].float(), atol=tol, rtol=tol)
    assert torch.equal(cache_tri[:, -1], cache[:, -1])  # padding rows write nothing
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    assert torch.all(got[~real] == 0)


def test_rope_needs_the_decode_launch_and_2d_tables(tri):
    from atom_compile.errors import AtomValueError

    q, k, v, cache, meta = _case([40, 9], 1, 4, 4, 32, torch.float32)
    table = _table(64, 32, torch.float32, torch.Generator().manual_seed(0))
    rope = RopeTable(table, table, meta.query_positions.long(), 0, 16)
    with pytest.raises(AtomValueError, match="new_kv"):
        tri.triton_paged_attention(q, cache[0], cache[1], torch.empty_like(q), meta, 0.1, rope=rope)
    flat = RopeTable(table.reshape(-1), table, None, 0, 16)
    with pytest.raises(AtomValueError, match="2-D"):
        tri.triton_paged_attention(q, cache[0], cache[1], torch.empty_like(q), meta, 0.1, new_kv=(k, v), rope=flat)
