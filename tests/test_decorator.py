"""@support_torch_compile: compile once, dispatch without guards, refuse what would be wrong."""

import threading

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from atom_compile.backends import aot


def _cfg(level=3, **kw):
    kw.setdefault("splitting_ops", ["silly.attention"])
    kw.setdefault("compiler", "eager")
    return Config(compilation_config=CompilationConfig(level=level, **kw))


@ac.support_torch_compile
class SillyModel(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), scale), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w + 1
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        x = out - 2
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        return out * self.w


def _eager(model, x):
    return SillyModel.forward(model, x)


@ac.ignore_torch_compile
class IgnoredModel(SillyModel):
    pass


@ac.support_torch_compile(enable_if=lambda cfg: False)
class DisabledModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_counters_and_outputs_across_batch_sizes():
    with compilation_counter.expect(num_models_seen=1, num_graphs_seen=1, num_piecewise_graphs_seen=5,
                                    num_piecewise_capturable_graphs_seen=3, num_backend_compilations=3):
        model = SillyModel(compilation_config=_cfg())
        x = torch.randn(8, 4)
        assert torch.allclose(model(x), _eager(model, x))
    # later calls go straight to the compiled code: no graph, no compile, any batch size
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        for n in (2, 5, 17):
            x = torch.randn(n, 4)
            assert torch.allclose(model(x), _eager(model, x))


def test_config_through_the_context_manager_and_second_instance_with_other_weights():
    with ac.set_current_config(_cfg()):
        a = SillyModel(1.0)
        b = SillyModel(3.0)
    x = torch.randn(6, 4)
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, _eager(a, x)) and torch.allclose(yb, _eager(b, x))
    assert not torch.allclose(ya, yb)
    assert a._atom_dispatch is not b._atom_dispatch


@ac.support_torch_compile
class ScaledModel(nn.Module):
    """A Python float attribute in forward: a second instance with another value makes Dynamo
    trace it as a dynamic float, which the backend turns back into a constant by a restart."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.silly.attention(x * self.scale, x, x, out)
        return out * self.scale + 1


def test_a_second_instance_with_another_float_compiles_and_matches_eager():
    torch._dynamo.reset()  # the float's history is per code object: start from none
    x = torch.randn(6, 4)
    for scale in (0.5, 0.125, 3.0):
        model = ScaledModel(scale, compilation_config=_cfg())
        with compilation_counter.expect(num_graphs_seen=1):
            got = model(x)
        assert torch.allclose(got, ScaledModel.forward(model, x)), scale


def test_two_instances_with_different_configs_never_share_code():
    a = SillyModel(compilation_config=_cfg(level=3))
    b = SillyModel(compilation_config=_cfg(level=2))
    x = torch.randn(6, 4)
    with compilation_counter.expect(num_graphs_seen=2, num_piecewise_graphs_seen=5 + 1):
        assert torch.allclose(a(x), _eager(a, x))
        assert torch.allclose(b(x), _eager(b, x))


def test_ignored_subclass_and_enable_if_compile_nothing():
    zero = {name: 0 for name in compilation_counter.as_dict()}
    x = torch.randn(4, 4)
    with compilation_counter.expect(**zero):
        model = IgnoredModel(compilation_config=_cfg())
        assert torch.allclose(model(x), _eager(model, x))
    zero.pop("num_models_seen")  # built, but not compiled
    with compilation_counter.expect(**zero):
        assert torch.equal(DisabledModel(compilation_config=_cfg())(x), x + 1)


def test_no_config_means_level_0(caplog):
    with compilation_counter.expect(num_graphs_seen=0):
        model = SillyModel()
        x = torch.randn(4, 4)
        assert torch.allclose(model(x), _eager(model, x))
    assert model.do_not_compile


@pytest.mark.parametrize("level", [0, 1])
def test_levels_0_and_1_run_forward_directly(level):
    with compilation_counter.expect(num_graphs_seen=0):
        model = SillyModel(compilation_config=_cfg(level=level))
        model(torch.randn(4, 4))


def test_environment_variable_turns_compilation_off(monkeypatch):
    monkeypatch.setenv("ATOM_COMPILE_DISABLE", "1")
    with compilation_counter.expect(num_graphs_seen=0):
        model = SillyModel(compilation_config=_cfg())
        x = torch.randn(4, 4)
        assert torch.allclose(model(x), _eager(model, x))


@ac.support_torch_compile
class BufferRebinder(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return x + self.steps


@ac.support_torch_compile
class BufferInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return x + self.steps


def test_buffer_rebinding_is_refused_and_in_place_update_works():
    with pytest.raises(ac.BufferMutationError, match=r"BufferRebinder.forward rebinds a registered buffer"):
        BufferRebinder(compilation_config=_cfg(level=2))(torch.zeros(4, 2))
    model = BufferInPlace(compilation_config=_cfg(level=2))
    model(torch.zeros(4, 2))
    assert torch.equal(model(torch.zeros(3, 2)), torch.full((3, 2), 2.0))


def test_a_call_needing_a_new_graph_is_an_error_naming_the_cause():
    model = SillyModel(compilation_config=_cfg())
    model(torch.randn(4, 4))
    with pytest.raises(ac.RecompileError, match="argument 0 has size 5 on dim 1, which was traced as the constant 4"):
        model(torch.randn(4, 5))
    with pytest.raises(ac.RecompileError, match="float32"):
        model(torch.randn(4, 4, dtype=torch.float64))


def test_first_call_of_size_one_is_a_clear_error():
    model = SillyModel(compilation_config=_cfg())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(torch.randn(1, 4))


def test_forward_without_tensor_arguments_is_refused():
    class NoTensors(nn.Module):
        def forward(self, n: int):
            return n

    with pytest.raises(TypeError, match="no torch.Tensor"):
        ac.support_torch_compile(NoTensors)
    with pytest.raises(ValueError, match="has no argument 'y'"):
        ac.support_torch_compile(dynamic_arg_dims={"y": 0})(NoTensors)


def test_bytecode_hook_dispatch_on_torch_without_aot(monkeypatch):
    monkeypatch.setattr(aot, "supported", lambda: False)
    model = SillyModel(compilation_config=_cfg())
    x = torch.randn(8, 4)
    assert torch.allclose(model(x), _eager(model, x))
    with compilation_counter.expect(num_graphs_seen=0):
        for n in (3, 11):
            x = torch.randn(n, 4)
            assert torch.allclose(model(x), _eager(model, x))


# --- the forward context -------------------------------------------------------------------


def test_forward_context_set_reset_and_nesting():
    assert ac.get_forward_context().attn_metadata is None
    with ac.set_forward_context("outer", context=ac.Context(batch_size=2)):
        assert ac.get_forward_context().attn_metadata == "outer"
        with ac.set_forward_context("inner") as inner:
            assert ac.get_forward_context() is inner and inner.attn_metadata == "inner"
        assert ac.get_forward_context().attn_metadata == "outer"
        assert ac.get_forward_context().context.batch_size == 2
    assert ac.get_forward_context().attn_metadata is None
    # reset even when the block raises
    with pytest.raises(RuntimeError):
        with ac.set_forward_context("boom"):
            raise RuntimeError
    assert ac.get_forward_context().attn_metadata is None
    ac.set_forward_context("plain call")
    assert ac.get_forward_context().attn_metadata == "plain call"
    ac.reset_forward_context()
    assert ac.get_forward_context().attn_metadata is None
    with pytest.raises(ValueError, match="tr_graph"):
        ac.set_forward_context(None, tr_graph="sometimes")


def test_forward_context_layers_from_config_and_threads_are_isolated():
    cfg = Config()
    cfg.compilation_config.static_forward_context["layer.0"] = "L0"
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with ac.set_forward_context(name, cfg):
            barrier.wait()
            seen[name] = (ac.get_forward_context().attn_metadata, ac.get_forward_context().no_compile_layers)
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"][0] == "a" and seen["b"][0] == "b"
    assert seen["a"][1] == {"layer.0": "L0"}
    assert ac.get_forward_context().attn_metadata is None
