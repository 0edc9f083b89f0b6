"""`clear`: by hash, all, age and size; never a cache in use; asks on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from cli_helpers import cache_dir, copy_root, one_line_error, run


def test_clear_refuses_without_yes_in_a_script(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    line = one_line_error(run(env, "clear", "--all", "--cache-root", str(root)), 2)
    assert "--yes" in line
    assert cache_dir(root, warmed["hash"]).is_dir()
    dry = run(env, "clear", "--all", "--dry-run", "--cache-root", str(root))
    assert dry.returncode == 0 and warmed["hash"] in dry.stdout and cache_dir(root, warmed["hash"]).is_dir()
    one_line_error(run(env, "clear", "--cache-root", str(root)), 2)
    one_line_error(run(env, "clear", "--all", "--max-size", "1G", "--cache-root", str(root)), 2)
    one_line_error(run(env, "clear", "--max-size", "lots", "--yes", "--cache-root", str(root)), 2)


def test_clear_skips_a_cache_in_use(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    path = cache_dir(root, warmed["hash"])
    fd = os.open(path / ".in_use", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # what a running process holds
    try:
        every = run(env, "clear", "--all", "--yes", "--cache-root", str(root))
        assert every.returncode == 0 and "in use" in every.stderr and path.is_dir()
        named = run(env, "clear", warmed["hash"], "--yes", "--cache-root", str(root))
        assert named.returncode == 1 and "in use" in named.stderr and path.is_dir()
        assert list((root / "torch_compile_cache" / "entrypoints").glob("*.json"))
    finally:
        os.close(fd)
    gone = run(env, "clear", warmed["hash"], "--yes", "--cache-root", str(root))
    assert gone.returncode == 0, gone.stderr
    assert not path.exists()
    assert not list((root / "torch_compile_cache" / "entrypoints").glob("*.json"))  # its entry point went too
    assert not [p for p in (root / "torch_compile_cache").iterdir() if p.name.startswith(".removing")]


def _clone(root: Path, source: str, new_hash: str, age_days: float) -> Path:
    """A copy of a cache under another hash, last used `age_days` ago."""
    target = cache_dir(root, new_hash)
    shutil.copytree(cache_dir(root, source), target)
    when = time.time() - age_days * 86400
    for index in target.glob("rank_*/*/index.json"):
        doc = json.loads(index.read_text())
        doc["created"] = doc["updated"] = when
        index.write_text(json.dumps(doc))
    (target / "last_used").touch()
    os.utime(target / "last_used", (when, when))
    return target


def test_clear_older_than_and_max_size(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    old = _clone(root, warmed["hash"], "00000000000000aa", age_days=40)
    older = _clone(root, warmed["hash"], "00000000000000bb", age_days=60)
    proc = run(env, "clear", "--older-than", "50", "--yes", "--cache-root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert not older.exists() and old.exists() and cache_dir(root, warmed["hash"]).exists()
    # Two caches left; a limit that holds one removes the least recently used one.
    one = warmed["bytes"] + warmed["bytes"] // 2
    proc = run(env, "clear", "--max-size", str(one), "--yes", "--cache-root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["removed"] == ["00000000000000aa"]
    assert cache_dir(root, warmed["hash"]).exists()
    nothing = run(env, "clear", "--max-size", "1T", "--yes", "--cache-root", str(root))
    assert nothing.returncode == 0 and "Nothing to remove" in nothing.stdout
