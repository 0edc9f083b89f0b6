"""One answer of the CPU ISA probe for the session, placed in new cache roots (seeded()).

The first process that compiles or loads a CPU piece under a cache root probes the CPU's vector
ISA (atom_compile/backends/cpu_isa.py: six child Pythons, about 8 s on 2 cores) and records the
answer in <root>/torch_compile_cache/isa_probe/answer.json; every later process under that root
takes it and starts no child. A test whose subject is not that first probe can start its new
root with the answer this session probed once, as if an earlier process had probed there: the
root then holds what the probe itself would have left (a private isa_probe directory with the
same answer.json). The probe and its record are tested where they are the subject
(tests/backends/test_cpu_isa.py), and by the cold starts that are not seeded (test_trust.py's,
whose files must all come out private under umask 002).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from atom_compile.backends.cpu_isa import ANSWER_FILE

REPO = Path(__file__).resolve().parents[2]
_SESSION: dict[str, Optional[tuple[Path, dict]]] = {}
# One process priming a probe directory (argv[1]); it prints what it did: how many test programs
# Inductor's probe loaded in a child process, the ISA and flags picked, whether a recorded answer
# was taken. tests/backends/test_cpu_isa.py reads the session's first run as its own first.
PROBE_SCRIPT = """
import json, sys
from torch._inductor import cpu_vec_isa
calls = [0]
real = cpu_vec_isa.VecISA._probe_load
def counting(self, path):
    calls[0] += 1
    return real(self, path)
cpu_vec_isa.VecISA._probe_load = counting
from atom_compile.backends import cpu_isa, inductor
inductor.prime_cpu_isa(sys.argv[1], None)
with cpu_isa.patches():
    picked = cpu_vec_isa.pick_vec_isa()
    isa, flags = str(picked), picked.build_arch_flags()
print(json.dumps({"probes": calls[0], "isa": isa, "flags": flags, "answered": cpu_isa.answered()}))
"""


def prime(directory: Path) -> dict:
    """PROBE_SCRIPT in a fresh process on `directory`: its report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(directory)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def session_probe() -> Optional[tuple[Path, dict]]:
    """The session's one probe (made once per test process, in a new private directory): the
    directory and the report of the process that probed there first; None where not x86."""
    if "probe" not in _SESSION:
        _SESSION["probe"] = None
        if platform.machine() in ("x86_64", "AMD64"):
            directory = Path(tempfile.mkdtemp(prefix="atom-test-isa-")) / "isa_probe"
            directory.mkdir(mode=0o700)
            _SESSION["probe"] = (directory, prime(directory))
    return _SESSION["probe"]


def session_answer() -> Optional[bytes]:
    """The recorded answer of the session's probe, or None where the probe is not recorded (not
    x86, or Inductor's internals moved): then nothing is seeded."""
    probe = session_probe()
    answer = probe[0] / ANSWER_FILE if probe is not None else None
    return answer.read_bytes() if answer is not None and answer.is_file() else None


def seeded(root: Path) -> Path:
    """`root` (a cache root no process has used yet) holding the session's probe answer; the
    directories are made private by atom-compile's own make_private_dirs. Returns `root`."""
    answer = session_answer()
    if answer is None:
        return root
    from atom_compile.cache.trust import make_private_dirs

    probe = Path(root) / "torch_compile_cache" / "isa_probe"
    make_private_dirs(Path(root), probe)
    target = probe / ANSWER_FILE
    target.write_bytes(answer)
    os.chmod(target, 0o600)
    return Path(root)
