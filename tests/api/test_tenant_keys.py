"""One tenant against another through the names of things: Redis keys built from key ids,
pools and idempotency keys, the idempotent replay, and /metrics.

Written as a hostile tenant (or a careless operator) would try it: key ids and
idempotency keys chosen so that joining them with ``:`` gives the same text, a replay
aimed at another key's job, and a tenant key reading the operator's metrics.
"""

from __future__ import annotations

import asyncio
import itertools

import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from app.jobs import keys
from app.jobs.api_store import ApiJobStore
from app.jobs.keys import (
    active_key,
    idem_key,
    owner_key,
    sched_done_key,
    sched_owners_key,
    sched_queue_key,
    usage_key,
)
from app.jobs.record import JobRecord, new_job_id, now_iso
from app.queue import QUEUE
from tests.api.conftest import Api

# Text a key id, pool or idempotency key could hold if nothing stopped it: ':' above all.
_TEXT = st.text(alphabet=st.sampled_from("ab:1é\x00 "), max_size=6)


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(_TEXT, _TEXT), b=st.tuples(_TEXT, _TEXT))
def test_keys_built_from_two_parts_are_injective(a: tuple[str, str],
                                                 b: tuple[str, str]) -> None:
    """Different (owner, idempotency key) or (pool, owner) pairs never share a key, and
    one-part keys never share one either, whatever the values hold. Besides ``b``, every
    other split of ``a``'s ``:``-joined text is tried: the pairs a separator confuses."""
    joined = ":".join(a)
    splits = [(joined[:i], joined[i + 1:]) for i, c in enumerate(joined) if c == ":"]
    for other in (b, *splits):
        for build in (idem_key, sched_queue_key):
            assert (build(*a) == build(*other)) == (a == other), (build, a, other)
    for build1 in (owner_key, active_key, usage_key, sched_owners_key, sched_done_key):
        assert (build1(a[0]) == build1(b[0])) == (a[0] == b[0]), build1


def test_the_colon_split_that_used_to_alias_is_two_keys() -> None:
    assert idem_key("alice", "ci:X") != idem_key("alice:ci", "X")
    assert sched_queue_key("p:a", "b") != sched_queue_key("p", "a:b")
    assert keys.part("alice") == "5:alice" and keys.part("é") == "2:é"  # bytes, as Lua counts


def test_lua_builds_the_same_keys_as_python(api: Api) -> None:
    """The scripts build the active set and the scheduler keys from a record's owner and
    pool in Lua: one definition (keys.LUA_KEYS), identical to the Python builders."""
    lua = ("local A = {active_prefix = ARGV[1], sched_prefix = ARGV[2]}\n" + keys.LUA_KEYS + """
return {active_key(ARGV[3]), sched_queue_key(ARGV[4], ARGV[3]), sched_owners_key(ARGV[4]),
        sched_done_key(ARGV[4])}""")
    for owner, pool in itertools.product(["alice", "alice:ci", "", "é:ü", "a b", "x" * 200],
                                         ["merges", "p:a", "", "ünï"]):
        got = [k.decode() for k in api.r.eval(lua, 0, keys.ACTIVE_PREFIX, keys.SCHED_PREFIX,
                                              owner, pool)]
        assert got == [active_key(owner), sched_queue_key(pool, owner),
                       sched_owners_key(pool), sched_done_key(pool)], (owner, pool)


def _record(owner: str, idem: str) -> JobRecord:
    return JobRecord(id=new_job_id(), owner=owner, method="linear", recipe={},
                     created_at=now_iso(), idempotency_key=idem, pool=QUEUE)


def test_owner_ids_with_colons_never_share_a_slot_in_the_store(api: Api) -> None:
    """Below the settings' key-id alphabet the store itself keeps owners apart: ``alice``
    with idempotency key ``ci:X`` and ``alice:ci`` with ``X`` are two jobs, each counted in
    its own owner's active set and fair-share queue, and a worker takes both."""

    async def go() -> list[tuple[str, str]]:
        store = ApiJobStore(aioredis.Redis.from_url(api.settings.redis_url))
        try:
            out = []
            for owner, idem in (("alice", "ci:X"), ("alice:ci", "X"), ("alice", "ci:X")):
                out.append(await store.create(_record(owner, idem), max_active=1,
                                              weights={}))
            return out
        finally:
            await store.close()

    (o1, first), (o2, second), (o3, again) = asyncio.run(go())
    assert (o1, o2) == ("created", "created") and first != second
    # alice's own replay still finds her job (and is not refused by max_active=1).
    assert (o3, again) == ("existing", first)
    assert api.r.smembers(active_key("alice")) == {first.encode()}
    assert api.r.smembers(active_key("alice:ci")) == {second.encode()}
    assert api.r.zrange(sched_queue_key(QUEUE, "alice:ci"), 0, -1) == [second.encode()]
    store = api.worker_store()
    taken = {store.take([QUEUE], worker=f"w{i}", pool=QUEUE, lease_s=30, max_attempts=3,
                        policy="fair", weights={}).job_id for i in range(3)}
    assert taken == {first, second, ""}
    # Leaving the queue emptied both owners' queues through the Lua-built keys.
    assert not api.r.exists(sched_queue_key(QUEUE, "alice:ci"),
                            sched_queue_key(QUEUE, "alice"))
    assert not api.r.smembers(sched_owners_key(QUEUE))


def test_a_replay_never_answers_with_another_keys_job(api: Api) -> None:
    """An idempotency slot that names another key's job (a store written by an older key
    layout) is a 409 for the caller, never that job's record or id, and the owner's own
    replay is untouched."""
    alice = api.submit(api.named(idempotency_key="nightly"))
    api.r.set(idem_key("bob", "nightly"), str(alice["id"]))
    r = api.client.post("/v1/jobs", json=api.named(idempotency_key="nightly"),
                        headers=api.auth("bob"))
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "idempotency_conflict"
    assert str(alice["id"]) not in r.text and "alice" not in r.text
    mine = api.client.post("/v1/jobs", json=api.named(idempotency_key="nightly"),
                           headers=api.auth())
    assert mine.status_code == 200 and mine.json()["id"] == alice["id"]


def test_a_stale_idempotency_slot_is_taken_over(api: Api) -> None:
    """A slot whose job is gone is no match: the submission queues a new job."""
    api.r.set(idem_key("alice", "k"), "j_0000000000000000gone")
    r = api.client.post("/v1/jobs", json=api.named(idempotency_key="k"), headers=api.auth())
    assert r.status_code == 202, r.text
    assert api.r.get(idem_key("alice", "k")) == r.json()["id"].encode()


# -- /metrics: the operator's, not the tenants' --


def test_a_tenant_key_cannot_read_metrics(api: Api) -> None:
    api.submit()
    api.submit(key="bob")
    for who in ("alice", "bob"):
        r = api.client.get("/metrics", headers=api.auth(who))
        assert r.status_code == 403, r.text
        assert r.json()["code"] == "operator_only"
        assert "maec_" not in r.text and "bob" not in r.text and "alice" not in r.text
    text = api.client.get("/metrics", headers=api.operator()).text
    assert 'maec_jobs{status="queued"} 2.0' in text
    assert "maec_key_" not in text and 'key="' not in text  # no tenant named by default


def test_without_an_operator_token_only_dev_mode_serves_metrics(api_factory: object
                                                                 ) -> None:
    """No MAEC_METRICS_TOKEN_SHA256: no API key reads /metrics; dev mode (`make run`, one
    local user, auth off) still does, without a token."""
    api: Api = api_factory(metrics_token_sha256=None)  # type: ignore[operator]
    r = api.client.get("/metrics", headers=api.auth())
    assert r.status_code == 403 and r.json()["code"] == "operator_only"
    dev: Api = api_factory(dev_mode=True, api_keys={},  # type: ignore[operator]
                           metrics_token_sha256=None)
    r = dev.client.get("/metrics")
    assert r.status_code == 200 and "maec_jobs" in r.text


def test_per_key_gauges_only_when_the_operator_asks(api_factory: object) -> None:
    api: Api = api_factory(metrics_per_key=True)  # type: ignore[operator]
    api.submit(key="bob")
    text = api.client.get("/metrics", headers=api.operator()).text
    assert 'maec_key_queued{key="bob"} 1.0' in text


def test_redis_holds_no_key_joined_from_an_owner(api: Api) -> None:
    """After a submission every key that names the owner names it as a part."""
    api.submit(api.named(idempotency_key="x"))
    names = [k.decode() for k in redis.Redis.from_url(api.settings.redis_url).scan_iter()]
    named = [n for n in names if "alice" in n]
    assert named and all("5:alice" in n for n in named), named


def test_index_entries_naming_another_keys_job_list_nothing(api: Api) -> None:
    """Listings read ids from per-key indexes, then the records: a record that is not the
    caller's is never shown, whatever put its id in the caller's index (the job list, the
    fair-share queue behind /v1/queue)."""
    alice = str(api.submit()["id"])
    bob = str(api.submit(key="bob")["id"])
    api.r.zadd(owner_key("bob"), {alice: 0})
    api.r.zadd(sched_queue_key(QUEUE, "bob"), {alice: 0})
    listed = api.client.get("/v1/jobs", headers=api.auth("bob")).json()
    assert [j["id"] for j in listed["jobs"]] == [bob]
    queue = api.client.get("/v1/queue", headers=api.auth("bob")).json()
    assert alice not in {j["id"] for j in queue["queued"]}
    assert alice in {j["id"] for j in api.client.get(
        "/v1/queue", headers=api.auth()).json()["queued"]}
