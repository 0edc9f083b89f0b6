"""The `warm` job (and the factors `explain` compares): compile a model's every piece ahead of time.

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

The job makes one call with the general shape (the largest capture size worth of tokens, at
least 8: Dynamo traces and every piece is compiled or loaded) and one call per compile size
(each piece's concrete entry is compiled or loaded), then records CUDA graphs where there is
a CUDA device. Torch is imported inside the functions: `import atom_compile.cache.warm` is cheap.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..config import CAPTURE_SIZES_TOKEN, CompilationConfig, CompilationLevel, Config, CUDAGraphMode
from . import inventory
from .store import cache_root, caches_dir

DEFAULT_MODEL = "tiny"
MIN_GENERAL_TOKENS = 8  # Dynamo specialises sizes 0 and 1; a few more keep the trace general
KV_BLOCKS, BLOCK_SIZE = 4, 16


class WarmError(ValueError):
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


def _import_factory(spec: ModelSpec) -> Callable:
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
        _import_factory(spec)


def _check_preset(spec: ModelSpec) -> None:
    from ..models.llama import PRESETS

    if spec.preset not in PRESETS:
        raise WarmError(f"model: got {spec.text!r}; allowed: a preset ({', '.join(sorted(PRESETS))}) "
                        "or package.module:factory")


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise WarmError("--device cuda: no CUDA (or ROCm) device is available here; use --device cpu")


def build_job(spec: ModelSpec, cfg: Config, device: str, layers: Optional[int], max_tokens: int) -> Job:
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
    desc = f"{spec.preset} ({llama.num_layers} layers)"
    return _paged_job(model, desc, device, max_tokens)


def _paged_job(model: Any, desc: str, device: str, max_tokens: int) -> Job:
    """Drive a Llama-style model (paged KV cache, attention from the forward context) as
    tests/_job.py does: padding rows only, so no real cache block is written."""
    from ..forward_context import set_forward_context
    from ..ops.attention import PagedAttentionMetadataBuilder

    model.allocate_kv_cache(KV_BLOCKS, BLOCK_SIZE)
    builder = PagedAttentionMetadataBuilder(max_tokens, max_tokens, 1, BLOCK_SIZE, device=device)

    def forward(n: int) -> Any:
        ids, pos, meta, ctx = builder.build_for_capture(n, 1)
        with set_forward_context(meta, None, ctx, no_compile_layers=model.no_compile_layers):
            return model(ids, pos)

    return Job(model, forward, desc, builder)


def _default_inputs(device: str) -> Callable[[int], tuple]:
    import torch

    def inputs(n: int) -> tuple:
        return (torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))

    return inputs


def _factory_job(spec: ModelSpec, cfg: Config, device: str, max_tokens: int) -> Job:
    import torch

    from ..decorators import CompiledDispatcher, set_current_config

    factory = _import_factory(spec)
    with set_current_config(cfg):
        try:
            made = factory(cfg)
        except (ValueError, TypeError) as exc:
            raise WarmError(f"model {spec.text!r}: the factory refused the config ({type(exc).__name__}: {exc})") from None
    model, inputs = made if isinstance(made, tuple) and len(made) == 2 and callable(made[1]) else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise WarmError(f"model {spec.text!r}: the factory returned {type(model).__name__}; allowed: an "
                        "nn.Module, or (nn.Module, example_inputs(num_tokens))")
    model = model.to(device).eval()
    desc = f"{spec.text} ({type(model).__qualname__})"
    if inputs is None and hasattr(model, "no_compile_layers") and hasattr(model, "allocate_kv_cache"):
        return _paged_job(model, desc, device, max_tokens)
    inputs = inputs or _default_inputs(device)
    decorated = any(isinstance(m, CompiledDispatcher) for m in model.modules())
    fn = model
    if not decorated and cfg.compilation_config.level >= CompilationLevel.DYNAMO_AS_IS:
        from ..backends.atom_backend import backend

        fn = torch.compile(model, backend=backend(cfg, prefix=type(model).__name__), fullgraph=True)

    def forward(n: int) -> Any:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in inputs(n))
        if fn is not model:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    torch._dynamo.mark_dynamic(a, 0)
        return fn(*args)

    return Job(model, forward, desc)


# --- running it ----------------------------------------------------------------------------


@dataclass
class WarmReport:
    model: str
    level: int
    device: str
    cache_root: str
    cache_hashes: list[str]
    general_tokens: int
    compile_sizes: list[int]
    seconds: float
    counters: dict[str, int]
    cudagraph_mode: str
    cudagraphs_recorded: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    caches: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        c = self.counters
        return {
            "model": self.model, "level": self.level, "device": self.device, "cache_root": self.cache_root,
            "cache_hashes": self.cache_hashes, "caches": self.caches,
            "bytes": sum(x["bytes"] for x in self.caches),
            "general_tokens": self.general_tokens, "compile_sizes": self.compile_sizes,
            "pieces": c.get("num_piecewise_capturable_graphs_seen", 0),
            "split_ops": c.get("num_piecewise_graphs_seen", 0) - c.get("num_piecewise_capturable_graphs_seen", 0),
            "distinct_pieces": sum(x["distinct_pieces"] for x in self.caches),
            "compiled": c.get("num_inductor_compiles", 0) + c.get("num_eager_compiles", 0),
            "loaded": c.get("num_compiled_artifacts_loaded", 0),
            "deduplicated": c.get("num_deduplicated_pieces", 0),
            "seconds": round(self.seconds, 3), "cudagraph_mode": self.cudagraph_mode,
            "cudagraphs_recorded": self.cudagraphs_recorded, "notes": self.notes, "counters": c,
        }


@contextlib.contextmanager
def _progress(total: int, show: bool) -> Iterator[Callable[[str], None]]:
    if not show:
        yield lambda desc: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="atom-compile-cache warm", unit="step", leave=False) as bar:
        def step(desc: str) -> None:
            bar.set_postfix_str(desc)
            bar.update(1)

        yield step


def _show_progress() -> bool:
    from .store import current_rank

    return current_rank() == 0 and sys.stderr.isatty()


def _caches_used(root: Path) -> list[str]:
    """Hashes of the caches this process opened under `root` (each PieceCache.open takes the
    cache's `.in_use` flock and remembers it: the one record of which caches were used)."""
    from . import store

    base = caches_dir(root).resolve()
    out = []
    for path in store.open_cache_paths():
        p = Path(path).resolve()
        if p.parent == base:
            out.append(p.name)
    return sorted(out)


def _cache_summary(root: Path, cache_hash: str) -> dict[str, Any]:
    info = inventory.read_cache(root, cache_hash)
    general = {e["content_key"] for e in info.entries if e.get("runtime_shape") is None}
    return {"hash": cache_hash, "path": str(info.path), "bytes": info.bytes, "files": info.files,
            "prefixes": info.prefixes, "entries": len(info.entries), "distinct_pieces": len(general),
            "shapes": ["general" if s is None else s for s in info.shapes]}


def run_warm(opts: WarmOptions) -> WarmReport:
    """Build, compile every piece (general shape and each compile size), record graphs if CUDA."""
    spec = parse_model_spec(opts.model)
    cfg, root = build_config(opts)
    start = time.perf_counter()
    if spec.module is not None:
        _import_factory(spec)  # a bad spec fails before torch is imported
    import torch

    from ..counters import compilation_counter

    check_device(opts.device)
    cc = cfg.compilation_config
    sizes = cc.concrete_compile_sizes()
    tokens = general_tokens(cfg)
    max_tokens = max([tokens, *sizes, *(cfg.capture_sizes or [])])
    before = compilation_counter.clone().as_dict()
    job = build_job(spec, cfg, opts.device, opts.layers, max_tokens)
    notes: list[str] = []
    mode = cc.cudagraph_mode or CUDAGraphMode.NONE
    record = mode != CUDAGraphMode.NONE and not cfg.enforce_eager and bool(cfg.capture_sizes)
    if record and opts.device != "cuda":
        notes.append(f"CUDA graphs are not recorded on {opts.device} (cudagraph_mode {mode.name} runs as NONE "
                     "here); the compiled pieces are cached")
        record = False
    if record and job.builder is None:
        notes.append("CUDA graphs are recorded for models driven with attention metadata only; not recorded")
        record = False
    recorded: list[int] = []
    with torch.inference_mode(), _progress(1 + len(sizes) + int(record), _show_progress()) as step:
        job.forward(tokens)
        step(f"general shape ({tokens} tokens)")
        for size in sizes:
            job.forward(size)
            step(f"size {size}")
        if record:
            recorded = _record_graphs(job, cfg)
            step("cuda graphs")
    counters = {k: v - before.get(k, 0) for k, v in compilation_counter.as_dict().items()}
    hashes = _caches_used(root)
    return WarmReport(
        model=job.description, level=int(cc.level), device=opts.device, cache_root=str(root),
        cache_hashes=hashes, general_tokens=tokens, compile_sizes=sizes,
        seconds=time.perf_counter() - start, counters=counters, cudagraph_mode=mode.name,
        cudagraphs_recorded=recorded, notes=notes,
        caches=[_cache_summary(root, h) for h in hashes if inventory.hash_dir(root, h).is_dir()],
    )


def _record_graphs(job: Job, cfg: Config) -> list[int]:
    from ..runtime.model_runner import ModelRunner

    runner = ModelRunner(job.model, cfg, job.builder)
    _, sizes = runner.capture_cudagraph()
    return sizes


# --- explain -------------------------------------------------------------------------------


def current_factors(opts: WarmOptions) -> tuple[dict[str, Any], Config, Path]:
    """The key factors known before tracing: the config's and the compiler environment's."""
    spec = parse_model_spec(opts.model)
    cfg, root = build_config(opts)
    check_device(opts.device)
    import_model_code(spec)
    from ..backends.inductor import make_compiler
    from .keys import environment_factors

    cc = cfg.compilation_config
    compiler = make_compiler(cc)
    return {"config": cc.hash_factors(), "environment": environment_factors(compiler.compute_hash(), opts.device)}, cfg, root


def factors_now(base: dict[str, Any], cached: dict[str, Any]) -> dict[str, Any]:
    """`base` completed with what can be re-checked for one cache without tracing: the recorded
    source files re-hashed and the recorded custom ops' sources. The traced graph is taken
    as equal (only tracing can tell)."""
    from .keys import code_factors, custom_op_factors

    files = ((cached.get("code") or {}).get("files") or {})
    ops = cached.get("custom_ops") or {}
    return {**base, "code": code_factors(files), "custom_ops": custom_op_factors(ops),
            "graph": cached.get("graph")}

