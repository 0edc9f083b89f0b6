"""FastLaunch's bookkeeping on CPU, with a stand-in kernel that records how it was called: the
JIT path once per specialisation, the direct path after, the JIT path for good where the
compiled kernel offers no direct launch. (The real launches are in test_fast_launch_cuda.py.)"""

from __future__ import annotations

import torch

from atom_compile.ops.triton_launch import FastLaunch, cdiv, next_power_of_2


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _Kernel:
    arg_names = ["x", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self, offers_direct=True):
        self.log = []
        self.offers_direct = offers_direct

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log) if self.offers_direct else None
        return run


def test_host_arithmetic():
    assert [cdiv(a, 4) for a in (1, 4, 5, 8)] == [1, 1, 2, 2]
    assert [next_power_of_2(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


def test_jit_once_per_specialisation_then_direct():
    kernel = _Kernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(64)
    for n in (32, 48, 32):  # multiples of 16: one specialisation
        launch((2, 1, 1), (x, n, 0.5), {"BLOCK": 16, "FLAG": True})
    assert [entry[0] for entry in kernel.log] == ["jit", "direct", "direct"]
    assert kernel.log[1][2] == (x, 48, 0.5, 16, True)  # every parameter, in signature order
    launch((2, 1, 1), (x, 33, 0.5), {"BLOCK": 16, "FLAG": True})  # not a multiple of 16
    launch((2, 1, 1), (x, 1, 0.5), {"BLOCK": 16, "FLAG": True})  # the value 1
    launch((2, 1, 1), (x[1:], 32, 0.5), {"BLOCK": 16, "FLAG": True})  # misaligned address
    launch((2, 1, 1), (x, 32, 0.5), {"BLOCK": 32, "FLAG": True})  # another constexpr
    launch((2, 1, 1), (x, 32, 0.5), {"BLOCK": 16, "FLAG": True}, num_warps=8)
    assert [entry[0] for entry in kernel.log[3:]] == ["jit"] * 5
    assert len(launch.compiled) == 6


def test_no_direct_launch_means_jit_for_good():
    kernel = _Kernel(offers_direct=False)
    launch = FastLaunch(kernel)
    for _ in range(3):
        launch((1, 1, 1), (torch.zeros(4), 16, 1.0), {"BLOCK": 16, "FLAG": False})
    assert [entry[0] for entry in kernel.log] == ["jit"] * 3 and not launch.direct


def test_constexprs_out_of_signature_order_take_the_jit_path():
    kernel = _Kernel()
    launch = FastLaunch(kernel)
    for _ in range(2):
        launch((1, 1, 1), (torch.zeros(4), 16, 1.0), {"FLAG": False, "BLOCK": 16})
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"] and not launch.direct


class _RunCompiled(_Compiled):
    """A compiled kernel with Triton's launcher interface (`run`, `function`, `packed_metadata`)."""

    function = "fn-handle"
    packed_metadata = ("packed",)

    def run(self, gx, gy, gz, stream, function, packed, launch_meta, enter, exit_, *args):
        self.log.append(("bound", (gx, gy, gz), function, packed, args))

    def launch_metadata(self, grid, stream, *args):
        return None


class _RunKernel(_Kernel):
    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _RunCompiled(self.log)
        return run


def test_bind_launches_once_then_replays_the_fixed_arguments(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    kernel = _RunKernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(64)
    bound = launch.bind((3, 2, 1), (x, 32, 0.5), {"BLOCK": 16, "FLAG": True}, num_warps=2)
    assert [entry[0] for entry in kernel.log] == ["jit"]  # bind ran the launch once (and compiled it)
    bound()
    bound()
    assert [entry[0] for entry in kernel.log] == ["jit", "bound", "bound"]
    assert kernel.log[-1][1:] == ((3, 2, 1), "fn-handle", ("packed",), (x, 32, 0.5, 16, True))
    # the same specialisation launched unbound still takes the direct path, not a second compile
    launch((1, 1, 1), (x, 48, 0.5), {"BLOCK": 16, "FLAG": True}, num_warps=2)
    assert kernel.log[-1][0] == "direct" and len(launch.compiled) == 1


def test_bind_without_a_launcher_interface_is_none():
    kernel = _Kernel()  # its compiled kernel has no `run`
    launch = FastLaunch(kernel)
    assert launch.bind((1, 1, 1), (torch.zeros(4), 16, 1.0), {"BLOCK": 16, "FLAG": False}) is None
    assert FastLaunch(_Kernel(offers_direct=False)).bind((1, 1, 1), (torch.zeros(4), 16, 1.0),
                                                         {"BLOCK": 16, "FLAG": False}) is None
