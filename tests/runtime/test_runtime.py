"""The runtime on CPU: ladders, bucket keys, padding, and which path each mode takes."""

import pytest
import torch

from atom_compile import CompilationConfig, Config, CUDAGraphMode
from atom_compile.ops.attention import SequenceStep
from atom_compile.runtime import ModelRunner, capture_ladder, pad_to_bucket, request_bucket
from atom_compile.runtime.graphs import TokenGraph
from support.llama_helpers import Stepper, tiny


def test_capture_ladder_and_keys():
    assert capture_ladder(CompilationConfig(cuda_graph_sizes=[64])) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64]
    assert capture_ladder(CompilationConfig(cuda_graph_sizes=[512]), max_num_seqs=32) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
    assert capture_ladder(CompilationConfig(cudagraph_capture_sizes=[8, 1, 4])) == [1, 4, 8]
    with pytest.raises(ValueError, match="exceed max_num_seqs"):
        capture_ladder(CompilationConfig(cudagraph_capture_sizes=[1, 64]), max_num_seqs=16)
    assert request_bucket(8, 1) == (8, 0) and request_bucket(4, 3) == (4, 2)
    sizes = [1, 2, 4, 8, 16]
    assert [pad_to_bucket(n, sizes) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, None]


class _FakeGraphs:
    def __init__(self):
        self.replayed = []

    def __contains__(self, key):
        return True

    def replay(self, key):
        self.replayed.append(key)
        return torch.zeros(16, 64)


def _runner(mode, **kw):
    cfg = Config(max_num_seqs=16, compilation_config=CompilationConfig(
        cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8]), **kw)
    stepper = Stepper(max_seqs=16)
    model = tiny()
    stepper.allocate(model)
    runner = ModelRunner(model, cfg, stepper.builder)
    return runner, stepper


def test_a_new_runner_starts_a_new_warm_up():
    """A second model's runner: its first forward compiles its own kernels, which are no misses
    of the first model's warm-up; its capture's end marks the process warm again."""
    from atom_compile.ops import jit_watch

    jit_watch.mark_warmed_up()
    assert jit_watch.is_warm()
    try:
        _runner(CUDAGraphMode.FULL)
        assert not jit_watch.is_warm()
    finally:
        jit_watch.stop_watching()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_no_cuda_runs_every_mode_as_none():
    for mode in CUDAGraphMode:
        runner, _ = _runner(mode)
        assert runner.mode == CUDAGraphMode.NONE
        assert runner.capture_cudagraph() == (0.0, [])


def test_enforce_eager_means_no_graphs():
    runner, _ = _runner(CUDAGraphMode.FULL, enforce_eager=True)
    assert runner.mode == CUDAGraphMode.NONE


@pytest.mark.parametrize("mode, decode_path, prefill_path", [
    (CUDAGraphMode.FULL, "req", "eager"),
    (CUDAGraphMode.FULL_DECODE_ONLY, "req", "eager"),
    (CUDAGraphMode.TR_HYBRID, "token", "token"),
    (CUDAGraphMode.FULL_AND_TR_HYBRID, "token", "token"),
])
def test_mode_dispatch_table(mode, decode_path, prefill_path, monkeypatch):
    """Which recording a step replays, with the recordings faked (this machine has no GPU)."""
    runner, stepper = _runner(CUDAGraphMode.NONE)
    runner.mode = mode
    runner.graphed_sizes = [1, 2, 4, 8]
    fake = _FakeGraphs()
    runner.req_graph = fake
    tg = TokenGraph()
    tg._phase_sizes = {"prefill": {1, 2, 4, 8}, "decode": {1, 2, 4, 8}}
    token_replays = []
    monkeypatch.setattr(tg, "has", lambda rows, phase: rows in (1, 2, 4, 8))
    monkeypatch.setattr(tg, "replay", lambda rows, phase, inputs: token_replays.append((rows, phase)) or torch.zeros(rows, 64))
    runner.model.model.__dict__["_token_graph"] = tg

    def path_of(steps):
        fake.replayed.clear()
        token_replays.clear()
        runner.step(steps)
        return "req" if fake.replayed else "token" if token_replays else "eager"

    decode = [SequenceStep([5], 7, stepper.table(i)) for i in range(3)]  # 3 -> bucket 4
    assert runner.padding_for(decode) == (4, None)  # decode pads sequences to the bucket
    assert path_of(decode) == decode_path
    if decode_path == "req":
        assert fake.replayed == [(4, 0)]
    else:
        assert token_replays == [(4, "decode")]
    prefill = stepper.prefill([3, 2])  # 5 rows -> token bucket 8
    assert path_of(prefill) == prefill_path
    if prefill_path == "token":
        assert token_replays == [(8, "prefill")]
    big = [SequenceStep([5], 7, stepper.table(i)) for i in range(12)]  # beyond the largest bucket
    assert path_of(big) == "eager"


def test_runner_steps_on_cpu_match_the_model():
    runner, stepper = _runner(CUDAGraphMode.FULL)
    ref = tiny()
    stepper.allocate(ref)
    steps = stepper.prefill([4, 6])
    logits, hidden = runner.step(steps)
    assert logits.shape == (10, 512) and hidden.shape == (10, 64)
    assert torch.allclose(logits, stepper.logits(ref, steps), atol=1e-5)


def test_runtime_config_carries_what_the_runner_reads():
    from atom_compile.runtime import RuntimeConfig

    cfg = Config(max_num_seqs=16, num_draft_tokens=1,
                 compilation_config=CompilationConfig(level=0, cudagraph_mode="FULL", cuda_graph_sizes=[8]))
    rc = RuntimeConfig.from_config(cfg)
    assert rc.capture_sizes == cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (rc.max_num_seqs, rc.max_q_len, rc.cudagraph_mode, rc.enforce_eager) == (16, 2, CUDAGraphMode.FULL, False)
    assert rc.no_compile_layers is cfg.compilation_config.static_forward_context
    with pytest.raises(TypeError, match="RuntimeConfig"):
        ModelRunner(object(), cfg.compilation_config, None)
