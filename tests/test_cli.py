"""atom-compile-cache, end to end: every subcommand as a real subprocess against real caches.

One `warm` of the tiny Llama (2 layers, compile size 4) makes the cache every test reads;
destructive tests work on a copy (shutil.copytree). Real Inductor compiles take seconds each
on a small CPU, so only three more model runs happen: a second warm, a warm after an
export/import round trip, and a factory model at level 2.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "atom_compile.cache.cli"]
MODEL = ["--layers", "2"]
SIZES = ["--compile-sizes", "4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The subprocesses' environment: an Inductor cache of their own, no inherited root."""
    out = dict(os.environ)
    out["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    out.pop("ATOM_COMPILE_CACHE_ROOT", None)
    out.pop("ATOM_COMPILE_DISABLE_CACHE", None)
    return out


def run(env: dict, *args: str, timeout: int = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    """The process failed with `code` and said why in exactly one stderr line."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("atom-compile-cache")
    return lines[0]


@pytest.fixture(scope="module")
def warmed(env, tmp_path_factory) -> dict:
    """One cold warm into a fresh root; its JSON report plus the root."""
    root = tmp_path_factory.mktemp("warmed") / "root"
    proc = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["cache_hashes"]) == 1
    report["root"] = root
    report["hash"] = report["cache_hashes"][0]
    return report


def copy_root(warmed: dict, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(warmed["root"], target)
    return target


def cache_dir(root: Path, cache_hash: str) -> Path:
    return root / "torch_compile_cache" / cache_hash


def artifacts(root: Path, cache_hash: str) -> list[Path]:
    return sorted(cache_dir(root, cache_hash).glob("rank_*/*/artifacts/*.bin"))


# --- warm ----------------------------------------------------------------------------------


def test_cold_warm_compiles_every_piece_for_every_shape(warmed):
    c = warmed["counters"]
    assert warmed["pieces"] == 3 and warmed["split_ops"] == 2
    # 3 pieces for the general shape, and again for compile size 4
    assert c["num_inductor_compiles"] == 6 and c["num_concrete_compilations"] == 3
    assert warmed["compiled"] == 6 and warmed["loaded"] == 0
    assert c["num_dynamo_functions_saved"] == 1
    assert warmed["general_tokens"] >= 8 and warmed["compile_sizes"] == [4]
    (cache,) = warmed["caches"]
    assert cache["shapes"] == ["general", 4] and cache["entries"] == 6 and cache["distinct_pieces"] == 3
    assert cache["bytes"] > 0 and warmed["bytes"] == cache["bytes"]
    assert any("not recorded on cpu" in n for n in warmed["notes"])


def test_second_warm_compiles_nothing(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    proc = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "compiled     0" in proc.stdout and "loaded       6 from the cache" in proc.stdout
    assert "Dynamo did not run" in proc.stdout
    assert f"torch_compile_cache/{warmed['hash']}" in proc.stdout
    assert proc.stderr.count("not recorded on cpu") == 1


def test_warm_rejects_bad_model_specs_and_options(env, tmp_path):
    root = str(tmp_path / "root")
    line = one_line_error(run(env, "warm", "nosuch.module:factory", "--cache-root", root), 2)
    assert "nosuch.module" in line
    assert "preset" in one_line_error(run(env, "warm", "nosuch", "--cache-root", root), 2)
    one_line_error(run(env, "warm", "--compile-sizes", "x", "--cache-root", root), 2)
    one_line_error(run(env, "warm", "--level", "7", "--cache-root", root), 2)
    one_line_error(run(env, "warm", "--config", "{not json", "--cache-root", root), 2)
    assert not Path(root).exists()


def test_warm_on_cuda_without_a_device_is_a_usage_error(env, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    line = one_line_error(run(env, "warm", "--device", "cuda", "--cache-root", str(tmp_path)), 2)
    assert "CUDA" in line


def test_warm_a_factory_model(env, tmp_path):
    (tmp_path / "cli_factory_model.py").write_text(textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(8, 8)

            def forward(self, x):
                return torch.relu(self.proj(x)) * 2

        def build(config):
            assert config.compilation_config.level == 2
            return Net(), lambda n: (torch.randn(n, 8),)
    """))
    proc = run(env, "warm", "cli_factory_model:build", "--level", "2", "--cache-root", str(tmp_path / "root"),
               "--json", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled"] == 1 and report["pieces"] == 1
    assert report["caches"][0]["prefixes"] == ["Net"]
    missing = run(env, "warm", "cli_factory_model:nope", "--cache-root", str(tmp_path / "root"), cwd=str(tmp_path))
    assert "no attribute" in one_line_error(missing, 2)


# --- inspect -------------------------------------------------------------------------------


def test_inspect_lists_caches(warmed, env):
    proc = run(env, "inspect", "--cache-root", str(warmed["root"]))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert warmed["hash"] in out and "LlamaModel" in out and "general,4" in out and "level 3" in out
    data = json.loads(run(env, "inspect", "--cache-root", str(warmed["root"]), "--json").stdout)
    (cache,) = data["caches"]
    assert cache["hash"] == warmed["hash"] and cache["entries"] == 6 and cache["ranks"] == [0]
    assert cache["shapes"] == ["general", 4] and cache["bytes"] == warmed["bytes"]
    assert cache["entrypoints"] == 1 and cache["torch_version"] and cache["created"] <= cache["last_used"]


def test_inspect_one_cache_in_detail(warmed, env):
    prefix = warmed["hash"][:6]  # a unique prefix is enough
    proc = run(env, "inspect", prefix, "--cache-root", str(warmed["root"]))
    assert proc.returncode == 0, proc.stderr
    assert "config.compile_sizes" in proc.stdout and "environment.torch" in proc.stdout
    assert proc.stdout.count("inductor_standalone") >= 6
    data = json.loads(run(env, "inspect", warmed["hash"], "--json", "--cache-root", str(warmed["root"])).stdout)
    assert data["factors"]["config"]["level"] == 3
    (piece,) = data["pieces"]
    assert len(piece["entries"]) == 6 and piece["dynamo_function"]["path"] == "dynamo_function.bin"


def test_inspect_unknown_and_bad_hashes(warmed, env, tmp_path):
    root = str(warmed["root"])
    assert "no cache" in one_line_error(run(env, "inspect", "0123456789abcdef", "--cache-root", root), 1)
    assert "bad cache hash" in one_line_error(run(env, "inspect", "not-a-hash", "--cache-root", root), 2)
    empty = run(env, "inspect", "--cache-root", str(tmp_path / "empty"))
    assert empty.returncode == 0 and "No caches" in empty.stdout


# --- verify --------------------------------------------------------------------------------


def test_verify_detects_a_flipped_byte(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    ok = run(env, "verify", "--cache-root", str(root))
    assert ok.returncode == 0 and " ok " in ok.stdout, ok.stdout + ok.stderr
    victim = artifacts(root, warmed["hash"])[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = run(env, "verify", "--cache-root", str(root))
    assert bad.returncode == 1 and "DAMAGED" in bad.stdout and str(victim) in bad.stdout
    report = json.loads(run(env, "verify", warmed["hash"], "--json", "--cache-root", str(root)).stdout)
    assert report["ok"] is False and [d["path"] for d in report["caches"][0]["damaged"]] == [str(victim)]


def test_verify_detects_a_garbage_index(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    (index,) = cache_dir(root, warmed["hash"]).glob("rank_*/*/index.json")
    index.write_text("{ truncated")
    proc = run(env, "verify", "--cache-root", str(root))
    assert proc.returncode == 1 and "not JSON" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert "no cache" in one_line_error(run(env, "verify", "0123456789abcdef", "--cache-root", str(root)), 1)


# --- clear ---------------------------------------------------------------------------------


def test_clear_refuses_without_yes_in_a_script(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    line = one_line_error(run(env, "clear", "--all", "--cache-root", str(root)), 2)
    assert "--yes" in line
    assert cache_dir(root, warmed["hash"]).is_dir()
    dry = run(env, "clear", "--all", "--dry-run", "--cache-root", str(root))
    assert dry.returncode == 0 and warmed["hash"] in dry.stdout and cache_dir(root, warmed["hash"]).is_dir()
    one_line_error(run(env, "clear", "--cache-root", str(root)), 2)
    one_line_error(run(env, "clear", "--all", "--max-size", "1G", "--cache-root", str(root)), 2)
    one_line_error(run(env, "clear", "--max-size", "lots", "--yes", "--cache-root", str(root)), 2)


def test_clear_skips_a_cache_in_use(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    path = cache_dir(root, warmed["hash"])
    fd = os.open(path / ".in_use", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # what a running process holds
    try:
        every = run(env, "clear", "--all", "--yes", "--cache-root", str(root))
        assert every.returncode == 0 and "in use" in every.stderr and path.is_dir()
        named = run(env, "clear", warmed["hash"], "--yes", "--cache-root", str(root))
        assert named.returncode == 1 and "in use" in named.stderr and path.is_dir()
        assert list((root / "torch_compile_cache" / "entrypoints").glob("*.json"))
    finally:
        os.close(fd)
    gone = run(env, "clear", warmed["hash"], "--yes", "--cache-root", str(root))
    assert gone.returncode == 0, gone.stderr
    assert not path.exists()
    assert not list((root / "torch_compile_cache" / "entrypoints").glob("*.json"))  # its entry point went too
    assert not [p for p in (root / "torch_compile_cache").iterdir() if p.name.startswith(".removing")]


def _clone(root: Path, source: str, new_hash: str, age_days: float) -> Path:
    """A copy of a cache under another hash, last used `age_days` ago."""
    target = cache_dir(root, new_hash)
    shutil.copytree(cache_dir(root, source), target)
    when = time.time() - age_days * 86400
    for index in target.glob("rank_*/*/index.json"):
        doc = json.loads(index.read_text())
        doc["created"] = doc["updated"] = when
        index.write_text(json.dumps(doc))
    (target / "last_used").touch()
    os.utime(target / "last_used", (when, when))
    return target


def test_clear_older_than_and_max_size(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    old = _clone(root, warmed["hash"], "00000000000000aa", age_days=40)
    older = _clone(root, warmed["hash"], "00000000000000bb", age_days=60)
    proc = run(env, "clear", "--older-than", "50", "--yes", "--cache-root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert not older.exists() and old.exists() and cache_dir(root, warmed["hash"]).exists()
    # Two caches left; a limit that holds one removes the least recently used one.
    one = warmed["bytes"] + warmed["bytes"] // 2
    proc = run(env, "clear", "--max-size", str(one), "--yes", "--cache-root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["removed"] == ["00000000000000aa"]
    assert cache_dir(root, warmed["hash"]).exists()
    nothing = run(env, "clear", "--max-size", "1T", "--yes", "--cache-root", str(root))
    assert nothing.returncode == 0 and "Nothing to remove" in nothing.stdout


# --- explain -------------------------------------------------------------------------------


def test_explain_says_which_factor_differs(warmed, env):
    root = str(warmed["root"])
    hit = run(env, "explain", *MODEL, *SIZES, "--cache-root", root)
    assert hit.returncode == 0, hit.stdout + hit.stderr
    assert "would hit" in hit.stdout
    miss = run(env, "explain", *MODEL, "--compile-sizes", "8", "--cache-root", root, "--json")
    assert miss.returncode == 1, miss.stderr
    report = json.loads(miss.stdout)
    assert report["hit"] is False
    (cache,) = report["caches"]
    assert cache["differences"] == ["config.compile_sizes: [4] in the cache, now [8]"]


# --- export / import -----------------------------------------------------------------------


def test_export_import_round_trip_then_warm_compiles_nothing(warmed, env, tmp_path):
    archive = tmp_path / "cache.tar.gz"
    proc = run(env, "export", warmed["hash"], "-o", str(archive), "--cache-root", str(warmed["root"]))
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any(n.endswith("index.json") for n in names) and any("/entrypoints/" in n for n in names)
    assert not any(n.endswith((".in_use", ".index.lock", "last_used")) for n in names)
    fresh = tmp_path / "fresh"
    proc = run(env, "import", str(archive), "--cache-root", str(fresh))
    assert proc.returncode == 0, proc.stderr
    assert run(env, "verify", "--cache-root", str(fresh)).returncode == 0
    again = run(env, "import", str(archive), "--cache-root", str(fresh))
    assert again.returncode == 0 and "already" in again.stdout
    proc = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(fresh), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["counters"]["num_inductor_compiles"] == 0
    assert report["counters"]["num_dynamo_functions_loaded"] == 1 and report["loaded"] == 6
    assert report["cache_hashes"] == [warmed["hash"]]


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def test_import_refuses_unsafe_or_damaged_archives(warmed, env, tmp_path):
    root = tmp_path / "root"
    h = warmed["hash"]
    missing = one_line_error(run(env, "import", str(tmp_path / "nope.tar.gz"), "--cache-root", str(root)), 2)
    assert "no such file" in missing
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"this is not an archive" * 100)
    assert "archive" in one_line_error(run(env, "import", str(garbage), "--cache-root", str(root)), 1)
    escape = _archive(tmp_path / "escape.tar.gz", [_file(f"torch_compile_cache/{h}/../../evil.txt", b"x")])
    assert "escapes" in one_line_error(run(env, "import", str(escape), "--cache-root", str(root)), 1)
    absolute = _archive(tmp_path / "abs.tar.gz", [_file("/tmp/evil.txt", b"x")])
    one_line_error(run(env, "import", str(absolute), "--cache-root", str(root)), 1)
    link = tarfile.TarInfo(f"torch_compile_cache/{h}/rank_0")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc"
    linked = _archive(tmp_path / "link.tar.gz", [(link, b"")])
    assert "link" in one_line_error(run(env, "import", str(linked), "--cache-root", str(root)), 1)
    no_index = _archive(tmp_path / "noindex.tar.gz", [_file(f"torch_compile_cache/{h}/cache_key_factors.json", b"{}")])
    assert "no index" in one_line_error(run(env, "import", str(no_index), "--cache-root", str(root)), 1)
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil.txt").exists()
    assert not root.exists() or not any((root / "torch_compile_cache").iterdir())


def test_import_checks_every_digest_before_placing(warmed, env, tmp_path):
    source = copy_root(warmed, tmp_path)
    archive = tmp_path / "cache.tar.gz"
    assert run(env, "export", warmed["hash"], "-o", str(archive), "--cache-root", str(source)).returncode == 0
    # Rewrite the archive with one artifact's bytes changed.
    tampered = tmp_path / "tampered.tar.gz"
    with tarfile.open(archive) as src, tarfile.open(tampered, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name.endswith(".bin") and "/artifacts/" in member.name and data:
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    root = tmp_path / "root"
    line = one_line_error(run(env, "import", str(tampered), "--cache-root", str(root)), 1)
    assert "sha256" in line and "nothing was imported" in line
    assert not cache_dir(root, warmed["hash"]).exists()
    assert [p.name for p in (root / "torch_compile_cache").iterdir()] == []  # no temp dir left
    # Exporting a damaged cache is refused as well.
    victim = artifacts(source, warmed["hash"])[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    one_line_error(run(env, "export", warmed["hash"], "-o", str(tmp_path / "x.tar.gz"), "--cache-root", str(source)), 1)
    assert "no cache" in one_line_error(run(env, "export", "0123456789abcdef", "--cache-root", str(source)), 1)


# --- the torch-free half -------------------------------------------------------------------


def test_inspect_verify_clear_export_import_never_import_torch(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    archive, fresh = tmp_path / "c.tar.gz", tmp_path / "fresh"
    script = textwrap.dedent(f"""
        import sys
        from atom_compile.cache.cli import main
        root, h = {str(root)!r}, {warmed['hash']!r}
        codes = [
            main(["inspect", "--cache-root", root]),
            main(["inspect", h, "--json", "--cache-root", root]),
            main(["verify", "--cache-root", root]),
            main(["export", h, "-o", {str(archive)!r}, "--cache-root", root]),
            main(["import", {str(archive)!r}, "--cache-root", {str(fresh)!r}]),
            main(["clear", "--all", "--dry-run", "--cache-root", root]),
            main(["clear", h, "--yes", "--cache-root", root]),
        ]
        print("CODES", codes, "TORCH", "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "CODES [0, 0, 0, 0, 0, 0, 0] TORCH False" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["warm", "inspect", "clear", "verify", "explain", "export", "import"])
def test_every_subcommand_has_help_with_an_example(env, command):
    proc = run(env, command, "--help", timeout=30)
    assert proc.returncode == 0 and "example" in proc.stdout and "--cache-root" in proc.stdout
