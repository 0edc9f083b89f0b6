"""Tensor parallel over gloo on CPU: 2 ranks, 1 layer of the tiny Llama, real processes.

Identical pieces are compiled by one rank of all the processes that share a cache root and
loaded by the others; a dead or hung owner is passed by.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from .helpers import env, finish, start_group, start_rank, stderr_tail, total


TOL = 1e-5


def _content_records(cache_root) -> list:
    return sorted((cache_root / "torch_compile_cache").glob("*/shared/*/content/*.json"))


GROUP_NAMES = ["a-0", "a-1", "b-0", "b-1"]
ONE_LAYER = ("--layers", "1")  # two pieces, each its own code: what the tests below need, at half the work


def test_two_groups_compile_each_piece_once_then_nothing(tmp_path, two_groups):
    """Two groups (4 processes) on one cold root: each piece is compiled once, by one rank, and
    loaded by the three others (the module's cache, made once: see two_groups). Nothing is
    compiled by a warm group (test_a_warm_rank_traces_with_a_cold_peer's first run) nor by one
    started from the exported and imported copy (_archive_round_trip)."""
    root, unique, reports = _copy_of(two_groups, tmp_path), two_groups[1], two_groups[2]
    assert all(r["max_abs_err"] < TOL for r in reports), [r["max_abs_err"] for r in reports]
    assert unique == 2  # embed+layer0 | layer0+norm: different code each
    assert len(_content_records(root)) == unique
    assert total(reports, "num_inductor_compiles") == unique, stderr_tail(two_groups[3], GROUP_NAMES)
    assert total(reports, "num_peer_pieces_loaded") == 4 * unique - unique
    assert total(reports, "num_cache_errors") == 0
    _archive_round_trip(tmp_path, root, unique)


def test_locks_only_loader_links_the_owners_libraries(tmp_path):
    """No agreement (ATOM_COMPILE_GROUP_COMPILE=0): the ranks meet at each piece's lock; the
    owner commits its index before it lets go, so the loader links the owner's C++ libraries
    rather than running the C++ compiler again."""
    root = tmp_path / "cache"
    procs = start_group(tmp_path, root, "l", 2, "--layers", "1", extra_env={"ATOM_COMPILE_GROUP_COMPILE": "0"})
    reports = finish(tmp_path, procs, ["l-0", "l-1"])
    assert all(r["max_abs_err"] < TOL for r in reports), [r["max_abs_err"] for r in reports]
    assert all(r["group"] == [] for r in reports)  # no agreement ran
    assert total(reports, "num_inductor_compiles") == 2 and total(reports, "num_peer_pieces_loaded") == 2
    libs = [{p.name: p.stat().st_ino for p in root.glob(f"torch_compile_cache/*/rank_{r}/*/inductor/**/*.so")}
            for r in range(2)]
    assert libs[0] and libs[0] == libs[1], libs
    assert total(reports, "num_cache_errors") == 0


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    """Two cold groups (2 ranks each, 1 layer) at once into a fresh root, made once for the tests
    that start from a cache groups compiled: each works on its own copy (_copy_of). Returns the
    root, the number of unique pieces, the four ranks' reports and the folder of their stderr."""
    tmp = tmp_path_factory.mktemp("tp-two-groups")
    root = tmp / "cache"
    procs = start_group(tmp, root, "a", 2, *ONE_LAYER) + start_group(tmp, root, "b", 2, *ONE_LAYER)
    reports = finish(tmp, procs, GROUP_NAMES)
    return root, reports[0]["counters"]["num_piecewise_capturable_graphs_seen"], reports, tmp


def _copy_of(group, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(group[0], root, symlinks=True)
    return root


def test_published_pieces_load_while_their_locks_are_held(tmp_path, two_groups):
    """A rank that finds a piece published loads it without the piece's lock: loaders do not
    take turns (each waiting out the others' loads), nor wait on a peer that holds the lock."""
    import filelock

    root, unique = _copy_of(two_groups, tmp_path), two_groups[1]
    for own in root.glob("torch_compile_cache/*/rank_*"):
        shutil.rmtree(own)  # the ranks start with nothing of their own: every piece is published
    locks = [filelock.FileLock(str(p)) for p in root.glob("torch_compile_cache/*/shared/*/locks/*.lock")]
    assert len(locks) == unique
    for lock in locks:
        lock.acquire()
    try:
        reports = finish(tmp_path, start_group(tmp_path, root, "h", 2, "--layers", "1",
                                               extra_env={"ATOM_COMPILE_PEER_TIMEOUT": "120"}),
                         ["h-0", "h-1"], timeout=100)
    finally:
        for lock in locks:
            lock.release()
    assert all(r["max_abs_err"] < TOL for r in reports)
    assert total(reports, "num_inductor_compiles") == 0
    assert [r["counters"]["num_peer_pieces_loaded"] for r in reports] == [unique, unique]
    assert total(reports, "num_cache_errors") == 0


def test_a_warm_rank_traces_with_a_cold_peer(tmp_path, two_groups):
    """A warm group (both ranks' caches warm) compiles nothing. Then one rank's own cache is
    warm, its peer's is empty: the warm rank sets its saved forward aside and traces with the
    peer (one exchange decides it for the group), rather than run into the model's collectives
    while the peer waits in the agreement; nothing is compiled."""
    root, unique = _copy_of(two_groups, tmp_path), two_groups[1]
    warm = finish(tmp_path, start_group(tmp_path, root, "v", 2, "--layers", "1"), ["v-0", "v-1"])
    assert all(r["max_abs_err"] < TOL for r in warm)
    assert total(warm, "num_inductor_compiles") == 0 and total(warm, "num_cache_errors") == 0
    assert [r["counters"]["num_dynamo_functions_loaded"] for r in warm] == [1, 1]
    assert total(warm, "num_dynamo_functions_set_aside") == 0
    for own in root.glob("torch_compile_cache/*/rank_1"):
        shutil.rmtree(own)
    reports = finish(tmp_path, start_group(tmp_path, root, "m", 2, "--layers", "1",
                                           extra_env={"ATOM_COMPILE_PEER_TIMEOUT": "60"}),
                     ["m-0", "m-1"], timeout=120)
    assert all(r["max_abs_err"] < TOL for r in reports), [r["max_abs_err"] for r in reports]
    assert [r["counters"]["num_dynamo_functions_set_aside"] for r in reports] == [1, 0]
    assert total(reports, "num_inductor_compiles") == 0
    assert [r["counters"]["num_peer_pieces_loaded"] for r in reports] == [0, unique]
    assert all(g["peer_problem"] is None for r in reports for g in r["group"])
    assert total(reports, "num_cache_errors") == 0


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "atom_compile.cli", *args], capture_output=True, text=True,
                          env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _archive_round_trip(tmp_path, root, unique: int) -> None:
    """inspect names the shared pieces; export/import move both ranks as one cache whose
    shared artifacts stay one file each; the imported copy starts the group with no compile."""
    [cache_hash] = [p.name for p in (root / "torch_compile_cache").iterdir() if len(p.name) == 16]
    text = _cli("inspect", cache_hash, "--cache-root", str(root))
    assert f"shared        {unique} artifacts (TPLlamaModel)" in text and "rank_1/TPLlamaModel" in text
    archive, fresh = tmp_path / "tp.tar.gz", tmp_path / "fresh"
    _cli("export", cache_hash, "-o", str(archive), "--cache-root", str(root))
    _cli("import", str(archive), "--cache-root", str(fresh))
    arts = sorted((fresh / "torch_compile_cache" / cache_hash).glob("rank_*/*/artifacts/*.bin"))
    assert len(arts) == 2 * unique and len({a.stat().st_ino for a in arts}) == unique
    warm = finish(tmp_path, start_group(tmp_path, fresh, "d", 2, *ONE_LAYER), ["d-0", "d-1"])
    assert all(r["max_abs_err"] < TOL for r in warm)
    assert total(warm, "num_inductor_compiles") == 0 and total(warm, "num_cache_errors") == 0
    _cli("clear", cache_hash, "--yes", "--cache-root", str(fresh))
    assert not (fresh / "torch_compile_cache" / cache_hash).exists()


def _wait_for(path, proc, seconds=120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, "the owner exited before compiling"
        assert time.monotonic() < deadline, "the owner never started compiling"
        time.sleep(0.1)


@pytest.mark.parametrize("stall", [False, True], ids=["killed", "hung"])
def test_owner_dies_or_hangs_mid_compile(tmp_path, stall):
    """Two processes without a group, one cache root: the owner of the first piece is killed
    (or hangs) inside the compiler; the other compiles it itself, once warned, correct."""
    root, ready = tmp_path / "cache", tmp_path / "compiling"
    one_layer = ["--layers", "1"]  # two pieces: keeps the test short
    owner = start_rank(tmp_path, root, "owner", *one_layer, "--die-in-compile", str(ready),
                       *(["--stall"] if stall else []))
    try:
        _wait_for(ready, owner)
        started = time.monotonic()
        other = start_rank(tmp_path, root, "other", *one_layer, extra_env={"ATOM_COMPILE_PEER_TIMEOUT": "3"})
        [report] = finish(tmp_path, [other], ["other"], timeout=180)
        assert time.monotonic() - started < 180
    finally:
        owner.kill()
        owner.wait()
    assert report["max_abs_err"] < TOL
    assert report["counters"]["num_inductor_compiles"] == 2
    err = (tmp_path / "other.err").read_text()
    said = "for more than 3s" if stall else "died while compiling"
    assert err.count(said) == 1, err[-3000:]
