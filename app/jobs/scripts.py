"""Lua scripts for every job state change, so each is one atomic Redis call.

Each script declares its KEYS and ARGV by name; the body reads them as ``K.<name>`` and
``A.<name>``, and :meth:`Script.pack` lays the values out in the declared order, so the
argument layout is written once, not once in Lua and again in each caller. Key names come
from :mod:`app.jobs.keys`; no script spells a key prefix.

Values in the job hash are JSON, hence comparisons against ``cjson.decode``d values. The
status sets and an owner's active set move in the same script as the record, so counts and
listings never disagree with the record. A script that moves a job between statuses gets
every status set as KEYS and builds the owner's active-set key from the record's owner
(its prefix passed in ARGV, the rest by :data:`app.jobs.keys.LUA_KEYS`, the Lua twin of
the Python key builders): the owner is only known inside the script, which assumes a
single Redis instance, the deployment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from app.jobs.keys import (
    ACTIVE_PREFIX,
    BAND_SPAN,
    LUA_KEYS,
    RECENT_DONE,
    SCHED_PREFIX,
    STATUS_KEYS,
)
from app.jobs.record import STATUSES, TERMINAL

# What redis-py sends as an ARGV entry.
Arg = str | int | float
_LUA_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
# The move helper's arguments beyond a script's own (their names are used in _MOVE).
_MOVE_ARGS = ("active_prefix", "sched_prefix")
_LUA_KEYWORDS = frozenset((
    "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in",
    "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while",
))

_MOVE = "local TERMINAL = {" + ", ".join(f"{s} = true" for s in STATUSES if s in TERMINAL) + f"""}}
local RECENT = {RECENT_DONE}
""" + LUA_KEYS + """
-- Take job ``id`` out of ``owner``'s fair-share queue of ``pool`` (and the owner out of
-- the pool's waiting owners when that queue is left empty).
local function dequeue(pool, owner, id)
  local q = sched_queue_key(pool, owner)
  redis.call('ZREM', q, id)
  if redis.call('ZCARD', q) == 0 then
    redis.call('SREM', sched_owners_key(pool), owner)
  end
end
-- ``job``: the record's key (default K.job). Besides the status sets and the owner's
-- active set, a job leaving ``queued`` leaves its pool's fair-share queue, and a job
-- that succeeded adds its attempt's duration to the recent durations of the pool that
-- ran it (the queue's ETA).
local function move(id, from, to, now_ms, job)
  job = job or K.job
  redis.call('ZREM', SETS[from], id)
  redis.call('ZADD', SETS[to], now_ms, id)
  local owner = cjson.decode(redis.call('HGET', job, 'owner'))
  if TERMINAL[to] then
    redis.call('SREM', active_key(owner), id)
  end
  if from == to then return end
  if from == 'queued' then
    local raw = redis.call('HGET', job, 'pool')
    if raw and raw ~= 'null' then dequeue(cjson.decode(raw), owner, id) end
  end
  if to == 'succeeded' then
    local ran = redis.call('HGET', job, 'ran_pool')
    local began = tonumber(redis.call('HGET', job, 'attempt_started') or '0') or 0
    if ran and ran ~= 'null' and began > 0 then
      local done = sched_done_key(cjson.decode(ran))
      redis.call('LPUSH', done, tostring(now_ms / 1000 - began))
      redis.call('LTRIM', done, 0, RECENT - 1)
    end
  end
end
"""


def _table(names: Sequence[str], array: str, first: int) -> str:
    return "{" + ", ".join(f"{n} = {array}[{first + i}]" for i, n in enumerate(names)) + "}"


@dataclass(frozen=True)
class Script:
    """One Lua script with its KEYS and ARGV named.

    ARGV entries after the named ones (from index ``TAIL``) are the script's variable part,
    e.g. field/value pairs. With ``moves`` the script also gets every status set (``SETS``
    by status name), the active-set and scheduler prefixes and the ``move`` helper.
    """

    name: str
    keys: tuple[str, ...]
    args: tuple[str, ...]
    body: str
    moves: bool = False
    lua: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        names = (*self.keys, *self.args)
        bad = [n for n in names
               if not _LUA_NAME.match(n) or n in _LUA_KEYWORDS or n in _MOVE_ARGS]
        if bad or len(set(self.keys)) != len(self.keys) or len(set(self.args)) != len(
            self.args
        ):
            raise ValueError(f"script {self.name}: bad or repeated names {bad or names}")
        object.__setattr__(self, "lua", self._source())

    def _source(self) -> str:
        args = (*self.args, *_MOVE_ARGS) if self.moves else self.args
        head = [f"local K = {_table(self.keys, 'KEYS', 1)}",
                f"local A = {_table(args, 'ARGV', 1)}",
                f"local TAIL = {len(args) + 1}"]
        if self.moves:
            head.append(f"local SETS = {_table(STATUSES, 'KEYS', len(self.keys) + 1)}")
            head.append(_MOVE)
        return "\n".join(head) + "\n" + self.body

    def pack(self, keys: Mapping[str, str], args: Mapping[str, Arg],
             tail: Sequence[Arg] = ()) -> tuple[list[str], list[Arg]]:
        """KEYS and ARGV in this script's order; every declared name must be given."""
        if keys.keys() != set(self.keys) or args.keys() != set(self.args):
            raise ValueError(f"script {self.name} takes keys {self.keys} and args "
                             f"{self.args}; got {tuple(keys)} and {tuple(args)}")
        packed_keys = [keys[n] for n in self.keys]
        packed_args: list[Arg] = [args[n] for n in self.args]
        if self.moves:
            packed_keys.extend(STATUS_KEYS)
            packed_args.extend((ACTIVE_PREFIX, SCHED_PREFIX))
        packed_args.extend(tail)
        return packed_keys, packed_args


# Tail: field, value, ... of the new record. The job enters its pool's fair-share queue
# (``sched_queue``, scored band * BAND_SPAN + sequence). An owner that had nothing queued
# in the pool starts one round behind the least-served owner already waiting there: level
# with it less ``credit`` of its jobs (the API passes the number of live workers that take
# the pool's jobs), per that owner's weight. So a newcomer is owed up to one job per worker
# before it is level with a key that has had every worker to itself (fair share over the
# recent round, as a usage-decay fair share would give), and a key idle for a week is owed
# no more than that one round: it does not win every tie until it has caught up.
# An idempotency key answers with its earlier job only when that job is this owner's
# (``owner_json``, read from the record, not inferred from the key's name): another
# owner's job there is {'conflict', ''} (its id is not told), and a slot whose job is
# gone is stale and taken over.
CREATE = Script("create", ("job", "owner", "active", "queued", "idem", "sched_queue",
                           "sched_owners", "seq", "served"),
                ("id", "max_active", "has_idem", "now_ms", "owner_name", "owner_json",
                 "job_prefix", "band", "credit", "weights_json"), f"""
local BAND = {BAND_SPAN}
""" + """
if A.has_idem == '1' then
  local existing = redis.call('GET', K.idem)
  if existing then
    local holder = redis.call('HGET', A.job_prefix .. existing, 'owner')
    if holder == A.owner_json then return {'existing', existing} end
    if holder then return {'conflict', ''} end
  end
end
if redis.call('SCARD', K.active) >= tonumber(A.max_active) then return {'too_many', ''} end
redis.call('HSET', K.job, unpack(ARGV, TAIL, #ARGV))
-- band '': a job with no pool (made outside the API), run only by a message naming it.
if A.band ~= '' then
  local seq = redis.call('INCR', K.seq)
  redis.call('HSET', K.job, 'seq', tostring(seq))
  redis.call('ZADD', K.sched_queue, tonumber(A.band) * BAND + seq, A.id)
  local others = redis.call('SMEMBERS', K.sched_owners)
  if redis.call('SADD', K.sched_owners, A.owner_name) == 1 then
    local weights = cjson.decode(A.weights_json)
    local least = nil
    for _, o in ipairs(others) do
      local v = tonumber(redis.call('ZSCORE', K.served, o) or '0')
                - tonumber(A.credit) / (tonumber(weights[o]) or 1)
      if not least or v < least then least = v end
    end
  local mine = tonumber(redis.call('ZSCORE', K.served, A.owner_name) or '0')
    if least and mine < least then redis.call('ZADD', K.served, least, A.owner_name) end
  end
end
redis.call('ZADD', K.owner, 0, A.id)
redis.call('SADD', K.active, A.id)
redis.call('ZADD', K.queued, A.now_ms, A.id)
if A.has_idem == '1' then redis.call('SET', K.idem, A.id) end
return {'created', A.id}
""")

# Values ending in _json (and now_iso) are JSON text, stored as they are.
CLAIM = Script("claim", ("job",),
               ("id", "now_s", "lease_until", "worker_json", "max_attempts", "now_iso",
                "now_ms", "exhausted_error", "time_limit_s", "time_limit_error",
                "pool_json"), """
local raw = redis.call('HGET', K.job, 'status')
if not raw then return {'missing', 0} end
local st = cjson.decode(raw)
local attempts = tonumber(redis.call('HGET', K.job, 'attempts'))
if st == 'running' or st == 'publishing' then
  local lease = tonumber(redis.call('HGET', K.job, 'lease_until'))
  if lease > tonumber(A.now_s) then return {'busy', attempts} end
  local began = tonumber(redis.call('HGET', K.job, 'attempt_started') or '0')
  if began > 0 and tonumber(A.now_s) - began >= tonumber(A.time_limit_s) then
    -- The last attempt ran until the hard time limit killed it: running it again
    -- would only time out again.
    redis.call('HSET', K.job, 'status', '"failed"', 'finished_at', A.now_iso,
               'error', A.time_limit_error, 'stage', 'null')
    move(A.id, st, 'failed', A.now_ms)
    return {'time_limit', attempts}
  end
elseif st ~= 'queued' then
  return {'done', attempts}
end
if redis.call('HGET', K.job, 'cancel_requested') == 'true' then
  redis.call('HSET', K.job, 'status', '"cancelled"', 'finished_at', A.now_iso,
             'stage', 'null')
  move(A.id, st, 'cancelled', A.now_ms)
  return {'cancelled', attempts}
end
if attempts >= tonumber(A.max_attempts) then
  redis.call('HSET', K.job, 'status', '"failed"', 'finished_at', A.now_iso,
             'error', A.exhausted_error)
  move(A.id, st, 'failed', A.now_ms)
  return {'exhausted', attempts}
end
attempts = attempts + 1
redis.call('HSET', K.job, 'status', '"running"', 'attempts', tostring(attempts),
           'lease_until', A.lease_until, 'worker', A.worker_json, 'stage', '"fetch"',
           'attempt_started', A.now_s, 'ran_pool', A.pool_json,
           'progress', '{"fraction":0.0,"done":0,"total":0}')
if redis.call('HGET', K.job, 'started_at') == 'null' then
  redis.call('HSET', K.job, 'started_at', A.now_iso)
end
move(A.id, st, 'running', A.now_ms)
return {'claimed', attempts}
""", moves=True)

# A free worker takes the next job: the fair-share choice and the claim in one atomic
# call, so no job is ever popped and then lost (a worker killed after this call holds a
# lease that expires; one killed before it took nothing). ``pools_json``: the pools'
# queues to look in, in order (the wake-up message's pool, the worker's own, then those
# it covers); the first with a queued job decides. Within a pool: the highest priority
# band, then (policy ``fair``) the owner with the least running work per weight (a sweep
# counts its candidates; a split job one more for each other worker running one of its
# parts, ``parts_prefix``; a job that ended still holds its worker until that worker
# takes the next, up to ``hold_ms``), ties to the least served, then the owner's oldest
# job; (``fifo``) the oldest job (see ``choose`` for how the pools combine). Returns
# {'claimed', id, attempt, pool}, {'exhausted', id, n, pool} (a requeued job out of
# attempts, now failed) or {'empty', '', 0, ''}; ``pool``: the queue the job came from.
TAKE = Script("take", ("served", "holds"),
              ("pools_json", "policy", "weights_json", "now_s", "lease_until", "worker_json",
               "max_attempts", "now_iso", "now_ms", "exhausted_error", "job_prefix",
               "pool_json", "hold_ms", "parts_prefix"), f"""
local BAND = {BAND_SPAN}
""" + """
local weights = cjson.decode(A.weights_json)
local function weight(o) return tonumber(weights[o]) or 1 end
local me = cjson.decode(A.worker_json)
local load = nil
-- The workers running a split job's parts beside its own (app.jobs.parts): each part
-- running under a live lease on another worker than the job's holds one more worker.
local function helpers(id, coordinator)
  local key = A.parts_prefix .. id
  local owners, n = {}, 0
  for i = 0, (tonumber(redis.call('HGET', key, 'n') or '0') or 0) - 1 do
    local raw = redis.call('HGET', key, 'p' .. i)
    local e = raw and cjson.decode(raw)
    if e and e.state == 'running' and tonumber(e.lease_until) >= tonumber(A.now_s)
       and e.owner ~= coordinator and not owners[e.owner] then
      owners[e.owner] = true
      n = n + 1
    end
  end
  return n
end
local function add(id, running)
  local f = redis.call('HMGET', A.job_prefix .. id, 'owner', 'cost', 'worker')
  if f[1] then
    local o = cjson.decode(f[1])
    local n = tonumber(f[2]) or 1
    if running and f[3] then n = n + helpers(id, cjson.decode(f[3])) end
    load[o] = (load[o] or 0) + n
  end
end
local function loads()
  if load then return load end
  load = {}
  for _, st in ipairs({'running', 'publishing'}) do
    for _, id in ipairs(redis.call('ZRANGE', SETS[st], 0, -1)) do add(id, true) end
  end
  -- Other workers' jobs that ended (still running ones are counted above): each holds
  -- its worker until that worker takes again, or for hold_ms.
  local held = redis.call('HGETALL', K.holds)
  for i = 1, #held, 2 do
    local w, id = held[i], held[i + 1]
    if w ~= me then
      local raw = redis.call('HGET', A.job_prefix .. id, 'status')
      local st = raw and cjson.decode(raw)
      if st and TERMINAL[st] then
        local ended = tonumber(redis.call('ZSCORE', SETS[st], id) or '0')
        if tonumber(A.now_ms) - ended <= tonumber(A.hold_ms) then add(id, false)
        else redis.call('HDEL', K.holds, w) end
      elseif not st then
        redis.call('HDEL', K.holds, w)
      end
    end
  end
  return load
end
local function less(a, b)
  for i = 1, #a do
    if a[i] ~= b[i] then return a[i] < b[i] end
  end
  return false
end
local pools = cjson.decode(A.pools_json)
-- The next job as {pool, owner, id}, or nil. fifo: the first pool in order with a queued
-- job, its oldest. fair: across every pool this worker serves, the owner by band, then
-- running work per weight, then service; of that owner's jobs, the first pool in order
-- (the message's, the worker's own, then the covered ones), then the oldest. So a large
-- worker gives a key that is owed a turn a small job rather than the next large job of
-- a key that already has its share, and within one key still prefers the jobs that only
-- it can run.
local function choose()
  local best, pick = nil, nil
  for pi, pool in ipairs(pools) do
    local okey = sched_owners_key(pool)
    for _, o in ipairs(redis.call('SMEMBERS', okey)) do
      local head = redis.call('ZRANGE', sched_queue_key(pool, o), 0, 0, 'WITHSCORES')
      if #head == 0 then
        redis.call('SREM', okey, o)
      else
        local score = tonumber(head[2])
        local rank
        if A.policy == 'fifo' then
          rank = {pi, score % BAND}
        else
          rank = {math.floor(score / BAND), (loads()[o] or 0) / weight(o),
                  tonumber(redis.call('ZSCORE', K.served, o) or '0'), pi, score}
        end
        if not best or less(rank, best) then best, pick = rank, {pool, o, head[1]} end
      end
    end
  end
  return pick
end
while true do
  local pick = choose()
  if not pick then break end
  local pool, owner, id = pick[1], pick[2], pick[3]
  local job = A.job_prefix .. id
  local raw = redis.call('HGET', job, 'status')
  if not raw or cjson.decode(raw) ~= 'queued' then
    -- A stale entry (its record gone): drop it and choose again.
    dequeue(pool, owner, id)
  else
    local attempts = tonumber(redis.call('HGET', job, 'attempts')) or 0
    if attempts >= tonumber(A.max_attempts) then
      redis.call('HSET', job, 'status', '"failed"', 'finished_at', A.now_iso,
                 'error', A.exhausted_error)
      move(id, 'queued', 'failed', A.now_ms, job)
      return {'exhausted', id, attempts, pool}
    end
    attempts = attempts + 1
    redis.call('HSET', job, 'status', '"running"', 'attempts', tostring(attempts),
               'lease_until', A.lease_until, 'worker', A.worker_json, 'stage', '"fetch"',
               'attempt_started', A.now_s, 'ran_pool', A.pool_json,
               'progress', '{"fraction":0.0,"done":0,"total":0}')
    if redis.call('HGET', job, 'started_at') == 'null' then
      redis.call('HSET', job, 'started_at', A.now_iso)
    end
    move(id, 'queued', 'running', A.now_ms, job)
    local cost = tonumber(redis.call('HGET', job, 'cost') or '1') or 1
    redis.call('ZINCRBY', K.served, cost / weight(owner), owner)
    redis.call('HSET', K.holds, me, id)
    return {'claimed', id, attempts, pool}
  end
end
return {'empty', '', 0, ''}
""", moves=True)

# Progress / lease / report fields of the attempt that owns the job; returns the cancel
# flag (1/0) so the worker learns about a cancel on its next progress write, or -1 when
# the job is no longer this attempt's (a stale worker must stop writing).
# Tail: field, value, ...
UPDATE = Script("update", ("job",), ("attempt",), """
local raw = redis.call('HGET', K.job, 'status')
if not raw then return -1 end
local st = cjson.decode(raw)
if (st ~= 'running' and st ~= 'publishing')
   or tonumber(redis.call('HGET', K.job, 'attempts')) ~= tonumber(A.attempt) then
  return -1
end
if #ARGV >= TAIL then redis.call('HSET', K.job, unpack(ARGV, TAIL, #ARGV)) end
if redis.call('HGET', K.job, 'cancel_requested') == 'true' then return 1 end
return 0
""")

# allowed: space-separated statuses; attempt: '' for any. Tail: n_metrics pairs of
# (metric, increment), then field, value, ...
TRANSITION = Script("transition", ("job", "metrics"),
                    ("id", "allowed", "to", "now_ms", "attempt", "n_metrics"), """
local raw = redis.call('HGET', K.job, 'status')
if not raw then return {'missing', ''} end
local st = cjson.decode(raw)
local allowed = false
for s in string.gmatch(A.allowed, '%S+') do if s == st then allowed = true end end
if not allowed then return {'conflict', st} end
if A.attempt ~= '' and
   tonumber(redis.call('HGET', K.job, 'attempts')) ~= tonumber(A.attempt) then
  return {'conflict', st}
end
local i = TAIL
for _ = 1, tonumber(A.n_metrics) do
  redis.call('HINCRBYFLOAT', K.metrics, ARGV[i], ARGV[i + 1])
  i = i + 2
end
local fields = {'status', cjson.encode(A.to)}
while i <= #ARGV do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  i = i + 2
end
redis.call('HSET', K.job, unpack(fields))
if st ~= A.to then move(A.id, st, A.to, A.now_ms) end
return {'ok', st}
""", moves=True)

CANCEL = Script("cancel", ("job",), ("id", "now_iso", "now_ms"), """
local raw = redis.call('HGET', K.job, 'status')
if not raw then return 'missing' end
local st = cjson.decode(raw)
if st == 'queued' then
  redis.call('HSET', K.job, 'status', '"cancelled"', 'cancel_requested', 'true',
             'finished_at', A.now_iso)
  move(A.id, st, 'cancelled', A.now_ms)
  return 'cancelled'
end
if st == 'running' or st == 'publishing' then
  redis.call('HSET', K.job, 'cancel_requested', 'true')
  return 'requested'
end
return 'finished'
""", moves=True)

# Retention: set or clear the pinned flag (owner only); returns 1, or 0 when the job is
# missing or another owner's.
PIN = Script("pin", ("job",), ("owner_json", "value"), """
local owner = redis.call('HGET', K.job, 'owner')
if not owner or owner ~= A.owner_json then return 0 end
redis.call('HSET', K.job, 'pinned', A.value)
return 1
""")

# Drop one artifact reference of a job; an artifact left without any becomes a collection
# candidate from now. A local function, prepended to the scripts that release references.
_RELEASE_REFS = """
local function release_refs(id, refs_prefix, unreferenced, now_ms)
  local raw = redis.call('HGET', K.job, 'artifact_keys')
  if not raw then return end
  for _, key in ipairs(cjson.decode(raw)) do
    redis.call('SREM', refs_prefix .. key, id)
    if redis.call('SCARD', refs_prefix .. key) == 0 then
      redis.call('ZADD', unreferenced, now_ms, key)
    end
  end
end
"""

# Before publishing: count ``bytes`` of outputs against the owner's quota and reference the
# artifacts (tail: artifact keys) in place of whatever this job held before (an earlier
# attempt's reservation), unless that takes the owner past ``quota``. ``bytes`` 0 with no
# keys releases the job's reservation (a failed or cancelled attempt). Returns
# {'ok', usage after} / {'over', usage without this job} / {'lost', 0}.
RESERVE = Script("reserve", ("job", "usage", "unreferenced"),
                 ("id", "attempt", "bytes", "quota", "refs_prefix", "now_ms"),
                 _RELEASE_REFS + """
local raw = redis.call('HGET', K.job, 'status')
if not raw then return {'lost', 0} end
local st = cjson.decode(raw)
if (st ~= 'running' and st ~= 'publishing')
   or tonumber(redis.call('HGET', K.job, 'attempts')) ~= tonumber(A.attempt) then
  return {'lost', 0}
end
local old = tonumber(redis.call('HGET', K.job, 'published_bytes') or '0')
local used = tonumber(redis.call('GET', K.usage) or '0')
local delta = tonumber(A.bytes) - old
if delta > 0 and used + delta > tonumber(A.quota) then return {'over', used - old} end
release_refs(A.id, A.refs_prefix, K.unreferenced, A.now_ms)
local keys = {}
for i = TAIL, #ARGV do
  redis.call('SADD', A.refs_prefix .. ARGV[i], A.id)
  redis.call('ZREM', K.unreferenced, ARGV[i])
  keys[#keys + 1] = ARGV[i]
end
if delta ~= 0 and redis.call('INCRBY', K.usage, delta) <= 0 then
  redis.call('DEL', K.usage)
end
-- cjson writes an empty table as {}; the record's field is a list.
local listed = '[]'
if #keys > 0 then listed = cjson.encode(keys) end
redis.call('HSET', K.job, 'published_bytes', A.bytes, 'artifact_keys', listed)
return {'ok', used + delta}
""")

# Delete a finished job's record and every index entry (owner list, status set,
# idempotency key, requeue marker, a split job's parts if its end left them), give its
# bytes back to the owner's quota, drop its artifact references and queue its storage
# ``prefix`` for deletion (the orphans set, which the workers retry while the store is
# down). ``mode`` 'expire' spares a pinned job and one that ended after ``cutoff_ms``.
# Returns {outcome, bytes released}; outcome is removed, missing, active (queued or
# running: cancel it first), pinned or kept.
REMOVE = Script("remove", ("job", "owner", "idem", "usage", "unreferenced", "orphans",
                           "requeue", "parts"),
                ("id", "mode", "cutoff_ms", "refs_prefix", "prefix", "now_ms"),
                _RELEASE_REFS + """
local raw = redis.call('HGET', K.job, 'status')
if not raw then return {'missing', 0} end
local st = cjson.decode(raw)
if not TERMINAL[st] then return {'active', 0} end
if A.mode == 'expire' then
  if redis.call('HGET', K.job, 'pinned') == 'true' then return {'pinned', 0} end
  local since = redis.call('ZSCORE', SETS[st], A.id)
  if since and tonumber(since) > tonumber(A.cutoff_ms) then return {'kept', 0} end
end
local bytes = tonumber(redis.call('HGET', K.job, 'published_bytes') or '0')
release_refs(A.id, A.refs_prefix, K.unreferenced, A.now_ms)
if bytes > 0 and redis.call('DECRBY', K.usage, bytes) <= 0 then
  redis.call('DEL', K.usage)
end
if redis.call('GET', K.idem) == A.id then redis.call('DEL', K.idem) end
redis.call('ZREM', K.owner, A.id)
redis.call('ZREM', SETS[st], A.id)
redis.call('DEL', K.job, K.requeue, K.parts)
redis.call('SADD', K.orphans, A.prefix)
return {'removed', bytes}
""", moves=True)

# An artifact was stored or read: if no job references it, its grace period restarts.
TOUCH_ARTIFACT = Script("touch_artifact", ("unreferenced",),
                        ("key", "refs_prefix", "now_ms"), """
if redis.call('SCARD', A.refs_prefix .. A.key) == 0 then
  redis.call('ZADD', K.unreferenced, A.now_ms, A.key)
end
return 0
""")

# Take an artifact off the candidates for collection: 1 when it may be deleted now (no
# reference, unreferenced since before ``cutoff_ms``); a referenced one just leaves the
# candidates.
COLLECT_ARTIFACT = Script("collect_artifact", ("unreferenced",),
                          ("key", "refs_prefix", "cutoff_ms"), """
local since = redis.call('ZSCORE', K.unreferenced, A.key)
if not since then return 0 end
if redis.call('SCARD', A.refs_prefix .. A.key) > 0 then
  redis.call('ZREM', K.unreferenced, A.key)
  return 0
end
if tonumber(since) > tonumber(A.cutoff_ms) then return 0 end
redis.call('ZREM', K.unreferenced, A.key)
return 1
""")

ALL: tuple[Script, ...] = (CREATE, CLAIM, TAKE, UPDATE, TRANSITION, CANCEL, PIN, RESERVE, REMOVE,
                           TOUCH_ARTIFACT, COLLECT_ARTIFACT)
