"""The backend inlines `invoke_subgraph` (torch's nested_compile_region), nested ones too,
whoever marked the region: here a user of `torch.compile(..., backend=ac.backend(cfg))`."""

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import compilation_counter, layer_regions
from atom_compile.backends import regions

pytestmark = pytest.mark.skipif(not layer_regions.supported(), reason="torch without nested_compile_region")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Inner(), Inner()

    def forward(self, x):
        return self.b(self.a(x)) * 0.5


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Outer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_nested_regions_are_inlined_and_match_eager(monkeypatch):
    monkeypatch.setattr(Inner, "forward", torch.compiler.nested_compile_region(Inner.forward))
    monkeypatch.setattr(Outer, "forward", torch.compiler.nested_compile_region(Outer.forward))
    torch.manual_seed(0)
    model = Model()
    backend = ac.backend(ac.CompilationConfig(level=3, compiler="eager"))
    # static shapes: nested regions with dynamic=True hit a KeyError inside Dynamo on 2.13
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, 8)
    # 3 calls of the outer body; once inlined, each holds 2 calls of the inner body
    with torch.no_grad(), compilation_counter.expect(num_graphs_seen=1, num_regions_inlined=3 + 6):
        got = compiled(x)
    torch.testing.assert_close(got, model(x), rtol=0, atol=0)
    graph = backend.result.split_gm
    assert not any(regions.is_invoke_subgraph(n) for item in backend.result.items for n in item.graph.graph.nodes)
    assert not [name for name, _ in graph.named_modules() if "subgraph" in name]


def test_a_graph_without_regions_is_left_alone():
    gm = torch.fx.symbolic_trace(Inner())
    code = gm.code
    assert regions.inline_invoke_subgraphs(gm) == 0 and gm.code == code
