"""The package's error base: every error atom-compile raises on purpose derives from
`AtomCompileError`, so a host engine can catch ours apart from torch's. Each subclass also keeps
the builtin base its callers already catch (`ValueError` for bad input, `RuntimeError` for a
failed compile or run)."""

from __future__ import annotations


class AtomCompileError(Exception):
    """Base of every error atom-compile raises on purpose."""
