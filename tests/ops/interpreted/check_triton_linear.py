"""The small-M Triton linear against F.linear, on CPU through Triton's interpreter
(TRITON_INTERPRET=1): every row count up to MAX_M, every block shape of the dot and the GEMV
paths, ragged N and K, bias or none, fp16 (bf16 runs on the GPU in the cuda-marked test), and
the choice ATOM_COMPILE_SMALL_M_ROWS makes between them."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tri():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/ops/test_interpreted.py"
    from atom_compile.ops import triton_linear

    return triton_linear


def _set_rows(monkeypatch, tri, value):
    # the mode is read once per process: set the variable and forget the value read so far
    if value is None:
        monkeypatch.delenv("ATOM_COMPILE_SMALL_M_ROWS", raising=False)
    else:
        monkeypatch.setenv("ATOM_COMPILE_SMALL_M_ROWS", value)
    monkeypatch.setattr(tri, "_rows_mode", None)


def _case(m, n, k, bias, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    return x, w, b, want


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_every_block_shape_matches_linear(tri, m):
    x, w, b, want = _case(m, 70, 300, bias=m % 2 == 1, seed=m)
    block_m = tri._block_m(m, "dot")
    for config in [c for c in tri.CONFIGS if tri._fits(c, block_m)]:
        out = torch.full((m, 70), float("nan"), dtype=x.dtype)
        tri._launch(x, w, b, out, config, mode="dot")
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3, msg=f"config {config}")


def test_entry_point_and_supported(tri, monkeypatch):
    _set_rows(monkeypatch, tri, None)  # the default: `dot`
    x, w, b, want = _case(4, 33, 64, bias=True)
    torch.testing.assert_close(tri.small_m_linear(x, w, b).float(), want, atol=2e-3, rtol=2e-3)
    assert tri.supported(x[:1], w, b)  # one row: the GEMV
    for k in (64, 130, 3000):  # the untuned one-row shape: a step no longer than K, or a K loop
        x1, w1, b1, want1 = _case(1, 33, k, bias=True, seed=k)
        assert tri.gemv_config(k)[1] <= max(16, 1 << (k - 1).bit_length())
        torch.testing.assert_close(tri.small_m_linear(x1, w1, b1).float(), want1, atol=1e-2, rtol=1e-2)
    assert not tri.supported(x, w, b)  # 4 rows of a narrow layer: cuBLAS was faster
    wide = torch.zeros(tri.DOT_MIN_N, 64, dtype=x.dtype)
    assert tri.supported(x, wide, None)  # 4 rows of an LM-head-wide layer: the padded dots
    assert not tri.supported(x.float(), w.float(), None)  # fp32 stays with F.linear
    assert not tri.supported(torch.randn(9, 64).half(), w, None)  # more rows than MAX_M
    assert not tri.supported(x, w.t().contiguous().t(), None)  # a transposed weight
    assert not tri.supported(x, w, b[:-1])  # a bias of the wrong length


@pytest.mark.parametrize("m", range(2, 9))
def test_multi_row_gemv_every_shape_matches_linear(tri, m):
    # K 1100: one step (masked), two or three steps with a ragged last one, per shape
    n, k = 37, 1100
    x, w, b, want = _case(m, n, k, bias=m % 2 == 0, seed=10 + m)
    if m == 5:  # rows further apart than K
        x = torch.cat([x, torch.zeros(m, 20, dtype=x.dtype)], dim=1)[:, :k]
    block_m = tri._block_m(m, "gemv")
    assert block_m == 1 << (m - 1).bit_length()
    configs = tri.gemv_configs(k, m)
    assert configs[0] == tri.gemv_config(k, m) and len(configs) >= 6
    assert {c[1] for c in configs} >= {512, 1024, 2048}  # clamped to K's power of two, looped below it
    for config in configs:
        block_n, block_k, warps = config
        assert block_m * block_n * block_k <= tri.GEMV_REGS * 32 * warps
        # the reduction every K step, and (several steps only) once at the end
        for defer in (False, True) if block_k < k else (False,):
            out = torch.full((m, n), float("nan"), dtype=x.dtype)
            tri._launch(x, w, b, out, config, mode="gemv", defer=defer)
            torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3, msg=f"config {config} {defer}")
    assert not tri._fits((4, 2048, 4), 8) and tri._fits((4, 2048, 4), 2)  # 256 vs 64 products a thread


def test_gemv_configs_keep_the_one_row_shape(tri):
    assert [tri.gemv_config(k) for k in (64, 2048, 3000, 8192)] == [(2, 64, 2), (2, 2048, 2), (2, 4096, 4),
                                                                     (2, 4096, 4)]
    assert tri.gemv_config(64, 3)[1] == 64 and tri.gemv_config(8192, 8) == (2, 1024, 8)


def test_rows_mode_routes_two_to_eight_rows(tri, monkeypatch):
    x, w, b, want = _case(3, 45, 200, bias=True, seed=3)
    wide = torch.zeros(tri.DOT_MIN_N, 200, dtype=x.dtype)
    _set_rows(monkeypatch, tri, "gemv")
    assert tri.rows_mode() == "gemv"
    assert tri.supported(x, w, b) and tri.supported(x, wide, None)  # every N
    assert not tri.supported(torch.randn(9, 200).half(), w, None)  # still at most MAX_M rows
    monkeypatch.setattr(tri, "_tuned", {})
    torch.testing.assert_close(tri.small_m_linear(x, w, b).float(), want, atol=2e-3, rtol=2e-3)
    assert list(tri._tuned) == [(4, 45, 200, x.dtype, True)]  # 3 rows padded to 4: the GEMV
    monkeypatch.setenv("ATOM_COMPILE_SMALL_M_ROWS", "dot")
    assert tri.rows_mode() == "gemv"  # read once per process
    _set_rows(monkeypatch, tri, " DOT ")
    assert not tri.supported(x, w, b) and tri.supported(x, wide, None)  # LM-head-wide only
    assert tri._block_m(3) == 16 and tri._block_m(1) == 1
    _set_rows(monkeypatch, tri, "tensor")
    from atom_compile.errors import AtomValueError

    with pytest.raises(AtomValueError, match="ATOM_COMPILE_SMALL_M_ROWS: got 'tensor'"):
        tri.supported(x, w, b)
    assert tri.supported(x[:1], w, b)  # one row never reads it
