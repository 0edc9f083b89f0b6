"""Kernel micro-benchmark: the small-M Triton linear against F.linear (cuBLAS) at decode shapes.

For each (M, N, K) of Llama-3.2-1B's projections and LM head, bf16: microseconds per call and the
weight-read bandwidth each reaches, against a device-to-device copy's. Calls are timed inside a
CUDA graph (triton.testing.do_bench_cudagraph), as decode runs them, so Python's launch cost is
not counted; each graph cycles through enough copies of the weight (>= 256 MB) that none is
served from the 50 MB L2.

    python benchmarks/small_m_linear.py [--m 1,2,4,8] [--sweep]

--sweep times every block shape that fits, with the weights cycled past L2 (the tuning itself
times one weight, which L2 may hold): at one row the GEMV shapes of triton_linear.CONFIGS; at
2..8 rows both paths, `dot` (triton_linear.CONFIGS, rows padded to 16 for tensor cores) and
`gemv` (triton_linear.gemv_configs, CUDA-core FMA, rows padded to 2/4/8; `gemv-defer` is its
variant that reduces once after several K steps), the five fastest of each; then a table of the
fastest of gemv / dot / cuBLAS for every (layer, M). The main table's
Triton column follows ATOM_COMPILE_SMALL_M_ROWS (`dot` by default, or `gemv`) at 2..8 rows.
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
    args = ap.parse_args()
    import triton.testing

    from atom_compile.ops import triton_linear

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_bw = 2 * n / (triton.testing.do_bench(lambda: b.copy_(a), rep=200) * 1e-3)
    del a, b
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy_bw / 1e12:.2f} TB/s; "
          f"2..8 rows: {triton_linear.rows_mode()}")
    best = []
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
            config = triton_linear._tuned[(triton_linear._block_m(m), rows, k, x.dtype, False)]
            if m > 1:
                config = f"{triton_linear.rows_mode()} {config}"
            nbytes = w.numel() * 2
            print(f"| {name} | {m} | {cublas:.1f} | {nbytes / cublas / 1e6:.2f} | {ours:.1f} | "
                  f"{nbytes / ours / 1e6:.2f} | {config} | {cublas / ours:.2f}x |", flush=True)
            if args.sweep:
                modes = ("gemv",) if m == 1 else ("gemv", "gemv-defer", "dot")
                best.append((name, m, cublas, {p: sweep(triton_linear, x, copies, per, cublas, p) for p in modes}))
    if best:
        summary(best)


def summary(best: list) -> None:
    """The fastest of the GEMV, the padded dots and cuBLAS for every (layer, M) swept."""
    print("\nFastest per (layer, M), weights past L2: us (config)")
    print("| layer | M | gemv | dot | cuBLAS | fastest |")
    print("|---|---|---|---|---|---|")
    for name, m, cublas, paths in best:
        paths = {**{p: t for p, t in paths.items() if t}, "cuBLAS": (cublas, "")}
        if "gemv-defer" in paths and paths["gemv-defer"][0] < paths["gemv"][0]:  # the faster GEMV kernel
            paths["gemv"] = (paths["gemv-defer"][0], f"defer {paths['gemv-defer'][1]}")
        paths.pop("gemv-defer", None)
        cells = [f"{paths[p][0]:.1f} {paths[p][1]}".strip() if p in paths else "-" for p in ("gemv", "dot", "cuBLAS")]
        winner = min(paths, key=lambda p: paths[p][0])
        print(f"| {name} | {m} | {' | '.join(cells)} | {winner} |", flush=True)


def sweep(triton_linear, x, copies, per: float, cublas: float, label: str):
    """Every fitting config of one path on HBM-resident weights: `gemv`, `gemv-defer` (the GEMV
    that reduces once after its K steps; configs of several steps only) or `dot`. Prints the
    five fastest, us and against cuBLAS; returns the fastest (us, config), or None if none ran."""
    import triton.testing

    m, k = x.shape
    mode, defer = label.split("-")[0], label.endswith("-defer")
    block_m = triton_linear._block_m(m, mode)
    if block_m == 1:
        configs = [c for c in triton_linear.CONFIGS if triton_linear._fits(c, 1)]
    elif mode == "gemv":
        configs = [c for c in triton_linear.gemv_configs(k, m) if not defer or k > c[1]]
    else:
        configs = [c for c in triton_linear.CONFIGS if triton_linear._fits(c, block_m)]
    if not configs:
        print(f"    sweep {label}: no config of more than one K step", flush=True)
        return None
    out = torch.empty(m, copies[0].shape[0], device=x.device, dtype=x.dtype)
    timings = {}
    want = torch.nn.functional.linear(x, copies[-1]).float()
    for config in configs:
        try:
            triton_linear._launch(x, copies[-1], None, out, config, mode, defer)
            if not torch.allclose(out.float(), want, atol=0.5, rtol=2e-2):
                print(f"    sweep {label}: {config} MISMATCH against F.linear, left out", flush=True)
                continue
            timings[config] = triton.testing.do_bench_cudagraph(
                lambda: [triton_linear._launch(x, c, None, out, config, mode, defer) for c in copies], rep=50) * per
        except triton_linear.OutOfResources:  # a tile this GPU's shared memory cannot hold
            print(f"    sweep {label}: {config} does not fit this GPU's shared memory", flush=True)
    top = sorted(timings.items(), key=lambda t: t[1])[:5]
    print(f"    sweep {label}: " + ", ".join(f"{c} {us:.1f} ({cublas / us:.2f}x)" for c, us in top), flush=True)
    return (top[0][1], top[0][0]) if top else None


if __name__ == "__main__":
    main()
