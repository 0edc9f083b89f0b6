"""The small-M Triton linear on the GPU: the kernel in bf16 at decode shapes against F.linear,
and per-size pieces (compile_sizes 1..8) that take it, replayed in FULL graphs, against the
general-shape run of the same model."""

from __future__ import annotations

import pytest
import torch

from atom_compile import CompilationConfig, Config, CUDAGraphMode
from atom_compile.models import build_model
from atom_compile.ops.attention import PagedAttentionMetadataBuilder
from atom_compile.runtime import ModelRunner

from .test_runtime_cuda import BLOCK, CAPTURE, LLAMA, Engine, _schedule

pytestmark = pytest.mark.cuda
triton_linear = pytest.importorskip("atom_compile.ops.triton_linear")


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (1000, 130)])
def test_kernel_bf16_matches_linear(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    got = triton_linear.small_m_linear(x, w, b)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def _run(cache_root, compile_sizes, forced=None):
    cc = CompilationConfig(level=3, cudagraph_mode=CUDAGraphMode.FULL, cudagraph_capture_sizes=CAPTURE,
                           compile_sizes=compile_sizes, cache_dir=str(cache_root))
    cfg = Config(max_num_seqs=16, max_num_batched_tokens=256, compilation_config=cc)
    model = build_model(LLAMA, compilation_config=cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    model.allocate_kv_cache(16 * 4, BLOCK)
    runner = ModelRunner(model, cfg, PagedAttentionMetadataBuilder(16, 256, 4, BLOCK, device="cuda"))
    runner.capture_cudagraph()
    engine = Engine(runner, 16 * 4, forced=forced)
    _schedule(engine)
    return engine


def test_per_size_pieces_take_the_kernel_and_match(tmp_path):
    base = _run(tmp_path / "general", None)
    triton_linear._tuned.clear()
    sized = _run(tmp_path / "sized", list(CAPTURE), forced=base.trace)
    assert {key[0] for key in triton_linear._tuned} == {1, 16}  # the GEMV and the dot path both ran
    for i, ((_, got), (_, want)) in enumerate(zip(sized.trace, base.trace)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=lambda m: f"step {i}: {m}")
