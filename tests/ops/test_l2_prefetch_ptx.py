"""The bulk L2 prefetch kernel (ops/l2_prefetch.py) compiled for Hopper (sm_90) on any machine
with Triton's CUDA backend: one `cp.async.bulk.prefetch.L2` per lane, no shared memory."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the CUDA backend
    pytest.skip("needs Triton's CUDA backend", allow_module_level=True)


def test_the_kernel_issues_bulk_l2_prefetches_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from atom_compile.ops import l2_prefetch

    source = ASTSource(fn=l2_prefetch._l2_prefetch_kernel,
                       signature={"base_ptr": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "PER_PROGRAM": "constexpr"},
                       constexprs={"CHUNK": l2_prefetch.CHUNK, "PER_PROGRAM": l2_prefetch.PER_PROGRAM})
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    except RuntimeError as exc:  # pragma: no cover - no ptxas here
        if "ptxas" in str(exc):
            pytest.skip(f"Triton's ptxas is not usable here: {exc}")
        raise
    lines = [line.strip() for line in kernel.asm["ptx"].splitlines()]
    assert sum(line.startswith("cp.async.bulk.prefetch.L2.global") for line in lines) == 1  # one per lane
    assert kernel.metadata.shared == 0
