"""`atom::rms_norm_linear` and `atom::add_rms_norm_linear`: an RMSNorm (after a residual add)
and the projection that reads it, as one op.

At one token a decode step's norms are kernels of their own between GEMVs: a launch and a trip
of the row through memory each, two per layer. The fusion pass (backends/norm_linear_pass.py)
puts these ops where a CUDA piece normalises a row and projects it. One row takes the GEMV with
the norm as its prologue (ops/triton_linear.py: one launch); more rows take a Triton add + norm
kernel and then `F.linear` (the launches Inductor would have made); off CUDA, PyTorch itself.
The results round where the model's code does, but at one row the norm is applied in float32
inside the dot (no rounding of the normalised row): within bf16's rounding of the model's own.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op, registered_op
from .triton_present import triton_available

NAMESPACE = "atom"


def _reference(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual if residual is not None else x
    f = h.float()
    normed = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return norm_weight * normed, h


def _fused(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
           weight: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    flat = x.reshape(-1, x.shape[-1])
    res = residual.reshape(flat.shape) if residual is not None else None
    if x.is_cuda and triton_available():
        from . import triton_linear, triton_norm

        if triton_norm.supported(flat, res, norm_weight):
            if flat.shape[0] == 1 and triton_linear.supported(flat, weight, None) and (
                    res is None or res.stride(1) == 1):
                y, h = triton_linear.rms_norm_linear(flat, res, norm_weight, eps, weight)
            else:
                normed, h = triton_norm.add_rms_norm(flat, res, norm_weight, eps)
                y = torch.nn.functional.linear(normed, weight)
            return y.reshape(*x.shape[:-1], weight.shape[0]), (h.reshape(x.shape) if h is not None else None)
    normed, h = _reference(x, residual, norm_weight, eps)
    # the sum contiguous, as the fake implementation says (Inductor checks a custom op's strides)
    return torch.nn.functional.linear(normed, weight), (h.contiguous() if residual is not None else None)


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    return _fused(x, None, norm_weight, eps, weight)[0]


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = _fused(x, residual, norm_weight, eps, weight)
    return y, h


def _fake(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_add(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty_like(x, memory_format=torch.contiguous_format)


def _register() -> None:
    lib = _library(NAMESPACE)  # kept alive there: a freed Library unregisters
    if registered_op(f"{NAMESPACE}::rms_norm_linear") is None:
        direct_register_custom_op("rms_norm_linear", rms_norm_linear, mutates_args=[], fake_impl=_fake, target_lib=lib)
    if registered_op(f"{NAMESPACE}::add_rms_norm_linear") is None:
        direct_register_custom_op("add_rms_norm_linear", add_rms_norm_linear, mutates_args=[], fake_impl=_fake_add,
                                  target_lib=lib)


_register()


def ops() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    """The registered ops' default overloads: (rms_norm_linear, add_rms_norm_linear)."""
    return torch.ops.atom.rms_norm_linear.default, torch.ops.atom.add_rms_norm_linear.default
