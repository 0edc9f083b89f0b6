"""atom::qkv_rope_linear on the GPU, bf16 at decode shapes, against the built-in Llama's own
PyTorch (the projection, then its neox `_rotate` on the query's and key's heads): one row on the
epilogue GEMV (one launch), more rows on the projection and one rotation kernel."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)
pytest.importorskip("triton")

from atom_compile.models.llama import _rotate  # noqa: E402
from atom_compile.ops import rope_linear  # noqa: E402
from support.pass_checks import cuda_kernels  # noqa: E402

BF16 = torch.bfloat16


def _case(m, heads, kv_heads, head_dim, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(m, k, device="cuda", generator=g, dtype=BF16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=BF16) / k ** 0.5
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.randint(0, 8192, (m,), device="cuda", generator=g).float()[:, None] * inv
    table = torch.cat([freqs.cos(), freqs.sin()], -1)  # the built-in Llama's cos_sin_cache rows
    return x, w, table[:, :head_dim // 2], table[:, head_dim // 2:]


def _want(x, w, b, cos, sin, heads, kv_heads, head_dim):
    y = torch.nn.functional.linear(x, w, b)
    q, k = heads * head_dim, kv_heads * head_dim
    rq = _rotate(y[:, :q].reshape(-1, heads, head_dim), cos, sin).reshape(-1, q)
    rk = _rotate(y[:, q:q + k].reshape(-1, kv_heads, head_dim), cos, sin).reshape(-1, k)
    return torch.cat([rq, rk, y[:, q + k:]], 1)


@pytest.mark.parametrize("m", [1, 3, 64])
# Llama-3.2-1B's; Qwen2-7B's, with its qkv bias; a ragged one
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,bias", [(32, 8, 64, 2048, False), (28, 4, 128, 3584, True),
                                                            (5, 1, 32, 130, True)])
def test_the_op_matches_the_model(m, heads, kv_heads, head_dim, k, bias):
    x, w, cos, sin = _case(m, heads, kv_heads, head_dim, k, seed=m)
    b = torch.randn(w.shape[0], device="cuda", dtype=BF16) if bias else None
    got = rope_linear.op()(x, w, b, cos, sin, (heads + kv_heads) * head_dim, head_dim)
    torch.testing.assert_close(got, _want(x, w, b, cos, sin, heads, kv_heads, head_dim), atol=3e-2, rtol=3e-2)


def test_one_row_is_one_launch_and_more_rows_one_rotation_kernel():
    for m, most in ((1, 1), (4, 3)):  # four rows: the GEMM (or a split-K pair), then the rotation
        x, w, cos, sin = _case(m, 32, 8, 64, 2048)
        names = cuda_kernels(lambda: rope_linear.op()(x, w, None, cos, sin, 40 * 64, 64))
        assert len(names) <= most and sum("rope" in k for k in names) == 1, names
        assert not any("elementwise" in k.lower() or "cat" in k.lower() for k in names), names
