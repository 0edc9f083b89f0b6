"""Host mode on a GPU: a host-like loop records its OWN CUDA graph per batch size around our
level-3 compiled built-in Llama (our attention op inside), then replays a decode schedule whose
lengths and block tables change every step; every step matches the eager model."""

from __future__ import annotations

import random

import pytest
import torch

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from atom_compile.host_config import HostConfig
from atom_compile.models import build_model, preset
from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep

pytestmark = pytest.mark.cuda

LLAMA = preset("tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)
BLOCK, BLOCKS_PER_SEQ, MAX_SEQS = 16, 8, 4
BUCKETS = (4, 2, 1)


def _forward(model, builder, steps, padded=None):
    ids, pos, meta, ctx = builder.build(steps, padded_num_seqs=padded)
    with ac.set_forward_context(meta, None, ctx, no_compile_layers=model.no_compile_layers):
        return model(ids, pos)


def test_the_host_records_and_replays_its_own_graphs_around_our_model(tmp_path):
    cfg = Config(host=HostConfig(), max_num_seqs=MAX_SEQS, max_num_batched_tokens=256,
                 compilation_config=CompilationConfig(level=3, cache_dir=str(tmp_path)))
    model = build_model(LLAMA, compilation_config=cfg, device="cuda", seed=0)
    eager = build_model(LLAMA, compilation_config=Config(compilation_config=CompilationConfig(level=0)),
                        device="cuda", seed=0, prefix="eager")
    num_blocks = MAX_SEQS * BLOCKS_PER_SEQ
    model.allocate_kv_cache(num_blocks, BLOCK)
    eager.allocate_kv_cache(num_blocks, BLOCK)
    host_builder = PagedAttentionMetadataBuilder(MAX_SEQS, 256, BLOCKS_PER_SEQ, BLOCK, device="cuda")
    eager_builder = PagedAttentionMetadataBuilder(MAX_SEQS, 256, BLOCKS_PER_SEQ, BLOCK, device="cuda")

    # the host's capture: warm-up (compiles on the first, largest size), then its own graph
    graphs = {}
    captured_before = compilation_counter.num_cudagraph_captured
    with torch.inference_mode():
        for bs in BUCKETS:
            ids, pos, meta, ctx = host_builder.build_for_cudagraph_capture(bs)
            with ac.set_forward_context(meta, None, ctx, no_compile_layers=model.no_compile_layers):
                model(ids, pos)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = model(ids, pos)
            graphs[bs] = (graph, out)
    assert compilation_counter.num_cudagraph_captured == captured_before  # ours recorded nothing

    rng = random.Random(0)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = [blocks[i * BLOCKS_PER_SEQ:(i + 1) * BLOCKS_PER_SEQ] for i in range(MAX_SEQS)]
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (37, 5, 60, 18)]
    with torch.inference_mode():
        prefill = [SequenceStep(p, 0, t) for p, t in zip(prompts, tables)]
        got = _forward(model, host_builder, prefill)  # the host runs prefill eagerly (our compiled code)
        want = _forward(eager, eager_builder, prefill)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        tokens = [list(p) for p in prompts]
        for active in ([0, 1, 2, 3], [0, 2, 3], [1, 3], [2], [0, 1, 2, 3], [3, 0]):
            steps = [SequenceStep(tokens[s][-1:], len(tokens[s]) - 1, tables[s]) for s in active]
            bs = min(b for b in BUCKETS if b >= len(active))
            host_builder.build(steps, padded_num_seqs=bs)  # the step's data into the captured buffers
            graph, out = graphs[bs]
            graph.replay()
            got = out[:len(active)].clone()
            want = _forward(eager, eager_builder, steps)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            nxt = eager.compute_logits(want).argmax(-1).tolist()
            for s, t in zip(active, nxt):
                tokens[s].append(t)
