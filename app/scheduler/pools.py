"""Routing by size: the smallest configured pool whose workers hold a job's needs.

A pool's limits are (host memory, GPU memory, disk) per worker (``MAEC_POOLS``). A job
fits a pool when its host memory and disk fit and, for a GPU pool, its GPU working set
fits the card; a CPU pool (no GPU memory) runs the merge on the CPU. Among the pools
that fit, the job goes to the smallest (fewest GPU bytes, then host memory, then disk):
the cheapest worker that can hold it, keeping the large ones for the jobs only they
can run. A worker also takes the jobs of every pool it *covers* (no larger on any of
the three) when its own pool has none waiting, so a large pool never idles while small
jobs wait (:func:`served_by`).
"""

from __future__ import annotations

from collections.abc import Mapping

from app.scheduler.estimate import GPU_BUDGET_BYTES, Need
from app.settings import GIB, PoolSpec
from maec_core.service import MaecError


class NoCapableWorker(MaecError):
    """No configured pool's workers can hold the job (refused at submission)."""

    code = "no_capable_worker"


def fits(need: Need, pool: PoolSpec) -> bool:
    host, gpu, disk = pool.limits()
    if need.host_memory_bytes > host or need.disk_bytes > disk:
        return False
    return gpu == 0 or need.gpu_memory_bytes <= gpu


def _size(pool: PoolSpec) -> tuple[float, float, float]:
    host, gpu, disk = pool.limits()
    return gpu, host, disk


def covers(big: PoolSpec, small: PoolSpec) -> bool:
    """Every job that fits ``small`` fits ``big``: more host memory and disk, and a card
    as large (a GPU pool covers a CPU pool when its card holds the engine's whole GPU
    budget, which caps any job's GPU working set)."""
    b, s = big.limits(), small.limits()
    if b[0] < s[0] or b[2] < s[2]:
        return False
    return b[1] == s[1] or b[1] >= (s[1] if s[1] > 0 else GPU_BUDGET_BYTES)


def route(need: Need, pools: Mapping[str, PoolSpec]) -> str:
    """The pool the job queues for; NoCapableWorker naming the need and the largest pool
    when none fits."""
    fitting = sorted((n for n, p in pools.items() if fits(need, p)),
                     key=lambda n: (_size(pools[n]), n))
    if fitting:
        return fitting[0]
    largest = max(pools, key=lambda n: (_size(pools[n])[1], _size(pools[n]), n))
    spec = pools[largest]
    raise NoCapableWorker(
        f"no worker pool can run this job: it needs about {_gib(need.host_memory_bytes)} "
        f"host memory, {_gib(need.gpu_memory_bytes)} GPU memory (on a GPU worker) and "
        f"{_gib(need.disk_bytes)} disk; the largest pool, {largest!r}, has "
        f"{_limit(spec.host_memory_gib)} host memory, {spec.gpu_memory_gib:g} GiB GPU "
        f"memory and {_limit(spec.disk_gib)} disk",
        need=need.to_dict(), largest_pool={"name": largest, **spec.model_dump()})


def served_by(pool: str, pools: Mapping[str, PoolSpec]) -> list[str]:
    """The queues a worker of ``pool`` takes from, in order: its own, then each pool it
    covers, the largest first."""
    own = pools[pool]
    smaller = [n for n, p in pools.items() if n != pool and covers(own, p)]
    return [pool, *sorted(smaller, key=lambda n: (_size(pools[n]), n), reverse=True)]


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _limit(gib: float | None) -> str:
    return "unlimited" if gib is None else f"{gib:g} GiB"
