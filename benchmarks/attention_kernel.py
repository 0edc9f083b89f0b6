"""Kernel micro-benchmark: the Triton decode attention (one launch per layer) at decode shapes.

Llama-3.2-1B attention (32 heads, 8 KV heads, head size 64), bf16, paged KV (block 16), every
row at the same context length. For each batch size: microseconds per call and the KV
bandwidth it reaches (bytes of K and V read / time), against a device-to-device copy's.

Timed two ways, each the median of CUDA-event timings of --iters runs: inside a CUDA graph of
one call per KV cache copy (as a FULL decode graph runs it; enough copies, >= 256 MB, that none
is served from L2), divided by the copies; and eager (one call between two events, the host's
launch cost included, as a token graph's eager region runs it). "with KV write" is the whole
decode op per layer in the graph: the step's key and value written, then attended (one launch
where the tree has `writes_kv`, else the write launch and the attention launch), so the same
script on an older tree measures what the one-launch kernel replaced.

    python benchmarks/attention_kernel.py [--batch 1,8,32] [--context 1024] [--iters 200]
        [--sweep [--tunings PxBxW,...]] [--table-keys N]

--sweep also times the whole decode op in the graph for each tuning of the kernel (span
programs per multiprocessor, keys per loop step, warps: `triton_attention.Tuning`, forced
through `triton_attention.FORCED`) and prints one row per tuning, the fastest of each batch
starred and the one the tree's rule (`tuning_for`) picks marked. `--tunings 2x128x4,0x512x8`
names the tunings to time instead (P 0: one span per row and KV head, the whole row in one program).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 64, 16


def _timed(fn, iters: int) -> float:
    """Median milliseconds of `fn` between two CUDA events, over `iters` runs."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _decode_op(ta, q, k, v, cache, out, meta, scale) -> None:
    """The step's KV write and the attention, as the op runs them on this tree."""
    if getattr(ta, "writes_kv", None) is not None and ta.writes_kv(meta):
        ta.triton_paged_attention(q, cache[0], cache[1], out, meta, scale, new_kv=(k, v))
    else:
        ta.triton_write_kv(k, v, cache, meta.slot_mapping)
        ta.triton_paged_attention(q, cache[0], cache[1], out, meta, scale)


def _graph_us(calls, iters: int) -> float:
    """Median microseconds per call of `calls` (closures), replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for call in calls:  # warm: every specialisation compiled before the capture
            call()
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.synchronize()
    return _timed(graph.replay, iters) * 1e3 / len(calls)


TABLE_KEYS = 0  # --table-keys: the block table's width in keys (0: the context's)


def _case(batch: int, context: int, copies: int):
    from atom_compile.ops import attention as ref

    blocks = context // BLOCK
    table = max(blocks, -(-TABLE_KEYS // BLOCK))  # an engine's table is as wide as its longest sequence
    builder = ref.PagedAttentionMetadataBuilder(batch, batch, table, BLOCK, device="cuda")
    steps = [ref.SequenceStep([1], context - 1, list(range(s * blocks, (s + 1) * blocks))) for s in range(batch)]
    meta = builder.build(steps)[2]
    caches = [torch.randn(2, batch * blocks + 1, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
              for _ in range(copies)]
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return q, caches, meta


def bench(batch: int, context: int, iters: int) -> dict:
    """One batch size: correctness against the reference, then graph and eager timings."""
    from atom_compile.ops import attention as ref
    from atom_compile.ops import triton_attention as ta

    kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2  # K and V, bf16
    copies = max(1, (256 << 20) // (kv_bytes + 1))
    q, caches, meta = _case(batch, context, min(copies, 512))
    out, scale = torch.empty_like(q), DIM ** -0.5
    want = torch.zeros_like(q)
    ref._torch_paged_attention(q, caches[0][0], caches[0][1], want, meta, scale)
    ta.triton_paged_attention(q, caches[0][0], caches[0][1], out, meta, scale)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    graph_us = _graph_us([lambda c=c: ta.triton_paged_attention(q, c[0], c[1], out, meta, scale)
                          for c in caches], iters)
    k = torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    op_us = _graph_us([lambda c=c: _decode_op(ta, q, k, v, c, out, meta, scale) for c in caches], iters)
    eager_us = _timed(lambda: ta.triton_paged_attention(q, caches[0][0], caches[0][1], out, meta, scale), iters) * 1e3
    plan = ta._plan_for(q, caches[0][0], meta)
    return {"graph_us": graph_us, "op_us": op_us, "eager_us": eager_us, "tb_s": kv_bytes / graph_us / 1e6,
            "splits": plan.num_splits, "copies": len(caches)}


SWEEP = [(ppsm, block_n, warps) for ppsm in (2, 4, 8) for block_n in (32, 64, 128) for warps in (2, 4)]


def sweep(batch: int, context: int, iters: int) -> dict[tuple, float]:
    """The in-graph decode op (KV write + attention) per tuning in SWEEP, us, at one batch."""
    from atom_compile.ops import triton_attention as ta

    kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2
    q, caches, meta = _case(batch, context, min(max(1, (256 << 20) // (kv_bytes + 1)), 512))
    k = torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v, out = torch.randn_like(k), torch.empty_like(q)
    timings = {}
    rule = ta.tuning_for(batch * KV_HEADS, torch.device("cuda"))
    rule = (rule.programs_per_sm, rule.block_n, rule.num_warps)
    try:
        for tuning in SWEEP + [rule] * (rule not in SWEEP):
            ta.FORCED = ta.Tuning(*tuning)
            timings[tuning] = _graph_us([lambda c=c: _decode_op(ta, q, k, v, c, out, meta, DIM ** -0.5)
                                         for c in caches], iters)
    finally:
        ta.FORCED = None
    return timings


def print_sweep(batches: list[int], context: int, iters: int) -> None:
    """One row per tuning, one column per batch (us per layer): the fastest of each column
    starred, the tuning the tree's rule (triton_attention.tuning_for) picks marked with `<`."""
    from atom_compile.ops import triton_attention as ta

    columns = {batch: sweep(batch, context, iters) for batch in batches}
    picked = {}
    for batch in batches:
        rule = ta.tuning_for(batch * KV_HEADS, torch.device("cuda"))
        picked[batch] = (rule.programs_per_sm, rule.block_n, rule.num_warps)
    print("\nsweep: the decode op (KV write + attention) in a CUDA graph, us per layer "
          "(* fastest, < the tree's rule)")
    print("| programs/SM, BLOCK_N, warps | " + " | ".join(f"bs {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for tuning in SWEEP + sorted(set(picked.values()) - set(SWEEP)):
        cells = []
        for batch in batches:
            us = columns[batch].get(tuning)
            if us is None:  # a rule's tuning for another batch only
                cells.append("")
                continue
            mark = ("*" if us == min(columns[batch].values()) else "") + ("<" if picked[batch] == tuning else "")
            cells.append(f"{us:.2f}{mark}")
        print(f"| {tuning} | " + " | ".join(cells) + " |", flush=True)
    rule = [columns[b][picked[b]] for b in batches]
    best = [min(columns[b].values()) for b in batches]
    print("| the rule / the fastest | " + " | ".join(f"{r / f:.2f}" for r, f in zip(rule, best)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="keys per row (a multiple of 16)")
    ap.add_argument("--iters", type=int, default=200, help="timed runs per measurement (>= 100)")
    ap.add_argument("--sweep", action="store_true", help="also time each kernel tuning (SWEEP)")
    ap.add_argument("--table-keys", type=int, default=0, help="block table width in keys (default: the context)")
    ap.add_argument("--tunings", default="", help="the sweep's tunings instead of SWEEP, as PxBxW,... (programs "
                    "per SM, keys per step, warps; P 0: one span per row and KV head)")
    args = ap.parse_args()
    global TABLE_KEYS, SWEEP
    TABLE_KEYS = args.table_keys
    if args.tunings:
        try:
            SWEEP = [tuple(int(x) for x in t.split("x")) for t in args.tunings.split(",")]
        except ValueError:
            ap.error("--tunings takes PxBxW,... with integers")
        if any(len(t) != 3 or t[0] < 0 or t[1] < 16 or t[1] & (t[1] - 1) or t[2] not in (1, 2, 4, 8, 16)
               for t in SWEEP):
            ap.error("--tunings: P >= 0, B a power of two >= 16, W one of 1, 2, 4, 8, 16")
    batches = [int(b) for b in args.batch.split(",")]
    if args.context <= 0 or args.context % BLOCK or args.iters < 100 or min(batches) <= 0:
        ap.error(f"--context must be a positive multiple of {BLOCK}, --iters >= 100, batches > 0")
    if not torch.cuda.is_available():
        sys.exit("attention_kernel.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("attention_kernel.py: needs Triton (pip install triton)")
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_tb_s = 2 * n / (_timed(lambda: b.copy_(a), 100) * 1e-3) / 1e12
    del a, b
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; "
          f"copy {copy_tb_s:.2f} TB/s; {HEADS} heads, {KV_HEADS} KV heads, dim {DIM}, context {args.context}, "
          f"table {max(args.context, args.table_keys)} keys, bf16")
    print("| batch | spans | graph us/call | KV TB/s | of copy | with KV write us | eager us/call |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        r = bench(batch, args.context, args.iters)
        print(f"| {batch} | {r['splits']} | {r['graph_us']:.2f} | {r['tb_s']:.2f} | "
              f"{r['tb_s'] / copy_tb_s:.0%} | {r['op_us']:.2f} | {r['eager_us']:.2f} |", flush=True)
    if args.sweep:
        print_sweep(batches, args.context, args.iters)


if __name__ == "__main__":
    main()
