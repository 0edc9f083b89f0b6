"""Our PDL kernels compiled for Hopper (sm_90) on any machine with Triton's CUDA backend (no GPU
needed): each is launched with PDL and waits for the kernel before; a plain variant issues no
global load before that wait (it reads nothing the kernel before may still be writing), and a
prefetching variant (what a CUDA graph records, ops/pdl.py prefetch) issues its constant
operands' loads before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget  # noqa: F401
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:  # pragma: no cover - a Triton without the CUDA backend
    pytest.skip("needs Triton's CUDA backend", allow_module_level=True)

ROOT = Path(__file__).parents[2]


# the shared memory one block of an H100 or H200 may ask for (227 KiB)
HOPPER_SHARED = 232448


def _compile(tmp_path, *args) -> list[dict]:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/ops/hopper/ptx_order.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not on this machine")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_multi_row_block_shape_compiles_and_fits_hopper(tmp_path):
    from atom_compile.ops import triton_linear, triton_splitk

    rows = _compile(tmp_path, "--every-shape")
    dots = [c for c in triton_linear.CONFIGS if triton_linear._fits(c, 16)]
    gated = [c for c in map(triton_splitk.glu_config, triton_splitk.CONFIGS) if c is not None]
    assert gated and len(rows) == 2 * len(triton_splitk.CONFIGS) + len(gated) + len(dots), rows
    for row in rows:
        assert 0 < row["shared"] <= HOPPER_SHARED, row


def test_plain_variants_read_nothing_before_the_wait_and_prefetching_ones_do(tmp_path):
    rows = _compile(tmp_path)
    assert len(rows) == 25, rows
    for row in rows:
        assert row["launch_pdl"] and row["waits"] >= 1, row
        assert row["after"] > 0, row  # the inputs the kernel before wrote are read after the wait
        if row["prefetch"]:
            assert row["before"] > 0, row
        else:
            assert row["before"] == 0, row
