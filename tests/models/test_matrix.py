"""Levels, compilers, shape schedules and generate(), each on one representative family."""

from __future__ import annotations

import pytest
import torch

import atom_compile as ac
from atom_compile.counters import compilation_counter

from .families import inputs, tiny_model
from .helpers import config, check_matches_eager


@pytest.mark.parametrize("level, compiler", [(1, "auto"), (2, "inductor_standalone"), (2, "eager"),
                                             (3, "inductor"), (3, "eager")])
def test_levels_and_compilers(level, compiler, model_cache):
    check_matches_eager(tiny_model("llama"), config(level, compiler, model_cache))


def test_mark_dynamic(model_cache):
    check_matches_eager(tiny_model("qwen2"), config(3, "eager", model_cache), dynamic=False, mark=True)


def test_without_fullgraph(model_cache):
    check_matches_eager(tiny_model("qwen2"), config(3, "eager", model_cache), fullgraph=False)


def test_float_restart_is_one_graph_and_one_compile(model_cache):
    """dynamic=True makes RMSNorm's eps and SDPA's scale symbolic floats: Dynamo restarts once,
    and the restart counts as nothing (one graph, each piece compiled once)."""
    before = compilation_counter.clone()
    check_matches_eager(tiny_model("gpt2"), config(2, "inductor_standalone", model_cache))
    assert compilation_counter.num_backend_compilations - before.num_backend_compilations == 1


def test_boundary_is_contiguous_in_the_dump(model_cache, tmp_path):
    cfg = config(3, "eager", model_cache)
    cfg.debug_dump_path = str(tmp_path / "dump")
    check_matches_eager(tiny_model("phi3"), cfg)
    text = "".join(p.read_text() for p in (tmp_path / "dump").rglob("submod_*.py"))
    assert "_contiguous" in text


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_greedy_matches_eager(use_cache, model_cache):
    model = tiny_model("llama")
    x = inputs(2, 6)
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=4, do_sample=False, use_cache=use_cache, pad_token_id=0)
        model.forward = torch.compile(model.forward, backend=ac.backend(config(3, "eager", model_cache)),
                                      dynamic=True)
        got = model.generate(x, max_new_tokens=4, do_sample=False, use_cache=use_cache, pad_token_id=0)
    assert torch.equal(got, want)


def test_unsupported_graph_names_model_and_level(model_cache):
    from atom_compile.backends.unsupported import ModelCompileError

    model = tiny_model("llama")
    cfg = config(2, "inductor_standalone", model_cache)
    cfg.inductor_compile_config = {"no_such_inductor_option": 1}
    compiled = torch.compile(model, backend=ac.backend(cfg), fullgraph=True, dynamic=True)
    with pytest.raises(Exception) as info, torch.no_grad():
        compiled(input_ids=inputs(2, 8), use_cache=False)
    error = info.value
    while error is not None and not isinstance(error, ModelCompileError):
        error = error.__cause__ or error.__context__
    assert error is not None and isinstance(error, ac.AtomCompileError)
    assert "LlamaForCausalLM" in str(error) and "level 2" in str(error)
