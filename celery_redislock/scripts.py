"""The Lua scripts of the lock, each with its KEYS/ARGV/returns header.

Every lock operation is one of these, sent as one ``EVALSHA`` (re-sent as
``EVAL`` after a ``NOSCRIPT``: see :class:`celery_redislock.transport.Script`).
They are the only code that changes a lock key, so the lock's guarantees are
read here: a key is only ever changed by the holder of its exact value (or,
for a worker's parent releasing a dead child's lock, of its owner prefix).
"""

from __future__ import annotations

from celery_redislock.transport import Script

__all__ = [
    "ACQUIRE",
    "ACQUIRE_SCRIPT",
    "DEBOUNCE",
    "DEBOUNCE_DUE",
    "DEBOUNCE_DUE_SCRIPT",
    "DEBOUNCE_SCRIPT",
    "PARK",
    "PARK_SCRIPT",
    "RELEASE",
    "RELEASE_SCRIPT",
    "RENEW",
    "RENEW_SCRIPT",
]


# Takes the lock: the common end of ACQUIRE and PARK. ``current`` is the
# value found in KEYS[1] (false if none); KEYS[2] is the fence counter,
# ARGV[1..3] the value, its TTL and the counter's TTL. Sets ``fence``.
_TAKE = """
local fence = redis.call('GET', KEYS[2])
if not current or not fence then
    local now = redis.call('TIME')
    local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
    fence = string.format('%.0f', math.max(tonumber(fence or '0') + 1, micros))
end
local counter_ttl = math.max(tonumber(ARGV[3]), tonumber(ARGV[2]))
redis.call('SET', KEYS[2], fence, 'PX', counter_ttl)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
"""

# KEYS[1]    - lock key
# KEYS[2]    - fence counter of this key (same hash slot: see fence_key)
# ARGV[1]    - value to store (see tokens.py)
# ARGV[2]    - time to live in milliseconds
# ARGV[3]    - time to live of the fence counter in milliseconds
# ARGV[4..n] - values this caller may take over: the queued value its
#              producer stored at enqueue time, and the values of its own
#              earlier acquires whose replies were lost (a timeout after the
#              script had been sent). Each is replaced by ARGV[1].
# returns {1, fence} when the lock was taken (a new fence), when the key
#         already holds ARGV[1] (a client retry after a lost reply: still
#         ours, TTL refreshed, same fence) or one of ARGV[4..n] (same fence
#         as that holder); {0, holder value, holder PTTL in ms} otherwise.
# The fence is max(last fence + 1, server time in microseconds): it keeps
# increasing after a restart that lost the counter, and the counter key
# expires, so no key is left behind for ever. Lua numbers are doubles; a
# microsecond timestamp (~1.8e15) is exact below 2^53.
ACQUIRE_SCRIPT = (
    """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then
    local ours = false
    for i = 4, #ARGV do
        if current == ARGV[i] then
            ours = true
            break
        end
    end
    if not ours then
        return {0, current, redis.call('PTTL', KEYS[1])}
    end
end
"""
    + _TAKE
    + """
return {1, fence}
"""
)

# KEYS[1] - lock key
# KEYS[2] - its waiters list, KEYS[3] its parked hash, KEYS[4] its parking
#           flag (see keys.handoff_keys): the list and hash are only read
#           when the flag is set
# ARGV[1] - the holder's whole value (mode "exact") or an owner prefix
#           (mode "prefix", used by a worker's parent for a dead child)
# ARGV[2] - "exact" or "prefix"
# ARGV[3] - channel to PUBLISH on when released, to wake waiters
# ARGV[4] - '' to delete; otherwise a value to leave in place instead
#           (handing the lock back to a queued retry, or keeping it as an
#           idempotency window after success)
# ARGV[5] - time to live in milliseconds for ARGV[4]
# ARGV[6] - time to live in milliseconds of a lock handed to a parked
#           execution (how long its message has to start)
# returns 1 if released or handed over (also when the key already holds
#         ARGV[4]: a retried release whose first reply was lost), 0 if the
#         key was already gone, -1 if another holder's value is there (it is
#         left alone); {1, hand-off value, message} when, instead of
#         deleting, it handed the lock to the first execution parked on the
#         key (see PARK): the caller publishes that message. Entries of
#         parked executions that already ran are dropped on the way.
RELEASE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if not current then
    return 0
end
if ARGV[4] ~= '' and current == ARGV[4] then
    return 1
end
local ours
if ARGV[2] == 'prefix' then
    ours = string.sub(current, 1, string.len(ARGV[1])) == ARGV[1]
else
    ours = current == ARGV[1]
end
if not ours then
    return -1
end
if ARGV[4] ~= '' then
    redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
    redis.call('PUBLISH', ARGV[3], '1')
    return 1
end
if redis.call('GET', KEYS[4]) then
    while true do
        local waiter = redis.call('LPOP', KEYS[2])
        if not waiter then
            redis.call('DEL', KEYS[4])
            break
        end
        local message = redis.call('HGET', KEYS[3], waiter)
        if message then
            redis.call('HDEL', KEYS[3], waiter)
            redis.call('SET', KEYS[1], waiter, 'PX', ARGV[6])
            redis.call('PUBLISH', ARGV[3], '1')
            return {1, waiter, message}
        end
    end
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], '1')
return 1
"""

# KEYS[1..n] - lock keys
# ARGV[i]    - the holder's value for KEYS[i]
# ARGV[n+i]  - new time to live in milliseconds for KEYS[i]
# returns one status per key: 1 renewed, 0 gone, -1 another holder's value.
# It only PEXPIREs a key that still holds our value; it never re-creates an
# expired key, which would hide a gap in which someone else may have run.
RENEW_SCRIPT = """
local n = #KEYS
local result = {}
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    if not current then
        result[i] = 0
    elseif current == ARGV[i] then
        redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
        result[i] = 1
    else
        result[i] = -1
    end
end
return result
"""

# KEYS[1]    - lock key
# KEYS[2]    - fence counter of this key
# KEYS[3..6] - its waiters list, parked hash, ran hash and parking flag
#              (keys.handoff_keys)
# KEYS[7]    - its queued key (keys.queued_key), for a coalesced run
# ARGV[1..3] - value, its TTL in ms, the fence counter's TTL in ms (as ACQUIRE)
# ARGV[4]    - this execution's hand-off value ('' if it never parked): the
#              value a release leaves in KEYS[1] to hand the lock to it
# ARGV[5]    - tag of this copy of the parked execution (its woken message
#              and each safety-net re-send have their own)
# ARGV[6]    - the message to publish when the lock is handed to it; ''
#              means do not park (only try)
# ARGV[7]    - time to live in ms of the waiters, parked and ran keys, and
#              of the queued key while its run is parked
# ARGV[8]    - this execution's value in KEYS[7] ('' if none): freed when
#              the lock is granted, kept alive while parked
# ARGV[9..n] - values to take over, as ACQUIRE's ARGV[4..n]
# returns {1, fence} when granted (as ACQUIRE; the hand-off value is marked
#         as ran by this copy and leaves the queue); {0, holder value,
#         holder PTTL, parked} when held by another (parked = 1 once its
#         hand-off value is queued behind the holder, at most once); {2}
#         when another copy of this hand-off value was already granted (a
#         redelivery of the granted copy itself is not refused).
PARK_SCRIPT = (
    """
if ARGV[4] ~= '' then
    local ran = redis.call('HGET', KEYS[5], ARGV[4])
    if ran and ran ~= ARGV[5] then
        return {2}
    end
end
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] and current ~= ARGV[4] then
    local ours = false
    for i = 9, #ARGV do
        if current == ARGV[i] then
            ours = true
            break
        end
    end
    if not ours then
        local parked = 0
        if ARGV[6] ~= '' then
            if redis.call('HSETNX', KEYS[4], ARGV[4], ARGV[6]) == 1 then
                redis.call('RPUSH', KEYS[3], ARGV[4])
            end
            redis.call('PEXPIRE', KEYS[3], ARGV[7])
            redis.call('PEXPIRE', KEYS[4], ARGV[7])
            redis.call('SET', KEYS[6], '1', 'PX', ARGV[7])
            if ARGV[8] ~= '' and redis.call('GET', KEYS[7]) == ARGV[8] then
                redis.call('PEXPIRE', KEYS[7], ARGV[7])
            end
            parked = 1
        end
        return {0, current, redis.call('PTTL', KEYS[1]), parked}
    end
end
"""
    + _TAKE
    + """
if ARGV[4] ~= '' then
    redis.call('HSET', KEYS[5], ARGV[4], ARGV[5])
    redis.call('PEXPIRE', KEYS[5], ARGV[7])
    if redis.call('HDEL', KEYS[4], ARGV[4]) == 1 then
        redis.call('LREM', KEYS[3], 0, ARGV[4])
    end
end
if ARGV[8] ~= '' and redis.call('GET', KEYS[7]) == ARGV[8] then
    redis.call('DEL', KEYS[7])
end
return {1, fence}
"""
)

# KEYS[1] - a key's debounce record (keys.debounce_key): a hash with the
#           burst's task id, its first call and its due time (server ms)
# ARGV[1] - task id for a new burst
# ARGV[2] - window in ms (the run is due this long after the last call)
# ARGV[3] - longest delay in ms from a burst's first call to its run
# ARGV[4] - time to live in ms of the record
# returns {1, ARGV[1], window} for a new burst (the caller publishes it with
#         that countdown), {0, burst task id, ms until due} for a call that
#         joins the burst in progress (it moves the due time, up to the cap)
DEBOUNCE_SCRIPT = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local id = redis.call('HGET', KEYS[1], 'id')
if id then
    local first = tonumber(redis.call('HGET', KEYS[1], 'first'))
    local due = math.min(now_ms + tonumber(ARGV[2]), first + tonumber(ARGV[3]))
    redis.call('HSET', KEYS[1], 'due', string.format('%.0f', due))
    return {0, id, math.max(due - now_ms, 0)}
end
local due = now_ms + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'first', string.format('%.0f', now_ms),
    'due', string.format('%.0f', due))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, ARGV[1], tonumber(ARGV[2])}
"""

# KEYS[1] - a key's debounce record
# ARGV[1] - the task id of a run that is due (its countdown ended)
# ARGV[2] - '1' to only forget the burst (its message was never published)
# returns 0 when the run should start now (the record is gone, so the next
#         call starts a new burst), the ms still to wait when a later call
#         moved the due time, -1 when the record is not this task's (gone:
#         a store that lost it, or a second delivery): run now.
DEBOUNCE_DUE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then
    return -1
end
if ARGV[2] ~= '1' then
    local now = redis.call('TIME')
    local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    local due = tonumber(redis.call('HGET', KEYS[1], 'due'))
    if due > now_ms then
        return due - now_ms
    end
end
redis.call('DEL', KEYS[1])
return 0
"""


ACQUIRE = Script(ACQUIRE_SCRIPT)
DEBOUNCE = Script(DEBOUNCE_SCRIPT)
DEBOUNCE_DUE = Script(DEBOUNCE_DUE_SCRIPT)
PARK = Script(PARK_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT)
RENEW = Script(RENEW_SCRIPT)
