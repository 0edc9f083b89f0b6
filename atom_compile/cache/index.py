"""The index document of one `<prefix>/` directory: its schema, bounded parsing, entry bindings.

    {"format": "atom-compile-index", "format_version": 1, "atom_compile_version": ...,
     "entries": [{"runtime_shape", "graph_index", "compiler", "content_key", "handle": {"path"},
                  "sha256", "binding", ...}],
     "dynamo_function": {"path", "sha256", "bytes"} | null,
     "inductor_files": {"<path under inductor/>": "<sha256>"}}

The index is read without executing anything (bounded JSON, see trust.loads_bounded). Each
entry carries a `binding`: a digest over its content key, shape, position, compiler and the
artifact it names, so an entry moved, swapped or edited by hand is damage, never a wrong piece.
`inductor_files` is the manifest of Inductor's own files for the pieces: each is checked
against it before Inductor may import anything from that directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from .._version import __version__
from ..errors import IndexInvalid
from .trust import loads_bounded

INDEX_FILE = "index.json"
INDEX_FORMAT = "atom-compile-index"
INDEX_VERSION = 1
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
# a compile range [lo, hi) stored as runtime_shape "lo-hi"
_RANGE_SHAPE = re.compile(r"^[1-9][0-9]*-[1-9][0-9]*$")


def check_rel_path(rel: Any) -> str:
    """`rel` if it is a relative path that stays inside the cache directory; else IndexInvalid."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise IndexInvalid(f"artifact path {rel!r} is not a path inside the cache")
    return rel


def entry_key(entry: dict) -> tuple:
    """(runtime_shape, graph_index, compiler): where an entry sits in the index."""
    return (entry.get("runtime_shape"), entry["graph_index"], entry["compiler"])


def entry_binding(entry: dict) -> str:
    """The digest that binds an entry's content key and shape to its position and artifact."""
    blob = json.dumps([entry.get("content_key"), entry.get("graph"), entry.get("runtime_shape"),
                       entry.get("graph_index"), entry.get("compiler"), (entry.get("handle") or {}).get("path"),
                       entry.get("sha256")])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def bind(entry: dict) -> dict:
    """`entry` with its binding set."""
    return dict(entry, binding=entry_binding(entry))


def _check_entry(raw: Any) -> dict:
    if not isinstance(raw, dict):
        raise IndexInvalid("an entry is not an object")
    shape = raw.get("runtime_shape")
    if isinstance(shape, str) and _RANGE_SHAPE.match(shape):
        shape = None  # a compile range, "lo-hi"
    if shape is not None and (isinstance(shape, bool) or not isinstance(shape, int) or shape <= 0):
        raise IndexInvalid(f"bad runtime_shape {shape!r}")
    index = raw.get("graph_index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise IndexInvalid(f"bad graph_index {index!r}")
    if not isinstance(raw.get("compiler"), str) or not isinstance(raw.get("content_key"), str):
        raise IndexInvalid("entry without compiler or content_key")
    handle = raw.get("handle")
    if not isinstance(handle, dict):
        raise IndexInvalid("entry without a handle")
    check_rel_path(handle.get("path"))
    if not isinstance(raw.get("sha256"), str) or not SHA_RE.match(raw["sha256"]):
        raise IndexInvalid(f"bad sha256 {raw.get('sha256')!r}")
    locator = raw.get("shape_locator")
    if locator is not None and not (isinstance(locator, list) and all(isinstance(x, int) for x in locator)):
        raise IndexInvalid(f"bad shape_locator {locator!r}")
    if raw.get("binding") != entry_binding(raw):
        raise IndexInvalid(f"the entry of piece {index} (shape {shape if shape is not None else 'general'}) "
                           "is not bound to its content key and shape (moved or edited)")
    return raw


def check_manifest_path(rel: Any) -> str:
    """A path under inductor/ as the manifest may name it (plain names, no dot-files, no '..')."""
    if not isinstance(rel, str) or not rel:
        raise IndexInvalid(f"inductor file {rel!r} is not a path")
    parts = PurePosixPath(rel).parts
    if rel.startswith("/") or not parts or any(p.startswith(".") or not _MANIFEST_NAME_RE.match(p) for p in parts):
        raise IndexInvalid(f"inductor file {rel!r} is not a plain path inside inductor/")
    return rel


def _check_manifest(raw: Any) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise IndexInvalid("inductor_files is not an object")
    for rel, digest in raw.items():
        check_manifest_path(rel)
        if not isinstance(digest, str) or not SHA_RE.match(digest):
            raise IndexInvalid(f"inductor file {rel!r}: bad sha256 {digest!r}")
    return raw


def parse_index(text: str) -> dict:
    """Validate an index document (size and nesting bounded first); raise IndexInvalid."""
    try:
        data = loads_bounded(text)
    except json.JSONDecodeError as exc:
        raise IndexInvalid(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:
        raise IndexInvalid(f"refused before parsing: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise IndexInvalid("not an atom-compile index")
    if data.get("format_version") != INDEX_VERSION:
        raise IndexInvalid(f"index format {data.get('format_version')!r}, this package reads {INDEX_VERSION}")
    if data.get("atom_compile_version") != __version__:
        raise IndexInvalid(
            f"written by atom-compile {data.get('atom_compile_version')!r}, this is {__version__}"
        )
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise IndexInvalid("no entries list")
    data["entries"] = [_check_entry(e) for e in entries]
    keys = [entry_key(e) for e in data["entries"]]
    if len(set(keys)) != len(keys):
        raise IndexInvalid("two entries for the same piece and shape")
    dynamo = data.get("dynamo_function")
    if dynamo is not None:
        if not isinstance(dynamo, dict) or not isinstance(dynamo.get("sha256"), str):
            raise IndexInvalid("bad dynamo_function record")
        check_rel_path(dynamo.get("path"))
    data["inductor_files"] = _check_manifest(data.get("inductor_files"))
    return data


def _entry_order(entry: dict) -> tuple:
    """graph_index, then general, sizes and ranges ("lo-hi", after the sizes) in order."""
    shape = entry.get("runtime_shape")
    if isinstance(shape, str):
        return (entry["graph_index"], 1, int(shape.split("-")[0]))
    return (entry["graph_index"], 0, shape or 0)


def new_document(current: dict, entries: list[dict], dynamo_function: Any, manifest: Any,
                 torch_version: Any, now: float) -> dict:
    """The next index document: `entries` (already merged), the rest carried over from `current`."""
    return {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "atom_compile_version": __version__,
        "created": current.get("created", now),
        "updated": now,
        "entries": sorted(entries, key=_entry_order),
        "dynamo_function": dynamo_function if dynamo_function is not None else current.get("dynamo_function"),
        "inductor_files": manifest if manifest is not None else current.get("inductor_files") or {},
        "torch_version": torch_version or current.get("torch_version"),
    }
