"""Every decoder family once on the important path: level 3, split at SDPA, the standalone
compiler, dynamic=True. Other combinations run on one family each (test_matrix.py)."""

from __future__ import annotations

import pytest

from atom_compile.counters import compilation_counter

from .families import FAMILIES, tiny_model
from .helpers import config, check_matches_eager


@pytest.mark.parametrize("family", FAMILIES)
def test_level3_standalone_dynamic(family, model_cache):
    model = tiny_model(family)
    before = compilation_counter.clone()
    backend = check_matches_eager(model, config(3, "inductor_standalone", model_cache))
    # split at SDPA: attention runs between compiled pieces
    assert compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen >= 3
    assert any(item.is_splitting_graph for item in backend.result.items)
