"""Our own Triton kernels' files in the piece cache: routed there, recorded in the manifest,
unrecorded ones removed before Triton may load them, damaged ones repaired (CPU: the files are
written the way Triton's cache writes them; the GPU test runs the real kernels)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atom_compile.backends.base import EagerAdaptor
from atom_compile.backends.manager import CompilerManager
from atom_compile.cache.store import PieceCache
from atom_compile.counters import compilation_counter
from atom_compile.ops import kernel_dir

REPO = Path(__file__).resolve().parents[2]
HASH = "0123456789abcdef"


@pytest.fixture(autouse=True)
def _no_kernel_dir():
    kernel_dir.use_kernel_dir(None)
    yield
    kernel_dir.use_kernel_dir(None)


def _manager(root: Path) -> CompilerManager:
    cache = PieceCache.open(root, HASH, 0, "Model")
    assert cache is not None
    return CompilerManager(EagerAdaptor(), cache, {})


def _triton_writes(name: str, data: bytes) -> None:
    """What Triton's FileCacheManager does on a compile: a file under $TRITON_CACHE_DIR/<key>/."""
    with kernel_dir.compiling():
        target = Path(os.environ["TRITON_CACHE_DIR"]) / "KEY" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _index(root: Path) -> dict:
    return json.loads(next(root.rglob("index.json")).read_text())


def test_first_launch_files_are_recorded_and_env_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    scratch = _manager(tmp_path)._scratch_dir()
    assert kernel_dir.kernel_dir() == os.path.join(scratch, "triton_ops")
    _triton_writes("k.cubin", b"cubin bytes")
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"
    files = _index(tmp_path)["inductor_files"]
    assert files["triton_ops/KEY/k.cubin"] == hashlib.sha256(b"cubin bytes").hexdigest()


def test_a_launch_that_writes_nothing_records_nothing(tmp_path):
    _manager(tmp_path)._scratch_dir()
    _triton_writes("k.cubin", b"cubin bytes")
    index = next(tmp_path.rglob("index.json"))
    stamp = index.stat().st_mtime_ns
    with kernel_dir.compiling():  # a warm start: Triton finds every file
        assert os.environ["TRITON_CACHE_DIR"] == kernel_dir.kernel_dir()
    assert index.stat().st_mtime_ns == stamp
    _triton_writes("k2.cubin", b"more")
    assert "triton_ops/KEY/k2.cubin" in _index(tmp_path)["inductor_files"]


def test_unrecorded_files_are_removed_before_use(tmp_path):
    scratch = Path(_manager(tmp_path)._scratch_dir())
    _triton_writes("k.cubin", b"good")
    planted = scratch / "triton_ops" / "OTHER" / "__triton_launcher.so"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"not recorded")
    kernel_dir.use_kernel_dir(None)  # a new process
    _manager(tmp_path)._scratch_dir()
    assert not planted.exists()
    assert (scratch / "triton_ops" / "KEY" / "k.cubin").read_bytes() == b"good"
    assert kernel_dir.kernel_dir() == str(scratch / "triton_ops")


def test_a_changed_kernel_file_is_repaired_not_loaded(tmp_path):
    scratch = Path(_manager(tmp_path)._scratch_dir())
    _triton_writes("k.cubin", b"good")
    _triton_writes("k.json", b"{}")
    (scratch / "triton_ops" / "KEY" / "k.cubin").write_bytes(b"evil")
    kernel_dir.use_kernel_dir(None)
    errors = compilation_counter.num_cache_errors
    _manager(tmp_path)._scratch_dir()
    assert compilation_counter.num_cache_errors == errors + 1
    assert not (scratch / "triton_ops" / "KEY" / "k.cubin").exists()
    assert (scratch / "triton_ops" / "KEY" / "k.json").read_bytes() == b"{}"


def test_read_only_cache_leaves_triton_alone(tmp_path):
    mgr = _manager(tmp_path)
    mgr.cache.writable = False
    assert mgr._scratch_dir() is None
    assert kernel_dir.kernel_dir() is None


_CUDA_START = """
import json, os, sys, torch
import atom_compile as ac
from atom_compile.models import build_model, preset
from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep
cfg = ac.Config(max_num_seqs=4, compilation_config=ac.CompilationConfig(level=3))
model = build_model(preset("tiny", num_layers=2), compilation_config=cfg, dtype=torch.float16, device="cuda")
model.allocate_kv_cache(16, 16)
builder = PagedAttentionMetadataBuilder(4, 64, 4, 16, device="cuda")
ids, pos, meta, ctx = builder.build([SequenceStep(list(range(1, 9)), 0, [0, 1])])
with torch.inference_mode(), ac.set_forward_context(meta, cfg, ctx, no_compile_layers=model.no_compile_layers):
    model.compute_logits(model.model(ids, pos))
torch.cuda.synchronize()
print(json.dumps(ac.compilation_counter.as_dict()))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_start_in_a_fresh_home_compiles_none_of_our_kernels(tmp_path):
    root = tmp_path / "atom"

    def start(n: int) -> dict:
        home = tmp_path / f"home{n}"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), ATOM_COMPILE_CACHE_ROOT=str(root), PYTHONPATH=str(REPO),
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor{n}"))
        env.pop("TRITON_CACHE_DIR", None)
        proc = subprocess.run([sys.executable, "-c", _CUDA_START], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    start(1)
    recorded = [f for f in _index(root)["inductor_files"] if f.startswith("triton_ops/")]
    assert any(f.endswith(".cubin") for f in recorded), recorded
    warm = start(2)
    assert warm["num_inductor_compiles"] == 0
    built = [p.name for p in (tmp_path / "home2").rglob("*") if p.is_file()
             and ("_kernel" in p.name or "launcher" in p.name or p.name.startswith("cuda_utils"))]
    assert built == [], f"built again in the fresh HOME: {built}"
