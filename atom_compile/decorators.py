"""`@support_torch_compile`: compile a model class once, then dispatch with no guard checks.

    @support_torch_compile
    class MyModel(nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    with set_current_config(cfg):          # or MyModel(..., compilation_config=cfg)
        model = MyModel(...)

Levels 0 and 1 call `forward` directly. At levels 2 and 3 the first call marks the dynamic
dimensions, compiles through `backend(cfg)` and keeps the code Dynamo produced; every later
call runs that code directly, so no guard is evaluated. Where torch can save the Dynamo
function, the next process loads it and skips Dynamo as well (backends/aot.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import types
import typing
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch._dynamo.exc import TensorifyScalarRestartAnalysis

from . import envs, layer_regions
from .backends import aot, strict
from .backends.guard_free import check_code, check_inputs, input_checks
from .backends.atom_backend import AtomBackend, remote_tier
from .backends.regions import RegionInlineError
from .config import CompilationConfig, CompilationLevel, Config, as_compilation_config
from .counters import compilation_counter
from .errors import (AtomCompileError, AtomTypeError, AtomValueError, BufferMutationError, CacheRequired,
                     RecompileError)

logger = logging.getLogger("atom_compile")

ConfigLike = Union[Config, CompilationConfig, dict, str, int, None]

_current_config: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar(
    "atom_compile_current_config", default=None
)
_logged_no_config: set[str] = set()


@contextlib.contextmanager
def set_current_config(cfg: ConfigLike) -> Iterator[None]:
    """Models built inside this block (with @support_torch_compile) compile under `cfg`."""
    token = _current_config.set(cfg)
    try:
        yield
    finally:
        _current_config.reset(token)


def get_current_config() -> Optional[Any]:
    """The config set by the innermost set_current_config (None outside one)."""
    return _current_config.get()


def _is_tensor_annotation(annotation: Any) -> bool:
    if annotation is torch.Tensor:
        return True
    if isinstance(annotation, str):
        text = annotation.replace(" ", "")
        return text in ("torch.Tensor", "Tensor", "Optional[torch.Tensor]", "Optional[Tensor]",
                        "torch.Tensor|None", "Tensor|None", "None|torch.Tensor")
    origin = typing.get_origin(annotation)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(args) == 1 and args[0] is torch.Tensor
    return False


def _dynamic_dims(cls: type, dynamic_arg_dims: Optional[dict]) -> dict[str, list[int]]:
    sig = inspect.signature(cls.forward)
    params = [p for name, p in sig.parameters.items() if name != "self"]
    if dynamic_arg_dims is None:
        dims = {p.name: [0] for p in params if _is_tensor_annotation(p.annotation)}
        if not dims:
            raise AtomTypeError(
                f"@support_torch_compile on {cls.__qualname__}: forward has no torch.Tensor (or "
                "Optional[torch.Tensor]) argument whose dim 0 could be dynamic; annotate the tensor "
                "arguments or pass dynamic_arg_dims={'arg': dim}"
            )
        return dims
    if not isinstance(dynamic_arg_dims, dict) or not dynamic_arg_dims:
        raise AtomTypeError(f"dynamic_arg_dims: got {dynamic_arg_dims!r}; allowed: a non-empty dict arg -> dim | [dims]")
    names = {p.name for p in params}
    out = {}
    for name, dims in dynamic_arg_dims.items():
        if name not in names:
            raise AtomValueError(f"dynamic_arg_dims: {cls.__qualname__}.forward has no argument {name!r}; "
                             f"it has {sorted(names)}")
        dims = [dims] if isinstance(dims, int) else list(dims)
        if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise AtomValueError(f"dynamic_arg_dims[{name!r}]: got {dims!r}; allowed: an int or a list of ints")
        out[name] = dims
    return out


def support_torch_compile(
    cls: Optional[type] = None,
    *,
    dynamic_arg_dims: Optional[dict[str, Union[int, list[int]]]] = None,
    enable_if: Optional[Callable[[Any], bool]] = None,
) -> Any:
    """Class decorator: compile the model once at levels 2-3 and dispatch without guards.

    `dynamic_arg_dims` names the dims that vary (default: dim 0 of every Tensor argument);
    `enable_if(config)` returning False leaves the class uncompiled.
    """

    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise AtomTypeError(f"@support_torch_compile: got {cls!r}; allowed: an nn.Module subclass")
        dims = _dynamic_dims(cls, dynamic_arg_dims)
        if CompiledDispatcher not in cls.__mro__:
            cls.__bases__ = cls.__bases__ + (CompiledDispatcher,)
        original_init = cls.__init__
        takes_config = "compilation_config" in inspect.signature(original_init).parameters

        @functools.wraps(original_init)
        def __init__(self: Any, *args: Any, compilation_config: ConfigLike = None, **kwargs: Any) -> None:
            cfg = compilation_config if compilation_config is not None else get_current_config()
            if takes_config:
                kwargs["compilation_config"] = compilation_config
            with set_current_config(cfg):
                original_init(self, *args, **kwargs)
            self._atom_setup(cls, cfg, dims, enable_if)

        cls.__init__ = __init__
        cls.__call__ = CompiledDispatcher._atom_call
        cls._atom_decorated = cls
        return cls

    return wrap(cls) if cls is not None else wrap


def ignore_torch_compile(cls: type) -> type:
    """A subclass of a decorated class opts out: it runs eagerly."""
    cls._atom_ignore = cls
    return cls


class CompiledDispatcher:
    """The base class @support_torch_compile adds: first call compiles, later calls dispatch."""

    def _atom_setup(self, cls: type, cfg: ConfigLike, dims: dict[str, list[int]],
                    enable_if: Optional[Callable[[Any], bool]]) -> None:
        ignored = getattr(type(self), "_atom_ignore", None) is type(self)
        if not ignored:
            compilation_counter.num_models_seen += 1
        self._atom_cls = cls
        if cfg is None and cls.__qualname__ not in _logged_no_config:
            _logged_no_config.add(cls.__qualname__)
            logger.info("atom-compile: %s was built without a config: level 0 (no compilation)", cls.__qualname__)
        self.atom_config = cfg
        self._atom_cc = as_compilation_config(cfg) if cfg is not None else CompilationConfig(level=0)
        self._atom_dims = dims
        self._atom_dispatch: Optional[Callable] = None
        self._atom_checks: tuple = ()
        enabled = enable_if(cfg) if enable_if is not None else True
        self.do_not_compile = (
            ignored or not enabled or self._atom_cc.level < CompilationLevel.DYNAMO_ONCE
        )
        # The environment, read once here (only where a compile may follow: reading it imports
        # Dynamo's config, which a level-0 model should not pay for).
        self._atom_env: Optional[envs.Environment] = (
            None if self.do_not_compile else envs.read(self._atom_cc.cache_dir)
        )

    # The class's __call__: keep it short, it runs every step.
    def _atom_call(self, *args: Any, **kwargs: Any) -> Any:
        dispatch = self._atom_dispatch
        if dispatch is not None:
            if self._atom_checks:
                check_inputs(self, args)
            return dispatch(self, *args, **kwargs)
        if self.do_not_compile or torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        if self._atom_env is None:  # do_not_compile was switched off after construction
            self._atom_env = envs.read(self._atom_cc.cache_dir)
        if self._atom_env.compile_disabled or getattr(type(self).forward, "_torchdynamo_disable", False):
            logger.info("atom-compile: compilation disabled (ATOM_COMPILE_DISABLE / TORCHDYNAMO_DISABLE / "
                        "torch.compiler.disable): %s runs eagerly", type(self).__qualname__)
            self.do_not_compile = True
            return self.forward(*args, **kwargs)
        return self._atom_first_call(args, kwargs)

    def _atom_first_call(self, args: tuple, kwargs: dict) -> Any:
        cls = type(self)
        bound = inspect.signature(cls.forward).bind(self, *args, **kwargs)
        _mark_dynamic(cls, bound.arguments, self._atom_dims)
        cc = self._atom_cc
        prefix = cls.__name__
        device_type = _device_type(bound.arguments)
        compiler_factors = _compiler_factors(cc)
        f_globals = cls.forward.__globals__

        # torch >= 2.10 can save a Dynamo-compiled function: compile through aot_compile (its code
        # runs without guards) and save it, so the next start skips Dynamo too. Older torch, or a
        # compiler whose artifacts need example inputs to load: torch.compile, keeping the
        # bytecode Dynamo produces (a bytecode hook) and calling it directly.
        if aot.supported() and compiler_factors is not None:
            required = cc.require_cache or self._atom_env.require_cache
            fn, missed = aot.try_load(cc, compiler_factors, device_type, prefix, self, args, f_globals,
                                      self._atom_env.cache_root, required, remote_tier(cc, self._atom_env))
            fn, missed = aot.agree_to_load(fn, missed, self._atom_env)
            if fn is not None:
                check_code(fn.__code__, cls)
                return self._atom_start_dispatch(fn, args, kwargs)
            if required:
                strict.refuse(f"{cls.__qualname__}: the forward (Dynamo's trace, then its pieces)", missed)
            compiled, backend = self._atom_aot_compile(args, kwargs, prefix)
            if compiled is not None:
                fn = compiled.fn
                check_code(fn.__code__, cls)
                aot.save(compiled, backend.result, cc, compiler_factors, device_type, prefix, self, args)
                self._atom_backend = backend
                return self._atom_start_dispatch(fn, args, kwargs)
        return self._atom_compile_with_hook(args, kwargs, prefix)

    def _atom_aot_compile(self, args: tuple, kwargs: dict, prefix: str) -> tuple[Any, AtomBackend]:
        """aot_compile the forward, the alike layers of its ModuleLists traced once where torch
        and the model allow (layer_regions.py); a trace that fails with them is retried without.
        Returns (None, backend) where torch cannot pre-compile (the caller uses torch.compile)."""
        cls = type(self)
        cc = self._atom_cc
        with_regions = cc.trace_layers_once
        restarts = 0
        while True:
            backend = AtomBackend(self.atom_config if self.atom_config is not None else cc, prefix,
                                  extra_traced_files=[inspect.getfile(cls)], serializable=True,
                                  environment=self._atom_env)
            # torch.compile(...).aot_compile exists only while Dynamo's enable_aot_compile is on
            # (off by default before torch 2.12).
            with torch._dynamo.config.patch(enable_aot_compile=True):
                optimized = torch.compile(cls.forward, fullgraph=True, backend=backend,
                                          options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
            if not hasattr(optimized, "aot_compile"):
                return None, backend
            marked = 0
            try:
                with torch._dynamo.config.patch(enable_aot_compile=True), \
                        layer_regions.applied(self, with_regions) as marked:
                    return optimized.aot_compile(((self, *args), kwargs)), backend
            except Exception as exc:
                if isinstance(exc, (BufferMutationError, RecompileError, CacheRequired)):
                    raise
                # aot_compile calls the backend after Dynamo's restart loop, so a restart the backend
                # asks for (floats.py: a float Dynamo made dynamic, e.g. a second model's different
                # attention scale) reaches us: trace again, the float now marked to specialise.
                if _error_in(exc, TensorifyScalarRestartAnalysis) is not None and restarts < 8:
                    restarts += 1
                    continue
                if marked and isinstance(_atom_error_in(exc), (type(None), RegionInlineError)):
                    compilation_counter.num_region_fallbacks += 1
                    logger.info("atom-compile: %s: tracing its %d alike layers once failed (%s: %s); "
                                "tracing every layer", cls.__qualname__, marked, type(exc).__name__, str(exc)[:200])
                    with_regions = False
                    continue
                if not backend.compiled:
                    raise
                logger.info("atom-compile: torch could not pre-compile %s (%s: %s); using torch.compile",
                            cls.__qualname__, type(exc).__name__, str(exc)[:200])
                return None, backend

    def _atom_compile_with_hook(self, args: tuple, kwargs: dict, prefix: str) -> Any:
        """torch.compile, keeping the bytecode Dynamo produced for forward (older torch)."""
        cls = type(self)
        backend = AtomBackend(self.atom_config if self.atom_config is not None else self._atom_cc, prefix,
                              extra_traced_files=[inspect.getfile(cls)], environment=self._atom_env)
        original = cls.forward.__code__
        captured: list[types.CodeType] = []

        def hook(old_code: types.CodeType, new_code: types.CodeType) -> None:
            if old_code is original:
                captured.append(new_code)

        handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        try:
            out = torch.compile(self.forward, fullgraph=True, backend=backend)(*args, **kwargs)
        finally:
            handle.remove()
        self._atom_backend = backend
        if not captured:
            raise RecompileError(f"{cls.__qualname__}: Dynamo produced no code for forward")
        code = captured[-1]
        check_code(code, cls)
        fwd = cls.forward
        # Dynamo's code keeps forward's arguments, cells and free variables (depyf's invariant),
        # so a new function over forward's globals and closure runs it directly. Building our own
        # function (instead of swapping forward.__code__) keeps other instances and threads safe.
        fn = types.FunctionType(code, fwd.__globals__, fwd.__name__, fwd.__defaults__, fwd.__closure__)
        fn.__kwdefaults__ = fwd.__kwdefaults__
        self._atom_dispatch = fn
        self._atom_checks = input_checks(args) if self._atom_env.check_inputs else ()
        return out

    def _atom_start_dispatch(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self._atom_dispatch = fn
        self._atom_checks = input_checks(args) if self._atom_env.check_inputs else ()
        return fn(self, *args, **kwargs)


def _atom_error_in(exc: BaseException) -> Optional[BaseException]:
    """Our own error behind `exc` (Dynamo wraps what a backend raises), or None."""
    return _error_in(exc, AtomCompileError)


def _error_in(exc: BaseException, kind: type) -> Optional[BaseException]:
    """The first error of type `kind` in `exc`'s chain of wrapped errors and causes, or None."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = getattr(current, "inner_exception", None) or current.__cause__
    return None


def _compiler_factors(cc: CompilationConfig) -> Optional[dict]:
    from .backends.inductor import make_compiler

    compiler = make_compiler(cc)
    return compiler.compute_hash() if compiler.loads_without_inputs else None


def _device_type(arguments: dict) -> str:
    for value in arguments.values():
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _mark_dynamic(cls: type, arguments: dict, dims: dict[str, list[int]]) -> None:
    for name, arg_dims in dims.items():
        value = arguments.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        for d in arg_dims:
            dim = d if d >= 0 else value.dim() + d
            if not 0 <= dim < value.dim():
                raise AtomValueError(f"{cls.__qualname__}.forward: argument {name!r} has {value.dim()} dims; "
                                 f"cannot mark dim {d} dynamic")
            if value.shape[dim] < 2:
                raise AtomValueError(
                    f"{cls.__qualname__}: the first call traces the general shape, but argument {name!r} "
                    f"has size {value.shape[dim]} on its dynamic dim {d}; Dynamo specialises sizes 0 and 1. "
                    "Make the first call with at least 2 tokens (e.g. the largest capture size)."
                )
            torch._dynamo.mark_dynamic(value, dim)
