"""Run the Triton kernels' checks (tests/ops/interpreted/) on CPU through Triton's interpreter.

TRITON_INTERPRET is read when triton.language is first imported, so the checks run in a pytest
subprocess that has it set from the start; each check module compares a kernel with the
plain-torch reference over many shapes. The interpreter runs on one core, so the modules' runs
start together, as many at a time as there are cores, and each test waits for its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")
HERE = Path(__file__).parent / "interpreted"


MODULES = ["check_triton_attention.py", "check_triton_glu.py", "check_triton_linear.py", "check_triton_prologues.py",
           "check_triton_rope.py", "check_triton_rope_attention.py", "check_triton_splitk.py"]


def _check(module: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parents[2])


@pytest.fixture(scope="module")
def runs():
    with ThreadPoolExecutor(max_workers=max(1, min(len(MODULES), os.cpu_count() or 1))) as pool:
        yield {module: pool.submit(_check, module) for module in MODULES}


@pytest.mark.parametrize("module", MODULES)
def test_kernel_matches_reference_in_the_interpreter(runs, module):
    proc = runs[module].result()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 5 and "skipped" not in proc.stdout, proc.stdout[-2000:]
