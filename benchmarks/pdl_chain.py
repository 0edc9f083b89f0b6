"""What a small kernel costs between decode GEMVs in a PDL chain (issue 15).

A decode step at batch 1 is a chain of some 160 kernels: four GEMVs a layer and, between them,
small kernels (norms with the residual add, RoPE, SiLU-and-mul, attention). Removing a small
kernel by fusing it into a GEMV did not shorten the step (BENCHMARKS.md, the GLU and RoPE
epilogues). This times the chain's pieces alone, each recorded in one CUDA graph and replayed:

- `gemv`: n one-row GEMVs (ops/triton_linear.py, launched with PDL where the GPU has it), each on
  its own weight, so every weight is read from memory as in a step;
- `gemv+tiny`, `gemv+2tiny`: the same with one or two small kernels after each GEMV (a row of the
  hidden size read with a residual, added, RMS-normalised and written, as Inductor's norm does;
  launched with PDL too);
- `tiny`: the small kernels alone.

It prints us per replay and per kernel, and the marginal cost of one small kernel between two
GEMVs: ((gemv+k tiny) - gemv) / (n k). Run it twice to compare with PDL off:

    python benchmarks/pdl_chain.py [--n 32] [--shapes o,gate_up,down]
    ATOM_COMPILE_PDL=0 python benchmarks/pdl_chain.py
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

HIDDEN = 2048  # the row the small kernels normalise (Llama-3.2-1B's hidden size)
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def _chain(shape: tuple[int, int], n: int, tiny: int, gemv: bool):
    """A function launching the chain, and the buffers it keeps alive. The small kernel is the
    package's add+RMSNorm (ops/triton_rowwise.py), launched with PDL where the GPU has it."""
    from atom_compile.ops import triton_linear, triton_rowwise

    rows, k = shape
    dev = torch.device("cuda")
    weights = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(n if gemv else 0)]
    norm_w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    hidden = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)

    # with PDL each kernel waits for the one before whatever it reads, so the GEMVs all read x
    # and the small kernels a row of their own: the chain is the launch order, as in a step
    def run() -> None:
        v = hidden
        for i in range(n):
            if gemv:
                triton_linear.small_m_linear(x, weights[i])
            for _ in range(tiny):
                v = triton_rowwise.add_rms_norm(v, residual, norm_w, 1e-6)[0]

    return run, (weights, norm_w, residual, x, hidden)


def _time(run, replays: int = 50) -> float:
    """Median us of one replay of `run` recorded in a CUDA graph."""
    run()  # compiles and tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="GEMVs per chain")
    ap.add_argument("--shapes", default="o,gate_up,down")
    args = ap.parse_args()
    from atom_compile.ops import pdl

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"PDL {'on' if pdl.enabled(torch.device('cuda')) else 'off'}; n = {args.n}")
    print("| GEMV (N x K) | chain | us per replay | us per kernel | marginal us per small kernel |")
    print("|---|---|---|---|---|")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        base = None
        for label, tiny, gemv in (("gemv", 0, True), ("gemv+tiny", 1, True), ("gemv+2tiny", 2, True),
                                  ("tiny", 1, False)):
            run, keep = _chain(shape, args.n, tiny, gemv)
            us = _time(run)
            del keep
            kernels = args.n * (tiny + int(gemv))
            base = us if label == "gemv" else base
            marginal = f"{(us - base) / (args.n * tiny):.2f}" if gemv and tiny else ""
            print(f"| {name} {shape[0]} x {shape[1]} | {label} | {us:.1f} | {us / kernels:.2f} | {marginal} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
