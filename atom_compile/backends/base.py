"""The interface every compiler adaptor implements, and the eager adaptor."""

from __future__ import annotations

import abc
from typing import Any, Callable, Optional

import torch.fx as fx

from ..counters import compilation_counter
from ..errors import AtomRuntimeError

# A handle is a small JSON-able dict that `load` understands, e.g. {"path": "artifacts/<key>.bin"}
# (paths relative to the cache directory, so a cache can be moved).
Handle = dict


class CompilerInterface(abc.ABC):
    """A compiler for one piece. Every torch-version quirk lives inside an adaptor."""

    name: str = "base"
    cache_dir: Optional[str] = None
    last_save_error: Optional[OSError] = None
    # where the compiler's own scratch files go (set by the manager while the cache is writable)
    inductor_dir: Optional[str] = None
    # where Inductor probes the CPU's vector ISA (shared by the caches of one root; manager-set)
    isa_dir: Optional[str] = None

    def initialize_cache(self, cache_dir: Optional[str], disable_cache: bool = False, prefix: str = "") -> None:
        """Where this adaptor writes artifacts (None or disable_cache: write nothing)."""
        self.cache_dir = None if disable_cache else cache_dir
        self.prefix = prefix
        self.last_save_error: Optional[OSError] = None

    def compute_hash(self) -> dict[str, Any]:
        """Compiler-specific factors of the cache key (versions, compiler config)."""
        return {"compiler": self.name}

    @abc.abstractmethod
    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: Optional[int] = None,
        key: Optional[str] = None,
    ) -> tuple[Callable, Optional[Handle]]:
        """Compile `graph` for `example_inputs` (symbolic sizes when runtime_shape is None).

        Returns the callable and a handle for `load`, or None when nothing was saved.
        """

    def load(
        self,
        handle: Handle,
        graph: fx.GraphModule,
        example_inputs: Optional[list[Any]],
        graph_index: int,
        runtime_shape: Optional[int] = None,
    ) -> Callable:
        """Rebuild the callable from a handle returned by `compile` (in this or another process)."""
        raise AtomRuntimeError(f"the {self.name} compiler saves no artifacts: there is nothing to load")

    # Whether `load` works without example inputs (needed to skip Dynamo on a warm start).
    loads_without_inputs: bool = False


class EagerAdaptor(CompilerInterface):
    """Runs each piece as traced: no compiler, nothing saved."""

    name = "eager"
    loads_without_inputs = True

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        compilation_counter.num_eager_compiles += 1
        return graph, None

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        return graph
