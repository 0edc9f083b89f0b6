"""backend="atom": torch's torch_dynamo_backends entry point, options onto CompilationConfig."""

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from atom_compile import ConfigError, compilation_counter
from atom_compile.backends.dynamo_entry import atom_backend, config_from_options

ROOT = Path(__file__).resolve().parents[2]


def _registered() -> bool:
    return any(ep.value == "atom_compile.backends.dynamo_entry:atom_backend"
               for ep in entry_points(group="torch_dynamo_backends") if ep.name == "atom")


def test_pyproject_declares_the_entry_point():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.torch_dynamo_backends]\natom = "atom_compile.backends.dynamo_entry:atom_backend"' in text


def test_options_map_onto_the_config_with_its_validation():
    assert int(config_from_options(None).compilation_config.level) == 3
    cc = config_from_options({"level": 2, "compile_sizes": [4]}).compilation_config
    assert int(cc.level) == 2 and cc.compile_sizes == [4]
    assert int(config_from_options({"mode": 1}).compilation_config.level) == 1
    with pytest.raises(ConfigError, match="level"):
        config_from_options({"level": 7})
    with pytest.raises(ConfigError, match="no_such_field"):
        config_from_options({"no_such_field": 1})
    with pytest.raises(ConfigError, match="options"):
        config_from_options([("level", 3)])


def test_the_function_compiles_through_torch_compile_with_options():
    def f(x):
        return torch.relu(x) * 2 + 1

    x = torch.randn(5, 3)
    with compilation_counter.expect(num_graphs_seen=1, num_inductor_compiles=1):
        out = torch.compile(f, backend=atom_backend, options={"level": 2})(x)
    assert torch.allclose(out, f(x))


@pytest.mark.skipif(not _registered(), reason="the installed distribution has no 'atom' entry point "
                    "(pip install -e . from this checkout registers it, as CI does)")
def test_a_process_that_only_imports_torch_uses_backend_atom(tmp_path):
    code = textwrap.dedent("""
        import torch
        def f(x):
            return torch.relu(x) * 2 + 1
        x = torch.randn(5, 3)
        out = torch.compile(f, backend="atom", options={"level": 2})(x)
        assert torch.allclose(out, f(x))
        import atom_compile
        assert atom_compile.compilation_counter.num_inductor_compiles == 1
        print("ok")
    """)
    env = dict(os.environ, ATOM_COMPILE_CACHE_ROOT=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
