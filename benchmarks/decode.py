"""Decode step time of the built-in Llama (Llama-3.2-1B dimensions, bf16, random weights).

Arms, in one run: eager; torch.compile; torch.compile(mode="reduce-overhead") and
mode="max-autotune" of the same model; atom-compile level 3 with cudagraph_mode NONE, FULL and
TR_HYBRID, each also as `-sizes` (compile_sizes = the batches <= 8: per-size pieces) and as
`-fused` (prologue_pass: each RMSNorm in the prologue of the projection after it) or `-epinorm`
(epilogue_pass: each RMSNorm split between the GEMVs around it, no norm kernel) and as
`-glu` / `-noglu` (glu_pass: each MLP's SiLU-and-mul in the epilogue of its gate_up GEMV; on by
default since 2026-12-06) and as
`-rope` (rope_pass: the query's and key's RoPE in the epilogue of their qkv GEMV) or `-ropeattn`
(rope_attention_pass: that RoPE in the decode attention) and as
`-combo` / `-nocombo` (Inductor's combo_kernels: independent pointwise kernels of a piece,
RoPE's q and k, launched as one; on by default since 2026-12-06) and as
`-prefetch` (ATOM_COMPILE_PREFETCH=1: graphs recorded with the GEMV reading its weight and
the attention its cached keys before their PDL wait, for an A/B of the prefetch in one process;
run it first, its twins compile with new shapes only) or `-attnpf` (ATOM_COMPILE_PREFETCH=attention:
the attention's reads only) and as `-dots` (2-8 rows of every
projection on the small-M kernel's padded tensor-core dots rather than cuBLAS) or `-splitk` (the split-K dots,
ops/triton_splitk.py, the default since 2026-12-06) or `-nosplitk` (cuBLAS for those) or
`-splitglu` / `-nosplitglu` (2-8 rows of the gate_up projection with the SiLU-and-mul as its
epilogue, or the activation's own kernel; by default 2 rows take the first); and as
`-nopnorm` (persistent_reduction_max=0: the norms as Inductor's two-pass loops, as up to
1029ea9), `-norope` (the model's RoPE left out: for timing only, a bound on what moving it into
the attention could save; its results are wrong) and `-attnold` (the decode attention's tuning rule up to 1029ea9) or `-attnPxBxW`
(that tuning at every batch: programs per SM, keys per step, warps); and
`peer`, a plain-PyTorch decoder of the same dimensions (static KV, SDPA,
benchmarks/_peer_decoder.py) under torch.compile(mode="reduce-overhead"), one compile per batch.
Batches of 1, 8, 32 and 128 sequences, each with a 1k-token context already in the paged KV
cache (random keys and values), so every arm times the same decode step: one token per
sequence, logits included. `--table-keys N` makes the block table N keys wide (an engine's
maximum model length; default: the context and the new token), the contexts staying as long.

Also measured in the same run: the device-to-device copy bandwidth (bytes read + written), the
floor of each batch ((weight bytes + the KV bytes the step reads) / that bandwidth) and each
arm's ratio to it, and the time to capture the default ladder.

    python benchmarks/decode.py [--batches 1,8,32,128] [--context 1024] [--steps 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n / statistics.median(times)


def build(cc_kwargs: dict, max_seqs: int, context: int, block: int, share=None):
    """The model, its KV cache and metadata builder; `share`: a model built before, whose
    weights and KV caches this one uses (an A/B where every arm reads the same memory)."""
    import atom_compile as ac
    from atom_compile.models import build_model, preset
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder

    blocks_per_seq = (context + 1 + block - 1) // block
    table_blocks = max(blocks_per_seq, -(-TABLE_KEYS // block)) if TABLE_KEYS else blocks_per_seq
    cfg = ac.Config(max_num_seqs=max_seqs, max_num_batched_tokens=max(8192, max_seqs),
                    compilation_config=ac.CompilationConfig(**cc_kwargs))
    model = build_model(preset("llama-3.2-1b"), compilation_config=cfg, dtype=torch.bfloat16, device="cuda")
    if share is not None:
        shared = dict(share.named_parameters())
        for name, param in model.named_parameters():
            param.data = shared[name].data
        for name, layer in model.no_compile_layers.items():
            layer.kv_cache = share.no_compile_layers[name].kv_cache
    else:
        model.allocate_kv_cache(max_seqs * blocks_per_seq, block)
        with torch.no_grad():
            for layer in model.no_compile_layers.values():
                layer.kv_cache.normal_()
    builder = PagedAttentionMetadataBuilder(max_seqs, max(8192, max_seqs), table_blocks, block, device="cuda")
    return cfg, model, builder, blocks_per_seq


def decode_steps(batch: int, context: int, blocks_per_seq: int):
    from atom_compile.ops.attention import SequenceStep

    return [SequenceStep([(7 * i) % 1000 + 1], context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i in range(batch)]


TABLE_KEYS = 0  # --table-keys: the block table's width in keys (0: the context's)
WALL = False  # --wall: time steps on the host clock (a synchronize after each), as before 2026-12-06


def median_step(fn, steps: int) -> float:
    """Median seconds of one step: GPU time between CUDA events around it (the issue's method;
    a host-bound step still counts, as the GPU then idles between the events), or with --wall
    the host's clock around the step and a synchronize, which adds the launch of the first
    kernel and the synchronize's wake-up to every step."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        if WALL:
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


PROFILE = False  # set for the profiling pass, which runs after every arm has been timed


def kernel_breakdown(fn, top: int = 12) -> list[tuple[str, float, int]]:
    """GPU time per kernel over 5 calls of `fn` (name, microseconds per call, launches per call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        if us > 0:
            rows.append((e.key[:70], us / 5, e.count // 5))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def atom_arm(name: str, batches: list[int]) -> tuple[dict, contextlib.ExitStack]:
    """An atom arm's compilation config and the switches its name asks for, as a stack to enter
    around its compile and capture (what a switch changes is chosen then and recorded)."""
    mode = name.split("-")[1].upper()
    cc: dict = {"level": 3, "cudagraph_mode": mode}
    if "-sizes" in name:
        cc["compile_sizes"] = [b for b in batches if b <= 8]  # decode's few-token sizes
    if "-fused" in name:
        cc["prologue_pass"] = True  # the norms into the projections' prologues
    if "-epinorm" in name:
        cc["epilogue_pass"] = True  # each RMSNorm split between the GEMVs around it
    if "-glu" in name:
        cc["glu_pass"] = True  # SiLU-and-mul into the gate_up GEMV's epilogue (the default since 2026-12-06)
    if "-noglu" in name:
        cc["glu_pass"] = False
    if "-rope" in name:
        cc["rope_pass"] = True  # the query's and key's RoPE into the qkv GEMV's epilogue
    if "-ropeattn" in name:
        cc["rope_pass"] = False
        cc["rope_attention_pass"] = True  # the query's and key's RoPE into the attention
    if "-combo" in name:  # horizontal fusion of a piece's independent kernels
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config, "combo_kernels"):
            raise SystemExit(f"{name}: this torch's Inductor has no combo_kernels")
        cc["inductor_compile_config"] = {"combo_kernels": True}  # the default since 2026-12-06
    if "-nocombo" in name:
        cc["inductor_compile_config"] = {"combo_kernels": False}
    from atom_compile.ops import triton_linear, triton_splitk

    patches = contextlib.ExitStack()
    if "-prefetch" in name:  # ATOM_COMPILE_PREFETCH=1 (its twins compiled with new shapes only)
        patches.enter_context(mock.patch.dict(os.environ, {"ATOM_COMPILE_PREFETCH": "1"}))
    if "-attnpf" in name:  # ATOM_COMPILE_PREFETCH=attention: the attention's reads only
        patches.enter_context(mock.patch.dict(os.environ, {"ATOM_COMPILE_PREFETCH": "attention"}))
    if "-dots" in name:  # 2-8 rows of every projection on the padded dots, not cuBLAS
        patches.enter_context(mock.patch.object(triton_linear, "DOT_MIN_N", 0))
    if "-splitk" in name:  # 2-8 rows of the narrower projections on the split-K dots (the default)
        patches.enter_context(mock.patch.object(triton_linear, "SPLIT_K_ROWS", True))
    if "-nosplitk" in name:  # as ATOM_COMPILE_SPLIT_K=0: cuBLAS for them
        patches.enter_context(mock.patch.object(triton_linear, "SPLIT_K_ROWS", False))
    if "-nolib" in name:  # 2-8 rows: the split-K shapes only, the library GEMM not a candidate (its own choices,
        # kept from the other arms in memory and on disk, where the default's would be overwritten)
        patches.enter_context(mock.patch.object(triton_linear, "_split_k_candidates", lambda: list(triton_splitk.CONFIGS)))
        patches.enter_context(mock.patch.dict(triton_linear._tuned, clear=True))
        patches.enter_context(mock.patch.object(triton_linear.tuning, "remember", lambda *args: None))
    if "-nosplitglu" in name or "-splitglu" in name:  # 2-8 rows of gate_up: the SiLU-and-mul as the split-K
        from atom_compile.ops import triton_glu  # dots' epilogue, or its own kernel after them (-nosplitglu)

        patches.enter_context(mock.patch.object(triton_glu, "SPLIT_K_GLU_ROWS", 8 if "-splitglu" in name else 0))
    if "-nopnorm" in name:  # norms as Inductor's two-pass loops (its own limit; as up to 1029ea9)
        cc["persistent_reduction_max"] = 0
    if "-norope" in name:  # timing only: q and k unrotated, no RoPE kernel (wrong results)
        from atom_compile.models import llama

        patches.enter_context(mock.patch.object(llama.RotaryEmbedding, "forward", lambda self, p, q, k: (q, k)))
    if "-nol2pf" in name:  # no weight prefetch into L2 before the attention (the default up to 2026-12-06)
        cc["l2_prefetch_mb"] = 0
    if "-nomemo" in name:  # each manifest commit hashes every scratch file again (as before 2026-12-07)
        from atom_compile.cache import scratch

        patches.enter_context(mock.patch.object(scratch, "RACY_NS", 1 << 62))
    if "-l2pfrest" in name:  # no prefetch before the first attention (the step's opening gap); the stitching
        from atom_compile.backends import l2_prefetch_pass  # graph differs, so a cache of its own

        plan = l2_prefetch_pass.plan
        patches.enter_context(mock.patch.object(l2_prefetch_pass, "plan", lambda *args: plan(*args)[1:]))
        patches.enter_context(mock.patch.dict(os.environ, {"ATOM_COMPILE_CACHE_ROOT": tempfile.mkdtemp()}))
    l2pf = re.search(r"-l2pf(\d+)", name)
    if l2pf:  # -l2pfN: the prefetch's budget, N MB (the default: half the GPU's L2)
        cc["l2_prefetch_mb"] = int(l2pf.group(1))
    l2pp = re.search(r"-l2pp(\d+)", name)
    if l2pp:  # -l2ppN: N 64 KB chunks a prefetch program (a power of two; ops/l2_prefetch.PER_PROGRAM)
        from atom_compile.ops import l2_prefetch

        per = int(l2pp.group(1))
        if per <= 0 or per & (per - 1):  # the kernel's lanes are a tl.arange
            raise SystemExit(f"{name}: -l2pp wants a power of two, got {per}")
        patches.enter_context(mock.patch.object(l2_prefetch, "PER_PROGRAM", per))
    attn = re.search(r"-attn(\d+)x(\d+)x(\d+)", name)
    if attn:  # -attnPxBxW: the decode attention's tuning at every batch (programs per SM, keys per step, warps)
        patches.enter_context(_attention_tuning(tuple(int(g) for g in attn.groups())))
    if "-attnold" in name:  # the attention's tuning rule up to 1029ea9 (two tiers, split at the SM count)
        patches.enter_context(_attention_tuning(None))
    return cc, patches


@contextlib.contextmanager
def _attention_tuning(forced):
    from atom_compile.ops import triton_attention as ta

    def old_rule(pairs, device):
        return ta.Tuning(2, 128, 4) if pairs < ta._sms(device) else ta.MANY_PAIRS

    ta._plans.clear()  # plans are cached per shape: recompute them under this tuning
    patch = mock.patch.object(ta, "FORCED", ta.Tuning(*forced)) if forced else mock.patch.object(ta, "tuning_for", old_rule)
    with patch:
        yield
    ta._plans.clear()


def run_arm(name: str, batches: list[int], context: int, steps: int, block: int) -> tuple[dict, dict]:
    import atom_compile as ac

    max_seqs = max(batches)
    extra: dict = {}
    if name == "peer":
        return run_peer(batches, context, steps), extra
    if name.startswith("atom"):
        cc, switches = atom_arm(name, batches)
        with switches:
            # max_num_seqs 512: the default ladder, [1..8] + range(16, 513, 16), 40 sizes
            return _run_atom(cc, batches, context, steps, block, max(max_seqs, 512))

    cfg, model, builder, bps = build({"level": 0}, max_seqs, context, block)
    forward = model.model
    if name == "torch.compile":
        forward = torch.compile(model.model, fullgraph=True, dynamic=True)
    elif name in ("reduce-overhead", "max-autotune"):
        forward = torch.compile(model.model, fullgraph=True, dynamic=True, mode=name)
    out = {}
    for b in batches:
        ids, pos, meta, ctx = builder.build(decode_steps(b, context, bps))
        with torch.inference_mode(), ac.set_forward_context(meta, cfg, ctx, no_compile_layers=model.no_compile_layers):
            out[b] = median_step(lambda: model.compute_logits(forward(ids, pos)), steps)
    return out, extra


def recorded_runner(cc: dict, max_seqs: int, context: int, block: int, share=None):
    """(model, runner, blocks per sequence, capture seconds, captured sizes): an atom arm
    compiled, then its ladder recorded in a graph pool of its own (`share`: as build's)."""
    import atom_compile as ac
    from atom_compile.runtime import ModelRunner
    from atom_compile.runtime.graphs import reset_graph_pool

    cfg, model, builder, bps = build(cc, max_seqs, context, block, share=share)
    runner = ModelRunner(model, cfg, builder)
    # the first call compiles; the capture's warm-up would do it, but time compile and capture apart
    ids, pos, meta, ctx = builder.build_for_capture(max_seqs, 1)
    with torch.inference_mode(), ac.set_forward_context(meta, cfg, ctx, no_compile_layers=model.no_compile_layers):
        model(ids, pos)
    reset_graph_pool()  # a pool of this arm's own (graphs recorded before keep theirs)
    seconds, sizes = runner.capture_cudagraph()
    return model, runner, bps, seconds, sizes


def _run_atom(cc: dict, batches: list[int], context: int, steps: int, block: int, max_seqs: int) -> tuple[dict, dict]:
    _, runner, bps, seconds, sizes = recorded_runner(cc, max_seqs, context, block)
    pool = list(runner.capture_pool_bytes.values())
    extra = {"capture_seconds": seconds, "captured_sizes": len(sizes),
             "capture_first_seconds": runner.capture_first_seconds,
             "pool_ratio": pool[-1] / pool[0] if pool and pool[0] else None, "pool_mib": pool[-1] / 2**20 if pool else 0}
    out = {}
    for b in batches:
        inputs, scope = runner.prepare(decode_steps(b, context, bps))
        with scope:
            if PROFILE:
                extra["kernels"] = kernel_breakdown(lambda: runner.run_model(inputs))
                break
            out[b] = median_step(lambda: runner.run_model(inputs), steps)
    return out, extra


def run_peer(batches: list[int], context: int, steps: int) -> dict:
    from _peer_decoder import PeerDecoder

    from atom_compile.models import preset
    from atom_compile.ops import jit_watch

    jit_watch.stop_watching()  # the peer compiles and tunes kernels of its own: no miss of our warm-up
    out = {}
    for b in batches:
        torch.manual_seed(0)
        model = PeerDecoder(preset("llama-3.2-1b"), b, context)
        forward = torch.compile(model, fullgraph=True, dynamic=False, mode="reduce-overhead")
        ids = torch.randint(1, 1000, (b,), device="cuda")
        pos = torch.full((b,), context, device="cuda")
        with torch.inference_mode():
            out[b] = median_step(lambda: forward(ids, pos), steps)
        model = forward = None  # freed before the next batch compiles its own
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return out


def kv_bytes(cfg, batch: int, context: int) -> int:
    """Bytes of keys and values a decode step reads: every layer, every cached position, bf16."""
    return batch * (context + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def main() -> None:
    global PROFILE, WALL, TABLE_KEYS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--arms", default="eager,torch.compile,reduce-overhead,max-autotune,peer,atom-none,"
                    "atom-full,atom-tr_hybrid,atom-full-sizes,atom-tr_hybrid-sizes")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", action="store_true", help="print the GPU time per kernel of the atom arms at the first batch")
    ap.add_argument("--wall", action="store_true", help="time steps on the host clock, not CUDA events")
    ap.add_argument("--table-keys", type=int, default=0, help="block table width in keys (an engine's max model length)")
    args = ap.parse_args()
    WALL, TABLE_KEYS = args.wall, args.table_keys
    if not torch.cuda.is_available():
        sys.exit("decode.py needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    block = 16

    from atom_compile.models import preset

    llama = preset("llama-3.2-1b")
    bw = copy_bandwidth()
    weights = _weight_bytes(llama)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "copy_bandwidth_tb_s": bw / 1e12, "weight_bytes": weights, "floor_ms": weights / bw * 1e3,
                     "context": args.context, "arms": {}, "extra": {}}
    for arm in args.arms.split(","):
        t = time.perf_counter()
        times, extra = run_arm(arm, batches, args.context, args.steps, block)
        label = _label(arm, results["arms"])
        results["arms"][label] = {b: s * 1e3 for b, s in times.items()}
        results["extra"][label] = dict(extra, wall_seconds=time.perf_counter() - t)
        pool = f"  pool {extra['pool_mib']:.0f} MiB ({extra['pool_ratio']:.2f}x largest)" \
            if extra.get("pool_ratio") else ""
        print(f"{arm:16s} " + "  ".join(f"bs{b}={s * 1e3:.3f}ms" for b, s in times.items())
              + (f"  capture {extra['capture_seconds']:.1f}s (first size {extra['capture_first_seconds']:.1f}s)"
                 if "capture_seconds" in extra else "") + pool,
              flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    if args.profile:
        # A pass of its own, after all timing: once CUPTI has run (torch.profiler with CUDA
        # activities), every later kernel launch from Python costs more host time, which would
        # slow every arm timed after it that launches from Python (TR_HYBRID's eager regions).
        PROFILE = True
        for arm in dict.fromkeys(a for a in args.arms.split(",") if a.startswith("atom")):  # each once
            results["extra"][arm]["kernels"] = run_arm(arm, batches[:1], args.context, args.steps, block)[1]["kernels"]
            torch._dynamo.reset()
            torch.cuda.empty_cache()

    print(f"\n{results['device']}, torch {results['torch']}, context {args.context}, "
          f"{'host clock' if WALL else 'CUDA events'}, median of {args.steps} steps")
    print(f"copy bandwidth {results['copy_bandwidth_tb_s']:.2f} TB/s; weights {weights / 1e9:.2f} GB; "
          f"floor {results['floor_ms']:.3f} ms")
    print("| arm | " + " | ".join(f"bs {b} (ms)" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    floors = {b: (weights + kv_bytes(llama, b, args.context)) / bw * 1e3 for b in batches}
    results["floor_ms_per_batch"] = floors
    for arm, row in results["arms"].items():
        print(f"| {arm} | " + " | ".join(f"{row[b]:.3f} ({row[b] / floors[b]:.2f}x)" for b in batches) + " |")
    print("| floor (weights + KV) | " + " | ".join(f"{floors[b]:.3f}" for b in batches) + " |")
    _goals(results, batches, llama)
    for arm, extra in results["extra"].items():
        if extra.get("kernels"):
            total = sum(us for _, us, _ in extra["kernels"])
            print(f"\n{arm}, bs {batches[0]}: top kernels (us per step, launches per step), top total {total:.0f} us")
            for name, us, n in extra["kernels"]:
                print(f"  {us:8.1f}  x{n:<4d} {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _label(arm: str, taken: dict) -> str:
    """An arm named again (an A/B's spread) is kept as "arm (2)", "arm (3)": the goals read the first."""
    n = 1
    while (label := arm if n == 1 else f"{arm} ({n})") in taken:
        n += 1
    return label


def _ratio(arms: dict, num: str, den: str, batches: list[int]) -> str:
    return ", ".join(f"bs{b} {arms[num][b] / arms[den][b]:.2f}" for b in batches)


def _goals(results: dict, batches: list[int], llama) -> None:
    """Issue 15's goals, for whichever arms ran (the -sizes arms stand in for their mode)."""
    arms, floors, extra = results["arms"], results["floor_ms_per_batch"], results["extra"]
    for suffix in dict.fromkeys(a[len("atom-full"):] for a in arms if a == "atom-full" or a.startswith("atom-full-")):
        full, hybrid = f"atom-full{suffix}", f"atom-tr_hybrid{suffix}"
        print(f"\n{full} / floor: " + ", ".join(f"bs{b} {arms[full][b] / floors[b]:.2f}" for b in batches)
              + " (goal <= 1.3 at bs 1, <= 1.5 at bs 8)")
        if suffix and "atom-full" in arms:  # a switch's A/B against the defaults, in one process
            print(f"{full} / atom-full: {_ratio(arms, full, 'atom-full', batches)}")
        for peer in ("peer", "reduce-overhead", "max-autotune"):
            if peer in arms:
                print(f"{full} / {peer}: {_ratio(arms, full, peer, batches)} (goal < 1.0)")
        if hybrid in arms:
            small = [b for b in batches if b <= 32]
            print(f"{hybrid} / {full}: {_ratio(arms, hybrid, full, small)} (goal <= 1.15)")
            regions = llama.num_layers
            print(f"{hybrid} host cost per eager region (step difference / {regions} regions): " + ", ".join(
                f"bs{b} {(arms[hybrid][b] - arms[full][b]) * 1e3 / regions:.1f}us" for b in small))
        print(f"capture of the default ladder ({extra[full].get('captured_sizes')} sizes): "
              f"{full} {extra[full].get('capture_seconds', 0):.1f}s, "
              f"{hybrid} {extra.get(hybrid, {}).get('capture_seconds', 0):.1f}s (goal < 30s)")
        for arm in (full, hybrid):
            if extra.get(arm, {}).get("pool_ratio") is not None:
                print(f"{arm} graph pool: {extra[arm]['pool_mib']:.1f} MiB for the ladder, "
                      f"{extra[arm]['pool_ratio']:.2f}x the largest size's alone (goal <= 1.25)")


def _weight_bytes(cfg) -> int:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = qkv + cfg.num_heads * cfg.head_dim * h + 3 * h * i + 2 * h
    params = cfg.num_layers * per_layer + h + v * h * (1 if cfg.tie_word_embeddings else 2)
    return params * 2  # bf16; the embedding rows a step reads are negligible, the LM head is not


if __name__ == "__main__":
    main()
