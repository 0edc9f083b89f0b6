"""The RoPE-attention pass: an attention op's query and key RoPE goes into the op
(atom::rope_paged_attention_with_output), on the graphs Dynamo traces, for RoPEs spelled as the
built-in Llama, vLLM and transformers spell them; the op then attends as the model did (here its
PyTorch path: the rotation, then the reference attention). What is not neox RoPE of q and k
with one set of angles, or is read elsewhere rotated, is left alone."""

import pytest
import torch

import atom_compile as ac
from atom_compile.backends.rope_attention_pass import fuse_rope_into_attention
from atom_compile.ops import rope_attention
from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep
from test_rope_pass import HEAD_DIM, HEADS, HIDDEN, KV, KV_HEADS, Q, _builtin, _gptj, _partial, _table, \
    _transformers, _vllm

BF16 = torch.bfloat16
BLOCK, SEQS, BLOCKS_PER_SEQ = 4, 2, 4


class PagedAttention(torch.nn.Module):
    """qkv, RoPE on q and k (a table gathered at the positions, or angles computed from them),
    then our paged attention op and a projection of its output."""

    def __init__(self, rope, angles="table", reads_rotated_q=False, k_shift=0, by_name=False):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(HIDDEN, Q + 2 * KV, bias=False)
        self.o = torch.nn.Linear(Q, HIDDEN, bias=False)
        cos, sin = _table()
        self.register_buffer("cos_sin", torch.cat([cos, sin], -1))
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)))
        self.register_buffer("kv_cache", torch.zeros(2, SEQS * BLOCKS_PER_SEQ + 1, BLOCK, KV_HEADS, HEAD_DIM))
        self.rope, self.angles, self.reads_rotated_q, self.k_shift = rope, angles, reads_rotated_q, k_shift
        self.by_name, self.scale = by_name, 0.25

    def _angles(self, positions):
        if self.angles == "computed":  # a row per token, computed in the graph
            freqs = positions[:, None].float() * self.inv_freq[None, :]
            return freqs.cos(), freqs.sin()
        return self.cos_sin.index_select(0, positions).chunk(2, dim=-1)

    def forward(self, positions, h):
        q, k, v = self.qkv(h).split([Q, KV, KV], dim=-1)
        cos, sin = self._angles(positions)
        k_cos, k_sin = self._angles(positions + self.k_shift) if self.k_shift else (cos, sin)
        if self.rope is _vllm:
            q, k = _vllm(q, cos, sin), _vllm(k, k_cos, k_sin)
        else:
            q = self.rope(q.view(-1, HEADS, HEAD_DIM), cos, sin)
            k = self.rope(k.view(-1, KV_HEADS, HEAD_DIM), k_cos, k_sin)
        q, k = q.reshape(-1, HEADS, HEAD_DIM), k.reshape(-1, KV_HEADS, HEAD_DIM)
        out = torch.empty_like(q)
        if self.by_name:  # the layer found by name in the forward context, as a vLLM-style model calls it
            torch.ops.aiter.unified_attention_with_output(q, k, v.view(-1, KV_HEADS, HEAD_DIM), out, "layer")
        else:
            torch.ops.atom.paged_attention_with_output(q, k, v.view(-1, KV_HEADS, HEAD_DIM), out, self.kv_cache, 0.25)
        y = self.o(out.view(-1, Q))
        return y + q.float().mean() if self.reads_rotated_q else y


def _steps():
    """A prefill of 5 and 3 tokens, then two decode steps, as (positions, metadata) steps."""
    builder = PagedAttentionMetadataBuilder(SEQS, 16, BLOCKS_PER_SEQ, BLOCK)
    tables = [list(range(s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ)) for s in range(SEQS)]
    plans = [[(5, 0), (3, 0)], [(1, 5), (1, 3)], [(1, 6), (1, 4)]]
    for plan in plans:
        steps = [SequenceStep([1] * n, start, tables[s]) for s, (n, start) in enumerate(plan)]
        _, positions, meta, ctx = builder.build(steps)
        yield positions, meta, ctx


def _run(rope, **kwargs):
    """(rewrites, the rewritten graph's call targets, max |compiled - eager| over the steps' outputs
    and the final KV caches)."""
    eager = PagedAttention(rope, **kwargs).to(BF16).requires_grad_(False)
    compiled_module = PagedAttention(rope, **kwargs).to(BF16).requires_grad_(False)
    seen = {}

    def backend(gm, example_inputs):
        seen["moved"] = fuse_rope_into_attention(gm)
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(compiled_module, backend=backend, fullgraph=True, dynamic=True)
    worst = 0.0
    gen = torch.Generator().manual_seed(3)
    for positions, meta, ctx in _steps():
        h = torch.randn(positions.shape[0], HIDDEN, generator=gen).to(BF16)
        with torch.no_grad(), ac.set_forward_context(meta, None, ctx, no_compile_layers={"layer": compiled_module}):
            got = compiled(positions, h)
        with torch.no_grad(), ac.set_forward_context(meta, None, ctx, no_compile_layers={"layer": eager}):
            want = eager(positions, h)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    worst = max(worst, (compiled_module.kv_cache.float() - eager.kv_cache.float()).abs().max().item())
    return seen["moved"], seen["targets"], worst


@pytest.mark.parametrize("rope", [_builtin, _vllm, _transformers], ids=["builtin", "vllm", "transformers"])
def test_neox_ropes_go_into_the_attention_and_attend_as_eager(rope):
    moved, targets, worst = _run(rope)
    assert moved == 1
    assert rope_attention.paged_op() in targets and torch.ops.atom.paged_attention_with_output not in targets
    assert torch.cat not in targets and torch.index_select not in targets  # the rotation and gather are gone
    assert worst < 0.05  # bf16: the models round their math differently (the built-in: not at all)


def test_the_by_name_op_becomes_its_rotating_twin():
    moved, targets, worst = _run(_builtin, by_name=True)
    assert moved == 1 and rope_attention.by_name_op() in targets and worst < 0.05


def test_angles_computed_in_the_graph_are_read_a_row_per_token():
    moved, targets, worst = _run(_builtin, angles="computed")
    assert moved == 1 and rope_attention.paged_op() in targets and worst < 0.05


@pytest.mark.parametrize("variant", ["gptj", "partial", "reads_rotated_q", "k_other_angles"])
def test_what_is_not_one_neox_rope_of_q_and_k_is_left_alone(variant):
    kwargs = {"reads_rotated_q": {"reads_rotated_q": True}, "k_other_angles": {"k_shift": 1}}.get(variant, {})
    rope = {"gptj": _gptj, "partial": _partial}.get(variant, _builtin)
    moved, targets, worst = _run(rope, **kwargs)
    assert moved == 0 and rope_attention.paged_op() not in targets
    assert worst == 0.0


def test_the_pass_runs_on_cuda_graphs_only_and_is_keyed_when_on():
    on = ac.CompilationConfig(level=3, rope_attention_pass=True)
    assert on.hash_factors()["rope_attention_pass"] is True
    assert "rope_attention_pass" not in ac.CompilationConfig(level=3).hash_factors()
    before = ac.compilation_counter.num_rope_into_attention
    module = PagedAttention(_builtin).to(BF16).requires_grad_(False)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=ac.backend(ac.Config(compilation_config=on)), fullgraph=True)
    positions, meta, ctx = next(_steps())
    with torch.no_grad(), ac.set_forward_context(meta, None, ctx):
        compiled(positions, torch.randn(positions.shape[0], HIDDEN).to(BF16))
    assert ac.compilation_counter.num_rope_into_attention == before  # a CPU graph keeps its RoPE
