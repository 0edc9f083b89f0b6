"""Launching our Triton kernels with less host time than `kernel[grid](...)`.

An eager region (attention between token-graph segments) runs every step and layer from Python,
and Triton's JIT launch costs about 30 us of host time per kernel on an H200 host (binding and
specialising every argument, computing the cache key, then the launcher), three times what the
GPU spends on a decode attention. `FastLaunch` takes the JIT path the first time it sees a
specialisation, keeps the compiled kernel Triton returns, and later launches that kernel
directly (`CompiledKernel[grid](*args)`).

The specialisation key is ours and errs on the side of more keys: each tensor's dtype and
whether its address is 16-byte aligned, each integer's value class (1, a multiple of 16, 32-bit
or not), and every constexpr; those are all Triton specialises on. Where the compiled kernel
does not offer the direct launch (the interpreter, another Triton), every call takes the JIT path.

`FastLaunch.bind` goes one step further for launches that repeat with the very same arguments
(an eager region replayed every step on the buffers its token graph recorded): it resolves the
compiled kernel once and returns a `BoundLaunch` that calls the kernel's launcher with the
argument tuple built once, skipping the key, the grid closure and Triton's launch metadata.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import jit_watch, kernel_dir

_INT32 = 2**31


def cdiv(a: int, b: int) -> int:
    """Ceil division on host ints (`triton.cdiv` is a constexpr function: microseconds a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), on host ints."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.dtype, not t.data_ptr() & 15)


def _int_key(v: int) -> tuple:
    return (v == 1, not v & 15, -_INT32 <= v < _INT32)


def _other_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return _tensor_key(arg)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return _int_key(arg)
    if isinstance(arg, float):
        return "f"
    return ("o", arg)


# the current CUDA device, cheaply (torch.cuda.current_device() costs microseconds); -1 without one
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else (lambda: -1)
# by exact type first: the key is computed on every launch, and a dict look-up is cheaper than
# a chain of isinstance checks
_KEYS = {torch.Tensor: _tensor_key, int: _int_key, float: lambda _: "f", bool: lambda b: ("b", b)}


def _spec_key(args: tuple, constexprs: dict, num_warps: int) -> tuple:
    # a compiled kernel is loaded for the device current at its first launch, as Triton's own cache is
    return (_current_device(), num_warps, *[_KEYS.get(type(a), _other_key)(a) for a in args], *constexprs.values())


def _launch_options(constexprs: dict) -> dict:
    """Triton launch options a kernel's constexprs call for: a kernel whose PDL constexpr is set
    waits for the kernel before, so only it may be launched early (ops/pdl.py); launch_pdl
    becomes part of the compiled kernel's metadata, which the direct launch then uses."""
    return {"launch_pdl": True} if constexprs.get("PDL") else {}


class FastLaunch:
    """A Triton JIT kernel launched with its compiled kernel cached per specialisation.

    `args` are the kernel's runtime arguments in order; `constexprs` its constexpr parameters,
    which must come after them in the kernel's signature (ours are written that way)."""

    def __init__(self, kernel: Any, twins: Optional[Callable[[dict], list[dict]]] = None):
        """`twins(constexprs)`: other constexprs whose specialisations are compiled (not launched)
        when this one is, for a variant that must not compile where it is launched (a capture)."""
        self.kernel = kernel
        self.compiled: dict[tuple, Any] = {}
        self.direct = True  # False once the compiled kernel turns out not to offer a direct launch
        self.twins = twins

    def __call__(self, grid: tuple[int, int, int], args: tuple, constexprs: dict, num_warps: int = 4) -> None:
        """Launch on the current stream; `grid` has all three dimensions."""
        if not self.direct:
            self.kernel[grid](*args, **constexprs, num_warps=num_warps, **_launch_options(constexprs))
            return
        compiled = self.compiled.get(key := _spec_key(args, constexprs, num_warps))
        if compiled is not None:
            compiled[grid](*args, *constexprs.values())
            return
        # a compile here after warm-up is reported with these shapes; its files go to our cache
        with jit_watch.launching(args), kernel_dir.compiling():
            compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps, **_launch_options(constexprs))
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if compiled is None or not callable(getattr(compiled, "__getitem__", None)) or not self._ordered(args, constexprs):
            self.direct = False
            return
        self.compiled[key] = compiled
        for twin in self.twins(constexprs) if self.twins is not None else ():
            self._compile_only(grid, args, twin, num_warps)

    def _compile_only(self, grid: tuple[int, int, int], args: tuple, constexprs: dict, num_warps: int) -> None:
        key = _spec_key(args, constexprs, num_warps)
        if key in self.compiled:
            return
        with jit_watch.launching(args), kernel_dir.compiling():
            compiled = self.kernel.warmup(*args, grid=grid, **constexprs, num_warps=num_warps,
                                          **_launch_options(constexprs))
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if compiled is not None and callable(getattr(compiled, "__getitem__", None)):
            self.compiled[key] = compiled

    def _ordered(self, args: tuple, constexprs: dict) -> bool:
        """True when the constexprs follow the runtime arguments in the kernel's signature, in
        the order given: the direct launch passes every parameter positionally."""
        names = getattr(self.kernel, "arg_names", None)
        return names is not None and list(names[len(args):]) == list(constexprs)

    def bind(self, grid: tuple[int, int, int], args: tuple, constexprs: dict, num_warps: int = 4) -> Optional["BoundLaunch"]:
        """This launch with every argument fixed, as a zero-argument callable (launching it once
        now, which compiles the specialisation if needed); None where the compiled kernel does
        not offer the launcher `BoundLaunch` needs. The caller keeps `args`' tensors alive and
        unchanged in address for as long as it replays the binding."""
        self(grid, args, constexprs, num_warps)
        if not self.direct:
            return None
        compiled = self.compiled.get(_spec_key(args, constexprs, num_warps))
        return BoundLaunch.of(compiled, grid, (*args, *constexprs.values())) if compiled is not None else None


_KNOBS: Any = None


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch hooks (a profiler's), or (None, None) when none is set: an empty hook
    chain still costs two Python calls and a metadata dict per launch."""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs

            _KNOBS = knobs.runtime
        except ImportError:  # an older Triton without knobs: its hooks are not looked at here
            _KNOBS = False
    if _KNOBS is False:
        return None, None
    enter, exit_ = _KNOBS.launch_enter_hook, _KNOBS.launch_exit_hook
    if not getattr(enter, "calls", enter) and not getattr(exit_, "calls", exit_):
        return None, None
    return enter, exit_


class BoundLaunch:
    """One compiled Triton kernel launch with grid and arguments fixed (see `FastLaunch.bind`)."""

    __slots__ = ("_compiled", "_grid", "_args", "_device", "_run")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], args: tuple):
        self._compiled, self._grid, self._args = compiled, grid, args
        self._device = _current_device()
        self._run: Callable = compiled.run  # loads the module on first use

    @classmethod
    def of(cls, compiled: Any, grid: tuple[int, int, int], args: tuple) -> Optional["BoundLaunch"]:
        """A binding, or None where `compiled` lacks the launcher interface used here (Triton's
        `CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
        enter_hook, exit_hook, *args)`, stable across Triton 3.x)."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            return None
        return cls(compiled, grid, args)

    def __call__(self) -> None:
        compiled = self._compiled
        stream = torch._C._cuda_getCurrentRawStream(self._device)
        enter, exit_ = _launch_hooks()
        if enter is None:
            self._run(*self._grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *self._args)
        else:  # a profiler is listening: give it what Triton's own launch gives
            meta = compiled.launch_metadata(self._grid, stream, *self._args)
            self._run(*self._grid, stream, compiled.function, compiled.packed_metadata, meta, enter, exit_, *self._args)
