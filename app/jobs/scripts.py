"""Lua scripts for every job state change, so each is one atomic Redis call.

Values in the job hash are JSON, hence comparisons against ``cjson.decode``d values. The
status sets (``maec:status:<s>``) and an owner's active set move in the same script as
the record, so counts and listings never disagree with the record. Keys derived inside a
script (status sets, active set) assume a single Redis instance, which is the deployment.
"""

from __future__ import annotations

_MOVE = """
local function move(id, from, to, now_ms)
  redis.call('ZREM', 'maec:status:' .. from, id)
  redis.call('ZADD', 'maec:status:' .. to, now_ms, id)
  if to == 'succeeded' or to == 'failed' or to == 'cancelled' then
    local owner = cjson.decode(redis.call('HGET', 'maec:job:' .. id, 'owner'))
    redis.call('SREM', 'maec:active:' .. owner, id)
  end
end
"""

# KEYS: job, owner zset, active set, queued zset, idem key
# ARGV: id, max_active, has_idem, now_ms, field, value, ...
CREATE = """
if ARGV[3] == '1' then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {'existing', existing} end
end
if redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[2]) then return {'too_many', ''} end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
if ARGV[3] == '1' then redis.call('SET', KEYS[5], ARGV[1]) end
return {'created', ARGV[1]}
"""

# KEYS: job. ARGV: id, now_s, lease_until, worker_json, max_attempts, now_iso_json, now_ms,
#       exhausted_error_json, time_limit_s, time_limit_error_json
CLAIM = _MOVE + """
local raw = redis.call('HGET', KEYS[1], 'status')
if not raw then return {'missing', 0} end
local st = cjson.decode(raw)
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts'))
if st == 'running' or st == 'publishing' then
  local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_until'))
  if lease > tonumber(ARGV[2]) then return {'busy', attempts} end
  local began = tonumber(redis.call('HGET', KEYS[1], 'attempt_started') or '0')
  if began > 0 and tonumber(ARGV[2]) - began >= tonumber(ARGV[9]) then
    -- The last attempt ran until the hard time limit killed it: running it again
    -- would only time out again.
    redis.call('HSET', KEYS[1], 'status', '"failed"', 'finished_at', ARGV[6],
               'error', ARGV[10], 'stage', 'null')
    move(ARGV[1], st, 'failed', ARGV[7])
    return {'time_limit', attempts}
  end
elseif st ~= 'queued' then
  return {'done', attempts}
end
if redis.call('HGET', KEYS[1], 'cancel_requested') == 'true' then
  redis.call('HSET', KEYS[1], 'status', '"cancelled"', 'finished_at', ARGV[6],
             'stage', 'null')
  move(ARGV[1], st, 'cancelled', ARGV[7])
  return {'cancelled', attempts}
end
if attempts >= tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[1], 'status', '"failed"', 'finished_at', ARGV[6],
             'error', ARGV[8])
  move(ARGV[1], st, 'failed', ARGV[7])
  return {'exhausted', attempts}
end
attempts = attempts + 1
redis.call('HSET', KEYS[1], 'status', '"running"', 'attempts', tostring(attempts),
           'lease_until', ARGV[3], 'worker', ARGV[4], 'stage', '"fetch"',
           'attempt_started', ARGV[2],
           'progress', '{"fraction":0.0,"done":0,"total":0}')
if redis.call('HGET', KEYS[1], 'started_at') == 'null' then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[6])
end
move(ARGV[1], st, 'running', ARGV[7])
return {'claimed', attempts}
"""

# Progress / lease / report fields of the attempt that owns the job; returns the cancel
# flag (1/0) so the worker learns about a cancel on its next progress write, or -1 when
# the job is no longer this attempt's (a stale worker must stop writing).
# KEYS: job. ARGV: attempt, field, value, ...
UPDATE = """
local raw = redis.call('HGET', KEYS[1], 'status')
if not raw then return -1 end
local st = cjson.decode(raw)
if (st ~= 'running' and st ~= 'publishing')
   or tonumber(redis.call('HGET', KEYS[1], 'attempts')) ~= tonumber(ARGV[1]) then
  return -1
end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
if redis.call('HGET', KEYS[1], 'cancel_requested') == 'true' then return 1 end
return 0
"""

# KEYS: job, metrics hash. ARGV: id, allowed_from (space separated), to, now_ms,
#       expect_attempt ('' = any), n_metrics, metric, incr, ..., field, value, ...
TRANSITION = _MOVE + """
local raw = redis.call('HGET', KEYS[1], 'status')
if not raw then return {'missing', ''} end
local st = cjson.decode(raw)
local allowed = false
for s in string.gmatch(ARGV[2], '%S+') do if s == st then allowed = true end end
if not allowed then return {'conflict', st} end
if ARGV[5] ~= '' and
   tonumber(redis.call('HGET', KEYS[1], 'attempts')) ~= tonumber(ARGV[5]) then
  return {'conflict', st}
end
local n = tonumber(ARGV[6])
local i = 7
for _ = 1, n do
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local fields = {'status', cjson.encode(ARGV[3])}
while i <= #ARGV do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  i = i + 2
end
redis.call('HSET', KEYS[1], unpack(fields))
if st ~= ARGV[3] then move(ARGV[1], st, ARGV[3], ARGV[4]) end
return {'ok', st}
"""

# KEYS: job. ARGV: id, now_iso_json, now_ms
CANCEL = _MOVE + """
local raw = redis.call('HGET', KEYS[1], 'status')
if not raw then return 'missing' end
local st = cjson.decode(raw)
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'status', '"cancelled"', 'cancel_requested', 'true',
             'finished_at', ARGV[2])
  move(ARGV[1], st, 'cancelled', ARGV[3])
  return 'cancelled'
end
if st == 'running' or st == 'publishing' then
  redis.call('HSET', KEYS[1], 'cancel_requested', 'true')
  return 'requested'
end
return 'finished'
"""
