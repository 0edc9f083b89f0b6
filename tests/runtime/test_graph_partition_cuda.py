"""use_inductor_graph_partition with the runtime's CUDA graphs on a real GPU: the built-in Llama,
compiled as one Inductor graph partitioned at the attention op, records one CUDA-graph segment
per partition (TR_HYBRID, vLLM's PIECEWISE) and matches the eager run. Marked `cuda`.

The design (backends/graph_partition.py): the runtime owns the graphs; its token graphs break at
the attention op (an eager region) wherever it is called from, here Inductor's fallback-kernel
call between two partitions. Inductor's own CUDA graphs stay off.
"""

from __future__ import annotations

import pytest
import torch

from atom_compile import CUDAGraphMode, compilation_counter
from atom_compile.backends.graph_partition import graph_partition_unsupported

from .test_runtime_cuda import CAPTURE, LLAMA, _run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(graph_partition_unsupported() is not None,
                       reason=f"Inductor graph partition unavailable: {graph_partition_unsupported()}"),
]

PARTITION = {"use_inductor_graph_partition": True}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The eager run (level 0, no graphs) and the partitioned compile without CUDA graphs, fed
    the eager run's tokens."""
    root = tmp_path_factory.mktemp("partition-cuda-cache")
    eager = _run(CUDAGraphMode.NONE, 0, root)[0]
    before = compilation_counter.clone()
    compiled = _run(CUDAGraphMode.NONE, 3, root, forced=eager.trace, **PARTITION)[0]
    partitions = compilation_counter.num_inductor_partitions - before.num_inductor_partitions
    pieces = compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen
    return root, eager, compiled, partitions, pieces


def test_one_inductor_graph_with_a_partition_per_layer_boundary(baselines):
    _, eager, compiled, partitions, pieces = baselines
    assert pieces == 1  # no FX split: Inductor got the whole graph
    assert partitions == 2 * LLAMA.num_layers + 1  # attention, and the computation around each
    for i, ((_, got), (_, want)) in enumerate(zip(compiled.trace, eager.trace)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2, msg=lambda m: f"step {i}: {m}")


@pytest.mark.parametrize("mode", [CUDAGraphMode.TR_HYBRID, CUDAGraphMode.FULL_AND_TR_HYBRID, CUDAGraphMode.FULL],
                         ids=lambda m: m.name)
def test_cuda_graphs_per_partition_match_the_run_without_graphs(mode, baselines):
    root, eager, compiled, _, _ = baselines
    engine, info = _run(mode, 3, root, forced=eager.trace, **PARTITION)
    assert len(engine.trace) == len(compiled.trace)
    for i, ((_, logits), (_, want_logits)) in enumerate(zip(engine.trace, compiled.trace)):
        # padding a batch to its bucket may change a matmul's kernel: bf16 tolerance
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
        top2 = want_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05
        assert torch.equal(logits.argmax(-1)[clear], want_logits.argmax(-1)[clear]), f"step {i}"
    assert info["sizes"] == CAPTURE and info["replayed"] > 0
    if mode.uses_tr_hybrid():
        # one CUDA-graph segment per compiled partition: the layers' boundaries, as per FX piece
        assert info["captured"] == len(CAPTURE) * (LLAMA.num_layers + 1)
    else:
        assert info["captured"] == len(CAPTURE)
