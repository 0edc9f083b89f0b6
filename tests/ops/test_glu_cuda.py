"""atom::gate_up_glu on the GPU, bf16 at decode shapes, against the model's own PyTorch: one row
on the epilogue GEMV (one launch), more rows (past the gated split-K form's, test_splitk_cuda.py)
on the projections and the activation-and-mul kernel; a merged gate_up weight's halves (either
order) and weights of their own."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)
pytest.importorskip("triton")

from atom_compile.ops import glu_linear  # noqa: E402
from support.pass_checks import cuda_kernels  # noqa: E402

BF16 = torch.bfloat16


def _weights(n, k, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(2 * n, k, device="cuda", generator=g, dtype=BF16) * 2 / k ** 0.5
    if layout == "separate":
        return w[:n].clone(), w[n:].clone()
    return (w[:n], w[n:]) if layout == "merged" else (w[n:], w[:n])


@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,k", [(8192, 2048), (1000, 130)])
@pytest.mark.parametrize("layout", ["merged", "merged_up_first", "separate"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_op_matches_the_model(m, n, k, layout, activation):
    gate_w, up_w = _weights(n, k, layout, seed=m + k)
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    gate, up = torch.nn.functional.linear(x, gate_w), torch.nn.functional.linear(x, up_w)
    want = glu_linear.activate(gate, activation) * up
    torch.testing.assert_close(glu_linear.op()(x, gate_w, up_w, activation), want, atol=3e-2, rtol=3e-2)


def test_one_row_is_one_launch_and_more_rows_one_activation_kernel(monkeypatch):
    from atom_compile.ops import triton_glu

    monkeypatch.setattr(triton_glu, "SPLIT_K_GLU_ROWS", 0)  # the gated split-K form: test_splitk_cuda.py
    gate_w, up_w = _weights(8192, 2048, "merged", seed=0)
    row = torch.ones(1, 2048, device="cuda", dtype=BF16)
    one = cuda_kernels(lambda: glu_linear.op()(row, gate_w, up_w, "silu"))
    assert len(one) == 1 and "gate_up_glu" in one[0], one
    # four rows: the library GEMM over the merged halves (one, or a split-K pair), then one
    # activation-and-mul kernel, and no PyTorch elementwise kernel
    for act in ("silu", "gelu_tanh"):
        rows = torch.ones(4, 2048, device="cuda", dtype=BF16)
        four = cuda_kernels(lambda: glu_linear.op()(rows, gate_w, up_w, act))
        assert sum("act_mul" in k for k in four) == 1 and len(four) <= 3, four
        assert not any("elementwise" in k.lower() for k in four), four
