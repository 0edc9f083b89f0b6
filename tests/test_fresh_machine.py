"""The README's fresh-machine commands work as written: a new venv (`python -m venv`), a new
HOME, the package installed from this checkout with its test extra, then the tests.

Opt-in, since it installs torch (minutes, GBs): ATOM_TEST_FRESH_VENV=1 runs the smoke part of
the suite there, ATOM_TEST_FRESH_VENV=full all of it. Skipped, with the reason, where pip reaches
no package index. .ci/run runs the full version as its second run.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from support import fresh_venv

MODE = os.environ.get("ATOM_TEST_FRESH_VENV", "")


def test_the_readme_names_the_commands_this_test_runs():
    """Always on: the section this test follows exists and says what a CPU-only user runs."""
    cpu = fresh_venv.readme_commands()
    assert any("download.pytorch.org/whl/cpu" in line for line in cpu.setup), cpu.setup
    assert re.fullmatch(r'pip install -e "\.\[test\]"', cpu.install), cpu.install
    assert cpu.test == "python -m pytest -q"
    gpu = fresh_venv.readme_commands(gpu=True)
    assert "triton" in gpu.install and gpu.test == cpu.test


def test_a_full_run_names_its_slowest_tests_a_smoke_run_its_files():
    """CI's run 2 (--full) prints the suite's slowest tests; the README's command is kept as written."""
    readme = fresh_venv.readme_commands()
    commands = fresh_venv.Commands(setup=[], install=readme.install, test=readme.test)
    full = fresh_venv.script(commands, smoke=False).splitlines()[-1]
    assert full == readme.test + " --durations=15", full
    smoke = fresh_venv.script(commands, smoke=True).splitlines()[-1]
    assert smoke == readme.test + " " + " ".join(fresh_venv.SMOKE), smoke


def test_the_fresh_venv_keeps_nothing_of_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("ATOM_COMPILE_CACHE_ROOT", "/elsewhere")
    env = fresh_venv.fresh_env(tmp_path)
    assert env["HOME"] == str(tmp_path)
    assert not [k for k in env if k.startswith(("PYTHON", "ATOM_", "TORCH", "VIRTUAL_ENV"))], sorted(env)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(MODE not in ("1", "full"), reason="installs torch in a new venv (minutes, GBs): "
                    "set ATOM_TEST_FRESH_VENV=1 (smoke part of the suite) or =full (all of it)")
def test_readme_commands_in_a_fresh_venv(tmp_path):
    log_path = tmp_path / "fresh.log"
    with open(log_path, "w") as log:
        code = fresh_venv.run(tmp_path, smoke=MODE != "full", gpu=torch.cuda.is_available(), log=log)
    text = log_path.read_text()
    if code == fresh_venv.NO_INDEX:
        pytest.skip("pip reaches no package index here (network or PyPI unreachable): " + text[-500:])
    assert code == 0, text[-6000:]
    assert re.search(r"^fresh venv: torch \S+", text, re.M), text[-2000:]
    assert re.search(r"^\d+ passed", text, re.M) or " passed" in text.splitlines()[-1], text[-2000:]
    print(re.search(r"^fresh venv: torch .*$", text, re.M).group(0))
