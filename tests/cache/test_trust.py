"""The cache as a trust boundary (issue 14): one test per attack and per damage, in real processes.

We run as root here: another owner is simulated with os.chown to uid 65534.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from atom_compile.cache import archive, inventory, trust
from atom_compile.cache.index import entry_binding, parse_index
from atom_compile.cache.verify import verify_cache
from atom_compile.errors import IndexInvalid
from support.jobs import run_job

from _damage_loop import KINDS, bad_rounds

TOL = 1e-4
AS_ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
CLI = [sys.executable, "-m", "atom_compile.cli"]


def _job(root: Path, *args: str) -> dict:
    return run_job("--cache-root", str(root), "--layers", "1", *args)


def _warnings(report: dict) -> list[str]:
    return [line for line in report["stderr"].splitlines() if line.startswith("WARNING")]


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, dict]:
    """A cache made by one cold run (tiny Llama, 1 layer, level 3); tests work on copies."""
    root = tmp_path_factory.mktemp("trust") / "root"
    old = os.umask(0o002)  # a careless umask: what we create must be private all the same
    try:
        report = _job(root)
    finally:
        os.umask(old)
    assert report["counters"]["num_inductor_compiles"] == 2 and not _warnings(report), report["stderr"]
    return root, report


def _copy(cold, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(cold[0], root, symlinks=True)
    return root


def _prefix(root: Path) -> Path:
    (path,) = root.glob("torch_compile_cache/*/rank_0/*")
    return path


def _verify(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.run([*CLI, "verify", "--cache-root", str(root)], capture_output=True, text=True,
                          env=env, timeout=120)


def _warm_ok(report: dict, cold) -> None:
    assert report["output_sha256"] == cold[1]["output_sha256"], "not bit-identical with the cold run"
    assert report["max_abs_err"] < TOL


# --- attacks ---------------------------------------------------------------------------------


def test_world_writable_inductor_dir_with_planted_python_never_runs(cold, tmp_path):
    root = _copy(cold, tmp_path)
    scratch = _prefix(root) / "inductor"
    marker = tmp_path / "planted-ran"
    victim = next(scratch.rglob("*.py"))
    victim.write_text(f"open({str(marker)!r}, 'w').write('x')\n" + victim.read_text())
    os.chmod(scratch, 0o777)
    bad = _verify(root)
    assert bad.returncode == 1 and str(scratch) in bad.stdout + bad.stderr
    report = _job(root)
    assert not marker.exists(), "planted code ran"
    (line,) = _warnings(report)
    assert str(scratch) in line and "writable by group or others" in line
    _warm_ok(report, cold)
    assert stat.S_IMODE(os.lstat(scratch).st_mode) == 0o700  # ours, only damaged: repaired privately
    assert _verify(root).returncode == 0


def test_world_writable_artifacts_dir_is_not_loaded(cold, tmp_path):
    root = _copy(cold, tmp_path)
    artifacts = _prefix(root) / "artifacts"
    os.chmod(artifacts, 0o777)
    assert str(artifacts) in _verify(root).stdout
    report = _job(root)
    assert report["counters"]["num_compiled_artifacts_loaded"] == 0
    assert any("writable by group or others" in w for w in _warnings(report))
    _warm_ok(report, cold)


def test_symlinked_artifact_is_refused_and_replaced(cold, tmp_path):
    root = _copy(cold, tmp_path)
    victim = next((_prefix(root) / "artifacts").iterdir())
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o777)
    target = outside / victim.name
    target.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(target)
    report = _job(root)
    (line,) = _warnings(report)
    assert str(victim) in line and "symbolic link" in line
    _warm_ok(report, cold)
    assert target.exists() and not victim.is_symlink()  # the link went, its target was never touched


def test_symlinked_hash_dir_is_refused_and_clear_does_not_follow_it(cold, tmp_path):
    root = _copy(cold, tmp_path)
    hash_dir = _prefix(root).parents[1]
    outside = tmp_path / "elsewhere"
    shutil.move(str(hash_dir), str(outside))
    hash_dir.symlink_to(outside, target_is_directory=True)
    report = _job(root)
    assert any("symbolic link" in w for w in _warnings(report))
    assert report["counters"]["num_compiled_artifacts_loaded"] == 0 and report["max_abs_err"] < TOL
    assert _verify(root).returncode == 1
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    subprocess.run([*CLI, "clear", "--all", "--yes", "--cache-root", str(root)], env=env, timeout=120)
    assert any(outside.rglob("*.bin")), "clear deleted files outside the cache root"


@AS_ROOT
def test_index_or_artifact_owned_by_another_user_is_not_trusted(cold, tmp_path):
    root = _copy(cold, tmp_path)
    index = _prefix(root) / "index.json"
    os.chown(index, 65534, 65534)
    assert "owned by uid 65534" in _verify(root).stdout
    report = _job(root)
    (line,) = _warnings(report)
    assert str(index) in line and "owned by uid 65534" in line
    _warm_ok(report, cold)
    assert os.lstat(index).st_uid == os.geteuid() and _verify(root).returncode == 0
    artifact = _prefix(root) / parse_index(index.read_text())["entries"][0]["handle"]["path"]
    os.chown(artifact, 65534, 65534)
    report = _job(root)
    (line,) = _warnings(report)
    assert str(artifact) in line and "owned by uid 65534" in line
    _warm_ok(report, cold)
    assert _verify(root).returncode == 0  # the foreign file was removed, never loaded


@AS_ROOT
def test_inductor_dir_owned_by_another_user_is_never_used(cold, tmp_path):
    root = _copy(cold, tmp_path)
    scratch = _prefix(root) / "inductor"
    before = sorted(p.name for p in scratch.rglob("*"))
    os.chown(scratch, 65534, 65534)
    report = _job(root)
    assert any(str(scratch) in w and "owned by uid 65534" in w for w in _warnings(report))
    assert report["max_abs_err"] < TOL
    assert sorted(p.name for p in scratch.rglob("*")) == before  # nothing written there


def test_umask_002_cold_compile_creates_only_private_files(cold):
    # the cold fixture ran under umask 002: Inductor's files, artifacts, index, locks, dirs
    loose = [p for p in cold[0].rglob("*") if os.lstat(p).st_mode & 0o077]
    assert not loose, loose[:5]
    assert stat.S_IMODE(os.lstat(_prefix(cold[0]) / "inductor").st_mode) == 0o700


def test_cleanup_of_a_bad_entry_never_deletes_through_a_symlinked_artifacts_dir(cold, tmp_path):
    root = _copy(cold, tmp_path)
    artifacts = _prefix(root) / "artifacts"
    outside = tmp_path / "outside"
    shutil.move(str(artifacts), str(outside))
    artifacts.symlink_to(outside, target_is_directory=True)
    victim = next(outside.iterdir())
    victim.write_bytes(b"damaged")
    report = _job(root)
    assert report["max_abs_err"] < TOL and _warnings(report)
    assert victim.exists(), "a file outside the cache was deleted"


def test_swapped_index_entries_are_damage_not_a_wrong_piece(cold, tmp_path):
    root = _copy(cold, tmp_path)
    path = _prefix(root) / "index.json"
    doc = json.loads(path.read_text())
    a, b = doc["entries"][0], doc["entries"][1]
    for field in ("handle", "sha256", "content_key", "graph", "shape_locator", "bytes"):
        a[field], b[field] = b.get(field), a.get(field)
    for e in (a, b):  # re-bound, as a careless hand edit that fixed the bindings would be
        e["binding"] = entry_binding(e)
    path.write_text(json.dumps(doc))
    report = _job(root)
    (line,) = _warnings(report)
    assert str(path) in line and "another graph" in line, report["stderr"][-2000:]
    _warm_ok(report, cold)
    doc["entries"][0]["graph_index"] = 7  # and an unbound edit is refused at parse time
    with pytest.raises(IndexInvalid, match="not bound"):
        parse_index(json.dumps({**doc, "atom_compile_version": parse_index(path.read_text())["atom_compile_version"]}))


def test_deeply_nested_index_is_damage_not_a_recursion_error(cold, tmp_path):
    root = _copy(cold, tmp_path)
    path = _prefix(root) / "index.json"
    path.write_text("[" * 200000 + "]" * 200000)
    bad = _verify(root)
    assert bad.returncode == 1 and "nested" in bad.stdout and "Traceback" not in bad.stderr
    report = _job(root)
    (line,) = _warnings(report)
    assert str(path) in line and "nested" in line
    _warm_ok(report, cold)


def test_eager_compiler_saves_no_dynamo_function_without_its_pieces(tmp_path):
    root = tmp_path / "root"
    first = _job(root, "--compiler", "eager")
    assert first["counters"]["num_dynamo_functions_saved"] == 0
    second = _job(root, "--compiler", "eager")
    assert not _warnings(second) and second["counters"]["num_cache_errors"] == 0


# --- import, export, clear -------------------------------------------------------------------


def _export(root: Path, tmp_path: Path) -> tuple[str, Path]:
    (h,) = inventory.cache_hashes(root)
    out = tmp_path / "cache.tar.gz"
    archive.export_cache(root, h, out)
    return h, out


def test_export_ships_inductor_files_and_import_warm_starts_with_no_compiler_run(cold, tmp_path):
    h, out = _export(cold[0], tmp_path)
    fresh = tmp_path / "fresh"
    assert archive.import_archive(fresh, out)["imported"] == [h]
    scratch = _prefix(fresh) / "inductor"
    before = {p: p.stat().st_mtime_ns for p in scratch.rglob("*") if p.is_file()}
    assert any(p.suffix == ".so" for p in before)
    report = _job(fresh)
    _warm_ok(report, cold)
    assert report["counters"]["num_inductor_compiles"] == 0 and not _warnings(report)
    after = {p: p.stat().st_mtime_ns for p in scratch.rglob("*") if p.is_file() and p.suffix in (".so", ".cpp")}
    assert all(before.get(p) == t for p, t in after.items()), "the C++ compiler ran after the import"


def test_import_places_only_named_files_never_overwrites_and_is_bounded(cold, tmp_path):
    import tarfile

    h, out = _export(cold[0], tmp_path)
    padded = tmp_path / "padded.tar.gz"
    with tarfile.open(out) as src, tarfile.open(padded, "w:gz") as dst:
        for member in src.getmembers():
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        extra = tarfile.TarInfo(f"torch_compile_cache/{h}/rank_0/LlamaModel/zeros.bin")
        extra.size = 1 << 20
        dst.addfile(extra, __import__("io").BytesIO(bytes(extra.size)))
    with pytest.raises(archive.ArchiveError, match="expands to"):
        archive.import_archive(tmp_path / "small", padded, max_bytes=1 << 20)
    fresh = tmp_path / "fresh"
    archive.import_archive(fresh, padded)
    assert not list(fresh.rglob("zeros.bin"))
    (point,) = (fresh / "torch_compile_cache" / "entrypoints").iterdir()
    point.write_text(json.dumps({"hash": h, "mine": True}))
    assert archive.import_archive(fresh, padded)["present"] == [h]
    assert json.loads(point.read_text())["mine"] is True  # an existing entry point is left as it is
    assert not [p for p in fresh.rglob("*") if os.lstat(p).st_mode & 0o077]


def test_unusable_roots_and_bad_older_than_are_usage_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), HOME=str(tmp_path / "home"))
    env.pop("ATOM_COMPILE_CACHE_ROOT", None)
    real = tmp_path / "home" / ".cache" / "atom" / "torch_compile_cache" / "0123456789abcdef"
    real.mkdir(parents=True)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    cases = [["clear", "--all", "--yes", "--cache-root", ""], ["verify", "--cache-root", str(a_file)],
             ["inspect", "--cache-root", str(loop)], ["clear", "--all", "--yes", "--cache-root", str(loop)],
             ["clear", "--older-than", "nan", "--cache-root", str(tmp_path)],
             ["clear", "--older-than", "inf", "--cache-root", str(tmp_path)],
             ["clear", "--older-than", "-1", "--cache-root", str(tmp_path)]]
    for args in cases:
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
    assert real.is_dir()


def test_remove_tree_never_leaves_the_root(tmp_path):
    root = tmp_path / "root"
    trust.make_private_dirs(root, root / "a")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    (root / "a" / "link").symlink_to(outside, target_is_directory=True)
    trust.remove_tree(root, root / "a")
    assert (outside / "keep").exists() and not (root / "a").exists()
    with pytest.raises(trust.Untrusted):
        trust.remove_tree(root, outside)


def test_verify_names_an_untrusted_file(cold, tmp_path):
    root = _copy(cold, tmp_path)
    index = _prefix(root) / "index.json"
    os.chmod(index, 0o666)
    (info,) = inventory.list_caches(root)
    damage = verify_cache(info)
    assert any(str(d.path) == str(index) and "writable" in d.reason for d in damage)
    proc = _verify(root)
    assert proc.returncode == 1 and "index.json" in proc.stdout


# --- damage, at random ---------------------------------------------------------------------


def test_random_damages_are_named_once_recovered_bit_identical_and_repaired(cold, tmp_path):
    """Twelve rounds, each of the six kinds twice on a file the seed picks (the long sweep, many
    seeds and rounds: benchmarks/cache_damage_sweep.py)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    script = Path(__file__).with_name("_damage_loop.py")
    # the module's cold cache (the same model and config as the loop's) is the pristine one: the
    # loop checks it is warm and takes its output as the expected one
    pristine = tmp_path / "pristine"
    shutil.copytree(cold[0], pristine, symlinks=True)
    proc = subprocess.run([sys.executable, str(script), str(pristine), str(tmp_path), str(2 * len(KINDS)), "14"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = bad_rounds(report)
    assert not bad, bad[:5]
    assert sorted(r["kind"] for r in report["rounds"]) == sorted(KINDS * 2)


def test_inductor_autotuning_results_are_checked_for_trust_not_digested(tmp_path):
    """Inductor rewrites `<kernel>.best_config` when a later run tunes again, and torch 2.14 writes
    `<lib>.so.load_ok` after a load: a new digest or a missing marker is not damage, but a
    foreign-owned or world-writable file still is."""
    from atom_compile.cache import scratch

    root = tmp_path / "root"
    inductor = root / "inductor"
    trust.make_private_dirs(root, inductor / "ab")
    kernel, tuned = inductor / "ab" / "kernel.py", inductor / "ab" / "kernel.best_config"
    marker = inductor / "ab" / "kernel.so.load_ok"  # torch 2.14 writes it after loading a library
    for path, text in ((kernel, "x = 1\n"), (tuned, '{"XBLOCK": 64}'), (marker, "")):
        path.write_text(text)
        os.chmod(path, 0o600)
    recorded = scratch.manifest(root, inductor)
    assert list(recorded) == ["ab/kernel.py"]
    tuned.write_text('{"XBLOCK": 128}')
    marker.unlink()
    assert scratch.scratch_problem(root, inductor, recorded) is None
    os.chmod(tuned, 0o666)
    problem = scratch.scratch_problem(root, inductor, recorded)
    assert problem is not None and "kernel.best_config" in problem
    kernel.write_text("import os\n")
    os.chmod(tuned, 0o600)
    assert "its sha256" in scratch.scratch_problem(root, inductor, recorded)
