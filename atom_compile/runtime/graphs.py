"""CUDA-graph recordings: one shared pool, request graphs (FULL) and token graphs (TR_HYBRID).

A `TokenGraph` recording of a forward is a list of CUDA-graph segments broken only at eager
regions (ops whose launches depend on host data, such as attention). Replay runs segment 0,
then the eager region for real (it reads the live step's metadata from the forward context)
with its inputs at the addresses segment 0 wrote, puts its result where segment 1 was recorded
reading, replays segment 1, and so on. No Python forward runs on replay, and none of this needs
torch.compile: a model marked `@token_graph` records at level 0 too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

from ..counters import compilation_counter
from ..errors import AtomTypeError, AtomValueError
from ..forward_context import get_forward_context, push_forward_context
from .pool import (PoolMembership, capture_stream, claim_reservation, graph_pool, graph_pool_bytes, pool_alias,
                   reset_graph_pool, uses_pool)

__all__ = ["ReqGraph", "Recording", "TokenGraph", "eager_region", "graph_pool", "graph_pool_bytes", "pool_alias",
           "recording_guard", "register_drain_hook", "reset_graph_pool", "token_graph", "token_graph_of"]

logger = logging.getLogger("atom_compile")

_drain_hooks: list[Callable[[], None]] = []


def register_drain_hook(hook: Callable[[], None]) -> None:
    """A distributed engine registers how to wait out pending collectives (e.g. NCCL watchdog
    work): a collective still pending on a stream the recording joins invalidates the capture."""
    _drain_hooks.append(hook)


def drain_collectives() -> None:
    for hook in _drain_hooks:
        hook()


@contextlib.contextmanager
def recording_guard() -> Iterator[None]:
    """Around every recording: collectives drained, device idle, garbage collector paused (a
    finaliser that unloads a module during capture aborts it)."""
    drain_collectives()
    torch.cuda.synchronize()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        torch.cuda.synchronize()


class ReqGraph:
    """One CUDA graph per request bucket, `(running_bs, draft_num)`; static inputs and outputs."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def record(self, fn: Callable[[], Any], bucket: Hashable) -> Any:
        """Record `fn()` (which reads static inputs) for `bucket`; returns its static output."""
        graph = torch.cuda.CUDAGraph()
        with recording_guard():
            with torch.cuda.graph(graph, pool=graph_pool(), stream=capture_stream(), capture_error_mode="thread_local"):
                claim_reservation()
                output = fn()
        uses_pool(graph)
        output = pool_alias(output)
        self.graphs[bucket] = (graph, output)
        compilation_counter.num_cudagraph_captured += 1
        return output

    def replay(self, bucket: Hashable) -> Any:
        graph, output = self.graphs[bucket]
        graph.replay()
        compilation_counter.num_cudagraph_replayed += 1
        return output

    def __contains__(self, bucket: Hashable) -> bool:
        return bucket in self.graphs

    def buckets(self) -> list[Hashable]:
        return sorted(self.graphs)


@dataclass
class _Region:
    fn: Callable
    args: tuple
    kwargs: dict
    static_result: Any  # where the next segment reads the result (None for ops that mutate)
    replay: Optional[Callable] = None  # the op's own bound replay (custom_ops bind_region), if any


@dataclass
class Recording:
    segments: list[torch.cuda.CUDAGraph]
    regions: list[_Region]
    inputs: tuple
    output: Any


class _SegmentRecorder:
    """Set as the forward context's region_recorder while a token graph records.

    A region keeps its tensors as non-owning views from the start (`pool_alias`), as the
    recording keeps its output: what the forward still holds stays allocated while the later
    segments record, and what it drops the later segments (and the next recordings) reuse, as
    an eager run would. A replay runs the segments and regions in the recorded order, so each
    region reads its inputs before any later segment writes over them."""

    def __init__(self) -> None:
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.regions: list[_Region] = []
        self.inside = PoolMembership()
        self._graph: Optional[torch.cuda.CUDAGraph] = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=graph_pool(), capture_error_mode="thread_local")
        claim_reservation()

    def end(self) -> None:
        assert self._graph is not None
        self._graph.capture_end()
        uses_pool(self._graph)
        self.segments.append(self._graph)
        self._graph = None

    def eager_region(self, fn: Callable, args: tuple, kwargs: dict, name: str = "",
                     bind: Optional[Callable] = None) -> Any:
        self.end()
        # Runs once outside the capture (on the recording's not-yet-computed inputs), which also
        # warms the op up; replays run it again on the real data.
        result = fn(*args, **kwargs)
        args, kwargs = pool_alias(args, self.inside), pool_alias(kwargs, self.inside)
        # bound now, while the forward still holds every one of these tensors (binding runs once)
        replay = bind(*args, **kwargs) if bind is not None else None
        self.begin()
        # where replays put the result: pool memory, allocated (no kernel) in the capture that reads it
        static = _static_like(result, name)
        self.regions.append(_Region(fn, args, kwargs, pool_alias(static, lambda ptr: True), replay))
        return static if static is not None else result


def _static_like(result: Any, name: str) -> Any:
    if result is None:
        return None
    if isinstance(result, torch.Tensor):
        return torch.empty_like(result)
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return type(result)(torch.empty_like(r) for r in result)
    raise AtomTypeError(f"eager region {name or '?'} returned {type(result).__name__}; an eager region must "
                    "return None (it mutates its outputs), a tensor, or a tuple of tensors")


def _copy_into(static: Any, live: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(live)
    else:
        for s, r in zip(static, live):
            s.copy_(r)


class TokenGraph:
    """A model's recordings, one per token bucket (rows = bs * q), optionally per phase."""

    def __init__(self, per_phase: bool = False):
        self.per_phase = per_phase
        self.recordings: dict[tuple, Recording] = {}
        self._phase_sizes: dict[str, set[int]] = {"prefill": set(), "decode": set()}

    def _key(self, rows: int, phase: str) -> tuple:
        return (phase if self.per_phase else None, rows)

    def captured_sizes(self, phase: str) -> list[int]:
        """The token buckets a step of `phase` ("prefill" or "decode") can replay."""
        if phase not in self._phase_sizes:
            raise AtomValueError(f"phase: got {phase!r}; allowed: 'prefill', 'decode'")
        return sorted(self._phase_sizes[phase])

    def has(self, rows: int, phase: str) -> bool:
        return rows in self._phase_sizes.get(phase, ()) and self._key(rows, phase) in self.recordings

    def record(self, fn: Callable[[], Any], inputs: tuple, rows: int, phase: str) -> Any:
        """Record `fn()` as segments for this bucket (or reuse the other phase's recording)."""
        key = self._key(rows, phase)
        existing = self.recordings.get(key)
        if existing is not None:
            self._phase_sizes[phase].add(rows)
            return existing.output
        recorder = _SegmentRecorder()
        ctx = dataclasses.replace(get_forward_context(), region_recorder=recorder, tr_graph=None)
        with recording_guard():
            stream = capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), push_forward_context(ctx):
                recorder.begin()
                try:
                    output = fn()
                finally:
                    if recorder._graph is not None:
                        recorder.end()
            torch.cuda.current_stream().wait_stream(stream)
        output = pool_alias(output, recorder.inside)
        self.recordings[key] = Recording(recorder.segments, recorder.regions, pool_alias(tuple(inputs), recorder.inside),
                                         output)
        self._phase_sizes[phase].add(rows)
        compilation_counter.num_cudagraph_captured += len(recorder.segments)
        return output

    def replay(self, rows: int, phase: str, inputs: tuple) -> Any:
        rec = self.recordings[self._key(rows, phase)]
        for recorded, live in zip(rec.inputs, inputs):
            if isinstance(recorded, torch.Tensor) and recorded.data_ptr() != live.data_ptr():
                recorded.copy_(live)
        segments = rec.segments
        segments[0].replay()
        for i, region in enumerate(rec.regions):
            result = region.replay() if region.replay is not None else region.fn(*region.args, **region.kwargs)
            if region.static_result is not None:
                _copy_into(region.static_result, result)
            segments[i + 1].replay()
        compilation_counter.num_cudagraph_replayed += 1
        return rec.output


def token_graph(cls: Optional[type] = None, *, per_phase: bool = False) -> Any:
    """Mark a model class as a token-graph recording unit.

    Outside token-graph steps the model runs as before. With the forward context's tr_graph set
    to "record" a call records the bucket of its row count; with "replay" it replays that bucket
    (or runs normally when none was recorded). `per_phase=True` records prefill and decode
    separately, for a forward whose work differs between them.
    """

    def wrap(cls: type) -> type:
        inner_call = cls.__call__

        @functools.wraps(inner_call)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # traced by an outer torch.compile: no recording
                return inner_call(self, *args, **kwargs)
            ctx = get_forward_context()
            state = ctx.tr_graph
            if state is None:
                return inner_call(self, *args, **kwargs)
            graphs = self.__dict__.get("_token_graph")
            if graphs is None:
                graphs = TokenGraph(per_phase=per_phase)
                self.__dict__["_token_graph"] = graphs
            rows = args[0].shape[0]
            phase = "prefill" if ctx.context is not None and ctx.context.is_prefill else "decode"
            if state == "record":
                return graphs.record(lambda: inner_call(self, *args, **kwargs), args, rows, phase)
            if graphs.has(rows, phase):
                return graphs.replay(rows, phase, args)
            return inner_call(self, *args, **kwargs)

        cls.__call__ = __call__
        cls._atom_token_graph = True
        return cls

    return wrap(cls) if cls is not None else wrap


def eager_region(fn: Callable) -> Callable:
    """Mark a function whose launches depend on host data: token graphs break around it, and on
    replay it runs for real with the live forward context."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = get_forward_context().region_recorder
        if recorder is not None:
            return recorder.eager_region(fn, args, kwargs, name=getattr(fn, "__qualname__", ""))
        return fn(*args, **kwargs)

    wrapper._atom_eager_region = True  # type: ignore[attr-defined]
    return wrapper


def token_graph_of(model: Any) -> Optional[TokenGraph]:
    """The TokenGraph of a model (or of the first submodule marked @token_graph)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else [model]
    for module in modules:
        graphs = module.__dict__.get("_token_graph")
        if graphs is not None:
            return graphs
    return None
