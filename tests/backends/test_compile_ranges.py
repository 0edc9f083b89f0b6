"""compile_ranges: one compiled piece per [lo, hi) of token counts; exact compile sizes win."""

import re

import pytest
import torch

import atom_compile as ac
from atom_compile import CompilationConfig, Config, ConfigError, compilation_counter
from atom_compile.backends import piecewise, ranges
from atom_compile.cache.index import _check_entry



class SillyTwoLayers(torch.nn.Module):
    """tests/backends/test_backend.py's model: three pieces around two silly.attention calls."""

    def forward(self, x):
        x = x + 1
        x = x + 2
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        x = out - 2
        x = x - 1
        out = torch.empty_like(x)
        torch.ops.silly.attention(x, x, x, out)
        return out + 1


PIECES = 3  # SillyTwoLayers split at silly.attention: three pieces to compile


def _compile(model, **cc):
    cfg = Config(compilation_config=CompilationConfig(level=3, splitting_ops=["silly.attention"], **cc))
    return torch.compile(model, backend=ac.backend(cfg), fullgraph=True)


def _tokens(n):
    """n tokens of width 4; only the token count is dynamic (the piece's size is read from it)."""
    x = torch.randn(n, 4)
    torch._dynamo.mark_dynamic(x, 0)
    return x


@pytest.fixture
def range_calls(monkeypatch):
    """Counts the calls each range's compiled piece receives, by (lo, hi)."""
    calls: dict = {}
    real = ranges.compile_ranges

    def counting(*args, **kwargs):
        out = {}
        for span, fn in real(*args, **kwargs).items():
            def wrapped(*a, _fn=fn, _span=span):
                calls[_span] = calls.get(_span, 0) + 1
                return _fn(*a)
            out[span] = wrapped
        return out

    monkeypatch.setattr(piecewise, "compile_ranges", counting)
    return calls


def test_one_compile_per_range_and_dispatch(range_calls):
    model = SillyTwoLayers()
    # general: 3 pieces; each of 2 ranges: 3 pieces; the exact size 6 compiles on first use
    with compilation_counter.expect(num_backend_compilations=PIECES, num_concrete_compilations=2 * PIECES,
                                    num_inductor_compiles=3 * PIECES):
        compiled = _compile(model, compile_ranges=[[16, 64], [4, 16]], compile_sizes=[6])
        x = _tokens(8)
        assert torch.allclose(compiled(x), model(x))
    assert range_calls == {(4, 16): PIECES}
    # every other size of [4, 16) and of [16, 64) runs the range's piece: no compile per size
    with compilation_counter.expect(num_backend_compilations=0, num_concrete_compilations=0,
                                    num_inductor_compiles=0):
        for n in (4, 5, 15, 16, 40, 63):
            x = _tokens(n)
            assert torch.allclose(compiled(x), model(x))
    assert range_calls == {(4, 16): 4 * PIECES, (16, 64): 3 * PIECES}
    # outside every range: the general piece
    range_calls.clear()
    for n in (2, 64, 100):
        x = _tokens(n)
        assert torch.allclose(compiled(x), model(x))
    assert range_calls == {}
    # an exact compile size inside a range wins: compiled for 6, the range piece is not called
    with compilation_counter.expect(num_concrete_compilations=PIECES, num_inductor_compiles=PIECES):
        x = _tokens(6)
        assert torch.allclose(compiled(x), model(x))
    assert range_calls == {}


def test_range_pieces_are_stored_and_loaded(cache_root):
    model = SillyTwoLayers()
    compiled = _compile(model, compile_ranges=[[2, 9]])
    x = _tokens(3)
    assert torch.allclose(compiled(x), model(x))
    index = next(cache_root.glob("torch_compile_cache/*/rank_0/*/index.json")).read_text()
    assert '"runtime_shape": "2-9"' in index
    torch._dynamo.reset()
    with compilation_counter.expect(num_inductor_compiles=0, num_concrete_compilations=PIECES):
        compiled = _compile(model, compile_ranges=[[2, 9]])
        assert torch.allclose(compiled(x), model(x))


def test_range_label_is_a_valid_index_shape():
    entry = {"runtime_shape": ranges.range_label(4, 16), "graph_index": 0, "compiler": "x", "content_key": "k"}
    with pytest.raises(Exception) as info:  # fails later, on the missing handle; not on the shape
        _check_entry(entry)
    assert "runtime_shape" not in str(info.value)
    with pytest.raises(Exception, match="runtime_shape"):
        _check_entry(dict(entry, runtime_shape="4-x"))


def test_find_range():
    spans = [(1, 4), (4, 16), (32, 64)]
    assert ranges.find_range(spans, 1) == (1, 4)
    assert ranges.find_range(spans, 4) == (4, 16)
    assert ranges.find_range(spans, 15) == (4, 16)
    assert ranges.find_range(spans, 16) is None
    assert ranges.find_range(spans, 63) == (32, 64)
    assert ranges.find_range(spans, 64) is None
    assert ranges.find_range([], 3) is None


@pytest.mark.parametrize("bad", [
    "1-4", [[4, 4]], [[0, 4]], [[1, 2, 3]], [[1, True]], [[1.0, 4]], [[1, 8], [4, 16]], [5],
])
def test_validation_names_field_and_value(bad):
    with pytest.raises(ConfigError, match="CompilationConfig.compile_ranges"):
        CompilationConfig(compile_ranges=bad)


def test_ranges_sorted_enter_the_key_and_round_trip():
    plain = CompilationConfig(level=3)
    ranged = CompilationConfig(level=3, compile_ranges=[(16, 64), [1, 16]])
    assert ranged.compile_ranges == [[1, 16], [16, 64]]
    assert "compile_ranges" not in plain.hash_factors()  # keys made before ranges stay valid
    assert ranged.hash_factors()["compile_ranges"] == [[1, 16], [16, 64]]
    assert ranged.compute_hash() != plain.compute_hash()
    assert ranged.compute_hash() != CompilationConfig(level=3, compile_ranges=[[1, 17]]).compute_hash()
    again = CompilationConfig.from_dict(ranged.to_dict())
    assert again.compute_hash() == ranged.compute_hash()


def test_inspect_lists_ranges_and_range_pieces(cache_root, capsys):
    from atom_compile.cli import main

    model = SillyTwoLayers()
    compiled = _compile(model, compile_ranges=[[2, 9]])
    x = _tokens(3)
    compiled(x)
    capsys.readouterr()
    assert main(["inspect"]) == 0
    assert "compile ranges [[2, 9]]" in capsys.readouterr().out
    (digest,) = [p.name for p in cache_root.glob("torch_compile_cache/*") if re.fullmatch(r"[0-9a-f]{16}", p.name)]
    assert main(["inspect", digest]) == 0
    text = capsys.readouterr().out
    assert "compile_ranges" in text and " 2-9 " in text
