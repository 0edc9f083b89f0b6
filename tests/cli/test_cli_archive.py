"""`export` and `import`: the round trip, and archives that import refuses."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from cli_helpers import artifacts, cache_dir, copy_root, one_line_error, run


def test_export_import_round_trip_then_warm_loads_with_no_compiler_run(warmed, imported, env):
    with tarfile.open(imported["archive"]) as tar:
        names = tar.getnames()
    assert any(n.endswith("index.json") for n in names) and any("/entrypoints/" in n for n in names)
    assert not any(n.endswith((".in_use", ".index.lock", "last_used")) for n in names)
    assert any("/inductor/" in n and n.endswith(".so") for n in names)  # digests cover them: they travel
    assert not any(n.endswith(".lock") for n in names)
    assert "6 artifacts, 1 Dynamo function, 1 entry point" in imported["export"].stdout
    assert "Inductor files" in imported["export"].stdout and "included" in imported["export"].stdout
    fresh = imported["root"]
    assert run(env, "verify", "--cache-root", str(fresh)).returncode == 0
    again = run(env, "import", str(imported["archive"]), "--cache-root", str(fresh))
    assert again.returncode == 0 and "already" in again.stdout
    out = imported["warm"].stdout
    assert "compiled     0 by the compiler" in out and "loaded       6 from the cache" in out
    assert "Dynamo did not run" in out
    assert "rebuilt      Inductor's files" not in out
    assert f"torch_compile_cache/{warmed['hash']}" in out


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
