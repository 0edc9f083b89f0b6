"""The remote tier (issue 17): a real redis-server and fsspec's local filesystem.

Machine A (a subprocess with its own HOME and cache root) compiles once and publishes; every
other case starts from what A published: machine B (another process, another HOME, an empty
cache) compiles nothing, and each damage or outage gives a correct result, one warning and a
bounded time. The in-process cases run the real pull against the real server.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atom_compile.cache import remote, signing
from atom_compile.cache.store import PieceCache
from support.isa import seeded
from support.jobs import run_job

redis = pytest.importorskip("redis", reason="the remote tests need the `redis` package (pip install -e '.[test]')")
pytest.importorskip("fsspec", reason="the remote tests need `fsspec` (pip install -e '.[test]')")

KEY = "fleet-test-key-0123456789"
TIMEOUT = 1.0
TOL = 1e-4


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("WARNING")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server on a free port (base URL without the db), stopped after the module."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run does it)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def _env(home: Path, url: str, key: str = KEY) -> dict:
    return {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "ATOM_COMPILE_REMOTE_CACHE": url,
            "ATOM_COMPILE_REMOTE_KEY": key, "ATOM_COMPILE_REMOTE_TIMEOUT": str(TIMEOUT)}


def _machine(home: Path, url: str, key: str = KEY) -> tuple[dict, float]:
    start = time.perf_counter()
    # each machine's new root starts with the session's CPU ISA answer (support/isa.py), as the
    # second process on a host would: the probe is not what these tests compare
    report = run_job("--cache-root", str(seeded(home / "cache")), "--layers", "1", env=_env(home, url, key))
    return report, time.perf_counter() - start


@pytest.fixture(scope="module")
def machine_a(redis_url, tmp_path_factory):
    """Machine A: compiles the tiny Llama (1 layer, level 3) and publishes to redis db 0."""
    home = tmp_path_factory.mktemp("machine_a")
    report, seconds = _machine(home, f"{redis_url}/0")
    report["seconds"] = seconds
    assert report["counters"]["num_inductor_compiles"] == 2, report["stderr"]
    assert not _warnings(report["stderr"]), report["stderr"]
    return home, report


def _copy_db(redis_url: str, db: int) -> redis.Redis:
    """A copy of what machine A published, in db `db` (each case damages its own copy)."""
    source, target = redis.Redis.from_url(f"{redis_url}/0"), redis.Redis.from_url(f"{redis_url}/{db}")
    target.flushdb()
    for key in source.scan_iter():
        target.set(key, source.get(key))
    return target


def _names(client: redis.Redis) -> list[str]:
    start = f"{remote.PREFIX}/entries/"
    return sorted(k.decode()[len(start):-5] for k in client.scan_iter(match=f"{start}*"))


def _assert_warm(report: dict, a_report: dict) -> None:
    assert report["counters"]["num_inductor_compiles"] == 0, report["stderr"]
    assert report["counters"]["num_graphs_seen"] == 0, "Dynamo traced: the entry point did not travel"
    assert report["counters"]["num_dynamo_functions_loaded"] == 1
    assert report["counters"]["num_compiled_artifacts_loaded"] == 2
    assert report["output_sha256"] == a_report["output_sha256"]
    assert not _warnings(report["stderr"]), report["stderr"]


# --- machine B ---------------------------------------------------------------------------------

def test_machine_b_redis_compiles_nothing(machine_a, redis_url, tmp_path):
    report, _ = _machine(tmp_path / "b", f"{redis_url}/0")
    _assert_warm(report, machine_a[1])


def test_machine_b_fsspec_compiles_nothing(machine_a, tmp_path):
    url = f"file://{tmp_path / 'bucket'}"
    tier = remote.RemoteTier(remote.open_store(url, TIMEOUT), KEY.encode(), TIMEOUT)
    proc = subprocess.run([sys.executable, "-m", "atom_compile.cli", "push", "--cache-root",
                           str(machine_a[0] / "cache"), "--remote-cache", url, "--json"],
                          capture_output=True, text=True, env=dict(os.environ, ATOM_COMPILE_REMOTE_KEY=KEY))
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)["caches"]
    assert len(pushed) == 2 and all(c["pushed"] for c in pushed), pushed  # the cache, its entry point
    assert not list((tmp_path / "bucket").rglob(".tmp-*")), "a temporary object was left behind"
    report, _ = _machine(tmp_path / "b", url)
    _assert_warm(report, machine_a[1])


def test_remote_hanging_costs_one_timeout(machine_a, tmp_path):
    """A server that accepts and never answers: one timeout, one warning, a correct compile."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # the kernel accepts connections; nothing ever answers
        report, seconds = _machine(tmp_path / "b", f"redis://127.0.0.1:{server.getsockname()[1]}/0")
    assert report["counters"]["num_inductor_compiles"] == 2
    assert report["max_abs_err"] < TOL
    (warning,) = _warnings(report["stderr"])
    assert "no answer within" in warning and "local cache only" in warning
    assert seconds < machine_a[1]["seconds"] + 3 * TIMEOUT + 30  # a cold compile, plus one timeout


def test_wrong_key_machine_compiles_locally(machine_a, redis_url, tmp_path):
    """Machine B holds another key: A's entries are refused (one warning), B compiles, correctly."""
    _copy_db(redis_url, 5)
    report, _ = _machine(tmp_path / "b", f"{redis_url}/5", key="another-key-0123456789")
    assert report["counters"]["num_inductor_compiles"] == 2
    assert report["max_abs_err"] < TOL
    (warning,) = _warnings(report["stderr"])
    assert "refusing the remote" in warning and "signature does not verify" in warning


# --- pulls in this process against the real server ------------------------------------------------

@pytest.fixture
def empty_cache(machine_a, redis_url, tmp_path):
    """A factory: an empty local piece cache for the name machine A published."""
    (name,) = _names(redis.Redis.from_url(f"{redis_url}/0"))
    cache_hash, rank, prefix = name.split("/")
    return lambda: PieceCache.open(tmp_path / "local", cache_hash, int(rank[5:]), prefix)


def _pull(url: str, cache: PieceCache, caplog, key: str = KEY) -> tuple[bool, float, list[str]]:
    tier = remote.tier_for(url, key, None, TIMEOUT)
    caplog.clear()
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="atom_compile"):
        pulled = tier.pull(cache)
        again = tier.pull(cache)  # the tier is off (outage) or the entry refused once: no more warnings
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not again
    return pulled, time.perf_counter() - start, warnings


def test_pull_installs_a_verified_entry(redis_url, empty_cache, caplog):
    cache = empty_cache()
    pulled, _, warnings = _pull(f"{redis_url}/0", cache, caplog)
    assert pulled and not warnings and cache.index_path.exists()
    assert all(p.stat().st_mode & 0o077 == 0 for p in cache.path.rglob("*") if p.is_file())


@pytest.mark.parametrize("case", ["bad_signature", "wrong_key", "truncated_object", "unsigned"])
def test_refused_entries(case, redis_url, empty_cache, caplog):
    db = {"bad_signature": 1, "wrong_key": 2, "truncated_object": 3, "unsigned": 4}[case]
    client = _copy_db(redis_url, db)
    cache = empty_cache()
    key = f"{remote.PREFIX}/entries/{remote.cache_name(cache)}.json"
    doc = json.loads(client.get(key))
    if case == "bad_signature":
        doc["index"] = doc["index"].replace('"updated"', '"updated" ', 1)
    elif case == "unsigned":
        del doc["signature"]
    elif case == "truncated_object":
        sha = json.loads(doc["index"])["entries"][0]["sha256"]
        data = client.get(remote.object_key(sha))
        client.set(remote.object_key(sha), data[: len(data) // 2])
    client.set(key, json.dumps(doc))
    pulled, seconds, warnings = _pull(f"{redis_url}/{db}", cache, caplog,
                                      key="another-key-0123456789" if case == "wrong_key" else KEY)
    assert not pulled and not cache.index_path.exists(), "a refused entry must leave the local cache empty"
    assert len(warnings) == 1 and "refusing the remote cache entry" in warnings[0], warnings
    assert ("does not match its digest" if case == "truncated_object" else "signature") in warnings[0]
    assert seconds < 2 * TIMEOUT


@pytest.mark.parametrize("case", ["closed_port", "hanging"])
def test_outages_cost_one_timeout(case, empty_cache, caplog):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        if case == "hanging":
            server.listen(64)
        else:
            server.close()
        pulled, seconds, warnings = _pull(f"redis://127.0.0.1:{port}/0", empty_cache(), caplog)
    assert not pulled
    assert len(warnings) == 1 and "local cache only" in warnings[0], warnings
    if case == "hanging":  # the tier's watchdog speaks, not the client's own socket timeout
        assert f"no answer within {TIMEOUT:g} s" in warnings[0], warnings
    assert seconds < TIMEOUT + 1.0


def test_fsspec_truncated_object_is_refused(machine_a, tmp_path, empty_cache, caplog):
    url = f"file://{tmp_path / 'bucket'}"
    tier = remote.RemoteTier(remote.open_store(url, TIMEOUT), KEY.encode(), TIMEOUT)
    assert all(remote.push_all(tier, machine_a[0] / "cache").values())
    victim = max((tmp_path / "bucket").rglob("objects/*"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:100])
    pulled, _, warnings = _pull(url, empty_cache(), caplog)
    assert not pulled and len(warnings) == 1 and "truncated" in warnings[0], warnings


def test_concurrent_publishers_are_harmless(machine_a, tmp_path, empty_cache, caplog):
    """Four publishers of the same cache at once: whole objects, one whole entry, a good pull."""
    url = f"file://{tmp_path / 'bucket'}"
    tiers = [remote.RemoteTier(remote.open_store(url, 30), KEY.encode(), 30) for _ in range(4)]
    results: list[dict] = []
    threads = [threading.Thread(target=lambda t=t: results.append(remote.push_all(t, machine_a[0] / "cache")))
               for t in tiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(all(r.values()) for r in results), results
    assert not list((tmp_path / "bucket").rglob(".tmp-*")), "a temporary object was left behind"
    cache = empty_cache()
    pulled, _, warnings = _pull(url, cache, caplog)
    assert pulled and not warnings


# --- keys -----------------------------------------------------------------------------------------

def test_no_key_means_off(caplog):
    with caplog.at_level(logging.WARNING, logger="atom_compile"):
        assert remote.tier_for("redis://127.0.0.1:1/9", None, None, TIMEOUT) is None
        assert remote.tier_for("redis://127.0.0.1:1/9", None, None, TIMEOUT) is None
    (record,) = caplog.records
    assert "no key is set" in record.getMessage()


def test_key_file_must_be_private(tmp_path):
    path = tmp_path / "key"
    path.write_text("a-secret-of-enough-bytes\n")
    path.chmod(0o644)
    with pytest.raises(signing.KeyProblem, match="chmod 600"):
        signing.load_key(None, str(path))
    path.chmod(0o600)
    assert signing.load_key(None, str(path)) == b"a-secret-of-enough-bytes"
    with pytest.raises(signing.KeyProblem, match="at least 16 bytes"):
        signing.load_key("short", None)
    assert signing.sign(b"k" * 16, "a/rank_0/b", "{}") != signing.sign(b"k" * 16, "a/rank_0/c", "{}")


def test_bad_urls_are_named():
    from atom_compile.config import CompilationConfig, ConfigError

    with pytest.raises(ConfigError, match="remote_cache"):
        CompilationConfig(remote_cache="localhost:6379")
    with pytest.raises(remote.StoreError, match="(?i)nosuchfs.*(not installed|not known)"):
        remote.open_store("nosuchfs://bucket/x", TIMEOUT)
