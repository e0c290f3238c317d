"""The parts of a split merge, kept in the job store beside the job's record.

A split job's parts live in one Redis hash (:func:`parts_key`): ``n`` and, per part
``p<i>``, a JSON entry ``{lo, hi, state, attempt, owner, lease_until, fraction,
shards}``. Each change is one Lua script, so two workers can never both hold a part:

- :meth:`PartStore.claim` hands out the first part that is pending, or running under a
  lease that ran out (its worker is gone), with the next attempt number; a part that
  has used up its attempts is marked failed instead;
- :meth:`PartStore.update` (lease renewal, progress, a shard that landed) and
  :meth:`PartStore.finish` take effect only for the attempt that holds the part, so a
  worker whose part was taken over records nothing and cannot mark it done: a part is
  done once, by its current holder. A part's fraction only grows (a part claimed again
  starts its count over), so the job's progress, made from it, never goes back.

The job's own attempt (the coordinator, ``worker.split``) creates the parts, runs parts
itself and, once every part is done, writes the index, card and manifest: that final
step is fenced by the job's attempt like any publish.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from app.jobs.keys import PREFIX

# A split job's parts outlive no job by long: removed when it ends, else they expire.
PARTS_TTL_S = 7 * 86400


def parts_key(job_id: str) -> str:
    return f"{PREFIX}parts:{job_id}"


_INIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'n', n, 'prefix', ARGV[2])
for i = 0, n - 1 do
  local e = {lo = tonumber(ARGV[3 + 2 * i]), hi = tonumber(ARGV[4 + 2 * i]),
             state = 'pending', attempt = 0, owner = '', lease_until = 0, fraction = 0}
  redis.call('HSET', KEYS[1], 'p' .. i, cjson.encode(e))
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3 + 2 * n]))
return 1
"""

# ARGV: now, lease_s, worker, max_attempts. Returns {i, attempt} for a claimed part,
# {-2, i} for a part that ran out of attempts, {-1} when none is free.
_CLAIM = """
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
local now = tonumber(ARGV[1])
for i = 0, n - 1 do
  local raw = redis.call('HGET', KEYS[1], 'p' .. i)
  local e = cjson.decode(raw)
  if e.state == 'pending' or (e.state == 'running' and e.lease_until < now) then
    if e.attempt >= tonumber(ARGV[4]) then
      e.state = 'failed'
      redis.call('HSET', KEYS[1], 'p' .. i, cjson.encode(e))
      return {-2, i}
    end
    e.state = 'running'
    e.attempt = e.attempt + 1
    e.owner = ARGV[3]
    e.lease_until = now + tonumber(ARGV[2])
    redis.call('HSET', KEYS[1], 'p' .. i, cjson.encode(e))
    return {i, e.attempt}
  end
end
return {-1}
"""

# ARGV: i, attempt, state ('' keeps it), fields as JSON (merged into the entry).
# Returns 1, or -1 when the part is not this attempt's (taken over, or the job ended).
_UPDATE = """
local raw = redis.call('HGET', KEYS[1], 'p' .. ARGV[1])
if not raw then return -1 end
local e = cjson.decode(raw)
-- Already so for this attempt: a call retried after a dropped reply.
if e.attempt == tonumber(ARGV[2]) and ARGV[3] ~= '' and e.state == ARGV[3] then
  return 1
end
if e.attempt ~= tonumber(ARGV[2]) or e.state ~= 'running' then return -1 end
for k, v in pairs(cjson.decode(ARGV[4])) do
  -- A part claimed again counts its progress from its start; what the parts have done
  -- (and the job's progress, made from it) never goes back.
  if k ~= 'fraction' or v > (tonumber(e.fraction) or 0) then e[k] = v end
end
if ARGV[3] ~= '' then e.state = ARGV[3] end
redis.call('HSET', KEYS[1], 'p' .. ARGV[1], cjson.encode(e))
return 1
"""


@dataclass(frozen=True)
class Part:
    """One part as stored: shards ``lo`` to ``hi - 1`` of the output's plan."""

    index: int
    lo: int
    hi: int
    state: str
    attempt: int
    fraction: float = 0.0
    # name -> {"size", "sha256", "etag"}: its shards stored and verified so far.
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    # A failed part's error (its worker's {"code", "message"}).
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Parts:
    """Every part of one job, and the storage prefix their shards go under."""

    prefix: str
    parts: list[Part]

    @property
    def done(self) -> bool:
        return all(p.state == "done" for p in self.parts)

    @property
    def fraction(self) -> float:
        if not self.parts:
            return 0.0
        return sum(1.0 if p.state == "done" else p.fraction for p in self.parts) / len(
            self.parts)


def part_ranges(shards: int, parts: int) -> list[tuple[int, int]]:
    """``shards`` cut into at most ``parts`` contiguous groups of near-equal size."""
    k = max(1, min(parts, shards))
    cuts = [round(i * shards / k) for i in range(k + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(k)]


class PartStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._init = client.register_script(_INIT)
        self._claim = client.register_script(_CLAIM)
        self._update = client.register_script(_UPDATE)

    def create(self, job_id: str, prefix: str, ranges: list[tuple[int, int]]) -> bool:
        """The job's parts, unless it has them already (a later coordinator attempt
        goes on with those); whether they were created now."""
        args: list[Any] = [len(ranges), prefix]
        for lo, hi in ranges:
            args += [lo, hi]
        return bool(self._init(keys=[parts_key(job_id)], args=[*args, PARTS_TTL_S]))

    def get(self, job_id: str) -> Parts | None:
        raw = cast(dict[bytes, bytes], self.r.hgetall(parts_key(job_id)))
        if not raw:
            return None
        doc = {k.decode(): v.decode() for k, v in raw.items()}
        parts = []
        for i in range(int(doc.get("n", 0))):
            e = json.loads(doc[f"p{i}"])
            shards = e.get("shards") or {}
            parts.append(Part(i, int(e["lo"]), int(e["hi"]), str(e["state"]),
                              int(e["attempt"]), float(e.get("fraction") or 0.0),
                              shards if isinstance(shards, dict) else {},
                              e.get("error") if isinstance(e.get("error"), dict) else None))
        return Parts(doc.get("prefix", ""), parts)

    def claim(self, job_id: str, *, worker: str, lease_s: float, now: float,
              max_attempts: int) -> tuple[int, int]:
        """(part, attempt) claimed; (-1, 0) none free; (-2, part) a part out of attempts."""
        got = self._claim(keys=[parts_key(job_id)],
                          args=[now, lease_s, worker, max_attempts])
        return (int(got[0]), int(got[1])) if len(got) > 1 else (-1, 0)

    def update(self, job_id: str, index: int, attempt: int, fields: dict[str, Any],
               state: str = "") -> bool:
        """Whether the write took effect (the part is still this attempt's)."""
        return int(self._update(keys=[parts_key(job_id)],
                                args=[index, attempt, state, json.dumps(fields)])) == 1

    def finish(self, job_id: str, index: int, attempt: int) -> bool:
        return self.update(job_id, index, attempt, {"fraction": 1.0}, state="done")

    def remove(self, job_id: str) -> None:
        self.r.delete(parts_key(job_id))
