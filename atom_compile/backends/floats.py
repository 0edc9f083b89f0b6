"""Python floats that Dynamo made symbolic, and scalar nodes that are constants, before a split.

With `dynamic=True` (`specialize_float=False`) Dynamo passes a Python float that reaches a tensor
op (SDPA's `scale`, LayerNorm's `eps`, a RoPE factor) into the graph as a 0-d float64 tensor and
reads it back with `.item()`. Inductor's full `compile_fx` copes by a joint-graph pass that either
turns the float arithmetic into tensor arithmetic or, where it cannot, asks Dynamo to specialise
the float and trace again (`TensorifyScalarRestartAnalysis`). Pieces compiled on their own never
run that pass and receive an unbacked float (`GuardOnDataDependentSymNode`).

`specialize_tensorified_floats` does what that pass does in its fallback, before anything is
compiled: it records every such float in Dynamo's `TensorifyState` and raises the restart Dynamo
already handles. Dynamo traces the frame again with those floats as constants (guarded by value)
and calls the backend once more: one graph, nothing compiled twice.

`fold_constant_scalars` replaces scalar (SymInt/SymFloat/SymBool) nodes whose value is a known
constant by that constant (GPT-2 computes `sym_sqrt` of its head size), so that no such node
becomes a value crossing a split boundary.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

logger = logging.getLogger("atom_compile")

__all__ = ["fold_constant_scalars", "specialize_tensorified_floats", "tensorified_floats"]


def _float_symbol_name(node: fx.Node) -> str | None:
    """The SymFloat symbol (`zf0`) of a placeholder that Dynamo made from a Python float, or None."""
    if node.op != "placeholder":
        return None
    value = node.meta.get("example_value")
    memo = getattr(value, "item_memo", None) if isinstance(value, FakeTensor) else None
    if memo is None or not node.users:
        return None
    expr = getattr(memo.node, "_expr", None)
    if not hasattr(expr, "name"):
        return None
    if not all(u.op == "call_method" and u.target == "item" for u in node.users):
        return None
    return str(expr.name)


def tensorified_floats(gm: fx.GraphModule) -> dict[str, str]:
    """Placeholder name -> float symbol, for every Python float Dynamo passed as a 0-d tensor."""
    out = {}
    for node in gm.graph.nodes:
        name = _float_symbol_name(node)
        if name is not None:
            out[node.name] = name
    return out


def specialize_tensorified_floats(gm: fx.GraphModule) -> None:
    """Ask Dynamo to trace again with this graph's tensorified floats as constants.

    Raises `TensorifyScalarRestartAnalysis` (Dynamo catches it and calls the backend again with
    the new graph) when the graph has floats not yet marked; returns when there are none. A float
    already marked but still present (Dynamo could not specialise it) is left to the piece.
    """
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    floats = tensorified_floats(gm)
    new = sorted({s for s in floats.values() if not TensorifyState.should_specialize(s)})
    if not new:
        return
    for symbol in new:
        TensorifyState.specialize(symbol)
    logger.info("atom-compile: %d Python float input(s) (%s) become constants: Dynamo traces the frame "
                "again (a restart, not a second graph)", len(floats), ", ".join(sorted(floats)))
    raise TensorifyScalarRestartAnalysis


def _constant_of(value: object) -> object:
    """The Python constant a symbolic scalar stands for, or None when it has free symbols."""
    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return None
    expr = value.node.expr
    if getattr(expr, "free_symbols", None):
        return None
    if isinstance(value, torch.SymBool):
        return bool(expr)
    if isinstance(value, torch.SymInt):
        return int(expr)
    number = float(expr)
    return number if math.isfinite(number) else None


def fold_constant_scalars(gm: fx.GraphModule) -> int:
    """Replace scalar nodes whose value is a constant by the constant; return how many."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        constant = _constant_of(node.meta.get("example_value"))
        if constant is None:
            continue
        node.replace_all_uses_with(constant)  # type: ignore[arg-type]
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded
