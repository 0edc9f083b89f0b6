"""The L2 prefetch pass: before each attention of a split graph, an atom::l2_prefetch of the
weights the next piece multiplies by (first-read order, a byte budget, the last one cut), one
atom::l2_prefetch_join before the output; on Dynamo's graphs of a layered model, whose split
graph still computes what the model does. Off the GPU (and outside a capture) the ops do
nothing, so the compile path leaves CPU graphs alone."""

import pytest
import torch
import torch.fx as fx

import atom_compile as ac
from atom_compile.backends import l2_prefetch_pass
from atom_compile.backends.split import split_graph
from atom_compile.errors import ConfigError

HIDDEN, INTER, LAYERS = 128, 512, 2  # o: 64 KB, the smallest the pass asks for
WEIGHT = {"o": HIDDEN * HIDDEN * 4, "gate_up": 2 * INTER * HIDDEN * 4, "down": HIDDEN * INTER * 4,
          "qkv": 3 * HIDDEN * HIDDEN * 4}


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(HIDDEN))  # read by a mul, not a matmul: never fetched
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down = torch.nn.Parameter(torch.randn(HIDDEN, INTER) / INTER ** 0.5)  # as x @ w.t()

    def forward(self, h):
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        out = torch.empty_like(q)
        torch.ops.silly.attention(q, k, v, out)
        h = h + self.o(out)
        gate, up = self.gate_up(h * self.norm).chunk(2, dim=-1)
        return h + (torch.nn.functional.silu(gate) * up) @ self.down.t()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _split(model, h):
    """The split graph of Dynamo's trace, its pieces, and the inputs Dynamo called it with."""
    seen = {}

    def capture(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=True, dynamic=True)(h)
    return (*split_graph(seen["gm"], ["silly::attention"]), seen["inputs"])


def _prefetches(split_gm):
    return [n for n in split_gm.graph.nodes if n.target is torch.ops.atom.l2_prefetch.default]


def _weight_of(node: fx.Node) -> str:
    return next(name for name in WEIGHT if f"_{name}_" in node.name or node.name.endswith(f"_{name}"))


@pytest.fixture(scope="module")
def traced():
    model = Model().requires_grad_(False)
    h = torch.randn(5, HIDDEN)
    return model, h


def test_each_attention_fetches_the_next_pieces_weights_in_read_order(traced):
    model, h = traced
    split_gm, items, inputs = _split(model, h)
    want = model(h)
    assert l2_prefetch_pass.insert(split_gm, items, budget=1 << 30) == LAYERS
    forks = _prefetches(split_gm)
    # after layer 0's attention the piece runs o, gate_up, down, then layer 1's qkv; after the
    # last one, o, gate_up, down
    read = [[_weight_of(n) for n in fork.args[0]] for fork in forks]
    assert read == [["o", "gate_up", "down", "qkv"], ["o", "gate_up", "down"]]
    assert all(fork.args[1] == [WEIGHT[w] for w in names] for fork, names in zip(forks, read))
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    for fork in forks:  # each right before an attention piece
        assert fork.next.op == "call_module" and fork.next in calls
    joins = [n for n in split_gm.graph.nodes if n.target is torch.ops.atom.l2_prefetch_join.default]
    assert len(joins) == 1 and joins[0].next.op == "output"
    torch.testing.assert_close(split_gm(*inputs)[0], want)  # on the CPU the ops do nothing


def test_the_budget_cuts_the_last_weight_and_stops():
    model = Model().requires_grad_(False)
    h = torch.randn(3, HIDDEN)
    split_gm, items, _ = _split(model, h)
    budget = WEIGHT["o"] + 100_000
    assert l2_prefetch_pass.insert(split_gm, items, budget=budget) == LAYERS
    for fork in _prefetches(split_gm):
        assert [_weight_of(n) for n in fork.args[0]] == ["o", "gate_up"]
        assert fork.args[1] == [WEIGHT["o"], 100_000 // 16 * 16]


def test_a_budget_under_one_chunk_puts_nothing_in():
    model = Model().requires_grad_(False)
    split_gm, items, _ = _split(model, torch.randn(3, HIDDEN))
    code = split_gm.code
    assert l2_prefetch_pass.insert(split_gm, items, budget=l2_prefetch_pass.MIN_BYTES - 16) == 0
    assert split_gm.code == code


def test_cpu_compiles_keep_their_graphs():
    before = ac.compilation_counter.num_l2_prefetches
    cc = ac.CompilationConfig(level=3, cudagraph_mode="FULL", splitting_ops=["silly::attention"])
    torch._dynamo.reset()
    model = Model().requires_grad_(False)
    h = torch.randn(4, HIDDEN)
    got = torch.compile(model, backend=ac.backend(ac.Config(compilation_config=cc)), fullgraph=True)(h)
    torch.testing.assert_close(got, model(h), atol=1e-4, rtol=1e-4)
    assert ac.compilation_counter.num_l2_prefetches == before
    assert l2_prefetch_pass.budget_bytes(None, torch.device("cpu")) == 0


def test_a_token_graphs_recording_is_seen():
    """The op forks nothing while a token graph records (ops/l2_prefetch.py): the recording's
    forward context carries its recorder, the capture loop's says "record"."""
    from atom_compile.forward_context import ForwardContext, push_forward_context
    from atom_compile.ops.l2_prefetch import recording_token_graph

    assert not recording_token_graph()
    for ctx in (ForwardContext(region_recorder=object()), ForwardContext(tr_graph="record")):
        with push_forward_context(ctx):
            assert recording_token_graph()
    with push_forward_context(ForwardContext(tr_graph="replay")):
        assert not recording_token_graph()


def test_the_ops_are_no_ops_off_a_capture():
    w = torch.randn(64, 64)
    torch.ops.atom.l2_prefetch([w], [w.numel() * 4])
    torch.ops.atom.l2_prefetch_join(w)


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_bad_budgets_are_refused(value):
    with pytest.raises(ConfigError, match="l2_prefetch_mb"):
        ac.CompilationConfig(l2_prefetch_mb=value)


def test_a_budget_set_is_keyed():
    keys = {str(ac.CompilationConfig(level=3, l2_prefetch_mb=mb).hash_factors()) for mb in (None, 0, 8, 16)}
    assert len(keys) == 4
