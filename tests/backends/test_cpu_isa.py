"""Inductor's CPU ISA probe runs once per cache root: a later process takes the recorded answer.

Each case is a fresh process (the probe's answer is process state in Inductor), counting the
child processes the probe starts to load its test programs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="recorded on x86 only")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
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


def _prime(directory: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(directory)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_takes_the_recorded_answer(tmp_path):
    probe_dir = tmp_path / "isa_probe"
    probe_dir.mkdir(mode=0o700)
    first = _prime(probe_dir)
    answer = json.loads((probe_dir / "answer.json").read_text())
    assert first["probes"] > 0 and not first["answered"]
    if answer["valid"] != answer["question"]["allowed"]:
        pytest.skip(f"a candidate ISA failed its probe here ({answer}): the probe must run every time")

    second = _prime(probe_dir)
    # the base probe of every candidate is skipped, and Inductor's own sub-probes (avx512's bf16,
    # AMX tiles) are answered from the record: no child process at all, the same ISA and flags
    assert second["answered"] and second["isa"] == first["isa"] and second["flags"] == first["flags"]
    assert second["probes"] == 0, (first, second)
    assert all(isinstance(v, bool) for v in answer["builds"].values())

    # an answer in which a candidate failed (or made for another compiler) is not taken
    answer["valid"] = answer["valid"][1:]
    (probe_dir / "answer.json").write_text(json.dumps(answer))
    third = _prime(probe_dir)
    assert not third["answered"] and third["isa"] == first["isa"]
    # the probe ran again: a load in a child process, unless torch (2.14 on) remembers loads that
    # passed with a `<lib>.so.load_ok` marker beside the test program
    assert third["probes"] > 0 or any(probe_dir.rglob("*.load_ok")), third
