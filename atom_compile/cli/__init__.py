"""`atom-compile-cache`: warm, inspect, clear, verify, explain, export and import compiler caches.

    atom-compile-cache warm                      # compile the built-in tiny Llama into the cache
    atom-compile-cache inspect                   # what is cached, how big, when last used
    atom-compile-cache clear --max-size 2G --yes # drop least recently used caches until 2 GiB fit

Human output by default, `--json` for scripts; exit 0 ok, 1 damage or a miss, 2 bad usage;
every error is one line on stderr. The global options (--cache-root, --json, -v) go before or
after the subcommand. `inspect`, `verify`, `clear`, `export` and `import` never import torch;
`warm` and `explain` import it when they run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Callable, NoReturn, Optional, Sequence

from ..cache.inventory import InventoryError
from ..config import ConfigError
from . import archive_cmds, clear, explain, inspect, quiet, remote_cmds, verify, warm
from .common import CliError
from .output import PROG
from .warm_model import WarmError

logger = logging.getLogger("atom_compile")


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (and exit code 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)", 2, where=self.prog)


def _global_options(p: argparse.ArgumentParser, top: bool) -> None:
    """On the top parser with defaults; on each subparser with SUPPRESS, so that an option
    given before the subcommand is not reset by the subparser's default."""
    default = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    p.add_argument("--cache-root", metavar="DIR", default=default(None),
                   help="the cache root (default: $ATOM_COMPILE_CACHE_ROOT, else $XDG_CACHE_HOME/atom or ~/.cache/atom)")
    p.add_argument("--json", action="store_true", default=default(False), help="machine-readable output on stdout")
    p.add_argument("-v", "--verbose", action="store_true", default=default(False),
                   help="atom-compile's log, third-party warnings and tracebacks on stderr")


_COMMANDS: list[tuple[str, str, str, Callable, Optional[Callable]]] = [
    ("warm", warm.HELP, warm.EPILOG, warm.run, warm.add_warm_arguments),
    ("inspect", inspect.HELP, inspect.EPILOG, inspect.run, inspect.add_arguments),
    ("clear", clear.HELP, clear.EPILOG, clear.run, clear.add_arguments),
    ("verify", verify.HELP, verify.EPILOG, verify.run, verify.add_arguments),
    ("explain", explain.HELP, explain.EPILOG, explain.run, explain.add_arguments),
    ("export", archive_cmds.EXPORT_HELP, archive_cmds.EXPORT_EPILOG, archive_cmds.run_export,
     archive_cmds.add_export_arguments),
    ("import", archive_cmds.IMPORT_HELP, archive_cmds.IMPORT_EPILOG, archive_cmds.run_import,
     archive_cmds.add_import_arguments),
    ("push", remote_cmds.PUSH_HELP, remote_cmds.PUSH_EPILOG, remote_cmds.run_push, remote_cmds.add_arguments),
    ("pull", remote_cmds.PULL_HELP, remote_cmds.PULL_EPILOG, remote_cmds.run_pull, remote_cmds.add_arguments),
]


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = _Parser(prog=PROG, description="Warm, inspect and manage atom-compile compiler caches.",
                     epilog=f"examples:\n  {PROG} warm\n  {PROG} inspect\n  {PROG} clear --max-size 2G --yes\n\n"
                            f"`{PROG} COMMAND --help` for each command.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text, epilog, func, add_arguments in _COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if add_arguments:
            add_arguments(p)
        _global_options(p, top=False)
        p.set_defaults(func=func)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script. Returns the exit code; never raises for bad input or damage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet.install("-v" in argv or "--verbose" in argv)
    parser = build_parser()
    command, verbose = "?", False
    try:
        args = parser.parse_args(argv)
        command, verbose = args.command or "?", args.verbose
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.func(args)
    except CliError as exc:
        return _fail(command, str(exc), exc.code, exc.where)
    except (InventoryError, WarmError) as exc:
        return _fail(command, str(exc), exc.exit_code)
    except ConfigError as exc:
        return _fail(command, str(exc), 2)
    except KeyboardInterrupt:
        return _fail(command, "interrupted", 130)
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a compile or an OS failure: one line, the traceback on request
        if verbose:
            traceback.print_exc()
        else:
            logger.debug("%s failed", command, exc_info=True)
        hint = "" if verbose else " (rerun with -v for the traceback)"
        return _fail(command, f"{type(exc).__name__}: {exc}".splitlines()[0] + hint, 1)


def _fail(command: str, message: str, code: int, where: Optional[str] = None) -> int:
    """Print the error as one line (a multi-line message is joined) and return `code`."""
    where = where or (f"{PROG} {command}" if command != "?" else PROG)
    text = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"{where}: error: {text}", file=sys.stderr)
    return code
