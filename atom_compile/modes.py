"""Compilation levels and CUDA-graph modes (DESIGN.md, 'Compilation levels', 'CUDA graph modes')."""

from __future__ import annotations

import enum
from typing import Any

from .errors import ConfigError


class CompilationLevel(enum.IntEnum):
    """How torch.compile is applied (DESIGN.md, 'Compilation levels')."""

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3

    @classmethod
    def parse(cls, value: Any, field_name: str = "level") -> "CompilationLevel":
        """Accept an int 0-3, a member, or a name (ours or vLLM's CompilationMode names)."""
        allowed = "0 NO_COMPILATION, 1 DYNAMO_AS_IS, 2 DYNAMO_ONCE, 3 PIECEWISE"
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            raise ConfigError(field_name, value, allowed)
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                raise ConfigError(field_name, value, allowed) from None
        if isinstance(value, str):
            key = value.strip().upper()
            if key.isdigit():
                return cls.parse(int(key), field_name)
            aliases = {
                "NONE": cls.NO_COMPILATION,
                "STOCK_TORCH_COMPILE": cls.DYNAMO_AS_IS,
                "DYNAMO_TRACE_ONCE": cls.DYNAMO_ONCE,
                "VLLM_COMPILE": cls.PIECEWISE,
            }
            if key in cls.__members__:
                return cls[key]
            if key in aliases:
                return aliases[key]
        raise ConfigError(field_name, value, allowed)


class CUDAGraphMode(enum.Enum):
    """Which CUDA graphs a step replays; tuple members are (decode mode, mixed mode)."""

    NONE = 0
    TR_HYBRID = 1
    FULL = 2
    # Inside the class body the names above are still their plain values.
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_TR_HYBRID = (FULL, TR_HYBRID)

    @classmethod
    def parse(cls, value: Any, field_name: str = "cudagraph_mode") -> "CUDAGraphMode":
        """Accept a member, a value (0, 1, 2, [2, 0], [2, 1]) or a name, case-insensitively.

        vLLM's names are aliases: PIECEWISE is TR_HYBRID, FULL_AND_PIECEWISE is FULL_AND_TR_HYBRID.
        """
        allowed = (
            "NONE, TR_HYBRID (alias PIECEWISE), FULL, FULL_DECODE_ONLY, "
            "FULL_AND_TR_HYBRID (alias FULL_AND_PIECEWISE), or a value 0, 1, 2, [2, 0], [2, 1]"
        )
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            key = {"PIECEWISE": "TR_HYBRID", "FULL_AND_PIECEWISE": "FULL_AND_TR_HYBRID"}.get(key, key)
            if key in cls.__members__:
                return cls[key]
            if key.isdigit():
                return cls.parse(int(key), field_name)
            raise ConfigError(field_name, value, allowed)
        if isinstance(value, (list, tuple)) and not isinstance(value, bool):
            value = tuple(value)
        if isinstance(value, bool):
            raise ConfigError(field_name, value, allowed)
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise ConfigError(field_name, value, allowed) from None

    def separate_routine(self) -> bool:
        """True for tuple modes: decode and mixed batches take different routines."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def max_cudagraph_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def uses_tr_hybrid(self) -> bool:
        return CUDAGraphMode.TR_HYBRID in (self.decode_mode(), self.mixed_mode())
