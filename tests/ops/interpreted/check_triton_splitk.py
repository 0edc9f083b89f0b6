"""The split-K dots for 2..8 rows (ops/triton_splitk.py) against F.linear, on CPU through
Triton's interpreter: every block shape and slice count, ragged N and K, bias or none, the
prefetching variant bit-equal to the plain one, the counters back at 0 after each call, and the
entry point's dispatch when SPLIT_K_ROWS is on."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def sk():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/ops/test_interpreted.py"
    from atom_compile.ops import triton_splitk

    return triton_splitk


def _case(m, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    b = torch.randn(n, generator=g).half() if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    return x, w, b, want


@pytest.mark.parametrize("m,n,k", [(2, 70, 300), (8, 33, 1000), (5, 16, 64)])
def test_every_block_shape_and_slice_count_matches_linear(sk, m, n, k):
    x, w, b, want = _case(m, n, k, bias=m % 2 == 1, seed=n)
    for config in sk.CONFIGS:
        out = torch.full((m, n), float("nan"), dtype=x.dtype)
        sk.launch(x, w, b, out, config)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3, msg=f"config {config}")
        assert int(sk._tickets[x.device].abs().sum()) == 0, config  # every counter back at 0


def test_slices_cover_k_in_block_multiples(sk):
    for k in (64, 300, 1000, 2048, 8192):
        for block_k in (128, 256, 512):
            for split in (1, 2, 4, 8):
                per, count = sk.slices(k, block_k, split)
                assert per % block_k == 0 and count <= split and per * count >= k > per * (count - 1)


def test_the_prefetching_variant_computes_the_same(sk, monkeypatch):
    x, w, b, _ = _case(3, 70, 1000, bias=True, seed=3)
    for config in sk.CONFIGS:
        outs = []
        for prefetch in (False, True):
            monkeypatch.setattr(sk.pdl, "prefetch", lambda early, kind: {"linear": prefetch}[kind])
            out = torch.full((3, 70), float("nan"), dtype=x.dtype)
            sk.launch(x, w, b, out, config)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), config


def test_the_entry_point_takes_it_for_few_rows_unless_off(monkeypatch):
    from atom_compile.ops import triton_linear as tl_

    x, w, b, want = _case(4, 48, 256, bias=True)
    monkeypatch.setenv("ATOM_COMPILE_SPLIT_K", "0")
    assert not tl_.supported(x, w, b) and tl_.supported(x[:1], w, b)  # off: cuBLAS; one row: the GEMV either way
    monkeypatch.delenv("ATOM_COMPILE_SPLIT_K", raising=False)
    assert tl_.supported(x, w, b)  # on by default
    monkeypatch.setattr(tl_, "SPLIT_K_ROWS", False)  # the module switch overrides the variable
    assert not tl_.supported(x, w, b)
    monkeypatch.setattr(tl_, "SPLIT_K_ROWS", True)
    assert tl_.supported(x, w, b)
    torch.testing.assert_close(tl_.small_m_linear(x, w, b).float(), want, atol=2e-3, rtol=2e-3)
    assert ("split_k", 48, 256, x.dtype, True) in tl_._tuned


def test_the_library_choice_is_the_same_op(monkeypatch):
    from atom_compile.ops import triton_linear as tl_

    monkeypatch.setattr(tl_, "SPLIT_K_ROWS", True)
    for bias in (False, True):
        x, w, b, want = _case(3, 40, 96, bias=bias)
        monkeypatch.setitem(tl_._tuned, ("split_k", 40, 96, x.dtype, bias), tl_.LIBRARY)
        torch.testing.assert_close(tl_.small_m_linear(x, w, b).float(), want, atol=2e-3, rtol=2e-3)
