"""`inspect` and `verify` against a real cache, and against damaged copies of it."""

from __future__ import annotations

import json

from cli_helpers import artifacts, cache_dir, copy_root, one_line_error, run


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
    rel = victim.relative_to(cache_dir(root, warmed["hash"]))
    assert bad.returncode == 1 and "DAMAGED" in bad.stdout and f"! {rel}: its sha256" in bad.stdout
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


def test_counts_and_sizes_agree_across_inspect_verify_and_export(warmed, env, tmp_path):
    root = str(warmed["root"])
    listed = json.loads(run(env, "inspect", "--json", "--cache-root", root).stdout)["caches"][0]
    checked = json.loads(run(env, "--json", "verify", "--cache-root", root).stdout)["caches"][0]
    exported = json.loads(run(env, "export", warmed["hash"], "-o", str(tmp_path / "c.tar.gz"), "--cache-root", root,
                              "--json").stdout)
    # 3 pieces x (general + size 4) = 6 artifacts, and the saved Dynamo function apart from them
    assert listed["artifacts"] == checked["artifacts_checked"] == exported["artifacts"] == 6
    assert listed["dynamo_functions"] == checked["dynamo_functions_checked"] == exported["dynamo_functions"] == 1
    assert listed["cache_bytes"] == checked["cache_bytes"] == exported["cache_bytes"]
    assert listed["scratch_bytes"] == exported["scratch_bytes"] > 0
    assert listed["cache_bytes"] + listed["scratch_bytes"] == listed["bytes"]
    text = run(env, "inspect", warmed["hash"], "--cache-root", root).stdout
    assert "6 artifacts, 1 Dynamo function; 6 index entries" in text
    assert "artifacts " in text and "Inductor files " in text
