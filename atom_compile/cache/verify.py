"""Check a cache against the digests its indexes recorded, without loading anything."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from .inventory import CacheInfo, PieceDir
from .scratch import SCRATCH_DIR, scratch_problem
from .store import FACTORS_FILE, INDEX_FILE, digest_problem


@dataclass
class Damage:
    path: Path
    reason: str


def _inside(base: Path, rel: str) -> Optional[Path]:
    """`base/rel` if `rel` stays inside `base` (parse_index checked it; belt and braces)."""
    if os.path.isabs(rel) or ".." in PurePosixPath(rel).parts:
        return None
    return base / rel


def verify_piece(piece: PieceDir) -> list[Damage]:
    """Every artifact (and the Dynamo function) of one index against its recorded sha256."""
    if piece.problem:
        return [Damage(piece.path / INDEX_FILE, piece.problem)]
    records = [(e["handle"]["path"], e["sha256"]) for e in piece.entries]
    if piece.dynamo_function:
        records.append((piece.dynamo_function["path"], piece.dynamo_function["sha256"]))
    damage, seen = [], set()
    for rel, sha256 in records:
        if rel in seen:  # deduplicated pieces share one artifact
            continue
        seen.add(rel)
        path = _inside(piece.path, rel)
        reason = "path outside the cache" if path is None else digest_problem(piece.root, path, sha256)
        if reason is not None:
            damage.append(Damage(path or piece.path / rel, reason))
    if os.path.lexists(piece.path / SCRATCH_DIR):
        problem = scratch_problem(piece.root, piece.path / SCRATCH_DIR, piece.inductor_files)
        if problem is not None:
            damage.append(Damage(piece.path / SCRATCH_DIR, problem))
    return damage


def verify_cache(info: CacheInfo) -> list[Damage]:
    """All damage in one cache: unusable indexes or factors, artifacts that fail their digest."""
    damage = [d for p in info.pieces for d in verify_piece(p)]
    if info.factors_problem:
        damage.append(Damage(info.path / FACTORS_FILE, info.factors_problem))
    for problem in info.trust:
        path, _, reason = problem.partition(": ")
        damage.append(Damage(Path(path), f"untrusted: {reason}"))
    return damage


def verified_files(info: CacheInfo) -> tuple[int, int]:
    """(artifacts, Dynamo functions) that verify_cache hashes: the counts inspect shows too."""
    usable = [p for p in info.pieces if not p.problem]
    return sum(len(p.artifact_paths) for p in usable), sum(1 for p in usable if p.dynamo_function)

