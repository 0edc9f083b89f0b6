"""Compile our PDL kernels for Hopper (sm_90) without a GPU and report, per variant, whether the
kernel is launched with PDL and how many global loads its PTX issues before and after its
`griddepcontrol.wait`. Run as a script (by tests/ops/test_hopper_ptx.py): prints one JSON line
per variant."""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from atom_compile.ops.triton_attention_kernels import _attention_kernel, _write_kv_kernel  # noqa: F401
from atom_compile.ops.triton_glu import _gate_up_glu_kernel
from atom_compile.ops.triton_linear import _small_m_linear_kernel
from atom_compile.ops.triton_rope import _qkv_rope_kernel, _rope_rows_kernel
from atom_compile.ops.triton_rowwise import _act_mul_kernel, _add_rms_norm_kernel
from atom_compile.ops.triton_splitk import _split_k_kernel

TARGET = GPUTarget("cuda", 90, 32)
INT_POINTERS = {"cnt_ptr", "tickets_ptr", "tables_ptr", "token_seq_ptr", "query_pos_ptr", "slot_ptr"}
FLOATS = {"eps", "scale"}


def _type(name: str) -> str:
    if name in INT_POINTERS:
        return "*i32"
    if name in ("acc_ptr", "part_ptr", "cos_ptr", "sin_ptr", "ss_ptr", "clr_ptr"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in FLOATS else "i32"


def compile_for_hopper(fn, constexprs: dict, num_warps: int):
    signature = {n: "constexpr" if n in constexprs else _type(n) for n in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps, "launch_pdl": True})


def load_order(ptx: str) -> tuple[int, int, int]:
    """(waits, global loads before the first wait, global loads after it)."""
    lines = ptx.splitlines()
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    first = waits[0] if waits else len(lines)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    return len(waits), sum(i < first for i in loads), sum(i > first for i in loads)


def _linear(prefetch: bool, **extra) -> dict:
    c = dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, USE_DOT=False, IEEE=False, PDL=True,
             NORM=False, ADD=False, SILU_MUL=False, PREFETCH=prefetch, EPI_SS=False, SS_SCALE=False)
    c.update(extra)
    return c


VARIANTS = [
    ("gemv", _small_m_linear_kernel, _linear(False), 2),
    ("gemv+prefetch", _small_m_linear_kernel, _linear(True), 2),
    ("gemv k-loop+prefetch", _small_m_linear_kernel, _linear(True, BLOCK_K=512), 2),
    ("add-norm gemv", _small_m_linear_kernel, _linear(False, NORM=True, ADD=True), 2),
    ("add-norm gemv+prefetch", _small_m_linear_kernel, _linear(True, NORM=True, ADD=True), 2),
    ("silu-mul gemv+prefetch", _small_m_linear_kernel, _linear(True, SILU_MUL=True), 2),
    ("gemv with the split norm's add and squares", _small_m_linear_kernel, _linear(False, EPI_SS=True), 2),
    ("silu-mul gemv with the split norm's add and squares+prefetch", _small_m_linear_kernel,
     _linear(True, SILU_MUL=True, EPI_SS=True), 2),
    ("gemv scaled by the split norm's sum+prefetch", _small_m_linear_kernel, _linear(True, SS_SCALE=True), 2),
    ("padded dots", _small_m_linear_kernel, _linear(False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, USE_DOT=True), 4),
    ("padded dots+prefetch", _small_m_linear_kernel,
     _linear(True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, USE_DOT=True), 4),
    ("attention", _attention_kernel, dict(GROUP=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=64, HEAD_DIM=64, D_PAD=64,
                                          S_PAD=32, IEEE=False, WRITE_KV=False, PDL=True, PREFETCH=False, ROPE=0), 4),
    ("attention+write", _attention_kernel, dict(GROUP=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=64, HEAD_DIM=64, D_PAD=64,
                                                S_PAD=32, IEEE=False, WRITE_KV=True, PDL=True, PREFETCH=False, ROPE=0), 4),
    ("attention+write+prefetch", _attention_kernel,
     dict(GROUP=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=64, HEAD_DIM=64, D_PAD=64, S_PAD=32, IEEE=False,
          WRITE_KV=True, PDL=True, PREFETCH=True, ROPE=0), 4),
    ("attention+write+rope", _attention_kernel,  # the angles' loads after the wait
     dict(GROUP=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=64, HEAD_DIM=64, D_PAD=64, S_PAD=32, IEEE=False,
          WRITE_KV=True, PDL=True, PREFETCH=False, ROPE=2), 4),
    ("attention+write+rope+prefetch", _attention_kernel,  # the first tile before the wait, the angles after
     dict(GROUP=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=64, HEAD_DIM=64, D_PAD=64, S_PAD=32, IEEE=False,
          WRITE_KV=True, PDL=True, PREFETCH=True, ROPE=2), 4),
    ("add-rms-norm", _add_rms_norm_kernel, dict(ADD=True, BLOCK_K=2048, PDL=True), 4),
    ("silu-mul", _act_mul_kernel, dict(BLOCK_K=1024, ACT=0, PDL=True), 4),
    ("gate_up gemv with the gelu-mul epilogue", _gate_up_glu_kernel,
     dict(BLOCK_N=1, BLOCK_K=2048, ACT=1, PDL=True, SS_SCALE=False), 2),
    ("gate_up gemv scaled by the split norm's sum", _gate_up_glu_kernel,
     dict(BLOCK_N=1, BLOCK_K=2048, ACT=0, PDL=True, SS_SCALE=True), 2),
    ("qkv gemv with the rope epilogue", _qkv_rope_kernel, dict(HAS_BIAS=True, HALF=32, BLOCK_P=1, BLOCK_K=2048, PDL=True), 2),
    ("rope rows", _rope_rows_kernel, dict(HALF=32, BLOCK_P=256, PDL=True), 4),
    ("split-k", _split_k_kernel,
     dict(HAS_BIAS=True, BLOCK_N=16, BLOCK_K=256, SPLIT=4, PDL=True, PREFETCH=False, ACT=-1), 4),
    ("split-k+prefetch", _split_k_kernel,
     dict(HAS_BIAS=False, BLOCK_N=32, BLOCK_K=128, SPLIT=8, PDL=True, PREFETCH=True, ACT=-1), 4),
    ("split-k with the silu-mul epilogue", _split_k_kernel,
     dict(HAS_BIAS=False, BLOCK_N=32, BLOCK_K=128, SPLIT=1, PDL=True, PREFETCH=False, ACT=0), 4),
]


def every_shape() -> None:
    """Every block shape the multi-row paths may time or derive (split-K, its prefetching twin
    and its gated form, the padded dots): it compiles for sm_90, and the shared memory it asks for."""
    from atom_compile.ops import triton_linear, triton_splitk

    for shape in triton_splitk.CONFIGS:
        block_n, block_k, split, warps = shape
        for prefetch in (False, True):
            kernel = compile_for_hopper(_split_k_kernel, dict(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k,
                                                              SPLIT=split, PDL=True, PREFETCH=prefetch, ACT=-1),
                                        warps)
            print(json.dumps({"kernel": "split-k", "shape": shape, "shared": kernel.metadata.shared}), flush=True)
        gated = triton_splitk.glu_config(shape)
        if gated is not None:  # the same shape's gated form: half its columns from each weight
            kernel = compile_for_hopper(_split_k_kernel, dict(HAS_BIAS=False, BLOCK_N=gated[0], BLOCK_K=block_k,
                                                              SPLIT=1, PDL=True, PREFETCH=False, ACT=0), warps)
            print(json.dumps({"kernel": "split-k glu", "shape": gated, "shared": kernel.metadata.shared}), flush=True)
    for shape in (c for c in triton_linear.CONFIGS if triton_linear._fits(c, 16)):
        block_n, block_k, warps = shape
        kernel = compile_for_hopper(_small_m_linear_kernel, _linear(True, BLOCK_M=16, BLOCK_N=block_n,
                                                                    BLOCK_K=block_k, USE_DOT=True), warps)
        print(json.dumps({"kernel": "padded dots", "shape": shape, "shared": kernel.metadata.shared}), flush=True)


def main() -> None:
    if sys.argv[1:] == ["--every-shape"]:
        every_shape()
        return
    for name, fn, constexprs, warps in VARIANTS:
        kernel = compile_for_hopper(fn, constexprs, warps)
        waits, before, after = load_order(kernel.asm["ptx"])
        print(json.dumps({"name": name, "prefetch": bool(constexprs.get("PREFETCH")),
                          "launch_pdl": bool(getattr(kernel.metadata, "launch_pdl", False)),
                          "waits": waits, "before": before, "after": after}), flush=True)


if __name__ == "__main__":
    main()
