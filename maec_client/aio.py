"""asyncio variant of Client for async tools (same endpoints, errors and retry rules).

Downloads are file and hash work more than network waiting, so ``download`` runs the
threaded sync downloader in a worker thread rather than re-implementing it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Unpack
from urllib.parse import quote

import httpx

from maec_client.client import (
    Client,
    Poller,
    ProgressCallback,
    RecipeSource,
    checked,
    connection,
    http_options,
    job_id_of,
    job_path,
    list_params,
    named_job,
    network_error,
    parse_job,
    parse_json,
    parse_page,
    parse_queue,
    submit_body,
)
from maec_client.errors import NotFound
from maec_client.models import Job, JobPage, QueueSummary
from maec_client.options import AsyncClientOptions, DownloadOptions


class AsyncClient:
    """One service endpoint and API key, for asyncio code. See Client for the semantics."""

    def __init__(self, url: str | None = None, api_key: str | None = None,
                 **options: Unpack[AsyncClientOptions]) -> None:
        self.config, self.retry = connection(url, api_key, options)
        self._sleep = options.get("sleep", asyncio.sleep)
        self._clock = options.get("clock", time.monotonic)
        self._sync_transport = options.get("sync_transport")
        self.http = httpx.AsyncClient(transport=options.get("transport"),
                                      **http_options(self.config))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, *, json_body: Any = None,
                      params: Mapping[str, Any] | None = None,
                      retry: bool = True) -> httpx.Response:
        async def send() -> httpx.Response:
            return checked(await self.http.request(method, path, json=json_body,
                                                   params=params))

        try:
            return await self.retry.acall(send, self._sleep, enabled=retry)
        except httpx.TransportError as exc:
            raise network_error(method, path, exc) from exc

    async def health(self) -> dict[str, Any]:
        data = parse_json(await self.request("GET", "/healthz"))
        return dict(data) if isinstance(data, dict) else {"status": data}

    async def submit(self, source: RecipeSource, *, idempotency_key: str | None = None,
                     name: str | None = None, validate: bool = True,
                     pinned: bool | None = None, gguf: str | None = None) -> Job:
        body = submit_body(source, idempotency_key=idempotency_key, name=name,
                           validate=validate, pinned=pinned, gguf=gguf)
        return parse_job(await self.request("POST", "/v1/jobs", json_body=body))

    async def submit_named(self, method: str, *, idempotency_key: str | None = None,
                           **fields: Any) -> Job:
        return await self.submit(named_job(method, **fields), idempotency_key=idempotency_key)

    async def get(self, job: Job | str) -> Job:
        path = f"/v1/jobs/{quote(job_id_of(job), safe='')}"
        return parse_job(await self.request("GET", path))

    async def list_page(self, *, status: str | None = None, limit: int = 20,
                        cursor: str | None = None) -> JobPage:
        params = list_params(status, limit, cursor)
        return parse_page(await self.request("GET", "/v1/jobs", params=params))

    async def iter_jobs(self, *, status: str | None = None, limit: int | None = None,
                        page_size: int = 100) -> AsyncIterator[Job]:
        cursor: str | None = None
        seen = 0
        while True:
            want = page_size if limit is None else max(1, min(page_size, limit - seen))
            page = await self.list_page(status=status, limit=want, cursor=cursor)
            for job in page.jobs:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield job
            if not page.next_cursor or (limit is not None and seen >= limit):
                return
            cursor = page.next_cursor

    async def list_jobs(self, *, status: str | None = None,
                        limit: int | None = None) -> list[Job]:
        return [j async for j in self.iter_jobs(status=status, limit=limit)]

    async def queue(self) -> QueueSummary:
        """See Client.queue."""
        return parse_queue(await self.request("GET", "/v1/queue"))

    async def cancel(self, job: Job | str) -> Job:
        path = f"/v1/jobs/{quote(job_id_of(job), safe='')}/cancel"
        return parse_job(await self.request("POST", path))

    async def pin(self, job: Job | str) -> Job:
        return parse_job(await self.request("POST", job_path(job, "pin")))

    async def unpin(self, job: Job | str) -> Job:
        return parse_job(await self.request("POST", job_path(job, "unpin")))

    async def delete(self, job: Job | str, *, missing_ok: bool = False) -> None:
        """See Client.delete."""
        try:
            await self.request("DELETE", job_path(job))
        except NotFound:
            if not missing_ok:
                raise

    async def wait(self, job: Job | str, *, timeout: float | None = None,
                   poll_interval: float = 0.5, max_interval: float = 5.0,
                   on_progress: ProgressCallback | None = None,
                   raise_on_failure: bool = True) -> Job:
        poll = Poller(self._clock, timeout, poll_interval, max_interval, on_progress)
        current = job if isinstance(job, Job) else await self.get(job)
        while (delay := poll.next_delay(current)) is not None:
            await self._sleep(delay)
            current = await self.get(current.id)
        return poll.outcome(current, raise_on_failure)

    async def download(self, job: Job | str, dest: str | Path,
                       options: DownloadOptions | None = None, **fields: Any) -> Path:
        """Client.download in a worker thread (the event loop stays free meanwhile)."""
        opts = DownloadOptions.of(options, **fields)
        current = job if isinstance(job, Job) and job.result is not None else await self.get(job)

        def run() -> Path:
            with Client(config=self.config, transport=self._sync_transport,
                        retry=self.retry) as sync:
                return sync.download(current, dest, opts)

        return await asyncio.to_thread(run)
