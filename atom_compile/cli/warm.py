"""`warm`: compile a model's every piece into the cache, with progress on stderr and a
ccache-like summary on stdout (the model options are shared with `explain`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from . import output as out
from . import quiet
from .common import resolve_root
from .warm_model import DEFAULT_MODEL, WarmOptions, parse_sizes

HELP = "compile a model's every piece into the cache"
FACTORY_HELP = """\
MODEL is a built-in preset (tiny, llama-3.2-1b; random weights) or package.module:factory.
The factory is called as factory(config) with an atom_compile.Config, inside
set_current_config(config), and returns a model or (model, example_inputs) where
example_inputs(num_tokens) returns the positional arguments of one forward. Without
example_inputs the model is called as model(input_ids, positions); a model with
no_compile_layers and allocate_kv_cache (like the built-in Llama) is driven with a paged KV
cache. A model without a @support_torch_compile part is compiled with
torch.compile(model, backend=atom_compile.backend(config)). The working directory is on the
import path.
"""
EPILOG = FACTORY_HELP + """
The first call traces the general shape (the largest capture size worth of tokens, at least 8)
and compiles (or loads) every piece; then one call per compile size compiles each concrete
entry. On CUDA the capture sizes are recorded as CUDA graphs. A second warm of the same model
compiles nothing. Progress goes to stderr, the summary to stdout.

examples:
  atom-compile-cache warm
  atom-compile-cache warm tiny --layers 4 --compile-sizes 1 2 4 8 --json
  atom-compile-cache warm llama-3.2-1b --device cuda --capture-sizes 1 2 4 8 --compile-sizes cudagraph_capture_sizes
  atom-compile-cache warm mypkg.models:build --config '{"max_num_seqs": 64}'
  atom-compile-cache warm llama-3.2-1b --fake-weights --compile-sizes 1 2 4 8   # a build step: no weight memory

With --fake-weights the model is built on the meta device and its weights become fake tensors
(no memory); every piece and compile size is compiled into the cache exactly as a real warm
would, but nothing runs, and no CUDA graph is recorded. A later run with real weights loads
that cache and compiles nothing. A model that cannot be compiled this way is refused with the
reason (a tensor left on the meta device, a tensor constant, Inductor's freezing).
"""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL", default=DEFAULT_MODEL,
                   help="a preset (tiny, llama-3.2-1b) or package.module:factory (default: tiny)")
    p.add_argument("--level", metavar="N", help="compilation level 0-3 or its name (default 3, PIECEWISE)")
    p.add_argument("--compile-sizes", nargs="+", metavar="SIZE",
                   help="token counts to compile a concrete entry for; 'cudagraph_capture_sizes' adds every capture size")
    p.add_argument("--capture-sizes", nargs="+", metavar="SIZE", help="CUDA-graph capture sizes (batch sizes)")
    p.add_argument("--cudagraph-mode", metavar="M", help="NONE, TR_HYBRID (PIECEWISE), FULL, FULL_DECODE_ONLY, "
                   "FULL_AND_TR_HYBRID")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs (default cpu)")
    p.add_argument("--cache-dir", dest="cache_root", default=argparse.SUPPRESS, metavar="DIR",
                   help="the same as --cache-root")
    p.add_argument("--config", metavar="JSON", help="a Config as JSON (or @file.json); the options above win")
    p.add_argument("--layers", type=int, metavar="N", help="decoder layers of a built-in preset")


def add_warm_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--fake-weights", action="store_true",
                   help="build the model with fake weights (no weight memory) and compile only: a build step "
                        "for CI or an image; a real run with real weights loads the cache it writes")


def warm_options(args: argparse.Namespace) -> WarmOptions:
    root = resolve_root(args)
    return WarmOptions(
        model=args.model or DEFAULT_MODEL, level=args.level,
        compile_sizes=parse_sizes(args.compile_sizes, True, "--compile-sizes"),
        capture_sizes=parse_sizes(args.capture_sizes, False, "--capture-sizes"),
        cudagraph_mode=args.cudagraph_mode, device=args.device, cache_dir=str(root),
        config=args.config, layers=args.layers, fake_weights=bool(getattr(args, "fake_weights", False)),
    )


def run(args: argparse.Namespace) -> int:
    opts = warm_options(args)
    import torch  # noqa: F401  (torch's logging set-up first, then our quiet levels over it)

    quiet.install(args.verbose)
    from .warm_job import run_warm

    keep_stdout = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with keep_stdout:
        report = run_warm(opts).as_dict()
    for text in report["notes"]:
        out.note(f"note: {text}")
    if args.json:
        out.emit(report)
    else:
        out.lines(format_summary(report))
    return 0


def _dynamo_line(c: dict[str, int]) -> str:
    if c.get("num_dynamo_functions_loaded"):
        return "loaded the saved function: Dynamo did not run"
    if c.get("num_dynamo_functions_saved"):
        return "traced and saved: the next start skips Dynamo"
    return "traced (not saved)" if c.get("num_graphs_seen") else "-"


def format_summary(r: dict[str, Any]) -> list[str]:
    """The warm summary, ccache -s style."""
    shapes = [f"general ({r['general_tokens']} tokens)", *map(str, r["compile_sizes"])]
    pieces = f"{r['pieces']} compiled pieces, {r['distinct_pieces']} distinct"
    if r["split_ops"]:
        pieces += f" (+{r['split_ops']} split ops run eagerly)"
    rows = [
        ("pieces", pieces),
        ("shapes", ", ".join(shapes)),
        ("compiled", f"{r['compiled']} by the compiler"),
        ("loaded", f"{r['loaded']} from the cache"),
        ("reused", f"{r['deduplicated']} from identical pieces"),
    ]
    if r["rebuilt_inductor_files"]:
        rows.append(("rebuilt", f"Inductor's files of {', '.join(r['rebuilt_inductor_files'])}: not in the "
                                "imported archive, their C++ was built again"))
    rows += [("dynamo", _dynamo_line(r["counters"])), ("cuda graphs", _graphs_line(r))]
    for cache in r["caches"]:
        rows.append(("cache", cache["path"]))
        rows.append(("size", f"{out.size(cache['bytes'])} (artifacts {out.size(cache['cache_bytes'])}, "
                             f"Inductor files {out.size(cache['scratch_bytes'])})"))
    if not r["caches"]:
        rows.append(("cache", "none used" + (" (levels 0 and 1 compile nothing)" if r["level"] < 2 else "")))
    if r.get("fake_weights"):
        rows.append(("weights", f"fake: {out.size(r['real_weight_bytes'])} allocated of "
                                f"{out.size(r['weight_bytes'])} (compiled only, nothing ran)"))
    head = f"Warmed {r['model']} at level {r['level']} on {r['device']} in {r['seconds']:.1f} s"
    return [head, *out.fields(rows)]


def _graphs_line(r: dict[str, Any]) -> str:
    if r["cudagraphs_recorded"]:
        return f"{r['cudagraph_mode']}: recorded sizes " + ", ".join(map(str, r["cudagraphs_recorded"]))
    if r["cudagraph_mode"] == "NONE":
        return "none (cudagraph_mode NONE)"
    return f"not recorded on {r['device']}" if r["device"] != "cuda" else "none recorded"
