"""The inputs of a compiled graph: as Dynamo traced them, and kept at fixed addresses for CUDA graphs."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx as fx

logger = logging.getLogger("atom_compile")


class _CopyInputs:
    """Copies the inputs that carry the token dimension into static buffers before each call,
    so that a CUDA graph recorded around the compiled code always reads the same addresses."""

    def __init__(self, fn: Callable, indices: list[int]):
        self.fn = fn
        self.indices = indices
        self.buffers: dict[int, torch.Tensor] = {}

    def __call__(self, *args: Any) -> Any:
        args = list(args)
        for i in self.indices:
            live = args[i]
            n = live.shape[0]
            buf = self.buffers.get(i)
            if buf is None or buf.shape[0] < n or buf.shape[1:] != live.shape[1:] or buf.dtype != live.dtype:
                if buf is not None:
                    logger.info("atom-compile: static input buffer %d grows to %d rows (record the "
                                "largest size first to keep addresses fixed)", i, n)
                buf = torch.empty_like(live)
                self.buffers[i] = buf
            static = buf[:n]
            if static.data_ptr() != live.data_ptr():
                static.copy_(live)
            args[i] = static
        return self.fn(*args)


def traced_values(gm: fx.GraphModule, example_inputs: list[Any]) -> list[Any]:
    """The inputs as Dynamo traced them (fake tensors with symbolic sizes). Dynamo may hand a
    backend the real tensors of the first call, whose sizes are that call's, not the graph's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return list(example_inputs)
    return [n.meta.get("example_value", x) for n, x in zip(placeholders, example_inputs)]


def _symbolic_tensor_indices(example_inputs: list[Any]) -> list[int]:
    out = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.dim() > 0 \
                and isinstance(x.shape[0], torch.SymInt):
            out.append(i)
    return out
