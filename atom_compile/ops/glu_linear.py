"""`atom::gate_up_silu_mul`: an MLP's gate and up projections with the SiLU-and-mul after them.

silu(x @ gate_weight.T) * (x @ up_weight.T): the two weights are a merged gate_up weight's two
row blocks (vLLM's and the built-in Llama's layout) or two weights of their own (transformers').
The GLU pass (backends/glu_pass.py) puts it where a CUDA piece has that computation. One row
takes the Triton GEMV with the activation as its epilogue (ops/triton_glu.py: one launch);
more rows take the projections as `atom::small_m_linear` decides them (one GEMM where the two
weights are one merged block) and then one SiLU-and-mul kernel, the launches Inductor would
have made; off CUDA, PyTorch itself. Results round where the model's own ops round.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op, registered_op
from .linear import small_m_linear
from .triton_present import triton_available

OP_NAME = "gate_up_silu_mul"
NAMESPACE = "atom"


def _merged(first: torch.Tensor, second: torch.Tensor) -> Optional[torch.Tensor]:
    """`first` and `second` as one [2n, k] weight where `second`'s rows follow `first`'s in one
    storage with the same strides (a merged weight's two halves), else None."""
    if first.stride() != second.stride() or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    if second.storage_offset() != first.storage_offset() + first.shape[0] * first.stride(0):
        return None
    return first.as_strided((2 * first.shape[0], first.shape[1]), first.stride())


def _projections(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = gate_weight.shape[0]
    for first, second, swapped in ((gate_weight, up_weight, False), (up_weight, gate_weight, True)):
        merged = _merged(first, second)
        if merged is not None:  # one GEMM reads both halves, as the model's own gate_up did
            both = small_m_linear(x, merged, None)
            lo, hi = both[..., :n], both[..., n:]
            return (hi, lo) if swapped else (lo, hi)
    return small_m_linear(x, gate_weight, None), small_m_linear(x, up_weight, None)


def gate_up_silu_mul(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    n = gate_weight.shape[0]
    if x.is_cuda and triton_available():
        from . import triton_glu, triton_rowwise

        if triton_glu.supported(flat, gate_weight, up_weight):
            return triton_glu.gate_up_silu_mul(flat, gate_weight, up_weight).reshape(*x.shape[:-1], n)
        gate, up = _projections(flat, gate_weight, up_weight)
        if flat.shape[0] and triton_rowwise.silu_mul_supported(gate, up):
            return triton_rowwise.silu_mul(gate, up).reshape(*x.shape[:-1], n)
    else:
        gate, up = _projections(flat, gate_weight, up_weight)
    return (torch.nn.functional.silu(gate) * up).reshape(*x.shape[:-1], n)


def _fake(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], gate_weight.shape[0]))


def _register() -> None:
    if registered_op(f"{NAMESPACE}::{OP_NAME}") is not None:
        return
    direct_register_custom_op(OP_NAME, gate_up_silu_mul, mutates_args=[], fake_impl=_fake,
                              target_lib=_library(NAMESPACE))  # kept alive there: a freed Library unregisters


_register()


def op() -> torch._ops.OpOverload:
    """The registered op's default overload."""
    return torch.ops.atom.gate_up_silu_mul.default
