"""The built-in norm-into-projection pass: a CUDA piece's RMSNorm (and the residual add before
it) becomes the prologue of the projection that reads it (atom::rms_norm_linear,
atom::add_rms_norm_linear), on graphs spelled as Inductor's post-grad graphs are."""

import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from torch._inductor.custom_graph_pass import CustomGraphPass

from atom_compile.backends.prologue_pass import fuse_prologues, match_rms_norm
from atom_compile.backends.residual_add import split_residual_addmm
from atom_compile.backends.small_m_pass import use_small_m_linear
from atom_compile.ops.linear import op as small_m_linear_op
from atom_compile.ops.prologue_linear import ops as prologue_ops

aten, prims = torch.ops.aten, torch.ops.prims
BF16 = torch.bfloat16


def _norm(h, w, eps=1e-5, square="pow", weight_first=True):
    x32 = prims.convert_element_type.default(h, torch.float32)
    sq = aten.pow.Tensor_Scalar(x32, 2) if square == "pow" else aten.mul.Tensor(x32, x32)
    rstd = aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(sq, [-1], True), eps))
    rounded = prims.convert_element_type.default(aten.mul.Tensor(x32, rstd), h.dtype)
    return aten.mul.Tensor(w, rounded) if weight_first else aten.mul.Tensor(rounded, w)


def _layer(o, r, nw1, wq, wk, down, nw2, wgu):
    """A decode layer's tail as the post-grad graph has it: residual add, norm, two projections
    of the normed row, an early reader of the sum, a later residual add; a second norm of the
    x * x spelling, weight second, with no add before it."""
    linear = small_m_linear_op()
    h = aten.add.Tensor(o, r)
    early = aten.mul.Tensor(h, 2)  # before the projections: keeps the add's own output
    normed = _norm(h, nw1)
    q = linear(normed, wq, None)
    k = linear(normed, wk, None)
    later = aten.add.Tensor(down, h)
    gu = linear(_norm(later, nw2, eps=1e-6, square="mul", weight_first=False), wgu, None)
    return q, k, early, later, gu


def _inputs(device, gen=None):
    def t(*shape):
        return torch.randn(*shape, generator=gen).to(BF16) if gen is not None \
            else torch.empty(*shape, dtype=BF16, device=device)

    return (t(1, 16), t(1, 16), t(16), t(8, 16), t(4, 16), t(1, 16), t(16), t(12, 16))


def _trace(fn, device="cuda"):
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        args = _inputs(device)
    return make_fx(fn, tracing_mode="fake")(*args)


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_norms_before_projections_are_fused_and_compute_the_same():
    gm = _trace(_layer)
    plain, with_add, _ = prologue_ops()
    assert _count(gm, small_m_linear_op()) == 3
    assert fuse_prologues(gm.graph) == 3
    gm.graph.lint()
    gm.recompile()
    assert _count(gm, small_m_linear_op()) == 0
    # q and gu take their residual adds; k reads the sum q's op made
    assert _count(gm, with_add) == 2 and _count(gm, plain) == 1
    k_call = next(n for n in gm.graph.nodes if n.target is plain)
    assert k_call.args[0].target is operator.getitem and k_call.args[0].args[0].target is with_add
    assert _count(gm, aten.rsqrt.default) == 0 and _count(gm, aten.mean.dim) == 0  # the norms are gone
    # the early reader keeps the first add (the only add left); the later add is gu's op's, and
    # it reads the sum of q's op
    [add] = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert [u.target for u in add.users] == [aten.mul.Tensor]
    gu_call = [n for n in gm.graph.nodes if n.target is with_add][1]
    assert gu_call.args[1].target is operator.getitem
    args = _inputs("cpu", torch.Generator().manual_seed(0))
    for got, want in zip(gm(*args), _layer(*args)):
        torch.testing.assert_close(got, want)


def test_a_computed_norm_weight_is_an_input_of_the_op():
    """Gemma's norm multiplies by (1 + w): the sum is a node the fused op reads."""
    def f(h, w, wq):
        return small_m_linear_op()(_norm(h, aten.add.Tensor(w, 1)), wq, None)

    with FakeTensorMode():
        args = (torch.empty(1, 16, dtype=BF16, device="cuda"), torch.empty(16, dtype=BF16, device="cuda"),
                torch.empty(8, 16, dtype=BF16, device="cuda"))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert fuse_prologues(gm.graph) == 1
    gm.recompile()
    gen = torch.Generator().manual_seed(1)
    real = (torch.randn(1, 16, generator=gen).to(BF16), torch.randn(16, generator=gen).to(BF16),
            torch.randn(8, 16, generator=gen).to(BF16))
    torch.testing.assert_close(gm(*real), f(*real))


@pytest.mark.parametrize("variant", ["fp32", "no_keepdim"])
def test_other_norms_are_left_alone(variant):
    linear = small_m_linear_op()

    def f(h, w, wq):
        if variant == "fp32":
            return linear(_norm(h.float(), w.float()).to(BF16), wq, None)
        x32 = prims.convert_element_type.default(h, torch.float32)
        rstd = aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(aten.pow.Tensor_Scalar(x32, 2), [-1]), 1e-5))
        return linear(aten.mul.Tensor(w, prims.convert_element_type.default(aten.mul.Tensor(x32, rstd), BF16)),
                      wq, None)

    with FakeTensorMode():
        args = (torch.empty(1, 16, dtype=BF16, device="cuda"), torch.empty(16, dtype=BF16, device="cuda"),
                torch.empty(8, 16, dtype=BF16, device="cuda"))
    try:
        gm = make_fx(f, tracing_mode="fake")(*args)
    except RuntimeError:  # a spelling that does not even trace: nothing to match
        pytest.skip("does not trace")
    assert fuse_prologues(gm.graph) == 0
    assert _count(gm, small_m_linear_op()) == 1


def test_match_names_the_parts():
    gm = _trace(_layer)
    normed = next(n for n in gm.graph.nodes if n.target is small_m_linear_op()).args[0]
    h, weight, eps = match_rms_norm(normed)
    assert h.target is aten.add.Tensor and weight.op == "placeholder" and eps == 1e-5


@pytest.mark.parametrize("spelling", ["div_exp", "sigmoid", "silu_f32", "silu_half"])
def test_silu_and_mul_before_a_projection_is_fused(spelling):
    linear = small_m_linear_op()

    def f(gu, wd):
        gate, up = aten.split.Tensor(gu, 8, -1)
        if spelling == "silu_half":
            act = aten.silu.default(gate)
        else:
            g = prims.convert_element_type.default(gate, torch.float32)
            if spelling == "div_exp":
                s = aten.div.Tensor(g, aten.add.Tensor(aten.exp.default(aten.neg.default(g)), 1))
            elif spelling == "sigmoid":
                s = aten.mul.Tensor(aten.sigmoid.default(g), g)
            else:
                s = aten.silu.default(g)
            act = prims.convert_element_type.default(s, BF16)
        return linear(aten.mul.Tensor(up, act), wd, None)

    with FakeTensorMode():
        args = (torch.empty(1, 16, dtype=BF16, device="cuda"), torch.empty(4, 8, dtype=BF16, device="cuda"))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert fuse_prologues(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    *_, silu_mul = prologue_ops()
    assert _count(gm, silu_mul) == 1 and _count(gm, small_m_linear_op()) == 0
    assert _count(gm, aten.mul.Tensor) == 0  # the product and (sigmoid's) factor are gone
    gen = torch.Generator().manual_seed(2)
    real = (torch.randn(1, 16, generator=gen).to(BF16), torch.randn(4, 8, generator=gen).to(BF16))
    torch.testing.assert_close(gm(*real), f(*real))


def test_another_activation_is_left_alone():
    def f(gu, wd):
        gate, up = aten.split.Tensor(gu, 8, -1)
        return small_m_linear_op()(aten.mul.Tensor(aten.gelu.default(gate), up), wd, None)

    with FakeTensorMode():
        args = (torch.empty(1, 16, dtype=BF16, device="cuda"), torch.empty(4, 8, dtype=BF16, device="cuda"))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert fuse_prologues(gm.graph) == 0


# --- the graphs Inductor itself hands the pass (this torch's decompositions) ------------------

class _Layer(torch.nn.Module):
    """The tail of a decoder layer: o projection, residual add, norm, MLP; the built-in Llama's
    RMSNorm and MLP, or transformers' (2-D rows, as an engine's flattened tokens are)."""

    def __init__(self, kind: str):
        super().__init__()
        self.o = torch.nn.Linear(64, 64, bias=False)
        if kind == "atom":
            from atom_compile.models.llama import MLP, RMSNorm, preset

            self.norm, self.mlp = RMSNorm(64, 1e-5), MLP(preset("tiny", hidden_size=64, intermediate_size=96))
        else:
            import transformers
            from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

            self.norm = LlamaRMSNorm(64, 1e-5)
            self.mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=96))
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x, residual):
        h = self.o(x) + residual
        return self.mlp(self.norm(h)), h


class _CpuPasses(CustomGraphPass):
    """The built-in passes as a CUDA piece runs them, with the small-M rewrite allowed on CPU
    (where the ops take their PyTorch paths): what the prologue pass fused, counted."""

    def __init__(self):
        self.fused = []

    def __call__(self, graph):
        split_residual_addmm(graph)
        use_small_m_linear(graph, devices=("cpu",))
        self.fused.append(fuse_prologues(graph))

    def uuid(self):
        return None  # never cached: each compile runs the pass


@pytest.mark.parametrize("kind,shape", [("atom", (1, 64)), ("transformers", (1, 64)), ("transformers", (1, 1, 64)),
                                        ("transformers", (2, 3, 64))])
def test_inductor_graphs_of_real_layers_are_fused_and_match_eager(kind, shape):
    """2-D rows (an engine's flattened tokens) and transformers' [batch, seq, hidden], which its
    Linear flattens: the norm's operands are reshaped to the op's rows and the sum back."""
    layer = _Layer(kind).to(BF16)
    passes = _CpuPasses()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": passes, "fx_graph_cache": False})
    gen = torch.Generator().manual_seed(3)
    x, r = torch.randn(*shape, generator=gen).to(BF16), torch.randn(*shape, generator=gen).to(BF16)
    with torch.no_grad():
        got, want = compiled(x, r), layer(x, r)
    # the norm (with the add before it) into gate_up, or into gate and up (transformers' MLP:
    # the second reads the first's sum); the SiLU-and-mul into down
    assert passes.fused == [{"atom": 2, "transformers": 3}[kind]]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
