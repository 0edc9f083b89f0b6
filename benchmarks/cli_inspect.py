"""Claim: `atom-compile-cache inspect` on a root with 50 caches takes under a second.

Makes one real cache with `atom-compile-cache warm` (the tiny Llama, 2 layers, compile size 4),
copies it 50 times under new hashes into a fresh root, then times `inspect`, `inspect --json`
and `verify` as subprocesses (the median of several runs: what a user waits for, Python
start-up included) and prints a table.

    python3 benchmarks/cli_inspect.py [--caches 50] [--runs 7] [--source-root DIR]

`--source-root` reuses a root that `warm` already filled (skips the ~30 s compile).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "atom_compile.cli"]


def device_name() -> str:
    """The CPU model and core count (the commands timed here run on the CPU only)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def warm_source(workdir: Path) -> Path:
    root = workdir / "source"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"))
    print("warming the tiny Llama once (a real cache to copy) ...", file=sys.stderr)
    subprocess.run([*CLI, "warm", "--layers", "2", "--compile-sizes", "4", "--cache-root", str(root)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return root


def the_cache(root: Path) -> Path:
    caches = [p for p in (root / "torch_compile_cache").iterdir() if len(p.name) == 16]
    if not caches:
        raise SystemExit(f"no cache under {root}; run `atom-compile-cache warm --cache-root {root}` first")
    return caches[0]


def fill(root: Path, source: Path, count: int) -> int:
    """`count` copies of `source` under fresh hashes; returns the bytes of one."""
    target = root / "torch_compile_cache"
    target.mkdir(parents=True)
    for _ in range(count):
        shutil.copytree(source, target / secrets.token_hex(8), ignore=shutil.ignore_patterns(".in_use"))
    return sum(f.stat().st_size for f in source.rglob("*") if f.is_file())


def time_command(args: list[str], runs: int) -> tuple[float, float]:
    """(median, min) wall seconds of `atom-compile-cache ARGS` over `runs` runs (one warm-up)."""
    times = []
    for i in range(runs + 1):
        start = time.perf_counter()
        proc = subprocess.run([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        if i:  # the first run warms the page cache
            times.append(elapsed)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caches", type=int, default=50)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--source-root", type=Path, help="a root that warm already filled")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="atom-bench-cli-") as tmp:
        work = Path(tmp)
        source = the_cache(args.source_root or warm_source(work))
        root = work / "root"
        one = fill(root, source, args.caches)
        rows = []
        for command in (["inspect"], ["inspect", "--json"], ["verify"]):
            median, best = time_command([*command, "--cache-root", str(root)], args.runs)
            rows.append((f"atom-compile-cache {' '.join(command)}", median, best))
    print(f"device: {device_name()}")
    print(f"python {platform.python_version()}, torch {torch_version()}; "
          f"{args.caches} caches of {one / 2**20:.2f} MiB each; median of {args.runs} runs")
    print()
    print(f"{'command':<36} {'caches':>6} {'median s':>9} {'min s':>7}")
    for name, median, best in rows:
        print(f"{name:<36} {args.caches:>6} {median:>9.3f} {best:>7.3f}")
    inspect_median = rows[0][1]
    verdict = "holds" if inspect_median < 1.0 else "does NOT hold"
    print(f"\nclaim 'inspect on {args.caches} caches < 1 s' {verdict} ({inspect_median:.3f} s)")


if __name__ == "__main__":
    main()
