"""The multi-row GEMV of ops/triton_linear.py on the GPU (bf16, compiled, not interpreted): every
shape and both reductions at 2..MAX_M rows against F.linear, and `atom::small_m_linear` taking
it for a narrow layer under ATOM_COMPILE_SMALL_M_ROWS=gemv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
triton_linear = pytest.importorskip("atom_compile.ops.triton_linear")


def _case(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    return x, w, b, torch.nn.functional.linear(x.float(), w.float(), b.float())


@pytest.mark.parametrize("m", [2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (1000, 130)])
def test_every_gemv_shape_bf16_matches_linear(m, n, k):
    x, w, b, want = _case(m, n, k, seed=m)
    for config in triton_linear.gemv_configs(k, m):
        for defer in (False, True) if config[1] < k else (False,):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=x.dtype)
            try:
                triton_linear._launch(x, w, b, out, config, mode="gemv", defer=defer)
            except triton_linear.OutOfResources:  # a tile this GPU's shared memory cannot hold
                continue
            torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2, msg=f"{config} defer={defer}")


def test_op_takes_the_gemv_when_configured(monkeypatch):
    from atom_compile.ops import linear

    monkeypatch.setenv("ATOM_COMPILE_SMALL_M_ROWS", "gemv")
    monkeypatch.setattr(triton_linear, "_rows_mode", None)
    monkeypatch.setattr(triton_linear, "_tuned", {})
    x, w, b, want = _case(6, 2048, 2048)
    got = linear.op()(x.view(2, 3, 2048), w, b)
    torch.testing.assert_close(got.float(), want.view(2, 3, 2048), atol=2e-2, rtol=2e-2)
    assert list(triton_linear._tuned) == [(8, 2048, 2048, torch.bfloat16, True)]  # 6 rows padded to 8
    monkeypatch.setenv("ATOM_COMPILE_SMALL_M_ROWS", "dot")
    monkeypatch.setattr(triton_linear, "_rows_mode", None)
    monkeypatch.setattr(triton_linear, "_tuned", {})
    linear.op()(x, w, b)
    assert not triton_linear._tuned  # a narrow layer at 6 rows: F.linear
