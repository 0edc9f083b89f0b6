"""Kernel micro-benchmark: the small-M Triton linear against F.linear (cuBLAS) at decode shapes.

For each (M, N, K) of Llama-3.2-1B's projections and LM head, bf16: microseconds per call and the
weight-read bandwidth each reaches, against a device-to-device copy's. Calls are timed inside a
CUDA graph (triton.testing.do_bench_cudagraph), as decode runs them, so Python's launch cost is
not counted; each graph cycles through enough copies of the weight (>= 256 MB) that none is
served from the 50 MB L2.

    python benchmarks/small_m_linear.py [--m 1,2,4,8] [--sweep] [--split-k]

--sweep times every config of triton_linear.CONFIGS that fits, with the weights cycled past L2
(as the tuning does: ops/tuning.py past_l2), and prints the five fastest.
--split-k turns triton_linear.SPLIT_K_ROWS on: 2..8 rows of the narrower layers take the split-K
dots (ops/triton_splitk.py), and --sweep then times its configs.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--split-k", action="store_true")
    args = ap.parse_args()
    import triton.testing

    from atom_compile.ops import triton_linear

    triton_linear.SPLIT_K_ROWS = args.split_k

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_bw = 2 * n / (triton.testing.do_bench(lambda: b.copy_(a), rep=200) * 1e-3)
    del a, b
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy_bw / 1e12:.2f} TB/s")
    print("| layer | M | cuBLAS us | TB/s | Triton us | TB/s | config | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for m in [int(x) for x in args.m.split(",")]:
        for name, (rows, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            copies = [w] + [w.clone() for _ in range(max(0, (256 << 20) // (w.numel() * 2)))]
            torch.testing.assert_close(triton_linear.small_m_linear(x, w).float(),
                                       torch.nn.functional.linear(x, w).float(), atol=0.5, rtol=2e-2)
            per = 1e3 / len(copies)
            cublas = triton.testing.do_bench_cudagraph(
                lambda: [torch.nn.functional.linear(x, c) for c in copies], rep=100) * per
            ours = triton.testing.do_bench_cudagraph(
                lambda: [triton_linear.small_m_linear(x, c) for c in copies], rep=100) * per
            split_k = args.split_k and m > 1 and rows < triton_linear.DOT_MIN_N
            config = triton_linear._tuned[("split_k" if split_k else triton_linear._block_m(m), rows, k, x.dtype, False)]
            nbytes = w.numel() * 2
            print(f"| {name} | {m} | {cublas:.1f} | {nbytes / cublas / 1e6:.2f} | {ours:.1f} | "
                  f"{nbytes / ours / 1e6:.2f} | {config} | {cublas / ours:.2f}x |", flush=True)
            if args.sweep:
                sweep(triton_linear, x, copies, per, cublas, split_k)


def sweep(triton_linear, x, copies, per: float, cublas: float, split_k: bool = False) -> None:
    """Every fitting config on HBM-resident weights: the five fastest, us and against cuBLAS."""
    import triton.testing

    from atom_compile.ops import triton_splitk

    block_m = triton_linear._block_m(x.shape[0])
    out = torch.empty(x.shape[0], copies[0].shape[0], device="cuda", dtype=x.dtype)
    timings = {}
    configs = triton_splitk.CONFIGS if split_k else [c for c in triton_linear.CONFIGS if triton_linear._fits(c, block_m)]
    run = triton_splitk.launch if split_k else triton_linear.launch_gemv
    for config in configs:
        try:
            timings[config] = triton.testing.do_bench_cudagraph(
                lambda: [run(x, c, None, out, config) for c in copies], rep=50) * per
        except triton_linear.OutOfResources:  # a tile this GPU's shared memory cannot hold
            print(f"    sweep: {config} does not fit this GPU's shared memory", flush=True)
    top = sorted(timings.items(), key=lambda t: t[1])[:5]
    print("    sweep: " + ", ".join(f"{c} {us:.1f} ({cublas / us:.2f}x)" for c, us in top), flush=True)


if __name__ == "__main__":
    main()
