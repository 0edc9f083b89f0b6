"""The compiler cache: keys, the store on disk, the compile-or-load manager and the CLI.

Knows nothing of CUDA graphs.
"""
