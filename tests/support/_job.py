"""Run the built-in tiny Llama through atom-compile in a fresh process and report as JSON.

Used by the cache tests: every fault is exercised in a real subprocess. `--fail-writes`
makes every write under the cache root fail the way a read-only directory (EACCES) or a full
disk (ENOSPC) does, through an audit hook installed before atom_compile is imported.
"""

import argparse
import errno
import hashlib
import json
import os
import sys


def install_write_failures(root: str, kind: str) -> None:
    root = os.path.realpath(root)
    code = errno.EACCES if kind == "readonly" else errno.ENOSPC

    def under_root(path) -> bool:
        try:
            real = os.path.realpath(os.fsdecode(path))
            return real == root or real.startswith(root + os.sep)  # not a sibling like root + ".prof"
        except (TypeError, ValueError):
            return False

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2] if len(args) > 2 else 0
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and under_root(args[0]):
                raise OSError(code, os.strerror(code), os.fsdecode(args[0]))
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.link",
                       "os.symlink", "os.chmod", "os.truncate") and args:
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            if any(under_root(p) for p in paths):
                raise OSError(code, os.strerror(code), os.fsdecode(paths[0]))
        elif event == "tempfile.mkstemp" and args and under_root(args[0]):
            raise OSError(code, os.strerror(code), os.fsdecode(args[0]))

    sys.addaudithook(hook)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-root", required=True)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--compiler", default="auto")
    ap.add_argument("--compile-sizes", default="")
    ap.add_argument("--fail-writes", choices=["none", "readonly", "full"], default="none")
    ap.add_argument("--graph-partition", action="store_true", help="use_inductor_graph_partition=True")
    ap.add_argument("--plain", action="store_true", help="torch.compile with backend(cfg), no decorator")
    args = ap.parse_args()
    if args.fail_writes != "none":
        install_write_failures(args.cache_root, args.fail_writes)

    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    import torch

    import atom_compile as ac
    from atom_compile.models import build_model, preset
    from atom_compile.ops.attention import PagedAttentionMetadataBuilder, SequenceStep

    sizes = [int(s) for s in args.compile_sizes.split(",") if s]
    cfg = ac.Config(max_num_seqs=8, compilation_config=ac.CompilationConfig(
        level=args.level, cache_dir=args.cache_root, compiler=args.compiler, compile_sizes=sizes or None,
        use_inductor_graph_partition=args.graph_partition))
    llama = preset("tiny", num_layers=args.layers)
    if args.plain:
        model = build_model(llama, compilation_config=ac.Config())
    else:
        model = build_model(llama, compilation_config=cfg)
    ref = build_model(llama, compilation_config=ac.Config())
    for m in (model, ref):
        m.allocate_kv_cache(16, 4)
    builder = PagedAttentionMetadataBuilder(8, 64, 8, 4)
    forward = model
    if args.plain:
        compiled = torch.compile(model.model, backend=ac.backend(cfg), fullgraph=True)
        forward = lambda ids, pos: compiled(ids, pos)  # noqa: E731

    def run(fn, m, steps):
        ids, pos, meta, ctx = builder.build(steps)
        if args.plain:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
        with ac.set_forward_context(meta, None, ctx, no_compile_layers=m.no_compile_layers):
            return m.compute_logits(fn(ids, pos))

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    batches = [[SequenceStep(p, 0, [i * 4, i * 4 + 1, i * 4 + 2]) for i, p in enumerate(prompts)]]
    for step in range(2):
        batches.append([SequenceStep([10 + step], 5 + step, [0, 1, 2]), SequenceStep([20 + step], 3 + step, [4, 5, 6])])
    err = 0.0
    digest = hashlib.sha256()
    with torch.inference_mode():
        for steps in batches:
            out = run(forward, model, steps)
            expect = run(ref, ref, steps)
            err = max(err, (out - expect).abs().max().item())
            digest.update(bytes(out.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist()))  # no numpy
    print(json.dumps({"counters": ac.compilation_counter.as_dict(), "max_abs_err": err,
                      "output_sha256": digest.hexdigest()}))


if __name__ == "__main__":
    main()
