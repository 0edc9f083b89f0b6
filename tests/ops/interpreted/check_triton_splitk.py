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


def _glu_want(x, wg, wu, act):
    from atom_compile.ops.glu_linear import activate

    # rounded where the model's ops round: each projection, act(gate), the product
    gate, up = (x.float() @ wg.float().T).to(x.dtype), (x.float() @ wu.float().T).to(x.dtype)
    return (activate(gate, act).float() * up.float()).to(x.dtype)


@pytest.mark.parametrize("m,n,k", [(2, 70, 300), (8, 33, 1000)])
def test_the_gated_form_of_every_one_slice_shape_matches_act_and_mul(sk, m, n, k):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=g).half()
    wg, wu = ((torch.randn(n, k, generator=g) / k ** 0.5).half() for _ in range(2))
    gated = [c for c in map(sk.glu_config, sk.CONFIGS) if c is not None]
    assert gated and all(c[2] == 1 and c[0] >= 16 for c in gated)
    for act in ("silu", "gelu_tanh"):
        want = _glu_want(x, wg, wu, act)
        for config in gated:
            out = torch.full((m, n), float("nan"), dtype=x.dtype)
            sk.launch_glu(x, wg, wu, out, act, config)
            torch.testing.assert_close(out.float(), want.float(), atol=3e-3, rtol=3e-3, msg=f"{act} {config}")
    with pytest.raises(ValueError, match="one slice"):
        sk.launch_glu(x, wg, wu, out, "silu", (32, 128, 2, 4))


def test_rows_take_the_gated_form_of_the_projections_one_slice_choice(sk, monkeypatch):
    from atom_compile.ops import triton_glu, triton_linear as tl_

    monkeypatch.setattr(tl_, "SPLIT_K_ROWS", True)
    monkeypatch.setattr(triton_glu, "SPLIT_K_GLU_ROWS", 8)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, generator=g).half()
    merged = (torch.randn(2 * 80, 96, generator=g) / 96 ** 0.5).half()
    wg, wu = merged[:80], merged[80:]
    merged_key, half_key = ("split_k", 160, 96, x.dtype, False), ("split_k", 80, 96, x.dtype, False)
    monkeypatch.setitem(tl_._tuned, merged_key, (64, 128, 1, 4))
    monkeypatch.setitem(tl_._tuned, half_key, (16, 256, 1, 4))
    assert triton_glu.rows_config(x, wg, wu) == (32, 128, 1, 4)  # the merged block's choice, halved
    assert triton_glu.rows_config(x, wu, wg) == (32, 128, 1, 4)  # its halves the other way round
    apart = wg.clone(), wu.clone()
    assert triton_glu.rows_config(x, *apart) is None  # two weights: their own choice, too narrow to halve
    monkeypatch.setitem(tl_._tuned, half_key, (32, 256, 1, 4))
    assert triton_glu.rows_config(x, *apart) == (16, 256, 1, 4)
    torch.testing.assert_close(triton_glu.gate_up_glu_rows(x, *apart, "silu", (16, 256, 1, 4)).float(),
                               _glu_want(x, *apart, "silu").float(), atol=3e-3, rtol=3e-3)
    for other in (tl_.LIBRARY, (64, 128, 2, 4)):  # the library GEMM or several slices: unfused
        monkeypatch.setitem(tl_._tuned, merged_key, other)
        assert triton_glu.rows_config(x, wg, wu) is None
    monkeypatch.setitem(tl_._tuned, merged_key, (64, 128, 1, 4))
    assert triton_glu.rows_config(x[:1], wg, wu) is None  # one row: the GEMV's own epilogue
    monkeypatch.setattr(triton_glu, "SPLIT_K_GLU_ROWS", 3)  # more rows than that: unfused
    assert triton_glu.rows_config(x, wg, wu) is None and triton_glu.rows_config(x[:3], wg, wu) == (32, 128, 1, 4)
    monkeypatch.setattr(triton_glu, "SPLIT_K_GLU_ROWS", 0)
    assert triton_glu.rows_config(x[:2], wg, wu) is None
