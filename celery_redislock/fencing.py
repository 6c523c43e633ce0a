"""Fencing: let the resource a task writes to reject a stale lock holder.

A TTL lock cannot stop a holder that was paused longer than its TTL (GC,
SIGSTOP, a VM freeze) or whose key Redis lost (restart, failover, eviction)
from carrying on after someone else took the lock. Every acquisition
therefore gets a *fence*: an integer that strictly increases per key
(``max(last fence + 1, Redis server time in µs)``, taken in the acquire's
round trip, so it keeps increasing even after a Redis restart without
persistence). A task reads it as ``self.lock.fence`` and passes it with
every write; the resource keeps the highest fence it has seen and refuses
anything lower.

For state kept in Redis, :class:`FencedStore` does that check atomically.
For SQL, keep a ``last_fence`` column and make the fence part of the write::

    UPDATE accounts
       SET balance = :balance, last_fence = :fence
     WHERE id = :id AND last_fence < :fence

    -- 0 rows updated: a newer holder has written; stop, do not retry.

Use ``<=`` instead of ``<`` if one execution writes the same row several
times with its one fence.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import NoScriptError

from celery_redislock.exceptions import RedisLockError

__all__ = ["FencedStore", "StaleFence"]

# KEYS[1] - hash holding the resource: field "value" and field "fence"
# ARGV[1] - the writer's fence (an integer)
# ARGV[2] - the value to store
# returns 1 if written (ARGV[1] >= the stored fence), otherwise
#         {0, stored fence}: a newer holder has written, the write is refused
FENCED_WRITE_SCRIPT = """
local stored = redis.call('HGET', KEYS[1], 'fence')
if stored and tonumber(stored) > tonumber(ARGV[1]) then
    return {0, stored}
end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
return {1}
"""


class StaleFence(RedisLockError):
    """A write carried a fence lower than one the resource has already seen.

    Attributes:
        fence: The refused writer's fence.
        current: The highest fence the resource has seen.
    """

    def __init__(self, key: str, fence: int, current: int) -> None:
        self.key = key
        self.fence = fence
        self.current = current
        super().__init__(key, fence, current)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.fence, self.current))

    def __str__(self) -> str:
        return (
            f"write to {self.key!r} with fence {self.fence} refused: "
            f"fence {self.current} has already written"
        )


class FencedStore:
    """Values in Redis that only the newest lock holder can overwrite.

    Args:
        client: Client of the Redis that holds the resource (it may be the
            lock store or another server).
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._sha: str | None = None

    def write(self, key: str, value: str | bytes | int | float, fence: int) -> bool:
        """Store ``value`` under ``key`` if ``fence`` is not older than the last write.

        Returns:
            True if written; False if a newer fence has written (refused).
        """
        reply = self._eval(key, fence, value)
        return int(reply[0]) == 1

    def write_or_raise(self, key: str, value: str | bytes | int | float, fence: int) -> None:
        """Like :meth:`write`, but raise :class:`StaleFence` when refused."""
        reply = self._eval(key, fence, value)
        if int(reply[0]) != 1:
            raise StaleFence(key, fence, int(reply[1]))

    def read(self, key: str) -> tuple[bytes | str | None, int | None]:
        """Return the stored value and the fence that wrote it."""
        value, fence = self.client.hmget(key, ["value", "fence"])
        return value, (int(fence) if fence is not None else None)

    def _eval(self, key: str, fence: int, value: Any) -> Any:
        if isinstance(fence, bool) or not isinstance(fence, int):
            raise TypeError(f"fence must be an int (self.lock.fence), got {fence!r}")
        if self._sha is None:
            self._sha = self.client.script_load(FENCED_WRITE_SCRIPT)
        try:
            return self.client.evalsha(self._sha, 1, key, fence, value)
        except NoScriptError:
            return self.client.eval(FENCED_WRITE_SCRIPT, 1, key, fence, value)
