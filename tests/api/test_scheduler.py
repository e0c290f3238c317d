"""The fair-share scheduler over a real Redis: which job a free worker takes (fair share
between keys, priority bands, a sweep's cost, weights, FIFO), routing by size and the
refusal of a job no pool can hold, a queued job's place, GET /v1/queue and the gauges,
and the heartbeat's repair of lost wake-ups. Takes are the worker's own store calls; no
worker process runs here."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from celery import Celery
from click.testing import CliRunner

from app.jobs.calls import Taken
from app.jobs.keys import (
    HOLD_MS,
    SCHED_SERVED_KEY,
    job_key,
    sched_done_key,
    sched_owners_key,
    sched_queue_key,
    sched_topup_key,
    status_key,
)
from app.queue import QUEUE
from app.scheduler.estimate import GPU_BUDGET_BYTES, whole_tensor_bytes
from app.scheduler.pools import covers, served_by
from app.settings import PoolSpec, Settings
from maec_client import AsyncClient, Client, ClientConfig, QueueSummary
from maec_client.cli import main
from tests.api.conftest import API_KEYS, Api
from worker.sweeper import top_up_wakeups

GIB = 1 << 30


def take(api: Api, pools: list[str] | None = None, *, worker_pool: str = QUEUE,
         policy: str = "fair", weights: dict[str, float] | None = None) -> Taken:
    return api.worker_store().take(pools or [QUEUE], worker="w", pool=worker_pool,
                                   lease_s=30, max_attempts=3, policy=policy,
                                   weights=weights or {})


def owner_of(api: Api, job_id: str) -> str:
    return str(json.loads(api.r.hget(job_key(job_id), "owner") or b'""'))


def finish(api: Api, job_id: str) -> None:
    rec = api.worker_store().get(job_id)
    assert rec is not None
    ok, _ = api.worker_store().transition(job_id, allowed=("running",), to="succeeded",
                                          attempt=rec.attempts)
    assert ok


def queue_as_the_client_reads_it(api: Api, key: str) -> dict[str, Any]:
    """``GET /v1/queue`` through Client.queue, AsyncClient.queue and ``maec jobs queue
    --json`` against this app: all three parse the contract's QueueSummary, and what
    they give back is the answer as served."""
    def forward(request: httpx.Request) -> httpx.Response:
        got = api.client.request(request.method, request.url.path,
                                 headers=dict(request.headers), content=request.content)
        return httpx.Response(got.status_code, headers=got.headers, content=got.content)

    config = ClientConfig(url="http://testserver", api_key=API_KEYS[key])
    with Client(config=config, transport=httpx.MockTransport(forward)) as client:
        summary = client.queue()
    assert isinstance(summary, QueueSummary) and summary.key == key

    async def read_async() -> QueueSummary:
        async with AsyncClient(config=config,
                               transport=httpx.MockTransport(forward)) as aclient:
            return await aclient.queue()

    assert asyncio.run(read_async()) == summary
    cli = CliRunner().invoke(
        main, ["jobs", "queue", "--json"], catch_exceptions=False,
        obj={"client_factory": lambda **_: Client(config=config,
                                                  transport=httpx.MockTransport(forward))})
    assert cli.exit_code == 0, cli.output
    text = CliRunner().invoke(
        main, ["jobs", "queue"], catch_exceptions=False,
        obj={"client_factory": lambda **_: Client(config=config,
                                                  transport=httpx.MockTransport(forward))})
    assert f"key {key} (fair): {summary.jobs.queued} queued" in text.output
    assert json.loads(cli.stdout) == summary.model_dump(mode="json")
    return summary.model_dump(mode="json")


def test_the_engines_figures_are_the_estimates(api: Api) -> None:
    from maec_core import runtime

    assert GPU_BUDGET_BYTES == runtime.GPU_BUDGET_BYTES
    assert whole_tensor_bytes(1000, 3, 4) == runtime.whole_tensor_bytes(1000, 3, 4)


@pytest.mark.parametrize("policy", ["fair", "fifo"])
def test_a_small_key_is_not_stuck_behind_a_large_one(api: Api, policy: str) -> None:
    """alice queues six jobs, then bob two. Fair: bob's jobs go second and fourth (bob
    has less running each time); FIFO: after all of alice's."""
    ids = [str(api.submit()["id"]) for _ in range(6)]
    ids += [str(api.submit(key="bob")["id"]) for _ in range(2)]
    order = []
    for _ in range(8):
        got = take(api, policy=policy)
        assert got.outcome == "claimed" and got.attempt == 1
        order.append(owner_of(api, got.job_id))
    if policy == "fair":
        assert order == ["alice", "bob", "alice", "bob", "alice", "alice", "alice", "alice"]
    else:
        assert order == ["alice"] * 6 + ["bob"] * 2
    assert take(api).outcome == "empty"
    assert {api.worker_store().get(i).status for i in ids} == {"running"}  # type: ignore[union-attr]


def test_share_follows_running_work_a_sweeps_cost_and_weights(api: Api) -> None:
    a = [str(api.submit()["id"]) for _ in range(4)]
    for _ in range(4):
        api.submit(key="bob")
    first = take(api)
    assert first.job_id == a[0]
    # alice's running job is a 3-candidate sweep: it counts 3 against her share.
    api.r.hset(job_key(a[0]), "cost", "3")
    assert [owner_of(api, take(api).job_id) for _ in range(3)] == ["bob", "bob", "bob"]
    # Her job ends: 0 against bob's 3, so hers come next until level.
    finish(api, a[0])
    assert owner_of(api, take(api).job_id) == "alice"
    # Running 1 (alice) against 3 (bob): alice's turn at equal weights, but bob's with
    # weight 4 (3/4 < 1); then level (4/4 = 1/1), the least served (alice) goes.
    assert owner_of(api, take(api, weights={"bob": 4.0}).job_id) == "bob"
    assert owner_of(api, take(api, weights={"bob": 4.0}).job_id) == "alice"


def test_a_split_jobs_parts_count_against_its_key(api: Api) -> None:
    """alice's job runs split, its parts on three workers (its own and two helpers):
    for the scheduler she holds three workers, not one, so bob's jobs go next; a part
    whose lease ran out (its worker died) no longer counts."""
    def take_as(worker: str) -> str:
        got = api.worker_store().take([QUEUE], worker=worker, pool=QUEUE, lease_s=30,
                                      max_attempts=3, policy="fair", weights={})
        assert got.outcome == "claimed"
        return got.job_id

    for _ in range(2):
        api.submit()
    for _ in range(3):
        api.submit(key="bob")
    a0 = take_as("wa")
    assert owner_of(api, a0) == "alice"
    parts = api.worker_store().parts()
    parts.create(a0, f"jobs/{a0}/a1", [(0, 1), (1, 2), (2, 3)])
    claimed = {w: parts.claim(a0, worker=w, lease_s=30, now=time.time(), max_attempts=3)
               for w in ("wa", "h1", "h2")}
    assert sorted(i for i, _ in claimed.values()) == [0, 1, 2]
    # 3 against bob's 0, then 1, then 2: his turns (counted as one job, her turn came
    # at his second).
    assert [owner_of(api, take_as(w)) for w in ("w1", "w2")] == ["bob", "bob"]
    # h2 died: once its part's lease ran out she holds two workers against his two, and
    # the tie goes to her (served least).
    i, attempt = claimed["h2"]
    assert parts.update(a0, i, attempt, {"lease_until": time.time() - 1})
    assert owner_of(api, take_as("w3")) == "alice"


def live_workers(api: Api, n: int, pool: str = QUEUE) -> None:
    for i in range(n):
        api.worker_store().heartbeat(f"w{i}", pool=pool)


def test_a_newcomer_is_owed_one_round_of_the_pool(api: Api) -> None:
    """Three live workers have each just run one of alice's jobs (short jobs: done before
    the next take, so running work is level at 0) when bob submits three. bob starts one
    round behind her (3 jobs), so the next three workers take his jobs, then hers again;
    without that credit the ties would alternate and his third job would wait for the
    fifth worker."""
    live_workers(api, 3)
    for _ in range(8):
        api.submit()
    for _ in range(3):
        got = take(api)
        assert owner_of(api, got.job_id) == "alice"
        finish(api, got.job_id)
    for _ in range(3):
        api.submit(key="bob")
    order = []
    for _ in range(4):
        got = take(api)
        order.append(owner_of(api, got.job_id))
        finish(api, got.job_id)
    assert order == ["bob", "bob", "bob", "alice"]


def test_a_finished_job_holds_its_worker_until_that_worker_takes_again(api: Api) -> None:
    """w1 has just finished alice's job (turning around to its next: a fresh child, the
    next message) while w2 runs bob's. For w3 that is one worker each, not 0 against 1, so
    the tie goes to bob, served less; when w1 itself takes again its own hold no longer
    counts; a hold older than HOLD_MS counts for nothing."""
    def take_as(worker: str) -> str:
        got = api.worker_store().take([QUEUE], worker=worker, pool=QUEUE, lease_s=30,
                                      max_attempts=3, policy="fair", weights={})
        assert got.outcome == "claimed"
        return got.job_id

    for _ in range(4):
        api.submit()
    for _ in range(4):
        api.submit(key="bob")
    a1 = take_as("w1")
    assert owner_of(api, a1) == "alice"
    finish(api, a1)
    b1 = take_as("w2")
    assert owner_of(api, b1) == "bob"
    api.r.zadd(SCHED_SERVED_KEY, {"alice": 1.0, "bob": 0.0})
    assert owner_of(api, take_as("w3")) == "bob"
    # w1 takes: its own finished job is behind it; alice 0 running against bob's 2.
    a2 = take_as("w1")
    assert owner_of(api, a2) == "alice"
    # alice's job on w1 and bob's on w2 end; bob still runs one (w3). Held, alice's
    # counts 1 against bob's 1 and the tie goes to bob (served less); once the hold has
    # lapsed she has 0 against his 1.
    finish(api, a2)
    finish(api, b1)
    api.r.zadd(SCHED_SERVED_KEY, {"alice": 50.0, "bob": 0.0})
    api.r.zadd(status_key("succeeded"), {a2: time.time() * 1000 - HOLD_MS - 1000})
    assert owner_of(api, take_as("w2")) == "alice"


@pytest.mark.parametrize(("alice_weight", "start"), [(1.0, 98.0), (2.0, 99.0)])
def test_a_key_back_from_idle_is_owed_no_more_than_one_round(
        api_factory: Any, alice_weight: float, start: float) -> None:
    """alice has been served 100 units when bob, idle since his last job (served 1),
    queues with two live workers: he starts at 98 (her 100 less one round of 2 jobs), not
    at 1, so he does not win every tie until he has caught up 99 jobs. Served counts cost
    per weight, and so does the round taken off it: at weight 2 her 2 jobs count 1."""
    api = api_factory(key_weights={"alice": alice_weight})
    live_workers(api, 2)
    api.submit()
    api.r.zadd(SCHED_SERVED_KEY, {"alice": 100.0, "bob": 1.0})
    api.submit(key="bob")
    assert api.r.zscore(SCHED_SERVED_KEY, "bob") == pytest.approx(start)


def test_priority_bands_and_caps(api_factory: Any) -> None:
    api: Api = api_factory(priority_caps={"bob": "high"})
    low = str(api.submit(api.named(priority="low"))["id"])
    normal = [str(api.submit()["id"]) for _ in range(2)]
    high = str(api.submit(api.named(priority="high"), key="bob")["id"])
    assert take(api).job_id == high  # every high before any normal
    got = [take(api).job_id for _ in range(2)]
    assert got == normal
    assert take(api).job_id == low  # low last
    # alice's cap is the default, normal.
    r = api.client.post("/v1/jobs", json=api.named(priority="high"), headers=api.auth())
    assert r.status_code == 403 and r.json()["code"] == "priority_not_allowed"
    assert r.json()["details"] == {"priority": "high", "cap": "normal"}
    r = api.client.post("/v1/jobs", json=api.named(priority="urgent"), headers=api.auth())
    assert r.status_code == 422


def test_cancelled_or_directly_claimed_jobs_leave_the_queue(api: Api) -> None:
    ids = [str(api.submit()["id"]) for _ in range(3)]
    assert api.client.post(f"/v1/jobs/{ids[0]}/cancel", headers=api.auth()).status_code == 202
    # A message naming the job (a redelivery) claims it outside the scheduler.
    store = api.worker_store()
    assert store.claim(ids[1], worker="w", lease_s=30, max_attempts=3).outcome == "claimed"
    assert store.pending(QUEUE) == 1
    assert take(api).job_id == ids[2]
    assert take(api).outcome == "empty" and store.pending(QUEUE) == 0


def test_routing_by_size_and_refusing_what_no_pool_holds(api_factory: Any) -> None:
    pools = {"small": {"host_memory_gib": 1, "disk_gib": 1},
             "large": {"host_memory_gib": 64, "disk_gib": 500},
             "gpu-24g": {"host_memory_gib": 64, "gpu_memory_gib": 24, "disk_gib": 500}}
    api: Api = api_factory(pools=pools, worker_pool="large")
    job = api.submit()
    assert job["pool"] == "small"  # the smallest that holds it
    est = job["estimate"]
    assert est["host_memory_bytes"] < GIB and 0 < est["disk_bytes"] < GIB
    assert api.r.llen("small") == 1 and api.r.llen(QUEUE) == 0
    # A worker of the large pool takes the small pool's jobs (it covers it); its own first.
    assert served_by("large", api.settings.pools) == ["large", "small"]
    assert served_by("small", api.settings.pools) == ["small"]
    got = take(api, served_by("large", api.settings.pools), worker_pool="large")
    assert got.job_id == job["id"]
    assert api.worker_store().get(job["id"]).ran_pool == "large"  # type: ignore[union-attr]

    tight: Api = api_factory(pools={"cpu": {"host_memory_gib": 0.25, "disk_gib": 100},
                                    "tiny-gpu": {"host_memory_gib": 0.3,
                                                 "gpu_memory_gib": 4}},
                             worker_pool="cpu")
    r = tight.client.post("/v1/jobs", json=tight.named(), headers=tight.auth())
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "no_capable_worker"
    assert "tiny-gpu" in body["message"] and "host memory" in body["message"]
    assert body["details"]["largest_pool"]["name"] == "tiny-gpu"
    assert body["details"]["need"]["host_memory_bytes"] > 0.3 * GIB
    assert not tight.r.keys("maec:job:*") and tight.r.llen("cpu") == 0


def to_pool(api: Api, job_id: str, pool: str) -> None:
    """Move a queued job of the default route to ``pool``'s queue, as if routed there."""
    rec = api.worker_store().get(job_id)
    assert rec is not None and rec.pool is not None
    score = api.r.zscore(sched_queue_key(rec.pool, rec.owner), job_id)
    api.r.zrem(sched_queue_key(rec.pool, rec.owner), job_id)
    api.r.zadd(sched_queue_key(pool, rec.owner), {job_id: score})
    api.r.sadd(sched_owners_key(pool), rec.owner)
    api.r.hset(job_key(job_id), "pool", json.dumps(pool))


def test_a_large_worker_gives_a_key_owed_a_turn_a_small_job(api_factory: Any) -> None:
    """alice runs a small job and has a large one queued; bob has a small one. A large
    worker (serving large, then small) is free: the fair share is decided across both of
    its pools, so bob (nothing running) gets it, from the small pool, and the large pool's
    message is sent again for alice's job; when alice is the one owed the turn, her large
    job comes before her small ones (her jobs only this worker can run, first)."""
    from app.storage.local import LocalStorage
    from worker.dispatch import take_next
    from worker.runner import JobRunner

    pools = {"small": {"host_memory_gib": 1, "disk_gib": 1},
             "large": {"host_memory_gib": 64, "disk_gib": 500}}
    api: Api = api_factory(pools=pools, worker_pool="large")
    a = [str(api.submit()["id"]) for _ in range(3)]
    to_pool(api, a[1], "large")
    b1 = str(api.submit(key="bob")["id"])
    assert take(api, ["small"], worker_pool="small").job_id == a[0]
    api.r.delete("small", "large")  # the wake-ups, read here by hand
    sent: list[str] = []
    runner = JobRunner(api.settings, api.worker_store(),
                       LocalStorage(api.settings.storage_dir), worker="big")
    assert take_next(runner, "large", wake=sent.append) == "succeeded"
    assert api.worker_store().get(b1).status == "succeeded"  # type: ignore[union-attr]
    assert sent == ["large"]  # alice's large job keeps a message waiting for it
    # bob is done and alice's small job is over: hers next, the large one first.
    finish(api, a[0])
    got = take(api, ["large", "small"], worker_pool="large")
    assert (got.job_id, got.pool) == (a[1], "large")


def test_pool_cover_rules() -> None:
    cpu = PoolSpec(host_memory_gib=32, disk_gib=100)
    gpu_small = PoolSpec(host_memory_gib=64, gpu_memory_gib=4, disk_gib=500)
    gpu = PoolSpec(host_memory_gib=64, gpu_memory_gib=24, disk_gib=500)
    assert covers(gpu, cpu) and covers(gpu, gpu_small) and not covers(gpu_small, gpu)
    # A card smaller than the engine's GPU budget may not hold a CPU job's working set.
    assert not covers(gpu_small, cpu) and not covers(cpu, gpu)
    with pytest.raises(ValueError, match="MAEC_WORKER_POOL"):
        Settings(dev_mode=True, pools={"cpu": cpu}, worker_pool="gpu")
    with pytest.raises(ValueError, match="pool name"):
        Settings(dev_mode=True, pools={"webhooks": cpu}, worker_pool="webhooks")


def test_a_queued_jobs_place_and_the_queue_summary(api: Api) -> None:
    a = [str(api.submit()["id"]) for _ in range(3)]
    b = str(api.submit(key="bob")["id"])

    def place(job_id: str, key: str = "alice") -> dict[str, Any]:
        job = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth(key)).json()
        return dict(job["queue"])

    assert [place(i)["position"] for i in a] == [0, 2, 3]
    assert place(b, "bob")["position"] == 1  # after alice's first, before her second
    assert place(b, "bob")["eta_s"] is None  # no live worker, no finished job yet
    store = api.worker_store()
    store.heartbeat("w1", QUEUE)
    store.heartbeat("w2", QUEUE)
    api.r.lpush(sched_done_key(QUEUE), "10", "10", "30")
    assert place(a[2])["eta_s"] == 20.0  # ceil((3 + 1) / 2) rounds of the 10 s median

    summary = api.client.get("/v1/queue", headers=api.auth("bob")).json()
    assert queue_as_the_client_reads_it(api, "bob") == summary
    assert summary["key"] == "bob"
    assert summary["jobs"] == {"queued": 1, "running": 0, "running_cost": 0}
    assert [j["id"] for j in summary["queued"]] == [b]
    pool = summary["pools"][QUEUE]
    assert (pool["queued"], pool["active"], pool["workers"]) == (4, 0, 2)
    assert not any(i in json.dumps(summary) for i in a)  # never another key's jobs
    took = take(api)
    assert took.job_id == a[0]
    summary = api.client.get("/v1/queue", headers=api.auth()).json()
    assert summary["jobs"]["running"] == 1 and summary["pools"][QUEUE]["active"] == 1
    assert api.client.get(f"/v1/jobs/{a[0]}", headers=api.auth()).json()["queue"] is None

    text = api.client.get("/metrics", headers=api.operator()).text
    assert f'maec_pool_queued{{pool="{QUEUE}"}} 3.0' in text
    assert f'maec_pool_active{{pool="{QUEUE}"}} 1.0' in text
    # Key ids are labels only when the operator turns them on (they name the tenants).
    assert "maec_key_" not in text and "alice" not in text and "bob" not in text
    api.settings.metrics_per_key = True  # the app reads the same Settings object
    text = api.client.get("/metrics", headers=api.operator()).text
    assert 'maec_key_queued{key="bob"} 1.0' in text
    assert 'maec_key_running{key="alice"} 1.0' in text
    assert api.client.get("/v1/queue").status_code == 401


def test_the_heartbeat_replaces_lost_wakeups_and_only_those(api: Api) -> None:
    for _ in range(3):
        api.submit()
    store = api.worker_store()
    celery = Celery("t", broker=api.settings.redis_url, set_as_current=False)
    try:
        assert api.r.llen(QUEUE) == 3
        assert top_up_wakeups(store, celery, api.settings) == {}  # nothing is missing
        api.r.delete(QUEUE)  # the messages are lost (a broker restarted behind the store)
        api.r.delete(sched_topup_key(QUEUE))
        assert top_up_wakeups(store, celery, api.settings) == {QUEUE: 3}
        assert api.r.llen(QUEUE) == 3
        # One worker per heartbeat period does it.
        api.r.delete(QUEUE)
        assert top_up_wakeups(store, celery, api.settings) == {}
    finally:
        celery.close()


def test_a_finished_jobs_estimate_stands_beside_its_measured_peak(api: Api) -> None:
    from app.storage.local import LocalStorage
    from worker.dispatch import take_next
    from worker.runner import JobRunner

    job = api.submit()
    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                       worker="t")
    assert take_next(runner, QUEUE) == "succeeded"
    done = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth()).json()
    assert done["status"] == "succeeded" and done["ran_pool"] == QUEUE
    assert done["measured"]["peak_rss_bytes"] > 50 * (1 << 20)
    assert done["estimate"] == job["estimate"]
    assert take_next(runner, QUEUE) == "empty"
    assert api.r.lrange(sched_done_key(QUEUE), 0, -1)  # feeds the ETA
