"""Programmatic dependent launch (PDL, Hopper and later) for our decode kernels.

A decode step is some 130 kernels of a few microseconds each, and between two kernels of one
stream the GPU drains the first before it starts launching the second. Launched with PDL, a
kernel may be scheduled as soon as every program of the kernel before it has either finished
or called `gdc_launch_dependents`; it then waits in `gdc_wait` until that kernel has finished
and its writes are visible. So the launch and the scheduling of its programs overlap the tail
of the kernel before. Our kernels wait first and read nothing before: what the kernel before writes may be
anything they read, weights included (an engine that copies new weights in right before a
step). They then let the next kernel launch at once (`gdc_launch_dependents`).

`enabled(device)` says whether a launch on that device may use it: an NVIDIA GPU of compute
capability 9.0 or later, a Triton with the grid-dependency intrinsics and the `launch_pdl`
launch option, and ATOM_COMPILE_PDL not 0. The kernel's PDL constexpr and the launch option
go together (ops/triton_launch.py passes `launch_pdl` for a kernel launched with PDL=True).
"""

from __future__ import annotations

import functools

import torch
import triton

from .. import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _INTRINSICS = True
except ImportError:  # an older Triton: the kernels never take the PDL branch
    _INTRINSICS = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@triton.jit
def wait_then_release():
    """A kernel launched with PDL, first: wait for the kernel before (its writes visible), then
    let the next kernel launch."""
    gdc_wait()
    gdc_launch_dependents()


def _launch_option() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _device_can(index: int) -> bool:
    if not (_INTRINSICS and torch.version.hip is None and envs.pdl() and _launch_option()):
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether a kernel launched on `device` (a CUDA tensor's) may use PDL."""
    if device.type != "cuda":
        return False
    return _device_can(device.index if device.index is not None else torch.cuda.current_device())


def prefetch(early: bool, kind: str) -> bool:
    """Whether a kernel of `kind` (envs.PREFETCH_KINDS) launched early (`early`: PDL) may read
    its constant operands (a weight, the KV cache's earlier keys) before its wait: only where
    ATOM_COMPILE_PREFETCH names that kind and inside a CUDA-graph capture, where what is
    recorded is a model's forward (those operands only read, the writes before a replay
    finished before the graph starts). Eagerly the kernel just before may have written them."""
    return early and envs.prefetch(kind) and torch.cuda.is_current_stream_capturing()


def prefetch_twins(kind: str):
    """For a launcher of `kind`: constexprs -> the prefetching variant of a PDL launch's
    specialisation, to compile beside it (nothing may compile inside a capture), where
    prefetching is on for that kind; else none."""
    def twins(constexprs: dict) -> list[dict]:
        if constexprs["PDL"] and not constexprs["PREFETCH"] and envs.prefetch(kind):
            return [{**constexprs, "PREFETCH": True}]
        return []
    return twins
