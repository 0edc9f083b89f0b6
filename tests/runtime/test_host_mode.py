"""Host mode (README "Inside vLLM"): a vLLM-shaped config translated, our compile and cache
kept, our CUDA graphs off, and the `vllm.general_plugins` hook with its toggles."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace as NS

import pytest
import torch

import atom_compile as ac
from atom_compile import compilation_counter
from atom_compile.config import ConfigError
from atom_compile.host_config import HostConfig
from atom_compile.runtime import ModelRunner
from support.llama_helpers import Stepper, tiny


class CompilationMode(enum.IntEnum):  # vLLM's enum, as its config holds it
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


def vllm_config(mode=CompilationMode.VLLM_COMPILE, **compilation):
    return NS(
        scheduler_config=NS(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=2048),
        model_config=NS(model="org/some-llama", max_model_len=4096),
        parallel_config=NS(tensor_parallel_size=2, enable_expert_parallel=True, rank=1),
        cache_config=NS(block_size=16, cache_dtype="fp8_e4m3", enable_prefix_caching=True, num_gpu_blocks=900),
        speculative_config=NS(num_speculative_tokens=2),
        compilation_config=NS(mode=mode, splitting_ops=["vllm::unified_attention_with_output"],
                              compile_sizes=["cudagraph_capture_sizes", 3], cudagraph_capture_sizes=[1, 2, 4],
                              inductor_compile_config={"max_autotune": False}, cache_dir="", **compilation),
    )


def test_the_seed_mapping_table():
    cfg = ac.Config.from_vllm(vllm_config())
    cc = cfg.compilation_config
    assert (cfg.enforce_eager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_draft_tokens) == (True, 32, 1024, 2)
    assert cfg.capture_sizes == [] and not cc.use_cudagraph and cc.cudagraph_mode == ac.CUDAGraphMode.NONE
    assert cc.level == 3 and cc.compile_sizes == [1, 2, 3, 4]  # vLLM's token names vLLM's capture sizes
    assert "vllm::unified_attention_with_output" in cc.splitting_ops
    assert "aiter::unified_attention_with_output" in cc.splitting_ops  # ours stay: absent ops cost nothing
    assert cc.inductor_compile_config == {"max_autotune": False}
    assert cfg.host == HostConfig(name="vllm", model="org/some-llama", max_model_len=4096, tensor_parallel_size=2,
                                  kv_block_size=16, kv_cache_dtype="fp8_e4m3", num_kv_blocks=900,
                                  enable_prefix_caching=True, enable_expert_parallel=True, rank=1)


@pytest.mark.parametrize("mode,level", [(CompilationMode.NONE, 0), ("STOCK_TORCH_COMPILE", 1),
                                        (2, 2), (CompilationMode.VLLM_COMPILE, 3)])
def test_modes_as_enum_name_or_number(mode, level):
    assert ac.Config.from_vllm(vllm_config(mode)).compilation_config.level == level


def test_bad_host_values_are_named():
    with pytest.raises(ConfigError, match="compilation_config.mode"):
        ac.Config.from_vllm(vllm_config(mode=7))
    with pytest.raises(ConfigError, match="vllm_config"):
        ac.Config.from_vllm(NS(model_config=NS()))
    with pytest.raises(ConfigError, match="Config.host"):
        ac.Config(host="vllm")
    with pytest.raises(ac.AtomCompileError, match="HostConfig.name"):
        HostConfig(name="sglang-ish")


def test_the_real_vllm_config_classes():
    vllm_config_module = pytest.importorskip("vllm.config", reason="vllm is not installed (an optional extra)")
    cfg = ac.Config.from_vllm(vllm_config_module.VllmConfig())
    assert cfg.enforce_eager and cfg.host.name == "vllm"


def test_host_mode_compiles_and_caches_but_records_nothing(tmp_path):
    cfg = ac.Config(host=HostConfig(), max_num_seqs=8, max_num_batched_tokens=64,
                    compilation_config=ac.CompilationConfig(level=3, cache_dir=str(tmp_path)))
    stepper = Stepper()
    model = tiny(compilation_config=cfg)
    reference = tiny(compilation_config=ac.Config(compilation_config=ac.CompilationConfig(level=0)))
    reference.load_state_dict(model.state_dict())
    stepper.allocate(model, reference)
    runner = ModelRunner(model, cfg, stepper.builder)
    before = compilation_counter.as_dict()
    steps = stepper.prefill([5, 3])
    with torch.no_grad():
        got, _ = runner.step(steps)
        want, _ = ModelRunner(reference, ac.Config(compilation_config=ac.CompilationConfig(level=0)),
                              stepper.builder).step(steps)
        assert runner.capture_cudagraph() == (0.0, [])
    after = compilation_counter.as_dict()
    assert after["num_inductor_compiles"] > before["num_inductor_compiles"]
    assert after["num_cudagraph_captured"] == before["num_cudagraph_captured"]
    assert list((tmp_path / "torch_compile_cache").glob("*/rank_0/*/index.json"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


PLUGIN = ("import json, sys, torch, atom_compile.runtime.host as h; r = h.register(); "
          "print(json.dumps([r, 'atom_compile.ops.attention' in sys.modules]))")


@pytest.mark.parametrize("env,want", [({}, [True, True]),
                                      ({"ATOM_COMPILE_DISABLE_VLLM_PLUGIN": "1"}, [False, False]),
                                      ({"ATOM_DISABLE_VLLM_PLUGIN": "1"}, [False, False]),
                                      ({"ATOM_COMPILE_DISABLE_VLLM_PLUGIN_ATTENTION": "1"}, [True, False]),
                                      ({"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1"}, [True, False])])
def test_the_plugin_hook_and_its_toggles(env, want, monkeypatch):
    for name in ("ATOM_COMPILE_DISABLE_VLLM_PLUGIN", "ATOM_DISABLE_VLLM_PLUGIN",
                 "ATOM_COMPILE_DISABLE_VLLM_PLUGIN_ATTENTION", "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = subprocess.run([sys.executable, "-c", PLUGIN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


def test_the_entry_point_is_installed():
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "atom_compile"]
    assert entry.value == "atom_compile.runtime.host:register"
