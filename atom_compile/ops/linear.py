"""`atom::small_m_linear`: a linear layer that takes the Triton GEMV kernel for few-token calls.

The compiler swaps `F.linear` for this op in pieces compiled for a concrete size of at most
MAX_M tokens on CUDA (backends/small_m_linear.py); everywhere else, and for any call the kernel
does not take (fp32, CPU, a strided weight), it is `F.linear` itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op, registered_op
from .attention import _triton_available

OP_NAME = "small_m_linear"
NAMESPACE = "atom"
MAX_M = 8  # the kernel's row limit (triton_linear.MAX_M); kept here so CPU code needs no Triton


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if x.is_cuda and _triton_available():
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
    """The registered op's default overload (what a graph pass puts in place of F.linear)."""
    return torch.ops.atom.small_m_linear.default
