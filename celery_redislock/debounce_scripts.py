"""The Lua scripts of a key's debounce record, each with its KEYS/ARGV/returns header.

A debounced call's burst (``lock_debounce``): the record holds the burst's
task id, its first call and its due time, on the server's clock.
"""

from __future__ import annotations

from celery_redislock.transport import Script

__all__ = ["DEBOUNCE", "DEBOUNCE_DUE"]

# KEYS[1] - a key's debounce record (keys.debounce_key): a hash with the
#           burst's task id, its first call and its due time (server ms)
# ARGV[1] - task id for a new burst
# ARGV[2] - window in ms (the run is due this long after the last call)
# ARGV[3] - longest delay in ms from a burst's first call to its run
# ARGV[4] - time to live in ms of the record
# ARGV[5] - the run's message, kept for a worker's sweep to publish again if
#           the run has not started a while after it is due ('' for none)
# ARGV[6] - the run's hand-off value (which copy of it ran)
# ARGV[7] - the run's countdown in ms (its message is due then, at the
#           earliest: a sweep copies it no sooner)
# ARGV[8] - ms after it is due before a sweep publishes a copy
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
    redis.call('HSET', KEYS[1], 'msg', ARGV[5], 'handoff', ARGV[6], 'grace', ARGV[8],
        'not_before', string.format('%.0f', now_ms + tonumber(ARGV[7])))
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

DEBOUNCE = Script(DEBOUNCE_SCRIPT)
DEBOUNCE_DUE = Script(DEBOUNCE_DUE_SCRIPT)
