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

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from atom_compile.backends.cpu_isa import ANSWER_FILE

REPO = Path(__file__).resolve().parents[2]
_ANSWER: dict[str, Optional[bytes]] = {}
_PROBE = "import sys\nfrom atom_compile.backends import inductor\ninductor.prime_cpu_isa(sys.argv[1], None)\n"


def session_answer() -> Optional[bytes]:
    """The recorded answer of one probe (made once per test process), or None where the probe
    is not recorded (not x86, or Inductor's internals moved): then nothing is seeded."""
    if "answer" not in _ANSWER:
        _ANSWER["answer"] = None
        if platform.machine() in ("x86_64", "AMD64"):
            directory = Path(tempfile.mkdtemp(prefix="atom-test-isa-")) / "isa_probe"
            directory.mkdir(mode=0o700)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            proc = subprocess.run([sys.executable, "-c", _PROBE, str(directory)], capture_output=True, text=True,
                                  env=env, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            answer = directory / ANSWER_FILE
            _ANSWER["answer"] = answer.read_bytes() if answer.is_file() else None
    return _ANSWER["answer"]


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
