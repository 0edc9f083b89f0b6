"""RuntimeConfig: what the capture/replay runtime reads, and nothing else of the Config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from ..config import Config
from ..modes import CUDAGraphMode


@dataclass
class RuntimeConfig:
    """Capture sizes (ascending), batch limits and the graph mode the runner records.

    `cudagraph_mode` is the configured mode; the runner turns it to NONE under `enforce_eager`
    or without a CUDA device. `no_compile_layers` is the registry of layers by name that the
    forward context hands to attention when the model does not carry its own.
    """

    capture_sizes: list[int] = field(default_factory=list)
    max_num_seqs: int = 512
    max_q_len: int = 1
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    enforce_eager: bool = False
    cudagraph_memory_budget: Union[int, float, None] = None
    no_compile_layers: dict[str, Any] = field(default_factory=dict, repr=False)
    # data-parallel ranks that must replay the same decode bucket (a torch.distributed group)
    dp_group: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: Config) -> "RuntimeConfig":
        cc = cfg.compilation_config
        return cls(
            capture_sizes=list(cfg.capture_sizes or []),
            max_num_seqs=cfg.max_num_seqs,
            max_q_len=cfg.max_q_len,
            cudagraph_mode=cc.cudagraph_mode if cc.cudagraph_mode is not None else CUDAGraphMode.NONE,
            enforce_eager=cfg.enforce_eager,
            cudagraph_memory_budget=cfg.cudagraph_memory_budget,
            # the same dict, not a copy: layers built after the runner still register in it
            no_compile_layers=cc.static_forward_context,
        )
