"""Strict mode (ATOM_COMPILE_REQUIRE_CACHE=1, CompilationConfig.require_cache): a start that
would compile fails with CacheRequired naming the piece, the shape and the key factor that
differed; a start the cache covers runs without compiling anything."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from atom_compile.errors import CacheRequired


class TwoPieces(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = torch.empty_like(h)
        torch.ops.silly.attention(h, h, h, out)
        return self.b(out) + x


def _run(model, x, root, **cc):
    torch._dynamo.reset()
    cfg = Config(compilation_config=CompilationConfig(level=3, splitting_ops=["silly.attention"],
                                                      cache_dir=str(root), **cc))
    return torch.compile(model, backend=ac.backend(cfg), fullgraph=True, dynamic=True)(x)


def _cache_required(exc_info) -> CacheRequired:
    """Dynamo wraps what a backend raises (BackendCompilerFailed); ours is in the chain."""
    exc = exc_info.value
    while exc is not None and not isinstance(exc, CacheRequired):
        exc = exc.__cause__ or exc.__context__
    assert exc is not None, f"no CacheRequired in {exc_info.value!r}"
    return exc


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A cache warmed once (not strict) for the model at level 3; shared by the cases."""
    root = tmp_path_factory.mktemp("strict-cache")
    model = TwoPieces()
    x = torch.randn(6, 8)
    with compilation_counter.expect(num_inductor_compiles=2):
        want = _run(model, x, root)
    return root, model, x, want


def test_an_empty_cache_refuses_naming_the_piece_and_why(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_COMPILE_REQUIRE_CACHE", "1")
    with compilation_counter.expect(num_inductor_compiles=0), pytest.raises(Exception) as info:
        _run(TwoPieces(), torch.randn(4, 8), tmp_path)
    message = str(_cache_required(info))
    assert "piece 0 (shape general)" in message and f"no cache under {tmp_path}" in message
    assert "ATOM_COMPILE_REQUIRE_CACHE" in message


def test_a_warmed_cache_runs_strict_without_compiling(warmed, monkeypatch):
    root, model, x, want = warmed
    monkeypatch.setenv("ATOM_COMPILE_REQUIRE_CACHE", "1")
    with compilation_counter.expect(num_inductor_compiles=0, num_compiled_artifacts_loaded=2):
        got = _run(model, x, root)
    assert torch.equal(got, want)


def test_a_changed_factor_is_named(warmed):
    root, model, x, _ = warmed
    with compilation_counter.expect(num_inductor_compiles=0), pytest.raises(Exception) as info:
        _run(model, x, root, require_cache=True, inductor_compile_config={"max_autotune": False})
    message = str(_cache_required(info))
    assert "config.inductor_compile_config" in message and "nearest cache" in message


@ac.support_torch_compile
class Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((8,), 0.5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w + 1
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        return out - 2


def test_the_decorator_refuses_to_trace_then_starts_from_a_warmed_cache(tmp_path, monkeypatch):
    cc = dict(level=3, splitting_ops=["silly.attention"], cache_dir=str(tmp_path))
    x = torch.randn(6, 8)
    torch._dynamo.reset()
    monkeypatch.setenv("ATOM_COMPILE_REQUIRE_CACHE", "1")
    with compilation_counter.expect(num_graphs_seen=0, num_inductor_compiles=0), pytest.raises(CacheRequired) as info:
        Decorated(compilation_config=Config(compilation_config=CompilationConfig(**cc)))(x)
    assert "Decorated" in str(info.value)
    monkeypatch.delenv("ATOM_COMPILE_REQUIRE_CACHE")
    want = Decorated(compilation_config=Config(compilation_config=CompilationConfig(**cc)))(x)
    torch._dynamo.reset()
    strict_cc = CompilationConfig(require_cache=True, **cc)
    with compilation_counter.expect(num_graphs_seen=0, num_inductor_compiles=0):
        got = Decorated(compilation_config=Config(compilation_config=strict_cc))(x)
    assert torch.equal(got, want)
