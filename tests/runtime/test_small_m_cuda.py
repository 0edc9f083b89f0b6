"""The small-M Triton linear on the GPU: the kernel in bf16 at decode shapes against F.linear,
and the built-in Llama's logits, which take it at up to MAX_M rows."""

from __future__ import annotations

import pytest
import torch

from atom_compile.models import build_model

from .test_runtime_cuda import LLAMA

pytestmark = pytest.mark.cuda
triton_linear = pytest.importorskip("atom_compile.ops.triton_linear")


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (1000, 130)])
def test_kernel_bf16_matches_linear(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    got = triton_linear.small_m_linear(x, w, b)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_llama_logits_take_the_kernel_up_to_max_m(rows):
    model = build_model(LLAMA, dtype=torch.bfloat16, device="cuda", seed=0)
    hidden = torch.randn(rows, LLAMA.hidden_size, device="cuda", dtype=torch.bfloat16)
    triton_linear._tuned.clear()
    got = model.compute_logits(hidden)
    want = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    assert bool(triton_linear._tuned) == (rows <= triton_linear.MAX_M)  # 9 rows: F.linear
