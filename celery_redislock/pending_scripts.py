"""The Lua scripts of calls that run later, each with its KEYS/ARGV/returns header.

They run on the pending-call index (one sorted set per app, and its
outbox), on a key's queued run and on the companion keys of one lock key
(the debounce record's own scripts are in ``debounce_scripts.py``);
``pending.py`` says what the index is for.
"""

from __future__ import annotations

from celery_redislock.scripts import SETTLE_FENCE
from celery_redislock.transport import Script

__all__ = [
    "DUE",
    "FORGET_DEBOUNCED",
    "FORGET_QUEUED",
    "OUTBOX_PUT",
    "OUTBOX_TAKE",
    "QUEUE_RUN",
    "REAP_DEBOUNCED",
    "REAP_PARKED",
    "REAP_QUEUED",
    "SETTLE",
    "TOUCH",
    "WITHDRAW_RUN",
]

# Sets ``now``: the server clock in milliseconds. Every time in the index
# is the server's, so workers whose clocks differ agree on what is due.
_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# KEYS[1] - the pending index
# ARGV[1] - member
# ARGV[2] - in how many ms a sweep should look at it
# returns the member's due time (server ms): the earlier of the one it had
#         and now + ARGV[2]. A member a sweep has claimed (its score ends in
#         .5) is always moved, so the sweep sees it was touched.
TOUCH_SCRIPT = (
    _NOW
    + """
local due = now + tonumber(ARGV[2])
local current = redis.call('ZSCORE', KEYS[1], ARGV[1])
if current then
    current = tonumber(current)
    if current <= due and current % 1 == 0 then
        return current
    end
end
redis.call('ZADD', KEYS[1], string.format('%.0f', due), ARGV[1])
return due
"""
)

# KEYS[1] - the pending index
# ARGV[1] - at most this many members
# ARGV[2] - lease in ms: how long another sweep leaves a claimed member alone
# returns {now, claim, member...}: the members due by now, each moved to the
#         claim (now + lease + 0.5 ms: a score no touch ever gives)
DUE_SCRIPT = (
    _NOW
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local claim = string.format('%.1f', now + tonumber(ARGV[2]) + 0.5)
local out = {now, claim}
for _, member in ipairs(due) do
    redis.call('ZADD', KEYS[1], claim, member)
    out[#out + 1] = member
end
return out
"""
)

# KEYS[1] - the pending index
# ARGV[1] - member
# ARGV[2] - the claim it was given (DUE_SCRIPT)
# ARGV[3] - '' to remove it, else in how many ms to look at it again
# returns 1 if changed, 0 if it was touched since the claim (left as it is)
SETTLE_SCRIPT = (
    """
local current = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not current or tonumber(current) ~= tonumber(ARGV[2]) then
    return 0
end
if ARGV[3] == '' then
    redis.call('ZREM', KEYS[1], ARGV[1])
    return 1
end
"""
    + _NOW
    + """
redis.call('ZADD', KEYS[1], string.format('%.0f', now + tonumber(ARGV[3])), ARGV[1])
return 1
"""
)

# Hands a free slot to a parked call whose holder is gone: what the holder's
# release would have done (its process died, or it kept the key for
# lock_hold_after_success and the kept value expired).
#
# KEYS[1..n]   - the key's slots (n = #KEYS - 3)
# KEYS[n+1..2] - its waiters list and parked hash
# KEYS[n+3]    - its fence counter
# ARGV[1]      - time to live in ms of a slot handed to a parked call
# ARGV[2]      - how long the fence counter outlives the hold, in ms
# ARGV[3]      - '1' when this is the retry of a try whose reply was lost
# returns {0} when nothing is parked; {1, ms} when every slot is held (look
#         again when the first frees); {2, slot, hand-off value, message}
#         when a slot was handed over (the caller publishes the message).
#         First served: a call handed a slot earlier whose hold expired
#         before it started (its message died: it is still in the parked
#         hash, no longer in the list, holds no slot), then the list's head.
REAP_PARKED_SCRIPT = (
    """
local n = #KEYS - 3
local waiters, parked_hash = KEYS[n + 1], KEYS[n + 2]
local free, soonest
local holding, tasks = {}, {}
for i = 1, n do
    local value = redis.call('GET', KEYS[i])
    if value then
        if string.sub(value, -2) == '|w' then
            value = string.sub(value, 1, -3)
        end
        holding[value] = true
        tasks[string.match(value, '^v1|[^|]*|') or value] = true
        local pttl = redis.call('PTTL', KEYS[i])
        if pttl < 0 then
            pttl = 60000
        end
        if not soonest or pttl < soonest then
            soonest = pttl
        end
    elseif not free then
        free = i
    end
end
if redis.call('HLEN', parked_hash) == 0 then
    return {0}
end
if not free then
    if ARGV[3] == '1' then
        -- A retry after a lost reply: the first try most likely handed a
        -- slot over, and nobody published its message.
        for i = 1, n do
            local value = redis.call('GET', KEYS[i])
            if value and string.sub(value, -2) == '|w' then
                value = string.sub(value, 1, -3)
            end
            local message = value and redis.call('HGET', parked_hash, value)
            if message then
                return {2, i, value, message}
            end
        end
    end
    return {1, soonest}
end
local handed
local listed = {}
for _, waiter in ipairs(redis.call('LRANGE', waiters, 0, -1)) do
    listed[waiter] = true
end
-- A call whose own task holds a slot waits (one message never runs twice
-- at once): it is skipped, and keeps its place.
local function free_to_run(waiter)
    return not holding[waiter] and not tasks[string.match(waiter, '^v1|[^|]*|') or waiter]
end
for _, waiter in ipairs(redis.call('HKEYS', parked_hash)) do
    if not listed[waiter] and free_to_run(waiter) then
        handed = waiter
        break
    end
end
if not handed then
    for _, waiter in ipairs(redis.call('LRANGE', waiters, 0, -1)) do
        if redis.call('HEXISTS', parked_hash, waiter) == 0 then
            redis.call('LREM', waiters, 1, waiter)
        elseif free_to_run(waiter) then
            handed = waiter
            redis.call('LREM', waiters, 1, waiter)
            break
        end
    end
end
if not handed then
    return {1, soonest or tonumber(ARGV[1])}
end
local mark = ''
if redis.call('LLEN', waiters) > 0 then
    mark = '|w'
end
redis.call('SET', KEYS[free], handed .. mark, 'PX', ARGV[1])
local counter_key, hold_ms, fence_ttl = KEYS[n + 3], tonumber(ARGV[1]), tonumber(ARGV[2])
"""
    + SETTLE_FENCE
    + """
return {2, free, handed, redis.call('HGET', parked_hash, handed)}
"""
)

# Marks a hand-off value as "a copy of it was published": from now on, the
# first copy granted the lock marks it ran, and every other copy is dropped
# (see PARK_SCRIPT). Sets nothing if a copy already ran.
_MARK_COPIED = """
if redis.call('HSETNX', ran, handoff, '?') == 1 and redis.call('PTTL', ran) < ran_ttl then
    redis.call('PEXPIRE', ran, ran_ttl)
end
"""

# How long to wait before publishing copy ``copies + 1`` of a run: ``grace``,
# doubled for every copy already published (a run stuck behind a long
# backlog, not a dead worker, is copied a few times, not every grace), and
# ``false`` after the fifth: the broker's own redelivery is left to it then.
# Sets ``wait``.
_BACKOFF = """
local copies = tonumber(record_copies or '0')
local wait = false
if copies < 5 then
    wait = grace * (2 ^ copies)
end
"""

# A coalesced run published at enqueue time that has not started: its
# worker may have died with the message reserved.
#
# KEYS[1] - the queued key (keys.queued_key)
# KEYS[2] - its run's record (keys.next_run_key): id, token, handoff, msg,
#           due (when a copy is due) and grace, copies
# KEYS[3] - the key's ran hash
# KEYS[4] - the key's parked hash
# ARGV[1] - time to live in ms of the ran hash
# ARGV[2] - the run's task id (the member's)
# returns {0} when the run started or parked (a parked run is the sweep's
#         through the key's parked member), or its record is another run's
#         or gone, or it has had its copies; {1, ms} when not yet due;
#         {2, message} to publish a copy
REAP_QUEUED_SCRIPT = (
    """
local record = redis.call('HMGET', KEYS[2], 'token', 'due', 'handoff', 'msg', 'id', 'grace',
    'copies')
if not record[1] or record[5] ~= ARGV[2] or redis.call('GET', KEYS[1]) ~= record[1]
        or redis.call('HEXISTS', KEYS[4], record[3]) == 1 then
    return {0}
end
"""
    + _NOW
    + """
local due = tonumber(record[2])
if due > now then
    return {1, due - now}
end
local grace, record_copies = tonumber(record[6]), record[7]
"""
    + _BACKOFF
    + """
if not wait then
    return {0}
end
redis.call('HSET', KEYS[2], 'due', string.format('%.0f', now + wait), 'copies', copies + 1)
local ran, handoff, ran_ttl = KEYS[3], record[3], tonumber(ARGV[1])
"""
    + _MARK_COPIED
    + """
return {2, record[4]}
"""
)

# A debounced run whose countdown ended and that has not started: the
# worker holding its countdown message may have died.
#
# KEYS[1] - the debounce record (keys.debounce_key): id, first, due, msg,
#           handoff, not_before (its countdown, if longer than the window),
#           grace and, once a copy was published, next and copies
# KEYS[2] - the key's ran hash
# ARGV[1] - time to live in ms of the ran hash
# returns {0} when the run started (the record is gone, or was written
#         without a message), or it has had its copies; {1, ms} when not
#         yet; {2, message}
REAP_DEBOUNCED_SCRIPT = (
    """
local record = redis.call('HMGET', KEYS[1], 'id', 'due', 'msg', 'handoff', 'next',
    'not_before', 'grace', 'copies')
if not record[1] or not record[3] then
    return {0}
end
"""
    + _NOW
    + """
local grace, record_copies = tonumber(record[7] or '0'), record[8]
local due = math.max(tonumber(record[2]), tonumber(record[6] or '0'))
local at = math.max(due + grace, tonumber(record[5] or '0'))
if at > now then
    return {1, at - now}
end
"""
    + _BACKOFF
    + """
if not wait then
    return {0}
end
redis.call('HSET', KEYS[1], 'next', string.format('%.0f', now + wait), 'copies', copies + 1)
local ran, handoff, ran_ttl = KEYS[2], record[4], tonumber(ARGV[1])
"""
    + _MARK_COPIED
    + """
return {2, record[3]}
"""
)

# KEYS[1] - the pending index; KEYS[2] - the outbox
# ARGV[1] - id; ARGV[2] - message; ARGV[3] - in how many ms to publish it
# ARGV[4] - time to live in ms of the outbox (refreshed)
OUTBOX_PUT_SCRIPT = (
    _NOW
    + """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
redis.call('ZADD', KEYS[1], string.format('%.0f', now + tonumber(ARGV[3])), 'o|' .. ARGV[1])
return 1
"""
)

# Takes a message out of the outbox to publish it (once: a sweep that
# fails to publish it puts it back with OUTBOX_PUT).
#
# KEYS[1] - the pending index; KEYS[2] - the outbox; ARGV[1] - id
# returns the message, or nil if it is gone (another sweep took it)
OUTBOX_TAKE_SCRIPT = """
local message = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], 'o|' .. ARGV[1])
return message
"""

TOUCH = Script(TOUCH_SCRIPT)
DUE = Script(DUE_SCRIPT)
SETTLE = Script(SETTLE_SCRIPT)
REAP_PARKED = Script(REAP_PARKED_SCRIPT)
REAP_QUEUED = Script(REAP_QUEUED_SCRIPT)
REAP_DEBOUNCED = Script(REAP_DEBOUNCED_SCRIPT)
OUTBOX_PUT = Script(OUTBOX_PUT_SCRIPT)
OUTBOX_TAKE = Script(OUTBOX_TAKE_SCRIPT)


# Queues a coalesced run at enqueue time (lock_enqueue="until_start"): takes
# the queued key, as ACQUIRE would, and keeps the run's message beside it,
# for a sweep to publish again if the worker that reserved it dies.
#
# KEYS[1] - the queued key (keys.queued_key)
# KEYS[2] - its run's record (keys.next_run_key)
# ARGV[1] - the run's queued token
# ARGV[2] - time to live in ms of both
# ARGV[3] - the run's hand-off value (marks which copy ran)
# ARGV[4] - the run's message (handoff.pack_signature)
# ARGV[5] - in how many ms a sweep may publish a copy if it has not started
# ARGV[6] - the run's task id
# ARGV[7] - ms between the copies a sweep publishes while it has not started
# ARGV[8] - a queued token to take over (a run revoked in the queue), or ''
# returns {1} when queued (also when the key already holds ARGV[1]: a retry
#         after a lost reply); {0, holder value, holder PTTL in ms} when
#         another run is queued
QUEUE_RUN_SCRIPT = (
    """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] and current ~= ARGV[8] then
    return {0, current, redis.call('PTTL', KEYS[1])}
end
"""
    + _NOW
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'token', ARGV[1], 'handoff', ARGV[3], 'msg', ARGV[4],
    'due', string.format('%.0f', now + tonumber(ARGV[5])), 'id', ARGV[6], 'grace', ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {1}
"""
)

QUEUE_RUN = Script(QUEUE_RUN_SCRIPT)

# Withdraws a coalesced run whose publish failed (QUEUE_RUN undone), unless
# a copy a sweep published has reached a worker: granted (its hand-off value
# marked ran by that copy's tag) or parked. A sweep's claim alone ('?' in
# the ran hash, ``copies`` counted) proves nothing: its publish may have
# failed too; nor does 'withdrawn' (UNPARK: a copy that gave up, revoked).
# The index member is left to the sweep, which drops it (another hash slot).
#
# KEYS[1] - the queued key; KEYS[2] - its run's record (keys.next_run_key)
# KEYS[3] - the key's ran hash; KEYS[4] - the key's parked hash
# ARGV[1] - the run's queued token; ARGV[2] - the run's task id
# ARGV[3] - the run's hand-off value
# returns 1 when a copy runs (nothing changed), else 0
WITHDRAW_RUN_SCRIPT = """
local ran = redis.call('HGET', KEYS[3], ARGV[3])
if (ran and ran ~= '?' and ran ~= 'withdrawn') or redis.call('HEXISTS', KEYS[4], ARGV[3]) == 1 then
    return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
end
if redis.call('HGET', KEYS[2], 'id') == ARGV[2] then
    redis.call('DEL', KEYS[2])
end
return 0
"""

WITHDRAW_RUN = Script(WITHDRAW_RUN_SCRIPT)


# Forgets a coalesced run's member once the run started or parked; sent in
# the same round trip right after the script that may have done either.
# Outside a cluster only: the keys are of two hash slots.
#
# KEYS[1] - the pending index; KEYS[2] - the queued key; KEYS[3] - the
#           key's parked hash
# ARGV[1] - the run's member; ARGV[2] - its queued token; ARGV[3] - its
#           hand-off value
FORGET_QUEUED_SCRIPT = """
if redis.call('GET', KEYS[2]) ~= ARGV[2] or redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then
    redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""

# Forgets a key's debounce member once its run started (the burst's record
# is gone; a new burst's record keeps it). Outside a cluster only, as
# FORGET_QUEUED.
#
# KEYS[1] - the pending index; KEYS[2] - the key's debounce record
# ARGV[1] - the key's debounce member
FORGET_DEBOUNCED_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""

FORGET_QUEUED = Script(FORGET_QUEUED_SCRIPT)
FORGET_DEBOUNCED = Script(FORGET_DEBOUNCED_SCRIPT)
