"""CompilerManager: compile-or-load of the pieces of one graph, with content dedup.

With a `SharedPieces` (the ranks of a group on one cache root), a piece that no local entry
holds is compiled under its content key's shared lock: one rank compiles and publishes it,
the others wait on the lock and load it (cache/shared.py says how a dead owner is passed).

Index entries are keyed by `(runtime_shape, graph_index, compiler)` and name an artifact file
by its own sha256 (`artifacts/<digest>.bin`), so concurrent writers never disagree about a
file's bytes. Pieces are also keyed by content: the N identical layers of a decoder are
compiled once, and every later piece with the same content reuses that compiled code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch.fx as fx

from . import kernel_files
from .base import CompilerInterface
from ..counters import compilation_counter
from ..cache.keys import content_key, graph_fingerprint, sha256_bytes, sha256_file
from ..cache import run_stats
from ..cache.shared import SharedPieces
from ..cache.store import PieceCache, damage, entry_key
from ..cache.scratch import isa_probe_dir
from ..cache.trust import make_private_dir, os_error_in, private_umask

logger = logging.getLogger("atom_compile")


def _graph_digest(graph: fx.GraphModule) -> str:
    return sha256_bytes(graph_fingerprint(graph).encode())[:32]


class CompilerManager:
    """Compile-or-load for one backend instance (one traced graph)."""

    def __init__(self, compiler: CompilerInterface, cache: Optional[PieceCache], compiler_config: dict[str, Any],
                 shared: Optional[SharedPieces] = None):
        self.compiler = compiler
        self.cache = cache
        self.shared = shared if cache is not None else None
        self.compiler_config = dict(compiler_config or {})
        compiler.initialize_cache(str(cache.path) if cache is not None else None, disable_cache=cache is None)
        index = cache.read_index() if cache is not None else {"entries": []}
        if cache is not None and cache.writable:
            run_stats.register(cache.path)  # where the run's after-warm-up Triton compiles are reported
        self.entries: dict[tuple, dict] = {entry_key(e): e for e in index.get("entries", [])}
        self.dynamo_function: Optional[dict] = index.get("dynamo_function")
        self.inductor_files: dict[str, str] = dict(index.get("inductor_files") or {})
        self._by_content: dict[str, tuple[Callable, Optional[dict]]] = {}
        self._loaded: dict[str, Callable] = {}
        self._pending: list[dict] = []
        self._remove: list[tuple] = []
        self.compile_seconds = 0.0
        self.load_seconds = 0.0
        self._scratch_checked = False
        self._scratch_used = False
        self._private_scratch: Optional[str] = None
        # called with (graph_index, runtime_shape) before a piece really compiles (strict mode raises)
        self.before_compile: Optional[Callable[[int, Optional[int]], None]] = None
        self.on_commit: Optional[Callable[[], Any]] = None  # called after each index write (publishing)
        self._unannounced = False  # an index write on_commit has not been called for
        # commit after each piece compiled under its shared lock (off during a group's shares)
        self.commit_on_release = True

    @property
    def can_write(self) -> bool:
        return self.cache is not None and self.cache.writable

    def _scratch_dir(self) -> Optional[str]:
        """Our directory for Inductor's files, checked against the index's manifest before
        Inductor may import anything from it, after one test write there (a read-only or full
        disk is found here, before Inductor's own probes fail quietly inside it). Damage is
        repaired into a fresh directory; one we must not touch is never used."""
        if not self.can_write:
            return None
        if self._private_scratch is not None:
            return self._private_scratch
        directory = self.cache.scratch_path
        if not self._scratch_checked:
            try:
                self._check_scratch()
                if self._private_scratch is not None:
                    return self._private_scratch
                fd, probe = tempfile.mkstemp(prefix=".probe-", dir=str(directory))
                os.write(fd, b"ok")
                os.close(fd)
                os.unlink(probe)
            except OSError as exc:
                self.cache.write_failed(directory, exc)
                return None
            self._scratch_checked = True
            kernel_files.attach(self, str(directory))
        return str(directory)

    def _check_scratch(self) -> None:
        directory = self.cache.scratch_path
        if not os.path.lexists(directory):
            make_private_dir(directory)
            return
        problem = self.cache.scratch_problem(self.inductor_files)
        if problem is None:
            return
        try:
            st = os.lstat(directory)
            if os.path.islink(directory) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
                raise PermissionError(f"{directory} is not ours to repair")
            kept = self.cache.fresh_scratch(self.inductor_files)
        except OSError as exc:
            damage(directory, problem, "compiling in memory: Inductor's files go to a private temp "
                   f"directory and nothing is saved ({exc}).")
            self._private_scratch = tempfile.mkdtemp(prefix="atom-inductor-")
            self.cache.writable = False
            return
        damage(directory, problem, "repairing it: a fresh directory with the files that pass their "
               "digests; Inductor rebuilds the rest.")
        self.inductor_files = kept
        self._scratch_used = True

    def _with_scratch(self, call: Callable[[], Any]) -> Any:
        """Run a compile or load with Inductor's own files (the CPU libraries an artifact names)
        beside our artifacts, under umask 077. If writing there fails (a read-only or full disk
        that we learn of only now), say so once and run again with Inductor's default place."""
        self.compiler.inductor_dir = self._scratch_dir()
        self.compiler.isa_dir = None
        if self.compiler.inductor_dir is None:
            return call()
        self.compiler.isa_dir = isa_probe_dir(self.cache.root, self.cache.isa_probe_path)
        self._scratch_used = True
        try:
            with private_umask():
                return call()
        except Exception as exc:
            error = os_error_in(exc)
            if error is None:
                raise
            self.cache.write_failed(self.cache.scratch_path, error)
            self.compiler.inductor_dir = None
            return call()
        finally:
            self.compiler.inductor_dir = None

    # --- the one entry point ---------------------------------------------------------------

    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        runtime_shape: Optional[int] = None,
        shape_locator: Optional[list[int]] = None,
    ) -> Callable:
        """The compiled piece: loaded from the cache, reused from an identical piece, or compiled."""
        if runtime_shape is None:
            compilation_counter.num_backend_compilations += 1
        else:
            compilation_counter.num_concrete_compilations += 1
        key = (runtime_shape, graph_index, self.compiler.name)
        ck = content_key(graph, example_inputs, runtime_shape, self.compiler.name, self.compiler_config)
        entry = self._bound_entry(key, ck)
        if entry is not None:
            fn = self._load(entry, graph, example_inputs, graph_index, runtime_shape)
            if fn is not None:
                return fn

        if ck in self._by_content:
            fn, proto = self._by_content[ck]
            compilation_counter.num_deduplicated_pieces += 1
            if proto is not None:
                self._record(proto, graph_index, runtime_shape, shape_locator)
            return fn
        same = next((e for e in self.entries.values()
                     if e["content_key"] == ck and e["compiler"] == self.compiler.name), None)
        if same is not None:
            fn = self._load(same, graph, example_inputs, graph_index, runtime_shape)
            if fn is not None:
                self._record(same, graph_index, runtime_shape, shape_locator)
                return fn

        if self.shared is not None:
            # a published piece loads without its lock: N loaders of one piece would otherwise
            # take turns, each waiting out the others' loads
            fn = self._from_peer(ck, graph, example_inputs, graph_index, runtime_shape, shape_locator)
            if fn is not None:
                return fn
        with self._claim(ck) as owned:
            if owned:
                fn = self._from_peer(ck, graph, example_inputs, graph_index, runtime_shape, shape_locator)
                if fn is not None:
                    return fn
            fn, entry = self._compile_new(graph, example_inputs, graph_index, runtime_shape, shape_locator,
                                          key, ck)
            if owned and entry is not None:
                if self.commit_on_release and entry["handle"].get("device", "cpu") == "cpu":
                    # committed before the record is published: whoever sees the record links the
                    # C++ libraries our index lists (SharedPieces.borrow_libraries) instead of
                    # building them (each commit hashes Inductor's directory, hence off while no
                    # one waits)
                    self.flush(announce=False)
                self.shared.publish(entry)
        return fn

    def content_key_of(self, graph: fx.GraphModule, example_inputs: list[Any],
                       runtime_shape: Optional[int] = None) -> str:
        """The content key `compile` files this piece under (what the ranks of a group exchange)."""
        return content_key(graph, example_inputs, runtime_shape, self.compiler.name, self.compiler_config)

    def _claim(self, ck: str) -> Any:
        """The shared lock of a content key (the peers' agreement on who compiles it)."""
        return self.shared.claim(ck) if self.shared is not None else contextlib.nullcontext(False)

    def _from_peer(self, ck: str, graph: fx.GraphModule, example_inputs: list[Any], graph_index: int,
                   runtime_shape: Optional[int], shape_locator: Optional[list[int]]) -> Optional[Callable]:
        """The piece a peer rank compiled (and published) while we waited, loaded; else None."""
        record = self.shared.lookup(ck)
        if record is None or record["compiler"] != self.compiler.name:
            return None
        entry = self.shared.adopt(record)
        if entry is None:
            return None
        scratch = self._scratch_dir() if entry["handle"].get("device", "cpu") == "cpu" else None
        if scratch is not None and self.shared.borrow_libraries(Path(scratch)):
            self._scratch_used = True  # the next commit records the linked libraries
        fn = self._load(entry, graph, example_inputs, graph_index, runtime_shape)
        if fn is not None:
            compilation_counter.num_peer_pieces_loaded += 1
            self._record(entry, graph_index, runtime_shape, shape_locator)
        return fn

    def _compile_new(self, graph: fx.GraphModule, example_inputs: list[Any], graph_index: int,
                     runtime_shape: Optional[int], shape_locator: Optional[list[int]], key: tuple,
                     ck: str) -> tuple[Callable, Optional[dict]]:
        if self.before_compile is not None:
            self.before_compile(graph_index, runtime_shape)
        start = time.perf_counter()

        def compile_piece() -> tuple[Callable, Optional[dict]]:
            staging = f"staging-{uuid.uuid4().hex}" if self.can_write else None
            return self.compiler.compile(graph, example_inputs, self.compiler_config, runtime_shape, key=staging)

        fn, handle = self._with_scratch(compile_piece) if self.cache is not None else compile_piece()
        self.compile_seconds += time.perf_counter() - start
        if self.compiler.last_save_error is not None and self.cache is not None:
            self.cache.write_failed(self.cache.path, self.compiler.last_save_error)
            self.compiler.last_save_error = None
        entry = self._publish(handle, ck, graph) if handle is not None else None
        if entry is not None:
            self._record(entry, graph_index, runtime_shape, shape_locator)
        self._by_content[ck] = (fn, entry)
        logger.debug("atom-compile: compiled piece %d (shape %s) in %.2fs", graph_index,
                     runtime_shape if runtime_shape is not None else "general", time.perf_counter() - start)
        return fn, entry

    def _bound_entry(self, key: tuple, ck: str) -> Optional[dict]:
        """The index entry for `key` if it was made for this piece's content; an entry bound
        to other content (moved or swapped in the index) is damage: named once and dropped."""
        entry = self.entries.get(key)
        if entry is None or entry["content_key"] == ck:
            return entry
        assert self.cache is not None
        damage(self.cache.index_path, f"its entry for piece {key[1]} (shape "
               f"{key[0] if key[0] is not None else 'general'}) names content {entry['content_key'][:12]}..., "
               f"this piece is {ck[:12]}...", "recompiling the piece and rewriting the entry.")
        del self.entries[key]
        self._remove.append(key)
        return None

    def _publish(self, handle: dict, ck: str, graph: fx.GraphModule) -> Optional[dict]:
        """Rename a freshly written artifact to its digest's name and make its index entry."""
        assert self.cache is not None
        staging = self.cache.artifact_path(handle["path"])
        digest = sha256_file(str(staging))
        if digest is None:
            return None
        final_rel = os.path.join(os.path.dirname(handle["path"]), f"{digest[:32]}{os.path.splitext(handle['path'])[1]}")
        final = self.cache.artifact_path(final_rel)
        try:
            if self.cache.verify(final_rel, digest) is None:
                staging.unlink()  # identical bytes already published (another process, another piece)
            else:  # absent, or a damaged / untrusted file under that name: replaced, never trusted
                os.replace(staging, final)
        except OSError as exc:
            self.cache.write_failed(final, exc)
            return None
        compilation_counter.num_compiled_artifacts_saved += 1
        return {
            "content_key": ck,
            "graph": _graph_digest(graph),
            "compiler": self.compiler.name,
            "handle": dict(handle, path=final_rel),
            "sha256": digest,
            "bytes": final.stat().st_size,
        }

    def _record(self, proto: dict, graph_index: int, runtime_shape: Optional[int],
                shape_locator: Optional[list[int]]) -> None:
        entry = dict(proto, graph_index=graph_index, runtime_shape=runtime_shape)
        if shape_locator is not None:
            entry["shape_locator"] = list(shape_locator)
        else:
            entry.pop("shape_locator", None)
        if self.entries.get(entry_key(entry)) == entry:
            return
        self.entries[entry_key(entry)] = entry
        self._pending.append(entry)

    def _load(self, entry: dict, graph: Optional[fx.GraphModule], example_inputs: Optional[list[Any]],
              graph_index: int, runtime_shape: Optional[int]) -> Optional[Callable]:
        rel = entry["handle"]["path"]
        if rel in self._loaded:
            return self._loaded[rel]
        if self.cache is None:
            return None
        if example_inputs is None and not self.compiler.loads_without_inputs:
            return None
        problem = self.cache.verify(rel, entry["sha256"])
        if problem is None:
            start = time.perf_counter()
            try:
                fn = self._with_scratch(
                    lambda: self.compiler.load(entry["handle"], graph, example_inputs, graph_index, runtime_shape))
            except Exception as exc:  # a damaged or foreign artifact must never fail the model
                problem = f"it does not load ({type(exc).__name__}: {str(exc)[:200]})"
            else:
                self.load_seconds += time.perf_counter() - start
                compilation_counter.num_compiled_artifacts_loaded += 1
                self._loaded[rel] = fn
                self._by_content[entry["content_key"]] = (fn, entry)
                return fn
        damage(self.cache.artifact_path(rel), problem, "recompiling it.")
        self.cache.discard(rel)
        for key in [k for k, e in self.entries.items() if e["handle"]["path"] == rel]:
            del self.entries[key]
            self._remove.append(key)
        return None

    # --- warm start without example inputs -------------------------------------------------

    def load_general(self, num_pieces: int, graphs: Optional[list[fx.GraphModule]] = None
                     ) -> Optional[list[tuple[Callable, Optional[list[int]]]]]:
        """Every piece's general-shape callable and shape locator from the index, or None if
        any is missing or unusable (the caller then traces with Dynamo). With `graphs`, each
        entry must have been made for that piece's graph (else it is damage)."""
        out = []
        for index in range(num_pieces):
            key = (None, index, self.compiler.name)
            entry = self.entries.get(key)
            if entry is None:
                return None
            if graphs is not None and entry.get("graph") not in (None, _graph_digest(graphs[index])):
                damage(self.cache.index_path if self.cache else "the index", f"its entry for piece {index} "
                       "(shape general) was made for another graph", "tracing and recompiling the piece.")
                del self.entries[key]
                self._remove.append(key)
                self.flush()
                return None
            fn = self._load(entry, None, None, index, None)
            if fn is None:
                return None
            compilation_counter.num_backend_compilations += 1
            out.append((fn, entry.get("shape_locator")))
        return out

    def has_concrete(self, graph_index: int, runtime_shape: int) -> bool:
        return (runtime_shape, graph_index, self.compiler.name) in self.entries

    def flush(self, dynamo_function: Optional[dict] = None, announce: bool = True) -> None:
        """Write what this manager added (or dropped) to the index, merged under the lock;
        `announce=False` leaves `on_commit` (publishing the cache) to the next flush."""
        if self.cache is None:
            return
        if self._pending or self._remove or dynamo_function is not None or self.cache._repair or self._scratch_used:
            if self.cache.commit(self._pending, self._remove, dynamo_function, scratch_used=self._scratch_used):
                if dynamo_function is not None:
                    self.dynamo_function = dynamo_function
                self._unannounced = True
            self._pending, self._remove = [], []
            self._scratch_used = False
        if announce and self._unannounced and self.on_commit is not None:
            self._unannounced = False
            self.on_commit()
