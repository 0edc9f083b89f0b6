"""The shared CUDA-graph pool (runtime/pool.py) on a real GPU: a token graph's eager-region
tensors go back to the pool once recorded, a reservation is the one segment every recording
carves from, and no library workspace stays allocated in it. Marked `cuda`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile.runtime import eager_region, token_graph
from atom_compile.runtime import graphs as graphs_module
from atom_compile.runtime import pool as pool_module

pytestmark = pytest.mark.cuda
ROWS = [64, 32, 16, 8, 4, 2, 1]
WIDTH = 1 << 17  # float32: 32 MiB at 64 rows


def _fresh_pool() -> None:
    graphs_module.reset_graph_pool()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _allocated_in_pool() -> int:
    return sum(b["size"] for seg in pool_module._segments() for b in seg["blocks"] if b["state"] == "active_allocated")


@eager_region
def _double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, 2 * ac.get_forward_context().attn_metadata["scale"], out=out)


@eager_region
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@token_graph
class _Chain(nn.Module):
    """Two mutating regions and one that returns its result, each between captured work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 1
        out = torch.empty_like(h)
        _double_into(h, out)
        h = _plus_one(out * 3)
        out = torch.empty_like(h)
        _double_into(h, out)
        return out - 1


def _want(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ((x + 1) * 2 * scale * 3 + 1) * 2 * scale - 1


@torch.no_grad()
def test_a_token_graphs_region_tensors_go_back_to_the_pool_and_replays_stay_right():
    """Kept strongly, each recording's region tensors (4 of 32 MiB at 64 rows) stay in the pool
    for good, and the ladder's pool is about twice the largest recording's."""
    _fresh_pool()
    model = _Chain()
    static = torch.randn(max(ROWS), WIDTH, device="cuda")
    pool = []
    for n in ROWS:
        with ac.set_forward_context({"scale": 1.0}, context=ac.Context(batch_size=n), tr_graph="record"):
            model(static[:n])
        pool.append(graphs_module.graph_pool_bytes())
    assert pool[-1] <= 1.25 * pool[0], [p / 2**20 for p in pool]
    graphs = model.__dict__["_token_graph"]
    assert all(len(rec.segments) == 4 for rec in graphs.recordings.values())
    for n, scale in ((1, 0.5), (64, 2.0), (8, -1.0), (32, 1.5), (1, 3.0), (2, 0.25)):
        static.normal_()
        with ac.set_forward_context({"scale": scale}, context=ac.Context(batch_size=n), tr_graph="replay"):
            got = model(static[:n]).clone()
        torch.testing.assert_close(got, _want(static[:n], scale))


def test_a_reservation_is_the_one_segment_every_recording_carves_from():
    _fresh_pool()
    static = torch.randn(max(ROWS), WIDTH // 2, device="cuda")  # 16 MiB at 64 rows
    assert pool_module.reserve(48 << 20)
    req = graphs_module.ReqGraph()
    rows = [64, 48, 40, 32, 24, 16, 12]  # blocks of 1.5-16 MiB: the allocator's large classes
    for n in rows:
        def fn(n=n):
            a = static[:n] + 1
            b = a * 2
            return b + a  # three blocks live at once: 48 MiB at 64 rows
        req.record(fn, n)
    assert len(pool_module.pool_ranges()) == 1 and graphs_module.graph_pool_bytes() == 48 << 20
    for n in (12, 64, 40, 32):
        static.normal_()
        torch.testing.assert_close(req.replay(n), static[:n] * 3 + 3)
    assert not pool_module.reserve(4 << 20)  # below the allocator's exact-size class: never reserved


def test_no_gemm_workspace_stays_in_the_pool():
    """A GEMM's first use of a stream makes cuBLAS's workspace there; recordings run on a
    stream where it was made before, so a recording whose output is not kept leaves nothing
    allocated in the pool."""
    _fresh_pool()
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    req = graphs_module.ReqGraph()
    def two_gemms():  # the second without a bias: cuBLAS's plain GEMM as well as cuBLASLt's
        return torch.nn.functional.linear(torch.nn.functional.linear(x, w, b)[:, :2048], w)

    out = req.record(two_gemms, 256)
    assert out.shape == (256, 4096) and _allocated_in_pool() == 0
    got, want = req.replay(256).float(), two_gemms().float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
