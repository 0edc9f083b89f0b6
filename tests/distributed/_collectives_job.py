"""One rank: a function with functional and in-place collectives, compiled at levels 1-3,
with the collectives inside Inductor pieces and named in splitting_ops; reports JSON.

    python _collectives_job.py RANK WORLD INIT_URL CACHE_ROOT OUT
"""

import json
import sys


def f(x, w):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    y = funcol.all_reduce(x @ w, "sum", group)
    z = funcol.all_gather_tensor(y.relu(), 0, group)
    r = funcol.reduce_scatter_tensor(z * 2, "sum", 0, group)
    t = r + 1
    dist.all_reduce(t)  # in place, as Dynamo traces it: a functional all_reduce and a copy back
    return t.sin()


CASES = {
    "level1": {"level": 1},
    "level2": {"level": 2},
    "level3": {"level": 3},
    "level3-split": {"level": 3, "splitting_ops": ["_c10d_functional.all_reduce",
                                                   "_c10d_functional.reduce_scatter_tensor"]},
}


def main():
    rank, world, init, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import atom_compile as ac

    torch.manual_seed(rank)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    expect = f(x, w)
    report = {}
    for name, cfg in CASES.items():
        torch._dynamo.reset()
        before = ac.compilation_counter.clone()
        got = torch.compile(f, backend=ac.backend(dict(cfg, cache_dir=root)), fullgraph=True)(x, w)
        c = ac.compilation_counter
        report[name] = {"err": (got - expect).abs().max().item(),
                        "pieces": c.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen,
                        "compiled": c.num_backend_compilations - before.num_backend_compilations}
    with open(out, "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
