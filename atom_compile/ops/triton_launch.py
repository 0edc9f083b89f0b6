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
"""

from __future__ import annotations

from typing import Any

import torch

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


class FastLaunch:
    """A Triton JIT kernel launched with its compiled kernel cached per specialisation.

    `args` are the kernel's runtime arguments in order; `constexprs` its constexpr parameters,
    which must come after them in the kernel's signature (ours are written that way)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.compiled: dict[tuple, Any] = {}
        self.direct = True  # False once the compiled kernel turns out not to offer a direct launch

    def __call__(self, grid: tuple[int, int, int], args: tuple, constexprs: dict, num_warps: int = 4) -> None:
        """Launch on the current stream; `grid` has all three dimensions."""
        if not self.direct:
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        # a compiled kernel is loaded for the device current at its first launch, as Triton's own cache is
        key = (_current_device(), num_warps, *[_KEYS.get(type(a), _other_key)(a) for a in args], *constexprs.values())
        compiled = self.compiled.get(key)
        if compiled is not None:
            compiled[grid](*args, *constexprs.values())
            return
        compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if compiled is None or not callable(getattr(compiled, "__getitem__", None)) or not self._ordered(args, constexprs):
            self.direct = False
            return
        self.compiled[key] = compiled

    def _ordered(self, args: tuple, constexprs: dict) -> bool:
        """True when the constexprs follow the runtime arguments in the kernel's signature, in
        the order given: the direct launch passes every parameter positionally."""
        names = getattr(self.kernel, "arg_names", None)
        return names is not None and list(names[len(args):]) == list(constexprs)
