"""Prometheus families built from Redis at scrape time.

Job counts and durations live in Redis (the status sets and the ``maec:metrics`` hash
the workers increment), so every API replica reports the same numbers and a restart
loses none of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.jobs.accounting import DURATION_BUCKETS, bucket_field
from app.jobs.api_store import ApiJobStore
from app.jobs.record import STATUSES
from app.scheduler.view import QueueView
from app.settings import Settings


class _Snapshot(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


async def _scheduler_families(view: QueueView, by_key: bool) -> list[Metric]:
    """Per pool: queued, active, live workers; with ``by_key``, per key: queued and
    running jobs (what a KEDA scaler or a dashboard reads; counts only, never a job's
    details). Key ids become labels only when the operator asks: they name the
    service's tenants."""
    running = await view.running_by()
    queued = await view.queued_by()
    pools = await view.pools(running, queued)
    pq = GaugeMetricFamily("maec_pool_queued", "Jobs waiting in a pool's queue",
                           labels=["pool"])
    pa = GaugeMetricFamily("maec_pool_active", "Jobs a pool's workers are running",
                           labels=["pool"])
    pw = GaugeMetricFamily("maec_pool_workers", "Live workers of a pool", labels=["pool"])
    for name, state in sorted(pools.items()):
        pq.add_metric([name], state.queued)
        pa.add_metric([name], state.active)
        pw.add_metric([name], state.workers)
    if not by_key:
        return [pq, pa, pw]
    kq = GaugeMetricFamily("maec_key_queued", "Queued jobs per API key", labels=["key"])
    kr = GaugeMetricFamily("maec_key_running", "Running jobs per API key", labels=["key"])
    per_key: dict[str, int] = {}
    for per in queued.values():
        for owner, n in per.items():
            per_key[owner] = per_key.get(owner, 0) + n
    for owner, n in sorted(per_key.items()):
        kq.add_metric([owner], n)
    runs: dict[str, int] = {}
    for owner, _, _ in running:
        runs[owner] = runs.get(owner, 0) + 1
    for owner, n in sorted(runs.items()):
        kr.add_metric([owner], n)
    return [pq, pa, pw, kq, kr]


async def render_metrics(store: ApiJobStore, settings: Settings,
                         view: QueueView | None = None) -> bytes:
    counts = await store.status_counts()
    raw = await store.metrics_hash()
    workers = await store.live_workers(3 * settings.worker_heartbeat_seconds)

    jobs = GaugeMetricFamily("maec_jobs", "Jobs by current status", labels=["status"])
    for s in STATUSES:
        jobs.add_metric([s], counts.get(s, 0))
    finished = CounterMetricFamily("maec_jobs_finished", "Jobs that ended, by outcome",
                                   labels=["status"])
    for s in ("succeeded", "failed", "cancelled"):
        finished.add_metric([s], raw.get(f"finished_total:{s}", 0.0))
    duration = HistogramMetricFamily(
        "maec_job_duration_seconds", "Wall time from claim to end, per job"
    )
    duration.add_metric(
        [],
        [("+Inf" if math.isinf(le) else repr(float(le)), raw.get(bucket_field(le), 0.0))
         for le in DURATION_BUCKETS],
        sum_value=raw.get("duration_sum", 0.0),
    )
    published = CounterMetricFamily("maec_published_bytes", "Bytes of results published")
    published.add_metric([], raw.get("bytes_published_total", 0.0))
    live = GaugeMetricFamily("maec_workers_live", "Workers with a recent heartbeat")
    live.add_metric([], workers)

    registry = CollectorRegistry(auto_describe=False)
    extra = await _scheduler_families(view, settings.metrics_per_key) \
        if view is not None else []
    registry.register(_Snapshot([jobs, finished, duration, published, live, *extra]))
    return generate_latest(registry)
