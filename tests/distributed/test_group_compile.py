"""The agreement over the process group: started by torchrun (gloo, CPU), the ranks exchange
their pieces' content keys, each compiles its own share, and every rank loads the rest.

The killed-rank case runs its ranks as plain processes (tests/distributed/helpers.py): torchrun
would end the whole group when one worker dies, which is the point of the test.
"""

from __future__ import annotations

import subprocess
import sys
import time

from atom_compile.backends.group_compile import assign_owners

from .helpers import JOB, env, finish, start_group, total

TOL = 1e-5


def test_owners_are_spread_and_rank_specific_keys_stay_home():
    assert assign_owners([["a", "b", "c"], ["a", "b", "c"]]) == {"a": 0, "b": 1, "c": 0}
    four = assign_owners([list("abcdefgh")] * 4)
    assert sorted(four.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    # "x" only rank 1 lacks (a rank-specific piece, or the others have it cached): rank 1's
    assert assign_owners([["a", "b"], ["a", "b", "x"]]) == {"a": 0, "b": 1, "x": 1}
    assert assign_owners([["x", "y"], []]) == {"x": 0, "y": 0}
    assert assign_owners([[], []]) == {}


def _torchrun(tmp_path, name: str, cache_root) -> list[dict]:
    out = tmp_path / f"{name}-{{rank}}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
         "--cache-root", str(cache_root), "--out", str(out), "--layers", "1"],
        capture_output=True, text=True, env=env(OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json

    return [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(2)]


def test_torchrun_group_compiles_each_piece_once_spread_over_ranks(tmp_path):
    root = tmp_path / "cache"
    cold = _torchrun(tmp_path, "cold", root)
    assert all(r["max_abs_err"] < TOL for r in cold), [r["max_abs_err"] for r in cold]
    unique = cold[0]["counters"]["num_piecewise_capturable_graphs_seen"]
    assert unique == 2  # embed+layer0 | layer0+norm
    assert total(cold, "num_inductor_compiles") == unique
    # the owners are different ranks: each compiled its share, and loaded the other's
    [g0], [g1] = cold[0]["group"], cold[1]["group"]
    assert (g0["owned"], g1["owned"]) == (1, 1) and g0["owners"] == g1["owners"] == {"0": 1, "1": 1}
    assert [r["counters"]["num_inductor_compiles"] for r in cold] == [1, 1]
    assert [r["counters"]["num_peer_pieces_loaded"] for r in cold] == [1, 1]
    assert g0["peer_problem"] is None and total(cold, "num_cache_errors") == 0

    warm = _torchrun(tmp_path, "warm", root)
    assert all(r["max_abs_err"] < TOL for r in warm)
    assert total(warm, "num_inductor_compiles") == 0 and total(warm, "num_cache_errors") == 0


def test_rank_killed_in_its_share_the_other_finishes(tmp_path):
    """Rank 1 dies inside the compile of its share: rank 0 passes the barrier with one warning,
    compiles the missing piece itself and answers correctly, in bounded time."""
    root = tmp_path / "cache"
    started = time.monotonic()
    procs = start_group(tmp_path, root, "k", 2, "--replicated", "--layers", "1",
                        "--die-in-compile", str(tmp_path / "dying"), "--die-rank", "1",
                        extra_env={"ATOM_COMPILE_PEER_TIMEOUT": "20"})
    try:
        [report] = finish(tmp_path, procs[:1], ["k-0"], timeout=180)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert time.monotonic() - started < 180
    assert procs[1].returncode != 0
    assert report["max_abs_err"] < TOL
    [g] = report["group"]
    assert g["owners"] == {"0": 1, "1": 1} and g["owned"] == 1 and g["peer_problem"]
    assert report["counters"]["num_inductor_compiles"] == 2  # its share, then the dead rank's
    err = (tmp_path / "k-0.err").read_text()
    assert err.count("atom-compile:") == 1, err[-3000:]  # one warning, no second from the locks
    assert err.count("not every rank finished its share") == 1, err[-3000:]
