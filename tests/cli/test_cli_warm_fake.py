"""`warm --fake-weights`: a build step that compiles without weight memory, into the very cache
that a real run with real weights loads (real subprocesses, real Inductor compiles)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli_helpers import MODEL, SIZES, run
from support.isa import seeded


def _entries(root: Path, cache_hash: str) -> set[tuple]:
    (index,) = (root / "torch_compile_cache" / cache_hash).glob("rank_*/*/index.json")
    doc = json.loads(index.read_text())
    return {(e["runtime_shape"], e["graph_index"], e["content_key"]) for e in doc["entries"]}


@pytest.fixture(scope="module")
def fake_warmed(env, tmp_path_factory) -> dict:
    root = seeded(tmp_path_factory.mktemp("fake") / "root")  # the session's CPU ISA answer
    proc = run(env, "warm", *MODEL, *SIZES, "--fake-weights", "--cache-root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    report["root"] = root
    return report


def test_fake_weight_warm_compiles_every_piece_and_allocates_no_weights(fake_warmed):
    r = fake_warmed
    assert r["fake_weights"] is True
    assert r["real_weight_bytes"] == 0
    # the tiny Llama's parameters and its rotary table, as a real build allocates them (float32)
    assert r["weight_bytes"] == 4 * (512 * 64 + 2 * (64 + 64 * 128 + 64 * 64 + 64 + 64 * 256 + 128 * 64) + 64
                                     + 512 * 64 + 2048 * 16)
    assert r["compiled"] == 6 and r["counters"]["num_concrete_compilations"] == 3
    assert r["counters"]["num_dynamo_functions_saved"] == 1
    assert r["cudagraphs_recorded"] == [] and any("real weights" in n for n in r["notes"])


def test_fake_weight_cache_is_the_real_warms_cache(fake_warmed, warmed):
    """Same hash, same index entries (shape, piece, content key) as a warm with real weights."""
    assert fake_warmed["cache_hashes"] == [warmed["hash"]]
    assert _entries(fake_warmed["root"], warmed["hash"]) == _entries(warmed["root"], warmed["hash"])


REAL_RUN = """
import json, sys
import torch
import atom_compile as ac
from atom_compile.models import build_model, preset
from atom_compile.ops.attention import PagedAttentionMetadataBuilder

cfg = ac.Config(compilation_config=ac.CompilationConfig(level=3, compile_sizes=[4], cache_dir=sys.argv[1]))
model = build_model(preset("tiny", num_layers=2), compilation_config=cfg)
model.allocate_kv_cache(4, 16)
builder = PagedAttentionMetadataBuilder(8, 8, 1, 16)
err = 0.0
with torch.inference_mode():
    for n in (8, 4, 3):  # the general shape, the compile size, and the general piece at another size
        ids, pos, meta, ctx = builder.build_for_capture(n, 1)
        with ac.set_forward_context(meta, None, ctx, no_compile_layers=model.no_compile_layers):
            out = model(ids, pos)
            eager = type(model.model).forward(model.model, ids, pos)  # the same weights, no compiled code
        err = max(err, (out - eager).abs().max().item())
print(json.dumps({"counters": ac.compilation_counter.as_dict(), "max_abs_err": err}))
"""


def test_real_run_after_fake_warm_compiles_nothing_and_matches_eager(fake_warmed, env):
    """A fresh process with real (random) weights: every piece and the compile size load, Dynamo
    and Inductor never run, and the outputs equal eager's."""
    proc = subprocess.run([sys.executable, "-c", REAL_RUN, str(fake_warmed["root"])], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    c = report["counters"]
    assert c["num_inductor_compiles"] == 0 and c["num_eager_compiles"] == 0
    assert c["num_dynamo_functions_loaded"] == 1 and c["num_graphs_seen"] == 0
    assert c["num_compiled_artifacts_loaded"] == 6 and c["num_concrete_compilations"] == 3
    assert report["max_abs_err"] < 1e-4


def test_fake_build_of_a_1b_model_allocates_no_parameter_memory(env):
    """Build llama-3.2-1b (4.9 GB of float32 weights) with fake weights: the peak RSS barely moves."""
    code = textwrap.dedent("""
        import json, resource
        import torch
        from atom_compile.cli.warm_model import parse_model_spec, build_config, WarmOptions
        from atom_compile.cli.warm_fake import fake_job, real_tensor_bytes
        cfg, _ = build_config(WarmOptions(model="llama-3.2-1b", cache_dir="/nonexistent-unused"))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        job = fake_job(parse_model_spec("llama-3.2-1b"), cfg, "cpu", None, 8)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"rss_delta": after - before, "weights": job.weight_bytes,
                          "real": real_tensor_bytes(job.model)}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["weights"] > 4.5e9 and r["real"] == 0
    assert r["rss_delta"] < 0.02 * r["weights"], r


FACTORY = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))  # computed in __init__

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


class Stray(MLP):
    def __init__(self):
        super().__init__()
        self.extra = [torch.ones(16)]  # no module tensor: a fake build leaves it on meta

    def forward(self, x):
        return super().forward(x) + self.extra[0]


def build(config):
    return MLP(), lambda n: (torch.randn(n, 16),)


def stray(config):
    return Stray(), lambda n: (torch.randn(n, 16),)
"""


def test_factory_fake_warm_then_real_warm_compiles_nothing(env, tmp_path):
    (tmp_path / "fakemodels.py").write_text(FACTORY)
    root = str(seeded(tmp_path / "root"))  # the session's CPU ISA answer
    opts = ["--level", "2", "--cache-root", root, "--json"]
    fake = run(env, "warm", "fakemodels:build", "--fake-weights", *opts, cwd=str(tmp_path))
    assert fake.returncode == 0, fake.stderr
    f = json.loads(fake.stdout)
    assert f["compiled"] == 1 and f["real_weight_bytes"] == 0 and f["weight_bytes"] == 4 * (16 * 32 + 32 + 32 * 16 + 16 + 16)
    real = run(env, "warm", "fakemodels:build", *opts, cwd=str(tmp_path))
    assert real.returncode == 0, real.stderr
    r = json.loads(real.stdout)
    assert r["cache_hashes"] == f["cache_hashes"]
    assert r["compiled"] == 0 and r["loaded"] == 1 and r["real_weight_bytes"] == r["weight_bytes"]


def test_a_model_the_fake_build_cannot_key_is_refused_with_the_reason(env, tmp_path):
    (tmp_path / "fakemodels.py").write_text(FACTORY)
    root = tmp_path / "root"
    proc = run(env, "warm", "fakemodels:stray", "--fake-weights", "--level", "2", "--cache-root", str(root),
               cwd=str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("atom-compile-cache warm: error:")]
    assert "--fake-weights" in line and "meta device" in line and "warm with real weights" in line
    assert not list(root.glob("torch_compile_cache/*/rank_*/*/artifacts/*.bin"))  # nothing was compiled


def test_python_api_runs_a_fake_weight_warm(tmp_path):
    """atom_compile.warm(..., fake_weights=True): the `warm --json` report (level 1: Dynamo runs
    the model as traced, on fake weights, and nothing is cached)."""
    import atom_compile

    r = atom_compile.warm("tiny", fake_weights=True, level=1, layers=1, cache_dir=tmp_path / "root")
    assert r["fake_weights"] is True and r["real_weight_bytes"] == 0 and r["weight_bytes"] > 0
    assert r["level"] == 1 and r["compiled"] == 0 and r["caches"] == []
    assert r["model"] == "tiny (1 layer, fake weights)"
