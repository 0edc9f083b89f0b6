"""The README's fresh-machine commands, as written, in a new venv with a new HOME.

The commands are read from README.md ("## Fresh machine": the first bash block is the CPU-only
path, the second the CUDA one), so this follows the doc, not a copy of it. Used by
tests/test_fresh_machine.py (opt-in) and by .ci/run (run 2: the newest torch pip resolves,
the full suite):

    python tests/support/fresh_venv.py --workdir DIR [--full]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Fresh machine"
# The part of the suite a smoke run takes: imports and config, the layout check, keys, and a
# real level-3 compile, warm start and `inspect` without numpy (about 2 minutes on 2 cores).
SMOKE = ("tests/test_config.py", "tests/test_layout.py", "tests/cache/test_keys.py", "tests/test_no_numpy.py")
NO_INDEX = 75  # the script's exit status when pip reaches no package index
# A full run (CI's run 2) names its slowest tests, as run 1 does, so the time budget can be kept.
FULL_OPTIONS = "--durations=15"
# What a fresh account on this machine still has: the system, its proxies and pip's machine-wide
# settings. Nothing of the user's (HOME, caches, PYTHONPATH, a venv, atom-compile's or torch's
# own variables) crosses over.
_KEPT = re.compile(r"(PATH|LANG|LC_\w+|TERM|TZ|TMPDIR|USER|LOGNAME|SHELL|(HTTPS?|NO|ALL)_PROXY|"
                   r"SSL_CERT_(FILE|DIR)|REQUESTS_CA_BUNDLE|PIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS|CERT|"
                   r"DEFAULT_TIMEOUT|DISABLE_PIP_VERSION_CHECK|TRUSTED_HOST|CONSTRAINT))", re.I)


@dataclass
class Commands:
    """The README's commands for one machine kind."""

    setup: list[str]      # environment creation and, CPU-only, the CPU torch
    install: str          # pip install -e ".[test...]"
    test: str             # python -m pytest -q


def readme_commands(readme: Path = REPO / "README.md", gpu: bool = False) -> Commands:
    """The CPU-only (or, with gpu, the CUDA) commands of the README's fresh-machine section."""
    text = readme.read_text()
    if SECTION not in text:
        raise AssertionError(f"README.md has no {SECTION!r} section")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [line.strip() for line in blocks[1 if gpu else 0].splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    install = [line for line in lines if line.startswith("pip install -e ")]
    test = [line for line in lines if line.startswith("python -m pytest")]
    assert len(install) == 1 and len(test) == 1, lines
    setup = [line for line in lines[: lines.index(install[0])]]
    return Commands(setup=setup, install=install[0], test=test[0])


def fresh_env(home: Path) -> dict[str, str]:
    """The environment of a new account: the machine's settings, a new HOME, our python first."""
    env = {k: v for k, v in os.environ.items() if _KEPT.fullmatch(k)}
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    return env


def reachable(url: str, timeout: float = 15.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def script(commands: Commands, smoke: bool) -> str:
    """A bash script: the README's lines as written, a probe of the package index, the torch version."""
    out = ["set -euo pipefail"]
    for line in commands.setup:
        url = re.search(r"--index-url\s+(\S+)", line)
        if url and not reachable(url.group(1) + "/torch/"):
            note = f"fresh venv: {url.group(1)} is unreachable here; torch comes from pip's index"
            out.append("echo " + shlex.quote(note))
            continue
        out.append(line)
    out.append("python -m pip install --dry-run --no-deps --ignore-installed -q pytest-timeout "
               f"|| {{ echo 'fresh venv: pip reaches no package index'; exit {NO_INDEX}; }}")
    out.append(commands.install)
    out.append("python -c \"import sys, torch; print('fresh venv: torch', torch.__version__, 'python', sys.version.split()[0])\"")
    out.append(commands.test + " " + (" ".join(SMOKE) if smoke else FULL_OPTIONS))
    return "\n".join(out) + "\n"


def run(workdir: Path, smoke: bool, gpu: bool = False, log=None, timeout: float | None = None) -> int:
    """Copy the checkout into workdir/src, run the README's commands there; their exit status."""
    src, home = workdir / "src", workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", ".whl", ".device", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", "build", "dist"))
    body = script(readme_commands(src / "README.md", gpu=gpu), smoke)
    (workdir / "fresh.sh").write_text(body)
    proc = subprocess.run(["bash", str(workdir / "fresh.sh")], cwd=src, env=fresh_env(home), stdout=log,
                          stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, type=Path, help="an empty directory (the caller removes it)")
    ap.add_argument("--full", action="store_true", help="the whole suite (default: the smoke part)")
    ap.add_argument("--gpu", action="store_true", help="the README's CUDA commands")
    args = ap.parse_args()
    sys.stdout.flush()
    return run(args.workdir, smoke=not args.full, gpu=args.gpu)


if __name__ == "__main__":
    sys.exit(main())
