"""Compile time and steady-state step time of tiny-config transformers decoders: atom-compile
level 3 (split at SDPA) against stock torch.compile(backend="inductor"), on CPU.

    python benchmarks/hf_models.py --families llama qwen2 mistral [--layers 2] [--json out.json]

Each measurement runs in a fresh process (no warm Inductor or atom cache: a cold compile)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPE = (4, 32)


def _one(family: str, which: str, layers: int, steps: int) -> dict:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import models.families as fam
    import atom_compile as ac

    fam._COMMON["num_hidden_layers"] = layers
    fam._COMMON.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    model = fam.tiny_model(family)
    if which == "atom":
        cfg = ac.CompilationConfig(level=3, splitting_ops=["aten::scaled_dot_product_attention"],
                                   cache_dir=tempfile.mkdtemp(prefix="hfbench-"))
        backend = ac.backend(cfg)
    else:
        backend = "inductor"
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    x = fam.inputs(*SHAPE)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(input_ids=x, use_cache=False)
        compile_s = time.perf_counter() - start
        for _ in range(3):
            compiled(input_ids=x, use_cache=False)
        start = time.perf_counter()
        for _ in range(steps):
            compiled(input_ids=x, use_cache=False)
        step_ms = (time.perf_counter() - start) / steps * 1e3
    return {"family": family, "backend": which, "compile_s": round(compile_s, 2), "step_ms": round(step_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="+", default=["llama", "qwen2", "mistral"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", default="")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1], args.layers, args.steps)))
        return
    import torch

    rows = []
    for family in args.families:
        for which in ("inductor", "atom"):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="hfbench-ind-"))
            out = subprocess.run([sys.executable, __file__, "--one", family, which, "--layers", str(args.layers),
                                  "--steps", str(args.steps)], capture_output=True, text=True, env=env, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"torch {torch.__version__}, CPU, {os.cpu_count()} cores, batch x seq {SHAPE}, {args.layers} layers")
    print(f"{'family':10} {'stock compile s':>16} {'atom compile s':>15} {'ratio':>6} "
          f"{'stock step ms':>14} {'atom step ms':>13} {'ratio':>6}")
    for family in args.families:
        s, a = [r for r in rows if r["family"] == family]
        print(f"{family:10} {s['compile_s']:16.2f} {a['compile_s']:15.2f} {a['compile_s'] / s['compile_s']:6.2f} "
              f"{s['step_ms']:14.3f} {a['step_ms']:13.3f} {a['step_ms'] / s['step_ms']:6.2f}")
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
