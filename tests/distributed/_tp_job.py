"""One rank of a tensor-parallel tiny Llama compiled through atom-compile; reports JSON.

    python _tp_job.py --rank R --world W --init file:///tmp/x --cache-root DIR --out R.json

Without --world (a single process, no group) it compiles the single-process Llama instead:
the processes then coordinate only through the cache directory. Started by torchrun (RANK and
WORLD_SIZE set, no --world) it joins torchrun's group. --replicated keeps the group but
compiles the single-process Llama on every rank (no collectives in the forward: a rank can
finish without its peers). --die-in-compile makes the process kill itself (SIGKILL) inside its
first Inductor compile, after creating that file (with --stall it hangs there instead);
--die-rank R limits that to rank R. The report carries the per-graph group agreement
(atom_compile.backends.group_compile.history) and the time split of the first forward.
"""

import argparse
import json
import os
import signal
import time


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=0)
    ap.add_argument("--init", default="")
    ap.add_argument("--cache-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--split-collectives", action="store_true")
    ap.add_argument("--die-in-compile", default="")
    ap.add_argument("--stall", action="store_true", help="with --die-in-compile: hang instead of dying")
    ap.add_argument("--die-rank", type=int, default=-1, help="with --die-in-compile: only this rank dies")
    ap.add_argument("--replicated", action="store_true", help="a group, but the single-process Llama")
    ap.add_argument("--kv-heads", type=int, default=0, help="override the preset's num_kv_heads")
    ap.add_argument("--compile-sizes", default="", help="comma-separated CompilationConfig.compile_sizes")
    ap.add_argument("--ranges", default="", help="compile ranges, e.g. 1-4,9-16 ([lo, hi) each)")
    return ap.parse_args()


def die_in_first_compile(ready: str, stall: bool) -> None:
    from atom_compile.backends import inductor

    for cls in vars(inductor).values():
        if isinstance(cls, type) and "compile" in vars(cls) and cls.__module__ == inductor.__name__:
            def dying(self, *a, **k):
                open(ready, "w").close()
                time.sleep(600.0 if stall else 2.0)
                os.kill(os.getpid(), signal.SIGKILL)
            cls.compile = dying


INDUCTOR_CPU = [0.0, 0.0]  # compiles, loads
BACKEND = {"wall_s": 0.0, "compile_s": 0.0, "load_s": 0.0}


def time_backend() -> None:
    """Add each graph's backend wall time (and its compile/load split) to BACKEND."""
    from atom_compile.backends import atom_backend

    def timed(*a, _inner=atom_backend.compile_graph, **k):
        result = _inner(*a, **k)
        BACKEND["wall_s"] += result.seconds
        if result.manager is not None:
            BACKEND["compile_s"] += result.manager.compile_seconds
            BACKEND["load_s"] += result.manager.load_seconds
        return result
    atom_backend.compile_graph = timed


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (the C++ compiler runs as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def time_compiles() -> None:
    """Add the CPU seconds of every compiler call, and of every load (its C++ compiler processes
    included: a CPU artifact whose library is missing builds it), to INDUCTOR_CPU."""
    from atom_compile.backends import inductor

    for cls in vars(inductor).values():
        if isinstance(cls, type) and "compile" in vars(cls) and cls.__module__ == inductor.__name__:
            for slot, name in enumerate(("compile", "load")):
                def timed(self, *a, _inner=getattr(cls, name), _slot=slot, **k):
                    start = _cpu()
                    try:
                        return _inner(self, *a, **k)
                    finally:
                        INDUCTOR_CPU[_slot] += _cpu() - start
                setattr(cls, name, timed)


def main():
    args = parse()
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    if args.world:
        dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        args.rank, args.world = dist.get_rank(), dist.get_world_size()
    if args.die_in_compile and args.die_rank in (-1, args.rank):
        die_in_first_compile(args.die_in_compile, args.stall)
    time_compiles()
    time_backend()
    import atom_compile as ac
    from atom_compile.models import build_model, preset, shard_llama
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep

    split = ["aiter.unified_attention_with_output"]
    if args.split_collectives:
        split += ["_c10d_functional.all_reduce"]
    sizes = [int(n) for n in args.compile_sizes.split(",") if n]
    spans = [[int(n) for n in r.split("-")] for r in args.ranges.split(",") if r]
    cfg = ac.Config(max_num_seqs=8, compilation_config=ac.CompilationConfig(
        level=args.level, cache_dir=args.cache_root, splitting_ops=split, compile_sizes=sizes or None,
        compile_ranges=spans or None))
    llama = preset("tiny", num_layers=args.layers, **({"num_kv_heads": args.kv_heads} if args.kv_heads else {}))
    ref = build_model(llama, compilation_config=ac.Config())
    if args.world and not args.replicated:
        model = shard_llama(build_model(llama, compilation_config=ac.Config(), prefix="full"), compilation_config=cfg)
    else:
        model = build_model(llama, compilation_config=cfg)
    for m in (model, ref):
        m.allocate_kv_cache(16, 4)
    builder = PagedAttentionMetadataBuilder(8, 64, 8, 4)

    def run(m, steps):
        ids, pos, meta, ctx = builder.build(steps)
        with ac.set_forward_context(meta, None, ctx, no_compile_layers=m.no_compile_layers):
            return m.compute_logits(m(ids, pos))

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    batches = [[SequenceStep(p, 0, [i * 4, i * 4 + 1, i * 4 + 2]) for i, p in enumerate(prompts)]]
    batches.append([SequenceStep([10], 5, [0, 1, 2]), SequenceStep([20], 3, [4, 5, 6])])
    err, first = 0.0, 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        for steps in batches:
            out = run(model, steps)
            first = first or time.perf_counter() - start
            err = max(err, (out - run(ref, steps)).abs().max().item())
    from atom_compile.backends import group_compile

    report = {"rank": args.rank, "counters": ac.compilation_counter.as_dict(), "max_abs_err": err,
              "seconds": time.perf_counter() - start, "inductor_cpu_s": INDUCTOR_CPU[0], "load_cpu_s": INDUCTOR_CPU[1],
              "first_forward_s": first, "backend": BACKEND,
              "group": [vars(g) for g in group_compile.history]}
    with open(args.out.replace("{rank}", str(args.rank)), "w") as f:
        json.dump(report, f)
    if args.world and not (args.die_in_compile or args.stall):
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
