"""Host mode: atom-compile inside an engine that owns scheduling, the KV cache and CUDA graphs.

In host mode (vLLM's plugin mode in the seed) torch.compile stays ours (the split at attention,
Inductor, the cache) and the host records its own CUDA graphs around our compiled pieces: our
runtime records nothing. `Config.from_vllm(vllm_config)` translates a host's configuration,
duck-typed: the real `vllm.config.VllmConfig` or any object with the same attributes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .config import Config

logger = logging.getLogger("atom_compile")

HOSTS = ("vllm",)
# vLLM's compilation modes (CompilationMode / the older CompilationLevel): the same numbers as ours
VLLM_MODES = {"NONE": 0, "NO_COMPILATION": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_AS_IS": 1,
              "DYNAMO_TRACE_ONCE": 2, "DYNAMO_ONCE": 2, "VLLM_COMPILE": 3, "PIECEWISE": 3}
# host settings we record but that change nothing in our compile; named once when not default
IGNORED_COMPILATION = ("pass_config", "custom_ops", "cudagraph_mode", "cudagraph_capture_sizes", "use_cudagraph")


@dataclass(frozen=True)
class HostConfig:
    """What the host engine decided (the seed's mapping table); ours to respect, not to change."""

    name: str = "vllm"
    model: Optional[str] = None
    max_model_len: Optional[int] = None
    tensor_parallel_size: int = 1
    kv_block_size: Optional[int] = None
    kv_cache_dtype: str = "auto"
    num_kv_blocks: Optional[int] = None
    enable_prefix_caching: bool = False
    enable_expert_parallel: bool = False
    rank: int = 0

    def __post_init__(self) -> None:
        from .errors import AtomValueError

        if self.name not in HOSTS:
            raise AtomValueError(f"HostConfig.name: got {self.name!r}; allowed: {', '.join(HOSTS)}")


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return default
    return obj


def _level(compilation: Any) -> int:
    """vLLM's `mode` (or the older `level`): an enum, its name or its number -> our level."""
    from .config import ConfigError

    value = getattr(compilation, "mode", None)
    if value is None:
        value = getattr(compilation, "level", None)
    if value is None:
        return 0
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in VLLM_MODES:
        return VLLM_MODES[name.upper()]
    number = getattr(value, "value", value)
    if isinstance(number, int) and not isinstance(number, bool) and 0 <= number <= 3:
        return number
    raise ConfigError("vllm_config.compilation_config.mode", value, "0-3 or " + " | ".join(sorted(VLLM_MODES)))


def _compilation(compilation: Any, host_capture_sizes: list) -> dict:
    """Our CompilationConfig fields from vLLM's compilation config; our graphs off."""
    cc: dict[str, Any] = {"level": _level(compilation), "use_cudagraph": False, "cudagraph_mode": "NONE"}
    if compilation is None:
        return cc
    splitting = getattr(compilation, "splitting_ops", None)
    if splitting and cc["level"] == 3:
        # the host's attention ops, and ours (for our models and ops): absent ones cost nothing
        from .config import DEFAULT_SPLITTING_OPS

        cc["splitting_ops"] = sorted(set(splitting) | set(DEFAULT_SPLITTING_OPS))
    sizes = getattr(compilation, "compile_sizes", None)
    if sizes:
        # vLLM's token names the HOST's capture sizes: ours are off in host mode
        expanded = [s for s in sizes if s != "cudagraph_capture_sizes"]
        if "cudagraph_capture_sizes" in sizes:
            expanded += list(host_capture_sizes)
        cc["compile_sizes"] = sorted(set(expanded))
    for ours, theirs in (("inductor_compile_config", "inductor_compile_config"), ("cache_dir", "cache_dir"),
                         ("debug_dump_path", "debug_dump_path")):
        value = getattr(compilation, theirs, None)
        if value:
            cc[ours] = dict(value) if isinstance(value, dict) else str(value)
    backend = getattr(compilation, "backend", None)
    if backend in ("eager", "inductor"):
        cc["compiler"] = "eager" if backend == "eager" else "auto"
    if getattr(compilation, "use_inductor", True) is False:
        cc["use_inductor"], cc["compiler"] = False, "auto"
    ignored = [name for name in IGNORED_COMPILATION if getattr(compilation, name, None) not in (None, [], {}, "")]
    if ignored:
        logger.info("atom-compile: host mode: vLLM's %s stay the host's (our compile ignores them; the host "
                    "records the CUDA graphs)", ", ".join(ignored))
    return cc


def config_from_vllm(vllm_config: Any) -> "Config":
    """Our Config for running inside vLLM: its batch limits, its compilation mode, splitting ops
    and compile sizes, the host settings recorded in `host`, and always enforce_eager."""
    from .config import CompilationConfig, Config, ConfigError

    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is None or getattr(scheduler, "max_num_seqs", None) is None:
        raise ConfigError("vllm_config", type(vllm_config).__name__,
                          "a VllmConfig (or an object with scheduler_config.max_num_seqs and friends)")
    compilation = getattr(vllm_config, "compilation_config", None)
    model_len = _get(vllm_config, "model_config.max_model_len") or _get(scheduler, "max_model_len")
    host = HostConfig(
        name="vllm", model=_get(vllm_config, "model_config.model"), max_model_len=model_len,
        tensor_parallel_size=int(_get(vllm_config, "parallel_config.tensor_parallel_size", 1)),
        kv_block_size=_get(vllm_config, "cache_config.block_size"),
        kv_cache_dtype=str(_get(vllm_config, "cache_config.cache_dtype", "auto")),
        num_kv_blocks=_get(vllm_config, "cache_config.num_gpu_blocks"),
        enable_prefix_caching=bool(_get(vllm_config, "cache_config.enable_prefix_caching", False)),
        enable_expert_parallel=bool(_get(vllm_config, "parallel_config.enable_expert_parallel", False)),
        rank=int(_get(vllm_config, "parallel_config.rank", 0)),
    )
    drafts = _get(vllm_config, "speculative_config.num_speculative_tokens", 0) or 0
    host_sizes = list(getattr(compilation, "cudagraph_capture_sizes", None) or [])
    return Config(
        enforce_eager=True, max_num_seqs=int(scheduler.max_num_seqs),
        max_num_batched_tokens=int(getattr(scheduler, "max_num_batched_tokens", None) or 16384),
        num_draft_tokens=int(drafts), host=host,
        compilation_config=CompilationConfig.from_dict(_compilation(compilation, host_sizes)),
    )
