"""The gate_up GEMV with the activation-and-mul epilogue (ops/triton_glu.py) against the model's
own PyTorch (two projections rounded to the dtype, F.silu or F.gelu's tanh form, the product),
on CPU through Triton's interpreter (TRITON_INTERPRET=1): merged and separate weights, either
order of the halves, ragged N and K (one step and a K loop), other block shapes, fp16 and bf16."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def glu():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through TRITON_INTERPRET=1"
    from atom_compile.ops import triton_glu

    return triton_glu


def _reference(x, wg, wu, activation):
    from atom_compile.ops.glu_linear import activate

    gate = torch.nn.functional.linear(x.float(), wg.float()).to(x.dtype)
    up = torch.nn.functional.linear(x.float(), wu.float()).to(x.dtype)
    return activate(gate, activation) * up


F16, BF16 = torch.float16, torch.bfloat16


# each layout in both dtypes and with both activations, each (n, k) twice: ragged N and K, one
# step and a K loop
@pytest.mark.parametrize("n,k,layout,dtype,activation", [
    (37, 48, "merged", F16, "silu"), (37, 48, "merged_up_first", BF16, "gelu_tanh"),
    (96, 300, "separate", F16, "gelu_tanh"), (96, 300, "merged", BF16, "silu"),
    (19, 5000, "merged_up_first", F16, "silu"), (19, 5000, "separate", BF16, "gelu_tanh")])
def test_gate_up_with_the_activation_epilogue(glu, n, k, layout, dtype, activation):
    g = torch.Generator().manual_seed(n * k)
    x = (torch.randn(1, k, generator=g) * 2).to(dtype)
    w = (torch.randn(2 * n, k, generator=g) * 2 / k ** 0.5).to(dtype)
    if layout == "separate":
        wg, wu = w[:n].clone(), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    else:
        wg, wu = (w[:n], w[n:]) if layout == "merged" else (w[n:], w[:n])
    want = _reference(x, wg, wu, activation)
    # bf16 through the interpreter truncates where the GPU rounds: a step at each of 3 roundings
    tol = dict(atol=2e-3, rtol=4e-3) if dtype == torch.float16 else dict(atol=2e-2, rtol=3e-2)
    for config in [glu.glu_config(k)] + ([(4, 128, 4), (1, 64, 2)] if k < 1000 else []):
        out = glu.gate_up_glu(x, wg, wu, activation, config)
        assert out.shape == (1, n) and out.dtype == dtype
        torch.testing.assert_close(out, want, **tol, msg=f"config {config}")


def test_the_config_keeps_the_plain_gemvs_rows_in_flight(glu):
    from atom_compile.ops import triton_linear

    for k in (64, 2048, 8192):
        block_n, block_k, warps = glu.glu_config(k)
        plain = triton_linear.gemv_config(k)
        assert (2 * block_n, block_k, warps) == plain


def test_a_strided_row(glu):
    big = torch.randn(3, 200).to(torch.float16)
    x = big[1:2, 40:104]  # a row of a wider block
    wg, wu = (torch.randn(2, 24, 64) / 8).to(torch.float16)
    want = _reference(x, wg, wu, "silu")
    torch.testing.assert_close(glu.gate_up_glu(x, wg, wu, "silu"), want, atol=2e-3, rtol=4e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_above_one_take_the_activation_and_mul_kernel(dtype):
    from atom_compile.ops import triton_rowwise
    from atom_compile.ops.glu_linear import activate

    g = torch.Generator().manual_seed(6)
    rows = (torch.randn(3, 2 * 300, generator=g) * 3).to(dtype)
    gate, up = rows[:, :300], rows[:, 300:]  # views of the merged projection's rows
    for act in ("silu", "gelu_tanh"):
        want = activate(gate, act) * up
        # bf16 through the interpreter truncates (see above): a step at each of two roundings
        tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float16 else dict(atol=1e-6, rtol=2 ** -6)
        torch.testing.assert_close(triton_rowwise.act_mul(gate, up, act), want, **tol, msg=act)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gates_far_out_in_both_tails(glu, activation):
    # |gate| up to ~60: exp overflows to inf on one side, the activation must not be nan
    x = torch.linspace(-1, 1, 64).to(torch.float32)[None, :]
    wg = (torch.randn(40, 64, generator=torch.Generator().manual_seed(5)) * 12).to(torch.float32)
    wu = torch.ones(40, 64) / 8
    got = glu.gate_up_glu(x, wg, wu, activation)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(x, wg, wu, activation), atol=1e-4, rtol=1e-4)
