"""persistent_reduction_max (backends/reductions.py): while a piece compiles, Inductor's choices
handler keeps rows of up to that many elements in registers (one read of the row)."""

import pytest
import sympy
import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.codegen.simd_kernel_features import SIMDKernelFeatures
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.sizevars import SizeVarAllocator
from torch._inductor.virtualized import V

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from atom_compile.backends import reductions
from atom_compile.backends.custom_passes import compiler_config

pytestmark = pytest.mark.skipif(not reductions.supported(),
                                reason="this torch's Inductor has no persistent-reduction choice to widen")


class _Features:
    """What Inductor's heuristic reads of one reduction kernel: its hint and length, and (torch
    >= 2.14) the block size a strict sum needs (None: no strict sum)."""

    def __init__(self, hint, numel, strict_rblock=None):
        self.hint, self.reduction_numel, self.numel = hint, sympy.Integer(numel), sympy.Integer(1)
        self.strict_rblock = strict_rblock

    def get_reduction_hint(self):
        return self.hint

    def strict_sum_rblock(self):
        return self.strict_rblock

    def has_strict_sum_multirow_reduction(self):
        return False


class _Graph:
    sizevars = SizeVarAllocator()


def _inductors(features, cooperative=False):
    return InductorChoices.should_use_persistent_reduction(features, cooperative)


def test_rows_up_to_the_limit_reduce_in_one_pass_and_inductor_decides_the_rest():
    with V.set_graph_handler(_Graph()), reductions.persistent_rows(4096):
        ours = V.choices.should_use_persistent_reduction
        for numel in (2048, 4096):  # Inductor alone: a loop (its limit is 1024)
            assert ours(_Features(ReductionHint.INNER, numel), False) and not _inductors(_Features(ReductionHint.INNER, numel))
        # past the limit, along another dimension, shorter rows, split across programs: Inductor's answer
        for hint, numel, cooperative in ((ReductionHint.INNER, 8192, False), (ReductionHint.OUTER, 2048, False),
                                         (ReductionHint.INNER, 512, False), (ReductionHint.INNER, 2048, True)):
            features = _Features(hint, numel)
            assert ours(features, cooperative) == _inductors(features, cooperative)
        # Inductor's own switch still holds
        with torch._inductor.config.patch({"triton.persistent_reductions": False}):
            assert not ours(_Features(ReductionHint.INNER, 2048), False)


@pytest.mark.skipif(not hasattr(SIMDKernelFeatures, "strict_sum_rblock"), reason="this Inductor has no strict sums")
def test_a_strict_sum_keeps_the_block_size_inductor_requires():
    with V.set_graph_handler(_Graph()), reductions.persistent_rows(4096):
        assert not V.choices.should_use_persistent_reduction(_Features(ReductionHint.INNER, 2048, 1024), False)
        assert V.choices.should_use_persistent_reduction(_Features(ReductionHint.INNER, 2048, 2048), False)


def test_the_handler_is_set_while_entered_and_a_users_own_stays_in_charge():
    before = V.choices
    with reductions.persistent_rows(2048):
        assert isinstance(V.choices, InductorChoices) and V.choices.limit == 2048
    assert V.choices is before
    with reductions.persistent_rows(0):
        assert V.choices is before

    class Mine(InductorChoices):
        pass

    mine = Mine()
    with V.set_choices_handler(mine), reductions.persistent_rows(4096):
        assert V.choices is mine


def test_a_piece_compiles_under_the_configured_limit_which_enters_the_key():
    seen = []

    def record(graph):  # an Inductor post-grad pass: runs inside the piece's compile
        seen.append(getattr(V.choices, "limit", None))

    x = torch.randn(4, 8)
    for limit in (2048, 0):
        cfg = Config(compilation_config=CompilationConfig(level=2, inductor_passes=[record],
                                                          persistent_reduction_max=limit))
        torch._dynamo.reset()
        with compilation_counter.expect(num_inductor_compiles=1):
            out = torch.compile(lambda t: t * 2 + 1, backend=ac.backend(cfg), fullgraph=True)(x)
        torch.testing.assert_close(out, x * 2 + 1)
    assert seen == [2048, None]
    assert CompilationConfig().persistent_reduction_max == 8192
    assert compiler_config(CompilationConfig())[reductions.ROW_LIMIT_KEY] == 8192
    assert reductions.ROW_LIMIT_KEY not in compiler_config(CompilationConfig(persistent_reduction_max=0))
    assert CompilationConfig().compute_hash() != CompilationConfig(persistent_reduction_max=0).compute_hash()


@pytest.mark.parametrize("value", [-1, True, 2.5, "4096"])
def test_a_bad_limit_is_a_config_error(value):
    with pytest.raises(ac.ConfigError, match="persistent_reduction_max"):
        CompilationConfig(persistent_reduction_max=value)


def _add_rms_norm(x, residual, weight):
    h = x + residual
    var = h.float().pow(2).mean(-1, keepdim=True)
    return h, (h.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [8192, 0])
def test_a_hidden_size_norm_is_one_pass_on_cuda(tmp_path, monkeypatch, limit):
    monkeypatch.setenv("ATOM_COMPILE_CACHE_ROOT", str(tmp_path))  # its generated code, to read
    cfg = Config(compilation_config=CompilationConfig(level=2, persistent_reduction_max=limit))
    compiled = torch.compile(_add_rms_norm, backend=ac.backend(cfg), fullgraph=True)
    x, residual = (torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    for got, want in zip(compiled(x, residual, weight), _add_rms_norm(x, residual, weight)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    code = "\n".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.py"))
    assert ("def triton_per_fused" in code) == bool(limit)
    assert ("def triton_red_fused" in code) == (not limit)  # Inductor's own: a loop that reads twice
