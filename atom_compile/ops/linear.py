"""`atom::small_m_linear`: a linear layer that takes the Triton GEMV kernel for few-token calls.

The built-in Llama computes its logits through it, and the built-in small-M pass
(backends/small_m_pass.py) puts it in place of a CUDA piece's projections. One row takes the
GEMV (1.2-1.35x cuBLAS on an H200 for 8-34 MB weights, BENCHMARKS.md); up to MAX_M rows take
the kernel's padded dots only for a vocabulary-wide layer, where they beat cuBLAS; any other
call (fp32, CPU, a strided weight, more rows) is `F.linear` itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op, registered_op
from .triton_present import triton_available

OP_NAME = "small_m_linear"
NAMESPACE = "atom"
MAX_M = 8  # the kernel's row limit (triton_linear.MAX_M); kept here so CPU code needs no Triton


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if x.is_cuda and triton_available():
        from . import triton_linear

        flat = x.reshape(-1, x.shape[-1])
        if triton_linear.supported(flat, weight, bias):
            return triton_linear.small_m_linear(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _register() -> None:
    if registered_op(f"{NAMESPACE}::{OP_NAME}") is not None:
        return
    direct_register_custom_op(OP_NAME, small_m_linear, mutates_args=[], fake_impl=_fake,
                              target_lib=_library(NAMESPACE))  # kept alive there: a freed Library unregisters


_register()


def op() -> torch._ops.OpOverload:
    """The registered op's default overload."""
    return torch.ops.atom.small_m_linear.default
