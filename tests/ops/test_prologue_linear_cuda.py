"""The prologue GEMVs (RMSNorm after a residual add; SiLU-and-mul) and the row-wise kernels on the
GPU, bf16 at decode shapes, against the model's own PyTorch (ops/prologue_linear)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)
pytest.importorskip("triton")

from atom_compile.ops import prologue_linear  # noqa: E402

BF16 = torch.bfloat16


def _case(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=BF16) * 3
    r = torch.randn(m, k, device="cuda", generator=g, dtype=BF16)
    nw = 1 + torch.randn(k, device="cuda", generator=g, dtype=BF16) / 4
    w = torch.randn(n, k, device="cuda", generator=g, dtype=BF16) / k ** 0.5
    return x, r, nw, w


@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (1000, 130)])
@pytest.mark.parametrize("add", [False, True])
def test_ops_match_the_model(m, n, k, add):
    plain, with_add, _ = prologue_linear.ops()
    x, r, nw, w = _case(m, n, k, seed=m + k)
    normed, h_want = prologue_linear._reference(x, r if add else None, nw, 1e-5)
    want = torch.nn.functional.linear(normed.float(), w.float())
    if add:
        y, h = with_add(x, r, nw, 1e-5, w)
        assert torch.equal(h, h_want)  # the GPU rounds the sum to nearest even, as PyTorch
    else:
        y = plain(x, nw, 1e-5, w)
    torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2)


def test_the_one_row_call_is_one_launch():
    x, r, nw, w = _case(1, 2048, 2048, seed=0)
    _, with_add, silu_mul = prologue_linear.ops()
    gu = torch.randn(1, 2 * 2048, device="cuda", dtype=BF16)
    for call in (lambda: with_add(x, r, nw, 1e-5, w), lambda: silu_mul(gu[:, :2048], gu[:, 2048:], w)):
        call()  # compiled
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1 and "small_m_linear" in kernels[0], kernels


@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,k", [(2048, 8192), (1000, 130)])
def test_silu_mul_linear_matches_the_model(m, n, k):
    *_, silu_mul = prologue_linear.ops()
    g = torch.Generator(device="cuda").manual_seed(m + k)
    gu = torch.randn(m, 2 * k, device="cuda", generator=g, dtype=BF16) * 2
    w = torch.randn(n, k, device="cuda", generator=g, dtype=BF16) / k ** 0.5
    gate, up = gu[:, :k], gu[:, k:]
    want = torch.nn.functional.linear(prologue_linear._silu_mul_reference(gate, up).float(), w.float())
    torch.testing.assert_close(silu_mul(gate, up, w).float(), want, atol=3e-2, rtol=3e-2)
