"""Shared fixtures: an isolated cache root per test, one Inductor cache per session, the
`silly::attention` test op, and the `cuda` marker. Helpers shared by several test files
(run_job, the Llama stepper) are in tests/support/."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

# Tests live in folders that mirror the package's rooms; their shared helpers are the `support`
# package beside this file, importable however pytest was started (root, a folder, one file).
TESTS = Path(__file__).parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import pytest

# One Inductor cache for the whole session, outside the user's: tests stay isolated from the
# machine and later compiles of an identical graph are cheap (our own counters still count them).
_INDUCTOR_DIR = tempfile.mkdtemp(prefix="atom-test-inductor-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_DIR)
# Compile in-process: on a 2-core CI machine a pool of compile workers (each importing torch)
# costs more than it saves, the more so with several test processes at once.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

import atom_compile as ac  # noqa: E402

def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Every test gets its own cache root, a fresh Dynamo and the `atom_compile` logger as it
    found it (the CLI's main(), run in-process, gives that logger its own stderr handler and
    stops propagation: later tests' caplog would see nothing)."""
    root = tmp_path / "atom-cache"
    monkeypatch.setenv("ATOM_COMPILE_CACHE_ROOT", str(root))
    monkeypatch.delenv("ATOM_COMPILE_DISABLE_CACHE", raising=False)
    monkeypatch.delenv("ATOM_COMPILE_DISABLE", raising=False)
    logger = logging.getLogger("atom_compile")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


@pytest.fixture
def cache_root(tmp_path) -> Path:
    return tmp_path / "atom-cache"


def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q + k + v)


_silly_lib = torch.library.Library("silly", "FRAGMENT")
ac.direct_register_custom_op("attention", silly_attention, mutates_args=["out"], target_lib=_silly_lib)
