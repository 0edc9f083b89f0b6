"""Our kernels' timed block shapes, kept in the cache's kernel directory (ops/tuning.py):
saved and taken back, per device; a damaged, oversized or foreign entry is ignored."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch

from atom_compile.ops import kernel_dir, tuning

CPU = torch.device("cpu")
KEY = (16, 128256, 2048, torch.bfloat16, False)
ALLOWED = [(16, 256, 4), (32, 128, 4)]


@pytest.fixture
def ops_dir(tmp_path):
    before = (kernel_dir.kernel_dir(), kernel_dir._state["on_written"])
    kernel_dir.use_kernel_dir(str(tmp_path))
    yield tmp_path
    kernel_dir.use_kernel_dir(*before)


def test_a_choice_is_saved_and_taken_back(ops_dir):
    assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) is None
    tuning.remember("small_m_linear", KEY, CPU, (32, 128, 4))
    tuning.remember("small_m_linear", KEY[:1] + (4096,) + KEY[2:], CPU, (16, 256, 4))
    path = ops_dir / "small_m_linear.best_config"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(json.loads(path.read_text())) == 2
    assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) == (32, 128, 4)
    assert tuning.lookup("small_m_linear", KEY[:1] + (4096,) + KEY[2:], CPU, ALLOWED) == (16, 256, 4)
    assert tuning.lookup("small_m_linear", KEY, torch.device("meta"), ALLOWED) is None  # another device


def test_without_a_kernel_directory_nothing_is_written(tmp_path):
    before = (kernel_dir.kernel_dir(), kernel_dir._state["on_written"])
    kernel_dir.use_kernel_dir(None)
    try:
        tuning.remember("small_m_linear", KEY, CPU, (32, 128, 4))
        assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) is None
    finally:
        kernel_dir.use_kernel_dir(*before)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["garbage", "list", "not_allowed", "oversized"])
def test_damaged_entries_are_ignored_and_timed_again(ops_dir, caplog, damage):
    path = ops_dir / "small_m_linear.best_config"
    entry = tuning._entry(KEY, CPU)
    content = {"garbage": "{not json", "list": "[1, 2, 3]",
               "not_allowed": json.dumps({entry: [64, 64, 64]}),
               "oversized": json.dumps({entry: [32, 128, 4], "pad": "x" * tuning.MAX_BYTES})}[damage]
    path.write_text(content)
    with caplog.at_level(logging.INFO, logger="atom_compile"):
        assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) is None
    assert "ignored" in caplog.text
    # a new choice replaces what could not be read
    tuning.remember("small_m_linear", KEY, CPU, (16, 256, 4))
    assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) == (16, 256, 4)


def test_a_choice_timed_another_way_is_timed_again(ops_dir):
    """An entry saved before the shapes were timed past L2 (no timing tag) is not taken."""
    path = ops_dir / "small_m_linear.best_config"
    old_entry = json.dumps([json.loads(tuning._entry(KEY, CPU))[0], *(str(k) for k in KEY)])
    path.write_text(json.dumps({old_entry: [32, 128, 4]}))
    assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) is None
    tuning.remember("small_m_linear", KEY, CPU, (16, 256, 4))
    assert tuning.lookup("small_m_linear", KEY, CPU, ALLOWED) == (16, 256, 4)
    assert len(json.loads(path.read_text())) == 2  # the old entry stays, unread


def test_a_choice_made_without_the_chain_handicap_is_timed_again(ops_dir):
    """Entries of the "past-l2" timing kept the library GEMM where it won back to back by less
    than its price in a PDL chain."""
    path = ops_dir / "small_m_split_k.best_config"
    name = json.loads(tuning._entry(KEY, CPU))[0]
    allowed = [(0, 0, 0, 0), (16, 256, 4, 4)]
    path.write_text(json.dumps({json.dumps([name, "past-l2", *(str(k) for k in KEY)]): [0, 0, 0, 0]}))
    assert tuning.lookup("small_m_split_k", KEY, CPU, allowed) is None
    path.write_text(json.dumps({json.dumps([name, tuning.TIMING, *(str(k) for k in KEY)]): [0, 0, 0, 0]}))
    assert tuning.lookup("small_m_split_k", KEY, CPU, allowed) == (0, 0, 0, 0)  # the same entry, timed now


def test_the_fastest_candidate_counts_its_handicap():
    library, split = (0, 0, 0, 0), (32, 256, 2, 4)
    timings = {split: 7.41e-3, library: 7.20e-3}  # ms: the 8-row qkv on an H100, back to back
    assert tuning.fastest(timings) == library
    assert tuning.fastest(timings, {library: 0.5e-3}) == split
    assert tuning.fastest({split: 8.0e-3, library: 7.2e-3}, {library: 0.5e-3}) == library
    assert tuning.fastest({split: 7.0e-3}, {library: 0.5e-3}) == split  # a handicap of no candidate


def test_past_l2_is_the_weight_alone_off_cuda():
    w = torch.ones(4, 4)
    assert tuning.past_l2(w) == [w] and tuning.past_l2(w)[0] is w
