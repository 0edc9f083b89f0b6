"""Warm start against cold compile and against torch.compile's own warm caches.

For each layer count, in fresh processes: atom cold (empty caches), atom warm (our cache from
the cold run, an empty Inductor cache: nothing of torch's own is reused), and torch.compile
with its caches warm (a first torch.compile run fills Inductor's caches; the second is timed).
Two times for each: the compile phase (first call of the compiled model to its first correct
output) and the whole process (start to first correct output).

    python benchmarks/warm_start.py [--layers 8,32] [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def start(arm: str, layers: int, device: str, cache_root: str, inductor_dir: str, extra: tuple = ()) -> dict:
    env = dict(os.environ, ATOM_COMPILE_CACHE_ROOT=cache_root, TORCHINDUCTOR_CACHE_DIR=inductor_dir,
               TRITON_CACHE_DIR=os.path.join(inductor_dir, "triton"), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(HERE / "_startup.py"), "--arm", arm, "--layers", str(layers),
                           "--device", device, *extra], capture_output=True, text=True, env=env, timeout=3000)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} ({layers} layers) failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if not report["correct"]:
        raise SystemExit(f"{arm} ({layers} layers) gave a wrong output (relative error {report['rel_error']:.2e})")
    return report


def measure(layers: int, device: str, work: Path) -> dict:
    d = work / f"l{layers}"
    root = str(d / "atom")
    cold = start("atom", layers, device, root, str(d / "inductor-cold"))
    warm = start("atom", layers, device, root, str(d / "inductor-warm-empty"))
    start("torch.compile", layers, device, str(d / "unused"), str(d / "inductor-tc"))  # fills torch's caches
    tc_warm = start("torch.compile", layers, device, str(d / "unused"), str(d / "inductor-tc"))
    return {"cold": cold, "warm": warm, "torch_compile_warm": tc_warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="atom-warm-start-") as tmp:
        for layers in (int(x) for x in args.layers.split(",")):
            results[layers] = measure(layers, args.device, Path(tmp))
            r = results[layers]
            print(f"{layers} layers: " + ", ".join(f"{k} {v['compile_phase_s']:.2f}s/{v['whole_process_s']:.2f}s"
                                                 for k, v in r.items()), flush=True)
    any_r = next(iter(results.values()))["cold"]
    print(f"\ndevice {args.device}, torch {any_r['torch']}; compile phase / whole process, seconds")
    print("| layers | atom cold | atom warm | torch.compile warm | warm/cold | warm/tc-warm | loaded | Dynamo skipped |")
    print("|---|---|---|---|---|---|---|---|")
    for layers, r in results.items():
        c, w, t = r["cold"], r["warm"], r["torch_compile_warm"]
        print(f"| {layers} | {c['compile_phase_s']:.2f} / {c['whole_process_s']:.2f} | "
              f"{w['compile_phase_s']:.2f} / {w['whole_process_s']:.2f} | "
              f"{t['compile_phase_s']:.2f} / {t['whole_process_s']:.2f} | "
              f"{w['compile_phase_s'] / c['compile_phase_s']:.1%} | {w['compile_phase_s'] / t['compile_phase_s']:.1%} | "
              f"{w['artifacts_loaded']} pieces, {w['inductor_compiles']} compiles | "
              f"{'yes' if w['dynamo_functions_loaded'] else 'no'} |")
    layer_counts = sorted(results)
    if len(layer_counts) > 1:
        lo, hi = layer_counts[0], layer_counts[-1]
        ratio = results[hi]["cold"]["compile_phase_s"] / results[lo]["cold"]["compile_phase_s"]
        print(f"cold({hi}) / cold({lo}) = {ratio:.2f}")
    print("goals: warm <= 10% of cold; warm <= 50% of torch.compile warm")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
