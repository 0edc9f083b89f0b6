"""persistent_reduction_max (backends/reductions.py): while a piece compiles, Inductor's choices
handler keeps rows of up to that many elements in registers (one read of the row)."""

import pytest
import sympy
import torch
from torch._inductor.choices import InductorChoices
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
    """What Inductor hands the heuristic about one reduction: its hint and its length."""

    def __init__(self, hint, numel):
        self.hint, self.reduction_numel = hint, sympy.Integer(numel)

    def get_reduction_hint(self):
        return self.hint


class _Graph:
    sizevars = SizeVarAllocator()


def _answer(choices, features, cooperative=False):
    # Inductor's own heuristic may read more of the kernel than the stand-in holds (newer ones do)
    try:
        return choices.should_use_persistent_reduction(features, cooperative)
    except AttributeError as exc:
        return f"asked for more: {exc}"


def test_rows_up_to_the_limit_reduce_in_one_pass_and_inductor_decides_the_rest():
    with V.set_graph_handler(_Graph()), reductions.persistent_rows(4096):
        ours = V.choices
        assert ours.should_use_persistent_reduction(_Features(ReductionHint.INNER, 2048), False) is True
        assert ours.should_use_persistent_reduction(_Features(ReductionHint.INNER, 4096), False) is True
        # past the limit, or along another dimension: whatever Inductor's own heuristic answers
        for hint, numel in ((ReductionHint.INNER, 8192), (ReductionHint.OUTER, 2048), (ReductionHint.INNER, 512)):
            assert _answer(ours, _Features(hint, numel)) == _answer(InductorChoices, _Features(hint, numel))
        # split across programs (a cooperative reduction): Inductor's too
        features = _Features(ReductionHint.INNER, 2048)
        assert _answer(ours, features, True) == _answer(InductorChoices, features, True)


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
