"""The model a `warm` (or `explain`) works on: the MODEL argument, the Config built from the
options, and one forward of n tokens on the built model.

A model is named by a built-in preset (`tiny`, `llama-3.2-1b`; models/llama.py) or by
`package.module:factory`. The factory protocol::

    def factory(config: atom_compile.Config) -> nn.Module | tuple[nn.Module, Callable[[int], tuple]]

It is called inside `set_current_config(config)`, so `@support_torch_compile` classes built
in it compile under the CLI's config. The optional second value, `example_inputs(num_tokens)`,
returns the positional arguments of one forward of that many tokens (default:
`(input_ids, positions)`, two int64 tensors). A model with `no_compile_layers` and
`allocate_kv_cache` (like the built-in Llama) is driven with a paged KV cache and attention
metadata instead. A model that has no `@support_torch_compile` part goes through
`torch.compile(model, backend=atom_compile.backend(config), fullgraph=True)`.
Torch is imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import CAPTURE_SIZES_TOKEN, CompilationConfig, CompilationLevel, Config
from ..cache.store import cache_root
from ..errors import AtomCompileError

DEFAULT_MODEL = "tiny"
MIN_GENERAL_TOKENS = 8  # Dynamo specialises sizes 0 and 1; a few more keep the trace general
KV_BLOCKS, BLOCK_SIZE = 4, 16


class WarmError(AtomCompileError, ValueError):
    """A model spec, option or device that the job cannot use; `exit_code` 2 (bad input)."""

    exit_code = 2


@dataclass
class WarmOptions:
    """What `warm` and `explain` take from the command line (None: not given)."""

    model: str = DEFAULT_MODEL
    level: Optional[str] = None
    compile_sizes: Optional[list] = None
    capture_sizes: Optional[list[int]] = None
    cudagraph_mode: Optional[str] = None
    device: str = "cpu"
    cache_dir: str = ""
    config: Optional[str] = None
    layers: Optional[int] = None
    fake_weights: bool = False


@dataclass
class ModelSpec:
    """A parsed MODEL argument: a preset name, or a module and a factory in it."""

    text: str
    preset: Optional[str] = None
    module: Optional[str] = None
    attr: Optional[str] = None


def parse_model_spec(text: str) -> ModelSpec:
    """'tiny' -> a preset; 'pkg.mod:factory' -> module and attribute (checked on import)."""
    text = (text or DEFAULT_MODEL).strip()
    if ":" not in text:
        return ModelSpec(text, preset=text)
    module, _, attr = text.partition(":")
    if not module or not attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        raise WarmError(f"model: got {text!r}; allowed: a preset name or package.module:factory")
    return ModelSpec(text, module=module, attr=attr)


# --- the config ----------------------------------------------------------------------------


def _config_document(text: Optional[str]) -> dict:
    """--config: a JSON object (a Config; `compilation_config` may be nested), or @file.json."""
    if not text:
        return {}
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise WarmError(f"--config: cannot read {text[1:]} ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WarmError(f"--config: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise WarmError(f"--config: got {type(doc).__name__}; allowed: a JSON object (a Config)")
    return doc


def build_config(opts: WarmOptions) -> tuple[Config, Path]:
    """The Config of the job and the cache root; CLI options win over --config."""
    doc = _config_document(opts.config)
    cc = doc.pop("compilation_config", {})
    if not isinstance(cc, dict):
        cc = CompilationConfig.from_dict(cc).to_dict()
    cc = dict(cc)
    if opts.level is not None:
        cc.pop("mode", None)
        cc["level"] = opts.level
    if "level" not in cc and "mode" not in cc:
        cc["level"] = int(CompilationLevel.PIECEWISE)
    if opts.compile_sizes is not None:
        cc["compile_sizes"] = list(opts.compile_sizes)
    if opts.capture_sizes is not None:
        cc["cudagraph_capture_sizes"] = list(opts.capture_sizes)
    if opts.cudagraph_mode is not None:
        cc["cudagraph_mode"] = opts.cudagraph_mode
    root = cache_root(opts.cache_dir or cc.get("cache_dir") or "")
    cc["cache_dir"] = str(root)
    cfg = Config.from_dict({**doc, "compilation_config": CompilationConfig.from_dict(cc)})
    return cfg, root


def general_tokens(cfg: Config) -> int:
    """Tokens of the first call: the largest capture size, at least MIN_GENERAL_TOKENS."""
    return max([MIN_GENERAL_TOKENS, *(cfg.capture_sizes or [])])


def parse_sizes(values: Optional[list[str]], allow_token: bool, flag: str) -> Optional[list]:
    """'4 8' / '4,8' (and 'cudagraph_capture_sizes' where allowed) -> [4, 8]."""
    if values is None:
        return None
    out: list = []
    for value in values:
        for item in filter(None, (v.strip() for v in str(value).split(","))):
            if allow_token and item == CAPTURE_SIZES_TOKEN:
                out.append(item)
            elif item.isdigit() and int(item) > 0:
                out.append(int(item))
            else:
                extra = f" or {CAPTURE_SIZES_TOKEN!r}" if allow_token else ""
                raise WarmError(f"{flag}: got {item!r}; allowed: positive ints{extra}, separated by spaces or commas")
    return out


# --- the model -----------------------------------------------------------------------------


@dataclass
class Job:
    """A built model and how to run one forward of n tokens on it."""

    model: Any
    forward: Callable[[int], Any]
    description: str
    builder: Any = None  # the attention metadata builder (built-in protocol): CUDA graphs need it
    fake_mode: Any = None  # the FakeTensorMode of a fake-weight build (cli/warm_fake.py)
    weight_bytes: int = 0  # the bytes of the parameters and buffers (fake: what a real build takes)


def import_factory(spec: ModelSpec) -> Callable:
    if os.getcwd() not in sys.path:  # a console script does not put the working dir on the path
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as exc:
        raise WarmError(f"model {spec.text!r}: cannot import {spec.module!r} ({exc})") from None
    except Exception as exc:
        raise WarmError(f"model {spec.text!r}: importing {spec.module!r} failed ({type(exc).__name__}: {exc})") from None
    target: Any = module
    for part in spec.attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise WarmError(f"model {spec.text!r}: {spec.module!r} has no attribute {spec.attr!r}")
    if not callable(target):
        raise WarmError(f"model {spec.text!r}: {spec.attr!r} is a {type(target).__name__}, not a callable factory")
    return target


def import_model_code(spec: ModelSpec) -> None:
    """Import what registers the model's custom ops, without building it (for explain)."""
    if spec.preset is not None:
        _check_preset(spec)
    else:
        import_factory(spec)


def _check_preset(spec: ModelSpec) -> None:
    from ..models.llama import PRESETS

    if spec.preset not in PRESETS:
        raise WarmError(f"model: got {spec.text!r}; allowed: a preset ({', '.join(sorted(PRESETS))}) "
                        "or package.module:factory")


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise WarmError("--device cuda: no CUDA (or ROCm) device is available here; use --device cpu")


def build_job(spec: ModelSpec, cfg: Config, device: str, layers: Optional[int], max_tokens: int,
              fake_weights: bool = False) -> Job:
    if fake_weights:
        from .warm_fake import fake_job

        return fake_job(spec, cfg, device, layers, max_tokens)
    if spec.preset is not None:
        return _builtin_job(spec, cfg, device, layers, max_tokens)
    if layers is not None:
        raise WarmError("--layers: applies to the built-in presets only; a factory decides its own layers")
    return _factory_job(spec, cfg, device, max_tokens)


def _builtin_job(spec: ModelSpec, cfg: Config, device: str, layers: Optional[int], max_tokens: int) -> Job:
    from ..models.llama import build_model, preset

    _check_preset(spec)
    if layers is not None and layers < 1:
        raise WarmError(f"--layers: got {layers}; allowed: a positive int")
    llama = preset(spec.preset, **({"num_layers": layers} if layers is not None else {}))
    model = build_model(llama, compilation_config=cfg, device=device)
    desc = f"{spec.preset} ({llama.num_layers} layer{'' if llama.num_layers == 1 else 's'})"
    return _paged_job(model, desc, device, max_tokens)


def _paged_job(model: Any, desc: str, device: str, max_tokens: int, fake_mode: Any = None) -> Job:
    """Drive a Llama-style model (paged KV cache, attention from the forward context) as
    tests/support/_job.py does: padding rows only, so no real cache block is written. With a
    `fake_mode` (fake weights) the KV cache and the inputs are fake as well. The forward runs
    outside the mode: Dynamo traces fake tensors of another mode, not inside one."""
    from ..forward_context import set_forward_context
    from ..ops.attention import PagedAttentionMetadataBuilder

    with _within(fake_mode):
        model.allocate_kv_cache(KV_BLOCKS, BLOCK_SIZE)
    builder = PagedAttentionMetadataBuilder(max_tokens, max_tokens, 1, BLOCK_SIZE, device=device)

    def forward(n: int) -> Any:
        ids, pos, meta, ctx = builder.build_for_capture(n, 1)
        with set_forward_context(meta, None, ctx, no_compile_layers=model.no_compile_layers):
            return model(*_faked((ids, pos), fake_mode))

    return Job(model, forward, desc, builder, fake_mode)


def _within(fake_mode: Any) -> Any:
    import contextlib

    return fake_mode if fake_mode is not None else contextlib.nullcontext()


def _faked(args: tuple, fake_mode: Any) -> tuple:
    """The arguments as fake tensors of `fake_mode` (None: as they are)."""
    if fake_mode is None:
        return args
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    return tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
                 for a in args)


def _default_inputs(device: str) -> Callable[[int], tuple]:
    import torch

    def inputs(n: int) -> tuple:
        return (torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))

    return inputs


def call_factory(spec: ModelSpec, cfg: Config) -> tuple[Any, Optional[Callable[[int], tuple]]]:
    """The factory's model and its example_inputs (None: the default inputs)."""
    import torch

    from ..decorators import set_current_config

    factory = import_factory(spec)
    with set_current_config(cfg):
        try:
            made = factory(cfg)
        except (ValueError, TypeError) as exc:
            raise WarmError(f"model {spec.text!r}: the factory refused the config ({type(exc).__name__}: {exc})") from None
    model, inputs = made if isinstance(made, tuple) and len(made) == 2 and callable(made[1]) else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise WarmError(f"model {spec.text!r}: the factory returned {type(model).__name__}; allowed: an "
                        "nn.Module, or (nn.Module, example_inputs(num_tokens))")
    return model, inputs


def _factory_job(spec: ModelSpec, cfg: Config, device: str, max_tokens: int) -> Job:
    model, inputs = call_factory(spec, cfg)
    return factory_forward(spec, model.to(device).eval(), inputs, cfg, device, max_tokens)


def factory_forward(spec: ModelSpec, model: Any, inputs: Optional[Callable[[int], tuple]], cfg: Config,
                    device: str, max_tokens: int, fake_mode: Any = None) -> Job:
    """The job of a factory's model, already on `device`."""
    import torch

    from ..decorators import CompiledDispatcher

    desc = f"{spec.text} ({type(model).__qualname__})"
    if inputs is None and hasattr(model, "no_compile_layers") and hasattr(model, "allocate_kv_cache"):
        return _paged_job(model, desc, device, max_tokens, fake_mode)
    inputs = inputs or _default_inputs(device)
    decorated = any(isinstance(m, CompiledDispatcher) for m in model.modules())
    fn = model
    if not decorated and cfg.compilation_config.level >= CompilationLevel.DYNAMO_AS_IS:
        from ..backends.atom_backend import backend

        fn = torch.compile(model, backend=backend(cfg, prefix=type(model).__name__), fullgraph=True)

    def forward(n: int) -> Any:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in inputs(n))
        args = _faked(args, fake_mode)
        if fn is not model:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    torch._dynamo.mark_dynamic(a, 0)
        return fn(*args)

    return Job(model, forward, desc, None, fake_mode)


