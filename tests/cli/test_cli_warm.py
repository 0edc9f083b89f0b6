"""`warm` and `explain`: real compiles of the tiny Llama and of a factory model."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cli_helpers import MODEL, SIZES, copy_root, one_line_error, our_lines, run
from support.isa import seeded


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
    assert warmed["rebuilt_inductor_files"] == []


def test_warm_shows_progress_as_plain_lines_off_a_terminal(warmed):
    lines = our_lines(warmed["stderr"])
    assert any(line.startswith("atom-compile-cache: [1/2] general shape") and "3 compiled" in line for line in lines)
    assert any(line.startswith("atom-compile-cache: [2/2] size 4: 3 compiled, 0 loaded") for line in lines)


def test_second_warm_compiles_nothing(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    proc = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "compiled     0" in proc.stdout and "loaded       6 from the cache" in proc.stdout
    assert "Dynamo did not run" in proc.stdout
    assert f"torch_compile_cache/{warmed['hash']}" in proc.stdout
    assert proc.stderr.count("not recorded on cpu") == 1
    assert "rebuilt" not in proc.stdout  # Inductor's files were there


def test_a_damaged_index_warns_once(warmed, env, tmp_path):
    root = copy_root(warmed, tmp_path)
    (index,) = (root / "torch_compile_cache" / warmed["hash"]).glob("rank_*/*/index.json")
    index.write_text("{ truncated")
    proc = run(env, "warm", *MODEL, *SIZES, "--cache-root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert sum("ignoring the cache index" in line for line in our_lines(proc.stderr)) == 1, proc.stderr
    # its pieces are not lost: each comes back from the shared store's verified copy (<hash>/shared/)
    assert "compiled     0 by the compiler" in proc.stdout and "loaded       6 from the cache" in proc.stdout


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
    root = seeded(tmp_path / "root")  # the session's CPU ISA answer (tests/support/isa.py)
    proc = run(env, "warm", "cli_factory_model:build", "--level", "2", "--cache-root", str(root),
               "--json", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled"] == 1 and report["pieces"] == 1
    assert report["caches"][0]["prefixes"] == ["Net"]
    missing = run(env, "warm", "cli_factory_model:nope", "--cache-root", str(root), cwd=str(tmp_path))
    assert "no attribute" in one_line_error(missing, 2)


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


def test_explain_compare_names_what_differs_between_two_caches(warmed, env, tmp_path):
    root = warmed["root"]
    (cache_dir,) = [p for p in (root / "torch_compile_cache").iterdir() if len(p.name) == 16]
    same = run(env, "explain", "--compare", cache_dir.name, str(cache_dir), "--cache-root", str(root))
    assert same.returncode == 0, same.stderr
    assert "Same key" in same.stdout
    # the same cache's factors as another machine would have written them: another torch
    other = json.loads((cache_dir / "cache_key_factors.json").read_text())
    other["environment"]["torch"] = "9.9.9"
    (tmp_path / "other.json").write_text(json.dumps(other))
    miss = run(env, "explain", "--compare", cache_dir.name, str(tmp_path / "other.json"), "--cache-root", str(root),
               "--json")
    assert miss.returncode == 1, miss.stderr
    report = json.loads(miss.stdout)
    assert report["same_key"] is False
    assert report["differences"] == [f"environment.torch: A {json.loads((cache_dir / 'cache_key_factors.json').read_text())['environment']['torch']}, B 9.9.9"]
    bad = run(env, "explain", "--compare", "nothing-here", cache_dir.name, "--cache-root", str(root))
    assert "--compare: nothing-here" in one_line_error(bad, 2)
