"""The small-M Triton linear on the GPU: the kernel in bf16 at decode shapes against F.linear,
and the built-in Llama's logits, which take it at one row (and up to MAX_M rows for a vocabulary
of at least DOT_MIN_N)."""

from __future__ import annotations

import pytest
import torch

from atom_compile.models import build_model

from .test_runtime_cuda import LLAMA

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


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_llama_logits_take_the_kernel_where_supported(rows):
    model = build_model(LLAMA, dtype=torch.bfloat16, device="cuda", seed=0)
    hidden = torch.randn(rows, LLAMA.hidden_size, device="cuda", dtype=torch.bfloat16)
    triton_linear._tuned.clear()
    got = model.compute_logits(hidden)
    want = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    wide = LLAMA.vocab_size >= triton_linear.DOT_MIN_N or triton_linear._split_k_rows()
    assert bool(triton_linear._tuned) == (rows == 1 or (rows <= triton_linear.MAX_M and wide))  # else F.linear


class _Projections(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 512, bias=False)
        self.down = torch.nn.Linear(512, 256, bias=False)

    def forward(self, x, residual):
        return self.down(torch.relu(self.up(x))) + residual


def test_compiled_projections_call_the_kernel_and_match_eager(tmp_path):
    import atom_compile as ac

    model = _Projections().to(device="cuda", dtype=torch.bfloat16)
    cfg = ac.Config(compilation_config=ac.CompilationConfig(level=2, compiler="inductor_standalone",
                                                            cache_dir=str(tmp_path / "cache")))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ac.backend(cfg), fullgraph=True, dynamic=True)
    triton_linear._tuned.clear()
    for rows in (2, 1, 16):  # 1: the Triton GEMV; 2: split-K or cuBLAS as timed; 16: F.linear, all in the same op
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x, r).float(), model(x, r).float(), atol=3e-2, rtol=3e-2)
    code = "\n".join(p.read_text() for p in (tmp_path / "cache").rglob("*.py") if "def call(" in p.read_text())
    assert code.count("torch.ops.atom.small_m_linear") >= 2  # both projections
    assert {k[1:3] for k in triton_linear._tuned} == {(512, 256), (256, 512)}  # the one-row calls took the kernel


def test_the_capture_warms_the_logits_too(tmp_path):
    """The logits run after the replay, outside the recording; the capture's warm-up runs them
    at every captured size, so no decode step compiles or tunes a Triton kernel after it
    (a vocabulary of DOT_MIN_N takes the Triton LM head at 1..MAX_M rows)."""
    import atom_compile as ac
    from atom_compile import compilation_counter
    from atom_compile.models import preset
    from atom_compile.ops import jit_watch
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep
    from atom_compile.runtime import ModelRunner

    pytest.importorskip("triton.knobs", reason="needs Triton >= 3.4 (its JIT hooks live in triton.knobs)")
    wide = preset("tiny", num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=256, vocab_size=triton_linear.DOT_MIN_N)
    cc = ac.CompilationConfig(level=3, cudagraph_mode=ac.CUDAGraphMode.FULL, cudagraph_capture_sizes=[1, 2, 4, 8],
                              cache_dir=str(tmp_path / "cache"))
    cfg = ac.Config(max_num_seqs=8, max_num_batched_tokens=64, compilation_config=cc)
    model = build_model(wide, compilation_config=cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    model.allocate_kv_cache(8 * 4, 16)
    runner = ModelRunner(model, cfg, PagedAttentionMetadataBuilder(8, 64, 4, 16, device="cuda"))
    triton_linear._tuned.clear()
    runner.capture_cudagraph()
    try:
        with compilation_counter.expect(num_triton_compiles_after_warmup=0):
            for bs in (1, 3, 8):
                steps = [SequenceStep([5 + s], 7, [4 * s, 4 * s + 1]) for s in range(bs)]
                logits, _ = runner.step(steps)
                assert logits.shape == (bs, wide.vocab_size)
    finally:
        jit_watch.stop_watching()


def test_a_second_models_capture_is_a_warm_up_too(tmp_path):
    """The watch is process-wide: a second model captured after the first's capture ended
    compiles its own kernels in its warm-up, which are no misses (0 compiles after warm-up
    counted across that capture), and the watch is on again when it ends."""
    pytest.importorskip("triton.knobs", reason="needs Triton >= 3.4 (its JIT hooks live in triton.knobs)")
    import atom_compile as ac
    from atom_compile import compilation_counter
    from atom_compile.models import preset
    from atom_compile.ops import jit_watch
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder
    from atom_compile.runtime import ModelRunner

    def runner(name: str, **dims) -> ModelRunner:
        cc = ac.CompilationConfig(level=3, cudagraph_mode=ac.CUDAGraphMode.FULL, cudagraph_capture_sizes=[1, 2],
                                  cache_dir=str(tmp_path / name))
        cfg = ac.Config(max_num_seqs=2, max_num_batched_tokens=16, compilation_config=cc)
        model = build_model(preset("tiny", num_layers=1, **dims), compilation_config=cfg, dtype=torch.bfloat16,
                            device="cuda", seed=0)
        model.allocate_kv_cache(8, 16)
        return ModelRunner(model, cfg, PagedAttentionMetadataBuilder(2, 16, 4, 16, device="cuda"))

    try:
        runner("a", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256).capture_cudagraph()
        assert jit_watch.is_warm()
        second = runner("b", hidden_size=192, num_heads=3, num_kv_heads=1, head_dim=64, intermediate_size=320)
        with compilation_counter.expect(num_triton_compiles_after_warmup=0):
            second.capture_cudagraph()
        assert jit_watch.is_warm()
    finally:
        jit_watch.stop_watching()


def test_a_tuned_shape_is_taken_from_the_kernel_directory(tmp_path, monkeypatch):
    """The block shape timed for 4 rows of a vocabulary-wide layer is saved in the cache's
    kernel directory; with the process's own choices forgotten (a restart), the next call takes
    it without timing anything, and computes the same bits."""
    from atom_compile.ops import kernel_dir

    before = (kernel_dir.kernel_dir(), kernel_dir._state["on_written"])
    kernel_dir.use_kernel_dir(str(tmp_path))
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(4, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(triton_linear.DOT_MIN_N, 2048, device="cuda", generator=g, dtype=torch.bfloat16) / 45
        triton_linear._tuned.clear()
        first = triton_linear.small_m_linear(x, w)
        assert (tmp_path / "small_m_linear.best_config").is_file()
        triton_linear._tuned.clear()
        monkeypatch.setattr(triton_linear, "_bench", lambda fn: pytest.fail("a saved shape was timed again"))
        assert torch.equal(triton_linear.small_m_linear(x, w), first)
    finally:
        kernel_dir.use_kernel_dir(*before)
        triton_linear._tuned.clear()


def test_shapes_are_timed_with_the_weight_past_l2(monkeypatch):
    """A shape's candidates are timed cycling through copies of the weight that exceed twice
    the L2 (a decode step reads each weight from memory), and the result is still the layer's."""
    from atom_compile.ops import kernel_dir, tuning

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, 2048, device="cuda", generator=g, dtype=torch.bfloat16) / 45
    x = torch.randn(4, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    copies = tuning.past_l2(w)
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    assert copies[0] is w and len(copies) * w.numel() * w.element_size() >= 2 * l2
    assert all(c.data_ptr() != w.data_ptr() and c.stride() == w.stride() and torch.equal(c, w) for c in copies[1:])
    read = set()
    real = triton_linear._split_k_or_library
    monkeypatch.setattr(triton_linear, "_split_k_or_library",
                        lambda x, w, *rest: (read.add(w.data_ptr()), real(x, w, *rest))[1])
    monkeypatch.setattr(triton_linear, "SPLIT_K_ROWS", True)
    before = (kernel_dir.kernel_dir(), kernel_dir._state["on_written"])
    kernel_dir.use_kernel_dir(None)
    triton_linear._tuned.clear()
    try:
        got = triton_linear.small_m_linear(x, w)
    finally:
        kernel_dir.use_kernel_dir(*before)
        triton_linear._tuned.clear()
    assert len(read) == len(copies)  # every copy was read while timing
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
