"""The parts of one FULL decode step, timed apart (issue 15).

decode.py times each step from an idle GPU (a synchronize after every step); decode_ab.py
queues steps behind each other. This takes the atom-full arm of decode.py (Llama-3.2-1B
dimensions, bf16, 1k context), records its ladder and, per batch, times each part three ways:
from an idle GPU (CUDA events around it after a synchronize), queued behind itself, and the
host's own time for the call (no synchronize inside):

- `run_model`: the runner's step (the graph's replay, then the LM head);
- `graph.replay`: torch's replay of the batch's graph alone;
- `raw launch`: `cuGraphLaunch` of the same executable graph (torch's replay less its C++ work);
- `logits`: the LM head alone, outside the graph.

With --profile it also prints the GPU kernels of one step from torch's profiler: start, end and
duration relative to the first, the first 30 (a layer and a half).

    python benchmarks/step_parts.py [--batches 1,8] [--profile] [--arm atom-full-ropeattn]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from decode import atom_arm, decode_steps, recorded_runner


def _events(fn, n: int, idle: bool) -> float:
    """Median microseconds between CUDA events around `fn`, from an idle GPU or queued."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(n):
        if idle:
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def _host(fn, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _graph_of(runner):
    """The recorded graph and output the runner replays for the step in the forward context
    (its bucket, as run_model looks it up)."""
    from atom_compile import get_forward_context, request_bucket

    fc = get_forward_context()
    return runner.req_graph.graphs[request_bucket(fc.context.running_bs, fc.attn_metadata.max_seqlen_q)]


def _kernels(fn, first: int = 30) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start
    for k in kernels[:first]:
        print(f"  {k.time_range.start - t0:8.1f} {k.time_range.end - t0:8.1f} {k.time_range.elapsed_us():6.1f}  {k.name[:70]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kernels", type=int, default=30, help="how many of the step's first kernels --profile prints")
    ap.add_argument("--arm", default="atom-full", help="a FULL arm of decode.py (its switches), e.g. atom-full-ropeattn")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_parts.py needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    cc, switches = atom_arm(args.arm, batches)
    with switches:
        model, runner, bps, _, _ = recorded_runner(cc, 512, 1024, 16)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    print(f"{args.arm}: {torch.cuda.get_device_name()}, torch {torch.__version__}; us, median of {args.steps}")
    print("| bs | part | from idle | queued | host |\n|---|---|---|---|---|")
    for b in batches:
        ids, scope = runner.prepare(decode_steps(b, 1024, bps))
        with scope:
            graph, out = _graph_of(runner)
            hidden = out[:ids.shape[0]]
            parts = {"run_model": lambda: runner.run_model(ids), "graph.replay": graph.replay,
                     "logits": lambda: model.compute_logits(hidden)}
            if hasattr(graph, "raw_cuda_graph_exec"):  # torch >= 2.9
                executable, stream = graph.raw_cuda_graph_exec(), torch.cuda.current_stream().cuda_stream
                parts["raw launch"] = lambda: cuda.cuGraphLaunch(executable, stream)
            for name, fn in parts.items():
                print(f"| {b} | {name} | {_events(fn, args.steps, True):.1f} | {_events(fn, args.steps, False):.1f} "
                      f"| {_host(fn, args.steps):.1f} |", flush=True)
            if args.profile:
                print(f"kernels of one bs {b} step (start, end, us):")
                _kernels(lambda: runner.run_model(ids), args.kernels)


if __name__ == "__main__":
    main()
