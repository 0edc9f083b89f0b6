import pytest
import torch

import atom_compile as ac
from atom_compile.custom_ops import is_eager_region_op, registered_op, registered_splitting_ops

_lib = torch.library.Library("atomtest", "FRAGMENT")


def _scale(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
    out.copy_(x * factor)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_register_runs_on_cpu_and_is_traceable():
    op = ac.direct_register_custom_op("scale", _scale, mutates_args=["out"], target_lib=_lib, splitting=True)
    x = torch.arange(4.0)
    out = torch.empty(4)
    op(x, out, 3.0)
    assert torch.equal(out, x * 3)
    assert "atomtest::scale" in registered_splitting_ops()

    def f(x):
        out = torch.empty_like(x)
        torch.ops.atomtest.scale(x, out, 2.0)
        return out + 1

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 2 + 1)


def test_register_twice_is_a_noop_and_another_schema_is_an_error():
    first = ac.direct_register_custom_op("double", _double, mutates_args=[], fake_impl=lambda x: torch.empty_like(x),
                                         target_lib=_lib)
    again = ac.direct_register_custom_op("double", _double, mutates_args=[], fake_impl=lambda x: torch.empty_like(x),
                                         target_lib=_lib, eager_region=True)
    assert first is again
    assert registered_op("atomtest::double").eager_region and is_eager_region_op("atomtest::double")

    def other(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    with pytest.raises(ValueError, match=r"atomtest::double is already registered with schema"):
        ac.direct_register_custom_op("double", other, mutates_args=[], fake_impl=lambda x, y: x, target_lib=_lib)


def test_default_namespace_is_aiter_and_an_existing_op_keeps_its_schema():
    import atom_compile.ops.attention  # noqa: F401  registers the reference attention

    op = torch.ops.aiter.unified_attention_with_output
    assert "layer_name" in str(op.default._schema)
    assert "aiter::unified_attention_with_output" in registered_splitting_ops()


def test_bad_registrations_are_clear_errors():
    with pytest.raises(ValueError, match="op_name"):
        ac.direct_register_custom_op("bad name", _double, mutates_args=[], target_lib=_lib)
    with pytest.raises(ValueError, match="give a fake_impl"):
        ac.direct_register_custom_op("nofake", _double, mutates_args=[], target_lib=_lib)

    def untyped(x):
        return x

    with pytest.raises(ValueError, match="cannot infer a schema"):
        ac.direct_register_custom_op("untyped", untyped, mutates_args=[], target_lib=_lib)
