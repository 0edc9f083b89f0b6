"""Content keys of constant tensors: hashed from their bytes with torch alone (no numpy)."""

from __future__ import annotations

import struct

import pytest
import torch
import torch.fx as fx

from atom_compile.cache import keys


@pytest.mark.parametrize("make,expected", [
    (lambda: torch.tensor([1.0, 2.0]), struct.pack("=2f", 1.0, 2.0)),
    (lambda: torch.tensor(1.5), struct.pack("=f", 1.5)),                             # 0-dim
    (lambda: torch.tensor(1.0, dtype=torch.bfloat16), struct.pack("=H", 0x3F80)),    # 0-dim bf16
    (lambda: torch.tensor([1.0, -2.0], dtype=torch.bfloat16), struct.pack("=2H", 0x3F80, 0xC000)),
    (lambda: torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, ::2], struct.pack("=4q", 0, 2, 3, 5)),
    (lambda: torch.arange(4, dtype=torch.int32)[1:], struct.pack("=3i", 1, 2, 3)),  # storage offset
    (lambda: torch.arange(4, dtype=torch.int16).reshape(2, 2).t(), struct.pack("=4h", 0, 2, 1, 3)),
    (lambda: torch.tensor([True, False]), b"\x01\x00"),
    (lambda: torch.empty(0, 3), b""),
])
def test_tensor_bytes_are_the_elements_in_c_order(make, expected):
    assert keys._tensor_bytes(make()) == expected


def test_tensor_bytes_of_a_conjugated_complex_view_are_its_values():
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert keys._tensor_bytes(z.conj()) == struct.pack("=2f", 1.0, -2.0)


class _WithConstant(torch.nn.Module):
    def __init__(self, constant: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("c", constant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_hashes_0dim_and_bf16_constants_by_value(dtype):
    def fingerprint(value: float) -> str:
        return keys.graph_fingerprint(fx.symbolic_trace(_WithConstant(torch.tensor(value, dtype=dtype))))

    one = fingerprint(2.0)
    assert "get_attr tensor(" in one and "empty" not in one
    assert one == fingerprint(2.0)
    assert one != fingerprint(3.0)
