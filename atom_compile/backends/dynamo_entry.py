"""`torch.compile(model, backend="atom", options={...})` through torch's backend entry point.

pyproject.toml registers `atom = "atom_compile.backends.dynamo_entry:atom_backend"` in the
`torch_dynamo_backends` group, so after `pip install` torch finds the backend by name. torch
calls it once per graph as `atom_backend(gm, example_inputs, options=options)`; `options` are
CompilationConfig fields (vLLM's `mode` and `backend` accepted too), validated by
`CompilationConfig.from_dict`. Without a level the graph compiles at level 3 (piecewise): a
user who names the backend wants it to compile.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch.fx as fx

from ..config import CompilationConfig, Config, ConfigError
from .atom_backend import backend

DEFAULT_LEVEL = 3


def config_from_options(options: Optional[Mapping[str, Any]]) -> Config:
    """The Config that torch.compile's `options` stand for (ConfigError on a bad one)."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError("torch.compile options", options, "a dict of CompilationConfig fields")
    data = dict(options or {})
    if "level" not in data and "mode" not in data:
        data["level"] = DEFAULT_LEVEL
    return Config(compilation_config=CompilationConfig.from_dict(data))


def atom_backend(gm: fx.GraphModule, example_inputs: list[Any],
                 options: Optional[Mapping[str, Any]] = None) -> Callable:
    """The backend torch finds as "atom": each graph gets an atom-compile backend of its own."""
    return backend(config_from_options(options))(gm, example_inputs)
