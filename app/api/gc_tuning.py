"""Cyclic garbage collection tuned for a long-running API process.

CPython starts a young-generation collection whenever tracked allocations outnumber
deallocations by 700. Under load dozens of requests are parked on Redis at once, each
holding its own objects, and every collection also promotes them, so the default fires
thousands of times a second and regularly walks the older generations, where the ~75,000
objects built at startup (routes, schemas, settings, client libraries) live. Measured
with bench/api.py's load (64 pollers, 2 cores): about a third of the process's CPU per
job read went to the collector, and p99 latency rose fourfold from the full collections.

Two standard remedies, applied once the app is built:
- ``gc.freeze()`` after a full collection moves everything alive into a generation the
  collector never walks; those objects live as long as the process anyway.
- a larger young-generation threshold: request garbage is still freed by reference
  counting at once; only reference cycles wait for the next (rarer) collection.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("maec.api")


def tune_gc(threshold: int) -> None:
    """Freeze startup objects and raise the young-generation threshold (0: leave both)."""
    if threshold <= 0:
        return
    gc.collect()  # so that garbage from start-up is not frozen with the live objects
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)
    log.info("gc: %d start-up objects frozen; young-generation threshold %d",
             gc.get_freeze_count(), threshold)
