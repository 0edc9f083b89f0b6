"""What happened, counted: graphs seen, pieces compiled and loaded, CUDA graphs captured.

Tests and benchmarks assert behaviour through `compilation_counter.expect(**deltas)`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterator

from .errors import AtomTypeError


@dataclass
class CompilationCounter:
    num_models_seen: int = 0
    num_graphs_seen: int = 0
    # pieces after the split, splitting ops included
    num_piecewise_graphs_seen: int = 0
    # pieces that are compiled (and that a CUDA graph may capture): the non-splitting ones
    num_piecewise_capturable_graphs_seen: int = 0
    # use_inductor_graph_partition: the partitions Inductor cuts the one compiled graph into
    num_inductor_partitions: int = 0
    # compile-or-load requests for the general shape, one per compiled piece
    num_backend_compilations: int = 0
    # compile-or-load requests for a concrete size from compile_sizes
    num_concrete_compilations: int = 0
    # real compiler invocations (after the cache and the content dedup)
    num_inductor_compiles: int = 0
    num_eager_compiles: int = 0
    # pieces whose compiled code was reused from an identical piece in this process
    num_deduplicated_pieces: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    # pieces Inductor compiled but could not serialise (kept in memory only)
    num_unsaveable_artifacts: int = 0
    # pieces another rank compiled (shared content key) that this rank loaded instead
    num_peer_pieces_loaded: int = 0
    num_cache_errors: int = 0
    # whole Dynamo functions saved / loaded (the warm start that skips Dynamo)
    num_dynamo_functions_saved: int = 0
    num_dynamo_functions_loaded: int = 0
    # saved Dynamo functions loaded but set aside: a peer of the compile group had none (it traces)
    num_dynamo_functions_set_aside: int = 0
    # invoke_subgraph calls (layers traced once as a nested compile region) inlined by the backend
    num_regions_inlined: int = 0
    # attention ops that took their query's and key's RoPE (backends/rope_attention_pass.py)
    num_rope_into_attention: int = 0
    # weight prefetches into L2 put before attention ops (backends/l2_prefetch_pass.py)
    num_l2_prefetches: int = 0
    # ... and recorded into CUDA graphs (ops/l2_prefetch.py: a fork of the capture's stream)
    num_l2_prefetches_recorded: int = 0
    # traces retried without nested compile regions (the region did not apply)
    num_region_fallbacks: int = 0
    num_cudagraph_captured: int = 0
    num_cudagraph_replayed: int = 0
    # Triton JIT compiles and Inductor autotunes after mark_warmed_up() (ops/jit_watch.py)
    num_triton_compiles_after_warmup: int = 0

    def clone(self) -> "CompilationCounter":
        return copy.deepcopy(self)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly the given amount."""
        unknown = sorted(set(deltas) - set(self.as_dict()))
        if unknown:
            raise AtomTypeError(f"expect(): unknown counters {unknown}; known: {sorted(self.as_dict())}")
        before = self.clone()
        yield
        wrong = []
        for name, delta in deltas.items():
            got = getattr(self, name) - getattr(before, name)
            if got != delta:
                wrong.append(f"{name}: expected +{delta}, got +{got}")
        if wrong:
            raise AssertionError("compilation_counter: " + "; ".join(wrong))


compilation_counter = CompilationCounter()
