"""What an attempt really used, written beside the estimate that routed its job.

The peak resident set of the process that ran it: a merge child runs one job and exits
(``worker_max_tasks_per_child = 1``), so its high-water mark is that job's, the torch
it forked with included, which is what the estimate's ``BASE_RSS`` stands for. (A runner
driven in-process, as tests do, reports its process's peak so far: an upper bound.)
"""

from __future__ import annotations

import resource
import sys
from typing import Any


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


def measured(seconds: float) -> dict[str, Any]:
    return {"peak_rss_bytes": peak_rss_bytes(), "seconds": round(seconds, 3)}
