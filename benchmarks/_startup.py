"""One start of the built-in Llama in a fresh process, timed; shared by warm_start.py and
compile_time.py.

    python benchmarks/_startup.py --arm atom|torch.compile --layers N --device cpu|cuda

Every arm imports the same modules and builds the same model before the clock of the compile
phase starts, so the compile phase (first call of the compiled model to its first correct
output) compares compile and load work only. Prints one JSON line.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Inductor's C++ compiler runs):
    on a machine shared with other work, steadier than the wall clock."""
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", choices=["atom", "torch.compile"], required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="")
    ap.add_argument("--every-layer", action="store_true",
                    help="trace every layer (CompilationConfig.trace_layers_once=False): the path before 0.x")
    ap.add_argument("--profile", default="", help="write a cProfile of the compile phase to this file")
    args = ap.parse_args()

    import torch
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    import atom_compile as ac
    from atom_compile.models import build_model, preset
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep

    t_imported = time.perf_counter()
    name = args.preset or ("tiny" if args.device == "cpu" else "llama-3.2-1b")
    # float32 everywhere: the first output is checked against eager, and bf16 differences
    # compound over 32 random layers past any honest tolerance
    dtype = torch.float32
    llama = preset(name, num_layers=args.layers)
    cfg = ac.Config(max_num_seqs=8, compilation_config=ac.CompilationConfig(level=3, trace_layers_once=not args.every_layer))
    model = build_model(llama, compilation_config=cfg if args.arm == "atom" else ac.Config(),
                        dtype=dtype, device=args.device)
    model.allocate_kv_cache(16, 16)
    builder = PagedAttentionMetadataBuilder(8, 64, 4, 16, device=args.device)
    steps = [SequenceStep(list(range(1, 9)), 0, [0, 1]), SequenceStep(list(range(3, 9)), 0, [2, 3])]
    ids, pos, meta, ctx = builder.build(steps)
    forward = model.model
    if args.arm == "torch.compile":
        forward = torch.compile(model.model, fullgraph=True, dynamic=True)
    t_built = time.perf_counter()
    cpu_built = _cpu_seconds()

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    with torch.inference_mode(), ac.set_forward_context(meta, cfg, ctx, no_compile_layers=model.no_compile_layers):
        out = model.compute_logits(forward(ids, pos))
        if args.device == "cuda":
            torch.cuda.synchronize()
        t_first = time.perf_counter()
        cpu_first = _cpu_seconds()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        reference = model.compute_logits(type(model.model).forward(model.model, ids, pos))
    # relative error over the whole output: float32 lands far under 1e-3
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    correct = error < 1e-3
    counters = ac.compilation_counter.as_dict()
    print(json.dumps({
        "arm": args.arm, "layers": args.layers, "device": args.device, "correct": correct, "rel_error": error,
        "import_s": t_imported - T_START, "build_s": t_built - t_imported,
        "compile_phase_s": t_first - t_built, "whole_process_s": t_first - T_START,
        "compile_phase_cpu_s": cpu_first - cpu_built,
        "inductor_compiles": counters["num_inductor_compiles"],
        "artifacts_loaded": counters["num_compiled_artifacts_loaded"],
        "dynamo_functions_loaded": counters["num_dynamo_functions_loaded"],
        "graphs_seen": counters["num_graphs_seen"],
        "regions_inlined": counters["num_regions_inlined"],
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
