"""The one output formatter of the CLI: human text by default (aligned, concise, pip- and
ccache-like), JSON with `--json` (indent 2, sorted keys). Progress and errors go to stderr."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from typing import Any, Iterable, Optional, Sequence

from ..cache.inventory import format_size

PROG = "atom-compile-cache"
_PLAIN_KEY = re.compile(r"^[A-Za-z_][\w:]*$")
VALUE_WIDTH = 64  # the key-factors table wraps longer values, then cuts them with an ellipsis


def emit(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def lines(text_lines: Iterable[str]) -> None:
    print("\n".join(text_lines))


def note(message: str) -> None:
    """A remark for the user on stderr, prefixed like every line of ours there."""
    print(f"{PROG}: {message}", file=sys.stderr)


def plural(n: int, word: str, plural_word: Optional[str] = None) -> str:
    return f"{n} {word if n == 1 else plural_word or word + 's'}"


def size(n: float) -> str:
    return format_size(n)


def when(t: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def iso(t: Optional[float]) -> Optional[str]:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t)) if t else None


def shapes(values: Iterable[Optional[int]]) -> str:
    return ",".join("general" if s is None else str(s) for s in values) or "-"


def ellipsis(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "",
          right: Sequence[str] = ()) -> list[str]:
    """Columns as wide as their widest cell; the columns named in `right` are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if h in right else c.ljust(w) for c, w, h in zip(row, widths, headers)]
        return indent + "  ".join(parts).rstrip()

    return [line(headers), *(line(r) for r in cells)]


def fields(pairs: Sequence[tuple[str, str]], indent: str = "  ") -> list[str]:
    """`name  value` lines, names padded to the longest."""
    width = max((len(k) for k, _ in pairs), default=0)
    return [f"{indent}{k:<{width}}  {v}".rstrip() for k, v in pairs]


def wrapped_fields(pairs: Sequence[tuple[str, str]], indent: str = "  ", key_width: int = 32,
                   value_width: int = VALUE_WIDTH, max_lines: int = 2) -> list[str]:
    """Like fields(), for long keys and values: a key wider than `key_width` gets a line of its
    own; a value is wrapped at `value_width` over at most `max_lines`, then cut with an ellipsis."""
    width = min(key_width, max((len(k) for k, _ in pairs), default=0))
    out = []
    pad = indent + " " * (width + 2)
    for key, value in pairs:
        chunks = [value[i:i + value_width] for i in range(0, len(value), value_width)] or [""]
        if len(chunks) > max_lines:
            chunks = chunks[:max_lines]
            chunks[-1] = ellipsis(chunks[-1] + "..", value_width)
        if len(key) > width:
            out.append(f"{indent}{ellipsis(key, width + 2 + value_width)}")
            out.extend(f"{pad}{c}" for c in chunks)
            continue
        out.append(f"{indent}{key:<{width}}  {chunks[0]}".rstrip())
        out.extend(f"{pad}{c}" for c in chunks[1:])
    return out


def factor_summary(factors: Optional[dict]) -> str:
    """One line of what a cache was compiled for: level, compiler, sizes, device, sources."""
    if not factors:
        return "key factors unreadable"
    cfg, env = factors.get("config") or {}, factors.get("environment") or {}
    device = " ".join(str(x) for x in (env.get("device_type"), env.get("device"), env.get("cpu_capability")) if x)
    parts = [
        f"level {cfg.get('level', '?')}",
        str(env.get("compiler") or cfg.get("compiler") or "?"),
        f"compile sizes {cfg.get('compile_sizes') or []}",
        *([f"compile ranges {cfg['compile_ranges']}"] if cfg.get("compile_ranges") else []),
        *([f"Inductor graph partition ({plural((factors.get('graph') or {}).get('inductor_partitions', 0), 'partition')}"
           " in 1 graph)"] if cfg.get("use_inductor_graph_partition") else []),
        device or "device ?",
        plural(len(((factors.get("code") or {}).get("files") or {})), "source file"),
        plural(len(factors.get("custom_ops") or {}), "custom op"),
    ]
    return ", ".join(parts)


def _key(name: str) -> str:
    """`.name` for a plain key, `[name]` for one with dots or slashes (a path, an Inductor option)."""
    return f".{name}" if _PLAIN_KEY.match(name) else f"[{name}]"


def flatten_factors(value: Any, prefix: str = "", collapse: int = 20) -> list[tuple[str, str]]:
    """(dotted name, value) pairs; a dict with more than `collapse` keys becomes one summary line."""
    if isinstance(value, dict) and value:
        if len(value) > collapse:
            digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
            return [(prefix, f"{len(value)} settings (sha256 {digest[:12]}; --json lists them)")]
        out = []
        for k in sorted(value, key=str):
            name = f"{prefix}{_key(str(k))}" if prefix else str(k)
            out.extend(flatten_factors(value[k], name, collapse))
        return out
    return [(prefix, value if isinstance(value, str) else json.dumps(value, default=str))]


def cache_size(info: Any) -> str:
    """'1.8 MiB (artifacts 148.0 KiB, Inductor files 1.7 MiB)': what a size includes."""
    text = f"{size(info.bytes)} (artifacts {size(info.cache_bytes)}"
    return text + (f", Inductor files {size(info.scratch_bytes)})" if info.scratch_bytes else ", no Inductor files)")


def contents(info: Any) -> str:
    """'3 artifacts, 1 Dynamo function': the counts inspect, verify and export share."""
    return f"{plural(info.artifacts, 'artifact')}, {plural(info.dynamo_functions, 'Dynamo function')}"
