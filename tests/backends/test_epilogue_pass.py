"""The built-in split-norm pass: a CUDA piece's residual add and RMSNorm between an o or down
projection and the one projection that reads the norm are split between the two
(atom::linear_add_weigh, atom::norm_scaled_linear), on graphs spelled as Inductor's post-grad
graphs are; what the pass cannot take is left as it is."""

import operator

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from atom_compile.backends.custom_passes import POST_PASS_KEY, compiler_config
from atom_compile.backends.epilogue_pass import fuse_epilogues
from atom_compile.backends.glu_pass import fuse_glu
from atom_compile.backends.small_m_pass import use_small_m_linear
from atom_compile.config import CompilationConfig
from atom_compile.errors import ConfigError
from atom_compile.ops.glu_linear import op as glu_op
from atom_compile.ops.linear import op as small_m_linear_op
from atom_compile.ops.split_norm import ops as split_ops

from tests.backends.test_prologue_pass import _norm

aten = torch.ops.aten
BF16 = torch.bfloat16
WEIGH, SCALED = split_ops()


def _layer(attn, r, wo, nw1, wgu, wdown, nw2, wq):
    """A decode layer from the attention's output as the post-grad graph has it: o projection,
    residual add, norm, an MLP, down projection, residual add (the sum first), the next norm of
    the x * x spelling with the weight second, the next layer's projection."""
    linear = small_m_linear_op()
    h1 = aten.add.Tensor(linear(attn, wo, None), r)
    mlp = aten.relu.default(linear(_norm(h1, nw1), wgu, None))
    h2 = aten.add.Tensor(h1, linear(mlp, wdown, None))
    q = linear(_norm(h2, nw2, eps=1e-6, square="mul", weight_first=False), wq, None)
    return q, h2


def _args(device, gen=None, rows=1):
    def t(*shape):
        return torch.randn(*shape, generator=gen).to(BF16) if gen is not None \
            else torch.empty(*shape, dtype=BF16, device=device)

    return (t(rows, 32), t(rows, 16), t(16, 32), t(16), t(24, 16), t(16, 24), t(16), t(8, 16))


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _fake_args(**kw):
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        return _args("cuda", **kw)


def test_both_norms_of_a_layer_are_split_and_compute_the_same():
    gm = _trace(_layer, *_fake_args())
    assert _count(gm, small_m_linear_op()) == 4
    assert fuse_epilogues(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    # o and down are in the producers, gate_up and the next layer's projection in the consumers
    assert _count(gm, small_m_linear_op()) == 0 and _count(gm, WEIGH) == 2 and _count(gm, SCALED) == 2
    assert _count(gm, aten.rsqrt.default) == 0 and _count(gm, aten.mean.dim) == 0
    assert _count(gm, aten.add.Tensor) == 0  # both residual adds are the producers' own
    first, second = [n for n in gm.graph.nodes if n.target is WEIGH]
    # the down projection's residual is the sum the o projection's producer made; eps as the
    # model's; each pair its own site, the consumer the same as its producer
    assert second.args[2].target is operator.getitem and second.args[2].args[0] is first
    assert (first.args[4:], second.args[4:]) == ((1e-5, 0, 1), (1e-6, 1, 0))  # eps, site, clear: round the two
    for scaled in [n for n in gm.graph.nodes if n.target is SCALED]:
        producer = scaled.args[0].args[0]
        assert scaled.args[1].args[0] is producer and scaled.args[7] == producer.args[5]
        assert scaled.args[3] == producer.args[4] and scaled.args[5:7] == (None, "")
    for rows in (1, 3):  # the ops' own path off CUDA, at one token and more
        args = _args("cpu", torch.Generator().manual_seed(rows), rows=rows)
        for got, want in zip(gm(*args), _layer(*args)):
            torch.testing.assert_close(got, want)


def _glu_layer(attn, r, wo, nw, wg, wu, wdown, wq):
    """The o projection, its add and norm read by a gated MLP's atom::gate_up_glu (transformers'
    two weights), the down projection, its add and the next norm, read by the next q."""
    linear = small_m_linear_op()
    h = aten.add.Tensor(linear(attn, wo, None), r)
    h2 = aten.add.Tensor(h, linear(glu_op()(_norm(h, nw), wg, wu, "silu"), wdown, None))
    return linear(_norm(h2, nw), wq, None), h2


def test_a_gated_mlp_reads_the_split_norm():
    with FakeTensorMode():
        fake = [torch.empty(*s, dtype=BF16, device="cuda") for s in ((1, 32), (1, 16), (16, 32), (16,), (24, 16),
                                                                      (24, 16), (16, 24), (8, 16))]
    gm = _trace(_glu_layer, *fake)
    assert fuse_epilogues(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    glu, q = [n for n in gm.graph.nodes if n.target is SCALED]
    assert glu.args[6] == "silu" and glu.args[5] is not None and _count(gm, glu_op()) == 0
    assert q.args[5:] == (None, "", 1)
    for rows in (1, 2):
        gen = torch.Generator().manual_seed(rows)
        real = [torch.randn(rows if i < 2 else t.shape[0], *t.shape[1:], generator=gen).to(BF16)
                for i, t in enumerate(fake)]
        for got, want in zip(gm(*real), _glu_layer(*real)):
            torch.testing.assert_close(got, want)


def test_a_norm_weight_computed_after_the_add_and_an_early_reader_of_the_sum():
    """Gemma-style (1 + w) made after the add in the graph's order, a reader of the sum before
    the norm and one after it: the producer goes where all its operands are, the early reader
    keeps the add, the late one reads the producer's sum."""
    linear = small_m_linear_op()

    def f(x, r, w, nw, wq, w2):
        h = aten.add.Tensor(linear(x, w, None), r)
        early = aten.mul.Tensor(h, 2)
        normed = _norm(h, aten.add.Tensor(nw, 1))
        late = aten.mul.Tensor(h, 3)
        h2 = aten.add.Tensor(linear(linear(normed, wq, None), w2, None), late)  # the second pair
        return linear(_norm(h2, nw), wq, None), early, late

    with FakeTensorMode():
        fake = [torch.empty(*s, dtype=BF16, device="cuda") for s in ((1, 32), (1, 16), (16, 32), (16,), (8, 16), (16, 8))]
    gm = _trace(f, *fake)
    assert fuse_epilogues(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    [add] = [n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.args[1] not in (1, 1e-5)]
    assert [u.target for u in add.users] == [aten.mul.Tensor]  # the early reader only
    [late] = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor and n.args[1] == 3]
    assert late.args[0].target is operator.getitem and late.args[0].args[0].target is WEIGH
    gen = torch.Generator().manual_seed(5)
    real = tuple(torch.randn(*t.shape, generator=gen).to(BF16) for t in fake)
    for got, want in zip(gm(*real), f(*real)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", ["none", "two_readers", "bias", "no_projection", "wide_view", "norm_read_twice",
                                  "norm_not_projected"])
def test_what_it_cannot_take_is_left_alone(case):
    """A norm with one defect, read by a projection whose output feeds a layer of two pairs it
    can take: those two are split, the defective one is left as it was ("none": no defect, all
    three split)."""
    linear = small_m_linear_op()

    def f(x, r, w, nw, b, wc, *layer):
        wide = case == "wide_view"
        if wide:  # a view that is not [batch, seq, N] rows of the projection
            y = aten.view.default(linear(aten.view.default(x, [2, 32]), w, None), [1, 2, 16])
            h = aten.view.default(aten.add.Tensor(y, r), [1, 32])
        elif case == "no_projection":
            h = aten.add.Tensor(aten.relu.default(r), r)
        else:
            y = linear(x, w, b if case == "bias" else None)
            h = aten.add.Tensor(y, r)
        normed = _norm(h, nw)
        if case == "norm_read_twice":
            attn = aten.add.Tensor(linear(normed, wc, None), linear(normed, wc, None))
        else:
            attn = linear(aten.relu.default(normed) if case == "norm_not_projected" else normed,
                          aten.view.default(wc, [32, 32]) if wide else wc, None)
        out = _layer(attn, *layer)
        return (*out, aten.mul.Tensor(y, 2)) if case == "two_readers" else out

    wide = case == "wide_view"
    with FakeTensorMode():
        def t(*shape):
            return torch.empty(*shape, dtype=BF16, device="cuda")

        args = (t(1, 64 if wide else 32), t(*((1, 2, 16) if wide else (1, 16))), t(16, 32), t(32 if wide else 16),
                t(16), t(32, 32) if wide else t(32, 16), *_args("cuda"))
    gm = _trace(f, *args[:6], *args[7:])
    rsqrts = _count(gm, aten.rsqrt.default)
    assert fuse_epilogues(gm.graph) == (3 if case == "none" else 2)
    gm.graph.lint()
    assert _count(gm, WEIGH) == _count(gm, SCALED) == (3 if case == "none" else 2)
    assert _count(gm, aten.rsqrt.default) == rsqrts - _count(gm, WEIGH)


def test_a_lone_pair_and_pairs_not_in_a_chain():
    """One pair alone has no next producer to empty its slot: left alone. Two pairs side by side
    (neither reads the other's consumer): only the first is a chain's, so neither is split."""
    linear = small_m_linear_op()

    def lone(x, r, w, nw, wq):
        return linear(_norm(aten.add.Tensor(linear(x, w, None), r), nw), wq, None)

    def side_by_side(x, r, w, nw, wq):
        return lone(x, r, w, nw, wq), lone(aten.mul.Tensor(x, 2), r, w, nw, wq)

    with FakeTensorMode():
        args = [torch.empty(*s, dtype=BF16, device="cuda") for s in ((1, 32), (1, 16), (16, 32), (16,), (8, 16))]
    for fn in (lone, side_by_side):
        gm = _trace(fn, *args)
        assert fuse_epilogues(gm.graph) == 0 and _count(gm, WEIGH) == 0


def test_the_pass_runs_where_it_is_asked_for_and_needs_the_small_m_pass():
    on = compiler_config(CompilationConfig(level=3, epilogue_pass=True, prologue_pass=True))[POST_PASS_KEY]
    names = [type(p).__name__ for p in on.passes]
    assert names.index("EpiloguePass") == names.index("ProloguePass") - 1  # it takes its norms first
    off = compiler_config(CompilationConfig(level=3))[POST_PASS_KEY]
    assert "EpiloguePass" not in [type(p).__name__ for p in off.passes]
    assert CompilationConfig(level=3, epilogue_pass=True).compute_hash() != CompilationConfig(level=3).compute_hash()
    with pytest.raises(ConfigError, match="small_m_linear_pass"):
        CompilationConfig(level=3, epilogue_pass=True, small_m_linear_pass=False)
    with pytest.raises(ConfigError, match="epilogue_pass"):
        CompilationConfig(level=3, epilogue_pass="yes")


def cpu_small_m_glu_and_epilogue(graph) -> None:
    """The small-M rewrite allowed on CPU, the GLU pass, then this one: an `inductor_passes`
    entry, so the built-in Llama's own post-grad spelling is what the pass sees."""
    use_small_m_linear(graph, devices=("cpu",))
    fuse_glu(graph)
    fuse_epilogues(graph)


def test_the_builtin_llama_at_level_3_saves_the_op_and_a_restart_compiles_nothing(tmp_path):
    """Its o projection's and down projection's norms in pieces the cache saves: a second start
    loads them (no compile) and gives the first start's logits; both near the eager model's."""
    from support.pass_checks import level3_round_trip

    level3_round_trip(tmp_path, "tests.backends.test_epilogue_pass:cpu_small_m_glu_and_epilogue",
                      "torch.ops.atom.linear_add_weigh", [1, 1], layers=2)
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.py") if "def call(" in p.read_text())
    # the piece between the attentions: o's norm read by gate_up, down's by the next qkv (the
    # last piece's one pair is alone: its down feeds the final norm, the graph's output)
    assert code.count("torch.ops.atom.linear_add_weigh.default(") >= 2
    assert code.count("torch.ops.atom.norm_scaled_linear.default(") == code.count("linear_add_weigh.default(")


class _CpuPasses(CustomGraphPass):
    """The small-M, GLU and epilogue passes as a CUDA piece runs them, the small-M rewrite allowed
    on CPU (where the ops take their PyTorch paths): what the epilogue pass fused, counted."""

    def __init__(self):
        self.fused = []

    def __call__(self, graph):
        use_small_m_linear(graph, devices=("cpu",))
        fuse_glu(graph)
        self.fused.append(fuse_epilogues(graph))

    def uuid(self):
        return None  # never cached: each compile runs the pass


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_whole_transformers_decoder_is_fused_and_matches_eager(family):
    """Models nobody here wrote, [batch, seq, hidden] activations, two layers in bf16: each
    layer's o projection and gate_up (the GLU op on two weights), and the last down projection
    and the LM head (the final norm) split their norms; the first down's norm is read by q, k and
    v (three readers) and stays. Logits as eager's."""
    import transformers

    from support.pass_checks import transformers_logits
    from tests.models.families import _COMMON

    config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    cfg = config(**{**_COMMON, "num_hidden_layers": 2}, **({"head_dim": 8} if family == "qwen3" else {}))
    passes = _CpuPasses()
    got, want = transformers_logits(cfg, passes)
    assert passes.fused == [3]
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
