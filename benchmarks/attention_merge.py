"""The split attention's merge by its last span (tickets) against a second launch (an experiment, reverted: BENCHMARKS.md)."""
import os, sys, json
import torch
sys.path.insert(0, "benchmarks")
import attention_kernel as ak
from atom_compile.ops import triton_attention as ta
res = {}
for b in (1, 2, 4, 8, 16, 32):
    for merge_here in (True, False):
        for pf in ("0", "attention"):
            os.environ["ATOM_COMPILE_PREFETCH"] = pf
            ta.MERGE_IN_LAUNCH = merge_here
            ta._plans.clear()
            r = ak.bench(b, 1024, 200)
            key = f"bs{b} {'here' if merge_here else 'launch'} pf={pf}"
            res[key] = r
            print(f"{key:30s} op {r['op_us']:7.2f}  attn {r['graph_us']:7.2f}  eager {r['eager_us']:7.2f} splits {r['splits']}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "merge.json"), "w"), indent=1)
