"""Weights asked of L2 before each attention (backends/l2_prefetch_pass.py, ops/l2_prefetch.py)
on a real GPU: FULL graphs record one fork per attention and decode as the level-3 run without
graphs, from a trace and from a warm start that loads the stitching graph with the ops in it;
token graphs that load that graph fork nothing, and a zero budget puts none in. Marked `cuda`."""

from __future__ import annotations

import pytest
import torch

from atom_compile import CUDAGraphMode, compilation_counter
from atom_compile.ops import l2_prefetch
from .test_runtime_cuda import LLAMA, _run

pytestmark = pytest.mark.cuda

hopper = pytest.mark.skipif(not (torch.cuda.is_available() and l2_prefetch.available(torch.device("cuda"))),
                            reason="the bulk L2 prefetch needs an NVIDIA GPU of compute capability 9.0 or later")


@pytest.fixture(scope="module")
def expect(tmp_path_factory):
    """The level-3 run without CUDA graphs: the logits every run here must give."""
    return _run(CUDAGraphMode.NONE, 3, tmp_path_factory.mktemp("l2-prefetch-base"))[0]


def _same_logits(engine, expect) -> None:
    assert len(engine.trace) == len(expect.trace)
    for i, ((_, logits), (_, want)) in enumerate(zip(engine.trace, expect.trace)):
        torch.testing.assert_close(logits, want, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")


@hopper
def test_full_graphs_record_a_prefetch_per_attention_and_decode_as_eager(expect, tmp_path):
    for start in ("traced", "warm"):  # the second start loads what the first saved, where torch can
        before = compilation_counter.clone()
        engine, info = _run(CUDAGraphMode.FULL, 3, tmp_path, forced=expect.trace)
        if start == "traced":
            assert compilation_counter.num_l2_prefetches - before.num_l2_prefetches == LLAMA.num_layers
        recorded = compilation_counter.num_l2_prefetches_recorded - before.num_l2_prefetches_recorded
        assert info["captured"] > 0 and recorded == LLAMA.num_layers * info["captured"], (start, recorded, info)
        _same_logits(engine, expect)


@hopper
def test_token_graphs_from_a_full_compiles_cache_fork_nothing(expect, tmp_path):
    """A TR_HYBRID start loads the stitching graph a FULL compile saved (the CUDA-graph mode is
    not keyed), prefetches in it: a token graph's segment ends at the attention, so they must
    not fork there (an unjoined fork fails the recording)."""
    _run(CUDAGraphMode.FULL, 3, tmp_path, forced=expect.trace)
    before = compilation_counter.clone()
    engine, info = _run(CUDAGraphMode.TR_HYBRID, 3, tmp_path, forced=expect.trace)
    assert compilation_counter.num_l2_prefetches_recorded == before.num_l2_prefetches_recorded
    assert info["captured"] > 0 and info["replayed"] > 0
    _same_logits(engine, expect)


@hopper
def test_a_zero_budget_puts_none_in(expect, tmp_path):
    before = compilation_counter.clone()
    engine, info = _run(CUDAGraphMode.FULL, 3, tmp_path, forced=expect.trace, l2_prefetch_mb=0)
    assert compilation_counter.num_l2_prefetches == before.num_l2_prefetches
    assert compilation_counter.num_l2_prefetches_recorded == before.num_l2_prefetches_recorded
    assert info["replayed"] > 0
    _same_logits(engine, expect)
