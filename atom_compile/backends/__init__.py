"""The compiler: adaptors, graph splitting, piecewise compilation, the compile-or-load manager,
saving/loading Dynamo functions, and the backend."""
