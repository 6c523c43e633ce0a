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
    "ACQUIRE_SLOT",
    "ACQUIRE_SLOT_SCRIPT",
    "DEBOUNCE",
    "DEBOUNCE_DUE",
    "DEBOUNCE_DUE_SCRIPT",
    "DEBOUNCE_SCRIPT",
    "PARK",
    "PARK_SCRIPT",
    "RELEASE",
    "RELEASE_SCRIPT",
    "RELEASE_SLOTS",
    "RELEASE_SLOTS_SCRIPT",
    "RENEW",
    "RENEW_SCRIPT",
    "SETTLE_FENCE",
    "UNPARK",
    "UNPARK_SCRIPT",
]


# Takes the lock: the common end of ACQUIRE, PARK and ACQUIRE_SLOT.
# ``lock_key`` is the key taken, ``current`` the value found in it (false if
# none), ``counter_key`` the fence counter; ARGV[1..3] the value, its TTL and
# the fence TTL (how long the counter outlives the hold; 0 by default). Sets
# ``fence``.
#
# The fence is max(last fence + 1, server time in µs). The counter exists
# for as long as the key is held (it has the lock's TTL, is renewed with it,
# and is never shortened here: another slot's holder may need it longer)
# and at least until the server clock has passed the fence, so the next
# fence is larger than this one whether the counter is still there or not
# (see _SETTLE).
_TAKE = """
local last = redis.call('GET', counter_key)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local fence = last
if not current or not last then
    fence = string.format('%.0f', math.max(tonumber(last or '0') + 1, now))
end
local counter_ttl = math.max(
    tonumber(ARGV[2]) + tonumber(ARGV[3]),
    redis.call('PTTL', counter_key),
    math.floor((tonumber(fence) - now) / 1000) + 2)
-- The lock first: the clock may tick between the two SETs, and the
-- counter must not expire before the lock it belongs to.
redis.call('SET', lock_key, ARGV[1], 'PX', ARGV[2])
redis.call('SET', counter_key, fence, 'PX', counter_ttl)
"""

# Settles a key's fence counter once a release has changed the key: the
# common end of RELEASE, RELEASE_SLOTS and UNPARK. ``counter_key`` is the
# counter, ``hold_ms`` how long the key stays held (a kept value's or a
# hand-off's TTL; 0 when freed), ``fence_ttl`` how long the counter outlives
# the hold. A counter the server clock has already passed goes with the
# lock when the key is freed (the default fence TTL is 0): every later
# fence is then at least the clock, larger than every fence handed out. One
# still ahead of the clock (its last fence came from last + 1, or the clock
# stepped back) stays until the clock passes it (+2 ms: TIME is in µs, PX in
# ms). A held key's counter is never shortened.
_SETTLE = """
local last = redis.call('GET', counter_key)
if last then
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
    local keep = hold_ms + fence_ttl
    if hold_ms > 0 or fence_ttl > 0 then
        -- Never shortened: another slot of the key may still be held, and
        -- a fence TTL promises at least that long after the release.
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

#: The fence-settling step for scripts in other modules (``pending.py``).
SETTLE_FENCE = _SETTLE

# Hands a freed key to the first parked call: the common end of RELEASE and
# RELEASE_SLOTS. ``freed`` is the key just released, ``waiters``,
# ``parked_hash`` and ``parking`` its hand-off keys, ``handoff_ttl`` the TTL
# of the hand-off value. Reads only the ``parking`` flag when nothing is
# parked. Sets ``handed`` to {hand-off value, message} when it handed over
# (``freed`` then holds the hand-off value), else leaves it nil.
_HAND_OVER = """
local handed
if redis.call('GET', parking) then
    while true do
        local waiter = redis.call('LPOP', waiters)
        if not waiter then
            redis.call('DEL', parking)
            break
        end
        local message = redis.call('HGET', parked_hash, waiter)
        if message then
            -- The message stays until a copy of the call is granted: if
            -- this hold expires unused (the woken message died with its
            -- worker), a sweep hands the call a slot again (pending.py).
            redis.call('SET', freed, waiter, 'PX', handoff_ttl)
            handed = {waiter, message}
            break
        end
    end
end
"""

# KEYS[1]    - lock key
# KEYS[2]    - fence counter of this key (same hash slot: see fence_key)
# ARGV[1]    - value to store (see tokens.py)
# ARGV[2]    - time to live in milliseconds
# ARGV[3]    - how long the fence counter outlives the lock, in
#              milliseconds (redislock_fence_ttl; 0 by default)
# ARGV[4..n] - values this caller may take over: the queued value its
#              producer stored at enqueue time, and the values of its own
#              earlier acquires whose replies were lost (a timeout after the
#              script had been sent). Each is replaced by ARGV[1].
# returns {1, fence} when the lock was taken (a new fence), when the key
#         already holds ARGV[1] (a client retry after a lost reply: still
#         ours, TTL refreshed, same fence) or one of ARGV[4..n] (same fence
#         as that holder); {0, holder value, holder PTTL in ms} otherwise.
# The fence is max(last fence + 1, server time in microseconds) (see
# _TAKE): it keeps increasing after a restart that lost the counter, and
# the counter goes with the lock, so a released key leaves nothing behind.
# Lua numbers are doubles; a microsecond timestamp (~1.8e15) is exact below
# 2^53.
ACQUIRE_SCRIPT = (
    """
local lock_key, counter_key = KEYS[1], KEYS[2]
local current = redis.call('GET', lock_key)
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
# KEYS[5] - its fence counter (keys.fence_key)
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
# ARGV[7] - how long the fence counter outlives the hold, in milliseconds
#           (0: a freed key's counter goes with it unless it is still ahead
#           of the server clock; see _SETTLE)
# ARGV[8] - '1' when this is the retry of a release whose reply was lost
# returns 1 if released or handed over (also when the key already holds
#         ARGV[4]: a retried release whose first reply was lost), 0 if the
#         key was already gone, -1 if another holder's value is there (it is
#         left alone); {1, hand-off value, message} when, instead of
#         deleting, it handed the lock to the first execution parked on the
#         key (see PARK): the caller publishes that message. Entries of
#         parked executions that already ran are dropped on the way. A
#         retry that finds a parked call's hand-off value not yet taken up
#         returns its message too: the lost reply was most likely that
#         hand-over, whose message nobody has published.
RELEASE_SCRIPT = (
    """
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
    if ARGV[8] == '1' then
        local message = redis.call('HGET', KEYS[3], current)
        if message then
            return {1, current, message}
        end
    end
    return -1
end
local counter_key, fence_ttl = KEYS[5], tonumber(ARGV[7])
local hold_ms = 0
if ARGV[4] ~= '' then
    redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
    hold_ms = tonumber(ARGV[5])
"""
    + _SETTLE
    + """
    redis.call('PUBLISH', ARGV[3], '1')
    return 1
end
local freed, waiters, parked_hash, parking = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local handoff_ttl = ARGV[6]
redis.call('DEL', freed)
"""
    + _HAND_OVER
    + """
if handed then
    hold_ms = tonumber(handoff_ttl)
end
"""
    + _SETTLE
    + """
redis.call('PUBLISH', ARGV[3], '1')
if handed then
    return {1, handed[1], handed[2]}
end
return 1
"""
)

# KEYS[1..n]    - lock keys
# KEYS[n+1..2n] - their fence counters (keys.fence_key), optional
# ARGV[i]       - the holder's value for KEYS[i]
# ARGV[n+i]     - new time to live in milliseconds for KEYS[i]
# ARGV[2n+1]    - how long a counter outlives its lock, in milliseconds
#                 (optional; 0 if absent)
# returns one status per key: 1 renewed, 0 gone, -1 another holder's value.
# It only PEXPIREs a key that still holds our value; it never re-creates an
# expired key, which would hide a gap in which someone else may have run.
# A renewed lock's counter is extended to live at least as long (never
# shortened: it may be kept for a clock it is ahead of, or another slot).
RENEW_SCRIPT = """
local n = math.floor(#ARGV / 2)
local counters = #KEYS == 2 * n
local fence_ttl = tonumber(ARGV[2 * n + 1] or '0')
local result = {}
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    if not current then
        result[i] = 0
    elseif current == ARGV[i] then
        redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
        if counters then
            local counter_ttl = tonumber(ARGV[n + i]) + fence_ttl
            if redis.call('PTTL', KEYS[n + i]) < counter_ttl then
                redis.call('PEXPIRE', KEYS[n + i], counter_ttl)
            end
        end
        result[i] = 1
    else
        result[i] = -1
    end
end
return result
"""

# KEYS[1..n]   - the lock's slot keys (n = #KEYS - 8; n = 1: the lock key
#                itself; see keys.slot_keys for lock_limit)
# KEYS[n+1]    - fence counter of the key, shared by its slots
# KEYS[n+2..5] - its waiters list, parked hash, ran hash and parking flag
#                (keys.handoff_keys)
# KEYS[n+6]    - its queued key (keys.queued_key), for a coalesced run
# KEYS[n+7]    - the queued key's fence counter (its producer took the
#                queued key with ACQUIRE): deleted with the queued key
# KEYS[n+8]    - the queued run's record (keys.next_run_key): deleted too
# ARGV[1..3]   - value, its TTL in ms, how long the fence counter outlives
#                the lock in ms (as ACQUIRE)
# ARGV[4]      - this call's hand-off value (tokens.LockValue.parked; '' for
#                a run that never parks): the value a release leaves in a
#                slot to hand the lock to it
# ARGV[5]      - tag of this copy of the call (the original message, its
#                woken message and each safety-net re-send have their own)
# ARGV[6]      - the message to publish when the lock is handed to it; ''
#                means do not park (only try)
# ARGV[7]      - time to live in ms of the waiters, parked and ran keys, and
#                of the queued key while its run is parked
# ARGV[8]      - this execution's value in the queued key ('' if none):
#                freed when the lock is granted, kept alive while parked
# ARGV[9]      - "v1|<task id>|" when n > 1 (a slot held by the same task is
#                contention, as ACQUIRE_SLOT), else ''
# ARGV[10]     - time to live in ms of a slot handed to a parked call
# ARGV[11..]   - values to take over, as ACQUIRE's ARGV[4..n]
# returns {1, fence, slot} when granted (as ACQUIRE; a hand-off value that
#         was parked or handed the lock, or of which a sweep published a
#         copy (marked '?' in the ran hash), is marked as ran by this copy
#         and leaves the queue; one never parked leaves no mark); {0, holder
#         value, holder PTTL, parked} when every slot is held by another
#         (the holder whose slot frees first; parked = 1 once its hand-off
#         value is queued, at most once); {2} when another copy of this
#         call already ran (a redelivery of the granted copy is not refused);
#         {3, hand-off value, its hold in ms, message} when a copy of a
#         parked call found a free slot while an earlier parked call waits:
#         the slot is handed to that one (the caller publishes its message)
#         and this call stays parked, so parked calls run in the order they
#         parked, whichever copy finds the key free first.
PARK_SCRIPT = (
    """
local n = #KEYS - 8
local counter_key = KEYS[n + 1]
local waiters, parked_hash, ran = KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
local parking, queued = KEYS[n + 5], KEYS[n + 6]
local copy
if ARGV[4] ~= '' then
    copy = redis.call('HGET', ran, ARGV[4])
    if copy and copy ~= '?' and copy ~= ARGV[5] then
        return {2}
    end
end
local slot, current, free, same_task, shortest, shortest_ttl, handed
for i = 1, n do
    local value = redis.call('GET', KEYS[i])
    if value then
        local ours = value == ARGV[1] or value == ARGV[4]
        if not ours then
            for j = 11, #ARGV do
                if value == ARGV[j] then
                    ours = true
                    break
                end
            end
        end
        if ours then
            slot, current, handed = i, value, value == ARGV[4]
            break
        end
        if ARGV[9] ~= '' and string.sub(value, 1, #ARGV[9]) == ARGV[9] then
            same_task = same_task or i
        else
            local rank = redis.call('PTTL', KEYS[i])
            if rank < 0 then
                rank = math.huge
            end
            if not shortest or rank < shortest_ttl then
                shortest, shortest_ttl = i, rank
            end
        end
    elseif not free then
        free = i
    end
end
if not slot and (same_task or not free) then
    local blocker = same_task or shortest
    local parked = 0
    if ARGV[6] ~= '' then
        if redis.call('HSETNX', parked_hash, ARGV[4], ARGV[6]) == 1 then
            redis.call('RPUSH', waiters, ARGV[4])
        elseif not redis.call('LPOS', waiters, ARGV[4]) then
            -- Handed a slot once, and the hold expired before any copy ran
            -- (the woken message died): first in line again.
            redis.call('LPUSH', waiters, ARGV[4])
        end
        -- Parking again (a copy that was let through: the granted copy
        -- redelivered) means the call is pending again: any copy may run it.
        redis.call('HDEL', ran, ARGV[4])
        redis.call('PEXPIRE', waiters, ARGV[7])
        redis.call('PEXPIRE', parked_hash, ARGV[7])
        redis.call('SET', parking, '1', 'PX', ARGV[7])
        if ARGV[8] ~= '' and redis.call('GET', queued) == ARGV[8] then
            redis.call('PEXPIRE', queued, ARGV[7])
        end
        parked = 1
    end
    return {0, redis.call('GET', KEYS[blocker]), redis.call('PTTL', KEYS[blocker]), parked}
end
if not slot and ARGV[4] ~= '' and redis.call('HEXISTS', parked_hash, ARGV[4]) == 1 then
    -- A copy of a parked call found a slot free (a safety net firing, a
    -- sweep's copy): the call that parked first goes first.
    local head
    while true do
        head = redis.call('LINDEX', waiters, 0)
        if not head or head == ARGV[4] or redis.call('HEXISTS', parked_hash, head) == 1 then
            break
        end
        redis.call('LPOP', waiters)
    end
    if head and head ~= ARGV[4] then
        redis.call('LPOP', waiters)
        redis.call('SET', KEYS[free], head, 'PX', ARGV[10])
        local hold_ms, fence_ttl = tonumber(ARGV[10]), tonumber(ARGV[3])
"""
    + _SETTLE
    + """
        return {3, head, tonumber(ARGV[10]), redis.call('HGET', parked_hash, head)}
    end
end
slot = slot or free
local lock_key = KEYS[slot]
if handed then
    -- Handed over by a release: a new holder, so a new fence.
    current = false
end
"""
    + _TAKE
    + """
if ARGV[4] ~= '' then
    local was_parked = redis.call('HDEL', parked_hash, ARGV[4]) == 1
    if was_parked then
        redis.call('LREM', waiters, 0, ARGV[4])
    end
    -- A copy made by parking (tag other than the original's 'o') marks too:
    -- after a hand-over whose hold expired unused, nothing else says so.
    if was_parked or handed or ARGV[5] ~= 'o' or copy == '?' then
        redis.call('HSET', ran, ARGV[4], ARGV[5])
        redis.call('PEXPIRE', ran, ARGV[7])
    end
end
if ARGV[8] ~= '' and redis.call('GET', queued) == ARGV[8] then
    redis.call('DEL', queued, KEYS[n + 7], KEYS[n + 8])
end
return {1, fence, slot}
"""
)

# Withdraws a parked call that gave up (HandOff's max_wait, an interrupt
# after it parked): it leaves the queue, every copy of it is dropped from
# now on, and a slot already handed to it passes to the next parked call.
#
# KEYS[1..n]   - the lock's slot keys (n = #KEYS - 5)
# KEYS[n+1..4] - its waiters list, parked hash, ran hash and parking flag
# KEYS[n+5]    - its fence counter, shared by its slots
# ARGV[1]      - the call's hand-off value
# ARGV[2]      - what to mark it ran by (a tag no copy has)
# ARGV[3]      - time to live in ms of the ran hash
# ARGV[4]      - time to live in ms of a slot handed to the next parked call
# ARGV[5]      - channel to PUBLISH on when a slot is freed
# ARGV[6]      - how long the fence counter outlives the hold, in ms (as
#                RELEASE; the counter is settled only when no slot is held)
# returns 0, or {slot, hand-off value, message} when a slot held for the
#         call was handed to the next parked call (the caller publishes it)
UNPARK_SCRIPT = (
    """
local n = #KEYS - 5
local waiters, parked_hash, ran, parking = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
local counter_key, fence_ttl = KEYS[n + 5], tonumber(ARGV[6])
if redis.call('HDEL', parked_hash, ARGV[1]) == 1 then
    redis.call('LREM', waiters, 0, ARGV[1])
end
redis.call('HSET', ran, ARGV[1], ARGV[2])
redis.call('PEXPIRE', ran, ARGV[3])
for i = 1, n do
    if redis.call('GET', KEYS[i]) == ARGV[1] then
        local freed, handoff_ttl = KEYS[i], ARGV[4]
        redis.call('DEL', freed)
"""
    + _HAND_OVER
    + """
        local hold_ms, occupied = 0, false
        if handed then
            hold_ms = tonumber(handoff_ttl)
        end
        for j = 1, n do
            occupied = occupied or (j ~= i and redis.call('GET', KEYS[j]) ~= false)
        end
        if handed or not occupied then
"""
    + _SETTLE
    + """
        end
        redis.call('PUBLISH', ARGV[5], '1')
        if handed then
            return {i, handed[1], handed[2]}
        end
        return 0
    end
end
return 0
"""
)

# KEYS[1] - a key's debounce record (keys.debounce_key): a hash with the
#           burst's task id, its first call and its due time (server ms)
# ARGV[1] - task id for a new burst
# ARGV[2] - window in ms (the run is due this long after the last call)
# ARGV[3] - longest delay in ms from a burst's first call to its run
# ARGV[4] - time to live in ms of the record
# ARGV[5] - the run's message, kept for a worker's sweep to publish again if
#           the run has not started a while after it is due ('' for none)
# ARGV[6] - the run's hand-off value (which copy of it ran)
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
if (ARGV[5] or '') ~= '' then
    redis.call('HSET', KEYS[1], 'msg', ARGV[5], 'handoff', ARGV[6])
end
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

# At most N per key (lock_limit=N > 1): N slot keys, each an ordinary
# token-owned lock (slot 1 is the key itself; see keys.slot_key). Renewal,
# loss detection and exact release work on the one slot a holder took, with
# the scripts above.
#
# KEYS[1..n] - the slot keys (n = #KEYS - 1)
# KEYS[n+1]  - the fence counter of the base key, shared by every slot
# ARGV[1]    - value to store
# ARGV[2]    - time to live in milliseconds
# ARGV[3]    - how long the fence counter outlives the lock, in ms (as ACQUIRE)
# ARGV[4]    - the caller's task prefix ("v1|<task id>|") or '': a slot
#              holding a value with this prefix (another delivery or an
#              earlier attempt of the same task) is contention, even if
#              another slot is free: one message never runs twice at once
# ARGV[5..m] - values this caller may take over (as ACQUIRE_SCRIPT's)
# returns {1, fence, slot} when a slot was taken: the first slot that holds
#         ARGV[1] or one of ARGV[5..m] (a retry after a lost reply finds its
#         own slot; same fence, as ACQUIRE_SCRIPT), else the first free slot
#         (a new fence). Any further slot holding one of our values is
#         deleted, so a caller never holds two. {0, holder value, holder
#         PTTL in ms} otherwise: a holder of the same task if any, else the
#         holder with the shortest remaining PTTL (the slot that frees first).
ACQUIRE_SLOT_SCRIPT = (
    """
local slots = #KEYS - 1
local task_prefix = ARGV[4]
local mine, free, same_task, shortest, shortest_ttl
local values = {}
for i = 1, slots do
    local current = redis.call('GET', KEYS[i])
    values[i] = current
    if current then
        local ours = current == ARGV[1]
        if not ours then
            for j = 5, #ARGV do
                if current == ARGV[j] then
                    ours = true
                    break
                end
            end
        end
        if ours then
            if mine then
                redis.call('DEL', KEYS[i])
            else
                mine = i
            end
        elseif task_prefix ~= '' and string.sub(current, 1, #task_prefix) == task_prefix then
            same_task = same_task or i
        else
            local pttl = redis.call('PTTL', KEYS[i])
            local rank = pttl
            if rank < 0 then
                rank = math.huge
            end
            if not shortest or rank < shortest_ttl then
                shortest, shortest_ttl = i, rank
            end
        end
    elseif not free then
        free = i
    end
end
local slot = mine
if not slot then
    if same_task then
        return {0, values[same_task], redis.call('PTTL', KEYS[same_task])}
    end
    if not free then
        return {0, values[shortest], redis.call('PTTL', KEYS[shortest])}
    end
    slot = free
end
local lock_key, counter_key, current = KEYS[slot], KEYS[slots + 1], mine
"""
    + _TAKE
    + """
return {1, fence, slot}
"""
)

# Release whichever slot holds a value (lock_limit=N > 1): taking back the
# value of an acquire whose reply was lost, and a worker's parent releasing
# a dead child's slot by owner prefix, when neither knows the slot.
#
# KEYS[1..n] - the slot keys (n = #KEYS - 4)
# KEYS[n+1..n+3] - the key's waiters list, parked hash and parking flag
# KEYS[n+4]  - its fence counter, shared by its slots
# ARGV[1]    - the holder's whole value (mode "exact") or an owner prefix
#              (mode "prefix")
# ARGV[2]    - "exact" or "prefix"
# ARGV[3]    - channel to PUBLISH on when released, to wake waiters
# ARGV[4]    - time to live in ms of a slot handed to a parked call
# ARGV[5]    - how long the fence counter outlives the hold, in ms (as
#              RELEASE; the counter is settled only when no slot is held)
# returns the number (1..n) of the slot released (every matching slot is
#         deleted; the lowest is returned, and handed to the first parked
#         call if any: then {slot, hand-off value, message}), 0 if none
#         matched and some slot is empty, -1 if none matched and every slot
#         holds another value
RELEASE_SLOTS_SCRIPT = (
    """
local n = #KEYS - 4
local released = 0
local empty, occupied = false, false
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    if not current then
        empty = true
    else
        local ours
        if ARGV[2] == 'prefix' then
            ours = string.sub(current, 1, string.len(ARGV[1])) == ARGV[1]
        else
            ours = current == ARGV[1]
        end
        if ours then
            redis.call('DEL', KEYS[i])
            if released == 0 then
                released = i
            end
        else
            occupied = true
        end
    end
end
if released > 0 then
    local freed, waiters = KEYS[released], KEYS[n + 1]
    local parked_hash, parking = KEYS[n + 2], KEYS[n + 3]
    local handoff_ttl = ARGV[4]
"""
    + _HAND_OVER
    + """
    if handed or not occupied then
        local counter_key, fence_ttl, hold_ms = KEYS[n + 4], tonumber(ARGV[5]), 0
        if handed then
            hold_ms = tonumber(handoff_ttl)
        end
"""
    + _SETTLE
    + """
    end
    redis.call('PUBLISH', ARGV[3], '1')
    if handed then
        return {released, handed[1], handed[2]}
    end
    return released
end
if empty then
    return 0
end
return -1
"""
)


ACQUIRE = Script(ACQUIRE_SCRIPT)
DEBOUNCE = Script(DEBOUNCE_SCRIPT)
DEBOUNCE_DUE = Script(DEBOUNCE_DUE_SCRIPT)
PARK = Script(PARK_SCRIPT)
UNPARK = Script(UNPARK_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT)
RENEW = Script(RENEW_SCRIPT)
ACQUIRE_SLOT = Script(ACQUIRE_SLOT_SCRIPT)
RELEASE_SLOTS = Script(RELEASE_SLOTS_SCRIPT)
