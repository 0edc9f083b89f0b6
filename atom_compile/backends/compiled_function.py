"""A compiled graph in a form torch can save with the Dynamo function, and its loading.

`AtomCompiledFunction` subclasses torch's `SerializableCallable` (torch >= 2.10): saving it keeps
the stitching graph, the pieces' graphs (code only) and where the compiled pieces live in our
cache; loading (inside `loading_from(root)`) rebuilds the stitching module and loads every piece
by index, so neither Dynamo nor Inductor runs. backends/aot.py saves and finds these files.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx

from ..cache.store import PieceCache, current_rank
from ..config import CompilationConfig
from ..counters import compilation_counter
from ..errors import AtomRuntimeError, CacheMiss
from .inductor import make_compiler
from .custom_passes import compiler_config
from .manager import CompilerManager
from . import strict
from .piecewise import PiecewiseBackend, install
from .split import SplitItem
from .static_inputs import _CopyInputs

logger = logging.getLogger("atom_compile")

_load_root: contextvars.ContextVar[Optional[Path]] = contextvars.ContextVar("atom_compile_load_root", default=None)
_load_strict: contextvars.ContextVar[bool] = contextvars.ContextVar("atom_compile_load_strict", default=False)


@contextlib.contextmanager
def loading_from(root: Path, require_cache: bool = False) -> Iterator[None]:
    """Deserialising an AtomCompiledFunction inside this block reads pieces from `root`; with
    `require_cache` (strict mode) its pieces may never compile a size later."""
    token = _load_root.set(Path(root))
    strict_token = _load_strict.set(require_cache)
    try:
        yield
    finally:
        _load_strict.reset(strict_token)
        _load_root.reset(token)


def _strip(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a graph module without node metadata (fake tensors, stack traces): loading
    needs only the code, and unpickling fake tensors would cost seconds."""
    return fx.GraphModule(gm, _graph_only(gm))


def serializable_base() -> Optional[type]:
    """torch's SerializableCallable (torch >= 2.10), imported only when needed: importing it
    imports Dynamo, which a level-0 user of this package should not pay for."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:  # older torch: no warm start that skips Dynamo
        return None
    return SerializableCallable


def __getattr__(name: str) -> Any:
    # AtomCompiledFunction subclasses a Dynamo class; it is built on first use (pickle finds it
    # here by name when torch loads a saved function).
    if name == "AtomCompiledFunction":
        cls = globals().get(name) or _make_compiled_function_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_compiled_function_class() -> type:
    base = serializable_base()
    if base is None:
        raise AtomRuntimeError("this torch cannot save a Dynamo function")

    class AtomCompiledFunction(_CompiledFunctionBody, base):  # type: ignore[misc,valid-type]
        __doc__ = _CompiledFunctionBody.__doc__
        __module__ = __name__
        __qualname__ = "AtomCompiledFunction"

    return AtomCompiledFunction


class _CompiledFunctionBody:
    """The compiled callable in a form torch can save with the Dynamo function.

    Saved: the stitching graph and the pieces' graphs (code only) and where the compiled
    pieces live in our cache; loading rebuilds the stitching module and loads every piece by
    index, so neither Dynamo nor Inductor runs.
    """

    def __init__(self, fn: Callable, split_gm: Optional[fx.GraphModule], items: list[SplitItem], state: dict):
        self.fn = fn
        self.split_gm = split_gm
        self.items = items
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @classmethod
    def serialize_compile_artifacts(cls, fn: Any) -> bytes:
        from torch.fx._graph_pickler import GraphPickler, Options

        if fn.split_gm is None:
            raise CacheMiss("nothing to save at this level")
        pieces = [
            (item.submod_name, item.is_splitting_graph, GraphPickler.dumps(_strip(item.graph), Options(ops_filter=None)))
            for item in fn.items
        ]
        # The stitching graph alone: its pieces travel separately (above) and are put back on load.
        graph = _graph_only(fn.split_gm)
        holders: dict[str, Any] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                holders[node.target] = torch.nn.Module()
            elif node.op == "get_attr":
                holders[node.target] = getattr(fn.split_gm, node.target)
        stitch = GraphPickler.dumps(fx.GraphModule(holders, graph), Options(ops_filter=None))
        return pickle.dumps({"stitch": stitch, "pieces": pieces, **fn.state})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler

        root = _load_root.get()
        if root is None:
            raise CacheMiss("an atom-compile function can only be loaded through atom_compile")
        state = pickle.loads(data)
        if state.get("format") != 1 or not state.get("cache_hash"):
            raise CacheMiss("saved function of an unknown format")
        mode = FakeTensorMode()
        items = []
        for graph_id, (name, is_split, blob) in enumerate(state.pop("pieces")):
            piece = GraphPickler.loads(blob, mode)
            piece.recompile()
            items.append(SplitItem(name, graph_id, is_split, piece))
        stitch = GraphPickler.loads(state.pop("stitch"), mode)
        split_gm = fx.GraphModule({item.submod_name: item.graph for item in items}, stitch.graph)
        return cls(rebuild_from_cache(split_gm, items, state, root), split_gm, items, state)


def _graph_only(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        node.meta = {}
    return graph


def _refuse_size(prefix: str, cache: PieceCache, graph_index: int, shape: Optional[int]) -> None:
    strict.refuse(f"{prefix}: piece {graph_index} (shape {shape if shape is not None else 'general'})",
                  f"cache {cache.path} has no entry for it (a compile size its warm-up never ran)")


def rebuild_from_cache(split_gm: fx.GraphModule, items: list[SplitItem], state: dict, root: Path) -> Callable:
    """The compiled callable for a split graph whose pieces are all in the cache."""
    cc = CompilationConfig.from_dict(state["config"])
    compiler = make_compiler(cc)
    if not compiler.loads_without_inputs:
        raise CacheMiss(f"the {compiler.name} compiler cannot load without tracing")
    cache = PieceCache.open(root, state["cache_hash"], current_rank(), state["prefix"])
    if cache is None:
        raise CacheMiss("the cache directory is not usable")
    manager = CompilerManager(compiler, cache, compiler_config(cc))
    if _load_strict.get():
        manager.before_compile = functools.partial(_refuse_size, state["prefix"], cache)
    compile_items = [item for item in items if not item.is_splitting_graph]
    if cc.compile_ranges:  # range pieces are loaded while tracing (they need the fake inputs)
        raise CacheMiss("compile ranges are loaded on the traced path")
    loaded = manager.load_general(len(compile_items), [item.graph for item in compile_items])
    if loaded is None:
        raise CacheMiss("a piece is missing from the cache")
    compilation_counter.num_piecewise_graphs_seen += len(items)
    compilation_counter.num_piecewise_capturable_graphs_seen += len(compile_items)
    for index, (item, (fn, locator)) in enumerate(zip(compile_items, loaded)):
        piece = PiecewiseBackend(item.graph, index, fn, locator, cc.concrete_compile_sizes(), manager)
        install(split_gm, item.submod_name, piece)
    manager.flush()
    out: Callable = split_gm.forward
    if state.get("copy_inputs"):
        out = _CopyInputs(out, list(state["copy_inputs"]))
    return out
