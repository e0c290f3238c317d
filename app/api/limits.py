"""Per-key request rate limit and constant-time API key matching.

The rate limit is a token bucket per key id, held in this process: ``rate_limit_per_minute``
tokens a minute, at most ``rate_limit_burst`` saved up. It bounds what one client can
make one API process do (each submission reads checkpoint headers); with several API
replicas each enforces it separately. Exceeding it answers 429 ``rate_limited`` with
``Retry-After`` (whole seconds until the next token). Concurrent jobs are limited
separately, atomically in Redis (``too_many_jobs``).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time

from app.api.errors import ApiError


class RateLimiter:
    def __init__(self, per_minute: int, burst: int) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(max(1, burst))
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def check(self, key_id: str, now: float | None = None) -> None:
        """Take one token for ``key_id`` or raise 429 rate_limited."""
        t = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key_id, (self.burst, t))
            tokens = min(self.burst, tokens + (t - last) * self.rate)
            if tokens < 1.0:
                self._buckets[key_id] = (tokens, t)
                wait = max(1, math.ceil((1.0 - tokens) / self.rate))
                raise ApiError(
                    429, "rate_limited",
                    f"too many requests for key {key_id}; retry in {wait} s",
                    headers={"Retry-After": str(wait)}, retry_after=wait,
                )
            self._buckets[key_id] = (tokens - 1.0, t)


def owner_of(token: str, digests: dict[str, str]) -> str | None:
    """The key id whose stored sha256 matches ``token``, comparing against every stored
    digest with ``hmac.compare_digest`` and no early exit, so timing does not depend on
    how much of any stored hash a guess matches."""
    presented = hashlib.sha256(token.encode()).hexdigest().encode()
    found: str | None = None
    for digest, key_id in digests.items():
        if hmac.compare_digest(presented, digest.encode()):
            found = key_id
    return found
