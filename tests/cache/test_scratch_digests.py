"""The manifest of Inductor's and our kernels' files reads a file again only when it changed.

A cold capture commits the manifest after each of our kernels' first launches (dozens); each
commit used to hash every file of the scratch directory again. These check that an unchanged
file is hashed once per process, and that a change (in place, same size, even with its mtime
put back) or a file too fresh to trust its times is always hashed again."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from atom_compile.cache import scratch, trust
from atom_compile.ops import kernel_dir

from test_kernel_files import _index, _manager, _triton_writes


@pytest.fixture
def hashes(monkeypatch):
    """The paths trust.sha256_and_stat read, in order; the memo starts empty."""
    monkeypatch.setattr(scratch, "_known", {})
    seen: list[str] = []
    real = trust.sha256_and_stat

    def counted(root, path):
        seen.append(Path(path).name)
        return real(root, path)

    monkeypatch.setattr(trust, "sha256_and_stat", counted)
    return seen


def _tree(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, Path]:
    root = tmp_path / "root"
    directory = root / "inductor"
    trust.make_private_dirs(root, directory / "ab")
    for name, data in files.items():
        path = directory / "ab" / name
        path.write_bytes(data)
        os.chmod(path, 0o600)
    return root, directory


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_an_unchanged_file_is_hashed_once_and_a_new_one_alone(tmp_path, monkeypatch, hashes):
    monkeypatch.setattr(scratch, "RACY_NS", 0)  # the files here are a moment old
    root, directory = _tree(tmp_path, {"a.py": b"a = 1\n", "b.cubin": b"\x00" * 100, "c.json": b"{}"})
    first = scratch.manifest(root, directory)
    assert first == {"ab/a.py": _sha(b"a = 1\n"), "ab/b.cubin": _sha(b"\x00" * 100), "ab/c.json": _sha(b"{}")}
    assert sorted(hashes) == ["a.py", "b.cubin", "c.json"]
    assert scratch.manifest(root, directory) == first
    assert len(hashes) == 3
    (directory / "ab" / "d.so").write_bytes(b"lib")
    os.chmod(directory / "ab" / "d.so", 0o600)
    assert scratch.manifest(root, directory) == {**first, "ab/d.so": _sha(b"lib")}
    assert hashes[3:] == ["d.so"]
    assert scratch.scratch_problem(root, directory, first) is None  # the start's check uses it too
    assert len(hashes) == 4


def test_a_file_changed_in_place_is_hashed_again_even_with_its_mtime_put_back(tmp_path, monkeypatch, hashes):
    monkeypatch.setattr(scratch, "RACY_NS", 0)
    root, directory = _tree(tmp_path, {"k.cubin": b"good"})
    path = directory / "ab" / "k.cubin"
    recorded = scratch.manifest(root, directory)
    st = path.stat()
    time.sleep(0.05)  # past a coarse clock's tick: the write's ctime differs
    path.write_bytes(b"evil")  # the same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ctime moves again; no call sets it
    assert scratch.manifest(root, directory) == {"ab/k.cubin": _sha(b"evil")}
    assert "its sha256" in scratch.scratch_problem(root, directory, recorded)
    assert hashes.count("k.cubin") == 2  # the second manifest remembered the evil digest


def test_a_file_hashed_right_after_a_change_is_not_remembered(tmp_path, hashes):
    root, directory = _tree(tmp_path, {"k.cubin": b"good"})
    assert scratch.manifest(root, directory) == {"ab/k.cubin": _sha(b"good")}
    (directory / "ab" / "k.cubin").write_bytes(b"evil")  # within the same clock tick, maybe
    assert scratch.manifest(root, directory) == {"ab/k.cubin": _sha(b"evil")}
    assert scratch.manifest(root, directory) == {"ab/k.cubin": _sha(b"evil")}
    assert hashes == ["k.cubin"] * 3
    assert scratch._known == {}


def test_each_kernel_record_hashes_only_the_files_it_added(tmp_path, monkeypatch, hashes):
    monkeypatch.setattr(scratch, "RACY_NS", 0)
    _manager(tmp_path)._scratch_dir()
    try:
        for i in range(6):
            _triton_writes(f"k{i}.cubin", b"cubin %d" % i)
    finally:  # later tests' kernels compile where Triton would put them
        kernel_dir.use_kernel_dir(None)
    files = _index(tmp_path)["inductor_files"]
    assert {k: v for k, v in files.items() if k.startswith("triton_ops/")} == \
        {f"triton_ops/KEY/k{i}.cubin": _sha(b"cubin %d" % i) for i in range(6)}
    assert sorted(hashes) == sorted(f"k{i}.cubin" for i in range(6))
