"""Programmatic dependent launch (ops/pdl.py) on a GPU of compute capability >= 9: our kernels
are compiled and launched with it, and a chain of kernels each reading what the one before
wrote stays right: eagerly with each weight written just before its GEMV, and replayed in a
CUDA graph (which, with ATOM_COMPILE_PREFETCH=1, prefetches the weights: written before the
replay); ATOM_COMPILE_PDL=0 turns it off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda
tl_ = pytest.importorskip("atom_compile.ops.triton_linear")
from atom_compile import envs  # noqa: E402
from atom_compile.ops import pdl  # noqa: E402

needs_pdl = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
                               or not pdl._INTRINSICS or not pdl._launch_option(),
                               reason="PDL needs compute capability 9.0 and a Triton with launch_pdl")


def _chain(x, weights, scratch=None):
    """x -> GEMV -> GEMV ... where each GEMV reads the last output and, given `scratch`, each
    weight is rewritten by a kernel just before its GEMV (the hazard of a kernel that reads
    before it waits)."""
    for i, w in enumerate(weights):
        if scratch is not None:
            w.copy_(scratch[i])  # a copy kernel right before the GEMV writes the very weight it reads
        x = tl_.small_m_linear(x, w)
    return x


@needs_pdl
def test_dependent_kernels_stay_right_eagerly_and_in_a_graph():
    assert pdl.enabled(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = [2048, 4096, 1024, 2048, 512]
    weights = [torch.zeros(n, k, device="cuda", dtype=torch.bfloat16) for k, n in zip(dims, dims[1:])]
    fresh = [torch.empty(w.shape, device="cuda", dtype=torch.bfloat16) for w in weights]

    def draw():  # unit-scale layers: every output is about N(0, 1)
        for f in fresh:
            f.copy_(torch.randn(f.shape, device="cuda", generator=gen) / f.shape[1] ** 0.5)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))

    def check(got):
        want = x.float()
        for f in fresh:  # rounded to bf16 after each layer, as the kernel's output is
            want = (want @ f.float().T).to(torch.bfloat16).float()
        # a weight or input read before its writer finished leaves O(1) errors everywhere;
        # accumulation order and bf16 rounding leave about 1e-2 of the norm
        assert ((got.float() - want).norm() / want.norm()).item() < 3e-2

    x = torch.empty(1, dims[0], device="cuda", dtype=torch.bfloat16)
    draw()
    check(_chain(x, weights, fresh))
    compiled = list(tl_._linear_launch.compiled.values())
    assert compiled and all(getattr(c.metadata, "launch_pdl", False) for c in compiled)

    # with the prefetch on, its twins were compiled beside them; off, none: the capture compiles nothing
    names = tl_._small_m_linear_kernel.arg_names  # a key ends with the constexprs, in this order
    twins = [key for key in tl_._linear_launch.compiled if key[names.index("PREFETCH") - len(names)] is True]
    assert (twins and 2 * len(twins) == len(compiled)) if envs.prefetch("linear") else not twins
    before = len(tl_._linear_launch.compiled)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, weights)
    assert len(tl_._linear_launch.compiled) == before
    for _ in range(3):
        draw()
        for w, f in zip(weights, fresh):  # written before the replay, by the kernels just before it
            w.copy_(f)
        graph.replay()
        check(out)


@needs_pdl
def test_the_chain_stays_right_with_the_prefetch_on():
    # a fresh process: the twins are compiled with a kernel's first specialisation, which earlier
    # tests of this process may have made with the prefetch off
    test = f"{__file__}::test_dependent_kernels_stay_right_eagerly_and_in_a_graph"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, ATOM_COMPILE_PREFETCH="1"))
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@needs_pdl
def test_the_switch_turns_it_off():
    code = ("import torch; from atom_compile.ops import pdl, triton_linear as t;"
            "x = torch.randn(1, 256, device='cuda', dtype=torch.bfloat16);"
            "w = torch.randn(64, 256, device='cuda', dtype=torch.bfloat16);"
            "y = t.small_m_linear(x, w); torch.cuda.synchronize();"
            "print(pdl.enabled(x.device), [bool(getattr(c.metadata, 'launch_pdl', False)) "
            "for c in t._linear_launch.compiled.values()])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ATOM_COMPILE_PDL="0"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "False [False]"
