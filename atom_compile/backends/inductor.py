"""Inductor adaptors: `standalone_compile` (torch >= 2.8) and the older `compile_fx` route.

Every version quirk of Inductor that the package depends on is handled in this file.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
from typing import Any, Callable, Optional
from unittest import mock

import torch
import torch.fx as fx

from ..config import CompilationConfig
from ..counters import compilation_counter
from ..ops import kernel_dir
from . import cpu_isa, reductions
from .base import CompilerInterface, EagerAdaptor, Handle

logger = logging.getLogger("atom_compile")

ARTIFACT_DIR = "artifacts"


def has_standalone_compile() -> bool:
    return hasattr(torch._inductor, "standalone_compile")


def _graph_device(example_inputs: list[Any]) -> str:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def _config_patches(compiler_config: dict[str, Any], runtime_shape: Optional[int], device: str) -> dict:
    patches = dict(compiler_config or {})
    patches.pop(reductions.ROW_LIMIT_KEY, None)  # ours, not Inductor's: see _codegen_choices
    # The runtime half owns CUDA graphs; Inductor must not capture its own.
    patches.setdefault("triton.cudagraphs", False)
    if device == "cpu":
        for name, value in cpu_isa.config_patches().items():
            patches.setdefault(name, value)
    if isinstance(runtime_shape, int) and device == "cuda":
        # A concrete size is worth tuning for; on CPU autotuning only costs time.
        patches.setdefault("max_autotune", True)
        patches.setdefault("coordinate_descent_tuning", True)
    return patches


def _codegen_choices(compiler_config: Optional[dict[str, Any]]):
    """The Inductor heuristics a piece compiles under (backends/reductions.py)."""
    return reductions.persistent_rows((compiler_config or {}).get(reductions.ROW_LIMIT_KEY, 0))


def ensure_tuple_output(graph: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """A single-output piece from split_module returns a bare Node, which some versions of
    Inductor's "from_graph" path reject; return a copy whose output is a 1-tuple, and True."""
    output = next(iter(reversed(graph.graph.nodes)))
    if output.op == "output" and isinstance(output.args[0], fx.Node):
        graph = copy.copy(graph)
        graph.graph = copy.deepcopy(graph.graph)
        out = next(iter(reversed(graph.graph.nodes)))
        out.args = ((out.args[0],),)
        graph.recompile()
        return graph, True
    return graph, False


def _unwrapped(fn: Callable, single: bool) -> Callable:
    if not single:
        return fn

    def call(*args: Any) -> Any:
        return fn(*args)[0]

    return call


def _atomic_save(path: str, save: Callable[[str], None]) -> None:
    """Write through a temp file in the same directory, then rename (readers never see half);
    the directory is made 0700 and the file 0600, whatever the umask."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        save(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def inductor_files_in(directory: Optional[str]):
    """Point Inductor's own cache (generated code, the C++ libraries it builds on CPU, Triton
    kernels) at `directory` while a piece compiles or loads. A CPU artifact names its compiled
    library without carrying it; kept beside the artifact, a warm start finds it instead of
    running the C++ compiler again. With no directory (no cache, or a read-only one), nothing
    changes."""
    if directory is None:
        yield
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:  # pragma: no cover - torch without the helper: leave Inductor's cache alone
        yield
        return
    with temporary_cache_dir(directory):
        yield


def prime_cpu_isa(isa_dir: Optional[str], inductor_dir: Optional[str]) -> None:
    """Run Inductor's probe of the CPU's vector ISA once per process, in `isa_dir` (else
    `inductor_dir`), or take the answer a process before us recorded in `isa_dir` (cpu_isa.py).

    The probe builds test programs into the current cache directory (seconds in a fresh one)
    and the process remembers its answer even when the build fails, so it must first run
    where writing works: the manager hands us a directory only after it checked it (the
    root's shared probe directory, else the piece's own)."""
    try:
        cpu_isa.prime(isa_dir or inductor_dir, isa_dir is not None, inductor_files_in)
    except Exception as exc:  # pragma: no cover - no C++ toolchain: Inductor says so when it compiles
        logger.debug("atom-compile: Inductor's CPU ISA probe failed (%s: %s)", type(exc).__name__, exc)


def _inductor_env_factors() -> dict[str, Any]:
    from torch._inductor import config as inductor_config

    factors: dict[str, Any] = {}
    try:
        from torch._inductor.codecache import torch_key

        factors["torch_key"] = torch_key().hex()
    except Exception:  # pragma: no cover - private API moved
        factors["torch_key"] = None
    try:
        # The portable part of Inductor's config; machine-local entries are excluded by torch.
        portable = inductor_config.save_config_portable()
        skip = {"compile_threads", "worker_start_method", "debug", "trace.enabled"}
        factors["inductor_config"] = {
            k: repr(v) for k, v in sorted(portable.items()) if k not in skip and not k.startswith("_")
        }
    except Exception:  # pragma: no cover
        factors["inductor_config"] = None
    # The CPU's vector ISA decides Inductor's C++ code. torch's own probe compiles a test
    # program (~0.7 s); the dispatcher's capability answers the same question for free.
    try:
        factors["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover
        factors["cpu_capability"] = None
    return factors


class InductorStandaloneAdaptor(CompilerInterface):
    """`torch._inductor.standalone_compile`: each piece becomes one self-contained file."""

    name = "inductor_standalone"
    loads_without_inputs = True

    def compute_hash(self) -> dict[str, Any]:
        return {"compiler": self.name, **_inductor_env_factors()}

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        compilation_counter.num_inductor_compiles += 1
        graph, single = ensure_tuple_output(graph)
        patches = _config_patches(compiler_config, runtime_shape, _graph_device(example_inputs))
        # "from_tracing_context" broke Dynamo's guard building on 2.13; "from_graph" works for
        # the general shape, and a concrete size specialises on the real inputs.
        dynamic_shapes = "from_example_inputs" if isinstance(runtime_shape, int) else "from_graph"
        device = _graph_device(example_inputs)
        if device == "cpu" and key is not None:
            prime_cpu_isa(self.isa_dir, self.inductor_dir)
        elif device == "cuda":
            kernel_dir.prepare_triton_driver()
        with torch.no_grad(), inductor_files_in(self.inductor_dir if key is not None else None), \
                _codegen_choices(compiler_config):
            artifact = torch._inductor.standalone_compile(
                graph, list(example_inputs), dynamic_shapes=dynamic_shapes,
                options={"config_patches": patches},
            )
            handle = self._save(artifact, key, single)
        if handle is not None:
            handle["device"] = device
        return _unwrapped(artifact, single), handle

    def _save(self, artifact: Any, key: Optional[str], single: bool) -> Optional[Handle]:
        if self.cache_dir is None or key is None:
            return None
        # 2.11+ says up front whether it can serialise; older ones raise from save().
        is_saveable = getattr(artifact, "is_saveable", None)
        if is_saveable is not None and not is_saveable():
            compilation_counter.num_unsaveable_artifacts += 1
            logger.info("atom-compile: Inductor cannot serialise piece %s; it stays compiled in memory only", key)
            return None
        rel = os.path.join(ARTIFACT_DIR, f"{key}.bin")
        try:
            _atomic_save(os.path.join(self.cache_dir, rel), lambda p: artifact.save(path=p, format="binary"))
        except RuntimeError as exc:
            compilation_counter.num_unsaveable_artifacts += 1
            logger.info("atom-compile: Inductor cannot serialise piece %s (%s); it stays in memory only", key, exc)
            return None
        except OSError as exc:
            self.last_save_error = exc
            return None
        return {"path": rel, "single_output": single}

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        from torch._inductor import CompiledArtifact

        path = os.path.join(self.cache_dir or "", handle["path"])
        if handle.get("device", "cpu") == "cpu":
            prime_cpu_isa(self.isa_dir, self.inductor_dir)
        elif handle.get("device") == "cuda":
            kernel_dir.prepare_triton_driver()
        with inductor_files_in(self.inductor_dir), cpu_isa.patches():
            artifact = CompiledArtifact.load(path=path, format="binary")
        return _unwrapped(artifact, bool(handle.get("single_output")))


class AlwaysHitShapeEnv:
    """A shape environment whose guards always pass.

    Pieces are compiled outside Dynamo's tracing context (concrete sizes, loads), where
    Inductor's FX-graph cache has no ShapeEnv to evaluate its guards with and would miss or
    fail. The piece's cache key already holds its input shapes, so no guard is needed. Every
    other attribute comes from the real ShapeEnv (the traced one, or a fresh one), since newer
    Inductor reads more of it than the guard methods.
    """

    def __init__(self, real: Any = None) -> None:
        if real is None:
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            tc = torch._guards.TracingContext.try_get()
            real = getattr(getattr(tc, "fake_mode", None), "shape_env", None) or ShapeEnv()
        self._real = real
        self.guards: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def evaluate_guards_expression(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def get_pruned_guards(self, *args: Any, **kwargs: Any) -> list:
        return []

    def produce_guards_expression(self, *args: Any, **kwargs: Any) -> str:
        return ""


class InductorAdaptor(CompilerInterface):
    """`compile_fx` with Inductor's own FX-graph cache (for torch without standalone_compile).

    The artifact kept in our cache is Inductor's FX-graph cache entry; loading seeds Inductor's
    cache with it and compiles again, which then hits the entry instead of generating code, and
    keeps AOTAutograd's wrappers (input mutations, aliasing) exactly as on the first compile.
    """

    name = "inductor"
    loads_without_inputs = False

    def compute_hash(self) -> dict[str, Any]:
        return {"compiler": self.name, **_inductor_env_factors()}

    @contextlib.contextmanager
    def _patched(self, captured: dict):
        from torch._inductor import codecache, compile_fx as cfx

        original_inner = cfx.compile_fx_inner

        def inner(*args: Any, **kwargs: Any) -> Any:
            out = original_inner(*args, **kwargs)
            captured["key"] = getattr(out, "_fx_graph_cache_key", None)
            return out

        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(
                codecache.FxGraphCache, "_get_shape_env", staticmethod(lambda *a, **k: AlwaysHitShapeEnv())
            ))
            # Inductor refuses to cache outside Dynamo's context and for some graphs; we key
            # the piece ourselves, so caching is always wanted.
            stack.enter_context(mock.patch.object(
                codecache.FxGraphCache, "_check_can_cache", staticmethod(lambda *a, **k: None)
            ))
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False))
            # The AOTAutograd cache would answer before inner compile runs (no key to capture).
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            yield inner

    def _compile_fx(self, graph, example_inputs, patches, captured) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        with self._patched(captured) as inner, torch.no_grad():
            return compile_fx(copy.deepcopy(graph), list(example_inputs), inner_compile=inner,
                              config_patches=patches)

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        compilation_counter.num_inductor_compiles += 1
        patches = _config_patches(compiler_config, runtime_shape, _graph_device(example_inputs))
        captured: dict = {}
        with _codegen_choices(compiler_config):
            fn = self._compile_fx(graph, example_inputs, patches, captured)
        handle = None
        if self.cache_dir is not None and key is not None and captured.get("key"):
            handle = self._save_entry(captured["key"], key, patches)
        return fn, handle

    def _save_entry(self, fx_key: str, key: str, patches: dict) -> Optional[Handle]:
        from torch._inductor.codecache import FxGraphCache

        entry_dir = FxGraphCache._get_tmp_dir_for_key(fx_key)
        try:
            files = sorted((os.path.join(entry_dir, f) for f in os.listdir(entry_dir)), key=os.path.getmtime)
        except OSError:
            files = []
        if not files:
            compilation_counter.num_unsaveable_artifacts += 1
            return None
        with open(files[-1], "rb") as f:
            content = f.read()
        rel = os.path.join(ARTIFACT_DIR, f"{key}.fxgraph")

        def write(path: str) -> None:
            with open(path, "wb") as out:
                out.write(content)

        try:
            _atomic_save(os.path.join(self.cache_dir, rel), write)
        except OSError as exc:
            self.last_save_error = exc
            return None
        return {"path": rel, "fx_key": fx_key}

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        from torch._inductor.codecache import FxGraphCache

        if example_inputs is None:
            raise ValueError("the inductor (compile_fx) adaptor needs example inputs to load")
        path = os.path.join(self.cache_dir or "", handle["path"])
        with open(path, "rb") as f:
            content = f.read()
        entry_dir = FxGraphCache._get_tmp_dir_for_key(handle["fx_key"])
        if not (os.path.isdir(entry_dir) and os.listdir(entry_dir)):
            FxGraphCache._write_to_local_cache(handle["fx_key"], content)
        patches = _config_patches({}, runtime_shape, _graph_device(example_inputs))
        captured: dict = {}
        hits_before = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        fn = self._compile_fx(graph, example_inputs, patches, captured)
        if torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] == hits_before:
            logger.debug("inductor adaptor: load of piece %d regenerated code (no FX-cache hit)", graph_index)
        return fn


def make_compiler(cfg: CompilationConfig) -> CompilerInterface:
    """The adaptor for `cfg.compiler` ('auto': standalone where the installed torch has it)."""
    choice = cfg.resolved_compiler()
    if choice == "eager":
        return EagerAdaptor()
    if choice == "auto":
        choice = "inductor_standalone" if has_standalone_compile() else "inductor"
    if choice == "inductor_standalone":
        if not has_standalone_compile():
            raise ValueError(
                "CompilationConfig.compiler: got 'inductor_standalone'; this torch "
                f"({torch.__version__}) has no torch._inductor.standalone_compile; use 'inductor' or 'auto'"
            )
        return InductorStandaloneAdaptor()
    return InductorAdaptor()
