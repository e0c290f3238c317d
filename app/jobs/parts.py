"""The parts of a split merge, kept in the job store beside the job's record.

A split job's parts live in one Redis hash (:func:`parts_key`): ``n``, the phase the
parts are in (``phase``, of ``phases``), the records decided once (``r<k>``) and, per
part ``p<i>``, a JSON entry ``{lo, hi, state, attempt, owner, lease_until, fraction,
shards, result}``. Each change is one Lua script, so two workers can never both hold a
part:

- :meth:`PartStore.claim` hands out the first part that is pending, or running under a
  lease that ran out (its worker is gone), with the next attempt number; a part that
  has used up its attempts is marked failed instead;
- :meth:`PartStore.update` (lease renewal, progress, a shard that landed) and
  :meth:`PartStore.finish` take effect only for the attempt that holds the part, so a
  worker whose part was taken over records nothing and cannot mark it done: a part is
  done once, by its current holder. A part's fraction only grows within a phase (a part
  claimed again starts its count over), so the job's progress, made from it, never
  goes back;
- a merge whose method decides something over the whole model (MAEC's tensor selection)
  runs in phases: every part runs phase 0 (its ``result``, a few numbers, kept in its
  entry), then :meth:`PartStore.advance` records what was decided from all the results
  (``r<k>``) and hands every part out again for the next phase, once: only while the
  phase is the one its caller finished, and only when every part is done. The last
  phase makes the shards. Attempt numbers go on across phases (a worker that held a
  part in an earlier phase can write nothing in a later one); each phase has
  ``max_attempts`` of its own. ``r0`` is what the coordinator did before the parts
  (MAEC: the ability vectors it extracted or found), given at :meth:`PartStore.create`.

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


# ARGV: n, prefix, phases, r0, then lo, hi per part, then the TTL.
_INIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'n', n, 'prefix', ARGV[2], 'phase', 0, 'phases',
           tonumber(ARGV[3]), 'r0', ARGV[4])
for i = 0, n - 1 do
  local e = {lo = tonumber(ARGV[5 + 2 * i]), hi = tonumber(ARGV[6 + 2 * i]),
             state = 'pending', attempt = 0, base = 0, owner = '', lease_until = 0,
             fraction = 0}
  redis.call('HSET', KEYS[1], 'p' .. i, cjson.encode(e))
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5 + 2 * n]))
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
    if e.attempt - (e.base or 0) >= tonumber(ARGV[4]) then
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


# ARGV: the phase finished, the record decided from its results. Returns 1 (the next
# phase begun, every part pending again), 0 (the phase was already past it: another
# coordinator advanced it) or -1 (a part of the phase is not done).
_ADVANCE = """
local phase = tonumber(redis.call('HGET', KEYS[1], 'phase') or '-1')
if phase ~= tonumber(ARGV[1]) then return 0 end
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
local entries = {}
for i = 0, n - 1 do
  local e = cjson.decode(redis.call('HGET', KEYS[1], 'p' .. i))
  if e.state ~= 'done' then return -1 end
  e.state = 'pending'
  e.base = e.attempt
  e.owner = ''
  e.lease_until = 0
  e.fraction = 0
  e.result = nil
  entries[i] = e
end
for i = 0, n - 1 do
  redis.call('HSET', KEYS[1], 'p' .. i, cjson.encode(entries[i]))
end
redis.call('HSET', KEYS[1], 'phase', phase + 1, 'r' .. (phase + 1), ARGV[2])
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
    # What the part's run of a phase before the last one gave (a method's own text).
    result: str | None = None
    # The attempt number the part's current phase began after (its tries: the rest).
    base: int = 0


@dataclass(frozen=True)
class Parts:
    """Every part of one job, the storage prefix their shards go under, the phase the
    parts are in (of ``phases``; the last makes the shards) and the records decided so
    far (``records[0]``: before the parts; ``records[k]``: after phase ``k - 1``)."""

    prefix: str
    parts: list[Part]
    phase: int = 0
    phases: int = 1
    records: list[str] = field(default_factory=list)

    @property
    def last_phase(self) -> bool:
        return self.phase >= self.phases - 1

    @property
    def phase_done(self) -> bool:
        """Every part done in the current phase."""
        return all(p.state == "done" for p in self.parts)

    @property
    def done(self) -> bool:
        """Every part done in the last phase: every shard made."""
        return self.last_phase and self.phase_done

    @property
    def fraction(self) -> float:
        if not self.parts:
            return 0.0
        within = sum(1.0 if p.state == "done" else p.fraction for p in self.parts) / len(
            self.parts)
        return (min(self.phase, self.phases - 1) + within) / max(1, self.phases)


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
        self._advance = client.register_script(_ADVANCE)

    def create(self, job_id: str, prefix: str, ranges: list[tuple[int, int]], *,
               phases: int = 1, before: str = "") -> bool:
        """The job's parts, in ``phases`` phases (``before``: the record of what was
        done before them), unless it has them already (a later coordinator attempt goes
        on with those); whether they were created now."""
        args: list[Any] = [len(ranges), prefix, max(1, phases), before]
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
                              e.get("error") if isinstance(e.get("error"), dict) else None,
                              e["result"] if isinstance(e.get("result"), str) else None,
                              int(e.get("base") or 0)))
        phase = int(doc.get("phase", 0))
        return Parts(doc.get("prefix", ""), parts, phase, int(doc.get("phases", 1)),
                     [doc.get(f"r{k}", "") for k in range(phase + 1)])

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

    def finish(self, job_id: str, index: int, attempt: int, result: str | None = None
               ) -> bool:
        """Mark the part done (with its ``result``, in a phase before the last); whether
        it still was this attempt's. The result goes in as a JSON string, so Redis's
        JSON codec keeps its numbers exactly as given."""
        fields: dict[str, Any] = {"fraction": 1.0}
        if result is not None:
            fields["result"] = result
        return self.update(job_id, index, attempt, fields, state="done")

    def advance(self, job_id: str, phase: int, record: str) -> int:
        """Phase ``phase`` done by every part: ``record`` (what was decided from their
        results) kept and the next phase begun. 1: done now; 0: the parts were past
        ``phase`` already (the record kept is the earlier one); -1: a part is not done."""
        return int(self._advance(keys=[parts_key(job_id)], args=[phase, record]))

    def remove(self, job_id: str) -> None:
        self.r.delete(parts_key(job_id))
