"""Host cost of a token-graph (TR_HYBRID) decode step, piece by piece.

The built-in Llama at Llama-3.2-1B dimensions (bf16, random weights, 1k-token context), level 3,
TR_HYBRID. For one batch it times, in microseconds of host time per call (the GPU kept busy
enough not to block the host):
- the whole replayed step and the FULL step of the same model;
- one segment replay, one eager attention region, and inside the region the KV write and the
  attention launch alone;
and prints cProfile's top functions (by own time) over the replayed steps.

    python benchmarks/eager_region_cost.py [--batch 1] [--context 1024] [--steps 200] [--ladder]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode import build, decode_steps, median_step  # noqa: E402


def host_us(fn, calls: int) -> float:
    """Median host microseconds per call over batches of calls (synchronising between batches)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def runner_for(mode: str, batch: int, context: int, ladder: bool):
    import atom_compile as ac
    from atom_compile.runtime import ModelRunner

    cc = {"level": 3, "cudagraph_mode": mode}
    if not ladder:
        cc["cudagraph_capture_sizes"] = [batch]
    cfg, model, builder, bps = build(cc, 512 if ladder else max(batch, 8), context, 16)
    runner = ModelRunner(model, cfg, builder)
    ids, pos, meta, ctx = builder.build_for_capture(max(batch, 8), 1)  # the first call traces: >= 2 rows
    with torch.inference_mode(), ac.set_forward_context(meta, cfg, ctx, no_compile_layers=model.no_compile_layers):
        model(ids, pos)
    runner.capture_cudagraph()
    inputs, scope = runner.prepare(decode_steps(batch, context, bps))
    return runner, model, inputs, scope


def parts(model, batch: int) -> dict:
    """Host cost of a segment replay and of an eager region (and its launches) of one recording."""
    from atom_compile.ops import triton_attention as ta
    from atom_compile.runtime.graphs import token_graph_of

    rec = next(iter(token_graph_of(model).recordings.values()))
    region = rec.regions[0]
    from atom_compile.forward_context import get_forward_context

    args = list(region.args) + list(region.kwargs.values())
    query, key, value, output = args[:4]
    if isinstance(args[4], str):  # aiter::unified_attention_with_output(..., layer_name)
        layer = model.no_compile_layers[args[4]]
        kv_cache, scale = layer.kv_cache, layer.scale
    else:  # atom::paged_attention_with_output(..., kv_cache, scale)
        kv_cache, scale = args[4], args[5]

    meta = get_forward_context().attn_metadata
    return {
        "segments per step": len(rec.segments),
        "segment replay": host_us(rec.segments[1].replay, 200),
        "eager region (the op)": host_us(lambda: region.fn(*region.args, **region.kwargs), 200),
        "eager region (bound replay)": host_us(region.replay, 200) if region.replay is not None else float("nan"),
        "  KV write launch": host_us(lambda: ta.triton_write_kv(key, value, kv_cache, meta.slot_mapping), 200),
        "  attention launch(es)": host_us(lambda: ta.triton_paged_attention(
            query, kv_cache[0], kv_cache[1], output, meta, scale), 200),
        "  get_forward_context": host_us(get_forward_context, 2000),
        "  torch.empty (small)": host_us(lambda: torch.empty((batch, 32, 4, 64), device="cuda"), 2000),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ladder", action="store_true", help="capture the default 40-size ladder (max_num_seqs 512)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eager_region_cost.py needs a CUDA GPU")
    results = {}
    for mode in ("FULL", "TR_HYBRID"):
        runner, model, inputs, scope = runner_for(mode, args.batch, args.context, args.ladder)
        with scope, torch.inference_mode():
            results[mode] = median_step(lambda: runner.run_model(inputs), args.steps) * 1e3
            results[mode + " host"] = host_us(lambda: runner.run_model(inputs), 50) / 1e3
            if mode == "TR_HYBRID":
                for k, v in parts(model, args.batch).items():
                    print(f"{k:28s} {v:8.1f}" + ("" if k.startswith("segments") else " us"))
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    runner.run_model(inputs)
                torch.cuda.synchronize()
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue())
        torch._dynamo.reset()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, context {args.context}")
    for mode in ("FULL", "TR_HYBRID"):
        print(f"{mode:10s} step {results[mode]:.3f} ms (host-synchronised median), host issue {results[mode + ' host']:.3f} ms")
    regions = len(model.no_compile_layers)
    print(f"TR_HYBRID / FULL {results['TR_HYBRID'] / results['FULL']:.2f} (goal <= 1.15); "
          f"{(results['TR_HYBRID'] - results['FULL']) * 1e3 / regions:.1f} us per eager region")


if __name__ == "__main__":
    main()
