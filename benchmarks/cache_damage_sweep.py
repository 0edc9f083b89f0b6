"""The long random-damage sweep of the cache (tests/cache/_damage_loop.py), outside the suite.

For each seed, in a fresh process: compile the tiny Llama (1 layer, level 3) into an empty root,
then ROUNDS times copy that cache, damage one file (each of the six kinds in turn, the file
picked by the seed), start twice, and check what tests/cache/test_trust.py checks for its few
rounds: the first start names the damage once and answers bit-identically, the next one warns
of nothing, compiles nothing and finds the cache whole. Exits 1 if any round went wrong.

    python benchmarks/cache_damage_sweep.py [--rounds 50] [--seeds 14,15,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP = REPO / "tests" / "cache" / "_damage_loop.py"
sys.path.insert(0, str(LOOP.parent))

from _damage_loop import bad_rounds  # noqa: E402


def sweep(seed: int, rounds: int) -> dict:
    """One process of the loop from an empty pristine root: its report, with the bad rounds."""
    with tempfile.TemporaryDirectory(prefix="atom-damage-") as work:
        pristine = Path(work) / "pristine"
        pristine.mkdir(mode=0o700)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   TORCHINDUCTOR_CACHE_DIR=str(Path(work) / "inductor"))
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, str(LOOP), str(pristine), work, str(rounds), str(seed)],
                              capture_output=True, text=True, env=env, timeout=6 * 3600)
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed}: the loop failed:\n{proc.stderr[-4000:]}")
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["bad"] = bad_rounds(report)
    report["wall_s"] = time.perf_counter() - started
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50, help="damaged starts per seed")
    ap.add_argument("--seeds", default="14", help="comma-separated seeds, one process each")
    ap.add_argument("--json", default="", help="write every seed's bad rounds and timings here")
    args = ap.parse_args()
    failed, out = 0, {}
    for seed in (int(s) for s in args.seeds.split(",") if s):
        report = sweep(seed, args.rounds)
        kinds = collections.Counter(r["kind"] for r in report["rounds"])
        files = len({r["path"] for r in report["rounds"]})
        print(f"seed {seed}: {len(report['rounds'])} rounds ({dict(kinds)}) on {files} files, "
              f"{len(report['bad'])} bad, {report['wall_s']:.1f} s")
        for bad in report["bad"][:5]:
            print("  ", bad)
        failed += len(report["bad"])
        out[seed] = {"bad": report["bad"], "wall_s": report["wall_s"], "kinds": dict(kinds), "files": files}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
