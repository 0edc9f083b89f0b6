"""The agreement over the process group: started by torchrun (gloo, CPU), the ranks exchange
their pieces' content keys, each compiles its own share, and every rank loads the rest.

The killed-rank case runs its ranks as plain processes (tests/distributed/helpers.py): torchrun
would end the whole group when one worker dies, which is the point of the test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import time
import warnings

import pytest

from atom_compile.backends.group_compile import COST_PER_OWNER, LOCK_GRACE_S, assign_owners, owner_count

from support.isa import seeded

from .helpers import JOB, cli, env, finish, start_group, total

TOL = 1e-5


def test_owners_are_spread_and_rank_specific_keys_stay_home():
    assert assign_owners([["a", "b", "c"], ["a", "b", "c"]]) == {"a": 0, "b": 1, "c": 0}
    four = assign_owners([list("abcdefgh")] * 4)
    assert sorted(four.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    # "x" only rank 1 lacks (a rank-specific piece, or the others have it cached): rank 1's
    assert assign_owners([["a", "b"], ["a", "b", "x"]]) == {"a": 0, "b": 1, "x": 1}
    assert assign_owners([["x", "y"], []]) == {"x": 0, "y": 0}
    assert assign_owners([[], []]) == {}


def test_few_owners_take_the_shared_keys():
    every = [list("abcd")] * 4
    assert assign_owners(every, max_owners=1) == dict.fromkeys("abcd", 0)
    assert assign_owners(every, max_owners=2) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert assign_owners(every, max_owners=9) == assign_owners(every) == {"a": 0, "b": 1, "c": 2, "d": 3}
    # rank 2 compiles its own "x" anyway (it pays the set-up): the shared keys go there too
    assert assign_owners([["a", "b"], ["a", "b"], ["a", "b", "x"]], max_owners=1) == {"a": 2, "b": 2, "x": 2}
    # two rank-specific owners and a limit of 1: both stay owners, the shared key balances
    assert assign_owners([["a", "x"], ["a", "y"], ["a"]], max_owners=1) == {"a": 0, "x": 0, "y": 1}
    # no allowed rank (rank 0) lacks "c" and "d": one more owner takes both, not two more
    assert assign_owners([["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]], max_owners=1) \
        == {"a": 0, "b": 0, "c": 2, "d": 2}


def test_owners_balance_the_cost_costliest_first():
    assert assign_owners([list("abc")] * 2, costs={"a": 1, "b": 5, "c": 4}) == {"b": 0, "c": 1, "a": 1}
    assert assign_owners([list("abcd")] * 2, costs={"a": 9, "b": 1, "c": 1, "d": 1}) \
        == {"a": 0, "b": 1, "c": 1, "d": 1}
    # a key's missing cost counts 1
    assert assign_owners([list("abc")] * 2, costs={"a": 3}) == {"a": 0, "b": 1, "c": 1}


def test_owner_count_follows_the_work_unless_set():
    assert owner_count(59 + 72 + 31, 2) == 1  # the tiny Llama's three pieces: one owner
    assert owner_count(0, 4) == 1
    assert owner_count(3 * COST_PER_OWNER, 4) == 3 and owner_count(3 * COST_PER_OWNER - 1, 4) == 2
    assert owner_count(100 * COST_PER_OWNER, 4) == 4
    assert owner_count(10**6, 4, limit=1) == 1 and owner_count(1, 4, limit=2) == 2 and owner_count(1, 4, limit=9) == 4
    assert owner_count(1000, 8, cost_per_owner=100) == 8 and owner_count(1000, 8, cost_per_owner=300) == 3


def _torchrun(tmp_path, name: str, cache_root, *extra: str, owners: str = "auto") -> list[dict]:
    out = tmp_path / f"{name}-{{rank}}.json"
    if not cache_root.exists():
        seeded(cache_root)  # the session's CPU ISA answer (support/isa.py): the probe is not the subject
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
           "--cache-root", str(cache_root), "--out", str(out), "--layers", "1", *extra]
    run_env = env(OMP_NUM_THREADS="1", ATOM_COMPILE_GROUP_OWNERS=owners)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=300)
    if proc.returncode != 0 and _native_abort(proc.stderr):
        # Seen once in CI on torch 2.14.1 (2 cores, not reproduced in 20 runs since): a rank
        # aborted in native code mid-compile ("terminate called without an active exception").
        # Reported with its Python stack (PYTHONFAULTHANDLER) and run once more from the same
        # start; a second abort, or any other failure, fails the test.
        warnings.warn(f"torchrun {name}: a rank aborted in native code; run again. "
                      f"stderr tail:\n{proc.stderr[-3000:]}")
        if name == "cold":
            shutil.rmtree(cache_root, ignore_errors=True)
            seeded(cache_root)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(2)]


def _native_abort(stderr: str) -> bool:
    return "SIGABRT" in stderr or "terminate called" in stderr


def test_torchrun_group_compiles_each_piece_once_on_one_owner(tmp_path):
    """Two small pieces (ATOM_COMPILE_GROUP_OWNERS=auto): one rank compiles both, rather
    than two processes each paying Inductor's set-up; the other loads them."""
    root = tmp_path / "cache"
    cold = _torchrun(tmp_path, "cold", root)
    assert all(r["max_abs_err"] < TOL for r in cold), [r["max_abs_err"] for r in cold]
    unique = cold[0]["counters"]["num_piecewise_capturable_graphs_seen"]
    assert unique == 2  # embed+layer0 | layer0+norm
    assert total(cold, "num_inductor_compiles") == unique
    [g0], [g1] = cold[0]["group"], cold[1]["group"]
    assert 0 < g0["cost"] == g1["cost"] < COST_PER_OWNER and g0["max_owners"] == g1["max_owners"] == 1
    assert (g0["owned"], g1["owned"]) == (2, 0) and g0["owners"] == g1["owners"] == {"0": 2}
    assert [r["counters"]["num_inductor_compiles"] for r in cold] == [2, 0]
    assert [r["counters"]["num_peer_pieces_loaded"] for r in cold] == [0, 2]
    assert g0["peer_problem"] is None and total(cold, "num_cache_errors") == 0
    # the loader linked the owner's compiled C++ libraries instead of building them again
    libs = [{p.name: p.stat().st_ino for p in root.glob(f"torch_compile_cache/*/rank_{r}/*/inductor/**/*.so")}
            for r in range(2)]
    assert libs[0] and libs[0] == libs[1], libs

    warm = _torchrun(tmp_path, "warm", root)
    assert all(r["max_abs_err"] < TOL for r in warm)
    assert total(warm, "num_inductor_compiles") == 0 and total(warm, "num_cache_errors") == 0


def test_compile_sizes_and_ranges_join_the_agreement(tmp_path):
    """Every compile of a piece (general shape, a compile range, a compile size) is one unit
    of the exchange: 2 pieces x 3 shapes = 6 compiles, 3 per rank (two owners asked for by
    ATOM_COMPILE_GROUP_OWNERS), none at run time (the size compiled ahead serves the call of
    8 tokens, the range [1, 4) the call of 2)."""
    root = tmp_path / "cache"
    shapes = ("--compile-sizes", "8", "--ranges", "1-4")
    cold = _torchrun(tmp_path, "cold", root, *shapes, owners="2")
    assert all(r["max_abs_err"] < TOL for r in cold), [r["max_abs_err"] for r in cold]
    [g0], [g1] = cold[0]["group"], cold[1]["group"]
    assert g0["pieces"] == g1["pieces"] == 6 and g0["unique_missing"] == 6
    assert (g0["owned"], g1["owned"]) == (3, 3) and g0["owners"] == {"0": 3, "1": 3}
    assert [r["counters"]["num_inductor_compiles"] for r in cold] == [3, 3]
    assert [r["counters"]["num_peer_pieces_loaded"] for r in cold] == [3, 3]
    # per rank: 2 ranges + 2 sizes in the agreement, no size compiled (or loaded) at its call
    assert [r["counters"]["num_concrete_compilations"] for r in cold] == [4, 4]
    assert total(cold, "num_cache_errors") == 0

    warm = _torchrun(tmp_path, "warm", root, *shapes)
    assert all(r["max_abs_err"] < TOL for r in warm)
    assert total(warm, "num_inductor_compiles") == 0 and total(warm, "num_cache_errors") == 0
    _tools_ignore_the_locks(tmp_path, root)


def _tools_ignore_the_locks(tmp_path, root) -> None:
    """The shared store's locks/ (key locks, a probe a killed rank left behind) is neither
    exported nor taken for damage; inspect lists the sizes and ranges beside the general shape."""
    [cache] = [p for p in (root / "torch_compile_cache").iterdir() if len(p.name) == 16]
    [locks] = list(cache.glob("shared/*/locks"))
    assert not list(locks.glob("probe-*"))  # each rank removed its own after the agreement
    (locks / ("probe-" + "0" * 32)).write_bytes(b"")
    assert " ok " in cli("verify", cache.name, "--cache-root", str(root))
    assert "shapes        general,8,1-4" in cli("inspect", cache.name, "--cache-root", str(root))
    archive = tmp_path / "tp.tar.gz"
    cli("export", cache.name, "-o", str(archive), "--cache-root", str(root))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any("/rank_1/" in n for n in names) and not any("/shared" in n or "probe-" in n for n in names)


@pytest.mark.parametrize("stall", [False, True], ids=["killed", "hung"])
def test_rank_killed_in_its_share_the_other_finishes(tmp_path, stall):
    """Rank 1 dies (or hangs, holding its piece's lock) inside the compile of its share: rank 0
    passes the barrier with one warning, compiles the missing piece itself and answers
    correctly, in one timeout: the lock of the hung owner is not waited for a second time."""
    root = tmp_path / "cache"
    started = time.monotonic()
    # the hung case waits this out at the barrier. 12 s: the two ranks meet at the exchange
    # within it, and the rest (measured 4.7 s: LOCK_GRACE_S plus one tiny compile) stays well
    # under timeout - LOCK_GRACE_S, so the check below still tells one timeout from two
    timeout = 12.0
    procs = start_group(tmp_path, root, "k", 2, "--replicated", "--layers", "1",
                        "--die-in-compile", str(tmp_path / "dying"), "--die-rank", "1",
                        *(["--stall"] if stall else []),
                        extra_env={"ATOM_COMPILE_PEER_TIMEOUT": str(int(timeout)), "ATOM_COMPILE_GROUP_OWNERS": "2"})
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
    # the rest (one tiny compile, a few seconds) waited at most LOCK_GRACE_S for the hung
    # owner's lock; waiting a full timeout again would put it past `timeout`
    assert g["rest_s"] < timeout - LOCK_GRACE_S, g
    err = (tmp_path / "k-0.err").read_text()
    assert err.count("atom-compile:") == 1, err[-3000:]  # one warning, no second from the locks
    assert err.count("not every rank finished its share") == 1, err[-3000:]
