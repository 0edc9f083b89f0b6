"""Fleet start: cold compile, local warm start, and remote warm start on an empty machine.

Each start is a fresh process (benchmarks/_startup.py, the built-in Llama at level 3):
  cold         an empty cache; the compile is published to the remote tier
  local warm   the same cache root again (the remote is configured but never needed)
  (every start gets an empty Inductor cache, as in warm_start.py: only atom's cache is reused)
  remote warm  another cache root and HOME, empty: everything comes from the remote, verified
Goal: remote warm within 1.5x of local warm (compile phase: first call to first correct output).

    python benchmarks/fleet_start.py [--preset llama-3.2-1b] [--layers 2] [--remote file|redis]
                                     [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
KEY = "benchmark-signing-key-0123456789"


def start(work: Path, machine: str, remote: str, args: argparse.Namespace) -> dict:
    home = work / machine
    # a fresh Inductor cache for every start (as in warm_start.py): only atom's cache is reused
    inductor = tempfile.mkdtemp(prefix="inductor-", dir=work)
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               ATOM_COMPILE_CACHE_ROOT=str(home / "atom"), TORCHINDUCTOR_CACHE_DIR=inductor,
               ATOM_COMPILE_REMOTE_CACHE=remote, ATOM_COMPILE_REMOTE_KEY=KEY, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(HERE / "_startup.py"), "--arm", "atom", "--layers", str(args.layers),
           "--device", "cpu", "--preset", args.preset]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    if proc.returncode != 0:
        raise SystemExit(f"{machine} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if not report["correct"]:
        raise SystemExit(f"{machine} gave a wrong output (relative error {report['rel_error']:.2e})")
    return report


def _redis(work: Path) -> tuple[str, subprocess.Popen]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("--remote redis needs redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return f"redis://127.0.0.1:{port}/0", proc


def measure(args: argparse.Namespace, work: Path) -> dict:
    server = None
    remote = f"file://{work / 'bucket'}"
    if args.remote == "redis":
        remote, server = _redis(work)
    try:
        cold = start(work, "a", remote, args)
        local = [start(work, "a", remote, args) for _ in range(args.repeat)]
        remote_runs = []
        for i in range(args.repeat):
            remote_runs.append(start(work, f"b{i}", remote, args))  # a new empty machine each time
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    return {"cold": cold, "local_warm": local, "remote_warm": remote_runs, "remote": args.remote}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--remote", choices=["file", "redis"], default="file")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="atom-fleet-start-") as tmp:
        r = measure(args, Path(tmp))
    cold, local, rem = r["cold"], r["local_warm"], r["remote_warm"]
    for name, runs in (("local warm", local), ("remote warm", rem)):
        compiles = sorted({x["inductor_compiles"] for x in runs})
        print(f"{name}: compile phase {[round(x['compile_phase_s'], 2) for x in runs]} s, "
              f"Inductor compiles {compiles}, Dynamo skipped {[bool(x['dynamo_functions_loaded']) for x in runs]}")
    lw, rw = _median(local, "compile_phase_s"), _median(rem, "compile_phase_s")
    print(f"\n{args.preset}, {args.layers} layers, cpu, torch {cold['torch']}, remote {args.remote}; "
          "compile phase / whole process, seconds (warm: median of "
          f"{args.repeat})")
    print("| cold | local warm | remote warm | remote/local | remote warm compiles |")
    print("|---|---|---|---|---|")
    print(f"| {cold['compile_phase_s']:.2f} / {cold['whole_process_s']:.2f} | "
          f"{lw:.2f} / {_median(local, 'whole_process_s'):.2f} | {rw:.2f} / {_median(rem, 'whole_process_s'):.2f} | "
          f"{rw / lw:.2f}x | {max(x['inductor_compiles'] for x in rem)} |")
    print("goal: remote warm <= 1.5x local warm")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
