"""Trace a decoder's repeated layers once: torch's `nested_compile_region` on a ModuleList.

Dynamo's trace of a decoder grows with its depth: every layer is traced again although each is
the same code over other weights. torch >= 2.9's `torch.compiler.nested_compile_region` makes
Dynamo trace a marked function once and call the traced body again (`invoke_subgraph`) for
every later call whose inputs pass the first trace's guards; a call that fails them is traced
anew, so correctness never depends on the layers really being alike. The backend inlines the
bodies again before splitting (backends/regions.py).

`applied(model)` marks the layers of every ModuleList whose entries are alike (one class, the
same parameter and buffer shapes) for the duration of a trace, by giving each layer a subclass
whose forward is the marked one, and restores their classes afterwards: the model's classes
are never modified, and eager calls never see a region.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

_REGION_CLASSES: dict[tuple[type, int], type] = {}


def supported() -> bool:
    """Whether the installed torch has `nested_compile_region` (torch >= 2.9)."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "nested_compile_region")


def _signature(module: nn.Module) -> tuple:
    tensors = [(name, tuple(t.shape), t.dtype, t.device.type)
               for name, t in list(module.named_parameters()) + list(module.named_buffers())]
    return type(module), tuple(tensors), tuple(type(m) for m in module.modules())


def repeated_blocks(model: nn.Module) -> list[nn.ModuleList]:
    """The ModuleLists (outermost only) of at least two alike modules."""
    found: list[nn.ModuleList] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        first = _signature(module[0])
        if all(_signature(m) == first for m in module[1:]):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _region_class(cls: type, max_reuse_entries: int) -> type:
    key = (cls, max_reuse_entries)
    if key not in _REGION_CLASSES:
        # the limit above the layer count: layers whose guards differ (a per-layer constant)
        # are traced one by one, as without the region, instead of failing the trace
        try:
            forward = torch.compiler.nested_compile_region(cls.forward, max_reuse_entries=max_reuse_entries)
        except TypeError:  # a torch whose regions have no reuse limit
            forward = torch.compiler.nested_compile_region(cls.forward)
        _REGION_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_atom_region_of": cls,
        })
    return _REGION_CLASSES[key]


@contextlib.contextmanager
def applied(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, the layers of `model`'s repeated blocks trace as nested compile
    regions; yields how many layers were marked (0: none, or not supported)."""
    if not enabled or not supported():
        yield 0
        return
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for block in repeated_blocks(model):
            for layer in block:
                original = type(layer)
                layer.__class__ = _region_class(original, len(block) + 1)
                swapped.append((layer, original))
        yield len(swapped)
    finally:
        for layer, original in swapped:
            layer.__class__ = original

