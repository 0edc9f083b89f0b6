"""What every subcommand shares: global options anywhere, the cache root check, a quiet start,
the torch-free half, help with examples."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli_helpers import CLI, copy_root, one_line_error, our_lines, run


def test_inspect_verify_clear_export_import_never_import_torch(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    archive, fresh = tmp_path / "c.tar.gz", tmp_path / "fresh"
    script = textwrap.dedent(f"""
        import sys
        from atom_compile.cli import main
        root, h = {str(root)!r}, {warmed['hash']!r}
        codes = [
            main(["inspect", "--cache-root", root]),
            main(["inspect", h, "--json", "--cache-root", root]),
            main(["verify", "--cache-root", root]),
            main(["export", h, "-o", {str(archive)!r}, "--cache-root", root]),
            main(["import", {str(archive)!r}, "--cache-root", {str(fresh)!r}]),
            main(["clear", "--all", "--dry-run", "--cache-root", root]),
            main(["clear", h, "--yes", "--cache-root", root]),
        ]
        print("CODES", codes, "TORCH", "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "CODES [0, 0, 0, 0, 0, 0, 0] TORCH False" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["warm", "inspect", "clear", "verify", "explain", "export", "import"])
def test_every_subcommand_has_help_with_an_example(env, command):
    proc = run(env, command, "--help", timeout=30)
    assert proc.returncode == 0 and "example" in proc.stdout and "--cache-root" in proc.stdout


@pytest.mark.parametrize("where", ["before", "after"])
def test_global_options_before_or_after_the_subcommand(warmed, env, where):
    options = ["--cache-root", str(warmed["root"]), "--json", "-v"]
    args = [*options, "inspect"] if where == "before" else ["inspect", *options]
    proc = run(env, *args)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [c["hash"] for c in data["caches"]] == [warmed["hash"]]
    assert '\n  "caches": [' in proc.stdout  # indent 2


def _bad_roots(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    loop = tmp_path / "loop"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    return {"empty": "", "a file": str(a_file), "a symlink loop": str(loop), "through a file": str(a_file / "sub")}


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["clear", "--all", "--dry-run"],
                                     ["export", "0123456789abcdef"], ["import", "x.tar.gz"], ["warm"], ["explain"]])
def test_an_unusable_cache_root_is_a_usage_error_for_every_subcommand(env, tmp_path, command):
    for name, root in _bad_roots(tmp_path).items():
        line = one_line_error(run(env, *command, "--cache-root", root, timeout=60), 2)
        assert "cache root" in line or "--cache-root" in line, (name, line)


def test_a_root_that_does_not_exist_yet_has_no_caches(env, tmp_path):
    proc = run(env, "inspect", "--cache-root", str(tmp_path / "new" / "root"))
    assert proc.returncode == 0 and proc.stdout.startswith("No caches under") and proc.stderr == ""


def test_clear_answered_no_aborts_and_exits_0(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([*CLI, "clear", "--all", "--cache-root", str(root)], stdin=slave, stdout=slave,
                                stderr=subprocess.PIPE, env=env)
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + 60
        while b"[y/N]" not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 1024)
        assert b"[y/N]" in seen, seen
        os.write(master, b"n\n")
        seen += _drain(master)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert b"Aborted, nothing removed." in seen
    assert (root / "torch_compile_cache" / warmed["hash"]).is_dir()


def _drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 30.0)[0]:
        try:
            chunk = os.read(fd, 1024)
        except OSError:  # EIO: the child closed its side
            return out
        if not chunk:
            return out
        out += chunk
    return out


_WARN = ("import warnings; from atom_compile.cli import quiet; quiet.install({verbose}); "
         "warnings.warn('Failed to initialize NumPy: No module named numpy', UserWarning); "
         "import logging; logging.getLogger('torch.utils.cpp_extension').warning('No CUDA runtime is found')")


@pytest.mark.parametrize("verbose,log,shown", [(False, None, False), (True, None, True), (False, "debug", True)])
def test_known_harmless_warnings_are_filtered_unless_asked_for(env, verbose, log, shown):
    child = dict(env)
    if log:
        child["ATOM_COMPILE_LOG"] = log
    proc = subprocess.run([sys.executable, "-c", _WARN.format(verbose=verbose)], capture_output=True, text=True,
                          env=child, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("Failed to initialize NumPy" in proc.stderr) is shown
    assert ("No CUDA runtime is found" in proc.stderr) is shown


def test_a_normal_run_shows_none_of_the_known_third_party_warnings(warmed, env):
    """The cold warm imported torch and ran Inductor: none of the warnings the CLI knows to be
    harmless shows. What else a torch version prints is torch's: this test does not count it."""
    from atom_compile.cli.quiet import _HARMLESS

    assert our_lines(warmed["stderr"])
    known = [line for line in warmed["stderr"].splitlines() if any(re.search(m, line) for m, _ in _HARMLESS)]
    assert known == [], warmed["stderr"]
    proc = run(env, "inspect", "--cache-root", str(warmed["root"]))
    assert proc.returncode == 0 and proc.stderr == ""  # inspect never imports torch (test above)
