"""Load: 200 jobs submitted concurrently by 20 clients while they poll status, on two
workers with tiny models and SeaweedFS. All succeed, each exactly once; submit latency
percentiles and throughput are reported (RESULT figures and docs/reliability.md).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.reliability import helpers as h
from tests.reliability import results
from tests.stack import S3Server, Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

CLIENTS = 20
JOBS_PER_CLIENT = 10
ENV = {"MAEC_RATE_LIMIT_PER_MINUTE": "1000000", "MAEC_RATE_LIMIT_BURST": "100000",
       "MAEC_SUBMISSIONS_PER_MINUTE": "100000", "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "1000",
       "MAEC_PROGRESS_INTERVAL": "0.5"}


@pytest.fixture(scope="module")
def load_stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
               model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("load"), None, storage="s3", s3=s3_server,
                       workers=2, local_roots=[model_root], env=ENV) as st:
        yield st


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_200_jobs_20_clients_2_workers(load_stack: Stack, s3_server: S3Server,
                                       tiny: dict[str, Path]) -> None:
    body = {"method": "linear", "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["base"])}
    submit_ms: list[float] = []
    finished: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    polls = [0]
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)
    deadline = time.monotonic() + 600

    def client(n: int) -> None:
        key = "alice" if n % 2 == 0 else "bob"
        mine: list[str] = []
        with load_stack.client(key) as c:
            start.wait()
            for j in range(JOBS_PER_CLIENT):
                t = time.perf_counter()
                resp = c.post("/v1/jobs", json={**body, "name": f"load-{n}-{j}"})
                with lock:
                    submit_ms.append((time.perf_counter() - t) * 1000)
                if resp.status_code != 202:
                    errors.append(f"client {n}: {resp.status_code} {resp.text[:200]}")
                    continue
                mine.append(resp.json()["id"])
            pending = list(mine)
            while pending and time.monotonic() < deadline:
                still = []
                for jid in pending:
                    job = c.get(f"/v1/jobs/{jid}").json()
                    with lock:
                        polls[0] += 1
                    if job.get("status") in ("succeeded", "failed", "cancelled"):
                        with lock:
                            finished[jid] = job
                    else:
                        still.append(jid)
                pending = still
                time.sleep(0.5)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0

    total = CLIENTS * JOBS_PER_CLIENT
    assert errors == [], errors[:5]
    statuses = [j["status"] for j in finished.values()]
    results.figure("load_jobs", total)
    results.figure("load_wall_s", round(wall, 1))
    results.figure("load_jobs_per_minute", round(total / wall * 60, 1))
    results.figure("load_submit_ms_p50", round(_pct(submit_ms, 50), 1))
    results.figure("load_submit_ms_p99", round(_pct(submit_ms, 99), 1))
    results.figure("load_submit_ms_max", round(max(submit_ms), 1))
    results.figure("load_status_polls", polls[0])
    durations = [_ts(j["finished_at"]) - _ts(j["created_at"]) for j in finished.values()
                 if j.get("finished_at")]
    if durations:
        results.figure("load_job_latency_s_p50", round(statistics.median(durations), 1))
        results.figure("load_job_latency_s_p99", round(_pct(durations, 99), 1))
    lost, dup = h.audit(load_stack, s3_server, list(finished), h.worker_logs(load_stack))
    lost += total - len(finished)
    results.add("lost_jobs", total - len(finished))
    assert len(finished) == total, f"{total - len(finished)} jobs never finished"
    assert statuses.count("succeeded") == total, statuses
    assert all(j["attempts"] == 1 for j in finished.values())
    assert (lost, dup) == (0, 0)
    for jid, job in list(finished.items())[:: max(1, total // 20)]:  # spot-check layouts
        h.assert_published_once(s3_server, job, h.record(load_stack, jid))
