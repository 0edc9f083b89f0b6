"""Streaming the next weights into L2 while a decode layer's latency-bound kernels run (issue 15).

At batch 1 a decode layer reads its weights in four GEMVs at near the copy bandwidth, and in
between the memory idles: the attention (some 8 us of latency for 2 MB of KV), the norms, the
GEMVs' ramps. A persistent "megakernel" keeps the memory busy through those by loading the next
weights early. This measures the same idea inside a CUDA graph: after a layer's qkv GEMV (or
its attention), a second stream of the graph issues bulk L2 prefetches (Hopper's
`cp.async.bulk.prefetch.L2`: one instruction per chunk, no registers or shared memory) of the
weights the next GEMVs read (the o projection, the first MB of gate_up), and the GEMVs then find
them in L2. The prefetch is only a hint: nothing waits on it but the graph's end. The kernel is
the package's (ops/l2_prefetch.py); the compiler puts the same fork before every attention of a
FULL graph (backends/l2_prefetch_pass.py), as decode.py's atom-full arm runs it.

The chain is a decode layer of the package's own kernels, Llama-3.2-1B dimensions, bf16, 1k
context, every layer its own weights and KV cache (so every byte comes from memory as in a
step): add+RMSNorm, qkv GEMV, the decode attention (KV write and attention in one launch),
o GEMV, add+RMSNorm, gate_up GEMV, SiLU-and-mul + down GEMV, all launched with PDL where the GPU
has it (RoPE left out). Each arm is recorded in one CUDA graph; the arms' replays are
interleaved over --rounds rounds and each arm's us per replay is the median.

    python benchmarks/l2_prefetch.py [--layers 16] [--rounds 30] [--arms base,qkv:o+gu16,...]

An arm is `base` or `FORK:W+W...`, or several of those joined by `;`: FORK is where a prefetch
starts (after the `qkv`, `attn`, `o` or `gu` kernel; `gu`: the gate_up GEMV, before down), each
W a weight (`o`, `gu`, `down`, `next_qkv`; `kv`: the layer's KV cache) with an optional size in MB
(its first bytes; the whole weight without one), and an optional `/P` (for every fork): P 64 KB
bulk prefetches a program (a power of two; 32 without, the compiler's), or `/lK`: a kernel of
this script's own instead, each thread asking L2 for one 128-byte line
(`prefetch.global.L2::evict_last`), K KB a program of 4 warps (a power of two, 16 or more).
An arm prefixed `e.` (`e.base`, `e.qkv:o+gu16`) splits each RMSNorm between the GEMVs around
it (ops/triton_gemv_forms.linear_add_weigh: the o and down GEMVs add, weigh and sum the squares;
scaled_linear: gate_up and the next qkv scale by 1 / rms), five kernels a layer where the
others run seven.
--profile ARM,... prints, for those arms, where one replay's layer goes: each kernel's end after the one before's, the
mean over the middle layers (torch's profiler), and the prefetch kernels' span.
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch
import triton
import triton.language as tl

from atom_compile.ops import l2_prefetch
from atom_compile.ops.triton_linear import SLOT_FLOATS
from attention_kernel import _timed
from decode import copy_bandwidth

HIDDEN, INTER, HEADS, KV_HEADS, DIM, BLOCK, CONTEXT = 2048, 8192, 32, 8, 64, 16, 1024
EPS = 1e-5
FORKS = ("qkv", "attn", "o", "gu")  # after that GEMV (or the attention)
DEFAULT_ARMS = ("base,qkv:o,qkv:o+gu8,qkv:o+gu16,qkv:o+gu24,qkv:gu16,attn:o+gu16,attn:gu16,"
                "o:gu16,qkv:o+gu16+down8,base")


def parse_arm(arm: str) -> tuple[list[tuple[str, list[tuple[str, int]]]], tuple[str, int]]:
    """`qkv:o+gu16;gu:next_qkv/8` -> ([("qkv", [("o", 0), ("gu", 16 MB)]), ("gu", [("next_qkv", 0)])],
    ("bulk", 8)); size 0: the whole weight; `/l16` -> ("line", 16)."""
    if arm == "base":
        return [], ("bulk", 0)
    arm, _, suffix = arm.partition("/")
    kind, per = ("line", suffix[1:]) if suffix.startswith("l") else ("bulk", suffix)
    n = int(per) if per.isdigit() else 0
    if per and (n <= 0 or n & (n - 1) or (kind == "line" and n < 16)):
        raise SystemExit(f"bad /{suffix} in {arm!r}: a power of two (l: 16 or more)")
    forks = []
    for part in arm.split(";"):
        fork, _, items = part.partition(":")
        if fork not in FORKS or not items or fork in dict(forks):
            raise SystemExit(f"bad arm {arm!r}: want FORK:W+W[;FORK:W...] with FORK one of {', '.join(FORKS)}, "
                             "each once")
        out = []
        for item in items.split("+"):
            m = re.fullmatch(r"(o|gu|down|next_qkv|kv)(\d*)", item)
            if not m:
                raise SystemExit(f"bad weight {item!r} in {arm!r}: o, gu, down, next_qkv or kv, then MB")
            out.append((m.group(1), int(m.group(2) or 0) << 20))
        forks.append((fork, out))
    return forks, (kind, n or l2_prefetch.PER_PROGRAM)


class Layers:
    """The chain's weights, caches and metadata, shared by every arm."""

    def __init__(self, layers: int):
        from atom_compile.ops import attention as ref

        dev, bf = torch.device("cuda"), torch.bfloat16

        def w(n, k):
            return [torch.randn(n, k, device=dev, dtype=bf) / k ** 0.5 for _ in range(layers)]

        self.qkv, self.o = w((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), w(HIDDEN, HEADS * DIM)
        self.gu, self.down = w(2 * INTER, HIDDEN), w(HIDDEN, INTER)
        self.norm = torch.ones(HIDDEN, device=dev, dtype=bf)
        blocks = CONTEXT // BLOCK
        builder = ref.PagedAttentionMetadataBuilder(1, 1, blocks, BLOCK, device="cuda")
        # the step's key goes to the last slot of the last block; the cache holds the keys before
        self.meta = builder.build([ref.SequenceStep([1], CONTEXT - 1, list(range(blocks)))])[2]
        self.caches = [torch.randn(2, blocks, BLOCK, KV_HEADS, DIM, device=dev, dtype=bf) for _ in range(layers)]
        self.hidden = torch.randn(1, HIDDEN, device=dev, dtype=bf)
        self.residual = torch.zeros_like(self.hidden)  # made here: a fill in the chain would be a kernel more
        self.out = torch.empty(1, HEADS, DIM, device=dev, dtype=bf)
        self.slots = torch.zeros(2 * layers, SLOT_FLOATS, device=dev)  # the split norms' slots (ops/split_norm.py)

    def weight(self, name: str, i: int) -> torch.Tensor:
        if name == "next_qkv":
            return self.qkv[(i + 1) % len(self.qkv)]
        return {"o": self.o, "gu": self.gu, "down": self.down, "kv": self.caches}[name][i]


@triton.jit
def _line_prefetch_kernel(base_ptr, nbytes, BYTES: tl.constexpr):
    # a thread a 128-byte line; one past the end asks again for the last line (harmless)
    first = tl.minimum(tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES // 128) * 128, nbytes - 128)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [base_ptr + first], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(weight: torch.Tensor, nbytes: int, how: tuple[str, int]) -> None:
    kind, n = how
    if kind == "bulk":
        l2_prefetch.launch(weight, nbytes, n)
        return
    size = n << 10
    _line_prefetch_kernel[(triton.cdiv(nbytes, size),)](weight.view(-1).view(torch.uint8), nbytes, BYTES=size,
                                                       num_warps=4)


def split_epi(arm: str) -> tuple[bool, str]:
    """`e.ARM` -> (True, ARM): the norms split between the GEMVs."""
    return (True, arm[2:]) if arm.startswith("e.") else (False, arm)


def run_chain(lay: Layers, forks: list[tuple[str, list[tuple[str, int]]]], how: tuple[str, int],
              side: torch.cuda.Stream, epi: bool = False) -> torch.Tensor:
    from atom_compile.ops import triton_attention as ta
    from atom_compile.ops import triton_gemv_forms as forms, triton_linear as tlin
    from atom_compile.ops import triton_rowwise as rw

    main = torch.cuda.current_stream()

    def maybe_prefetch(point: str, i: int) -> None:
        items = dict(forks).get(point)
        if not items:
            return
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for name, nbytes in items:
                t = lay.weight(name, i)
                prefetch(t, min(nbytes or t.numel() * 2, t.numel() * 2), how)

    hidden, residual = lay.hidden, lay.residual
    q_size, kv_size = HEADS * DIM, KV_HEADS * DIM
    layers = len(lay.qkv)

    def pair_slots(p: int) -> tuple[torch.Tensor, torch.Tensor]:
        # pair p's slot and the one it zeroes: the next pair's, round the chain's 2 * layers - 1
        return lay.slots[p], lay.slots[(p + 1) % (2 * layers - 1)]

    for i in range(layers):
        if i == 0 or not epi:  # with epi, the down GEMV before weighed this layer's input
            h, residual = rw.add_rms_norm(hidden, residual, lay.norm, EPS)
            qkv = tlin.small_m_linear(h, lay.qkv[i])
        else:
            qkv = forms.scaled_linear(h, lay.qkv[i], EPS, lay.slots[2 * i - 1])
        maybe_prefetch("qkv", i)
        q = qkv[:, :q_size].view(1, HEADS, DIM)
        k = qkv[:, q_size:q_size + kv_size].view(1, KV_HEADS, DIM)
        v = qkv[:, q_size + kv_size:].view(1, KV_HEADS, DIM)
        cache = lay.caches[i]
        ta.triton_paged_attention(q, cache[0], cache[1], lay.out, lay.meta, DIM ** -0.5, new_kv=(k, v))
        maybe_prefetch("attn", i)
        if epi:  # h is then the weighed row (g), residual the sum
            h, residual = forms.linear_add_weigh(lay.out.view(1, q_size), lay.o[i], residual, lay.norm,
                                                 *pair_slots(2 * i))
            maybe_prefetch("o", i)
            gu = forms.scaled_linear(h, lay.gu[i], EPS, lay.slots[2 * i])
        else:
            o = tlin.small_m_linear(lay.out.view(1, q_size), lay.o[i])
            maybe_prefetch("o", i)
            h, residual = rw.add_rms_norm(o, residual, lay.norm, EPS)
            gu = tlin.small_m_linear(h, lay.gu[i])
        maybe_prefetch("gu", i)
        if epi and i < layers - 1:  # the last layer's output is the down GEMV's, as without
            h, residual = forms.linear_add_weigh(gu[:, :INTER], lay.down[i], residual, lay.norm,
                                                 *pair_slots(2 * i + 1), up=gu[:, INTER:])
        else:
            hidden = forms.silu_mul_linear(gu[:, :INTER], gu[:, INTER:], lay.down[i])
    if forks:
        main.wait_stream(side)  # a capture must join every stream it forked
    return hidden


def record(lay: Layers, arm: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    epi, rest = split_epi(arm)
    forks, how = parse_arm(rest)
    side = torch.cuda.Stream()
    run_chain(lay, forks, how, side, epi)  # compiles and tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_chain(lay, forks, how, side, epi)
    torch.cuda.synchronize()
    return graph, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--replays", type=int, default=10, help="replays per arm per round")
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--profile", default="", help="arms to profile (comma-separated)")
    args = ap.parse_args()
    arms = args.arms.split(",")
    for arm in arms:
        parse_arm(split_epi(arm)[1])
    from atom_compile.ops import pdl

    bw = copy_bandwidth() / 1e12
    lay = Layers(args.layers)
    layer_bytes = 2 * (lay.qkv[0].numel() + lay.o[0].numel() + lay.gu[0].numel() + lay.down[0].numel()
                       + lay.caches[0].numel())
    floor_us = args.layers * layer_bytes / (bw * 1e12) * 1e6
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"PDL {'on' if pdl.enabled(torch.device('cuda')) else 'off'}; copy {bw:.2f} TB/s; "
          f"{args.layers} layers, floor {floor_us:.1f} us ({floor_us / args.layers:.2f} a layer)")
    graphs = {}
    for arm in dict.fromkeys(arms):
        graphs[arm] = record(lay, arm)
    graphs[arms[0]][0].replay()
    torch.cuda.synchronize()
    base_out = graphs[arms[0]][1].float()
    for arm, (graph, out) in graphs.items():  # the prefetch is a hint: every arm computes the same
        graph.replay()
        torch.cuda.synchronize()
        diff = (out.float() - base_out).abs().max().item()
        if diff > 0:
            print(f"note: {arm}'s output differs from {arms[0]}'s by {diff:.3g} at most")
    samples: dict[str, list[float]] = {arm: [] for arm in graphs}
    for _ in range(args.rounds):
        for arm in arms:
            samples[arm].append(_timed(graphs[arm][0].replay, args.replays) * 1e3)
    base = statistics.median(samples[arms[0]])
    print("| arm | us per replay | us a layer | / floor | / first arm | 5-95% of rounds |")
    print("|---|---|---|---|---|---|")
    for arm in graphs:
        s = sorted(samples[arm])
        med = statistics.median(s)
        lo, hi = s[int(0.05 * (len(s) - 1))], s[int(0.95 * (len(s) - 1))]
        print(f"| {arm} | {med:.1f} | {med / args.layers:.2f} | {med / floor_us:.3f} | {med / base:.4f} | "
              f"{lo:.1f}-{hi:.1f} |")
    for arm in filter(None, args.profile.split(",")):
        profile_layer(arm, graphs[arm][0], args.layers)


PARTS = ("norm", "qkv", "attention", "o", "norm", "gate_up", "down")
EPI_PARTS = ("qkv", "attention", "o+add", "gate_up", "down+add")  # after one norm before the first layer


def profile_layer(arm: str, graph: torch.cuda.CUDAGraph, layers: int) -> None:
    """Mean us from each kernel's end to the next one's over the middle layers of one replay."""
    from torch.profiler import ProfilerActivity, profile

    parts, lead = (EPI_PARTS, 1) if split_epi(arm)[0] else (PARTS, 0)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    chain = [k for k in kernels if "prefetch" not in k.name]
    side = [k for k in kernels if "prefetch" in k.name]
    if len(chain) != lead + len(parts) * layers:
        print(f"{arm}: {len(chain)} chain kernels, not {lead + len(parts) * layers}; not profiled")
        return

    def end(part: int, layer: int) -> float:
        return chain[lead + part + len(parts) * layer].time_range.end

    middle = range(2, layers - 2)
    gaps = [statistics.mean(end(p, i) - end(p - 1, i) for i in middle) for p in range(len(parts))]
    print(f"{arm}: " + ", ".join(f"{n} {g:.2f}" for n, g in zip(parts, gaps)) + f" = {sum(gaps):.2f} us a layer")
    if side:
        qkv_ends = [end(parts.index("qkv"), i) for i in range(layers)]
        spans = [(k.time_range.start - min(qkv_ends, key=lambda e: abs(e - k.time_range.start)), k.time_range.elapsed_us())
                 for k in side]
        print(f"  {len(side)} prefetch kernels: start {statistics.mean(s for s, _ in spans):.2f} us after the nearest "
              f"qkv GEMV's end, {statistics.mean(d for _, d in spans):.2f} us long")


if __name__ == "__main__":
    main()
