"""AtomBackend: the callable that torch.compile gets, for levels 1-3.

Compiling is a plain pipeline over one traced graph: trace (the sources Dynamo read) -> key
(the cache key factors) -> open the cache -> split at the splitting ops -> compile the pieces.
Its result is a `CompileResult`; the backend keeps only that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.fx as fx

from .. import envs, groups
from ..cache import keys
from ..cache.remote import RemoteTier, tier_for
from ..cache.shared import SharedPieces
from ..cache.store import PieceCache, current_rank
from ..config import (
    DEFAULT_SPLITTING_OPS,
    CompilationConfig,
    CompilationLevel,
    CUDAGraphMode,
    as_compilation_config,
)
from ..counters import compilation_counter
from ..errors import CacheMiss, GraphBreakError
from . import (compile_only, compiled_function, floats, graph_partition, l2_prefetch_pass, regions, rope_attention_pass,
               strict, unsupported)
from .inductor import make_compiler
from .custom_passes import compiler_config
from .manager import CompilerManager
from .piecewise import PiecewiseCompileInterpreter
from .split import SplitItem, split_graph
from .static_inputs import _CopyInputs, _symbolic_tensor_indices, traced_values

__all__ = [
    "AtomBackend", "AtomBackendGraphs", "CacheMiss", "CompileResult", "GraphBreakError", "backend", "compile_graph",
    "effective_cudagraph_mode", "splitting_ops_for", "traced_values", "user_source_files",
]

logger = logging.getLogger("atom_compile")

_TORCH_DIR = os.path.dirname(torch.__file__)


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


@dataclass
class CompileResult:
    """What compiling one graph produced. At level 1 only `fn`, `seconds` and `traced_files`
    are set; at levels 2-3 `cache` is None when compiling without the cache."""

    fn: Callable
    seconds: float
    traced_files: set[str] = field(default_factory=set)
    factors: Optional[dict] = None
    cache_hash: Optional[str] = None
    cache: Optional[PieceCache] = None
    manager: Optional[CompilerManager] = None
    split_gm: Optional[fx.GraphModule] = None
    items: list[SplitItem] = field(default_factory=list)
    copy_indices: Optional[list[int]] = None
    remote: Optional[RemoteTier] = None

    def state(self, cc: CompilationConfig, prefix: str) -> dict:
        """What loading needs besides the graphs: the config, where the pieces are, the copies."""
        return {"format": 1, "config": cc.to_dict(), "prefix": prefix, "cache_hash": self.cache_hash,
                "copy_inputs": self.copy_indices}


class AtomBackend:
    """The torch.compile backend: level 1 runs the graph as traced, level 2 compiles it as one
    piece, level 3 splits it at the splitting ops and compiles each other piece (cached).

    One instance compiles one graph; a second graph (graph break, recompilation) is an error.
    `environment` is what the entry point read (default: read here, once).
    """

    def __init__(
        self,
        cfg: Any = None,
        prefix: str = "backbone",
        *,
        extra_traced_files: Iterable[str] = (),
        serializable: bool = False,
        environment: Optional[envs.Environment] = None,
    ):
        self.compilation_config = as_compilation_config(cfg)
        self.prefix = prefix
        self.extra_traced_files = set(extra_traced_files)
        self.serializable = serializable
        self.environment = environment if environment is not None else envs.read(self.compilation_config.cache_dir)
        self.result: Optional[CompileResult] = None

    @property
    def compiled(self) -> bool:
        return self.result is not None

    @property
    def compiled_callable(self) -> Optional[Callable]:
        return self.result.fn if self.result is not None else None

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        # Python floats Dynamo made symbolic: Dynamo traces again with them as constants (a
        # restart, raised before anything is counted or compiled) and calls us once more.
        floats.specialize_tensorified_floats(gm)
        compilation_counter.num_graphs_seen += 1
        if self.result is not None:
            raise GraphBreakError(
                f"AtomBackend(prefix={self.prefix!r}) was given a second graph. Dynamo either broke the "
                "function into several graphs (a graph break) or traced it again (a guard failed: often a "
                "new size on a dimension not marked dynamic). Use fullgraph=True, mark the sizes that vary "
                "(torch._dynamo.mark_dynamic, or dynamic=True), and run with "
                "TORCH_LOGS=graph_breaks,recompiles to see the cause. One backend instance compiles one graph."
            )
        # Dynamo may restart its analysis from inside a compile (e.g. to specialise a float that
        # dynamic=True made symbolic) and then hand us the graph again: not a second graph. The
        # result is kept only once compile_graph returns, so a restart leaves nothing behind.
        try:
            result = compile_graph(gm, example_inputs, self.compilation_config, self.prefix,
                                   self.environment, self.extra_traced_files)
        except Exception as exc:
            if unsupported.is_restart(exc):
                raise
            raise unsupported.explain(exc, int(self.compilation_config.level), self.prefix) from exc
        self.result = result
        if self.serializable and compiled_function.serializable_base() is not None:
            cls = compiled_function.AtomCompiledFunction
            return cls(result.fn, result.split_gm, result.items, result.state(self.compilation_config, self.prefix))
        return result.fn


class AtomBackendGraphs(AtomBackend):
    """What `backend(cfg)` returns: an AtomBackend for the first graph that also takes later ones.

    Without fullgraph=True a graph break gives Dynamo a second graph (and a size that was not
    marked dynamic, a recompilation): each later graph is compiled by a backend of its own whose
    prefix is `<prefix>-graph<n>`, so its cache entries never collide with the first graph's.
    `result` stays the first graph's; `later` holds the others' backends, in order.
    """

    def __init__(self, cfg: Any = None, prefix: str = "backbone", **kwargs: Any):
        super().__init__(cfg, prefix, **kwargs)
        self.later: list[AtomBackend] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if self.result is None:
            return super().__call__(gm, example_inputs)
        n = len(self.later) + 1
        logger.info("atom-compile: %s: graph %d (a graph break or a recompilation) compiles as %s-graph%d",
                    self.prefix, n, self.prefix, n)
        sub = AtomBackend(self.compilation_config, f"{self.prefix}-graph{n}",
                          extra_traced_files=self.extra_traced_files, serializable=self.serializable,
                          environment=self.environment)
        fn = sub(gm, example_inputs)
        self.later.append(sub)
        return fn


def backend(cfg: Any = None, prefix: str = "backbone") -> AtomBackendGraphs:
    """The torch.compile backend for `cfg` (a Config, CompilationConfig, dict, JSON or level);
    later graphs (graph breaks, recompilations) get backends of their own."""
    return AtomBackendGraphs(cfg, prefix)


# --- the pipeline --------------------------------------------------------------------------

def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], cc: CompilationConfig, prefix: str,
                  environment: envs.Environment, extra_traced_files: Iterable[str] = ()) -> CompileResult:
    """trace -> key -> open cache -> split -> compile pieces."""
    start = time.perf_counter()
    traced_files = user_source_files(_traced_files_from_dynamo() | set(extra_traced_files))
    if cc.level <= CompilationLevel.DYNAMO_AS_IS:
        logger.info("atom-compile: level %d: the graph runs as Dynamo traced it", int(cc.level))
        return CompileResult(gm.forward, time.perf_counter() - start, traced_files)

    inlined = regions.inline_invoke_subgraphs(gm)
    if inlined:
        compilation_counter.num_regions_inlined += inlined
        logger.info("atom-compile: %s: %d nested compile region calls inlined", prefix, inlined)
    _move_rope(gm, cc, example_inputs, prefix)
    compiler = make_compiler(cc)
    traced = traced_values(gm, example_inputs)
    if compile_only.active():
        compile_only.check_graph(gm, traced, compiler_config(cc))
    copies = cc.cudagraph_copy_inputs and effective_cudagraph_mode(cc) != CUDAGraphMode.NONE
    copy_indices = _symbolic_tensor_indices(traced) if copies else None
    factors = keys.build_factors(
        cc, compiler.compute_hash(), _device_type(example_inputs), traced_files, keys.custom_op_names(gm),
        keys.graph_digest(gm, traced),
    )
    if graph_partition.enabled(cc):  # derived from the graph (keyed already); shown by inspect
        factors["graph"]["inductor_partitions"] = graph_partition.partitions(gm, _partition_ops(cc))
    cache_hash = keys.compute_hash(factors)
    cache = open_cache(environment, cache_hash, prefix, factors)
    tier = remote_tier(cc, environment) if cache is not None else None
    if tier is not None and not os.path.lexists(cache.index_path):
        tier.pull(cache)  # look-up order: local disk first, the remote only on a local miss
    shared = SharedPieces(cache, current_rank(), environment.peer_timeout) if cache is not None else None
    manager = CompilerManager(compiler, cache, compiler_config(cc), shared)
    if tier is not None:
        manager.on_commit = lambda: tier.publish(cache)
    if cc.require_cache or environment.require_cache:
        manager.before_compile = _strict_check(environment, prefix, factors, cache_hash, cache, bool(manager.entries))
    if cc.debug_dump_path:  # printing a deep graph costs ~1 s: only for a dump
        _dump(cc, prefix, "traced_graph.py", gm.print_readable(print_output=False))

    floats.fold_constant_scalars(gm)
    split_gm, items = _split(gm, cc)
    group = groups.compile_group(environment.group_compile, environment.peer_timeout,
                                 environment.group_owners) \
        if shared is not None else None
    compile_pieces(split_gm, items, manager, cc, example_inputs, prefix, group)
    _prefetch_weights(split_gm, items, cc, example_inputs, prefix)
    _write_graphs(cc, prefix, cache, split_gm, items)

    fn: Callable = split_gm.forward
    if copy_indices is not None:
        fn = _CopyInputs(fn, copy_indices)
    compiled = sum(1 for item in items if not item.is_splitting_graph)
    logger.info(
        "atom-compile: %s: %d pieces (%d compiled, %d distinct), %.2fs (compiler %.2fs, loads %.2fs)%s",
        prefix, len(items), compiled, len(manager._by_content), time.perf_counter() - start,
        manager.compile_seconds, manager.load_seconds, f", cache {cache.path}" if cache is not None else ", no cache",
    )
    return CompileResult(fn, time.perf_counter() - start, traced_files, factors, cache_hash, cache, manager,
                         split_gm, items, copy_indices, tier)


def _move_rope(gm: fx.GraphModule, cc: CompilationConfig, example_inputs: list[Any], prefix: str) -> None:
    """The RoPE-attention pass, on a CUDA graph before its key is taken (the key holds the
    rewritten graph)."""
    if cc.rope_attention_pass and _device_type(example_inputs) == "cuda":
        moved = rope_attention_pass.fuse_rope_into_attention(gm)
        compilation_counter.num_rope_into_attention += moved
        logger.info("atom-compile: %s: RoPE moved into %d attention ops", prefix, moved)


def _prefetch_weights(split_gm: fx.GraphModule, items: list[SplitItem], cc: CompilationConfig,
                      example_inputs: list[Any], prefix: str) -> None:
    mode = effective_cudagraph_mode(cc)
    full = mode.has_full_cudagraphs() and not mode.uses_tr_hybrid() and not graph_partition.enabled(cc)
    forks = l2_prefetch_pass.apply(split_gm, items, example_inputs, cc.l2_prefetch_mb, full)
    if forks:
        compilation_counter.num_l2_prefetches += forks
        logger.info("atom-compile: %s: %d weight prefetches into L2 before the attention ops", prefix, forks)


def _partition_ops(cc: CompilationConfig) -> list[str]:
    return graph_partition.partition_ops(cc, DEFAULT_SPLITTING_OPS)


def _split(gm: fx.GraphModule, cc: CompilationConfig) -> tuple[fx.GraphModule, list[SplitItem]]:
    """FX pieces cut at the splitting ops, or (Inductor graph partition) the graph as one piece."""
    if graph_partition.enabled(cc):
        split_gm, items, _ = graph_partition.whole_graph(gm, _partition_ops(cc))
        return split_gm, items
    return split_graph(gm, splitting_ops_for(cc))


def _strict_check(environment: envs.Environment, prefix: str, factors: dict, cache_hash: str,
                  cache: Optional[PieceCache], had_entries: bool) -> Callable[[int, Optional[int]], None]:
    """Strict mode's refusal, called before a piece would compile: names the piece, its shape,
    and why the cache could not give it."""

    def check(graph_index: int, shape: Optional[int]) -> None:
        what = f"{prefix}: piece {graph_index} (shape {shape if shape is not None else 'general'})"
        if cache is None:
            reason = strict.nearest_difference(environment.cache_root, prefix, factors, exclude=cache_hash) \
                if environment.cache_root is not None else "the cache is disabled (ATOM_COMPILE_DISABLE_CACHE)"
        elif had_entries:
            reason = (f"cache {cache_hash} ({cache.path}) has this key but no entry for the piece at this shape "
                      "(a compile size or piece its warm-up never compiled, or an entry dropped as damaged)")
        else:
            reason = strict.nearest_difference(environment.cache_root, prefix, factors, exclude=cache_hash)
        strict.refuse(what, reason)

    return check


def open_cache(environment: envs.Environment, cache_hash: str, prefix: str, factors: dict) -> Optional[PieceCache]:
    """The piece cache of this graph (its key factors written beside it), or None without one."""
    if environment.cache_root is None:
        logger.info("atom-compile: ATOM_COMPILE_DISABLE_CACHE is set: compiling without the cache")
        return None
    cache = PieceCache.open(environment.cache_root, cache_hash, current_rank(), prefix)
    if cache is not None:
        cache.write_factors(factors)
    return cache


def remote_tier(cc: CompilationConfig, environment: envs.Environment) -> Optional[RemoteTier]:
    """The remote tier the config (else the environment) names, or None (off)."""
    return tier_for(cc.remote_cache or environment.remote_cache, environment.remote_key,
                    environment.remote_key_file, environment.remote_timeout)


def compile_pieces(split_gm: fx.GraphModule, items: list[SplitItem], manager: CompilerManager,
                   cc: CompilationConfig, example_inputs: list[Any], prefix: str,
                   group: Optional[groups.GroupHandle] = None) -> None:
    """Compile (or load) every piece that is not a splitting op, installing it in `split_gm`;
    with a process group, after the ranks agree on who compiles which (group_compile.py)."""
    compile_names = [item.submod_name for item in items if not item.is_splitting_graph]
    compilation_counter.num_piecewise_graphs_seen += len(items)
    compilation_counter.num_piecewise_capturable_graphs_seen += len(compile_names)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _progress(len(compile_names), f"compiling {prefix}") as step:
        PiecewiseCompileInterpreter(
            split_gm, compile_names, manager, cc.concrete_compile_sizes(), fake_mode, step,
            cc.concrete_compile_ranges(), group,
        ).run(*example_inputs)
    manager.flush()


def _write_graphs(cc: CompilationConfig, prefix: str, cache: Optional[PieceCache],
                  split_gm: fx.GraphModule, items: list[SplitItem]) -> None:
    code = split_gm.print_readable(print_output=False)
    if cache is not None:
        cache.write_text("computation_graph.py", code)
    _dump(cc, prefix, "computation_graph.py", code)
    for item in items if cc.debug_dump_path else ():
        _dump(cc, prefix, f"{item.submod_name}.py", item.graph.print_readable(print_output=False))


def _dump(cc: CompilationConfig, prefix: str, name: str, text: str) -> None:
    if not cc.debug_dump_path:
        return
    directory = Path(cc.debug_dump_path) / f"rank_{current_rank()}" / prefix
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    except OSError as exc:
        logger.warning("atom-compile: cannot write the debug dump %s (%s)", directory / name, exc)


@contextlib.contextmanager
def _progress(total: int, desc: str) -> Iterator[Optional[Callable[[], None]]]:
    if total < 2 or current_rank() != 0 or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=f"atom-compile: {desc}", unit="piece", leave=False) as bar:
        yield lambda: bar.update(1)


def __getattr__(name: str) -> Any:
    # Functions saved before the move name their class here; pickle finds it by this name.
    if name == "AtomCompiledFunction":
        return compiled_function.AtomCompiledFunction
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
