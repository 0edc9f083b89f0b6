"""The small-M linear graph pass on CPU: which pieces it applies to, what it rewrites, and that
the rewritten graph computes the same thing (the op is F.linear wherever the kernel does not run)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from atom_compile.backends import small_m_linear
from atom_compile.ops import linear as linear_op


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(24, 16))
        self.b1 = torch.nn.Parameter(torch.randn(24))
        self.w2 = torch.nn.Parameter(torch.randn(8, 24))

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w1, self.b1)), weight=self.w2)


def test_rewrite_replaces_every_linear_and_keeps_the_result():
    torch.manual_seed(0)
    module = TwoLinears()
    graph = fx.symbolic_trace(module)
    out, count = small_m_linear.rewrite(graph)
    assert count == 2
    targets = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert targets.count(linear_op.op()) == 2 and F.linear not in targets
    assert sum(n.target is F.linear for n in graph.graph.nodes) == 2  # the original is untouched
    x = torch.randn(3, 16)
    torch.testing.assert_close(out(x), module(x), atol=0, rtol=0)
    x3 = torch.randn(2, 3, 16)  # leading batch dims flatten inside the op
    torch.testing.assert_close(out(x3), module(x3), atol=0, rtol=0)


def test_applies_only_to_small_sizes_on_cuda():
    cpu = [torch.randn(2, 4)]
    assert not small_m_linear.applies(1, cpu)
    meta = [torch.empty(2, 4, device="meta")]
    assert not small_m_linear.applies(4, meta)
    if torch.cuda.is_available():
        gpu = [torch.randn(2, 4, device="cuda")]
        assert small_m_linear.applies(linear_op.MAX_M, gpu) and not small_m_linear.applies(linear_op.MAX_M + 1, gpu)


def test_graph_without_linear_is_returned_as_is():
    graph = fx.symbolic_trace(lambda x: x * 2)
    assert small_m_linear.rewrite(graph) == (graph, 0)
