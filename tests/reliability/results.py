"""Counters the reliability suite reports in its final RESULT line.

Tests add to these in-process (the suite runs in one pytest process); the conftest's
terminal-summary hook prints them and writes them as JSON beside the run's basetemp so
docs/reliability.md figures can be checked against a file, not a scrollback.
"""

from __future__ import annotations

import threading

KEYS = ("fuzz_requests", "fuzz_5xx", "property_bodies", "property_5xx", "hostile_inputs",
        "lost_jobs", "duplicate_runs", "webhooks_expected", "webhooks_verified",
        "toctou_refused", "toctou_cases", "adapters_refused", "deletes_mid_download",
        "corrupt_downloads", "hostile_tokenizers", "hostile_eval_sets", "secrets_echoed",
        "secret_cases", "hostile_bodies")

_lock = threading.Lock()
COUNTERS: dict[str, int] = dict.fromkeys(KEYS, 0)
# Free-form figures (latencies, durations) that go into the JSON file and the summary.
FIGURES: dict[str, object] = {}


def add(key: str, n: int = 1) -> None:
    if key not in COUNTERS:
        raise KeyError(f"unknown reliability counter {key!r}")
    with _lock:
        COUNTERS[key] += n


def figure(key: str, value: object) -> None:
    with _lock:
        FIGURES[key] = value
