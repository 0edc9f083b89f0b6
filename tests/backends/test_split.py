import operator

import torch
import torch.fx as fx

from atom_compile.backends.split import split_graph, target_names


def _dynamo_graph(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def _two_attentions(x):
    x = x + 1
    out = torch.empty_like(x)
    out2 = torch.empty_like(x)
    torch.ops.silly.attention(x, x, x, out)
    torch.ops.silly.attention(out, out, out, out2)  # adjacent to the first: one piece
    y = out2 * 2
    out3 = torch.empty_like(y)
    torch.ops.silly.attention(y, y, y, out3)
    return out3 - 1


def test_split_at_op_written_three_ways_keeps_order_and_semantics():
    x = torch.randn(4, 3)
    gm = _dynamo_graph(_two_attentions, x)
    for spelling in ("silly.attention", "silly::attention", "silly::attention.default"):
        split_gm, items = split_graph(gm, [spelling])
        assert [i.is_splitting_graph for i in items] == [False, True, False, True, False], spelling
        assert [i.graph_id for i in items] == sorted(i.graph_id for i in items)
        assert torch.allclose(split_gm(x)[0], _two_attentions(x))
    # the piece holding the consecutive splitting ops has both
    split_gm, items = split_graph(gm, ["silly.attention"])
    calls = [n for n in items[1].graph.graph.nodes if n.op == "call_function" and "silly" in str(n.target)]
    assert len(calls) == 2


def test_no_splitting_ops_gives_one_piece():
    x = torch.randn(4, 3)
    split_gm, items = split_graph(_dynamo_graph(_two_attentions, x), [])
    assert len(items) == 1 and not items[0].is_splitting_graph
    assert torch.allclose(split_gm(x)[0], _two_attentions(x))


def test_getitem_stays_with_its_producer():
    def f(x):
        a, b = torch.split(x, 2, dim=1)  # getitem nodes follow the split
        out = torch.empty_like(a)
        torch.ops.silly.attention(a, b, a, out)
        return out

    gm = _dynamo_graph(f, torch.randn(4, 4))
    _, items = split_graph(gm, ["silly.attention"])
    first = items[0].graph.graph
    assert any(n.target is operator.getitem for n in first.nodes)
    assert not any(n.target is operator.getitem for n in items[1].graph.graph.nodes)


def test_torch_function_matches_its_aten_name():
    def attn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).relu()

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    gm = _dynamo_graph(attn, q, k, v)
    sdpa = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot" in str(n.target)][0]
    assert "aten::scaled_dot_product_attention" in target_names(sdpa.target)
    split_gm, items = split_graph(gm, ["aten::scaled_dot_product_attention"])
    assert [i.is_splitting_graph for i in items] == [True, False]
    assert torch.allclose(split_gm(q, k, v)[0], attn(q, k, v))


def test_plain_fx_graph():
    class M(torch.nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            torch.ops.silly.attention(x, x, x, out)
            return out + x

    gm = fx.symbolic_trace(M())
    split_gm, items = split_graph(gm, ["silly.attention"])
    assert [i.is_splitting_graph for i in items] == [False, True, False]  # empty_like | op | add
    x = torch.randn(3)
    assert torch.allclose(split_gm(x), 4 * x)
