"""`atom::qkv_rope_linear`: a qkv projection with rotary embeddings (RoPE, neox style) applied to
its query and key columns.

y = x @ weight.T (+ bias), then each head of head_dim among y's first `rotated` columns (the query's and
the key's heads; the value's come after them) has its pairs (j, j + head_dim / 2) rotated by
the angle whose cos and sin are cos[t, j] and sin[t, j]:
    y[j] * cos - y[j + half] * sin,  y[j + half] * cos + y[j] * sin
computed in float32 on the projection rounded to y's dtype, as the models' RoPE computes. The
RoPE pass (backends/rope_pass.py) puts it where a CUDA piece has that computation. One row takes
the Triton GEMV with the rotation as its epilogue (ops/triton_rope.py: one launch); more rows
take the projection as `atom::small_m_linear` decides it and one rotation kernel; off CUDA,
PyTorch itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op
from .linear import small_m_linear
from .triton_present import triton_available

OP_NAME = "qkv_rope_linear"
NAMESPACE = "atom"


def rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, head_dim: int) -> torch.Tensor:
    """y [rows, columns] with its first `rotated` columns rotated per head (PyTorch, out of place)."""
    rows, half = y.shape[0], head_dim // 2
    heads = y[:, :rotated].float().reshape(rows, rotated // head_dim, 2, half)
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    a, b = heads[:, :, 0], heads[:, :, 1]
    turned = torch.stack([a * c - b * s, b * c + a * s], dim=2).reshape(rows, rotated).to(y.dtype)
    return torch.cat([turned, y[:, rotated:]], dim=1)


def _check(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int,
           head_dim: int) -> None:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if head_dim <= 0 or head_dim % 2 or rotated < 0 or rotated % head_dim or rotated > weight.shape[0]:
        raise ValueError(f"atom::{OP_NAME}: rotated={rotated} must be whole heads of an even head_dim={head_dim} "
                         f"within the weight's {weight.shape[0]} rows")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or tuple(t.shape) != (rows, head_dim // 2):
            raise ValueError(f"atom::{OP_NAME}: {name} is {tuple(t.shape)}, not (rows, head_dim / 2) = "
                             f"{(rows, head_dim // 2)}")


def qkv_rope_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor,
                    sin: torch.Tensor, rotated: int, head_dim: int) -> torch.Tensor:
    _check(x, weight, cos, sin, rotated, head_dim)
    flat = x.reshape(-1, x.shape[-1])
    shape = (*x.shape[:-1], weight.shape[0])
    if x.is_cuda and triton_available():
        from . import triton_rope

        if triton_rope.supported(flat, weight, bias, cos, sin, head_dim):
            return triton_rope.qkv_rope(flat, weight, bias, cos, sin, rotated, head_dim).reshape(shape)
        y = small_m_linear(flat, weight, bias)
        if rotated and triton_rope.rows_supported(y, cos, sin, rotated, head_dim):
            return triton_rope.rope_rows(y, cos, sin, rotated, head_dim).reshape(shape)
    else:
        y = small_m_linear(flat, weight, bias)
    return rotate(y, cos, sin, rotated, head_dim).reshape(shape)


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
          rotated: int, head_dim: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# registered once (a second import finds the same schema and changes nothing); the Library
# keeps it, and a freed Library would unregister it
_PACKET = direct_register_custom_op(OP_NAME, qkv_rope_linear, mutates_args=[], fake_impl=_fake,
                                    target_lib=_library(NAMESPACE))


def op() -> torch._ops.OpOverload:
    """The registered op's default overload."""
    return _PACKET.default
