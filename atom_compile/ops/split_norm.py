"""An RMSNorm split between the projections around it: `atom::linear_add_weigh` and
`atom::norm_scaled_linear`.

At one token a decode layer's o and down projections are each followed by a residual add and
an RMSNorm, and the norm by the next projection (gate_up, or the next layer's qkv): the norm is
a kernel of its own, a launch and a boundary where the memory drains and ramps again. Split, the
norm needs no kernel of its own:
- `linear_add_weigh(x, W, r, w, eps, site, clear) -> (g, h)`: the projection, h = y + r,
  g = h * w, and the sum of h squared added into the site's slot (ops/triton_linear.py, EPI_SS);
- `norm_scaled_linear(g, h, w, eps, W2, up, activation, site)`: g @ W2.T (or a gated MLP's
  act(gate) * up) scaled by 1 / rms from the slot (SS_SCALE). With g = h * w that is
  rms_norm(h) * w @ W2.T; the rounding differs from the model's by where 1 / rms is applied
  (after the dot, not on the row), as in the prologue pass.

Who empties a slot: not its consumer (its programs would have to count themselves, thousands of
atomics on one address), but the next producer: the pass numbers a graph's pairs 0..S-1 (S >= 2)
in an order where each pair's consumer comes before the next pair's producer, and producer s
zeroes slot `clear` = (s + 1) mod S. So every slot is zeroed after its last reader and before
its next writer, slot 0 at the end of each graph. The host keeps the same account (which slots
hold a sum) and zeroes a slot itself before a producer that would find it dirty (a forward that
stopped half way).

Both ops take the split form on the same condition, which each can decide alone: one row, on
CUDA with Triton, and slots for this stream. Otherwise g is the normalised row and the consumer
a plain projection (more rows: the projection, one add + RMSNorm kernel, the next projection:
the launches there were before). A shape the kernels do not take inside the split form runs the
same arithmetic in PyTorch.

Slots: SITES per (device, stream) for eager calls, SITES per device for CUDA-graph captures
(graphs that hold these ops must not replay at once, as graphs that share a memory pool must
not). They are made outside captures only (nothing may allocate into a graph's pool for good); a
capture that finds none (no eager call before it) records the unsplit launches.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..custom_ops import _library, direct_register_custom_op
from .glu_linear import activate, gate_up_glu
from .linear import small_m_linear
from .prologue_linear import _reference
from .triton_present import triton_available

NAMESPACE = "atom"
GRAPHS = -1  # the stream slot of the slots that captures use
SITES = 64  # split pairs one graph may hold

_slots: dict[tuple[int, int], torch.Tensor] = {}
_dirty: dict[tuple[int, int], set[int]] = {}  # the slots that hold a sum, as the stream will find them


def _slots_for(x: torch.Tensor, site: int) -> Optional[tuple[torch.Tensor, tuple[int, int]]]:
    """(this stream's slots, their key) for a split pair at `site`, or None where the pair runs
    unsplit: not one CUDA row with Triton, a site past SITES, or a capture with no slots."""
    if not (x.is_cuda and x.shape[0] == 1 and 0 <= site < SITES and triton_available()):
        return None
    from .triton_linear import SLOT_FLOATS

    stream = torch.cuda.current_stream(x.device)
    if torch.cuda.is_current_stream_capturing():
        key = (stream.device_index, GRAPHS)
    else:
        key = (stream.device_index, stream.cuda_stream)
        for k in (key, (stream.device_index, GRAPHS)):
            if k not in _slots:
                _slots[k] = torch.zeros((SITES, SLOT_FLOATS), dtype=torch.float32, device=x.device)
                _dirty[k] = set()
    rows = _slots.get(key)
    return (rows, key) if rows is not None else None


def _weigh_in_torch(x, weight, residual, norm_weight, slot, clear) -> tuple[torch.Tensor, torch.Tensor]:
    # the split form's results where the kernel does not take the shapes: the same arithmetic
    y = small_m_linear(x, weight, None)
    h = (y.float() + residual.float()).to(y.dtype)
    slot[0].add_(h.float().pow(2).sum())
    clear.zero_()
    return (h.float() * norm_weight.float()).to(h.dtype), h


def linear_add_weigh(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, site: int, clear: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, h) with h = x @ weight.T + residual on rows [rows, *]; g is h * norm_weight awaiting
    the consumer's 1 / rms where the pair is split (see above), else rms_norm(h) * norm_weight."""
    if not (0 <= clear < SITES and clear != site):
        raise ValueError(f"atom::linear_add_weigh: clear {clear} is not another site of 0..{SITES - 1} (site {site})")
    found = _slots_for(x, site)
    if found is not None:
        from . import triton_gemv_forms, triton_linear

        rows, key = found
        dirty = _dirty[key]
        if site in dirty:  # a forward stopped before the producer that would have zeroed it
            rows[site].zero_()
        dirty.add(site)
        dirty.discard(clear)
        if (triton_linear.supported(x, weight, None) and residual.shape == (1, weight.shape[0])
                and residual.dtype == x.dtype and residual.is_contiguous()
                and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()):
            return triton_gemv_forms.linear_add_weigh(x, weight, residual, norm_weight, rows[site], rows[clear])
        return _weigh_in_torch(x, weight, residual, norm_weight, rows[site], rows[clear])
    y = small_m_linear(x, weight, None)  # the small-M pass's choice for the projection alone
    if x.is_cuda and triton_available():
        from . import triton_rowwise

        if triton_rowwise.supported(y, residual, norm_weight):
            return triton_rowwise.add_rms_norm(y, residual, norm_weight, eps)
    normed, h = _reference(y, residual, norm_weight, eps)
    return normed.contiguous(), h.contiguous()


def _scaled(g, h, norm_weight, eps, weight, up_weight, activation, slot) -> torch.Tensor:
    from . import triton_gemv_forms, triton_glu, triton_linear

    if up_weight is None and triton_linear.supported(g, weight, None):
        return triton_gemv_forms.scaled_linear(g, weight, eps, slot)
    if up_weight is not None and triton_glu.supported(g, weight, up_weight):
        return triton_glu.gate_up_glu(g, weight, up_weight, activation, scale=(eps, slot))
    # weights the kernels do not take: the whole norm from h (the next producer empties the slot)
    return _project(_reference(h, None, norm_weight, eps)[0].contiguous(), weight, up_weight, activation)


def _project(normed, weight, up_weight, activation) -> torch.Tensor:
    if up_weight is None:
        return small_m_linear(normed, weight, None)
    return gate_up_glu(normed, weight, up_weight, activation)


def norm_scaled_linear(g: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       up_weight: Optional[torch.Tensor], activation: str, site: int) -> torch.Tensor:
    """rms_norm(h) * norm_weight @ weight.T from `linear_add_weigh`'s (g, h) at the same site;
    with `up_weight`, act(that) * (the same row @ up_weight.T), `activation` as atom::gate_up_glu
    takes it. g and h are 2-D rows."""
    if up_weight is not None:
        activate(g[:0], activation)  # an activation there is none of raises here, naming them
    found = _slots_for(g, site)
    if found is None:
        return _project(g, weight, up_weight, activation)  # g is the normalised row
    return _scaled(g, h, norm_weight, eps, weight, up_weight, activation, found[0][site])


def _fake_weigh(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, site: int, clear: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def _fake_scaled(g: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 up_weight: Optional[torch.Tensor], activation: str, site: int) -> torch.Tensor:
    return g.new_empty((*g.shape[:-1], weight.shape[0]))


# registered once (a second import finds the same schema and changes nothing); the Library
# keeps them, and a freed Library would unregister them
_WEIGH = direct_register_custom_op("linear_add_weigh", linear_add_weigh, mutates_args=[], fake_impl=_fake_weigh,
                                   target_lib=_library(NAMESPACE))
_SCALED = direct_register_custom_op("norm_scaled_linear", norm_scaled_linear, mutates_args=[],
                                    fake_impl=_fake_scaled, target_lib=_library(NAMESPACE))


def ops() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    """The registered ops' default overloads: (linear_add_weigh, norm_scaled_linear)."""
    return _WEIGH.default, _SCALED.default
