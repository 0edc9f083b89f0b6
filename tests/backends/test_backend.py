"""The compiler core through torch.compile(model, backend=atom_compile.backend(cfg))."""

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from support.llama_helpers import Stepper, tiny


class SillyTwoLayers(nn.Module):
    def forward(self, x):
        x = x + 1
        x = x + 2
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        x = out
        x = x - 2
        x = x - 1
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        return out + 1


class ToyLlama(nn.Module):
    """Embedding-free decoder of `n` layers split at silly::attention (the shape of vLLM's toy)."""

    def __init__(self, n: int, hidden: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"qkv": nn.Linear(hidden, 3 * hidden), "o": nn.Linear(hidden, hidden),
                                                   "mlp": nn.Linear(hidden, hidden)}) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            q, k, v = layer["qkv"](x).chunk(3, dim=-1)
            out = torch.empty_like(q)
            torch.ops.silly.attention(q, k, v, out)
            x = x + layer["o"](out)
            x = x + torch.relu(layer["mlp"](x))
        return x


def _compile(model, **cc):
    cfg = Config(compilation_config=CompilationConfig(**cc))
    return torch.compile(model, backend=ac.backend(cfg), fullgraph=True, dynamic=True)


def test_silly_two_layers_inductor_counters_and_output():
    model = SillyTwoLayers()
    x = torch.randn(8, 4)
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=5,
                                    num_piecewise_capturable_graphs_seen=3, num_backend_compilations=3,
                                    num_inductor_compiles=3, num_compiled_artifacts_saved=3):
        compiled = _compile(model, level=3, splitting_ops=["silly.attention"])
        assert torch.allclose(compiled(x), model(x))
    y = torch.randn(5, 4)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        assert torch.allclose(compiled(y), model(y))


def test_toy_llama_12_layers_split_counts_and_dedup():
    torch.manual_seed(0)
    model = ToyLlama(12).eval().requires_grad_(False)
    x = torch.randn(6, 16)
    # 12 attentions: 13 compiled pieces; the 11 between attentions are one computation
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=25,
                                    num_piecewise_capturable_graphs_seen=13, num_backend_compilations=13,
                                    num_eager_compiles=3, num_deduplicated_pieces=10):
        compiled = _compile(model, level=3, splitting_ops=["silly.attention"], compiler="eager")
        assert torch.allclose(compiled(x), model(x))


def test_no_split_is_one_piece():
    model = SillyTwoLayers()
    x = torch.randn(8, 4)
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=1,
                                    num_piecewise_capturable_graphs_seen=1, num_backend_compilations=1):
        compiled = _compile(model, level=3, splitting_ops=[], compiler="eager")
        assert torch.allclose(compiled(x), model(x))


def test_level1_runs_the_traced_graph_and_level2_is_one_piece():
    model = SillyTwoLayers()
    x = torch.randn(8, 4)
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=0, num_backend_compilations=0):
        assert torch.allclose(_compile(model, level=1)(x), model(x))
    torch._dynamo.reset()
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=1, num_backend_compilations=1):
        assert torch.allclose(_compile(model, level=2, compiler="eager")(x), model(x))


def test_second_graph_is_a_clear_error():
    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    compiled = torch.compile(broken, backend=ac.AtomBackend(CompilationConfig(level=3, compiler="eager")))
    with pytest.raises(Exception, match="was given a second graph"):
        compiled(torch.randn(4))


def test_backend_compiles_each_graph_of_a_graph_break():
    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    backend = ac.backend(CompilationConfig(level=3, compiler="eager"))
    x = torch.randn(4)
    with compilation_counter.expect(num_graphs_seen=2):
        assert torch.allclose(torch.compile(broken, backend=backend)(x), broken(x))
    assert [b.prefix for b in backend.later] == ["backbone-graph1"]


def test_debug_dump_and_computation_graph(tmp_path, cache_root):
    model = SillyTwoLayers()
    dump = tmp_path / "dump"
    compiled = _compile(model, level=3, splitting_ops=["silly.attention"], compiler="eager", debug_dump_path=str(dump))
    compiled(torch.randn(8, 4))
    files = {p.name for p in (dump / "rank_0" / "backbone").iterdir()}
    assert {"traced_graph.py", "computation_graph.py", "submod_0.py", "submod_1.py", "submod_4.py"} <= files
    assert list(cache_root.glob("torch_compile_cache/*/rank_0/backbone/computation_graph.py"))


def test_copy_inputs_uses_static_buffers():
    from atom_compile.backends.atom_backend import _CopyInputs

    backend = ac.backend(Config(compilation_config=CompilationConfig(
        level=3, splitting_ops=["silly.attention"], compiler="eager", cudagraph_copy_inputs=True)).compilation_config)
    model = SillyTwoLayers()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for n in (8, 3):
        x = torch.randn(n, 4)
        assert torch.allclose(compiled(x), model(x))
    copier = backend.compiled_callable
    assert isinstance(copier, _CopyInputs)
    assert [b.shape[0] for b in copier.buffers.values()] == [8]


LEVELS_AND_COMPILERS = [(0, "auto"), (1, "auto"), (2, "eager"), (2, "inductor_standalone"), (3, "eager"),
                        (3, "inductor_standalone"), (3, "inductor"), (2, "inductor")]


@pytest.mark.parametrize("level, compiler", LEVELS_AND_COMPILERS)
def test_builtin_llama_matches_eager_at_every_level(level, compiler):
    stepper = Stepper()
    # one layer: the level-3 split still gives two pieces around attention, at half the work
    model, ref = tiny(num_layers=1), tiny(num_layers=1)
    stepper.allocate(model, ref)
    cfg = Config(max_num_seqs=8, compilation_config=CompilationConfig(level=level, compiler=compiler,
                                                                      compile_sizes=[4]))
    compiled = torch.compile(model.model, backend=ac.backend(cfg), fullgraph=True, dynamic=True)
    # sizes in compile_sizes (4) and outside it (6, 9), prefill and decode
    for steps in (stepper.prefill([6]), stepper.prefill([4], seed=1), stepper.prefill([5, 4], seed=2),
                  stepper.decode([9, 4], [7, 8])):
        got = stepper.logits(model, steps, compiled)
        want = stepper.logits(ref, steps)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (level, compiler)
    if level >= 2 and compiler != "eager":
        assert compilation_counter.num_concrete_compilations >= 1
