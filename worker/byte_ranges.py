"""Sets of byte ranges ``[start, end)``, kept sorted and merged: what a partial cache
entry holds of its file (``worker.inputs.InputCache``, recorded in the entry's sidecar)
and what a part of a split merge asks of it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

Ranges = list[tuple[int, int]]


def merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, empty ones dropped, overlapping or touching ones joined."""
    out: Ranges = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def missing(have: Ranges, want: Iterable[tuple[int, int]]) -> Ranges:
    """The parts of ``want`` not in ``have`` (both merged first)."""
    gaps: Ranges = []
    held = merged(have)
    for start, end in merged(want):
        pos = start
        for hs, he in held:
            if he <= pos or hs >= end:
                continue
            if hs > pos:
                gaps.append((pos, hs))
            pos = max(pos, he)
            if pos >= end:
                break
        if pos < end:
            gaps.append((pos, end))
    return gaps


def covers(have: Ranges, start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies wholly in ``have`` (merged)."""
    return end <= start or any(hs <= start and end <= he for hs, he in have)


def total(ranges: Ranges) -> int:
    return sum(end - start for start, end in ranges)


def read_sidecar(path: Path) -> Ranges:
    """The ranges a sidecar records (missing: none)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return merged((int(a), int(b)) for a, b in doc)


def write_sidecar(path: Path, ranges: Ranges) -> None:
    """Record ``ranges`` atomically (a temporary name, then a rename): a reader sees the
    old list or the new one, never half of one. Written only after the bytes it adds
    are in the data file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(merged(ranges)))
    os.replace(tmp, path)
