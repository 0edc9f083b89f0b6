"""The cache key is complete, and keys nothing needless: one factor changed at a time.

Each factor is classified. A keyed factor must change the key. A factor that is not keyed must
leave it alone AND be harmless: a start with the changed factor loads the cached artifact
(compiles nothing) and its outputs equal a fresh compile's with that factor, bit for bit. A new
config field or environment variable that nobody classified fails here, so a factor cannot be
added without deciding whether it changes code (vLLM #53366: a factor missing from the key;
#47573 / #53193: HOME and a model path in it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import atom_compile as ac
from atom_compile import CompilationConfig, Config, compilation_counter
from atom_compile.backends.inductor import _inductor_env_factors
from atom_compile.cache import keys

PACKAGE = Path(ac.__file__).parent

# CompilationConfig field -> (another value, keyed?)
CONFIG_FIELDS = {
    "level": (2, True),
    "splitting_ops": ([], True),
    "compile_sizes": ([4], True),
    "compiler": ("inductor", True),
    "use_inductor": (False, True),
    "inductor_compile_config": ({"max_autotune": True}, True),
    "use_cudagraph": (False, False),
    "cudagraph_capture_sizes": ([1, 2], False),
    "cuda_graph_sizes": ([64], False),
    "cudagraph_mode": ("FULL", False),
    "cudagraph_copy_inputs": (True, False),
    "debug_dump_path": ("/elsewhere/dump", False),
    "cache_dir": ("/elsewhere/cache", False),
    "require_cache": (True, False),
    "trace_layers_once": (False, False),
    "remote_cache": ("file:///nonexistent/atom-remote", False),
    "compile_ranges": ([[2, 8]], True),
    "inductor_passes": (["tests.cache.test_key_completeness:_noop_pass"], True),
    "use_inductor_graph_partition": (True, True),
    "residual_add_pass": (False, True),
    "small_m_linear_pass": (False, True),
    "prologue_pass": (True, True),
    "epilogue_pass": (True, True),
    "glu_pass": (False, True),  # on by default (with small_m_linear_pass)
    "rope_pass": (True, True),
    "rope_attention_pass": (True, True),
    "persistent_reduction_max": (0, True),
    "l2_prefetch_mb": (0, True),
}
def _noop_pass(graph) -> None:
    """An Inductor post-grad pass that changes nothing: its source still enters the key."""


NEVER_FACTORS = {"static_forward_context"}  # filled while a model is built; not a setting

# environment variables the package reads -> why none of them changes compiled code
PACKAGE_ENV = {
    "ATOM_COMPILE_CACHE_ROOT": "where the cache lives, not what it holds",
    "ATOM_COMPILE_DISABLE_CACHE": "no cache is read or written",
    "ATOM_COMPILE_DISABLE": "nothing is compiled",
    "ATOM_COMPILE_CHECK_INPUTS": "a per-call check around the compiled code",
    "ATOM_COMPILE_LOG": "log level",
    "ATOM_COMPILE_REQUIRE_CACHE": "refuses to compile; changes nothing it loads",
    "ATOM_COMPILE_REMOTE_CACHE": "where caches are fetched from and published to, not what they hold",
    "ATOM_COMPILE_REMOTE_KEY": "the key that signs remote entries",
    "ATOM_COMPILE_REMOTE_KEY_FILE": "the file that holds that key",
    "ATOM_COMPILE_REMOTE_TIMEOUT": "how long a remote may take",
    "ATOM_COMPILE_PEER_TIMEOUT": "how long a rank waits for a peer compiling a shared piece",
    "ATOM_COMPILE_GROUP_COMPILE": "which rank compiles a piece, never what it compiles to",
    "ATOM_COMPILE_GROUP_OWNERS": "how many ranks compile the shared pieces, never what they compile to",
    "ATOM_COMPILE_PDL": "when our kernels start (a runtime launch option), never what they compute",
    "ATOM_COMPILE_PREFETCH": "when a recorded kernel reads its weight (a runtime launch variant), never what it computes",
    "ATOM_COMPILE_SPLIT_K": "which kernel a small-M op call runs (a runtime choice inside the op), not the graph",
    "ATOM_COMPILE_DISABLE_VLLM_PLUGIN": "whether vLLM's plugin hook registers anything",
    "ATOM_COMPILE_DISABLE_VLLM_PLUGIN_ATTENTION": "whether that hook registers our attention op",
    "ATOM_COMPILE_CONFIG": "backend='atom''s CompilationConfig: its fields are keyed as CONFIG_FIELDS says, "
                           "not the variable's text",
}
# Inductor config entries whose change leaves our key alone although torch's own cache keys
# them: debug output and cache switches, which change no generated code
INDUCTOR_NOT_CODE = {"debug", "force_disable_caches"}


def _base() -> CompilationConfig:
    return CompilationConfig(level=3, splitting_ops=["silly.attention"])


def _variant(name: str) -> CompilationConfig:
    value, _ = CONFIG_FIELDS[name]
    if name == "compiler" and value == _base().resolved_compiler():
        value = "eager"
    fields = {f.name: getattr(_base(), f.name) for f in dataclasses.fields(CompilationConfig)
              if f.name not in NEVER_FACTORS}
    fields[name] = value
    if name == "use_inductor":
        fields["compiler"] = "auto"
    return CompilationConfig(**fields)


def test_every_config_field_is_classified():
    names = {f.name for f in dataclasses.fields(CompilationConfig)} - NEVER_FACTORS
    assert names == set(CONFIG_FIELDS), (
        f"classify these CompilationConfig fields in CONFIG_FIELDS (keyed or not): {sorted(names ^ set(CONFIG_FIELDS))}")


@pytest.mark.parametrize("name", sorted(CONFIG_FIELDS))
def test_a_config_field_changes_the_key_exactly_when_it_is_keyed(name):
    _, keyed = CONFIG_FIELDS[name]
    changed = _variant(name).hash_factors() != _base().hash_factors()
    assert changed == keyed, f"{name}: keyed={keyed} but the key {'changed' if changed else 'did not change'}"


def test_every_environment_variable_the_package_reads_is_classified():
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read |= set(re.findall(r"\bATOM_COMPILE_[A-Z0-9_]+\b", path.read_text()))
    assert read == set(PACKAGE_ENV), f"classify in PACKAGE_ENV: {sorted(read ^ set(PACKAGE_ENV))}"


def _alternative(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    return None


def test_every_inductor_setting_that_can_change_code_changes_the_key():
    """Environment variables reach Inductor through its config: every entry (bool, int, str)
    flipped alone must change the key, unless torch's own cache ignores it or it is listed
    in INDUCTOR_NOT_CODE."""
    import torch._inductor.config as inductor_config

    ignored = tuple(getattr(inductor_config, "_cache_config_ignore_prefix", ())) + \
        tuple(getattr(inductor_config, "_save_config_ignore", ()))
    base = _inductor_env_factors()["inductor_config"]
    checked, missed = 0, []
    for name in list(inductor_config._config):
        if name.startswith("_") or name.startswith(ignored) or name in INDUCTOR_NOT_CODE:
            continue
        alt = _alternative(getattr(inductor_config, name) if "." not in name else
                           getattr(getattr(inductor_config, name.split(".")[0]), name.split(".", 1)[1], None))
        if alt is None:
            continue
        try:
            with inductor_config.patch(name, alt):
                now = _inductor_env_factors()["inductor_config"]
        except Exception:  # a value the entry refuses: nothing to compare
            continue
        checked += 1
        if now == base:
            missed.append(name)
    assert checked > 200, checked
    assert not missed, f"Inductor settings that change no key: {missed}"


# --- not keyed, and harmless: load the cached artifact, same outputs as a fresh compile ------

class TwoPieces(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = torch.empty_like(h)
        torch.ops.silly.attention(h, h, h, out)
        return self.b(out) + x


def _run(cc: CompilationConfig, x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    model = TwoPieces().requires_grad_(False)
    return torch.compile(model, backend=ac.backend(Config(compilation_config=cc)), fullgraph=True, dynamic=True)(x)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    root = tmp_path_factory.mktemp("key-root")
    x = torch.randn(6, 8)
    cc = dataclasses.replace(_base(), cache_dir=str(root))
    with compilation_counter.expect(num_inductor_compiles=2):
        _run(cc, x)
    return root, x


def _unkeyed_cases():
    fields = [name for name, (_, keyed) in CONFIG_FIELDS.items() if not keyed and name != "cache_dir"]
    return fields + ["cwd", "HOME", "model file location"]


@pytest.mark.parametrize("factor", _unkeyed_cases())
def test_an_unkeyed_factor_loads_the_cache_and_matches_a_fresh_compile(factor, warmed, tmp_path, monkeypatch):
    root, x = warmed
    if factor in CONFIG_FIELDS:
        cc = dataclasses.replace(_variant(factor), cache_dir=str(root), debug_dump_path=str(tmp_path / "dump")
                                 if factor == "debug_dump_path" else "")
    else:
        cc = dataclasses.replace(_base(), cache_dir=str(root))
        if factor == "cwd":
            monkeypatch.chdir(tmp_path)
        elif factor == "HOME":
            monkeypatch.setenv("HOME", str(tmp_path))
    with compilation_counter.expect(num_inductor_compiles=0, num_compiled_artifacts_loaded=2):
        loaded = _run(cc, x) if factor != "model file location" else _run_moved(cc, x, tmp_path)
    monkeypatch.setenv("ATOM_COMPILE_DISABLE_CACHE", "1")
    cc = dataclasses.replace(cc, require_cache=False)  # a fresh compile is what strict mode refuses
    fresh = _run(cc, x) if factor != "model file location" else _run_moved(cc, x, tmp_path)
    assert torch.equal(loaded, fresh)


def _run_moved(cc: CompilationConfig, x: torch.Tensor, where: Path) -> torch.Tensor:
    """TwoPieces imported from a copy of this file elsewhere: same content, another path."""
    import importlib.util

    copy = where / "moved_model.py"
    copy.write_text(Path(__file__).read_text())
    spec = importlib.util.spec_from_file_location("moved_model", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch._dynamo.reset()
    model = module.TwoPieces().requires_grad_(False)
    return torch.compile(model, backend=ac.backend(Config(compilation_config=cc)), fullgraph=True, dynamic=True)(x)


# --- keyed: a change gives another key -------------------------------------------------------

def _hash_dirs(root: Path) -> set[str]:
    return {p.name for p in (root / "torch_compile_cache").iterdir() if re.fullmatch(r"[0-9a-f]{16}", p.name)}


def test_dtype_and_model_source_change_the_key(warmed, tmp_path):
    root, x = warmed
    before = _hash_dirs(root)
    cc = dataclasses.replace(_base(), cache_dir=str(root))
    torch._dynamo.reset()
    model = TwoPieces().double().requires_grad_(False)
    torch.compile(model, backend=ac.backend(Config(compilation_config=cc)), fullgraph=True, dynamic=True)(x.double())
    after_dtype = _hash_dirs(root)
    assert len(after_dtype - before) == 1
    edited = tmp_path / "moved_model.py"
    edited.write_text(Path(__file__).read_text().replace("return self.b(out) + x", "return self.b(out) + x  # edited"))
    factors = keys.build_factors(cc, {}, "cpu", [str(edited)], [], "g")
    same = keys.build_factors(cc, {}, "cpu", [__file__], [], "g")
    assert keys.compute_hash(factors) != keys.compute_hash(same)
    assert any("moved_model.py" in d or "changed" in d or "traced now" in d for d in keys.diff_factors(same, factors))


def test_rank_does_not_change_the_key(monkeypatch):
    cc = _base()
    before = keys.compute_hash(keys.build_factors(cc, {}, "cpu", [__file__], [], "g"))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert keys.compute_hash(keys.build_factors(cc, {}, "cpu", [__file__], [], "g")) == before
