"""Shared fixtures of the CLI tests: one cold `warm` (the tiny Llama, 2 layers, compile size 4)
per session makes the cache every test reads; destructive tests work on a copy. New roots start
with the session's CPU ISA answer (tests/support/isa.py): the probe is not what the CLI shows.

`pytest --update-golden` (or ATOM_UPDATE_GOLDEN=1) rewrites tests/cli/golden/ from this run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_helpers import MODEL, SIZES, run
from support.isa import seeded


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/cli/golden/*.txt from this run's CLI output")


@pytest.fixture(scope="session")
def update_golden(request) -> bool:
    return bool(request.config.getoption("--update-golden", default=False)) or os.environ.get("ATOM_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict:
    """The subprocesses' environment: an Inductor cache of their own, no inherited root, our
    worktree first on the path, no log level forced."""
    out = dict(os.environ)
    out["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), out.get("PYTHONPATH")]))
    for name in ("ATOM_COMPILE_CACHE_ROOT", "ATOM_COMPILE_DISABLE_CACHE", "ATOM_COMPILE_LOG"):
        out.pop(name, None)
    return out


@pytest.fixture(scope="session")
def warmed(env, tmp_path_factory) -> dict:
    """One cold warm into a fresh root; its JSON report plus the root."""
    root = seeded(tmp_path_factory.mktemp("warmed") / "root")
    proc = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["cache_hashes"]) == 1
    report["root"] = root
    report["hash"] = report["cache_hashes"][0]
    report["stderr"] = proc.stderr
    return report


@pytest.fixture(scope="session")
def imported(env, warmed, tmp_path_factory) -> dict:
    """export -> import into a fresh root -> warm there (text output): the round trip."""
    base = tmp_path_factory.mktemp("imported")
    archive, fresh = base / "cache.tar.gz", base / "fresh"
    exported = run(env, "export", warmed["hash"], "-o", str(archive), "--cache-root", str(warmed["root"]))
    assert exported.returncode == 0, exported.stderr
    placed = run(env, "import", str(archive), "--cache-root", str(seeded(fresh)))
    assert placed.returncode == 0, placed.stderr
    warm = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(fresh))
    assert warm.returncode == 0, warm.stderr
    return {"archive": archive, "root": fresh, "export": exported, "import": placed, "warm": warm}
