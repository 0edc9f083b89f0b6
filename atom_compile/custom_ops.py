"""Register custom ops that Dynamo sees, and mark them as splitting ops or eager regions.

Ops are registered through `torch.library.Library(...).define/impl` (a FRAGMENT library on the
`aiter` namespace by default): that dispatches in about 1-3 us, against 7-15 us for
`torch.library.custom_op`, which matters for ops that run eagerly between graph segments.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from .errors import AtomTypeError, AtomValueError
from .forward_context import get_forward_context

logger = logging.getLogger("atom_compile")

DEFAULT_NAMESPACE = "aiter"
DEFAULT_DISPATCH_KEYS = ("CPU", "CUDA")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


@dataclass
class RegisteredOp:
    qualname: str  # "ns::name"
    schema: str  # "(Tensor q, ...) -> ()"
    op_func: Callable
    fake_impl: Optional[Callable]
    splitting: bool
    eager_region: bool
    bind_region: Optional[Callable] = None

    def source_digest_material(self) -> str:
        """Source of the implementation and fake, for the cache key (Inductor's key names an op
        but does not hash its Python code)."""
        parts = [self.qualname, self.schema]
        for fn in (self.op_func, self.fake_impl):
            if fn is None:
                continue
            try:
                parts.append(inspect.getsource(fn))
            except (OSError, TypeError):
                parts.append(getattr(fn, "__qualname__", repr(fn)))
        return "\n".join(parts)


_libraries: dict[str, torch.library.Library] = {}
_registered: dict[str, RegisteredOp] = {}
_splitting: set[str] = set()
_eager_regions: set[str] = set()


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _libraries[namespace]


def existing_schema(qualname: str) -> Optional[str]:
    """The schema of an op already known to the dispatcher (ours or anyone's), or None."""
    name, _, overload = qualname.partition(".")
    try:
        return str(torch._C._get_schema(name, overload))
    except RuntimeError:
        return None


def _strip_name(schema: str) -> str:
    return schema[schema.index("(") :] if "(" in schema else schema


def _with_eager_region(qualname: str, op_func: Callable, bind_region: Optional[Callable]) -> Callable:
    def impl(*args: Any, **kwargs: Any) -> Any:
        recorder = get_forward_context().region_recorder
        if recorder is not None:
            return recorder.eager_region(op_func, args, kwargs, name=qualname, bind=bind_region)
        return op_func(*args, **kwargs)

    impl.__name__ = getattr(op_func, "__name__", "eager_region")
    impl.__wrapped__ = op_func  # type: ignore[attr-defined]
    return impl


def _register_again(qualname: str, schema: str, splitting: bool, eager_region: bool) -> bool:
    """True if `qualname` is already registered (its marks are updated); a different schema
    under the same name is a ValueError."""
    previous = _registered.get(qualname)
    if previous is None and existing_schema(qualname) is None:
        return False
    known = previous.schema if previous is not None else _strip_name(existing_schema(qualname) or "")
    if known != schema:
        raise AtomValueError(
            f"{qualname} is already registered with schema {known}; "
            f"refusing to register {schema} under the same name"
        )
    if previous is not None:
        previous.splitting |= splitting
        previous.eager_region |= eager_region
    _mark(qualname, splitting, eager_region)
    return True


def direct_register_custom_op(
    op_name: str,
    op_func: Callable,
    mutates_args: Sequence[str],
    fake_impl: Optional[Callable] = None,
    target_lib: Optional[torch.library.Library] = None,
    dispatch_key: Optional[str | Iterable[str]] = None,
    tags: tuple = (),
    splitting: bool = False,
    eager_region: bool = False,
    bind_region: Optional[Callable] = None,
) -> Any:
    """Register `op_func` as `torch.ops.<ns>.<op_name>` and return the op packet.

    The schema is inferred from `op_func`'s annotations. `splitting=True` makes the op a
    piecewise split point wherever it appears; `eager_region=True` makes it a break in token
    graphs (it runs for real between recorded segments, reading the live forward context).
    `bind_region(*args, **kwargs)`, for an eager region, is called once when a token graph records
    it (after the op ran), on the recording's tensors; it may return a zero-argument callable that
    replays the op on them with less host work (checking itself that what it bound is still what
    the op would read, else running the op), or None. It may run the op again.
    Registering the same op again is a no-op (its marks are updated); a different schema under
    an existing name is a ValueError.
    """
    if not isinstance(op_name, str) or not _IDENT.match(op_name):
        raise AtomValueError(f"op_name: got {op_name!r}; allowed: a Python identifier (no namespace)")
    if not callable(op_func):
        raise AtomTypeError(f"op_func: got {type(op_func).__name__}; allowed: a callable")
    lib = target_lib if target_lib is not None else _library(DEFAULT_NAMESPACE)
    namespace = getattr(lib, "ns", DEFAULT_NAMESPACE)
    qualname = f"{namespace}::{op_name}"
    try:
        schema = torch.library.infer_schema(op_func, mutates_args=list(mutates_args))
    except (ValueError, TypeError) as exc:
        raise AtomValueError(f"{qualname}: cannot infer a schema from op_func's annotations: {exc}") from None

    if _register_again(qualname, schema, splitting, eager_region):
        return getattr(getattr(torch.ops, namespace), op_name)

    if fake_impl is None:
        returns = schema.split("->", 1)[1].strip()
        if returns not in ("()", "None"):
            raise AtomValueError(f"{qualname} returns {returns}: give a fake_impl so Dynamo can trace it")

        def fake_impl(*args: Any, **kwargs: Any) -> None:
            return None

    lib.define(op_name + schema, tags=tuple(tags))
    kernel = _with_eager_region(qualname, op_func, bind_region) if eager_region else op_func
    for key in _dispatch_keys(dispatch_key):
        lib.impl(op_name, kernel, key)
    lib._register_fake(op_name, fake_impl)
    _registered[qualname] = RegisteredOp(qualname, schema, op_func, fake_impl, splitting, eager_region, bind_region)
    _mark(qualname, splitting, eager_region)
    return getattr(getattr(torch.ops, namespace), op_name)


def _dispatch_keys(dispatch_key: Optional[str | Iterable[str]]) -> tuple[str, ...]:
    if dispatch_key is None:
        return tuple(DEFAULT_DISPATCH_KEYS)
    return (dispatch_key,) if isinstance(dispatch_key, str) else tuple(dispatch_key)


def _mark(qualname: str, splitting: bool, eager_region: bool) -> None:
    if splitting:
        _splitting.add(qualname)
    if eager_region:
        _eager_regions.add(qualname)


def mark_splitting_op(qualname: str) -> None:
    """Make an op registered elsewhere (e.g. by a real aiter) a split point by name."""
    from .config import normalize_op_name

    _splitting.add(normalize_op_name(qualname, "qualname").split(".")[0])


def registered_splitting_ops() -> frozenset[str]:
    return frozenset(_splitting)


def is_eager_region_op(qualname: str) -> bool:
    return qualname in _eager_regions


def registered_op(qualname: str) -> Optional[RegisteredOp]:
    return _registered.get(qualname)
