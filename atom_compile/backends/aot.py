"""Save and load a whole Dynamo-compiled function: the warm start that skips Dynamo too.

Where the installed torch can save a Dynamo function (`aot_compile` and
`torch.compiler.load_compiled_function`, torch >= 2.10), the decorator saves the compiled
forward as `dynamo_function.bin` beside the pieces, and records an entry point

    <root>/torch_compile_cache/entrypoints/<key>.json  ->  {"hash": ..., "files": {path: sha256}}

keyed by what is known before tracing (config, environment, model class, prefix, rank). A warm
start re-hashes the recorded source files; if the hash they give still names the cache, the
function loads and its pieces load by index: neither Dynamo nor Inductor runs. Any mismatch
or damage falls back to tracing, which then rewrites the entry point.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..cache.keys import build_factors, compute_hash, diff_factors, module_fingerprint, sha256_bytes, sha256_file
from ..cache import trust
from ..cache.remote import RemoteTier
from ..cache.remote_entrypoints import publish_entrypoint, pull_entrypoint
from ..cache.files import atomic_write
from ..cache.store import FACTORS_FILE, HASH_RE, PieceCache, caches_dir, current_rank, damage
from .. import groups
from ..config import CompilationConfig
from ..counters import compilation_counter
from ..errors import CacheMiss
from .compiled_function import loading_from

logger = logging.getLogger("atom_compile")

FUNCTION_FILE = "dynamo_function.bin"
ENTRYPOINTS = "entrypoints"


def supported() -> bool:
    """Whether this torch can save and load a Dynamo-compiled function."""
    return hasattr(torch.compiler, "load_compiled_function") and _has_aot_compile() \
        and hasattr(torch._dynamo.config, "enable_aot_compile")


def _has_aot_compile() -> bool:
    try:
        from torch._dynamo import aot_compile  # noqa: F401
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
    except ImportError:
        return False
    return True


def entrypoint_key(cc: CompilationConfig, compiler_factors: dict, device_type: str,
                   model: torch.nn.Module, args: tuple, prefix: str) -> str:
    """Everything known before tracing that decides the traced graph: config, environment,
    the model's structure (module_fingerprint) and the first call's input metadata."""
    pre = build_factors(cc, compiler_factors, device_type, (), ())
    blob = json.dumps({
        "config": pre["config"], "environment": pre["environment"],
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "structure": module_fingerprint(model), "inputs": _call_signature(args),
        "prefix": prefix, "rank": current_rank(),
    }, sort_keys=True, default=repr)
    return sha256_bytes(blob.encode())[:32]


def _call_signature(args: tuple) -> list[str]:
    """The first call's inputs without their dynamic sizes (any batch size finds the entry)."""
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            dynamic = getattr(x, "_dynamo_dynamic_indices", set())
            dims = ["*" if d in dynamic else str(n) for d, n in enumerate(x.shape)]
            out.append(f"T[{','.join(dims)}]{x.dtype}{x.device.type}")
        else:
            out.append(f"{type(x).__name__}")
    return out


def _entry_path(root: Path, key: str) -> Path:
    return caches_dir(root) / ENTRYPOINTS / f"{key}.json"


def try_load(cc: CompilationConfig, compiler_factors: dict, device_type: str, prefix: str,
             model: torch.nn.Module, args: tuple, f_globals: dict, root: Optional[Path],
             require_cache: bool = False, tier: Optional[RemoteTier] = None) -> tuple[Optional[Callable], str]:
    """The saved forward (a plain function taking `self` first), or None to trace instead, and
    why not (strict mode names it). `root` is the cache root the entry point resolved (None:
    the cache is disabled); `tier`, the remote tier asked when the entry point is not on local disk."""
    if root is None:
        return None, "the cache is disabled (ATOM_COMPILE_DISABLE_CACHE)"
    start = time.perf_counter()
    key = entrypoint_key(cc, compiler_factors, device_type, model, args, prefix)
    path = _entry_path(root, key)
    if tier is not None and not os.path.lexists(path):
        pull_entrypoint(tier, root, key, path, current_rank())
    entry = _read_entry_point(root, path)
    if entry is None:
        return None, (f"no saved forward for this config, model and call signature ({path.name} under "
                      f"{path.parent}); the warm-up ran with other compile settings or input shapes")
    files, op_names, recorded_hash, graph = entry
    changed = [p for p, digest in files.items() if sha256_file(p) != digest]
    if changed:
        logger.info("atom-compile: traced sources changed since the last compile (%s); tracing again",
                    ", ".join(changed[:3]))
        return None, f"traced sources changed since the warm-up: {', '.join(changed[:3])}"
    factors = build_factors(cc, compiler_factors, device_type, files, op_names, graph)
    if compute_hash(factors) != recorded_hash:
        logger.info("atom-compile: the cache key changed since the last compile; tracing again")
        return None, _key_change(root, recorded_hash, factors)
    cache = PieceCache.open(root, recorded_hash, current_rank(), prefix)
    if cache is None:
        return None, f"cache {recorded_hash} cannot be opened (see the warning above)"
    cache.write_factors(factors)  # checked (and repaired) as the tracing path does
    record = cache.read_index().get("dynamo_function")
    if not record:
        return None, f"cache {recorded_hash} holds no saved Dynamo function"
    target = cache.artifact_path(record["path"])
    try:
        data = cache.read_artifact(record["path"], record["sha256"])
    except (OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, trust.Untrusted) else \
            "the file is missing" if isinstance(exc, FileNotFoundError) else str(exc)
        damage(target, reason, "tracing again.")
        return None, f"the saved Dynamo function {target} is damaged: {reason}"
    try:
        with loading_from(root, require_cache):
            loaded = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals,
                                                           external_data={"model": model})
    except Exception as exc:
        cause = _cache_miss_in(exc)
        if cause is not None:  # a piece is missing or damaged: named where it was found
            logger.info("atom-compile: the saved Dynamo function %s cannot load its pieces (%s); tracing again",
                        target, cause)
            return None, f"the saved Dynamo function cannot load its pieces ({cause})"
        damage(target, f"it does not load ({type(exc).__name__}: {str(exc)[:200]})", "tracing again.")
        return None, f"the saved Dynamo function {target} does not load ({type(exc).__name__})"
    cache.touch_last_used()
    compilation_counter.num_dynamo_functions_loaded += 1
    logger.info("atom-compile: warm start of %s from %s in %.2fs: saved Dynamo function and pieces "
                "loaded, neither Dynamo nor Inductor ran", prefix, cache.path, time.perf_counter() - start)
    return loaded.fn, ""


def agree_to_load(fn: Optional[Callable], missed: str, environment: Any) -> tuple[Optional[Callable], str]:
    """`try_load`'s answer, kept only if every rank of the compile group loaded its forward too:
    a rank that traces meets its peers in the agreement's exchange, so a loaded rank traces with
    it (its pieces then load from its own cache) rather than run ahead into the model's
    collectives. One exchange, on every rank that reaches here with the cache on."""
    if environment.cache_root is None:
        return fn, missed
    peers = groups.ranks_without(fn is not None, environment.group_compile, environment.peer_timeout)
    if fn is None or not peers:
        return fn, missed
    compilation_counter.num_dynamo_functions_set_aside += 1
    logger.info("atom-compile: rank(s) %s of the compile group have no saved forward; this rank traces "
                "with them (its pieces load from its cache)", peers)
    return None, f"rank(s) {peers} of the compile group have no saved forward (every rank traces with them)"


def _key_change(root: Path, recorded_hash: str, factors: dict) -> str:
    """The factors that differ from those the saved forward's cache was keyed with."""
    try:
        old = json.loads((caches_dir(root) / recorded_hash / FACTORS_FILE).read_text())
    except (OSError, ValueError):
        return f"the cache key changed since the warm-up (cache {recorded_hash} has no readable key factors)"
    differences = diff_factors(old, factors)
    return "the cache key changed since the warm-up: " + ("; ".join(differences[:3]) or "no factor named")


def _read_entry_point(root: Path, path: Path) -> Optional[tuple[dict, list, str, Any]]:
    """(files, custom ops, hash, graph digest) of an entry point read through the trust checks;
    None if absent, or damaged (named once)."""
    if not os.path.lexists(path):
        return None
    try:
        entry = trust.loads_bounded(trust.read_bytes(root, path, trust.MAX_JSON_BYTES).decode())
        if not HASH_RE.match(str(entry["hash"])):
            raise ValueError(f"no cache hash in it ({str(entry['hash'])[:40]!r})")
        return dict(entry["files"]), list(entry["custom_ops"]), str(entry["hash"]), entry["graph"]
    except FileNotFoundError:
        return None
    except trust.Untrusted as exc:
        damage(path, exc.reason, "tracing again (the entry point is rewritten).")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        damage(path, f"damaged entry point ({type(exc).__name__}: {exc})", "tracing again (it is rewritten).")
    return None


def _cache_miss_in(exc: BaseException) -> Optional[BaseException]:
    return trust.exception_in(exc, CacheMiss)


def _every_piece_saved(result: Any) -> bool:
    """Whether every compiled piece has a saved general-shape entry (else the saved function
    could never load its pieces, and every later start would warn)."""
    manager = result.manager
    pieces = [item for item in result.items if not item.is_splitting_graph] if result.items else [None]
    return all((None, index, manager.compiler.name) in manager.entries for index in range(len(pieces)))


def save(compiled: Any, result: Any, cc: CompilationConfig, compiler_factors: dict, device_type: str,
         prefix: str, model: torch.nn.Module, args: tuple) -> bool:
    """Save the AOT-compiled function beside its pieces (`result`: the backend's CompileResult)
    and point the entry point at it."""
    cache: Optional[PieceCache] = result.cache
    if cache is None or not cache.writable or result.manager is None:
        return False
    if not _every_piece_saved(result):
        logger.info("atom-compile: not saving the Dynamo function: some pieces are not in the cache "
                    "(compiler %s); the next start traces again", result.manager.compiler.name)
        return False
    target = cache.path / FUNCTION_FILE
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=str(cache.path))
        os.close(fd)
        try:
            compiled.save_compiled_function(tmp, external_data={"model": model})
            os.chmod(tmp, trust.FILE_MODE)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        cache.write_failed(target, exc)
        return False
    except Exception as exc:  # torch could not serialise something in this function
        logger.info("atom-compile: the Dynamo function cannot be saved (%s: %s); the next start traces again",
                    type(exc).__name__, str(exc)[:200])
        return False
    digest = sha256_file(str(target))
    result.manager.flush(dynamo_function={"path": FUNCTION_FILE, "sha256": digest,
                                           "bytes": target.stat().st_size})
    entry = {
        "hash": result.cache_hash,
        "prefix": prefix,
        "files": result.factors["code"]["files"],
        "custom_ops": sorted(result.factors["custom_ops"]),
        "graph": result.factors["graph"]["sha256"],
    }
    path = _entry_path(cache.root, entrypoint_key(cc, compiler_factors, device_type, model, args, prefix))
    try:
        trust.make_private_dir(path.parent)
        if trust.path_problem(cache.root, path.parent) is not None:
            raise PermissionError(f"{path.parent}: {trust.path_problem(cache.root, path.parent)}")
        trust.unlink_in(cache.root, path)
        atomic_write(path, (json.dumps(entry, indent=1, sort_keys=True) + "\n").encode())
    except OSError as exc:
        cache.write_failed(path, exc)
        return False
    if result.remote is not None:
        publish_entrypoint(result.remote, path.stem, json.dumps(entry, indent=1, sort_keys=True) + "\n")
    compilation_counter.num_dynamo_functions_saved += 1
    return True
