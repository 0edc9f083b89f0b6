"""inductor_passes: custom post-grad passes run by Inductor, keyed into the cache."""

import pytest
import torch

import atom_compile as ac
from atom_compile import CompilationConfig, Config, ConfigError, compilation_counter
from atom_compile.cache.keys import diff_factors


def add_to_sub(graph: torch.fx.Graph) -> None:
    """Every aten.add.Tensor becomes aten.sub.Tensor."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.add.Tensor:
            node.target = torch.ops.aten.sub.Tensor


def add_to_sub_v2(graph: torch.fx.Graph) -> None:
    """The same rewrite, other source: a different uuid."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.add.Tensor:
            node.target = torch.ops.aten.sub.Tensor


class Keyed:
    def __call__(self, graph):
        add_to_sub(graph)

    def uuid(self):
        return "keyed-1"


class AddModel(torch.nn.Module):
    def forward(self, x, y):
        return x * 2 + y


def _compile(model, **cc):
    cfg = Config(compilation_config=CompilationConfig(level=2, compiler="inductor_standalone", **cc))
    return torch.compile(model, backend=ac.backend(cfg), fullgraph=True)


def test_add_to_sub_pass_changes_outputs_and_key():
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with compilation_counter.expect(num_inductor_compiles=1):
        out = _compile(AddModel(), inductor_passes=[add_to_sub])(x, y)
    assert torch.allclose(out, x * 2 - y)  # eager with the same rewrite
    assert not torch.allclose(out, x * 2 + y)
    plain = CompilationConfig(level=2)
    passed = CompilationConfig(level=2, inductor_passes=[add_to_sub])
    assert plain.compute_hash() != passed.compute_hash()
    assert "inductor_passes" not in plain.hash_factors()


def test_a_changed_pass_recompiles_and_explain_names_it():
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    _compile(AddModel(), inductor_passes=[add_to_sub])(x, y)
    torch._dynamo.reset()
    with compilation_counter.expect(num_inductor_compiles=0):  # same pass: loaded from the cache
        assert torch.allclose(_compile(AddModel(), inductor_passes=[add_to_sub])(x, y), x * 2 - y)
    torch._dynamo.reset()
    with compilation_counter.expect(num_inductor_compiles=1):  # changed source: compiled again
        assert torch.allclose(_compile(AddModel(), inductor_passes=[add_to_sub_v2])(x, y), x * 2 - y)
    a = CompilationConfig(level=2, inductor_passes=[add_to_sub]).hash_factors()
    b = CompilationConfig(level=2, inductor_passes=[add_to_sub_v2]).hash_factors()
    changed = " ".join(str(d) for d in diff_factors({"config": a}, {"config": b}))
    assert "add_to_sub" in changed


def test_string_specs_and_uuid_method():
    by_name = CompilationConfig(inductor_passes=[f"{__name__}:add_to_sub"])
    assert list(by_name.hash_factors()["inductor_passes"].values()) == \
        list(CompilationConfig(inductor_passes=[add_to_sub]).hash_factors()["inductor_passes"].values())
    assert list(CompilationConfig(inductor_passes=[Keyed()]).hash_factors()["inductor_passes"].values()) == ["keyed-1"]


@pytest.mark.parametrize("bad", ["no_colon", [3], ["bad name:x"], [int], ["atom_compile.nope_mod:f"]])
def test_bad_passes_name_the_field(bad):
    with pytest.raises(ConfigError, match="CompilationConfig.inductor_passes"):
        CompilationConfig(inductor_passes=bad).hash_factors()
