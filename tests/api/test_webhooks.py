"""Signed webhooks without Celery: signature, backoff, address checks, one delivery
attempt against a real HTTP receiver on 127.0.0.1, the submission check, the record,
and the hooks that queue a delivery when a job ends."""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import SecretStr, ValidationError

from app.queue import WEBHOOK_QUEUE, WEBHOOK_TASK_NAME
from app.settings import Settings, hash_key
from app.storage.local import LocalStorage
from app.webhooks.delivery import (
    accept_callback,
    attempt_once,
    backoff_delay,
    deliver,
    job_body,
    post,
    schedule,
)
from app.webhooks.hosts import AllowList, CallbackRefused, check_callback
from app.webhooks.signing import sign, signed_headers, verify
from tests.api.conftest import Api
from tests.stack import ROOT, free_port
from tests.webhook_receiver import Receiver
from worker.runner import JobRunner

SECRET = "whsec-0123456789abcdef"
LOCAL = ["127.0.0.1"]


def resolver(table: dict[str, list[str]]) -> Any:
    def resolve(host: str, _port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]
    return resolve


def refused(url: str, allowed: list[str], table: dict[str, list[str]] | None = None) -> str:
    with pytest.raises(CallbackRefused) as info:
        check_callback(url, AllowList.parse(allowed), resolver(table or {}))
    assert info.value.code == "invalid_callback"
    return str(info.value.details["reason"])


# -- signature ---------------------------------------------------------------------------

def test_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    body = b'{"id":"j_1","status":"succeeded"}'
    # Computed outside Python: printf '1700000000.<body>' | openssl dgst -sha256 -hmac ...
    assert sign(SECRET, 1700000000, body) == (
        "sha256=84a6f1432a3ca8815e4e49c50a8e1ec2100d437573bbc00e7fb6f681b88ceb76")
    headers = signed_headers(SECRET, body, now=1700000000.9)
    assert headers == {"X-Maec-Timestamp": "1700000000",
                       "X-Maec-Signature": sign(SECRET, 1700000000, body)}


def test_verify_refuses_tampering_other_secrets_and_stale_timestamps() -> None:
    body = b'{"id":"j_1"}'
    sig = sign(SECRET, 1000, body)
    assert verify(SECRET, body, "1000", sig, now=1000)
    assert verify(SECRET, body, "1000", sig, now=1299)
    assert not verify(SECRET, body, "1000", sig, now=1301)  # replayed too late
    assert not verify(SECRET, body + b" ", "1000", sig, now=1000)
    assert not verify(SECRET + "x", body, "1000", sig, now=1000)
    assert not verify(SECRET, body, "1001", sig, now=1000)  # timestamp is signed too
    assert not verify(SECRET, body, "-1000", sig, now=1000)
    assert not verify(SECRET, body, "1000", sig.removeprefix("sha256="), now=1000)


def _docs_snippet() -> Any:
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Webhooks"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), "docs/api.md", "exec"), scope)
    return scope["verify_maec_webhook"]


def test_the_documented_receiver_check_accepts_the_services_signature() -> None:
    check = _docs_snippet()
    body = b'{"id":"j_1","status":"failed"}'
    headers = signed_headers(SECRET, body)
    assert check(SECRET, headers, body)
    assert not check(SECRET, headers, body.replace(b"failed", b"succeeded"))
    assert not check("another-secret-0123", headers, body)
    assert not check(SECRET, signed_headers(SECRET, body, now=1000), body)
    assert not check(SECRET, {}, body)


# -- backoff -------------------------------------------------------------------------------

def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    assert [backoff_delay(n, 10, 3600) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert backoff_delay(30, 10, 3600) == 3600
    s = Settings(dev_mode=True, webhook_max_attempts=6, webhook_backoff_seconds=2,
                 webhook_backoff_max_seconds=12)
    assert schedule(s) == [2, 4, 8, 12, 12]
    assert schedule(s.model_copy(update={"webhook_max_attempts": 1})) == []
    default = Settings(dev_mode=True)
    assert len(schedule(default)) == default.webhook_max_attempts - 1


# -- where a webhook may go ----------------------------------------------------------------

def test_allowed_names_resolving_to_public_addresses_are_accepted() -> None:
    table = {"hooks.example.com": ["93.184.216.34", "2606:2800:220:1::1"],
             "a.b.example.org": ["93.184.216.35"]}
    t = check_callback("https://Hooks.Example.com./in?x=1", AllowList.parse(
        ["hooks.example.com", "*.example.org"]), resolver(table))
    assert (t.scheme, t.host, t.port, t.path) == ("https", "hooks.example.com", 443, "/in?x=1")
    assert t.addresses == ("93.184.216.34", "2606:2800:220:1::1")
    assert t.host_header == "hooks.example.com" and not t.host_is_ip
    assert t.url_for(t.addresses[1]) == "https://[2606:2800:220:1::1]:443/in?x=1"
    wild = check_callback("http://a.b.example.org:8080", AllowList.parse(["*.example.org"]),
                          resolver(table))
    assert wild.host_header == "a.b.example.org:8080" and wild.path == "/"


@pytest.mark.parametrize("url", [
    "https://example.org/", "https://evil-example.org/", "https://hooks.example.com.evil.net/",
    "https://93.184.216.34/",
])
def test_hosts_outside_the_allow_list_are_refused(url: str) -> None:
    table = {h: ["93.184.216.34"] for h in ("example.org", "evil-example.org",
                                           "hooks.example.com.evil.net")}
    assert refused(url, ["hooks.example.com", "*.example.org"], table) == "host_not_allowed"


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
    "2002:7f00:1::1",
])
def test_names_resolving_to_private_ranges_are_refused(address: str) -> None:
    table = {"hooks.example.com": [address]}
    assert refused("https://hooks.example.com/", ["hooks.example.com"], table) == \
        "private_address"


def test_one_private_address_among_public_ones_refuses_the_host() -> None:
    table = {"hooks.example.com": ["93.184.216.34", "10.0.0.7"]}
    assert refused("https://hooks.example.com/", ["hooks.example.com"], table) == \
        "private_address"


def test_private_addresses_an_ip_entry_covers_are_accepted() -> None:
    table = {"hooks.internal": ["10.1.2.3"]}
    t = check_callback("http://hooks.internal/x", AllowList.parse(
        ["hooks.internal", "10.1.0.0/16"]), resolver(table))
    assert t.addresses == ("10.1.2.3",)
    local = check_callback("http://127.0.0.1:9000/x", AllowList.parse(LOCAL))
    assert local.addresses == ("127.0.0.1",) and local.host_is_ip
    assert local.url_for("127.0.0.1") == "http://127.0.0.1:9000/x"
    # 127.0.0.1 allow-listed covers that address only, not the rest of loopback.
    assert refused("http://127.0.0.2/", LOCAL) == "host_not_allowed"
    assert refused("http://[::1]/", LOCAL) == "host_not_allowed"


@pytest.mark.parametrize(("url", "reason"), [
    ("ftp://hooks.example.com/", "scheme"),
    ("file:///etc/passwd", "scheme"),
    ("gopher://hooks.example.com/", "scheme"),
    ("hooks.example.com/x", "scheme"),
    ("https://user:pw@hooks.example.com/", "credentials_in_url"),
    ("https://hooks.example.com:99999/", "malformed"),
    ("https://hooks.example.com/a b", "malformed"),
    ("https://hooks.example.com/\r\nX: y", "malformed"),
    ("https:///x", "malformed"),
    ("http://2130706433/", "invalid_host"),
    ("http://127.1/", "invalid_host"),
    ("http://hooks_example.com/", "invalid_host"),
    ("https://unknown.example.com/", "unresolvable"),
    ("https://" + "a" * 2050 + ".com/", "malformed"),
])
def test_malformed_or_unresolvable_urls_are_refused(url: str, reason: str) -> None:
    assert refused(url, ["hooks.example.com", "*.example.com"]) == reason


def test_allow_list_entries_are_checked_when_settings_load() -> None:
    for bad in (["http://hooks.example.com"], ["hooks.example.com:443"], ["*"], [""]):
        with pytest.raises(ValidationError):
            Settings(dev_mode=True, webhook_allowed_hosts=bad)
    ok = Settings(dev_mode=True, webhook_allowed_hosts=["Hooks.Example.com", "10.0.0.0/8",
                                                         "::1", "*.example.org"])
    parsed = AllowList.parse(ok.webhook_allowed_hosts)
    assert parsed.names == {"hooks.example.com"} and parsed.suffixes == (".example.org",)


def test_settings_never_show_webhook_secrets() -> None:
    s = Settings(dev_mode=True, webhook_secrets={"alice": SecretStr(SECRET)})
    assert SECRET not in repr(s) and SECRET not in str(s.model_dump())
    assert SECRET not in s.model_dump_json()
    assert s.webhook_secrets["alice"].get_secret_value() == SECRET
    weak = "short-secret"
    with pytest.raises(ValidationError) as info:
        Settings.model_validate({"dev_mode": True, "webhook_secrets": {"alice": weak}})
    assert "alice" in str(info.value)
    assert weak not in str(info.value.errors(include_input=False))


# -- one attempt over HTTP ----------------------------------------------------------------

@pytest.fixture
def receiver() -> Any:
    r = Receiver().start()
    yield r
    r.stop()


def test_post_connects_to_the_checked_address_with_the_named_host(receiver: Receiver
                                                                   ) -> None:
    # "hooks.test" exists in no DNS: the POST reaches the receiver only because the
    # delivery dials the address the check returned.
    target = check_callback(f"http://hooks.test:{receiver.port}/in?k=v",
                            AllowList.parse(["hooks.test", "127.0.0.1"]),
                            resolver({"hooks.test": ["127.0.0.1"]}))
    assert post(target, b'{"a":1}', {"X-Test": "1"}, 5) == "200"
    (got,) = receiver.received()
    assert got.path == "/in?k=v" and got.body == b'{"a":1}'
    assert got.headers["host"] == f"hooks.test:{receiver.port}"
    assert got.headers["content-type"] == "application/json"
    assert got.headers["x-test"] == "1"


def test_redirects_are_not_followed(receiver: Receiver) -> None:
    other = Receiver().start()
    try:
        receiver.status, receiver.location = 302, other.url
        target = check_callback(receiver.url, AllowList.parse(LOCAL))
        assert post(target, b"{}", {}, 5) == "302"
        assert len(receiver.received()) == 1 and other.received() == []
    finally:
        other.stop()


def test_a_receiver_that_is_down_is_a_connect_error() -> None:
    target = check_callback(f"http://127.0.0.1:{free_port()}/", AllowList.parse(LOCAL))
    assert post(target, b"{}", {}, 2) == "connect_error"


# -- the service: submission, record, delivery, hooks ------------------------------------

def hook_settings(**kw: Any) -> dict[str, Any]:
    return {"webhook_allowed_hosts": LOCAL, "webhook_secrets": {"alice": SECRET},
            "webhook_max_attempts": 3, "webhook_backoff_seconds": 0.5, **kw}


@pytest.fixture
def hooked(api_factory: Any) -> Api:
    return api_factory(**hook_settings())  # type: ignore[no-any-return]


def _webhook_messages(api: Api) -> list[tuple[str, list[Any]]]:
    out = []
    for raw in cast(list[bytes], api.r.lrange(WEBHOOK_QUEUE, 0, -1)):
        m = json.loads(raw)
        out.append((m["headers"]["task"], json.loads(base64.b64decode(m["body"]))[0]))
    return out


def test_submission_refuses_callbacks_the_service_would_not_send_to(hooked: Api) -> None:
    for url, reason in [(f"http://10.0.0.1:{free_port()}/", "host_not_allowed"),
                        ("http://localhost/", "host_not_allowed"),
                        ("ftp://127.0.0.1/", "scheme")]:
        r = hooked.client.post("/v1/jobs", json=hooked.named(callback_url=url),
                               headers=hooked.auth())
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "invalid_callback"
        assert r.json()["details"]["reason"] == reason
    # bob has no webhook secret: nothing could be signed for him.
    r = hooked.client.post("/v1/jobs", json=hooked.named(callback_url="http://127.0.0.1/"),
                           headers=hooked.auth("bob"))
    assert r.status_code == 422 and r.json()["details"]["reason"] == "no_secret"
    r = hooked.client.post("/v1/jobs", json={"recipe": {"merge_method": "linear"},
                                             "callback_url": ""}, headers=hooked.auth())
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
    assert hooked.client.get("/v1/jobs", headers=hooked.auth()).json()["jobs"] == []


def test_the_default_settings_refuse_every_callback(api: Api) -> None:
    r = api.client.post("/v1/jobs", json=api.named(callback_url="http://127.0.0.1/"),
                        headers=api.auth())
    assert r.status_code == 422 and r.json()["code"] == "invalid_callback"


def test_a_delivered_webhook_is_the_signed_job_and_is_recorded(hooked: Api,
                                                               receiver: Receiver) -> None:
    jid = str(hooked.submit(hooked.named(callback_url=receiver.url))["id"])
    ended: list[str] = []
    runner = JobRunner(hooked.settings, hooked.worker_store(),
                       LocalStorage(hooked.settings.storage_dir), on_finished=ended.append)
    assert runner.run(jid) == "succeeded" and ended == [jid]
    before = hooked.client.get(f"/v1/jobs/{jid}", headers=hooked.auth())
    assert before.json()["callback_url"] == receiver.url and before.json()["webhook"] is None
    retries: list[float] = []
    store = hooked.worker_store()
    assert deliver(store, hooked.settings, jid, 1, retries.append) == "200"
    assert retries == []
    (got,) = receiver.received()
    # The body is the job exactly as GET served it before the delivery was recorded.
    assert got.body == before.content
    assert verify(SECRET, got.body, got.headers["x-maec-timestamp"],
                  got.headers["x-maec-signature"])
    job = hooked.client.get(f"/v1/jobs/{jid}", headers=hooked.auth()).json()
    assert job["status"] == "succeeded"
    assert job["webhook"]["attempts"] == 1 and job["webhook"]["last_status"] == "200"
    assert job["webhook"]["delivered_at"] is not None
    # A repeated message for the same attempt, or a later one, sends nothing more.
    assert deliver(store, hooked.settings, jid, 1, retries.append) == "skipped"
    assert deliver(store, hooked.settings, jid, 2, retries.append) == "skipped"
    assert len(receiver.received()) == 1


def test_failed_attempts_are_recorded_and_retried_until_the_last(hooked: Api) -> None:
    down = f"http://127.0.0.1:{free_port()}/hook"
    jid = str(hooked.submit(hooked.named(callback_url=down))["id"])
    runner = JobRunner(hooked.settings, hooked.worker_store(),
                       LocalStorage(hooked.settings.storage_dir))
    assert runner.run(jid) == "succeeded"
    store = hooked.worker_store()
    retries: list[float] = []
    for attempt in (1, 2, 3):
        assert deliver(store, hooked.settings, jid, attempt, retries.append) == \
            "connect_error"
        rec = store.get(jid)
        assert rec is not None and rec.webhook is not None
        assert rec.webhook.attempts == attempt and rec.webhook.delivered_at is None
    assert retries == [0.5, 1.0]  # none after the last attempt
    rec = store.get(jid)
    assert rec is not None and rec.status == "succeeded"


def test_a_host_that_turned_private_is_not_contacted(hooked: Api, receiver: Receiver
                                                     ) -> None:
    settings = hooked.settings.model_copy(update={"webhook_allowed_hosts": ["hooks.test"]})
    url = f"http://hooks.test:{receiver.port}/"
    accept_callback(url, settings, "alice", resolver({"hooks.test": ["93.184.216.34"]}))
    jid = str(hooked.submit()["id"])
    rec = hooked.worker_store().get(jid)
    assert rec is not None
    rec = rec.model_copy(update={"callback_url": url, "status": "succeeded"})
    # DNS now answers with this machine: the attempt refuses, nothing is sent.
    assert attempt_once(rec, settings, resolver({"hooks.test": ["127.0.0.1"]})) == \
        "refused_address"
    assert attempt_once(rec, settings, resolver({})) == "dns_error"
    assert receiver.received() == []
    no_secret = settings.model_copy(update={"webhook_secrets": {}})
    assert attempt_once(rec, no_secret) == "no_secret"


def test_job_body_matches_the_served_json(hooked: Api) -> None:
    jid = str(hooked.submit(hooked.named(callback_url="http://127.0.0.1/x"))["id"])
    # Webhooks go out for jobs that ended, never queued ones (whose served body also
    # carries their place in the queue): compare a job that has left the queue.
    hooked.worker_store().claim(jid, worker="w", lease_s=30, max_attempts=3)
    rec = hooked.worker_store().get(jid)
    assert rec is not None
    assert job_body(rec) == hooked.client.get(f"/v1/jobs/{jid}", headers=hooked.auth()).content


def test_cancelling_a_queued_job_queues_its_webhook(hooked: Api) -> None:
    jid = str(hooked.submit(hooked.named(callback_url="http://127.0.0.1/x"))["id"])
    plain = str(hooked.submit()["id"])
    r = hooked.client.post(f"/v1/jobs/{jid}/cancel", headers=hooked.auth())
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    assert hooked.client.post(f"/v1/jobs/{plain}/cancel",
                              headers=hooked.auth()).status_code == 202
    # A repeated cancel answers the same and queues nothing more.
    assert hooked.client.post(f"/v1/jobs/{jid}/cancel",
                              headers=hooked.auth()).status_code == 202
    assert _webhook_messages(hooked) == [(WEBHOOK_TASK_NAME, [jid, 1])]


def test_jobs_ended_by_the_worker_or_its_claim_are_handed_on(hooked: Api, tmp_path: Path
                                                              ) -> None:
    from tests import hostile

    ended: list[str] = []
    store = hooked.worker_store()
    runner = JobRunner(hooked.settings, store, LocalStorage(hooked.settings.storage_dir),
                       on_finished=ended.append)
    bad = hostile.nan_weights(hooked.models.donor, hooked.root / "extra" / "nan")
    failed = str(hooked.submit(hooked.named(ability_donor=[str(bad)],
                                            callback_url="http://127.0.0.1/x"))["id"])
    assert runner.run(failed) == "failed"
    plain = str(hooked.submit()["id"])
    assert runner.run(plain) == "succeeded"
    exhausted = str(hooked.submit(hooked.named(callback_url="http://127.0.0.1/x"))["id"])
    hooked.r.hset(f"maec:job:{exhausted}", "attempts", str(hooked.settings.max_attempts))
    assert runner.run(exhausted) == "exhausted"
    assert runner.run(failed) == "done"  # a redelivered message ends nothing again
    assert ended == [failed, exhausted]


def test_a_webhook_that_cannot_be_queued_leaves_the_job_finished(hooked: Api) -> None:
    def broken(_job_id: str) -> None:
        raise ConnectionError("broker down")

    runner = JobRunner(hooked.settings, hooked.worker_store(),
                       LocalStorage(hooked.settings.storage_dir), on_finished=broken)
    jid = str(hooked.submit(hooked.named(callback_url="http://127.0.0.1/x"))["id"])
    assert runner.run(jid) == "succeeded"


def test_settings_env_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAEC_WEBHOOK_ALLOWED_HOSTS", '["127.0.0.1", "*.example.com"]')
    monkeypatch.setenv("MAEC_WEBHOOK_SECRETS", json.dumps({"alice": SECRET}))
    s = Settings(api_keys={"alice": hash_key("k")})
    assert s.webhook_allowed_hosts == ["127.0.0.1", "*.example.com"]
    assert s.webhook_secrets["alice"].get_secret_value() == SECRET


def test_an_attempt_cut_short_by_the_task_limit_counts_as_a_timeout(hooked: Api) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    def stuck(_host: str, _port: int) -> list[str]:
        raise SoftTimeLimitExceeded()

    settings = hooked.settings.model_copy(update={"webhook_allowed_hosts": ["hooks.test"]})
    jid = str(hooked.submit()["id"])
    store = hooked.worker_store()
    assert JobRunner(settings, store, LocalStorage(settings.storage_dir)).run(jid) == \
        "succeeded"
    hooked.r.hset(f"maec:job:{jid}", "callback_url", json.dumps("http://hooks.test/x"))
    retries: list[float] = []
    assert deliver(store, settings, jid, 1, retries.append, stuck) == "timeout"
    rec = store.get(jid)
    assert rec is not None and rec.webhook is not None
    assert (rec.webhook.attempts, rec.webhook.last_status) == (1, "timeout")
    assert retries == [0.5]


def _certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``name`` (and its key), made by the openssl tool."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}"], check=True, capture_output=True)
    return cert, key


def test_https_dials_the_checked_address_and_checks_the_certificate_against_the_name(
        tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path, "hooks.test")
    other, other_key = _certificate(tmp_path, "other.test")
    trust = ssl.create_default_context(cafile=str(cert))
    trust.load_verify_locations(cafile=str(other))
    allowed = AllowList.parse(["hooks.test", "127.0.0.1"])
    good = Receiver(tls=(cert, key)).start()
    wrong = Receiver(tls=(other, other_key)).start()
    try:
        for r, expected in ((good, "200"), (wrong, "tls_error")):
            target = check_callback(f"https://hooks.test:{r.port}/in", allowed,
                                    resolver({"hooks.test": ["127.0.0.1"]}))
            assert post(target, b"{}", {}, 5, verify=trust) == expected
        assert len(good.received()) == 1 and wrong.received() == []
        assert good.received()[0].headers["host"] == f"hooks.test:{good.port}"
    finally:
        good.stop()
        wrong.stop()
