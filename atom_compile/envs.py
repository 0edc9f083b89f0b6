"""Every environment variable atom-compile reads, read here and nowhere else.

The entry points (`backend(cfg)`, the decorator when a model is built, the CLI's main) call
`read()` once; the `Environment` it returns travels with the backend and the model, so no room
below reads `os.environ` on its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")

logger = logging.getLogger("atom_compile")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _not_off(name: str) -> bool:
    """On unless the variable says 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_root_override() -> str | None:
    """ATOM_COMPILE_CACHE_ROOT: the cache root (default: $XDG_CACHE_HOME/atom or ~/.cache/atom)."""
    return os.environ.get("ATOM_COMPILE_CACHE_ROOT") or None


def xdg_cache_home() -> Path:
    value = os.environ.get("XDG_CACHE_HOME")
    return Path(value) if value else Path.home() / ".cache"


def cache_disabled() -> bool:
    """ATOM_COMPILE_DISABLE_CACHE=1: compile without reading or writing any cache."""
    return _flag("ATOM_COMPILE_DISABLE_CACHE")


def compile_disabled() -> bool:
    """ATOM_COMPILE_DISABLE=1 (or Dynamo's own TORCHDYNAMO_DISABLE=1): run forwards eagerly."""
    if _flag("ATOM_COMPILE_DISABLE"):
        return True
    try:
        import torch._dynamo.config as dynamo_config

        return bool(dynamo_config.disable)
    except Exception as exc:  # pragma: no cover - a torch without Dynamo
        logger.debug("atom-compile: cannot read Dynamo's disable flag (%s)", exc)
        return False


def check_inputs() -> bool:
    """ATOM_COMPILE_CHECK_INPUTS=0 drops the per-call check that a guard-free dispatch still
    matches the traced static sizes (saves about a microsecond a call)."""
    return os.environ.get("ATOM_COMPILE_CHECK_INPUTS", "1").strip().lower() not in ("0", "false", "no", "off")


def require_cache() -> bool:
    """ATOM_COMPILE_REQUIRE_CACHE=1: strict mode, any compile at run time is an error (a pre-built
    cache that misses must fail loudly, not pay the cold compile in production)."""
    return _flag("ATOM_COMPILE_REQUIRE_CACHE")


def vllm_plugin_disabled() -> bool:
    """ATOM_COMPILE_DISABLE_VLLM_PLUGIN=1 (the seed's ATOM_DISABLE_VLLM_PLUGIN too): vLLM's plugin
    hook does nothing."""
    return _flag("ATOM_COMPILE_DISABLE_VLLM_PLUGIN") or _flag("ATOM_DISABLE_VLLM_PLUGIN")


def vllm_plugin_attention_disabled() -> bool:
    """ATOM_COMPILE_DISABLE_VLLM_PLUGIN_ATTENTION=1 (or ATOM_DISABLE_VLLM_PLUGIN_ATTENTION): the
    plugin leaves attention to the host (our reference attention op is not registered)."""
    return _flag("ATOM_COMPILE_DISABLE_VLLM_PLUGIN_ATTENTION") or _flag("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION")


def log_level() -> str | None:
    """ATOM_COMPILE_LOG: the log level of the `atom_compile` logger and of the CLI (`debug` also
    shows the third-party warnings the entry points otherwise filter)."""
    value = os.environ.get("ATOM_COMPILE_LOG", "").strip().lower()
    return value or None


def peer_timeout() -> float:
    """ATOM_COMPILE_PEER_TIMEOUT: seconds a rank waits for the peer compiling a shared piece
    before compiling it itself (default 600)."""
    raw = os.environ.get("ATOM_COMPILE_PEER_TIMEOUT", "").strip()
    if not raw:
        return 600.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from .errors import AtomValueError

        raise AtomValueError(f"ATOM_COMPILE_PEER_TIMEOUT: got {raw!r}; allowed: a positive number of seconds")
    return value


def group_compile() -> bool:
    """ATOM_COMPILE_GROUP_COMPILE=0 turns off the agreement over the process group (who
    compiles which piece); the ranks then coordinate through the cache directory's locks."""
    return _not_off("ATOM_COMPILE_GROUP_COMPILE")


def pdl() -> bool:
    """ATOM_COMPILE_PDL=0 launches our decode kernels without programmatic dependent launch
    (ops/pdl.py) on GPUs that have it; it changes when a kernel starts, never what it computes."""
    return _not_off("ATOM_COMPILE_PDL")


PREFETCH_KINDS = ("linear", "attention")


def prefetch(kind: str | None = None) -> bool:
    """ATOM_COMPILE_PREFETCH makes our decode kernels recorded in a CUDA graph with PDL read
    what the kernel before cannot write before waiting for it (ops/pdl.py prefetch): `1` for
    every kernel, or a comma list of kinds: `linear` (a projection's weight) and `attention`
    (the step's metadata and the first tile of cached keys). `kind` None: whether any kind is
    on. Off by default: on an H100 the decode step was 1-2% faster without the projections',
    and each prefetching twin costs a compile. It changes when a read happens, never what is
    computed."""
    raw = os.environ.get("ATOM_COMPILE_PREFETCH", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in _TRUE or raw == "all":
        return True
    kinds = {part.strip() for part in raw.split(",") if part.strip()}
    if not kinds <= set(PREFETCH_KINDS):
        from .errors import AtomValueError

        raise AtomValueError(f"ATOM_COMPILE_PREFETCH: got {raw!r}; allowed: 0, 1, or a comma list of "
                             f"{', '.join(PREFETCH_KINDS)}")
    return kind is None or kind in kinds


def split_k_rows() -> bool:
    """2-8 rows of a narrow projection run on our split-K dots where they time faster than the
    library GEMM (ops/triton_splitk.py); ATOM_COMPILE_SPLIT_K=0 keeps the library GEMM. On by
    default: on an H100 the decode step at batch 8 was 5-7% faster with it (BENCHMARKS.md). A
    runtime choice inside the op: no compiled code changes."""
    return _not_off("ATOM_COMPILE_SPLIT_K")


def group_owners() -> int | None:
    """ATOM_COMPILE_GROUP_OWNERS: at most this many ranks of a group compile the pieces they
    share; `auto` (the default) picks the count from the pieces' size, so a few small pieces
    go to one rank and many or large ones spread over all."""
    raw = os.environ.get("ATOM_COMPILE_GROUP_OWNERS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        from .errors import AtomValueError

        raise AtomValueError(f"ATOM_COMPILE_GROUP_OWNERS: got {raw!r}; allowed: 'auto' or a positive "
                             "number of ranks")
    return value


def cache_root(cache_dir: str = "") -> Path:
    """`cache_dir` if set, else $ATOM_COMPILE_CACHE_ROOT, else $XDG_CACHE_HOME/atom (~/.cache/atom)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    override = cache_root_override()
    if override:
        return Path(override).expanduser()
    return xdg_cache_home() / "atom"


def remote_cache() -> str | None:
    """ATOM_COMPILE_REMOTE_CACHE: the remote tier's URL (redis://host:port/db or an fsspec URL);
    CompilationConfig.remote_cache wins when set."""
    return os.environ.get("ATOM_COMPILE_REMOTE_CACHE", "").strip() or None


def remote_key() -> str | None:
    """ATOM_COMPILE_REMOTE_KEY: the secret that signs and verifies remote entries."""
    return os.environ.get("ATOM_COMPILE_REMOTE_KEY") or None


def remote_key_file() -> str | None:
    """ATOM_COMPILE_REMOTE_KEY_FILE: a private file (0600, the user's) holding that secret."""
    return os.environ.get("ATOM_COMPILE_REMOTE_KEY_FILE") or None


def compile_config() -> str | None:
    """ATOM_COMPILE_CONFIG: the CompilationConfig of `torch.compile(..., backend="atom")` when no
    options are given (options override it field by field): a JSON object of its fields, or the
    path of a JSON or YAML file holding one. Parsed and validated by backends/dynamo_entry.py."""
    return os.environ.get("ATOM_COMPILE_CONFIG", "").strip() or None


DEFAULT_REMOTE_TIMEOUT = 2.0
_warned_timeouts: set[str] = set()


def remote_timeout() -> float:
    """ATOM_COMPILE_REMOTE_TIMEOUT: seconds one remote operation may take (default 2)."""
    text = os.environ.get("ATOM_COMPILE_REMOTE_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_REMOTE_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 600:
        if text in _warned_timeouts:
            return DEFAULT_REMOTE_TIMEOUT
        _warned_timeouts.add(text)
        logger.warning("atom-compile: ATOM_COMPILE_REMOTE_TIMEOUT=%r is not a number of seconds in (0, 600]; "
                       "using %.0f s", text, DEFAULT_REMOTE_TIMEOUT)
        return DEFAULT_REMOTE_TIMEOUT
    return value


@dataclass(frozen=True)
class Environment:
    """The environment as one entry point read it. `cache_root` is None when the cache is
    disabled (ATOM_COMPILE_DISABLE_CACHE)."""

    cache_root: Path | None
    check_inputs: bool = True
    compile_disabled: bool = False
    require_cache: bool = False
    peer_timeout: float = 600.0
    group_compile: bool = True
    group_owners: int | None = None
    remote_cache: str | None = None
    remote_key: str | None = field(default=None, repr=False)
    remote_key_file: str | None = None
    remote_timeout: float = DEFAULT_REMOTE_TIMEOUT
    compile_config: str | None = None

    @property
    def cache_disabled(self) -> bool:
        return self.cache_root is None


def read(cache_dir: str = "") -> Environment:
    """Read every variable once; `cache_dir` (the config's) wins over the environment's root."""
    prefetch()  # launch-time switches are read at launch; a bad value fails here, at the entry point
    return Environment(
        cache_root=None if cache_disabled() else cache_root(cache_dir),
        check_inputs=check_inputs(),
        compile_disabled=compile_disabled(),
        require_cache=require_cache(),
        peer_timeout=peer_timeout(),
        group_compile=group_compile(),
        group_owners=group_owners(),
        remote_cache=remote_cache(),
        remote_key=remote_key(),
        remote_key_file=remote_key_file(),
        remote_timeout=remote_timeout(),
        compile_config=compile_config(),
    )
