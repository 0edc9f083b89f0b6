"""What the shared CUDA-graph pool holds after a FULL capture of the decode ladder (issue 15's
pool goal: the ladder's pool <= 1.25x the largest recording's alone).

Captures the decode benchmark's model (Llama-3.2-1B dimensions, bf16) with the allocator's
history on, then groups the pool's still-allocated blocks by the innermost frame of our package
(or of torch) that allocated them: what a smaller recording keeps beyond the largest's memory.

    python benchmarks/graph_pool.py [--top 15] [--mode FULL|TR_HYBRID]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import build  # noqa: E402


def _where(frames: list) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "atom_compile" in name or "/torch/_inductor" in name or "/tmp/" in name:
            return f"{name.split('site-packages/')[-1][-60:]}:{f.get('line')} {f.get('name')}"
    return frames[0].get("filename", "?")[-60:] + f":{frames[0].get('line')}" if frames else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--mode", default="FULL", choices=["FULL", "TR_HYBRID"])
    args = ap.parse_args()
    import atom_compile as ac
    from atom_compile.runtime import ModelRunner
    from atom_compile.runtime import graphs

    cfg, model, builder, _ = build({"level": 3, "cudagraph_mode": args.mode}, 512, 1024, 16)
    runner = ModelRunner(model, cfg, builder)
    ids, pos, meta, ctx = builder.build_for_capture(512, 1)
    with torch.inference_mode(), ac.set_forward_context(meta, cfg, ctx, no_compile_layers=model.no_compile_layers):
        model(ids, pos)
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
    seconds, sizes = runner.capture_cudagraph()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    pool = tuple(graphs.graph_pool())
    segments = [s for s in snap["segments"] if tuple(s.get("segment_pool_id", ())) == pool]
    groups: dict = collections.defaultdict(lambda: [0, 0])
    free = 0
    for seg in segments:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                g = groups[_where(block.get("frames", []))]
                g[0] += block["size"]
                g[1] += 1
            else:
                free += block["size"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.mode}: {len(sizes)} sizes in {seconds:.1f}s")
    print("pool after the largest / after the ladder (MiB):",
          [round(v / 2**20, 1) for v in runner.capture_pool_bytes.values()], f"free in pool {free / 2**20:.1f} MiB")
    print("still allocated (kept by a recording or a cache), by where it was allocated:")
    for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {size / 2**20:8.2f} MiB  x{n:<5d} {where}")
    # which allocation each segment holds first: segments made for the smaller recordings are
    # the ladder's growth over the largest's memory (the allocator's size classes: < 1 MiB in
    # 2 MiB segments, 1-10 MiB in 20 MiB segments, larger ones exact)
    print("segments of the pool:")
    for seg in sorted(segments, key=lambda s: -s["total_size"])[:args.top]:
        first = seg["blocks"][0] if seg["blocks"] else {}
        print(f"  {seg['total_size'] / 2**20:8.2f} MiB  {seg.get('segment_type', '?'):5s} "
              f"first block {first.get('size', 0) / 2**20:.2f} MiB from {_where(first.get('frames', []))}")


if __name__ == "__main__":
    main()
