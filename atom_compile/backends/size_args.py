"""Example inputs of one compile size, made from a piece's symbolic (fake) example inputs.

A compile size is normally compiled on the real inputs of its first call. The ranks of a
process group instead agree on every compile of a graph at once (group_compile.py), before
any call: each size's inputs are the piece's fake inputs with the token count bound to the
size, in the same fake mode, so their content key equals that of the real call's inputs.
"""

from __future__ import annotations

from typing import Any, Optional

import sympy
import torch


class _Unbound(Exception):
    """A size that does not follow from the token count alone (another symbol)."""


def size_args(args: list[Any], locator: list[int], size: int) -> Optional[list[Any]]:
    """`args` with the token count read at `locator` set to `size` (fake tensors of that shape,
    ints for symbolic ints); None when some size depends on another symbol too (that compile
    size then compiles at its first call, as without a group). Call inside the fake mode."""
    x = args[locator[0]]
    token = x if len(locator) == 1 else x.shape[locator[1]]
    symbol = token.node.expr if isinstance(token, torch.SymInt) else None
    if not isinstance(symbol, sympy.Symbol):
        return None

    def bind(value: Any) -> int:
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = value.node.expr.subs({symbol: size})
        if not expr.is_number:
            raise _Unbound(str(expr))
        return int(expr)

    out: list[Any] = []
    try:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                out.append(_bound_tensor(arg, bind))
            elif isinstance(arg, torch.SymInt):
                out.append(bind(arg))
            else:
                out.append(arg)
    except _Unbound:
        return None
    return out


def _bound_tensor(t: torch.Tensor, bind: Any) -> torch.Tensor:
    if not any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride())):
        return t  # a weight, a static buffer: as traced
    shape = [bind(s) for s in t.shape]
    stride = [bind(s) for s in t.stride()]
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    return out.requires_grad_(True) if t.requires_grad else out
