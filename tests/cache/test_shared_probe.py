"""Which ranks see the same shared store: a fresh probe file per agreement, found by name.

A copied cache root (a container image, an rsync to another node) must not pass for the same
store: the ranks would wait for pieces published into a directory they do not read.
"""

from __future__ import annotations

import shutil

from atom_compile.cache.shared import SharedPieces
from atom_compile.cache.store import PieceCache

HASH = "0123456789abcdef"


def _store(root, rank: int) -> SharedPieces:
    cache = PieceCache.open(root, HASH, rank, "Model")
    assert cache is not None
    return SharedPieces(cache, rank, 10.0)


def test_probe_is_seen_in_the_same_store_only(tmp_path):
    a0, a1 = _store(tmp_path / "a", 0), _store(tmp_path / "a", 1)
    p0, p1 = a0.probe(), a1.probe()
    assert p0 and p1 and p0 != p1
    assert a1.sees(p0) and a0.sees(p1)
    a0.drop_probe()
    a1.drop_probe()
    assert not a1.sees(p0) and not list(a0.path.glob("locks/probe-*"))

    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the whole root, locks/ included
    b1 = _store(tmp_path / "b", 1)
    fresh = a0.probe()
    assert b1.probe() and not b1.sees(fresh) and a1.sees(fresh)


def test_sees_takes_only_probe_names(tmp_path):
    s = _store(tmp_path, 0)
    assert s.probe()
    (s.path / "locks" / "x.lock").write_bytes(b"")
    for bad in (None, 7, "x.lock", "../locks/x.lock", "probe-" + "g" * 32, "probe-" + "0" * 31):
        assert not s.sees(bad), bad
