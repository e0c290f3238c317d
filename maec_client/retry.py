"""The client's one retry policy: what is retried, how long to wait, how often.

Used by the sync client, the async client and every download range, so the three agree.
Retried: transport errors (connect, read, a dropped stream) and the statuses that mean
"not now" — 429 (refused before doing anything) and 502-504 (a restarting API or proxy).
A ``Retry-After`` the service sends wins over the backoff; otherwise the delay doubles
from ``backoff`` up to ``max_backoff``, minus a random share (``jitter``) so that many
clients refused together do not come back together.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from maec_client.errors import ApiError

T = TypeVar("T")

RETRY_STATUS: frozenset[int] = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """``max_retries`` retries after the first attempt (so ``max_retries + 1`` sends)."""

    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0
    # Fraction of each backoff delay drawn at random: a delay d becomes d * (1 - jitter*u)
    # with u uniform in [0, 1). 0 gives exact, reproducible delays.
    jitter: float = 0.5
    # A server asking for longer than this is taken to mean "much later", not obeyed.
    max_retry_after: float = 300.0
    statuses: frozenset[int] = RETRY_STATUS
    rand: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff < 0 or not 0 <= self.jitter <= 1:
            raise ValueError("max_retries and backoff must be >= 0, jitter within [0, 1]")

    def retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, httpx.TransportError):
            return True
        return isinstance(exc, ApiError) and exc.status in self.statuses

    def delay(self, attempt: int, exc: BaseException | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1`` after ``exc``."""
        if isinstance(exc, ApiError) and exc.retry_after is not None:
            return float(min(exc.retry_after, self.max_retry_after))
        base = min(self.backoff * (2 ** attempt), self.max_backoff)
        return float(base * (1.0 - self.jitter * self.rand()))

    def call(self, send: Callable[[], T], sleep: Callable[[float], None],
             enabled: bool = True) -> T:
        """``send()`` until it returns, a non-retryable error, or retries run out."""
        attempt = 0
        while True:
            try:
                return send()
            except (httpx.TransportError, ApiError) as exc:
                if not (enabled and attempt < self.max_retries and self.retryable(exc)):
                    raise
                sleep(self.delay(attempt, exc))
                attempt += 1

    async def acall(self, send: Callable[[], Awaitable[T]],
                    sleep: Callable[[float], Awaitable[None]], enabled: bool = True) -> T:
        """``call`` for coroutines."""
        attempt = 0
        while True:
            try:
                return await send()
            except (httpx.TransportError, ApiError) as exc:
                if not (enabled and attempt < self.max_retries and self.retryable(exc)):
                    raise
                await sleep(self.delay(attempt, exc))
                attempt += 1
