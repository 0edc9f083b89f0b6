"""AtomBackend: the callable that torch.compile gets, for levels 1-3."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.fx as fx

from .. import envs
from ..config import (
    DEFAULT_SPLITTING_OPS,
    CompilationConfig,
    CompilationLevel,
    CUDAGraphMode,
    as_compilation_config,
)
from ..counters import compilation_counter
from ..cache import keys
from ..cache.manager import CompilerManager
from ..cache.store import PieceCache, cache_root, current_rank
from .inductor import make_compiler
from .piecewise import PiecewiseBackend, PiecewiseCompileInterpreter, install
from .split import SplitItem, split_graph

logger = logging.getLogger("atom_compile")

_TORCH_DIR = os.path.dirname(torch.__file__)


class GraphBreakError(RuntimeError):
    """Dynamo handed one AtomBackend a second graph (a graph break or a recompilation)."""


class CacheMiss(RuntimeError):
    """A saved Dynamo function cannot be rebuilt from the cache (the caller traces instead)."""


def effective_cudagraph_mode(cc: CompilationConfig) -> CUDAGraphMode:
    if cc.cudagraph_mode is not None:
        return cc.cudagraph_mode
    return CUDAGraphMode.TR_HYBRID if cc.level == CompilationLevel.PIECEWISE else CUDAGraphMode.NONE


def splitting_ops_for(cc: CompilationConfig) -> list[str]:
    if cc.level == CompilationLevel.DYNAMO_ONCE:
        return []
    if cc.splitting_ops is not None:
        return list(cc.splitting_ops)
    return list(DEFAULT_SPLITTING_OPS)


def _device_type(example_inputs: Iterable[Any]) -> str:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter):
            return x.device.type
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def _traced_files_from_dynamo() -> set[str]:
    tc = torch._guards.TracingContext.try_get()
    codes = getattr(tc, "traced_code", None) or []
    return {c.co_filename for c in codes}


def user_source_files(files: Iterable[str]) -> set[str]:
    """Traced files that are not torch's own (torch's are covered by torch_key)."""
    return {f for f in files if not os.path.abspath(f).startswith(_TORCH_DIR + os.sep)}


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


class AtomBackend:
    """The torch.compile backend: level 1 runs the graph as traced, level 2 compiles it as one
    piece, level 3 splits it at the splitting ops and compiles each other piece (cached).

    One instance compiles one graph; a second graph (graph break, recompilation) is an error.
    """

    def __init__(
        self,
        cfg: Any = None,
        prefix: str = "backbone",
        *,
        extra_traced_files: Iterable[str] = (),
        serializable: bool = False,
    ):
        self.compilation_config = as_compilation_config(cfg)
        self.prefix = prefix
        self.extra_traced_files = set(extra_traced_files)
        self.serializable = serializable
        self.compiled = False
        self.traced_files: set[str] = set()
        self.factors: Optional[dict] = None
        self.cache_hash: Optional[str] = None
        self.cache: Optional[PieceCache] = None
        self.manager: Optional[CompilerManager] = None
        self.split_gm: Optional[fx.GraphModule] = None
        self.items: list[SplitItem] = []
        self.compile_seconds = 0.0
        self.compiled_callable: Optional[Callable] = None
        self._copy_indices: Optional[list[int]] = None

    # --- torch.compile calls this --------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compilation_counter.num_graphs_seen += 1
        if self.compiled:
            raise GraphBreakError(
                f"AtomBackend(prefix={self.prefix!r}) was given a second graph. Dynamo either broke the "
                "function into several graphs (a graph break) or traced it again (a guard failed: often a "
                "new size on a dimension not marked dynamic). Use fullgraph=True, mark the sizes that vary "
                "(torch._dynamo.mark_dynamic, or dynamic=True), and run with "
                "TORCH_LOGS=graph_breaks,recompiles to see the cause. One backend instance compiles one graph."
            )
        start = time.perf_counter()
        try:
            fn = self._compile(gm, example_inputs, start)
        except BaseException:
            # Dynamo may restart its analysis from inside a compile (e.g. to specialise a float
            # that dynamic=True made symbolic) and then hand us the graph again: not a second graph.
            self.split_gm, self.items = None, []
            raise
        self.compiled = True
        return fn

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any], start: float) -> Callable:
        cc = self.compilation_config
        self.traced_files = user_source_files(_traced_files_from_dynamo() | self.extra_traced_files)
        if cc.level <= CompilationLevel.DYNAMO_AS_IS:
            logger.info("atom-compile: level %d: the graph runs as Dynamo traced it", int(cc.level))
            return self._finish(gm.forward, gm, example_inputs, start)

        compiler = make_compiler(cc)
        device_type = _device_type(example_inputs)
        traced = traced_values(gm, example_inputs)
        copies = cc.cudagraph_copy_inputs and effective_cudagraph_mode(cc) != CUDAGraphMode.NONE
        self._copy_indices = _symbolic_tensor_indices(traced) if copies else None
        self.factors = keys.build_factors(
            cc, compiler.compute_hash(), device_type, self.traced_files, keys.custom_op_names(gm),
            keys.graph_digest(gm, traced),
        )
        self.cache_hash = keys.compute_hash(self.factors)
        self.cache = self._open_cache()
        if self.cache is not None:
            self.cache.write_factors(self.factors)
        self.manager = CompilerManager(compiler, self.cache, cc.inductor_compile_config)
        self._dump("traced_graph.py", gm.print_readable(print_output=False))

        split_gm, items = split_graph(gm, splitting_ops_for(cc))
        self.split_gm, self.items = split_gm, items
        compile_names = [item.submod_name for item in items if not item.is_splitting_graph]
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(compile_names)

        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        if fake_mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with _progress(len(compile_names), f"compiling {self.prefix}") as step:
            PiecewiseCompileInterpreter(
                split_gm, compile_names, self.manager, cc.concrete_compile_sizes(), fake_mode, step
            ).run(*example_inputs)
        self.manager.flush()

        code = split_gm.print_readable(print_output=False)
        if self.cache is not None:
            self.cache.write_text("computation_graph.py", code)
        self._dump("computation_graph.py", code)
        for item in items:
            self._dump(f"{item.submod_name}.py", item.graph.print_readable(print_output=False))
        fn: Callable = split_gm.forward
        if self._copy_indices is not None:
            fn = _CopyInputs(fn, self._copy_indices)
        logger.info(
            "atom-compile: %s: %d pieces (%d compiled, %d distinct), %.2fs (compiler %.2fs, loads %.2fs)%s",
            self.prefix, len(items), len(compile_names), len(self.manager._by_content),
            time.perf_counter() - start, self.manager.compile_seconds, self.manager.load_seconds,
            f", cache {self.cache.path}" if self.cache is not None else ", no cache",
        )
        return self._finish(fn, gm, example_inputs, start)

    def _finish(self, fn: Callable, gm: fx.GraphModule, example_inputs: list[Any], start: float) -> Callable:
        """Record the result; wrapped for saving with the Dynamo function when asked to."""
        self.compile_seconds = time.perf_counter() - start
        self.compiled_callable = fn
        if self.serializable and serializable_base() is not None:
            cls = __getattr__("AtomCompiledFunction")
            return cls(fn, self.split_gm, self.items, self._state())
        return fn

    def _state(self) -> dict:
        """What loading needs besides the graphs: the config, where the pieces are, the copies."""
        return {
            "format": 1,
            "config": self.compilation_config.to_dict(),
            "prefix": self.prefix,
            "cache_hash": self.cache_hash,
            "copy_inputs": self._copy_indices,
        }

    def _open_cache(self) -> Optional[PieceCache]:
        if envs.cache_disabled():
            logger.info("atom-compile: ATOM_COMPILE_DISABLE_CACHE is set: compiling without the cache")
            return None
        root = cache_root(self.compilation_config.cache_dir)
        return PieceCache.open(root, self.cache_hash, current_rank(), self.prefix)

    def _dump(self, name: str, text: str) -> None:
        path = self.compilation_config.debug_dump_path
        if not path:
            return
        directory = Path(path) / f"rank_{current_rank()}" / self.prefix
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text)
        except OSError as exc:
            logger.warning("atom-compile: cannot write the debug dump %s (%s)", directory / name, exc)


def backend(cfg: Any = None, prefix: str = "backbone") -> AtomBackend:
    """The torch.compile backend for `cfg` (a Config, CompilationConfig, dict, JSON or level)."""
    return AtomBackend(cfg, prefix)


@contextlib.contextmanager
def _progress(total: int, desc: str) -> Iterator[Optional[Callable[[], None]]]:
    if total < 2 or current_rank() != 0 or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=f"atom-compile: {desc}", unit="piece", leave=False) as bar:
        yield lambda: bar.update(1)


# --- the warm start that skips Dynamo ------------------------------------------------------

_load_root: contextvars.ContextVar[Optional[Path]] = contextvars.ContextVar("atom_compile_load_root", default=None)


@contextlib.contextmanager
def loading_from(root: Path) -> Iterator[None]:
    """Deserialising an AtomCompiledFunction inside this block reads pieces from `root`."""
    token = _load_root.set(Path(root))
    try:
        yield
    finally:
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
        raise RuntimeError("this torch cannot save a Dynamo function")

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


def rebuild_from_cache(split_gm: fx.GraphModule, items: list[SplitItem], state: dict, root: Path) -> Callable:
    """The compiled callable for a split graph whose pieces are all in the cache."""
    cc = CompilationConfig.from_dict(state["config"])
    compiler = make_compiler(cc)
    if not compiler.loads_without_inputs:
        raise CacheMiss(f"the {compiler.name} compiler cannot load without tracing")
    cache = PieceCache.open(root, state["cache_hash"], current_rank(), state["prefix"])
    if cache is None:
        raise CacheMiss("the cache directory is not usable")
    manager = CompilerManager(compiler, cache, cc.inductor_compile_config)
    compile_items = [item for item in items if not item.is_splitting_graph]
    loaded = manager.load_general(len(compile_items))
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
