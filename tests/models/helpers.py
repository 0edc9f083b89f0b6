"""Compile a tiny decoder through atom_compile.backend and compare it with eager."""

from __future__ import annotations

import torch

import atom_compile as ac
from atom_compile.counters import compilation_counter

from .families import SHAPES, inputs

SDPA = "aten::scaled_dot_product_attention"


def config(level: int, compiler: str, cache_dir: str) -> ac.CompilationConfig:
    extra = {"splitting_ops": [SDPA]} if level == 3 else {}
    return ac.CompilationConfig(level=level, compiler=compiler, cache_dir=cache_dir, **extra)


def check_matches_eager(model, cfg, *, fullgraph=True, dynamic=True, mark=False) -> ac.AtomBackend:
    """Calls of several batch sizes and lengths equal eager (1e-4); one graph, no recompiles."""
    backend = ac.backend(cfg)
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=True if dynamic else None)
    from torch._dynamo.utils import counters

    before = compilation_counter.clone()
    recompiles = sum(counters["recompiles"].values())
    with torch.no_grad():
        for batch, seq in SHAPES:
            x = inputs(batch, seq)
            if mark:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
            want = model(input_ids=x, use_cache=False).logits
            got = compiled(input_ids=x, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 1
    assert sum(counters["recompiles"].values()) == recompiles
    assert backend.compiled and not getattr(backend, "later", [])
    return backend
