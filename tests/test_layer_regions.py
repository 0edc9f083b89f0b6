"""The alike layers of a ModuleList traced once (nested_compile_region), inlined by the backend
before the split at attention; layers that are not alike, or that a region cannot hold, take
the path that traces every layer."""

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter, layer_regions
from atom_compile.backends import regions
from support.llama_helpers import BLOCK, Stepper, tiny

pytestmark = pytest.mark.skipif(not layer_regions.supported(), reason="torch without nested_compile_region")


def _spy_bodies(monkeypatch) -> list[tuple[int, int]]:
    """(invoke_subgraph calls, distinct bodies) of every graph the backend inlines: each
    distinct body is one Dynamo trace of a layer."""
    seen = []
    inline = regions.inline_invoke_subgraphs

    def spy(gm):
        calls = [n for n in gm.graph.nodes if regions.is_invoke_subgraph(n)]
        seen.append((len(calls), len({n.args[0].target for n in calls})))
        return inline(gm)

    monkeypatch.setattr(regions, "inline_invoke_subgraphs", spy)
    return seen


def _attention_ops(model) -> int:
    items = model.model._atom_backend.result.items
    return sum(1 for item in items if item.is_splitting_graph for node in item.graph.graph.nodes
               if "paged_attention_with_output" in str(node.target))


def test_llama_layers_traced_once_match_eager_and_warm_start_compiles_nothing(monkeypatch):
    seen = _spy_bodies(monkeypatch)
    stepper = Stepper()
    model = tiny(4, compilation_config=Config(compilation_config=CompilationConfig(level=3)))
    reference = tiny(4)
    stepper.allocate(model, reference)
    prefill = stepper.prefill([5, 3])
    with compilation_counter.expect(num_graphs_seen=1, num_regions_inlined=3, num_region_fallbacks=0,
                                    num_inductor_compiles=3, num_piecewise_graphs_seen=9):
        got = stepper.logits(model, prefill)
    # layers 1-3 are three calls of one traced body; layer 0 (no residual yet) has a body of its
    # own, called once, which Dynamo inlines itself
    assert seen == [(3, 1)]
    assert _attention_ops(model) == 4  # still split at every layer's attention
    torch.testing.assert_close(got, stepper.logits(reference, prefill), rtol=1e-5, atol=1e-5)
    decode = stepper.decode([5, 3], [7, 9])
    torch.testing.assert_close(stepper.logits(model, decode), stepper.logits(reference, decode),
                               rtol=1e-5, atol=1e-5)

    # A second start (same config and cache root): nothing is traced or compiled, even with a
    # KV cache of another block count (dim 1 of the cache is symbolic in the graph).
    torch._dynamo.reset()
    warm = tiny(4, compilation_config=Config(compilation_config=CompilationConfig(level=3)))
    warm.allocate_kv_cache(stepper.max_seqs * stepper.blocks_per_seq + 5, BLOCK)
    fresh = tiny(4)
    stepper.allocate(fresh)
    with compilation_counter.expect(num_inductor_compiles=0, num_graphs_seen=0 if _aot() else 1):
        got = stepper.logits(warm, prefill)
    torch.testing.assert_close(got, stepper.logits(fresh, prefill), rtol=1e-5, atol=1e-5)


def _aot() -> bool:
    from atom_compile.backends import aot

    return aot.supported()


class Block(nn.Module):
    def __init__(self, width: int = 8, act=torch.relu):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) + x


class Scaled(Block):
    """Alike in structure, but each layer multiplies by its own index: a per-layer constant."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (self.index + 1) + x


class Passthrough(Block):
    """Returns a view of its input: a region's output may not alias its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t().t()


@ac.support_torch_compile
class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _run(layers: list[nn.Module], trace_layers_once: bool = True, graphs: int = 1, **expect: int) -> None:
    torch.manual_seed(0)
    cfg = Config(compilation_config=CompilationConfig(level=3, compiler="eager", trace_layers_once=trace_layers_once))
    model = Stack(layers, compilation_config=cfg)
    x = torch.randn(4, 8)
    with torch.no_grad(), compilation_counter.expect(num_graphs_seen=graphs, **expect):
        got = model(x.clone())
    torch.testing.assert_close(got, Stack.forward(model, x.clone()), rtol=0, atol=0)
    # the marks were for the trace only: every layer has its own class again
    assert [type(layer) for layer in model.layers] == [type(layer) for layer in layers]


@pytest.mark.parametrize("case", ["not alike", "per-layer constant", "cannot be a region", "cannot be inlined",
                                  "opt-out"])
def test_where_the_region_does_not_apply_every_layer_is_traced(case, monkeypatch):
    seen = _spy_bodies(monkeypatch)
    if case == "not alike":  # two classes (and widths) in one list: no region at all
        _run([Block(), Block(act=torch.tanh), nn.Linear(8, 8), Block()], num_regions_inlined=0,
             num_region_fallbacks=0)
        assert seen == [(0, 0)]
    elif case == "per-layer constant":  # the guards differ per layer: each traced, none reused
        # wrongly (Dynamo inlines a body called once itself: the backend sees a flat graph)
        _run([Scaled(i) for i in range(3)], num_regions_inlined=0, num_region_fallbacks=0)
        assert seen == [(0, 0)]
    elif case == "cannot be a region":  # Dynamo refuses the region: traced again without
        _run([Passthrough() for _ in range(3)], num_regions_inlined=0, num_region_fallbacks=1)
    elif case == "cannot be inlined":  # the backend fails on the region's graph: traced again without

        def broken(gm, node):
            raise KeyError("a body this backend cannot copy")

        monkeypatch.setattr(regions, "_inline_one", broken)
        _run([Block() for _ in range(3)], graphs=2, num_regions_inlined=0, num_region_fallbacks=1)
        assert seen == [(3, 1), (0, 0)]
    else:
        _run([Block() for _ in range(3)], False, num_regions_inlined=0, num_region_fallbacks=0)
        assert seen == [(0, 0)]


def test_alike_blocks_are_found_outermost_only():
    inner = nn.ModuleList([Block(), Block()])
    outer = nn.ModuleList([nn.Sequential(Block()), nn.Sequential(Block())])
    model = nn.Module()
    model.a, model.b, model.c = inner, outer, nn.ModuleList([Block()])
    assert layer_regions.repeated_blocks(model) == [inner, outer]
    with layer_regions.applied(model) as marked:
        assert marked == 4 and isinstance(inner[0], Block) and type(inner[0]) is not Block
    assert type(inner[0]) is Block and type(outer[0]) is nn.Sequential
