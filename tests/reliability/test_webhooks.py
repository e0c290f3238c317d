"""Signed webhooks over the real stack: a receiver on 127.0.0.1 gets the finished job.

One stack for the module (its own redis-server, local storage, one Celery worker started
with ``-Q merges`` as deployed, and the API), allow-listing 127.0.0.1 and signing alice's
webhooks. Every delivery the receiver gets is checked: the signature over the exact bytes
received, a recent timestamp, and the job as ``GET /v1/jobs/{id}`` serves it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.webhooks.signing import verify
from tests.reliability import results
from tests.stack import Stack, free_port, stack_context, wait_for
from tests.webhook_receiver import Received, Receiver

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

SECRET = "whsec-stack-0123456789abcdef"
MAX_ATTEMPTS = 4
ENV = {
    "MAEC_WEBHOOK_ALLOWED_HOSTS": json.dumps(["127.0.0.1"]),
    "MAEC_WEBHOOK_SECRETS": json.dumps({"alice": SECRET}),
    "MAEC_WEBHOOK_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    "MAEC_WEBHOOK_BACKOFF_SECONDS": "0.5",
    "MAEC_WEBHOOK_TIMEOUT_SECONDS": "3",
    "MAEC_PROGRESS_INTERVAL": "0.05",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("webhooks"), None, workers=1,
                       local_roots=[model_root], env=ENV) as st:
        yield st


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def quick_job(donor: Path, base: Path, callback: str, **kw: Any) -> dict[str, Any]:
    return {"method": "linear", "ability_donor": [str(donor)], "language_base": str(base),
            "callback_url": callback, **kw}


def webhook(stack: Stack, job_id: str, pred: Any, what: str) -> dict[str, Any]:
    """The job once ``pred(job["webhook"])`` holds."""
    with stack.client() as c:
        def check() -> dict[str, Any] | None:
            job = c.get(f"/v1/jobs/{job_id}").json()
            return job if job["webhook"] is not None and pred(job["webhook"]) else None
        try:
            return dict(wait_for(check, 60, what))
        except TimeoutError:
            raise TimeoutError(f"{what}; worker log:\n{stack.workers[0].tail()}") from None


def check_signed(stack: Stack, got: Received, job_id: str, status: str) -> dict[str, Any]:
    """The delivery is alice's signature over the job as served; returns the job."""
    results.add("webhooks_expected")
    assert got.method == "POST" and got.path == "/hook?src=test"
    assert got.headers["content-type"] == "application/json"
    assert verify(SECRET, got.body, got.headers["x-maec-timestamp"],
                  got.headers["x-maec-signature"], tolerance_s=120)
    sent = json.loads(got.body)
    assert (sent["id"], sent["status"]) == (job_id, status)
    job = webhook(stack, job_id, lambda w: w["delivered_at"] is not None, "delivery recorded")
    # The same JSON as GET, but for the delivery record written after it was sent.
    assert {k: v for k, v in sent.items() if k != "webhook"} == \
        {k: v for k, v in job.items() if k != "webhook"}
    assert job["webhook"]["last_status"] == "200"
    results.add("webhooks_verified")
    return job


def test_a_succeeded_job_is_posted_signed(stack: Stack, tiny: dict[str, Path],
                                          receiver: Receiver) -> None:
    job_id = stack.submit(quick_job(tiny["a"], tiny["base"], receiver.url))["id"]
    assert stack.wait(job_id)["status"] == "succeeded"
    (got,) = receiver.wait_for(1)
    job = check_signed(stack, got, job_id, "succeeded")
    assert job["webhook"]["attempts"] == 1 and job["callback_url"] == receiver.url
    assert json.loads(got.body)["result"]["files"]


def test_a_failed_job_is_posted_signed(stack: Stack, tiny: dict[str, Path], model_root: Path,
                                       receiver: Receiver) -> None:
    from tests import hostile

    bad = model_root / "webhook-nan"
    if not bad.exists():
        hostile.nan_weights(tiny["a"], bad)
    job_id = stack.submit(quick_job(bad, tiny["base"], receiver.url))["id"]
    assert stack.wait(job_id)["status"] == "failed"
    (got,) = receiver.wait_for(1)
    check_signed(stack, got, job_id, "failed")
    assert json.loads(got.body)["error"]["code"] == "non_finite_output"


def test_cancelled_jobs_are_posted_signed_queued_or_running(
        stack: Stack, tiny: dict[str, Path], big: dict[str, Path],
        receiver: Receiver) -> None:
    slow = {"recipe": {
        "merge_method": "ties", "base_model": str(big["b"]), "name": "webhook-slow",
        "models": [{"model": str(big["a"]), "parameters": {"weight": 0.5, "density": 0.5}}],
    }, "callback_url": receiver.url}
    running = stack.submit(slow)["id"]
    stack.wait(running, until={"running"})
    # The only worker is busy: this one is still queued, and the API ends it.
    queued = stack.submit(quick_job(tiny["a"], tiny["base"], receiver.url))["id"]
    with stack.client() as c:
        r = c.post(f"/v1/jobs/{queued}/cancel")
        assert r.status_code == 202 and r.json()["status"] == "cancelled", r.text
        assert c.post(f"/v1/jobs/{running}/cancel").status_code == 202
    assert stack.wait(running)["status"] == "cancelled"
    got = receiver.wait_for(2)
    by_job = {json.loads(g.body)["id"]: g for g in got}
    assert set(by_job) == {queued, running}
    check_signed(stack, by_job[queued], queued, "cancelled")
    check_signed(stack, by_job[running], running, "cancelled")


def test_a_receiver_down_at_first_gets_it_on_a_retry(stack: Stack, tiny: dict[str, Path]
                                                      ) -> None:
    later = Receiver()  # its port is chosen, nothing listens yet
    job_id = stack.submit(quick_job(tiny["a"], tiny["base"], later.url))["id"]
    first = webhook(stack, job_id, lambda w: w["attempts"] >= 1, "a first attempt")
    assert first["status"] == "succeeded"
    assert first["webhook"]["last_status"] == "connect_error"
    assert first["webhook"]["delivered_at"] is None
    later.start()
    try:
        (got,) = later.wait_for(1)
        job = check_signed(stack, got, job_id, "succeeded")
    finally:
        later.stop()
    assert 2 <= job["webhook"]["attempts"] <= MAX_ATTEMPTS
    # The body of a retry shows the attempts before it.
    assert json.loads(got.body)["webhook"]["last_status"] == "connect_error"


def test_a_receiver_down_for_good_leaves_the_job_succeeded(stack: Stack,
                                                           tiny: dict[str, Path]) -> None:
    down = f"http://127.0.0.1:{free_port()}/hook"
    job_id = stack.submit(quick_job(tiny["a"], tiny["base"], down))["id"]
    job = webhook(stack, job_id, lambda w: w["attempts"] >= MAX_ATTEMPTS, "every attempt")
    assert job["status"] == "succeeded" and job["error"] is None
    assert job["webhook"] == {"attempts": MAX_ATTEMPTS, "last_status": "connect_error",
                              "delivered_at": None}
    # Merges go on: a job submitted after the last attempt finishes as usual.
    assert stack.wait(stack.submit(quick_job(tiny["a"], tiny["base"], down))["id"]
                      )["status"] == "succeeded"


def test_a_refused_callback_queues_nothing(stack: Stack, tiny: dict[str, Path]) -> None:
    with stack.client() as c:
        r = c.post("/v1/jobs", json=quick_job(tiny["a"], tiny["base"],
                                              "http://169.254.169.254/latest/meta-data"))
    assert r.status_code == 422 and r.json()["code"] == "invalid_callback"
    assert r.json()["details"]["reason"] == "host_not_allowed"
