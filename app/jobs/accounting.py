"""Counters the worker adds to the ``maec:metrics`` hash when a job ends.

Kept in Redis (not in one process's memory) so the API's /metrics reports every worker's
jobs and survives restarts; the API turns these fields back into Prometheus families.
"""

from __future__ import annotations

import math

DURATION_BUCKETS: tuple[float, ...] = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, math.inf)


def bucket_field(le: float) -> str:
    return "duration_bucket:" + ("+Inf" if math.isinf(le) else repr(float(le)))


def finish_increments(status: str, seconds: float | None, nbytes: int = 0) -> dict[str, float]:
    """Hash increments for a job that reached ``status`` after ``seconds`` of running."""
    out: dict[str, float] = {f"finished_total:{status}": 1}
    if seconds is not None:
        out["duration_sum"] = seconds
        out["duration_count"] = 1
        for le in DURATION_BUCKETS:
            if seconds <= le:
                out[bucket_field(le)] = 1
    if nbytes:
        out["bytes_published_total"] = nbytes
    return out
