"""cudagraph_memory_budget on CPU: the validation and the size selection as plain functions."""

import pytest

from atom_compile import Config, ConfigError
from atom_compile.runtime.capture_budget import budget_bytes, capture_within_budget
from atom_compile.runtime.runtime_config import RuntimeConfig


class FakePool:
    """A pool that grows by `cost(size)` per recording."""

    def __init__(self, cost):
        self.cost, self.bytes, self.recorded = cost, 0, []

    def capture(self, size):
        self.recorded.append(size)
        self.bytes += self.cost(size)


def test_records_largest_first_and_stops_before_the_budget():
    pool = FakePool(lambda s: 100 * s)
    # 8 -> 800; predicted for 4: 800 + 800*4/8 = 1200 <= 1500: record (1200); 2: 1400; 1: 1500
    assert capture_within_budget([1, 2, 4, 8], pool.capture, lambda: pool.bytes, 1500) == ([8, 4, 2, 1], [])
    pool = FakePool(lambda s: 100 * s)
    # 8 -> 800; 4 -> 1200; predicted for 2: 1200 + 400*2/4 = 1400 > 1300: stop, 2 and 1 skipped
    assert capture_within_budget([4, 1, 8, 2], pool.capture, lambda: pool.bytes, 1300) == ([8, 4], [2, 1])
    assert pool.recorded == [8, 4] and pool.bytes <= 1300


def test_a_pool_that_is_reused_keeps_recording():
    pool = FakePool(lambda s: 1000 if s == 16 else 0)  # the largest sets the pool; the rest reuse it
    assert capture_within_budget([1, 2, 16], pool.capture, lambda: pool.bytes, 1200) == ([16, 2, 1], [])


def test_budget_bytes():
    assert budget_bytes(1 << 20, 123) == 1 << 20
    assert budget_bytes(0.5, 1000) == 500


@pytest.mark.parametrize("bad", [0, -1, 0.0, 1.5, True, "1G", float("nan")])
def test_validation_names_field_and_value(bad):
    with pytest.raises(ConfigError, match="Config.cudagraph_memory_budget"):
        Config(cudagraph_memory_budget=bad)


def test_runtime_config_carries_the_budget():
    assert RuntimeConfig.from_config(Config(cudagraph_memory_budget=0.25)).cudagraph_memory_budget == 0.25
    assert RuntimeConfig.from_config(Config()).cudagraph_memory_budget is None
