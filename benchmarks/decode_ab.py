"""Paired A/B of decode switches: FULL-graph arms that read the same weights and KV cache,
timed step by step in turn.

decode.py times one arm after another, each on weights of its own. Two timings of the same
arm there differ by 1-2% (a different placement of 2.5 GB of weights in memory, the GPU's
clocks drifting between arms), as much as a switch worth having changes. Here every arm's model
shares the first arm's parameters and KV caches, all arms are compiled and recorded first, and
each round replays one step of every arm, in an order that rotates from round to round, each
step queued behind the one before (GPU time). Each arm's step time is reported as its median;
its ratio to the first arm as the median of the per-round ratios (a drift moves both halves of
a pair), with the 5th-95th percentile of a bootstrap of that median. Each round starts with one
more step, of one arm in turn, timed from an idle GPU after a synchronize, as decode.py times
every step (the host's launch of the step included): its median is the last column.

Arms: the `atom-full...` names of decode.py (`-attnpf`, `-prefetch`, `-rope`, `-glu`,
`-combo`, `-nosplitk`, ...) and `-pdlearly` (Inductor's kernels let the next one launch right
after their first grid-dependency wait, not after their last load); name the baseline first. A
name given twice is timed twice (the spread of one configuration against itself).

    python benchmarks/decode_ab.py --arms atom-full,atom-full-attnpf,atom-full [--batches 1,8] [--rounds 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

import decode
from decode import _label, atom_arm, decode_steps, kv_bytes, _weight_bytes, copy_bandwidth, recorded_runner


def _fresh_launchers() -> None:
    """Forget which Triton specialisations our launchers hold (Triton keeps the compiled ones):
    an arm's first launches then compile what its switches need, a prefetching twin included."""
    from atom_compile.ops.triton_launch import FastLaunch

    for name, module in list(sys.modules.items()):
        if name.startswith("atom_compile.ops."):
            for value in list(vars(module).values()):
                if isinstance(value, FastLaunch):
                    value.compiled.clear()


def _early_release(code) -> None:
    """After Inductor's own PDL filtering of a kernel's lines: its `gdc_launch_dependents` moved
    from after its last load to just after its first `gdc_wait` (the next kernel may launch as
    soon as this one has waited for the one before)."""
    from torch._inductor.codegen.triton import TritonKernel

    lines = code._lines
    waits = [i for i, line in enumerate(lines) if type(line) is str and TritonKernel.GDC_WAIT in line]
    launches = [i for i, line in enumerate(lines) if type(line) is str and TritonKernel.GDC_LAUNCH in line]
    if waits and len(launches) == 1 and launches[0] > waits[0] + 1:
        wait = lines[waits[0]]
        lines.insert(waits[0] + 1, wait[: len(wait) - len(wait.lstrip())] + lines.pop(launches[0]).strip())


def _switches(name: str, batches: list[int]):
    """decode.py's arm, plus `-pdlearly`: Inductor's kernels release the next one right after
    their first wait (`_early_release`; its caches off, so that every piece is generated)."""
    cc, switches = atom_arm(name.replace("-pdlearly", ""), batches)
    if "-pdlearly" in name:
        from unittest import mock

        from torch._inductor.codegen.triton import TritonKernel

        own = TritonKernel._filter_pdl

        def filter_then_release_early(self, code) -> None:
            own(self, code)
            _early_release(code)

        cc["inductor_compile_config"] = {**cc.get("inductor_compile_config", {}), "force_disable_caches": True}
        switches.enter_context(mock.patch.object(TritonKernel, "_filter_pdl", filter_then_release_early))
    return cc, switches


def record(names: list[str], batches: list[int], context: int, block: int) -> list[tuple[str, object, int]]:
    """Every arm compiled and its ladder recorded, on the first arm's weights and KV caches."""
    arms, base, taken = [], None, {}
    for name in names:
        cc, switches = _switches(name, batches)
        if cc["cudagraph_mode"] != "FULL":
            sys.exit(f"{name}: decode_ab.py pairs FULL-graph arms only")
        _fresh_launchers()
        with switches:
            model, runner, bps, seconds, _ = recorded_runner(cc, 512, context, block, share=base)
        print(f"{name}: recorded in {seconds:.1f}s", flush=True)
        base = base or model
        label = _label(name, taken)
        taken[label] = True
        arms.append((label, runner, bps))
        torch._dynamo.reset()
    return arms


def _timed(arm: tuple, inputs: tuple) -> tuple:
    """One step of `arm` between two CUDA events (returned, not yet waited for)."""
    from atom_compile import set_forward_context

    (_, runner, _), (ids, meta, ctx) = arm, inputs
    with set_forward_context(meta, None, ctx, no_compile_layers=runner.no_compile_layers):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.run_model(ids)
        end.record()
    return start, end


def paired(arms: list, batch: int, context: int, rounds: int) -> tuple[dict, dict]:
    """Seconds of each arm's step per round, each step queued behind the one before (GPU time),
    the arms in an order that rotates from round to round; and, per arm, steps timed from an
    idle GPU (after a synchronize, as decode.py times every step: the host's launch of the step
    included), one arm per round in turn. That step also starts the round, so no queued step
    is timed from an idle GPU."""
    steps = []
    for _, runner, bps in arms:  # each arm's inputs and metadata, built once in its own builder
        step = decode_steps(batch, context, bps)
        ids, _, meta, ctx = runner.builder.build(step, *runner.padding_for(step))
        steps.append((ids, meta, ctx))
    n = len(arms)
    queued: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    idle: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    for r in range(rounds + 5):
        torch.cuda.synchronize()
        first = _timed(arms[r % n], steps[r % n])
        events = [(arms[i][0], _timed(arms[i], steps[i])) for i in [(r + j) % n for j in range(n)]]
        torch.cuda.synchronize()
        if r >= 5:  # the first rounds warm the arms up
            idle[arms[r % n][0]].append(first[0].elapsed_time(first[1]) / 1e3)
            for label, (start, end) in events:
                queued[label].append(start.elapsed_time(end) / 1e3)
    return queued, idle


def _bootstrap(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def report(times: dict[str, list[float]], idle: dict[str, list[float]], batch: int, floor_ms: float) -> dict:
    base = next(iter(times))
    print(f"\nbs {batch}: {len(times[base])} rounds; floor {floor_ms:.3f} ms")
    print(f"| arm | ms per step, queued (median) | / floor | / {base} (median of paired ratios) | 5-95% "
          "| ms from an idle GPU (median) |")
    print("|---|---|---|---|---|---|")
    out = {}
    for label, ts in times.items():
        ms = statistics.median(ts) * 1e3
        ratios = [t / b for t, b in zip(ts, times[base])]
        lo, hi = _bootstrap(ratios)
        med = statistics.median(ratios)
        cold = statistics.median(idle[label]) * 1e3 if idle[label] else float("nan")
        print(f"| {label} | {ms:.3f} | {ms / floor_ms:.2f}x | {med:.4f} | {lo:.4f}-{hi:.4f} | {cold:.3f} |")
        out[label] = {"ms": ms, "ratio": med, "ratio_5": lo, "ratio_95": hi, "ms_from_idle": cold}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", required=True, help="comma-separated atom-full... arms, the baseline first")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--table-keys", type=int, default=0, help="block table width in keys (decode.py's)")
    args = ap.parse_args()
    decode.TABLE_KEYS = args.table_keys
    if not torch.cuda.is_available():
        sys.exit("decode_ab.py needs a CUDA GPU")
    from atom_compile.models import preset

    batches = [int(b) for b in args.batches.split(",")]
    names = args.arms.split(",")
    llama = preset("llama-3.2-1b")
    bw = copy_bandwidth()
    arms = record(names, batches, args.context, block=16)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw / 1e12:.2f} TB/s, "
          f"context {args.context}, CUDA events")
    for b in batches:
        floor_ms = (_weight_bytes(llama) + kv_bytes(llama, b, args.context)) / bw * 1e3
        report(*paired(arms, b, args.context, args.rounds), b, floor_ms)


if __name__ == "__main__":
    main()
