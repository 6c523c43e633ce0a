"""The lock's own Lua scripts, each with its KEYS/ARGV/returns header.

An uncontended cycle costs the server what redis-py's ``Lock`` costs it:
``SET key value NX PX ttl GET`` takes a free key (a plain command, no
script: see ``store.py``), and :data:`RELEASE` is a ``GET``, a compare and
a ``DEL``. Everything else is paid only by whoever needs it:

* a fence, by the holder that reads one (:data:`FENCE`): the key's counter
  exists only then, and its renewals and release then settle it;
* a hand-over or a wake-up, by the releases of keys someone parked or waits
  behind: a waiter appends ``tokens.WAITING`` to the
  holder's value, the release sees it in its ``GET`` and leaves the work to
  :data:`RELEASE_FULL`;
* taking over one's own value after a lost reply, or a queued value
  (:data:`ACQUIRE`), by the rare acquire that finds one.

A key is only ever changed by the holder of its exact value (with the
waiting mark left out), or, for a worker's parent releasing a dead child's
lock, of its owner prefix. Sent as ``EVALSHA``, re-sent as ``EVAL`` after a
``NOSCRIPT`` (:class:`celery_redislock.transport.Script`).
"""

from __future__ import annotations

from celery_redislock.transport import Script

__all__ = [
    "ACQUIRE",
    "ACQUIRE_SCRIPT",
    "FENCE",
    "FENCE_SCRIPT",
    "HAND_OVER",
    "RELEASE",
    "RELEASE_FULL",
    "RELEASE_FULL_SCRIPT",
    "RELEASE_SCRIPT",
    "RENEW",
    "RENEW_SCRIPT",
    "SETTLE_FENCE",
    "WAIT_TRY",
    "WAIT_TRY_SCRIPT",
    "WATCH",
    "WATCH_SCRIPT",
]

# Settles a key's fence counter once a release changed the key (any script
# ending a hold). ``counter_key`` is the counter, ``hold_ms`` how long the
# key stays held (a kept value's or a hand-off's TTL; 0 when freed),
# ``fence_ttl`` how long the counter outlives the hold. A counter exists
# only if a holder read a fence. One the server clock has already passed
# goes with the lock when the key is freed (the default fence TTL is 0):
# every later fence is then at least the clock, larger than every fence
# handed out. One still ahead of the clock (its last fence came from last +
# 1, or the clock stepped back) stays until the clock passes it (+2 ms:
# TIME is in µs, PX in ms). A held key's counter is never shortened.
SETTLE_FENCE = """
local last = redis.call('GET', counter_key)
if last then
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
    local keep = hold_ms + fence_ttl
    if hold_ms > 0 or fence_ttl > 0 then
        keep = math.max(keep, redis.call('PTTL', counter_key))
    end
    local ahead = tonumber(last) - now
    if ahead >= 0 then
        keep = math.max(keep, math.floor(ahead / 1000) + 2)
    end
    if keep > 0 then
        redis.call('PEXPIRE', counter_key, keep)
    else
        redis.call('DEL', counter_key)
    end
end
"""

# Hands a freed key (or slot) to the first parked call: the common end of
# the releases. ``freed`` is the key just freed, ``waiters`` and
# ``parked_hash`` its hand-off keys, ``handoff_ttl`` the TTL of the hand-off
# value. Sets ``handed`` (declared by the caller) to {hand-off value,
# message} when it handed over (``freed`` then holds the hand-off value,
# marked waiting if others are still in line, so that its release hands
# on), else leaves it nil. The
# message stays in the parked hash until a copy of the call is granted: if
# this hold expires unused (the woken message died with its worker), a
# sweep hands the call a slot again (pending.py). ``PTTL`` (-2: no such key)
# before any list command: a release only a waiter marked (no parked call,
# no list) then runs no list or hash command, so the documented base ACL
# (docs/_parts/topologies.md, which has PTTL) is enough for it.
HAND_OVER = """
while redis.call('PTTL', waiters) ~= -2 do
    local waiter = redis.call('LPOP', waiters)
    if not waiter then
        break
    end
    local message = redis.call('HGET', parked_hash, waiter)
    if message then
        local mark = ''
        if redis.call('LLEN', waiters) > 0 then
            mark = '|w'
        end
        redis.call('SET', freed, waiter .. mark, 'PX', handoff_ttl)
        handed = {waiter, message}
        break
    end
end
"""

# KEYS[1] - lock key
# ARGV[1] - the holder's value
# returns 1 if released; 0 if the key was already gone; -1 if another
#         holder's value is there (left alone); 2 if it is ours but someone
#         parked or waits behind it (marked): nothing was done, and the
#         caller releases with RELEASE_FULL, which hands over and wakes.
RELEASE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
    redis.call('DEL', KEYS[1])
    return 1
end
if not current then
    return 0
end
if current == ARGV[1] .. '|w' then
    return 2
end
return -1
"""

# Every release but the plain one: a marked key (hand it to the first
# parked call, wake the waiters), a fenced holder (settle the counter), a
# worker's parent releasing a dead child's lock by owner prefix, a kept
# value, a retry after a lost reply.
#
# KEYS[1] - lock key
# KEYS[2] - its waiters list, KEYS[3] its parked hash (keys.handoff_keys)
# KEYS[4] - its fence counter (keys.fence_key)
# ARGV[1] - the holder's whole value (mode "exact") or an owner prefix
#           (mode "prefix")
# ARGV[2] - "exact" or "prefix"
# ARGV[3] - channel to PUBLISH on when released, if someone waits
# ARGV[4] - '' to delete; otherwise a value to leave in place instead
#           (handing the lock back to a queued retry, or keeping it as an
#           idempotency window after success)
# ARGV[5] - time to live in milliseconds for ARGV[4]
# ARGV[6] - time to live in milliseconds of a lock handed to a parked call
# ARGV[7] - how long the fence counter outlives the hold, in milliseconds
# ARGV[8] - '1' when this is the retry of a release whose reply was lost
# returns 1 if released or handed over (also when the key already holds
#         ARGV[4]: a retried release whose first reply was lost), 3 when
#         ARGV[4] was kept and a parked call or a waiter had marked the key
#         (a sweep hands it over when the kept value expires), 0 if the
#         key was already gone, -1 if another holder's value is there (left
#         alone); {1, hand-off value, message} when it handed the lock to
#         the first call parked on the key (see PARK): the caller publishes
#         that message. A retry that finds a parked call's hand-off value
#         not yet taken up returns its message too: the lost reply was most
#         likely that hand-over, whose message nobody has published.
RELEASE_FULL_SCRIPT = (
    """
local current = redis.call('GET', KEYS[1])
if not current then
    return 0
end
local marked = string.sub(current, -2) == '|w'
if marked then
    current = string.sub(current, 1, -3)
end
if ARGV[4] ~= '' and current == ARGV[4] then
    if marked then
        return 3
    end
    return 1
end
local ours
if ARGV[2] == 'prefix' then
    ours = string.sub(current, 1, string.len(ARGV[1])) == ARGV[1]
else
    ours = current == ARGV[1]
end
if not ours then
    if ARGV[8] == '1' and redis.call('PTTL', KEYS[3]) ~= -2 then
        local message = redis.call('HGET', KEYS[3], current)
        if message then
            return {1, current, message}
        end
    end
    return -1
end
local counter_key, fence_ttl, hold_ms = KEYS[4], tonumber(ARGV[7]), 0
local freed, waiters, parked_hash, handoff_ttl = KEYS[1], KEYS[2], KEYS[3], ARGV[6]
local handed
if ARGV[4] ~= '' then
    -- Kept (marked still: a sweep hands it over when it expires).
    local mark = ''
    if marked then
        mark = '|w'
    end
    redis.call('SET', freed, ARGV[4] .. mark, 'PX', ARGV[5])
    hold_ms = tonumber(ARGV[5])
else
    redis.call('DEL', freed)
    if marked then
"""
    + HAND_OVER
    + """
    end
    if handed then
        hold_ms = tonumber(handoff_ttl)
    end
end
"""
    + SETTLE_FENCE
    + """
if marked then
    redis.call('PUBLISH', ARGV[3], '1')
end
if handed then
    return {1, handed[1], handed[2]}
end
if marked and ARGV[4] ~= '' then
    return 3
end
return 1
"""
)

# KEYS[1]    - lock key
# ARGV[1]    - value to store
# ARGV[2]    - time to live in milliseconds
# ARGV[3..n] - values this caller may take over: the queued value its
#              producer stored at enqueue time, and the values of its own
#              earlier acquires whose replies were lost (a timeout after the
#              command had been sent). Each is replaced by ARGV[1].
# returns {1} when taken: the key was free, or held ARGV[1] (a client retry
#         after a lost reply: TTL refreshed) or one of ARGV[3..n]; a waiting
#         mark stays. {0, holder value, holder PTTL in ms} otherwise.
# The acquire of a free key is SET NX GET, no script; this runs when that
# found one of our values, or on a server without SET NX GET (Redis < 7).
ACQUIRE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
local mark = ''
if current then
    if string.sub(current, -2) == '|w' then
        current, mark = string.sub(current, 1, -3), '|w'
    end
    local ours = current == ARGV[1]
    for i = 3, #ARGV do
        if current == ARGV[i] then
            ours = true
            break
        end
    end
    if not ours then
        return {0, current, redis.call('PTTL', KEYS[1])}
    end
end
redis.call('SET', KEYS[1], ARGV[1] .. mark, 'PX', ARGV[2])
return {1}
"""

# The acquire of a caller that waits for the key (the Wait policy, a
# blocking RedisLock): as ACQUIRE, and when the key is held it marks the
# holder's value, so its release publishes on the key's channel.
#
# KEYS, ARGV and returns as ACQUIRE_SCRIPT.
WAIT_TRY_SCRIPT = """
local current = redis.call('GET', KEYS[1])
local mark = ''
if current then
    if string.sub(current, -2) == '|w' then
        current, mark = string.sub(current, 1, -3), '|w'
    end
    local ours = current == ARGV[1]
    for i = 3, #ARGV do
        if current == ARGV[i] then
            ours = true
            break
        end
    end
    if not ours then
        if mark == '' then
            redis.call('APPEND', KEYS[1], '|w')
        end
        return {0, current, redis.call('PTTL', KEYS[1])}
    end
end
redis.call('SET', KEYS[1], ARGV[1] .. mark, 'PX', ARGV[2])
return {1}
"""

# KEYS[1..n]   - lock keys
# KEYS[n+1..]  - the fence counters of the locks whose holders read a fence,
#                in their order
# ARGV[i]      - the holder's value for KEYS[i]
# ARGV[n+i]    - new time to live in milliseconds for KEYS[i]
# ARGV[2n+i]   - '1' if KEYS[i]'s holder read a fence, else ''
# ARGV[3n+1]   - how long a counter outlives its lock, in milliseconds
# returns one status per lock: 1 renewed, 0 gone, -1 another holder's value.
# It only PEXPIREs a key that still holds our value (a waiting mark left
# out); it never re-creates an expired key, which would hide a gap in which
# someone else may have run. A fenced lock's counter is extended to live at
# least as long (never shortened: it may be kept for a clock it is ahead
# of, or another slot).
RENEW_SCRIPT = """
local n = (#ARGV - 1) / 3
local fence_ttl = tonumber(ARGV[3 * n + 1])
local counter = n
local result = {}
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    local fenced = ARGV[2 * n + i] == '1'
    if fenced then
        counter = counter + 1
    end
    if not current then
        result[i] = 0
    elseif current == ARGV[i] or current == ARGV[i] .. '|w' then
        redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
        if fenced then
            local counter_ttl = tonumber(ARGV[n + i]) + fence_ttl
            if redis.call('PTTL', KEYS[counter]) < counter_ttl then
                redis.call('PEXPIRE', KEYS[counter], counter_ttl)
            end
        end
        result[i] = 1
    else
        result[i] = -1
    end
end
return result
"""

# A fence for the holder that asks (self.lock.fence): issued on demand, so
# a holder that never reads one costs the server nothing for it.
#
# KEYS[1] - the held key (a slot, with lock_limit)
# KEYS[2] - the key's fence counter (keys.fence_key: shared by its slots)
# ARGV[1] - the holder's value
# ARGV[2] - how long the counter outlives the lock, in milliseconds
# returns {1, fence} for the holder: max(last fence + 1, server time in
#         µs), larger than every fence issued for the key before, in any
#         slot; {0} when the key no longer holds ARGV[1] (lost: no fence).
# The counter lives at least as long as the lock (its renewals extend it)
# and until the server clock has passed it (see SETTLE_FENCE), so the next
# fence is larger whether the counter is still there or not. Lua numbers
# are doubles; a microsecond timestamp (~1.8e15) is exact below 2^53.
FENCE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current ~= ARGV[1] and current ~= ARGV[1] .. '|w' then
    return {0}
end
local last = redis.call('GET', KEYS[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local fence = string.format('%.0f', math.max(tonumber(last or '0') + 1, now))
local counter_ttl = math.max(
    redis.call('PTTL', KEYS[1]) + tonumber(ARGV[2]),
    redis.call('PTTL', KEYS[2]),
    math.floor((tonumber(fence) - now) / 1000) + 2)
redis.call('SET', KEYS[2], fence, 'PX', counter_ttl)
return {1, fence}
"""

# Whether a holder of an owner still holds the key (a worker's parent
# waiting for a signalled child's own release); if so, its value is marked
# waited for, so that the release publishes and wakes the parent at once.
#
# KEYS[1..n] - the key's slots (n = 1: the key itself)
# ARGV[1]    - the owner prefix ("v1|<task id>|<attempt>|<node>|<pid>|")
# returns 1 while a slot holds a value of that owner, else 0
WATCH_SCRIPT = """
for i = 1, #KEYS do
    local value = redis.call('GET', KEYS[i])
    if value and string.sub(value, 1, #ARGV[1]) == ARGV[1] then
        if string.sub(value, -2) ~= '|w' then
            redis.call('APPEND', KEYS[i], '|w')
        end
        return 1
    end
end
return 0
"""

FENCE = Script(FENCE_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT)
RELEASE_FULL = Script(RELEASE_FULL_SCRIPT)
RENEW = Script(RENEW_SCRIPT)
ACQUIRE = Script(ACQUIRE_SCRIPT)
WAIT_TRY = Script(WAIT_TRY_SCRIPT)
WATCH = Script(WATCH_SCRIPT)
