"""Synchronous client for the merge service's REST API (docs/api.md).

Torch-free by design: internal tools install this next to anything. It imports neither
the merge library nor the service; what they add (local recipe checks) is found by entry
point (maec_client.extensions).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, Unpack
from urllib.parse import quote, urlsplit

import httpx
import yaml
from pydantic import BaseModel, ValidationError

from maec_client.config import ClientConfig, resolve_config
from maec_client.errors import (
    ClientError,
    JobCancelled,
    JobFailed,
    NetworkError,
    NotFound,
    ServerError,
    ValidationFailed,
    WaitTimeout,
    error_from_response,
)
from maec_client.extensions import check_recipe
from maec_client.models import (
    Job,
    JobPage,
    JobSubmission,
    MoeJobRequest,
    NamedJob,
    QueueSummary,
    RecipeJob,
)
from maec_client.options import (
    ClientOptions,
    ConnectionOptions,
    DownloadOptions,
    with_gguf_output,
)
from maec_client.retry import RetryPolicy
from maec_contract import parse_job_request

# A Recipe model of the merge library is a BaseModel too.
M = TypeVar("M", bound=BaseModel)
RecipeSource = NamedJob | BaseModel | Mapping[str, Any] | str | Path
ProgressCallback = Callable[[Job], None]
RequestT = TypeVar("RequestT", bound=JobSubmission)


class _OriginBearer(httpx.Auth):
    """Sends the API key only to the service's own origin.

    File URLs in a job result may be absolute (another host, a presigned store URL); a
    client-wide header would leak the key there. httpx strips Authorization on
    cross-origin redirects itself, this covers URLs we are handed directly.
    """

    def __init__(self, api_key: str, base_url: str) -> None:
        self._header = f"Bearer {api_key}"
        self._origin = _origin(base_url)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if _origin(str(request.url)) == self._origin:
            request.headers["Authorization"] = self._header
        yield request


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def http_options(config: ClientConfig) -> dict[str, Any]:
    """httpx.Client / AsyncClient settings for one service endpoint."""
    return {
        "base_url": config.url,
        "auth": _OriginBearer(config.api_key, config.url) if config.api_key else None,
        "timeout": httpx.Timeout(config.timeout, connect=min(config.timeout, 10.0)),
        "headers": {"User-Agent": "maec-client/0.1"},
        # Needed for ?redirect=true downloads (307 to a presigned store URL).
        "follow_redirects": True,
        "limits": httpx.Limits(max_connections=64, max_keepalive_connections=32),
    }


def job_id_of(job: Job | str) -> str:
    return job.id if isinstance(job, Job) else job


def connection(url: str | None, api_key: str | None,
               options: ConnectionOptions) -> tuple[ClientConfig, RetryPolicy]:
    """The endpoint settings and retry policy both clients make from their options:
    ``config``, else the URL, key and timeout resolved (maec_client.config); ``retry``
    (default RetryPolicy()) with the ``max_retries`` and ``backoff`` shorthands applied."""
    config = options.get("config") or resolve_config(url=url, api_key=api_key,
                                                      timeout=options.get("timeout"))
    policy = options.get("retry") or RetryPolicy()
    if (max_retries := options.get("max_retries")) is not None:
        policy = dataclasses.replace(policy, max_retries=max_retries)
    if (backoff := options.get("backoff")) is not None:
        policy = dataclasses.replace(policy, backoff=backoff)
    return config, policy


class Client:
    """One service endpoint and API key; thread-safe (downloads use it from many threads).

    ``url``/``api_key``/``timeout`` left as None are read from the environment and the
    config file (see maec_client.config); the other keyword arguments are
    :class:`~maec_client.options.ClientOptions` (the retry policy, and a transport, sleep
    and clock for tests and embedding).
    """

    def __init__(self, url: str | None = None, api_key: str | None = None,
                 **options: Unpack[ClientOptions]) -> None:
        self.config, self.retry = connection(url, api_key, options)
        self._sleep = options.get("sleep", time.sleep)
        self._clock = options.get("clock", time.monotonic)
        self.http = httpx.Client(transport=options.get("transport"),
                                 **http_options(self.config))

    # -- plumbing ---------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, json_body: Any = None,
                params: Mapping[str, Any] | None = None, retry: bool = True) -> httpx.Response:
        """Send one request under the retry policy (when ``retry``); errors typed.

        ``retry`` is False only for a non-idempotent request that could run twice;
        ``submit`` always sends an idempotency key, so every call here is retry-safe.
        """
        def send() -> httpx.Response:
            return checked(self.http.request(method, path, json=json_body, params=params))

        try:
            return self.retry.call(send, self._sleep, enabled=retry)
        except httpx.TransportError as exc:
            raise network_error(method, path, exc) from exc

    # -- endpoints --------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        data = parse_json(self.request("GET", "/healthz"))
        return dict(data) if isinstance(data, dict) else {"status": data}

    def ready(self) -> dict[str, Any]:
        """``/readyz``; a 503 (not ready) raises ServerError with the body's details."""
        data = parse_json(self.request("GET", "/readyz", retry=False))
        return dict(data) if isinstance(data, dict) else {"ready": data}

    def submit(self, source: RecipeSource, *, idempotency_key: str | None = None,
               name: str | None = None, validate: bool = True,
               pinned: bool | None = None, gguf: str | None = None) -> Job:
        """Queue a job from a recipe (file, YAML text, dict, Recipe) or a NamedJob.

        Mappings with ``merge_method`` (mergekit or MAEC recipe shape) are sent as
        ``{"recipe": ...}``; mappings with ``method`` are the named-checkpoints form; a
        mapping that already has ``recipe`` is sent as is. ``validate`` checks recipes
        locally first (schema and parameter ranges, no source access) so mistakes fail
        fast with the same ``invalid_recipe`` code the service would use. ``pinned``
        keeps the job past the service's retention period (see ``pin``). ``gguf``
        (``"q8_0"``, ``"f16"``, ...) also publishes the merged model as one GGUF file.
        """
        body = submit_body(source, idempotency_key=idempotency_key, name=name,
                           validate=validate, pinned=pinned, gguf=gguf)
        return parse_job(self.request("POST", "/v1/jobs", json_body=body))

    def submit_named(self, method: str, *, idempotency_key: str | None = None,
                     **fields: Any) -> Job:
        """Named-checkpoints form from keyword arguments (see NamedJob for the fields)."""
        return self.submit(named_job(method, **fields), idempotency_key=idempotency_key)

    def get(self, job: Job | str) -> Job:
        return parse_job(self.request("GET", f"/v1/jobs/{quote(job_id_of(job), safe='')}"))

    def list_page(self, *, status: str | None = None, limit: int = 20,
                  cursor: str | None = None) -> JobPage:
        params = list_params(status, limit, cursor)
        return parse_page(self.request("GET", "/v1/jobs", params=params))

    def iter_jobs(self, *, status: str | None = None, limit: int | None = None,
                  page_size: int = 100) -> Iterator[Job]:
        """Every job (newest first), following ``next_cursor`` until done or ``limit``."""
        cursor: str | None = None
        seen = 0
        while True:
            want = page_size if limit is None else max(1, min(page_size, limit - seen))
            page = self.list_page(status=status, limit=want, cursor=cursor)
            for job in page.jobs:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield job
            if not page.next_cursor or (limit is not None and seen >= limit):
                return
            cursor = page.next_cursor

    def list_jobs(self, *, status: str | None = None, limit: int | None = None) -> list[Job]:
        return list(self.iter_jobs(status=status, limit=limit))

    def queue(self) -> QueueSummary:
        """``GET /v1/queue``: the caller's queued and running jobs (each queued one with
        its position and ETA) and every worker pool's load."""
        return parse_queue(self.request("GET", "/v1/queue"))

    def cancel(self, job: Job | str) -> Job:
        """Ask a job to stop (safe to retry); Conflict (``job_finished``) if it already
        succeeded or failed."""
        path = f"/v1/jobs/{quote(job_id_of(job), safe='')}/cancel"
        return parse_job(self.request("POST", path))

    def pin(self, job: Job | str) -> Job:
        """Keep the job and its outputs past the retention period (until unpinned or
        deleted)."""
        return parse_job(self.request("POST", job_path(job, "pin")))

    def unpin(self, job: Job | str) -> Job:
        """Let the job expire again with the service's retention period."""
        return parse_job(self.request("POST", job_path(job, "unpin")))

    def delete(self, job: Job | str, *, missing_ok: bool = False) -> None:
        """Delete a finished job and its files. NotFound (``job_not_found``) when there
        is no such job (or it is already deleted) unless ``missing_ok``; Conflict
        (``job_active``) while it is queued or running: cancel it first."""
        try:
            self.request("DELETE", job_path(job))
        except NotFound:
            if not missing_ok:
                raise

    def wait(self, job: Job | str, *, timeout: float | None = None,
             poll_interval: float = 0.5, max_interval: float = 5.0,
             on_progress: ProgressCallback | None = None,
             raise_on_failure: bool = True) -> Job:
        """Poll until the job ends. Returns the succeeded job.

        Polls start at ``poll_interval`` and grow 1.5x to ``max_interval`` (a long merge
        should not cost a request every half second); they reset when the job moves so a
        progress bar stays live. Raises JobFailed / JobCancelled (unless
        ``raise_on_failure`` is False) and WaitTimeout.
        """
        poll = Poller(self._clock, timeout, poll_interval, max_interval, on_progress)
        current = job if isinstance(job, Job) else self.get(job)
        while (delay := poll.next_delay(current)) is not None:
            self._sleep(delay)
            current = self.get(current.id)
        return poll.outcome(current, raise_on_failure)

    def download(self, job: Job | str, dest: str | Path,
                 options: DownloadOptions | None = None, **fields: Any) -> Path:
        """Download a succeeded job's files into ``dest``, verified; ``options`` (or
        its fields as keyword arguments: ``workers=4``) as in
        :class:`~maec_client.options.DownloadOptions`. See maec_client.download."""
        from maec_client.download import download_job

        opts = DownloadOptions.of(options, **fields)
        current = job if isinstance(job, Job) and job.result is not None else self.get(job)
        return download_job(self, current, Path(dest), opts)


def job_path(job: Job | str, action: str | None = None) -> str:
    path = f"/v1/jobs/{quote(job_id_of(job), safe='')}"
    return path if action is None else f"{path}/{action}"


def checked(resp: httpx.Response) -> httpx.Response:
    """The response if it is a success; else the typed error its status and body mean."""
    if resp.status_code < 400:
        return resp
    raise error_from_response(resp.status_code, error_body(resp),
                              resp.headers.get("retry-after"))


def network_error(method: str, path: str, exc: httpx.TransportError) -> NetworkError:
    return NetworkError(f"{method} {path}: {type(exc).__name__}: {exc}")


def error_body(resp: httpx.Response) -> Any:
    """The (already read) body of an error answer: JSON if it is, else text."""
    try:
        return resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return resp.text


def parse_json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ServerError("invalid_response", f"non-JSON answer: {resp.text[:200]!r}",
                          {}, resp.status_code) from None


def parse_answer(resp: httpx.Response, model: type[M], what: str) -> M:
    """The answer's JSON as ``model``; an answer of another shape is the server's fault
    (``invalid_response``), not the caller's."""
    try:
        return model.model_validate(parse_json(resp))
    except ValidationError as exc:
        raise ServerError("invalid_response", f"answer is not {what}: {exc}", {},
                          resp.status_code) from None


def parse_job(resp: httpx.Response) -> Job:
    return parse_answer(resp, Job, "a Job")


def parse_page(resp: httpx.Response) -> JobPage:
    return parse_answer(resp, JobPage, "a job page")


def parse_queue(resp: httpx.Response) -> QueueSummary:
    return parse_answer(resp, QueueSummary, "a queue summary")


def list_params(status: str | None, limit: int, cursor: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    if cursor:
        params["cursor"] = cursor
    return params


def named_job(method: str, **fields: Any) -> NamedJob:
    return request_model(NamedJob, {"method": method, **fields})


def request_model(model: type[RequestT], data: Mapping[str, Any]) -> RequestT:
    """``data`` validated as a request body; ValidationFailed(invalid_request) if it is
    not one, as the service would answer."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed("invalid_request", f"invalid job fields: {exc}",
                               {"errors": exc.errors(include_url=False)}) from None


def _any_request(data: Mapping[str, Any]) -> JobSubmission:
    """``data`` as the body of the kind it names (a merge when it names none)."""
    try:
        return parse_job_request(data)
    except ValidationError as exc:
        raise ValidationFailed("invalid_request", f"invalid job fields: {exc}",
                               {"errors": exc.errors(include_url=False)}) from None


def submit_body(source: RecipeSource, *, idempotency_key: str | None, name: str | None,
                validate: bool, pinned: bool | None = None,
                gguf: str | None = None) -> dict[str, Any]:
    body = with_gguf_output(build_body(source, validate=validate), gguf)
    if name is not None:
        body["name"] = name
    if pinned is not None:
        body["pinned"] = pinned
    # A key per call makes the POST safe to retry: a resend after a lost answer gets
    # the job the first attempt created (200), never a second job.
    body["idempotency_key"] = (idempotency_key or body.get("idempotency_key")
                               or f"maec-client-{uuid.uuid4().hex}")
    return body


class Poller:
    """The polling schedule of ``wait``, shared by the sync and async clients.

    Polls start at ``poll_interval`` and grow 1.5x to ``max_interval`` (a long merge
    should not cost a request every half second); they reset when the job moves so a
    progress bar stays live.
    """

    def __init__(self, clock: Callable[[], float], timeout: float | None,
                 poll_interval: float, max_interval: float,
                 on_progress: ProgressCallback | None) -> None:
        self._clock = clock
        self._start = clock()
        self._timeout = timeout
        self._base = poll_interval
        self._interval = poll_interval
        self._max = max_interval
        self._on_progress = on_progress
        self._last: tuple[Any, ...] | None = None

    def next_delay(self, job: Job) -> float | None:
        """Seconds to sleep before the next poll; None once the job has ended."""
        key = (job.status, job.stage, job.progress.done, job.progress.fraction)
        if key != self._last:
            if self._on_progress is not None:
                self._on_progress(job)
            if self._last is not None:
                self._interval = self._base
            self._last = key
        if job.done:
            return None
        elapsed = self._clock() - self._start
        if self._timeout is not None and elapsed >= self._timeout:
            raise WaitTimeout(job, self._timeout)
        delay = self._interval
        if self._timeout is not None:
            delay = min(delay, max(0.0, self._timeout - elapsed))
        self._interval = min(self._interval * 1.5, self._max)
        return delay

    @staticmethod
    def outcome(job: Job, raise_on_failure: bool) -> Job:
        if raise_on_failure and job.status == "failed":
            raise JobFailed(job)
        if raise_on_failure and job.status == "cancelled":
            raise JobCancelled(job)
        return job


def load_source(source: RecipeSource) -> dict[str, Any]:
    """A recipe source as a plain mapping (YAML files and text parsed, models dumped)."""
    if isinstance(source, NamedJob):
        return {"__named__": True, **source.body()}
    if isinstance(source, BaseModel):
        return dict(source.model_dump(mode="json", exclude_none=True))
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, Path) or ("\n" not in source and source.endswith((".yaml", ".yml"))):
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ValidationFailed("invalid_recipe",
                                   f"cannot read recipe {source}: {exc.strerror}") from None
    else:
        text = str(source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValidationFailed("invalid_recipe", f"recipe is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationFailed("invalid_recipe", "recipe must be a YAML mapping")
    return data


def build_body(source: RecipeSource, *, validate: bool = True) -> dict[str, Any]:
    """The POST /v1/jobs body for ``source`` (one of the contract's forms; a mapping with
    ``experts`` and no ``merge_method`` is a mergekit-moe config, sent as an MoE build)."""
    data = load_source(source)
    if data.pop("__named__", False):
        return data
    if "experts" in data and "merge_method" not in data and "recipe" not in data:
        # A bare mergekit-moe config: sent as an MoE build.
        data = MoeJobRequest.of(data).body()
    if "recipe" in data:
        job = _any_request(data)
        if not job.checked_locally:
            # A kind whose recipe the client has no check for: the service checks it.
            return job.body()
    elif "merge_method" in data:
        job = request_model(RecipeJob, {"recipe": data})
    elif "method" in data:
        return request_model(NamedJob, data).body()
    else:
        raise ValidationFailed(
            "invalid_request",
            "not a job: expected a recipe ('merge_method'), a named-checkpoints job "
            "('method') or a body with 'recipe'")
    body = job.body()
    if validate:
        check_recipe(body["recipe"])
    return body


__all__ = ["Client", "ClientError", "RecipeSource", "build_body", "load_source"]
