"""Compiling without running: the mode a fake-weight warm-up compiles in.

Inside `compile_only()` the model's weights and inputs are fake tensors (no memory). Dynamo
traces them as it traces real ones, and every piece compiles (or loads) as usual, but a
compiled piece is never installed where it would run: `piecewise.install` puts a `FakeRun`
in its place, which compiles the piece's concrete size when a call of that size arrives (as
the real piece would) and returns what the piece's graph gives on the fake inputs. Inductor's
code never runs on fake data.

What a fake build cannot give is refused here with `FakeWeightsError`, before anything is
compiled: a tensor left on the meta device (its graph and key would differ from the real
run's), a tensor constant whose value the fake build does not know (it would be baked into
the code), and Inductor's freezing (which bakes the weights themselves).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
import torch.fx as fx

from ..errors import AtomCompileError

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("atom_compile_compile_only", default=False)


class FakeWeightsError(AtomCompileError, ValueError):
    """A model that cannot be compiled from fake weights into the cache a real run loads."""


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Pieces compiled (or loaded) inside this block are never run: see the module's doc."""
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def active() -> bool:
    return _active.get()


def _is_fake_or_meta(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def check_graph(gm: fx.GraphModule, traced: list[Any], compiler_config: dict[str, Any]) -> None:
    """Refuse what a fake build would compile into a cache that a real run does not load, or
    loads with wrong values baked in."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, traced):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise FakeWeightsError(
                f"the traced graph reads {node.target!r} on the meta device: a tensor the fake build left "
                "there (not a parameter, buffer or tensor attribute of a module). Its device would key a "
                "cache that a real run never loads. Build it inside the model, or warm with real weights."
            )
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        attr: Any = gm
        for part in str(node.target).split("."):
            attr = getattr(attr, part, None)
        if isinstance(attr, torch.Tensor) and _is_fake_or_meta(attr):
            raise FakeWeightsError(
                f"the traced graph holds the tensor constant {node.target!r}, whose value a fake build does "
                "not know: Inductor would bake it into the compiled code. Pass it as a parameter or buffer, "
                "or warm with real weights."
            )
    from torch._inductor import config as inductor_config

    if compiler_config.get("freezing", inductor_config.freezing):
        raise FakeWeightsError(
            "Inductor's freezing is on: it bakes the weights' values into the compiled code, which a "
            "fake-weight warm-up does not have. Turn freezing off, or warm with real weights."
        )
