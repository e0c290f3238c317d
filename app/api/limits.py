"""Rate limits shared by every API process, and constant-time API key matching.

Token buckets, held in Redis so that N API processes enforce one limit:

- requests per key: ``rate_limit_per_minute`` tokens a minute, ``rate_limit_burst`` saved;
- job submissions per key: ``submissions_per_minute``, as many saved;
- failed authentications per client address: ``auth_failures_per_minute``,
  ``auth_failure_burst`` saved. Only failed attempts take from it, and only failed
  attempts are refused while it is empty: a valid key from the same address (everyone
  behind one NAT or proxy) keeps working, so a guesser cannot lock the others out. What
  stops guessing is the key space (keys are long random strings, stored as sha256);
  the bucket bounds the log noise and the work a guesser costs the service.

Exceeding one answers 429 ``rate_limited`` with ``Retry-After`` (whole seconds until the
next token). Concurrent jobs are limited separately, atomically with the job record
(``too_many_jobs``).

One Lua script takes (or, for the address check, only reads) any number of buckets in one
atomic call, timed by the Redis server's clock (API hosts' clocks may disagree). Checks
asked for by concurrent requests are queued and sent as one script call, one call in
flight at a time, as the job reads are (app/jobs/batching.py): the limiter adds one round
trip per request at most, and the job-read route overlaps it with its read.

If Redis cannot be reached (connection refused, timeout, still loading) the limits let
requests through and say so in the log: the routes that need Redis answer 503 by
themselves, and health and readiness must go on answering as they do without a limiter.
Any other error fails the requests it concerns, so a fault cannot switch limits off.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.api.errors import ApiError
from app.jobs.keys import part
from app.settings import Settings

log = logging.getLogger("maec.api")

# KEYS: one bucket each (the same bucket may appear many times in a batch). ARGV: three
# numbers per bucket: tokens per ms, capacity, and cost (1 takes a token, 0 only looks).
# Returns per entry 0 (a token was there) or the ms until one is. A bucket is a hash
# {tokens, ts}, read once and written once per call however often it appears; it expires
# once it would be full again, since an absent bucket reads as full.
TAKE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local buckets = {}
local out = {}
for i, key in ipairs(KEYS) do
  local rate = tonumber(ARGV[3 * i - 2])
  local cap = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local b = buckets[key]
  if not b then
    local state = redis.call('HMGET', key, 'tokens', 'ts')
    local tokens = tonumber(state[1]) or cap
    local last = tonumber(state[2]) or now
    b = {tokens = math.min(cap, tokens + math.max(0, now - last) * rate),
         rate = rate, cap = cap, taken = false}
    buckets[key] = b
  end
  if b.tokens >= 1 then
    out[i] = 0
    if cost > 0 then
      b.tokens = b.tokens - cost
      b.taken = true
    end
  else
    out[i] = math.ceil((1 - b.tokens) / rate)
  end
end
-- An untouched bucket keeps its stored state: refilling is linear, so the next call
-- computes the same level from it.
for key, b in pairs(buckets) do
  if b.taken then
    redis.call('HSET', key, 'tokens', b.tokens, 'ts', now)
    redis.call('PEXPIRE', key, math.ceil((b.cap - b.tokens) / b.rate) + 1000)
  end
end
return out
"""
PREFIX = "maec:limit:"
# Script calls carry at most this many checks (a few hundred keys per call is cheap).
MAX_BATCH = 256
# A Redis outage is logged at most this often, not once per request.
_WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class Bucket:
    key: str
    per_ms: float
    capacity: float
    cost: int = 1


def _bucket(kind: str, who: str, per_minute: int, burst: int, cost: int = 1) -> Bucket:
    # ``who`` (a key id, a client address) as a length-prefixed part: no value can name
    # another's bucket.
    return Bucket(f"{PREFIX}{kind}:{part(who)}", per_minute / 60_000.0, float(max(1, burst)),
                  cost)


def _retry_after(wait_ms: int) -> int:
    return max(1, math.ceil(wait_ms / 1000))


def _limited(message: str, wait_ms: int, **details: object) -> ApiError:
    wait = _retry_after(wait_ms)
    return ApiError(429, "rate_limited", f"{message}; retry in {wait} s",
                    headers={"Retry-After": str(wait)}, retry_after=wait, **details)


_Waiter = tuple[tuple[Bucket, ...], "asyncio.Future[list[int]]"]


class _Batcher:
    """Sends the checks asked for in one event-loop round as one script call."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._script = client.register_script(TAKE)
        self._pending: list[_Waiter] = []
        self._sender: asyncio.Task[None] | None = None
        self._warned = 0.0

    def check(self, buckets: tuple[Bucket, ...]) -> asyncio.Future[list[int]]:
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._pending.append((buckets, fut))
        if self._sender is None:
            # Started, not run: checks asked for in this same round join the first call.
            self._sender = asyncio.ensure_future(self._send_all())
        return fut

    async def _send_all(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                await self._send(batch)
        except BaseException:  # cancelled at shutdown: nobody is left waiting
            for _, fut in self._pending:
                fut.cancel()
            self._pending = []
            raise
        finally:
            self._sender = None

    async def _send(self, batch: list[_Waiter]) -> None:
        keys = [b.key for buckets, _ in batch for b in buckets]
        args = [x for buckets, _ in batch for b in buckets for x in (b.per_ms, b.capacity,
                                                                    b.cost)]
        try:
            waits = [int(w) for w in await self._script(keys=keys, args=args)]
        except asyncio.CancelledError:
            for _, fut in batch:
                fut.cancel()
            raise
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self._warn(exc)
            waits = [0] * len(keys)
        except Exception as exc:  # not an outage (a script error): the requests fail
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        at = 0
        for buckets, fut in batch:
            if not fut.done():  # its request may have gone away meanwhile
                fut.set_result(waits[at:at + len(buckets)])
            at += len(buckets)

    def _warn(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning("rate limits not enforced: redis unreachable (%s)", type(exc).__name__)


class Admission:
    """The pending verdict on one authenticated request; ``check`` raises 429 or returns."""

    __slots__ = ("_fut", "_owner")

    def __init__(self, fut: asyncio.Future[list[int]], owner: str) -> None:
        self._fut = fut
        self._owner = owner

    async def check(self) -> None:
        (key_wait,) = await self._fut
        if key_wait:
            raise _limited(f"too many requests for key {self._owner}", key_wait)


class Limits:
    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self._client = client
        self._s = settings
        self._batcher = _Batcher(client)
        # Per-request checks reuse their bucket descriptions (keys are few).
        self._keys: dict[str, Bucket] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        # The same kind of client the API's job store makes, on its own pool.
        return cls(aioredis.Redis.from_url(settings.redis_url, health_check_interval=30),
                   settings)

    async def close(self) -> None:
        await self._client.aclose()

    def _address(self, address: str, cost: int) -> Bucket:
        s = self._s
        return _bucket("auth", address, s.auth_failures_per_minute, s.auth_failure_burst, cost)

    def request(self, owner: str) -> Admission:
        """Start the check of one request by ``owner`` (one token from the key's bucket);
        the caller awaits ``check()``. The address's failed-login bucket is not looked
        at: an authenticated request is never refused for others' failures."""
        key = self._keys.get(owner)
        if key is None:
            s = self._s
            key = self._keys[owner] = _bucket("req", owner, s.rate_limit_per_minute,
                                              s.rate_limit_burst)
        return Admission(self._batcher.check((key,)), owner)

    async def failed_auth(self, address: str) -> None:
        """Count one failed authentication from ``address``; 429 once over its limit."""
        (wait,) = await self._batcher.check((self._address(address, 1),))
        if wait:
            raise _limited("too many failed authentications from this address", wait)

    async def submission(self, owner: str) -> None:
        """Take one of ``owner``'s job submissions; 429 once over the limit."""
        n = self._s.submissions_per_minute
        (wait,) = await self._batcher.check((_bucket("submit", owner, n, n),))
        if wait:
            raise _limited(f"more than {n} submissions a minute", wait, limit=n)


def token_matches(token: str, digest: str) -> bool:
    """Whether ``token``'s sha256 is ``digest`` (hex), compared in constant time."""
    presented = hashlib.sha256(token.encode()).hexdigest().encode()
    return hmac.compare_digest(presented, digest.encode())


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
