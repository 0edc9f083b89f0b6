"""Checks the built-in passes' tests share: a level-3 cache round trip of the built-in Llama
with a pass as an `inductor_passes` entry, and the CUDA kernels one call launches."""

from __future__ import annotations

import torch


def level3_round_trip(tmp_path, entry: str, op_call: str, tokens: list[int], layers: int = 1) -> None:
    """The tiny built-in Llama (`layers` deep) at level 3 with `entry` as its inductor pass: its saved pieces
    call `op_call`, its logits are near the eager model's, and a restart compiles nothing and
    gives the same logits bit for bit."""
    from atom_compile import CompilationConfig, Config, compilation_counter

    from .llama_helpers import Stepper, tiny

    def build():
        cc = CompilationConfig(level=3, cache_dir=str(tmp_path), small_m_linear_pass=False, inductor_passes=[entry])
        return tiny(layers, compilation_config=Config(compilation_config=cc), dtype=torch.bfloat16)

    stepper = Stepper()
    torch._dynamo.reset()
    model, reference = build(), tiny(layers, dtype=torch.bfloat16)
    stepper.allocate(model, reference)
    steps = stepper.prefill(tokens)
    before = compilation_counter.clone()
    first = stepper.logits(model, steps)
    assert compilation_counter.num_inductor_compiles > before.num_inductor_compiles
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.py") if "def call(" in p.read_text())
    assert code.count(op_call) >= 1, op_call
    torch.testing.assert_close(first, stepper.logits(reference, steps), atol=5e-2, rtol=5e-2)
    torch._dynamo.reset()
    warm = build()
    stepper.allocate(warm)
    with compilation_counter.expect(num_inductor_compiles=0):
        again = stepper.logits(warm, steps)
    assert torch.equal(again, first)


def transformers_logits(config, passes) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits through Inductor with `passes` as its post-grad pass, eager logits) of a bf16
    transformers causal LM built from `config` (seed 0) on six tokens."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": passes, "fx_graph_cache": False})
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return compiled(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits


def cuda_kernels(call) -> list[str]:
    """The names of the CUDA kernels `call` launches, after a first call (compiles, tuning)."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
