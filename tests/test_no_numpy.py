"""atom-compile needs no numpy at run time: torch does not depend on it, so a fresh machine may
not have it. Each check runs in a real subprocess in which `import numpy` fails as it does where
numpy is not installed (a sitecustomize on PYTHONPATH hides numpy from every import finder)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.jobs import run_job

_BLOCKER = '''
import sys


class _WithoutNumpy:
    """A finder that never finds numpy: `import numpy` raises ModuleNotFoundError and
    importlib.util.find_spec("numpy") is None, as where numpy is not installed."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "numpy" or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self._finder, name)


sys.meta_path[:] = [_WithoutNumpy(finder) for finder in sys.meta_path]
'''

# A warning torch itself prints ("Failed to initialize NumPy", say) is torch's business, not
# ours: the checks below never depend on it being printed or not.
_TORCH_WARNING = re.compile(r"[/\\]torch[/\\].*\.py:\d+: \w*Warning: ")


@pytest.fixture(scope="module")
def no_numpy_env(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("no-numpy-site")
    (site / "sitecustomize.py").write_text(_BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return env


def _about_numpy(stderr: str) -> list[str]:
    """Lines that mention numpy and are not one of torch's own warnings."""
    return [line for line in stderr.splitlines() if "numpy" in line.lower() and not _TORCH_WARNING.search(line)]


def _python(env: dict, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_blocker_makes_numpy_unimportable(no_numpy_env):
    proc = _python(no_numpy_env, "import importlib.util; print(importlib.util.find_spec('numpy')); import numpy")
    assert proc.stdout.strip() == "None", proc.stdout
    assert proc.returncode == 1 and "ModuleNotFoundError: No module named 'numpy'" in proc.stderr, proc.stderr


def test_import_atom_compile_without_numpy(no_numpy_env):
    code = ("import sys, atom_compile, atom_compile.cli, atom_compile.models, atom_compile.runtime; "
            "print(atom_compile.__version__, 'numpy' in sys.modules)")
    proc = _python(no_numpy_env, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "False"
    assert _about_numpy(proc.stderr) == [], proc.stderr


def test_level3_compile_warm_start_and_inspect_without_numpy(no_numpy_env, tmp_path):
    """Also the cache's plain torch.compile case (tests/cache/test_cache.py): a second process
    loads every piece the first compiled, Dynamo still traces."""
    root = tmp_path / "root"  # not seeded: the first process probes the CPU ISA, without numpy too
    cold = run_job("--cache-root", str(root), "--plain", env=no_numpy_env)
    assert cold["counters"]["num_inductor_compiles"] == 3 and cold["max_abs_err"] < 1e-4
    assert _about_numpy(cold["stderr"]) == [], cold["stderr"]
    warm = run_job("--cache-root", str(root), "--plain", env=no_numpy_env)  # loads what cold stored
    assert warm["counters"]["num_inductor_compiles"] == 0, warm["counters"]
    assert warm["counters"]["num_compiled_artifacts_loaded"] == 3, warm["counters"]
    assert warm["counters"]["num_graphs_seen"] == 1, warm["counters"]  # Dynamo traces, every piece loads
    assert warm["output_sha256"] == cold["output_sha256"]
    assert _about_numpy(warm["stderr"]) == [], warm["stderr"]

    proc = subprocess.run([sys.executable, "-m", "atom_compile.cli", "inspect", "--json", "--cache-root", str(root)],
                          capture_output=True, text=True, env=no_numpy_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout), proc.stdout
    assert "Traceback" not in proc.stderr and _about_numpy(proc.stderr) == [], proc.stderr
    assert Path(root / "torch_compile_cache").is_dir()
