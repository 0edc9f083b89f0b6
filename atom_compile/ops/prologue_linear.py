"""The row-wise step before a projection and the projection, as one op:
`atom::rms_norm_linear` and `atom::add_rms_norm_linear` (an RMSNorm, after a residual add) and
`atom::silu_mul_linear` (an MLP's SiLU-and-mul before its down projection).

At one token a decode step's norms and activations are kernels of their own between GEMVs: a
launch and a trip of the row through memory each, three per layer. The prologue pass
(backends/prologue_pass.py) puts these ops where a CUDA piece has them. One row takes the GEMV
with the step as its prologue (ops/triton_gemv_forms.py: one launch); more rows take a Triton
row-wise kernel and then `F.linear` (the launches Inductor would have made); off CUDA, PyTorch
itself. The results round where the model's code does, except that at one row the norm is
applied in float32 inside the dot (the normalised row is never rounded): within bf16's
rounding of the model's own.
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
        from . import triton_gemv_forms, triton_linear, triton_rowwise

        if triton_rowwise.supported(flat, res, norm_weight):
            if flat.shape[0] == 1 and triton_linear.supported(flat, weight, None):
                y, h = triton_gemv_forms.rms_norm_linear(flat, res, norm_weight, eps, weight)
            else:
                normed, h = triton_rowwise.add_rms_norm(flat, res, norm_weight, eps)
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


def _silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    flat_g, flat_u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    if gate.is_cuda and triton_available():
        from . import triton_gemv_forms, triton_linear, triton_rowwise

        if triton_rowwise.silu_mul_supported(flat_g, flat_u):
            if flat_g.shape[0] == 1 and triton_linear.supported(flat_g, weight, None):
                y = triton_gemv_forms.silu_mul_linear(flat_g, flat_u, weight)
            else:
                y = torch.nn.functional.linear(triton_rowwise.silu_mul(flat_g, flat_u), weight)
            return y.reshape(*gate.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(_silu_mul_reference(gate, up), weight)


def _fake_silu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


def _fake(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_add(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty_like(x, memory_format=torch.contiguous_format)


def _register() -> None:
    lib = _library(NAMESPACE)  # kept alive there: a freed Library unregisters
    for name, fn, fake in (("rms_norm_linear", rms_norm_linear, _fake),
                           ("add_rms_norm_linear", add_rms_norm_linear, _fake_add),
                           ("silu_mul_linear", silu_mul_linear, _fake_silu)):
        if registered_op(f"{NAMESPACE}::{name}") is None:
            direct_register_custom_op(name, fn, mutates_args=[], fake_impl=fake, target_lib=lib)


_register()


def ops() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload, torch._ops.OpOverload]:
    """The registered ops' default overloads: (rms_norm_linear, add_rms_norm_linear, silu_mul_linear)."""
    return (torch.ops.atom.rms_norm_linear.default, torch.ops.atom.add_rms_norm_linear.default,
            torch.ops.atom.silu_mul_linear.default)
