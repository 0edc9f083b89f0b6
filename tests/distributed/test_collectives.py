"""Graphs with collectives (gloo, CPU, 2 ranks) compile and run correctly at levels 1-3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.isa import seeded

from .helpers import env

JOB = Path(__file__).with_name("_collectives_job.py")


def test_collectives_at_every_level(tmp_path):
    init = f"file://{tmp_path / 'init'}"
    seeded(tmp_path / "cache")  # the session's CPU ISA answer (support/isa.py): the probe is not the subject
    procs = [subprocess.Popen([sys.executable, str(JOB), str(r), "2", init, str(tmp_path / "cache"),
                               str(tmp_path / f"{r}.json")], stderr=subprocess.PIPE, text=True, env=env())
             for r in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
    for r in range(2):
        report = json.loads((tmp_path / f"{r}.json").read_text())
        for name, case in report.items():
            assert case["err"] < 1e-5, (r, name, case)
        assert report["level1"]["pieces"] == 0
        assert report["level2"]["pieces"] == 1 and report["level3"]["pieces"] == 1
        # two all_reduces (one from the in-place dist.all_reduce) and a reduce_scatter cut the graph
        assert report["level3-split"]["pieces"] == 7
        assert report["level3-split"]["compiled"] == 4
