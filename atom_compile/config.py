"""The two configs (the levels and CUDA-graph modes live in modes.py, re-exported here).

`CompilationConfig` holds what the compiler half needs; `Config` is the runtime-facing config
that runs the level-3 set-up sequence of the seed (splitting ops, capture ladder, graph mode,
compile sizes) in ``__post_init__``. Every bad value raises `ConfigError` (a ValueError) that
names the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

from .errors import AtomTypeError, ConfigError
from .config_checks import (CAPTURE_SIZES_TOKEN, _check_bool, _check_budget, _check_count, _check_graph_partition,
                            _check_size, _jsonable, _range_list, _size_list, default_capture_ladder,
                            normalize_op_name)
from .host_config import HostConfig
from .modes import CompilationLevel, CUDAGraphMode
from .passes import check_pass, pass_factors

__all__ = [
    "CAPTURE_SIZES_TOKEN", "COMPILERS", "DEFAULT_SPLITTING_OPS", "CompilationConfig", "CompilationLevel",
    "Config", "ConfigError", "CUDAGraphMode", "as_compilation_config", "default_capture_ladder",
    "normalize_op_name",
]


DEFAULT_SPLITTING_OPS = ("aiter.unified_attention_with_output", "aiter.mla_attention")
COMPILERS = ("auto", "inductor_standalone", "inductor", "eager")

_BOOL_FIELDS = ("use_cudagraph", "cudagraph_copy_inputs", "use_inductor", "require_cache",
                "use_inductor_graph_partition", "trace_layers_once", "residual_add_pass", "small_m_linear_pass",
                "prologue_pass", "epilogue_pass", "glu_pass", "rope_pass", "rope_attention_pass")


@dataclass
class CompilationConfig:
    """What the compiler half needs: level, splitting ops, sizes, compiler and cache choices.

    Only `hash_factors()` (level, splitting ops, compile sizes, the compiler, Inductor's
    options) changes compiled code; paths and CUDA-graph settings never enter the cache key.
    """

    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: list[int] | None = None
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [512])
    cudagraph_mode: CUDAGraphMode | None = None
    splitting_ops: list[str] | None = None
    cudagraph_copy_inputs: bool = False
    use_inductor: bool = True
    compile_sizes: list[Union[int, str]] | None = None
    # vLLM's compile_ranges: [lo, hi) token-count ranges, one compiled piece per range (an exact
    # compile size wins over a range). Enters the hash only when set.
    compile_ranges: list[list[int]] | None = None
    # Inductor post-grad passes (callables over a torch.fx.Graph or "package.module:name"),
    # run in order; each pass's uuid (default: its source hash) enters the hash when set.
    inductor_passes: list = field(default_factory=list)
    # vLLM's use_inductor_graph_partition: level 3 gives Inductor the whole graph, which it
    # partitions at the splitting ops itself (backends/graph_partition.py). Hashed when True.
    use_inductor_graph_partition: bool = False
    # The built-in post-grad pass (backends/residual_add.py) that keeps a residual add out of
    # the GEMM before it (Inductor's addmm copies the residual first: a copy per add); the add
    # fuses into the next kernel. Changes compiled code: it enters each piece's key through the
    # compiler options (as inductor_passes do), so caches made without it are not reused.
    residual_add_pass: bool = True
    # The built-in post-grad pass (backends/small_m_pass.py) that makes a CUDA piece's half-
    # precision projections call atom::small_m_linear: a Triton GEMV at one row, F.linear else.
    # Keyed the same way; it changes nothing on CPU.
    small_m_linear_pass: bool = True
    # The built-in post-grad pass (backends/prologue_pass.py) that puts an RMSNorm (with the
    # residual add before it) or a SiLU-and-mul into the small-M projection that reads it: one
    # launch at one token. Off until measured on a GPU; needs small_m_linear_pass. Keyed when on.
    prologue_pass: bool = False
    # The built-in post-grad pass (backends/epilogue_pass.py) that splits an RMSNorm between the
    # projections around it (a layer's o or down before, gate_up or the next qkv after): at one
    # token the first GEMV adds, weighs and sums the squares, the second scales by 1 / rms; no
    # norm kernel. Off: on an H100 the chain of kernels is 1.6% faster with it, the decode step
    # 10% slower (BENCHMARKS.md). Needs small_m_linear_pass. Keyed when on.
    epilogue_pass: bool = False
    # The built-in post-grad pass (backends/glu_pass.py) that puts a gated MLP's activation-and-
    # mul (SwiGLU, GeGLU) into the epilogue of its gate and up projections: one launch at one
    # token, no activation kernel. None (the default): on wherever small_m_linear_pass is (on an
    # H100 the decode step at batch 1 is 2.2% faster with it, benchmarks/decode_ab.py); True
    # needs small_m_linear_pass. Keyed when on.
    glu_pass: Optional[bool] = None
    # The built-in post-grad pass (backends/rope_pass.py) that puts the rotary embedding of the
    # query and key (neox RoPE, recognised by what it computes) into the epilogue of their qkv
    # projection: one launch at one token, no RoPE kernels. Off: on an H100 the step is no
    # faster (BENCHMARKS.md, benchmarks/decode.py -rope arms); needs small_m_linear_pass. Keyed when on.
    rope_pass: bool = False
    # A pass on a CUDA graph before it is split (backends/rope_attention_pass.py) that moves the
    # rotary embedding of the query and key (neox RoPE, recognised by what it computes) into our
    # paged attention op: the decode attention rotates them in registers, no RoPE kernel runs
    # between the qkv projection and the attention. Off: on an H100 the decode step is 1.9% slower
    # at batch 1, the rotation's dependent loads on the attention's critical path (BENCHMARKS.md,
    # benchmarks/decode_ab.py -ropeattn). Keyed when on.
    rope_attention_pass: bool = False
    # Where a FULL CUDA graph records the split graph on a Hopper or later GPU, before each
    # attention a second stream of the graph asks L2 for the first this-many MB of the weights
    # the next piece multiplies by (backends/l2_prefetch_pass.py): the memory works through the
    # attention's latency. None: half the GPU's L2; 0: off. Changes no compiled piece, but the
    # stitching graph a warm start loads holds the prefetches: keyed when set. (A warm start in
    # another CUDA-graph mode loads them too: they fork in FULL captures only.)
    l2_prefetch_mb: Optional[int] = None
    # Reductions along a row of up to this many elements (an RMSNorm over the hidden size) run
    # as Inductor's persistent reductions, one read of the row, where Inductor stops at 1024
    # (backends/reductions.py): 2.0% off the decode step at batch 1 on an H100. 0 leaves
    # Inductor's choice. Keyed when not 0.
    persistent_reduction_max: int = 8192
    inductor_compile_config: dict = field(default_factory=dict)
    debug_dump_path: str = ""
    cache_dir: str = ""
    # The remote tier's URL (redis://host:port/db or an fsspec URL); "" reads
    # ATOM_COMPILE_REMOTE_CACHE. Never part of the hash: machines with and without it share keys.
    remote_cache: str = ""
    compiler: str = "auto"
    # Strict mode: a compile at run time is an error (CacheRequired), as ATOM_COMPILE_REQUIRE_CACHE=1.
    # Changes no compiled code, so never part of the hash.
    require_cache: bool = False
    # Trace the alike layers of a ModuleList once (torch's nested_compile_region, torch >= 2.9;
    # the decorator's path): the same computation, traced faster. Never part of the hash.
    trace_layers_once: bool = True
    # Layers that run outside the compiled graph, by name (filled while the model is built;
    # the forward context hands it to the attention op). Never part of the hash.
    static_forward_context: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.level = CompilationLevel.parse(self.level, "CompilationConfig.level")
        for name in _BOOL_FIELDS:
            if name == "glu_pass" and self.glu_pass is None:  # the default: follows small_m_linear_pass
                continue
            setattr(self, name, _check_bool(f"CompilationConfig.{name}", getattr(self, name)))
        self.persistent_reduction_max = _check_count("CompilationConfig.persistent_reduction_max",
                                                     self.persistent_reduction_max, "Inductor's choice")
        _check_count("CompilationConfig.l2_prefetch_mb", self.l2_prefetch_mb, "off", none_means="half the GPU's L2")
        for name in ("prologue_pass", "epilogue_pass", "glu_pass", "rope_pass"):
            if getattr(self, name) and not self.small_m_linear_pass:
                raise ConfigError(f"CompilationConfig.{name}", True,
                                  "True only with small_m_linear_pass (it fuses into that pass's calls)")
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode, "CompilationConfig.cudagraph_mode")
        if self.cudagraph_capture_sizes is not None:
            self.cudagraph_capture_sizes = _size_list(
                "CompilationConfig.cudagraph_capture_sizes", self.cudagraph_capture_sizes
            )
        self.cuda_graph_sizes = _size_list("CompilationConfig.cuda_graph_sizes", self.cuda_graph_sizes)
        if not self.cuda_graph_sizes:
            raise ConfigError("CompilationConfig.cuda_graph_sizes", [], "a non-empty list of positive ints")
        if self.splitting_ops is not None:
            if isinstance(self.splitting_ops, str) or not isinstance(self.splitting_ops, Iterable):
                raise ConfigError(
                    "CompilationConfig.splitting_ops", self.splitting_ops, "a list of op names"
                )
            self.splitting_ops = [
                normalize_op_name(op, "CompilationConfig.splitting_ops") for op in self.splitting_ops
            ]
        if self.compile_sizes is not None:
            self.compile_sizes = _size_list(
                "CompilationConfig.compile_sizes", self.compile_sizes, allow_token=True
            )
        if self.compile_ranges is not None:
            self.compile_ranges = _range_list("CompilationConfig.compile_ranges", self.compile_ranges)
        if isinstance(self.inductor_passes, (str, bytes)) or not isinstance(self.inductor_passes, Iterable):
            raise ConfigError("CompilationConfig.inductor_passes", self.inductor_passes, "a list of passes")
        self.inductor_passes = [check_pass(p) for p in self.inductor_passes]
        if not isinstance(self.inductor_compile_config, dict):
            raise ConfigError(
                "CompilationConfig.inductor_compile_config", self.inductor_compile_config,
                "a dict of Inductor config names to values",
            )
        for name in ("debug_dump_path", "cache_dir"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"CompilationConfig.{name}", getattr(self, name), "a path string")
        if not isinstance(self.remote_cache, str) or (self.remote_cache and "://" not in self.remote_cache):
            raise ConfigError("CompilationConfig.remote_cache", self.remote_cache,
                              "'' or a URL: redis://host:port/db, rediss://..., or an fsspec URL (file://, s3://, ...)")
        if self.compiler not in COMPILERS:
            raise ConfigError("CompilationConfig.compiler", self.compiler, " | ".join(COMPILERS))
        if not self.use_inductor and self.compiler in ("inductor_standalone", "inductor"):
            raise ConfigError(
                "CompilationConfig.compiler", self.compiler,
                "'auto' or 'eager' when use_inductor is False",
            )
        _check_graph_partition(self)

    # --- the seed's set-up steps -------------------------------------------------------

    def set_splitting_ops_for_v1(self) -> None:
        """Level 3: split at the attention ops unless the user chose (an empty list means no split)."""
        if self.splitting_ops is None:
            self.splitting_ops = [normalize_op_name(op) for op in DEFAULT_SPLITTING_OPS]

    def init_with_cudagraph_sizes(self, capture_sizes: list[int]) -> None:
        """Finalise compile sizes: expand the string 'cudagraph_capture_sizes', sort, dedupe."""
        if self.compile_sizes is None:
            return
        sizes: set[int] = set()
        for item in self.compile_sizes:
            if item == CAPTURE_SIZES_TOKEN:
                sizes.update(capture_sizes)
            else:
                sizes.add(item)
        self.compile_sizes = sorted(sizes)

    def resolved_compiler(self) -> str:
        """The compiler a level-2/3 graph goes through ('auto' resolves in backends.inductor)."""
        if not self.use_inductor:
            return "eager"
        return self.compiler

    def concrete_compile_sizes(self) -> list[int]:
        """Compile sizes as ints (the capture-size token is expanded by init_with_cudagraph_sizes)."""
        return sorted({s for s in (self.compile_sizes or []) if isinstance(s, int)})

    def concrete_compile_ranges(self) -> list[tuple[int, int]]:
        """compile_ranges as sorted (lo, hi) tuples; [] when unset."""
        return [tuple(r) for r in (self.compile_ranges or [])]

    def hash_factors(self) -> dict[str, Any]:
        """The fields that change compiled code, in a JSON-able form (see cache/keys.py)."""
        factors = {
            "level": int(self.level),
            "splitting_ops": sorted(self.splitting_ops) if self.splitting_ops is not None else None,
            "compile_sizes": self.concrete_compile_sizes(),
            "compiler": self.resolved_compiler(),
            "inductor_compile_config": _jsonable(self.inductor_compile_config),
        }
        if self.compile_ranges:  # only when set, so that keys made without ranges stay valid
            factors["compile_ranges"] = [list(r) for r in self.concrete_compile_ranges()]
        if self.inductor_passes:  # likewise
            factors["inductor_passes"] = pass_factors(self.inductor_passes)
        if self.use_inductor_graph_partition:  # likewise
            factors["use_inductor_graph_partition"] = True
        for name in ("residual_add_pass", "small_m_linear_pass"):  # keyed when off (on is the default)
            if not getattr(self, name):
                factors[name] = False
        for name, on in (("prologue_pass", self.prologue_pass), ("epilogue_pass", self.epilogue_pass),
                         ("glu_pass", self.glu_fused()),
                         ("rope_pass", self.rope_pass), ("rope_attention_pass", self.rope_attention_pass)):  # keyed when on
            if on:
                factors[name] = True
        if self.persistent_reduction_max:
            factors["persistent_reduction_max"] = self.persistent_reduction_max
        if self.l2_prefetch_mb is not None:  # the stitching graph a warm start loads holds the prefetches
            factors["l2_prefetch_mb"] = self.l2_prefetch_mb
        return factors

    def glu_fused(self) -> bool:
        """Whether the GLU pass runs: glu_pass, or where it is None (the default) the small-M pass."""
        return self.small_m_linear_pass if self.glu_pass is None else self.glu_pass

    def compute_hash(self) -> str:
        """A short digest of `hash_factors()`; equal configs give equal hashes across processes."""
        blob = json.dumps(self.hash_factors(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # --- input --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Union[Mapping[str, Any], str, int]) -> "CompilationConfig":
        """Build from a dict, a JSON string or a bare level; accepts vLLM's `mode` for `level`
        and vLLM's `backend` ('inductor' / 'eager')."""
        if isinstance(data, int) and not isinstance(data, bool):
            return cls(level=data)
        if isinstance(data, str):
            text = data.strip()
            if text.isdigit():
                return cls(level=int(text))
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError("compilation_config", data, f"a JSON object ({exc.msg})") from None
        if not isinstance(data, Mapping):
            raise ConfigError("compilation_config", data, "a dict, a JSON object string or a level")
        data = dict(data)
        if "mode" in data:
            mode = data.pop("mode")
            if "level" in data and CompilationLevel.parse(data["level"]) != CompilationLevel.parse(mode, "mode"):
                raise ConfigError("mode", mode, f"the same level as 'level' ({data['level']!r})")
            data["level"] = mode
        if "backend" in data:
            backend = data.pop("backend")
            mapping = {"inductor": "auto", "eager": "eager", "": "auto"}
            if backend not in mapping:
                raise ConfigError("backend", backend, "'inductor' or 'eager'")
            data.setdefault("compiler", mapping[backend])
        names = {f.name for f in dataclasses.fields(cls) if f.name != "static_forward_context"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError("compilation_config", unknown[0], "one of " + ", ".join(sorted(names)))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict that from_dict() reads back."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "static_forward_context":
                continue
            value = getattr(self, f.name)
            if isinstance(value, CUDAGraphMode):
                value = value.name
            elif isinstance(value, enum.IntEnum):
                value = int(value)
            out[f.name] = value
        return out


@dataclass
class Config:
    """The runtime-facing config: batch limits, eager switch and the compilation config.

    `capture_sizes` is computed: the CUDA-graph batch sizes, ascending. `enforce_eager` turns
    off atom-compile's CUDA graphs (as in plugin mode, where the host owns graphs); the
    compilation level still applies, so set level 0 to skip compilation as well.
    """

    enforce_eager: bool = False
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    num_draft_tokens: int = 0
    # capture within this much graph-pool memory: bytes (int) or a fraction of free memory
    # (float in (0, 1]); the sizes that would not fit are skipped, named in one info line
    cudagraph_memory_budget: Union[int, float, None] = None
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    # host mode (README "Inside vLLM"): the host's settings; our CUDA graphs off, compile ours
    host: HostConfig | None = None
    capture_sizes: list[int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.enforce_eager = _check_bool("Config.enforce_eager", self.enforce_eager)
        if self.host is not None:
            self._host_mode()
        _check_size("Config.max_num_seqs", self.max_num_seqs)
        _check_size("Config.max_num_batched_tokens", self.max_num_batched_tokens)
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or self.num_draft_tokens < 0:
            raise ConfigError("Config.num_draft_tokens", self.num_draft_tokens, "an int >= 0")
        _check_budget(self.cudagraph_memory_budget)
        if not isinstance(self.compilation_config, CompilationConfig):
            self.compilation_config = CompilationConfig.from_dict(self.compilation_config)
        cc = self.compilation_config
        if cc.level == CompilationLevel.PIECEWISE:
            cc.set_splitting_ops_for_v1()
        self._set_cudagraph_sizes()
        if cc.cudagraph_mode is None:
            cc.cudagraph_mode = (
                CUDAGraphMode.TR_HYBRID if cc.level == CompilationLevel.PIECEWISE else CUDAGraphMode.NONE
            )
        cc.init_with_cudagraph_sizes(self.capture_sizes)
        for size in cc.concrete_compile_sizes():
            _check_size(
                "CompilationConfig.compile_sizes", size,
                self.max_num_batched_tokens, "max_num_batched_tokens",
            )

    def _host_mode(self) -> None:
        """The host records the CUDA graphs: ours are off whatever else was asked."""
        if isinstance(self.host, Mapping):
            self.host = HostConfig(**self.host)
        if not isinstance(self.host, HostConfig):
            raise ConfigError("Config.host", self.host, "a HostConfig (or a dict of its fields), or None")
        self.enforce_eager = True
        if not isinstance(self.compilation_config, CompilationConfig):
            self.compilation_config = CompilationConfig.from_dict(self.compilation_config)
        self.compilation_config.use_cudagraph = False
        self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "Config":
        """Our Config inside vLLM (host mode), from its VllmConfig or any object shaped like it."""
        from .host_config import config_from_vllm

        return config_from_vllm(vllm_config)

    def _set_cudagraph_sizes(self) -> None:
        cc = self.compilation_config
        rows = self.num_draft_tokens + 1
        if not cc.use_cudagraph:
            self.capture_sizes = []
            return
        if cc.cudagraph_capture_sizes is not None:
            sizes = list(cc.cudagraph_capture_sizes)
            source = "CompilationConfig.cudagraph_capture_sizes"
        elif len(cc.cuda_graph_sizes) == 1:
            # The generated ladder stops at max_num_seqs rather than failing on the default [512].
            sizes = default_capture_ladder(min(cc.cuda_graph_sizes[0], self.max_num_seqs))
            source = None
        else:
            sizes = list(cc.cuda_graph_sizes)
            source = "CompilationConfig.cuda_graph_sizes"
        if source is not None:
            for size in sizes:
                _check_size(source, size, self.max_num_seqs, "max_num_seqs")
        for size in sizes:
            if size * rows > self.max_num_batched_tokens:
                raise ConfigError(
                    source or "CompilationConfig.cuda_graph_sizes", size,
                    f"sizes whose rows (size * (num_draft_tokens + 1) = {size * rows}) fit "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens})",
                )
        self.capture_sizes = sorted(set(sizes))

    @property
    def max_q_len(self) -> int:
        """Query rows per request in a decode step: the drafts plus the token it decodes."""
        return self.num_draft_tokens + 1

    @classmethod
    def from_dict(cls, data: Union[Mapping[str, Any], str]) -> "Config":
        """Build from a dict or JSON string; `compilation_config` may itself be a dict."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ConfigError("config", data, f"a JSON object ({exc.msg})") from None
        if not isinstance(data, Mapping):
            raise ConfigError("config", data, "a dict or a JSON object string")
        data = dict(data)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError("config", unknown[0], "one of " + ", ".join(sorted(names)))
        if "compilation_config" in data and not isinstance(data["compilation_config"], CompilationConfig):
            data["compilation_config"] = CompilationConfig.from_dict(data["compilation_config"])
        return cls(**data)


def as_compilation_config(cfg: Union[Config, CompilationConfig, Mapping, str, int, None]) -> CompilationConfig:
    """The CompilationConfig inside whatever the user passed (a Config, a dict, JSON, a level)."""
    if cfg is None:
        return Config().compilation_config
    if isinstance(cfg, Config):
        return cfg.compilation_config
    if isinstance(cfg, CompilationConfig):
        return cfg
    if isinstance(cfg, (Mapping, str, int)) and not isinstance(cfg, bool):
        return Config(compilation_config=CompilationConfig.from_dict(cfg)).compilation_config
    raise AtomTypeError(
        f"config: got {type(cfg).__name__}; allowed: Config, CompilationConfig, a dict, a JSON string or a level"
    )
