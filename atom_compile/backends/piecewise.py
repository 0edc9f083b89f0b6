"""Compile every non-splitting piece for the general shape, and per size on demand."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from . import compile_only
from .group_compile import Piece, PieceCompile, compile_with_group
from .manager import CompilerManager
from .ranges import compile_ranges, find_range, range_label
from .size_args import size_args

logger = logging.getLogger("atom_compile")


def shape_locator(args: list[Any]) -> Optional[list[int]]:
    """Where a piece's runtime size (the token count) is read: [i] for a SymInt argument,
    [i, d] for dim d of tensor argument i; None for a piece with no symbolic size."""
    for i, x in enumerate(args):
        if isinstance(x, torch.SymInt) and not x.node.expr.is_number:
            return [i]
    for i, x in enumerate(args):
        if isinstance(x, torch.Tensor):
            for d, size in enumerate(x.shape):
                if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                    return [i, d]
    return None


def read_runtime_shape(args: tuple, locator: Optional[list[int]]) -> Optional[int]:
    if locator is None:
        return None
    x = args[locator[0]]
    return int(x) if len(locator) == 1 else int(x.shape[locator[1]])


@dataclass
class ConcreteSizeEntry:
    """One size from compile_sizes: compiled the first time a call of that size arrives, or
    ahead (a group's agreement) from fake inputs whose content key is `key`: the first call
    checks that its real inputs have that key before it runs the piece."""

    runtime_shape: int
    runnable: Optional[Callable] = None
    key: Optional[str] = None


class PiecewiseBackend:
    """A compiled piece: the general-shape callable plus per-size entries."""

    def __init__(
        self,
        graph: fx.GraphModule,
        graph_index: int,
        general: Callable,
        locator: Optional[list[int]],
        compile_sizes: list[int],
        manager: CompilerManager,
        range_pieces: Optional[dict[tuple[int, int], Callable]] = None,
    ):
        self.graph = graph
        self.graph_index = graph_index
        self.compiled_graph_for_general_shape = general
        self.locator = locator
        self.manager = manager
        self.concrete_size_entries = (
            {size: ConcreteSizeEntry(size) for size in compile_sizes} if locator is not None else {}
        )
        # compile ranges (see ranges.py): sorted (lo, hi) -> the range's compiled piece
        self.range_pieces = dict(sorted((range_pieces or {}).items()))
        self._ranges = list(self.range_pieces)

    @property
    def dispatches(self) -> bool:
        """Whether a call must look at its size (else the general piece serves every call)."""
        return bool(self.concrete_size_entries or self.range_pieces)

    def __call__(self, *args: Any) -> Any:
        if not self.dispatches:
            return self.compiled_graph_for_general_shape(*args)
        size = read_runtime_shape(args, self.locator)
        entry = self.concrete_size_entries.get(size)
        if entry is None:
            span = find_range(self._ranges, size) if self._ranges else None
            if span is not None:
                return self.range_pieces[span](*args)
            return self.compiled_graph_for_general_shape(*args)
        if entry.key is not None:
            entry.runnable = self._check_ahead(entry, args)
        if entry.runnable is None:
            if _capturing(args):
                # a compile inside someone's CUDA-graph capture would break it (the host records
                # graphs in host mode): the general piece runs, and the size compiles later
                _warn_capture_once(size)
                return self.compiled_graph_for_general_shape(*args)
            entry.runnable = self.compile_size(size, list(args))
        return entry.runnable(*args)

    def _check_ahead(self, entry: ConcreteSizeEntry, args: tuple) -> Optional[Callable]:
        """The size's piece compiled ahead, if the real inputs are those it was compiled for."""
        ahead, key, entry.key = entry.runnable, entry.key, None
        if self.manager.content_key_of(self.graph, list(args), entry.runtime_shape) == key:
            return ahead
        return None

    def compile_size(self, size: int, args: list[Any]) -> Callable:
        fn = self.manager.compile(self.graph, args, self.graph_index, runtime_shape=size)
        self.manager.flush()
        return fn


_warned_sizes: set[int] = set()


def _capturing(args: tuple) -> bool:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _warn_capture_once(size: int) -> None:
    if size not in _warned_sizes:
        _warned_sizes.add(size)
        logger.warning("atom-compile: compile size %d was first seen inside a CUDA-graph capture; the graph "
                       "records the general-shape piece (run each compile size once before capturing)", size)


def install(split_gm: fx.GraphModule, name: str, backend: PiecewiseBackend) -> None:
    """Put the compiled piece where the stitching module calls `self.<name>(...)`: an instance
    attribute wins over `_modules`. Without per-size entries the general callable goes in
    directly, one Python frame less per piece and step. Compiling only (fake weights), a
    `FakeRun` goes in instead: compiled code never runs on fake data."""
    if compile_only.active():
        split_gm.__dict__[name] = FakeRun(backend)
        return
    split_gm.__dict__[name] = backend if backend.dispatches else backend.compiled_graph_for_general_shape


class FakeRun:
    """A compiled piece's stand-in while compiling only: a call of a compile size compiles (or
    loads) that size's entry, as the piece itself would; the outputs are the piece's graph run
    on the (fake) inputs."""

    def __init__(self, piece: PiecewiseBackend):
        self.piece = piece
        self.sizes_done: set[int] = set()

    def __call__(self, *args: Any) -> Any:
        piece = self.piece
        if piece.concrete_size_entries:
            size = read_runtime_shape(args, piece.locator)
            entry = piece.concrete_size_entries.get(size)
            if entry is not None and entry.runnable is None and size not in self.sizes_done:
                piece.compile_size(size, list(args))
                self.sizes_done.add(size)
        mode = torch._guards.detect_fake_mode(args)
        with mode if mode is not None else contextlib.nullcontext():
            return piece.graph(*args)


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; compiles each piece as it reaches it.

    Running it (rather than compiling pieces in isolation) gives every piece example inputs
    with the symbolic sizes Dynamo traced, exactly as the stitching module will call it.
    """

    def __init__(
        self,
        split_gm: fx.GraphModule,
        compile_names: list[str],
        manager: CompilerManager,
        compile_sizes: list[int],
        fake_mode: FakeTensorMode,
        progress: Optional[Callable[[], None]] = None,
        ranges: Optional[list[tuple[int, int]]] = None,
        group: Any = None,
    ):
        super().__init__(split_gm)
        self.compile_names = compile_names
        self.manager = manager
        self.compile_sizes = compile_sizes
        self.fake_mode = fake_mode
        self.progress = progress
        self.ranges = ranges or []
        self.backends: dict[str, PiecewiseBackend] = {}
        # with a process group (groups.GroupHandle) the pieces are compiled after the run,
        # once the ranks have agreed on who compiles which (group_compile.py)
        self.group = group
        self.pending: list[Piece] = []

    def _fake(self) -> Any:
        @contextlib.contextmanager
        def scope():
            with self.fake_mode, enable_python_dispatcher():
                yield
        return scope()

    def run(self, *args: Any) -> Any:
        # A fake tensor of another mode (a fake-weight build's inputs) is converted as a real
        # one is: Dynamo's mode gives back the symbolic value it traced.
        fake_args = [
            self.fake_mode.from_tensor(t)
            if isinstance(t, torch.Tensor) and not (isinstance(t, FakeTensor) and t.fake_mode is self.fake_mode)
            else t
            for t in args
        ]
        with self._fake():
            out = super().run(*fake_args)
        if self.pending:  # outside the fake mode: the exchange makes real tensors
            self._compile_agreed()
        return out

    def _compile_agreed(self) -> None:
        """Every compile of the pending pieces (general shape, ranges, sizes) dealt out by the
        group's agreement; then each piece installed."""
        with self._fake():
            compiles = [c for piece in self.pending for c in self._compiles_of(piece)]
        compile_with_group(self.group, self.manager, compiles, self._compile_one, self._fake)
        for piece in self.pending:
            mine = [c for c in compiles if c.piece is piece]
            general = next(c.fn for c in mine if c.shape is None)
            by_range = {span: c.fn for span in self.ranges for c in mine if c.shape == range_label(*span)}
            backend = PiecewiseBackend(piece.graph, piece.index, general, piece.locator, self.compile_sizes,
                                       self.manager, by_range)
            for c in mine:
                entry = backend.concrete_size_entries.get(c.shape) if isinstance(c.shape, int) else None
                if entry is not None:
                    entry.runnable, entry.key = c.fn, c.key
            self._installed(piece, backend)

    def _compiles_of(self, piece: Piece) -> list[PieceCompile]:
        """A piece's compiles: its general shape, each compile range and each compile size
        (with inputs bound to the size; a size they cannot be made for compiles at first call)."""
        out = [PieceCompile(piece, None, piece.args)]
        if piece.locator is None:
            return out
        out += [PieceCompile(piece, range_label(lo, hi), piece.args) for lo, hi in self.ranges]
        for size in self.compile_sizes:
            args = size_args(piece.args, piece.locator, size)
            if args is not None:
                out.append(PieceCompile(piece, size, args))
        return out

    def _compile_one(self, c: PieceCompile) -> None:
        c.fn = self.manager.compile(c.piece.graph, c.args, c.piece.index, c.shape, c.piece.locator)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target not in self.compile_names:
            return super().call_module(target, args, kwargs)
        index = self.compile_names.index(target)
        submod = self.fetch_attr(target)
        # Dynamo already computed every value's fake tensor: taking the piece's outputs from
        # there (in our fake mode) is exact, and spares fake-running dozens of identical layers.
        output = self._traced_outputs(submod)
        if output is None:
            output = super().call_module(target, args, kwargs)
            _stamp_outputs(submod, output)
        piece = Piece(target, submod, list(args), index, shape_locator(list(args)))
        if self.group is not None:
            self.pending.append(piece)
        else:
            self._compile_piece(piece)
        return output

    def _compile_piece(self, piece: Piece) -> None:
        """Compile (or load) one piece for the general shape and its ranges; install it."""
        general = self.manager.compile(piece.graph, piece.args, piece.index, None, piece.locator)
        by_range = compile_ranges(self.manager, piece.graph, piece.args, piece.index, self.ranges, piece.locator)
        backend = PiecewiseBackend(piece.graph, piece.index, general, piece.locator, self.compile_sizes,
                                   self.manager, by_range)
        self._installed(piece, backend)

    def _installed(self, piece: Piece, backend: PiecewiseBackend) -> None:
        self.backends[piece.target] = backend
        install(self.module, piece.target, backend)
        if self.progress is not None:
            self.progress()

    def _traced_outputs(self, graph: fx.GraphModule) -> Any:
        """The piece's outputs from the example values Dynamo left on its output nodes, converted
        into this interpreter's fake mode (Dynamo hands its backend a mode of its own over the
        same ShapeEnv, so the symbolic sizes carry over); None if any is missing."""
        out_node = next(iter(reversed(graph.graph.nodes)))
        if out_node.op != "output":
            return None
        result = out_node.args[0]
        nodes = list(result) if isinstance(result, (list, tuple)) else [result]
        values = []
        for node in nodes:
            value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
            if not isinstance(value, FakeTensor):
                return None
            values.append(value if value.fake_mode is self.fake_mode else self.fake_mode.from_tensor(value))
        return type(result)(values) if isinstance(result, (list, tuple)) else values[0]


def _stamp_outputs(graph: fx.GraphModule, output: Any) -> None:
    """Give the piece's output nodes the fake values they produce, so that Inductor's
    "from_graph" mode finds the traced fake mode even when Dynamo left no example_value."""
    out_node = next(iter(reversed(graph.graph.nodes)))
    if out_node.op != "output":
        return
    nodes = out_node.args[0]
    values = output
    if isinstance(nodes, fx.Node):
        nodes, values = [nodes], [output]
    if not isinstance(nodes, (list, tuple)) or not isinstance(values, (list, tuple)):
        return
    for node, value in zip(nodes, values):
        if isinstance(node, fx.Node) and "example_value" not in node.meta and isinstance(value, FakeTensor):
            node.meta["example_value"] = value
