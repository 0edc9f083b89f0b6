"""The graph pool's decisions that need no GPU (runtime/pool.py): when a reservation is made,
and what `pool_alias` leaves alone."""

from __future__ import annotations

import pytest
import torch

from atom_compile.runtime import pool


@pytest.fixture(autouse=True)
def _no_pending_reservation():
    pool.reset_graph_pool()
    yield
    pool.reset_graph_pool()


@pytest.mark.parametrize("conf", ["", "garbage_collection_threshold:0.8", "expandable_segments:False"])
def test_a_need_over_10_mib_is_reserved_where_the_allocator_splits_freely(monkeypatch, conf):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native", raising=False)
    assert pool.reserve(64 << 20) and pool._reserved == 64 << 20
    pool.reset_graph_pool()
    assert not pool.reserve(10 << 20) and pool._reserved == 0  # a 20 MiB segment of its class: none


@pytest.mark.parametrize("variable, conf", [
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    ("PYTORCH_ALLOC_CONF", "Expandable_Segments:true,garbage_collection_threshold:0.6"),
])
def test_no_reservation_where_a_free_block_would_not_be_split(monkeypatch, variable, conf):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(variable, conf)
    assert not pool.reserve(64 << 20) and pool._reserved == 0


def test_no_reservation_under_cuda_malloc_async(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync", raising=False)
    assert not pool.reserve(64 << 20)


def test_pool_alias_leaves_cpu_tensors_and_other_leaves_alone():
    t = torch.arange(4.0)
    tree = (t, {"n": 3, "s": "layer.0"}, [t[1:]])
    out = pool.pool_alias(tree, lambda ptr: True)
    assert out[0] is t and out[2][0].data_ptr() == t[1:].data_ptr() and out[1] == {"n": 3, "s": "layer.0"}
