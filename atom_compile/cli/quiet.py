"""A quiet start: third-party warnings known to be harmless are filtered at the CLI's entry
point only (never by the library), and `-v` or ATOM_COMPILE_LOG=debug shows everything."""

from __future__ import annotations

import logging
import sys
import warnings

from .. import envs

# (message regex, category): warnings torch and transformers print on a normal run that say
# nothing about the user's cache or model.
_HARMLESS = (
    (r"Failed to initialize NumPy", UserWarning),           # torch without numpy installed
    (r".*No CUDA runtime is found", UserWarning),
    (r".*TypedStorage is deprecated", UserWarning),
    (r".*`torch\.cuda\.amp\.", FutureWarning),
    (r".*torch\._dynamo.*is deprecated", FutureWarning),
    (r".*Dynamo detected a call to a `functools\.lru_cache`", UserWarning),
)
_HARMLESS_MODULES = (r"torch(\..*)?", r"transformers(\..*)?")
# torch loggers that warn about the machine (no CUDA toolkit, no compiler cache hits), not about us.
_NOISY_LOGGERS = ("torch.utils.cpp_extension", "torch._inductor", "torch._dynamo", "torch._subclasses",
                  "transformers")


def wanted_level(verbose: bool) -> int:
    """INFO with -v; the level ATOM_COMPILE_LOG names; else WARNING."""
    named = envs.log_level()
    if named:
        level = logging.getLevelName(named.upper())
        if isinstance(level, int):
            return level
    return logging.INFO if verbose else logging.WARNING


def everything_shown(verbose: bool) -> bool:
    return verbose or wanted_level(verbose) <= logging.DEBUG


def install(verbose: bool) -> None:
    """Filters and log levels for one CLI run (before torch is imported, and again after)."""
    _setup_logging(wanted_level(verbose))
    if everything_shown(verbose):
        return
    for message, category in _HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for module in _HARMLESS_MODULES:
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=module)
    quiet_torch_loggers()


def quiet_torch_loggers() -> None:
    """torch's own logging config resets levels when torch._logging loads; call after it too."""
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


class OncePerProblem(logging.Filter):
    """One warning per problem: a record whose text was already shown is dropped (two readers
    of one damaged index each warn about it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def _setup_logging(level: int) -> None:
    """atom-compile's own lines on stderr, as they are (each starts with `atom-compile`)."""
    logger = logging.getLogger("atom_compile")
    logger.setLevel(level)
    if not any(getattr(h, "_atom_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(OncePerProblem())
        handler._atom_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
