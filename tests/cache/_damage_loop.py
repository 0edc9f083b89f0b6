"""Damage a real cache N times in one process, each time a random file in a random way (seeded).

argv: PRISTINE_ROOT WORK_DIR N SEED. PRISTINE_ROOT holds the tiny Llama's cache (1 layer, level 3),
or is empty: then the first start here compiles it. Each round copies it, damages one file, runs
the tiny Llama (a start), then runs it again (the next start), clearing Dynamo's and Inductor's
in-memory caches and atom-compile's warn-once memory before each start, so each behaves as a
fresh process would. Round i damages in the way KINDS[i % 6] (every kind as often as the next), a
file the seed picks. Prints one JSON report; bad_rounds(report) lists the rounds that went wrong.

tests/cache/test_trust.py runs a few rounds; benchmarks/cache_damage_sweep.py runs the long sweep.
"""

import hashlib
import io
import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

KINDS = ["truncate", "garble", "empty", "delete", "chmod", "symlink"]


def candidates(root: Path) -> list[Path]:
    """Every file of the cache that a start reads for its content (Inductor's run-time files,
    `scratch.RUNTIME_FILES`, are only trust-checked: test_trust.py covers them)."""
    from atom_compile.cache.scratch import RUNTIME_FILES

    caches = root / "torch_compile_cache"
    out = sorted(caches.glob("entrypoints/*.json")) + sorted(caches.glob("*/cache_key_factors.json"))
    for prefix in caches.glob("*/rank_*/*"):
        out += [prefix / "index.json", prefix / "dynamo_function.bin", *sorted((prefix / "artifacts").iterdir())]
        out += sorted(p for p in (prefix / "inductor").rglob("*") if p.is_file() and not p.name.endswith(RUNTIME_FILES))
    return [p for p in out if p.is_file()]


def damage(path: Path, kind: str, rng: random.Random, outside: Path) -> None:
    data = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(data[: rng.randrange(max(1, len(data)))])
    elif kind == "garble":
        buf = bytearray(data)
        at = rng.randrange(max(1, len(buf)))
        for i in range(at, min(len(buf), at + 16)):
            buf[i] ^= 0xA5
        path.write_bytes(bytes(buf) if buf else b"\xa5")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "delete":
        path.unlink()
    elif kind == "chmod":
        os.chmod(path, 0o666)
    elif kind == "symlink":  # the same bytes, but reached through a link out of the cache
        target = outside / f"{rng.randrange(1 << 30)}-{path.name}"
        target.write_bytes(data)
        path.unlink()
        path.symlink_to(target)


def bad_rounds(report: dict) -> list[tuple]:
    """The rounds whose first start did not name the damage once (a deleted entry point is
    indistinguishable from one never written: no warning is due) and answer bit-identically, or
    whose next start warned, compiled, answered otherwise or found the cache not whole again."""
    bad = []
    for r in report["rounds"]:
        first, second = r["first"], r["second"]
        warnings = first["log"].strip().splitlines()
        expected = 0 if (r["kind"] == "delete" and r["path"].startswith("torch_compile_cache/entrypoints")) else 1
        ok = (first["sha"] == report["expected"] and len(warnings) == expected
              and second["sha"] == report["expected"] and not second["log"]
              and second["counters"]["num_inductor_compiles"] == 0 and not second["complete"]["damage"]
              and not second["complete"]["missing"])
        if not ok:
            bad.append((r["kind"], r["path"], warnings, second["log"], second["counters"], second["complete"]))
    return bad


def main() -> None:
    pristine, work, n, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    logging.getLogger("atom_compile").addHandler(handler)
    logging.getLogger("torch").addHandler(handler)
    import torch

    import atom_compile as ac
    from atom_compile.cache import store
    from atom_compile.models import build_model, preset
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep

    builder = PagedAttentionMetadataBuilder(8, 64, 8, 4)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    batches = [[SequenceStep(p, 0, [i * 4, i * 4 + 1, i * 4 + 2]) for i, p in enumerate(prompts)]]
    batches.append([SequenceStep([10], 5, [0, 1, 2]), SequenceStep([20], 3, [4, 5, 6])])

    def start(root: Path) -> dict:
        torch._dynamo.reset()
        torch._inductor.utils.clear_caches()
        store._warned.clear()
        stream.seek(0)
        stream.truncate()
        t0 = time.perf_counter()
        before = ac.compilation_counter.clone().as_dict()
        cfg = ac.Config(max_num_seqs=8, compilation_config=ac.CompilationConfig(level=3, cache_dir=str(root)))
        model = build_model(preset("tiny", num_layers=1), compilation_config=cfg)
        model.allocate_kv_cache(16, 4)
        digest = hashlib.sha256()
        with torch.inference_mode():
            for steps in batches:
                ids, pos, meta, ctx = builder.build(steps)
                with ac.set_forward_context(meta, None, ctx, no_compile_layers=model.no_compile_layers):
                    digest.update(model.compute_logits(model(ids, pos)).numpy().tobytes())
        after = ac.compilation_counter.as_dict()
        return {"sha": digest.hexdigest(), "log": stream.getvalue(), "seconds": time.perf_counter() - t0,
                "counters": {k: after[k] - before[k] for k in after}}

    from atom_compile.cache import inventory
    from atom_compile.cache.verify import verify_cache

    def manifest(root: Path) -> set:
        (info,) = inventory.list_caches(root)
        return {rel for p in info.pieces for rel in p.inductor_files}, info

    def complete(root: Path, files: set) -> bool:
        """What is damaged, and which Inductor files of the pristine cache are not back."""
        now, info = manifest(root)
        damage = verify_cache(info)
        return {"damage": [f"{d.path}: {d.reason}" for d in damage],
                "missing": sorted(f for f in files - now if not isa_probe(f))}

    def isa_probe(rel: str) -> bool:
        """Inductor's test programs for the CPU's vector ISA: probed once per process (this
        one remembers its answers), never needed by a warm start."""
        (scratch,) = pristine.glob("torch_compile_cache/*/rank_0/*/inductor")
        source = (scratch / rel).with_suffix(".cpp")
        return source.is_file() and "_chk_kernel" in source.read_text()

    rng = random.Random(seed)
    cold = start(pristine)
    expected = start(pristine)
    assert expected["counters"]["num_inductor_compiles"] == 0, "the pristine cache is not warm"
    assert expected["sha"] == cold["sha"] and not expected["log"], expected["log"]
    pristine_files = manifest(pristine)[0]
    assert any(f.endswith(".so") for f in pristine_files)
    rounds = []
    for i in range(n):
        root = work / f"r{i}"
        shutil.copytree(pristine, root, symlinks=True)
        outside = work / f"outside{i}"
        outside.mkdir()
        files = candidates(root)
        path = rng.choice(files)
        kind = KINDS[i % len(KINDS)]
        damage(path, kind, rng, outside)
        first = start(root)
        second = start(root)
        second["complete"] = complete(root, pristine_files)
        rounds.append({"path": str(path.relative_to(root)), "kind": kind,
                       "first": first, "second": second})
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)
    print(json.dumps({"expected": expected["sha"], "cold": cold, "rounds": rounds}))


if __name__ == "__main__":
    main()
