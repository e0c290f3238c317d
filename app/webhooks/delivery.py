"""One webhook delivery attempt, its record on the job, and when the next one runs.

At least once: every attempt is its own Celery message (:func:`app.queue.send_webhook`).
An attempt without a 2xx answer records itself on the job (``webhook``) and queues the
next one, due after an exponential backoff, until ``MAEC_WEBHOOK_MAX_ATTEMPTS``. Nothing
sleeps in a worker: a receiver that is down costs one short connection attempt per try,
never a merge's slot. Celery-free, so tests drive it directly; worker/tasks.py binds it
to the worker's Celery app.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
from celery.exceptions import SoftTimeLimitExceeded

from app.jobs.record import TERMINAL, JobRecord, now_iso
from app.settings import Settings
from app.webhooks.hosts import (
    AllowList,
    CallbackRefused,
    Resolver,
    Target,
    check_callback,
    resolve_host,
)
from app.webhooks.signing import signed_headers
from maec_contract import WebhookDelivery

if TYPE_CHECKING:  # the API imports this module for accept_callback, never the store
    from app.jobs.worker_store import WorkerJobStore

log = logging.getLogger("maec.webhooks")

USER_AGENT = "maec-webhooks/1"
# Addresses of one host tried per attempt (the next only when connecting fails).
MAX_ADDRESSES = 3
# The delivery task's limits: each address may take a connect timeout, and the one that
# answers a send and a read timeout (MAEC_WEBHOOK_TIMEOUT_SECONDS is at most 30).
SOFT_TIME_LIMIT_S = 170
TIME_LIMIT_S = 180


def accept_callback(url: str, settings: Settings, owner: str,
                    resolve: Resolver = resolve_host) -> str:
    """The ``callback_url`` of a submission by ``owner``, checked; CallbackRefused
    (422 ``invalid_callback``) when the service would not send there or cannot sign."""
    if owner not in settings.webhook_secrets:
        raise CallbackRefused("no webhook secret is configured for this API key "
                              "(MAEC_WEBHOOK_SECRETS)", reason="no_secret")
    check_callback(url, AllowList.parse(settings.webhook_allowed_hosts), resolve)
    return url


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds between attempt ``attempt`` (1-based) failing and the next one."""
    return float(min(base_s * 2 ** (attempt - 1), max_s))


def schedule(settings: Settings) -> list[float]:
    """Every wait between attempts, in order (one fewer than the attempts)."""
    return [backoff_delay(n, settings.webhook_backoff_seconds,
                          settings.webhook_backoff_max_seconds)
            for n in range(1, settings.webhook_max_attempts)]


def job_body(rec: JobRecord) -> bytes:
    """The job as ``GET /v1/jobs/{id}`` serves it (the store keeps each field as compact
    JSON and joins them in this order)."""
    return json.dumps(rec.public(), separators=(",", ":")).encode()


def delivered(status: str) -> bool:
    return status.isdigit() and 200 <= int(status) < 300


def post(target: Target, body: bytes, headers: dict[str, str], timeout_s: float,
         verify: ssl.SSLContext | bool = True) -> str:
    """POST ``body`` to the first checked address that accepts a connection; the answer's
    HTTP status as text, or why there was none. Redirects are answers, not followed.
    ``verify``: the TLS trust (the system's by default; tests pass their own CA)."""
    headers = {**headers, "Host": target.host_header, "Content-Type": "application/json",
               "User-Agent": USER_AGENT}
    # The certificate is checked against the URL's host name, not the address dialled.
    extensions = {"sni_hostname": target.host} if (
        target.scheme == "https" and not target.host_is_ip) else {}
    outcome = "connect_error"
    # trust_env=False: a proxy from the environment would connect on its own terms.
    with httpx.Client(follow_redirects=False, trust_env=False, timeout=timeout_s,
                      verify=verify) as client:
        for address in target.addresses[:MAX_ADDRESSES]:
            try:
                with client.stream("POST", target.url_for(address), content=body,
                                   headers=headers, extensions=extensions) as answer:
                    return str(answer.status_code)  # the body is never read
            except httpx.ConnectError as exc:
                outcome = "tls_error" if _caused_by(exc, ssl.SSLError) else "connect_error"
            except httpx.ConnectTimeout:
                outcome = "timeout"
            except httpx.TimeoutException:
                return "timeout"
            except httpx.HTTPError:
                return "http_error"
    return outcome


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def attempt_once(rec: JobRecord, settings: Settings, resolve: Resolver = resolve_host
                 ) -> str:
    """One POST of ``rec`` to its callback, checked again first (DNS may have changed)."""
    assert rec.callback_url is not None
    secret = settings.webhook_secrets.get(rec.owner)
    if secret is None:
        return "no_secret"
    try:
        target = check_callback(rec.callback_url,
                                AllowList.parse(settings.webhook_allowed_hosts), resolve)
    except CallbackRefused as exc:
        log.warning("job %s: webhook not sent: %s", rec.id, exc.message)
        return "dns_error" if exc.details.get("reason") == "unresolvable" else \
            "refused_address"
    body = job_body(rec)
    headers = signed_headers(secret.get_secret_value(), body)
    return post(target, body, headers, settings.webhook_timeout_seconds)


def deliver(store: WorkerJobStore, settings: Settings, job_id: str, attempt: int,
            retry: Callable[[float], None], resolve: Resolver = resolve_host) -> str:
    """Attempt ``attempt`` of the job's webhook: post, record it on the job, and call
    ``retry(delay_s)`` when another attempt is due. Returns the attempt's outcome, or
    ``skipped`` when there is nothing (more) to send."""
    rec = store.get(job_id)
    if rec is None or rec.callback_url is None or rec.status not in TERMINAL:
        return "skipped"
    done = rec.webhook or WebhookDelivery()
    if done.delivered_at is not None or done.attempts >= attempt:
        return "skipped"  # a repeated message: this attempt already ran
    try:
        status = attempt_once(rec, settings, resolve)
    except SoftTimeLimitExceeded:  # a resolver or receiver too slow for the task's limit
        status = "timeout"
    ok = delivered(status)
    state = WebhookDelivery(attempts=attempt, last_status=status,
                            delivered_at=now_iso() if ok else None)
    # Written only while the job still has the status it ended with: a job removed in
    # the meantime is not brought back as a stub.
    store.transition(job_id, allowed=(rec.status,), to=rec.status, attempt=None,
                     fields={"webhook": state.model_dump(mode="json")})
    if ok:
        log.info("job %s: webhook delivered (attempt %d, %s)", job_id, attempt, status)
    elif attempt < settings.webhook_max_attempts:
        delay = backoff_delay(attempt, settings.webhook_backoff_seconds,
                              settings.webhook_backoff_max_seconds)
        log.info("job %s: webhook attempt %d got %s; next in %.1f s", job_id, attempt,
                 status, delay)
        retry(delay)
    else:
        log.warning("job %s: webhook not delivered after %d attempts (last: %s)", job_id,
                    attempt, status)
    return status
