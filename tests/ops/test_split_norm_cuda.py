"""The RMSNorm split between two GEMVs (ops/split_norm.py) on the GPU, bf16 at decode shapes:
against the model's own PyTorch, eagerly and replayed in a CUDA graph many times with new
inputs (each producer zeroing the next pair's slot), a forward stopped half way, a consumer
weight the kernels do not take; the host's account of the slots matches the GPU's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)
pytest.importorskip("triton")

from atom_compile.ops import split_norm  # noqa: E402
from atom_compile.ops.prologue_linear import _reference  # noqa: E402

BF16 = torch.bfloat16
WEIGH, SCALED = split_norm.ops()
EPS = 1e-5


def _tensors(m, n, k, n2, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g, dtype=BF16) * scale

    return t(m, k), t(n, k, scale=k ** -0.5), t(m, n), 1 + t(n, scale=0.25), t(n2, n, scale=n ** -0.5)


def _want(x, w, r, nw, w2, glu=False):
    normed, h = _reference(torch.nn.functional.linear(x, w), r, nw, EPS)
    if not glu:
        return torch.nn.functional.linear(normed, w2), h
    half = w2.shape[0] // 2
    gate, up = torch.nn.functional.linear(normed, w2[:half]), torch.nn.functional.linear(normed, w2[half:])
    return torch.nn.functional.silu(gate) * up, h


def _pair(x, w, r, nw, w2, site=0, glu=False, clear=1):
    g, h = WEIGH(x, w, r, nw, EPS, site, clear)
    if glu:
        half = w2.shape[0] // 2
        return SCALED(g, h, nw, EPS, w2[:half], w2[half:], "silu", site), h
    return SCALED(g, h, nw, EPS, w2, None, "", site), h


def _close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=6e-2, rtol=6e-2)


def _account_holds():
    """Every slot the host does not count as holding a sum is zero on the GPU."""
    torch.cuda.synchronize()
    return all(not rows[i].any() for key, rows in split_norm._slots.items()
               for i in range(split_norm.SITES) if i not in split_norm._dirty[key])


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n,k,n2,glu", [(2048, 2048, 3072, False), (2048, 8192, 2 * 8192, True), (4100, 130, 64, False)])
def test_pair_matches_the_model(m, n, k, n2, glu):
    x, w, r, nw, w2 = _tensors(m, n, k, n2, seed=n + k + m)
    _close(_pair(x, w, r, nw, w2, glu=glu), _want(x, w, r, nw, w2, glu))
    assert _account_holds()


def test_two_launches_and_right_over_many_graph_replays():
    x, w, r, nw, w2 = _tensors(1, 2048, 2048, 2048, seed=1)
    _pair(x, w, r, nw, w2)  # compiled, outside the capture
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _pair(x, w, r, nw, w2, site=1, clear=0)  # the next site: nothing to zero first
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2 and all("small_m_linear" in k for k in kernels), kernels
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _pair(x, w, r, nw, w2)  # this stream's slots, made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        first = _pair(x, w, r, nw, w2)
        # the next pair reads the first's consumer: a chain of two sites, each zeroing the other's
        second = _pair(first[0], w, first[1], nw, w2, site=1, clear=0)
    for _ in range(50):
        x.normal_(), r.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = _want(x, w, r, nw, w2)
        _close(first, want)
        _close(second, _want(first[0], w, first[1], nw, w2))
    assert _account_holds()


def test_a_forward_stopped_half_way():
    a, b = _tensors(1, 2048, 2048, 512, seed=2), _tensors(1, 2048, 2048, 512, seed=3)
    WEIGH(*a[:4], EPS, 0, 1)  # stopped: no consumer, and no next producer zeroes site 0
    _close(_pair(*a), _want(*a))  # the producer finds site 0 dirty and zeroes it first
    _close(_pair(*b, site=1, clear=0), _want(*b))
    _close(_pair(*a), _want(*a))
    assert _account_holds()


def test_a_consumer_weight_the_kernels_do_not_take():
    x, w, r, nw, w2 = _tensors(1, 2048, 2048, 256, seed=4)
    odd = w2.t().contiguous().t()  # column-major: the GEMV takes unit inner strides only
    _close(_pair(x, w, r, nw, odd), _want(x, w, r, nw, w2))
    assert _account_holds()
    _close(_pair(x, w, r, nw, w2), _want(x, w, r, nw, w2))  # the slot was emptied for the next pair
