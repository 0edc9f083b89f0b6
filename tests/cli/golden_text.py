"""Golden files of the CLI's human output: normalise what changes from run to run and machine
to machine (hashes, times, sizes, paths, timings, versions), keep everything else, and check
that every table's columns line up in the raw output."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

GOLDEN = Path(__file__).parent / "golden"
_HEX = re.compile(r"\b(?:[0-9a-f]{64}|[0-9a-f]{32}|[0-9a-f]{16}|[0-9a-f]{12})\b")
_TIME = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d\b")
_SIZE = re.compile(r"\b\d+(?:\.\d)? (?:B|KiB|MiB|GiB|TiB)\b")
_SECONDS = re.compile(r"\b\d+\.\d s\b")
_COUNTS = re.compile(r"\b\d+ (settings|files)\b")
_HEADER = re.compile(r"^( *)([A-Z][A-Z0-9 ]*[A-Z0-9])$")


def _digits(match: re.Match) -> str:
    return re.sub(r"\d", "#", match.group(0))


def normalise(text: str, replacements: Iterable[tuple[str, str]]) -> str:
    """Volatile bits become fixed text of the same width where the width is fixed (hashes,
    times) and '#' digits otherwise (sizes, timings), so the golden file shows the layout."""
    for old, new in sorted(replacements, key=lambda r: -len(r[0])):
        if old:
            text = text.replace(old, new)
    names: dict[str, str] = {}
    text = _HEX.sub(lambda m: names.setdefault(m.group(0), format(len(names) + 1, f"0{len(m.group(0))}x")), text)
    text = _TIME.sub("2026-01-01 00:00", text)
    for pattern in (_SIZE, _SECONDS, _COUNTS):
        text = pattern.sub(_digits, text)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def comparable(text: str) -> str:
    """What must match a golden file: the text with any run of '#' digits as one, and runs of
    spaces as one (a size one digit longer elsewhere widens its column; alignment is checked
    on the raw output by assert_aligned instead). The CUDA/HIP versions torch was built for
    differ between a CPU wheel and a CUDA one, and Triton is absent beside a CPU wheel (null)
    and present elsewhere, so their values are masked."""
    text = re.sub(r"#[#.]*", "#", text)
    text = re.sub(r"^(\s*environment\.(?:cuda|hip|triton)\s+)\S+$", r"\1<build>", text, flags=re.M)
    return "\n".join(re.sub(r" {2,}", "  ", line) for line in text.splitlines())


def _cells(line: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", line)]


def assert_aligned(text: str) -> None:
    """Every table (an upper-case header line, then rows at its indent) has each cell starting
    where its header starts (left-aligned) or ending where it ends (right-aligned)."""
    lines = text.splitlines()
    for i, header in enumerate(lines):
        match = _HEADER.match(header)
        if not match or "  " not in match.group(2):
            continue
        indent, columns = len(match.group(1)), _cells(header)
        for row in lines[i + 1:]:
            if not row.strip() or len(row) - len(row.lstrip()) != indent:
                break
            cells = _cells(row)
            assert len(cells) == len(columns), f"row has {len(cells)} cells, header {len(columns)}:\n{header}\n{row}"
            for (hs, he), (cs, ce) in zip(columns, cells):
                assert cs == hs or ce == he, f"cell at {cs}-{ce} is off its column {hs}-{he}:\n{header}\n{row}"


def check(name: str, text: str, update: bool) -> None:
    path = GOLDEN / f"{name}.txt"
    if update or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        if not update:
            raise AssertionError(f"{path} did not exist; written from this run: review it and commit it")
        return
    assert comparable(text) == comparable(path.read_text()), (
        f"{name}: the CLI's output differs from {path} (pytest --update-golden rewrites it)\n" + text)
