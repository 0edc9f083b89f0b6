"""CompilationConfig.use_inductor_graph_partition: Inductor partitions the graph, not FX.

With the option on, level 3 does not cut the traced graph at the splitting ops: the whole graph
is one piece, compiled once by Inductor (so Inductor fuses across what would have been piece
boundaries), with `graph_partition=True` and the splitting ops in
`custom_should_partition_ops`, Inductor's own partition points (torch >= 2.9; vLLM's
`use_inductor_graph_partition` sets up the same two options).

CUDA graphs per partition. Our runtime owns the CUDA graphs, and its piecewise mode (TR_HYBRID,
vLLM's PIECEWISE) does not wrap compiled pieces: a TokenGraph recording breaks at every op
registered as an eager region, whoever calls it. The compiled graph calls the splitting op
through the dispatcher (Inductor keeps a custom op as a fallback kernel), so the recording breaks
exactly at Inductor's partition points, one CUDA-graph segment per partition, as it does per FX
piece. Inductor's own CUDA graphs (`triton.cudagraphs`) and a customized partition wrapper stay
off: they would record into pools the runtime cannot share or budget. With nothing for Inductor
to record, it emits the partitions inline in one `call` (its partition functions only exist for
graphs it records itself); `partitions()` counts them as the runtime sees them.
"""

from __future__ import annotations

import logging
import operator
from typing import Iterable

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from ..config import CompilationConfig, CompilationLevel
from ..config_checks import graph_partition_unsupported
from ..counters import compilation_counter
from .split import SplitItem, is_splitting_node, resolve_splitting_ops

__all__ = ["enabled", "graph_partition_unsupported", "inductor_options", "partition_ops", "partitions",
           "whole_graph"]

logger = logging.getLogger("atom_compile")


def enabled(cc: CompilationConfig) -> bool:
    return bool(cc.use_inductor_graph_partition) and cc.level == CompilationLevel.PIECEWISE


def partition_ops(cc: CompilationConfig, default_ops: Iterable[str]) -> list[str]:
    """The op names Inductor partitions at: the configured splitting ops (else the defaults)
    plus ops registered with splitting=True, as `ns::op` (Inductor's name format)."""
    ops = cc.splitting_ops if cc.splitting_ops is not None else list(default_ops)
    return sorted(resolve_splitting_ops(ops))


def inductor_options(cc: CompilationConfig, default_ops: Iterable[str]) -> dict:
    """The Inductor config the whole graph compiles with (empty when the option is off)."""
    if not enabled(cc):
        return {}
    return {"graph_partition": True, "custom_should_partition_ops": partition_ops(cc, default_ops)}


def partitions(gm: fx.GraphModule, ops: Iterable[str]) -> int:
    """How many partitions the graph has at `ops`: each run of splitting-op calls is one, and
    so is each non-empty run of other computation between them."""
    names = frozenset(ops)
    count, previous = 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        split = is_splitting_node(node, names)
        if node.op == "call_function" and node.target is operator.getitem and previous is not None:
            continue  # unpacks the node before it: same partition
        if split != previous:
            count += 1
            previous = split
    return count


def whole_graph(gm: fx.GraphModule, ops: Iterable[str]) -> tuple[fx.GraphModule, list[SplitItem], int]:
    """The traced graph as one piece (the split module calls it as `submod_0`), its item, and
    the number of partitions Inductor cuts it into at `ops` (counted, and logged)."""
    split_gm = split_module(gm, None, lambda node: 0, keep_original_order=True)
    item = SplitItem("submod_0", 0, False, split_gm.submod_0)
    n = partitions(gm, ops)
    compilation_counter.num_inductor_partitions += n
    logger.info("atom-compile: Inductor graph partition: 1 graph, %d partitions at %s", n, ", ".join(ops) or "-")
    return split_gm, [item], n
