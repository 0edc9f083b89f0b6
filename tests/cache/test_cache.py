"""The compiler cache in real processes: warm starts, concurrency, damage, refusals, keys."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import atom_compile as ac
from atom_compile.backends import aot
from atom_compile.cache import keys
from atom_compile.cache.store import parse_index
from support.isa import seeded
from support.jobs import run_job

TOL = 1e-4


def _job(root: Path, *args: str, env: dict | None = None) -> dict:
    """The tiny Llama, 1 layer (two pieces around attention: what these tests need, at less
    work), at level 3 in a fresh process on `root`."""
    return run_job("--cache-root", str(root), "--layers", "1", *args, env=env)


def _index(root: Path) -> tuple[Path, dict]:
    (path,) = root.glob("torch_compile_cache/*/rank_0/*/index.json")
    return path, parse_index(path.read_text())


def _artifact(root: Path) -> Path:
    path, index = _index(root)
    return path.parent / index["entries"][0]["handle"]["path"]


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, dict]:
    """A cache made by one cold run (the tiny Llama at level 3), copied by destructive tests.
    Its root starts with the session's CPU ISA answer (support/isa.py): the probe is not the
    subject here."""
    root = seeded(tmp_path_factory.mktemp("warmed") / "root")
    report = _job(root)
    assert report["counters"]["num_inductor_compiles"] == 2
    assert report["max_abs_err"] < TOL
    return root, report


@pytest.fixture
def warmed(cold) -> Path:
    return cold[0]


def _assert_cache_sound(root: Path) -> None:
    """The index parses and every artifact it names matches its recorded digest."""
    from atom_compile.cache.files import sha256_file

    path, index = _index(root)
    assert index["entries"]
    for entry in index["entries"]:
        assert sha256_file(str(path.parent / entry["handle"]["path"])) == entry["sha256"]
    if index.get("dynamo_function"):
        assert sha256_file(str(path.parent / index["dynamo_function"]["path"])) == index["dynamo_function"]["sha256"]


def _copy(warmed: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(warmed, root)
    return root


def test_cold_then_warm_compiles_nothing_and_is_bit_identical(cold, tmp_path):
    root, first = cold
    warm = _job(_copy(root, tmp_path))  # a copy: the cache moves with its files
    c = warm["counters"]
    assert c["num_inductor_compiles"] == 0 and c["num_compiled_artifacts_loaded"] == 2
    if aot.supported():
        assert c["num_dynamo_functions_loaded"] == 1 and c["num_graphs_seen"] == 0  # Dynamo skipped too
    assert warm["output_sha256"] == first["output_sha256"]
    assert warm["max_abs_err"] < TOL


# A second process of plain torch.compile (no decorator) loads every piece: checked without
# numpy, in the same two processes (tests/test_no_numpy.py's level-3 test).


def test_four_processes_warm_one_empty_cache(tmp_path):
    root = seeded(tmp_path / "root")  # empty of compiled pieces: the ISA probe is not what races
    with ThreadPoolExecutor(4) as pool:  # 1 layer: two pieces, two index entries to race over
        reports = list(pool.map(lambda _: _job(root), range(4)))
    assert all(r["max_abs_err"] < TOL for r in reports)
    _, index = _index(root)  # parses: valid
    assert len(index["entries"]) == 2 and index["dynamo_function"] is not None
    fifth = _job(root)
    assert fifth["counters"]["num_inductor_compiles"] == 0
    assert fifth["counters"]["num_compiled_artifacts_loaded"] == 2


def _damage_artifact_truncate(root):
    path = _artifact(root)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _damage_artifact_flip(root):
    path = _artifact(root)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _damage_artifact_missing(root):
    path = _artifact(root)
    path.unlink()
    return path


def _damage_index_garbage(root):
    path, _ = _index(root)
    path.write_text("{not json at all")
    return path


def _damage_index_empty(root):
    path, _ = _index(root)
    path.write_text("")
    return path


def _damage_index_other_version(root):
    path, index = _index(root)
    index["atom_compile_version"] = "0.0.1"
    path.write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("damage", [_damage_artifact_truncate, _damage_artifact_flip, _damage_artifact_missing,
                                    _damage_index_garbage, _damage_index_empty, _damage_index_other_version],
                         ids=lambda f: f.__name__.removeprefix("_damage_"))
def test_damage_is_named_recompiled_correct_and_repaired(warmed, tmp_path, damage):
    root = _copy(warmed, tmp_path)
    damaged = damage(root)
    report = _job(root)
    assert str(damaged) in report["stderr"], report["stderr"][-2000:]
    # recompiled, or restored from the shared store's copy (<hash>/shared/, checked by its digest)
    assert report["counters"]["num_inductor_compiles"] + report["counters"]["num_peer_pieces_loaded"] >= 1
    assert report["max_abs_err"] < TOL
    _assert_cache_sound(root)
    if damage is _damage_artifact_flip:  # and the repaired cache serves the next start whole
        again = _job(root)
        assert again["counters"]["num_inductor_compiles"] == 0, "the cache was not repaired"
        assert again["max_abs_err"] < TOL and "WARNING" not in again["stderr"]


def test_read_only_cache_loads_and_warns_on_write(warmed, tmp_path):
    root = _copy(warmed, tmp_path)
    loads = _job(root, "--fail-writes", "readonly")
    assert loads["counters"]["num_inductor_compiles"] == 0 and loads["max_abs_err"] < TOL
    # a config this read-only cache has never seen: compiles, cannot save, stays correct
    other = _job(root, "--fail-writes", "readonly", "--compiler", "eager")
    assert other["max_abs_err"] < TOL
    assert "WARNING" in other["stderr"] and "compiling without the cache" in other["stderr"]
    assert other["counters"]["num_compiled_artifacts_saved"] == 0


def test_full_disk_compiles_correctly_with_a_warning(warmed, tmp_path):
    root = _copy(warmed, tmp_path)
    cache_dir = _index(root)[0].parent
    for path in cache_dir.rglob("*"):  # the directories exist, every write fails
        if path.is_file():
            path.unlink()
    report = _job(root, "--fail-writes", "full")
    assert report["max_abs_err"] < TOL
    # the first compile learns of the full disk in Inductor's own writes and runs again elsewhere
    assert report["counters"]["num_inductor_compiles"] >= 2
    assert report["counters"]["num_compiled_artifacts_saved"] == 0
    assert "no space left on the device" in report["stderr"]


def test_cache_writable_by_others_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "torch_compile_cache").mkdir(parents=True)
    os.chmod(root / "torch_compile_cache", 0o777)
    report = _job(root, "--compiler", "eager")
    assert "writable by group or others" in report["stderr"]
    assert report["counters"]["num_compiled_artifacts_saved"] == 0
    assert report["max_abs_err"] < TOL


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a directory away")
def test_cache_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "torch_compile_cache").mkdir(parents=True, mode=0o755)
    os.chown(root / "torch_compile_cache", 65534, 65534)
    report = _job(root, "--compiler", "eager")
    assert "owned by uid 65534" in report["stderr"]
    assert report["counters"]["num_compiled_artifacts_saved"] == 0 and report["max_abs_err"] < TOL


def test_disable_cache_writes_nothing(tmp_path):
    root = tmp_path / "root"
    report = _job(root, "--compiler", "eager", env={"ATOM_COMPILE_DISABLE_CACHE": "1"})
    assert report["max_abs_err"] < TOL
    assert not root.exists()


MODEL_SOURCE = '''
import torch
from torch import nn
import atom_compile as ac


@ac.support_torch_compile
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))  # VARIANT
'''

RUNNER = '''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import atom_compile as ac
import user_model
cfg = ac.Config(compilation_config=ac.CompilationConfig(level=3, compiler="eager", compile_sizes=[int(sys.argv[2])]))
torch.manual_seed(0)
m = user_model.Mlp(compilation_config=cfg).requires_grad_(False)
m(torch.randn(4, 8))
print(json.dumps(ac.compilation_counter.as_dict()))
'''


def test_traced_source_and_config_changes_give_new_hashes_unrelated_fields_do_not(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "user_model.py").write_text(MODEL_SOURCE)
    root = tmp_path / "root"

    def run(size: int) -> dict:
        env = dict(os.environ, ATOM_COMPILE_CACHE_ROOT=str(root))
        out = subprocess.run([sys.executable, "-c", RUNNER, str(src), str(size)], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    hashes = lambda: sorted(p.name for p in (root / "torch_compile_cache").iterdir() if len(p.name) == 16)  # noqa: E731
    run(8)
    assert len(hashes()) == 1
    (src / "user_model.py").write_text(MODEL_SOURCE.replace("# VARIANT", "# edited"))
    assert run(8)["num_dynamo_functions_loaded"] == 0
    assert len(hashes()) == 2  # a changed traced file gives a new hash (a hit is tested above)
    run(16)
    assert len(hashes()) == 3  # a compile-relevant config field too


def test_factor_hash_torch_version_and_unrelated_fields(tmp_path, monkeypatch):
    source = tmp_path / "m.py"
    source.write_text("x = 1\n")
    cc = ac.CompilationConfig(level=3, compile_sizes=[4])
    base = keys.build_factors(cc, {"compiler": "c"}, "cpu", [str(source)], [], "g")
    h = keys.compute_hash(base)
    moved = tmp_path / "elsewhere.py"
    moved.write_text("x = 1\n")
    # paths, debug and cache locations never enter the hash; content does
    same_cc = ac.CompilationConfig(level=3, compile_sizes=[4], cache_dir="/x", debug_dump_path="/y")
    assert keys.compute_hash(keys.build_factors(same_cc, {"compiler": "c"}, "cpu", [str(moved)], [], "g")) == h
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    newer = keys.build_factors(cc, {"compiler": "c"}, "cpu", [str(source)], [], "g")
    assert keys.compute_hash(newer) != h
    assert any(line.startswith("environment.torch") for line in keys.diff_factors(base, newer))
    source.write_text("x = 2\n")
    edited = keys.build_factors(cc, {"compiler": "c"}, "cpu", [str(source)], [], "g")
    assert any("m.py changed" in line for line in keys.diff_factors(base, edited))
