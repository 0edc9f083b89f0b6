"""The built-in RoPE pass: the rotary embedding of the query and key goes into their qkv
projection as atom::qkv_rope_linear (the rotation as the GEMV's epilogue), on the graphs
Inductor hands the pass for RoPEs spelled as the built-in Llama, vLLM and transformers spell
them; what is not neox RoPE of the projection's first pieces is left alone."""

import pytest
import torch

from atom_compile.backends.rope_pass import fuse_rope
from atom_compile.backends.small_m_pass import use_small_m_linear
from atom_compile.ops import rope_linear
from atom_compile.ops.linear import op as small_m_linear_op

BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 64
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def _table(positions=2048, head_dim=HEAD_DIM):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    return freqs.cos(), freqs.sin()


def _builtin(x, cos, sin):  # the built-in Llama: float math on [tokens, heads, head_dim], halves by chunk
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _vllm(x, cos, sin):  # vLLM's native neox rotary: [tokens, heads * head_dim] in, the same out
    shape = x.shape
    x = x.view(x.shape[0], -1, HEAD_DIM)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).reshape(shape)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _transformers(x, cos, sin):  # rotate_half with cos and sin over the whole head_dim
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def _gptj(x, cos, sin):  # interleaved pairs (2j, 2j + 1): not neox, left alone
    x1, x2 = x.float()[..., ::2], x.float()[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)


def _partial(x, cos, sin):  # a rotary dim of half the head: left alone
    rot, rest = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    half = HEAD_DIM // 4
    r1, r2 = rot.float().chunk(2, dim=-1)
    c, s = cos[:, None, :half], sin[:, None, :half]
    return torch.cat([torch.cat([r1 * c - r2 * s, r2 * c + r1 * s], -1).to(x.dtype), rest], -1)


class Attention(torch.nn.Module):
    """qkv, RoPE on q and k (a table gathered at the positions), then what reads them."""

    def __init__(self, rope, bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(HIDDEN, Q + 2 * KV, bias=bias)
        cos, sin = _table()
        self.register_buffer("cos_sin", torch.cat([cos, sin], -1))
        self.rope = rope

    def forward(self, positions, h):
        q, k, v = self.qkv(h).split([Q, KV, KV], dim=-1)
        cos, sin = self.cos_sin.index_select(0, positions).chunk(2, dim=-1)
        if self.rope is _vllm:
            q, k = _vllm(q, cos, sin), _vllm(k, cos, sin)
        else:
            q = self.rope(q.view(-1, HEADS, HEAD_DIM), cos, sin)
            k = self.rope(k.view(-1, KV_HEADS, HEAD_DIM), cos, sin)
        # a scale after the RoPE stays outside it; v's reader sees the projection's columns
        return q * 0.5, k, v.view(-1, KV_HEADS, HEAD_DIM) + 1


class _CpuPasses(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.fused = []

    def __call__(self, graph):
        use_small_m_linear(graph, devices=("cpu",))
        self.fused.append(fuse_rope(graph))
        self.code = [n.target for n in graph.nodes if n.op == "call_function"]

    def uuid(self):
        return None  # never cached: each compile runs the pass


def _compile(module, dynamic=True):
    passes = _CpuPasses()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="inductor", fullgraph=True, dynamic=dynamic,
                             options={"post_grad_custom_post_pass": passes, "fx_graph_cache": False})
    return compiled, passes


# the bias: Qwen2's qkv has one
@pytest.mark.parametrize("rope,bias", [(_builtin, False), (_vllm, True), (_transformers, False)],
                         ids=["builtin", "vllm_with_bias", "transformers"])
def test_neox_ropes_go_into_the_projection_and_match_eager(rope, bias):
    module = Attention(rope, bias).to(BF16).requires_grad_(False)
    compiled, passes = _compile(module)
    for tokens in (1, 3, 5):
        h = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(BF16)
        positions = torch.randint(0, 2048, (tokens,), generator=torch.Generator().manual_seed(9))
        for got, want in zip(compiled(positions, h), module(positions, h)):
            torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert set(passes.fused) == {1}
    assert passes.code.count(rope_linear.op()) == 1 and small_m_linear_op() not in passes.code
    assert torch.ops.aten.cat.default not in passes.code  # the RoPE's nodes are gone
    assert torch.ops.aten.mul.Tensor in passes.code  # the scale after it stays


@pytest.mark.parametrize("rope", [_gptj, _partial], ids=["gptj_interleaved", "partial_rotary"])
def test_other_rotations_are_left_alone(rope):
    module = Attention(rope).to(BF16).requires_grad_(False)
    compiled, passes = _compile(module)
    h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1)).to(BF16)
    positions = torch.tensor([5, 700, 2047])
    for got, want in zip(compiled(positions, h), module(positions, h)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert passes.fused == [0] and rope_linear.op() not in passes.code


class _ReadsTheQueryTwice(Attention):
    def forward(self, positions, h):
        q, k, v = self.qkv(h).split([Q, KV, KV], dim=-1)
        cos, sin = self.cos_sin.index_select(0, positions).chunk(2, dim=-1)
        rq = _builtin(q.view(-1, HEADS, HEAD_DIM), cos, sin)
        rk = _builtin(k.view(-1, KV_HEADS, HEAD_DIM), cos, sin)
        return rq, rk, v, q.float().sum()  # the unrotated query is read too


class _KeyWithItsOwnTable(Attention):
    def forward(self, positions, h):
        q, k, v = self.qkv(h).split([Q, KV, KV], dim=-1)
        cos, sin = self.cos_sin.index_select(0, positions).chunk(2, dim=-1)
        rq = _builtin(q.view(-1, HEADS, HEAD_DIM), cos, sin)
        rk = _builtin(k.view(-1, KV_HEADS, HEAD_DIM), sin, cos)  # another angle
        return rq, rk, v


@pytest.mark.parametrize("cls", [_ReadsTheQueryTwice, _KeyWithItsOwnTable])
def test_left_alone_where_the_query_is_read_elsewhere_or_the_tables_differ(cls):
    module = cls(_builtin).to(BF16).requires_grad_(False)
    compiled, passes = _compile(module, dynamic=False)
    h = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(2)).to(BF16)
    positions = torch.tensor([3, 1000])
    for got, want in zip(compiled(positions, h), module(positions, h)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert passes.fused == [0]


def test_the_ops_cpu_path_checks_its_arguments():
    x, w = torch.randn(2, 8), torch.randn(32, 8)
    cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    torch.testing.assert_close(rope_linear.op()(x, w, None, cos, sin, 16, 8), x @ w.T)  # angle 0: the projection
    with pytest.raises(ValueError, match="whole heads"):
        rope_linear.op()(x, w, None, cos, sin, 12, 8)
    with pytest.raises(ValueError, match="cos is"):
        rope_linear.op()(x, w, None, torch.ones(3, 4), sin, 16, 8)


def test_the_config_puts_the_pass_after_the_glu_one_and_needs_small_m():
    from atom_compile import CompilationConfig
    from atom_compile.backends.custom_passes import POST_PASS_KEY, compiler_config
    from atom_compile.errors import ConfigError

    on = compiler_config(CompilationConfig(level=3, rope_pass=True, prologue_pass=True))[POST_PASS_KEY]
    assert [type(p).__name__ for p in on.passes] == ["ResidualAddPass", "SmallMLinearPass", "GluPass", "RopePass",
                                                     "ProloguePass"]
    off = compiler_config(CompilationConfig(level=3, glu_pass=True, prologue_pass=True))[POST_PASS_KEY]
    assert on.uuid() != off.uuid()
    with pytest.raises(ConfigError, match="CompilationConfig.rope_pass"):
        CompilationConfig(rope_pass=True, small_m_linear_pass=False)


def cpu_small_m_and_rope(graph) -> None:
    """The small-M rewrite allowed on CPU, then the RoPE pass: an `inductor_passes` entry."""
    use_small_m_linear(graph, devices=("cpu",))
    fuse_rope(graph)


def test_the_builtin_llama_at_level_3_saves_the_op_and_a_restart_compiles_nothing(tmp_path):
    """The op in pieces the cache saves: a second start loads them (no compile) and gives the
    first start's logits; both near the eager model's."""
    from support.pass_checks import level3_round_trip

    level3_round_trip(tmp_path, "tests.backends.test_rope_pass:cpu_small_m_and_rope",
                      "torch.ops.atom.qkv_rope_linear.default(", [1, 1, 1])
