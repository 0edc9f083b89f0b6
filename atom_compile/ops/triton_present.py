"""Whether Triton can be imported here (checked once: the ops ask on every CUDA call)."""

from __future__ import annotations

from typing import Optional

_PRESENT: Optional[bool] = None


def triton_available() -> bool:
    global _PRESENT
    if _PRESENT is None:
        try:
            import triton  # noqa: F401

            _PRESENT = True
        except ImportError:
            _PRESENT = False
    return _PRESENT
