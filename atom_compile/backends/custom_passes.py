"""CompilationConfig.inductor_passes as Inductor's post_grad_custom_post_pass.

Inductor runs one `post_grad_custom_post_pass` on the post-grad graph; `PostGradPasses` is a
`CustomGraphPass` that runs the configured passes in order. Its uuid() (the passes' uuids, see
passes.py) lets Inductor's own FX graph cache key on it, and its repr is that uuid, so the
content key of a piece (which hashes the compiler config's reprs) changes with a pass.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..config import DEFAULT_SPLITTING_OPS, CompilationConfig
# the ops the built-in passes put into pieces, registered before any saved piece that calls
# them is loaded (a warm start of a model that imports neither)
from ..ops import glu_linear, linear, prologue_linear, rope_linear, split_norm  # noqa: F401
from ..passes import pass_factors, resolve_pass
from . import graph_partition
from .reductions import ROW_LIMIT_KEY
from .residual_add import ResidualAddPass
from .epilogue_pass import EpiloguePass
from .glu_pass import GluPass
from .prologue_pass import ProloguePass
from .rope_pass import RopePass
from .small_m_pass import SmallMLinearPass

POST_PASS_KEY = "post_grad_custom_post_pass"
PDL_OPTION = "triton.enable_pdl"  # Inductor's programmatic dependent launch (torch >= 2.10)
COMBO_OPTION = "combo_kernels"  # Inductor's horizontal fusion of a piece's independent kernels


def _inductor_has(option: str) -> bool:
    """Whether this torch's Inductor config has `option` (a dotted name, as the options dict spells it)."""
    import torch._inductor.config as inductor_config

    node = inductor_config
    for part in option.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


class PostGradPasses(CustomGraphPass):
    """The configured passes, in order, as one Inductor post-grad pass."""

    def __init__(self, specs: list) -> None:
        self.passes: list[Callable] = [resolve_pass(s) for s in specs]
        blob = json.dumps(pass_factors(specs), sort_keys=True).encode()
        self._uuid = hashlib.sha256(blob).hexdigest()[:32]

    def __call__(self, graph: fx.Graph) -> None:
        for fn in self.passes:
            fn(graph)

    def uuid(self) -> str:
        return self._uuid

    def __repr__(self) -> str:
        return f"PostGradPasses({self._uuid})"


def compiler_config(cc: CompilationConfig) -> dict[str, Any]:
    """The Inductor options a piece compiles with: inductor_compile_config, the passes (the
    built-in ones first, those that are on: residual add, small-M linear, the GLU and RoPE
    epilogues, prologues: an MLP's activation goes into gate_up rather than into down), Inductor
    graph partition's (when use_inductor_graph_partition is on), and PDL and combo kernels on
    where Inductor has them (inductor_compile_config={"triton.enable_pdl": False} or
    {"combo_kernels": False} keeps them off), and the persistent rows' limit (reductions.py)."""
    out = dict(cc.inductor_compile_config)
    out.update(graph_partition.inductor_options(cc, DEFAULT_SPLITTING_OPS))
    if PDL_OPTION not in out and _inductor_has(PDL_OPTION):
        # Inductor's Triton kernels wait for the kernel before and let the next one launch
        # early: on GPUs of compute capability >= 9 only (Inductor checks), as ours do
        # (ops/pdl.py); a decode step is some 130 kernels of a few microseconds each
        out[PDL_OPTION] = True
    if COMBO_OPTION not in out and _inductor_has(COMBO_OPTION):
        # independent pointwise kernels of a piece (a layer's RoPE of q and of k) launched as
        # one: 1.5% off the decode step on an H100 (benchmarks/decode_ab.py); Inductor leaves
        # CPU kernels out of them
        out[COMBO_OPTION] = True
    if cc.persistent_reduction_max:
        out[ROW_LIMIT_KEY] = cc.persistent_reduction_max
    passes = ([ResidualAddPass()] if cc.residual_add_pass else []) \
        + ([SmallMLinearPass()] if cc.small_m_linear_pass else []) \
        + ([GluPass()] if cc.glu_fused() else []) + ([RopePass()] if cc.rope_pass else []) \
        + ([EpiloguePass()] if cc.epilogue_pass else []) + ([ProloguePass()] if cc.prologue_pass else []) \
        + list(cc.inductor_passes)
    if passes:
        out[POST_PASS_KEY] = PostGradPasses(passes)
    return out
