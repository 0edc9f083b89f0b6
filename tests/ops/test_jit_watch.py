"""Triton compiles after warm-up (ops/jit_watch.py): counted, one warning per kernel and shape,
written next to the pieces the process ran, shown by `inspect`. Triton's interpreter (the only
Triton on CPU) compiles nothing, so the hook is called here as Triton's JIT calls it; the real
compiles are in test_fast_launch_cuda.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from atom_compile.cache import run_stats
from atom_compile.ops import jit_watch

knobs = pytest.importorskip("triton.knobs", reason="needs Triton >= 3.4 (its JIT hooks live in triton.knobs)")


def _jit_compiled(name: str) -> None:
    """What Triton's JIT does after compiling a new specialisation (JITFunction._do_compile)."""
    hook = knobs.runtime.jit_post_compile_hook
    assert hook is not None
    hook(key="k", repr=f"{name}[num_warps=4](x: *bf16)", fn=types.SimpleNamespace(module="mod", name=name),
         compile={}, is_manual_warmup=False, already_compiled=False)


@pytest.fixture
def compiled_cache(tmp_path):
    torch._dynamo.reset()
    cfg = Config(compilation_config=CompilationConfig(level=3, cache_dir=str(tmp_path)))
    fn = torch.compile(nn.Linear(8, 8), backend=ac.backend(cfg), dynamic=True)
    fn(torch.randn(4, 8))
    paths = [p for p in run_stats.active_paths() if str(p).startswith(str(tmp_path))]
    assert len(paths) == 1
    yield tmp_path, paths[0]
    jit_watch.stop_watching()


def test_compiles_after_warmup_are_counted_warned_once_and_inspected(compiled_cache, caplog):
    root, piece_dir = compiled_cache
    ac.mark_warmed_up()  # installs the hook
    jit_watch.stop_watching()
    with compilation_counter.expect(num_triton_compiles_after_warmup=0):
        _jit_compiled("before_warmup")  # not warm: not counted
    ac.mark_warmed_up()
    assert json.loads((piece_dir / "run_stats.json").read_text())["triton_compiles_after_warmup"] == 0
    caplog.set_level(logging.WARNING, logger="atom_compile")
    with compilation_counter.expect(num_triton_compiles_after_warmup=3):
        with jit_watch.launching((torch.zeros(3, 32, 64, dtype=torch.bfloat16), 7)):
            _jit_compiled("attention")
            _jit_compiled("attention")  # the same kernel and shapes: counted, not warned again
        _jit_compiled("merge")
    warnings = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(warnings) == 2
    assert "mod.attention" in warnings[0] and "(3, 32, 64) bfloat16, 7" in warnings[0]
    stats = json.loads((piece_dir / "run_stats.json").read_text())
    assert stats["triton_compiles_after_warmup"] == 3 and len(stats["events"]) == 3
    cache_hash = piece_dir.parents[1].name  # <root>/torch_compile_cache/<hash>/rank_0/<prefix>
    shown = subprocess.run([sys.executable, "-m", "atom_compile.cli", "inspect", "--cache-root", str(root), cache_hash],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "3 Triton compiles after warm-up in the last run" in shown.stdout
    assert "Triton JIT compile of mod.attention for (3, 32, 64) bfloat16, 7" in shown.stdout
    ac.mark_warmed_up()  # a new run's warm-up ends: a new count
    assert json.loads((piece_dir / "run_stats.json").read_text())["triton_compiles_after_warmup"] == 0


def test_a_damaged_stats_file_reads_as_absent(compiled_cache):
    root, piece_dir = compiled_cache
    ac.mark_warmed_up()
    (piece_dir / "run_stats.json").write_text('{"triton_compiles_after_warmup": "many", "events": []}')
    assert run_stats.read(root, piece_dir) is None
    (piece_dir / "run_stats.json").write_text("not json")
    assert run_stats.read(root, piece_dir) is None
