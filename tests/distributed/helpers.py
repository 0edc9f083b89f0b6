"""Start the ranks of tensor-parallel groups (tests/distributed/_tp_job.py) as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support.isa import seeded

JOB = Path(__file__).with_name("_tp_job.py")
REPO = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict:
    # PYTHONFAULTHANDLER: a rank killed by a signal (a native abort) prints its Python stack
    out = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONFAULTHANDLER="1")
    out.update(extra)
    return out


def start_rank(tmp: Path, cache_root: Path, name: str, *args: str, extra_env: dict | None = None) -> subprocess.Popen:
    """One process of _tp_job.py whose report goes to `tmp/<name>.json`, stderr to `<name>.err`.
    A root no process has used starts with the session's CPU ISA answer (support/isa.py): what
    these tests check is the compile and its agreement, not the probe."""
    if not cache_root.exists():
        seeded(cache_root)
    err = open(tmp / f"{name}.err", "w")
    cmd = [sys.executable, str(JOB), "--cache-root", str(cache_root), "--out", str(tmp / f"{name}.json"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env(**(extra_env or {})))


def start_group(tmp: Path, cache_root: Path, group: str, world: int, *args: str,
                extra_env: dict | None = None) -> list[subprocess.Popen]:
    init = f"file://{tmp / f'{group}.init'}"
    if (tmp / f"{group}.init").exists():
        (tmp / f"{group}.init").unlink()
    return [start_rank(tmp, cache_root, f"{group}-{r}", "--rank", str(r), "--world", str(world), "--init", init, *args,
                       extra_env=extra_env) for r in range(world)]


def finish(tmp: Path, procs: list[subprocess.Popen], names: list[str], timeout: float = 240) -> list[dict]:
    """Wait for the processes (killing them all past `timeout`); their reports, in order."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("ranks did not finish in time:\n" + stderr_tail(tmp, names))
    bad = [n for p, n in zip(procs, names) if p.returncode != 0]
    if bad:
        raise AssertionError(f"ranks {bad} failed:\n" + stderr_tail(tmp, bad))
    return [json.loads((tmp / f"{n}.json").read_text()) for n in names]


def stderr_tail(tmp: Path, names: list[str]) -> str:
    return "\n".join(f"--- {n}\n" + (tmp / f"{n}.err").read_text()[-3000:] for n in names)


def total(reports: list[dict], counter: str) -> int:
    return sum(r["counters"][counter] for r in reports)


def cli(*args: str) -> str:
    """Run `atom-compile-cache ARGS`; its stdout (asserting it succeeded)."""
    proc = subprocess.run([sys.executable, "-m", "atom_compile.cli", *args], capture_output=True, text=True,
                          env=env(), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout
