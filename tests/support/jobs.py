"""run_job: a model compiled in a fresh process (support/_job.py), its JSON report back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("_job.py")


def run_job(*args: str, env: dict | None = None, timeout: int = 600) -> dict:
    """Run tests/support/_job.py in a fresh process; return its JSON report."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["stderr"] = proc.stderr
    return report
