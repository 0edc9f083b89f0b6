"""The split-K dots for 2..8 rows (ops/triton_splitk.py) on the GPU, bf16 at Llama-3.2-1B's
decode shapes: every candidate against F.linear, eagerly and replayed in a CUDA graph (the
prefetching variant, with PDL), the ticket counters back at 0 after each."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)
pytest.importorskip("triton")

from atom_compile.ops import triton_linear, triton_splitk  # noqa: E402

BF16 = torch.bfloat16


def _close(got, x, w, b):
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (1000, 130)])
def test_every_candidate_matches_linear_eagerly_and_in_a_graph(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=BF16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=BF16) / k ** 0.5
    b = torch.randn(n, device="cuda", generator=g, dtype=BF16) if m == 5 else None
    for config in triton_splitk.CONFIGS:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=BF16)
        triton_splitk.launch(x, w, b, out, config)
        _close(out, x, w, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_splitk.launch(x, w, b, out, config)
        for _ in range(2):
            x.normal_(generator=g)
            out.fill_(float("nan"))
            graph.replay()
            _close(out, x, w, b)
        assert int(triton_splitk._tickets[x.device].abs().sum()) == 0, config


def test_the_entry_point_tunes_and_keeps_the_choice(monkeypatch):
    monkeypatch.setattr(triton_linear, "SPLIT_K_ROWS", True)
    x = torch.randn(8, 2048, device="cuda", dtype=BF16)
    w = torch.randn(2048, 2048, device="cuda", dtype=BF16) / 2048 ** 0.5
    _close(triton_linear.small_m_linear(x, w), x, w, None)
    assert triton_linear._tuned[("split_k", 2048, 2048, BF16, False)] in triton_linear._split_k_candidates()


@pytest.mark.parametrize("bias", [False, True])
def test_the_library_choice_matches_linear_eagerly_and_in_a_graph(monkeypatch, bias):
    # a shape that cuBLAS reads faster keeps cuBLAS: the same op, the same output buffer
    monkeypatch.setattr(triton_linear, "SPLIT_K_ROWS", True)
    x = torch.randn(6, 1024, device="cuda", dtype=BF16)
    w = torch.randn(3000, 1024, device="cuda", dtype=BF16) / 32
    b = torch.randn(3000, device="cuda", dtype=BF16) if bias else None
    monkeypatch.setitem(triton_linear._tuned, ("split_k", 3000, 1024, BF16, bias), triton_linear.LIBRARY)
    out = triton_linear.small_m_linear(x, w, b)
    _close(out, x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_linear.small_m_linear(x, w, b)
    x.normal_()
    graph.replay()
    _close(out, x, w, b)


@pytest.mark.parametrize("merged", [True, False])
def test_few_rows_of_a_gated_mlp_take_the_gated_form_eagerly_and_in_a_graph(monkeypatch, merged):
    # one launch (no activation kernel) where the split-K path chose one slice for the
    # projections: the merged block's choice, or each weight's where they are apart
    from atom_compile.ops import glu_linear, triton_glu, triton_rowwise

    monkeypatch.setattr(triton_linear, "SPLIT_K_ROWS", True)
    monkeypatch.setattr(triton_glu, "SPLIT_K_GLU_ROWS", 8)
    n, k = 8192, 2048
    gate_up = torch.randn(2 * n, k, device="cuda", dtype=BF16) / k ** 0.5
    wg, wu = (gate_up[:n], gate_up[n:]) if merged else (gate_up[:n].clone(), gate_up[n:].clone())
    monkeypatch.setitem(triton_linear._tuned, ("split_k", 2 * n if merged else n, k, BF16, False), (64, 128, 1, 4))
    launches = []
    monkeypatch.setattr(triton_splitk, "launch_glu", lambda *a, _f=triton_splitk.launch_glu: launches.append(a[-1]) or _f(*a))
    monkeypatch.setattr(triton_rowwise, "act_mul", lambda *a: pytest.fail("the activation ran as its own kernel"))

    def want(x):
        gate, up = (x.float() @ wg.float().T).to(BF16), (x.float() @ wu.float().T).to(BF16)
        return torch.nn.functional.silu(gate.float()).to(BF16).float() * up.float()

    for m in (2, 8):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        out = glu_linear.gate_up_glu(x, wg, wu, "silu")
        assert ((out.float() - want(x)).norm() / want(x).norm()).item() < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = glu_linear.gate_up_glu(x, wg, wu, "silu")
        x.normal_()
        graph.replay()
        assert ((out.float() - want(x)).norm() / want(x).norm()).item() < 1e-2
    assert launches == [(32, 128, 1, 4)] * 4
