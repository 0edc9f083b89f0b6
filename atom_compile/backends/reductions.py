"""Row reductions in one pass: Inductor's persistent reductions, for longer rows.

Inductor keeps a row in registers (a persistent reduction: the row is read once) only up to
1024 elements along it (InductorChoices.should_use_persistent_reduction). A longer row runs as
a loop that reads it twice: once for the sum, once to scale it. An RMSNorm over a 2048-8192
hidden is such a row; at decode's few rows its kernel is a program or a few, and each pass is a
round trip to memory. On an H100 the one-pass norms take 2.0% off the decode step at batch 1
and 1.3% at batch 8 (benchmarks/decode_ab.py, BENCHMARKS.md).

While a piece compiles, `persistent_rows(limit)` sets Inductor's choices handler to one that
also keeps rows of up to `limit` elements along the innermost dimension in registers where
Inductor refused only for their length: it asks Inductor's own heuristic again with the size
threshold of Inductor's multi-kernel mode (16 times the usual, 16384 along a row), so every other
rule of it (its switch, the block size a strict sum needs) still holds, and a row longer than
that stays a loop whatever the limit. CompilationConfig.persistent_reduction_max sets the limit
and enters our key. A choices handler the user installed stays in charge. Inductor's own
FX-graph cache does not key the handler; ours points Inductor's files at a directory of the
config's hash, and with our cache off a graph compiled under another limit may be reused from
Inductor's (its code is right either way).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Iterator, Optional

logger = logging.getLogger("atom_compile")

# the compiler option that carries the limit from CompilationConfig to the adaptors (never an
# Inductor option: backends/inductor.py takes it out of the patches)
ROW_LIMIT_KEY = "atom.persistent_reduction_max"


@functools.lru_cache(maxsize=None)
def _choices_class() -> Optional[type]:
    """The handler class, or None where this torch's Inductor decides otherwise (no choices
    handler, or a persistent-reduction heuristic of another shape)."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.choices import InductorChoices
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - torch without the choices handler
        return None
    base = getattr(InductorChoices, "should_use_persistent_reduction", None)
    if base is None or not hasattr(V, "set_choices_handler"):
        return None
    if list(inspect.signature(base).parameters)[:2] != ["features", "cooperative_reduction"]:
        return None

    class RowReductionChoices(InductorChoices):
        """Inductor's choices, with rows of up to `limit` elements reduced in registers."""

        def __init__(self, limit: int) -> None:
            super().__init__()
            self.limit = limit

        def should_use_persistent_reduction(self, features, cooperative_reduction):
            if base(features, cooperative_reduction):
                return True
            if (cooperative_reduction or features.get_reduction_hint() != ReductionHint.INNER
                    or not V.graph.sizevars.statically_known_leq(features.reduction_numel, self.limit)):
                return False
            # Inductor's own rules (its switch, strict sums' block size, ...) with only its size
            # threshold widened: its multi-kernel mode multiplies that threshold by 16
            with inductor_config.patch({"triton.multi_kernel": 1}):
                return base(features, cooperative_reduction)

        def uuid(self) -> str:  # Inductor keys its own cache by this where it asks
            return f"atom-compile-row-reductions-{self.limit}"

    return RowReductionChoices


def supported() -> bool:
    """Whether this torch's Inductor takes the wider persistent reductions."""
    return _choices_class() is not None


@contextlib.contextmanager
def persistent_rows(limit: int) -> Iterator[None]:
    """Inductor reduces rows of up to `limit` elements (innermost dimension) in one pass while
    this is entered; 0, or a torch without the handler, changes nothing."""
    cls = _choices_class() if limit > 0 else None
    if cls is None:
        yield
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    current = V.choices
    if type(current) is not InductorChoices and not isinstance(current, cls):
        logger.debug("atom-compile: Inductor choices handler %s is the user's; persistent rows left to it",
                     type(current).__name__)
        yield
        return
    with V.set_choices_handler(cls(limit)):
        yield
