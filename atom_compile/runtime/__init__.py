"""The runtime half: CUDA-graph recordings (graph pool, ReqGraph, TokenGraph), capture ladders
and the ModelRunner. Works with or without torch.compile."""

from .buckets import capture_ladder, pad_for_data_parallel, pad_to_bucket, request_bucket
from .graphs import (
    ReqGraph,
    TokenGraph,
    eager_region,
    graph_pool,
    register_drain_hook,
    token_graph,
    token_graph_of,
)
from .model_runner import ModelRunner
from .runtime_config import RuntimeConfig

__all__ = [
    "ModelRunner", "ReqGraph", "RuntimeConfig", "TokenGraph", "capture_ladder", "eager_region", "graph_pool",
    "pad_for_data_parallel", "pad_to_bucket", "register_drain_hook", "request_bucket", "token_graph",
    "token_graph_of",
]
