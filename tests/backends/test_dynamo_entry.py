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
from support.isa import seeded

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
    # the root holds the session's CPU ISA answer (tests/support/isa.py): the entry point is the subject
    env = dict(os.environ, ATOM_COMPILE_CACHE_ROOT=str(seeded(tmp_path / "cache")))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


# --- ATOM_COMPILE_CONFIG: the config from the environment; options override it -------------

def test_the_environment_gives_the_config_and_options_override_it(tmp_path):
    cc = config_from_options(None, '{"level": 2, "compile_sizes": [4]}').compilation_config
    assert int(cc.level) == 2 and cc.compile_sizes == [4]
    cc = config_from_options({"mode": 1}, '{"level": 2, "compile_sizes": [4]}').compilation_config
    assert int(cc.level) == 1 and cc.compile_sizes == [4]  # field by field; the level is the options'
    assert int(config_from_options(None, '{"compile_sizes": [4]}').compilation_config.level) == 3
    path = tmp_path / "atom.yaml"
    path.write_text("level: 2\ncompile_ranges: [[2, 8]]\n")
    assert config_from_options(None, str(path)).compilation_config.compile_ranges == [[2, 8]]
    (tmp_path / "atom.json").write_text('{"level": 1}')
    assert int(config_from_options(None, str(tmp_path / "atom.json")).compilation_config.level) == 1
    with pytest.raises(ConfigError, match=r"^ATOM_COMPILE_CONFIG: .*not valid JSON"):
        config_from_options(None, '{"level": 2')
    with pytest.raises(ConfigError, match=r"^ATOM_COMPILE_CONFIG: compilation_config: got 'no_such_field'"):
        config_from_options(None, '{"no_such_field": 1}')
    with pytest.raises(ConfigError, match=r"^ATOM_COMPILE_CONFIG: CompilationConfig.level: got 7"):
        config_from_options({"compile_sizes": [4]}, '{"level": 7}')
    with pytest.raises(ConfigError, match=r"^ATOM_COMPILE_CONFIG: .*neither a JSON object nor an existing file"):
        config_from_options(None, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=r"^ATOM_COMPILE_CONFIG: .*holds a list"):
        config_from_options(None, "[3]")
    path.write_text("level: [\n")
    with pytest.raises(ConfigError, match=r"^ATOM_COMPILE_CONFIG: .*not valid YAML"):
        config_from_options(None, str(path))
    assert int(config_from_options({"level": 1}, '{"level": 7}').compilation_config.level) == 1  # overridden


@pytest.mark.skipif(not _registered(), reason="the installed distribution has no 'atom' entry point "
                    "(pip install -e . from this checkout registers it, as CI does)")
def test_a_process_that_only_imports_torch_takes_the_config_from_the_environment(tmp_path):
    code = textwrap.dedent("""
        import os
        import torch
        def f(x):
            return torch.relu(x) * 2 + 1
        x = torch.randn(5, 3)
        out = torch.compile(f, backend="atom")(x)   # level 1 from ATOM_COMPILE_CONFIG: nothing compiles
        assert torch.allclose(out, f(x))
        import atom_compile
        counters = atom_compile.compilation_counter
        assert (counters.num_graphs_seen, counters.num_inductor_compiles, counters.num_eager_compiles) == (1, 0, 0)
        os.environ["ATOM_COMPILE_CONFIG"] = '{"level": 1, "no_such_field": 2}'
        torch._dynamo.reset()
        try:
            torch.compile(f, backend="atom")(x)
        except Exception as exc:  # torch wraps it (BackendCompilerFailed), our message inside
            print("error:", exc)
    """)
    env = dict(os.environ, ATOM_COMPILE_CACHE_ROOT=str(tmp_path / "cache"),
               ATOM_COMPILE_CONFIG='{"level": 1, "splitting_ops": []}')
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ConfigError: ATOM_COMPILE_CONFIG: compilation_config: got 'no_such_field'; allowed: one of" \
        in done.stdout, done.stdout
