"""Inductor's probe of the CPU's vector ISA: run once per cache root, not once per process.

Inductor picks the vector ISA of its C++ code by building a test program for each candidate
the CPU's flags allow and loading it in a child Python (`pick_vec_isa`). In a fresh directory
the builds take seconds; with them built, each process still spends about 1.3 s (measured on
a 2-core machine) in those child processes, so every rank that compiled or loaded a CPU piece
paid it (the first compile of a process: 5.2 s CPU, 4.2 s with the answer below).

The first process under a cache root runs the probe and writes its answer beside the test
programs (`answer.json`, under a lock), keyed by what decides it: torch, the C++ compiler and
its version, the CPU's flags and Inductor's candidates. A later process that asks the same
question, where the answer says every allowed candidate passed, skips the probe: Inductor's
`cpp.vec_isa_ok` is set within its compiles and loads, which gives exactly the list the probe
gave. Inductor's sub-probes that decide code details (avx512's bf16 and VNNI, AMX tiles) ignore
that setting: their results are recorded too (`builds`) and replayed, so a later process starts
no child Python at all. Each child imports torch: on a 16-core GPU host about 10 s apiece, and
ranks that probed one after another under the lock lost 20 s each. Any other answer (a
candidate failed, another compiler, a non-x86 CPU): the probe runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any, Iterator, Optional

import filelock

logger = logging.getLogger("atom_compile")

ANSWER_FILE = "answer.json"
_state = {"primed": False, "answered": False}


def prime(directory: Optional[str], record: bool, files_in: Any) -> None:
    """Probe once per process (in `directory`, under `files_in(directory)`), or take the answer
    recorded there (`record`: the root's shared probe directory); later compiles and loads
    run under `patches()`."""
    if _state["primed"]:
        return
    _state["primed"] = True
    from torch._inductor import cpu_vec_isa

    question = _question() if directory is not None and record else None
    if question is None:
        with files_in(directory):
            cpu_vec_isa.pick_vec_isa()
        return
    from ..cache.trust import FILE_MODE

    builds = _taken(_read(directory), question)
    if builds is None:
        lock = filelock.FileLock(os.path.join(directory, "answer.lock"), timeout=600, mode=FILE_MODE)
        with lock:  # a second rank waits for the first one's probe, then reads its answer
            builds = _taken(_read(directory), question)
            if builds is None:
                builds = {}
                with files_in(directory), _builds(cpu_vec_isa, builds, record=True):
                    cpu_vec_isa.pick_vec_isa()
                valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
                _write(directory, {"question": question, "valid": valid, "builds": builds})
                return
    _state["answered"] = True  # outside the lock: replaying the answer starts no process
    with files_in(directory), patches(), _builds(cpu_vec_isa, builds, record=False):
        cpu_vec_isa.pick_vec_isa()


def _taken(answer: Optional[dict], question: dict) -> Optional[dict[str, bool]]:
    """The recorded sub-probe results if `answer` answers `question` with every allowed
    candidate passing, else None (the probe must run)."""
    if not isinstance(answer, dict) or answer.get("question") != question or answer.get("valid") != question["allowed"]:
        return None
    builds = answer.get("builds", {})
    ok = isinstance(builds, dict) and all(isinstance(v, bool) for v in builds.values())
    return builds if ok else {}


@contextlib.contextmanager
def _builds(cpu_vec_isa: Any, builds: dict[str, bool], record: bool) -> Iterator[None]:
    """Inductor's `VecISA.check_build` (a test build loaded in a child Python) recording its
    results into `builds`, or answering from them (a build never recorded still runs)."""
    cls = getattr(cpu_vec_isa, "VecISA", None)
    real = getattr(cls, "check_build", None)
    if real is None:  # another layout of Inductor's probe: nothing recorded or replayed
        yield
        return

    def check_build(isa: Any, code: str) -> bool:
        name = f"{type(isa).__name__} {isa.build_arch_flags()} {hashlib.sha256(code.encode()).hexdigest()[:16]}"
        if not record and name in builds:
            return builds[name]
        result = bool(real(isa, code))
        if record:
            builds[name] = result
        return result

    cls.check_build = check_build
    try:
        yield
    finally:
        cls.check_build = real


def answered() -> bool:
    """Whether this process took the root's recorded answer (and must run under `patches`)."""
    return _state["answered"]


def config_patches() -> dict[str, Any]:
    """Inductor config patches for a compile: {} unless the recorded answer is used."""
    return {"cpp.vec_isa_ok": True} if _state["answered"] else {}


@contextlib.contextmanager
def patches() -> Iterator[None]:
    """`config_patches()` in effect (for a load, which takes no patches of its own)."""
    if not _state["answered"]:
        yield
        return
    from torch._inductor import config

    with config.patch(config_patches()):
        yield


def _question() -> Optional[dict[str, Any]]:
    """What decides the probe's answer, or None where it is not recorded (not x86, or
    Inductor's internals moved)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        import torch
        from torch._inductor import config, cpp_builder, cpu_vec_isa

        flags = sorted(cpu_vec_isa.x86_isa_checker())
        compiler = cpp_builder.get_cpp_compiler()
        return {
            "torch": torch.__version__, "compiler": compiler,
            "compiler_version": cpp_builder.get_compiler_version_info(compiler),
            "flags": flags, "simdlen": config.cpp.simdlen,
            "capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
            "allowed": [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                        if all(flag in flags for flag in str(isa).split())],
        }
    except Exception as exc:  # pragma: no cover - private API moved: probe every time
        logger.debug("atom-compile: not recording the CPU ISA probe (%s: %s)", type(exc).__name__, exc)
        return None


def _read(directory: str) -> Optional[dict]:
    try:
        with open(os.path.join(directory, ANSWER_FILE), "rb") as f:
            return json.loads(f.read(1 << 16).decode())
    except (OSError, ValueError):
        return None


def _write(directory: str, answer: dict) -> None:
    from ..cache.files import atomic_write

    try:
        atomic_write(Path(directory) / ANSWER_FILE, (json.dumps(answer, sort_keys=True) + "\n").encode())
    except OSError as exc:  # the next process probes again
        logger.debug("atom-compile: cannot record the CPU ISA probe (%s)", exc)
