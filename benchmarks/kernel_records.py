"""The cost of recording our kernels' Triton files in the cache's manifest (issue 15's capture).

A cold capture launches each of our Triton kernels' specialisations for the first time; each
first launch compiles into the cache's scratch directory and commits the manifest at once
(backends/kernel_files.py). This replays that on the CPU: a scratch directory already holding
`--inductor-files` of Inductor's files, then `--kernels` first launches, each writing
`--files` files of `--kb` KB as Triton's cache does, `--interval` seconds apart (the compile
between two first launches; a file written in the last two seconds is hashed at every record,
scratch.RACY_NS). It prints the seconds of those launches' records (the intervals not counted)
and how many files were hashed.

    python benchmarks/kernel_records.py [--kernels 33] [--files 7] [--inductor-files 100] [--kb 64] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from atom_compile.backends.base import EagerAdaptor
from atom_compile.backends.manager import CompilerManager
from atom_compile.cache import trust
from atom_compile.cache.store import PieceCache
from atom_compile.ops import kernel_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=33, help="first launches (a cold H100 capture: 33)")
    ap.add_argument("--files", type=int, default=7, help="files a launch writes")
    ap.add_argument("--inductor-files", type=int, default=100, help="files already in the scratch directory")
    ap.add_argument("--kb", type=int, default=64, help="KB a file")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds from one first launch to the next")
    args = ap.parse_args()
    hashed = [0]
    real = trust.sha256_and_stat

    def counted(root, path):
        hashed[0] += 1
        return real(root, path)

    trust.sha256_and_stat = counted
    payload = os.urandom(args.kb << 10)
    with tempfile.TemporaryDirectory() as root:
        cache = PieceCache.open(Path(root), "0123456789abcdef", 0, "Model")
        manager = CompilerManager(EagerAdaptor(), cache, {})
        scratch = Path(manager._scratch_dir())
        for i in range(args.inductor_files):
            path = scratch / f"i{i % 16:02x}" / f"piece{i}.py"
            path.parent.mkdir(mode=0o700, exist_ok=True)
            path.write_bytes(payload)
            os.chmod(path, 0o600)
        cache.commit([], scratch_used=True)
        hashed[0] = 0
        seconds = 0.0
        for k in range(args.kernels):
            time.sleep(args.interval)
            start = time.perf_counter()
            with kernel_dir.compiling():
                target = Path(os.environ["TRITON_CACHE_DIR"]) / f"KEY{k}"
                target.mkdir(mode=0o700)
                for f in range(args.files):
                    (target / f"kernel{f}.bin").write_bytes(payload)
            seconds += time.perf_counter() - start
    kernel_dir.use_kernel_dir(None)
    print(f"{args.kernels} first launches, {args.files} files of {args.kb} KB each, after {args.inductor_files} "
          f"Inductor files, {args.interval} s apart: {seconds:.3f} s recording, {hashed[0]} files hashed "
          f"({args.kernels * args.files} written)")


if __name__ == "__main__":
    main()
