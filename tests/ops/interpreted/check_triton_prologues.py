"""The RMSNorm prologue of the one-row GEMV, the norm split between two GEMVs, and the add +
RMSNorm kernel, against the model's
own PyTorch (ops/prologue_linear._reference), on CPU through Triton's interpreter (TRITON_INTERPRET=1):
with and without the residual add, ragged K (one step and a K loop), every one-row block shape,
fp16 and bf16."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through TRITON_INTERPRET=1"
    from atom_compile.ops import prologue_linear, triton_linear, triton_rowwise

    return prologue_linear, triton_linear, triton_rowwise


@pytest.fixture(scope="module")
def forms(kernels):
    from atom_compile.ops import triton_gemv_forms

    return triton_gemv_forms


def _case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    r = torch.randn(m, k, generator=g).to(dtype)
    nw = (1 + torch.randn(k, generator=g) / 4).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    return x, r, nw, w


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [48, 300, 3000])
@pytest.mark.parametrize("add", [False, True])
def test_gemv_with_the_norm_prologue(kernels, forms, dtype, k, add):
    prologue_linear, tri, _ = kernels
    x, r, nw, w = _case(1, 37, k, dtype, seed=k)
    normed, h_want = prologue_linear._reference(x, r if add else None, nw, 1e-5)
    want = torch.nn.functional.linear(normed.float(), w.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    # other block shapes (a K loop of many steps, one weight row a program) at the small K
    for config in [tri.gemv_config(k)] + ([(4, 128, 4), (1, 64, 2)] if k < 1000 else []):
        out = torch.full((1, 37), float("nan"), dtype=dtype)
        h = torch.full_like(x, float("nan")) if add else None
        tri.launch_gemv(x, w, None, out, config, norm=(nw, 1e-5, r if add else None, h))
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=f"config {config}")
        if add:  # the sum rounded as the model's own add
            _same_sum(h, h_want)
    y, h = forms.rms_norm_linear(x, r if add else None, nw, 1e-5, w)
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)
    assert (h is None) == (not add)
    if add:
        _same_sum(h, h_want)


def _same_sum(h, want):
    # fp16: exactly. bf16: the interpreter converts float32 to bf16 by truncation (the GPU
    # rounds to nearest even, as PyTorch does): within one bf16 step
    if h.dtype == torch.float16:
        assert torch.equal(h, want)
    else:
        torch.testing.assert_close(h, want, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 300), (3, 4096)])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_rounds_as_the_model(kernels, dtype, m, k, add):
    prologue_linear, _, norm = kernels
    x, r, nw, _ = _case(m, 8, k, dtype, seed=m * k)
    want, h_want = prologue_linear._reference(x, r if add else None, nw, 1e-6)
    y, h = norm.add_rms_norm(x, r if add else None, nw, 1e-6)
    if add and dtype == torch.bfloat16:  # from the kernel's sum (see _same_sum)
        want = prologue_linear._reference(h, None, nw, 1e-6)[0]
    # the same roundings in the same places: equal but for the float32 sum's order
    torch.testing.assert_close(y, want, atol=1e-6, rtol=2 ** -6)
    assert (h is None) == (not add)
    if add:
        _same_sum(h, h_want)


def test_strided_rows(kernels, forms):
    prologue_linear, tri, norm = kernels
    big = torch.randn(4, 160).to(torch.float16)
    x, r = big[:, :64], big[:, 80:144]  # rows 160 apart
    nw = torch.rand(64).to(torch.float16) + 0.5
    w = torch.randn(16, 64).to(torch.float16) / 8
    want, h_want = prologue_linear._reference(x, r, nw, 1e-5)
    y, h = norm.add_rms_norm(x, r, nw, 1e-5)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=2 ** -6)
    assert torch.equal(h, h_want)
    y1, h1 = forms.rms_norm_linear(x[2:3], r[2:3], nw, 1e-5, w)
    torch.testing.assert_close(y1.float(), torch.nn.functional.linear(want[2:3].float(), w.float()),
                               atol=4e-3, rtol=4e-3)
    assert torch.equal(h1, h_want[2:3])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [40, 300, 5000])
def test_gemv_with_the_silu_mul_prologue(kernels, forms, dtype, k):
    prologue_linear, tri, rowwise = kernels
    g = torch.Generator().manual_seed(k)
    gu = (torch.randn(1, 2 * k, generator=g) * 2).to(dtype)
    gate, up = gu[:, :k], gu[:, k:]  # views of one row, as the gate_up projection's output
    w = (torch.randn(29, k, generator=g) / k ** 0.5).to(dtype)
    act = prologue_linear._silu_mul_reference(gate, up)
    want = torch.nn.functional.linear(act.float(), w.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for config in [tri.gemv_config(k)] + ([(4, 128, 4)] if k < 1000 else []):
        out = torch.full((1, 29), float("nan"), dtype=dtype)
        tri.launch_gemv(gate, w, None, out, config, up=up)
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=f"config {config}")
    torch.testing.assert_close(forms.silu_mul_linear(gate, up, w).float(), want, atol=tol, rtol=tol)
    rows = (torch.randn(3, 2 * k, generator=g) * 2).to(dtype)
    got = rowwise.silu_mul(rows[:, :k], rows[:, k:])
    # bf16 through the interpreter truncates (see _same_sum): one step for each of two roundings
    rtol = 0 if dtype == torch.float16 else 2 ** -6
    torch.testing.assert_close(got, prologue_linear._silu_mul_reference(rows[:, :k], rows[:, k:]),
                               atol=1e-3 if dtype == torch.float16 else 1e-6, rtol=rtol or 1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,silu,glu", [(37, 48, False, False), (300, 300, False, True), (3000, 64, False, False),
                                          (64, 300, True, True)])
def test_a_norm_split_between_two_gemvs(kernels, forms, dtype, n, k, silu, glu):
    """The producer adds the residual, weighs by the norm weight, sums the squares into the
    slot's lanes and zeroes the next pair's slot; the consumer (a GEMV, or the gate_up GEMV
    with its activation) scales by 1 / rms; with `up`, after the SiLU-and-mul prologue."""
    prologue_linear, tri, _ = kernels
    from atom_compile.ops import triton_glu

    x, up, _, w = _case(1, n, k, dtype, seed=n + k)
    g = torch.Generator().manual_seed(n)
    x_in = (torch.nn.functional.silu(x.float()).to(dtype).float() * up.float()).to(dtype) if silu else x
    r = torch.randn(1, n, generator=g).to(dtype)
    nw = (1 + torch.randn(n, generator=g) / 4).to(dtype)
    w2 = (torch.randn(2 * 24, n, generator=g) / n ** 0.5).to(dtype)
    slots = torch.zeros(2, tri.SLOT_FLOATS)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for i in range(4):  # two pairs round two slots, each zeroing the other's
        slot, clear = slots[i % 2], slots[(i + 1) % 2]
        clear.fill_(7.0)  # the last pair's sums
        weighed, h = forms.linear_add_weigh(x, w, r, nw, slot, clear, up=up if silu else None)
        lanes = slice(None, None, 32)  # eight lanes, a 128-byte line apart
        assert not clear[lanes].any() and (clear != 0).sum().item() == tri.SLOT_FLOATS - 8
        y = torch.nn.functional.linear(x_in.float(), w.float())
        atol = tol * max(1.0, y.abs().max().item())  # y rounds before the add (the interpreter truncating bf16)
        torch.testing.assert_close(h.float(), y.to(dtype).float() + r.float(), atol=atol, rtol=tol)
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10  # the interpreter truncates, CUDA rounds
        torch.testing.assert_close(weighed, (h.float() * nw.float()).to(dtype), atol=0, rtol=ulp)
        assert slot[lanes].sum().item() == pytest.approx(h.float().pow(2).sum().item(), rel=1e-4)
        normed = prologue_linear._reference(h, None, nw, 1e-5)[0]
        if glu:
            got = triton_glu.gate_up_glu(weighed, w2[:24], w2[24:], "silu", scale=(1e-5, slot))
            gate, upp = (torch.nn.functional.linear(normed.float(), half.float()).to(dtype) for half in (w2[:24], w2[24:]))
            want = (torch.nn.functional.silu(gate.float()).to(dtype).float() * upp.float()).to(dtype)
        else:
            got = forms.scaled_linear(weighed, w2, 1e-5, slot)
            want = torch.nn.functional.linear(normed.float(), w2.float()).to(dtype)
        torch.testing.assert_close(got.float(), want.float(), atol=2 * tol, rtol=2 * tol)


def test_the_split_norm_refuses_what_it_cannot_take(kernels, forms):
    _, tri, _ = kernels
    x, r, nw, w = _case(1, 8, 16, torch.float16, seed=1)
    slot, clear = torch.zeros(tri.SLOT_FLOATS), torch.zeros(tri.SLOT_FLOATS)
    with pytest.raises(ValueError, match="one row"):
        forms.linear_add_weigh(x.expand(2, 16), w, r[:, :8], nw[:8], slot, clear)
    with pytest.raises(ValueError, match="is not the gate's"):
        forms.linear_add_weigh(x, w, r[:, :8].contiguous(), nw[:8], slot, clear, up=r[:, :8].contiguous())
    with pytest.raises(ValueError, match="float32"):
        forms.linear_add_weigh(x, w, r[:, :8].contiguous(), nw[:8], slot.double(), clear)
    with pytest.raises(ValueError, match="float32"):
        forms.scaled_linear(x, w, 1e-5, slot[:8])
    with pytest.raises(ValueError, match="one row"):
        forms.scaled_linear(x.expand(2, 16), w, 1e-5, slot)
