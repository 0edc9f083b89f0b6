"""Cache keys: the factors that decide `<hash>`, the content key of a piece, and their diff.

`<hash>` covers the compile-relevant config fields, the content of every source file Dynamo
traced, the source of the custom ops the graph calls, and the compiler environment. Paths,
ports, pids, timings and ranks never enter it, so a cache hits after a restart, a move or a
copy to an identical machine. The factors are written beside the artifacts
(`cache_key_factors.json`) so that a miss can be explained factor by factor.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import platform
import sys
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from .._version import __version__
from ..config import CompilationConfig
from ..custom_ops import registered_op
from .files import sha256_file

logger = logging.getLogger("atom_compile")

# Factor groups that enter the hash. "code.files" enters as the sorted set of digests only.
HASHED_GROUPS = ("config", "environment", "code", "custom_ops", "graph")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in C order, in native byte order; torch only (no numpy)."""
    data = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    size = data.numel() * data.element_size()
    # A contiguous CPU tensor's elements are `size` bytes from data_ptr() (storage offset
    # included); this also covers a 0-dim tensor and dtypes numpy lacks (bfloat16, float8).
    return ctypes.string_at(data.data_ptr(), size) if size else b""


def environment_factors(compiler_factors: dict[str, Any], device_type: str) -> dict[str, Any]:
    """Versions and the device: what makes compiled code valid on this machine."""
    try:
        import triton  # noqa: F401

        triton_version = getattr(triton, "__version__", "unknown")
    except Exception as exc:  # absent, or broken on this machine: no triton factor
        logger.debug("atom-compile: triton not importable (%s: %s)", type(exc).__name__, exc)
        triton_version = None
    device = platform.machine()
    if device_type == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device())
    return {
        "atom_compile": __version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "device_type": device_type,
        "device": device,
        **compiler_factors,
    }


def code_factors(files: Iterable[str]) -> dict[str, Any]:
    """{path: sha256} of every traced source file; unreadable ones (e.g. '<string>') map to None."""
    return {"files": {path: sha256_file(path) for path in sorted(set(files))}}


def custom_op_names(graph: fx.GraphModule) -> list[str]:
    """Non-aten ops that `graph` calls ("ns::op"), in sorted order."""
    names = set()
    for node in graph.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            qualname = target._schema.name if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
            if qualname.split("::")[0] not in ("aten", "prims", "_c10d_functional", "higher_order"):
                names.add(qualname)
    return sorted(names)


def custom_op_factors(names: Iterable[str]) -> dict[str, Optional[str]]:
    """Digest of each custom op's Python implementation and fake (None: not registered by us)."""
    out: dict[str, Optional[str]] = {}
    for name in names:
        op = registered_op(name)
        out[name] = sha256_bytes(op.source_digest_material().encode()) if op is not None else None
    return out


def build_factors(
    cfg: CompilationConfig,
    compiler_factors: dict[str, Any],
    device_type: str,
    traced_files: Iterable[str],
    op_names: Iterable[str],
    graph: Optional[str] = None,
) -> dict[str, Any]:
    """All factors of `<hash>`. `graph` (a graph_digest()) ties the cache to the traced
    graph itself: the model's structure and input shapes, which no source file reveals."""
    return {
        "config": cfg.hash_factors(),
        "environment": environment_factors(compiler_factors, device_type),
        "code": code_factors(traced_files),
        "custom_ops": custom_op_factors(op_names),
        "graph": {"sha256": graph},
    }


def graph_digest(gm: fx.GraphModule, example_inputs: Iterable[Any]) -> str:
    """Digest of the traced graph's computation and input metadata (names excluded)."""
    blob = graph_fingerprint(gm) + "\n" + "\n".join(describe_inputs(example_inputs))
    return sha256_bytes(blob.encode())


_SIMPLE = (int, float, bool, str, type(None))


def _simple(value: Any) -> bool:
    if isinstance(value, _SIMPLE) or isinstance(value, torch.dtype):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return all(_simple(v) for v in value)
    return False


def module_fingerprint(module: torch.nn.Module) -> str:
    """What decides the graph Dynamo would trace from `module`, known before tracing: every
    submodule's type, its plain attributes (sizes, eps, names) and its tensors' metadata."""
    lines = []
    for name, sub in module.named_modules(remove_duplicate=False):
        attrs = {k: repr(v) for k, v in sorted(vars(sub).items())
                 if not k.startswith("_") and k != "training" and _simple(v)}
        lines.append(f"{name}:{type(sub).__module__}.{type(sub).__qualname__}:{json.dumps(attrs, sort_keys=True)}")
        for pname, p in list(sub._parameters.items()) + list(sub._buffers.items()):
            if p is not None:
                lines.append(f"{name}.{pname}:{tuple(p.shape)}:{p.dtype}:{p.device.type}:{p.requires_grad}")
    return sha256_bytes("\n".join(lines).encode())


def _hash_view(factors: dict[str, Any]) -> dict[str, Any]:
    view = {group: factors.get(group) for group in HASHED_GROUPS}
    files = (view.get("code") or {}).get("files") or {}
    # Content, not location: the same sources installed elsewhere give the same hash.
    view["code"] = sorted(d for d in files.values() if d is not None)
    return view


def compute_hash(factors: dict[str, Any]) -> str:
    blob = json.dumps(_hash_view(factors), sort_keys=True, default=repr).encode()
    return sha256_bytes(blob)[:16]


def diff_factors(old: dict[str, Any], new: dict[str, Any], names: Optional[tuple[str, str]] = None) -> list[str]:
    """Human-readable differences between two factor sets (old: on disk, new: now), or between
    two named ones (`names`, e.g. two caches or two machines)."""
    lines: list[str] = []
    a_name, b_name = names or ("", "")

    def value_pair(a: Any, b: Any) -> str:
        if names:
            return f"{a_name} {_short(a)}, {b_name} {_short(b)}"
        return f"{_short(a)} in the cache, now {_short(b)}"

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b), key=str):
                sub = f"{path}.{key}" if path else str(key)
                if key not in a:
                    lines.append(f"{sub}: absent in {a_name}, {b_name} {_short(b[key])}" if names
                                 else f"{sub}: not in the cache, now {_short(b[key])}")
                elif key not in b:
                    lines.append(f"{sub}: {a_name} {_short(a[key])}, absent in {b_name}" if names
                                 else f"{sub}: {_short(a[key])} in the cache, absent now")
                else:
                    walk(a[key], b[key], sub)
        elif a != b:
            lines.append(f"{path}: {value_pair(a, b)}")

    for group in HASHED_GROUPS:
        if group == "graph":
            if (old.get("graph") or {}) != (new.get("graph") or {}):
                lines.append("graph: the traced graph differs (model structure, sizes or input shapes changed)")
            continue
        if group == "code":
            lines += _code_differences(old, new, names)
            continue
        walk(old.get(group), new.get(group), group)
    return lines


def _code_differences(old: dict[str, Any], new: dict[str, Any], names: Optional[tuple[str, str]]) -> list[str]:
    """Traced sources by content: a file whose digest is only on one side, named by path."""
    lines = []
    old_files = (old.get("code") or {}).get("files") or {}
    new_files = (new.get("code") or {}).get("files") or {}
    old_by_digest = {d: p for p, d in old_files.items()}
    new_by_digest = {d: p for p, d in new_files.items()}
    for digest in sorted(set(old_by_digest) - set(new_by_digest), key=str):
        path = old_by_digest[digest]
        if names:
            lines.append(f"code.files: {path} differs (sha256 {str(digest)[:12]} in {names[0]})")
            continue
        state = "changed" if new_files.get(path) is not None else "not traced now"
        lines.append(f"code.files: {path} {state} (sha256 {str(digest)[:12]} in the cache)")
    for digest in sorted(set(new_by_digest) - set(old_by_digest), key=str):
        path = new_by_digest[digest]
        if path not in old_files:
            where = f"in {names[1]} only" if names else "is traced now but not in the cache"
            lines.append(f"code.files: {path} {where}")
    return lines


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


# --- content keys of pieces ----------------------------------------------------------------


def _describe_value(value: Any, names: dict[fx.Node, str]) -> str:
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe_value(v, names) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner},)"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe_value(v, names)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, slice):
        return f"slice({_describe_value(value.start, names)}, {_describe_value(value.stop, names)}, {_describe_value(value.step, names)})"
    if isinstance(value, torch.Tensor):
        return f"tensor({_tensor_meta(value)})"
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    return repr(value)


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}"


def _tensor_meta(t: torch.Tensor) -> str:
    return f"{tuple(str(s) for s in t.shape)}|{tuple(str(s) for s in t.stride())}|{t.dtype}|{t.device.type}|{t.requires_grad}"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """The piece's computation with every name replaced by its position.

    The pieces of different decoder layers are the same computation under different names (their
    placeholders carry each layer's parameter path), so names must not enter the content key.
    """
    names: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"v{i}"
        if node.op == "placeholder":
            lines.append(f"v{i} = placeholder")
            continue
        if node.op == "get_attr":
            attr = gm
            for part in str(node.target).split("."):
                attr = getattr(attr, part)
            if isinstance(attr, torch.Tensor):
                digest = sha256_bytes(_tensor_bytes(attr)) if attr.numel() else "empty"
                lines.append(f"v{i} = get_attr tensor({_tensor_meta(attr)}|{digest})")
            elif isinstance(attr, fx.GraphModule):
                lines.append(f"v{i} = get_attr module[{graph_fingerprint(attr)}]")
            else:
                lines.append(f"v{i} = get_attr {type(attr).__name__}")
            continue
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            body = graph_fingerprint(sub) if isinstance(sub, fx.GraphModule) else type(sub).__qualname__
            target = f"module[{body}]"
        else:
            target = _target_name(node.target)
        args = _describe_value(node.args, names)
        kwargs = _describe_value(node.kwargs, names)
        lines.append(f"v{i} = {node.op} {target} {args} {kwargs}")
    return "\n".join(lines)


def describe_inputs(example_inputs: Iterable[Any]) -> list[str]:
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            out.append(f"T{_tensor_meta(x)}")
        elif isinstance(x, torch.SymInt):
            out.append(f"S{x}")
        else:
            out.append(f"V{type(x).__name__}:{x!r}")
    return out


def content_key(
    gm: fx.GraphModule,
    example_inputs: Iterable[Any],
    runtime_shape: Optional[int],
    compiler_name: str,
    compiler_config: dict[str, Any],
) -> str:
    """Equal for two pieces whose code, input metadata, runtime shape and compiler are equal."""
    blob = json.dumps(
        {
            "graph": graph_fingerprint(gm),
            "inputs": describe_inputs(example_inputs),
            "runtime_shape": runtime_shape,
            "compiler": compiler_name,
            "compiler_config": {str(k): repr(v) for k, v in sorted(compiler_config.items())},
        },
        sort_keys=True,
    ).encode()
    return sha256_bytes(blob)[:32]
