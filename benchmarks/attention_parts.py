"""Where the decode attention's time goes: the in-graph decode op of attention_kernel.py (the
step's KV write and the attention, one launch per call, each call on its own copy of the KV
cache), timed with parts of the kernel taken out of its source. The variants compute WRONG
results; they exist only to be timed.

Variants (text replaced in ops/triton_attention_kernels.py, compiled as a module of their own):
- base: the kernel as it is;
- nomerge: every span stores its partial output as the row's output (no ticket, no merge);
- relaxed: the ticket's atomic add without its acquire-release ordering;
- nometa: position and sequence as constants instead of loads;
- notable: block addresses computed instead of read from the block table;
- empty: the kernel returns at once (the launch, inside a CUDA graph);
- `+pf` after a name: recorded with ATOM_COMPILE_PREFETCH=attention (the previous call in the
  graph is also an attention, so the prefetch overlaps it).

    python benchmarks/attention_parts.py [--batches 1,8] [--context 1024] [--iters 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
from unittest import mock

import torch

import attention_kernel as ak

SOURCE = pathlib.Path(__file__).resolve().parents[1] / "atom_compile" / "ops" / "triton_attention_kernels.py"
VARIANTS = {
    "base": [],
    "nomerge": [("    if active == 1:  # the whole row", "    if True:  # the whole row")],
    "relaxed": [('sem="acq_rel", scope="gpu"', 'sem="relaxed", scope="gpu"')],
    "nometa": [("pos = tl.load(query_pos_ptr + row)", "pos = num_splits * 0 + CONTEXT - 1"),
               ("seq = tl.load(token_seq_ptr + row)", "seq = row")],
    "notable": [("block = tl.load(tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)",
                 "block = seq * BLOCKS_PER_SEQ + offs_n // BLOCK_SIZE")],
    "empty": [("    if PDL and not PREFETCH:  # launched early", "    return\n    if PDL and not PREFETCH:  # launched early")],
}
VARIANTS["nomerge-nometa-notable"] = VARIANTS["nomerge"] + VARIANTS["nometa"] + VARIANTS["notable"]
VARIANTS["base+pf"] = []
VARIANTS["nomerge+pf"] = VARIANTS["nomerge"]


def variant_module(name: str, context: int, workdir: str):
    """The kernels' module with `name`'s replacements (each must match once or more)."""
    src = SOURCE.read_text().replace("from .pdl import", "from atom_compile.ops.pdl import")
    for old, new in VARIANTS[name]:
        if old not in src:
            raise SystemExit(f"{name}: the kernel's source no longer has {old!r}")
        src = src.replace(old, new)
    src = src.replace("CONTEXT", str(context)).replace("BLOCKS_PER_SEQ", str(context // ak.BLOCK))
    tag = "_parts_" + name.replace("-", "_").replace("+", "_")
    path = os.path.join(workdir, tag + ".py")
    with open(path, "w") as f:  # Triton reads a kernel's source from its file
        f.write(src)
    spec = importlib.util.spec_from_file_location(tag, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_case(batch: int, context: int) -> tuple:
    """attention_kernel.py's case (query, KV copies past L2, metadata) with the step's key and
    value and an output: the same for every variant."""
    kv_bytes = 2 * batch * context * ak.KV_HEADS * ak.DIM * 2
    q, caches, meta = ak._case(batch, context, min(max(1, (256 << 20) // (kv_bytes + 1)), 512))
    k = torch.randn(batch, ak.KV_HEADS, ak.DIM, device="cuda", dtype=torch.bfloat16)
    return q, caches, meta, k, torch.randn_like(k), torch.empty_like(q)


def time_variant(name: str, module, case: tuple, iters: int) -> float:
    """Microseconds per in-graph decode op with `module`'s kernel (the variant `name`)."""
    from atom_compile.ops import pdl
    from atom_compile.ops import triton_attention as ta
    from atom_compile.ops.triton_launch import FastLaunch

    q, caches, meta, k, v, out = case
    twins = pdl.prefetch_twins("attention")
    launch = FastLaunch(module._attention_kernel, twins=lambda c: twins(c) if c["WRITE_KV"] else [])
    prefetch = "attention" if name.endswith("+pf") else "0"
    with mock.patch.object(ta, "_attention_launch", launch), \
            mock.patch.dict(os.environ, {"ATOM_COMPILE_PREFETCH": prefetch}):
        return ak._graph_us([lambda c=c: ak._decode_op(ta, q, k, v, c, out, meta, ak.DIM ** -0.5) for c in caches],
                            iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_parts.py needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per in-graph decode op, context {args.context}")
    print("| variant | " + " | ".join(f"bs {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    cases = {b: decode_case(b, args.context) for b in batches}
    with tempfile.TemporaryDirectory() as workdir:
        for name in VARIANTS:
            module = variant_module(name, args.context, workdir)
            cells = [time_variant(name, module, cases[b], args.iters) for b in batches]
            print(f"| {name} | " + " | ".join(f"{us:.2f}" for us in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
