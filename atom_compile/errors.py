"""The package's error base: every error atom-compile raises on purpose derives from
`AtomCompileError`, so a host engine can catch ours apart from torch's. Each subclass also keeps
the builtin base its callers already catch (`ValueError` for bad input, `RuntimeError` for a
failed compile or run)."""

from __future__ import annotations

from typing import Any


class AtomCompileError(Exception):
    """Base of every error atom-compile raises on purpose."""


class ConfigError(AtomCompileError, ValueError):
    """A config value that is not allowed; the message names field, value and what is allowed."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        super().__init__(f"{field_name}: got {value!r}; allowed: {allowed}")
        self.field_name = field_name
        self.value = value


class GraphBreakError(AtomCompileError, RuntimeError):
    """Dynamo handed one AtomBackend a second graph (a graph break or a recompilation)."""


class CacheMiss(AtomCompileError, RuntimeError):
    """A saved Dynamo function cannot be rebuilt from the cache (the caller traces instead)."""


class CacheRequired(AtomCompileError, RuntimeError):
    """Strict mode (ATOM_COMPILE_REQUIRE_CACHE=1, CompilationConfig.require_cache): a start that
    would compile. The message names the piece, the shape and the key factor that differed."""


class BufferMutationError(AtomCompileError, RuntimeError):
    """A compiled forward rebinds a registered buffer (silently skipped under CUDA graphs)."""


class RecompileError(AtomCompileError, RuntimeError):
    """A call that the compiled code was not traced for (it would need a new graph)."""


class IndexInvalid(AtomCompileError, ValueError):
    """A cache index document that does not validate (the message says why)."""


class AtomValueError(AtomCompileError, ValueError):
    """Bad input that is not a config field (a size, a name, an argument): the message names
    what was given and what is allowed."""


class AtomTypeError(AtomCompileError, TypeError):
    """An argument of the wrong kind (not an nn.Module, not a callable, ...)."""


class AtomRuntimeError(AtomCompileError, RuntimeError):
    """A call that cannot run as asked (no forward context, nothing to load, ...)."""
