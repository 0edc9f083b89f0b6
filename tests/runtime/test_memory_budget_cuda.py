"""Config.cudagraph_memory_budget on a real GPU: capture stops before the budget, the skipped
sizes are named once and run on the next larger graph. Marked `cuda`: skipped without a device."""

from __future__ import annotations

import logging

import pytest
import torch

from atom_compile import CompilationConfig, Config, CUDAGraphMode
from atom_compile.models import build_model, preset
from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep
from atom_compile.runtime import ModelRunner
from atom_compile.runtime import graphs as graphs_module

pytestmark = pytest.mark.cuda

BLOCK = 16
SIZES = [1, 2, 4, 8, 16, 32]
LLAMA = preset("tiny", num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64,
               intermediate_size=2048)


def _runner(budget):
    graphs_module.reset_graph_pool()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cc = CompilationConfig(level=0, cudagraph_mode=CUDAGraphMode.FULL, cudagraph_capture_sizes=SIZES)
    cfg = Config(max_num_seqs=max(SIZES), max_num_batched_tokens=1024, compilation_config=cc,
                 cudagraph_memory_budget=budget)
    model = build_model(LLAMA, compilation_config=cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    model.allocate_kv_cache(max(SIZES) * 4, BLOCK)
    builder = PagedAttentionMetadataBuilder(max(SIZES), 1024, 4, BLOCK, device="cuda")
    runner = ModelRunner(model, cfg, builder)
    _, sizes = runner.capture_cudagraph()
    return runner, sizes


def test_no_budget_records_every_size():
    runner, sizes = _runner(None)
    assert sizes == SIZES
    assert runner.pool_memory() > 0


def test_a_tight_budget_skips_the_small_sizes_and_names_them(caplog):
    caplog.set_level(logging.INFO, logger="atom_compile")
    runner, sizes = _runner(1)  # one byte: only the largest (always recorded) fits
    assert sizes == [max(SIZES)]
    lines = [r.getMessage() for r in caplog.records if "cudagraph_memory_budget" in r.getMessage()]
    assert len(lines) == 1 and str(sorted(SIZES)[:-1]) in lines[0], lines
    # a 3-sequence decode pads to the next larger recorded graph
    steps = [SequenceStep([5], 3, [i]) for i in range(3)]  # decode: one token at position 3
    assert runner.padding_for(steps)[0] == max(SIZES)


def test_a_fraction_of_free_memory_that_holds_everything_records_everything():
    _, sizes = _runner(0.9)
    assert sizes == SIZES


def test_a_recordings_output_goes_back_to_the_pool_and_replays_stay_right():
    """Request graphs of a ladder share one pool, and a recorded output is not kept: the next
    (smaller) recording reuses its memory, so the pool is the largest recording's, not the sum
    of every output (2x here if kept: each recording allocates its output alone). Each replay
    still writes its output, read before the next."""
    graphs_module.reset_graph_pool()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    rows = [64, 32, 16, 8, 4, 2, 1]
    static = torch.randn(max(rows), 1 << 17, device="cuda")  # 32 MiB of float32 at 64 rows
    req = graphs_module.ReqGraph()
    pool = []
    for n in rows:
        out = req.record(lambda n=n: static[:n] + 1, n)
        assert out.shape == (n, static.shape[1])
        pool.append(graphs_module.graph_pool_bytes())
    assert pool[-1] <= 1.25 * pool[0], [p / 2**20 for p in pool]
    for n in (1, 64, 8, 32, 1, 2):
        static.normal_()
        got = req.replay(n)
        torch.testing.assert_close(got, static[:n] + 1)
