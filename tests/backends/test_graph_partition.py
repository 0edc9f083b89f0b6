"""use_inductor_graph_partition: the whole graph goes to Inductor once, partitioned at the
splitting ops by Inductor itself (not by FX); validated, keyed, cached, equal to eager."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor import scheduler

from atom_compile import CompilationConfig, Config, ConfigError, compilation_counter
from atom_compile.backends import graph_partition
from atom_compile.cache import inventory
from atom_compile.cli import output
from support import _job
from support.isa import seeded
from support.jobs import run_job

pytestmark = pytest.mark.skipif(
    graph_partition.graph_partition_unsupported() is not None,
    reason=f"Inductor graph partition unavailable: {graph_partition.graph_partition_unsupported()}")


def test_the_option_is_validated():
    with pytest.raises(ConfigError, match=r"use_inductor_graph_partition.*level 3"):
        CompilationConfig(level=2, use_inductor_graph_partition=True)
    with pytest.raises(ConfigError, match=r"use_inductor_graph_partition.*only Inductor"):
        CompilationConfig(level=3, use_inductor_graph_partition=True, compiler="eager")
    with pytest.raises(ConfigError, match=r"use_inductor_graph_partition.*True or False"):
        CompilationConfig(level=3, use_inductor_graph_partition="yes")
    with pytest.raises(ConfigError, match="use_inductor_graph_partition"):
        Config.from_dict({"compilation_config": {"mode": 1, "use_inductor_graph_partition": True}})
    # the ranges and sizes still apply: to the one piece
    cc = CompilationConfig(level=3, use_inductor_graph_partition=True, compile_ranges=[[2, 8]], compile_sizes=[4])
    assert cc.hash_factors()["use_inductor_graph_partition"] is True
    assert "use_inductor_graph_partition" not in CompilationConfig(level=3).hash_factors()


def test_a_torch_without_the_feature_is_a_clear_config_error(monkeypatch):
    class OldInductorConfig:  # what torch < 2.9's Inductor config lacks
        graph_partition = False

    monkeypatch.setattr(torch._inductor, "config", OldInductorConfig)
    with pytest.raises(ConfigError, match=r"custom_should_partition_ops.*torch >= 2\.9"):
        CompilationConfig(level=3, use_inductor_graph_partition=True)
    CompilationConfig(level=3)  # off: nothing is asked of Inductor


@pytest.fixture
def partition_reasons(monkeypatch):
    """Inductor's own answers: the graph_partition / custom_should_partition_ops it compiled
    with, and its should_partition reason for each node."""
    seen = {"options": set(), "reasons": []}
    real = scheduler.Scheduler.should_partition

    def spy(self, node):
        reason = real(self, node)
        seen["options"].add((inductor_config.graph_partition, tuple(inductor_config.custom_should_partition_ops)))
        seen["reasons"].append(reason)
        return reason

    monkeypatch.setattr(scheduler.Scheduler, "should_partition", spy)
    return seen


def test_llama_matches_eager_and_a_second_process_compiles_nothing(tmp_path, monkeypatch, capsys, partition_reasons):
    """The cold start in this process (Inductor watched), the warm one in a fresh process."""
    root = str(seeded(tmp_path / "cache"))  # the session's CPU ISA answer: the warm process takes it
    args = ("--cache-root", root, "--layers", "1", "--graph-partition")
    monkeypatch.setattr(sys, "argv", ["_job.py", *args])
    before = compilation_counter.clone()
    _job.main()
    cold = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cold["max_abs_err"] <= 1e-5
    c = {k: v - getattr(before, k) for k, v in compilation_counter.as_dict().items()}
    assert c["num_inductor_compiles"] == 1 and c["num_piecewise_graphs_seen"] == 1
    assert c["num_inductor_partitions"] == 3  # before the attention, the attention, after it
    # Inductor itself was told, and partitioned at the attention op
    (options,) = partition_reasons["options"]
    assert options[0] is True and {"aiter::unified_attention_with_output", "atom::paged_attention_with_output"} <= set(options[1])
    # the built-in Llama calls the attention by its KV cache where the by-name op is ours
    assert any(r and r.startswith(("custom partition op: atom::paged_attention_with_output",
                                   "custom partition op: aiter::unified_attention_with_output"))
               for r in partition_reasons["reasons"])

    warm = run_job(*args)
    w = warm["counters"]
    assert w["num_inductor_compiles"] == 0 and w["num_eager_compiles"] == 0
    assert w["num_compiled_artifacts_loaded"] + w["num_dynamo_functions_loaded"] >= 1
    assert warm["max_abs_err"] <= 1e-5 and warm["output_sha256"] == cold["output_sha256"]
    # inspect: one graph, its partitions
    (cache,) = inventory.list_caches(Path(root))
    assert cache.factors["config"]["use_inductor_graph_partition"] is True
    assert "Inductor graph partition (3 partitions in 1 graph)" in output.factor_summary(cache.factors)
