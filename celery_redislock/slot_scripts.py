"""The Lua scripts of slots (``lock_limit`` > 1): paid only by the tasks that use them.

A task with ``lock_limit`` > 1 takes its lock with :data:`ACQUIRE_SLOT`; its
release, by owner prefix or exact, with :data:`RELEASE_SLOTS`.
"""

from __future__ import annotations

from celery_redislock.park_scripts import MARK_HOLDERS
from celery_redislock.scripts import HAND_OVER, SETTLE_FENCE
from celery_redislock.transport import Script

__all__ = ["ACQUIRE_SLOT", "ACQUIRE_SLOT_SCRIPT", "RELEASE_SLOTS", "RELEASE_SLOTS_SCRIPT"]

# At most N per key (lock_limit=N > 1): N slot keys, each an ordinary
# token-owned lock (slot 1 is the key itself; see keys.slot_key). Renewal,
# loss detection, fences and exact release work on the one slot a holder
# took, with the lock's own scripts.
#
# KEYS[1..n] - the slot keys
# ARGV[1]    - value to store
# ARGV[2]    - time to live in milliseconds
# ARGV[3]    - '1' to mark every holder when all slots are held (a caller
#              that waits for a release: the Wait policy), else ''
# ARGV[4]    - the caller's task prefix ("v1|<task id>|") or '': a slot
#              holding a value with this prefix (another delivery or an
#              earlier attempt of the same task) is contention, even if
#              another slot is free: one message never runs twice at once
# ARGV[5..m] - values this caller may take over (as ACQUIRE_SCRIPT's)
# returns {1, slot} when a slot was taken: the first slot that holds
#         ARGV[1] or one of ARGV[5..m] (a retry after a lost reply finds its
#         own slot), else the first free slot. Any further slot holding one
#         of our values is deleted, so a caller never holds two. {0, holder
#         value, holder PTTL in ms} otherwise: a holder of the same task if
#         any, else the holder with the shortest remaining PTTL (the slot
#         that frees first).
ACQUIRE_SLOT_SCRIPT = (
    """
local n = #KEYS
local task_prefix = ARGV[4]
local mine, mark, free, same_task, shortest, shortest_ttl
local values = {}
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    local marked = ''
    if current and string.sub(current, -2) == '|w' then
        current, marked = string.sub(current, 1, -3), '|w'
    end
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
                mine, mark = i, marked
            end
        elseif task_prefix ~= '' and string.sub(current, 1, #task_prefix) == task_prefix then
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
local slot = mine
if not slot then
    local blocker = same_task
    if not blocker and not free then
        blocker = shortest
    end
    if blocker then
        if ARGV[3] == '1' then
"""
    + MARK_HOLDERS
    + """
        end
        return {0, values[blocker], redis.call('PTTL', KEYS[blocker])}
    end
    slot = free
end
redis.call('SET', KEYS[slot], ARGV[1] .. (mark or ''), 'PX', ARGV[2])
return {1, slot}
"""
)

# Release whichever slot holds a value (lock_limit=N > 1): taking back the
# value of an acquire whose reply was lost, and a worker's parent releasing
# a dead child's slot by owner prefix, when neither knows the slot.
#
# KEYS[1..n]     - the slot keys (n = #KEYS - 3)
# KEYS[n+1..n+2] - the key's waiters list and parked hash
# KEYS[n+3]      - its fence counter, shared by its slots
# ARGV[1]        - the holder's whole value (mode "exact") or an owner
#                  prefix (mode "prefix")
# ARGV[2]        - "exact" or "prefix"
# ARGV[3]        - channel to PUBLISH on when released, to wake waiters
# ARGV[4]        - time to live in ms of a slot handed to a parked call
# ARGV[5]        - how long the fence counter outlives the hold, in ms (the
#                  counter is settled only when no slot is held)
# ARGV[6]        - '1' when this is the retry of a release whose reply was
#                  lost: a slot holding a parked call's hand-off value not
#                  yet taken up was most likely that release's hand-over
# returns the number (1..n) of the slot released (every matching slot is
#         deleted; the lowest is returned, and handed to the first parked
#         call if any: then {slot, hand-off value, message}), 0 if none
#         matched and some slot is empty, -1 if none matched and every slot
#         holds another value
RELEASE_SLOTS_SCRIPT = (
    """
local n = #KEYS - 3
local released = 0
local empty, occupied = false, false
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    if not current then
        empty = true
    else
        if string.sub(current, -2) == '|w' then
            current = string.sub(current, 1, -3)
        end
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
    local freed, waiters, parked_hash = KEYS[released], KEYS[n + 1], KEYS[n + 2]
    local handoff_ttl, handed = ARGV[4], nil
"""
    + HAND_OVER
    + """
    if handed or not occupied then
        local counter_key, fence_ttl, hold_ms = KEYS[n + 3], tonumber(ARGV[5]), 0
        if handed then
            hold_ms = tonumber(handoff_ttl)
        end
"""
    + SETTLE_FENCE
    + """
    end
    redis.call('PUBLISH', ARGV[3], '1')
    if handed then
        return {released, handed[1], handed[2]}
    end
    return released
end
if ARGV[6] == '1' and redis.call('PTTL', KEYS[n + 2]) ~= -2 then
    for i = 1, n do
        local current = redis.call('GET', KEYS[i])
        if current and string.sub(current, -2) == '|w' then
            current = string.sub(current, 1, -3)
        end
        local message = current and redis.call('HGET', KEYS[n + 2], current)
        if message then
            return {i, current, message}
        end
    end
end
if empty then
    return 0
end
return -1
"""
)


ACQUIRE_SLOT = Script(ACQUIRE_SLOT_SCRIPT)
RELEASE_SLOTS = Script(RELEASE_SLOTS_SCRIPT)
