"""What the guard-free dispatch of a `@support_torch_compile` model checks where Dynamo's guards
would: a forward that rebinds a registered buffer (refused at compile time), and on each call
the rank, dtype and traced-constant sizes of its tensor arguments (ATOM_COMPILE_CHECK_INPUTS)."""

from __future__ import annotations

import types
from typing import Any

import torch

from ..errors import BufferMutationError, RecompileError


def check_code(code: types.CodeType, cls: type) -> None:
    """Refuse a forward that rebinds a registered buffer: Dynamo replays that outside the graph."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(const.co_names)
    if "_buffers" in names and "update" in names:
        raise BufferMutationError(
            f"{cls.__module__}.{cls.__qualname__}.forward rebinds a registered buffer (like "
            "`self.x = self.x + 1`). Dynamo replays that assignment outside the compiled graph, so a "
            "CUDA graph replay would skip it and give silently wrong results. Update the buffer in "
            "place instead (`self.x.add_(1)`, `self.x.copy_(...)`)."
        )


def input_checks(args: tuple) -> tuple:
    """(position, ndim, dtype, ((dim, size), ...)) of each tensor argument: what the guard-free
    dispatch assumes stays fixed. Dims marked dynamic are excluded."""
    checks = []
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            dynamic = getattr(value, "_dynamo_dynamic_indices", set())
            static = tuple((d, s) for d, s in enumerate(value.shape) if d not in dynamic)
            checks.append((i, value.dim(), value.dtype, static))
    return tuple(checks)


def check_inputs(module: Any, args: tuple) -> None:
    """Raise RecompileError where `args` differ from what `module._atom_checks` recorded."""
    for i, ndim, dtype, static in module._atom_checks:
        if i >= len(args):
            raise RecompileError(f"{type(module).__qualname__}: called with {len(args)} positional arguments; "
                                 f"the compiled code was traced with more")
        value = args[i]
        if not isinstance(value, torch.Tensor) or value.dim() != ndim or value.dtype != dtype:
            raise RecompileError(
                f"{type(module).__qualname__}: argument {i} is {describe(value)}; the compiled code was "
                f"traced for a {ndim}-dim {dtype} tensor. A new graph would be needed: build another "
                "instance, or mark the dims that vary with dynamic_arg_dims."
            )
        shape = value.shape
        for d, size in static:
            if shape[d] != size:
                raise RecompileError(
                    f"{type(module).__qualname__}: argument {i} has size {shape[d]} on dim {d}, which was "
                    f"traced as the constant {size}. A new graph would be needed: mark the dim dynamic "
                    "with dynamic_arg_dims."
                )


def describe(value: Any) -> str:
    """A value as an error message names it."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-dim {value.dtype} tensor"
    return type(value).__name__
