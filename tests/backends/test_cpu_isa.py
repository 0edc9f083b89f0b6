"""Inductor's CPU ISA probe runs once per cache root: a later process takes the recorded answer.

Each case is a fresh process (the probe's answer is process state in Inductor), counting the
child processes the probe starts to load its test programs (tests/support/isa.py's PROBE_SCRIPT).
"""

from __future__ import annotations

import json
import platform
import shutil

import pytest

from support import isa

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="recorded on x86 only")


def test_second_process_takes_the_recorded_answer(tmp_path):
    # the first process is the session's own probe (tests/support/isa.py: a new directory, no
    # answer in it yet), made once for the roots the other tests seed; a copy of its directory
    session_dir, first = isa.session_probe()
    probe_dir = tmp_path / "isa_probe"
    shutil.copytree(session_dir, probe_dir, symlinks=True)
    answer = json.loads((probe_dir / "answer.json").read_text())
    assert first["probes"] > 0 and not first["answered"]
    if answer["valid"] != answer["question"]["allowed"]:
        pytest.skip(f"a candidate ISA failed its probe here ({answer}): the probe must run every time")

    second = isa.prime(probe_dir)
    # the base probe of every candidate is skipped, and Inductor's own sub-probes (avx512's bf16,
    # AMX tiles) are answered from the record: no child process at all, the same ISA and flags
    assert second["answered"] and second["isa"] == first["isa"] and second["flags"] == first["flags"]
    assert second["probes"] == 0, (first, second)
    assert all(isinstance(v, bool) for v in answer["builds"].values())

    # an answer in which a candidate failed (or made for another compiler) is not taken
    answer["valid"] = answer["valid"][1:]
    (probe_dir / "answer.json").write_text(json.dumps(answer))
    third = isa.prime(probe_dir)
    assert not third["answered"] and third["isa"] == first["isa"]
    # the probe ran again: a load in a child process, unless torch (2.14 on) remembers loads that
    # passed with a `<lib>.so.load_ok` marker beside the test program
    assert third["probes"] > 0 or any(probe_dir.rglob("*.load_ok")), third
