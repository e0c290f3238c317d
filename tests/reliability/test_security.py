"""Security: keys on every endpoint but health, keys hashed and compared in constant
time, one key never sees another's jobs or files, per-key limits answer 429 with
Retry-After, and no secret reaches a log, a job record or an error message.

This module runs after the fault, fuzz and load modules (alphabetical order), so the
log scan at its end covers the logs of every process the suite started.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.helpers import succeeded_linear_job
from tests.stack import API_KEYS, S3_KEY_ID, S3_SECRET, Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration]

# The every-endpoint test fails authentication dozens of times from one address.
HIGH = {"MAEC_RATE_LIMIT_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_BURST": "10000",
        "MAEC_SUBMISSIONS_PER_MINUTE": "100000", "MAEC_AUTH_FAILURES_PER_MINUTE": "100000",
        "MAEC_AUTH_FAILURE_BURST": "10000"}


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("security"), None, workers=1,
                       local_roots=[model_root], env=HIGH) as stack:
        yield stack


@pytest.fixture(scope="module")
def alice_job(st: Stack, tiny: dict[str, Path]) -> dict[str, Any]:
    return succeeded_linear_job(st, tiny, "alice")


def _operations(st: Stack, job_id: str) -> list[tuple[str, str]]:
    with st.client("alice") as c:
        spec = c.get("/openapi.json").json()
    ops = []
    for path, methods in spec["paths"].items():
        concrete = path.replace("{job_id}", job_id).replace("{path}", "manifest.json")
        ops += [(m.upper(), concrete) for m in methods]
    return ops


def test_every_endpoint_but_health_requires_a_key(st: Stack,
                                                  alice_job: dict[str, Any]) -> None:
    ops = _operations(st, alice_job["id"])
    assert len(ops) >= 8
    bad_headers: list[dict[str, str] | None] = [
        None, {"Authorization": "Bearer"}, {"Authorization": "Bearer not-a-key"},
        {"Authorization": f"Basic {API_KEYS['alice']}"},
        {"Authorization": f"Bearer {API_KEYS['alice']}x"},
        {"Authorization": f"Bearer {hashlib.sha256(API_KEYS['alice'].encode()).hexdigest()}"},
        {"X-Api-Key": API_KEYS["alice"]},
    ]
    with st.client(None) as c:
        for method, path in ops:
            for headers in bad_headers:
                resp = c.request(method, path, headers=headers,
                                 json={} if method == "POST" else None)
                if path == "/healthz":
                    assert resp.status_code == 200
                    continue
                assert resp.status_code == 401, (method, path, headers, resp.text)
                assert resp.json()["code"] == "unauthorized"
                assert resp.headers.get("www-authenticate") == "Bearer"
                for v in (headers or {}).values():  # a presented key is never echoed
                    token = v.split(" ")[-1]
                    assert len(token) < 8 or token not in resp.text
            if method == "DELETE":  # accepted, but the shared job must stay
                path = path.replace(alice_job["id"], "j_000000000000deadbeef0000")
            resp = c.request(method, path,
                             headers={"Authorization": f"Bearer {API_KEYS['alice']}"},
                             json={} if method == "POST" else None)
            assert resp.status_code != 401, (method, path)


def test_a_key_never_sees_another_keys_jobs_or_files(st: Stack,
                                                     alice_job: dict[str, Any]) -> None:
    jid = alice_job["id"]
    files = [f["url"] for f in alice_job["result"]["files"]]
    with st.client("bob") as bob, st.client("alice") as alice:
        missing = bob.get("/v1/jobs/j_000000000000deadbeef0000").json()
        for path in (f"/v1/jobs/{jid}", f"/v1/jobs/{jid}/files", *files):
            resp = bob.get(path)
            assert resp.status_code == 404, (path, resp.text)
            assert resp.json()["code"] == "job_not_found"
        # Indistinguishable from an id that does not exist (ids are not an oracle).
        other = bob.get(f"/v1/jobs/{jid}").json()
        assert other["code"] == missing["code"] and other["details"].keys() == \
            missing["details"].keys()
        resp = bob.post(f"/v1/jobs/{jid}/cancel")
        assert (resp.status_code, resp.json()["code"]) == (404, "job_not_found")
        resp = bob.get(files[0], params={"redirect": "true"}, headers={"Range": "bytes=0-1"})
        assert resp.status_code == 404
        listed = bob.get("/v1/jobs", params={"limit": 100}).json()
        assert jid not in {j["id"] for j in listed["jobs"]}
        # Alice, for contrast, sees it all.
        assert alice.get(f"/v1/jobs/{jid}").status_code == 200
        assert alice.get(files[0]).status_code == 200
        assert jid in {j["id"] for j in alice.get("/v1/jobs").json()["jobs"]}


def test_keys_are_stored_hashed(st: Stack) -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError):
        Settings(api_keys={"alice": API_KEYS["alice"]}, dev_mode=False)
    # The running API was configured with digests only: no raw key in its environment.
    assert st.api is not None
    environ = Path(f"/proc/{st.api.pid}/environ").read_bytes()
    assert b"MAEC_API_KEYS" in environ
    for raw in API_KEYS.values():
        assert raw.encode() not in environ


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stored digest is compared, with hmac.compare_digest, whether the presented
    key matches the first, the last or none: no early exit to time."""
    import hmac

    from app.api import limits

    digests = {hashlib.sha256(f"k{i}".encode()).hexdigest(): f"id{i}" for i in range(8)}
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)  # limits calls hmac.compare_digest
    for token, want in (("k0", "id0"), ("k7", "id7"), ("nope", None)):
        calls.clear()
        assert limits.owner_of(token, digests) == want
        assert len(calls) == len(digests)
    source = (Path(limits.__file__).parent / "deps.py").read_text()
    assert "owner_of(" in source and "keys.get(" not in source


def test_request_rate_limit_answers_429_with_retry_after(tmp_path: Path,
                                                          model_root: Path) -> None:
    # 12 a minute: one token every 5 s, so a slow (loaded) machine cannot refill the
    # bucket between the eight quick requests below.
    env = {"MAEC_RATE_LIMIT_PER_MINUTE": "12", "MAEC_RATE_LIMIT_BURST": "5"}
    with stack_context(tmp_path / "rate", None, workers=0, local_roots=[model_root],
                       env=env) as stack, stack.client("alice") as alice, \
            stack.client("bob") as bob:
        codes = [alice.get("/v1/jobs").status_code for _ in range(8)]
        assert codes[:5] == [200] * 5 and set(codes[5:]) == {429}, codes
        resp = alice.get("/v1/jobs")
        assert resp.json()["code"] == "rate_limited"
        wait = int(resp.headers["retry-after"])
        assert 1 <= wait <= 5
        assert bob.get("/v1/jobs").status_code == 200  # per key
        assert alice.get("/healthz").status_code == 200  # health is never limited
        time.sleep(wait + 0.2)
        assert alice.get("/v1/jobs").status_code == 200


def test_concurrent_jobs_and_submission_rate_answer_429(tmp_path: Path, model_root: Path,
                                                        tiny: dict[str, Path]) -> None:
    env = {"MAEC_RATE_LIMIT_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_BURST": "10000",
           "MAEC_SUBMISSIONS_PER_MINUTE": "4", "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "2"}
    body = {"method": "linear", "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["base"])}
    if time.time() % 60 > 40:  # the submission window is per minute: start a fresh one
        time.sleep(61 - time.time() % 60)
    # No workers: jobs stay queued, so they count as active.
    with stack_context(tmp_path / "limits", None, workers=0, local_roots=[model_root],
                       env=env) as stack, stack.client("alice") as alice, \
            stack.client("bob") as bob:
        first = [alice.post("/v1/jobs", json=body) for _ in range(2)]
        assert [r.status_code for r in first] == [202, 202]
        resp = alice.post("/v1/jobs", json=body)
        assert (resp.status_code, resp.json()["code"]) == (429, "too_many_jobs")
        assert int(resp.headers["retry-after"]) >= 1
        assert bob.post("/v1/jobs", json=body).status_code == 202  # limits are per key
        assert alice.post(f"/v1/jobs/{first[0].json()['id']}/cancel").status_code == 202
        assert alice.post("/v1/jobs", json=body).status_code == 202  # a slot came free
        assert alice.post(f"/v1/jobs/{first[1].json()['id']}/cancel").status_code == 202
        resp = alice.post("/v1/jobs", json=body)  # 5th submission this minute
        assert (resp.status_code, resp.json()["code"]) == (429, "rate_limited")
        assert int(resp.headers["retry-after"]) >= 1


SECRETS = {
    **{f"api key {k}": v for k, v in API_KEYS.items()},
    **{f"api key digest {k}": hashlib.sha256(v.encode()).hexdigest()
       for k, v in API_KEYS.items()},
    "s3 secret key": S3_SECRET,
    "s3 access key id": S3_KEY_ID,
}


def _evidence_files(base: Path) -> list[Path]:
    """Every log of every process the session started, and every Redis AOF (which holds
    every job record and error message ever written)."""
    # weed.log is the object store's own log: it holds its configured identities by
    # definition and is not written by this service.
    out = [p for p in base.rglob("*.log") if p.is_file() and p.name != "weed.log"]
    out += [p for p in base.rglob("*.aof") if p.is_file()]
    return sorted(out)


def test_no_secret_in_logs_records_or_errors(st: Stack, alice_job: dict[str, Any],
                                             tmp_path_factory: pytest.TempPathFactory,
                                             tiny: dict[str, Path]) -> None:
    # Provoke the paths where a secret could leak: failed auth with near-miss keys, a
    # source in a store this service cannot reach, a job that fails in the worker.
    with st.client(None) as c:
        for raw in API_KEYS.values():
            c.get("/v1/jobs", headers={"Authorization": f"Bearer {raw[:-1]}"})
    with st.client("alice") as c:
        resp = c.post("/v1/jobs", json={"method": "linear",
                                        "ability_donor": ["s3://maec-test-inputs/nowhere"],
                                        "language_base": str(tiny["base"])})
        assert resp.status_code == 422
        for secret in SECRETS.values():
            assert secret not in resp.text
    files = _evidence_files(tmp_path_factory.getbasetemp())
    assert any(f.name.startswith("worker") for f in files), files
    assert any(f.name == "api.log" for f in files), files
    assert any(f.suffix == ".aof" for f in files), files
    leaks: list[str] = []
    for f in files:
        text = f.read_bytes().decode(errors="replace")
        for what, secret in SECRETS.items():
            if secret in text:
                line = next(ln for ln in text.splitlines() if secret in ln)
                leaks.append(f"{what} in {f}: {line[:200]}")
    assert leaks == [], "\n".join(leaks)
    # The records served to clients carry no credentials either.
    with st.client("alice") as c:
        listing = c.get("/v1/jobs", params={"limit": 100}).text
    assert not any(s in listing for s in SECRETS.values())
    assert not re.search(r"(?i)aws_secret|secret_key", listing)
    assert os.environ.get("MAEC_S3_SECRET_KEY") is None  # the test process holds none


# -- X-Forwarded-For: believed only from a configured proxy --

# The failed-authentication limit of these servers: 5 saved up, then one a minute.
_AUTH_LIMIT = {"MAEC_AUTH_FAILURE_BURST": "5", "MAEC_AUTH_FAILURES_PER_MINUTE": "1"}


def _dockerfile_api_command(port: int) -> tuple[list[str], str | None]:
    """The api image's CMD (listening on 127.0.0.1:``port`` here instead of 0.0.0.0) and
    its FORWARDED_ALLOW_IPS (None: the image sets none, uvicorn's default applies)."""
    import json

    text = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    stage = text[text.index("FROM base AS api"):]
    stage = stage[:stage.index("\nFROM ")]
    cmd = json.loads(re.search(r"^CMD (\[.*?\])\s*$", stage, re.M | re.S)
                     .group(1).replace("\\\n", " "))  # type: ignore[union-attr]
    cmd[cmd.index("--host") + 1] = "127.0.0.1"
    cmd[cmd.index("--port") + 1] = str(port)
    trusted = re.search(r'^ENV FORWARDED_ALLOW_IPS="?([^"\n]*)"?$', stage, re.M)
    return [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]], \
        trusted.group(1) if trusted else None


def _failed_logins(st: Stack, name: str, command: list[str], env: dict[str, str],
                   port: int) -> list[int]:
    """Start the API as ``command`` does on a Redis DB of its own, then send 45 bad keys
    from 127.0.0.1, each with a different X-Forwarded-For (a new address every time, as
    someone hiding from the per-address limit would); the status codes."""
    import httpx
    import redis as redis_lib

    from tests.stack import Proc, wait_for

    url = st.redis.db_url(5)
    redis_lib.Redis.from_url(url).flushdb()
    proc = Proc(name, command, env={**st.env, **_AUTH_LIMIT, "MAEC_REDIS_URL": url, **env},
                log=st.root / f"{name}.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(base + "/healthz", timeout=1).status_code == 200, 60,
                 name)
        with httpx.Client(base_url=base, timeout=10) as c:
            return [c.get("/v1/jobs", headers={"Authorization": f"Bearer guess-{i}",
                                               "X-Forwarded-For": f"203.0.113.{i}"}
                          ).status_code for i in range(45)]
    finally:
        proc.stop()


def test_a_spoofed_forwarded_for_neither_resets_nor_dodges_the_login_limit(
        st: Stack) -> None:
    """``make run``'s uvicorn and the api image's, each started with the exact command
    they use: a client that rotates X-Forwarded-For is still one address, refused once
    its failures are spent. For contrast, the image with its proxy configured
    (FORWARDED_ALLOW_IPS=127.0.0.1, where the header is a proxy's word) counts each
    forwarded client apart, so this test can tell the header was ignored."""
    from app.run_local import api_command
    from tests.stack import free_port

    port = free_port()
    codes = _failed_logins(st, "api-run-local", api_command(port), {}, port)
    assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}, codes

    port = free_port()
    command, trusted = _dockerfile_api_command(port)
    assert trusted is not None, "the api image names whom it trusts"
    codes = _failed_logins(st, "api-image", command, {"FORWARDED_ALLOW_IPS": trusted}, port)
    assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}, codes

    port = free_port()
    command, _ = _dockerfile_api_command(port)
    codes = _failed_logins(st, "api-behind-proxy", command,
                           {"FORWARDED_ALLOW_IPS": "127.0.0.1"}, port)
    assert set(codes) == {401}, codes


def test_a_tenant_key_reads_no_metrics_and_no_other_key_id(st: Stack,
                                                           alice_job: dict[str, Any]) -> None:
    """/metrics is the operator's: a tenant's key gets 403 ``operator_only`` with nothing
    of the service in it, and even the operator's scrape names no key unless asked."""
    from tests.stack import METRICS_TOKEN

    for key in ("alice", "bob"):
        with st.client(key) as c:
            resp = c.get("/metrics")
        assert resp.status_code == 403, resp.text
        assert resp.json()["code"] == "operator_only"
        assert "maec_" not in resp.text and "alice" not in resp.text and \
            "bob" not in resp.text
    with st.client(METRICS_TOKEN) as op:
        text = op.get("/metrics").text
    assert 'maec_jobs_finished_total{status="succeeded"}' in text
    assert 'key="' not in text and "alice" not in text
