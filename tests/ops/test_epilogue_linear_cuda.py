"""The add + RMSNorm epilogue GEMV (ops/epilogue_linear.py) on the GPU, bf16 at decode shapes:
against the model's own PyTorch, eagerly and replayed in a CUDA graph many times with new
inputs (the programs race to finish: the last must see every strip, and leave the counter at 0)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)
pytest.importorskip("triton")

from atom_compile.ops import epilogue_linear  # noqa: E402
from atom_compile.ops.prologue_linear import _reference  # noqa: E402

BF16 = torch.bfloat16


def _check(got, x, w, r, nw, eps):
    normed, h = got
    normed_want, h_want = _reference(torch.nn.functional.linear(x, w), r, nw, eps)
    torch.testing.assert_close(h.float(), h_want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(normed.float(), normed_want.float(), atol=6e-2, rtol=6e-2)
    # from the kernel's own sum: the norm rounds as the model's
    torch.testing.assert_close(normed, _reference(h, None, nw, eps)[0], atol=1e-2, rtol=2 ** -6)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n,k", [(2048, 2048), (2048, 8192), (4100, 130)])
def test_op_matches_the_model(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=BF16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=BF16) / k ** 0.5
    r = torch.randn(m, n, device="cuda", generator=g, dtype=BF16)
    nw = 1 + torch.randn(n, device="cuda", generator=g, dtype=BF16) / 4
    _check(epilogue_linear.op()(x, w, r, nw, 1e-5), x, w, r, nw, 1e-5)


def test_one_launch_and_right_over_many_graph_replays():
    n, k = 2048, 2048
    x = torch.empty(1, k, device="cuda", dtype=BF16)
    r = torch.empty(1, n, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k ** 0.5
    nw = 1 + torch.randn(n, device="cuda", dtype=BF16) / 4
    fused = epilogue_linear.op()
    x.normal_(), r.normal_()
    fused(x, w, r, nw, 1e-5)  # compiled, outside the capture
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused(x, w, r, nw, 1e-5)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "small_m_linear" in kernels[0], kernels
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(x, w, r, nw, 1e-5)  # this stream's counter, made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [fused(x, w, r, nw, 1e-5) for _ in range(4)]  # four launches, one counter
    for _ in range(50):
        x.normal_(), r.normal_()
        graph.replay()
        torch.cuda.synchronize()
        for got in outs:
            _check(got, x, w, r, nw, 1e-5)
    assert all(int(c.item()) == 0 for c in epilogue_linear._counters.values())
