"""Custom Inductor post-grad passes (vLLM's inductor passes), named and hashed.

A pass is a callable over a `torch.fx.Graph` that edits it in place, or a
"package.module:name" string naming one. Its uuid() (when it has one) or else the sha256 of its
source is what enters the cache key, so a changed pass recompiles. Floor 0: no torch import.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from typing import Any, Callable

from .errors import ConfigError

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
FIELD = "CompilationConfig.inductor_passes"


def check_pass(spec: Any) -> Any:
    """`spec` if it is a callable or a 'package.module:name' string; else ConfigError."""
    if isinstance(spec, str) and _SPEC.match(spec):
        return spec
    if callable(spec) and not isinstance(spec, (str, type)):
        return spec
    raise ConfigError(FIELD, spec, "callables over a torch.fx.Graph or 'package.module:name' strings")


def resolve_pass(spec: Any) -> Callable:
    """The callable that `spec` names (imported for a string)."""
    if not isinstance(spec, str):
        return spec
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(FIELD, spec, f"an importable 'package.module:name' ({exc})") from None
    return check_pass(obj)


def pass_name(spec: Any) -> str:
    """'module:qualname' for a callable (its class's for an instance), the string itself else."""
    if isinstance(spec, str):
        return spec
    target = spec if inspect.isfunction(spec) or inspect.ismethod(spec) else type(spec)
    return f"{target.__module__}:{target.__qualname__}"


def pass_uuid(spec: Any) -> str:
    """The pass's own uuid() if it has one, else the sha256 of its source (its class's source
    for an instance); a pass without either is an error, since it could not be keyed."""
    fn = resolve_pass(spec)
    uuid = getattr(fn, "uuid", None)
    if callable(uuid):
        return str(uuid())
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        raise ConfigError(FIELD, spec, "a pass with a uuid() method or readable source") from None
    return hashlib.sha256(source.encode()).hexdigest()[:32]


def pass_factors(specs: list) -> dict[str, str]:
    """{name: uuid} in order, for the cache key (diff_factors then names a changed pass)."""
    return {f"{i}:{pass_name(s)}": pass_uuid(s) for i, s in enumerate(specs)}
