"""Cold compile of a tensor-parallel group: one cache root shared by the ranks against every
rank compiling alone, and against one rank by itself.

For each group size N, in fresh processes (gloo, CPU), the tiny Llama (2 layers, 4 KV heads
so that 4 ranks divide them), level 3, empty caches:
  one rank      a group of 1: the work of a single process
  alone         N ranks, each with its own cache root (what every rank compiling does today)
  shared        N ranks, one cache root, locks only (ATOM_COMPILE_GROUP_COMPILE=0): each unique
                piece compiled by whichever rank takes its lock first
  group         N ranks, one cache root, the agreement over the process group: the ranks
                exchange content keys and each compiles its own share, in parallel
Reported: wall time of the group (start to every rank's first correct output), the summed
CPU seconds in the compiler over the ranks (the C++ compiler processes it runs included), the
summed CPU seconds in loads (a CPU piece whose C++ library is missing builds it there), the
summed number of compiler runs, and for each rank where its first forward went: Dynamo tracing
(first forward minus the backend), the compiler, loads, and waiting at the group's barrier.

    python benchmarks/tp_compile.py --nproc 2,4 [--arms one_rank,alone,shared,group] [--json out.json] [--keep DIR]

It ends with the issue's goals and the measured ratios (wall group/one rank at the largest N,
compiler CPU group/one rank at each N).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "distributed" / "_tp_job.py"


def run_group(world: int, roots: list[str], work: str, group_compile: bool = True) -> dict:
    """Start `world` ranks (rank r uses roots[r]); wait; wall time and summed counters."""
    init = f"file://{work}/init-{time.monotonic_ns()}"
    # OMP_NUM_THREADS=1 unless set, as torchrun sets it for several processes per node: without
    # it every rank starts one OpenMP thread per core and N ranks oversubscribe the machine
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TORCHINDUCTOR_COMPILE_THREADS="1", ATOM_COMPILE_GROUP_COMPILE="1" if group_compile else "0")
    start = time.perf_counter()
    procs = []
    for r in range(world):
        out = os.path.join(work, f"rank{r}-{time.monotonic_ns()}.json")
        cmd = [sys.executable, str(JOB), "--rank", str(r), "--world", str(world), "--init", init,
               "--cache-root", roots[r], "--out", out, "--kv-heads", "4"]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env), out))
    reports = []
    for proc, out in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed:\n{err[-3000:]}")
        reports.append(json.loads(Path(out).read_text()))
    wall = time.perf_counter() - start
    worst = max(r["max_abs_err"] for r in reports)
    if worst > 1e-5:
        raise SystemExit(f"wrong output: max abs error {worst}")
    return {"wall_s": round(wall, 2), "compiler_cpu_s": round(sum(r["inductor_cpu_s"] for r in reports), 2),
            "load_cpu_s": round(sum(r["load_cpu_s"] for r in reports), 2),
            "compiles": sum(r["counters"]["num_inductor_compiles"] for r in reports),
            "per_rank": [breakdown(r) for r in reports]}


def breakdown(report: dict) -> dict:
    """Where one rank's first forward went (seconds, wall)."""
    backend = report["backend"]
    wait = sum(g["barrier_s"] for g in report["group"])
    return {"first_forward_s": round(report["first_forward_s"], 2),
            "owners": max((g.get("max_owners", 0) for g in report["group"]), default=0),
            "dynamo_s": round(report["first_forward_s"] - backend["wall_s"], 2),
            "compile_s": round(backend["compile_s"], 2), "load_s": round(backend["load_s"], 2),
            "barrier_s": round(wait, 2), "compiles": report["counters"]["num_inductor_compiles"]}


ARMS = ("one_rank", "alone", "shared", "group")


def _roots(arm: str, world: int, work: str) -> tuple[int, list[str], bool]:
    """(ranks, cache root per rank, group agreement on) of one arm."""
    if arm == "one_rank":
        return 1, [os.path.join(work, "one")], True
    if arm == "alone":
        return world, [os.path.join(work, f"alone{r}") for r in range(world)], False
    return world, [os.path.join(work, arm)] * world, arm == "group"


def measure(world: int, arms: tuple[str, ...] = ARMS, keep: Optional[str] = None) -> dict:
    """The chosen arms at one group size, each printed as soon as it has run (a run cut short
    by a time limit still reports the arms it finished); `keep`: leave the caches there."""
    res: dict = {"nproc": world}
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(tempfile.mkdtemp(prefix=f"n{world}-", dir=keep)) if keep
          else tempfile.TemporaryDirectory(prefix="atom-tp-bench-")) as work:
        for arm in arms:
            ranks, roots, agree = _roots(arm, world, work)
            res[arm] = run_group(ranks, roots, work, group_compile=agree)
            print_arm(world, arm, res[arm])
    one = res.get("one_rank")
    for arm, name in (("group", "wall_vs_one"), ("shared", "shared_wall_vs_one")):
        if one and arm in res:
            res[name] = round(res[arm]["wall_s"] / one["wall_s"], 2)
    if one and "group" in res:
        res["compiler_cpu_vs_one"] = round(res["group"]["compiler_cpu_s"] / max(one["compiler_cpu_s"], 1e-9), 2)
    return res


def print_arm(world: int, arm: str, row: dict) -> None:
    print(f"{world:>2}  {arm:<9} wall {row['wall_s']:>7.2f} s, compiler CPU {row['compiler_cpu_s']:.2f} s, "
          f"load CPU {row['load_cpu_s']:.2f} s, {row['compiles']} compiles", flush=True)
    for r, b in enumerate(row["per_rank"]):
        print(f"      rank {r}: first forward {b['first_forward_s']}s = dynamo {b['dynamo_s']}s + compile "
              f"{b['compile_s']}s ({b['compiles']} runs) + load {b['load_s']}s (barrier {b['barrier_s']}s)"
              + (f"; owners dealt over: {b['owners']}" if b["owners"] else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2,4", help="group sizes, comma-separated")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)} to run, comma-separated")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--keep", help="leave each run's caches under this directory (to inspect them)")
    args = ap.parse_args()
    try:
        sizes = [int(n) for n in args.nproc.split(",") if n]
    except ValueError:
        raise SystemExit(f"--nproc: got {args.nproc!r}; allowed: comma-separated positive integers") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--nproc: got {args.nproc!r}; allowed: comma-separated positive integers")
    arms = tuple(a for a in args.arms.split(",") if a)
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: got {args.arms!r}; allowed: comma-separated names from {', '.join(ARMS)}")
    print(f"{'N':>2}  arm")
    results = [measure(n, arms, args.keep) for n in sizes]
    for res in results:
        if "wall_vs_one" in res:
            print(f"    N={res['nproc']} group/one rank: wall {res['wall_vs_one']}x, compiler CPU "
                  f"{res['compiler_cpu_vs_one']}x" + (f"; shared (locks)/one rank: wall {res['shared_wall_vs_one']}x"
                                                      if "shared_wall_vs_one" in res else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if all("wall_vs_one" in res for res in results):
        print_goals(results)


def print_goals(results: list[dict]) -> None:
    """The issue's goals with the measured ratios: wall at the largest N, compiler CPU (and,
    beside it, compiler + load CPU: a load that rebuilds a library is compiler work too)."""
    top = max(results, key=lambda r: r["nproc"])
    wall = top["wall_vs_one"]
    print(f"goal: group cold-compile wall within 1.2x of one rank's at N={top['nproc']}: {wall}x "
          f"({'met' if wall <= 1.2 else 'not met'})")
    for res in results:
        cpu = res["compiler_cpu_vs_one"]
        one, group = res["one_rank"], res["group"]
        both = (group["compiler_cpu_s"] + group["load_cpu_s"]) / max(one["compiler_cpu_s"] + one["load_cpu_s"], 1e-9)
        print(f"goal: total compiler CPU of the group within 1.1x of one rank's at N={res['nproc']}: {cpu}x "
              f"({'met' if cpu <= 1.1 else 'not met'}); compiler + load CPU {both:.2f}x")


if __name__ == "__main__":
    main()
