"""The built-in small-M pass: a CUDA piece's half-precision projections call atom::small_m_linear."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from atom_compile.backends.small_m_pass import use_small_m_linear
from atom_compile.ops.linear import op as small_m_linear_op

aten = torch.ops.aten


def _f(x, w, w32, x32, y):
    projected = aten.mm.default(x, w.t())  # a parameter's projection: rewritten
    permuted = aten.mm.default(x, aten.permute.default(w, [1, 0]))  # the post-grad spelling: rewritten
    activations = aten.mm.default(x, y)  # two activations, no weight: kept
    fp32 = aten.mm.default(x32, w32.t())  # fp32 stays with Inductor's mm: kept
    return projected, permuted, activations, fp32


def _trace(device: str) -> torch.fx.GraphModule:
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        args = (torch.empty(3, 8, device=device, dtype=torch.bfloat16),
                torch.empty(16, 8, device=device, dtype=torch.bfloat16),
                torch.empty(16, 8, device=device), torch.empty(3, 8, device=device),
                torch.empty(8, 5, device=device, dtype=torch.bfloat16))
    return make_fx(_f, tracing_mode="fake")(*args)


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_projections_of_cuda_half_weights_are_rewritten_and_compute_the_same():
    gm = _trace("cuda")
    assert _count(gm, aten.mm.default) == 4
    assert use_small_m_linear(gm.graph) == 2
    gm.recompile()
    assert _count(gm, small_m_linear_op()) == 2 and _count(gm, aten.mm.default) == 2
    call = next(n for n in gm.graph.nodes if n.target is small_m_linear_op())
    assert tuple(call.meta["val"].shape) == (3, 16) and call.meta["val"].device.type == "cuda"
    # the rewritten graph is device-agnostic code: on CPU the op is F.linear
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 8, generator=gen).bfloat16(), torch.randn(16, 8, generator=gen).bfloat16(),
            torch.randn(16, 8, generator=gen), torch.randn(3, 8, generator=gen),
            torch.randn(8, 5, generator=gen).bfloat16())
    for got, want in zip(gm(*args), _f(*args)):
        torch.testing.assert_close(got, want)


def _biased(x, w, b, r):
    qwen = aten.addmm.default(b, x, aten.permute.default(w, [1, 0]))  # a [N] bias (Qwen2's qkv): rewritten
    residual = aten.addmm.default(r, x, w.t())  # a 2-D addend is not a bias: kept
    scaled = aten.addmm.default(b, x, w.t(), beta=2)  # beta != 1: kept
    return qwen, residual, scaled


def test_biased_projections_are_rewritten_with_their_bias():
    with FakeTensorMode():
        shapes = [(3, 8), (16, 8), (16,), (3, 16)]
        fake = tuple(torch.empty(*s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    gm = make_fx(_biased, tracing_mode="fake")(*fake)
    assert use_small_m_linear(gm.graph) == 1
    gm.recompile()
    call = next(n for n in gm.graph.nodes if n.target is small_m_linear_op())
    assert call.args[2] is not None and _count(gm, aten.addmm.default) == 2
    gen = torch.Generator().manual_seed(1)
    args = tuple(torch.randn(*s, generator=gen).bfloat16() for s in shapes)
    for got, want in zip(gm(*args), _biased(*args)):
        torch.testing.assert_close(got, want)


def test_cpu_pieces_are_left_alone():
    gm = _trace("cpu")
    assert use_small_m_linear(gm.graph) == 0
    assert _count(gm, aten.mm.default) == 4


def test_a_backend_registers_the_ops_its_passes_put_into_pieces():
    """A warm start loads pieces that call atom::small_m_linear (and the prologue ops) without
    running the passes: making the backend registers them, in a process that imported nothing
    else of ours (as a warm start of a user's model does)."""
    import subprocess
    import sys

    code = ("import torch, atom_compile as ac\n"
            "ac.backend(ac.Config())\n"
            "for name in ('small_m_linear', 'rms_norm_linear', 'add_rms_norm_linear', 'silu_mul_linear',\n"
            "             'linear_add_weigh', 'norm_scaled_linear', 'gate_up_glu'):\n"
            "    getattr(torch.ops.atom, name).default\n"
            "print('registered')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "registered" in proc.stdout, proc.stderr[-2000:]
