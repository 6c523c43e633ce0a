"""The Lua scripts of parked calls (``HandOff``); those of slots are in ``slot_scripts.py``.

Paid only by the tasks that use them: a task that may park takes its lock
with :data:`PARK` (which also refuses a second copy of a parked call). Values are compared
with the waiting mark (``tokens.WAITING``) left out; a caller that parks
behind a holder marks the holder's value, so that its release hands over.
"""

from __future__ import annotations

from celery_redislock.scripts import HAND_OVER, SETTLE_FENCE
from celery_redislock.transport import Script

__all__ = ["MARK_HOLDERS", "PARK", "PARK_SCRIPT", "UNPARK", "UNPARK_SCRIPT"]

# Marks every held slot's value as waited for (a value marked already is
# left as it is). ``n`` slots in KEYS[1..n].
MARK_HOLDERS = """
for i = 1, n do
    local held = redis.call('GET', KEYS[i])
    if held and string.sub(held, -2) ~= '|w' then
        redis.call('APPEND', KEYS[i], '|w')
    end
end
"""

# A call just parked (or parked again): pending, whichever copy runs it
# (a copy that was let through, the granted copy redelivered, parks again),
# and its queue, and its coalesced run's queued key, kept alive.
_KEEP_PARKED = """
        redis.call('HDEL', ran, ARGV[4])
        redis.call('PEXPIRE', waiters, ARGV[7])
        redis.call('PEXPIRE', parked_hash, ARGV[7])
        if ARGV[8] ~= '' and redis.call('GET', queued) == ARGV[8] then
            redis.call('PEXPIRE', queued, ARGV[7])
        end
"""

# KEYS[1..n]   - the lock's slot keys (n = #KEYS - 6; n = 1: the lock key
#                itself; see keys.slot_keys for lock_limit)
# KEYS[n+1]    - fence counter of the key, shared by its slots
# KEYS[n+2..4] - its waiters list, parked hash and ran hash (keys.handoff_keys)
# KEYS[n+5]    - its queued key (keys.queued_key), for a coalesced run
# KEYS[n+6]    - the queued run's record (keys.next_run_key): deleted with it
# ARGV[1..2]   - value, its TTL in ms
# ARGV[3]      - how long the fence counter outlives a hold, in ms
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
# ARGV[11..]   - values to take over, as ACQUIRE's ARGV[3..n]
# returns {1, slot} when granted (a hand-off value that was parked or
#         handed the lock, or of which a sweep published a copy (marked '?'
#         in the ran hash), is marked as ran by this copy and leaves the
#         queue; one never parked leaves no mark); {0, holder value, holder
#         PTTL, parked} when every slot is held by another (the holder whose
#         slot frees first; parked = 1 once its hand-off value is queued, at
#         most once, and every holder marked); {2} when another copy of this
#         call already ran (a redelivery of the granted copy is not refused);
#         {3, hand-off value, its hold in ms, message} when a copy of a
#         parked call, or a new call that may park, found a free slot while
#         an earlier parked call waits (its holder died): the slot is handed
#         to that one (the caller publishes its message) and this call is
#         parked behind it, so calls run in the order they parked, whichever
#         copy finds the key free first; a new call that only tries gets
#         {0, that call's hand-off value, the hold in ms, 0} instead.
PARK_SCRIPT = (
    """
local n = #KEYS - 6
local counter_key = KEYS[n + 1]
local waiters, parked_hash, ran = KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
local queued = KEYS[n + 5]
local copy
if ARGV[4] ~= '' then
    copy = redis.call('HGET', ran, ARGV[4])
    if copy and copy ~= '?' and copy ~= ARGV[5] then
        return {2}
    end
end
local slot, mark, free, same_task, shortest, shortest_ttl, handed
-- The tasks holding a slot ("v1|<task id>|"): a call of one of them is
-- never handed another slot (one message never runs twice at once).
local tasks = {}
for i = 1, n do
    local value = redis.call('GET', KEYS[i])
    if value then
        local marked = ''
        if string.sub(value, -2) == '|w' then
            value, marked = string.sub(value, 1, -3), '|w'
        end
        local ours = value == ARGV[1] or value == ARGV[4]
        if not ours then
            for j = 11, #ARGV do
                if value == ARGV[j] then
                    ours = true
                    break
                end
            end
        end
        if ours and not slot then
            slot, mark, handed = i, marked, value == ARGV[4]
        elseif ARGV[9] ~= '' and string.sub(value, 1, #ARGV[9]) == ARGV[9] then
            same_task = same_task or i
            tasks[ARGV[9]] = true
        elseif not ours then
            tasks[string.match(value, '^v1|[^|]*|') or value] = true
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
if slot and handed and same_task then
    -- Handed a slot while its own task runs in another (a redelivery): not now.
    slot = nil
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
"""
    + _KEEP_PARKED
    + MARK_HOLDERS
    + """
        parked = 1
    end
    return {0, redis.call('GET', KEYS[blocker]), redis.call('PTTL', KEYS[blocker]), parked}
end
local was_waiting = ARGV[4] ~= '' and redis.call('HEXISTS', parked_hash, ARGV[4]) == 1
-- Parked, out of the queue: handed a slot once, and the hold expired before
-- any copy ran (the woken message died). It was first in line: it goes.
local first_in_line = was_waiting and not redis.call('LPOS', waiters, ARGV[4])
if not slot and ARGV[4] ~= '' and not first_in_line then
    -- A copy of a parked call found a slot free (a safety net firing, a
    -- sweep's copy), or a new call did (the holder died with calls parked
    -- behind it, before a sweep handed on): the call that parked first
    -- goes first, and a new one parks behind it.
    local head
    for _, waiter in ipairs(redis.call('LRANGE', waiters, 0, -1)) do
        if waiter == ARGV[4] then
            break
        end
        if redis.call('HEXISTS', parked_hash, waiter) == 0 then
            redis.call('LREM', waiters, 1, waiter)
        elseif not tasks[string.match(waiter, '^v1|[^|]*|') or waiter] then
            head = waiter
            break
        end
    end
    if head and not was_waiting and ARGV[6] == '' then
        -- Only trying (a first acquire, no message yet): refused as behind a
        -- holder; its park, with its message, hands the slot on.
        return {0, head, tonumber(ARGV[10]), 0}
    end
    if head then
        redis.call('LREM', waiters, 1, head)
        if not was_waiting then
            redis.call('HSET', parked_hash, ARGV[4], ARGV[6])
            redis.call('RPUSH', waiters, ARGV[4])
"""
    + _KEEP_PARKED
    + """
        end
        redis.call('SET', KEYS[free], head .. '|w', 'PX', ARGV[10])
        local hold_ms, fence_ttl = tonumber(ARGV[10]), tonumber(ARGV[3])
"""
    + SETTLE_FENCE
    + """
        return {3, head, tonumber(ARGV[10]), redis.call('HGET', parked_hash, head)}
    end
end
if not slot then
    slot, mark = free, ''
    if redis.call('LLEN', waiters) > 0 then
        -- Calls still wait (behind a holder that died): its release hands on.
        mark = '|w'
    end
end
redis.call('SET', KEYS[slot], ARGV[1] .. mark, 'PX', ARGV[2])
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
    redis.call('DEL', queued, KEYS[n + 6])
end
return {1, slot}
"""
)

# Withdraws a parked call that gave up (HandOff's max_wait, an interrupt
# after it parked): it leaves the queue, every copy of it is dropped from
# now on, and a slot already handed to it passes to the next parked call.
#
# KEYS[1..n]   - the lock's slot keys (n = #KEYS - 4)
# KEYS[n+1..3] - its waiters list, parked hash and ran hash
# KEYS[n+4]    - its fence counter, shared by its slots
# ARGV[1]      - the call's hand-off value
# ARGV[2]      - what to mark it ran by (a tag no copy has)
# ARGV[3]      - time to live in ms of the ran hash
# ARGV[4]      - time to live in ms of a slot handed to the next parked call
# ARGV[5]      - channel to PUBLISH on when a slot is freed
# ARGV[6]      - how long the fence counter outlives the hold, in ms (the
#                counter is settled only when no slot is held)
# returns 0, or {slot, hand-off value, message} when a slot held for the
#         call was handed to the next parked call (the caller publishes it)
UNPARK_SCRIPT = (
    """
local n = #KEYS - 4
local waiters, parked_hash, ran = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local counter_key, fence_ttl = KEYS[n + 4], tonumber(ARGV[6])
if redis.call('HDEL', parked_hash, ARGV[1]) == 1 then
    redis.call('LREM', waiters, 0, ARGV[1])
end
redis.call('HSET', ran, ARGV[1], ARGV[2])
redis.call('PEXPIRE', ran, ARGV[3])
for i = 1, n do
    local held = redis.call('GET', KEYS[i])
    if held == ARGV[1] or held == ARGV[1] .. '|w' then
        local freed, handoff_ttl, handed = KEYS[i], ARGV[4], nil
        redis.call('DEL', freed)
"""
    + HAND_OVER
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
    + SETTLE_FENCE
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

PARK = Script(PARK_SCRIPT)
UNPARK = Script(UNPARK_SCRIPT)
