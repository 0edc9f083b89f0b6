"""`warm --fake-weights`: build the model without weight memory and compile it into the cache
that a real run with real weights loads.

The model is built on the meta device (`with torch.device("meta")`: no storage at all), then
every parameter, buffer and tensor attribute of its modules is replaced, in place in the
module's dicts, by a FakeTensor of the same shape, stride, dtype and requires_grad on the
target device (`Module.to` cannot do it: torch swaps a fake parameter's payload, which fake
tensors refuse). Parameters and buffers are graph inputs at every level that compiles, so
the code does not depend on their values, and with the same metadata the graph, the cache
key, the pieces' content keys and the entry point equal the real run's. The forwards run
inside the FakeTensorMode and `compile_only()`: pieces compile (or load) as in a real warm,
but their compiled code is never run (backends/compile_only.py). What a fake build cannot
compile faithfully fails with a WarmError naming why; nothing is written silently.
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import Config
from .warm_model import Job, ModelSpec, WarmError, _check_preset, _paged_job, call_factory, factory_forward


def make_fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_module(model: Any, fake_mode: Any, device: str) -> int:
    """Replace the module's tensors by fake ones on `device` (see the module's doc); returns the
    bytes they describe (what a real build would allocate). Shared tensors stay shared."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    memo: dict[int, Any] = {}
    target = torch.device(device)

    def fake(t: torch.Tensor, param: bool) -> Any:
        if id(t) not in memo:
            if isinstance(t, FakeTensor) and t.fake_mode is fake_mode and t.device.type == target.type:
                new = t
            else:
                with fake_mode:
                    new = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=target)
            if param:
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
        return memo[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b, False)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                module.__dict__[name] = fake(value, isinstance(value, torch.nn.Parameter))
    seen = {id(v): v for v in memo.values()}
    return sum(v.numel() * v.element_size() for v in seen.values())


def real_tensor_bytes(model: Any) -> int:
    """Bytes of real (not fake, not meta) storage behind the model's parameters and buffers."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()
               if not isinstance(t, FakeTensor) and t.device.type != "meta")


def _on_meta(what: str, call: Any) -> Any:
    import torch

    try:
        with torch.device("meta"):
            return call()
    except (NotImplementedError, RuntimeError) as exc:
        raise WarmError(f"--fake-weights: {what} cannot be built on the meta device ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); a fake-weight warm-up builds the model "
                        "without weight memory and needs a build that copies no data. Warm with real weights "
                        "(without --fake-weights).") from None


def fake_job(spec: ModelSpec, cfg: Config, device: str, layers: Optional[int], max_tokens: int) -> Job:
    """The job of a model built with fake weights (no parameter memory)."""
    mode = make_fake_mode()
    if spec.preset is not None:
        from ..models.llama import LlamaForCausalLM, preset

        _check_preset(spec)
        if layers is not None and layers < 1:
            raise WarmError(f"--layers: got {layers}; allowed: a positive int")
        llama = preset(spec.preset, **({"num_layers": layers} if layers is not None else {}))
        # as build_model builds it (float32, no gradients, eval), without the random weights
        model = _on_meta(f"preset {spec.preset!r}", lambda: LlamaForCausalLM(llama, "model", compilation_config=cfg))
        model.requires_grad_(False)
        weight_bytes = fake_module(model.eval(), mode, device)
        desc = f"{spec.preset} ({llama.num_layers} layer{'' if llama.num_layers == 1 else 's'}, fake weights)"
        job = _paged_job(model, desc, device, max_tokens, mode)
    else:
        if layers is not None:
            raise WarmError("--layers: applies to the built-in presets only; a factory decides its own layers")
        model, inputs = _on_meta(f"model {spec.text!r}", lambda: call_factory(spec, cfg))
        weight_bytes = fake_module(model.eval(), mode, device)
        job = factory_forward(spec, model, inputs, cfg, device, max_tokens, mode)
        job.description = job.description[:-1] + ", fake weights)"
    if real_tensor_bytes(model):
        raise WarmError(f"--fake-weights: {spec.text}: {real_tensor_bytes(model)} bytes of real weights remain")
    job.weight_bytes = weight_bytes
    return job


def explain_failure(exc: BaseException, model: str) -> WarmError:
    """A failed fake-weight compile as one WarmError: the refusal (FakeWeightsError) where there
    is one, else the failure, and what to do."""
    from ..backends.compile_only import FakeWeightsError

    seen, cause, root = set(), exc, exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, FakeWeightsError):
            return WarmError(f"--fake-weights: {model}: {cause}")
        seen.add(id(cause))
        root = cause
        cause = cause.__cause__ or cause.__context__
    detail = f"{type(root).__name__}: {str(root).strip().splitlines()[0] if str(root).strip() else ''}"[:300]
    hint = ""
    if "meta" in detail:
        hint = (" A tensor the build left on the meta device (one held outside the modules' parameters, "
                "buffers and tensor attributes) met the fake weights.")
    return WarmError(f"--fake-weights: {model} could not be compiled from fake weights ({detail}).{hint} "
                     "Pieces compiled before the failure stay in the cache; warm with real weights (without "
                     "--fake-weights) to complete it.")
