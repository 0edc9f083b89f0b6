"""The compiler half: adaptors, graph splitting, piecewise compilation and the backend."""
