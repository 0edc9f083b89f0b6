"""A projection and the residual add + RMSNorm after it, as one op: `atom::linear_add_rms_norm`.

At one token a decode layer's o and down projections are each followed by a residual add and an
RMSNorm, a kernel of its own: a launch, and a boundary where the memory drains and ramps again.
The epilogue pass (backends/epilogue_pass.py) puts this op where a CUDA piece has that pattern.
One row on CUDA takes the GEMV whose last program to finish adds and normalises the row
(ops/triton_linear.linear_add_rms_norm: one launch); more rows take the projection as
`atom::small_m_linear` would and then a Triton row-wise add + RMSNorm (the launches there were
before); off CUDA, PyTorch itself. The results round where the model's code does.

The one-row kernel counts its finished programs in an int32 counter that it puts back to zero.
Eager calls take one per (device, stream), so launches on two streams never share one. Calls
inside a CUDA-graph capture take the device's graphs' counter: graphs that hold this op must not
replay at once (as graphs that share a memory pool must not). Counters are made outside captures
only (nothing may allocate into a graph's pool for good); a capture that finds none (no eager
call before it) records the unfused launches.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op, registered_op
from .linear import small_m_linear
from .prologue_linear import _reference
from .triton_present import triton_available

NAMESPACE = "atom"

_counters: dict[tuple[int, int], torch.Tensor] = {}
GRAPHS = -1  # the stream slot of the counter that captures use


def _counter(device: torch.device) -> Optional[torch.Tensor]:
    stream = torch.cuda.current_stream(device)
    if torch.cuda.is_current_stream_capturing():
        return _counters.get((stream.device_index, GRAPHS))
    for key in ((stream.device_index, stream.cuda_stream), (stream.device_index, GRAPHS)):
        if key not in _counters:
            _counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[(stream.device_index, stream.cuda_stream)]


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h) * norm_weight, h) with h = x @ weight.T + residual; x and residual [rows, *]."""
    cuda = x.is_cuda and triton_available()
    if cuda:
        from . import triton_linear

        y_shape = (x.shape[0], weight.shape[0])
        if (x.shape[0] == 1 and triton_linear.supported(x, weight, None) and residual.shape == y_shape
                and residual.dtype == x.dtype and residual.is_contiguous()
                and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()):
            counter = _counter(x.device)
            if counter is not None:
                return triton_linear.linear_add_rms_norm(x, weight, residual, norm_weight, eps, counter)
    y = small_m_linear(x, weight, None)  # the small-M pass's choice for the projection alone
    if cuda:
        from . import triton_rowwise

        if triton_rowwise.supported(y, residual, norm_weight):
            normed, h = triton_rowwise.add_rms_norm(y, residual, norm_weight, eps)
            return normed, h
    normed, h = _reference(y, residual, norm_weight, eps)
    return normed.contiguous(), h.contiguous()


def _fake(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def _register() -> None:
    lib = _library(NAMESPACE)  # kept alive there: a freed Library unregisters
    if registered_op(f"{NAMESPACE}::linear_add_rms_norm") is None:
        direct_register_custom_op("linear_add_rms_norm", linear_add_rms_norm, mutates_args=[], fake_impl=_fake,
                                  target_lib=lib)


_register()


def op() -> torch._ops.OpOverload:
    """The registered op's default overload."""
    return torch.ops.atom.linear_add_rms_norm.default
