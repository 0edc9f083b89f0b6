"""Warm start against cold compile and against torch.compile's own warm caches.

For each layer count, in fresh processes: atom cold (empty caches), atom warm (our cache from
the cold run, an empty Inductor cache: nothing of torch's own is reused), and torch.compile
with its caches warm (a first torch.compile run fills Inductor's caches; the second is timed).
Two times for each: the compile phase (first call of the compiled model to its first correct
output) and the whole process (start to first correct output).

    python benchmarks/warm_start.py [--layers 8,32] [--device cpu|cuda] [--json out.json]

With --fake-weights it measures the build step instead: `atom-compile-cache warm --fake-weights`
(weights as fake tensors, compile only) against a real `warm` of the same model, each in a fresh
process (wall time and peak RSS), then the warm start that the fake-weight cache gives a real
run (compile phase, pieces loaded, Inductor compiles, output checked against eager).

    python benchmarks/warm_start.py --fake-weights --preset llama-3.2-1b --layers 16
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
_PROFILE_DIR = ""  # --profile DIR: each atom start writes a cProfile of its compile phase there


def _env(cache_root: str, inductor_dir: str) -> dict:
    """A fresh machine's environment for one start: a new HOME beside the Inductor directory
    (so Triton's default cache, ~/.triton, is as empty as Inductor's) and TRITON_CACHE_DIR unset,
    as a user has it; what a warm start reuses is then only what `inductor_dir` and our cache
    root hold."""
    home = os.path.join(inductor_dir, "home")
    os.makedirs(home, exist_ok=True)
    env = dict(os.environ, ATOM_COMPILE_CACHE_ROOT=cache_root, TORCHINDUCTOR_CACHE_DIR=inductor_dir,
               HOME=home, PYTHONUNBUFFERED="1")
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("XDG_CACHE_HOME", None)
    return env


def start(arm: str, layers: int, device: str, cache_root: str, inductor_dir: str, preset: str = "",
          extra: tuple = ()) -> dict:
    env = _env(cache_root, inductor_dir)
    extra = (*(["--preset", preset] if preset else []), *extra)
    if arm == "atom" and _PROFILE_DIR:
        extra = (*extra, "--profile", os.path.join(_PROFILE_DIR, f"{Path(inductor_dir).name}-l{layers}.prof"))
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


# Runs one command as its only child and reports the child's wall time and peak RSS.
_PEAK = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
         "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "print(json.dumps({'rc': p.returncode, 'wall_s': time.perf_counter() - t, "
         "'peak_rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
         "'stdout': p.stdout, 'stderr': p.stderr[-3000:]}))")


def warm_step(preset: str, layers: int, device: str, root: str, inductor_dir: str, fake: bool) -> dict:
    """`atom-compile-cache warm` in a fresh process (config as _startup.py's): wall, peak RSS, report."""
    cmd = [sys.executable, "-m", "atom_compile.cli", "warm", preset, "--layers", str(layers), "--device", device,
           "--config", json.dumps({"max_num_seqs": 8}), "--cache-root", root, "--json"]
    cmd += ["--fake-weights"] if fake else []
    proc = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True,
                          env=_env(root, inductor_dir), timeout=3000)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["rc"] != 0:
        raise SystemExit(f"warm{' --fake-weights' if fake else ''} ({layers} layers) failed:\n{out['stderr']}")
    report = json.loads(out["stdout"])
    return {"wall_s": out["wall_s"], "peak_rss": out["peak_rss"], "compiled": report["compiled"],
            "weight_bytes": report["weight_bytes"], "real_weight_bytes": report["real_weight_bytes"],
            "warm_seconds": report["seconds"]}


def measure_fake(preset: str, layers: int, device: str, work: Path) -> dict:
    d = work / f"fake-l{layers}"
    fake = warm_step(preset, layers, device, str(d / "fake"), str(d / "inductor-fake"), True)
    real = warm_step(preset, layers, device, str(d / "real"), str(d / "inductor-real"), False)
    after = start("atom", layers, device, str(d / "fake"), str(d / "inductor-empty"), preset)
    return {"fake_build": fake, "real_warm": real, "warm_start_after_fake": after}


def main_fake(args: argparse.Namespace) -> None:
    gib = 1024 ** 3
    print(f"| layers | build step (--fake-weights) wall / peak RSS | real warm wall / peak RSS | RSS ratio | "
          f"weights (real / fake-allocated) | warm start after the build step |")
    print("|---|---|---|---|---|---|")
    results = {}
    with tempfile.TemporaryDirectory(prefix="atom-warm-fake-") as tmp:
        for layers in (int(x) for x in args.layers.split(",")):
            r = results[layers] = measure_fake(args.preset, layers, args.device, Path(tmp))
            f, w, a = r["fake_build"], r["real_warm"], r["warm_start_after_fake"]
            print(f"| {layers} | {f['wall_s']:.1f} s / {f['peak_rss'] / gib:.2f} GiB | {w['wall_s']:.1f} s / "
                  f"{w['peak_rss'] / gib:.2f} GiB | {f['peak_rss'] / w['peak_rss']:.1%} | "
                  f"{w['weight_bytes'] / gib:.2f} GiB / {f['real_weight_bytes']} B | compile phase "
                  f"{a['compile_phase_s']:.2f} s, {a['inductor_compiles']} Inductor compiles, {a['artifacts_loaded']} "
                  f"pieces loaded, Dynamo {'skipped' if a['dynamo_functions_loaded'] else 'ran'}, "
                  f"{'correct' if a['correct'] else 'WRONG'} (rel. error {a['rel_error']:.1e}) |", flush=True)
    print(f"\npreset {args.preset}, device {args.device}, torch {a['torch']}")
    print("goals: build step peak RSS < 10% of the real warm's; the warm start after it compiles nothing")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default="")
    ap.add_argument("--fake-weights", action="store_true", help="measure the build step (see above)")
    ap.add_argument("--preset", default="llama-3.2-1b", help="the model of --fake-weights (default llama-3.2-1b)")
    ap.add_argument("--profile", default="", help="write a cProfile of each atom start's compile phase into DIR")
    args = ap.parse_args()
    global _PROFILE_DIR
    _PROFILE_DIR = os.path.abspath(args.profile) if args.profile else ""
    if _PROFILE_DIR:
        os.makedirs(_PROFILE_DIR, exist_ok=True)
    if args.fake_weights:
        main_fake(args)
        return
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
