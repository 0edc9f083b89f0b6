"""atom-compile: a torch.compile backend and compiler cache for LLM inference models, with a
CUDA-graph capture/replay runtime on top.

    compiled = torch.compile(model, backend=atom_compile.backend(cfg), fullgraph=True)

Names are imported on first use, so that `import atom_compile` (and the cache CLI) does not
pay for importing torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> module that defines it
_EXPORTS = {
    # compiler half
    "AtomBackend": ".backends.atom_backend",
    "GraphBreakError": ".backends.atom_backend",
    "backend": ".backends.atom_backend",
    "CompilationConfig": ".config",
    "CompilationLevel": ".config",
    "Config": ".config",
    "ConfigError": ".config",
    "CUDAGraphMode": ".config",
    "AtomCompileError": ".errors",
    "CacheRequired": ".errors",
    "CompilationCounter": ".counters",
    "compilation_counter": ".counters",
    "direct_register_custom_op": ".custom_ops",
    "mark_splitting_op": ".custom_ops",
    "BufferMutationError": ".decorators",
    "RecompileError": ".decorators",
    "get_current_config": ".decorators",
    "ignore_torch_compile": ".decorators",
    "set_current_config": ".decorators",
    "support_torch_compile": ".decorators",
    "Context": ".forward_context",
    "ForwardContext": ".forward_context",
    "get_forward_context": ".forward_context",
    "reset_forward_context": ".forward_context",
    "set_forward_context": ".forward_context",
    # runtime half
    "ModelRunner": ".runtime.model_runner",
    "ReqGraph": ".runtime.graphs",
    "TokenGraph": ".runtime.graphs",
    "eager_region": ".runtime.graphs",
    "graph_pool": ".runtime.graphs",
    "token_graph": ".runtime.graphs",
    "request_bucket": ".runtime.buckets",
    "mark_warmed_up": ".ops.jit_watch",
    # the warm-up (the CLI's `warm`, from Python)
    "warm": ".cli.warm_job",
    # tensor parallel
    "TPLlamaForCausalLM": ".models.llama_tp",
    "shard_llama": ".models.llama_tp",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'atom_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .backends.atom_backend import AtomBackend, GraphBreakError, backend
    from .config import CompilationConfig, CompilationLevel, Config, ConfigError, CUDAGraphMode
    from .counters import CompilationCounter, compilation_counter
    from .custom_ops import direct_register_custom_op, mark_splitting_op
    from .errors import AtomCompileError, CacheRequired
    from .decorators import (
        BufferMutationError,
        RecompileError,
        get_current_config,
        ignore_torch_compile,
        set_current_config,
        support_torch_compile,
    )
    from .forward_context import (
        Context,
        ForwardContext,
        get_forward_context,
        reset_forward_context,
        set_forward_context,
    )
    from .runtime.buckets import request_bucket
    from .runtime.graphs import ReqGraph, TokenGraph, eager_region, graph_pool, token_graph
    from .runtime.model_runner import ModelRunner
    from .ops.jit_watch import mark_warmed_up
    from .models.llama_tp import TPLlamaForCausalLM, shard_llama
    from .cli.warm_job import warm
