"""The built-in GLU pass: a gated MLP's activation-and-mul over its gate and up projections
becomes atom::gate_up_glu (the activation as the gate_up GEMV's epilogue), on graphs spelled as
Inductor's post-grad graphs are and on the graphs Inductor itself hands the pass."""

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from atom_compile.backends.glu_pass import fuse_glu
from atom_compile.backends.prologue_pass import fuse_prologues
from atom_compile.backends.small_m_pass import use_small_m_linear
from atom_compile.ops import glu_linear
from atom_compile.ops.linear import op as small_m_linear_op

aten, prims = torch.ops.aten, torch.ops.prims
BF16 = torch.bfloat16
N, K = 8, 16


def _silu(gate):
    g = prims.convert_element_type.default(gate, torch.float32)
    s = aten.div.Tensor(g, aten.add.Tensor(aten.exp.default(aten.neg.default(g)), 1))
    return prims.convert_element_type.default(s, gate.dtype)


def _merged(spelling):
    linear = small_m_linear_op()

    def f(x, w, wd):
        gu = linear(x, w, None)
        if spelling == "split":
            gate, up = aten.split.Tensor(gu, N, -1)
        elif spelling == "split_with_sizes_up_first":
            up, gate = aten.split_with_sizes.default(gu, [N, N], 1)
        else:  # slices, the gate second
            up, gate = aten.slice.Tensor(gu, 1, 0, N), aten.slice.Tensor(gu, -1, N, 2 * N)
        return linear(aten.mul.Tensor(_silu(gate), up), wd, None)

    return f, (1, K), (2 * N, K)


def _separate(x, wg, wu, wd):  # transformers: [batch, seq, hidden] through Linear's reshapes
    linear = small_m_linear_op()
    rows = [aten.reshape.default(x, [x.shape[0] * x.shape[1], K]) for _ in range(2)]
    gate = aten.reshape.default(linear(rows[0], wg, None), [*x.shape[:2], N])
    up = aten.reshape.default(linear(rows[1], wu, None), [*x.shape[:2], N])
    out = linear(aten.reshape.default(aten.mul.Tensor(up, aten.silu.default(gate)), [-1, N]), wd, None)
    return aten.reshape.default(out, [*x.shape[:2], K])


def _trace(f, *shapes):
    # fake CPU tensors: a view of a fake CUDA tensor needs a CUDA build (the pass slices weights)
    with FakeTensorMode():
        args = tuple(torch.empty(*s, dtype=BF16) for s in shapes)
    return make_fx(f, tracing_mode="fake")(*args)


def _real(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*s, generator=gen) / 2).to(BF16) for s in shapes)


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("spelling", ["split", "split_with_sizes_up_first", "slices_gate_second"])
def test_halves_of_one_projection_are_fused_and_compute_the_same(spelling):
    f, x_shape, w_shape = _merged(spelling)
    shapes = (x_shape, w_shape, (K, N))
    gm = _trace(f, *shapes)
    assert fuse_glu(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert _count(gm, glu_linear.op()) == 1 and _count(gm, small_m_linear_op()) == 1  # down only
    assert _count(gm, aten.exp.default) == 0 and _count(gm, aten.mul.Tensor) == 0  # the activation is gone
    real = _real(*shapes)
    torch.testing.assert_close(gm(*real), f(*real))


@pytest.mark.parametrize("spelling", ["gelu_tanh_op", "decomposed"])
def test_gelu_tanh_gates_are_fused_as_geglu(spelling):
    """GeGLU (Gemma): GELU's tanh form, as one op or as its decomposition spells it."""
    linear = small_m_linear_op()

    def f(x, w, wd):
        gate, up = aten.split.Tensor(linear(x, w, None), N, -1)
        if spelling == "gelu_tanh_op":
            act = aten.gelu.default(gate, approximate="tanh")
        else:
            g = prims.convert_element_type.default(gate, torch.float32)
            inner = aten.mul.Tensor(aten.add.Tensor(g, aten.mul.Tensor(aten.mul.Tensor(aten.mul.Tensor(g, g), g),
                                                                       0.044715)), 0.7978845608028654)
            act = prims.convert_element_type.default(
                aten.mul.Tensor(aten.mul.Tensor(g, 0.5), aten.add.Tensor(aten.tanh.default(inner), 1)), BF16)
        return linear(aten.mul.Tensor(act, up), wd, None)

    shapes = ((1, K), (2 * N, K), (K, N))
    gm = _trace(f, *shapes)
    assert fuse_glu(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    [call] = [n for n in gm.graph.nodes if n.target is glu_linear.op()]
    assert call.args[3] == "gelu_tanh"
    real = _real(*shapes, seed=5)
    torch.testing.assert_close(gm(*real), f(*real))


def test_two_projections_of_the_same_rows_are_fused_through_reshapes():
    shapes = ((2, 3, K), (N, K), (N, K), (K, N))
    gm = _trace(_separate, *shapes)
    assert fuse_glu(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert _count(gm, glu_linear.op()) == 1 and _count(gm, small_m_linear_op()) == 1
    real = _real(*shapes, seed=1)
    torch.testing.assert_close(gm(*real), _separate(*real))


def test_left_alone_where_the_projections_are_read_elsewhere_or_differ():
    linear = small_m_linear_op()

    def read_elsewhere(x, w, wd):
        gu = linear(x, w, None)
        gate, up = aten.split.Tensor(gu, N, -1)
        return linear(aten.mul.Tensor(_silu(gate), up), wd, None), gu  # gate_up is an output too

    def other_rows(x, w, wd):  # gate of x, up of another row
        gate, up = linear(x, w[:N], None), linear(aten.mul.Tensor(x, 2), w[N:], None)
        return linear(aten.mul.Tensor(_silu(gate), up), wd, None)

    def with_bias(x, w, wd):
        gate, up = aten.split.Tensor(linear(x, w, w[:, 0]), N, -1)
        return linear(aten.mul.Tensor(_silu(gate), up), wd, None)

    def gelu_erf(x, w, wd):  # within 2e-4 of GELU's tanh form, and still another function
        gate, up = aten.split.Tensor(linear(x, w, None), N, -1)
        return linear(aten.mul.Tensor(aten.gelu.default(gate), up), wd, None)

    def sigmoid_only(x, w, wd):  # a GLU of sigmoid: not an activation of the op
        gate, up = aten.split.Tensor(linear(x, w, None), N, -1)
        return linear(aten.mul.Tensor(aten.sigmoid.default(gate), up), wd, None)

    def two_gates(x, w, wd):  # silu(gate) * gate: no up projection
        gate, _ = aten.split.Tensor(linear(x, w, None), N, -1)
        return linear(aten.mul.Tensor(aten.silu.default(gate), gate), wd, None)

    for f in (read_elsewhere, other_rows, with_bias, gelu_erf, sigmoid_only, two_gates):
        gm = _trace(f, (1, K), (2 * N, K), (K, N))
        assert fuse_glu(gm.graph) == 0, f.__name__


def test_the_op_merges_adjacent_weights_into_one_projection():
    w = torch.randn(2 * N, K)
    assert glu_linear._merged(w[:N], w[N:]).data_ptr() == w.data_ptr()
    assert glu_linear._merged(w[N:], w[:N]) is None  # not in storage order: the op swaps them
    assert glu_linear._merged(w[:N], w[N:].clone()) is None
    x, w = _real((3, K), (2 * N, K), seed=2)
    for gate, up in ((w[:N], w[N:]), (w[N:], w[:N]), (w[:N].clone(), w[N:].clone())):
        want = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
        torch.testing.assert_close(glu_linear.gate_up_glu(x, gate, up, "silu"), want)


class _Mlp(torch.nn.Module):
    """The built-in Llama's MLP (merged gate_up, chunk), transformers' Llama MLP (gate_proj,
    up_proj) or Gemma 3's (GeGLU: gelu_pytorch_tanh)."""

    def __init__(self, kind: str):
        super().__init__()
        if kind == "atom":
            from atom_compile.models.llama import MLP, preset

            self.mlp = MLP(preset("tiny", hidden_size=64, intermediate_size=96))
        elif kind == "gemma3":
            import transformers
            from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

            self.mlp = Gemma3MLP(transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=96))
        else:
            import transformers
            from transformers.models.llama.modeling_llama import LlamaMLP

            self.mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=96))

    def forward(self, x):
        return self.mlp(x)


class _CpuPasses(CustomGraphPass):
    """The small-M, GLU and prologue passes as a CUDA piece runs them, the small-M rewrite
    allowed on CPU (where the ops take their PyTorch paths): what each fused, counted."""

    def __init__(self):
        self.fused = []

    def __call__(self, graph):
        use_small_m_linear(graph, devices=("cpu",))
        self.fused.append((fuse_glu(graph), fuse_prologues(graph)))

    def uuid(self):
        return None  # never cached: each compile runs the pass


@pytest.mark.parametrize("kind,shape", [("atom", (1, 64)), ("transformers", (2, 3, 64)), ("gemma3", (1, 64))])
def test_inductor_graphs_of_real_mlps_are_fused_and_match_eager(kind, shape):
    """The activation goes into gate_up, so the prologue pass finds none for down."""
    mlp = _Mlp(kind).to(BF16)
    passes = _CpuPasses()
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend="inductor", fullgraph=True, dynamic=True,
                             options={"post_grad_custom_post_pass": passes, "fx_graph_cache": False})
    x = _real(shape, seed=3)[0]
    with torch.no_grad():
        got, want = compiled(x), mlp(x)
    assert passes.fused == [(1, 0)]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_the_config_puts_the_pass_before_the_prologues_and_needs_small_m():
    from atom_compile import CompilationConfig
    from atom_compile.backends.custom_passes import POST_PASS_KEY, compiler_config
    from atom_compile.errors import ConfigError

    on = compiler_config(CompilationConfig(level=3, glu_pass=True, prologue_pass=True))[POST_PASS_KEY]
    assert [type(p).__name__ for p in on.passes] == ["ResidualAddPass", "SmallMLinearPass", "GluPass", "ProloguePass"]
    off = compiler_config(CompilationConfig(level=3, glu_pass=False, prologue_pass=True))[POST_PASS_KEY]
    assert on.uuid() != off.uuid()
    # on by default wherever the small-M pass is, and off with it
    assert CompilationConfig().glu_fused() and not CompilationConfig(small_m_linear_pass=False).glu_fused()
    with pytest.raises(ConfigError, match="CompilationConfig.glu_pass"):
        CompilationConfig(glu_pass=True, small_m_linear_pass=False)
    with pytest.raises(ConfigError, match="CompilationConfig.glu_pass"):
        CompilationConfig(glu_pass="yes")


def test_a_whole_transformers_decoder_is_fused_and_matches_eager():
    """A model nobody here wrote: Phi-3's merged gate_up_proj (chunk, the gate first; the
    separate gate_proj and up_proj are transformers' Llama MLP above), two layers, in bf16: one
    fusion a layer (the prologue pass then fuses the norms only), logits as eager's."""
    import transformers

    from support.pass_checks import transformers_logits
    from tests.models.families import _COMMON

    cfg = transformers.Phi3Config(**{**_COMMON, "num_hidden_layers": 2})
    passes = _CpuPasses()
    got, want = transformers_logits(cfg, passes)
    assert [glu for glu, _ in passes.fused] == [2]
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def cpu_small_m_and_glu(graph) -> None:
    """The small-M rewrite allowed on CPU, then the GLU pass: an `inductor_passes` entry."""
    use_small_m_linear(graph, devices=("cpu",))
    fuse_glu(graph)


def test_the_builtin_llama_at_level_3_saves_the_op_and_a_restart_compiles_nothing(tmp_path):
    """The op with its activation argument in pieces the cache saves: a second start loads them
    (no compile) and gives the first start's logits; both near the eager model's."""
    from support.pass_checks import level3_round_trip

    # one token a sequence: decode's rows
    level3_round_trip(tmp_path, "tests.backends.test_glu_pass:cpu_small_m_and_glu", "torch.ops.atom.gate_up_glu",
                      [1, 1])
