"""The `warm` workflow: build a model, compile (or load) its every piece for the general shape
and each compile size, record CUDA graphs where there is a CUDA device, and report what
happened, counted. `explain` borrows the factors known before tracing from here.

A warm after an `import` rebuilds Inductor's own files for the pieces (they never travel in an
archive: no digest covers them); the report names those prefixes, from the cache directories
before and after the run, so that a slower warm is explained.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..cache import inventory
from ..cache.store import caches_dir, open_cache_paths
from ..config import Config, CUDAGraphMode
from ..counters import compilation_counter
from .progress import Progress
from .warm_model import (
    WarmError,
    WarmOptions,
    build_config,
    build_job,
    check_device,
    general_tokens,
    import_model_code,
    import_factory,
    parse_model_spec,
)


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
    rebuilt: list[str] = field(default_factory=list)  # rank_<r>/<prefix> whose Inductor files were rebuilt
    fake_weights: bool = False
    weight_bytes: int = 0  # of the parameters and buffers (fake weights: what a real build allocates)
    real_weight_bytes: int = 0  # real storage behind them (0 with fake weights)

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
            "rebuilt_inductor_files": self.rebuilt,
            "seconds": round(self.seconds, 3), "cudagraph_mode": self.cudagraph_mode,
            "cudagraphs_recorded": self.cudagraphs_recorded, "notes": self.notes, "counters": c,
            "fake_weights": self.fake_weights, "weight_bytes": self.weight_bytes,
            "real_weight_bytes": self.real_weight_bytes,
        }


def _caches_used(root: Path) -> list[str]:
    """Hashes of the caches this process opened under `root` (each PieceCache.open takes the
    cache's `.in_use` flock and remembers it: the one record of which caches were used)."""
    base = caches_dir(root).resolve()
    return sorted(Path(p).resolve().name for p in open_cache_paths() if Path(p).resolve().parent == base)


def _cache_summary(info: inventory.CacheInfo) -> dict[str, Any]:
    general = {e["content_key"] for e in info.entries if e.get("runtime_shape") is None}
    return {"hash": info.hash, "path": str(info.path), "bytes": info.bytes, "files": info.files,
            "cache_bytes": info.cache_bytes, "scratch_bytes": info.scratch_bytes,
            "artifacts": info.artifacts, "dynamo_functions": info.dynamo_functions,
            "prefixes": info.prefixes, "entries": len(info.entries), "distinct_pieces": len(general),
            "shapes": ["general" if s is None else s for s in info.shapes]}


def _pieces_without_scratch(root: Path) -> set[Path]:
    """Piece directories with an index but without Inductor's files (an imported cache)."""
    return {p.path for c in inventory.list_caches(root) for p in c.pieces if p.index and not p.has_scratch}


def _record_plan(cfg: Config, device: str, has_builder: bool, fake: bool = False) -> tuple[bool, list[str]]:
    mode = cfg.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    record = mode != CUDAGraphMode.NONE and not cfg.enforce_eager and bool(cfg.capture_sizes)
    if record and fake:
        return False, ["CUDA graphs are recorded by the serving process (they need real weights); the compiled "
                       "pieces are cached"]
    if record and device != "cuda":
        return False, [f"CUDA graphs are not recorded on {device} (cudagraph_mode {mode.name} runs as NONE "
                       "here); the compiled pieces are cached"]
    if record and not has_builder:
        return False, ["CUDA graphs are recorded for models driven with attention metadata only; not recorded"]
    return record, []


def run_warm(opts: WarmOptions, show_progress: bool = True) -> WarmReport:
    """Build, compile every piece (general shape and each compile size), record graphs if CUDA."""
    spec = parse_model_spec(opts.model)
    cfg, root = build_config(opts)
    start = time.perf_counter()
    if spec.module is not None:
        import_factory(spec)  # a bad spec fails before torch is imported
    import torch

    check_device(opts.device)
    cc = cfg.compilation_config
    sizes = cc.concrete_compile_sizes()
    tokens = general_tokens(cfg)
    max_tokens = max([tokens, *sizes, *(cfg.capture_sizes or [])])
    before = compilation_counter.as_dict()
    bare = _pieces_without_scratch(root)
    job = build_job(spec, cfg, opts.device, opts.layers, max_tokens, opts.fake_weights)
    record, notes = _record_plan(cfg, opts.device, job.builder is not None, opts.fake_weights)
    recorded: list[int] = []
    with torch.inference_mode(), Progress(1 + len(sizes) + int(record), show_progress) as progress, \
            _compiling_only(opts.fake_weights, job.description):
        progress.step(f"general shape ({tokens} tokens)", lambda: job.forward(tokens))
        for n in sizes:
            progress.step(f"size {n}", lambda n=n: job.forward(n))
        if record:
            recorded = progress.step("CUDA graphs", lambda: _record_graphs(job, cfg))
    counters = {k: v - before.get(k, 0) for k, v in compilation_counter.as_dict().items()}
    hashes = _caches_used(root)
    infos = [inventory.read_cache(root, h) for h in hashes if inventory.hash_dir(root, h).is_dir()]
    rebuilt = sorted(str(p.path.relative_to(i.path)) for i in infos for p in i.pieces
                     if p.path in bare and p.has_scratch)
    return WarmReport(
        model=job.description, level=int(cc.level), device=opts.device, cache_root=str(root),
        cache_hashes=hashes, general_tokens=tokens, compile_sizes=sizes,
        seconds=time.perf_counter() - start, counters=counters,
        cudagraph_mode=(cc.cudagraph_mode or CUDAGraphMode.NONE).name,
        cudagraphs_recorded=recorded, notes=notes, caches=[_cache_summary(i) for i in infos], rebuilt=rebuilt,
        fake_weights=opts.fake_weights, weight_bytes=job.weight_bytes or _tensor_bytes(job.model),
        real_weight_bytes=_real_bytes(job.model),
    )


@contextlib.contextmanager
def _compiling_only(fake: bool, model: str) -> Iterator[None]:
    """Fake weights: compile without running compiled code; a failure says why, as a WarmError."""
    if not fake:
        yield
        return
    from ..backends.compile_only import compile_only
    from .warm_fake import explain_failure

    try:
        with compile_only():
            yield
    except WarmError:
        raise
    except Exception as exc:
        raise explain_failure(exc, model) from exc


def _tensor_bytes(model: Any) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _real_bytes(model: Any) -> int:
    from .warm_fake import real_tensor_bytes

    return real_tensor_bytes(model)


def _record_graphs(job: Any, cfg: Config) -> list[int]:
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
    from ..cache.keys import environment_factors

    cc = cfg.compilation_config
    compiler = make_compiler(cc)
    return {"config": cc.hash_factors(), "environment": environment_factors(compiler.compute_hash(), opts.device)}, cfg, root


def factors_now(base: dict[str, Any], cached: dict[str, Any]) -> dict[str, Any]:
    """`base` completed with what can be re-checked for one cache without tracing: the recorded
    source files re-hashed and the recorded custom ops' sources. The traced graph is taken
    as equal (only tracing can tell)."""
    from ..cache.keys import code_factors, custom_op_factors

    files = ((cached.get("code") or {}).get("files") or {})
    ops = cached.get("custom_ops") or {}
    return {**base, "code": code_factors(files), "custom_ops": custom_op_factors(ops),
            "graph": cached.get("graph")}


# --- the Python API ------------------------------------------------------------------------


def warm(model: str = "tiny", *, fake_weights: bool = False, level: Any = None, compile_sizes: Any = None,
         capture_sizes: Any = None, cudagraph_mode: Any = None, device: str = "cpu", cache_dir: str = "",
         config: Any = None, layers: Any = None, progress: bool = False) -> dict[str, Any]:
    """`atom-compile-cache warm` from Python: the same options (a preset or "package.module:factory",
    `config` a Config, a dict or JSON), the same report as `warm --json`.

        atom_compile.warm("llama-3.2-1b", fake_weights=True, compile_sizes=[1, 2, 4, 8])
    """
    import json

    from .warm_model import parse_sizes

    if config is not None and not isinstance(config, str):
        config = json.dumps(config.to_dict() if hasattr(config, "to_dict") else config, default=str)
    opts = WarmOptions(
        model=model, level=None if level is None else str(level),
        compile_sizes=parse_sizes(None if compile_sizes is None else [str(s) for s in compile_sizes], True,
                                  "compile_sizes"),
        capture_sizes=parse_sizes(None if capture_sizes is None else [str(s) for s in capture_sizes], False,
                                  "capture_sizes"),
        cudagraph_mode=cudagraph_mode, device=device, cache_dir=str(cache_dir or ""), config=config,
        layers=layers, fake_weights=fake_weights,
    )
    return run_warm(opts, show_progress=progress).as_dict()
