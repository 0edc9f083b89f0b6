"""The built-in residual-add pass: Inductor's addmm with a full-size residual goes back to mm + add."""

from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import atom_compile as ac
from atom_compile import CompilationConfig, ConfigError
from atom_compile.backends.custom_passes import POST_PASS_KEY, compiler_config
from atom_compile.backends.residual_add import split_residual_addmm

aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _traced():
    def f(r, a, w, bias):
        residual = aten.addmm.default(r, a, w.t())  # the residual add Inductor folds into the GEMM
        biased = aten.addmm.default(bias, a, w.t())  # a bias row: BLAS adds it without a copy
        scaled = aten.addmm.default(r, a, w.t(), beta=2)  # not a plain add: left alone
        return residual, biased, scaled

    args = (torch.randn(5, 6), torch.randn(5, 4), torch.randn(6, 4), torch.randn(6))
    return make_fx(f, tracing_mode="fake")(*args), args, f


def test_full_size_addmm_is_split_and_bias_and_scaled_ones_are_kept():
    gm, args, f = _traced()
    assert _targets(gm).count(aten.addmm.default) == 3
    assert split_residual_addmm(gm.graph) == 1
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(aten.addmm.default) == 2 and targets.count(aten.mm.default) == 1
    assert targets.count(aten.add.Tensor) == 1
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want)
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    assert tuple(mm.meta["val"].shape) == (5, 6)  # metadata for Inductor's later passes


def test_the_builtin_passes_are_in_the_compiler_options_unless_turned_off():
    on = compiler_config(CompilationConfig(level=3))[POST_PASS_KEY]
    assert [type(p).__name__ for p in on.passes] == ["ResidualAddPass", "SmallMLinearPass", "GluPass"]
    one = compiler_config(CompilationConfig(level=3, small_m_linear_pass=False))[POST_PASS_KEY]
    assert [type(p).__name__ for p in one.passes] == ["ResidualAddPass"]
    assert on.uuid() != one.uuid()  # a different set of passes: a different piece key
    off = CompilationConfig(level=3, residual_add_pass=False, small_m_linear_pass=False)
    assert POST_PASS_KEY not in compiler_config(off)
    for name in ("residual_add_pass", "small_m_linear_pass"):
        with pytest.raises(ConfigError, match=f"CompilationConfig.{name}"):
            CompilationConfig(**{name: "yes"})


def test_inductor_pdl_is_on_where_inductor_has_it_unless_the_user_says_otherwise():
    import torch._inductor.config as inductor_config

    has = hasattr(inductor_config.triton, "enable_pdl")
    assert compiler_config(CompilationConfig(level=3)).get("triton.enable_pdl") is (True if has else None)
    off = CompilationConfig(level=3, inductor_compile_config={"triton.enable_pdl": False})
    assert compiler_config(off)["triton.enable_pdl"] is False


def test_inductor_combo_kernels_are_on_where_inductor_has_them_unless_the_user_says_otherwise():
    import torch._inductor.config as inductor_config

    has = hasattr(inductor_config, "combo_kernels")
    assert compiler_config(CompilationConfig(level=3)).get("combo_kernels") is (True if has else None)
    off = CompilationConfig(level=3, inductor_compile_config={"combo_kernels": False})
    assert compiler_config(off)["combo_kernels"] is False


class Block(torch.nn.Module):
    """A residual stream as transformers write it: the sum feeds the next norm (a reduction)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32, bias=False)
        self.norm = torch.nn.RMSNorm(32)

    def forward(self, x, residual):
        residual = self.proj(x) + residual
        return self.norm(residual), residual


def _generated(root: Path) -> str:
    return "\n".join(p.read_text() for p in root.rglob("*.py") if "def call(" in p.read_text())


@pytest.mark.parametrize("on", [True, False])
def test_inductor_output_has_no_residual_addmm_with_the_pass(tmp_path, on):
    x, residual = torch.randn(8, 32), torch.randn(8, 32)
    model = Block()
    cfg = ac.Config(compilation_config=CompilationConfig(level=2, compiler="inductor_standalone", residual_add_pass=on,
                                                         cache_dir=str(tmp_path / "cache")))
    torch._dynamo.reset()
    got = torch.compile(model, backend=ac.backend(cfg), fullgraph=True)(x, residual)
    for g, w in zip(got, model(x, residual)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    code = _generated(tmp_path / "cache")
    assert "extern_kernels.mm(" in code or "extern_kernels.addmm(" in code  # found the generated module
    assert ("extern_kernels.addmm(" in code) is (not on)
