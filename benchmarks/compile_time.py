"""Cold compile time of the built-in Llama at level 3 with few and many layers.

Fresh process per size, all caches empty (ours and Inductor's). The compiler sees the same
three distinct pieces whatever the depth (content dedup of identical layers); what grew with
the depth was Dynamo's trace of every layer, which `trace_layers_once` (the default: the
alike layers of a ModuleList traced once as torch's nested compile region) takes away.
`--path every-layer` measures the path before it (trace_layers_once=False), `--path both`
measures both, alternating, `--repeat N` each size N times. Besides the wall clock, the CPU
time of the compile phase (the process and its compiler subprocesses): on a shared machine the
wall clock varies with the other work, the CPU time much less.

    python benchmarks/compile_time.py [--layers 4,32] [--device cpu|cuda] [--path once|every-layer|both]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from warm_start import start

PATHS = {"once": (), "every-layer": ("--every-layer",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--path", default="once", choices=["once", "every-layer", "both"])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    paths = list(PATHS) if args.path == "both" else [args.path]
    layer_counts = [int(x) for x in args.layers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="atom-compile-time-") as tmp:
        for run in range(args.repeat):
            for path in paths:
                for layers in layer_counts:
                    d = Path(tmp) / f"{path}-l{layers}-r{run}"
                    r = start("atom", layers, args.device, str(d / "atom"), str(d / "inductor"), extra=PATHS[path])
                    rows.append((run, path, layers, r))
                    print(f"run {run} {path}: {layers} layers: compile phase {r['compile_phase_s']:.2f}s "
                          f"({r['compile_phase_cpu_s']:.2f} CPU s), whole "
                          f"process {r['whole_process_s']:.2f}s, {r['inductor_compiles']} Inductor compiles, "
                          f"{r['regions_inlined']} region calls inlined", flush=True)
    print(f"\ndevice {args.device}, torch {rows[0][3]['torch']}")
    print("| run | path | layers | cold compile phase (s) | its CPU time (s) | whole process (s) | Inductor compiles "
          "| region calls inlined |")
    print("|---|---|---|---|---|---|---|---|")
    for run, path, layers, r in rows:
        print(f"| {run} | {path} | {layers} | {r['compile_phase_s']:.2f} | {r['compile_phase_cpu_s']:.2f} | "
              f"{r['whole_process_s']:.2f} | "
              f"{r['inductor_compiles']} | {r['regions_inlined']} |")
    lo, hi = min(layer_counts), max(layer_counts)
    for run in range(args.repeat):
        for path in paths:
            by_layers = {layers: r for rr, p, layers, r in rows if rr == run and p == path}
            ratio = by_layers[hi]["compile_phase_s"] / by_layers[lo]["compile_phase_s"]
            cpu = by_layers[hi]["compile_phase_cpu_s"] / by_layers[lo]["compile_phase_cpu_s"]
            print(f"run {run} {path}: cold({hi}) / cold({lo}) = {ratio:.2f} wall, {cpu:.2f} CPU time (goal <= 1.3)")


if __name__ == "__main__":
    main()
