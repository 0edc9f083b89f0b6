"""Helpers of the CLI tests: run the CLI as a real subprocess, and read what it left."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "atom_compile.cli"]
MODEL = ["--layers", "2"]
SIZES = ["--compile-sizes", "4"]
PREFIX = "atom-compile"  # every stderr line of ours starts with it



def run(env: dict, *args: str, timeout: int = 300, cwd: str | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd,
                          input=input)


def our_lines(stderr: str) -> list[str]:
    """Our stderr lines only: a third-party warning (if any slipped through) is not counted here;
    test_options.py checks separately that a normal run prints none."""
    return [line for line in stderr.splitlines() if line.startswith(PREFIX)]


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    """The process failed with `code` and said why in exactly one stderr line of ours."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = our_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("atom-compile-cache")
    return lines[0]


def copy_root(warmed: dict, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(warmed["root"], target)
    return target


def cache_dir(root: Path, cache_hash: str) -> Path:
    return root / "torch_compile_cache" / cache_hash


def artifacts(root: Path, cache_hash: str) -> list[Path]:
    return sorted(cache_dir(root, cache_hash).glob("rank_*/*/artifacts/*.bin"))
