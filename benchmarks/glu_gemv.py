"""Kernel micro-benchmark: the gate_up GEMV with the activation as its epilogue (glu_pass's
atom::gate_up_glu at one token) against what decode runs without it.

For the gated MLPs of Llama-3.2-1B (gate_up 2 x 8192 x 2048) and Llama-3.1-8B (2 x 14336 x
4096), bf16, one row: microseconds per call and the weight-read bandwidth of
- `gemv+silu`: the one-row GEMV over the merged weight, then the SiLU-and-mul kernel (two
  launches: the pass off, Inductor's fused activation stood in for by ours);
- `cublas+silu`: F.linear, then the same kernel;
- `glu`: ops/triton_glu.py, one launch, at its default shape (glu_config) and, with --sweep,
  at every shape of SWEEP (the five fastest printed).
Timed inside a CUDA graph (triton.testing.do_bench_cudagraph) over enough weight copies
(>= 256 MB) that none is served from L2, as benchmarks/small_m_linear.py does.

    python benchmarks/glu_gemv.py [--sweep]
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"llama-3.2-1b": (8192, 2048), "llama-3.1-8b": (14336, 4096)}
# (BLOCK_N, BLOCK_K, num_warps): rows of each weight a program, K a step, warps
SWEEP = [(1, 2048, 2), (1, 4096, 4), (1, 1024, 2), (2, 2048, 4), (2, 1024, 2), (1, 8192, 8), (4, 512, 4),
         (2, 4096, 8), (1, 512, 1)]


def _time(fn, copies) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(lambda: [fn(*c) for c in copies], rep=100) * 1e3 / len(copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    from atom_compile.ops import glu_linear, triton_glu, triton_linear, triton_rowwise

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| MLP | arm | us | TB/s | config |")
    print("|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        copies = [(c, c[:n], c[n:]) for c in [w] + [w.clone() for _ in range((256 << 20) // (w.numel() * 2))]]
        want = glu_linear.activate(torch.nn.functional.linear(x, w[:n]), "silu") * torch.nn.functional.linear(x, w[n:])
        torch.testing.assert_close(triton_glu.gate_up_glu(x, w[:n], w[n:], "silu"), want, atol=3e-2, rtol=3e-2)

        def gemv_silu(full, gate, up):
            gu = triton_linear.small_m_linear(x, full)
            return triton_rowwise.silu_mul(gu[:, :n], gu[:, n:])

        def cublas_silu(full, gate, up):
            gu = torch.nn.functional.linear(x, full)
            return triton_rowwise.silu_mul(gu[:, :n], gu[:, n:])

        arms = {"gemv+silu": (gemv_silu, str(triton_linear.gemv_config(k))),
                "cublas+silu": (cublas_silu, ""),
                "glu": (lambda full, gate, up: triton_glu.gate_up_glu(x, gate, up, "silu"), str(triton_glu.glu_config(k)))}
        for arm, (fn, config) in arms.items():
            us = _time(fn, copies)
            print(f"| {name} | {arm} | {us:.1f} | {w.numel() * 2 / (us * 1e-6) / 1e12:.2f} | {config} |")
        if args.sweep:
            timed = sorted((_time(lambda full, gate, up, c=c: triton_glu.gate_up_glu(x, gate, up, "silu", c), copies), c)
                           for c in SWEEP if 2 * c[0] * c[1] <= 64 * 32 * c[2])  # two weights a program
            print(f"{name} fastest glu shapes: " + ", ".join(f"{c} {us:.1f}us" for us, c in timed[:5]))


if __name__ == "__main__":
    main()
