"""CUDA graphs on a real GPU: every mode at level 0 and 3 against the eager run, live eager
regions, capture counters and one shared pool. Marked `cuda`: skipped without a device."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, CUDAGraphMode, compilation_counter
from atom_compile.models import build_model, preset
from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep
from atom_compile.runtime import ModelRunner, eager_region, token_graph
from atom_compile.runtime import graphs as graphs_module

pytestmark = pytest.mark.cuda

BLOCK = 16
CAPTURE = [1, 2, 4, 8]
MODES = [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_TR_HYBRID]
LLAMA = preset("tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)


class Engine:
    """A small scheduler: sequences join (prefill), decode greedily, leave; blocks are handed
    out at random, so block tables and lengths change from step to step."""

    def __init__(self, runner: ModelRunner, num_blocks: int, seed: int = 0, forced: list | None = None):
        self.runner = runner
        # the baseline's tokens, fed to this run too: every step then compares identical inputs
        self.forced = forced
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)
        self.seqs: dict[int, dict] = {}
        self.trace: list[tuple[list[int], torch.Tensor]] = []

    def _blocks(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def add(self, sid: int, prompt: list[int]) -> None:
        self.seqs[sid] = {"tokens": list(prompt), "blocks": self._blocks(4), "new": True}

    def drop(self, sid: int) -> None:
        self.free.extend(self.seqs.pop(sid)["blocks"])

    def step(self, sids: list[int]) -> None:
        new = [s for s in sids if self.seqs[s]["new"]]
        if new:
            steps = [SequenceStep(self.seqs[s]["tokens"], 0, self.seqs[s]["blocks"]) for s in new]
            order = new
        else:
            steps = [SequenceStep(self.seqs[s]["tokens"][-1:], len(self.seqs[s]["tokens"]) - 1, self.seqs[s]["blocks"])
                     for s in sids]
            order = sids
        logits, _ = self.runner.step(steps)
        # the last row of each sequence predicts its next token
        ends, row = [], 0
        for st in steps:
            row += len(st.token_ids)
            ends.append(row - 1)
        last = logits[ends].float()
        tokens = last.argmax(-1).tolist() if self.forced is None else self.forced[len(self.trace)][0]
        for s, t in zip(order, tokens):
            self.seqs[s]["tokens"].append(t)
            self.seqs[s]["new"] = False
        self.trace.append((tokens, last.cpu()))


def _schedule(engine: Engine) -> None:
    """Batches that grow, shrink and pad (3 -> 4, 5 -> 8), buckets replayed out of order,
    one batch beyond the largest bucket (eager), new prompts between decodes."""
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(1, 500, (n,), generator=g).tolist()  # noqa: E731
    for sid, n in enumerate([5, 9, 3]):
        engine.add(sid, prompt(n))
    engine.step([0, 1, 2])
    for _ in range(3):
        engine.step([0, 1, 2])                       # bucket 4
    for sid, n in ((3, 7), (4, 2)):
        engine.add(sid, prompt(n))
    engine.step([3, 4])
    for _ in range(2):
        engine.step([0, 1, 2, 3, 4])                 # bucket 8
    engine.step([4])                                 # bucket 1
    engine.drop(1)
    engine.step([0, 2, 3, 4])                        # bucket 4 again, other sequences
    engine.step([2, 3])                              # bucket 2
    engine.add(12, prompt(3))
    engine.step([12])                                # a 3-row prefill: token bucket 4 under TR_HYBRID
    for sid in range(5, 12):
        engine.add(sid, prompt(4))
    engine.step(list(range(5, 12)))
    engine.step([0, 2, 3, 4] + list(range(5, 12)))   # 11 > 8: eager
    engine.step([0, 2, 3, 4, 5, 6])                  # bucket 8
    engine.step([5])                                 # bucket 1


def _run(mode: CUDAGraphMode, level: int, cache_root, forced: list | None = None, **fields) -> tuple[Engine, dict]:
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cudagraph_capture_sizes=CAPTURE, cache_dir=str(cache_root),
                           **fields)
    cfg = Config(max_num_seqs=16, max_num_batched_tokens=256, compilation_config=cc)
    model = build_model(LLAMA, compilation_config=cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    num_blocks = 16 * 4
    model.allocate_kv_cache(num_blocks, BLOCK)
    builder = PagedAttentionMetadataBuilder(16, 256, 4, BLOCK, device="cuda")
    runner = ModelRunner(model, cfg, builder)
    before = compilation_counter.clone()
    seconds, sizes = runner.capture_cudagraph()
    if sizes:  # the pool after the largest size and after the ladder, which reuses the largest's memory
        pool = list(runner.capture_pool_bytes.values())
        assert len(pool) == min(2, len(sizes)) and pool[0] <= pool[-1], runner.capture_pool_bytes
    captured = compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured
    engine = Engine(runner, num_blocks, forced=forced)
    _schedule(engine)
    return engine, {"captured": captured, "sizes": sizes, "seconds": seconds,
                    "replayed": compilation_counter.num_cudagraph_replayed - before.num_cudagraph_replayed}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-cache")
    return root, {level: _run(CUDAGraphMode.NONE, level, root)[0] for level in (0, 3)}


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_greedy_decode_matches_eager(mode, level, baselines):
    root, base = baselines
    expect = base[level]
    engine, info = _run(mode, level, root, forced=expect.trace)
    assert len(engine.trace) == len(expect.trace)
    for i, ((_, logits), (want_tokens, want_logits)) in enumerate(zip(engine.trace, expect.trace)):
        # padding a batch to its bucket may change a matmul's kernel: bf16 tolerance, and the
        # greedy token must agree wherever the eager run's choice is not a near-tie
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
        top2 = want_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05
        got_tokens = logits.argmax(-1)
        assert torch.equal(got_tokens[clear], torch.tensor(want_tokens)[clear]), f"step {i}"
    assert info["sizes"] == CAPTURE and info["replayed"] > 0
    segments_per_bucket = LLAMA.num_layers + 1
    if mode.uses_tr_hybrid():
        assert info["captured"] == len(CAPTURE) * segments_per_bucket
        # every attention region replays as bound launches (ops/attention.py bind_unified_attention)
        recordings = graphs_module.token_graph_of(engine.runner.model).recordings.values()
        assert all(region.replay is not None for rec in recordings for region in rec.regions)
    else:
        assert info["captured"] == len(CAPTURE)


def test_norms_fused_into_projections_decode_as_eager(baselines):
    """prologue_pass (glu_pass off, which would take the SiLU-and-mul first): every RMSNorm and
    SiLU-and-mul of the layers is the prologue of the projection after it (one launch at one
    token; a row-wise kernel and cuBLAS above), under FULL graphs."""
    root, base = baselines
    expect = base[3]
    engine, info = _run(CUDAGraphMode.FULL, 3, root, forced=expect.trace, prologue_pass=True, glu_pass=False)
    for i, ((_, logits), (_, want_logits)) in enumerate(zip(engine.trace, expect.trace)):
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
    code = "\n".join(p.read_text() for p in root.rglob("*.py") if "def call(" in p.read_text())
    # two norms a layer; the first layer's input norm has no residual add before it
    assert code.count("torch.ops.atom.add_rms_norm_linear") >= 2 * LLAMA.num_layers - 1
    assert code.count("torch.ops.atom.silu_mul_linear") >= LLAMA.num_layers
    assert info["replayed"] > 0


def test_silu_mul_fused_into_gate_up_decodes_as_eager(baselines, tmp_path):
    """glu_pass: every layer's SiLU-and-mul is the epilogue of its gate_up projection
    (atom::gate_up_glu: one launch at one token, cuBLAS and a SiLU-and-mul kernel above),
    under FULL graphs, with the prologue pass on too (which then finds no activation for down)."""
    expect = baselines[1][3]
    root = tmp_path  # a cache of its own: the code read below is this run's only
    engine, info = _run(CUDAGraphMode.FULL, 3, root, forced=expect.trace, glu_pass=True, prologue_pass=True)
    for i, ((_, logits), (_, want_logits)) in enumerate(zip(engine.trace, expect.trace)):
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
    code = "\n".join(p.read_text() for p in root.rglob("*.py") if "def call(" in p.read_text())
    assert code.count("torch.ops.atom.gate_up_glu") >= LLAMA.num_layers
    assert "torch.ops.atom.silu_mul_linear" not in code
    assert info["replayed"] > 0


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID])
def test_norms_split_between_the_projections_decode_as_eager(baselines, tmp_path, mode):
    """epilogue_pass: each RMSNorm between two projections is split between them
    (atom::linear_add_weigh, atom::norm_scaled_linear: at one token no norm kernel), under FULL
    and token graphs, replayed many times (the slots as the host counts them)."""
    from atom_compile.ops import split_norm

    expect = baselines[1][3]
    engine, info = _run(mode, 3, tmp_path, forced=expect.trace, epilogue_pass=True)
    for i, ((_, logits), (_, want_logits)) in enumerate(zip(engine.trace, expect.trace)):
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.py") if "def call(" in p.read_text())
    # in each piece between two attentions, o's norm (read by gate_up) and down's (read by the
    # next qkv); the last piece's one pair is alone (its down feeds the final norm, the output)
    assert code.count("torch.ops.atom.linear_add_weigh.default(") >= 2 * (LLAMA.num_layers - 1)
    assert code.count("torch.ops.atom.norm_scaled_linear.default(") == code.count("linear_add_weigh.default(")
    assert info["replayed"] > 0
    torch.cuda.synchronize()  # every slot the host counts as empty is
    assert all(not rows[i].any() for key, rows in split_norm._slots.items()
               for i in range(split_norm.SITES) if i not in split_norm._dirty[key])


def test_rope_fused_into_qkv_decodes_as_eager(baselines, tmp_path):
    """rope_pass: every layer's query and key RoPE is the epilogue of its qkv projection
    (atom::qkv_rope_linear), under FULL graphs: the logits as the unfused level 3's."""
    expect = baselines[1][3]
    engine, info = _run(CUDAGraphMode.FULL, 3, tmp_path, forced=expect.trace, rope_pass=True)
    for i, ((_, logits), (_, want_logits)) in enumerate(zip(engine.trace, expect.trace)):
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.py") if "def call(" in p.read_text())
    assert code.count("torch.ops.atom.qkv_rope_linear") >= LLAMA.num_layers
    assert info["replayed"] > 0


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID], ids=lambda m: m.name)
def test_rope_moved_into_the_attention_decodes_as_eager(baselines, tmp_path, mode):
    """rope_attention_pass: every layer's query and key RoPE is done by the attention op
    (atom::rope_paged_attention_with_output: in the decode launch, in a FULL graph and as a
    token graph's bound region): the logits as the unfused level 3's."""
    expect = baselines[1][3]
    before = compilation_counter.num_rope_into_attention
    engine, info = _run(mode, 3, tmp_path, forced=expect.trace, rope_attention_pass=True)
    assert compilation_counter.num_rope_into_attention - before == LLAMA.num_layers
    for i, ((_, logits), (_, want_logits)) in enumerate(zip(engine.trace, expect.trace)):
        torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
    assert info["replayed"] > 0
    if mode.uses_tr_hybrid():
        recordings = graphs_module.token_graph_of(engine.runner.model).recordings.values()
        assert all(region.replay is not None for rec in recordings for region in rec.regions)


def test_level3_matches_level0_within_bf16_tolerance(baselines):
    _, base = baselines
    for (_, a), (_, b) in zip(base[0].trace[:1], base[3].trace[:1]):  # same inputs only on the first step
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


# --- eager regions read the live step ------------------------------------------------------


@eager_region
def _scale_by_step(x: torch.Tensor) -> torch.Tensor:
    # host data: the scale is a Python float of the live forward context
    return x * ac.get_forward_context().attn_metadata["scale"]


@token_graph
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_scale_by_step(torch.relu(self.lin(x)))) + 1


@torch.no_grad()
def test_eager_region_reads_live_metadata_on_replay():
    model = Scaled()
    x = torch.randn(4, 8, device="cuda")
    ctx = ac.Context(batch_size=4)
    with compilation_counter.expect(num_cudagraph_captured=2):
        with ac.set_forward_context({"scale": 2.0}, context=ctx, tr_graph="record"):
            model(x)
    graphs = model.__dict__["_token_graph"]
    assert graphs.captured_sizes("decode") == [4] and graphs.captured_sizes("prefill") == []
    assert len(graphs.recordings[(None, 4)].segments) == 2
    for scale in (3.0, -1.5, 0.25):
        x.copy_(torch.randn(4, 8, device="cuda"))
        with ac.set_forward_context({"scale": scale}, context=ctx, tr_graph="replay"):
            got = model(x).clone()
        with ac.set_forward_context({"scale": scale}, context=ctx):
            want = model(x)
        torch.testing.assert_close(got, want)


# --- one pool ------------------------------------------------------------------------------


def _pool_bytes(sizes: list[int], tmp_path) -> int:
    graphs_module.reset_graph_pool()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    llama = preset("tiny", num_layers=2, hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128,
                   intermediate_size=4096)
    cc = CompilationConfig(level=0, cudagraph_mode=CUDAGraphMode.FULL, cudagraph_capture_sizes=sizes)
    cfg = Config(max_num_seqs=max(sizes), max_num_batched_tokens=1024, compilation_config=cc)
    model = build_model(llama, compilation_config=cfg, dtype=torch.bfloat16, device="cuda")
    model.allocate_kv_cache(max(sizes) * 4, BLOCK)
    builder = PagedAttentionMetadataBuilder(max(sizes), 1024, 4, BLOCK, device="cuda")
    runner = ModelRunner(model, cfg, builder)
    runner.capture_cudagraph()
    torch.cuda.synchronize()
    used = runner.pool_memory()
    del runner, model, builder
    graphs_module.reset_graph_pool()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return used


def test_all_recordings_share_one_pool(tmp_path):
    largest = _pool_bytes([256], tmp_path)
    ladder = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 192, 256]
    everything = _pool_bytes(ladder, tmp_path)
    assert largest > 0
    assert everything <= 1.25 * largest, (everything, largest)
