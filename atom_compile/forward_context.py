"""The forward context: per-step metadata that layers read instead of taking it as arguments.

A compiled or graph-replayed forward takes only `(input_ids, positions)`; attention finds its
metadata, its KV cache and its layer (by name) here. The context lives in a `ContextVar`, so
threads never see each other's step.

    with set_forward_context(attn_metadata, config, context=Context(positions, batch_size=4)):
        hidden = model(input_ids, positions)
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from .errors import AtomValueError

TokenGraphState = Optional[Literal["record", "replay"]]


@dataclass
class Context:
    """The step's most used state (seed, 'Context dataclass')."""

    positions: Optional[torch.Tensor] = None
    is_prefill: bool = False
    batch_size: int = 0  # sequences in the step
    running_bs: int = 0  # padded sequence count: the graph key and draft width
    running_tokens: int = 0  # padded row count
    is_draft: bool = False


@dataclass
class ForwardContext:
    """Everything a layer may need during one forward pass."""

    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    attn_metadata: Any = None
    kv_cache_data: dict[str, Any] = field(default_factory=dict)
    context: Optional[Context] = None
    dp_metadata: Any = None
    spec_decode_metadata: Any = None
    # token-graph state: None (run normally), "record" (capture loop) or "replay"
    tr_graph: TokenGraphState = None
    # set by the runtime while it records a token graph; eager regions hand themselves to it
    region_recorder: Any = field(default=None, repr=False)


_EMPTY = ForwardContext()
_current: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar(
    "atom_compile_forward_context", default=_EMPTY
)


class _ForwardContextScope:
    """Returned by set_forward_context: already active; as a context manager it restores the
    previous context on exit, whatever happens in the block."""

    __slots__ = ("context", "_token")

    def __init__(self, ctx: ForwardContext, token: contextvars.Token):
        self.context = ctx
        self._token = token

    def __enter__(self) -> ForwardContext:
        return self.context

    def __exit__(self, *exc: Any) -> None:
        self.reset()

    def reset(self) -> None:
        if self._token is not None:
            try:
                _current.reset(self._token)
            except ValueError:
                # set in another context (e.g. another thread): fall back to the empty context
                _current.set(_EMPTY)
            self._token = None


def set_forward_context(
    attn_metadata: Any,
    config: Any = None,
    context: Optional[Context] = None,
    dp_metadata: Any = None,
    spec_decode_metadata: Any = None,
    *,
    no_compile_layers: Optional[dict[str, Any]] = None,
    kv_cache_data: Optional[dict[str, Any]] = None,
    tr_graph: TokenGraphState = None,
) -> _ForwardContextScope:
    """Make a new forward context current; use it in a `with` block to reset it afterwards.

    `config` (a Config or CompilationConfig) supplies the layers registered by name
    (`static_forward_context`) unless `no_compile_layers` is given.
    """
    if tr_graph not in (None, "record", "replay"):
        raise AtomValueError(f"tr_graph: got {tr_graph!r}; allowed: None, 'record', 'replay'")
    if no_compile_layers is None:
        cc = getattr(config, "compilation_config", config)
        no_compile_layers = getattr(cc, "static_forward_context", None) or {}
    ctx = ForwardContext(
        no_compile_layers=no_compile_layers,
        attn_metadata=attn_metadata,
        kv_cache_data=kv_cache_data or {},
        context=context,
        dp_metadata=dp_metadata,
        spec_decode_metadata=spec_decode_metadata,
        tr_graph=tr_graph,
    )
    return _ForwardContextScope(ctx, _current.set(ctx))


def get_forward_context() -> ForwardContext:
    """The current forward context (an empty one outside any step)."""
    return _current.get()


def reset_forward_context() -> None:
    """Replace the current context with an empty ForwardContext (the seed's reset step)."""
    _current.set(_EMPTY)


def push_forward_context(ctx: ForwardContext) -> _ForwardContextScope:
    """Make an existing ForwardContext current (the runtime uses it to switch tr_graph state)."""
    return _ForwardContextScope(ctx, _current.set(ctx))
