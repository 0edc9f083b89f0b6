"""The small-M Triton linear against F.linear, on CPU through Triton's interpreter
(TRITON_INTERPRET=1): every row count up to MAX_M, every block shape, ragged N and K, bias or
none, fp16 (bf16 runs on the GPU in the cuda-marked test)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tri():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/ops/test_interpreted.py"
    from atom_compile.ops import triton_linear

    return triton_linear


def _case(m, n, k, bias, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    return x, w, b, want


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_every_block_shape_matches_linear(tri, m):
    x, w, b, want = _case(m, 70, 300, bias=m % 2 == 1, seed=m)
    block_m = tri._block_m(m)
    for config in [c for c in tri.CONFIGS if tri._fits(c, block_m)]:
        out = torch.full((m, 70), float("nan"), dtype=x.dtype)
        tri.launch_gemv(x, w, b, out, config)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3, msg=f"config {config}")


def test_entry_point_and_supported(tri, monkeypatch):
    x, w, b, want = _case(4, 33, 64, bias=True)
    torch.testing.assert_close(tri.small_m_linear(x, w, b).float(), want, atol=2e-3, rtol=2e-3)
    assert tri.supported(x[:1], w, b)  # one row: the GEMV
    for k in (64, 130, 3000):  # the untuned one-row shape: a step no longer than K, or a K loop
        x1, w1, b1, want1 = _case(1, 33, k, bias=True, seed=k)
        assert tri.gemv_config(k)[1] <= max(16, 1 << (k - 1).bit_length())
        torch.testing.assert_close(tri.small_m_linear(x1, w1, b1).float(), want1, atol=1e-2, rtol=1e-2)
    monkeypatch.delenv("ATOM_COMPILE_SPLIT_K", raising=False)
    assert tri.supported(x, w, b)  # 4 rows of a narrow layer: the split-K dots (or cuBLAS, as timed)
    monkeypatch.setattr(tri, "SPLIT_K_ROWS", False)
    assert not tri.supported(x, w, b)  # ... and cuBLAS with them off
    wide = torch.zeros(tri.DOT_MIN_N, 64, dtype=x.dtype)
    assert tri.supported(x, wide, None)  # 4 rows of an LM-head-wide layer: the padded dots
    assert not tri.supported(x.float(), w.float(), None)  # fp32 stays with F.linear
    assert not tri.supported(torch.randn(9, 64).half(), w, None)  # more rows than MAX_M
    assert not tri.supported(x, w.t().contiguous().t(), None)  # a transposed weight
    assert not tri.supported(x, w, b[:-1])  # a bias of the wrong length


@pytest.mark.parametrize("m", [1, 3])
def test_the_prefetching_variant_computes_the_same(tri, monkeypatch, m):
    """The variant a CUDA graph records with PDL reads each weight tile one step ahead (the first
    before its wait): every block shape, one step and a K loop, prologues included, bit-equal."""
    cases = [(m, 70, 300), (m, 33, 64)]
    block_m = tri._block_m(m)
    for m_, n, k in cases:
        x, w, b, _ = _case(m_, n, k, bias=True, seed=n)
        for config in [c for c in tri.CONFIGS if tri._fits(c, block_m)]:
            prologues = [{}]
            if m_ == 1:  # the GEMV's prologues: add + RMSNorm, SiLU-and-mul
                r = torch.randn(1, k).to(x.dtype)
                prologues += [{"norm": (torch.rand(k).to(x.dtype), 1e-5, r, torch.empty_like(x))}, {"up": r}]
            for prologue in prologues:
                outs = []
                for prefetch in (False, True):
                    monkeypatch.setattr(tri.pdl, "prefetch", lambda early, kind: {"linear": prefetch}[kind])
                    out = torch.full((m_, n), float("nan"), dtype=x.dtype)
                    tri.launch_gemv(x, w, None if prologue else b, out, config, **prologue)
                    outs.append(out)
                assert torch.equal(outs[0], outs[1]), f"config {config}, {(m_, n, k)}, {list(prologue)}"
