"""Validation of config values: each bad value is a ConfigError naming the field, the value
and what is allowed (config.py's dataclasses call these in __post_init__)."""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

from .errors import ConfigError

CAPTURE_SIZES_TOKEN = "cudagraph_capture_sizes"

# `ns.op`, `ns::op` or `ns::op.overload`
_OP_NAME = re.compile(r"^[A-Za-z_]\w*(::[A-Za-z_]\w*(\.[A-Za-z_]\w*)?|\.[A-Za-z_]\w*)$")


def normalize_op_name(name: Any, field_name: str = "splitting_ops") -> str:
    """`ns.op` / `ns::op` / `ns::op.overload` -> `ns::op` or `ns::op.overload`."""
    if not isinstance(name, str) or not _OP_NAME.match(name.strip()):
        raise ConfigError(
            field_name, name, "op names written 'ns.op', 'ns::op' or 'ns::op.overload'"
        )
    name = name.strip()
    if "::" in name:
        return name
    ns, op = name.split(".", 1)
    return f"{ns}::{op}"


def default_capture_ladder(max_size: int) -> list[int]:
    """`[1..8] + range(16, N+1, 16)`, the ladder that `cuda_graph_sizes=[N]` stands for."""
    return [i for i in range(1, 9) if i <= max_size] + list(range(16, max_size + 1, 16))


def _check_size(field_name: str, value: Any, upper: int | None = None, upper_name: str = "") -> int:
    allowed = "a positive int" + (f" <= {upper_name} ({upper})" if upper is not None else "")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field_name, value, allowed)
    if upper is not None and value > upper:
        raise ConfigError(field_name, value, allowed)
    return value


def _check_count(field_name: str, value: Any, zero_means: str, none_means: Optional[str] = None) -> Optional[int]:
    """An int >= 0 (bools are refused), where 0 means `zero_means`; None too where `none_means`."""
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        also = f" or None ({none_means})" if none_means is not None else ""
        raise ConfigError(field_name, value, f"an int >= 0 (0: {zero_means}){also}")
    return value


def _check_bool(field_name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(field_name, value, "True or False")
    return value


def _size_list(field_name: str, value: Any, allow_token: bool = False) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        extra = f" (and the string {CAPTURE_SIZES_TOKEN!r})" if allow_token else ""
        raise ConfigError(field_name, value, f"a list of positive ints{extra}")
    out: list = []
    for item in value:
        if allow_token and item == CAPTURE_SIZES_TOKEN:
            out.append(item)
            continue
        if allow_token and isinstance(item, str):
            raise ConfigError(
                field_name, item, f"positive ints or the string {CAPTURE_SIZES_TOKEN!r}"
            )
        out.append(_check_size(field_name, item))
    return out


def _range_list(field_name: str, value: Any) -> list[list[int]]:
    """[[lo, hi), ...]: positive ints, lo < hi, sorted, no two ranges overlapping."""
    allowed = "a list of [lo, hi) pairs of positive ints with lo < hi, not overlapping"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(field_name, value, allowed)
    out: list[list[int]] = []
    for item in value:
        if isinstance(item, (str, bytes)) or not isinstance(item, Iterable):
            raise ConfigError(field_name, item, allowed)
        pair = list(item)
        if len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in pair) \
                or pair[0] >= pair[1]:
            raise ConfigError(field_name, item, allowed)
        out.append(pair)
    out.sort()
    for a, b in zip(out, out[1:]):
        if b[0] < a[1]:
            raise ConfigError(field_name, b, f"{allowed} (overlaps {a})")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _check_budget(value: Any) -> None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0) \
        or (isinstance(value, float) and 0.0 < value <= 1.0)
    if not ok:
        raise ConfigError("Config.cudagraph_memory_budget", value,
                          "None, a positive int (bytes) or a float in (0, 1] (a fraction of free memory)")


def graph_partition_unsupported() -> str | None:
    """Why the installed torch's Inductor cannot partition a graph at given ops (None: it can).
    Decided by the feature (the two config entries), not by the version."""
    try:
        import torch._inductor.config as inductor_config
    except Exception as exc:  # pragma: no cover - a torch without Inductor
        return f"torch._inductor cannot be imported ({exc})"
    missing = [name for name in ("graph_partition", "custom_should_partition_ops")
               if not hasattr(inductor_config, name)]
    if missing:
        return f"the installed torch's Inductor has no {' / '.join(missing)} (Inductor graph partition needs torch >= 2.9)"
    return None


def _check_graph_partition(cc: Any) -> None:
    """use_inductor_graph_partition needs level 3, Inductor, and a torch that can partition."""
    name = "CompilationConfig.use_inductor_graph_partition"
    if not cc.use_inductor_graph_partition:
        return
    if int(cc.level) != 3:
        raise ConfigError(name, True, f"False at level {int(cc.level)}: Inductor partitions the graph at the "
                          "splitting ops only at level 3 (PIECEWISE)")
    if cc.resolved_compiler() == "eager":
        raise ConfigError(name, True, "False when the compiler is 'eager' (use_inductor=False): only Inductor "
                          "partitions a graph")
    reason = graph_partition_unsupported()
    if reason is not None:
        raise ConfigError(name, True, f"False on this torch: {reason}")
