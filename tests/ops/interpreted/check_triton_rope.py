"""The qkv GEMV with RoPE as its epilogue and the row-wise rotation (ops/triton_rope.py) against
the built-in Llama's own PyTorch (the projection rounded to the dtype, then its neox `_rotate` on
the query's and the key's heads), on CPU through Triton's interpreter (TRITON_INTERPRET=1):
GQA shapes, head_dim 16/64/128, ragged K (one step and a K loop), other block shapes, strided
cos and sin, fp16 and bf16; the value's columns are the projection's, bit for bit."""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def rope():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through TRITON_INTERPRET=1"
    from atom_compile.ops import triton_rope

    return triton_rope


def _angles(rows, head_dim, seed=0):
    """cos and sin [rows, head_dim / 2] of real positions (theta 10000), as float32 tables."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (rows,), generator=gen).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None] * inv[None, :]
    return freqs.cos(), freqs.sin()


def _reference(y, cos, sin, heads, kv_heads, head_dim):
    from atom_compile.models.llama import _rotate

    rows = y.shape[0]
    q, k = heads * head_dim, kv_heads * head_dim
    rq = _rotate(y[:, :q].reshape(rows, heads, head_dim), cos, sin).reshape(rows, q)
    rk = _rotate(y[:, q:q + k].reshape(rows, kv_heads, head_dim), cos, sin).reshape(rows, k)
    return torch.cat([rq, rk, y[:, q + k:]], dim=1)


def _close(got, want):
    """Within one rounding of the dtype: the GEMV sums K in another order than the reference."""
    tol = {F16: (2e-3, 4e-3), BF16: (1.6e-2, 1.6e-2)}[want.dtype]
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])


def _projection(x, w, b=None):
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _data(rows, heads, kv_heads, head_dim, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = (heads + 2 * kv_heads) * head_dim
    x = (torch.randn(rows, k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    return x, w


# the bias: Qwen2's qkv has one
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,dtype,bias", [
    (4, 2, 16, 48, F16, False), (4, 1, 64, 300, BF16, True), (2, 1, 128, 5000, F16, True),
    (8, 2, 64, 2048, BF16, False)])
def test_the_gemv_rotates_query_and_key_in_its_epilogue(rope, heads, kv_heads, head_dim, k, dtype, bias):
    x, w = _data(1, heads, kv_heads, head_dim, k, dtype)
    b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(8)).to(dtype) if bias else None
    cos, sin = _angles(1, head_dim)
    rotated = (heads + kv_heads) * head_dim
    y = _projection(x, w, b)
    want = _reference(y, cos, sin, heads, kv_heads, head_dim)
    for config in [rope.rope_config(k)] + ([(1, 64, 2), (8, 128, 4)] if k < 1000 else []):
        got = rope.qkv_rope(x, w, b, cos, sin, rotated, head_dim, config)
        _close(got, want)
        # the value's columns are the plain projection's (rounded once, never rotated)
        _close(got[:, rotated:], y[:, rotated:])


def test_nothing_rotated_is_the_plain_projection(rope):
    x, w = _data(1, 2, 1, 32, 96, BF16, seed=1)
    cos, sin = _angles(1, 32)
    got = rope.qkv_rope(x, w, None, cos, sin, 0, 32)
    _close(got, _projection(x, w))


def test_strided_cos_and_sin_halves_of_one_table(rope):
    x, w = _data(1, 4, 2, 16, 64, F16, seed=2)
    cos, sin = _angles(1, 16, seed=3)
    table = torch.cat([cos, sin], dim=-1)  # the built-in Llama's cos_sin_cache row
    rotated = 6 * 16
    got = rope.qkv_rope(x, w, None, table[:, :8], table[:, 8:], rotated, 16)
    _close(got, _reference(_projection(x, w), cos, sin, 4, 2, 16))


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,dtype", [(3, 4, 2, 16, F16), (8, 8, 2, 64, BF16),
                                                                (5, 2, 2, 128, BF16)])
def test_the_rows_kernel_rotates_in_place(rope, rows, heads, kv_heads, head_dim, dtype):
    x, w = _data(rows, heads, kv_heads, head_dim, 64, dtype, seed=4)
    y = _projection(x, w)
    cos, sin = _angles(rows, head_dim, seed=5)
    table = torch.cat([cos, sin], dim=-1)
    want = _reference(y, cos, sin, heads, kv_heads, head_dim)
    rotated = (heads + kv_heads) * head_dim
    assert rope.rope_rows(y, table[:, :head_dim // 2], table[:, head_dim // 2:], rotated, head_dim) is y
    _close(y, want)


def test_the_ops_pytorch_path_is_the_reference(rope):
    from atom_compile.ops.rope_linear import rotate

    x, w = _data(4, 4, 2, 16, 32, BF16, seed=6)
    y = _projection(x, w)
    cos, sin = _angles(4, 16, seed=7)
    torch.testing.assert_close(rotate(y, cos, sin, 96, 16), _reference(y, cos, sin, 4, 2, 16), atol=0, rtol=0)
