"""The one-row GEMV of ops/triton_linear.py with a prologue or an epilogue: the launches the
fused ops make at one token.

- `rms_norm_linear`, `silu_mul_linear`: an RMSNorm (after a residual add) or a SiLU-and-mul as
  the GEMV's prologue (ops/prologue_linear.py);
- `linear_add_weigh`, `scaled_linear`: an RMSNorm split between the GEMVs around it
  (ops/split_norm.py), their sums of squares in slots that `check_slot` checks (the split
  norm's gated form in ops/triton_glu.py too).
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_linear import SLOT_FLOATS, gemv_config, launch_gemv


def rms_norm_linear(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(rms_norm(x [+ residual]) * norm_weight @ weight.T, the sum or None) for one row that
    `triton_linear.supported` accepts (with no bias), in one launch: the norm is the GEMV's
    prologue."""
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    launch_gemv(x, weight, None, out, gemv_config(x.shape[1]), norm=(norm_weight, eps, residual, h))
    return out, h


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for one row that `triton_linear.supported` accepts (with no
    bias), in one launch: the activation is the GEMV's prologue."""
    out = torch.empty((1, weight.shape[0]), dtype=gate.dtype, device=gate.device)
    launch_gemv(gate, weight, None, out, gemv_config(gate.shape[1]), up=up)
    return out


def check_slot(slot: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """A split norm's slot: SLOT_FLOATS contiguous float32 on x's device."""
    if slot.dtype != torch.float32 or slot.shape != (SLOT_FLOATS,) or not slot.is_contiguous() or slot.device != x.device:
        raise ValueError(f"{name}'s slots are {SLOT_FLOATS} contiguous float32 on x's device")


def linear_add_weigh(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     slot: torch.Tensor, clear: torch.Tensor,
                     up: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, h) with h = x @ weight.T + residual and g = h * norm_weight (x: silu(x) * up with
    `up`, an MLP's down projection), for one row that `triton_linear.supported` accepts (no
    bias), in one launch; the sum of h squared is added into `slot` for `scaled_linear` (the
    norm's 1 / rms), and `clear` (the next pair's slot) is zeroed."""
    n = weight.shape[0]
    if x.shape[0] != 1 or residual.shape != (1, n) or not residual.is_contiguous() or norm_weight.shape != (n,):
        raise ValueError(f"linear_add_weigh takes one row: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"residual {tuple(residual.shape)} (contiguous), norm weight {tuple(norm_weight.shape)}")
    if up is not None and up.shape != x.shape:
        raise ValueError(f"linear_add_weigh's up {tuple(up.shape)} is not the gate's {tuple(x.shape)}")
    check_slot(slot, x, "linear_add_weigh")
    check_slot(clear, x, "linear_add_weigh")
    g = torch.empty((1, n), dtype=x.dtype, device=x.device)
    h = torch.empty_like(g)
    launch_gemv(x, weight, None, g, gemv_config(x.shape[1]), up=up, epilogue=(norm_weight, residual, h, slot, clear))
    return g, h


def scaled_linear(g: torch.Tensor, weight: torch.Tensor, eps: float, slot: torch.Tensor) -> torch.Tensor:
    """rsqrt(sum / K + eps) * (g @ weight.T), the sum of squares `linear_add_weigh` left in
    `slot`, for one row that `triton_linear.supported` accepts (no bias), in one launch: with
    g = h * w it is rms_norm(h) * w @ weight.T."""
    if g.shape[0] != 1:
        raise ValueError(f"scaled_linear takes one row, not {tuple(g.shape)}")
    check_slot(slot, g, "scaled_linear")
    out = torch.empty((1, weight.shape[0]), dtype=g.dtype, device=g.device)
    launch_gemv(g, weight, None, out, gemv_config(g.shape[1]), scale=(eps, slot))
    return out
