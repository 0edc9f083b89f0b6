"""Reference kernels for the default splitting ops, used when aiter is absent."""
