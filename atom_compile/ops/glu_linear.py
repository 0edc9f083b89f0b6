"""`atom::gate_up_glu`: a gated MLP's gate and up projections with the activation-and-mul after
them (SwiGLU: SiLU; GeGLU: GELU's tanh form).

act(x @ gate_weight.T) * (x @ up_weight.T): the two weights are a merged gate_up weight's two
row blocks (vLLM's and the built-in Llama's layout) or two weights of their own (transformers').
The GLU pass (backends/glu_pass.py) puts it where a CUDA piece has that computation. One row
takes the Triton GEMV with the activation as its epilogue (ops/triton_glu.py: one launch), and
2..triton_glu.SPLIT_K_GLU_ROWS rows (2 by default) the split-K dots' gated form where
`atom::small_m_linear` would take the projections on one-slice split-K dots; other rows take
the projections as `atom::small_m_linear` decides them (one GEMM where the two weights are one
merged block), then one activation-and-mul kernel (ops/triton_rowwise.py): the launches
Inductor would have made; off CUDA, PyTorch itself. Results round where the model's own ops
round.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op
from .linear import small_m_linear
from .triton_present import triton_available

OP_NAME = "gate_up_glu"
ACTIVATIONS = ("silu", "gelu_tanh")  # the kernels' ACT is an index into these (ops/triton_rowwise.py)
NAMESPACE = "atom"


def _merged(first: torch.Tensor, second: torch.Tensor) -> Optional[torch.Tensor]:
    """`first` and `second` as one [2n, k] weight where `second`'s rows follow `first`'s in one
    storage with the same strides (a merged weight's two halves), else None."""
    if first.stride() != second.stride() or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    if second.storage_offset() != first.storage_offset() + first.shape[0] * first.stride(0):
        return None
    return first.as_strided((2 * first.shape[0], first.shape[1]), first.stride())


def merged_weight(gate_weight: torch.Tensor, up_weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The two weights as the one [2n, k] block they are halves of (in either order), else None."""
    merged = _merged(gate_weight, up_weight)
    return merged if merged is not None else _merged(up_weight, gate_weight)


def _projections(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    merged = merged_weight(gate_weight, up_weight)
    if merged is not None:  # one GEMM reads both halves, as the model's own gate_up did
        n = gate_weight.shape[0]
        both = small_m_linear(x, merged, None)
        lo, hi = both[..., :n], both[..., n:]
        return (lo, hi) if merged.data_ptr() == gate_weight.data_ptr() else (hi, lo)
    return small_m_linear(x, gate_weight, None), small_m_linear(x, up_weight, None)


def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation as the models compute it, rounded to gate's dtype."""
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh")
    raise ValueError(f"atom::{OP_NAME}: activation {activation!r} is not one of {ACTIVATIONS}")


def gate_up_glu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, activation: str) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    shape = (*x.shape[:-1], gate_weight.shape[0])
    if activation not in ACTIVATIONS:
        activate(x, activation)  # raises, naming the activations there are
    if x.is_cuda and triton_available():
        from . import triton_glu, triton_rowwise

        if triton_glu.supported(flat, gate_weight, up_weight):
            return triton_glu.gate_up_glu(flat, gate_weight, up_weight, activation).reshape(shape)
        config = triton_glu.rows_config(flat, gate_weight, up_weight)
        if config is not None:  # 2..8 rows: the split-K dots with the activation as their epilogue
            return triton_glu.gate_up_glu_rows(flat, gate_weight, up_weight, activation, config).reshape(shape)
        gate, up = _projections(flat, gate_weight, up_weight)
        if triton_rowwise.silu_mul_supported(gate, up):
            return triton_rowwise.act_mul(gate, up, activation).reshape(shape)
    else:
        gate, up = _projections(flat, gate_weight, up_weight)
    return (activate(gate, activation) * up).reshape(shape)


def _fake(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, activation: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], gate_weight.shape[0]))


# registered once (a second import finds the same schema and changes nothing); the Library
# keeps it, and a freed Library would unregister it
_PACKET = direct_register_custom_op(OP_NAME, gate_up_glu, mutates_args=[], fake_impl=_fake,
                                    target_lib=_library(NAMESPACE))


def op() -> torch._ops.OpOverload:
    """The registered op's default overload."""
    return _PACKET.default
