"""The plain-torch reference of a decode step's attention, shared by the kernel checks."""

from __future__ import annotations

import torch

from atom_compile.ops import attention as ref


def reference(q, k, v, cache, meta, scale):
    """(output, cache) of the pure-torch reference on a copy of `cache`: write the step's keys
    and values, then attend."""
    want = torch.zeros_like(q)
    cache_ref = cache.clone()
    ref.write_kv(k, v, cache_ref, meta.slot_mapping)
    ref._torch_paged_attention(q, cache_ref[0], cache_ref[1], want, meta, scale)
    return want, cache_ref
