"""Cold compile time of the built-in Llama at level 3 with few and many layers.

Fresh process per size, all caches empty (ours and Inductor's). The ratio shows what the
content dedup of identical layers buys: the compiler sees the same three distinct pieces
whatever the depth, so only Dynamo's trace grows with the layer count.

    python benchmarks/compile_time.py [--layers 4,32] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from warm_start import start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="atom-compile-time-") as tmp:
        for layers in (int(x) for x in args.layers.split(",")):
            d = Path(tmp) / f"l{layers}"
            r = start("atom", layers, args.device, str(d / "atom"), str(d / "inductor"))
            rows.append((layers, r))
            print(f"{layers} layers: compile phase {r['compile_phase_s']:.2f}s, whole process "
                  f"{r['whole_process_s']:.2f}s, {r['inductor_compiles']} Inductor compiles", flush=True)
    print(f"\ndevice {args.device}, torch {rows[0][1]['torch']}")
    print("| layers | cold compile phase (s) | whole process (s) | Inductor compiles |")
    print("|---|---|---|---|")
    for layers, r in rows:
        print(f"| {layers} | {r['compile_phase_s']:.2f} | {r['whole_process_s']:.2f} | {r['inductor_compiles']} |")
    (lo, a), (hi, b) = rows[0], rows[-1]
    print(f"cold({hi}) / cold({lo}) = {b['compile_phase_s'] / a['compile_phase_s']:.2f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
