"""Models the backend cannot compile: one clear error instead of a torch internal assertion."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AtomCompileError


class ModelCompileError(AtomCompileError, RuntimeError):
    """A model (graph) that atom-compile could not compile at the level asked for."""


def model_name() -> str:
    """The class whose forward Dynamo was tracing (`LlamaForCausalLM`), or 'the model'.

    Dynamo records inlined code when its inlining ends, so the outermost `forward` is the last
    one; decorators on it (transformers' `deprecate_kwarg`) show up as `<locals>` qualnames."""
    tc = torch._guards.TracingContext.try_get()
    methods = [getattr(code, "co_qualname", "") for code in getattr(tc, "traced_code", None) or []]
    methods = [q for q in methods if "." in q and "<locals>" not in q]
    for qualname in sorted(reversed(methods), key=lambda q: not q.endswith(".forward")):
        return qualname.rsplit(".", 1)[0]
    return "the model"


def explain(exc: BaseException, level: int, prefix: str) -> ModelCompileError:
    """One paragraph naming the model class, the level and what to do, chained to `exc`."""
    name = model_name()
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return ModelCompileError(
        f"atom-compile could not compile {name} at level {level} (graph {prefix!r}): {what}. "
        f"Try a lower level (level 2 compiles the graph in one piece, level 1 runs it as Dynamo traced "
        f"it), or compiler='eager' to see whether Inductor is the cause; run with "
        f"TORCH_LOGS=graph_breaks,recompiles for Dynamo's side, and report it with the model class and "
        f"torch {torch.__version__}."
    )


def is_restart(exc: BaseException) -> bool:
    """Exceptions Dynamo uses to restart or skip, which must pass through untouched."""
    from torch._dynamo import exc as dynamo_exc

    passthrough: tuple[Any, ...] = (dynamo_exc.RestartAnalysis, dynamo_exc.SkipFrame, AtomCompileError)
    return isinstance(exc, passthrough)
