"""A built-in post-grad pass: the projections of a CUDA piece call `atom::small_m_linear`.

At decode's one token per sequence a projection reads its whole weight for one row of output;
cuBLAS's GEMM tiles leave much of the bandwidth unused there (1.4-2.4 TB/s on an H200 for the
8-34 MB projections of a 1B model), the Triton GEMV of ops/triton_linear.py reaches 1.2-1.35x
that. The op decides per call, so one piece serves every size: one row (and, for a vocabulary-
wide layer, up to MAX_M rows) takes the Triton kernel, every other call is `F.linear`, the same
cuBLAS call Inductor would have made. Only `mm(x, W.T)` and `addmm(bias, x, W.T)` (a [N]
bias: Qwen2's qkv) with `W` a 2-D half-precision CUDA input of the piece (a parameter) are
rewritten; any other matmul keeps Inductor's lowering.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _transposed_weight(node: object, devices: tuple = ("cuda",)) -> Optional[fx.Node]:
    """`W` where `node` is `W.T` (aten.t or permute [1, 0]) of a 2-D half-precision placeholder
    on one of `devices` with unit inner stride; else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    is_t = node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0])
    weight = node.args[0] if is_t else None
    val = weight.meta.get("val") if isinstance(weight, fx.Node) and weight.op == "placeholder" else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or val.dtype not in _HALF or val.device.type not in devices:
        return None
    return weight if val.stride(1) == 1 else None


def _x_fits(x: object, weight: fx.Node) -> bool:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2 and val.dtype == weight.meta["val"].dtype


def _bias_fits(bias: object, weight: fx.Node) -> bool:
    """A [N] bias of the weight's dtype and rows with unit stride (Qwen2's qkv), as the op takes."""
    val, w = (bias.meta.get("val") if isinstance(bias, fx.Node) else None), weight.meta["val"]
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == w.shape[0] \
        and val.dtype == w.dtype and val.stride(0) == 1


def _projection(node: fx.Node, devices: tuple) -> Optional[tuple]:
    """(x, W, bias or None) where `node` is `mm(x, W.T)` or `addmm(bias, x, W.T)` (alpha and
    beta 1, a [N] bias) of a piece's parameter `W` on one of `devices`; else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default and len(node.args) == 2:
        bias, (x, wt) = None, node.args
    elif node.target is aten.addmm.default and len(node.args) == 3:
        bias, x, wt = node.args
    else:
        return None
    weight = _transposed_weight(wt, devices)
    if weight is None or not _x_fits(x, weight) or (bias is not None and not _bias_fits(bias, weight)):
        return None
    return x, weight, bias


def use_small_m_linear(graph: fx.Graph, devices: tuple = ("cuda",)) -> int:
    """Rewrite each `mm(x, W.T)` or `addmm(bias, x, W.T)` of a piece's parameter `W` (on one of
    `devices`: tests take the op's F.linear path on CPU) as `atom::small_m_linear(x, W, bias)`;
    the number rewritten."""
    from ..ops.linear import op

    target = op()
    rewritten = 0
    for node in list(graph.nodes):
        found = _projection(node, devices)
        if found is None:
            continue
        wt = node.args[-1]
        with graph.inserting_before(node):
            call = graph.call_function(target, found)
        call.meta.update(node.meta)  # same shape, dtype and (contiguous) layout as the mm's
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
        rewritten += 1
    return rewritten


class SmallMLinearPass(CustomGraphPass):
    """`use_small_m_linear` as an Inductor custom pass, keyed by its source."""

    def __call__(self, graph: fx.Graph) -> None:
        use_small_m_linear(graph)

    def uuid(self) -> str:
        source = "".join(inspect.getsource(f) for f in (use_small_m_linear, _transposed_weight, _x_fits))
        return hashlib.sha256(source.encode()).hexdigest()[:32]
