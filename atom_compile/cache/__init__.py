"""The compiler cache's storage: keys, the store on disk with its trust checks, the index and
the inventory. Knows nothing of compiling, models or CUDA graphs (the compile-or-load manager and
the Dynamo-function save/load live in backends/)."""
